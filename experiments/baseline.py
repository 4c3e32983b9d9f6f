"""The bag-of-words bar: TF-IDF (word 1-2 grams, sublinear tf) + logistic regression on IMDB.

    python -m experiments.baseline --data ../shared/imdb

Fitted on the same training split classify.train uses by default (25,000 train reviews minus the
2,500 seeded, stratified validation reviews), and on all 25,000 for reference; scored on the
official 25,000-review test split. Uses the same model as ``classify.evaluate --baseline``.
Results: experiments/results/baseline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from classify.data import load_split, training_split
from classify.evaluate import baseline_probabilities

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.baseline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.environ.get("CLASSIFY_DATA", "../shared/imdb"))
    p.add_argument("--val-size", type=int, default=2500)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    test = load_split(args.data, "test")
    y = np.asarray(test.labels)
    train, _ = training_split(args.data, args.val_size, args.seed)
    rows = {}
    for name, examples in (("train minus validation (same split as classify.train)", train),
                           ("all 25,000 train reviews", load_split(args.data, "train"))):
        start = time.monotonic()
        probs = baseline_probabilities(examples, test.texts, 2)
        seconds = time.monotonic() - start
        rows[name] = {"train_examples": len(examples), "test_accuracy": float((probs.argmax(1) == y).mean()),
                      "fit_and_predict_seconds": round(seconds, 1)}
        print(f"{name}: test accuracy {rows[name]['test_accuracy']:.4f} ({seconds:.0f}s)", flush=True)
    RESULTS.mkdir(exist_ok=True)
    record = {"command": "python -m experiments.baseline " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
              "load_average_at_end": os.getloadavg(), "model": "TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, "
              "min_df=2) + LogisticRegression(max_iter=1000)", "results": rows}
    (RESULTS / "baseline.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
