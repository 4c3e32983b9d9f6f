"""The one training loop (classify.engine.loop.fit) and the run folder it writes, through all three
trainers: a kill and a resume end exactly where an uninterrupted run ends; one writer per folder; a
full disk is one line."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

import classify.engine.files as files
import classify.engine.loop as loop
from classify.engine.average import WeightAverage
from classify.engine.files import load_tensors, read_json
from classify.engine.runfolder import LAST, LOCK, METRICS, WEIGHTS, RunFolder
from classify.errors import ClassifyError, run_cli
from classify.pretrain import main as pretrain_main
from classify.seq2seq.cli import main as seq2seq_main
import classify.train as train
from classify.train import main as train_main
from conftest import TINY_MODEL_ARGS
from test_pretrain import TINY_PRETRAIN_ARGS
from test_seq2seq import TINY as TINY_SEQ2SEQ_ARGS
from test_seq2seq import write_corpus

# Validation every 8 steps, last/ every 5: a kill in step 13 loses steps 11-13 and the row of step 8
# stays; the resumed run must redo exactly those steps.
LOOP_ARGS = ["--max-steps", "24", "--epochs", "5", "--eval-every", "8", "--save-every", "5"]
TIMES = ("elapsed_s", "tokens_per_s", "validation_s")


@pytest.fixture(scope="module", autouse=True)
def restore_threads():
    """--threads 1 sets a process-wide torch setting: give the other test modules theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("toy"), {"train": 200, "val": 20})


def command(kind: str, parquet_data: Path, corpus: Path, out: Path) -> tuple:
    """(main, argv) of a small run of trainer ``kind`` into ``out``; "classifier+average" keeps a weight average
    from a quarter of the steps on (step 6), so the kill in step 13 leaves one of 5 steps in last/."""
    if kind.startswith("classifier"):  # one thread, as the other two: tiny models crawl on two busy ones
        average = ["--average-from", "0.25"] if kind.endswith("+average") else []
        return train_main, ["--data", str(parquet_data), "--output", str(out), *LOOP_ARGS, *TINY_MODEL_ARGS,
                            "--threads", "1", *average]
    if kind == "pretrain":
        return pretrain_main, ["--data", str(parquet_data), "--output", str(out), *LOOP_ARGS, *TINY_PRETRAIN_ARGS]
    return seq2seq_main, ["train", "--data", str(corpus), "--output", str(out), *LOOP_ARGS, *TINY_SEQ2SEQ_ARGS]


def rows(run: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock readings."""
    return [{k: v for k, v in r.items() if k not in TIMES} for r in files.read_jsonl(run / METRICS)]


def last_state(run: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    state = read_json(run / LAST / "state.json", "state")
    return state, load_tensors(run / LAST / state["weights_file"])


@pytest.mark.parametrize("kind", ["classifier", "classifier+average", "pretrain", "seq2seq"])
def test_kill_and_resume_ends_like_an_uninterrupted_run(kind, parquet_data, unlabelled_data, corpus, tmp_path,
                                                       monkeypatch):
    # The classifier reads unlabelled reviews too: self-training and pseudo-labels, which a resumed run must
    # take from the run folder, not fit again.
    data = unlabelled_data if kind.startswith("classifier") else parquet_data
    main, straight = command(kind, data, corpus, tmp_path / "straight")
    assert main(straight) == 0
    main, killed = command(kind, data, corpus, tmp_path / "killed")

    real_step, calls = loop.optimizer_step, {"n": 0}

    def crash_in_13(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 13:
            raise RuntimeError("simulated kill")  # files are left as a SIGKILL would leave them
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop, "optimizer_step", crash_in_13)
    with pytest.raises(RuntimeError, match="simulated kill"):
        main(killed)
    assert last_state(tmp_path / "killed")[0]["step"] == 10
    monkeypatch.setattr(loop, "optimizer_step", real_step)
    monkeypatch.setattr(train, "fit_ngram_stage", lambda *a, **k: pytest.fail("stage 1 ran again on resume"))
    assert main(killed) == 0

    (a_state, a), (b_state, b) = last_state(tmp_path / "straight"), last_state(tmp_path / "killed")
    assert a_state["step"] == b_state["step"] == 24 and a_state["tokens"] == b_state["tokens"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    best_a, best_b = load_tensors(tmp_path / "straight" / WEIGHTS), load_tensors(tmp_path / "killed" / WEIGHTS)
    assert all(torch.equal(best_a[k], best_b[k]) for k in best_a)
    assert rows(tmp_path / "killed") == rows(tmp_path / "straight")  # no row lost, doubled or changed
    assert [r["step"] for r in rows(tmp_path / "killed")] == ([0] if kind == "pretrain" else []) + [8, 16, 24]
    if kind.endswith("+average"):  # steps 6 to 24 averaged, the saved mean the same as without the kill
        assert [r["averaged_steps"] for r in rows(tmp_path / "killed")] == [3, 11, 19]
        mean_a = load_tensors(tmp_path / "straight" / LAST / a_state["average_file"])
        mean_b = load_tensors(tmp_path / "killed" / LAST / b_state["average_file"])
        assert mean_a.keys() == mean_b.keys() and all(torch.equal(mean_a[k], mean_b[k]) for k in mean_a)


def test_the_weight_average_is_what_validates_and_ships(parquet_data, tmp_path):
    # One validation, at the end: model.safetensors must hold the mean of steps 12-24, not the last weights.
    main, argv = command("classifier", parquet_data, tmp_path, tmp_path / "run")
    assert main([*argv, "--average-from", "0.5", "--eval-every", "24"]) == 0
    state, last_weights = last_state(tmp_path / "run")
    mean, best = load_tensors(tmp_path / "run" / LAST / state["average_file"]), load_tensors(tmp_path / "run" / WEIGHTS)
    assert state["average_count"] == 13 and [r["averaged_steps"] for r in rows(tmp_path / "run")] == [13]
    assert mean and all(torch.equal(best[k], mean[k]) for k in mean)
    assert any(not torch.equal(last_weights[k], mean[k]) for k in mean)
    assert "ngram.weight" not in mean  # the fitted n-gram table does not train here: nothing to average


def test_the_weight_average_is_the_running_mean_and_gives_the_weights_back():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    model[1].bias.requires_grad_(False)
    average, snapshots = WeightAverage(model), []
    for _ in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        snapshots.append({k: v.clone() for k, v in model.named_parameters()})
        average.update()
    trained = {k: v.clone() for k, v in model.named_parameters()}
    assert set(average.mean) == {"0.weight", "0.bias", "1.weight"}  # the frozen bias is not averaged
    with average.applied():
        for name, p in model.named_parameters():
            expected = trained[name] if name == "1.bias" else torch.stack([s[name] for s in snapshots]).mean(0)
            torch.testing.assert_close(p, expected, rtol=0, atol=1e-6)
    assert all(torch.equal(p, trained[k]) for k, p in model.named_parameters())
    resumed = WeightAverage(model)
    resumed.load(average.mean, average.count)
    assert resumed.count == 4 and all(torch.equal(resumed.mean[k], average.mean[k]) for k in trained
                                      if k != "1.bias")
    with pytest.raises(ClassifyError, match="does not fit the model"):
        WeightAverage(torch.nn.Linear(3, 2)).load(average.mean, 4)


def test_a_second_writer_is_refused_with_the_first_ones_pid(parquet_data, tmp_path, capsys):
    main, argv = command("classifier", parquet_data, tmp_path, tmp_path / "run")
    with RunFolder(tmp_path / "run", "classifier") as first:
        first.acquire()  # what a training running in another terminal holds
        assert run_cli(main, argv) == 2
    err = capsys.readouterr().err
    assert f"is being written by another run (pid {os.getpid()} on" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run" / "config.json").exists()


def test_a_lock_left_by_a_killed_run_does_not_block(parquet_data, tmp_path):
    main, argv = command("classifier", parquet_data, tmp_path, tmp_path / "run")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK).write_text("pid 999999 on elsewhere\n")  # its process is gone, so is its flock
    assert main([*argv, "--max-steps", "2"]) == 0


def test_a_failed_start_leaves_no_folder_behind(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(train_main, ["--data", str(tmp_path / "missing"), "--output", str(out), *TINY_MODEL_ARGS]) == 2
    assert not out.exists()


def test_resume_flag_refuses_to_start_afresh(parquet_data, tmp_path, capsys):
    main, argv = command("classifier", parquet_data, tmp_path, tmp_path / "run")
    assert run_cli(main, [*argv, "--resume"]) == 2
    assert "holds no run to continue" in capsys.readouterr().err
    assert main([*argv, "--max-steps", "6"]) == 0
    assert main([*argv, "--resume"]) == 0  # now there is one to continue


def test_a_run_recorded_before_a_setting_existed_resumes_as_it_trained(parquet_data, tmp_path, capsys):
    main, argv = command("classifier", parquet_data, tmp_path, tmp_path / "run")
    assert main([*argv, "--max-steps", "4"]) == 0
    config_file = tmp_path / "run" / "config.json"
    recorded = json.loads(config_file.read_text())

    def recorded_without(*names: str) -> None:  # config.json as the code before those settings wrote it
        train = {k: v for k, v in recorded["train"].items() if k not in names}
        config_file.write_text(json.dumps({**recorded, "train": train}))

    # Added at their defaults, which mean "as before": the run resumes, and records them from now on.
    recorded_without("self_label_share", "pseudo_label_weight", "train_max_len")   # max-len 64: 256 cuts nothing
    assert main([*argv, "--max-steps", "6", "--resume"]) == 0
    assert json.loads(config_file.read_text())["train"]["self_label_share"] == 0.0
    # Added at 1 and 3 by default now: a run from before trained each join once, so the default is another run,
    # --contrast-join-repeat 1 the same one.
    recorded_without("contrast_join_repeat")
    assert run_cli(main, [*argv, "--max-steps", "8"]) == 2
    assert "differs in: contrast_join_repeat" in capsys.readouterr().err
    assert main([*argv, "--max-steps", "8", "--contrast-join-repeat", "1", "--resume"]) == 0
    # A setting whose value before it existed is not known (the teacher's min count followed the branch's): refused.
    recorded_without("teacher_min_count")
    assert run_cli(main, [*argv, "--max-steps", "10", "--contrast-join-repeat", "1"]) == 2
    assert "differs in: teacher_min_count" in capsys.readouterr().err
    # A model field: a run from before it has its default (0, off), which the recipe's 4 is not.
    recorded["model"] = {k: v for k, v in recorded["model"].items() if k != "ngram_ellipsis"}
    recorded_without()
    assert run_cli(main, [*argv, "--max-steps", "10"]) == 2
    err = capsys.readouterr().err
    assert "differs in: ngram_ellipsis (0 there, 4 here)" in err and "pass the settings it was started with" in err
    assert main([*argv, "--max-steps", "10", "--ngram-ellipsis", "0", "--resume"]) == 0


def test_full_disk_while_saving_is_one_line_and_keeps_last(parquet_data, tmp_path, capsys, monkeypatch):
    main, argv = command("classifier", parquet_data, tmp_path, tmp_path / "run")
    real_save, calls = files.save_file, {"n": 0}

    def disk_fills_up(tensors, filename, metadata=None):
        calls["n"] += 1
        if calls["n"] > 4:  # best weights at step 8, last/ (weights + optimizer) at 5; then the disk is full
            with open(filename, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(files, "save_file", disk_fills_up)
    assert run_cli(main, argv) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and "last/ still holds step 5" in err and len(err.splitlines()) == 1
    assert "Traceback" not in err
    monkeypatch.setattr(files, "save_file", real_save)  # space freed: the same command resumes from step 5
    assert main(argv) == 0
    assert last_state(tmp_path / "run")[0]["step"] == 24
