"""The n-gram branch alone: what its vocabulary, its view of long reviews and self-training buy.

    python -m experiments.ngram_branch --data ../shared/imdb --record

The branch (``classify.ngrams``) is fitted as ``classify.train`` fits it, on the training part of the
default grouped split, and scored alone on the validation part and the test split. Variants:

* ``vocab``: the word tokenizer's vocabulary (the branch sees only words the tokenizer knows; with its
  minimum count of 2, a vocabulary of 200,000 asked for is every word seen twice);
* ``max_len``: the tokens kept per review (head+tail); the transformer needs a cut, the branch less so;
* ``self-train``: fitted, then the source's unlabelled reviews labelled by that fit, then fitted again on
  both (``--ngram-self-train``, ``classify.ngrams.self_train_ngram_bag``).

Each variant costs 1.5-4 minutes on one core (tokenizing, features, liblinear).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from classify.inference import encode_reviews
from classify.ngrams import NgramBag, bag_logits, self_train_ngram_bag
from classify.text.data import load_split, normalize, training_split
from classify.text.tokenize import train_tokenizer

from . import add_results_args, results_folder
from .trainruns import experiment_meta, write_results

ORDERS, BUCKETS = 3, 4_194_301


def parse_variant(text: str) -> tuple[int, int, bool]:
    """'VOCAB:MAX_LEN[:self]' -> (vocab, max_len, self_train)"""
    parts = text.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "self"):
        raise argparse.ArgumentTypeError(f"a variant is VOCAB:MAX_LEN or VOCAB:MAX_LEN:self, got {text!r}")
    return int(parts[0]), int(parts[1]), len(parts) == 3


def accuracy(bag: NgramBag, ids: list[list[int]], labels: list[int]) -> float:
    return float((bag_logits(bag, ids).argmax(dim=1).numpy() == np.asarray(labels)).mean())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.ngram_branch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="../shared/imdb", help="a source with train, test and unsupervised splits")
    p.add_argument("--variants", type=parse_variant, nargs="+",
                   default=[parse_variant(v) for v in ("30000:512", "30000:512:self", "30000:100000", "200000:512")],
                   help="VOCAB:MAX_LEN, with :self for self-training on the unlabelled reviews")
    p.add_argument("--c", type=float, default=1.0, help="the logistic regression's inverse L2 strength")
    p.add_argument("--seed", type=int, default=0, help="the validation split's seed")
    p.add_argument("--threads", type=int, default=1)
    add_results_args(p, "ngram_branch.json and .md")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    train, val = training_split(args.data, None, args.seed)
    test = load_split(args.data, "test")
    unlabelled = (load_split(args.data, "unsupervised", labelled=False).texts
                  if any(self_train for *_, self_train in args.variants) else [])
    rows = []
    for vocab, max_len, self_train in args.variants:
        start = time.monotonic()
        tokenizer = train_tokenizer([normalize(t) for t in train.texts], vocab, "word")
        size = tokenizer.get_vocab_size()

        def encode(texts: list[str]) -> list[list[int]]:
            return encode_reviews(tokenizer, texts, max_len, "head+tail")

        bag = NgramBag(size, 2, ORDERS, BUCKETS, pad_id=0)
        self_train_ngram_bag(bag, encode(train.texts), train.labels, encode(unlabelled) if self_train else [], args.c)
        row = {"vocab_asked": vocab, "vocab": size, "max_len": max_len, "self_train": self_train,
               "unlabelled": len(unlabelled) if self_train else 0,
               "val_accuracy": accuracy(bag, encode(val.texts), val.labels),
               "test_accuracy": accuracy(bag, encode(test.texts), test.labels),
               "seconds": round(time.monotonic() - start)}
        rows.append(row)
        print(row, flush=True)
    meta = experiment_meta("experiments.ngram_branch", argv if argv is not None else sys.argv[1:])
    lines = [f"Command: `{meta['command']}` ({meta['date']}); {len(train)} training / {len(val)} validation reviews "
             f"(grouped split, seed {args.seed}), 1-{ORDERS} grams in {BUCKETS:,} slots, C = {args.c}, "
             f"{args.threads} thread(s).", "",
             "| vocabulary | tokens kept | self-trained on | val acc | test acc | seconds |", "|---|---|---|---|---|---|"]
    for r in rows:
        extra = f"{r['unlabelled']:,} unlabelled" if r["self_train"] else "-"
        lines.append(f"| {r['vocab']:,} | {r['max_len']} | {extra} | {r['val_accuracy']:.4f} | "
                     f"{r['test_accuracy']:.4f} | {r['seconds']} |")
    write_results(results_folder(args), "ngram_branch", {"meta": meta, "rows": rows}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
