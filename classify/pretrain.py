"""python -m classify.pretrain: masked-language-model pretraining on IMDB's own text.

    python -m classify.pretrain --data ../shared/imdb --output runs/pretrain --time-budget 50
    python -m classify.train --init-from runs/pretrain --data ../shared/imdb --output runs/finetune

Pretrains the classifier's embedding + encoder (``classify.mlm.MaskedLM``) on the unlabelled
reviews plus the training reviews, never the test split, and never the reviews the classifier
will validate on (the same ``--val-size``/``--seed`` split ``classify.train`` carves), so
fine-tuning's validation accuracy stays an honest held-out estimate. A held-out slice of the
unlabelled reviews gives the validation MLM loss.

The run folder follows ``classify.engine.runfolder`` (kind ``"pretrain"``): config.json, tokenizer.json
(trained on the pretraining text), model.safetensors (best validation MLM loss), last/ (resume
state), metrics.jsonl. Re-running into the same ``--output`` resumes; Ctrl-C saves and exits.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import MISSING, dataclass
from functools import partial
from typing import ClassVar

import numpy as np
import torch
from rich.console import Console

from .engine.config import (HelpFormatter, ReviewRunConfig, add_flags, add_run_folder_args, from_args,
                             open_fraction, positive, setting)
from .engine.device import autocast, to_device
from .engine.loop import Task, fit, run_trainer
from .engine.runfolder import RunFolder
from .errors import ClassifyError, run_cli
from .mlm import MaskedLM, Masker, mlm_loss
from .models import ClassifierConfig
from .text.batching import BucketBatchSampler, Collate, pad_batch, pad_multiple
from .text.data import default_source, normalize, training_split, unlabelled_split
from .text.tokenize import encode, train_tokenizer

KIND = "pretrain"


@dataclass(kw_only=True)
class PretrainConfig(ReviewRunConfig):
    """Everything that defines a pretraining run except the model (config.json's "train")."""

    data: str = ReviewRunConfig.redefault("data", MISSING, "hub id or folder with train (and ideally unsupervised) "
                                                           "splits; a source without an unsupervised split "
                                                           "pretrains on its train texts only")
    epochs: int = ReviewRunConfig.redefault("epochs", 1, "passes over the pretraining text")
    warmup: int = ReviewRunConfig.redefault("warmup", 100)
    weight_decay: float = ReviewRunConfig.redefault("weight_decay", 0.01)
    save_every: int = ReviewRunConfig.redefault("save_every", 100)
    eval_every: int | None = ReviewRunConfig.redefault("eval_every", 250, "validation MLM loss every N steps")
    val_size: int = ReviewRunConfig.redefault("val_size", 2500, "the classifier's validation split (same as "
                                                                "classify.train --val-size, with --seed): these "
                                                                "reviews are left out of pretraining so fine-tuning "
                                                                "validation stays unseen")
    seed: int = ReviewRunConfig.redefault("seed", 0, "random seed; also picks the classifier's validation split "
                                                     "that is left out")
    max_tokens: int = setting(4096, "padded tokens per batch (length-bucketed)", check=positive)
    mask_prob: float = setting(0.15, "share of tokens to predict (of which 80%% become [MASK], 10%% a random token, "
                                     "10%% stay)", check=open_fraction)
    mlm_val_size: int = setting(500, "unlabelled reviews held out to measure the validation MLM loss",
                                check=positive)

    IDENTITY: ClassVar[tuple[str, ...]] = (*ReviewRunConfig.IDENTITY, "mask_prob", "mlm_val_size")

    def validate(self, model: ClassifierConfig) -> None:
        super().validate(model)
        if self.max_tokens < model.max_len:
            raise ClassifyError(f"--max-tokens {self.max_tokens} cannot hold one review of --max-len {model.max_len}")


MODEL_FLAGS = ("d_model", "num_heads", "num_layers", "d_ff", "max_len", "dropout", "positional", "norm_first",
               "mask_padding")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m classify.pretrain",
        description="Masked-language-model pretraining of the classifier's encoder on unlabelled IMDB text "
                    "(unsupervised + train splits; never test). Fine-tune the result with "
                    "`python -m classify.train --init-from OUTPUT`. Each flag is a setting that config.json "
                    "stores under the flag's name (--num-heads: num_heads).",
        formatter_class=HelpFormatter,
    )
    add_flags(p.add_argument_group("data"), PretrainConfig,
              ["data", "val_size", "mlm_val_size", "limit", "vocab_size", "tokenizer", "truncation"],
              defaults={"data": default_source()})
    add_flags(p.add_argument_group("model (fine-tuning inherits these)"), ClassifierConfig, MODEL_FLAGS)
    add_flags(p.add_argument_group("optimisation"), PretrainConfig,
              ["mask_prob", "epochs", "max_steps", "time_budget", "lr", "warmup", "schedule", "weight_decay", "clip",
               "average_from", "max_tokens", "grad_accum", "eval_every", "patience"])
    g = p.add_argument_group("run")
    add_flags(g, PretrainConfig, ["seed", "device", "precision", "threads", "save_every", "num_workers"])
    add_run_folder_args(g)
    return p


def configs_from_args(args: argparse.Namespace) -> tuple[ClassifierConfig, PretrainConfig]:
    """The encoder's config and the run's, from the flags; checked."""
    config = from_args(PretrainConfig, args)
    model = from_args(ClassifierConfig, args, vocab_size=config.vocab_size)
    config.validate(model)
    return model, config


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
    unlabelled = unlabelled_split(source).texts
    if unlabelled:
        what = f"{len(unlabelled)} unsupervised + {len(train_texts)} train reviews"
    else:  # e.g. a single CSV file: pretrain on its texts, hold out some of them
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


# ------------------------------------------------------------------------- the task
class MaskedLMTask(Task):
    """Predict masked tokens (fresh masks every batch); the validation MLM loss picks the best weights."""

    def __init__(self, model: MaskedLM, train_ids: list[np.ndarray], val_ids: list[np.ndarray], masker: Masker,
                 config: PretrainConfig, device: torch.device, dtype: torch.dtype | None):
        self.model, self.masker = model, masker
        self.lengths = [len(x) for x in train_ids]
        self.max_tokens = config.max_tokens
        self.collate = Collate(train_ids, pad_id=model.config.pad_id, max_len=model.config.max_len,
                               multiple=pad_multiple(device, dtype))
        val_sampler = BucketBatchSampler([len(x) for x in val_ids], max_tokens=config.max_tokens, shuffle=False)
        self.val_batches = [pad_batch([val_ids[i] for i in b], model.config.pad_id) for b in val_sampler]
        self.seed, self.device, self.dtype = config.seed, device, dtype

    def loss(self, model, batch):
        tokens = batch["tokens"]  # (B, T), on the device
        # Dynamic masking on the CPU, drawn from torch's (resumable) CPU RNG: the same masks on every device.
        inputs, targets = self.masker(tokens.cpu())
        logits, labels = model(to_device(inputs, self.device), to_device(targets, self.device))  # (N, V), (N,)
        loss = mlm_loss(logits, labels)
        n = len(labels)
        return loss, {"loss": float(loss.detach()) * n, "correct": float((logits.detach().argmax(-1) == labels).sum()),
                      "targets": n, "tokens": float((tokens != self.model.config.pad_id).sum())}

    def train_metrics(self, sums):
        n = sums["targets"]
        return {"train_loss": sums["loss"] / n if n else None, "train_accuracy": sums["correct"] / n if n else None}

    def validate(self, model):
        metrics = evaluate_mlm(model, self.val_batches, self.masker, self.device, self.dtype, self.seed)
        return {"val_loss": metrics["loss"], "val_accuracy": metrics["accuracy"]}

    def score(self, metrics):
        return -metrics["val_loss"]


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


# ---------------------------------------------------------------------- the command
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model_config, config = configs_from_args(args)
    return run_trainer(KIND, config, args, partial(pretrain, args, model_config, config))


def pretrain(args: argparse.Namespace, model_config: ClassifierConfig, config: PretrainConfig, run: RunFolder,
             device: torch.device, dtype: torch.dtype | None, console: Console) -> int:
    """The pretraining run of ``main``; under torchrun every rank runs it. Returns the exit code."""
    resuming = run.open(config, model_config, args.overwrite, args.resume)

    # ---- data: load, tokenize once (int32 arrays)
    t0 = time.monotonic()
    train_texts, val_texts, what = pretraining_texts(config.data, config.val_size, config.mlm_val_size,
                                                     config.seed, config.limit)
    tokenizer = run.tokenizer(resuming, partial(train_tokenizer, train_texts, config.vocab_size, config.tokenizer))
    model_config.vocab_size = tokenizer.get_vocab_size()
    train_ids = encode_compact(tokenizer, train_texts, model_config.max_len, config.truncation)
    val_ids = encode_compact(tokenizer, val_texts, model_config.max_len, config.truncation)
    del train_texts, val_texts
    console.log(f"data: {what}; vocabulary {model_config.vocab_size}, "
                f"{sum(map(len, train_ids)) / 1e6:.1f}M training tokens, {time.monotonic() - t0:.1f}s")
    run.record(resuming, tokenizer, config, model_config)

    model = MaskedLM(model_config).to(device)
    task = MaskedLMTask(model, train_ids, val_ids, Masker(tokenizer, config.mask_prob), config, device, dtype)
    # The untrained model's loss (about ln V) starts the validation curve.
    result = fit(task, config, run, device, dtype, resuming=resuming, quiet=args.quiet, validate_first=True)
    if result.interrupted:
        return 130
    result.print_summary(console, "classify.pretrain", run, [
        ("best validation MLM loss", f"{-result.state['best']:.4f}"),
        ("fine-tune with", f"python -m classify.train --init-from {run.path} --output ...")])
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="classify.pretrain"))
