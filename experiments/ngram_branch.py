"""The n-gram branch alone: what its features, vocabulary, view of long reviews and self-training buy.

    python -m experiments.ngram_branch --data ../shared/imdb --record

The branch (``classify.ngrams``) is fitted as ``classify.train`` fits it, on the training part of the
default grouped split, and scored alone on the validation part and the test split. A variant is a
comma-separated list of changes to plain 1-3-grams in 4,194,301 slots (an empty one: no change):

* ``skip``, ``head=N``, ``tail=N``: the other n-gram families (pairs of tokens one apart; 1-3-grams of the
  first / last N tokens as features of their own), as ``--ngram-skip-bigrams``, ``--ngram-head``, ``--ngram-tail``;
* ``buckets=N``: hash slots (more families need more of them to keep collisions rare);
* ``vocab=N``: the word tokenizer's vocabulary (the branch sees only words the tokenizer knows; with its
  minimum count of 2, a vocabulary of 200,000 asked for is every word seen twice);
* ``len=N``: the tokens kept per review (head+tail); the transformer needs a cut, the branch less so;
* ``self``: fitted, then the source's unlabelled reviews labelled by that fit, then fitted again on
  both (``--ngram-self-train``, ``classify.ngrams.self_train_ngram_bag``);
* ``neg=N``: words up to N tokens after a negator read as negated words (``--ngram-negation``);
* ``edits=P``: also fitted on negation edits of the training reviews' sentences and those sentences
  (``--negation-edits``, ``classify.text.edits``), each counting P/100 of a review (``--negation-edit-weight``).
  Validation then also scores the edits cut from the validation reviews (the "val edits" column).
* ``cf=P`` (with ``--folds`` and ``--counterfactual``): also fitted on the counterfactual pairs, both texts, each
  counting P/100 of a review (``classify.train --counterfactual`` fits them at 1): those outside the held-out
  quarter whose original is not a held-out review. Each fold also scores the held-out quarter's revised texts,
  the edited reviews the issue's contrast set stands for.
* ``passages=P`` (likewise): also fitted on those pairs' edited passages (``--counterfactual-passages``), each
  counting P/100 of a review (``--counterfactual-passage-weight``).
* ``min=N``: slots fewer than N of the texts fitted on have keep no weight (``--ngram-min-count``): an n-gram one
  review alone has is mostly that review's fingerprint.
* ``nb=N``: naive-Bayes' pseudo-count N instead of 1 (``classify.ngrams.fit_features``): the scales of slots few
  texts have shrink, a softer ``min``.
* ``movies=N`` (with ``--folds``): slots fewer than N movies' reviews have keep no weight either (the movies
  that ``classify.text.review_groups`` recovers; an edit or a pair counts in none): a title, a character or an
  actor of one movie is that movie's fingerprint however many of its reviews name it.

Beside validation and test accuracy, each variant's failure rates on the behavioural suite's labelled sentences
(``classify.behaviour``; all of them, and the negated positives and negatives): the suite is only scored, never
used to choose.

Each variant costs 1-4 minutes on one core (features, liblinear; tokenizing once per vocabulary).

``--folds K`` cross-validates the variants instead, for choices that one 2,500-review validation split is too
noisy to make (its standard error is about half a point): all 25,000 training reviews in K folds grouped by movie
(``classify.text.review_groups``) and stratified by label; each fold is held out once, the variants fitted on the
others (the lexicon and the negation edits too: from those reviews only) and scored on the held-out fold's whole
reviews and on the edits cut from them. Reported: the mean over folds and each variant's paired difference from
the first, with its standard error over folds. The test split and the suite are not read at all. Folds run ``--threads`` at a time,
in processes of their own:

    python -m experiments.ngram_branch --data ../shared/imdb --folds 5 --threads 2 --record \
        --variants skip,head=30,tail=60,buckets=16777259,neg=4 skip,head=30,tail=60,buckets=16777259,neg=4,edits=10
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import numpy as np
import torch

from classify.behaviour import build_suite, score, suite_texts, summary
from classify.text.prepare import Preprocessing
from classify.ngrams import NgramBag, bag_logits, describe, feature_matrix, fit_features, self_train_ngram_bag
from classify.text.counterfactual import load_pairs
from classify.text.data import Examples, load_split, normalize, training_split
from classify.text.review_groups import review_groups
from classify.text.edits import Lexicon, negation_pairs
from classify.text.tokenize import CLAUSE_BREAKS, NEGATORS, token_ids, train_tokenizer
from classify.train_config import TrainConfig
from classify.training_texts import counterfactual_examples

from . import add_results_args, results_folder
from .trainruns import experiment_meta, write_results

ORDERS = 3
PLAIN = {"vocab": 30_000, "len": 512, "buckets": 4_194_301, "skip": False, "head": 0, "tail": 0, "self": False,
         "neg": 0, "edits": 0, "cf": 0, "passages": 0, "min": 1, "nb": 1, "movies": 0}
PERCENT_KEYS = ("edits", "cf", "passages")   # given in percent: edits=1 weighs each negation edit 0.01
DEFAULT_VARIANTS = ("", "self", "skip", "head=30,tail=60", "skip,head=30,tail=60",
                    "skip,head=30,tail=60,buckets=16777259", "skip,head=30,tail=60,buckets=16777259,self",
                    "len=100000", "vocab=200000", "skip,head=30,tail=60,buckets=16777259,neg=4")


def parse_variant(text: str) -> dict:
    """'skip,tail=60,buckets=16777259' -> PLAIN with those changes"""
    variant = dict(PLAIN)
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key not in PLAIN or (value == "") != isinstance(PLAIN[key], bool) or (value and not value.isdigit()):
            keys = ", ".join(k if isinstance(v, bool) else f"{k}={'P' if k in PERCENT_KEYS else 'N'}"
                             for k, v in PLAIN.items())
            raise argparse.ArgumentTypeError(f"a variant is a comma-separated list of {keys}; got {text!r}")
        variant[key] = True if value == "" else int(value)
    return variant


def accuracy(bag: NgramBag, ids: list, labels: list[int]) -> float:
    return float((bag_logits(bag, ids).argmax(dim=1).numpy() == np.asarray(labels)).mean())


def behaviour(bag: NgramBag, tokenizer, length: int) -> dict[str, float]:
    """The branch's failure rates on the behavioural suite's labelled sentences: all, and per capability."""
    suite = [c for c in build_suite() if c.kind == "mft"]
    ids = Preprocessing(tokenizer, length, "head+tail").ids(suite_texts(suite))
    scores = score(suite, bag_logits(bag, ids).argmax(dim=1).numpy())
    return {"mft": summary(scores)["mft"], **{name: s["failure_rate"] for name, s in scores.items()}}


def _bag(v: dict, tokenizer) -> NgramBag:
    return NgramBag(tokenizer.get_vocab_size(), 2, ORDERS, v["buckets"], 0, v["skip"], v["head"], v["tail"], v["neg"],
                    tuple(token_ids(tokenizer, NEGATORS)), tuple(token_ids(tokenizer, CLAUSE_BREAKS)))


def fold_scores(data: str, folds: int, fold: int, variants: list[dict], c: float,
                counterfactual: str | None = None) -> list[dict]:
    """Fold ``fold`` of ``folds`` held out: each variant fitted on the other folds' reviews (and their edits, and
    the counterfactual pairs), scored on the held-out reviews and their edits (and the held-out quarter's revised
    reviews). Runs in a process of its own (one core: liblinear is serial)."""
    from sklearn.model_selection import StratifiedGroupKFold

    torch.set_num_threads(1)
    full = load_split(data, "train")
    texts = [normalize(t) for t in full.texts]
    groups, _ = review_groups(full.texts, full.labels)
    # Stratified: a movie's reviews (a group) may all share one label, and folds must hold both labels.
    fit_idx, held_idx = list(StratifiedGroupKFold(folds).split(texts, full.labels, groups))[fold]
    fit, held = full.subset(list(fit_idx)), full.subset(list(held_idx))
    lexicon = Lexicon.fit([texts[i] for i in fit_idx], fit.labels)
    edits, held_edits = (Examples(*negation_pairs([texts[i] for i in idx], split.labels, lexicon))
                         for idx, split in ((fit_idx, fit), (held_idx, held)))
    # The pairs classify.train fits, the held-out reviews in the place of its validation reviews: not the held-out
    # quarter, and none whose original is a held-out review (its revision is that review with the other label).
    pairs, passages = counterfactual_examples(TrainConfig(data=data, counterfactual=counterfactual,
                                                          counterfactual_passages=True), held)
    revised = load_pairs(counterfactual, held_out=True).revised if counterfactual else Examples([], [])
    tokenizers, encoded, out = {}, {}, []
    for v in variants:
        if v["vocab"] not in tokenizers:
            tokenizers[v["vocab"]] = train_tokenizer([texts[i] for i in fit_idx], v["vocab"], "word")
        if (v["vocab"], v["len"]) not in encoded:   # each vocabulary and cut tokenized once
            prepare = Preprocessing(tokenizers[v["vocab"]], v["len"], "head+tail")
            encoded[v["vocab"], v["len"]] = [prepare.ids(x.texts) for x in (fit, edits, pairs, passages, held,
                                                                             held_edits, revised)]
        fit_ids, edit_ids, pair_ids, passage_ids, held_ids, held_edit_ids, revised_ids = encoded[v["vocab"], v["len"]]
        bag = _bag(v, tokenizers[v["vocab"]])
        parts = [(fit_ids, fit.labels, 1.0), (edit_ids, edits.labels, v["edits"] / 100),
                 (pair_ids, pairs.labels, v["cf"] / 100), (passage_ids, passages.labels, v["passages"] / 100)]
        parts = [(ids, labels, weight) for ids, labels, weight in parts if weight]
        weights = np.concatenate([np.full(len(ids), w) for ids, _, w in parts])
        # The movies of the reviews fitted on (``movies=N``: a slot needs N of them); an edit or a pair is in none.
        movies = (np.concatenate([np.asarray(groups)[fit_idx], np.full(len(weights) - len(fit_idx), -1)])
                  if v["movies"] else None)
        fit_features(bag, feature_matrix(bag, [x for ids, _, _ in parts for x in ids]),
                     np.asarray([y for _, labels, _ in parts for y in labels]), c, weights, v["min"], v["nb"],
                     movies, v["movies"])
        out.append({"fold": fold, "features": describe(bag.kinds, bag.negation), "reviews": len(held),
                    "edits": len(held_edits.texts), "pairs": len(pairs.texts) // 2 if v["cf"] else 0,
                    "weighted_slots": int((bag.weight != 0).any(dim=1).sum()),
                    "accuracy": accuracy(bag, held_ids, held.labels),
                    "edit_accuracy": accuracy(bag, held_edit_ids, held_edits.labels),
                    "revised_accuracy": accuracy(bag, revised_ids, revised.labels) if revised_ids else None})
        print(f"fold {fold}, edits {v['edits'] / 100:g}, pairs {v['cf'] / 100:g}, passages {v['passages'] / 100:g}: "
              f"{out[-1]}", flush=True)
    return out


def cross_validate(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``--folds``: every variant's grouped K-fold accuracy over the training reviews (see the module docstring)."""
    with ProcessPoolExecutor(args.threads, mp_context=get_context("spawn")) as pool:
        per_fold = list(pool.map(fold_scores, *zip(*[(args.data, args.folds, k, args.variants, args.c,
                                                      args.counterfactual) for k in range(args.folds)])))
    rows = []
    for i, v in enumerate(args.variants):
        acc = np.array([f[i]["accuracy"] for f in per_fold])
        edit = np.array([f[i]["edit_accuracy"] for f in per_fold])
        diff = acc - np.array([f[0]["accuracy"] for f in per_fold])
        revised = [f[i]["revised_accuracy"] for f in per_fold]
        rows.append({**v, "folds": [f[i] for f in per_fold], "accuracy": float(acc.mean()),
                     "edit_accuracy": float(edit.mean()), "difference": float(diff.mean()),
                     "difference_se": float(diff.std(ddof=1) / np.sqrt(len(diff))),
                     "revised_accuracy": None if None in revised else float(np.mean(revised))})
    meta = experiment_meta("experiments.ngram_branch", argv if argv is not None else sys.argv[1:])
    lines = [f"Command: `{meta['command']}` ({meta['date']}); {args.folds}-fold cross-validation over the "
             f"{sum(f['reviews'] for f in rows[0]['folds']):,} training reviews, folds grouped by movie; C = {args.c}; "
             f"{args.threads} folds at a time, one thread each. The test split and the suite are not read.", "",
             "| features | slots | negation edits' weight | counterfactual pairs' weight | their edited passages' "
             "weight | texts a weighted slot needs "
             "| naive-Bayes pseudo-count | movies a weighted slot needs | slots with a weight (mean over folds) "
             "| accuracy, held-out reviews "
             "| difference from the first (± s.e. over folds) | accuracy, held-out edits | accuracy, the held-out "
             "quarter's revised reviews |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        edit = f"{r['edits'] / 100:g}" if r["edits"] else "-"
        pairs = f"{r['cf'] / 100:g}" if r["cf"] else "-"
        passages = f"{r['passages'] / 100:g}" if r["passages"] else "-"
        diff = "-" if r is rows[0] else f"{r['difference'] * 100:+.2f} ± {r['difference_se'] * 100:.2f} points"
        revised = "-" if r["revised_accuracy"] is None else f"{r['revised_accuracy']:.2%}"
        weighted = np.mean([f["weighted_slots"] for f in r["folds"]])
        lines.append(f"| {r['folds'][0]['features']} | {r['buckets']:,} | {edit} | {pairs} | {passages} | "
                     f"{r['min']} | {r['nb']} | {r['movies'] or '-'} | "
                     f"{weighted:,.0f} | {r['accuracy']:.2%} | {diff} | {r['edit_accuracy']:.2%} | {revised} |")
    write_results(results_folder(args), "ngram_branch_cv", {"meta": meta, "rows": rows}, "\n".join(lines) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.ngram_branch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="../shared/imdb", help="a source with train, test and unsupervised splits")
    p.add_argument("--variants", type=parse_variant, nargs="+", default=[parse_variant(v) for v in DEFAULT_VARIANTS],
                   help="changes to plain 1-3-grams, e.g. 'skip,head=30,tail=60,buckets=16777259,self' ('' = none)")
    p.add_argument("--c", type=float, default=1.0, help="the logistic regression's inverse L2 strength")
    p.add_argument("--seed", type=int, default=0, help="the validation split's seed")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--folds", type=int, help="cross-validate over the training reviews in this many folds instead "
                                             "(no validation split, no test, no suite)")
    p.add_argument("--counterfactual", help="with --folds: the counterfactual pairs (e.g. ../shared/imdb-counterfactual) "
                                            "that cf=P fits and whose held-out quarter's revisions are scored")
    add_results_args(p, "ngram_branch.json and .md")
    args = p.parse_args(argv)
    if any(v["cf"] or v["passages"] for v in args.variants) and not (args.folds and args.counterfactual):
        p.error("a cf=P or passages=P variant needs --folds and --counterfactual")
    if any(v["movies"] for v in args.variants) and not args.folds:
        p.error("a movies=N variant needs --folds")
    if args.folds is not None:
        if args.folds < 2:
            p.error(f"--folds must be at least 2, got {args.folds}")
        return cross_validate(args, argv)
    torch.set_num_threads(args.threads)

    train, val = training_split(args.data, None, args.seed)
    test = load_split(args.data, "test")
    unlabelled = (load_split(args.data, "unsupervised", labelled=False).texts
                  if any(v["self"] for v in args.variants) else [])
    tokenizers, encoded = {}, {}

    def encode(v: dict, name: str, texts: list[str]) -> list:
        """The reviews as the variant's branch reads them (each vocabulary and cut tokenized once)."""
        if v["vocab"] not in tokenizers:
            tokenizers[v["vocab"]] = train_tokenizer([normalize(t) for t in train.texts], v["vocab"], "word")
        if (v["vocab"], v["len"], name) not in encoded:
            prepare = Preprocessing(tokenizers[v["vocab"]], v["len"], "head+tail")
            encoded[v["vocab"], v["len"], name] = prepare.ids(texts)
        return encoded[v["vocab"], v["len"], name]

    lexicon = Lexicon.fit([normalize(t) for t in train.texts], train.labels)
    edits, val_edits = (Examples(*negation_pairs([normalize(t) for t in split.texts], split.labels, lexicon))
                        for split in (train, val))
    rows = []
    for v in args.variants:
        start = time.monotonic()
        ids = {name: encode(v, name, texts) for name, texts in
               (("train", train.texts), ("val", val.texts), ("test", test.texts), ("edits", edits.texts),
                ("val edits", val_edits.texts))}
        tokenizer = tokenizers[v["vocab"]]
        size = tokenizer.get_vocab_size()
        bag = _bag(v, tokenizer)
        weights = np.repeat([1.0, v["edits"] / 100], [len(train), len(edits.texts) if v["edits"] else 0])
        self_train_ngram_bag(bag, ids["train"] + (ids["edits"] if v["edits"] else []),
                             train.labels + (edits.labels if v["edits"] else []),
                             encode(v, "unlabelled", unlabelled) if v["self"] else [], args.c, weights=weights,
                             min_count=v["min"], smoothing=v["nb"])
        row = {**v, "vocab_asked": v["vocab"], "vocab": size, "features": describe(bag.kinds, bag.negation),
               "unlabelled": len(unlabelled) if v["self"] else 0,
               "val_accuracy": accuracy(bag, ids["val"], val.labels),
               "val_edit_accuracy": accuracy(bag, ids["val edits"], val_edits.labels),
               "test_accuracy": accuracy(bag, ids["test"], test.labels),
               "behaviour": behaviour(bag, tokenizer, v["len"]), "seconds": round(time.monotonic() - start)}
        rows.append(row)
        print(row, flush=True)
    meta = experiment_meta("experiments.ngram_branch", argv if argv is not None else sys.argv[1:])
    lines = [f"Command: `{meta['command']}` ({meta['date']}); {len(train)} training / {len(val)} validation reviews "
             f"(grouped split, seed {args.seed}), C = {args.c}, {args.threads} thread(s). Seconds include tokenizing "
             f"where a vocabulary or cut is first used.", "",
             "| features | slots | vocabulary | tokens kept | self-trained on | negation edits' weight | val acc | "
             "val edits acc | test acc | suite failures: labelled / negated pos / negated neg | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        extra = f"{r['unlabelled']:,} unlabelled" if r["self"] else "-"
        b = r["behaviour"]
        edit = f"{r['edits'] / 100:g} ({len(edits.texts):,} texts)" if r["edits"] else "-"
        lines.append(f"| {r['features']} | {r['buckets']:,} | {r['vocab']:,} | {r['len']} | {extra} | {edit} | "
                     f"{r['val_accuracy']:.4f} | {r['val_edit_accuracy']:.4f} | {r['test_accuracy']:.4f} | {b['mft']:.1%} / "
                     f"{b['negated positive']:.1%} / {b['negated negative']:.1%} | {r['seconds']} |")
    write_results(results_folder(args), "ngram_branch", {"meta": meta, "rows": rows}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
