"""Settings: the config dataclasses are their single source.

One naming rule: field ``num_heads`` is flag ``--num-heads``. A command's flags are generated
from the fields (``add_flags``), with the field's default, type, choices and help; its checks
live with the dataclass (``RunConfig.validate`` raises a ClassifyError naming the flag; the model
configs check themselves, ``classify.models``); the training loop reads the config, never argparse
results. ``config.json`` stores the same names.

    @dataclass(kw_only=True)
    class TrainConfig(RunConfig):
        label_smoothing: float = setting(0.0, "label smoothing of the cross-entropy", check=fraction)

    add_flags(parser, TrainConfig)                 # --label-smoothing, and RunConfig's --lr, --epochs, ...
    config = from_args(TrainConfig, parser.parse_args())

Old spellings (``--heads``, ``--layers``, ``--post-ln``, ``--no-padding-mask``) are aliases for one
release, each named in its flag's help.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

import torch

from ..core import POSITIONAL
from ..errors import ClassifyError
from ..models import POOLINGS
from ..text.tokenize import KINDS, TRUNCATIONS
from .device import PRECISIONS, autocast_dtype, resolve_device
from .optim import SCHEDULES

Check = Callable[[Any], bool]


def flag(name: str) -> str:
    """The flag of field ``name``: ``num_heads`` -> ``--num-heads``."""
    return "--" + name.replace("_", "-")


# ------------------------------------------------------------------------- checks
def positive(value: float) -> str | None:
    return None if value > 0 else "must be positive"


def non_negative(value: float) -> str | None:
    return None if value >= 0 else "must not be negative"


def fraction(value: float) -> str | None:
    return None if 0.0 <= value < 1.0 else "must be in [0, 1)"


def open_fraction(value: float) -> str | None:
    return None if 0.0 < value < 1.0 else "must be in (0, 1)"


def decay(value: float) -> str | None:
    return None if 0.0 < value <= 1.0 else "must be in (0, 1]"


@dataclass(frozen=True)
class Setting:
    """How a field appears on the command line: help, allowed values, check, old spellings."""

    help: str
    check: Callable[[Any], str | None] | None = None  # None if fine, else what is wrong ("must be positive")
    choices: Sequence[str] | None = None
    aliases: tuple[str, ...] = ()          # old spellings of the flag, kept for one release
    sets: dict[str, Any] = field(default_factory=dict)  # old flags that set a value: {"--post-ln": False}
    # What a run folder recorded before the setting existed trained with (its value then, which the default may
    # no longer be: --contrast-join-repeat was added at 1 and is 3 now), so that such a run can be resumed, and is
    # read (inference, evaluate) as it was trained; see ``recorded``. None where not known: only the setting at None
    # then continues that run.
    absent: Any = None


def setting(default: Any = MISSING, help: str = "", **kwargs: Any) -> Any:
    """A dataclass field with its command-line ``Setting``."""
    return field(default=default, metadata={"setting": Setting(help, **kwargs)})


def recorded(config: Any, stored: dict[str, Any], name: str) -> Any:
    """Setting ``name`` as the run settings ``stored`` (a config.json's "train") recorded it: its value, or for a run
    recorded before the setting existed, the setting's ``absent`` value. ``config``: the settings dataclass or an
    instance."""
    if name in stored:
        return stored[name]
    return next((f.metadata["setting"].absent for f in fields(config) if f.name == name), None)


def check_settings(config: Any) -> None:
    """Run each field's check on a settings dataclass: a ClassifyError naming the flag for the first that fails."""
    for f in fields(config):
        check, value = f.metadata["setting"].check, getattr(config, f.name)
        problem = check(value) if check is not None and value is not None else None
        if problem:
            raise ClassifyError(f"{flag(f.name)} {problem}, got {value}")


# The model configs (classify.models) stay free of command-line text: their fields' help is here.
MODEL_SETTINGS = {
    "d_model": Setting("model width"),
    "num_heads": Setting("attention heads (must divide --d-model)", aliases=("--heads",)),
    "num_layers": Setting("encoder blocks", aliases=("--layers",)),
    "num_encoder_layers": Setting("encoder blocks"),
    "num_decoder_layers": Setting("decoder blocks"),
    "d_ff": Setting("feed-forward hidden width"),
    "max_len": Setting("longest sequence in tokens (the model's position table)"),
    "dropout": Setting("dropout rate"),
    "attention_dropout": Setting("dropout on attention weights (unset: --dropout); 0 trains 1.4-2.7x faster on "
                                 "CPU, where SDPA with dropout cannot use its fused kernel"),
    "pooling": Setting("how token vectors become one: their mean, maximum, the first, or attention (a learned "
                       "query weighs them)", choices=POOLINGS),
    "positional": Setting("position encoding: a learned vector per position (Bloem), fixed sinusoids (Vaswani), "
                          "rotary (queries and keys rotated by position: attention sees distances), "
                          "learned+rotary (both) or end+rotary (rotary, and a learned vector per distance from "
                          "the text's end; classifiers only)", choices=tuple(POSITIONAL)),
    "norm_first": Setting("pre-LayerNorm blocks; --no-norm-first gives post-LN blocks (Bloem / the original paper)",
                          sets={"--post-ln": False}),
    "mask_padding": Setting("attention and pooling ignore padding; --no-mask-padding lets them see it (reproduces "
                            "Bloem's code; for ablations)", sets={"--no-padding-mask": False}),
    "tie_embeddings": Setting("share the decoder's input embedding with its output projection"),
    "ngram_orders": Setting("n-gram branch over word 1..N-grams (classify.ngrams), fitted as a naive-Bayes-weighted "
                            "logistic regression before training and mixed with the transformer on validation; "
                            "0 = the pure transformer (Bloem's model)"),
    "ngram_buckets": Setting("hash slots of the n-gram branch (a prime spreads the n-grams evenly)"),
    "ngram_skip_bigrams": Setting("the n-gram branch also reads pairs of tokens one apart (\"not * good\")"),
    "ngram_head": Setting("the n-gram branch also reads the n-grams of a review's first N tokens as features of "
                          "their own; 0 = not"),
    "ngram_tail": Setting("the same for a review's last N tokens, where reviews tend to give their verdict"),
    "ngram_negation": Setting("the n-gram branch reads a word up to N tokens after a negator (not, no, never, n't, "
                              "...; up to a comma, full stop or 'but') as another word, NOT_word, in "
                              "every n-gram family; 0 = not"),
    "ngram_ellipsis": Setting("the n-gram branch also reads the last N words of a clause that a negated auxiliary "
                              "with its verb left out denies (\"I thought it would be good, but it wasn't.\": "
                              "NOT_good) as NOT_word; 0 = not"),
    "scope_embedding": Setting("the transformer also reads the n-gram branch's negation scope: a learned vector is "
                               "added to the embedding of every word the branch reads as NOT_word (needs "
                               "--ngram-negation or --ngram-ellipsis; classify.train's default: on where the "
                               "branch marks negation, off without)"),
    "scope_dropout": Setting("with --scope-embedding: in training, each text goes without the mark at this "
                             "probability, so the transformer also learns to read negation from the words "
                             "(0 = always marked; classify.train's default: 0.25 with --scope-embedding)"),
}


# ---------------------------------------------------------------------- the configs
@dataclass(kw_only=True)
class RuntimeConfig:
    """Where and how a command computes (every command that runs a model has these)."""

    device: str = setting("auto", "auto, cpu, cuda, cuda:N or mps")
    precision: str = setting("auto", "autocast dtype; auto = bf16 where supported (incl. AVX-512 BF16 CPUs), else "
                                     "fp16 on CUDA, else fp32 (a model of the default size is launch-bound on a "
                                     "GPU and trains ~10%% faster there in fp32)", choices=PRECISIONS)
    threads: int | None = setting(None, "CPU threads for PyTorch (default: PyTorch's choice, all cores)")


@dataclass(kw_only=True)
class InferenceConfig(RuntimeConfig):
    """Where and how a command that only runs a trained model computes (predict, serve)."""

    backend: str = setting("torch", "torch: a run folder on PyTorch; onnx: a folder written by classify.export, on "
                                    "ONNX Runtime's CPU provider (--threads threads; --device and --precision are "
                                    "PyTorch's)", choices=("torch", "onnx"))
    spelling: bool | None = setting(None, "read an unknown word one typing slip from a known one as that word "
                                          "(classify.text.spelling); unset: as the run's config.json says (on for "
                                          "runs trained since the setting exists, off for older ones)")


@dataclass(kw_only=True)
class RunConfig(RuntimeConfig):
    """Everything that defines a training run except the model (whose config is the model's own), as
    ``classify.engine.loop.fit`` reads it. A trainer subclasses it (``TrainConfig``, ...)."""

    data: str = setting(help="where the training data is")
    epochs: int = setting(help="passes over the training data", check=positive)
    max_steps: int | None = setting(None, "stop after this many optimizer steps", check=positive)
    time_budget: float | None = setting(None, "minutes of training (validation included); then stop cleanly. The "
                                              "learning-rate decay follows steps or time, whichever is further "
                                              "along, so a budgeted run ends decayed", check=non_negative)
    lr: float = setting(1e-3, "peak learning rate (AdamW)", check=positive)
    warmup: int = setting(help="linear warmup steps", check=non_negative)
    schedule: str = setting("cosine", "decay after warmup: cosine/linear reach zero at the end of --epochs (or "
                                      "--max-steps); inverse_sqrt (Noam) needs no end", choices=SCHEDULES)
    weight_decay: float = setting(help="decoupled weight decay (matrices only)", check=non_negative)
    clip: float = setting(1.0, "gradient norm clipping (0 = off)", check=non_negative)
    average_from: float | None = setting(None, "from this share of training on (steps or time, whichever is "
                                               "further along), keep the mean of the weights after every step, "
                                               "and validate and save that mean instead of the last weights "
                                               "(stochastic weight averaging)", check=fraction)
    grad_accum: int = setting(1, "batches each process trains on per optimizer step, their gradients averaged (a "
                                 "bigger batch in the same memory)", check=positive)
    eval_every: int | None = setting(None, "validate every N steps (default: at the end of each epoch)",
                                     check=positive)
    patience: int | None = setting(None, "stop after N validations without improvement", check=positive)
    save_every: int = setting(200, "write last/ (resume state) every N steps", check=positive)
    seed: int = setting(0, "random seed (runs are deterministic on CPU)")
    num_workers: int = setting(0, "DataLoader worker processes that make the batches", check=non_negative)

    # Fields that must match to continue a run in the same folder (the rest may change on resume).
    IDENTITY: ClassVar[tuple[str, ...]] = ("data", "seed")

    @classmethod
    def redefault(cls, name: str, default: Any, help: str | None = None) -> Any:
        """The field ``name`` with another default (and help) for a subclass, its check kept."""
        old: Setting = cls.__dataclass_fields__[name].metadata["setting"]
        return field(default=default, metadata={"setting": Setting(**{**old.__dict__, "help": help or old.help})})

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of field ``name`` (what its flag defaults to)."""
        default = next((f.default for f in fields(cls) if f.name == name), MISSING)
        if default is MISSING:
            raise KeyError(f"{cls.__name__} has no field {name!r} with a default")
        return default

    def validate(self, model: Any) -> None:
        """Every field's check, then the model config's own (``model``: its dataclass), as one-line errors
        that name the flag. Subclasses add checks that involve several settings."""
        check_settings(self)
        try:
            model.validate()
        except ValueError as err:
            raise ClassifyError(f"model: {err} (each model field has a flag of its name, e.g. --num-heads)") from None


@dataclass(kw_only=True)
class ReviewRunConfig(RunConfig):
    """A run on reviews (classifier training and MLM pretraining): the tokenizer and the split too."""

    vocab_size: int = setting(30000, "tokenizer vocabulary size", check=positive)
    tokenizer: str = setting("word", "tokenizer kind, trained on the training text", choices=KINDS)
    truncation: str = setting("head+tail", "which part of a long review to keep (head+tail: first quarter + last "
                                           "three quarters)", choices=TRUNCATIONS, absent="head+tail")
    val_size: int | None = setting(None, "validation reviews carved from train (stratified); default: 10%% of the "
                                         "training reviews, at most 2,500", check=non_negative)
    limit: int | None = setting(None, "use only N training reviews, a seeded random sample (quick runs)",
                                check=positive)

    IDENTITY: ClassVar[tuple[str, ...]] = ("data", "vocab_size", "tokenizer", "truncation", "val_size", "limit",
                                           "seed")


# ------------------------------------------------------------------------- flags
class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except empty ones (None, False): their help text says what happens instead."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


_TYPES = {"int": int, "float": float, "str": str}


def add_flags(group: argparse._ActionsContainer, config: type, names: Sequence[str] | None = None,
              defaults: dict[str, Any] | None = None) -> None:
    """Add a flag for each field of the dataclass ``config`` (or those in ``names``, in that order), named by
    the rule, with the field's default (or ``defaults[name]``), type, choices and help."""
    by_name = {f.name: f for f in fields(config)}
    for name in names or list(by_name):
        f = by_name[name]
        s: Setting = f.metadata.get("setting") or MODEL_SETTINGS[name]
        default = (defaults or {}).get(name, f.default)
        kind = str(f.type).replace(" | None", "")
        help_text = s.help
        old = [*s.aliases, *s.sets]
        if old:
            help_text += f" (old spelling{'s' if len(old) > 1 else ''} {', '.join(old)}: kept for one release)"
        options: dict[str, Any] = {"dest": name, "help": help_text}
        if default is MISSING:
            options["required"] = True
        else:
            options["default"] = default
        if kind == "bool":
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = _TYPES[kind]
            if s.choices:
                options["choices"] = s.choices
        group.add_argument(flag(name), *s.aliases, **options)
        for old_flag, value in s.sets.items():
            group.add_argument(old_flag, dest=name, action="store_const", const=value, help=argparse.SUPPRESS)


def from_args(config: type, args: argparse.Namespace, **values: Any):
    """The ``config`` dataclass from parsed flags (fields without a flag from ``values``)."""
    return config(**{f.name: values[f.name] if f.name in values else getattr(args, f.name)
                     for f in fields(config) if f.name in values or hasattr(args, f.name)})


def add_run_folder_args(group: argparse._ActionsContainer) -> None:
    """How a trainer treats its --output folder, and how it reports (not settings of the run: not stored)."""
    group.add_argument("--output", required=True, help="run folder to write (re-running into it resumes)")
    group.add_argument("--resume", action="store_true",
                       help="continue the run in --output, and refuse to start afresh if there is none to continue "
                            "(without this flag a run found there is continued all the same)")
    group.add_argument("--overwrite", action="store_true", help="replace a different run found in --output")
    group.add_argument("--quiet", action="store_true", help="no progress display")
    group.add_argument("--dist-timeout", type=float, default=10.0,
                       help="under torchrun: minutes a process waits for the others (start-up, every "
                            "synchronisation) before the job fails instead of hanging")


def runtime(config: RuntimeConfig | argparse.Namespace) -> tuple[torch.device, torch.dtype | None]:
    """Flush denormal numbers to zero on the CPU; apply ``threads``; resolve ``device`` and ``precision``
    (one-line errors where this machine can't)."""
    # Arithmetic on denormals (below 1.2e-38 in fp32 and bf16) is many times slower on x86 CPUs, and a trained
    # model's attention softmax underflows into them: in fp32 a training step of 512 tokens ran 1.4x slower
    # (experiments.attention_precision, twenty-eighth session). Set before the first parallel region, so that the
    # thread pool, which inherits the main thread's floating-point state, flushes them too (TensorFlow flushes
    # them by default).
    torch.set_flush_denormal(True)
    if config.threads is not None:
        if config.threads < 1:
            raise ClassifyError(f"--threads must be at least 1, got {config.threads}")
        torch.set_num_threads(config.threads)
    try:
        device = resolve_device(config.device)
        return device, autocast_dtype(device, config.precision)
    except (ValueError, RuntimeError) as err:  # e.g. torch's own message for a CUDA ordinal this machine lacks
        raise ClassifyError(str(err).splitlines()[0]) from None
