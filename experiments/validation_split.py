"""Does a validation split flatter? A memorisation probe for the random and the grouped split.

    python -m experiments.validation_split --data ../shared/imdb --record

The probe is a logistic regression on rare words only (words in 2..50 training reviews: titles,
characters, actors, plot nouns). Such words say little about sentiment in general, but a lot about
other reviews of the same movie, so the probe's validation accuracy rises above its test accuracy
exactly as far as validation shares movies with training (the test split shares none). For each
split the table gives the probe's validation and test accuracy and the gap; a split that does not
flatter has a gap near zero. Splits compared:

* ``random``: the stratified random split used before (``--split random``);
* ``grouped``: ``classify.review_groups`` on the rows in file order (movie order for aclImdb ids);
* ``grouped, shuffled rows``: the same on the rows shuffled, as a source without movie order (the
  hub's tar order) would give them: groups then come from rare-word similarity alone.
"""

from __future__ import annotations

import argparse
import sys
import numpy as np

from classify.text.data import load_split, stratified_split
from classify.text.review_groups import grouped_split, review_groups

from . import add_results_args, results_folder
from .trainruns import experiment_meta, write_results


def probe_accuracy(train_texts: list[str], train_labels: list[int], eval_sets: dict[str, tuple[list[str], list[int]]]
                   ) -> dict[str, float]:
    """Fit the rare-word probe on the training part; its accuracy on each evaluation set."""
    from sklearn.feature_extraction.text import CountVectorizer
    from sklearn.linear_model import LogisticRegression

    vectorizer = CountVectorizer(binary=True, min_df=2, max_df=50, token_pattern=r"(?u)\b[^\W\d_]{2,}\b")
    probe = LogisticRegression(C=1.0, max_iter=2000).fit(vectorizer.fit_transform(train_texts), train_labels)
    return {name: float((probe.predict(vectorizer.transform(texts)) == np.asarray(labels)).mean())
            for name, (texts, labels) in eval_sets.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.validation_split", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="../shared/imdb", help="a source with train and test splits")
    p.add_argument("--val-size", type=int, default=2500)
    p.add_argument("--seed", type=int, default=0)
    add_results_args(p, "validation_split.json and .md")
    args = p.parse_args(argv)

    full, test = load_split(args.data, "train"), load_split(args.data, "test")
    shuffled = np.random.default_rng(args.seed).permutation(len(full)).tolist()
    groups, method = review_groups(full.texts, full.labels)
    shuffled_labels = [full.labels[i] for i in shuffled]
    shuffled_groups, shuffled_method = review_groups([full.texts[i] for i in shuffled], shuffled_labels)
    _, shuffled_val = grouped_split(shuffled_labels, shuffled_groups, args.val_size, args.seed)
    splits = {
        "random": stratified_split(full.labels, args.val_size, args.seed)[1],
        f"grouped ({method})": grouped_split(full.labels, groups, args.val_size, args.seed)[1],
        f"grouped, shuffled rows ({shuffled_method})": sorted(shuffled[i] for i in shuffled_val),
    }
    rows = []
    for name, val in splits.items():
        chosen = set(val)
        train = [i for i in range(len(full)) if i not in chosen]
        acc = probe_accuracy([full.texts[i] for i in train], [full.labels[i] for i in train],
                             {"val": ([full.texts[i] for i in val], [full.labels[i] for i in val]),
                              "test": (test.texts, test.labels)})
        rows.append({"split": name, "val_size": len(val), "probe_val_accuracy": acc["val"],
                     "probe_test_accuracy": acc["test"], "gap": acc["val"] - acc["test"]})
        print(f"{name}: probe val {acc['val']:.4f} test {acc['test']:.4f}", flush=True)
    meta = experiment_meta("experiments.validation_split", argv if argv is not None else sys.argv[1:])
    lines = [f"Command: `{meta['command']}` ({meta['date']})", "",
             "| split | validation reviews | probe val acc | probe test acc | gap (val - test) |", "|---|---|---|---|---|"]
    lines += [f"| {r['split']} | {r['val_size']} | {r['probe_val_accuracy']:.4f} | {r['probe_test_accuracy']:.4f} | "
              f"{100 * r['gap']:+.2f} pts |" for r in rows]
    write_results(results_folder(args), "validation_split", {"meta": meta, "rows": rows}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
