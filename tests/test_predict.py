"""python -m classify.predict: every input form, output schemas, order, bad inputs, explanations, bad run folders."""

import csv
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import subprocess_env, synthetic_reviews, write_csv, write_jsonl

import classify.text.inputs as inputs_module
from classify import predict
from classify.engine.runfolder import newest_run
from classify.errors import ClassifyError
from classify.explain import explain, to_html, token_attributions
from classify.inference import load_run
from classify.predict import main

GOOD = ["A wonderful, superb film; I loved the brilliant cast.", "Awful and boring, the worst waste of time.",
        "The plot was funny and the music beautiful.", "Dull, stupid and terrible."]


def run_json(capsys, *argv) -> list[dict]:
    assert main([*argv, "--json", "--quiet"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def fails(capsys, *argv) -> str:
    """Run the CLI the way ``python -m`` does; it must fail with one line on stderr."""
    from classify.errors import run_cli

    assert run_cli(main, list(argv), prog="classify.predict") == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.count("error:") == 1
    last = err.splitlines()[-1]
    assert last.startswith("classify.predict: error: ")
    return last


def test_arguments_json_schema_and_order(trained_run, capsys):
    records = run_json(capsys, "--model", str(trained_run), *GOOD)
    assert [r["id"] for r in records] == [0, 1, 2, 3]
    assert [r["source"] for r in records] == ["argument 1", "argument 2", "argument 3", "argument 4"]
    for r in records:
        assert set(r) == {"id", "source", "label", "score", "probabilities", "notes"}
        assert set(r["probabilities"]) == {"neg", "pos"} and sum(r["probabilities"].values()) == pytest.approx(1, abs=1e-5)
        assert r["score"] == max(r["probabilities"].values()) and r["label"] == max(r["probabilities"],
                                                                                   key=r["probabilities"].get)
    assert [r["label"] for r in records] == ["pos", "neg", "pos", "neg"]
    # Results do not depend on the company a review keeps (batching, bucketing, order).
    alone = run_json(capsys, "--model", str(trained_run), GOOD[2])
    assert alone[0]["probabilities"]["pos"] == pytest.approx(records[2]["probabilities"]["pos"], abs=2e-2)


def test_table_on_stdout_shows_labels_and_never_parses_markup(trained_run, capsys):
    assert main(["--model", str(trained_run), GOOD[0], "[bold red]not markup[/]", ""]) == 0
    out, err = capsys.readouterr()
    assert "pos" in out and "[bold red]not markup[/]" in out and "empty review" in out
    assert f"model: {trained_run}" in err and "2 of 3 reviews classified" in err


def test_every_input_form_gives_the_same_predictions(trained_run, tmp_path, capsys, monkeypatch):
    rows = [(text, 0) for text in GOOD]
    (tmp_path / "reviews.txt").write_text("\n".join(GOOD) + "\n", encoding="utf-8")
    write_jsonl(tmp_path / "reviews.jsonl", rows)
    write_csv(tmp_path / "reviews.csv", rows)
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    for i, text in enumerate(GOOD):
        (folder / ("sub" if i == 3 else "") / f"{i}.txt").write_text(text, encoding="utf-8")
    (folder / "notes.md").write_text("not a review")
    reference = [r["probabilities"]["pos"] for r in run_json(capsys, "--model", str(trained_run), *GOOD)]

    for name in ("reviews.txt", "reviews.jsonl", "reviews.csv", "folder"):
        records = run_json(capsys, "--model", str(trained_run), "--file", str(tmp_path / name))
        assert [r["probabilities"]["pos"] for r in records] == pytest.approx(reference, abs=1e-6), name
    assert records[3]["source"] == str(folder / "sub" / "3.txt")
    assert run_json(capsys, "--model", str(trained_run), "--file", str(tmp_path / "reviews.csv"))[1]["source"] \
        == f"{tmp_path / 'reviews.csv'}:3"  # line 3: the header is line 1

    stdin = io.TextIOWrapper(io.BytesIO(("\n".join(GOOD) + "\n").encode()), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stdin)
    records = run_json(capsys, "--model", str(trained_run), GOOD[0], "-")
    assert [r["source"] for r in records] == ["argument 1", "stdin:1", "stdin:2", "stdin:3", "stdin:4"]
    assert [r["probabilities"]["pos"] for r in records[1:]] == pytest.approx(reference, abs=1e-6)


def test_bad_inputs_are_per_item_and_never_stop_the_batch(trained_run, tmp_path, capsys, monkeypatch):
    huge = "This film was boring and awful. " * 70_000  # ~2 MB on one line
    lines = [b"great superb film", b"", b"   \t", b"<br /><br />", b"loved it \xff\xfe brilliant",
             huge.encode(), b"bad \x00 binary line", b"wonderful"]
    (tmp_path / "mixed.txt").write_bytes(b"\n".join(lines) + b"\n")
    records = run_json(capsys, "--model", str(trained_run), "--file", str(tmp_path / "mixed.txt"))
    assert [r["id"] for r in records] == list(range(len(lines)))
    assert [r.get("error") for r in records] == [
        None, "empty review", "empty review", "no text left once HTML markup is removed", None, None,
        "contains NUL bytes: binary data, not text", None]
    assert records[4]["notes"] == ["invalid UTF-8 bytes were replaced by U+FFFD"] and records[4]["label"] == "pos"
    assert records[5]["label"] == "neg" and "truncated" in records[5]["notes"][0]
    assert records[7]["label"] == "pos"

    # In a folder: a binary file is one item's error; unreadable UTF-8 a note.
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.txt").write_text("superb and wonderful")
    (folder / "b.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (folder / "c.txt").write_bytes(b"terrible \xc3\x28 dull")
    records = run_json(capsys, "--model", str(trained_run), "--file", str(folder))
    assert [r.get("label") for r in records] == ["pos", None, "neg"]
    assert "NUL" in records[1]["error"] and records[2]["notes"]

    # JSONL and CSV rows without usable text; a line over the size limit is skipped in bounded memory.
    monkeypatch.setattr(inputs_module, "MAX_REVIEW_CHARS", 1000)
    (tmp_path / "bad.jsonl").write_text('{"text": "superb"}\nnot json\n{"review": "x"}\n{"text": 5}\n\n'
                                        + json.dumps({"text": "a" * 1500}) + '\n{"text": "awful"}\n')
    records = run_json(capsys, "--model", str(trained_run), "--file", str(tmp_path / "bad.jsonl"))
    assert [r.get("label") for r in records] == ["pos", None, None, None, None, "neg"]
    assert "invalid JSON" in records[1]["error"] and "no 'text' field" in records[2]["error"]
    assert "not a string" in records[3]["error"] and "longer than 1000" in records[4]["error"]
    assert records[5]["source"].endswith(":7")
    (tmp_path / "bad.csv").write_text("id,text\n1,superb\n2\n3," + "b" * 1500 + "\n4,awful\n")
    records = run_json(capsys, "--model", str(trained_run), "--file", str(tmp_path / "bad.csv"))
    assert [r.get("label") for r in records] == ["pos", None, None, "neg"]


def test_invalid_utf8_on_stdin_is_replaced_with_a_note(trained_run, capsys, monkeypatch):
    stdin = io.TextIOWrapper(io.BytesIO(b"superb \xff film\n"), encoding="latin-1")
    monkeypatch.setattr(sys, "stdin", stdin)  # the raw bytes are read from .buffer, whatever the encoding
    [record] = run_json(capsys, "--model", str(trained_run))
    assert record["source"] == "stdin:1" and record["notes"] == ["invalid UTF-8 bytes were replaced by U+FFFD"]


@pytest.mark.parametrize("name, content, message", [
    ("reviews.pdf", b"%PDF-1.4", "unknown format '.pdf'"),
    ("reviews.txt", b"\xff\xfeg\x00r\x00e\x00a\x00t\x00", "binary file"),
    ("missing.txt", None, "input file not found"),
    ("reviews.csv", b"review,label\ngreat,1\n", "no 'text' column"),
    ("empty.txt", b"", "is empty"),
    ("blank.jsonl", b"\n\n", "no reviews in the input"),
])
def test_unusable_input_files_are_one_line_errors(trained_run, tmp_path, capsys, name, content, message):
    if content is not None:
        (tmp_path / name).write_bytes(content)
    assert message in fails(capsys, "--model", str(trained_run), "--file", str(tmp_path / name))


def test_output_files_csv_and_jsonl(trained_run, tmp_path, capsys):
    texts = [GOOD[0], "", GOOD[1]]
    reference = run_json(capsys, "--model", str(trained_run), *texts)
    assert main(["--model", str(trained_run), "--quiet", "--output", str(tmp_path / "p.jsonl"), *texts]) == 0
    assert capsys.readouterr().out == ""  # results went to the file only
    lines = (tmp_path / "p.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == reference
    assert main(["--model", str(trained_run), "--quiet", "--output", str(tmp_path / "out" / "p.csv"), *texts]) == 0
    with open(tmp_path / "out" / "p.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["label"] for row in rows] == ["pos", "", "neg"] and rows[1]["error"] == "empty review"
    assert float(rows[0]["p_pos"]) == reference[0]["probabilities"]["pos"]
    assert "use a .csv or .jsonl" in fails(capsys, "--model", str(trained_run), "--output", "p.xlsx", "x")


def test_explanations_json_and_escaped_html(trained_run, tmp_path, capsys):
    evil = "Superb &lt;script&gt;alert('x')&lt;/script&gt; film — très bien"
    html_file = tmp_path / "why.html"
    records = run_json(capsys, "--model", str(trained_run), "--explain-html", str(html_file), evil, "", GOOD[1])
    words = records[0]["explanation"]["words"]
    # Explained towards "pos" whatever the answer: the negative review's worst words score below zero.
    assert records[0]["explanation"]["target"] == records[0]["label"] == "pos"
    assert records[2]["label"] == "neg" and records[2]["explanation"]["target"] == "pos"
    assert min(records[2]["explanation"]["words"], key=lambda w: w[1])[0].strip(",.") in {"Awful", "boring", "worst",
                                                                                         "waste"}
    assert [w for w, _ in words] == ["Superb", "<script>alert('x')</script>", "film", "—", "très", "bien"]
    assert "explanation" not in records[1] and "explanation" in records[2]
    snippet = html_file.read_text(encoding="ascii")
    assert "<script>" not in snippet and "&lt;script&gt;" in snippet and "tr&#232;s" in snippet
    assert snippet.count('class="classify-explanation"') == 2
    # The table view renders the same explanation as coloured text.
    assert main(["--model", str(trained_run), "--explain", "--explain-steps", "1", GOOD[0]]) == 0
    assert "green: towards pos, red: towards neg" in capsys.readouterr().out
    assert "red</span> towards neg" in snippet


def test_attributions_use_the_models_tokens_and_add_up(trained_run):
    run = load_run(trained_run, torch.device("cpu"))
    text = " ".join(["wonderful film"] * 30 + ["boring"] * 10 + ["awful plot"] * 30)  # longer than max_len 64
    explanation = explain(run, text, 1, 4, torch.device("cpu"))
    assert len(explanation.segments) == 2  # head+tail truncation: the middle was not read
    ids = run.preprocessing.ids([text])[0]
    assert sum(1 for _ in explanation.words) == len(ids)  # one word per token for this text
    # Integrated gradients + the n-gram branch's exact shares: attributions sum to f(x) - f(baseline) (log-odds),
    # the baseline being all-zero token embeddings and an empty n-gram bag (its bias alone), here within 5%.
    assert run.model.ngram is not None and float(run.model.mix_weights(torch.tensor([len(ids)]))[0, 1]) != 0
    scores = token_attributions(run, ids, 1, 64, torch.device("cpu"))

    def log_odds(scale: float) -> float:
        hooks = [run.model.embed.tokens.register_forward_hook(lambda m, i, out: out * scale)]
        if scale == 0:
            hooks.append(run.model.ngram.register_forward_hook(lambda m, i, out: m.bias.expand_as(out)))
        with torch.no_grad():
            logits = run.model(torch.as_tensor(np.asarray(ids, dtype=np.int64))[None])[0]
        for hook in hooks:
            hook.remove()
        return float(logits[1] - logits[0])

    assert scores.sum() == pytest.approx(log_odds(1.0) - log_odds(0.0), rel=0.05)
    html = to_html(explanation, "<h1>")
    assert "&lt;h1&gt;" in html and "not read by the model" in html


def copy_run(trained_run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(trained_run, tmp_path / "run", ignore=shutil.ignore_patterns("last", "eval-*")))


def edit_config(run: Path, change) -> None:
    config = json.loads((run / "config.json").read_text())
    change(config)
    (run / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("damage, message", [
    (lambda run: (run / "model.safetensors").write_bytes((run / "model.safetensors").read_bytes()[:500]),
     "corrupt or truncated"),
    (lambda run: (run / "model.safetensors").unlink(), "weights not found"),
    (lambda run: (run / "tokenizer.json").unlink(), "tokenizer not found"),
    (lambda run: (run / "config.json").write_text("{not json"), "config.json is corrupt"),
    (lambda run: edit_config(run, lambda c: c["model"].update(vocab_size=c["model"]["vocab_size"] + 7)),
     "mixes files from different runs"),
    (lambda run: edit_config(run, lambda c: c.update(format_version=99)), "format_version 99"),
    (lambda run: edit_config(run, lambda c: c["model"].update(d_model=64)), "do not match"),
    (lambda run: shutil.rmtree(run), "run folder not found"),
])
def test_broken_run_folders_are_one_line_errors(trained_run, tmp_path, capsys, damage, message):
    run = copy_run(trained_run, tmp_path)
    damage(run)
    assert message in fails(capsys, "--model", str(run), "great film")


class _Payload:
    """Unpickling this creates a marker file: proof that a pickle was executed."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_pickle_files_are_never_loaded(trained_run, tmp_path, capsys, monkeypatch):
    run = copy_run(trained_run, tmp_path)
    marker = tmp_path / "pickle-was-executed"
    for name in ("pytorch_model.bin", "model.pt", "model.pkl"):
        (run / name).write_bytes(pickle.dumps(_Payload(str(marker))))
    (run / "model.safetensors").write_bytes(b"not safetensors at all")
    assert "corrupt or truncated" in fails(capsys, "--model", str(run), "great")
    (run / "model.safetensors").unlink()
    assert "weights not found" in fails(capsys, "--model", str(run), "great")
    # Nor is a folder holding only pickles ever chosen as the default model.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    shutil.move(str(run), tmp_path / "runs" / "pickles")
    assert "no trained classifier run" in fails(capsys, "great")
    assert not marker.exists()


def test_default_model_is_the_newest_run(trained_run, tmp_path, capsys, monkeypatch):
    for name, age in (("old", 100), ("new", 10), ("translation", 0)):
        run = shutil.copytree(trained_run, tmp_path / "runs" / name, ignore=shutil.ignore_patterns("last", "eval-*"))
        os.utime(Path(run) / "model.safetensors", (1e9 - age, 1e9 - age))
    edit_config(tmp_path / "runs" / "translation", lambda c: c.update(kind="seq2seq"))  # newest, wrong kind
    monkeypatch.chdir(tmp_path)
    assert newest_run(Path("runs"), "classifier") == Path("runs") / "new"
    records = run_json(capsys, GOOD[0])
    assert records[0]["label"] == "pos"


@pytest.mark.slow
def test_cli_subprocess_exit_codes_and_no_traceback(trained_run, tmp_path):
    env = subprocess_env()
    ok = subprocess.run([sys.executable, "-m", "classify.predict", "--model", str(trained_run), "--json", "-"],
                        input=b"superb film\n\n\xff awful\n", capture_output=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr.decode()
    records = [json.loads(line) for line in ok.stdout.decode().splitlines()]
    assert [r.get("error") for r in records] == [None, "empty review", None] and "Traceback" not in ok.stderr.decode()
    run = copy_run(trained_run, tmp_path)
    (run / "model.safetensors").write_bytes(b"\x00" * 10)
    bad = subprocess.run([sys.executable, "-m", "classify.predict", "--model", str(run), "great"],
                         capture_output=True, env=env, timeout=120)
    assert bad.returncode == 2 and bad.stdout == b""
    err = bad.stderr.decode().strip()
    assert err.startswith("classify.predict: error:") and "\n" not in err and "Traceback" not in err


def test_chunks_bound_reviews_and_text(monkeypatch):
    monkeypatch.setattr(predict, "CHUNK_REVIEWS", 3)
    monkeypatch.setattr(predict, "CHUNK_CHARS", 10)
    reviews = [inputs_module.Review(i, "x", "a" * n) for i, n in enumerate([1, 1, 1, 1, 20, 1])]
    assert [[r.id for r in c] for c in predict.chunks(reviews)] == [[0, 1, 2], [3, 4], [5]]


def test_open_inputs_checks_up_front():
    tty = io.StringIO()
    tty.isatty = lambda: True
    with pytest.raises(ClassifyError, match="nothing to classify"):
        inputs_module.open_inputs([], None, "auto", tty)
    with pytest.raises(ClassifyError, match="only once"):
        inputs_module.open_inputs(["-", "-"], None, "auto", tty)
    reviews = list(inputs_module.open_inputs([t for t, _ in synthetic_reviews(3)], None, "auto", tty).reviews)
    assert [r.source for r in reviews] == ["argument 1", "argument 2", "argument 3"]
    assert np.all([r.nbytes > 0 for r in reviews])


def test_typing_slips_are_read_as_meant_unless_switched_off(trained_run, capsys):
    slip, meant = run_json(capsys, "--model", str(trained_run), "a wondreful and moving film",
                           "a wonderful and moving film")
    assert slip["notes"] == ["read 'wondreful' as 'wonderful'"] and slip["probabilities"] == meant["probabilities"]
    [raw] = run_json(capsys, "--model", str(trained_run), "--no-spelling", "a wondreful and moving film")
    assert raw["notes"] == [] and raw["probabilities"] != meant["probabilities"]
