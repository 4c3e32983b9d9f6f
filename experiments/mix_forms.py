"""How well the mix's form fits both short and long texts, on a run's own validation texts (no test, no suite).

    python -m experiments.mix_forms --runs runs/imdb-v11 runs/imdb-v12 --threads 2 --record

``classify.train`` fits the mix of the transformer and the n-gram branch on validation texts of every length
(whole reviews, closing sentences, negation edits, contrast joins), each branch's weight linear in 1 and the log
of the length (``classify.mix.mix_features``). On whole reviews the mix can then fall below the branch alone.
This experiment rebuilds a run's validation texts exactly as its training did (its config.json; the branch's
held-out logits from the run folder; the transformer's from its weights), and compares forms of the mix, each
fitted on one half of the validation texts and scored on the other, both ways round (2-fold cross-fitting,
halves drawn by whole review: a review and the texts cut from it stay together):

* ``log``: 1 and log(length), as shipped;
* ``hinge at N``: also max(0, log(length) - log(N)), so that texts longer than N tokens get a slope of their own;
* ``split at N``: 1 and log(length) twice, the second pair for texts longer than N tokens only: a line of its own
  (``--split-at``: the lengths N, 64 by default);
* ``log + sentences``: also log(1 + the number of sentence ends), which tells a short review from one long sentence;
* ``log + confidences``: also each branch's |logit difference| on the text: a branch that is unsure of a text
  can count for less on it;
* ``log`` fitted without the contrast joins (scored on every group);
* for scale, ``log`` fitted on the whole reviews alone and scored on them: the best a mix of this kind does there;
* ``log`` fitted with each group counting alike (each text weighted by one over its group's size), as the
  checkpoint's score counts them, where the shipped fit counts texts alike.

With ``--counterfactual-pairs`` (a run trained with ``--counterfactual``), two more groups, ``pair originals`` and
``pair revisions``: the counterfactual pairs that training left out because their original is a validation review
(never the held-out quarter), with the branch's logits from the kept branch, which was fitted on those originals
and never on their revisions, as it was on the held-out quarter's originals (the branch recognises a review it was
fitted on and ignores the edit). Every system scores them; only the last three mixes are fitted with them: the
shipped ``log`` form with the pairs counted as texts, and counting as much as an average group; and ``log +
confidences`` with them counting as a group (a mix that could learn to doubt a branch sure of a review it knows).

Reported per group: the transformer alone, the branch alone and each mix.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from classify.engine.config import runtime
from classify.engine.runfolder import RunFolder
from classify.evaluate import run_training_split
from classify.inference import KIND, load_run
from classify.mix import fit_mix, mix_features, mixed_logits
from classify.ngrams import bag_logits
from classify.text.counterfactual import load_pairs
from classify.text.data import Examples
from classify.text.prepare import Preprocessing
from classify.text.tokenize import token_ids
from classify.text.windows import SENTENCE_ENDS
from classify.train import Validation, transformer_logits
from classify.train_config import TrainConfig
from classify.training_texts import rule_made_examples

from . import add_results_args, results_folder
from .trainruns import experiment_meta, write_results


def hinge_form(at: int) -> Callable[[Tensor], Tensor]:
    """lengths (B,) -> (B, 3): 1, log(length) and max(0, log(length) - log(at)): texts longer than ``at``
    tokens get a slope of their own."""
    def features(lengths: Tensor) -> Tensor:
        base = mix_features(lengths)
        return torch.cat([base, (base[:, 1:] - math.log(at)).clamp(min=0)], dim=-1)
    return features


def split_form(at: int) -> Callable[[Tensor], Tensor]:
    """lengths (B,) -> (B, 4): 1 and log(length), and both again for texts longer than ``at`` tokens: two
    separate lines."""
    def features(lengths: Tensor) -> Tensor:
        base = mix_features(lengths)
        return torch.cat([base, base * (lengths > at).to(base.dtype)[:, None]], dim=-1)
    return features


def forms(split_at: list[int]) -> dict[str, Callable[[Tensor], Tensor]]:
    """The mix forms compared: the shipped one, and a hinge and a split at each length in ``split_at``."""
    return {"log": mix_features, **{f"hinge at {at}": hinge_form(at) for at in split_at},
            **{f"split at {at}": split_form(at) for at in split_at}}


PAIRS = len(Validation.GROUPS)   # the group index of the validation pairs' originals (--counterfactual-pairs) ...
REVISIONS = PAIRS + 1             # ... and of their revisions


def validation_of(path: str, device, dtype, pairs: bool = False) -> tuple[Validation, np.ndarray, set[int]]:
    """The run's validation texts as its training built them, with the branch's held-out logits, the
    transformer's logits for them, and the sentence-end token ids; with ``pairs``, the validation pairs after them
    (groups ``PAIRS`` and ``REVISIONS``; their branch logits from the kept branch)."""
    run = load_run(path, device, dtype)
    train_config = run.config["train"]
    config = TrainConfig(**{k: v for k, v in train_config.items() if k in TrainConfig.__dataclass_fields__})
    train, val = run_training_split(run.config, None)
    _, val_made = rule_made_examples(config, train, val)
    tokenizer = run.tokenizer
    encode = Preprocessing(tokenizer, run.backend.model.config.max_len, run.truncation).ids
    ends = set(token_ids(tokenizer, SENTENCE_ENDS))
    validation = Validation.build(encode(val.texts), val.labels, ends if config.short_texts else None,
                                  {name: (encode(t.texts), t.labels) for name, t in val_made.items()})
    validation.ngram = RunFolder(run.path, KIND).branch_validation(len(validation.ids), len(run.labels))
    if validation.ngram is None:
        raise SystemExit(f"{path} has no branch_validation.json: it was trained without the n-gram branch")
    if pairs:
        more = validation_pairs(config, val.texts)
        more_ids = encode(more.texts)
        more_ngram = bag_logits(run.backend.model.ngram, more_ids).numpy()
        validation = Validation(validation.ids + more_ids, validation.labels + more.labels,
                                np.concatenate([validation.group, np.repeat([PAIRS, REVISIONS], len(more_ids) // 2)]),
                                np.concatenate([validation.ngram, more_ngram]))
    logits = transformer_logits(run.backend.model, validation.ids, device, dtype, 64, shard=False)
    return validation, logits, ends


def validation_pairs(config: TrainConfig, val_texts: list[str]) -> Examples:
    """The counterfactual pairs outside the held-out quarter whose original is a validation review (training
    leaves them out, ``training_texts.counterfactual_examples``): originals, then revisions."""
    if not config.counterfactual:
        raise SystemExit("--counterfactual-pairs needs runs trained with --counterfactual")
    inside, _ = load_pairs(config.counterfactual, held_out=False).by_original(val_texts)
    return inside.texts()


def halves(validation: Validation, seed: int = 0) -> np.ndarray:
    """(N,) 0 or 1 per text: reviews drawn into two halves at random; the texts cut from a review go with it
    where the data says which review that is (closing sentences: the same order as the reviews), the rule-made
    texts by their own draw (they come in pairs, sentence and edit, kept together)."""
    rng = np.random.default_rng(seed)
    reviews = int((validation.group == 0).sum())
    review_half = rng.integers(2, size=reviews)
    half = np.empty(len(validation.ids), dtype=np.int64)
    half[validation.group == 0] = review_half
    short = np.flatnonzero(validation.group == 1)
    half[short] = review_half[: len(short)]
    rest = np.flatnonzero((validation.group > 1) & (validation.group < PAIRS))
    half[rest] = np.repeat(rng.integers(2, size=(len(rest) + 1) // 2), 2)[: len(rest)]
    pairs = np.flatnonzero(validation.group >= PAIRS)   # originals, then revisions: pair i is rows i and n + i
    half[pairs] = np.tile(rng.integers(2, size=len(pairs) // 2), 2)
    return half


def per_text_form(validation: Validation, *more: Tensor) -> tuple[Callable[[Tensor], Tensor], np.ndarray]:
    """A form of 1, log(length) and ``more`` features of each text ((N,) each). ``fit_mix`` hands a form only what
    it is given as lengths, so this form is given row numbers and looks each text's features up: returns the form
    and (N,) the row numbers to pass in place of the lengths."""
    table = torch.stack([mix_features(torch.as_tensor(validation.lengths()))[:, 1],
                         *(m.to(torch.float32) for m in more)], dim=1)                   # (N, 1 + len(more))

    def features(rows: Tensor) -> Tensor:
        return torch.cat([torch.ones(len(rows), 1), table[rows.long()]], dim=1)
    return features, np.arange(len(validation.ids))


def sentence_form(validation: Validation, ends: set[int]) -> tuple[Callable[[Tensor], Tensor], np.ndarray]:
    """A form that also reads how many sentences a text has: log(1 + sentence ends) (``per_text_form``)."""
    return per_text_form(validation, torch.tensor([math.log1p(sum(t in ends for t in ids)) for ids in validation.ids]))


def confidence_form(validation: Validation, transformer: np.ndarray) -> tuple[Callable[[Tensor], Tensor], np.ndarray]:
    """A form that also reads how sure each branch is: each branch's |logit difference| (``per_text_form``), so
    that a branch that found little to go on can count for less on that text (a branch whose held-out logits are
    small has little evidence; the number of its slots that fired cannot be had, as the first fit that gave those
    logits is not kept)."""
    return per_text_form(validation, *(torch.as_tensor(np.abs(logits[:, 1] - logits[:, 0]))
                                       for logits in (transformer, validation.ngram)))


def compare(validation: Validation, transformer: np.ndarray, split_at: list[int],
            ends: set[int]) -> dict[str, dict[str, float | None]]:
    """Accuracy per group of each system, the mixes cross-fitted on halves. The validation pairs, when there, are
    scored by every system and fitted on by the last three only."""
    y, lengths, ngram = np.asarray(validation.labels), validation.lengths(), validation.ngram
    half = halves(validation)
    everything = np.ones(len(y), dtype=bool)

    def cross_fitted(features_of, fitted_on: np.ndarray, scored_on: np.ndarray, lengths=lengths,
                     weights: np.ndarray | None = None) -> np.ndarray:
        """(N,) the class each text gets from the mix fitted on the other half's ``fitted_on`` texts (each
        counting ``weights[i]`` when given); -1 where not ``scored_on``."""
        predicted = np.full(len(y), -1, dtype=np.int64)
        for k in (0, 1):
            fit, score = (half != k) & fitted_on, (half == k) & scored_on
            mix = fit_mix(transformer[fit], ngram[fit], lengths[fit], y[fit], features_of=features_of,
                          weights=None if weights is None else weights[fit])
            predicted[score] = mixed_logits(mix, transformer[score], ngram[score], lengths[score],
                                            features_of).argmax(1)
        return predicted

    pairs = validation.group >= PAIRS
    shipped = ~pairs              # what training fits the mix on
    systems = {"transformer": transformer.argmax(1), "ngram": ngram.argmax(1)}
    systems.update({f"mix, {name}": cross_fitted(features_of, shipped, everything)
                    for name, features_of in forms(split_at).items()})
    by_sentences, rows = sentence_form(validation, ends)
    systems["mix, log + sentences"] = cross_fitted(by_sentences, shipped, everything, lengths=rows)
    by_confidence, confidence_rows = confidence_form(validation, transformer)
    systems["mix, log + confidences"] = cross_fitted(by_confidence, shipped, everything, lengths=confidence_rows)
    # The shipped form fitted on some groups only: without the contrast joins (scored on every group), and, for
    # scale, on whole reviews alone (scored on them only): what a mix fitted for long texts can do there at best.
    reviews = validation.group == 0
    systems["mix, log, fitted without the joins"] = cross_fitted(
        mix_features, shipped & (validation.group != Validation.GROUPS.index("join")), everything)
    systems["mix, log, fitted on reviews alone"] = cross_fitted(mix_features, reviews, reviews)
    # Each group counting alike in the fit, as in the checkpoint's score (the mean of the groups' accuracies).
    groups = np.minimum(validation.group, PAIRS)                    # both texts of a pair in one group
    alike = 1.0 / np.bincount(groups)[groups]                       # (N,) one over the size of the text's group
    systems["mix, log, groups weighted alike"] = cross_fitted(mix_features, shipped, everything, weights=alike)
    if pairs.any():
        systems["mix, log, fitted with the pairs"] = cross_fitted(mix_features, everything, everything)
        # The pairs weighing as much as the texts of an average group (the others' texts count 1 each, as shipped).
        as_group = np.where(pairs, (~pairs).sum() / (len(Validation.GROUPS) * pairs.sum()), 1.0)
        systems["mix, log, fitted with the pairs counting as a group"] = cross_fitted(
            mix_features, everything, everything, weights=as_group)
        # With each branch's confidence, a mix could learn from the pairs to doubt a branch sure of a review it knows.
        systems["mix, log + confidences, fitted with the pairs counting as a group"] = cross_fitted(
            by_confidence, everything, everything, lengths=confidence_rows, weights=as_group)
    names = [*Validation.GROUPS, "pair originals", "pair revisions"]
    return {system: {group or "reviews": float((p[rows] == y[rows]).mean()) if (p[rows] >= 0).all() else None
                     for g, group in enumerate(names) if (rows := validation.group == g).any()}
            for system, p in systems.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.mix_forms", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True, help="run folders trained with the n-gram branch")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--split-at", type=int, nargs="+", default=[64], metavar="TOKENS",
                   help="lengths at which the hinge and split forms start their second slope or line")
    p.add_argument("--counterfactual-pairs", action="store_true",
                   help="also score the counterfactual pairs whose original is a validation review, and fit three "
                        "mixes with them (runs trained with --counterfactual)")
    p.add_argument("--name", default="mix_forms", help="the report's file name")
    add_results_args(p, "NAME.json and .md")
    args = p.parse_args(argv)
    device, dtype = runtime(argparse.Namespace(device="cpu", precision="auto", threads=args.threads))
    results = {}
    for path in args.runs:
        with torch.inference_mode():
            validation, logits, ends = validation_of(path, device, dtype, args.counterfactual_pairs)
        results[path] = compare(validation, logits, args.split_at, ends)
        print(path, results[path], flush=True)
    meta = experiment_meta("experiments.mix_forms", argv if argv is not None else sys.argv[1:])
    groups = list(next(iter(results.values()))["ngram"])
    lines = [f"Command: `{meta['command']}` ({meta['date']}). Validation only: each mix fitted on one half of a "
             f"run's validation texts and scored on the other, both ways round. Accuracy per group.", "",
             f"| run | system | {' | '.join(groups)} |", "|---|---|" + "---|" * len(groups)]
    for path, systems in results.items():
        for system, scores in systems.items():
            lines.append(f"| {path} | {system} | "
                         + " | ".join("-" if scores[g] is None else f"{scores[g]:.2%}" for g in groups) + " |")
    write_results(results_folder(args), args.name, {"meta": meta, "runs": results}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
