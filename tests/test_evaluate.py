"""python -m classify.evaluate: report files, metrics against scikit-learn, the baseline's training split, errors."""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import synthetic_reviews, write_csv
from sklearn.metrics import accuracy_score, f1_score

import torch

from classify.errors import run_cli
from classify.inference import load_run
from classify.text.counterfactual import load_pairs
from classify.evaluate import (run_probabilities, bootstrap_accuracy, classification_metrics, expected_calibration_error, fit_baseline, main,
                               run_training_split)
from classify.report import md
from classify.text.data import load_split, stratified_split, training_split
from classify.text.review_groups import grouped_split, review_groups

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def report(trained_run, counterfactual_data, tmp_path_factory) -> Path:
    """One evaluation with the baseline, shared by the checks below (the run folder is not written to)."""
    out = tmp_path_factory.mktemp("report")
    assert main(["--model", str(trained_run), "--split", "test", "--output", str(out), "--baseline",
                 "--bootstrap", "500", "--mistakes", "3", "--counterfactual", str(counterfactual_data), "--quiet"]) == 0
    return out


def test_report_files_are_written_and_well_formed(report, trained_run):
    metrics = json.loads((report / "metrics.json").read_text())
    assert metrics["examples"] == 200 and metrics["split"] == "test" and metrics["labels"] == ["neg", "pos"]
    assert list(metrics["systems"]) == ["model", "transformer alone", "n-gram branch alone", "tfidf", "nbsvm"]
    for system in metrics["systems"].values():
        assert {"accuracy", "accuracy_ci95", "precision_macro", "recall_macro", "f1_macro", "per_class", "roc_auc",
                "log_loss", "ece", "confusion_matrix", "reliability"} <= set(system)
        lo, hi = system["accuracy_ci95"]
        assert lo <= system["accuracy"] <= hi and 0.8 < system["accuracy"] <= 1
        assert np.sum(system["confusion_matrix"]) == 200
        assert len(system["reliability"]["mean_predicted"]) == len(system["reliability"]["fraction_positive"])
    # The model matches the accuracy train.py measured on the same test split.
    assert metrics["systems"]["model"]["accuracy"] == pytest.approx(
        json.loads((trained_run / "test_metrics.json").read_text())["accuracy"], abs=0.02)
    for kind, grid_size in (("tfidf", 6), ("nbsvm", 4)):
        baseline = metrics["baselines"][kind]
        assert baseline["training_examples"] == 320  # 400 training reviews minus --val-size 80
        by_c = baseline["validation_accuracy_by_C"]  # C chosen on the run's 80 validation reviews
        assert len(by_c) == grid_size and by_c[f"{baseline['C']:g}"] == max(by_c.values())
        lo, hi = baseline["difference_ci95"]
        assert lo <= baseline["model_minus_baseline"] <= hi
        assert baseline["model_minus_baseline"] == (metrics["systems"]["model"]["accuracy"]
                                                          - metrics["systems"][kind]["accuracy"])
    assert len(metrics["mistakes"]) <= 3 and all(m["label"] != m["predicted"] for m in metrics["mistakes"])
    assert metrics["training"]["evaluations"] == 4

    assert sorted(metrics["plots"]) == ["confusion_matrix.png", "reliability.png", "roc_curve.png",
                                        "training_curves.png"]
    for name in metrics["plots"]:
        assert (report / name).read_bytes().startswith(PNG)
    text = (report / "report.md").read_text()
    for heading in ("## Metrics", "## Per class", "## Confusion matrices", "## Calibration",
                    "## Short texts, negation and edits", "## Most confident mistakes (model)",
                    "## Most confident mistakes (tfidf)", "## Most confident mistakes (nbsvm)",
                    "Accuracy difference, model - nbsvm", "| behaviour: failures, all |"):
        assert heading in text
    assert "| metric | model | transformer alone | n-gram branch alone | tfidf | nbsvm |" in text
    assert "](roc_curve.png)" in text
    assert not list(report.glob(".*.tmp")) and not list(trained_run.glob("eval-*"))


def test_report_slices_by_length_and_scores_the_behavioural_suite_for_every_system(report):
    metrics = json.loads((report / "metrics.json").read_text())
    slices = metrics["length_slices"]
    assert [s["tokens"] for s in slices] == ["1-16", "17-64", "65-256", "257-511", "512+"]
    assert sum(s["examples"] for s in slices) == metrics["examples"]
    # Per system, the slices' accuracies weighted by their sizes are its accuracy.
    for name, system in metrics["systems"].items():
        weighted = sum(s["accuracy"][name] * s["examples"] for s in slices if s["examples"])
        assert weighted / metrics["examples"] == pytest.approx(system["accuracy"])
    behaviour = metrics["behaviour"]
    assert list(behaviour["systems"]) == list(metrics["systems"])
    for system in behaviour["systems"].values():
        capabilities = system["capabilities"]
        assert {"vocabulary", "negated positive", "negated negative", "contrast with but", "typos"} <= set(capabilities)
        assert sum(c["cases"] for c in capabilities.values() if c["kind"] == "mft") + sum(
            c["cases"] for c in capabilities.values() if c["kind"] == "inv") == behaviour["cases"]
        failures = sum(c["failures"] for c in capabilities.values())
        assert system["failure_rate"]["all"] == pytest.approx(failures / behaviour["cases"])
        for c in capabilities.values():
            assert c["failure_rate"] == c["failures"] / c["cases"] and len(c["examples"]) == min(3, c["failures"])


def test_report_scores_the_held_out_counterfactual_pairs(report, trained_run, counterfactual_data):
    metrics = json.loads((report / "metrics.json").read_text())
    counterfactual = metrics["counterfactual"]
    assert counterfactual["pairs"] == 10   # pair ids 0, 4, ..., 36 of the 40
    pairs = load_pairs(counterfactual_data, held_out=True)
    run = load_run(trained_run, torch.device("cpu"))
    probabilities, _ = run_probabilities(run, pairs.texts().texts, 64)
    for name, system in counterfactual["systems"].items():
        assert system["both"] <= min(system["original"], system["revised"])
        if name in probabilities:   # the model and its branches: the same answers as predicting the texts directly
            right = probabilities[name].argmax(1) == np.asarray(pairs.texts().labels)
            assert system["original"] == right[:10].mean() and system["revised"] == right[10:].mean()
    # Each revision swaps every sentiment word, and the tiny model reads those words.
    assert counterfactual["systems"]["model"]["revised"] >= 0.7
    assert "| counterfactual revised, accuracy (10 pairs) |" in (report / "report.md").read_text()


def test_metrics_agree_with_scikit_learn():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 500)
    p1 = np.clip(y * 0.6 + rng.normal(0.2, 0.25, 500), 0.01, 0.99)
    probs = np.stack([1 - p1, p1], axis=1)
    metrics = classification_metrics(y, probs, ["neg", "pos"], bins=10)
    assert metrics["accuracy"] == accuracy_score(y, probs.argmax(1))
    assert metrics["f1_macro"] == pytest.approx(f1_score(y, probs.argmax(1), average="macro"))
    assert metrics["per_class"]["pos"]["support"] == int(y.sum())
    # ECE: zero when confidence equals accuracy in every bin, the gap otherwise.
    assert expected_calibration_error(np.array([1, 1, 1, 0]), np.array([[0.25, 0.75]] * 4), 10) == pytest.approx(0)
    assert expected_calibration_error(np.array([1, 1]), np.array([[0.4, 0.6]] * 2), 10) == pytest.approx(0.4)
    # One class only: no ROC-AUC or reliability curve, but the rest still works.
    single = classification_metrics(np.ones(4, int), np.array([[0.2, 0.8]] * 4), ["neg", "pos"], bins=10)
    assert single["roc_auc"] is None and single["reliability"] is None and single["accuracy"] == 1


def test_bootstrap_is_seeded_paired_and_centred():
    rng = np.random.default_rng(1)
    a = (rng.random(2000) < 0.85).astype(float)
    b = a.copy()
    intervals = bootstrap_accuracy({"a": a, "b": b}, 1000, seed=0)
    assert intervals == bootstrap_accuracy({"a": a, "b": b}, 1000, seed=0)
    lo, hi = intervals["a"]
    assert lo < a.mean() < hi and 0.02 < hi - lo < 0.04  # ~ +-1.96 * sqrt(p(1-p)/n)
    assert intervals["a - b"] == [0.0, 0.0]  # identical systems: paired resamples give no difference


def test_baseline_uses_exactly_the_runs_training_split(trained_run, parquet_data):
    run_config = json.loads((trained_run / "config.json").read_text())
    config = run_config["train"]
    assert config["split"] == "grouped"
    train, val = run_training_split(run_config, None)
    full = load_split(str(parquet_data), "train")
    groups, _ = review_groups(full.texts, full.labels)
    train_idx, val_idx = grouped_split(full.labels, groups, config["val_size"], config["seed"])
    assert train.texts == [full.texts[i] for i in train_idx] and val.texts == [full.texts[i] for i in val_idx]
    assert len(val) == config["val_size"]
    # A run from before grouped validation recorded no split: it is rebuilt with the random split it used.
    del run_config["train"]["split"]
    old_train, _ = run_training_split(run_config, None)
    train_idx, _ = stratified_split(full.labels, config["val_size"], config["seed"])
    assert old_train.texts == [full.texts[i] for i in train_idx]
    # --limit: a seeded sample first, then the same split.
    small, small_val = training_split(str(parquet_data), 40, 3, limit=200)
    again, _ = training_split(str(parquet_data), 40, 3, limit=200)
    assert len(small) == 160 and len(small_val) == 40 and small.texts == again.texts
    assert not set(small.texts) & set(small_val.texts)


def test_baseline_takes_the_c_most_accurate_on_validation(parquet_data):
    train, val = training_split(str(parquet_data), 80, 0)
    fitted = fit_baseline(train, val, (0.001, 1.0, 100.0))
    assert set(fitted.validation_accuracy) == {0.001, 1.0, 100.0}
    assert fitted.validation_accuracy[fitted.c] == max(fitted.validation_accuracy.values())
    assert fitted.model[-1].C == fitted.c
    probabilities = fitted.probabilities(val.texts, 2)  # the refitted model scores as its C did
    assert probabilities.shape == (80, 2) and np.allclose(probabilities.sum(1), 1)
    assert (probabilities.argmax(1) == np.asarray(val.labels)).mean() == fitted.validation_accuracy[fitted.c]
    assert fit_baseline(train, None, (3.0,)).c == 3.0 and fit_baseline(train, None, (3.0,)).validation_accuracy == {}
    assert fit_baseline(train, val, (100.0, 1.0, 0.001)).c == fitted.c  # the grid's order does not matter
    for no_validation in (None, val.subset([])):
        with pytest.raises(ValueError, match="needs validation"):
            fit_baseline(train, no_validation, (1.0, 3.0))
    # refit: the C chosen as above, then the pipeline fitted on train and validation together.
    refitted = fit_baseline(train, val, (0.001, 1.0, 100.0), refit=True)
    assert refitted.c == fitted.c and refitted.model[-1].C == fitted.c
    words = refitted.model[0].vocabulary_
    assert set(fitted.model[0].vocabulary_) < set(words)   # the validation reviews' words are in it now
    alone = fit_baseline(val.subset(range(len(val))), None, (fitted.c,))
    assert set(alone.model[0].vocabulary_) <= set(words)


def test_labelled_file_limit_and_no_matplotlib(trained_run, tmp_path, capsys, monkeypatch):
    data = write_csv(tmp_path / "labelled.csv", synthetic_reviews(60, seed=5))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert main(["--model", str(trained_run), "--data", str(data), "--output", str(tmp_path / "r"),
                 "--limit", "40", "--bootstrap", "50"]) == 0
    metrics = json.loads((tmp_path / "r" / "metrics.json").read_text())
    assert metrics["examples"] == 40 and metrics["plots"] == [] and "baselines" not in metrics
    assert all(0 <= m["row"] < 60 for m in metrics["mistakes"])
    assert "No plots" in (tmp_path / "r" / "report.md").read_text()
    out = capsys.readouterr()
    assert "matplotlib is not installed" in out.err and "accuracy (95% CI)" in out.err


def test_markdown_escaping_keeps_review_text_inert():
    assert md("<script>x</script> | *bold* [link](u) &amp;") == \
        r"\<script\>x\</script\> \| \*bold\* \[link\](u) \&amp;"
    assert md("# not a heading") == r"\# not a heading" and md("1. not a list") == r"1\. not a list"


def test_corrupt_training_log_still_gives_a_report(trained_run, tmp_path, capsys):
    run = Path(shutil.copytree(trained_run, tmp_path / "run", ignore=shutil.ignore_patterns("last")))
    (run / "metrics.jsonl").write_text('{"step": 1, "val_accuracy": 0.5}\n{truncated')
    assert main(["--model", str(run), "--output", str(tmp_path / "r"), "--bootstrap", "20", "--quiet"]) == 0
    metrics = json.loads((tmp_path / "r" / "metrics.json").read_text())
    assert metrics["training"] is None and "training_curves.png" not in metrics["plots"]


@pytest.mark.parametrize("argv, message", [
    (["--data", "/nonexistent/data.csv"], "data not found"),
    (["--split", "validation"], "has no validation.parquet"),
    (["--bins", "0"], "--bins must be positive"),
    (["--baseline", "--train-data", "/nonexistent/train"], "needs the run's training data"),
])
def test_bad_arguments_are_one_line_errors(trained_run, tmp_path, capsys, argv, message):
    assert run_cli(main, ["--model", str(trained_run), "--output", str(tmp_path / "r"), "--quiet", *argv],
                   prog="classify.evaluate") == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and message in err.splitlines()[-1]


def test_broken_run_folder_is_a_one_line_error(trained_run, tmp_path, capsys):
    run = Path(shutil.copytree(trained_run, tmp_path / "run", ignore=shutil.ignore_patterns("last")))
    weights = run / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert run_cli(main, ["--model", str(run), "--quiet"], prog="classify.evaluate") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("classify.evaluate: error:") and "truncated" in err and "\n" not in err
