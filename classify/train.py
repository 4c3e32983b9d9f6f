"""python -m classify.train: train the transformer classifier on IMDB (or any labelled text).

    python -m classify.train --data ../shared/imdb --output runs/imdb

Writes a run folder (see ``classify.checkpoint``), resumes from it when re-run with the
same ``--output``, stops cleanly on Ctrl-C or when ``--time-budget`` runs out, and
finally evaluates the best checkpoint once on the test split.

Runs unchanged under ``torchrun --nproc_per_node=N -m classify.train ...`` (one process
per GPU, DistributedDataParallel; see ``classify.distributed``): rank 0 alone writes the
run folder and logs, validation covers the whole validation set across the ranks.
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
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from tokenizers import Tokenizer

from . import checkpoint, distributed
from .batching import BucketBatchSampler, TokenizedDataset, make_loader
from .cli import (HelpFormatter, ReviewRunConfig, add_model_args, add_optimisation_args, add_runtime_args,
                  add_tokenizer_args, check_run_args, runtime)
from .data import SPLITS_BY, LABEL_NAMES, default_source, load_split, normalize, provides_split, training_split
from .device import autocast, grad_scaler, pin_memory, to_device
from .errors import ClassifyError, run_cli
from .finetune import adopt_pretrained, layer_lr_scale, load_pretrained_encoder
from .inference import KIND, logits_ids, predict_ids, softmax
from .models import Classifier, ClassifierConfig
from .ngrams import fit_mix, fit_ngram_bag
from .tokenize import encode, load_tokenizer, save_tokenizer, train_tokenizer
from .training import (Deadline, StopSignal, TrainingProgress, budgeted_lr_multiplier, build_optimizer,
                       optimizer_step, record_evaluation, set_lr, set_seed)


@dataclass(kw_only=True)
class TrainConfig(ReviewRunConfig):
    """Everything that defines a classifier training run except the model sizes (stored in config.json)."""

    epochs: int = 3
    warmup: int = 200
    weight_decay: float = 0.1
    batch_size: int = 32
    max_tokens: int | None = None
    patience: int | None = None
    eval_every: int | None = None
    num_workers: int = 0
    label_smoothing: float = 0.0
    grad_accum: int = 1
    batching: str = "bucket"
    init_from: str | None = None
    layer_decay: float | None = None
    split: str = "grouped"
    ngram_c: float = 1.0

    IDENTITY: ClassVar[tuple[str, ...]] = (*ReviewRunConfig.IDENTITY, "batching", "init_from", "layer_decay",
                                           "split", "ngram_c")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m classify.train",
        description="Train the from-scratch transformer sentiment classifier. Defaults are the recipe measured "
                    "best per CPU-minute on a 2-core machine (see experiments/RESULTS.md).",
        epilog="Several GPUs or machines: torchrun --nproc_per_node=N -m classify.train ... (same flags; "
               "--batch-size is per process, so one optimizer step sees batch-size x N x grad-accum reviews).",
        formatter_class=HelpFormatter,
    )
    g = p.add_argument_group("data")
    g.add_argument("--data", default=default_source(),
                   help="hub id, folder of {train,test}.parquet, aclImdb folder, or a CSV/JSONL/parquet file "
                        "(default from $CLASSIFY_DATA)")
    g.add_argument("--output", required=True, help="run folder to write (re-running into it resumes)")
    g.add_argument("--limit", type=int, help="use only N training reviews, a seeded random sample (quick runs)")
    g.add_argument("--val-size", type=int, default=TrainConfig.default("val_size"),
                   help="validation reviews carved from train (stratified)")
    g.add_argument("--split", choices=SPLITS_BY, default=TrainConfig.default("split"),
                   help="grouped: reviews of one movie never on both sides of the validation split (an honest "
                        "estimate of test accuracy); random: the old random split, which shares movies")
    add_tokenizer_args(g, TrainConfig, "the training split")
    g = p.add_argument_group("model")
    add_model_args(g, d_model=128, layers=2, heads=4, d_ff=512, positional="learned")
    g.add_argument("--attention-dropout", type=float,
                   help="dropout on attention weights (default: --dropout); 0 trains 1.4-1.75x faster on CPU, "
                        "where SDPA with dropout cannot use its fused kernel")
    g.add_argument("--pooling", choices=("mean", "max", "first"), default="mean", help="how token vectors become one")
    g.add_argument("--no-padding-mask", action="store_true",
                   help="let attention and pooling see padding (reproduces Bloem's code; for ablations)")
    g.add_argument("--ngram-orders", type=int, default=3,
                   help="n-gram branch over word 1..N-grams, fitted as naive-Bayes-weighted logistic regression "
                        "before training and mixed with the transformer on validation; 0 = the pure transformer")
    g.add_argument("--ngram-buckets", type=int, default=ClassifierConfig.__dataclass_fields__["ngram_buckets"].default,
                   help="hash slots of the n-gram branch")
    g.add_argument("--ngram-c", type=float, default=TrainConfig.default("ngram_c"),
                   help="inverse L2 strength of the n-gram branch's logistic regression")
    g = p.add_argument_group("optimisation")
    add_optimisation_args(g, TrainConfig, lr="peak learning rate (AdamW); with --init-from the default is 3e-4")
    g.add_argument("--batch-size", type=int, default=TrainConfig.default("batch_size"),
                   help="reviews per batch on each process; one optimizer step trains on batch-size x "
                        "processes (torchrun) x --grad-accum reviews, and the schedule counts optimizer steps")
    g.add_argument("--batching", choices=("bucket", "fixed"), default=TrainConfig.default("batching"),
                   help="bucket: length-bucketed batches padded to their longest review; fixed: random batches "
                        "padded to --max-len (the naive pipeline, for comparisons only)")
    g.add_argument("--max-tokens", type=int, help="token budget per batch instead of a fixed batch size")
    g.add_argument("--grad-accum", type=int, default=TrainConfig.default("grad_accum"),
                   help="batches each process trains on per optimizer step, their gradients averaged (a bigger "
                        "batch in the same memory)")
    g.add_argument("--label-smoothing", type=float, default=TrainConfig.default("label_smoothing"),
                   help="label smoothing of the cross-entropy")
    g.add_argument("--patience", type=int, help="stop after N evaluations without validation improvement")
    g = p.add_argument_group("fine-tuning (see classify.pretrain)")
    g.add_argument("--init-from", metavar="PRETRAIN_RUN",
                   help="start from a classify.pretrain run: its tokenizer, model sizes and encoder weights "
                        "(the classification head starts fresh); model/tokenizer flags must then be left out")
    g.add_argument("--layer-decay", type=float,
                   help="layer-wise lr decay: block i of L gets lr * decay**(L - i), embeddings decay**(L + 1)")
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=int, default=TrainConfig.default("seed"),
                   help="random seed (runs are deterministic on CPU)")
    add_runtime_args(g)
    g.add_argument("--eval-every", type=int, help="validate every N steps (default: once per epoch)")
    g.add_argument("--save-every", type=int, default=TrainConfig.default("save_every"),
                   help="write last/ (resume state) every N steps")
    g.add_argument("--num-workers", type=int, default=TrainConfig.default("num_workers"),
                   help="DataLoader worker processes")
    g.add_argument("--resume", action="store_true", help="continue the run in --output (also automatic)")
    g.add_argument("--overwrite", action="store_true", help="replace a different run found in --output")
    g.add_argument("--no-test", action="store_true", help="skip the final evaluation on the test split")
    g.add_argument("--quiet", action="store_true", help="no progress display")
    g.add_argument("--dist-timeout", type=float, default=10.0,
                   help="under torchrun: minutes a process waits for the others (start-up, every "
                        "synchronisation) before the job fails instead of hanging")
    return p


def configs_from_args(args: argparse.Namespace, vocab_size: int | None = None) -> tuple[ClassifierConfig, TrainConfig]:
    model = ClassifierConfig(
        vocab_size=vocab_size or args.vocab_size, num_classes=2, d_model=args.d_model, num_heads=args.heads,
        num_layers=args.layers, d_ff=args.d_ff, max_len=args.max_len, dropout=args.dropout,
        pooling=args.pooling, positional=args.positional, norm_first=not args.post_ln,
        mask_padding=not args.no_padding_mask, attention_dropout=args.attention_dropout,
        ngram_orders=args.ngram_orders, ngram_buckets=args.ngram_buckets)
    return model, TrainConfig.from_args(args)


def check_args(args: argparse.Namespace) -> None:
    check_run_args(args, {"--batch-size": args.batch_size, "--grad-accum": args.grad_accum})
    if args.ngram_orders < 0 or args.ngram_buckets < 1 or args.ngram_c <= 0:
        raise ClassifyError("--ngram-orders must be >= 0, --ngram-buckets >= 1 and --ngram-c > 0")
    if args.layer_decay is not None and not 0.0 < args.layer_decay <= 1.0:
        raise ClassifyError(f"--layer-decay must be in (0, 1], got {args.layer_decay}")
    if args.limit is not None and args.limit <= args.val_size:
        raise ClassifyError(f"--limit {args.limit} leaves no training data after --val-size {args.val_size}")


# ----------------------------------------------------------------------- run folder
def prepare_output(out: Path, train: TrainConfig, model: ClassifierConfig, overwrite: bool) -> bool:
    """Decide between a fresh run and a resume. Returns True when resuming."""
    return checkpoint.prepare_run_folder(out, KIND, asdict(train), TrainConfig.IDENTITY, model.to_dict(), overwrite)


def pool_batches(batching: str) -> int:
    """Batches per length-sorted pool: 1 sorts nothing that matters, i.e. plain random batches."""
    return 1 if batching == "fixed" else 50


def reshard_epoch(state: dict[str, Any], layout: dict[str, Any], lengths: list[int], seed: int,
                  batching: str = "bucket") -> None:
    """Carry a resumed epoch over to this run's batch layout.

    ``state["batch_in_epoch"]`` counts batches of the epoch's global batch list (all ranks),
    which depends on --batch-size, --max-tokens and processes x --grad-accum (``layout``).
    Unchanged layout: the epoch continues exactly where it stopped. Changed layout (e.g.
    another number of GPUs): the examples of the batches already trained on join
    ``epoch_skip``, and the epoch's remaining examples are batched anew; every example is
    still seen once per epoch.
    """
    old = state["layout"]
    if old != layout and state["batch_in_epoch"]:
        # The global list does not depend on the rank count, only on the batches per step.
        sampler = BucketBatchSampler(lengths, batch_size=old["batch_size"], max_tokens=old["max_tokens"],
                                     seed=seed, grad_accum=old["batches_per_step"],
                                     pool_batches=pool_batches(batching))
        sampler.set_epoch(state["epoch"], state["epoch_skip"])
        seen = [i for batch in sampler.batches()[: state["batch_in_epoch"]] for i in batch]
        state["epoch_skip"] = sorted(state["epoch_skip"] + seen)
        state["batch_in_epoch"] = 0
    state["layout"] = layout


# ------------------------------------------------------------------------- training
@torch.inference_mode()
def evaluate_ids(model: Classifier, ids: list[list[int]], labels: list[int], device, dtype,
                 batch_size: int, shard: bool = False) -> dict[str, float]:
    """Loss and accuracy over pre-tokenized examples.

    ``shard``: called on every rank, each scores its share of the examples and the sums are
    added up, so every rank gets the metrics of the whole set (not of its own share).
    """
    if shard:
        ids, labels = distributed.shard(ids), distributed.shard(labels)
    probs = (predict_ids(model, ids, device, dtype, batch_size=batch_size * 2) if ids
             else np.zeros((0, model.config.num_classes)))
    sums = metric_sums(probs, labels)
    loss, correct, count = distributed.all_sum(sums) if shard else sums
    return {"loss": loss / count, "accuracy": correct / count}


def metric_sums(probs: np.ndarray, labels: list[int]) -> list[float]:
    """probs (N, C) -> [summed cross-entropy, correct predictions, N]."""
    y = np.asarray(labels, dtype=np.int64)
    return [float(-np.log(np.clip(probs[np.arange(len(y)), y], 1e-12, None)).sum()),
            float((probs.argmax(1) == y).sum()), len(y)]


def accuracy(logits: np.ndarray, labels: list[int]) -> float:
    return float((logits.argmax(-1) == np.asarray(labels)).mean())


def fit_branch_mix(out: Path, model: Classifier, val_ids: list[list[int]], val_labels: list[int], device, dtype,
                   batch_size: int, console: Console) -> dict | None:
    """The last stage of an n-gram run: on the best weights, choose the transformer's and the n-gram branch's
    weights in the mix on validation, and store them in ``model.safetensors``."""
    if not (out / checkpoint.WEIGHTS).exists():
        return None
    checkpoint.load_model_weights(model, out / checkpoint.WEIGHTS)
    record: dict[str, Any] = {}
    if val_ids:
        parts = logits_ids(model, val_ids, device, dtype, batch_size * 2, parts=True)
        weights = fit_mix(parts, val_labels)
        record["val_accuracy"] = {"transformer": accuracy(parts[0], val_labels),
                                  "ngram": accuracy(parts[1], val_labels),
                                  "mixed": accuracy(weights[0] * parts[0] + weights[1] * parts[1], val_labels)}
    else:  # nothing to choose on: the two at equal weight
        weights = (1.0, 1.0)
    model.mix.copy_(torch.tensor(weights))
    checkpoint.save_tensors(out / checkpoint.WEIGHTS, checkpoint.model_state(model))
    record["mix"] = [round(w, 4) for w in weights]
    console.log(f"mix of transformer and n-gram logits chosen on validation: {record['mix']}"
                + (f", validation accuracy {record['val_accuracy']}" if val_ids else " (no validation: equal)"))
    return record


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.init_from:
        adopt_pretrained(args, parser, argv)  # model sizes, tokenizer and lr default from the pretraining run
    check_args(args)
    device, dtype = runtime(args)
    with distributed.process_group(device, args.dist_timeout):
        return run(args, device, dtype)


def run(args: argparse.Namespace, device: torch.device, dtype: torch.dtype | None) -> int:
    """The training run of ``main``; under torchrun every rank runs it. Returns the exit code."""
    out = Path(args.output)
    world = distributed.world_size()
    console = Console(stderr=True, quiet=args.quiet or not distributed.is_main())
    set_seed(args.seed + distributed.rank())  # other dropout masks per rank; DDP gives all rank 0's weights
    model_config, train_config = configs_from_args(args)
    resuming = distributed.on_main(lambda: prepare_output(out, train_config, model_config, args.overwrite))

    # ---- data: load, split, tokenize once
    t0 = time.monotonic()
    train_set, val_set = training_split(args.data, args.val_size, args.seed, args.limit, args.split)
    if len(set(train_set.labels)) < 2:
        raise ClassifyError(f"the training data from {args.data} has only one class ({train_set.labels[0]})")
    train_texts = [normalize(t) for t in train_set.texts]
    val_texts = [normalize(t) for t in val_set.texts]

    def make_tokenizer() -> Tokenizer:
        if resuming:
            return load_tokenizer(out / checkpoint.TOKENIZER)
        if args.init_from:
            return load_tokenizer(Path(args.init_from) / checkpoint.TOKENIZER)
        return train_tokenizer(train_texts, args.vocab_size, args.tokenizer)

    # Rank 0 makes it and sends it to the others: identical everywhere, even where they cannot see its files.
    tokenizer = Tokenizer.from_str(distributed.on_main(lambda: make_tokenizer().to_str()))
    model_config.vocab_size = tokenizer.get_vocab_size()
    train_ids = encode(tokenizer, train_texts, args.max_len, args.truncation)
    val_ids = encode(tokenizer, val_texts, args.max_len, args.truncation)
    console.log(f"data: {len(train_ids)} train / {len(val_ids)} validation reviews from {args.data}, "
                f"vocabulary {model_config.vocab_size}, {time.monotonic() - t0:.1f}s")

    if not resuming and distributed.is_main():  # rank 0 alone writes the run folder
        out.mkdir(parents=True, exist_ok=True)
        save_tokenizer(tokenizer, out / checkpoint.TOKENIZER)
        checkpoint.write_config(out, KIND, model_config.to_dict(), train=asdict(train_config),
                                labels=list(LABEL_NAMES))
    elif distributed.is_main():  # flags that may change on resume (budget, epochs, ...) are recorded as the latest
        old = checkpoint.read_config(out, KIND)
        checkpoint.write_config(out, KIND, old["model"], train=asdict(train_config), labels=old["labels"])

    # ---- model and optimisation
    model = Classifier(model_config).to(device)
    if args.init_from:  # on resume, last/ (loaded below) then replaces these weights
        load_pretrained_encoder(model, args.init_from)
    if model.ngram is not None and not resuming:
        # Rank 0 fits the branch; DDP gives every rank its weights when it wraps the model below.
        def fit_branch() -> float:
            t = time.monotonic()
            fit_ngram_bag(model.ngram, train_ids, train_set.labels, args.ngram_c)
            return time.monotonic() - t
        console.log(f"n-gram branch (orders 1-{model_config.ngram_orders}, {model_config.ngram_buckets} slots) "
                    f"fitted in {distributed.on_main(fit_branch):.0f}s")
    lr_scale = layer_lr_scale(model_config.num_layers, args.layer_decay) if args.layer_decay else None
    optimizer = build_optimizer(model, args.lr, args.weight_decay, lr_scale=lr_scale)
    scaler = grad_scaler(device, dtype)
    dataset = TokenizedDataset(train_ids, train_set.labels)
    sampler = BucketBatchSampler(dataset.lengths, batch_size=args.batch_size, max_tokens=args.max_tokens,
                                 seed=args.seed, rank=distributed.rank(), world_size=world,
                                 grad_accum=args.grad_accum, pool_batches=pool_batches(args.batching))
    loader = make_loader(dataset, sampler, model_config.pad_id, args.num_workers, pin_memory(device),
                         pad_to=args.max_len if args.batching == "fixed" else None)
    steps_per_epoch = len(sampler) // args.grad_accum
    total_steps = steps_per_epoch * args.epochs
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)

    # batch_in_epoch counts the epoch's global batches (all ranks) in ``layout``; see reshard_epoch.
    layout = {"batch_size": args.batch_size, "max_tokens": args.max_tokens,
              "batches_per_step": world * args.grad_accum}
    state: dict[str, Any] = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "best_val_acc": -1.0,
                             "evals_since_best": 0, "train_seconds": 0.0, "tokens": 0, "layout": layout,
                             "epoch_skip": []}
    if resuming:
        # Rank 0 restores last/; the weights reach the other ranks when DDP wraps the model below.
        restored = distributed.on_main(lambda: checkpoint.load_last(out, model, optimizer))
        if restored is not None:
            distributed.share_optimizer_state(optimizer)
            state.update({k: restored[k] for k in state if k in restored})
            reshard_epoch(state, layout, dataset.lengths, args.seed, args.batching)
            if distributed.is_main():
                # Evaluations logged after the saved step will be redone: drop them so the log has no duplicates.
                kept = [r for r in checkpoint.read_jsonl(out / checkpoint.METRICS) if r["step"] <= state["step"]]
                checkpoint.write_text(out / checkpoint.METRICS, "".join(json.dumps(r) + "\n" for r in kept))
            console.log(f"resumed from {out / checkpoint.LAST} at step {state['step']} (epoch {state['epoch']})")
    ddp_model = distributed.wrap(model, device)  # trains; ``model`` (the same weights) evaluates and saves
    n_params = sum(p.numel() for p in model.parameters())
    console.log(f"model: {n_params / 1e6:.2f}M parameters, device {device}, "
                f"autocast {dtype if dtype else 'off (fp32)'}, {total_steps} steps")

    deadline = Deadline(args.time_budget, already_used_s=state["train_seconds"])
    eval_every = args.eval_every or steps_per_epoch
    run_loss, run_correct, run_seen = 0.0, 0, 0
    tokens_since, clock = 0, time.monotonic()
    stop_reason = "finished"

    def save_last() -> None:
        state["train_seconds"] = deadline.elapsed
        if distributed.is_main():
            checkpoint.save_last(out, model, optimizer, state)

    def validate() -> bool:
        """Evaluate, log, keep the best weights. Returns True when patience ran out."""
        nonlocal run_loss, run_correct, run_seen, tokens_since, clock
        metrics = evaluate_ids(model, val_ids, val_set.labels, device, dtype, args.batch_size, shard=True)
        now = time.monotonic()
        record = {"step": state["step"], "epoch": round(state["step"] / steps_per_epoch, 3),
                  "train_loss": run_loss / max(run_seen, 1), "train_accuracy": run_correct / max(run_seen, 1),
                  "val_loss": metrics["loss"], "val_accuracy": metrics["accuracy"],
                  "lr": optimizer.param_groups[0]["lr"], "elapsed_s": round(deadline.elapsed, 1),
                  "tokens_per_s": round(tokens_since / max(now - clock, 1e-9), 1)}
        if distributed.is_main():
            checkpoint.append_jsonl(out / checkpoint.METRICS, record)
        progress.log(f"step {record['step']}: val loss {metrics['loss']:.4f}  val acc {metrics['accuracy']:.4f}  "
                     f"train acc {record['train_accuracy']:.4f}  {record['tokens_per_s']:.0f} tok/s")
        run_loss, run_correct, run_seen, tokens_since = 0.0, 0, 0, 0
        improved, exhausted = record_evaluation(state, "best_val_acc", metrics["accuracy"], args.patience)
        if improved and distributed.is_main():
            checkpoint.save_tensors(out / checkpoint.WEIGHTS, checkpoint.model_state(model))
        model.train()
        clock = time.monotonic()
        return exhausted

    model.train()
    accum = args.grad_accum
    step_stats = np.zeros(4)  # this rank's loss sum, correct, reviews, real tokens in the current step
    with (StopSignal() as stop,
          TrainingProgress(total_steps, enabled=not args.quiet and distributed.is_main()) as progress):
        progress.update(state["step"], state["epoch"], {})
        if distributed.all_sum([deadline.expired])[0]:
            stop_reason = "time budget"  # resumed with the budget already spent
        while state["step"] < total_steps and state["epoch"] < args.epochs and stop_reason == "finished":
            sampler.set_epoch(state["epoch"], state["epoch_skip"])
            epoch_batches = len(sampler) * world
            for i, batch in enumerate(loader):
                if i < state["batch_in_epoch"] // world:
                    continue  # resuming mid-epoch: the sampler replays this epoch's order
                if i % accum == 0:  # a step's first micro-batch
                    factor = budgeted_lr_multiplier(state["step"], args.warmup, total_steps, args.schedule, deadline)
                    if deadline.seconds is not None:  # time enters the schedule: all ranks go by rank 0's clock
                        factor = distributed.from_main(factor)
                    set_lr(optimizer, args.lr * factor)
                last = (i + 1) % accum == 0  # the step's last micro-batch: gradients are all-reduced, then step
                batch = to_device(batch, device)
                with distributed.micro_batch(ddp_model, last):
                    with autocast(device, dtype):
                        logits = ddp_model(batch["tokens"])
                        loss = F.cross_entropy(logits.float(), batch["labels"], label_smoothing=args.label_smoothing)
                    # Mean over micro-batches here, DDP's mean over ranks: a step's gradient is that of the mean
                    # loss of its ranks x accum batches, as if one process had trained on them all.
                    if last:
                        optimizer_step(loss / accum, model, optimizer, scaler, args.clip)
                    else:
                        scaler.scale(loss / accum).backward()
                n = len(batch["labels"])
                step_stats += (float(loss.detach()) * n, int((logits.argmax(-1) == batch["labels"]).sum()), n,
                               int((batch["tokens"] != model_config.pad_id).sum()))
                if not last:
                    continue
                # One small all-reduce per step: every rank gets the step's totals and learns whether any
                # rank was told to stop (Ctrl-C, SIGTERM, time budget), so all stop after the same step.
                loss_sum, correct, seen, tokens, interrupted, expired = distributed.all_sum(
                    [*step_stats, stop.requested, deadline.expired])
                step_stats[:] = 0
                run_loss += loss_sum
                run_correct += int(correct)
                run_seen += int(seen)
                tokens_since += int(tokens)
                state["tokens"] += int(tokens)
                state["step"] += 1
                state["batch_in_epoch"] = (i + 1) * world
                if interrupted:
                    stop_reason = "interrupted"
                elif expired:
                    stop_reason = "time budget"
                progress.update(state["step"], state["epoch"] + 1, {
                    "loss": run_loss / run_seen, "acc": run_correct / run_seen,
                    "lr": optimizer.param_groups[0]["lr"],
                    "tok/s": tokens_since / max(time.monotonic() - clock, 1e-9)})
                if state["step"] % eval_every == 0 or state["step"] == total_steps:
                    if validate():
                        stop_reason = "early stopping"
                if state["step"] % args.save_every == 0:
                    save_last()
                if state["step"] >= total_steps or stop_reason != "finished":
                    break
            if state["batch_in_epoch"] >= epoch_batches:
                state["epoch"] += 1
                state["batch_in_epoch"] = 0
                state["epoch_skip"] = []
        # (best_val_acc < 0: no validation yet, so no weights; the same answer on every rank, unlike a file check)
        if stop_reason in ("time budget", "finished") and (run_seen or state["best_val_acc"] < 0):
            validate()  # the final partial interval counts too (and a run always leaves weights)
        save_last()

    if stop_reason == "interrupted":
        console.print(f"[yellow]interrupted at step {state['step']}; state saved in {out / checkpoint.LAST}. "
                      f"Re-run the same command to resume.[/]")
        return 130
    if not distributed.is_main():
        return 0

    # ---- the mix of the two branches, then one evaluation of the best weights on the test split (rank 0's
    # model, no other rank involved)
    mix = (fit_branch_mix(out, model, val_ids, val_set.labels, device, dtype, args.batch_size, console)
           if model.ngram is not None else None)
    test_metrics = None if args.no_test else evaluate_test(out, args, model, tokenizer, device, dtype, console, mix)
    print_summary(console, out, state, stop_reason, test_metrics, deadline.elapsed)
    return 0


def evaluate_test(out: Path, args, model: Classifier, tokenizer, device, dtype, console,
                  mix: dict | None) -> dict | None:
    """Test metrics of the best weights (``test_metrics.json``); with the n-gram branch, also each
    branch's accuracy alone and the mix chosen on validation."""
    if not (out / checkpoint.WEIGHTS).exists():
        return None
    if not provides_split(args.data, "test"):
        console.log(f"no test evaluation: {args.data} has no separate test split")
        return None
    try:
        test = load_split(args.data, "test")
    except ClassifyError as err:
        console.log(f"no test evaluation: {err}")
        return None
    checkpoint.load_model_weights(model, out / checkpoint.WEIGHTS)
    ids = encode(tokenizer, [normalize(t) for t in test.texts], args.max_len, args.truncation)
    t0 = time.monotonic()
    logits = logits_ids(model, ids, device, dtype, args.batch_size * 2, parts=mix is not None)
    if mix is not None:
        components = {"transformer": accuracy(logits[0], test.labels), "ngram": accuracy(logits[1], test.labels)}
        logits = float(model.mix[0]) * logits[0] + float(model.mix[1]) * logits[1]
    loss, correct, count = metric_sums(softmax(logits), test.labels)
    metrics: dict[str, Any] = {"loss": loss / count, "accuracy": correct / count}
    if mix is not None:
        metrics.update({"components": components, **mix})
    metrics.update({"split": "test", "examples": len(ids), "seconds": round(time.monotonic() - t0, 1)})
    checkpoint.write_json(out / checkpoint.TEST_METRICS, metrics)
    return metrics


def print_summary(console: Console, out: Path, state: dict, reason: str, test: dict | None, seconds: float) -> None:
    table = Table(title=f"classify.train: {out}", show_header=False)
    table.add_row("stopped", reason)
    table.add_row("steps / epochs", f"{state['step']} / {state['epoch']}")
    table.add_row("training time", f"{seconds / 60:.1f} min")
    table.add_row("best validation accuracy", f"{state['best_val_acc']:.4f}")
    if test:
        table.add_row("test accuracy", f"{test['accuracy']:.4f}  ({test['examples']} reviews)")
        if "components" in test:
            table.add_row("  transformer / n-grams alone", "{transformer:.4f} / {ngram:.4f}".format(**test["components"]))
        table.add_row("test loss", f"{test['loss']:.4f}")
    table.add_row("run folder", str(out))
    console.print(table)


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="classify.train"))
