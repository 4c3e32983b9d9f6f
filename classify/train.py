"""python -m classify.train: train the transformer classifier on IMDB (or any labelled text).

    python -m classify.train --data ../shared/imdb --output runs/imdb

The command reads the data, makes the tokenizer and the ``Classifier``, hands a
``ClassificationTask`` to the one training loop (``classify.engine.loop.fit``: run folder,
resume, Ctrl-C, time budget, torchrun), then evaluates the best weights once on the test split.

Runs unchanged under ``torchrun --nproc_per_node=N -m classify.train ...`` (one process
per GPU, DistributedDataParallel; see ``classify.engine.distributed``): rank 0 alone writes the
run folder and logs, validation covers the whole validation set across the ranks.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import MISSING, dataclass
from functools import partial
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console

from .engine.config import (HelpFormatter, ReviewRunConfig, add_flags, add_run_folder_args, decay, fraction,
                             from_args, positive, setting)
from .engine import distributed
from .engine.files import load_model_weights
from .engine.loop import Task, fit, run_trainer
from .engine.runfolder import TOKENIZER, WEIGHTS, RunFolder
from .errors import ClassifyError, run_cli
from .finetune import adopt_pretrained, layer_lr_scale, load_pretrained_encoder
from .backends import TorchBackend, batched_branches, batched_logits
from .inference import KIND, softmax
from .mix import fit_mix, mixed_logits
from .models import RECIPE, Classifier, ClassifierConfig, ngram_branch
from .ngrams import bag_logits, describe, self_train_ngram_bag
from .text.batching import Collate
from .text.prepare import Preprocessing
from .text.data import (LABEL_NAMES, SPLITS_BY, default_source, default_val_size, load_split, normalize,
                        provides_split, training_split, unlabelled_split)
from .text.tokenize import CLAUSE_BREAKS, NEGATORS, load_tokenizer, token_ids, train_tokenizer


@dataclass(kw_only=True)
class TrainConfig(ReviewRunConfig):
    """Everything that defines a classifier training run except the model (config.json's "train")."""

    data: str = ReviewRunConfig.redefault("data", MISSING, "hub id, folder of {train,test}.parquet, aclImdb folder, "
                                                           "or a CSV/JSONL/parquet file (default from "
                                                           "$CLASSIFY_DATA)")
    epochs: int = ReviewRunConfig.redefault("epochs", 3)
    limit: int | None = ReviewRunConfig.redefault("limit", None, "use only N training reviews and at most N "
                                                                 "unlabelled ones, seeded random samples (quick runs)")
    warmup: int = ReviewRunConfig.redefault("warmup", 200)
    weight_decay: float = ReviewRunConfig.redefault("weight_decay", 0.1)
    lr: float = ReviewRunConfig.redefault("lr", 1e-3, "peak learning rate (AdamW); with --init-from the default "
                                                      "is 3e-4")
    batch_size: int = setting(32, "reviews per batch on each process; one optimizer step trains on batch-size x "
                                  "processes (torchrun) x --grad-accum reviews, and the schedule counts optimizer "
                                  "steps", check=positive)
    max_tokens: int | None = setting(None, "token budget per batch instead of a fixed batch size", check=positive)
    batching: str = setting("bucket", "bucket: length-bucketed batches padded to their longest review; fixed: "
                                      "random batches padded to --max-len (the naive pipeline, for comparisons "
                                      "only)", choices=("bucket", "fixed"))
    label_smoothing: float = setting(0.0, "label smoothing of the cross-entropy", check=fraction)
    init_from: str | None = setting(None, "start from a classify.pretrain run folder: its tokenizer, model sizes "
                                          "and encoder weights (the classification head starts fresh); "
                                          "model/tokenizer flags must then be left out")
    layer_decay: float | None = setting(None, "layer-wise lr decay: block i of L gets lr * decay**(L - i), "
                                              "embeddings decay**(L + 1)", check=decay)
    split: str = setting("grouped", "grouped: reviews of one movie are never on both sides of the validation split "
                                    "(an honest estimate of test accuracy); random: the old random split, which "
                                    "shares movies with training", choices=SPLITS_BY)
    ngram_c: float = setting(1.0, "inverse L2 strength of the n-gram branch's logistic regression", check=positive)
    ngram_self_train: bool = setting(False, "self-train the n-gram branch on the source's unlabelled reviews (its "
                                            "unsupervised split, when it has one): fit, label them with the fit, "
                                            "fit again on both. On IMDB test: +0.2 points for plain 1-3-grams, "
                                            "none with the default features; about 2.5 more minutes")
    pseudo_labels: bool = setting(True, "train the transformer on the source's unlabelled reviews too, each labelled "
                                        "by an n-gram model fitted on the labelled ones (the n-gram branch's first "
                                        "fit, or with --ngram-orders 0 the same model fitted as a teacher only); "
                                        "IMDB: 50,000 more reviews")
    soft_labels: bool = setting(True, "the pseudo-labelled reviews' targets are the teacher's class probabilities "
                                       "(distillation) instead of its most likely class: a review the teacher is "
                                       "unsure of, where most of its mistakes are, pulls the transformer less")
    ngram_refit: bool = setting(True, "once the pseudo-labels are given, fit the n-gram branch again on all labelled "
                                      "reviews, the validation split's too, for the model it keeps; the mix and the "
                                      "validation scores still use the first fit's logits, which have not seen "
                                      "those reviews. IMDB test: about +0.1 point (3 seeds)")

    IDENTITY: ClassVar[tuple[str, ...]] = (*ReviewRunConfig.IDENTITY, "batching", "init_from", "layer_decay",
                                           "split", "ngram_c", "pseudo_labels", "soft_labels", "ngram_refit")

    def validate(self, model: ClassifierConfig) -> None:
        super().validate(model)
        if self.limit is not None and self.val_size is not None and self.limit <= self.val_size:
            raise ClassifyError(f"--limit {self.limit} leaves no training data after --val-size {self.val_size}")


MODEL_FLAGS = ("d_model", "num_heads", "num_layers", "d_ff", "dropout", "attention_dropout", "pooling", "positional",
               "norm_first", "mask_padding", "ngram_orders", "ngram_buckets", "ngram_skip_bigrams", "ngram_head",
               "ngram_tail", "ngram_negation")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m classify.train",
        description="Train the from-scratch transformer sentiment classifier. Defaults are the recipe measured "
                    "best per CPU-minute on a 2-core machine (see experiments/RESULTS.md). Each flag is a setting "
                    "that config.json stores under the flag's name (--num-heads: num_heads).",
        epilog="Several GPUs or machines: torchrun --nproc_per_node=N -m classify.train ... (same flags; "
               "--batch-size is per process, so one optimizer step sees batch-size x N x grad-accum reviews).",
        formatter_class=HelpFormatter,
    )
    g = p.add_argument_group("data")
    add_flags(g, TrainConfig, ["data", "limit", "val_size", "split", "vocab_size", "tokenizer", "truncation"],
              defaults={"data": default_source()})
    add_flags(g, ClassifierConfig, ["max_len"])
    g = p.add_argument_group("model")
    add_flags(g, ClassifierConfig, MODEL_FLAGS, defaults=RECIPE)  # the flags build the shipped model by default
    add_flags(g, TrainConfig, ["ngram_c", "ngram_self_train", "ngram_refit", "pseudo_labels", "soft_labels"])
    add_flags(p.add_argument_group("optimisation"), TrainConfig,
              ["epochs", "max_steps", "time_budget", "lr", "warmup", "schedule", "weight_decay", "clip", "batch_size",
               "batching", "max_tokens", "grad_accum", "label_smoothing", "eval_every", "patience"])
    add_flags(p.add_argument_group("fine-tuning (see classify.pretrain)"), TrainConfig, ["init_from", "layer_decay"])
    g = p.add_argument_group("run")
    add_flags(g, TrainConfig, ["seed", "device", "precision", "threads", "save_every", "num_workers"])
    add_run_folder_args(g)
    g.add_argument("--no-test", action="store_true", help="skip the final evaluation on the test split")
    return p


def configs_from_args(args: argparse.Namespace) -> tuple[ClassifierConfig, TrainConfig]:
    """The model's config and the run's, from the flags; checked. (The negation scope's token ids are filled in
    once the tokenizer exists: ``negation_tokens``.)"""
    config = from_args(TrainConfig, args)
    model = from_args(ClassifierConfig, args, vocab_size=config.vocab_size, num_classes=len(LABEL_NAMES),
                      ngram_negators=[], ngram_breaks=[])
    config.validate(model)
    return model, config


# ------------------------------------------------------------------------- the task
class ClassificationTask(Task):
    """Reviews -> labels by cross-entropy; validation accuracy picks the best weights."""

    def __init__(self, model: Classifier, train_ids: list[list[int]], train_labels: list[int] | np.ndarray,
                 val_ids: list[list[int]], val_labels: list[int], config: TrainConfig, device: torch.device,
                 dtype: torch.dtype | None):
        fixed = config.batching == "fixed"  # the naive pipeline: random batches padded to max_len
        self.model = model
        self.lengths = [len(x) for x in train_ids]
        self.batch_size, self.max_tokens = config.batch_size, config.max_tokens
        self.pool_batches = 1 if fixed else 50  # a pool of one batch sorts nothing that matters
        self.collate = Collate(train_ids, train_labels, model.config.pad_id, model.config.max_len if fixed else None)
        self.lr_scale = layer_lr_scale(model.config.num_layers, config.layer_decay) if config.layer_decay else None
        self.label_smoothing = config.label_smoothing
        self.val_ids, self.val_labels, self.device, self.dtype = val_ids, val_labels, device, dtype

    def loss(self, model, batch):
        logits = model(batch["tokens"])  # (B, C)
        labels = batch["labels"]  # (B,) classes, or (B, C) target distributions (soft labels)
        loss = F.cross_entropy(logits.float(), labels, label_smoothing=self.label_smoothing)
        n = len(labels)
        classes = labels if labels.dim() == 1 else labels.argmax(-1)
        return loss, {"loss": float(loss.detach()) * n, "correct": float((logits.argmax(-1) == classes).sum()),
                      "examples": n, "tokens": float((batch["tokens"] != self.model.config.pad_id).sum())}

    def train_metrics(self, sums):
        n = sums["examples"]
        return {"train_loss": sums["loss"] / n if n else None, "train_accuracy": sums["correct"] / n if n else None}

    def validate(self, model):
        metrics = evaluate_ids(model, self.val_ids, self.val_labels, self.device, self.dtype, self.batch_size,
                               shard=True)
        return {"val_loss": metrics["loss"], "val_accuracy": metrics["accuracy"]}

    def score(self, metrics):
        return metrics["val_accuracy"]


@torch.inference_mode()
def evaluate_ids(model: Classifier, ids: list[list[int]], labels: list[int], device, dtype,
                 batch_size: int, shard: bool = False) -> dict[str, float]:
    """Loss and accuracy over pre-tokenized examples.

    ``shard``: called on every rank, each scores its share of the examples and the sums are
    added up, so every rank gets the metrics of the whole set (not of its own share).
    """
    if shard:
        ids, labels = distributed.shard(ids), distributed.shard(labels)
    probs = softmax(batched_logits(TorchBackend(model, device, dtype), ids, batch_size * 2))
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


def fit_branch_mix(run: RunFolder, model: Classifier, val_ids: list[list[int]], val_labels: list[int], device, dtype,
                   batch_size: int, console: Console) -> dict | None:
    """The last stage of a run with the n-gram branch: on the best weights, choose the mix of the transformer
    and the branch (``classify.mix``) on validation, and store it in ``model.safetensors``."""
    if not (run.path / WEIGHTS).exists():
        return None
    load_model_weights(model, run.path / WEIGHTS)
    record: dict = {}
    if val_ids:
        parts = batched_branches(TorchBackend(model, device, dtype), val_ids, batch_size * 2)
        held_out = run.branch_validation(len(val_ids), model.config.num_classes)
        if held_out is not None:  # the branch was fitted again on all labelled reviews: score the first fit
            parts = parts._replace(ngram=held_out)
        mix = fit_mix(parts.transformer, parts.ngram, parts.lengths, val_labels)
        record["val_accuracy"] = {"transformer": accuracy(parts.transformer, val_labels),
                                  "ngram": accuracy(parts.ngram, val_labels),
                                  "mixed": accuracy(mixed_logits(mix, *parts), val_labels)}
    else:  # nothing to choose on: the two at equal weight
        mix = np.array([[1.0, 0.0], [1.0, 0.0]])
    model.mix.copy_(torch.as_tensor(mix, dtype=model.mix.dtype))
    run.save_best(model)
    record["mix"] = np.round(mix, 4).tolist()
    console.log(f"mix of transformer and n-gram logits chosen on validation (per branch: constant, slope per "
                f"log-token): {record['mix']}"
                + (f", validation accuracy {record['val_accuracy']}" if val_ids else " (no validation: equal)"))
    return record


def prepare(run: RunFolder, model: Classifier, config: TrainConfig, train: tuple[list[list[int]], list[int]],
            val: tuple[list[list[int]], list[int]], unlabelled_ids: list[list[int]], console: Console) -> np.ndarray:
    """Stage 1 of a fresh run, before the transformer trains: fit the n-gram branch on ``train`` (ids, labels;
    self-trained on the unlabelled reviews), label the unlabelled reviews for ``--pseudo-labels`` (kept in the
    run folder), and with ``--ngram-refit`` keep the fit's validation logits and fit the branch again on
    ``train`` and ``val`` together. Returns the teacher's class probabilities for the unlabelled reviews,
    (N, C); N = 0 without pseudo-labels."""
    (train_ids, train_labels), (val_ids, val_labels) = train, val
    given = np.zeros((0, model.config.num_classes), dtype=np.float32)
    if model.ngram is not None or (config.pseudo_labels and unlabelled_ids):
        t = time.monotonic()
        # Without a branch in the model (--ngram-orders 0), the branch the flags describe, with the default orders,
        # is fitted as a teacher only, then dropped.
        bag = model.ngram if model.ngram is not None else ngram_branch(model.config, RECIPE["ngram_orders"])
        refit = model.ngram is not None and config.ngram_self_train
        given = self_train_ngram_bag(bag, train_ids, train_labels, unlabelled_ids, config.ngram_c, refit=refit)
        what = ("n-gram branch" + (f" self-trained on {len(given)} unlabelled reviews" if refit else "")
                if model.ngram is not None else "n-gram teacher")
        console.log(f"{what} ({describe(bag.kinds)}; {bag.buckets:,} slots) fitted in {time.monotonic() - t:.0f}s"
                    + (f"; its first fit labels {(given.argmax(1) == 1).mean():.0%} of the unlabelled reviews "
                       f"{LABEL_NAMES[1]}" if len(given) else ""))
        if model.ngram is not None and config.ngram_refit and val_ids:
            t = time.monotonic()
            run.save_branch_validation(bag_logits(bag, val_ids).numpy())
            self_train_ngram_bag(bag, train_ids + val_ids, train_labels + val_labels, unlabelled_ids if refit else [],
                                 config.ngram_c, refit=refit)
            console.log(f"n-gram branch fitted again on all {len(train_ids) + len(val_ids)} labelled reviews in "
                        f"{time.monotonic() - t:.0f}s (the mix is chosen on the first fit's validation logits)")
    if not (config.pseudo_labels and len(given)):
        return given[:0]
    run.save_pseudo_labels(given, "n-gram branch, first fit" if model.ngram is not None else "n-gram teacher")
    return given


def saved_pseudo_labels(run: RunFolder, count: int, num_classes: int) -> np.ndarray:
    """The pseudo-labels of the run being resumed, (N, C) probabilities, checked against the ``count``
    unlabelled reviews read now."""
    labels = run.pseudo_labels(num_classes)
    if labels is None or len(labels) != count:
        raise ClassifyError(f"{run.path} cannot resume with pseudo-labels: it holds labels for "
                            f"{'no' if labels is None else len(labels)} unlabelled reviews, the source has {count} "
                            f"(start afresh with --overwrite)")
    return labels


# ---------------------------------------------------------------------- the command
def training_targets(labels: list[int], given: np.ndarray, soft: bool) -> list[int] | np.ndarray:
    """The targets of the labelled reviews, then of the pseudo-labelled ones (``given``: the teacher's
    probabilities, (N, C)): class ids, the teacher's most likely class for the latter; with ``soft``, one
    distribution per review, (len(labels) + N, C), one-hot for the labelled reviews."""
    if not (soft and len(given)):
        return labels + given.argmax(1).tolist()
    return np.concatenate([np.eye(given.shape[1], dtype=np.float32)[labels], given.astype(np.float32)])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.init_from:
        adopt_pretrained(args, parser, argv)  # model sizes, tokenizer and lr default from the pretraining run
    model_config, config = configs_from_args(args)
    return run_trainer(KIND, config, args, partial(train, args, model_config, config))


def train(args: argparse.Namespace, model_config: ClassifierConfig, config: TrainConfig, run: RunFolder,
          device: torch.device, dtype: torch.dtype | None, console: Console) -> int:
    """The training run of ``main``; under torchrun every rank runs it. Returns the exit code."""
    # ---- data: load, split (which settles the validation size), open the run folder, tokenize once
    t0 = time.monotonic()
    train_set, val_set = training_split(config.data, config.val_size, config.seed, config.limit, config.split)
    if len(set(train_set.labels)) < 2:
        raise ClassifyError(f"the training data from {config.data} has only one class ({train_set.labels[0]})")
    if config.val_size is None:
        # The size asked for, not the size obtained (whole movie groups can fall a few short): config.json must
        # rebuild this very split (on resume, and for evaluate --baseline).
        config.val_size = default_val_size(len(train_set) + len(val_set))
        console.log(f"validation: {len(val_set)} of the {len(train_set) + len(val_set)} training reviews (10%, at "
                    f"most 2,500; --val-size sets another number)")
    resuming = run.open(config, model_config, args.overwrite, args.resume)

    def make_tokenizer():
        if config.init_from:
            return load_tokenizer(Path(config.init_from) / TOKENIZER)
        return train_tokenizer([normalize(t) for t in train_set.texts], config.vocab_size, config.tokenizer)

    tokenizer = run.tokenizer(resuming, make_tokenizer)
    model_config.vocab_size = tokenizer.get_vocab_size()
    if model_config.ngram_negation:
        model_config.ngram_negators = token_ids(tokenizer, NEGATORS)
        model_config.ngram_breaks = token_ids(tokenizer, CLAUSE_BREAKS)
    preprocess = Preprocessing(tokenizer, model_config.max_len, config.truncation)
    train_ids, val_ids = preprocess.ids(train_set.texts), preprocess.ids(val_set.texts)
    console.log(f"data: {len(train_ids)} train / {len(val_ids)} validation reviews from {config.data}, "
                f"vocabulary {model_config.vocab_size}, {time.monotonic() - t0:.1f}s")
    run.record(resuming, tokenizer, config, model_config, labels=list(LABEL_NAMES))

    model = Classifier(model_config).to(device)
    if config.init_from:  # on resume, last/ then replaces these weights
        load_pretrained_encoder(model, config.init_from)
    unlabelled_ids = (preprocess.ids(unlabelled_split(config.data, config.limit, config.seed).texts)
                      if config.pseudo_labels or (not resuming and model.ngram is not None and config.ngram_self_train)
                      else [])
    if resuming:  # the weights come from last/; the unlabelled reviews' labels from the run folder
        given = (distributed.on_main(lambda: saved_pseudo_labels(run, len(unlabelled_ids), model_config.num_classes))
                 if config.pseudo_labels and unlabelled_ids else np.zeros((0, model_config.num_classes)))
    else:  # Stage 1: rank 0 alone; DDP gives every rank its weights when fit() wraps the model
        given = distributed.on_main(lambda: prepare(run, model, config, (train_ids, train_set.labels),
                                                    (val_ids, val_set.labels), unlabelled_ids, console))
    # Stage 2: the transformer (the mix is (1, 0) until stage 3, so training and validation see it alone).
    if len(given):
        console.log(f"training on {len(train_ids)} labelled + {len(given)} pseudo-labelled reviews"
                    + (" (the teacher's probabilities as targets)" if config.soft_labels else ""))
    task = ClassificationTask(model, train_ids + unlabelled_ids[: len(given)],
                              training_targets(train_set.labels, given, config.soft_labels),
                              val_ids, val_set.labels, config, device, dtype)
    result = fit(task, config, run, device, dtype, resuming=resuming, quiet=args.quiet)
    if result.interrupted:
        return 130
    if distributed.is_main():  # rank 0's model alone from here
        # Stage 3: the two branches' weights, chosen on validation; then one evaluation on the test split.
        mix = (fit_branch_mix(run, model, val_ids, val_set.labels, device, dtype, config.batch_size, console)
               if model.ngram is not None else None)
        test_metrics = (None if args.no_test else
                        evaluate_test(run, config, model, tokenizer, device, dtype, console, mix))
        rows = [("best validation accuracy" + (" (transformer alone)" if mix else ""), f"{result.state['best']:.4f}")]
        if mix and "val_accuracy" in mix:
            rows.append(("validation accuracy, mixed", f"{mix['val_accuracy']['mixed']:.4f}  (mix {mix['mix']})"))
        if test_metrics:
            rows += [("test accuracy", f"{test_metrics['accuracy']:.4f}  ({test_metrics['examples']} reviews)"),
                     ("test loss", f"{test_metrics['loss']:.4f}")]
            if "components" in test_metrics:
                rows.append(("test accuracy, transformer / n-grams alone",
                             "{transformer:.4f} / {ngram:.4f}".format(**test_metrics["components"])))
        result.print_summary(console, "classify.train", run, rows)
    return 0


def evaluate_test(run: RunFolder, config: TrainConfig, model: Classifier, tokenizer, device, dtype,
                  console: Console, mix: dict | None) -> dict | None:
    """Test metrics of the best weights (``test_metrics.json``); with the n-gram branch, also each
    branch's accuracy alone and the mix chosen on validation."""
    if not (run.path / WEIGHTS).exists():
        return None
    if not provides_split(config.data, "test"):
        console.log(f"no test evaluation: {config.data} has no separate test split")
        return None
    try:
        test = load_split(config.data, "test")
    except ClassifyError as err:
        console.log(f"no test evaluation: {err}")
        return None
    load_model_weights(model, run.path / WEIGHTS)
    ids = Preprocessing(tokenizer, model.config.max_len, config.truncation).ids(test.texts)
    t0 = time.monotonic()
    parts = batched_branches(TorchBackend(model, device, dtype), ids, config.batch_size * 2)
    logits = mixed_logits(model.mix.double().cpu().numpy(), *parts) if parts.ngram is not None else parts.transformer
    if mix is not None:
        components = {"transformer": accuracy(parts.transformer, test.labels), "ngram": accuracy(parts.ngram, test.labels)}
    loss, correct, count = metric_sums(softmax(logits), test.labels)
    metrics: dict = {"loss": loss / count, "accuracy": correct / count}
    if mix is not None:
        metrics.update({"components": components, **mix})
    metrics.update({"split": "test", "examples": len(ids), "seconds": round(time.monotonic() - t0, 1)})
    run.write_test_metrics(metrics)
    return metrics


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="classify.train"))
