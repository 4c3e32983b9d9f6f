"""python -m classify.export: a trained run as an ONNX model, for ONNX Runtime.

    python -m classify.export --model runs/imdb --output exports/imdb
    python -m classify.predict --backend onnx --model exports/imdb "A wonderful film."

The folder it writes::

    DIR/
      model.onnx        tokens (B, T) int64, right-padded with pad_id -> logits (B, C) float32: exactly
                        ``Classifier.forward`` (the transformer, the n-gram branch and their length-dependent mix),
                        B and T dynamic (1 <= T <= max_len); weights inside, fp32 but for the n-gram table
                        (one float16 column: ``ngrams.NgramBag.compact``); with ``--int8`` the matrix
                        products' weights int8 (``quantize_matmuls``)
      tokenizer.json    the run's tokenizer
      config.json       the run's config.json with kind "classifier-onnx": labels, the model's sizes (max_len,
                        pad_id), truncation; "export" says where it came from

What a runtime needs to prepare texts as training did is in the last two files; the steps themselves (clip,
normalise, tokenize, truncate) are ``classify.text.prepare``. The graph comes from ``torch.onnx.export``'s
dynamo exporter (``torch.export`` + onnxscript); before the folder is put in place, ONNX Runtime runs it on a
batch of mixed lengths and must give PyTorch's logits. The folder is built under a temporary name beside
``--output`` and renamed into place, so a failed or interrupted export leaves nothing behind.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from .backends import OnnxBackend
from .engine.config import HelpFormatter
from .engine.files import write_json
from .engine.runfolder import TOKENIZER
from .errors import ClassifyError, run_cli
from .inference import EXPORT_KIND, ONNX_MODEL, LoadedRun, load_run
from .text.batching import pad_batch
from .text.tokenize import SPECIAL_TOKENS

# 23: the first opset with an Attention operator, which the exporter makes of scaled_dot_product_attention
# (ONNX Runtime runs it as one kernel; opset 20 spelled it out in ~60 small operators, 20% slower).
OPSET = 23
TOLERANCE = 1e-4         # largest |ONNX Runtime - PyTorch| logit accepted when checking the export


def check_lengths(max_len: int, vocab_size: int) -> list[list[int]]:
    """Token id lists whose lengths cover the cases a graph can get wrong: one token, a few, and max_len (ids
    past the tokenizer's special tokens)."""
    first = len(SPECIAL_TOKENS)
    return [[first + i % (vocab_size - first) for i in range(n)]
            for n in sorted({1, min(3, max_len), min(17, max_len), max_len})]


@contextmanager
def quiet_exporter() -> Iterator[None]:
    """The exporter's progress lines, warnings and log messages off (its errors still raise)."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "onnxscript", "onnx_ir")]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


def export_graph(run: LoadedRun, path: Path) -> None:
    """Write ``run``'s classifier to ``path`` as ONNX, batch and sequence length dynamic."""
    model = run.model
    # An example of two rows of several tokens (the exporter would take a size of 1 for a constant).
    example = pad_batch(check_lengths(run.max_len, model.config.vocab_size)[-2:], model.config.pad_id)
    example = example[:, : min(run.max_len, 8)]
    dynamic = {"tokens": {0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC}}
    try:
        with quiet_exporter():
            torch.onnx.export(model, (example,), str(path), dynamo=True, input_names=["tokens"],
                              output_names=["logits"], dynamic_shapes=dynamic, opset_version=OPSET,
                              external_data=False, optimize=True, verbose=False)
    except Exception as err:  # the exporter's own error types, from torch.export, onnxscript or onnx
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise ClassifyError(f"the ONNX exporter failed on {run.path}: {first}") from None


def check_export(run: LoadedRun, path: Path) -> float:
    """Run the export on ONNX Runtime and PyTorch on one batch of mixed lengths (``check_lengths``); the
    largest difference of their logits, which must be below ``TOLERANCE``."""
    tokens = pad_batch(check_lengths(run.max_len, run.model.config.vocab_size), run.backend.pad_id).numpy()
    onnx = OnnxBackend(path, run.backend.pad_id, run.max_len, run.backend.num_classes, run.backend.parameters,
                       threads=1)
    try:
        logits = onnx.logits(tokens)
    except Exception as err:  # onnxruntime's own exception types
        raise ClassifyError(f"ONNX Runtime cannot run the exported model: {str(err).splitlines()[0]}") from None
    difference = float(np.abs(logits - run.backend.logits(tokens)).max())
    if not difference < TOLERANCE:
        raise ClassifyError(f"the exported model's logits differ from PyTorch's by {difference:.2g} (more than "
                            f"{TOLERANCE:g}): not written")
    return difference


def quantize_matmuls(source: Path, target: Path) -> None:
    """``source``'s ONNX model with its MatMul weights in int8, written to ``target``
    (``onnxruntime.quantization.quantize_dynamic``: activations are quantized on the fly, per batch). The n-gram
    table and the embeddings are gathers and stay as they are (the table float16, the embeddings fp32)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    try:
        quantize_dynamic(source, target, op_types_to_quantize=["MatMul"], weight_type=QuantType.QInt8)
    except Exception as err:  # onnxruntime's and onnx's own exception types
        first = str(err).splitlines()[0] if str(err) else repr(err)
        raise ClassifyError(f"int8 quantization failed: {first}") from None


def export(model: str | Path, output: str | Path, overwrite: bool = False, int8: bool = False) -> dict:
    """Export the run folder ``model`` to the folder ``output`` (see the module docstring); with ``int8``, the
    checked fp32 graph's matrix products then quantized (``quantize_matmuls``). Returns the "export" section
    written into its config.json."""
    output = Path(output)
    if output.exists() and not overwrite:
        raise ClassifyError(f"{output} already exists; pass --overwrite to replace it")
    if output.exists() and not output.is_dir():
        raise ClassifyError(f"{output} exists and is not a folder")
    run = load_run(model, torch.device("cpu"), None)   # the export is fp32, whatever autocast would pick
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.{os.getpid()}.tmp"   # same file system: the rename is atomic
    try:
        shutil.rmtree(tmp, ignore_errors=True)   # left by a killed export of a process with the same id
        tmp.mkdir()
        export_graph(run, tmp / ONNX_MODEL)
        info = {"from": str(run.path.resolve()), "format": "onnx", "opset": OPSET, "torch": torch.__version__,
                "parameters": run.backend.parameters, "max_difference": check_export(run, tmp / ONNX_MODEL),
                "weights": "int8" if int8 else "fp32"}
        if int8:   # from the fp32 graph that passed the check; int8's own error is the benchmark's to measure
            quantize_matmuls(tmp / ONNX_MODEL, tmp / f"int8.{ONNX_MODEL}")
            os.replace(tmp / f"int8.{ONNX_MODEL}", tmp / ONNX_MODEL)
        shutil.copyfile(run.path / TOKENIZER, tmp / TOKENIZER)
        write_json(tmp / "config.json", {**run.config, "kind": EXPORT_KIND, "labels": run.labels, "export": info})
        _put_in_place(tmp, output)
    except OSError as err:   # a full disk, a missing permission
        raise ClassifyError(f"cannot write {output}: {err.strerror or err}; nothing was written") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)   # gone already when it was renamed into place
    return info


def _put_in_place(tmp: Path, output: Path) -> None:
    """Rename the finished folder ``tmp`` to ``output``; an ``output`` there already (--overwrite) is moved
    aside first and removed after, so ``output`` is at every instant the old export or the new one, or absent."""
    if not output.exists():
        os.replace(tmp, output)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".old", dir=output.parent))
    os.replace(output, old / output.name)
    os.replace(tmp, output)
    shutil.rmtree(old, ignore_errors=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m classify.export",
        description="Export a trained classifier run to ONNX (model.onnx: token ids in, logits out, both branches "
                    "and their mix; tokenizer.json and config.json beside it) for python -m classify.predict / "
                    "classify.serve --backend onnx. The folder appears whole or not at all.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", required=True, help="the run folder to export")
    p.add_argument("--output", required=True, help="the folder to write (must not exist, unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    p.add_argument("--int8", action="store_true",
                   help="quantize the matrix products' weights to int8 (dynamic quantization) after the fp32 graph "
                        "passed its check: on a CPU without AMX 1.2x the reviews/s of PyTorch bf16 in batches, for "
                        "0.04 points of IMDB test accuracy; on one with AMX, PyTorch bf16 is faster "
                        "(experiments/RESULTS.md)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    info = export(args.model, args.output, args.overwrite, args.int8)
    size = (Path(args.output) / ONNX_MODEL).stat().st_size
    print(f"wrote {args.output}/{ONNX_MODEL} ({size / 2**20:.1f} MiB, opset {info['opset']}, {info['weights']} "
          f"weights; ONNX Runtime's fp32 logits within {info['max_difference']:.1g} of PyTorch's)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="classify.export"))
