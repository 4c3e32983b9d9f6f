"""python -m classify.train end to end: run folder, Ctrl-C, atomic writes, errors (kill-and-resume: test_loop.py)."""

import json
import math
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_MODEL_ARGS, synthetic_reviews, write_csv, write_jsonl
from safetensors.torch import load_file

import classify.engine.files as files
import classify.engine.loop as loop
from classify.command_budget import MARGIN, AfterTraining, training_minutes
from classify.engine.background import Background
from classify.engine.files import load_tensors, read_jsonl, save_tensors
from classify.engine.runfolder import FORMAT_VERSION, RunFolder
from classify.errors import ClassifyError, run_cli
from classify.inference import load_run
from classify.models import Classifier, ngram_branch
from classify.ngrams import bag_logits, fit_ngram_bag
from classify.text.batching import Collate
from classify.text.counterfactual import load_pairs
from classify.text.data import normalize, training_split
from classify.text.edits import NEGATION_FORMS, Lexicon, contrast_joins, negation_pairs
from classify.text.tokenize import token_ids, train_tokenizer
from classify.text.windows import SENTENCE_ENDS, Elision, closing_passage, closing_sentence, elided_negation
from classify.train import ClassificationTask, Validation, main, pair_loss
from classify.training_texts import (TrainingPart, TransformerExamples, rule_made_examples, training_targets,
                                     with_windows)
from classify.train_config import TrainConfig

RUN_FILES = ["config.json", "tokenizer.json", "model.safetensors", "metrics.jsonl", "test_metrics.json",
             "last/state.json"]


def test_trained_run_folder_is_complete(trained_run):
    for name in RUN_FILES:
        assert (trained_run / name).exists(), name
    config = json.loads((trained_run / "config.json").read_text())
    assert config["format_version"] == FORMAT_VERSION and config["kind"] == "classifier"
    assert config["model"]["d_model"] == 32 and config["labels"] == ["neg", "pos"]
    records = read_jsonl(trained_run / "metrics.jsonl")
    assert len(records) == 4  # one evaluation per epoch
    assert {"step", "epoch", "train_loss", "val_loss", "val_accuracy", "lr", "elapsed_s", "tokens_per_s"} <= set(records[0])
    test = json.loads((trained_run / "test_metrics.json").read_text())
    assert test["examples"] == 200 and test["accuracy"] > 0.8  # the synthetic task is learnable
    assert not list(trained_run.rglob("*.tmp"))


def run_steps(data, out, *extra):
    return main(["--data", str(data), "--output", str(out), "--max-steps", "24", "--epochs", "2",
                 "--eval-every", "8", "--save-every", "5", *TINY_MODEL_ARGS, *extra])


def last_weights(run):
    state = json.loads((run / "last" / "state.json").read_text())
    return state, load_tensors(run / "last" / state["weights_file"])


def test_ctrl_c_saves_and_exits_cleanly(parquet_data, tmp_path, monkeypatch):
    real_step, calls = loop.optimizer_step, {"n": 0}

    def interrupt_at_7(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 7:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop, "optimizer_step", interrupt_at_7)
    assert run_steps(parquet_data, tmp_path / "run") == 130
    state, _ = last_weights(tmp_path / "run")
    assert state["step"] == 7


def test_time_budget_stops_and_still_evaluates(parquet_data, tmp_path):
    out = tmp_path / "budget"
    assert main(["--data", str(parquet_data), "--output", str(out), "--time-budget", "0.0001",
                 *TINY_MODEL_ARGS]) == 0
    assert (out / "test_metrics.json").exists() and (out / "model.safetensors").exists()


def test_finish_within_trains_for_what_the_command_leaves_and_a_resume_keeps_those_minutes(parquet_data, tmp_path):
    out, steps = tmp_path / "deadline", ["--epochs", "9", *TINY_MODEL_ARGS]
    assert main(["--data", str(parquet_data), "--output", str(out), "--finish-within", "5", "--max-steps", "6",
                 *steps]) == 0
    budget = json.loads((out / "config.json").read_text())["train"]["time_budget"]
    assert 4.5 < budget < 5   # a few seconds of data, n-grams and (tiny) evaluations to come
    assert main(["--data", str(parquet_data), "--output", str(out), "--finish-within", "1", "--max-steps", "9",
                 *steps]) == 0
    assert last_weights(out)[0]["step"] == 9
    assert json.loads((out / "config.json").read_text())["train"]["time_budget"] == budget
    with pytest.raises(ClassifyError, match="pass one of them"):
        main(["--data", str(parquet_data), "--output", str(out), "--finish-within", "5", "--time-budget", "3", *steps])
    run_steps(parquet_data, tmp_path / "unlimited")
    with pytest.raises(ClassifyError, match="started without a time limit"):
        run_steps(parquet_data, tmp_path / "unlimited", "--finish-within", "5")


def test_finish_within_counts_the_evaluations_after_training_and_refuses_a_limit_they_fill():
    after = AfterTraining(validation_tokens=1_000, test_tokens=8_000, tokens_per_s=100, tokenize_s=5)
    assert after.seconds == (1_000 + 8_000) / 100 + 5   # the loop's last validation (the mix reuses it), the test
    assert training_minutes(10, elapsed_s=60, after=after) == pytest.approx((600 - 60 - MARGIN * 95) / 60)
    with pytest.raises(ClassifyError, match=rf"--finish-within 3 leaves no time to train: 1.0 min went .* 1.6 min "
                                             rf".*, {MARGIN:g}x that set aside \({MARGIN * 95 / 60:.1f} min\)"):
        training_minutes(3, elapsed_s=60, after=after)


def test_atomic_write_keeps_old_file_on_failure(tmp_path, monkeypatch):
    import torch

    path = tmp_path / "model.safetensors"
    save_tensors(path, {"w": torch.ones(3)})

    def explode(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(files, "save_file", explode)
    with pytest.raises(OSError):
        save_tensors(path, {"w": torch.zeros(3)})
    assert load_file(str(path))["w"].tolist() == [1.0, 1.0, 1.0]
    assert list(tmp_path.iterdir()) == [path]


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "classify.train", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def assert_one_line_error(result, fragment):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    assert fragment in result.stderr, result.stderr
    assert len([l for l in result.stderr.splitlines() if "error" in l]) == 1


@pytest.mark.slow
def test_cli_errors_are_one_line(tmp_path, parquet_data):
    out = str(tmp_path / "out")
    assert_one_line_error(cli("--data", str(tmp_path / "missing"), "--output", out), "not found")
    assert_one_line_error(cli("--data", str(parquet_data), "--output", out, "--d-model", "30", "--heads", "4"),
                          "must be a multiple of num_heads")
    bad_labels = write_jsonl(tmp_path / "labels.jsonl", [("good", 1), ("bad", 7)] * 50)
    assert_one_line_error(cli("--data", str(bad_labels), "--output", out), "label 7")
    cols = tmp_path / "cols.csv"
    cols.write_text("review,label\nok,1\n")
    assert_one_line_error(cli("--data", str(cols), "--output", out), "no 'text' column")
    empty = tmp_path / "empty.csv"
    empty.write_text("text,label\n")
    assert_one_line_error(cli("--data", str(empty), "--output", out), "empty")


@pytest.mark.slow
def test_refuses_folder_holding_a_different_run(trained_run, parquet_data, tmp_path):
    result = cli("--data", str(parquet_data), "--output", str(trained_run), "--d-model", "64", "--heads", "2",
                 "--quiet")
    assert_one_line_error(result, "different run")
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    assert_one_line_error(cli("--data", str(parquet_data), "--output", str(stranger)), "not a classify run")


@pytest.mark.slow
def test_help_explains_flags():
    result = cli("--help")
    assert result.returncode == 0
    for flag in ["--data", "--output", "--epochs", "--max-steps", "--time-budget", "--batch-size", "--lr",
                 "--warmup", "--weight-decay", "--d-model", "--layers", "--heads", "--d-ff", "--max-len",
                 "--dropout", "--vocab-size", "--limit", "--seed", "--device", "--precision", "--resume",
                 "--patience", "--num-workers"]:
        assert flag in result.stdout


@pytest.mark.slow
def test_the_command_lines_start_without_scikit_learn():
    """scikit-learn costs ~2.5 s to import: the commands import it where they fit or score, so that --help and a
    one-line error come back after torch's import alone."""
    commands = ["classify.train", "classify.predict", "classify.evaluate", "classify.pretrain", "classify.export"]
    code = f"import sys, {', '.join(commands)}; print(sorted(m for m in ('sklearn', 'scipy.stats') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_csv_source_trains_without_test_split(tmp_path):
    from conftest import synthetic_reviews

    data = write_csv(tmp_path / "reviews.csv", synthetic_reviews(300))
    out = tmp_path / "run"
    assert main(["--data", str(data), "--output", str(out), "--epochs", "1", *TINY_MODEL_ARGS]) == 0
    assert (out / "model.safetensors").exists() and not (out / "test_metrics.json").exists()


@pytest.mark.slow
def test_real_imdb_sample_beats_chance(shared_imdb, tmp_path):
    out = tmp_path / "imdb"
    assert main(["--data", str(shared_imdb), "--output", str(out), "--limit", "3000", "--val-size", "500",
                 "--epochs", "1", "--d-model", "64", "--heads", "2", "--layers", "1", "--d-ff", "128",
                 "--max-len", "128", "--vocab-size", "8000", "--batch-size", "32", "--lr", "2e-3",
                 "--warmup", "20", "--quiet", "--no-test"]) == 0
    best = max(r["val_accuracy"] for r in read_jsonl(out / "metrics.jsonl"))
    assert best > 0.68, best


def test_validation_size_follows_the_data_when_not_given(parquet_data, tmp_path, capsys):
    from classify.text.data import default_val_size

    assert (default_val_size(25000), default_val_size(3000), default_val_size(400)) == (2500, 300, 40)
    i = TINY_MODEL_ARGS.index("--val-size")
    tiny = TINY_MODEL_ARGS[:i] + TINY_MODEL_ARGS[i + 2:]
    out = tmp_path / "run"
    assert main(["--data", str(parquet_data), "--output", str(out), "--limit", "300", "--max-steps", "2",
                 *tiny]) == 0
    assert json.loads((out / "config.json").read_text())["train"]["val_size"] == 30  # recorded: resumes compare it
    assert main(["--data", str(parquet_data), "--output", str(out), "--limit", "300", "--max-steps", "4",
                 *tiny]) == 0  # the same default again: the same run, resumed


def test_the_ngram_branch_self_trains_on_the_sources_unlabelled_reviews(unlabelled_data, tmp_path):
    weights = {}
    for flag in ("--ngram-self-train", "--no-ngram-self-train"):
        out = tmp_path / flag
        assert main(["--data", str(unlabelled_data), "--output", str(out), "--max-steps", "1", "--no-test", flag,
                     *TINY_MODEL_ARGS]) == 0
        weights[flag] = load_tensors(out / "model.safetensors")
        assert json.loads((out / "config.json").read_text())["train"]["ngram_self_train"] == (flag == "--ngram-self-train")
    self_trained, plain = weights["--ngram-self-train"], weights["--no-ngram-self-train"]
    # The unlabelled reviews add n-grams of their own: more slots get weights than from the labelled ones alone.
    assert (self_trained["ngram.weight"] != 0).any(dim=1).sum() > (plain["ngram.weight"] != 0).any(dim=1).sum()


def test_unlabelled_reviews_labelled_by_the_ngram_model_train_the_transformer_too(unlabelled_data, tmp_path):
    steps = {}
    for name, flags in {"plain": ["--no-pseudo-labels"], "pseudo": [],
                        "pure": ["--ngram-orders", "0"]}.items():  # a teacher fitted for the labels alone
        out = tmp_path / name
        assert main(["--data", str(unlabelled_data), "--output", str(out), "--epochs", "1", "--no-test", *flags,
                     "--no-negation-edits", "--no-contrast-joins", *TINY_MODEL_ARGS]) == 0
        steps[name] = json.loads((out / "last" / "state.json").read_text())["step"]
        labels = out / "pseudo_labels.json"
        assert labels.exists() == (name != "plain")
        if name != "plain":
            saved = json.loads(labels.read_text())
            assert saved["count"] == len(saved["labels"]) == 600 and set(saved["labels"]) == {0, 1}
            assert saved["teacher"] == ("n-gram teacher" if name == "pure" else "n-gram branch, first fit")
    # One epoch, 16 texts a batch: 320 labelled reviews and their closing sentences, or those and the 600 unlabelled
    # ones and theirs.
    assert (steps["plain"], steps["pseudo"], steps["pure"]) == (40, 115, 115)
    assert not any(k.startswith("ngram.") for k in load_tensors(tmp_path / "pure" / "model.safetensors"))  # teacher not kept


def test_soft_labels_put_the_teachers_probabilities_into_the_loss():
    labels, given = [1, 0], np.array([[0.3, 0.7], [0.9, 0.1]], dtype=np.float32)
    assert training_targets(labels, given, soft=False) == [1, 0, 1, 0]   # the teacher's most likely class
    targets = training_targets(labels, given, soft=True)
    expected = np.array([[0, 1], [1, 0], [0.3, 0.7], [0.9, 0.1]], np.float32)   # one-hot, then the teacher's
    np.testing.assert_array_equal(targets, expected)
    assert training_targets(labels, given[:0], soft=True) == [1, 0]

    model = Classifier(vocab_size=16, num_classes=2, d_model=8, num_heads=2, num_layers=1, d_ff=16, max_len=8).eval()
    ids = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12]]
    task = ClassificationTask(model, ids, targets, Validation([], [], np.zeros(0, dtype=bool)),
                              TrainConfig(data="unused"), torch.device("cpu"), None)
    batch = task.collate([2, 0, 3])
    assert batch["labels"].dtype == torch.float32 and batch["labels"].shape == (3, 2)
    loss, sums = task.loss(model, batch)
    expected = -(batch["labels"] * F.log_softmax(model(batch["tokens"]), -1)).sum(-1).mean()
    torch.testing.assert_close(loss, expected)
    predicted = model(batch["tokens"]).argmax(-1)
    assert sums["correct"] == float((predicted == torch.tensor([1, 1, 0])).sum())  # against each target's argmax
    hard = Collate(ids, [1, 0, 1, 0])([2, 0])["labels"]
    assert hard.dtype == torch.long and hard.tolist() == [1, 1]


def test_the_teachers_texts_are_reweighted_and_moved_towards_the_transformers_own_class():
    labels, given = [1, 0], np.array([[0.3, 0.7], [1.0, 0.0]], dtype=np.float32)   # float32 rounds a sure teacher to 1
    targets = training_targets(labels, given, soft=True)
    assert (targets[2:].max(1) < 1).all() and (targets[:2].max(1) == 1).all()   # the teacher's rows are told apart
    np.testing.assert_allclose(targets[3], [1, 0], atol=2e-6)

    model = Classifier(vocab_size=16, num_classes=2, d_model=8, num_heads=2, num_layers=1, d_ff=16, max_len=8).eval()
    ids = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12]]

    def loss_of(**settings) -> tuple[torch.Tensor, dict]:
        task = ClassificationTask(model, ids, targets, Validation([], [], np.zeros(0, dtype=bool)),
                                  TrainConfig(data="unused", **settings), torch.device("cpu"), None)
        return task.loss(model, task.collate([0, 1, 2, 3]))

    batch = Collate(ids, targets)([0, 1, 2, 3])
    log_p = F.log_softmax(model(batch["tokens"]), -1)
    per_text = -(batch["labels"] * log_p).sum(-1)                                   # (4,)
    torch.testing.assert_close(loss_of()[0], per_text.mean())                       # the defaults: plain cross-entropy
    torch.testing.assert_close(loss_of(pseudo_label_weight=0.25)[0],                # given labels 1, the teacher's 0.25
                               (per_text * torch.tensor([1, 1, 0.25, 0.25])).mean())
    own = F.one_hot(log_p.argmax(-1), 2).float()
    moved = torch.cat([batch["labels"][:2], 0.8 * batch["labels"][2:] + 0.2 * own[2:]])
    torch.testing.assert_close(loss_of(self_label_share=0.2)[0], -(moved * log_p).sum(-1).mean())
    with pytest.raises(ClassifyError, match="--soft-labels"):
        TrainConfig(data="unused", soft_labels=False, pseudo_label_weight=0.5).validate(model.config)


def test_soft_labelled_run_keeps_the_probabilities_and_older_label_files_still_read(unlabelled_data, tmp_path):
    out = tmp_path / "soft"
    assert main(["--data", str(unlabelled_data), "--output", str(out), "--max-steps", "2", "--no-test",
                 "--soft-labels", *TINY_MODEL_ARGS]) == 0
    saved = json.loads((out / "pseudo_labels.json").read_text())
    probs = np.asarray(saved["probabilities"], dtype=np.float32)
    assert probs.shape == (600, 2) and np.allclose(probs.sum(1), 1, atol=1e-5) and (probs.max(1) < 1).any()
    assert saved["labels"] == probs.argmax(1).tolist()
    run = RunFolder(out, "classifier")
    np.testing.assert_array_equal(run.pseudo_labels(2), probs)   # bit for bit: a resumed run trains on the same
    (out / "pseudo_labels.json").write_text('{"teacher": "n-gram branch, first fit", "count": 3, "labels": [1, 0, 1]}')
    np.testing.assert_array_equal(run.pseudo_labels(2), [[0, 1], [1, 0], [0, 1]])   # an older run's file
    (out / "pseudo_labels.json").write_text('{"labels": [1, 0, 2]}')
    with pytest.raises(ClassifyError, match="is damaged"):
        run.pseudo_labels(2)


def test_the_mix_is_fitted_on_the_shipped_weights_logits_from_training_without_another_pass(parquet_data, tmp_path,
                                                                                            monkeypatch):
    import classify.train as train_module

    passes, mixed = [], {}
    scored, chosen = train_module.transformer_logits, train_module.choose_mix
    monkeypatch.setattr(train_module, "transformer_logits", lambda *a, **k: passes.append(1) or scored(*a, **k))

    def choose(run, model, validation, device, dtype, batch_size, console, logits=None):
        mixed.update(ids=validation.ids, logits=logits)
        return chosen(run, model, validation, device, dtype, batch_size, console, logits)

    monkeypatch.setattr(train_module, "choose_mix", choose)
    out = tmp_path / "run"
    # Two validations: whichever scores best, its logits are the ones of model.safetensors' weights.
    assert main(["--data", str(parquet_data), "--output", str(out), "--max-steps", "4", "--eval-every", "2",
                 "--no-test", "--no-negation-edits", "--no-contrast-joins", *TINY_MODEL_ARGS]) == 0
    assert len(passes) == len(read_jsonl(out / "metrics.jsonl")) == 2   # the mix took no pass of its own
    shipped = load_run(out, torch.device("cpu")).model
    np.testing.assert_allclose(mixed["logits"], scored(shipped, mixed["ids"], torch.device("cpu"), None, 32),
                               atol=1e-5)


def test_the_kept_branch_is_fitted_on_all_labelled_reviews_and_the_mix_on_the_first_fits_logits(parquet_data,
                                                                                                  tmp_path):
    out = tmp_path / "run"
    assert main(["--data", str(parquet_data), "--output", str(out), "--max-steps", "2", "--no-negation-edits",
                 "--no-contrast-joins", *TINY_MODEL_ARGS]) == 0
    run = load_run(out, torch.device("cpu"))
    config = run.config["train"]
    train, val = training_split(config["data"], config["val_size"], config["seed"], split=config["split"])
    encode = run.preprocessing.ids

    def fitted_on(texts, labels):
        bag = ngram_branch(run.model.config)
        fit_ngram_bag(bag, encode(texts), labels, config["ngram_c"], min_count=config["ngram_min_count"])
        return bag_logits(bag, encode(val.texts)).numpy()

    # The held-out logits: the validation reviews, then their closing sentences, from the first fit.
    held_out = RunFolder(out, "classifier").branch_validation(2 * len(val), 2)[: len(val)]
    np.testing.assert_allclose(held_out, fitted_on(train.texts, train.labels), atol=1e-4)   # the first fit's
    kept = bag_logits(run.model.ngram, encode(val.texts)).numpy()
    np.testing.assert_allclose(kept, fitted_on(train.texts + val.texts, train.labels + val.labels), atol=1e-4)
    # The mix and its validation scores come from the held-out logits, not from the branch that saw the reviews.
    mix = json.loads((out / "test_metrics.json").read_text())
    assert mix["val_accuracy"]["ngram"] == float((held_out.argmax(1) == np.asarray(val.labels)).mean())
    assert set(mix["val_accuracy"]) == {"transformer", "transformer_short", "ngram", "ngram_short", "mixed",
                                        "mixed_short"}

    plain = tmp_path / "plain"
    assert main(["--data", str(parquet_data), "--output", str(plain), "--max-steps", "2", "--no-test",
                 "--no-ngram-refit", "--no-negation-edits", "--no-contrast-joins", *TINY_MODEL_ARGS]) == 0
    # Without the refit the kept branch is the first fit: its logits are the held-out ones.
    kept = bag_logits(load_run(plain, torch.device("cpu")).model.ngram, encode(val.texts)).numpy()
    np.testing.assert_allclose(RunFolder(plain, "classifier").branch_validation(2 * len(val), 2)[: len(val)], kept,
                               atol=1e-5)
    (out / "branch_validation.json").write_text('{"count": 2, "logits": [[0, 1], [1, 0]]}')
    with pytest.raises(ClassifyError, match="is damaged or from another split"):
        RunFolder(out, "classifier").branch_validation(2 * len(val), 2)


@pytest.mark.parametrize("teacher_flag, branch_flag, one, other, same", [
    ("--teacher-edit-weight", "--negation-edit-weight", "0.5", "0.05", []),
    ("--teacher-min-count", "--ngram-min-count", "1", "3",
     ["--teacher-edit-weight", "0.05", "--negation-edit-weight", "0.05"])])
def test_the_teacher_and_the_kept_branch_are_fitted_each_by_its_own_flag(unlabelled_data, tmp_path, monkeypatch,
                                                                         teacher_flag, branch_flag, one, other, same):
    """Each setting of the two fits apart (``same``: the others made equal, so that one setting alone differs). With
    two threads the teacher is fitted on a second thread beside the branch, with one after it: the same fits."""
    beside = []
    monkeypatch.setattr("classify.train.Background", lambda fn, name: beside.append(name) or Background(fn, name))

    def run(teacher: str, branch: str, threads: str = "1") -> dict:
        out = tmp_path / f"{teacher}-{branch}-{threads}"
        assert main(["--data", str(unlabelled_data), "--output", str(out), "--max-steps", "1", "--no-test",
                     *TINY_MODEL_ARGS, teacher_flag, teacher, branch_flag, branch, *same,   # the last flag wins
                     "--threads", threads]) == 0
        folder = RunFolder(out, "classifier")
        return {"teacher": json.loads((out / "pseudo_labels.json").read_text())["teacher"],
                "labels": folder.pseudo_labels(2), "held_out": folder.branch_validation(
                    json.loads((out / "branch_validation.json").read_text())["count"], 2),
                "branch": load_tensors(out / "model.safetensors")["ngram.weight"]}

    both, teacher_only, branch_only = run(one, other, "2"), run(one, one), run(other, other)
    assert (both["teacher"], teacher_only["teacher"]) == ("n-gram teacher", "n-gram branch, first fit")
    in_turn = run(one, other)
    assert beside == ["n-gram-teacher"]   # the run of two threads with a teacher of its own, alone
    for part in ("labels", "held_out"):
        np.testing.assert_array_equal(both[part], in_turn[part])
    torch.testing.assert_close(both["branch"], in_turn["branch"], rtol=0, atol=0)
    # The unlabelled reviews' labels come from the fit at the teacher's setting ...
    np.testing.assert_array_equal(both["labels"], teacher_only["labels"])
    assert not np.allclose(both["labels"], branch_only["labels"])   # (the setting matters on this data)
    # ... the branch's held-out logits and the branch the model keeps from the fits at the branch's.
    np.testing.assert_array_equal(both["held_out"], branch_only["held_out"])
    torch.testing.assert_close(both["branch"], branch_only["branch"], rtol=0, atol=0)
    assert not torch.equal(both["branch"], teacher_only["branch"])


def test_without_teacher_passages_the_kept_branch_alone_reads_the_edited_passages(unlabelled_data, tmp_path):
    """--no-teacher-passages: the teacher labels the unlabelled reviews as in a run without the passages, and the
    branch the model keeps is fitted as in a run whose fits all read them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [(f"Movie {pair} opens at night. It was {ending}", label, pair, kind) for pair in range(1, 13)
            for ending, label, kind in (("boring and awful.", 0, "original"), ("superb, not dull.", 1, "revised"))]
    pq.write_table(pa.table(dict(zip(("text", "label", "pair", "kind"), map(list, zip(*rows))))),
                   tmp_path / "train.parquet")   # two sentences a pair: one passage each side

    def run(name: str, *flags: str) -> dict:
        out = tmp_path / name
        assert main(["--data", str(unlabelled_data), "--output", str(out), "--max-steps", "1", "--no-test",
                     *TINY_MODEL_ARGS, "--counterfactual", str(tmp_path), *flags]) == 0
        return {"teacher": json.loads((out / "pseudo_labels.json").read_text())["teacher"],
                "labels": RunFolder(out, "classifier").pseudo_labels(2),
                "branch": load_tensors(out / "model.safetensors")["ngram.weight"],
                "recorded": json.loads((out / "config.json").read_text())["train"]["teacher_passages"]}

    passages = ["--counterfactual-passages", "--counterfactual-passage-weight", "0.5",
                "--counterfactual-passage-repeat", "0", "--teacher-min-count", "2", "--no-negation-edits"]
    # (the teacher's other settings the branch's: one fit unless the passages tell them apart)
    without, everywhere = run("without", *passages[-3:]), run("everywhere", *passages)
    kept_only = run("kept-only", *passages, "--no-teacher-passages")
    assert (everywhere["teacher"], kept_only["teacher"]) == ("n-gram branch, first fit", "n-gram teacher")
    assert (everywhere["recorded"], kept_only["recorded"]) == (True, False)
    np.testing.assert_array_equal(kept_only["labels"], without["labels"])
    assert not np.allclose(everywhere["labels"], without["labels"])   # (the passages matter on this data)
    torch.testing.assert_close(kept_only["branch"], everywhere["branch"], rtol=0, atol=0)
    assert not torch.equal(kept_only["branch"], without["branch"])


def test_a_resume_whose_pseudo_labels_do_not_match_is_refused(unlabelled_data, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--data", str(unlabelled_data), "--output", str(out), "--max-steps", "2", "--no-test", *TINY_MODEL_ARGS]
    assert main(argv) == 0
    (out / "pseudo_labels.json").write_text('{"labels": [1, 0]}')
    assert run_cli(main, argv[:5] + ["4"] + argv[6:]) == 2
    err = capsys.readouterr().err
    assert "holds labels for 2 unlabelled reviews, the source has 600" in err and len(err.strip().splitlines()) == 1


def test_counterfactual_pairs_train_both_branches_and_validation_reads_short_texts(parquet_data, counterfactual_data,
                                                                                    tmp_path):
    out = tmp_path / "run"
    assert main(["--data", str(parquet_data), "--output", str(out), "--epochs", "1", "--no-test", "--no-pseudo-labels",
                 "--counterfactual", str(counterfactual_data), "--counterfactual-repeat", "3", "--no-negation-edits",
                 "--no-contrast-joins", *TINY_MODEL_ARGS]) == 0
    # The pairs trained on: outside the held-out quarter, and not those whose original is a validation review.
    train, val = training_split(str(parquet_data), 80, 0)
    pairs = load_pairs(counterfactual_data, held_out=False)
    kept = sum(1 for t in pairs.original.texts if t not in set(val.texts))
    assert 0 < kept < len(pairs) + 1 and len(pairs) == 30
    step = json.loads((out / "last" / "state.json").read_text())["step"]
    assert step == -(-(320 + 2 * kept * 3 + 320) // 16)   # reviews, pairs x 3, the reviews' closing sentences
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"val_accuracy", "val_short_accuracy", "val_mixed_accuracy", "val_mixed_short_accuracy"} <= set(record)
    held_out = json.loads((out / "branch_validation.json").read_text())
    assert held_out["count"] == 80 + 80   # the n-gram branch's held-out logits: reviews and closing sentences


def test_paired_counterfactual_texts_share_a_batch_and_add_the_margin_loss(parquet_data, counterfactual_data,
                                                                          tmp_path):
    out = tmp_path / "run"
    assert main(["--data", str(parquet_data), "--output", str(out), "--epochs", "1", "--no-test", "--no-pseudo-labels",
                 "--counterfactual", str(counterfactual_data), "--counterfactual-repeat", "3", "--no-negation-edits",
                 "--no-contrast-joins", "--counterfactual-pair-weight", "0.5", *TINY_MODEL_ARGS]) == 0
    train, val = training_split(str(parquet_data), 80, 0)
    kept = sum(1 for t in load_pairs(counterfactual_data, held_out=False).original.texts if t not in set(val.texts))
    step = json.loads((out / "last" / "state.json").read_text())["step"]
    assert step == -(-(320 + kept * 3 + 320) // 16)   # a pair is served as one example: its revision comes with it
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["train_pair_loss"] > 0
    assert json.loads((out / "config.json").read_text())["train"]["counterfactual_pair_weight"] == 0.5


def test_negation_edits_paired_come_in_one_batch_with_their_sentence(parquet_data, tmp_path):
    out = tmp_path / "run"
    assert main(["--data", str(parquet_data), "--output", str(out), "--epochs", "1", "--no-test", "--no-pseudo-labels",
                 "--no-contrast-joins", "--negation-edit-pair-weight", "1", *TINY_MODEL_ARGS]) == 0
    train, val = training_split(str(parquet_data), 80, 0)
    made, _ = rule_made_examples(TrainConfig(data=str(parquet_data), negation_edits=True, contrast_joins=False),
                                 train, val)
    edits = len(made["edit"].texts)
    assert edits > 0
    step = json.loads((out / "last" / "state.json").read_text())["step"]
    assert step == -(-(320 + edits // 2 + 320) // 16)   # reviews, sentences with their edits, closing sentences
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["train_pair_loss"] > 0


def test_a_pair_is_collated_together_and_its_margin_ignores_what_the_texts_share():
    collate = Collate([[3, 4], [5], [6, 7, 8], [3, 9], [6, 7]], [1, 0, 1, 0, 0], partner=np.array([3, -1, 4]),
                      partner_weight=np.array([2.0, 0.0, 0.5]))
    batch = collate([1, 0, 2])
    assert batch["tokens"][:, :2].tolist() == [[5, 0], [3, 4], [6, 7], [3, 9], [6, 7]]   # partners after the batch
    assert batch["labels"].tolist() == [0, 1, 1, 0, 0] and batch["pairs"].tolist() == [[1, 3], [2, 4]]
    assert batch["pair_weights"].tolist() == [2.0, 0.5]
    assert collate([1])["pairs"].shape == (0, 2)
    torch.manual_seed(0)
    model = Classifier(vocab_size=16, num_classes=2, d_model=8, num_heads=2, num_layers=1, d_ff=16, max_len=8).eval()
    tokens = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 7]])
    logits = model(tokens)
    classes, pairs = torch.tensor([1, 0, 0]), torch.tensor([[0, 1], [0, 2]])
    same, edited = pair_loss(logits, classes, pairs)
    # Identical texts lean alike whatever the weights: the margin is 0 (loss log 2) and gives no gradient at all.
    torch.testing.assert_close(same, torch.tensor(math.log(2)))
    grads = torch.autograd.grad(same, list(model.parameters()), allow_unused=True, retain_graph=True)
    assert max(float(g.abs().max()) for g in grads if g is not None) < 1e-6
    lean = (logits[:, 1] - logits[:, 0]).detach()
    torch.testing.assert_close(edited.detach(), F.softplus(-(lean[0] - lean[2])))
    grads = torch.autograd.grad(edited, list(model.parameters()), allow_unused=True)
    assert max(float(g.abs().max()) for g in grads if g is not None) > 1e-3


def test_closing_passages_are_training_texts_only(tmp_path):
    # Reviews of one to four sentences of 8 words (the fixture's are one long sentence each, and --max-len is 64),
    # so some have a passage and some do not.
    rows = synthetic_reviews(600, seed=3)
    sentences = {label: [" ".join(t.split()[:8]) + "." for t, y in rows if y == label] for label in (0, 1)}
    reviews = [(" ".join(sentences[i % 2][i % 290: i % 290 + 1 + i % 4]), i % 2) for i in range(300)]
    data = write_csv(tmp_path / "reviews.csv", reviews)
    out = tmp_path / "run"
    assert main(["--data", str(data), "--output", str(out), "--epochs", "1", "--no-test", "--no-pseudo-labels",
                 "--no-negation-edits", "--no-contrast-joins", "--closing-passages", *TINY_MODEL_ARGS,
                 "--val-size", "60"]) == 0
    train, _ = training_split(str(data), 60, 0)
    run = load_run(out, torch.device("cpu"))
    ends = set(token_ids(run.preprocessing.tokenizer, SENTENCE_ENDS))
    passages = sum(closing_passage(ids, ends) is not None for ids in run.preprocessing.ids(train.texts))
    assert 0 < passages < len(train) and json.loads((out / "config.json").read_text())["train"]["closing_passages"]
    step = json.loads((out / "last" / "state.json").read_text())["step"]
    assert step == -(-(2 * len(train) + passages) // 16)   # reviews, their closing sentences, their closing passages
    held_out = json.loads((out / "branch_validation.json").read_text())
    assert held_out["count"] == 2 * 60   # validation: reviews and closing sentences, no passages


def test_an_elided_negation_is_the_last_sentence_that_ends_on_a_negated_auxiliary():
    texts = ["We hoped it would get better. It didn't. The end was long.",
             "I thought the film would be great, but it wasn't!", "Was it good? It was not?",
             "Nothing here. It was not good.", "It was fun. I liked it, but he did not. She could not."] * 2
    tokenizer = train_tokenizer(texts, 200)
    ends, elision = set(token_ids(tokenizer, SENTENCE_ENDS)), Elision.of(tokenizer)

    def cut(text: str) -> str | None:
        window = elided_negation(tokenizer.encode(text).ids, ends, elision)
        return None if window is None else tokenizer.decode(window)

    assert cut(texts[0]) == "we hoped it would get better . it didn ' t ."   # short: the sentence before too
    assert cut(texts[1]) == "i thought the film would be great , but it wasn ' t !"
    assert cut(texts[2]) is None and cut(texts[3]) is None   # a question; a negation with its verb
    assert cut(texts[4]) == "i liked it , but he did not . she could not ."   # the last one, up to 8 words


def test_elided_negations_are_training_texts_repeated(tmp_path):
    rows = synthetic_reviews(300, seed=4)
    reviews = [(t + (" We hoped it would be better. It was not." if i % 3 == 0 else ""), y)
               for i, (t, y) in enumerate(rows)]
    data = write_csv(tmp_path / "reviews.csv", reviews)
    out = tmp_path / "run"
    assert main(["--data", str(data), "--output", str(out), "--epochs", "1", "--no-test", "--no-pseudo-labels",
                 "--no-negation-edits", "--no-contrast-joins", "--elided-negation-repeat", "2", *TINY_MODEL_ARGS,
                 "--val-size", "60"]) == 0
    train, _ = training_split(str(data), 60, 0)
    run = load_run(out, torch.device("cpu"))
    ends = set(token_ids(run.preprocessing.tokenizer, SENTENCE_ENDS))
    elided = sum(elided_negation(ids, ends, Elision.of(run.preprocessing.tokenizer)) is not None
                 for ids in run.preprocessing.ids(train.texts))
    assert 0.2 * len(train) < elided < 0.5 * len(train)
    step = json.loads((out / "last" / "state.json").read_text())["step"]
    assert step == -(-(2 * len(train) + 2 * elided) // 16)   # reviews, closing sentences, the elisions twice
    assert json.loads((out / "config.json").read_text())["train"]["elided_negation_repeat"] == 2


def test_windows_balanced_by_label_give_each_class_as_many_copies():
    ids = [[1, 2], [3, 4], [5, 6], [7, 8], [9]]
    cut = lambda x: x[-1:] if len(x) > 1 else None   # the last review has no window
    hard = [0, 0, 0, 1, 1]
    plain, plain_targets = with_windows(ids, hard, [0, 1, 2, 3, 4], cut, times=2)
    assert plain[5:] == [[2], [4], [6], [8]] * 2 and plain_targets[5:] == [0, 0, 0, 1] * 2   # copy by copy
    balanced, targets = with_windows(ids, hard, [0, 1, 2, 3, 4], cut, times=2, balance=True)
    added = list(zip(map(tuple, balanced[5:]), targets[5:]))
    assert sum(y == 0 for _, y in added) == sum(y == 1 for _, y in added) == 6   # 3 windows x 2; 1 window x 6
    assert added.count(((8,), 1)) == 6 and added.count(((2,), 0)) == 2
    soft = np.array([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.4, 0.6], [0.5, 0.5]], dtype=np.float32)
    more, soft_targets = with_windows(ids, soft, [0, 1, 2, 3], cut, times=1, balance=True)   # 2 and 2: as is
    assert more[5:] == [[2], [4], [6], [8]] and np.array_equal(soft_targets[5:], soft[:4])


def test_negators_choose_the_forms_of_the_negation_edits_on_both_sides_of_validation(parquet_data):
    train, val = training_split(str(parquet_data), 160, 0)
    texts = {"train": [normalize(t) for t in train.texts], "val": [normalize(t) for t in val.texts]}
    lexicon = Lexicon.fit(texts["train"], train.labels)
    for negators in NEGATION_FORMS:   # "never", the default, among them
        config = TrainConfig(data=str(parquet_data), negators=negators, contrast_joins=False)
        made = rule_made_examples(config, train, val)
        for side, (split, examples) in zip(("train", "val"), ((train, made[0]), (val, made[1]))):
            assert examples["edit"].texts == negation_pairs(texts[side], split.labels, lexicon, negators=negators)[0]
    assert negation_pairs(texts["train"], train.labels, lexicon)[0] != made[0]["edit"].texts   # told apart


def test_rule_made_texts_train_the_model_and_are_validation_groups(parquet_data, tmp_path):
    out = tmp_path / "run"
    assert main(["--data", str(parquet_data), "--output", str(out), "--epochs", "1", "--no-test", "--no-pseudo-labels",
                 *TINY_MODEL_ARGS, "--val-size", "160", "--contrast-join-repeat", "2",
                 "--negation-edit-repeat", "3"]) == 0
    train, val = training_split(str(parquet_data), 160, 0)   # enough validation sentences to join a few
    texts = {"train": [normalize(t) for t in train.texts], "val": [normalize(t) for t in val.texts]}
    lexicon = Lexicon.fit(texts["train"], train.labels)
    edits, val_edits = (negation_pairs(texts[s], split.labels, lexicon)[0] for s, split in (("train", train),
                                                                                             ("val", val)))
    joins, val_joins = (contrast_joins(texts[s], split.labels, lexicon)[0] for s, split in (("train", train),
                                                                                             ("val", val)))
    assert edits and val_edits and joins and val_joins   # the fixture's sentences give some of each
    step = json.loads((out / "last" / "state.json").read_text())["step"]
    # reviews, rule-made texts (the edits three times, the joins twice), closing sentences
    assert step == -(-(240 + 3 * len(edits) + 2 * len(joins) + 240) // 16)
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"val_edit_accuracy", "val_ngram_edit_accuracy", "val_mixed_edit_accuracy", "val_join_accuracy",
            "val_mixed_join_accuracy"} <= set(record)
    held_out = json.loads((out / "branch_validation.json").read_text())
    assert held_out["count"] == 160 + 160 + len(val_edits) + len(val_joins)
    assert {k: json.loads((out / "config.json").read_text())["train"][k]
            for k in ("negation_edit_weight", "teacher_edit_weight")} == {"negation_edit_weight": 0.01,
                                                                          "teacher_edit_weight": 0.1}
    # Without the flags, none: the run is the one before rule-made texts.
    plain = tmp_path / "plain"
    assert main(["--data", str(parquet_data), "--output", str(plain), "--epochs", "1", "--no-test",
                 "--no-pseudo-labels", "--no-negation-edits", "--no-contrast-joins",
                 *TINY_MODEL_ARGS, "--val-size", "160"]) == 0
    assert json.loads((plain / "last" / "state.json").read_text())["step"] == 30
    assert not {"val_edit_accuracy", "val_join_accuracy"} & set(json.loads((plain / "metrics.jsonl").read_text()
                                                                          .splitlines()[-1]))


def test_train_max_len_cuts_every_training_text_after_the_closing_sentences_are_cut_from_whole_reviews():
    ends, no_elision = {1}, Elision(frozenset(), frozenset(), None, None, None, frozenset())
    review = [20, 21, 22, 23, 1, 30, 31, 32, 33, 34, 35, 36, 1]          # its closing sentence: 30 ... 1 (8 tokens)
    parts = [TrainingPart([review, [5, 6, 1]], [1, 0]), TrainingPart([list(range(40, 50))], [0], times=2)]
    pseudo = [np.arange(60, 72, dtype=np.int32)]                        # as Preprocessing.ids gives them
    whole, cut = (TransformerExamples.build(parts, pseudo, np.array([[0.2, 0.8]]),
                                            TrainConfig(data="x", train_max_len=limit), ends, no_elision)
                  for limit in (None, 4))
    assert whole.windows == cut.windows == {"closing sentences": 3} and whole.ids[5] == review[5:]
    assert cut.ids[0] == [20, 35, 36, 1] and cut.ids[5] == [30, 35, 36, 1]   # head+tail: a quarter from the start
    assert cut.ids[2] == cut.ids[3] == [40, 47, 48, 49] and cut.ids[1] == whole.ids[1] == [5, 6, 1]
    assert cut.ids[4].tolist() == [60, 69, 70, 71] and cut.ids[4].dtype == np.int32
    assert [len(x) for x in cut.ids] == [min(len(x), 4) for x in whole.ids]
    assert np.array_equal(whole.targets, cut.targets)


def test_closing_sentences_are_the_last_sentence_long_enough_and_capped():
    ends = {1, 2}   # "." and "!"
    assert closing_sentence([5, 6, 1, 7, 8, 9, 10, 1], ends) == [7, 8, 9, 10, 1]
    assert closing_sentence([5, 6, 7, 8, 1, 9, 1, 2, 2], ends) == [5, 6, 7, 8, 1, 9, 1, 2, 2]   # too short: one more
    assert closing_sentence([5, 6, 7], ends) == [5, 6, 7]                                       # no end mark
    long = list(range(10, 110))
    assert closing_sentence([5, 1] + long, ends) == long[-48:]
    three = [5, 6, 7, 8, 1, 9, 10, 11, 12, 1, 13, 14, 15, 16, 2, 17, 18, 19, 20, 1]   # four sentences
    assert closing_sentence(three, ends, sentences=3) == three[5:]
    assert closing_passage(three, ends) == three[5:]
    assert closing_passage([5, 1] + long, ends) == long[-96:]
    assert closing_passage(three[5:], ends) is None                  # the whole review: not a new text
    assert closing_passage([30, 1, 20, 21, 1, 5, 1, 6, 7, 1], ends) is None   # its closing sentence already
    validation = Validation.build([[5, 6, 1, 7, 8, 9, 10, 1], [3, 4]], [1, 0], ends)
    assert validation.ids[2:] == [[7, 8, 9, 10, 1], [3, 4]] and validation.labels == [1, 0, 1, 0]
    assert validation.short.tolist() == [False, False, True, True]
