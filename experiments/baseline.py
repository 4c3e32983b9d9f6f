"""The bag-of-words bar: TF-IDF (word 1-2 grams, sublinear tf) + logistic regression on IMDB.

    python -m experiments.baseline --data ../shared/imdb

Two versions of ``classify.evaluate``'s baseline model, both scored once on the official 25,000-review
test split: with scikit-learn's default regularisation (C = 1, what ``classify.evaluate --baseline``
uses), and with C chosen on the validation split from ``--grid``, a fairer bar for a model whose own
settings were chosen on validation. Each is fitted on the training split classify.train uses by
default (25,000 train reviews minus the 2,500 seeded, stratified validation reviews); the tuned one
is also refitted on all 25,000 for reference. Results: experiments/results/baseline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from classify.data import Examples, load_split, normalize, training_split
from classify.evaluate import baseline_model

RESULTS = Path(__file__).resolve().parent / "results"


class Features:
    """The TF-IDF features of one training set, fitted once, for logistic regressions of several C."""

    def __init__(self, train: Examples):
        self.model = baseline_model()
        self.features = self.model[:-1].fit_transform([normalize(t) for t in train.texts])
        self.labels = np.asarray(train.labels)

    def accuracy(self, c: float, examples: Examples) -> float:
        self.model[-1].set_params(C=c).fit(self.features, self.labels)
        return float((self.model.predict([normalize(t) for t in examples.texts]) == np.asarray(examples.labels)).mean())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.baseline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.environ.get("CLASSIFY_DATA", "../shared/imdb"))
    p.add_argument("--val-size", type=int, default=2500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grid", type=float, nargs="+", default=[0.3, 1, 3, 10, 30, 100],
                   help="values of C tried on the validation split")
    p.add_argument("--results", type=Path, default=RESULTS, help="where baseline.json goes")
    args = p.parse_args(argv)

    test = load_split(args.data, "test")
    train, val = training_split(args.data, args.val_size, args.seed)
    start = time.monotonic()
    features = Features(train)
    val_accuracy = {c: features.accuracy(c, val) for c in args.grid}
    best_c = max(args.grid, key=lambda c: val_accuracy[c])
    print("validation accuracy by C: " + ", ".join(f"{c:g}: {a:.4f}" for c, a in val_accuracy.items()), flush=True)
    rows = {}
    for name, c, fitted in (("C=1, train minus validation (same split as classify.train)", 1.0, features),
                            (f"C={best_c:g} (tuned on validation), train minus validation", best_c, features),
                            (f"C={best_c:g} (tuned on validation), all 25,000 train reviews", best_c, None)):
        fitted = fitted or Features(load_split(args.data, "train"))
        rows[name] = {"C": c, "train_examples": len(fitted.labels), "test_accuracy": fitted.accuracy(c, test)}
        print(f"{name}: test accuracy {rows[name]['test_accuracy']:.4f}", flush=True)
    seconds = time.monotonic() - start
    args.results.mkdir(parents=True, exist_ok=True)
    record = {"command": "python -m experiments.baseline " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
              "load_average_at_end": os.getloadavg(), "seconds_all_fits": round(seconds, 1),
              "model": "TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=2) + LogisticRegression(C, max_iter=1000)",
              "validation_accuracy_by_C": {f"{c:g}": a for c, a in val_accuracy.items()}, "results": rows}
    (args.results / "baseline.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
