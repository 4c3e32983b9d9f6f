"""python -m classify.pretrain: masked-language-model pretraining on IMDB's own text.

    python -m classify.pretrain --data ../shared/imdb --output runs/pretrain --time-budget 50
    python -m classify.train --init-from runs/pretrain --data ../shared/imdb --output runs/finetune

Pretrains the classifier's embedding + encoder (``classify.mlm.MaskedLM``) on the unlabelled
reviews plus the training reviews, never the test split, and never the reviews the classifier
will validate on (the same ``--val-size``/``--seed`` split ``classify.train`` carves), so
fine-tuning's validation accuracy stays an honest held-out estimate. A held-out slice of the
unlabelled reviews gives the validation MLM loss.

The run folder follows ``classify.checkpoint`` (kind ``"pretrain"``): config.json, tokenizer.json
(trained on the pretraining text), model.safetensors (best validation MLM loss), last/ (resume
state), metrics.jsonl. Re-running into the same ``--output`` resumes; Ctrl-C saves and exits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from . import checkpoint
from .batching import BucketBatchSampler, pad_batch
from .cli import (HelpFormatter, ReviewRunConfig, add_model_args, add_optimisation_args, add_runtime_args,
                  add_tokenizer_args, check_run_args, runtime)
from .data import default_source, load_split, normalize, provides_split, training_split
from .device import autocast, grad_scaler, to_device
from .errors import ClassifyError, run_cli
from .mlm import Masker, MaskedLM, mlm_loss
from .models import ClassifierConfig
from .tokenize import encode, load_tokenizer, save_tokenizer, train_tokenizer
from .training import (Deadline, StopSignal, TrainingProgress, budgeted_lr_multiplier, build_optimizer,
                       optimizer_step, set_lr, set_seed)

KIND = "pretrain"


@dataclass(kw_only=True)
class PretrainConfig(ReviewRunConfig):
    """Everything that defines a pretraining run except the model sizes (stored in config.json)."""

    epochs: int = 1
    warmup: int = 100
    weight_decay: float = 0.01
    save_every: int = 100
    max_tokens: int = 4096
    mask_prob: float = 0.15
    mlm_val_size: int = 500
    eval_every: int = 250

    IDENTITY: ClassVar[tuple[str, ...]] = (*ReviewRunConfig.IDENTITY, "mask_prob", "mlm_val_size")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m classify.pretrain",
        description="Masked-language-model pretraining of the classifier's encoder on unlabelled IMDB text "
                    "(unsupervised + train splits; never test). Fine-tune the result with "
                    "`python -m classify.train --init-from OUTPUT`.",
        formatter_class=HelpFormatter,
    )
    g = p.add_argument_group("data")
    g.add_argument("--data", default=default_source(),
                   help="hub id or folder with train (and ideally unsupervised) splits; a source without an "
                        "unsupervised split pretrains on its train texts only")
    g.add_argument("--output", required=True, help="run folder to write (re-running into it resumes)")
    g.add_argument("--val-size", type=int, default=PretrainConfig.default("val_size"),
                   help="the classifier's validation split (same as classify.train --val-size, with --seed): "
                        "these reviews are left out of pretraining so fine-tuning validation stays unseen")
    g.add_argument("--mlm-val-size", type=int, default=PretrainConfig.default("mlm_val_size"),
                   help="unlabelled reviews held out to measure the validation MLM loss")
    g.add_argument("--limit", type=int, help="pretrain on a seeded random sample of N reviews (quick runs)")
    add_tokenizer_args(g, PretrainConfig, "the pretraining text")
    g = p.add_argument_group("model (fine-tuning inherits these)")
    add_model_args(g, d_model=128, layers=2, heads=4, d_ff=512, positional="learned")
    g.add_argument("--no-padding-mask", action="store_true", help="let attention see padding (for ablations)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--mask-prob", type=float, default=PretrainConfig.default("mask_prob"),
                   help="share of tokens to predict (of which 80%% become [MASK], 10%% a random token, 10%% stay)")
    add_optimisation_args(g, PretrainConfig, epochs="passes over the pretraining text")
    g.add_argument("--max-tokens", type=int, default=PretrainConfig.default("max_tokens"),
                   help="padded tokens per batch (length-bucketed)")
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=int, default=PretrainConfig.default("seed"),
                   help="random seed; also picks the classifier's validation split that is left out")
    add_runtime_args(g)
    g.add_argument("--eval-every", type=int, default=PretrainConfig.default("eval_every"),
                   help="validation MLM loss every N steps")
    g.add_argument("--save-every", type=int, default=PretrainConfig.default("save_every"),
                   help="write last/ (resume state) every N steps")
    g.add_argument("--overwrite", action="store_true", help="replace a different run found in --output")
    g.add_argument("--quiet", action="store_true", help="no progress display")
    return p


def check_args(args: argparse.Namespace) -> None:
    check_run_args(args, {"--max-tokens": args.max_tokens, "--eval-every": args.eval_every,
                          "--mlm-val-size": args.mlm_val_size})
    if args.max_tokens < args.max_len:
        raise ClassifyError(f"--max-tokens {args.max_tokens} cannot hold one review of --max-len {args.max_len}")
    if not 0.0 < args.mask_prob < 1.0:
        raise ClassifyError(f"--mask-prob must be in (0, 1), got {args.mask_prob}")


def configs_from_args(args: argparse.Namespace) -> tuple[ClassifierConfig, PretrainConfig]:
    model = ClassifierConfig(
        vocab_size=args.vocab_size, d_model=args.d_model, num_heads=args.heads, num_layers=args.layers,
        d_ff=args.d_ff, max_len=args.max_len, dropout=args.dropout, positional=args.positional,
        norm_first=not args.post_ln, mask_padding=not args.no_padding_mask)
    return model, PretrainConfig.from_args(args)


# ------------------------------------------------------------------------------ data
def pretraining_texts(source: str, val_size: int, mlm_val_size: int, seed: int,
                      limit: int | None = None) -> tuple[list[str], list[str], str]:
    """(training texts, validation texts, a description), normalised.

    Training: the unsupervised reviews (less the validation slice) + the train reviews outside
    the classifier's validation split. Validation: ``mlm_val_size`` seeded unsupervised reviews
    (train reviews if the source has no unsupervised split). The test split is never read.
    """
    labelled_train, labelled_val = training_split(source, val_size, seed)
    # Compare texts, not indices: a review that occurs twice in the train split, once in the
    # classifier's validation part, must not leak in through its twin either.
    excluded = set(labelled_val.texts)
    train_texts = [t for t in labelled_train.texts if t not in excluded]
    rng = np.random.default_rng(seed)
    if provides_split(source, "unsupervised"):
        unlabelled = load_split(source, "unsupervised", labelled=False).texts
        what = f"{len(unlabelled)} unsupervised + {len(train_texts)} train reviews"
    else:
        unlabelled = []  # e.g. a single CSV file: pretrain on its texts, hold out some of them
        what = f"{len(train_texts)} train reviews (no unsupervised split in {source})"
    pool = unlabelled if len(unlabelled) > mlm_val_size else train_texts
    if len(pool) <= mlm_val_size:
        raise ClassifyError(f"--mlm-val-size {mlm_val_size} leaves no pretraining text ({len(pool)} reviews)")
    held = set(rng.permutation(len(pool))[:mlm_val_size].tolist())
    val = [t for i, t in enumerate(pool) if i in held]
    rest = [t for i, t in enumerate(pool) if i not in held]
    train = rest + train_texts if pool is unlabelled else rest + unlabelled
    if limit and limit < len(train):
        train = [train[i] for i in sorted(rng.permutation(len(train))[:limit].tolist())]
    what += f", {val_size} classifier-validation reviews left out, {len(val)} held out for MLM validation"
    return [normalize(t) for t in train], [normalize(t) for t in val], what


def encode_compact(tokenizer, texts: list[str], max_len: int, truncation: str,
                   chunk: int = 4096) -> list[np.ndarray]:
    """Token ids as int32 arrays, encoded in chunks: 75k reviews as Python int lists would take ~1 GB."""
    out: list[np.ndarray] = []
    for start in range(0, len(texts), chunk):
        out.extend(np.asarray(ids, dtype=np.int32) for ids in
                   encode(tokenizer, texts[start : start + chunk], max_len, truncation))
    return [ids if len(ids) else np.zeros(1, dtype=np.int32) for ids in out]  # an empty review: one pad


# -------------------------------------------------------------------------- training
@torch.inference_mode()
def evaluate_mlm(model: MaskedLM, batches: list[torch.Tensor], masker: Masker, device: torch.device,
                 dtype: torch.dtype | None, seed: int) -> dict[str, float]:
    """MLM loss and masked-token accuracy over fixed batches with fixed masks (same every call,
    so successive evaluations are comparable)."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    loss_sum, correct, count = 0.0, 0, 0
    for tokens in batches:
        inputs, targets = masker(tokens, generator)
        with autocast(device, dtype):
            logits, labels = model(to_device(inputs, device), to_device(targets, device))
        loss_sum += float(mlm_loss(logits, labels)) * len(labels)
        correct += int((logits.argmax(-1) == labels).sum())
        count += len(labels)
    model.train()
    return {"loss": loss_sum / max(count, 1), "accuracy": correct / max(count, 1)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    device, dtype = runtime(args)
    out = Path(args.output)
    console = Console(stderr=True, quiet=args.quiet)
    set_seed(args.seed)
    model_config, train_config = configs_from_args(args)
    resuming = checkpoint.prepare_run_folder(out, KIND, asdict(train_config), PretrainConfig.IDENTITY,
                                             model_config.to_dict(), args.overwrite)

    # ---- data: load, tokenize once (int32 arrays)
    t0 = time.monotonic()
    train_texts, val_texts, what = pretraining_texts(args.data, args.val_size, args.mlm_val_size, args.seed,
                                                     args.limit)
    if resuming:
        tokenizer = load_tokenizer(out / checkpoint.TOKENIZER)
    else:
        tokenizer = train_tokenizer(train_texts, args.vocab_size, args.tokenizer)
    model_config.vocab_size = tokenizer.get_vocab_size()
    train_ids = encode_compact(tokenizer, train_texts, args.max_len, args.truncation)
    val_ids = encode_compact(tokenizer, val_texts, args.max_len, args.truncation)
    del train_texts, val_texts
    console.log(f"data: {what}; vocabulary {model_config.vocab_size}, "
                f"{sum(map(len, train_ids)) / 1e6:.1f}M training tokens, {time.monotonic() - t0:.1f}s")

    if not resuming:
        out.mkdir(parents=True, exist_ok=True)
        save_tokenizer(tokenizer, out / checkpoint.TOKENIZER)
    checkpoint.write_config(out, KIND, model_config.to_dict(), train=asdict(train_config))

    # ---- model and optimisation
    model = MaskedLM(model_config).to(device)
    masker = Masker(tokenizer, args.mask_prob)
    optimizer = build_optimizer(model, args.lr, args.weight_decay)
    scaler = grad_scaler(device, dtype)
    pad_id = model_config.pad_id
    sampler = BucketBatchSampler([len(x) for x in train_ids], max_tokens=args.max_tokens, seed=args.seed)
    val_sampler = BucketBatchSampler([len(x) for x in val_ids], max_tokens=args.max_tokens, shuffle=False)
    val_batches = [pad_batch([val_ids[i] for i in b], pad_id) for b in val_sampler]
    steps_per_epoch = len(sampler)
    total_steps = steps_per_epoch * args.epochs
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)

    state: dict[str, Any] = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "best_val_loss": None,
                             "train_seconds": 0.0, "tokens": 0}
    if resuming:
        restored = checkpoint.load_last(out, model, optimizer)
        if restored is not None:
            state.update({k: restored[k] for k in state if k in restored})
            # Evaluations logged after the saved step will be redone: drop them so the log has no duplicates.
            kept = [r for r in checkpoint.read_jsonl(out / checkpoint.METRICS) if r["step"] <= state["step"]]
            checkpoint.write_text(out / checkpoint.METRICS, "".join(json.dumps(r) + "\n" for r in kept))
            console.log(f"resumed from {out / checkpoint.LAST} at step {state['step']} (epoch {state['epoch']})")
    n_params = sum(p.numel() for p in model.parameters())
    console.log(f"model: {n_params / 1e6:.2f}M parameters (tied MLM decoder), device {device}, "
                f"threads {torch.get_num_threads()}, autocast {dtype if dtype else 'off (fp32)'}, "
                f"{steps_per_epoch} steps per epoch, at most {total_steps} steps")

    deadline = Deadline(args.time_budget, already_used_s=state["train_seconds"])
    run_loss, run_correct, run_targets = 0.0, 0, 0
    tokens_since, clock = 0, time.monotonic()
    stop_reason = "finished"

    def save_last() -> None:
        state["train_seconds"] = deadline.elapsed
        checkpoint.save_last(out, model, optimizer, state)

    def validate() -> None:
        """Validation MLM loss; log it; keep the best weights."""
        nonlocal run_loss, run_correct, run_targets, tokens_since, clock
        metrics = evaluate_mlm(model, val_batches, masker, device, dtype, args.seed)
        now = time.monotonic()
        record = {"step": state["step"], "epoch": round(state["step"] / steps_per_epoch, 3),
                  "train_loss": run_loss / run_targets if run_targets else None,
                  "train_accuracy": run_correct / run_targets if run_targets else None,
                  "val_loss": metrics["loss"], "val_accuracy": metrics["accuracy"],
                  "lr": optimizer.param_groups[0]["lr"] if state["step"] else None,  # of the last step taken
                  "elapsed_s": round(deadline.elapsed, 1), "tokens": state["tokens"],
                  "tokens_per_s": round(tokens_since / max(now - clock, 1e-9), 1)}
        checkpoint.append_jsonl(out / checkpoint.METRICS, record)
        train_part = f"train MLM loss {record['train_loss']:.4f}  " if run_targets else ""
        progress.log(f"step {record['step']}: val MLM loss {metrics['loss']:.4f}  masked acc "
                     f"{metrics['accuracy']:.4f}  {train_part}{record['tokens_per_s']:.0f} tok/s")
        run_loss, run_correct, run_targets, tokens_since = 0.0, 0, 0, 0
        if state["best_val_loss"] is None or metrics["loss"] < state["best_val_loss"]:
            state["best_val_loss"] = metrics["loss"]
            checkpoint.save_tensors(out / checkpoint.WEIGHTS, checkpoint.model_state(model))
        clock = time.monotonic()

    model.train()
    with StopSignal() as stop, TrainingProgress(total_steps, enabled=not args.quiet) as progress:
        progress.update(state["step"], state["epoch"], {})
        if state["step"] == 0 and not (out / checkpoint.METRICS).exists():
            validate()  # the untrained model's loss (about ln V) starts the validation curve
        while state["step"] < total_steps and stop_reason == "finished":
            sampler.set_epoch(state["epoch"])
            # Indices, not a DataLoader: a mid-epoch resume skips served batches without padding them.
            for i, indices in enumerate(sampler.batches()[state["batch_in_epoch"]:], start=state["batch_in_epoch"]):
                if stop.requested:
                    stop_reason = "interrupted"
                elif deadline.expired:
                    stop_reason = "time budget"
                if stop_reason != "finished":
                    break
                tokens = pad_batch([train_ids[j] for j in indices], pad_id)
                inputs, targets = masker(tokens)  # fresh masks every batch (dynamic masking)
                inputs, targets = to_device(inputs, device), to_device(targets, device)
                set_lr(optimizer, args.lr * budgeted_lr_multiplier(state["step"], args.warmup, total_steps,
                                                                   args.schedule, deadline))
                with autocast(device, dtype):
                    logits, labels = model(inputs, targets)
                    loss = mlm_loss(logits, labels)
                optimizer_step(loss, model, optimizer, scaler, args.clip)
                n = len(labels)
                run_loss += float(loss.detach()) * n
                run_correct += int((logits.detach().argmax(-1) == labels).sum())
                run_targets += n
                real_tokens = int((tokens != pad_id).sum())
                tokens_since += real_tokens
                state["tokens"] += real_tokens
                state["step"] += 1
                state["batch_in_epoch"] = i + 1
                progress.update(state["step"], state["epoch"] + 1, {
                    "mlm loss": run_loss / max(run_targets, 1), "masked acc": run_correct / max(run_targets, 1),
                    "lr": optimizer.param_groups[0]["lr"],
                    "tok/s": tokens_since / max(time.monotonic() - clock, 1e-9)})
                if state["step"] % args.eval_every == 0 or state["step"] == total_steps:
                    validate()
                if state["step"] % args.save_every == 0:
                    save_last()
                if state["step"] >= total_steps:
                    break
            if state["batch_in_epoch"] >= steps_per_epoch:
                state["epoch"] += 1
                state["batch_in_epoch"] = 0
        if stop_reason != "interrupted" and (run_targets or not (out / checkpoint.WEIGHTS).exists()):
            validate()  # the final partial interval counts too (and a run always leaves weights)
        save_last()

    if stop_reason == "interrupted":
        console.print(f"[yellow]interrupted at step {state['step']}; state saved in {out / checkpoint.LAST}. "
                      f"Re-run the same command to resume.[/]")
        return 130
    print_summary(console, out, state, stop_reason, deadline.elapsed)
    return 0


def print_summary(console: Console, out: Path, state: dict, reason: str, seconds: float) -> None:
    table = Table(title=f"classify.pretrain: {out}", show_header=False)
    table.add_row("stopped", reason)
    table.add_row("steps / epochs", f"{state['step']} / {state['epoch']}")
    table.add_row("tokens seen", f"{state['tokens'] / 1e6:.1f}M")
    table.add_row("training time", f"{seconds / 60:.1f} min")
    table.add_row("best validation MLM loss", f"{state['best_val_loss']:.4f}")
    table.add_row("fine-tune with", f"python -m classify.train --init-from {out} --output ...")
    table.add_row("run folder", str(out))
    console.print(table)


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="classify.pretrain"))
