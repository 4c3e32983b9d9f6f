"""The seq2seq example end to end on a made-up word-for-word "language" (seconds, not minutes).

Source sentences are target sentences with every word replaced through a fixed dictionary,
so a tiny model learns to translate them within a few epochs; the real Multi30k run is
recorded in experiments/RESULTS_seq2seq.md.
"""

from __future__ import annotations

import io
import json
import random
import signal
from pathlib import Path

import pytest
import torch

from classify.engine.files import load_tensors, read_jsonl, write_json
from classify.engine.runfolder import (CONFIG, FORMAT_VERSION, LAST, METRICS, TEST_METRICS, TOKENIZER, WEIGHTS,
                                       read_config)
from classify.errors import run_cli
from classify.generate import generate
from classify.seq2seq.cli import main
from classify.seq2seq.data import decode_ids, encode_side, load_parallel, special_ids
from classify.seq2seq.metrics import bleu_scores
from classify.seq2seq.translate import load_translator
from classify.text.tokenize import train_tokenizer

WORDS = {  # target word -> source word
    "a": "ein", "the": "der", "two": "zwei", "big": "groß", "small": "klein", "red": "rot",
    "man": "mann", "woman": "frau", "dog": "hund", "girl": "mädchen", "boy": "junge",
    "runs": "läuft", "sits": "sitzt", "plays": "spielt", "jumps": "springt", "walks": "geht",
    "in": "im", "on": "auf", "near": "bei", "park": "park", "beach": "strand", "snow": "schnee",
}
DETERMINERS, ADJECTIVES = ["a", "the", "two"], ["big", "small", "red"]
NOUNS, VERBS = ["man", "woman", "dog", "girl", "boy"], ["runs", "sits", "plays", "jumps", "walks"]
PREPOSITIONS, PLACES = ["in", "on", "near"], ["park", "beach", "snow"]

TINY = ["--d-model", "32", "--heads", "2", "--layers", "1", "--d-ff", "64", "--max-len", "32",
        "--vocab-size", "150", "--max-tokens", "256", "--warmup", "20", "--lr", "5e-3", "--dropout", "0.0",
        "--label-smoothing", "0.0", "--precision", "fp32", "--threads", "1", "--quiet"]


def sentence_pair(rng: random.Random) -> tuple[str, str]:
    """(source, target): 'A big dog runs in the park.' <-> 'Ein groß hund läuft im der park.'"""
    words = [rng.choice(DETERMINERS)] + ([rng.choice(ADJECTIVES)] if rng.random() < 0.5 else [])
    words += [rng.choice(NOUNS), rng.choice(VERBS), rng.choice(PREPOSITIONS), "the", rng.choice(PLACES)]
    target = " ".join(words)
    source = " ".join(WORDS[w] for w in words)
    return source.capitalize() + ".", target.capitalize() + "."


def write_corpus(folder: Path, sizes: dict[str, int]) -> Path:
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in sizes.items():
        pairs = [sentence_pair(rng) for _ in range(n)]
        (folder / f"{split}.de").write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
        (folder / f"{split}.en").write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("toy"), {"train": 400, "val": 40, "test": 40})


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus) -> Path:
    """A tiny model trained for 8 epochs in two sittings: 3 epochs, then resumed to 8. (Noam schedule:
    cosine would decay to zero at the end of the first sitting and warm up again in the second.)"""
    out = tmp_path_factory.mktemp("runs") / "toy"
    args = ["train", "--data", str(corpus), "--output", str(out), "--schedule", "inverse_sqrt", *TINY]
    assert main([*args, "--epochs", "3"]) == 0
    assert main([*args, "--epochs", "8"]) == 0
    return out


def read_state(run: Path) -> dict:
    return json.loads((run / LAST / "state.json").read_text())


# ---------------------------------------------------------------------------- training
def test_training_writes_a_run_folder_and_learns(run):
    config = read_config(run, "seq2seq")
    assert config["model"]["tie_embeddings"] and config["train"]["epochs"] == 8
    assert (run / TOKENIZER).exists() and (run / WEIGHTS).exists()
    metrics = read_jsonl(run / METRICS)
    assert [round(m["epoch"]) for m in metrics] == [1, 2, 3, 4, 5, 6, 7, 8]  # resumed: no epoch repeated or lost
    assert read_state(run)["epoch"] == 8
    assert metrics[-1]["val_loss"] < metrics[0]["val_loss"] - 1.0
    assert max(m["val_bleu"] for m in metrics) > 80
    test = json.loads((run / TEST_METRICS).read_text())
    assert test["sentences"] == 40 and 0 <= test["bleu"] <= 100


def test_resume_mid_epoch_reproduces_an_uninterrupted_run(corpus, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    args = ["--data", str(corpus), *TINY]
    assert main(["train", *args, "--output", str(straight), "--epochs", "2"]) == 0
    assert main(["train", *args, "--output", str(split), "--epochs", "2", "--max-steps", "7"]) == 0
    assert read_state(split)["step"] == 7
    assert main(["train", *args, "--output", str(split), "--epochs", "2"]) == 0
    a, b = read_state(straight), read_state(split)
    assert a["step"] == b["step"]
    wa = load_tensors(straight / LAST / a["weights_file"])
    wb = load_tensors(split / LAST / b["weights_file"])
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_epochs_of_different_lengths_each_end_on_their_own_batch_list(corpus, tmp_path, monkeypatch):
    """Under a token budget an epoch's batch count depends on its shuffle. Training once assumed
    every epoch had the first one's count and spun forever at the end of a shorter epoch."""
    import classify.engine.loop as loop

    class Uneven(loop.BucketBatchSampler):
        def batches(self) -> list[list[int]]:
            batches = super().batches()
            if self.epoch % 2:  # odd epochs: the last two batches merged, one batch fewer
                batches[-2:] = [batches[-2] + batches[-1]]
            return batches

    monkeypatch.setattr(loop, "BucketBatchSampler", Uneven)
    out = tmp_path / "uneven"
    assert main(["train", "--data", str(corpus), "--output", str(out), "--epochs", "3", *TINY]) == 0
    assert [m["epoch"] for m in read_jsonl(out / METRICS)] == [1.0, 2.0, 3.0]
    state = read_state(out)
    assert state["epoch"] == 3 and state["step"] % 3 == 2  # epochs of n, n - 1 and n batches


def test_ctrl_c_saves_and_exits_cleanly(corpus, tmp_path, monkeypatch):
    import classify.engine.loop as loop

    calls = {"n": 0}
    real_step = loop.optimizer_step

    def step_then_interrupt(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            signal.raise_signal(signal.SIGINT)  # what Ctrl-C does, caught by StopSignal
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop, "optimizer_step", step_then_interrupt)
    out = tmp_path / "interrupted"
    assert main(["train", "--data", str(corpus), "--output", str(out), "--epochs", "2", *TINY]) == 130
    assert read_state(out)["step"] == 3


def test_time_budget_stops_training(corpus, tmp_path):
    out = tmp_path / "budget"
    assert main(["train", "--data", str(corpus), "--output", str(out), "--time-budget", "0", *TINY]) == 0
    assert read_state(out)["step"] == 0


# ------------------------------------------------------------------------- inference
def test_translate_arguments_file_and_stdin(run, corpus, tmp_path, capsys, monkeypatch):
    assert main(["translate", "--model", str(run), "Ein groß hund läuft im der park.", "Zwei kinder."]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0] == "A big dog runs in the park."

    sources = (corpus / "test.de").read_text(encoding="utf-8").splitlines()[:5]
    path = tmp_path / "in.de"
    path.write_text("\n".join(sources) + "\n", encoding="utf-8")
    assert main(["translate", "--model", str(run), "--file", str(path), "--beam-size", "1"]) == 0
    from_file = capsys.readouterr().out.splitlines()
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(sources)))
    assert main(["translate", "--model", str(run), "-", "--beam-size", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == from_file and len(from_file) == 5


def test_evaluate_writes_report(run, corpus, tmp_path, capsys):
    report = tmp_path / "report.json"
    assert main(["evaluate", "--model", str(run), "--data", str(corpus), "--split", "test", "--beam-size", "2",
                 "--samples", "3", "--report", str(report), "--translations", str(tmp_path / "hyp.en"),
                 "--threads", "1"]) == 0
    data = json.loads(report.read_text())
    assert data["sentences"] == 40 and data["beam_size"] == 2 and len(data["samples"]) == 3
    assert {"bleu", "bleu_lowercase", "chrf", "loss", "perplexity", "word_perplexity", "signatures"} <= set(data)
    assert data["perplexity"] == pytest.approx(2.718281828 ** data["loss"], rel=1e-3)
    assert len((tmp_path / "hyp.en").read_text(encoding="utf-8").splitlines()) == 40
    assert "BLEU" in capsys.readouterr().out


def test_greedy_with_and_without_cache_agree(run, corpus):
    translator = load_translator(run, torch.device("cpu"))
    _, bos, eos = special_ids(translator.tokenizer)
    sources = load_parallel(corpus, "test", "de", "en").src[:16]
    ids = encode_side(translator.tokenizer, sources, 32)
    src = torch.nn.utils.rnn.pad_sequence([torch.tensor(x) for x in ids], batch_first=True)
    cached = generate(translator.model, src, 20, bos, eos)
    rerun = generate(translator.model, src, 20, bos, eos, use_cache=False)
    assert torch.equal(cached, rerun)


def test_tokenizer_round_trips_cased_text_with_punctuation():
    texts = ["A man, in a blue shirt, isn't running.", "Ein Hund läuft über die Wiese.", "Zwei (kleine) Kinder!"]
    tokenizer = train_tokenizer(texts * 20, 200, kind="bpe", lowercase=False, reversible=True)
    for text in texts:
        assert decode_ids(tokenizer, encode_side(tokenizer, [text])[0]) == text


# ------------------------------------------------------------------------------ BLEU
def test_bleu_on_hand_made_references():
    refs = ["The cat sat on the mat.", "A dog runs."]
    identical = bleu_scores(refs, refs)
    assert identical["bleu"] == identical["bleu_lowercase"] == identical["chrf"] == 100.0
    # 5 words, 4/3/2/1 of 5/4/3/2 n-grams match, no brevity penalty: 100 * (4/5*3/4*2/3*1/2) ** (1/4)
    assert bleu_scores(["a b c d e"], ["a b c d f"])["bleu"] == pytest.approx(66.87, abs=0.01)
    # Case matters to sacreBLEU but not to the lower-cased score.
    cased = bleu_scores(["the cat sat on the mat."], ["The cat sat on the mat."])
    assert cased["bleu_lowercase"] == 100.0 and cased["bleu"] < 100.0
    assert bleu_scores(["x y z"], ["a b c"])["bleu"] == 0.0


# ---------------------------------------------------------------------------- errors
def one_line_error(argv: list[str], capsys) -> str:
    assert run_cli(main, argv, prog="classify.seq2seq") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("classify.seq2seq: error:") and "\n" not in err
    return err


def test_user_errors_are_one_line(corpus, run, tmp_path, capsys):
    assert "data folder not found" in one_line_error(
        ["train", "--data", str(tmp_path / "nope"), "--output", str(tmp_path / "o"), *TINY], capsys)

    bad = write_corpus(tmp_path / "bad", {"train": 20, "val": 5})
    with open(bad / "train.en", "a", encoding="utf-8") as f:
        f.write("One line too many.\n")
    assert "not line-aligned" in one_line_error(
        ["train", "--data", str(bad), "--output", str(tmp_path / "o"), *TINY], capsys)

    assert "not found" in one_line_error(
        ["evaluate", "--model", str(run), "--data", str(corpus), "--split", "dev"], capsys)
    assert "run folder not found" in one_line_error(["translate", "--model", str(tmp_path / "x"), "Hallo"], capsys)

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{not json", encoding="utf-8")
    assert "corrupt" in one_line_error(["translate", "--model", str(corrupt), "Hallo"], capsys)

    classifier = tmp_path / "classifier"
    write_json(classifier / CONFIG, {"format_version": FORMAT_VERSION, "kind": "classifier", "model": {}})
    assert "not a 'seq2seq' run" in one_line_error(["translate", "--model", str(classifier), "Hallo"], capsys)

    assert "different run" in one_line_error(
        ["train", "--data", str(corpus), "--output", str(run), *TINY, "--d-model", "64"], capsys)
