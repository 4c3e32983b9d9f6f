"""--compile (predict, evaluate, serve): the compiled model computes the eager model's logits for every batch shape
without compiling again after its warm-up; a compilation that fails, or --compile with ONNX Runtime, is one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from classify import predict
from classify.backends import batched_logits
from classify.errors import run_cli
from classify.inference import load_run


@pytest.fixture(scope="module")
def compiled(trained_run):
    torch._dynamo.reset()
    counters.clear()
    yield load_run(trained_run, torch.device("cpu"), compile=True)
    torch._dynamo.reset()


def test_the_compiled_model_gives_the_eager_logits_without_compiling_again(trained_run, compiled):
    eager = load_run(trained_run, torch.device("cpu"))
    assert compiled.backend.runtime["compiled"] and not eager.backend.runtime["compiled"]
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1   # the warm-up compiled at load time, before any text came
    longest, vocab = eager.backend.max_len, eager.model.config.vocab_size
    rng = np.random.default_rng(0)
    texts = [[7], *(rng.integers(4, vocab, n).tolist() for n in (longest, 3, 40, 17, 64, 9))]
    for ids in ([texts[0]], [texts[1]], texts, texts[2:5], texts[:6]):   # one, one token, the longest, mixed
        got = batched_logits(compiled.backend, ids, batch_size=4)
        np.testing.assert_allclose(got, batched_logits(eager.backend, ids, batch_size=4), rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == graphs   # other batch sizes and lengths reuse the warm-up's graphs


def test_a_compilation_that_fails_is_one_line(trained_run, capsys, monkeypatch):
    def no_compiler(model, **options):
        def forward(tokens):
            raise RuntimeError("CppCompileError: C++ compile error\n\nCommand:\ng++ /tmp/x.cpp ...")
        return forward

    monkeypatch.setattr(torch, "compile", no_compiler)
    assert run_cli(predict.main, ["--model", str(trained_run), "--compile", "--quiet", "Great film."],
                   prog="classify.predict") == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert err.endswith("--compile failed (RuntimeError: CppCompileError: C++ compile error); run without --compile")


def test_compile_is_for_the_pytorch_backend(trained_run, capsys):
    assert run_cli(predict.main, ["--model", str(trained_run), "--backend", "onnx", "--compile", "Great film."],
                   prog="classify.predict") == 2
    assert "--compile compiles the PyTorch model: use it with --backend torch" in capsys.readouterr().err
