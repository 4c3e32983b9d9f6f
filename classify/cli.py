"""What the command lines share: help formatting, the flags every trainer has, their checks, and
the run configuration that a trainer's flags are stored as (``config.json``'s ``"train"``).

Each trainer (``classify.train``, ``classify.pretrain``, ``classify.seq2seq train``) subclasses
``RunConfig`` with its own fields and defaults; the shared ``add_*_args`` helpers take their
defaults from that class, so a flag's default and the stored config can never disagree.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar

import torch

from .engine.device import PRECISIONS, autocast_dtype, resolve_device
from .errors import ClassifyError
from .text.tokenize import KINDS, TRUNCATIONS
from .engine.optim import SCHEDULES


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except empty ones (None, False): their help text says what happens instead."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


@dataclass(kw_only=True)
class RunConfig:
    """Everything that defines a training run except the model sizes (those are the model's config)."""

    data: str
    epochs: int
    max_steps: int | None = None
    time_budget: float | None = None
    lr: float = 1e-3
    warmup: int
    schedule: str = "cosine"
    weight_decay: float
    clip: float = 1.0
    seed: int = 0
    precision: str = "auto"
    save_every: int = 200
    threads: int | None = None
    eval_every: int | None = None
    patience: int | None = None
    grad_accum: int = 1
    num_workers: int = 0

    # Fields that must match to continue a run in the same folder (the rest may change on resume).
    IDENTITY: ClassVar[tuple[str, ...]] = ("data", "seed")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RunConfig":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of field ``name`` (what its flag defaults to)."""
        default = next((f.default for f in fields(cls) if f.name == name), MISSING)
        if default is MISSING:
            raise KeyError(f"{cls.__name__} has no field {name!r} with a default")
        return default


@dataclass(kw_only=True)
class ReviewRunConfig(RunConfig):
    """A run on reviews (classifier training and MLM pretraining): the tokenizer and the split too."""

    vocab_size: int = 30000
    tokenizer: str = "word"
    truncation: str = "head+tail"
    val_size: int = 2500
    limit: int | None = None

    IDENTITY: ClassVar[tuple[str, ...]] = ("data", "vocab_size", "tokenizer", "truncation", "val_size", "limit",
                                           "seed")


def add_tokenizer_args(group: argparse._ArgumentGroup, config: type[ReviewRunConfig], trained_on: str) -> None:
    """How reviews become token ids: the tokenizer (trained on ``trained_on``) and the truncation."""
    group.add_argument("--vocab-size", type=int, default=config.default("vocab_size"), help="tokenizer vocabulary size")
    group.add_argument("--tokenizer", choices=KINDS, default=config.default("tokenizer"),
                       help=f"tokenizer kind, trained on {trained_on}")
    group.add_argument("--max-len", type=int, default=512, help="tokens kept per review (the model's position table)")
    group.add_argument("--truncation", choices=TRUNCATIONS, default=config.default("truncation"),
                       help="which part of a long review to keep (head+tail: first quarter + last three quarters)")


def add_model_args(group: argparse._ArgumentGroup, *, d_model: int, layers: int, heads: int, d_ff: int,
                   positional: str, layers_help: str = "encoder blocks") -> None:
    """The transformer's sizes and block style, as every trainer names them."""
    group.add_argument("--d-model", type=int, default=d_model, help="model width")
    group.add_argument("--layers", type=int, default=layers, help=layers_help)
    group.add_argument("--heads", type=int, default=heads, help="attention heads (must divide --d-model)")
    group.add_argument("--d-ff", type=int, default=d_ff, help="feed-forward hidden width")
    group.add_argument("--dropout", type=float, default=0.1, help="dropout rate")
    group.add_argument("--positional", choices=("learned", "sinusoidal"), default=positional,
                       help="position encoding")
    group.add_argument("--post-ln", action="store_true",
                       help="post-LayerNorm blocks (Bloem / the original paper) instead of pre-LN")


def add_optimisation_args(group: argparse._ArgumentGroup, config: type[RunConfig], **helps: str) -> None:
    """Length of the run and the AdamW schedule, defaults from ``config``; ``helps`` overrides help texts
    by field name."""
    default = config.default
    texts = {
        "epochs": "passes over the training data",
        "max_steps": "stop after this many optimizer steps",
        "time_budget": "minutes of training; then stop cleanly. The learning-rate decay follows steps or time, "
                       "whichever is further along, so a budgeted run ends decayed",
        "lr": "peak learning rate (AdamW)",
        "warmup": "linear warmup steps",
        "schedule": "decay after warmup (inverse_sqrt, the Noam schedule, needs no end)",
        "weight_decay": "decoupled weight decay (matrices only)",
        "clip": "gradient norm clipping (0 = off)",
        "eval_every": "validate every N steps (default: at the end of each epoch)",
        "patience": "stop after N validations without improvement",
        "grad_accum": "batches each process trains on per optimizer step, their gradients averaged (a bigger "
                      "batch in the same memory)",
        "num_workers": "DataLoader worker processes that make the batches",
        **helps,
    }
    group.add_argument("--epochs", type=int, default=default("epochs"), help=texts["epochs"])
    group.add_argument("--max-steps", type=int, default=default("max_steps"), help=texts["max_steps"])
    group.add_argument("--time-budget", type=float, default=default("time_budget"), help=texts["time_budget"])
    group.add_argument("--lr", type=float, default=default("lr"), help=texts["lr"])
    group.add_argument("--warmup", type=int, default=default("warmup"), help=texts["warmup"])
    group.add_argument("--schedule", choices=SCHEDULES, default=default("schedule"), help=texts["schedule"])
    group.add_argument("--weight-decay", type=float, default=default("weight_decay"), help=texts["weight_decay"])
    group.add_argument("--clip", type=float, default=default("clip"), help=texts["clip"])
    group.add_argument("--eval-every", type=int, default=default("eval_every"), help=texts["eval_every"])
    group.add_argument("--patience", type=int, default=default("patience"), help=texts["patience"])
    group.add_argument("--grad-accum", type=int, default=default("grad_accum"), help=texts["grad_accum"])
    group.add_argument("--num-workers", type=int, default=default("num_workers"), help=texts["num_workers"])


def add_runtime_args(group: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    """--device, --precision and --threads: where and how a command computes."""
    group.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    group.add_argument("--precision", choices=PRECISIONS, default="auto",
                       help="autocast dtype; auto = bf16 where supported (incl. AVX-512 BF16 CPUs), else fp16 on "
                            "CUDA, else fp32")
    group.add_argument("--threads", type=int, help="CPU threads for PyTorch (default: PyTorch's choice, all cores)")


def add_run_folder_args(group: argparse._ArgumentGroup) -> None:
    """How a trainer treats its --output folder, and how it reports."""
    group.add_argument("--resume", action="store_true",
                       help="continue the run in --output, and refuse to start afresh if there is none to continue "
                            "(without this flag a run found there is continued all the same)")
    group.add_argument("--overwrite", action="store_true", help="replace a different run found in --output")
    group.add_argument("--quiet", action="store_true", help="no progress display")
    group.add_argument("--dist-timeout", type=float, default=10.0,
                       help="under torchrun: minutes a process waits for the others (start-up, every "
                            "synchronisation) before the job fails instead of hanging")


def runtime(args: argparse.Namespace) -> tuple[torch.device, torch.dtype | None]:
    """Apply --threads; resolve --device and --precision (one-line errors where this machine can't)."""
    if args.threads is not None:
        if args.threads < 1:
            raise ClassifyError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    try:
        device = resolve_device(args.device)
        return device, autocast_dtype(device, args.precision)
    except (ValueError, RuntimeError) as err:  # e.g. torch's own message for a CUDA ordinal this machine lacks
        raise ClassifyError(str(err).splitlines()[0]) from None


def check_run_args(args: argparse.Namespace, positive: dict[str, float]) -> None:
    """One-line errors for the flags every trainer has, plus ``positive`` ({flag: value} that must be > 0)."""
    must_be_positive = {"--d-model": args.d_model, "--layers": args.layers, "--heads": args.heads,
                        "--d-ff": args.d_ff, "--max-len": args.max_len, "--epochs": args.epochs,
                        "--vocab-size": args.vocab_size, "--lr": args.lr, "--save-every": args.save_every, **positive}
    if args.max_steps is not None:
        must_be_positive["--max-steps"] = args.max_steps
    for flag, value in must_be_positive.items():
        if value <= 0:
            raise ClassifyError(f"{flag} must be positive, got {value}")
    if args.d_model % args.heads:
        raise ClassifyError(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    if not 0.0 <= args.dropout < 1.0:
        raise ClassifyError(f"--dropout must be in [0, 1), got {args.dropout}")
    for flag, value in (("--warmup", args.warmup),
                        ("--time-budget", args.time_budget), ("--weight-decay", args.weight_decay),
                        ("--clip", args.clip)):
        if value is not None and value < 0:
            raise ClassifyError(f"{flag} must not be negative, got {value}")
