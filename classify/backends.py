"""The second stage of inference: token ids -> logits, on a backend.

A backend runs one padded batch: ``logits(tokens (B, T) int64) -> (B, C) float32``, exactly
``Classifier.forward``. ``TorchBackend`` runs the PyTorch model (optionally under autocast) and also gives each
branch's logits (training and evaluation need them); ``OnnxBackend`` runs a folder written by
``classify.export`` with ONNX Runtime on the CPU. ``batched_logits`` feeds either of them id lists of any
lengths in length-bucketed batches.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from .engine.device import autocast, to_device
from .errors import ClassifyError
from .models import BranchLogits, Classifier
from .text.batching import PAD_MULTIPLE, BucketBatchSampler, pad_batch, pad_multiple
from .text.prepare import TokenIds

class Backend(Protocol):
    """What the inference path needs from a runtime."""

    name: str                 # "torch" | "onnx"
    pad_id: int               # the id padding is made of
    max_len: int              # the longest input, in tokens
    pad_multiple: int         # batches are padded to a multiple of this many positions (text.batching.pad_multiple)
    num_classes: int
    parameters: int           # the model's size, for /v1/model
    runtime: dict             # how it computes, for /v1/model: backend, device, precision, threads (PyTorch on a
                              # CPU: also how its idle OpenMP threads wait)

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """tokens (B, T) int64, right-padded with ``pad_id`` -> logits (B, num_classes) float32."""
        ...


class TorchBackend:
    """A ``Classifier`` on ``device``, under autocast to ``dtype`` (None: fp32)."""

    name = "torch"

    def __init__(self, model: Classifier, device: torch.device, dtype: torch.dtype | None):
        self.model, self.device, self.dtype = model.eval(), device, dtype
        config = model.config
        self.pad_id, self.num_classes, self.max_len = config.pad_id, config.num_classes, config.max_len
        self.pad_multiple = pad_multiple(device, dtype)
        self.parameters = sum(p.numel() for p in model.parameters())

    @property
    def runtime(self) -> dict:
        return {"backend": self.name, "device": str(self.device),
                "precision": str(self.dtype).removeprefix("torch.") if self.dtype else "fp32",
                "threads": torch.get_num_threads(),
                # on a CPU, how the idle OpenMP threads wait (None: libgomp's default, spin a while, then sleep)
                **({"omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") or None} if self.device.type == "cpu" else {})}

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        return self._run(self.model, tokens).float().cpu().numpy()

    def transformer(self, tokens: np.ndarray) -> np.ndarray:
        """tokens (B, T) -> the transformer branch's logits alone (B, C), the n-gram branch not computed."""
        return self._run(self.model.transformer, tokens).float().cpu().numpy()

    def branches(self, tokens: np.ndarray) -> BranchLogits:
        """tokens (B, T) -> each branch's logits before the mix, as NumPy (``models.BranchLogits``)."""
        parts = self._run(self.model.branches, tokens)
        return BranchLogits(*(None if t is None else t.float().cpu().numpy() if t.is_floating_point()
                              else t.cpu().numpy() for t in parts))

    def _run(self, forward, tokens: np.ndarray):
        with torch.inference_mode(), autocast(self.device, self.dtype):
            return forward(to_device(torch.from_numpy(tokens), self.device))


class OnnxBackend:
    """An exported classifier (``classify.export``) on ONNX Runtime's CPU provider, ``threads`` threads
    (None: ONNX Runtime's choice, one per physical core)."""

    name = "onnx"

    def __init__(self, path: Path, pad_id: int, max_len: int, num_classes: int, parameters: int, threads: int | None,
                 precision: str = "fp32"):
        try:
            import onnxruntime as ort
        except ImportError as err:
            raise ClassifyError(f"--backend onnx needs the export extra ({err}): pip install -e '.[export]'") from None
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or 0
        options.inter_op_num_threads = 1          # one graph at a time: the threads go to the matrix products
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        try:
            self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as err:  # onnxruntime raises its own exception types for unreadable models
            raise ClassifyError(f"ONNX Runtime cannot load {path}: {str(err).splitlines()[0]}") from None
        self.pad_id, self.max_len, self.num_classes, self.parameters = pad_id, max_len, num_classes, parameters
        self.pad_multiple = PAD_MULTIPLE   # ONNX Runtime's CPU kernels keep no cache per shape
        # "int8": an export whose matrix products' weights are int8 (``classify.export --int8``).
        self.runtime = {"backend": self.name, "device": "cpu", "precision": precision, "threads": threads or "default"}

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        return self.session.run(None, {"tokens": tokens})[0]


def padded_batches(ids: list[TokenIds], pad_id: int, batch_size: int = 64, max_tokens: int | None = None,
                   max_len: int | None = None, multiple: int = PAD_MULTIPLE) -> Iterator[tuple[list[int], np.ndarray]]:
    """Token id lists -> batches of texts of similar lengths, as ``batched`` runs them: each batch's indices into
    ``ids`` and its tokens (B, T) int64, padded with ``pad_id`` (``pad_batch``; an empty text as one pad position).
    ``max_tokens``, ``max_len`` and ``multiple``: as ``batched``."""
    # Empty inputs still need one position: a lone pad pools to zeros (bias-only logits).
    ids = [x if len(x) else [pad_id] for x in ids]
    for indices in BucketBatchSampler([len(x) for x in ids], batch_size=batch_size, max_tokens=max_tokens,
                                      shuffle=False):
        yield indices, pad_batch([ids[i] for i in indices], pad_id, max_len=max_len, multiple=multiple).numpy()


def batched(forward: Callable[[np.ndarray], Sequence[np.ndarray | None]], ids: list[TokenIds], pad_id: int,
            batch_size: int = 64, max_tokens: int | None = None, progress: Callable[[int], None] | None = None,
            max_len: int | None = None, multiple: int = PAD_MULTIPLE) -> list[np.ndarray | None]:
    """Run ``forward`` (tokens (B, T) -> a tuple of (B, ...) arrays or None) over token id lists in
    length-bucketed batches (``padded_batches``): its outputs for all N texts in input order, (N, ...) each (None
    stays None).

    ``max_tokens``: cut batches by padded tokens instead of by ``batch_size`` (the server: reviews of very
    different lengths batch well). ``progress``: called with the number of texts done. ``max_len``: the model's;
    batches are then padded to a multiple of ``multiple`` positions (``pad_batch``)."""
    outputs: list[np.ndarray | None] = []
    done = 0
    for indices, tokens in padded_batches(ids, pad_id, batch_size, max_tokens, max_len, multiple):
        out = forward(tokens)
        if not outputs:
            outputs = [None if a is None else np.zeros((len(ids), *a.shape[1:]), a.dtype) for a in out]
        for k, array in enumerate(out):
            if array is not None:
                outputs[k][indices] = array   # type: ignore[index]
        done += len(indices)
        if progress is not None:
            progress(done)
    return outputs


def batched_logits(backend: Backend, ids: list[TokenIds], batch_size: int = 64, max_tokens: int | None = None,
                   progress: Callable[[int], None] | None = None) -> np.ndarray:
    """Token id lists -> logits (N, C) float32 in input order, on ``backend`` (see ``batched``)."""
    if not ids:
        return np.zeros((0, backend.num_classes), dtype=np.float32)
    return batched(lambda t: (backend.logits(t),), ids, backend.pad_id, batch_size, max_tokens, progress,
                   backend.max_len, backend.pad_multiple)[0]


def batched_transformer(backend: TorchBackend, ids: list[TokenIds], batch_size: int = 64) -> np.ndarray:
    """Token id lists -> the transformer branch's logits alone (N, C), in input order (the n-gram branch is not
    computed; validation during training)."""
    return batched(lambda t: (backend.transformer(t),), ids, backend.pad_id, batch_size, max_len=backend.max_len,
                   multiple=backend.pad_multiple)[0]


def batched_branches(backend: TorchBackend, ids: list[TokenIds], batch_size: int = 64,
                     progress: Callable[[int], None] | None = None) -> BranchLogits:
    """Token id lists -> each branch's logits before the mix, in input order: (N, C), (N, C) or None without an
    n-gram branch, lengths (N,)."""
    return BranchLogits(*batched(backend.branches, ids, backend.pad_id, batch_size, progress=progress,
                                 max_len=backend.max_len, multiple=backend.pad_multiple))
