"""python -m classify.export and --backend onnx: the exported graph computes PyTorch's logits, predict and serve
answer the same on both backends, every export failure is one line, and a failed export leaves nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime", reason="the export extra is not installed (pip install -e '.[export]')")

from conftest import TINY_MODEL_ARGS, synthetic_reviews, write_parquet_folder  # noqa: E402

from classify import export as export_module  # noqa: E402
from classify.errors import ClassifyError, run_cli  # noqa: E402
from classify.inference import ONNX_MODEL, load_export, load_run  # noqa: E402
from classify.predict import main as predict_main  # noqa: E402
from classify.text.batching import pad_batch  # noqa: E402

TEXTS = [text for text, _ in synthetic_reviews(24, seed=3)]


@pytest.fixture(scope="module")
def exported(trained_run, tmp_path_factory) -> Path:
    """The tiny trained run (n-gram branch with every family, negation included) exported."""
    out = tmp_path_factory.mktemp("exports") / "tiny"
    assert export_module.main(["--model", str(trained_run), "--output", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def pure_transformer(parquet_data, tmp_path_factory) -> tuple[Path, Path]:
    """A run without the n-gram branch (no mix either), with attention pooling and end+rotary positions (rotated
    queries and keys, vectors counted from each text's end), and its export."""
    from classify.train import main

    root = tmp_path_factory.mktemp("pure")
    assert main(["--data", str(parquet_data), "--output", str(root / "run"), "--max-steps", "3",
                 *TINY_MODEL_ARGS, "--ngram-orders", "0", "--pooling", "attention", "--positional", "end+rotary"]) == 0
    assert export_module.main(["--model", str(root / "run"), "--output", str(root / "export")]) == 0
    return root / "run", root / "export"


# Denials the scope marks, after a negator and by an elided negation ("..., but it wasn't.").
DENIED = ["It was not good at all.", "The acting was not boring.", "I thought it would be great, but it wasn't.",
          "Everyone said the plot was dull. It was not."]


@pytest.fixture(scope="module")
def reads_scope(tmp_path_factory) -> tuple[Path, Path]:
    """A run whose transformer reads the branch's negation scope (``--scope-embedding``), trained on reviews with
    denials in them (so that the tokenizer holds the negators), and its export."""
    from classify.train import main

    root = tmp_path_factory.mktemp("scope")
    write_parquet_folder(root / "data", test=40, then=DENIED)
    assert main(["--data", str(root / "data"), "--output", str(root / "run"), "--max-steps", "5", *TINY_MODEL_ARGS,
                 "--scope-embedding"]) == 0
    assert export_module.main(["--model", str(root / "run"), "--output", str(root / "export")]) == 0
    return root / "run", root / "export"


def reuse_graph(monkeypatch, exported: Path) -> None:
    """The export writes ``exported``'s graph instead of running the exporter (~10 s); the rest of the export (the
    check on ONNX Runtime, quantization, the files, the atomic rename) runs as it is."""
    monkeypatch.setattr(export_module, "export_graph", lambda run, path: shutil.copyfile(exported / ONNX_MODEL, path))


def batches(run) -> dict[str, np.ndarray]:
    """Padded token batches (B, T): mixed lengths, one review, a one-token text, the longest allowed text."""
    ids = run.preprocessing.ids(TEXTS)
    longest = run.preprocessing.ids([" ".join(TEXTS)])   # truncated to max_len
    one_token = run.preprocessing.ids(["superb"])
    assert len(longest[0]) == run.max_len and len(one_token[0]) == 1
    return {"mixed lengths": pad_batch(ids, 0).numpy(), "one review": pad_batch(ids[:1], 0).numpy(),
            "one token": pad_batch(one_token, 0).numpy(),
            "max_len": pad_batch(longest + ids[:2], 0).numpy()}


def assert_same_logits(torch_run, onnx_run, tokens_by_name: dict[str, np.ndarray]) -> None:
    """ONNX Runtime's logits are PyTorch's to float32's rounding of the batch's sums: a run fitted on very easy data
    has logits in the hundreds, and a small logit of the same batch is a difference of terms that large, so its
    rounding is the batch's scale's (on an Intel Xeon with AMX one logit of -0.577 of a batch reaching 376 differed
    by 1.5e-5), a few float32 epsilons of the largest logit."""
    for name, tokens in tokens_by_name.items():
        assert tokens.dtype == np.int64
        expected, got = torch_run.backend.logits(tokens), onnx_run.backend.logits(tokens)
        assert got.dtype == np.float32 and got.shape == (len(tokens), 2), name
        scale = float(np.abs(expected).max())
        np.testing.assert_allclose(got, expected, atol=1e-5 + 8 * np.finfo(np.float32).eps * scale, rtol=2e-6,
                                   err_msg=name)


@pytest.mark.parametrize("which", ["ngram branch", "pure transformer"])
def test_the_exported_model_computes_pytorchs_logits(which, trained_run, exported, pure_transformer):
    run_folder, export_folder = (trained_run, exported) if which == "ngram branch" else pure_transformer
    torch_run, onnx_run = load_run(run_folder, torch.device("cpu")), load_export(export_folder, threads=1)
    assert (torch_run.model.ngram is not None) == (which == "ngram branch")
    assert_same_logits(torch_run, onnx_run, batches(torch_run))


def test_an_exported_transformer_reading_the_scope_computes_pytorchs_logits(reads_scope):
    torch_run, onnx_run = load_run(reads_scope[0], torch.device("cpu")), load_export(reads_scope[1], threads=1)
    denials = pad_batch(torch_run.preprocessing.ids(DENIED), 0).numpy()
    assert torch_run.model.ngram.scope(torch.as_tensor(denials)).any(1).all()   # each has words marked
    assert_same_logits(torch_run, onnx_run, {**batches(torch_run), "denials": denials})
    with torch.no_grad():   # ... and the vector counts: without it the transformer's logits are others
        torch_run.model.scope_vector.zero_()
    assert np.abs(torch_run.backend.logits(denials) - onnx_run.backend.logits(denials)).max() > 1e-4


def test_the_graph_holds_the_ngram_table_as_one_float16_column(trained_run, exported):
    import onnx

    bag = load_run(trained_run, torch.device("cpu")).model.ngram
    tables = {tuple(t.dims): t.data_type for t in onnx.load(str(exported / ONNX_MODEL)).graph.initializer
              if t.dims and t.dims[0] == bag.buckets + 1}
    assert tables == {(bag.buckets + 1,): onnx.TensorProto.FLOAT16}


def test_attention_is_one_operator_per_block(trained_run, exported):
    """The fast path: ONNX's Attention operator, not its decomposition into matrix products, masks and softmax."""
    import onnx

    config = load_run(trained_run, torch.device("cpu")).model.config
    ops = [node.op_type for node in onnx.load(str(exported / ONNX_MODEL)).graph.node]
    assert ops.count("Attention") == config.num_layers and "Softmax" not in ops


def test_an_int8_export_quantizes_the_matrix_products_and_answers_alike(trained_run, exported, int8_export):
    """--int8: the weights of the matrix products become int8 (integer MatMuls, weights quantized ahead), the
    n-gram table stays float16, and the logits stay near the fp32 export's (dynamic quantization's error)."""
    import onnx

    out = int8_export   # written by python -m classify.export --int8 (conftest), which returned 0
    assert json.loads((out / "config.json").read_text())["export"]["weights"] == "int8"
    assert json.loads((exported / "config.json").read_text())["export"]["weights"] == "fp32"
    graph = onnx.load(str(out / ONNX_MODEL)).graph
    ops = [node.op_type for node in graph.node]
    assert "MatMulInteger" in ops and "MatMul" not in ops
    assert onnx.TensorProto.FLOAT16 in {t.data_type for t in graph.initializer}
    fp32, int8 = load_export(exported, threads=1), load_export(out, threads=1)
    assert (fp32.backend.runtime["precision"], int8.backend.runtime["precision"]) == ("fp32", "int8")
    for name, tokens in batches(load_run(trained_run, torch.device("cpu"))).items():
        got, expected = int8.backend.logits(tokens), fp32.backend.logits(tokens)
        # Dynamic quantization's error follows the activations' range (one scale per tensor per batch), not each
        # logit's own size: within 10% of the batch's largest logit. Measured: 1.7-5.6% on an AMD EPYC with AVX2
        # alone (no VNNI), where a bound of 5% of each logit failed by 0.02 on one of 48.
        np.testing.assert_allclose(got, expected, rtol=0, atol=0.1 * np.abs(expected).max(), err_msg=name)
        assert (got.argmax(1) == expected.argmax(1)).all(), name


def test_a_failed_quantization_is_one_line_and_leaves_nothing(trained_run, exported, tmp_path, monkeypatch, capsys):
    import onnxruntime.quantization

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for MatMul\nmore detail")

    monkeypatch.setattr(onnxruntime.quantization, "quantize_dynamic", broken)
    reuse_graph(monkeypatch, exported)
    message = export_fails(capsys, "--model", str(trained_run), "--output", str(tmp_path / "int8"), "--int8")
    assert "int8 quantization failed: no kernel for MatMul" in message and "more detail" not in message
    assert not list(tmp_path.iterdir())


def test_the_export_folder_holds_what_the_runtime_needs(trained_run, exported):
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", ONNX_MODEL, "tokenizer.json"]
    config = json.loads((exported / "config.json").read_text())
    run_config = json.loads((trained_run / "config.json").read_text())
    assert config["kind"] == "classifier-onnx" and config["labels"] == ["neg", "pos"]
    assert config["model"] == run_config["model"] and config["train"]["truncation"] == "head+tail"
    model = load_run(trained_run, torch.device("cpu")).model
    assert config["export"]["parameters"] == sum(p.numel() for p in model.parameters())
    assert (exported / "tokenizer.json").read_bytes() == (trained_run / "tokenizer.json").read_bytes()
    assert not list(exported.parent.glob(".*"))   # no temporary folder left beside it


def predict_json(capsys, *argv) -> list[dict]:
    assert predict_main([*argv, "--json", "--quiet"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_predict_on_onnx_runtime_answers_as_on_pytorch(trained_run, exported, capsys):
    texts = [*TEXTS[:6], "", "superb", "A wonderful film. " * 200]
    on_torch = predict_json(capsys, "--model", str(trained_run), "--precision", "fp32", *texts)
    on_onnx = predict_json(capsys, "--model", str(exported), "--backend", "onnx", "--threads", "1", *texts)
    assert [r.get("label") for r in on_onnx] == [r.get("label") for r in on_torch]
    assert [r["notes"] for r in on_onnx] == [r["notes"] for r in on_torch] and on_onnx[6]["error"] == "empty review"
    assert any("truncated" in note for note in on_onnx[8]["notes"])
    for a, b in zip(on_onnx, on_torch):
        if "probabilities" in b:
            assert a["probabilities"] == pytest.approx(b["probabilities"], abs=1e-5)


def fails(main, capsys, prog: str, *argv) -> str:
    """``main`` run as ``python -m`` runs it must exit 2 with one line on stderr; that line."""
    assert run_cli(main, list(argv), prog=prog) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith(f"{prog}: error: ")
    return err


def export_fails(capsys, *argv) -> str:
    return fails(export_module.main, capsys, "classify.export", *argv)


def test_every_documented_export_failure_is_one_line(trained_run, exported, tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "out")
    assert "run folder not found" in export_fails(capsys, "--model", str(tmp_path / "nothing"), "--output", out)
    translation = Path(shutil.copytree(trained_run, tmp_path / "translation", ignore=shutil.ignore_patterns("last")))
    config = json.loads((translation / "config.json").read_text())
    (translation / "config.json").write_text(json.dumps({**config, "kind": "seq2seq"}))
    assert "not a 'classifier' run" in export_fails(capsys, "--model", str(translation), "--output", out)
    assert "not a 'classifier' run" in export_fails(capsys, "--model", str(exported), "--output", out)
    assert "already exists; pass --overwrite" in export_fails(capsys, "--model", str(trained_run), "--output",
                                                              str(exported))

    def broken_exporter(*args, **kwargs):
        raise RuntimeError("Failed to export the model with torch.export.\nmore detail")

    monkeypatch.setattr(torch.onnx, "export", broken_exporter)
    message = export_fails(capsys, "--model", str(trained_run), "--output", out)
    assert "the ONNX exporter failed" in message and "Failed to export the model with torch.export." in message
    assert not list(tmp_path.glob("out*")) and not list(tmp_path.glob(".out*"))


def test_an_interrupted_export_leaves_no_folder_and_keeps_the_old_one(trained_run, exported, tmp_path, monkeypatch):
    def interrupted(run, path):
        path.write_bytes(b"half a graph")
        raise KeyboardInterrupt

    monkeypatch.setattr(export_module, "export_graph", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_module.export(trained_run, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
    # A failure after the graph (here: writing config.json) with --overwrite keeps the previous export whole.
    previous = Path(shutil.copytree(exported, tmp_path / "previous"))
    reuse_graph(monkeypatch, exported)
    monkeypatch.setattr(export_module, "write_json", lambda *args: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(ClassifyError, match="No space left.*nothing was written"):
        export_module.export(trained_run, previous, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["previous"]
    assert (previous / ONNX_MODEL).read_bytes() == (exported / ONNX_MODEL).read_bytes()
    monkeypatch.undo()
    reuse_graph(monkeypatch, exported)
    (previous / "stale.txt").write_text("from the old export")
    export_module.export(trained_run, previous, overwrite=True)
    assert sorted(p.name for p in previous.iterdir()) == ["config.json", ONNX_MODEL, "tokenizer.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["previous"]


def test_backend_mistakes_are_one_line_errors(trained_run, exported, capsys):
    def predict_fails(*argv) -> str:
        return fails(predict_main, capsys, "classify.predict", *argv, "great film")

    assert "--explain needs the PyTorch model" in predict_fails("--model", str(exported), "--backend", "onnx",
                                                                "--explain")
    assert "is a training run, not an export" in predict_fails("--model", str(trained_run), "--backend", "onnx")
    assert "is an ONNX export: run it with --backend onnx" in predict_fails("--model", str(exported))
    assert "runs the exported model (fp32, or int8 weights" in predict_fails("--model", str(exported), "--backend",
                                                                             "onnx", "--precision", "bf16")


def test_the_server_runs_the_export_and_explains_only_on_pytorch(trained_run, exported):
    pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[serve]')")
    from fastapi.testclient import TestClient

    from classify.serve.app import create_app
    from classify.serve.service import ModelService

    answers = {}
    for name, run in (("torch", load_run(trained_run, torch.device("cpu"))), ("onnx", load_export(exported, 1))):
        with TestClient(create_app(ModelService(run, 64, 2048))) as client:
            answers[name] = client.post("/v1/predict", json={"texts": TEXTS[:4]}).json()["predictions"]
            info = client.get("/v1/model").json()
            assert info["runtime"]["backend"] == name and info["parameters"] > 0
            explained = client.post("/v1/explain", json={"text": TEXTS[0]})
            assert explained.status_code == (200 if name == "torch" else 422)
    assert "--backend onnx" in explained.json()["error"]
    assert [p["label"] for p in answers["onnx"]] == [p["label"] for p in answers["torch"]]
    for a, b in zip(answers["onnx"], answers["torch"]):
        assert a["probabilities"] == pytest.approx(b["probabilities"], abs=1e-5)


def test_evaluate_scores_the_export_as_it_scores_the_run(trained_run, exported, parquet_data, tmp_path):
    from classify.evaluate import main as evaluate_main

    scores = {}
    for backend, model in (("torch", trained_run), ("onnx", exported)):
        out = tmp_path / backend
        assert evaluate_main(["--model", str(model), "--backend", backend, "--data", str(parquet_data), "--limit", "60",
                              "--precision", "fp32" if backend == "torch" else "auto", "--output", str(out),
                              "--quiet"]) == 0
        scores[backend] = json.loads((out / "metrics.json").read_text())
    # The export runs the whole model only: no branch alone; the behavioural suite scores it as well.
    assert list(scores["onnx"]["systems"]) == ["model"] and list(scores["onnx"]["behaviour"]["systems"]) == ["model"]
    assert scores["onnx"]["behaviour"]["systems"]["model"]["failure_rate"] == pytest.approx(
        scores["torch"]["behaviour"]["systems"]["model"]["failure_rate"])
    scores = {backend: s["systems"]["model"] for backend, s in scores.items()}
    assert scores["onnx"]["accuracy"] == scores["torch"]["accuracy"]
    assert scores["onnx"]["log_loss"] == pytest.approx(scores["torch"]["log_loss"], abs=1e-5)
