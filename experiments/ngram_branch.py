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

Beside validation and test accuracy, each variant's failure rates on the behavioural suite's labelled sentences
(``classify.behaviour``; all of them, and the negated positives and negatives): the suite is only scored, never
used to choose.

Each variant costs 1-4 minutes on one core (features, liblinear; tokenizing once per vocabulary).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from classify.behaviour import build_suite, score, suite_texts, summary
from classify.text.prepare import Preprocessing
from classify.ngrams import NgramBag, bag_logits, describe, self_train_ngram_bag
from classify.text.data import Examples, load_split, normalize, training_split
from classify.text.edits import Lexicon, negation_pairs
from classify.text.tokenize import CLAUSE_BREAKS, NEGATORS, token_ids, train_tokenizer

from . import add_results_args, results_folder
from .trainruns import experiment_meta, write_results

ORDERS = 3
PLAIN = {"vocab": 30_000, "len": 512, "buckets": 4_194_301, "skip": False, "head": 0, "tail": 0, "self": False,
         "neg": 0, "edits": 0}
DEFAULT_VARIANTS = ("", "self", "skip", "head=30,tail=60", "skip,head=30,tail=60",
                    "skip,head=30,tail=60,buckets=16777259", "skip,head=30,tail=60,buckets=16777259,self",
                    "len=100000", "vocab=200000", "skip,head=30,tail=60,buckets=16777259,neg=4")


def parse_variant(text: str) -> dict:
    """'skip,tail=60,buckets=16777259' -> PLAIN with those changes"""
    variant = dict(PLAIN)
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key not in PLAIN or (value == "") != isinstance(PLAIN[key], bool) or (value and not value.isdigit()):
            raise argparse.ArgumentTypeError(f"a variant is a comma-separated list of skip, self, head=N, tail=N, "
                                             f"buckets=N, vocab=N, len=N, neg=N, edits=P; got {text!r}")
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.ngram_branch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="../shared/imdb", help="a source with train, test and unsupervised splits")
    p.add_argument("--variants", type=parse_variant, nargs="+", default=[parse_variant(v) for v in DEFAULT_VARIANTS],
                   help="changes to plain 1-3-grams, e.g. 'skip,head=30,tail=60,buckets=16777259,self' ('' = none)")
    p.add_argument("--c", type=float, default=1.0, help="the logistic regression's inverse L2 strength")
    p.add_argument("--seed", type=int, default=0, help="the validation split's seed")
    p.add_argument("--threads", type=int, default=1)
    add_results_args(p, "ngram_branch.json and .md")
    args = p.parse_args(argv)
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
        bag = NgramBag(size, 2, ORDERS, v["buckets"], 0, v["skip"], v["head"], v["tail"], v["neg"],
                       tuple(token_ids(tokenizer, NEGATORS)), tuple(token_ids(tokenizer, CLAUSE_BREAKS)))
        weights = np.repeat([1.0, v["edits"] / 100], [len(train), len(edits.texts) if v["edits"] else 0])
        self_train_ngram_bag(bag, ids["train"] + (ids["edits"] if v["edits"] else []),
                             train.labels + (edits.labels if v["edits"] else []),
                             encode(v, "unlabelled", unlabelled) if v["self"] else [], args.c, weights=weights)
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
