"""python -m classify.evaluate: a full report on a trained run, optionally against bag-of-n-grams baselines.

    python -m classify.evaluate --model runs/imdb --data ../shared/imdb --split test --baseline \
        --counterfactual ../shared/imdb-counterfactual

Predicts the split batched and length-bucketed as ``classify.predict`` does, computes
scikit-learn metrics (accuracy with a bootstrap CI, per-class and macro precision/recall/F1,
ROC-AUC, log-loss, confusion matrix, calibration), and writes ``metrics.json``,
``report.md`` and PNG plots to the report folder (``classify.report``). Every system is scored: the model,
each of its branches alone (a model with an n-gram branch), and the baselines. Beside the split's metrics:

* accuracy by text length (``LENGTH_BINS``, in the tokens the model reads);
* the behavioural suite (``classify.behaviour``): failure rates on short typed sentences by capability
  (negation, contrast, ...) and under perturbations that must not change the answer;
* with ``--counterfactual``, the held-out edited reviews whose label flipped (``text.counterfactual``).

``--baseline`` trains TF-IDF (word 1-2 grams, sublinear tf) + logistic regression and an NBSVM-style model on
exactly the training split the run used (``data.training_split`` with the run's config), with their
regularisation C chosen on the run's validation split, and scores them on the same examples.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.markup import escape

from .backends import TorchBackend, batched_branches, batched_logits
from .engine.config import HelpFormatter, InferenceConfig, add_flags, recorded
from .engine.files import read_jsonl, write_json
from .engine.progress import progress_bar
from .engine.runfolder import METRICS
from .errors import ClassifyError, run_cli
from .behaviour import build_suite, score, suite_texts, summary
from .inference import LoadedRun, open_run, softmax
from .mix import mixed_logits
from .report import print_summary, write_markdown, write_plots
from .text.counterfactual import load_pairs
from .text.data import Examples, default_source, load_split, normalize, training_split
from .train_config import TrainConfig

MODEL = "model"
TRANSFORMER_ALONE = "transformer alone"
NGRAM_ALONE = "n-gram branch alone"
MISTAKE_CHARS = 2000  # text kept per confident mistake in metrics.json / report.md
# Accuracy by length, in the tokens the model reads (512 = truncated: the review was longer).
LENGTH_BINS = ((1, 16), (17, 64), (65, 256), (257, 511), (512, None))


# -------------------------------------------------------------------------- systems
def run_probabilities(run: LoadedRun, texts: list[str], batch_size: int,
                      progress=None) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Class probabilities (N, C) of the model and, on the PyTorch backend with an n-gram branch, of each branch
    alone (float64, rows summing to 1); and each text's length in the tokens the model read, (N,)."""
    ids = run.preprocessing.ids(texts)
    if not isinstance(run.backend, TorchBackend):   # an export runs the whole model only
        logits = {MODEL: batched_logits(run.backend, ids, batch_size, progress=progress)}
        lengths = np.array([max(1, len(x)) for x in ids])
    else:
        parts = batched_branches(run.backend, ids, batch_size, progress)
        logits, lengths = {MODEL: parts.transformer}, parts.lengths
        if parts.ngram is not None:
            mix = run.model.mix.double().cpu().numpy()
            logits = {MODEL: mixed_logits(mix, *parts), TRANSFORMER_ALONE: parts.transformer, NGRAM_ALONE: parts.ngram}
    # Renormalised in float64: scikit-learn checks that rows sum to 1 within 1e-8.
    probs = {name: softmax(z).astype(np.float64) for name, z in logits.items()}
    return {name: p / p.sum(axis=1, keepdims=True) for name, p in probs.items()}, lengths


def length_slices(lengths: np.ndarray, y: np.ndarray, probabilities: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """Accuracy of every system within each of ``LENGTH_BINS`` (None where a bin is empty)."""
    out = []
    for low, high in LENGTH_BINS:
        inside = (lengths >= low) & (lengths <= (high if high is not None else np.inf))
        out.append({"tokens": f"{low}-{high}" if high else f"{low}+", "examples": int(inside.sum()),
                    "accuracy": {name: float((p[inside].argmax(1) == y[inside]).mean()) if inside.any() else None
                                 for name, p in probabilities.items()}})
    return out


def behaviour_report(predict: dict[str, Any], seed: int) -> dict[str, Any]:
    """The behavioural suite for each system; ``predict``: name -> callable(texts) -> probabilities (N, C)."""
    suite = build_suite(seed=seed)
    texts = suite_texts(suite)
    systems = {}
    for name, probabilities in predict.items():
        scores = score(suite, probabilities(texts).argmax(axis=1))
        systems[name] = {"failure_rate": summary(scores), "capabilities": scores}
    return {"cases": sum(len(c.texts) for c in suite), "seed": seed, "systems": systems}


def counterfactual_report(path: str, predict: dict[str, Any]) -> dict[str, Any]:
    """Accuracy on the held-out counterfactual pairs: originals (IMDB training reviews), their revisions (never
    trained on), and both right; ``predict`` as in ``behaviour_report``."""
    pairs = load_pairs(path, held_out=True)
    both = pairs.texts()
    y = np.asarray(both.labels)
    systems = {}
    for name, probabilities in predict.items():
        right = probabilities(both.texts).argmax(axis=1) == y
        original, revised = right[: len(pairs)], right[len(pairs):]
        systems[name] = {"original": float(original.mean()), "revised": float(revised.mean()),
                         "both": float((original & revised).mean())}
    return {"source": path, "pairs": len(pairs), "systems": systems}


# -------------------------------------------------------------------------- metrics
def expected_calibration_error(y: np.ndarray, probs: np.ndarray, bins: int) -> float:
    """Top-label ECE (Guo et al. 2017): |accuracy - confidence| averaged over equal-width confidence
    bins, weighted by the bins' sizes."""
    confidence = probs.max(axis=1)
    correct = probs.argmax(axis=1) == y
    which = np.minimum((confidence * bins).astype(int), bins - 1)
    gap = np.abs(np.bincount(which, weights=correct, minlength=bins) - np.bincount(which, weights=confidence,
                                                                                     minlength=bins))
    return float(gap.sum() / len(y))  # sum_b |sum correct - sum confidence| / N == sum_b n_b/N |acc_b - conf_b|


def classification_metrics(y: np.ndarray, probs: np.ndarray, labels: list[str], bins: int) -> dict[str, Any]:
    """Everything in the report for one system's probabilities ``probs`` (N, C) against labels ``y``."""
    from sklearn.calibration import calibration_curve
    from sklearn.metrics import (
        accuracy_score,
        confusion_matrix,
        log_loss,
        precision_recall_fscore_support,
        roc_auc_score,
    )

    classes = list(range(len(labels)))
    predicted = probs.argmax(axis=1)
    precision, recall, f1, support = precision_recall_fscore_support(y, predicted, labels=classes, zero_division=0)
    out: dict[str, Any] = {
        "accuracy": float(accuracy_score(y, predicted)),
        "precision_macro": float(precision.mean()), "recall_macro": float(recall.mean()), "f1_macro": float(f1.mean()),
        "per_class": {name: {"precision": float(precision[k]), "recall": float(recall[k]), "f1": float(f1[k]),
                             "support": int(support[k])} for k, name in enumerate(labels)},
        "log_loss": float(log_loss(y, probs, labels=classes)),
        "ece": expected_calibration_error(y, probs, bins),
        "confusion_matrix": confusion_matrix(y, predicted, labels=classes).tolist(),
        "roc_auc": None,
        "reliability": None,
    }
    if len(labels) == 2 and len(np.unique(y)) == 2:  # both need both classes present
        out["roc_auc"] = float(roc_auc_score(y, probs[:, 1]))
        fraction, mean = calibration_curve(y, probs[:, 1], n_bins=bins, strategy="uniform")
        out["reliability"] = {"class": labels[1], "mean_predicted": mean.round(6).tolist(),
                              "fraction_positive": fraction.round(6).tolist()}
    return out


def bootstrap_accuracy(correct: dict[str, np.ndarray], resamples: int, seed: int) -> dict[str, list[float]]:
    """Percentile 95% intervals for each system's accuracy and for the first system minus each other one.

    Paired: every resample draws the same review indices for all systems. Vectorised over
    blocks of resamples so memory stays at ~100 x N indices."""
    rng = np.random.default_rng(seed)
    names = list(correct)
    n = len(next(iter(correct.values())))
    samples: dict[str, list[np.ndarray]] = {name: [] for name in names}
    for start in range(0, resamples, 100):
        idx = rng.integers(0, n, size=(min(100, resamples - start), n))
        for name in names:
            samples[name].append(correct[name][idx].mean(axis=1))
    stacked = {name: np.concatenate(s) for name, s in samples.items()}
    for other in names[1:]:
        stacked[f"{names[0]} - {other}"] = stacked[names[0]] - stacked[other]
    return {name: np.percentile(s, [2.5, 97.5]).round(6).tolist() for name, s in stacked.items()}


def confident_mistakes(data: Examples, rows: np.ndarray, probs: np.ndarray, labels: list[str],
                       k: int) -> list[dict[str, Any]]:
    """The ``k`` wrong predictions made with the highest probability, with their (normalised) texts."""
    y = np.asarray(data.labels)
    predicted = probs.argmax(axis=1)
    wrong = np.flatnonzero(predicted != y)
    wrong = wrong[np.argsort(-probs[wrong, predicted[wrong]], kind="stable")][:k]
    mistakes = []
    for i in wrong:
        text = normalize(data.texts[i])
        mistakes.append({"row": int(rows[i]), "label": labels[y[i]], "predicted": labels[predicted[i]],
                         "probability": round(float(probs[i, predicted[i]]), 6),
                         "text": text if len(text) <= MISTAKE_CHARS else text[: MISTAKE_CHARS - 1] + "…"})
    return mistakes


# ------------------------------------------------------------------------ baselines
@dataclass(frozen=True)
class BaselineKind:
    description: str
    grid: tuple[float, ...]   # the Cs tried on validation


BASELINES = {
    # IMDB picks C = 30 (experiments/results/baseline.json).
    "tfidf": BaselineKind("TF-IDF (word 1-2 grams, sublinear tf, min_df 2) + logistic regression",
                          (0.3, 1.0, 3.0, 10.0, 30.0, 100.0)),
    # NBSVM (Wang & Manning 2012) with a logistic regression: the strongest bag-of-n-grams model measured here.
    "nbsvm": BaselineKind("naive-Bayes-weighted binary word 1-3 grams + logistic regression (NBSVM-style)",
                          (0.1, 0.3, 1.0, 3.0)),
}
BASELINE_C_GRID = BASELINES["tfidf"].grid


def _naive_bayes_scaler() -> Any:
    """A scikit-learn transformer: binary n-gram counts -> counts times their naive-Bayes log-count ratio."""
    from sklearn.base import BaseEstimator, TransformerMixin

    from .ngrams import naive_bayes_ratios

    class NaiveBayesScaler(TransformerMixin, BaseEstimator):
        def fit(self, features, labels):
            self.ratios_ = naive_bayes_ratios(features, np.asarray(labels))
            return self

        def transform(self, features):
            return features.multiply(self.ratios_).tocsr()

    return NaiveBayesScaler()


def baseline_model(kind: str = "tfidf") -> Any:
    """A bag-of-n-grams baseline (``BASELINES``), unfitted, C set by ``fit_baseline``. Fit it on
    ``normalize``d texts."""
    from sklearn.feature_extraction.text import CountVectorizer, TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    if kind == "nbsvm":
        return make_pipeline(CountVectorizer(ngram_range=(1, 3), binary=True, token_pattern=r"(?u)\b\w+\b|[!?]"),
                             _naive_bayes_scaler(), LogisticRegression(solver="liblinear", max_iter=1000))
    return make_pipeline(TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=2),
                         LogisticRegression(max_iter=1000))


@dataclass
class Baseline:
    """A fitted ``baseline_model``, its C, and the validation accuracy of each C tried."""

    kind: str
    model: Any
    c: float
    validation_accuracy: dict[float, float]

    def probabilities(self, texts: list[str], num_classes: int) -> np.ndarray:
        """texts -> class probabilities, shape (len(texts), num_classes)."""
        probs = np.zeros((len(texts), num_classes))
        probs[:, self.model.classes_] = self.model.predict_proba([normalize(t) for t in texts])
        return probs


def fit_baseline(train: Examples, val: Examples | None, grid: tuple[float, ...] | None = None,
                 kind: str = "tfidf", refit: bool = False) -> Baseline:
    """``baseline_model(kind)`` fitted on ``train``, with C the most accurate of ``grid`` (default: the
    kind's) on ``val`` (the same protocol as the transformer's own settings; scikit-learn's default C = 1
    is a point worse for TF-IDF on IMDB's test split). One C in ``grid`` needs no ``val``. The features
    are fitted once; ``refit``: then the whole pipeline again, with that C, on ``train`` and ``val``
    together (as ``classify.train --ngram-refit`` fits its n-gram branch)."""
    grid = tuple(sorted(grid or BASELINES[kind].grid))  # ascending: of equally accurate Cs the first wins
    if len(grid) > 1 and (val is None or len(val) == 0):
        raise ValueError("choosing C from a grid needs validation examples")
    from sklearn.base import clone

    model = baseline_model(kind)
    labels = np.asarray(train.labels)
    features = model[:-1].fit_transform([normalize(t) for t in train.texts], labels)
    fitted = {c: clone(model[-1]).set_params(C=c).fit(features, labels) for c in grid}
    scores: dict[float, float] = {}
    if len(grid) > 1:
        val_features = model[:-1].transform([normalize(t) for t in val.texts])
        scores = {c: float((classifier.predict(val_features) == np.asarray(val.labels)).mean())
                  for c, classifier in fitted.items()}
    c = max(grid, key=lambda c: scores.get(c, 0.0))
    if refit and val is not None and len(val):
        model.set_params(**{f"{model.steps[-1][0]}__C": c})
        model.fit([normalize(t) for t in train.texts + val.texts], np.concatenate([labels, val.labels]))
    else:
        model.steps[-1] = (model.steps[-1][0], fitted[c])  # the chosen classifier, not fitted again
    return Baseline(kind, model, c, scores)


def run_training_split(config: dict[str, Any], source: str | None) -> tuple[Examples, Examples]:
    """The (train, validation) split a run was trained on, rebuilt from its config.json (``source``
    overrides where the data is, for data that moved)."""
    train = config.get("train") or {}
    missing = [k for k in ("data", "val_size", "seed") if k not in train]
    if missing:
        raise ClassifyError(f"--baseline: the run's config.json has no train.{missing[0]}, so its training "
                            f"split cannot be rebuilt")
    try:
        return training_split(source or train["data"], train["val_size"], train["seed"], train.get("limit"),
                              recorded(TrainConfig, train, "split"))
    except ClassifyError as err:
        raise ClassifyError(f"--baseline needs the run's training data: {err} (pass --train-data if it moved)") from None


# ------------------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m classify.evaluate",
        description="Evaluate a trained run on a labelled split: metrics, calibration, plots, the most confident "
                    "mistakes, and optionally a TF-IDF + logistic-regression baseline side by side.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", help="run folder (default: the newest run under runs/ with model.safetensors)")
    p.add_argument("--data", help="hub id, folder of {train,test}.parquet, aclImdb folder, or a labelled "
                                  "CSV/JSONL/parquet file (whole file) (default: the run's training source)")
    p.add_argument("--split", default="test", help="split of --data to evaluate on")
    p.add_argument("--output", help="report folder (default: RUN/eval-SPLIT)")
    p.add_argument("--limit", type=int, help="evaluate a seeded random sample of N reviews (quick looks)")
    p.add_argument("--baseline", nargs="*", choices=sorted(BASELINES), metavar="KIND",
                   help="also train bag-of-n-grams baselines on the run's training split (C chosen on its validation "
                        "split; then fitted on both if the run's n-gram branch was, --ngram-refit) and compare: "
                        "tfidf (TF-IDF 1-2 grams + logistic regression), nbsvm (naive-Bayes-weighted 1-3 grams + "
                        "logistic regression); the flag alone trains both")
    p.add_argument("--counterfactual", metavar="PATH",
                   help="also score the held-out counterfactual pairs in PATH (a folder with train.parquet, e.g. "
                        "../shared/imdb-counterfactual): IMDB training reviews and their revisions edited so that "
                        "the label flips; the revisions of the held-out quarter are never trained on")
    p.add_argument("--train-data", help="where the run's training data is now, for --baseline (default: the "
                                        "source in the run's config.json)")
    p.add_argument("--bins", type=int, default=10, help="equal-width bins for ECE and the reliability curve")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples for the accuracy CIs")
    p.add_argument("--seed", type=int, default=0, help="seed of the bootstrap and of --limit")
    p.add_argument("--mistakes", type=int, default=10, help="most confident mistakes to list")
    add_flags(p, InferenceConfig)
    p.add_argument("--batch-size", type=int, default=64, help="reviews per forward pass (length-bucketed)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for flag in ("bins", "bootstrap", "batch_size"):
        if getattr(args, flag) <= 0:
            raise ClassifyError(f"--{flag.replace('_', '-')} must be positive")
    console = Console(stderr=True, quiet=args.quiet)
    run = open_run(args.model, args, console)
    source = args.data or (run.config.get("train") or {}).get("data") or default_source()
    data = load_split(source, args.split, num_classes=len(run.labels))
    rows = np.arange(len(data))
    if args.limit is not None and 0 < args.limit < len(data):
        rows = np.sort(np.random.default_rng(args.seed).permutation(len(data))[: args.limit])
        data = data.subset(rows)
    trained_on = (run.config.get("train") or {}).get("data")
    if Path(source).is_file() and trained_on and Path(trained_on).resolve() == Path(source).resolve():
        console.print(f"[yellow]note:[/] {escape(source)} is the run's own training file: these numbers include "
                      f"examples it was trained on")
    out = Path(args.output) if args.output else run.path / f"eval-{args.split}"
    y = np.asarray(data.labels)

    start = time.monotonic()
    with progress_bar(len(data), not args.quiet) as update:
        probabilities, lengths = run_probabilities(run, data.texts, args.batch_size,
                                                   progress=lambda done: update(done, f"{done} reviews"))
    seconds = {MODEL: round(time.monotonic() - start, 2)}
    kinds = [] if args.baseline is None else (args.baseline or list(BASELINES))
    baselines: dict[str, Baseline] = {}
    if kinds:
        train, val = run_training_split(run.config, args.train_data)
        # A model whose n-gram branch was fitted again on all labelled reviews meets baselines fitted so too.
        refit = (recorded(TrainConfig, run.config.get("train", {}), "ngram_refit")
                 and run.config["model"].get("ngram_orders", 0) > 0)
    for kind in dict.fromkeys(kinds):
        start = time.monotonic()
        console.print(f"baseline {kind}: {BASELINES[kind].description}, on the run's {len(train)} training "
                      f"reviews, C chosen on its {len(val)} validation reviews"
                      + (", then fitted again on both, as the model's n-gram branch was" if refit else ""))
        baselines[kind] = fit_baseline(train, val, kind=kind, refit=refit)
        probabilities[kind] = baselines[kind].probabilities(data.texts, len(run.labels))
        seconds[kind] = round(time.monotonic() - start, 2)

    systems = {name: classification_metrics(y, p, run.labels, args.bins) for name, p in probabilities.items()}
    intervals = bootstrap_accuracy({name: (p.argmax(axis=1) == y).astype(np.float64)
                                    for name, p in probabilities.items()}, args.bootstrap, args.seed)
    for name, metrics in systems.items():
        metrics["accuracy_ci95"] = intervals[name]
    metrics: dict[str, Any] = {
        "model": str(run.path), "data": source, "split": args.split, "examples": len(data),
        "limit": args.limit, "labels": run.labels, "bins": args.bins, "bootstrap_resamples": args.bootstrap,
        "seed": args.seed, "systems": systems, "seconds": seconds,
    }
    if baselines:
        metrics["baselines"] = {
            kind: {"description": f"{BASELINES[kind].description} (C = {b.c:g}, the best on the run's validation "
                                  f"split of {', '.join(f'{c:g}' for c in b.validation_accuracy)}), trained on the "
                                  f"run's training split",
                   "training_examples": len(train), "C": b.c,
                   "validation_accuracy_by_C": {f"{c:g}": a for c, a in b.validation_accuracy.items()},
                   "model_minus_baseline": systems[MODEL]["accuracy"] - systems[kind]["accuracy"],
                   "difference_ci95": intervals[f"{MODEL} - {kind}"]}
            for kind, b in baselines.items()}
    metrics["length_slices"] = length_slices(lengths, y, probabilities)
    predict = {**system_predictors(run, args.batch_size),
               **{kind: (lambda texts, b=b: b.probabilities(texts, len(run.labels))) for kind, b in baselines.items()}}
    metrics["behaviour"] = behaviour_report(predict, args.seed)
    if args.counterfactual:
        metrics["counterfactual"] = counterfactual_report(args.counterfactual, predict)
    metrics["mistakes"] = confident_mistakes(data, rows, probabilities[MODEL], run.labels, args.mistakes)
    if baselines:
        metrics["baseline_mistakes"] = {kind: confident_mistakes(data, rows, probabilities[kind], run.labels,
                                                                 args.mistakes) for kind in baselines}
    history = _training_history(run.path, console)
    metrics["training"] = _training_summary(history)

    metrics["plots"] = write_plots(out, y, probabilities, metrics, history, console)
    write_json(out / "metrics.json", metrics)
    write_markdown(out / "report.md", metrics)
    print_summary(console, metrics)
    console.print(f"report: {escape(str(out / 'report.md'))}")
    return 0


def system_predictors(run: LoadedRun, batch_size: int) -> dict[str, Any]:
    """name -> callable(texts) -> probabilities for the model and each of its branches, one pass per text list."""
    last: dict[str, Any] = {}

    def system(name: str):
        def probabilities(texts: list[str]) -> np.ndarray:
            if last.get("texts") is not texts:
                last.update(texts=texts, out=run_probabilities(run, texts, batch_size)[0])
            return last["out"][name]
        return probabilities

    branches = isinstance(run.backend, TorchBackend) and run.model.ngram is not None
    names = [MODEL] + ([TRANSFORMER_ALONE, NGRAM_ALONE] if branches else [])
    return {name: system(name) for name in names}


def _training_history(run: Path, console: Console) -> list[dict[str, Any]]:
    """The run's metrics.jsonl (one record per validation), or [] when it is missing or unreadable."""
    try:
        return read_jsonl(run / METRICS)
    except (ValueError, UnicodeDecodeError) as err:
        console.print(f"[yellow]note:[/] no training curves: {escape(str(run / METRICS))} is corrupt ({err})")
        return []


def _training_summary(history: list[dict[str, Any]]) -> dict[str, Any] | None:
    valid = [r for r in history if "val_accuracy" in r]
    if not valid:
        return None
    best = max(valid, key=lambda r: r["val_accuracy"])
    return {"evaluations": len(valid), "last_step": valid[-1].get("step"), "best_step": best.get("step"),
            "best_val_accuracy": best["val_accuracy"], "train_seconds": valid[-1].get("elapsed_s")}


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="classify.evaluate"))
