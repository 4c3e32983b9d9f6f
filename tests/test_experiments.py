"""The accuracy-experiment scripts at toy sizes: they drive the real CLI and tabulate what it wrote."""

from __future__ import annotations

import argparse

import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_MODEL_ARGS

from classify.train import main as train_main
from experiments import ablations, baseline, negation_forms, pretraining, seeds, trainruns


@pytest.mark.slow
def test_seeds_runs_each_seed_and_reports_the_spread_of_what_the_runs_wrote(parquet_data, tmp_path):
    runs, results = tmp_path / "runs", tmp_path / "results"
    argv = ["--data", str(parquet_data), "--seeds", "0", "1", "--parallel", "2", "--time-budget", "5",
            "--runs", str(runs), "--results", str(results), "--max-steps", "4", *TINY_MODEL_ARGS]
    assert seeds.main(argv) == 0

    report = json.loads((results / "seeds.json").read_text())
    rows = report["rows"]
    assert [r["seed"] for r in rows] == [0, 1]
    for row in rows:
        config = json.loads((runs / f"seed{row['seed']}" / "config.json").read_text())
        assert config["train"]["seed"] == row["seed"] and config["train"]["time_budget"] == 5
        assert config["train"]["threads"] == 1  # the thread limit is recorded with the run
        assert config["train"]["eval_every"] == 250  # the recipe reached classify.train
        test = json.loads((runs / f"seed{row['seed']}" / "test_metrics.json").read_text())
        assert row["test_accuracy"] == test["accuracy"] and row["steps"] == 4
        # The default model has the n-gram branch: each branch alone and the mixed model's validation accuracy.
        assert row["components_test"] == test["components"] and row["mix"] == test["mix"]
        assert row["val_test_gap"] == test["val_accuracy"]["mixed"] - test["accuracy"]
    accuracies = [r["test_accuracy"] for r in rows]
    assert report["test_accuracy"]["mean"] == statistics.fmean(accuracies)
    assert report["test_accuracy"]["std"] == statistics.stdev(accuracies)
    assert "± " in (results / "seeds.md").read_text()

    # --reuse tabulates finished runs without training them again
    before = (runs / "seed0" / "test_metrics.json").stat().st_mtime_ns
    assert seeds.main([*argv, "--reuse"]) == 0
    assert (runs / "seed0" / "test_metrics.json").stat().st_mtime_ns == before


@pytest.mark.slow
def test_pretraining_fine_tunes_each_snapshot_and_the_final_weights(parquet_data, tmp_path):
    runs, results = tmp_path / "runs", tmp_path / "results"
    pretrain_args = ("--d-model 32 --heads 2 --layers 1 --d-ff 64 --max-len 64 --vocab-size 200 --max-tokens 512 "
                     "--val-size 80 --mlm-val-size 20 --max-steps 6 --eval-every 2 --precision fp32")
    argv = ["--data", str(parquet_data), "--runs", str(runs), "--results", str(results), "--snapshots", "0",
            "--pretrain-budget", "5", "--finetune-budget", "5", "--poll", "0.05", "--pretrain-args", pretrain_args,
            "--finetune-args", "--max-steps 3 --batch-size 16 --val-size 80 --precision fp32 --ngram-buckets 100003"]
    assert pretraining.main(argv) == 0

    report = json.loads((results / "pretraining.json").read_text())
    rows = {Path(r["init_from"]).name: r for r in report["finetuned"]}
    assert set(rows) == {"pretrain-at-0min", "pretrain"}
    curve = report["pretraining_curve"]
    best = min(curve, key=lambda r: r["val_loss"])  # the final weights are the best evaluation's
    assert (rows["pretrain"]["pretraining_steps"], rows["pretrain"]["mlm_val_loss"]) == (best["step"], best["val_loss"])
    for source, row in rows.items():
        config = json.loads((runs / f"finetune-{source}" / "config.json").read_text())
        assert config["train"]["init_from"] == str(runs / source) and config["train"]["lr"] == 5e-4
        test = json.loads((runs / f"finetune-{source}" / "test_metrics.json").read_text())
        assert row["test_accuracy"] == test["accuracy"] and row["finetune_steps"] == 3
    assert [r["step"] for r in curve] == [0, 2, 4, 6]

    # --reuse tabulates the finished experiment without pretraining or fine-tuning again
    stamps = {f: f.stat().st_mtime_ns for f in runs.glob("*/model.safetensors")}
    assert pretraining.main([*argv, "--reuse"]) == 0
    assert {f: f.stat().st_mtime_ns for f in runs.glob("*/model.safetensors")} == stamps


def test_spread_is_mean_sample_std_and_range():
    assert seeds.spread([0.8, 0.9, 1.0]) == pytest.approx({"mean": 0.9, "std": 0.1, "min": 0.8, "max": 1.0, "n": 3})
    assert seeds.spread([0.5]) == {"mean": 0.5, "std": 0.0, "min": 0.5, "max": 0.5, "n": 1}


def test_repeated_seeds_are_refused(capsys):
    with pytest.raises(SystemExit):
        seeds.main(["--seeds", "0", "0"])
    assert "repeats" in capsys.readouterr().err


@pytest.mark.slow
def test_a_failing_run_stops_the_rest_of_its_group(tmp_path):
    def started(name: str, code: str) -> trainruns.Training:
        output = tmp_path / name
        with open(trainruns.log_path(output), "w") as log:
            process = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT)
        return trainruns.Training(name, output, process, time.monotonic())

    slow = started("slow.run", "import time; time.sleep(60)")
    failing = started("fails", "print('bad flag'); raise SystemExit(2)")
    with pytest.raises(SystemExit, match="fails failed \\(exit 2\\)[^\\n]*fails.log:\\nbad flag"):
        trainruns.wait_all([failing, slow])
    assert slow.process.poll() is not None  # terminated, not left running
    assert trainruns.log_path(tmp_path / "slow.run") == tmp_path / "slow.run.log"


def test_baseline_tunes_c_on_validation(parquet_data, tmp_path):
    argv = ["--data", str(parquet_data), "--val-size", "80", "--grid", "0.01", "10", "--results", str(tmp_path)]
    assert baseline.main(argv) == 0

    report = json.loads((tmp_path / "baseline.json").read_text())
    by_c = report["validation_accuracy_by_C"]
    assert set(by_c) == {"0.01", "10"}
    default, tuned, tuned_all = report["results"].values()
    assert default["C"] == 1 and tuned["C"] == tuned_all["C"] == max((0.01, 10.0), key=lambda c: by_c[f"{c:g}"])
    assert default["train_examples"] == tuned["train_examples"] == 320 and tuned_all["train_examples"] == 400
    assert all(0.5 < row["test_accuracy"] <= 1 for row in report["results"].values())


@pytest.mark.slow
def test_ablation_chain_differs_at_every_step_and_each_variant_trains_as_configured(parquet_data, tmp_path):
    chain = ablations.variants()
    assert chain[0][0] == "bloem" and "--no-padding-mask" in chain[0][2]
    assert all(before != after for (_, _, before), (_, _, after) in zip(chain, chain[1:]))
    assert "--no-padding-mask" not in chain[1][2] and "--post-ln" not in chain[2][2]
    assert ablations.replace(["--a", "1", "--b", "--c", "2"], "--a", "3") == ["--b", "--c", "2", "--a", "3"]
    assert ablations.replace(["--a", "1", "--b"], "--b") == ["--a", "1"]

    runs, results = tmp_path / "runs", tmp_path / "results"
    argv = ["--data", str(parquet_data), "--steps", "2", "--eval-every", "2", "--max-len", "32", "--val-size", "80",
            "--runs", str(runs), "--results", str(results), "--only", "bloem", "ours"]
    assert ablations.main(argv) == 0
    rows = json.loads((results / "ablations.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["bloem", "ours"]
    bloem = json.loads((runs / "bloem" / "config.json").read_text())["model"]
    ours = json.loads((runs / "ours" / "config.json").read_text())["model"]
    assert (bloem["num_layers"], bloem["norm_first"], bloem["mask_padding"]) == (6, False, False)
    assert (ours["num_layers"], ours["norm_first"], ours["mask_padding"]) == (2, True, True)
    assert all(r["curve"][-1][0] == 2 for r in rows)


def test_ngram_branch_scores_each_variant_alone(unlabelled_data, tmp_path):
    from experiments.ngram_branch import main as branch_main

    argv = ["--data", str(unlabelled_data), "--variants", "vocab=200,len=64,buckets=1009",
            "vocab=200,len=64,buckets=1009,self,skip,tail=8,neg=3", "--results", str(tmp_path)]
    assert branch_main(argv) == 0
    rows = json.loads((tmp_path / "ngram_branch.json").read_text())["rows"]
    assert [(r["len"], r["self"], r["unlabelled"]) for r in rows] == [(64, False, 0), (64, True, 600)]
    assert [r["features"] for r in rows] == ["1-3-grams", "1-3-grams, skip-bigrams, 1-3-grams of the last 8 tokens, "
                                                          "negation marked over 3 tokens"]
    assert all(0 <= r["behaviour"]["negated positive"] <= 1 for r in rows)
    assert all(0.5 < r["test_accuracy"] <= 1 and 0.5 < r["val_accuracy"] <= 1 for r in rows)
    table = (tmp_path / "ngram_branch.md").read_text()
    assert f"| 1,009 | {rows[1]['vocab']} | 64 | 600 unlabelled |" in table


def test_ngram_branch_cross_validates_each_variant_over_grouped_folds(unlabelled_data, tmp_path):
    from experiments.ngram_branch import main as branch_main

    argv = ["--data", str(unlabelled_data), "--folds", "2", "--threads", "2", "--variants",
            "vocab=200,len=64,buckets=1009", "vocab=200,len=64,buckets=1009,neg=3,edits=10",
            "vocab=200,len=64,buckets=1009,nb=64", "--results", str(tmp_path)]
    assert branch_main(argv) == 0
    rows = json.loads((tmp_path / "ngram_branch_cv.json").read_text())["rows"]
    assert [len(r["folds"]) for r in rows] == [2, 2, 2] and rows[0]["difference"] == 0
    for r in rows:   # every training review held out exactly once
        assert sum(f["reviews"] for f in r["folds"]) == 400 and 0.5 < r["accuracy"] <= 1
        assert r["accuracy"] == pytest.approx(sum(f["accuracy"] for f in r["folds"]) / 2)
    table = (tmp_path / "ngram_branch_cv.md").read_text()
    assert "test_accuracy" not in rows[0] and "| 0.1 |" in table and "| 64 |" in table   # pseudo-count column


def test_ngram_branch_cross_validation_fits_the_pairs_whose_original_is_not_held_out(unlabelled_data,
                                                                                     counterfactual_data, tmp_path):
    from experiments.ngram_branch import main as branch_main

    argv = ["--data", str(unlabelled_data), "--folds", "2", "--threads", "2", "--counterfactual",
            str(counterfactual_data), "--variants", "vocab=200,len=64,buckets=1009",
            "vocab=200,len=64,buckets=1009,cf=50", "--results", str(tmp_path)]
    assert branch_main(argv) == 0
    plain, pairs = json.loads((tmp_path / "ngram_branch_cv.json").read_text())["rows"]
    # 40 pairs, the held-out quarter (10) never fitted; each other pair's original is a training review, held out
    # in exactly one fold, where its pair is left out.
    assert [f["pairs"] for f in plain["folds"]] == [0, 0] and sum(f["pairs"] for f in pairs["folds"]) == 30
    assert 0 <= plain["revised_accuracy"] <= 1 and 0 <= pairs["revised_accuracy"] <= 1
    assert "| - | 0.5 |" in (tmp_path / "ngram_branch_cv.md").read_text()
    with pytest.raises(SystemExit):
        branch_main(["--data", str(unlabelled_data), "--folds", "2", "--variants", "cf=50"])


def test_ngram_branch_variants_are_checked():
    from experiments.ngram_branch import PLAIN, parse_variant

    assert parse_variant("") == PLAIN
    assert parse_variant("skip,tail=60,buckets=7")["skip"] and parse_variant("tail=60")["tail"] == 60
    assert PLAIN["nb"] == 1 and parse_variant("min=5,nb=16")["nb"] == 16
    for bad in ("skip=1", "tail", "colour=3", "len=x", "nb=0.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_variant(bad)


def test_behaviour_tables_every_system_of_every_run(trained_run, counterfactual_data, tmp_path):
    from experiments.behaviour import main as behaviour_main

    assert behaviour_main(["--runs", str(trained_run), "--counterfactual", str(counterfactual_data),
                           "--results", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "behaviour.json").read_text())
    systems = record["runs"][str(trained_run)]["behaviour"]["systems"]
    assert list(systems) == ["model", "transformer alone", "n-gram branch alone"]
    assert record["runs"][str(trained_run)]["counterfactual"]["pairs"] == 10
    table = (tmp_path / "behaviour.md").read_text()
    rate = systems["model"]["capabilities"]["negated positive"]["failure_rate"]
    assert f"| negated positive (mft, 200) | {100 * rate:.1f}% |" in table and "| counterfactual revised |" in table


def test_spelling_scores_each_run_as_written_and_with_slips_read(trained_run, tmp_path):
    from experiments.spelling import main as spelling_main

    assert spelling_main(["--runs", str(trained_run), "--results", str(tmp_path)]) == 0
    by = json.loads((tmp_path / "spelling.json").read_text())["runs"][str(trained_run)]
    assert by["off"]["corrected"] == {"validation": 0.0, "test": 0.0}
    assert set(by["on"]["test"]) == {"model", "transformer alone", "n-gram branch alone"}
    typos = [by[k]["behaviour"]["systems"]["model"]["capabilities"]["typos"]["failure_rate"] for k in ("off", "on")]
    assert typos[1] <= typos[0]
    table = (tmp_path / "spelling.md").read_text()
    assert f"| {trained_run.name} | off | 0.00% / 0.00% |" in table and f"| {trained_run.name} | on |" in table


def test_mix_forms_refits_the_mix_on_the_runs_own_validation_texts(trained_run, tmp_path):
    from experiments.mix_forms import main as forms_main

    assert forms_main(["--runs", str(trained_run), "--split-at", "8", "64", "--results", str(tmp_path)]) == 0
    systems = json.loads((tmp_path / "mix_forms.json").read_text())["runs"][str(trained_run)]
    assert list(systems) == ["transformer", "ngram", "mix, log", "mix, hinge at 8", "mix, hinge at 64",
                             "mix, split at 8", "mix, split at 64", "mix, log + sentences", "mix, log + confidences",
                             "mix, log, fitted without the joins", "mix, log, fitted on reviews alone",
                             "mix, log, groups weighted alike"]
    assert all(0 <= v <= 1 for s in systems.values() for v in s.values() if v is not None)
    assert systems["mix, log, fitted on reviews alone"]["short"] is None   # scored on reviews only


def test_mix_forms_scores_the_validation_pairs_and_fits_them_only_where_asked():
    import numpy as np

    from classify.train import Validation
    from experiments.mix_forms import PAIRS, REVISIONS, compare, halves

    rng = np.random.default_rng(0)
    reviews, shorts, pairs = 60, 60, 20
    group = np.array([0] * reviews + [1] * shorts)
    labels = rng.integers(2, size=len(group)).tolist()
    pair_labels = rng.integers(2, size=pairs).tolist()
    ids = [[5] * int(rng.integers(3, 300)) for _ in group]

    def logits(y, noise):   # (N, 2) logits that mostly agree with the labels
        y = 2 * np.asarray(y) - 1
        noisy = [sign * y + noise * rng.normal(size=len(y)) for sign in (-1, 1)]
        return np.stack(noisy, 1).astype(np.float32)

    base = Validation(ids, labels, group, logits(labels, 1.0))
    base_transformer = logits(labels, 1.5)
    with_pairs = Validation(ids + [[5] * 200] * (2 * pairs), labels + pair_labels + [1 - y for y in pair_labels],
                            np.concatenate([group, [PAIRS] * pairs, [REVISIONS] * pairs]),
                            np.concatenate([base.ngram, logits(pair_labels, 0.1), logits(pair_labels, 0.1)]))
    transformer = np.concatenate([base_transformer, logits(pair_labels, 1.0),
                                  logits([1 - y for y in pair_labels], 1.0)])

    half = halves(with_pairs)
    assert (half[: len(group)] == halves(base)).all()                  # the other texts' halves are not redrawn
    assert (half[len(group):][:pairs] == half[len(group):][pairs:]).all()   # a pair stays in one half

    without, scored = compare(base, base_transformer, [64], set()), compare(with_pairs, transformer, [64], set())
    assert scored["mix, log"]["reviews"] == without["mix, log"]["reviews"]   # the shipped fit never sees the pairs
    assert scored["mix, log"]["short"] == without["mix, log"]["short"]
    assert set(scored["ngram"]) == {"reviews", "short", "pair originals", "pair revisions"}
    # The branch here recognises the originals and misses every revision; fitted with the pairs, the mix leans on
    # the transformer, which reads them.
    assert scored["ngram"]["pair revisions"] == 0.0
    assert "mix, log + confidences, fitted with the pairs counting as a group" in scored
    assert (scored["mix, log, fitted with the pairs counting as a group"]["pair revisions"]
            > scored["mix, log"]["pair revisions"])


def test_validation_pairs_are_the_training_side_pairs_whose_original_is_a_validation_review(counterfactual_data):
    from classify.text.counterfactual import load_pairs
    from classify.train_config import TrainConfig
    from experiments.mix_forms import validation_pairs

    training, held_out = load_pairs(counterfactual_data, held_out=False), load_pairs(counterfactual_data, held_out=True)
    val_texts = training.original.texts[:3] + held_out.original.texts[:2] + ["a review with no pair"]
    pairs = validation_pairs(TrainConfig(data="unused", counterfactual=str(counterfactual_data)), val_texts)
    assert pairs.texts == training.original.texts[:3] + training.revised.texts[:3]   # never the held-out quarter
    assert pairs.labels == training.original.labels[:3] + [1 - y for y in training.original.labels[:3]]


def test_branch_memory_rebuilds_the_runs_branch_and_scores_each_variant(unlabelled_data, counterfactual_data,
                                                                         tmp_path):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from classify.engine.runfolder import RunFolder
    from classify.text.counterfactual import HOLDOUT_EVERY
    from classify.evaluate import run_training_split
    from classify.inference import load_run
    from classify.ngrams import bag_logits
    from classify.text.prepare import Preprocessing
    from experiments.branch_memory import Variant, branch_data, fitted, logits_of
    from experiments.branch_memory import main as memory_main

    run = tmp_path / "run"
    # On the CPU, where experiments.branch_memory computes the logits it fits the mix on again (a GPU's bf16
    # logits differ from a CPU's by more than the mix's tolerance below); a transformer that does not read the
    # branch's scope, so --ngram-ellipsis below may change the branch alone (one that does is refused at the end).
    assert train_main(["--data", str(unlabelled_data), "--output", str(run), "--max-steps", "1", "--no-test",
                       "--counterfactual", str(counterfactual_data), "--device", "cpu", "--no-scope-embedding",
                       *TINY_MODEL_ARGS]) == 0
    # The recipe's variant is the run's own branch: the same training texts, weights and fits.
    data = branch_data(str(run), students=True)
    recipe = Variant("fit", data.config.ngram_min_count, data.config.ngram_c)
    first, kept = (fitted(data, recipe, kept=k) for k in (False, True))
    count = json.loads((run / "branch_validation.json").read_text())["count"]
    reviews = len(data.val_labels)
    np.testing.assert_allclose(RunFolder(run, "classifier").branch_validation(count, 2)[:reviews],
                               logits_of(first, data.val), atol=1e-4)
    loaded = load_run(run, torch.device("cpu"))
    _, val = run_training_split(loaded.config, None)
    as_trained = Preprocessing(loaded.tokenizer, loaded.model.config.max_len, loaded.truncation)   # no --spelling
    np.testing.assert_allclose(bag_logits(loaded.model.ngram, as_trained.ids(val.texts)).numpy(),
                               logits_of(kept, data.val), atol=1e-4)

    assert memory_main(["--runs", str(run), "--variants", "2:1", "3:0.5", "2:1:8", "student:2:1:0",
                        "--results",
                        str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "branch_memory.json").read_text())["runs"][str(run)]["variants"]
    assert [r["variant"] for r in rows] == ["2:1", "3:0.5", "2:1:8", "student 2:1, reviews x0"]
    assert rows[1]["slots"] < rows[0]["slots"]
    assert rows[2]["mix"] != rows[0]["mix"]      # the smoothing reaches the fit
    assert all(0 <= v <= 1 for r in rows for system in ("ngram", "mixed") for v in r[system].values())
    assert "pair revisions, original unseen" in rows[0]["ngram"]
    assert "| 3:0.5 |" in (tmp_path / "branch_memory.md").read_text()

    # --save: each variant's model as a run folder; the recipe's own variant is the run itself.
    assert memory_main(["--runs", str(run), "--variants", "2:1", "3:0.5", "--save", str(tmp_path / "grafts"),
                        "--results", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "branch_memory.json").read_text())["runs"][str(run)]["variants"]
    same, looser = (load_run(r["saved"], torch.device("cpu")) for r in rows)
    assert looser.config["train"]["ngram_min_count"] == 3 and looser.config["graft"]["from"] == str(run)
    ids = as_trained.ids(val.texts)
    for name, tensor in loaded.model.state_dict().items():
        if not name.startswith(("ngram.", "mix")):
            assert torch.equal(tensor, looser.model.state_dict()[name]), name   # the transformer is the run's
    np.testing.assert_allclose(bag_logits(same.model.ngram, ids).numpy(), bag_logits(loaded.model.ngram, ids).numpy(),
                               atol=1e-4)
    assert not np.allclose(bag_logits(looser.model.ngram, ids).numpy(), bag_logits(loaded.model.ngram, ids).numpy(),
                           atol=1e-4)
    # The mix is fitted again on the transformer's validation logits, computed here in other batches than in
    # training (bf16 on a CPU that has it): the same mix to within a percent.
    np.testing.assert_allclose(same.model.mix.numpy(), loaded.model.mix.numpy(), rtol=0.01)
    np.testing.assert_allclose(RunFolder(rows[0]["saved"], "classifier").branch_validation(count, 2),
                               RunFolder(run, "classifier").branch_validation(count, 2), atol=1e-4)
    assert memory_main(["--runs", str(run), "--results", str(tmp_path)]) == 0    # by default the run's own fit
    rows = json.loads((tmp_path / "branch_memory.json").read_text())["runs"][str(run)]["variants"]
    assert [r["variant"] for r in rows] == [recipe.name]
    with pytest.raises(SystemExit):   # a student's fit has no flags to describe it in config.json
        memory_main(["--runs", str(run), "--variants", "student:2:1:0", "--save", str(tmp_path / "grafts")])
    # --ngram-ellipsis: the branch refitted reading denied clauses otherwise than the run's (the recipe's 4), and
    # the graft's config.json says so.
    assert loaded.model.ngram.ellipsis == 4 and loaded.model.ngram.auxiliaries.numel() > 0
    assert memory_main(["--runs", str(run), "--variants", "2:1", "--ngram-ellipsis", "0", "--save",
                        str(tmp_path / "grafts"), "--results", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "branch_memory.json").read_text())["runs"][str(run)]["variants"][0]["saved"]
    assert saved.endswith("-ell0") and load_run(saved, torch.device("cpu")).model.ngram.ellipsis == 0
    # --counterfactual-passage-weight: the fits read the pairs' edited passages, which the run never did. The
    # fixture's pairs are one sentence each (no passage: the whole text), so a copy of the run reads them beside
    # pairs of two sentences, one rewritten.
    pairs = pq.read_table(counterfactual_data / "train.parquet").to_pylist()
    longer = [{"text": f"Movie {pair} opens at night. It was {ending}", "label": label, "pair": pair, "kind": kind,
               "imdb_split": "train"} for pair in range(100, 112)
              for ending, label, kind in (("dull and slow.", 0, "original"), ("gripping.", 1, "revised"))]
    (tmp_path / "longer-pairs").mkdir()
    pq.write_table(pa.Table.from_pylist(pairs + longer), tmp_path / "longer-pairs" / "train.parquet")
    reads_longer = tmp_path / "reads-longer-pairs"
    shutil.copytree(run, reads_longer)
    config = json.loads((reads_longer / "config.json").read_text())
    config["train"]["counterfactual"] = str(tmp_path / "longer-pairs")
    (reads_longer / "config.json").write_text(json.dumps(config))
    without, with_passages = (branch_data(str(reads_longer), students=False, passage_weight=w) for w in (None, 0.5))
    trained = sum(1 for p in range(100, 112) if p % HOLDOUT_EVERY)       # the held-out quarter is never read
    assert with_passages.train.shape[0] == without.train.shape[0] + 2 * trained
    rows = []
    for weight in ([], ["--counterfactual-passage-weight", "0.5"], ["--counterfactual-passage-weight", "0"]):
        assert memory_main(["--runs", str(reads_longer), "--variants", "2:1", *weight, "--save",
                            str(tmp_path / "grafts"), "--results", str(tmp_path)]) == 0
        rows += json.loads((tmp_path / "branch_memory.json").read_text())["runs"][str(reads_longer)]["variants"]
    control, grafted, without = (load_run(r["saved"], torch.device("cpu")) for r in rows)
    assert rows[1]["saved"].endswith("-passages0.5") and grafted.config["graft"]["counterfactual_passage_weight"] == 0.5
    assert "counterfactual_passage_weight" not in control.config["graft"]
    assert not grafted.config["train"]["counterfactual_passages"]      # the run's teacher never read them
    assert not np.allclose(bag_logits(grafted.model.ngram, ids).numpy(), bag_logits(control.model.ngram, ids).numpy(),
                           atol=1e-4)
    # ... and at 0 none of the fits reads them, whatever the run did: here the run's own branch again.
    assert rows[2]["saved"].endswith("-passages0")
    np.testing.assert_array_equal(bag_logits(without.model.ngram, ids).numpy(),
                                  bag_logits(control.model.ngram, ids).numpy())
    with pytest.raises(SystemExit) as refused:
        memory_main(["--runs", str(reads_longer), "--counterfactual-passage-weight", "-1"])
    assert refused.value.code == 2
    # ... refused for a run whose transformer reads the branch's scope: it would no longer be the run's transformer.
    reads_scope = tmp_path / "reads-scope"
    shutil.copytree(run, reads_scope)
    config = json.loads((reads_scope / "config.json").read_text())
    (reads_scope / "config.json").write_text(json.dumps({**config, "model": {**config["model"],
                                                                             "scope_embedding": True}}))
    with pytest.raises(SystemExit):
        memory_main(["--runs", str(reads_scope), "--ngram-ellipsis", "0"])


def test_negation_forms_counts_how_reviews_negate_and_what_the_edits_write(parquet_data, tmp_path):
    counts = negation_forms.how_reviews_negate(["It was no gem. It was not a gem. It isn't a film, it wasn't good.",
                                                "I never laughed. I didn't laugh. It was never dull. It was no longer "
                                                "fun."])
    assert counts == {"copula: no": 1, "copula: not + article": 1, "copula: n't + article": 1, "copula: n't": 1,
                      "pronoun: never": 1, "pronoun: didn't": 1, "copula: never": 1}
    assert negation_forms.shares(counts) == {"no for an indefinite predicate": 1 / 3, "never after a copula": 0.5,
                                             "never after a pronoun": 0.5}
    assert negation_forms.main(["--data", str(parquet_data), "--results", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "negation_forms.json").read_text())
    assert record["reviews"] > 0 and set(record["edits"]) == {"not", "never", "varied"}
    assert "never" not in record["edits"]["not"] and "no" not in record["edits"]["not"]


def test_attention_precision_times_both_arms_and_its_fp32_arm_is_fp32_attention_rounded(tmp_path):
    from experiments import attention_precision

    core = attention_precision.core
    shipped = core.FP32_TRAINING_KEYS
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 300, 8, generator=g).bfloat16().requires_grad_() for _ in range(3))
    with attention_precision.fp32_attention_up_to(attention_precision.ARMS["fp32"]):
        in_fp32 = core._sdpa(q, k, v, None, 0.0)
    with attention_precision.fp32_attention_up_to(attention_precision.ARMS["bf16"]):
        in_bf16 = core._sdpa(q[..., :9, :], k[..., :9, :], v[..., :9, :], None, 0.0)
    assert in_fp32.dtype == torch.bfloat16 and core.FP32_TRAINING_KEYS == shipped
    assert torch.equal(in_fp32, F.scaled_dot_product_attention(q.float(), k.float(), v.float()).bfloat16())
    assert torch.equal(in_bf16, F.scaled_dot_product_attention(q[..., :9, :], k[..., :9, :], v[..., :9, :]))
    assert attention_precision.main(["--lengths", "16", "24", "--repeats", "1", "--threads", "1",
                                     "--results", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "attention_precision.json").read_text())
    assert [(r["case"], r["length"]) for r in record["rows"]] == [
        ("one attention call", 16), ("training step, initial weights", 16),
        ("one attention call", 24), ("training step, initial weights", 24)]
    assert all(r["bf16_ms"] > 0 and r["fp32_ms"] > 0 and r["fp32_speedup"] > 0 for r in record["rows"])
    assert core.FP32_TRAINING_KEYS == shipped  # the arms leave the core's bound as it was


def test_padding_counts_the_padded_share_and_times_each_multiple(unlabelled_data, counterfactual_data, trained_run,
                                                                 tmp_path):
    import numpy as np

    from experiments import padding

    lengths, batches = np.array([3, 5, 8, 9]), [[0, 1], [2, 3]]   # 25 real tokens
    assert padding.padded_share(lengths, batches, 512, 32) == pytest.approx(1 - 25 / (2 * 32 + 2 * 32))
    assert padding.padded_share(lengths, batches, 512, 8) == pytest.approx(1 - 25 / (2 * 8 + 2 * 16))
    assert padding.padded_share(lengths, batches, 512, 1) == pytest.approx(1 - 25 / (2 * 5 + 2 * 9))
    assert padding.padded_share(lengths, batches, 12, 8) == pytest.approx(1 - 25 / (2 * 8 + 2 * 12))  # max_len caps
    assert padding.main(["--data", str(unlabelled_data), "--counterfactual", str(counterfactual_data),
                         "--tokenizer-from", str(trained_run), "--multiples", "32", "8", "--batches", "2",
                         "--repeats", "1", "--threads", "1", "--results", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "padding.json").read_text())
    assert [r["multiple"] for r in record["rows"]] == [32, 8] and record["timed_batches"] == 2
    assert record["rows"][0]["padding"] > record["rows"][1]["padding"] > 0
    assert record["rows"][0]["against_32"] == 1 and all(r["tokens_per_s"] > 0 for r in record["rows"])


def test_step_speed_times_the_old_step_against_the_new(tmp_path):
    from classify.models import Classifier
    from experiments import step_speed

    model = Classifier(vocab_size=50, d_model=16, num_heads=2)
    arms = step_speed.optimizers(model)
    assert not arms["before"].defaults["fused"] and arms["now"].defaults["fused"]
    assert [g["params"] for g in arms["before"].param_groups] == [g["params"] for g in arms["now"].param_groups]
    shipped = step_speed.core.FP32_TRAINING_KEYS
    assert step_speed.main(["--lengths", "16", "--repeats", "1", "--threads", "1", "--results", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "step_speed.json").read_text())
    assert [(r["weights"], r["length"]) for r in record["rows"]] == [("initial weights", 16)]
    assert all(r["before_ms"] > 0 and r["now_ms"] > 0 and r["speedup"] > 0 for r in record["rows"])
    assert record["fp32_training_keys"] == shipped == step_speed.core.FP32_TRAINING_KEYS
