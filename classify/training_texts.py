"""What stage 2 trains the transformer on, assembled from the labelled data: the labelled reviews, the
counterfactual texts (``text.counterfactual``) and the rule-made texts (``text.edits``) as ``TrainingPart``s, each
seen as often as ``TrainConfig`` says; the pseudo-labelled reviews with the teacher's targets; the windows cut from
the reviews (``text.windows``); and, last, every text cut to ``--train-max-len``. ``TransformerExamples.build``
puts them in the one order the sampler and the pair loss (``train.pair_loss``) read."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import numpy as np

from .text.counterfactual import load_pairs
from .text.data import Examples, normalize
from .text.edits import Lexicon, contrast_joins, negation_pairs
from .text.prepare import TokenIds
from .text.tokenize import truncate
from .text.windows import Elision, closing_passage, closing_sentence, elided_negation
from .train_config import TrainConfig


def counterfactual_examples(config: TrainConfig, val: Examples) -> tuple[Examples, Examples]:
    """The counterfactual pairs --counterfactual trains on, both texts, originals first: those outside the
    held-out quarter whose original is no validation review (its revision would tell validation the answer); and
    with --counterfactual-passages their edited passages (``text.counterfactual.edited_passages``), the originals'
    side first (else none)."""
    if not config.counterfactual:
        return Examples([], []), Examples([], [])
    _, outside = load_pairs(config.counterfactual, held_out=False).by_original(val.texts)
    return outside.texts(), outside.passages().texts() if config.counterfactual_passages else Examples([], [])


# The kinds of labelled text the n-gram fits read (``LabelledTexts.ngram_parts``, in this order).
REVIEW, COUNTERFACTUAL, PASSAGE, EDIT = range(4)


def ngram_kinds(sizes: list[int]) -> np.ndarray:
    """Each text's kind, (sum(sizes),), for the n-gram parts of ``sizes`` texts, in the order of
    ``LabelledTexts.ngram_parts``."""
    return np.repeat([REVIEW, COUNTERFACTUAL, PASSAGE, EDIT], sizes)


def ngram_weights(kinds: np.ndarray, config: TrainConfig, teacher: bool = False) -> np.ndarray:
    """How much each text of kind ``kinds`` (N,) counts in an n-gram fit, (N,): a review or a counterfactual text
    1, an edited passage --counterfactual-passage-weight, a negation edit --negation-edit-weight (in the
    ``teacher``'s fit --teacher-edit-weight)."""
    edit = config.teacher_edit_weight if teacher else config.negation_edit_weight
    return np.choose(kinds, [1.0, 1.0, config.counterfactual_passage_weight, edit])


def teacher_reads(kinds: np.ndarray, config: TrainConfig) -> np.ndarray:
    """Which of the texts of kind ``kinds`` (N,) the teacher's n-gram fit reads, (N,) bool: all of them, or with
    --no-teacher-passages all but the edited passages (left out, not weighted 0: a slot's min count counts texts)."""
    return np.ones(len(kinds), dtype=bool) if config.teacher_passages else kinds != PASSAGE


def rule_made_examples(config: TrainConfig, train: Examples, val: Examples) -> tuple[dict[str, Examples],
                                                                                   dict[str, Examples]]:
    """--negation-edits and --contrast-joins (``text.edits``): the rule-made texts cut from the training reviews,
    to train on, and from the validation reviews, to validate on, by group name ("edit", "join"); the lexicon that
    picks their sentences is fitted on the training reviews alone."""
    made: tuple[dict[str, Examples], dict[str, Examples]] = ({}, {})
    if not (config.negation_edits or config.contrast_joins) or set(train.labels) - {0, 1}:
        return made
    texts = {"train": [normalize(t) for t in train.texts], "val": [normalize(t) for t in val.texts]}
    lexicon = Lexicon.fit(texts["train"], train.labels)
    for out, split, labels in ((made[0], "train", train.labels), (made[1], "val", val.labels)):
        if config.negation_edits:
            out["edit"] = Examples(*negation_pairs(texts[split], labels, lexicon, seed=config.seed,
                                                   negators=config.negators))
        if config.contrast_joins:
            out["join"] = Examples(*contrast_joins(texts[split], labels, lexicon, seed=config.seed))
    return made


@dataclass
class LabelledTexts:
    """The labelled texts a run reads, before tokenizing: its split's training and validation reviews, the
    counterfactual texts it trains on (``counterfactual_examples``), and the rule-made texts cut from each side of
    the split (``rule_made_examples``), by group name."""

    train: Examples
    val: Examples
    counterfactual: Examples
    passages: Examples              # the counterfactual pairs' edited passages (--counterfactual-passages)
    made: dict[str, Examples]       # to train on: "edit", "join"
    val_made: dict[str, Examples]   # to validate on

    @classmethod
    def of(cls, config: TrainConfig, train: Examples, val: Examples) -> "LabelledTexts":
        return cls(train, val, *counterfactual_examples(config, val), *rule_made_examples(config, train, val))

    @property
    def edits(self) -> Examples:
        return self.made.get("edit", Examples([], []))

    @property
    def joins(self) -> Examples:
        return self.made.get("join", Examples([], []))

    def parts(self) -> tuple[Examples, Examples, Examples, Examples, Examples]:
        """The reviews, the counterfactual texts, the negation edits, the contrast joins and the edited passages:
        the order of ``training_parts``."""
        return self.train, self.counterfactual, self.edits, self.joins, self.passages

    def ngram_parts(self) -> tuple[Examples, Examples, Examples, Examples]:
        """What the n-gram fits read, one part per kind in the order of ``REVIEW``, ... (``ngram_weights``): the
        reviews, the counterfactual texts, the edited passages and the negation edits."""
        return self.train, self.counterfactual, self.passages, self.edits


@dataclass
class TrainingPart:
    """Labelled texts the transformer trains on, seen ``times`` an epoch. Paired (``partners``): text i comes with
    ``partners[i]``, a text under another label, in the same batch, and their margin (``pair_loss``) counts
    ``pair_weight`` in the loss."""

    ids: list[TokenIds]
    labels: list[int]
    times: int = 1
    partners: list[TokenIds] | None = None
    partner_labels: list[int] | None = None
    pair_weight: float = 0.0

    @classmethod
    def of(cls, ids: list[TokenIds], labels: list[int], times: int, pair_weight: float,
           layout: str) -> "TrainingPart":
        """Texts that come in pairs, laid out as ``layout`` says ("halves": all first texts, then all second texts;
        "alternate": first, second, first, ...); paired when ``pair_weight`` > 0, else each text on its own."""
        if not (pair_weight > 0 and ids and times):
            return cls(ids, labels, times)
        half = len(ids) // 2
        first, second = (slice(0, half), slice(half, None)) if layout == "halves" else (slice(0, None, 2),
                                                                                         slice(1, None, 2))
        return cls(ids[first], labels[first], times, ids[second], labels[second], pair_weight)

    def describe_pairs(self) -> str:
        return f" (in pairs, margin weight {self.pair_weight})" if self.partners else ""


def training_parts(config: TrainConfig, reviews: tuple[list[TokenIds], list[int]],
                   counterfactual: tuple[list[TokenIds], list[int]], edits: tuple[list[TokenIds], list[int]],
                   joins: tuple[list[TokenIds], list[int]], passages: tuple[list[TokenIds], list[int]] = ([], []),
                   swaps: tuple[list[TokenIds], list[int]] = ([], [])) -> list[TrainingPart]:
    """Stage 2's labelled parts, each (token ids, labels): the labelled reviews once, then the counterfactual texts
    (originals, then revisions), the negation edits (sentence, edit, sentence, ...), the contrast joins, the
    counterfactual pairs' edited passages (laid out as their pairs) and the swapped reviews (``text.swaps``), each
    seen as often as ``config`` says."""
    return [TrainingPart(*reviews),
            TrainingPart.of(*counterfactual, config.counterfactual_repeat, config.counterfactual_pair_weight, "halves"),
            TrainingPart.of(*edits, config.negation_edit_repeat, config.negation_edit_pair_weight, "alternate"),
            TrainingPart(*joins, config.contrast_join_repeat),
            TrainingPart.of(*passages, config.counterfactual_passage_repeat, config.counterfactual_pair_weight,
                            "halves"),
            TrainingPart(*swaps, config.swapped_reviews)]


TEACHER_FLOOR = 1e-6   # the least probability a teacher's soft target gives a class (training_targets)


def training_targets(labels: list[int], given: np.ndarray, soft: bool) -> list[int] | np.ndarray:
    """The targets of the labelled reviews, then of the pseudo-labelled ones (``given``: the teacher's
    probabilities, (N, C)): class ids, the teacher's most likely class for the latter; with ``soft``, one
    distribution per review, (len(labels) + N, C), one-hot for the labelled reviews. A teacher's distribution is
    kept at least ``TEACHER_FLOOR`` from certain (float32 rounds 1.3% of the IMDB teacher's to exactly 1), so a
    target is the teacher's exactly when it is not one-hot (``ClassificationTask.teacher_weighted_loss``)."""
    if not (soft and len(given)):
        return labels + given.argmax(1).tolist()
    taught = np.clip(given, TEACHER_FLOOR, 1 - TEACHER_FLOOR).astype(np.float32)
    return np.concatenate([np.eye(given.shape[1], dtype=np.float32)[labels], taught])


def with_windows(ids: list[TokenIds], targets: list[int] | np.ndarray, rows: list[int],
                 cut: Callable[[TokenIds], TokenIds | None], times: int = 1,
                 balance: bool = False) -> tuple[list[TokenIds], list[int] | np.ndarray]:
    """The training examples plus ``cut`` of each of ``rows`` (a window of that review, or None for none), with
    that review's target, ``times`` times over. With ``balance``, each class's windows (by the target's most
    likely class) are repeated so that every class has as many as the most common one has ``times`` over: a
    window the reviews write mostly under one label would otherwise teach that label for its form alone."""
    cuts = [(i, w) for i, w in ((i, cut(ids[i])) for i in rows) if w is not None]
    repeats = np.full(len(cuts), times)
    if balance and cuts:
        picked = np.asarray(targets)[[i for i, _ in cuts]]          # (K,) class ids or (K, C) distributions
        classes = picked.argmax(1) if picked.ndim == 2 else picked
        counts = np.bincount(classes)
        repeats = np.rint(times * counts.max() / counts[classes]).astype(int)
    # copy by copy (the first copy of every window, then the second, ...): unbalanced, this is cuts * times
    taken = [(i, w) for copy in range(int(repeats.max(initial=0))) for (i, w), r in zip(cuts, repeats) if r > copy]
    rows, windows = [i for i, _ in taken], [w for _, w in taken]
    return appended(ids, targets, windows, targets[rows] if isinstance(targets, np.ndarray) else
                    [targets[i] for i in rows])


def appended(ids: list[TokenIds], targets: list[int] | np.ndarray, more_ids: list[TokenIds],
             more: list[int] | np.ndarray) -> tuple[list[TokenIds], list[int] | np.ndarray]:
    """The training examples plus ``more_ids`` with targets ``more``: class ids, or (M, C) distributions when
    ``targets`` are distributions (class ids are then made one-hot)."""
    if not isinstance(targets, np.ndarray):
        return ids + more_ids, targets + list(more)
    more = np.asarray(more)
    if more.ndim == 1:
        more = np.eye(targets.shape[1], dtype=targets.dtype)[more.astype(np.int64)].reshape(-1, targets.shape[1])
    return ids + more_ids, np.concatenate([targets, more])


@dataclass
class TransformerExamples:
    """What stage 2 trains the transformer on: N texts' token ids, their targets (N class ids, or (N, C)
    distributions with soft pseudo-labels), and with paired parts each text's partner row (N,; -1 for none) and
    pair weight (N,)."""

    ids: list[TokenIds]
    targets: list[int] | np.ndarray
    partner: np.ndarray | None = None
    pair_weight: np.ndarray | None = None
    windows: dict[str, int] = field(default_factory=dict)   # how many windows of each kind were cut

    @classmethod
    def build(cls, parts: list[TrainingPart], pseudo_ids: list[TokenIds], given: np.ndarray, config: TrainConfig,
              ends: set[int], elision: Elision) -> "TransformerExamples":
        """The parts, each ``times`` over (``parts[0]``: the labelled reviews, once), then the pseudo-labelled
        reviews (``given``: the teacher's (N, C) probabilities); then windows cut from the labelled and
        pseudo-labelled reviews, not from the pairs, whose two texts often end alike under opposite labels; then
        each paired part's second texts, once: the sampler serves a pair's first text (an original, a sentence)
        and its second (the revision, the negation edit) comes with it into the batch. Last, with
        ``--train-max-len``, every text is cut to it."""
        ids = [x for part in parts for x in part.ids * part.times] + pseudo_ids
        targets = training_targets([y for part in parts for y in part.labels * part.times], given,
                                   config.soft_labels)
        reviews = list(range(len(parts[0].ids))) + list(range(len(ids) - len(pseudo_ids), len(ids)))
        windows = {}
        for name, cut, times, balance in (
                ("closing sentences", closing_sentence, int(config.short_texts), False),
                ("closing passages", closing_passage, int(config.closing_passages), False),
                (f"sentences ending on an elided negation (x{config.elided_negation_repeat}"
                 + (", balanced by label)" if config.elided_negation_balance else ")"),
                 partial(elided_negation, elision=elision), config.elided_negation_repeat,
                 config.elided_negation_balance)):
            if times:
                before = len(ids)
                ids, targets = with_windows(ids, targets, reviews, partial(cut, ends=ends), times, balance)
                windows[name] = len(ids) - before
        partner, pair_weight = None, None
        if any(part.partners for part in parts):   # each copy of a pair's first text -> its second, appended once
            partner, pair_weight = np.full(len(ids), -1, dtype=np.int64), np.zeros(len(ids), dtype=np.float32)
            first = 0
            for part in parts:
                n = len(part.ids)
                if part.partners:
                    for copy in range(part.times):
                        partner[first + copy * n: first + (copy + 1) * n] = len(ids) + np.arange(n)
                    pair_weight[first: first + n * part.times] = part.pair_weight
                    ids, targets = appended(ids, targets, part.partners, part.partner_labels)
                first += n * part.times
        if config.train_max_len:   # after the windows: a closing sentence is cut from the whole review
            ids = [truncate(x, config.train_max_len, config.truncation) for x in ids]
        return cls(ids, targets, partner, pair_weight, windows)
