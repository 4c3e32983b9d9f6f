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
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console

from .backends import TorchBackend, batched_branches, batched_transformer, padded_batches
from .command_budget import AfterTraining, forward_rate, training_minutes
from .engine.config import HelpFormatter, add_flags, add_run_folder_args, from_args
from .engine import distributed
from .engine.background import Background
from .engine.device import peak_memory
from .engine.files import load_model_weights
from .engine.loop import Task, fit, run_trainer
from .engine.runfolder import TOKENIZER, WEIGHTS, RunFolder, read_config
from .errors import ClassifyError, run_cli
from .finetune import adopt_pretrained, layer_lr_scale, load_pretrained_encoder
from .inference import KIND, softmax
from .mix import fit_mix, mixed_logits
from .models import RECIPE, Classifier, ClassifierConfig, ngram_branch
from .ngrams import NgramBag, bag_logits, describe, self_train_ngram_bag
from .text.batching import Collate, pad_multiple
from .text.data import (LABEL_NAMES, Examples, default_source, default_val_size, load_split, normalize,
                        provides_split, training_split, unlabelled_split)
from .text.prepare import Preprocessing, TokenIds
from .text.tokenize import CLAUSE_BREAKS, NEGATORS, load_tokenizer, token_ids, train_tokenizer
from .text.windows import AUXILIARIES, CONTRACTED, SENTENCE_ENDS, Elision, closing_sentences
from .text.swaps import antonyms, log_count_ratios, swapped_reviews
from .text.word_vectors import SCALE, word_vectors
from .train_config import TrainConfig
from .training_texts import (EDIT, LabelledTexts, TransformerExamples, ngram_kinds, ngram_weights, teacher_reads,
                             training_parts)

MODEL_FLAGS = ("d_model", "num_heads", "num_layers", "d_ff", "dropout", "attention_dropout", "pooling", "positional",
               "norm_first", "mask_padding", "ngram_orders", "ngram_buckets", "ngram_skip_bigrams", "ngram_head",
               "ngram_tail", "ngram_negation", "ngram_ellipsis", "scope_embedding", "scope_dropout")


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
    add_flags(g, TrainConfig, ["data", "limit", "val_size", "split", "vocab_size", "tokenizer", "truncation",
                               "train_max_len", "spelling", "counterfactual", "counterfactual_passages",
                               "counterfactual_passage_weight", "counterfactual_passage_repeat",
                               "teacher_passages", "counterfactual_repeat", "counterfactual_pair_weight",
                               "short_texts", "closing_passages", "elided_negation_repeat", "elided_negation_balance",
                               "negation_edits", "negators", "negation_edit_weight", "teacher_edit_weight",
                               "negation_edit_repeat", "negation_edit_pair_weight", "contrast_joins",
                               "contrast_join_repeat", "swapped_reviews"],
              defaults={"data": default_source()})
    add_flags(g, ClassifierConfig, ["max_len"])
    g = p.add_argument_group("model")
    # The flags build the shipped model by default; the scope's two are resolved from the others
    # (``resolve_recipe_scope``).
    add_flags(g, ClassifierConfig, MODEL_FLAGS, defaults={**RECIPE, "scope_embedding": None, "scope_dropout": None})
    add_flags(g, TrainConfig, ["ngram_c", "ngram_min_count", "teacher_min_count", "ngram_self_train", "ngram_refit",
                               "pseudo_labels", "soft_labels", "pseudo_label_weight", "self_label_share",
                               "word_vectors", "word_polarity"])
    add_flags(p.add_argument_group("optimisation"), TrainConfig,
              ["epochs", "max_steps", "time_budget", "finish_within", "lr", "warmup", "schedule", "weight_decay",
               "clip", "average_from", "batch_size", "batching", "max_tokens", "grad_accum", "label_smoothing",
               "eval_every", "patience"])
    add_flags(p.add_argument_group("fine-tuning (see classify.pretrain)"), TrainConfig, ["init_from", "layer_decay"])
    g = p.add_argument_group("run")
    add_flags(g, TrainConfig, ["seed", "device", "precision", "threads", "save_every", "num_workers"])
    add_run_folder_args(g)
    g.add_argument("--no-test", action="store_true", help="skip the final evaluation on the test split")
    return p


def resolve_recipe_scope(model: ClassifierConfig) -> None:
    """--scope-embedding and --scope-dropout as given, or where left unsaid (None) the recipe's: the transformer reads
    the n-gram branch's negation scope (``RECIPE``) when the model has a branch that marks one, and nothing without
    (--ngram-orders 0, or neither --ngram-negation nor --ngram-ellipsis): an ablation needs no third flag."""
    if model.scope_embedding is None:
        model.scope_embedding = RECIPE["scope_embedding"] and model.marks_negation
    if model.scope_dropout is None:
        model.scope_dropout = RECIPE["scope_dropout"] if model.scope_embedding else 0.0


def configs_from_args(args: argparse.Namespace) -> tuple[ClassifierConfig, TrainConfig]:
    """The model's config and the run's, from the flags; checked. (The negation scope's token ids are filled in
    once the tokenizer exists: ``negation_tokens``.)"""
    config = from_args(TrainConfig, args)
    model = from_args(ClassifierConfig, args, vocab_size=config.vocab_size, num_classes=len(LABEL_NAMES),
                      ngram_negators=[], ngram_breaks=[], ngram_auxiliaries=[])
    resolve_recipe_scope(model)
    if config.train_max_len is not None and config.train_max_len >= model.max_len:
        config.train_max_len = None   # cuts nothing: recorded as no cut, as runs from before the flag read
    config.validate(model)
    return model, config


# ------------------------------------------------------------------------- the task
@dataclass
class Validation:
    """What the checkpoint and the mix are chosen on, in groups (``GROUPS``): the validation reviews; with
    --short-texts, their closing sentences; with --negation-edits and --contrast-joins, the rule-made texts cut
    from them (``text.edits``). For a model with an n-gram branch, also that branch's logits for all of them from
    its fit on the training part alone (saved in the run folder at stage 1, so they stay held out when the kept
    branch is fitted again on all labelled reviews)."""

    # The infix of each group's score (val_short_accuracy), and what the group holds.
    GROUPS: ClassVar[tuple[str, ...]] = ("", "short", "edit", "join")
    HOLDS: ClassVar[tuple[str, ...]] = ("reviews", "closing sentences", "negation edits and sentences",
                                        "contrast joins")

    ids: list[TokenIds]
    labels: list[int]
    group: np.ndarray                 # (N,) index into GROUPS
    ngram: np.ndarray | None = None   # (N, C) held-out n-gram logits

    @classmethod
    def build(cls, ids: list[TokenIds], labels: list[int], ends: set[int] | None,
              rule_made: dict[str, tuple[list[TokenIds], list[int]]] | None = None) -> "Validation":
        """Whole reviews, then their closing sentences when ``ends`` (the sentence-end token ids) is given, then
        ``rule_made`` texts by group name ("edit", "join"): (ids, labels)."""
        shorts = closing_sentences(ids, ends) if ends is not None else []
        ids, labels, group = ids + shorts, labels + labels[: len(shorts)], [0] * len(ids) + [1] * len(shorts)
        for name, (more_ids, more_labels) in (rule_made or {}).items():
            ids, labels, group = ids + more_ids, labels + more_labels, group + [cls.GROUPS.index(name)] * len(more_ids)
        return cls(ids, labels, np.array(group, dtype=np.int64))

    @staticmethod
    def key(system: str, group: str) -> str:
        """The metric of a system ("" for the transformer, "ngram", "mixed") on a group: val_mixed_short_accuracy."""
        return "_".join(p for p in ("val", system, group, "accuracy") if p)

    def describe(self) -> str:
        """How many texts each group holds: "2484 reviews, 2484 closing sentences, ..."."""
        return ", ".join(f"{int((self.group == g).sum())} {holds}" for g, holds in enumerate(self.HOLDS))

    @property
    def short(self) -> np.ndarray:
        """(N,) bool: a short text (a closing sentence or a rule-made text), not a whole review."""
        return self.group > 0

    def lengths(self) -> np.ndarray:
        return np.array([max(1, len(x)) for x in self.ids])

    def scores(self, transformer: np.ndarray) -> tuple[dict[str, float], np.ndarray | None]:
        """Accuracies per group of the transformer alone and, with held-out n-gram logits, of the branch and of
        the mix fitted on this validation set, and the mix (2, 2) or None."""
        y = np.asarray(self.labels)
        systems = {"": transformer}
        mix = None
        if self.ngram is not None:
            mix = fit_mix(transformer, self.ngram, self.lengths(), y)
            systems.update(ngram=self.ngram, mixed=mixed_logits(mix, transformer, self.ngram, self.lengths()))
        out = {}
        for system, logits in systems.items():
            for g, group in enumerate(self.GROUPS):
                rows = self.group == g
                if rows.any() or g == 0:
                    out[self.key(system, group)] = float((logits[rows].argmax(1) == y[rows]).mean()) if rows.any() else None
        return out, mix


class ClassificationTask(Task):
    """Reviews -> labels by cross-entropy; what ships (the mix, with an n-gram branch), on whole reviews and short
    texts alike, picks the best weights.

    ``partner`` (paired training, --counterfactual-pair-weight, --negation-edit-pair-weight): the first
    ``len(partner)`` texts are the examples the sampler serves; text i's partner, a text after them with the
    opposite label, or -1. A pair is served as one example of its longer text's length, both texts in the same
    batch, and adds ``pair_weight[i]`` x ``pair_loss`` to the batch's loss."""

    def __init__(self, model: Classifier, train_ids: list[TokenIds], train_labels: list[int] | np.ndarray,
                 validation: Validation, config: TrainConfig, device: torch.device, dtype: torch.dtype | None,
                 partner: np.ndarray | None = None, pair_weight: np.ndarray | None = None):
        fixed = config.batching == "fixed"  # the naive pipeline: random batches padded to max_len
        self.model = model
        served = len(train_ids) if partner is None else len(partner)
        self.lengths = [len(train_ids[i]) if partner is None or partner[i] < 0 else
                        max(len(train_ids[i]), len(train_ids[partner[i]])) for i in range(served)]
        self.batch_size, self.max_tokens = config.batch_size, config.max_tokens
        self.pool_batches = 1 if fixed else 50  # a pool of one batch sorts nothing that matters
        self.collate = Collate(train_ids, train_labels, model.config.pad_id, model.config.max_len if fixed else None,
                               model.config.max_len, partner, pair_weight, pad_multiple(device, dtype))
        self.lr_scale = layer_lr_scale(model.config.num_layers, config.layer_decay) if config.layer_decay else None
        self.label_smoothing = config.label_smoothing
        self.pseudo_label_weight, self.self_label_share = config.pseudo_label_weight, config.self_label_share
        self.validation, self.device, self.dtype = validation, device, dtype
        # The transformer's validation logits (N, C) of the last validation, and of the weights in
        # model.safetensors if they were validated in this sitting (not before a resume): the mix is fitted on
        # them after training, without another pass over validation.
        self.latest_logits: np.ndarray | None = None
        self.best_logits: np.ndarray | None = None

    def loss(self, model, batch):
        logits = model(batch["tokens"], ngram=False)  # (B, C): the transformer alone until the mix is chosen
        labels = batch["labels"]  # (B,) classes, or (B, C) target distributions (soft labels)
        n = len(labels)
        if labels.dim() == 2 and (self.pseudo_label_weight != 1 or self.self_label_share):
            loss = self.teacher_weighted_loss(logits.float(), labels)
        else:
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=self.label_smoothing)
        classes = labels if labels.dim() == 1 else labels.argmax(-1)
        sums = {"loss": float(loss.detach()) * n, "correct": float((logits.argmax(-1) == classes).sum()),
                "examples": n, "tokens": float((batch["tokens"] != self.model.config.pad_id).sum())}
        if "pairs" in batch:   # summed, over the batch's texts: at weight 1 a pair's margin counts as one text does
            pairs = pair_loss(logits.float(), classes, batch["pairs"])
            loss = loss + (batch["pair_weights"] * pairs).sum() / n
            sums.update(pair_loss=float(pairs.detach().sum()), pairs=len(pairs))
        return loss, sums

    def teacher_weighted_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of logits (B, C) against target distributions (B, C), the teacher's texts reweighted and
        moved towards the transformer's own class. A teacher's distribution is never certain (``training_targets``),
        a given label always is (one-hot), so the rows whose target's top probability is under 1 are the teacher's."""
        taught = targets.amax(-1) < 1                                    # (B,)
        if self.self_label_share:
            own = F.one_hot(logits.detach().argmax(-1), targets.shape[-1]).to(targets.dtype)
            moved = (1 - self.self_label_share) * targets + self.self_label_share * own
            targets = torch.where(taught[:, None], moved, targets)
        weights = torch.where(taught, self.pseudo_label_weight, 1.0)    # (B,)
        losses = F.cross_entropy(logits, targets, label_smoothing=self.label_smoothing, reduction="none")
        return (weights * losses).sum() / len(targets)

    def train_metrics(self, sums):
        n, pairs = sums["examples"], sums.get("pairs")
        return {"train_loss": sums["loss"] / n if n else None, "train_accuracy": sums["correct"] / n if n else None,
                **({"train_pair_loss": sums["pair_loss"] / pairs if pairs else None} if "pairs" in sums else {})}

    def validate(self, model):
        v = self.validation
        logits = self.latest_logits = transformer_logits(model, v.ids, self.device, self.dtype, self.batch_size * 2)
        loss = metric_sums(softmax(logits[~v.short]), np.asarray(v.labels)[~v.short])
        metrics, _ = v.scores(logits)
        return {"val_loss": loss[0] / loss[2], **metrics}

    def keep_best(self):
        self.best_logits = self.latest_logits

    def score(self, metrics):
        """Higher is better: what ships (the mix, with a branch), averaged over the validation groups."""
        system = "mixed" if self.validation.ngram is not None else ""
        values = [metrics.get(Validation.key(system, group)) for group in Validation.GROUPS]
        values = [v for v in values if v is not None]
        return sum(values) / len(values)


def pair_loss(logits: torch.Tensor, classes: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """The margin of each pair: logits (B, C), classes (B,), pairs (P, 2) rows (a, b) of two texts with different
    classes -> (P,) softplus(-d), d = (z_a[y_a] - z_a[y_b]) - (z_b[y_a] - z_b[y_b]): how much more text a leans to
    its own class than text b does. What the two texts share adds the same to both sides and cancels, so the
    gradient reaches the words that differ (an edited review against the review it was edited from), where
    each text's own cross-entropy also pulls on what they share."""
    a, b = pairs.unbind(-1)
    both = torch.stack([classes[a], classes[b]], 1)                  # (P, 2): y_a, y_b
    lean_a, lean_b = logits[a].gather(1, both), logits[b].gather(1, both)  # (P, 2): z[y_a], z[y_b] of each text
    return F.softplus(-((lean_a[:, 0] - lean_a[:, 1]) - (lean_b[:, 0] - lean_b[:, 1])))


def transformer_logits(model: Classifier, ids: list[TokenIds], device, dtype, batch_size: int,
                       shard: bool = True) -> np.ndarray:
    """The transformer branch's logits (N, C) for pre-tokenized texts. ``shard``: called on every rank, each
    scores its share and the shares are added up (a text's row is zero on the ranks that did not score it), so
    every rank gets all N rows; otherwise this process scores them all."""
    shard = shard and distributed.world_size() > 1
    mine = list(range(distributed.rank(), len(ids), distributed.world_size())) if shard else list(range(len(ids)))
    logits = np.zeros((len(ids), model.config.num_classes), dtype=np.float32)
    if mine:
        logits[mine] = batched_transformer(TorchBackend(model, device, dtype), [ids[i] for i in mine], batch_size)
    if shard:
        logits = np.asarray(distributed.all_sum(logits.ravel().tolist()), dtype=np.float32).reshape(logits.shape)
    return logits


def metric_sums(probs: np.ndarray, labels: list[int]) -> list[float]:
    """probs (N, C) -> [summed cross-entropy, correct predictions, N]."""
    y = np.asarray(labels, dtype=np.int64)
    return [float(-np.log(np.clip(probs[np.arange(len(y)), y], 1e-12, None)).sum()),
            float((probs.argmax(1) == y).sum()), len(y)]


def accuracy(logits: np.ndarray, labels: list[int]) -> float:
    return float((logits.argmax(-1) == np.asarray(labels)).mean())


def score_name(key: str) -> str:
    """A validation score's name in test_metrics.json: "val_accuracy" -> "transformer", "val_short_accuracy" ->
    "transformer_short", "val_mixed_short_accuracy" -> "mixed_short"."""
    parts = [p for p in key.removeprefix("val_").removesuffix("accuracy").split("_") if p]
    return "_".join(parts if parts and parts[0] not in Validation.GROUPS else ["transformer", *parts])


# ------------------------------------------------------------------------ the stages
def choose_mix(run: RunFolder, model: Classifier, validation: Validation, device, dtype, batch_size: int,
               console: Console, logits: np.ndarray | None = None) -> dict | None:
    """Stage 3 of a run with the n-gram branch: on the best weights, fit the mix of the transformer and the branch
    (``classify.mix``) on validation, whole reviews and short texts, and store it in ``model.safetensors``.
    ``logits``: the transformer's validation logits (N, C) of those weights where training kept them
    (``ClassificationTask.best_logits``); otherwise computed here."""
    if not (run.path / WEIGHTS).exists():
        return None
    load_model_weights(model, run.path / WEIGHTS)
    record: dict = {}
    if validation.ids:
        if logits is None:
            logits = transformer_logits(model, validation.ids, device, dtype, batch_size * 2, shard=False)  # rank 0
        scores, mix = validation.scores(logits)
        record["val_accuracy"] = {score_name(k): v for k, v in scores.items()}
    else:  # nothing to choose on: the two at equal weight
        mix = np.array([[1.0, 0.0], [1.0, 0.0]])
    model.mix.copy_(torch.as_tensor(mix, dtype=model.mix.dtype))
    run.save_best(model)
    record["mix"] = np.round(mix, 4).tolist()
    console.log(f"mix of transformer and n-gram logits chosen on validation (per branch: constant, slope per "
                f"log-token): {record['mix']}"
                + (f", validation accuracy {record['val_accuracy']}" if validation.ids else " (no validation: equal)"))
    return record


def fit_ngram_stage(run: RunFolder, model: Classifier, config: TrainConfig,
                    train: tuple[list[TokenIds], list[int], np.ndarray], val: tuple[list[TokenIds], list[int]],
                    validation: Validation, unlabelled_ids: list[TokenIds],
                    console: Console) -> tuple[np.ndarray, np.ndarray | None]:
    """Stage 1 of a fresh run, before the transformer trains. ``train``: (ids, labels, (N,) each text's kind,
    ``training_texts.REVIEW``, ...: how much it counts in each fit, ``training_texts.ngram_weights``).

    - For --pseudo-labels, the teacher: the n-gram model fitted on ``train`` (with --no-teacher-passages less the
      edited passages) labels the unlabelled reviews (kept in the run folder). It is the branch's own fit when the
      two fits' settings are equal (edit weight, min count, the passages); otherwise a fit of its own, in a bag of its own (the model's branch's n-grams, or the recipe's
      without a branch, --ngram-orders 0), then dropped. With two threads or more that fit runs on a second
      thread beside the branch's (``engine.background``): liblinear and torch's kernels release the GIL, so on
      two cores the stage takes about the teacher's time instead of the sum (each fit's result is as alone).
    - The branch: fitted on ``train`` (with --ngram-self-train self-trained on the unlabelled reviews), its logits
      for ``validation`` kept (held out: the mix and the checkpoint are chosen on them); with --ngram-refit,
      fitted again on ``train`` and ``val`` (the whole validation reviews) together, for the model it keeps.

    Returns the teacher's class probabilities for the unlabelled reviews, (N, C) (N = 0 without pseudo-labels),
    and with --word-polarity each word's weight in the first of these fits, (V,), else None."""
    (train_ids, train_labels, kinds), (val_ids, val_labels) = train, val
    towards_positive = torch.tensor([-1.0, 1.0])
    teach = config.pseudo_labels and bool(unlabelled_ids)
    read = teacher_reads(kinds, config)   # (N,) the texts the teacher's fit reads
    own_teacher = teach and (model.ngram is None or config.teacher_min_count != config.ngram_min_count
                             or (config.teacher_edit_weight != config.negation_edit_weight
                                 and bool((kinds == EDIT).any())) or not read.all())

    def polarity_of(bag: NgramBag) -> np.ndarray | None:
        return bag.word_values(towards_positive).cpu().numpy() if config.word_polarity else None

    def fit_teacher() -> tuple[np.ndarray, np.ndarray | None]:
        t = time.monotonic()
        teacher = ngram_branch(model.config, model.config.ngram_orders or RECIPE["ngram_orders"])
        teacher = teacher.to(model.head.weight.device)
        labels = self_train_ngram_bag(teacher, [x for x, r in zip(train_ids, read) if r],
                                      [y for y, r in zip(train_labels, read) if r], unlabelled_ids, config.ngram_c,
                                      False, ngram_weights(kinds, config, teacher=True)[read],
                                      config.teacher_min_count)
        console.log(f"n-gram teacher (negation edits weighted {config.teacher_edit_weight}, min count "
                    f"{config.teacher_min_count}" + ("" if read.all() else ", without the edited passages")
                    + f") fitted on {read.sum()} texts in {time.monotonic() - t:.0f}s; it labels "
                    f"{(labels.argmax(1) == 1).mean():.0%} of the unlabelled reviews {LABEL_NAMES[1]}; peak memory "
                    f"{peak_memory()}")
        return labels, polarity_of(teacher)

    def fit_branch(bag: NgramBag) -> tuple[np.ndarray, np.ndarray | None]:
        t = time.monotonic()
        self_train, branch_teaches = config.ngram_self_train, teach and not own_teacher
        weights = ngram_weights(kinds, config)
        labelled_by_fit = self_train_ngram_bag(bag, train_ids, train_labels,
                                               unlabelled_ids if self_train or branch_teaches else [],
                                               config.ngram_c, self_train, weights, config.ngram_min_count)
        polarity = None if own_teacher else polarity_of(bag)   # the first fit's: the refit below replaces it
        console.log(f"n-gram branch ({describe(bag.kinds, bag.negation, bag.ellipsis)}; {bag.buckets:,} slots; "
                    f"negation edits weighted {config.negation_edit_weight})"
                    + (f" self-trained on {len(unlabelled_ids)} unlabelled reviews" if self_train else "")
                    + f" fitted on {len(train_ids)} reviews in {time.monotonic() - t:.0f}s"
                    + (f"; it labels {(labelled_by_fit.argmax(1) == 1).mean():.0%} of the unlabelled reviews "
                       f"{LABEL_NAMES[1]}" if branch_teaches else "") + f"; peak memory {peak_memory()}")
        if validation.ids:
            validation.ngram = bag_logits(bag, validation.ids).numpy()
            run.save_branch_validation(validation.ngram)
            if config.ngram_refit:
                t = time.monotonic()
                self_train_ngram_bag(bag, train_ids + val_ids, train_labels + val_labels,
                                     unlabelled_ids if self_train else [], config.ngram_c, self_train,
                                     np.concatenate([weights, np.ones(len(val_ids))]), config.ngram_min_count)
                console.log(f"n-gram branch fitted again on all {len(train_ids) + len(val_ids)} labelled reviews in "
                            f"{time.monotonic() - t:.0f}s (validation keeps the first fit's logits); peak memory "
                            f"{peak_memory()}")
        return (labelled_by_fit if branch_teaches else labelled_by_fit[:0]), polarity

    given = np.zeros((0, model.config.num_classes), dtype=np.float32)
    polarity = None
    # Beside the branch only with two threads or more: on one core a second thread would share it, and hold both
    # fits' memory at once for nothing (IMDB's stage 1 peaks at 3.7 GB so, 2.4 GB one fit after the other).
    teaching = (Background(fit_teacher, "n-gram-teacher") if own_teacher and torch.get_num_threads() > 1
                else None)
    if model.ngram is not None:
        given, polarity = fit_branch(model.ngram)
    if own_teacher:
        given, polarity = teaching.result() if teaching is not None else fit_teacher()
    if not (teach and len(given)):
        return given[:0], polarity
    run.save_pseudo_labels(given, "n-gram teacher" if own_teacher else "n-gram branch, first fit")
    return given, polarity


def saved_pseudo_labels(run: RunFolder, count: int, num_classes: int) -> np.ndarray:
    """The pseudo-labels of the run being resumed, (N, C) probabilities, checked against the ``count``
    unlabelled reviews read now."""
    labels = run.pseudo_labels(num_classes)
    if labels is None or len(labels) != count:
        raise ClassifyError(f"{run.path} cannot resume with pseudo-labels: it holds labels for "
                            f"{'no' if labels is None else len(labels)} unlabelled reviews, the source has {count} "
                            f"(start afresh with --overwrite)")
    return labels


def start_from_word_vectors(model: Classifier, ids: list[TokenIds], seed: int, console: Console,
                            vectors: np.ndarray | None = None) -> None:
    """``--word-vectors``: the token embedding's rows start from word vectors counted from ``ids``
    (``text.word_vectors``; ``vectors``, when given, are those, counted already); a word those texts do not hold
    keeps its random start, and so does the padding row."""
    t0 = time.monotonic()
    weight = model.embed.tokens.weight
    counted = vectors is None
    vectors = torch.from_numpy(word_vectors(ids, weight.shape[0], weight.shape[1], seed) if counted else vectors)
    known = vectors.abs().sum(dim=1) > 0
    known[model.config.pad_id] = False
    with torch.no_grad():
        weight[known] = vectors[known].to(weight.device, weight.dtype)
    console.log(f"token embedding: {int(known.sum())} of {len(known)} rows start from word vectors of "
                f"{len(ids)} texts" + (f", {time.monotonic() - t0:.1f}s" if counted else " (counted for the swapped "
                                       "reviews)") + f"; peak memory {peak_memory()}")


def swaps_of(tokenizer, train_ids: list[TokenIds], labels: list[int], unlabelled_ids: list[TokenIds],
             config: ClassifierConfig, seed: int, console: Console) -> tuple[tuple[list[TokenIds], list[int]],
                                                                             np.ndarray]:
    """``--swapped-reviews``: the training reviews' swapped copies (``text.swaps``) and the word vectors (V, d_model)
    their partners were found in, counted from the training and unlabelled reviews as ``--word-vectors`` counts
    them (so the embedding starts from the same ones), among the tokens that are words."""
    t0 = time.monotonic()
    vectors = word_vectors(train_ids + unlabelled_ids, config.vocab_size, config.d_model, seed)
    ratio, docs = log_count_ratios(train_ids, labels, len(vectors))
    words = np.array([(tokenizer.id_to_token(i) or "").isalpha() for i in range(len(vectors))])
    partner = antonyms(vectors, ratio, docs, words)
    swapped = swapped_reviews(train_ids, labels, partner, ratio)
    commonest = [i for i in np.argsort(-docs) if partner[i] >= 0][:8]
    named = ", ".join(f"{tokenizer.id_to_token(int(i))} -> {tokenizer.id_to_token(int(partner[i]))}" for i in commonest)
    console.log(f"swapped reviews: {len(swapped[0])} of {len(train_ids)} training reviews, {int((partner >= 0).sum())} "
                f"words exchanged ({named}, ...), {time.monotonic() - t0:.1f}s")
    return swapped, vectors


# The polarity direction's entries: their root mean square over the words with a weight. Twice a word vector's
# entry (``text.word_vectors.SCALE``) and a learned position's: after the first LayerNorm a word of typical weight
# stands out of its row (~1.4 standard deviations) without drowning the rest of it.
POLARITY_SCALE = 2 * SCALE


def start_from_word_polarity(model: Classifier, polarity: np.ndarray | None, seed: int, console: Console) -> None:
    """``--word-polarity``: one direction ``u`` (a random unit vector of ``seed``) of the token embedding holds
    each word's weight towards the positive class in stage 1's first n-gram fit, ``polarity`` (V,), scaled to
    ``POLARITY_SCALE``; every row's own part along ``u`` gives way, the padding row stays. The blocks see a word's
    polarity from the first step, a rare word's too, which the transformer would otherwise meet in a few batches.
    The head is left as it starts: at the start the blocks add entries of ~0.5-0.8 to the residual stream, so the
    embedding's ~0.03 is drowned there and a head reading ``u`` would read nearly nothing of it."""
    if polarity is None:
        raise ClassifyError("--word-polarity: stage 1 fitted no n-gram model (no n-gram branch, and no unlabelled "
                            "reviews for the teacher)")
    weight = model.embed.tokens.weight
    u = torch.randn(weight.shape[1], generator=torch.Generator().manual_seed(seed))
    u = u / u.norm()
    p = torch.as_tensor(polarity, dtype=torch.float32).clone()
    p[model.config.pad_id] = 0.0
    weighted = p != 0
    if not weighted.any():
        raise ClassifyError("--word-polarity: the n-gram fit gave no word a weight (too few training texts for "
                            "--teacher-min-count / --ngram-min-count?)")
    p *= POLARITY_SCALE / p[weighted].square().mean().sqrt()
    rows = torch.ones(len(p), dtype=torch.bool)
    rows[model.config.pad_id] = False
    with torch.no_grad():
        start = weight.float().cpu()
        start[rows] += (p[rows] - start[rows] @ u)[:, None] * u[None]
        weight.copy_(start.to(weight.device, weight.dtype))
    console.log(f"token embedding: one direction holds the weights of {int(weighted.sum())} words in the first "
                f"n-gram fit")


# ---------------------------------------------------------------------- the command
def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()   # --finish-within counts from here
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.init_from:
        adopt_pretrained(args, parser, argv)  # model sizes, tokenizer and lr default from the pretraining run
    model_config, config = configs_from_args(args)
    return run_trainer(KIND, config, args, partial(train, args, model_config, config, started))


def train(args: argparse.Namespace, model_config: ClassifierConfig, config: TrainConfig, started: float,
          run: RunFolder, device: torch.device, dtype: torch.dtype | None, console: Console) -> int:
    """The training run of ``main`` (which started at ``started``, ``time.monotonic()``); under torchrun every rank
    runs it. Returns the exit code.

    Data, then three stages in order: (1) ``fit_ngram_stage``: the n-gram branch or teacher, the pseudo-labels;
    then the token embedding's start, ``start_from_word_vectors`` (the default; ``--no-word-vectors`` skips it);
    (2) ``fit``: the transformer, on ``TransformerExamples`` (the labelled, counterfactual, rule-made and
    pseudo-labelled texts and windows cut from the reviews), the checkpoint chosen on what ships;
    (3) ``choose_mix``; then one evaluation on the test split."""
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
    texts = LabelledTexts.of(config, train_set, val_set)
    resuming = run.open(config, model_config, args.overwrite, args.resume)
    if resuming and config.finish_within is not None:  # the training minutes its first start set
        config.time_budget = distributed.on_main(lambda: recorded_budget(run))

    def make_tokenizer():
        if config.init_from:
            return load_tokenizer(Path(config.init_from) / TOKENIZER)
        return train_tokenizer([normalize(t) for t in train_set.texts], config.vocab_size, config.tokenizer)

    tokenizer = run.tokenizer(resuming, make_tokenizer)
    model_config.vocab_size = tokenizer.get_vocab_size()
    if model_config.ngram_negation or model_config.ngram_ellipsis:
        model_config.ngram_negators = token_ids(tokenizer, NEGATORS)
        model_config.ngram_breaks = token_ids(tokenizer, CLAUSE_BREAKS)
    if model_config.ngram_ellipsis:
        model_config.ngram_auxiliaries = token_ids(tokenizer, AUXILIARIES + CONTRACTED)
    encode = Preprocessing(tokenizer, model_config.max_len, config.truncation).ids   # as written: no --spelling
    t_encode = time.monotonic()
    train_ids = encode(train_set.texts)
    encode_s_per_text = (time.monotonic() - t_encode) / len(train_ids)
    val_ids, counterfactual_ids = encode(val_set.texts), encode(texts.counterfactual.texts)
    edit_ids, join_ids = encode(texts.edits.texts), encode(texts.joins.texts)
    passage_ids = encode(texts.passages.texts)
    ends = set(token_ids(tokenizer, SENTENCE_ENDS))
    validation = Validation.build(val_ids, val_set.labels, ends if config.short_texts else None,
                                  {name: (encode(made.texts), made.labels) for name, made in texts.val_made.items()})
    console.log(f"data: {len(train_ids)} train / {len(val_ids)} validation reviews from {config.data}"
                + (f", {len(counterfactual_ids)} counterfactual texts" if counterfactual_ids else "")
                + (f" and {len(passage_ids)} of their edited passages" if passage_ids else "")
                + (f", {len(edit_ids)} negation edits and their sentences" if edit_ids else "")
                + (f", {len(join_ids)} contrast joins" if join_ids else "")
                + f"; to validate on: {validation.describe()}"
                + f", vocabulary {model_config.vocab_size}, {time.monotonic() - t0:.1f}s; peak memory {peak_memory()}")
    run.record(resuming, tokenizer, config, model_config, labels=list(LABEL_NAMES))
    test = load_test(config, console) if distributed.is_main() and not args.no_test else None

    model = Classifier(model_config).to(device)
    if config.init_from:  # on resume, last/ then replaces these weights
        load_pretrained_encoder(model, config.init_from)
    unlabelled_ids = (encode(unlabelled_split(config.data, config.limit, config.seed).texts)
                      if config.pseudo_labels or (not resuming and model.ngram is not None and config.ngram_self_train)
                      else [])
    ngram_ids = (train_ids, counterfactual_ids, passage_ids, edit_ids)   # the n-grams' data: texts.ngram_parts()
    labelled = ([x for ids in ngram_ids for x in ids], [y for part in texts.ngram_parts() for y in part.labels],
                ngram_kinds([len(ids) for ids in ngram_ids]))
    polarity = None
    if resuming:  # the weights come from last/; the unlabelled reviews' labels and held-out logits from the run folder
        given = (distributed.on_main(lambda: saved_pseudo_labels(run, len(unlabelled_ids), model_config.num_classes))
                 if config.pseudo_labels and unlabelled_ids else np.zeros((0, model_config.num_classes)))
        if model.ngram is not None:
            validation.ngram = distributed.on_main(lambda: run.branch_validation(len(validation.ids),
                                                                                 model_config.num_classes))
    else:  # Stage 1: rank 0 alone; DDP gives every rank its weights when fit() wraps the model
        given, polarity = distributed.on_main(lambda: fit_ngram_stage(run, model, config, labelled,
                                                                      (val_ids, val_set.labels), validation,
                                                                      unlabelled_ids, console))
        validation.ngram = distributed.broadcast_object(validation.ngram)
    vectors, swaps = None, ([], [])
    if config.swapped_reviews:   # every rank, and on resume: the training texts must be the same everywhere
        swaps, vectors = swaps_of(tokenizer, train_ids, train_set.labels, unlabelled_ids, model_config, config.seed,
                                  console)
    if config.word_vectors and not resuming:  # rank 0 alone, as stage 1; on resume last/ holds the trained rows
        distributed.on_main(lambda: start_from_word_vectors(model, train_ids + unlabelled_ids, config.seed, console,
                                                            vectors))
    if config.word_polarity and not resuming:   # after the word vectors: the direction is carved out of them
        distributed.on_main(lambda: start_from_word_polarity(model, polarity, config.seed, console))
    # Stage 2: the transformer (the mix is (1, 0) until stage 3, so training sees it alone).
    parts = training_parts(config, (train_ids, train_set.labels), (counterfactual_ids, texts.counterfactual.labels),
                           (edit_ids, texts.edits.labels), (join_ids, texts.joins.labels),
                           (passage_ids, texts.passages.labels), swaps)
    examples = TransformerExamples.build(parts, unlabelled_ids[: len(given)], given, config,
                                         ends, Elision.of(tokenizer))
    console.log(f"training the transformer on {len(train_ids)} labelled reviews"
                + (f", {len(counterfactual_ids)} counterfactual texts x {config.counterfactual_repeat}"
                   + parts[1].describe_pairs() if counterfactual_ids else "")
                + (f", {len(passage_ids)} edited passages x {config.counterfactual_passage_repeat}"
                   if passage_ids else "")
                + (f", {len(edit_ids)} negation edits and sentences x {config.negation_edit_repeat}"
                   + parts[2].describe_pairs() if edit_ids else "")
                + (f", {len(join_ids)} contrast joins x {config.contrast_join_repeat}" if join_ids else "")
                + (f", {len(swaps[0])} swapped reviews x {config.swapped_reviews}" if config.swapped_reviews else "")
                + (f", {len(given)} pseudo-labelled reviews" + (" (the teacher's probabilities as targets)"
                                                                 if config.soft_labels else "") if len(given) else "")
                + "".join(f", {n} {name}" for name, n in examples.windows.items())
                + (f"; each word the n-gram branch reads as NOT_word also marked for it (--scope-embedding"
                   f"{f', off a text at probability {p}' if (p := model_config.scope_dropout) else ''})"
                   if model_config.scope_embedding else "")
                + f"; peak memory {peak_memory()}")
    if config.finish_within is not None and not resuming:
        config.time_budget = distributed.on_main(lambda: plan_training_time(
            config, model, train_ids, validation, test, encode_s_per_text, started, device, dtype, console))
        run.record_settings(config)
    task = ClassificationTask(model, examples.ids, examples.targets, validation, config, device, dtype,
                              examples.partner, examples.pair_weight)
    result = fit(task, config, run, device, dtype, resuming=resuming, quiet=args.quiet)
    if result.interrupted:
        return 130
    if distributed.is_main():  # rank 0's model alone from here
        # Stage 3: the mix, chosen on validation; then one evaluation on the test split.
        mix = (choose_mix(run, model, validation, device, dtype, config.batch_size, console, task.best_logits)
               if model.ngram is not None else None)
        test_metrics = evaluate_test(run, test, config, model, tokenizer, device, dtype, mix)
        rows = [("best validation score" + (" (mixed; whole reviews and short texts)" if mix else ""),
                 f"{result.state['best']:.4f}")]
        if mix and "val_accuracy" in mix:
            rows.append(("validation accuracy, mixed", f"{mix['val_accuracy']['mixed']:.4f}  (mix {mix['mix']})"))
        if test_metrics:
            rows += [("test accuracy", f"{test_metrics['accuracy']:.4f}  ({test_metrics['examples']} reviews)"),
                     ("test loss", f"{test_metrics['loss']:.4f}")]
            if "components" in test_metrics:
                rows.append(("test accuracy, transformer / n-grams alone",
                             "{transformer:.4f} / {ngram:.4f}".format(**test_metrics["components"])))
        rows.append(("peak memory (resident)", peak_memory()))
        result.print_summary(console, "classify.train", run, rows)
    return 0


def load_test(config: TrainConfig, console: Console) -> Examples | None:
    """The test split, loaded before training (``--finish-within`` counts its reviews); None, with the reason
    on ``console``, where there is none."""
    if not provides_split(config.data, "test"):
        console.log(f"no test evaluation: {config.data} has no separate test split")
        return None
    try:
        return load_split(config.data, "test")
    except ClassifyError as err:
        console.log(f"no test evaluation: {err}")
        return None


def recorded_budget(run: RunFolder) -> float:
    """The training minutes that --finish-within set when the run in ``run`` first started (config.json)."""
    budget = read_config(run.path, KIND)["train"].get("time_budget")
    if budget is None:
        raise ClassifyError(f"{run.path} was started without a time limit, so --finish-within has no training "
                            f"minutes to keep on resume: give them with --time-budget instead")
    return budget


def plan_training_time(config: TrainConfig, model: Classifier, train_ids: list[TokenIds], validation: Validation,
                       test: Examples | None, encode_s_per_text: float, started: float, device, dtype,
                       console: Console) -> float:
    """--finish-within: the transformer's training minutes (``command_budget``), from the time spent since
    ``started``, the validation still to run after training, and the test evaluation: its reviews' tokens
    estimated from the training reviews' mean length, its tokenizing from theirs (``encode_s_per_text``)."""
    backend = TorchBackend(model, device, dtype)
    sample = padded_batches(train_ids[:512], backend.pad_id, config.batch_size * 2,   # batched as the evaluations
                            max_len=backend.max_len, multiple=backend.pad_multiple)
    rate = forward_rate(backend.branches, [tokens for _, tokens in sample])
    tests = len(test) if test is not None else 0
    after = AfterTraining(validation_tokens=sum(len(x) for x in validation.ids),
                          test_tokens=tests * float(np.mean([len(x) for x in train_ids])),
                          tokens_per_s=rate, tokenize_s=tests * encode_s_per_text)
    elapsed_s = time.monotonic() - started
    minutes = training_minutes(config.finish_within, elapsed_s, after)
    console.log(f"--finish-within {config.finish_within:g}: {elapsed_s / 60:.1f} min spent so far, "
                f"{after.describe()}, so the transformer trains for {minutes:.1f} min (its --time-budget, "
                f"recorded in config.json)")
    return minutes


def evaluate_test(run: RunFolder, test: Examples | None, config: TrainConfig, model: Classifier, tokenizer, device,
                  dtype, mix: dict | None) -> dict | None:
    """Test metrics of the best weights on ``test`` (``test_metrics.json``); with the n-gram branch, also each
    branch's accuracy alone and the mix chosen on validation."""
    if test is None or not (run.path / WEIGHTS).exists():
        return None
    load_model_weights(model, run.path / WEIGHTS)
    ids = Preprocessing(tokenizer, model.config.max_len, config.truncation, config.spelling).ids(test.texts)
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
