"""The bag-of-words bar: TF-IDF (word 1-2 grams, sublinear tf) + logistic regression on IMDB.

    python -m experiments.baseline --data ../shared/imdb

Two versions of ``classify.evaluate``'s baseline model, both scored once on the official 25,000-review
test split: with scikit-learn's default regularisation (C = 1), and with C chosen on the validation
split from ``--grid`` (what ``classify.evaluate --baseline`` does), a fairer bar for a model whose own
settings were chosen on validation. Each is fitted on the training split classify.train uses by
default (25,000 train reviews minus the 2,500 seeded, stratified validation reviews); the tuned one
is also refitted on all 25,000 for reference. Results: experiments/results/baseline.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from classify.engine.files import write_json
from classify.evaluate import BASELINE_C_GRID, fit_baseline
from classify.text.data import load_split, training_split

from . import add_results_args, results_folder
from .trainruns import experiment_meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.baseline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.environ.get("CLASSIFY_DATA", "../shared/imdb"))
    p.add_argument("--val-size", type=int, default=2500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grid", type=float, nargs="+", default=list(BASELINE_C_GRID),
                   help="values of C tried on the validation split")
    add_results_args(p, "baseline.json")
    args = p.parse_args(argv)

    test = load_split(args.data, "test")
    train, val = training_split(args.data, args.val_size, args.seed)
    start = time.monotonic()
    tuned = fit_baseline(train, val, tuple(args.grid))
    print("validation accuracy by C: " + ", ".join(f"{c:g}: {a:.4f}" for c, a in tuned.validation_accuracy.items()))
    full = load_split(args.data, "train")
    rows = {}
    for name, examples, baseline in (
            ("C=1, train minus validation (same split as classify.train)", train, fit_baseline(train, None, (1.0,))),
            (f"C={tuned.c:g} (tuned on validation), train minus validation", train, tuned),
            (f"C={tuned.c:g} (tuned on validation), all 25,000 train reviews", full, fit_baseline(full, None, (tuned.c,)))):
        accuracy = float((baseline.probabilities(test.texts, 2).argmax(1) == np.asarray(test.labels)).mean())
        rows[name] = {"C": baseline.c, "train_examples": len(examples), "test_accuracy": accuracy}
        print(f"{name}: test accuracy {accuracy:.4f}", flush=True)
    seconds = time.monotonic() - start
    results_folder(args).mkdir(parents=True, exist_ok=True)
    record = {**experiment_meta("experiments.baseline", argv if argv is not None else sys.argv[1:]),
              "seconds_all_fits": round(seconds, 1),
              "model": "TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=2) + LogisticRegression(C, max_iter=1000)",
              "validation_accuracy_by_C": {f"{c:g}": a for c, a in tuned.validation_accuracy.items()}, "results": rows}
    write_json(results_folder(args) / "baseline.json", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
