"""Training under torchrun (CPU, gloo, 2 processes): equivalence with one process, resume across
world sizes, failures; and the sampler/resume bookkeeping that makes those hold.

The single-process twin of ``2 ranks x --batch-size 8`` is ``1 process x --batch-size 8 x
--grad-accum 2``: the batch list depends only on ranks x grad-accum (2 in both), and optimizer
step s trains on global batches 2s and 2s+1, split across the ranks or accumulated in turn. DDP
averages the ranks' gradients and accumulation divides each micro-batch's loss by 2, so with
dropout 0 both runs compute the same updates up to floating-point rounding.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY_MODEL_ARGS, subprocess_env, synthetic_reviews

from classify.engine.files import load_tensors, read_jsonl
from classify.engine.loop import reshard_epoch
from classify.backends import batched_logits
from classify.inference import load_run, softmax
from classify.text.batching import BucketBatchSampler
from classify.train import main

WORKER = Path(__file__).with_name("distributed_worker.py")
# 320 training reviews in batches of 8: 20 steps of 2 batches per epoch, so 24 steps cross an epoch.
# No rule-made texts: the data these tests count. On the CPU: the single-process twins compare with the CPU ranks.
RUN_ARGS = ["--max-steps", "24", "--epochs", "2", "--eval-every", "8", "--save-every", "5", *TINY_MODEL_ARGS,
            "--batch-size", "8", "--dropout", "0", "--no-negation-edits", "--no-contrast-joins", "--device", "cpu"]


def torchrun(*args: str, crash: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=2 ARGS`` (ARGS: ``-m module ...`` or ``script ...``)."""
    # Two ranks on the CPU (gloo) on every machine, a one-GPU one too: these tests are about the loop's DDP
    # bookkeeping, and two ranks cannot share one GPU under NCCL.
    env = subprocess_env(CUDA_VISIBLE_DEVICES="")
    env.pop("CLASSIFY_TEST_CRASH", None)
    if crash:
        env["CLASSIFY_TEST_CRASH"] = crash
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as job:
        try:
            stdout, stderr = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # A job that hangs is ended whole: torchrun, sent SIGTERM, stops its ranks (each in a session of its
            # own) before it exits. Killed outright, it would leave them waiting on each other (gloo gives up
            # after 30 minutes), holding the cores the next tests need.
            job.terminate()
            job.communicate(timeout=90)
            raise
    return subprocess.CompletedProcess(cmd, job.returncode, stdout, stderr)


def train_args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["--data", str(data), "--output", str(out), *RUN_ARGS, *extra]


def last_weights(run: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    state = json.loads((run / "last" / "state.json").read_text())
    return state, load_tensors(run / "last" / state["weights_file"])


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        if name.endswith("in_proj.bias"):
            # [query; key; value] biases. The key bias has a zero gradient in exact arithmetic (softmax
            # ignores a shift shared by all keys), so Adam turns rounding noise there into lr-sized steps
            # that differ between any two summation orders, and change nothing the model computes.
            d = len(x) // 3
            x, y = torch.cat([x[:d], x[2 * d:]]), torch.cat([y[:d], y[2 * d:]])
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4, msg=name)


def assert_same_predictions(run_a: Path, run_b: Path) -> None:
    a, b = load_run(run_a, torch.device("cpu")), load_run(run_b, torch.device("cpu"))
    ids = a.preprocessing.ids([text for text, _ in synthetic_reviews(64, seed=5)])
    probs_a = softmax(batched_logits(a.backend, ids))
    probs_b = softmax(batched_logits(b.backend, ids))
    assert abs(probs_a - probs_b).max() < 1e-5


@pytest.fixture(scope="module")
def ddp_run(parquet_data, tmp_path_factory) -> Path:
    """2 ranks x batch 8, launched by torchrun."""
    out = tmp_path_factory.mktemp("ddp") / "run"
    result = torchrun("-m", "classify.train", *train_args(parquet_data, out))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def twin_run(parquet_data, tmp_path_factory) -> Path:
    """Its single-process twin: batch 8, 2 micro-batches per step."""
    out = tmp_path_factory.mktemp("twin") / "run"
    assert main(train_args(parquet_data, out, "--grad-accum", "2")) == 0
    return out


# ------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_two_ranks_match_one_process_with_grad_accum(ddp_run, twin_run):
    for name in ["config.json", "tokenizer.json", "model.safetensors", "metrics.jsonl", "test_metrics.json"]:
        assert (ddp_run / name).exists(), name
    ddp_state, ddp_weights = last_weights(ddp_run)
    twin_state, twin_weights = last_weights(twin_run)
    assert ddp_state["step"] == twin_state["step"] == 24
    assert ddp_state["tokens"] == twin_state["tokens"]  # the ranks' counts are summed
    assert_same_weights(ddp_weights, twin_weights)
    assert_same_predictions(ddp_run, twin_run)
    # Logged once, by rank 0, with metrics over all ranks: training stats summed over both ranks' batches,
    # validation over the whole validation set (each rank scored half).
    ddp_log = read_jsonl(ddp_run / "metrics.jsonl")
    twin_log = read_jsonl(twin_run / "metrics.jsonl")
    assert [r["step"] for r in ddp_log] == [r["step"] for r in twin_log] == [8, 16, 24]
    for d, t in zip(ddp_log, twin_log):
        assert d["train_accuracy"] == t["train_accuracy"] and d["val_accuracy"] == t["val_accuracy"]
        assert d["train_loss"] == pytest.approx(t["train_loss"], abs=1e-5)
        assert d["val_loss"] == pytest.approx(t["val_loss"], abs=1e-5)


@pytest.fixture(scope="module")
def crashed_run(parquet_data, tmp_path_factory) -> Path:
    """The ddp_run whose rank 1 died in step 13 (while rank 0 waited for its gradients)."""
    out = tmp_path_factory.mktemp("crashed") / "run"
    result = torchrun(str(WORKER), *train_args(parquet_data, out), crash="1:13", timeout=120)
    assert result.returncode != 0  # no hang: rank 0 fails at once, torchrun ends the job
    assert "simulated crash on rank 1" in result.stderr
    state, _ = last_weights(out)
    assert state["step"] == 10 and state["layout"]["batches_per_step"] == 2  # the last save before the crash
    return out


def resumed_copy(crashed: Path, tmp_path: Path) -> Path:
    shutil.copytree(crashed, tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.slow
def test_resume_on_two_ranks_is_exact(parquet_data, crashed_run, ddp_run, tmp_path):
    """Rank 0 alone reads last/: the others get its weights (DDP) and optimizer state (broadcast)."""
    out = resumed_copy(crashed_run, tmp_path)
    result = torchrun("-m", "classify.train", *train_args(parquet_data, out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_weights(last_weights(out)[1], last_weights(ddp_run)[1])
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [8, 16, 24]


@pytest.mark.slow
def test_resume_on_one_process_with_the_same_batches_per_step_is_exact(parquet_data, crashed_run, ddp_run,
                                                                       tmp_path):
    out = resumed_copy(crashed_run, tmp_path)
    assert main(train_args(parquet_data, out, "--grad-accum", "2")) == 0  # 1 x 2 = 2 x 1 batches per step
    state, weights = last_weights(out)
    assert state["step"] == 24 and state["layout"]["batches_per_step"] == 2
    assert_same_weights(weights, last_weights(ddp_run)[1])


@pytest.mark.slow
def test_resume_on_one_process_with_another_layout_finishes(parquet_data, crashed_run, tmp_path):
    out = resumed_copy(crashed_run, tmp_path)
    assert main(train_args(parquet_data, out)) == 0  # 1 batch per step: the epoch's rest is re-batched
    state, _ = last_weights(out)
    assert state["step"] == 24 and state["layout"]["batches_per_step"] == 1
    # Epoch 0 had 20 of its 40 batches of 8 trained before the crash; since the resume, 14 steps of the other
    # 160 reviews: the state says so, for the next resume.
    assert state["epoch"] == 0 and len(state["epoch_skip"]) == 160 and state["batch_in_epoch"] == 14


@pytest.mark.slow
def test_finish_within_gives_every_rank_rank_0s_training_minutes_and_a_resume_keeps_them(parquet_data, tmp_path):
    """--finish-within is planned on rank 0 alone (it alone holds the test split). Every rank must get the
    minutes: the schedule goes by rank 0's clock, which a rank without a budget would never ask for, so a
    rank left without them hangs the job (the timeout here fails the test) instead of finishing."""
    out = tmp_path / "run"
    result = torchrun("-m", "classify.train", *train_args(parquet_data, out, "--finish-within", "5",
                                                          "--max-steps", "12"), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    budget = json.loads((out / "config.json").read_text())["train"]["time_budget"]
    assert 4 < budget < 5   # seconds of data, n-grams and (tiny) evaluations to come
    result = torchrun("-m", "classify.train", *train_args(parquet_data, out, "--finish-within", "1"), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert last_weights(out)[0]["step"] == 24
    assert json.loads((out / "config.json").read_text())["train"]["time_budget"] == budget


@pytest.mark.slow
def test_error_on_rank_0_stops_every_rank(parquet_data, tmp_path):
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    result = torchrun("-m", "classify.train", *train_args(parquet_data, stranger), timeout=120)
    assert result.returncode != 0
    # Only rank 0 looks at --output; its one-line error reaches (and ends) both ranks.
    assert result.stderr.count("is not a classify run folder") == 2, result.stderr[-3000:]
    assert list(stranger.iterdir()) == [stranger / "notes.txt"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["pretrain", "seq2seq"])
def test_pretraining_and_seq2seq_train_and_resume_on_two_ranks(kind, parquet_data, tmp_path):
    """The same loop, so the same torchrun support: rank 0 writes, all ranks stop together, a resume on
    two ranks continues from last/ without repeating a logged validation."""
    from test_pretrain import TINY_PRETRAIN_ARGS
    from test_seq2seq import TINY, write_corpus

    out = tmp_path / "run"
    loop_args = ["--epochs", "5", "--eval-every", "4", "--save-every", "3"]
    if kind == "pretrain":
        module = ["-m", "classify.pretrain", "--data", str(parquet_data), *TINY_PRETRAIN_ARGS]
    else:
        corpus = write_corpus(tmp_path / "toy", {"train": 200, "val": 20})
        module = ["-m", "classify.seq2seq", "train", "--data", str(corpus), *TINY]
    for steps in (6, 10):
        result = torchrun(*module, "--output", str(out), *loop_args, "--max-steps", str(steps))
        assert result.returncode == 0, result.stderr[-3000:]
    state, _ = last_weights(out)
    assert state["step"] == 10 and state["layout"]["batches_per_step"] == 2
    steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl")]
    assert steps == ([0] if kind == "pretrain" else []) + [4, 6, 8, 10]


# ------------------------------------------------------------------- data bookkeeping
LENGTHS = [(i * 37) % 90 + 5 for i in range(333)]


def test_sampler_steps_depend_only_on_batches_per_step():
    """2 ranks x 1 micro-batch and 1 process x 2 micro-batches train each step on the same examples."""
    ranks = [list(BucketBatchSampler(LENGTHS, batch_size=8, rank=r, world_size=2)) for r in range(2)]
    accum = list(BucketBatchSampler(LENGTHS, batch_size=8, grad_accum=2))
    assert [ranks[0][s] + ranks[1][s] for s in range(len(ranks[0]))] == \
           [accum[2 * s] + accum[2 * s + 1] for s in range(len(accum) // 2)]


@pytest.mark.parametrize("world_size, grad_accum", [(2, 2), (3, 2)])
def test_sampler_covers_each_example_once_with_whole_steps(world_size, grad_accum):
    shards = [list(BucketBatchSampler(LENGTHS, batch_size=8, seed=1, rank=r, world_size=world_size,
                                      grad_accum=grad_accum)) for r in range(world_size)]
    assert len({len(s) for s in shards}) == 1 and len(shards[0]) % grad_accum == 0
    assert sorted(i for s in shards for b in s for i in b) == list(range(len(LENGTHS)))


def layout(batch_size: int, batches_per_step: int, max_tokens: int | None = None) -> dict:
    return {"batch_size": batch_size, "max_tokens": max_tokens, "batches_per_step": batches_per_step}


def epoch_state(old_layout: dict, batch_in_epoch: int) -> dict:
    return {"epoch": 3, "batch_in_epoch": batch_in_epoch, "layout": old_layout, "epoch_skip": []}


def test_reshard_keeps_each_example_once_per_epoch():
    old = layout(8, 2)
    sampler = BucketBatchSampler(LENGTHS, batch_size=8, seed=0, grad_accum=2)
    sampler.set_epoch(3)
    trained = [i for b in sampler.batches()[:10] for i in b]  # 5 steps of 2 batches before the stop

    state = epoch_state(old, 10)
    reshard_epoch(state, layout(5, 3, max_tokens=200), LENGTHS, seed=0)  # e.g. 3 GPUs, token budget
    assert state["batch_in_epoch"] == 0 and state["epoch_skip"] == sorted(trained)
    rest = BucketBatchSampler(LENGTHS, batch_size=5, max_tokens=200, seed=0, world_size=3)
    rest.set_epoch(3, state["epoch_skip"])
    assert sorted(trained + [i for b in rest.batches() for i in b]) == list(range(len(LENGTHS)))

    # Interrupted again, then resumed on yet another layout: still each example once.
    state["batch_in_epoch"] = 6
    again = [i for b in rest.batches()[:6] for i in b]
    reshard_epoch(state, layout(8, 1), LENGTHS, seed=0)
    last = BucketBatchSampler(LENGTHS, batch_size=8, seed=0)
    last.set_epoch(3, state["epoch_skip"])
    assert sorted(trained + again + [i for b in last for i in b]) == list(range(len(LENGTHS)))


def test_same_layout_resumes_in_place():
    state = epoch_state(layout(8, 2), 10)
    reshard_epoch(state, layout(8, 2), LENGTHS, seed=0)
    assert state["batch_in_epoch"] == 10 and state["epoch_skip"] == []
