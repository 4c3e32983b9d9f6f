"""Running a trained classifier: find and load a run folder, turn texts into probabilities.

Shared by ``train`` (validation/test), ``predict``, ``evaluate`` and ``serve`` so that all of them
normalise, tokenize, truncate, batch and run the model the same way. ``classify_texts`` is the
whole path for raw review texts (``predict`` and ``serve``): clip, normalise, tokenize, predict,
and say what was truncated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.markup import escape
from tokenizers import Tokenizer

from .engine.device import autocast, to_device
from .engine.files import load_model_weights
from .engine.runfolder import CONFIG, TOKENIZER, WEIGHTS, read_model_config
from .errors import ClassifyError
from .models import BranchLogits, Classifier, ClassifierConfig
from .text.batching import BucketBatchSampler, pad_batch
from .text.data import normalize
from .text.tokenize import encode, load_tokenizer, truncate

KIND = "classifier"
RUNS_DIR = Path("runs")
CHARS_PER_TOKEN = 100         # characters kept per model position before tokenizing (see ``clip``)


@dataclass
class LoadedRun:
    """A trained classifier ready for inference."""

    path: Path
    model: Classifier
    tokenizer: Tokenizer
    config: dict          # the whole config.json
    labels: list[str]     # class names, index = class id
    truncation: str

    @property
    def max_len(self) -> int:
        return self.model.config.max_len


def load_run(path: str | Path, device: torch.device) -> LoadedRun:
    """Load ``config.json``, ``tokenizer.json`` and ``model.safetensors``; every way these can be
    missing, corrupt or mutually inconsistent is a ClassifyError with one clear line."""
    path = Path(path)
    config, model_config = read_model_config(path, KIND, ClassifierConfig)
    tokenizer = load_tokenizer(path / TOKENIZER)
    if tokenizer.get_vocab_size() != model_config.vocab_size:
        raise ClassifyError(f"tokenizer.json has {tokenizer.get_vocab_size()} tokens but the model's embedding "
                            f"has {model_config.vocab_size}: the run folder mixes files from different runs")
    model = Classifier(model_config)
    load_model_weights(model, path / WEIGHTS)
    model.to(device).eval()
    train = config.get("train", {})
    labels = config.get("labels") or [str(i) for i in range(model_config.num_classes)]
    return LoadedRun(path, model, tokenizer, config, list(labels), train.get("truncation", "head+tail"))


def newest_run(root: Path = RUNS_DIR) -> Path:
    """The classifier run folder under ``root`` whose model.safetensors was written last (runs of
    other kinds, e.g. translation models, live there too)."""
    weights = sorted(root.rglob(WEIGHTS), key=lambda p: p.stat().st_mtime) if root.is_dir() else []
    for path in reversed(weights):
        try:
            kind = json.loads((path.parent / CONFIG).read_text(encoding="utf-8")).get("kind")
        except (OSError, ValueError, AttributeError):
            continue  # no or unreadable config: not a usable run
        if kind == KIND:
            return path.parent
    raise ClassifyError(f"no --model given and no trained classifier run (a folder with {WEIGHTS}) "
                        f"under {root}/; train one with python -m classify.train or pass --model RUN_FOLDER")


def open_run(model: str | None, device: torch.device, dtype: torch.dtype | None, console: Console) -> LoadedRun:
    """Load the run ``model`` (or the newest one) onto ``device``, announced on ``console``."""
    path = Path(model) if model is not None else newest_run()
    run = load_run(path, device)
    how = "" if model is not None else f" (the newest run under {RUNS_DIR}/; choose another with --model)"
    console.print(f"model: {escape(str(path))}{how}, device {device}, "
                  f"{'autocast ' + str(dtype).removeprefix('torch.') if dtype else 'fp32'}")
    return run


def _batched(model: Classifier, ids: list[list[int]], device: torch.device, dtype: torch.dtype | None,
             forward, batch_size: int, progress, max_tokens: int | None) -> list[np.ndarray]:
    """Run ``forward`` (tokens (B, T) -> a tuple of (B, ...) tensors) over token id lists in length-bucketed
    batches; its outputs for all N texts, in input order, as float32 arrays (N, ...)."""
    model.eval()
    pad_id = model.config.pad_id
    # Empty inputs still need one position: a lone pad pools to zeros (bias-only logits).
    ids = [x if x else [pad_id] for x in ids]
    sampler = BucketBatchSampler([len(x) for x in ids], batch_size=batch_size, max_tokens=max_tokens, shuffle=False)
    outputs: list[np.ndarray] = []
    done = 0
    with torch.inference_mode():
        for indices in sampler:
            tokens = pad_batch([ids[i] for i in indices], pad_id)
            with autocast(device, dtype):
                out = forward(to_device(tokens, device))
            for k, tensor in enumerate(out):
                if len(outputs) <= k:
                    outputs.append(np.zeros((len(ids), *tensor.shape[1:]), dtype=np.float32))
                outputs[k][indices] = tensor.float().cpu().numpy()
            done += len(indices)
            if progress is not None:
                progress(done)
    return outputs


def logits_ids(model: Classifier, ids: list[list[int]], device: torch.device, dtype: torch.dtype | None,
               batch_size: int = 64, progress=None, max_tokens: int | None = None) -> np.ndarray:
    """Token id lists -> logits (N, C) in input order, batched by length.

    ``progress``: optional callable(n_done) for a progress bar. ``max_tokens``: cut batches by padded
    tokens instead of by ``batch_size`` (the server: reviews of very different lengths batch well).
    """
    if not ids:
        return np.zeros((0, model.config.num_classes), dtype=np.float32)
    return _batched(model, ids, device, dtype, lambda t: (model(t),), batch_size, progress, max_tokens)[0]


def branch_logits_ids(model: Classifier, ids: list[list[int]], device: torch.device, dtype: torch.dtype | None,
                      batch_size: int = 64, progress=None) -> BranchLogits:
    """Token id lists -> each branch's logits before the mix (``models.BranchLogits`` of NumPy arrays: (N, C),
    (N, C) or None without an n-gram branch, lengths (N,)), in input order."""
    def forward(tokens):
        parts = model.branches(tokens)
        return (parts.transformer, parts.lengths) + ((parts.ngram,) if parts.ngram is not None else ())

    out = _batched(model, ids, device, dtype, forward, batch_size, progress, None)
    return BranchLogits(out[0], out[2] if len(out) > 2 else None, out[1].astype(np.int64))


def predict_ids(model: Classifier, ids: list[list[int]], device: torch.device, dtype: torch.dtype | None,
                batch_size: int = 64, progress=None, max_tokens: int | None = None) -> np.ndarray:
    """Token id lists -> class probabilities (N, C) in input order (``logits_ids``, then softmax)."""
    return softmax(logits_ids(model, ids, device, dtype, batch_size, progress, max_tokens=max_tokens))


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in float64 for the exponent."""
    z = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def encode_reviews(tokenizer: Tokenizer, texts: list[str], max_len: int, truncation: str) -> list[list[int]]:
    """Raw reviews -> token id lists, normalised and truncated as every command does it."""
    return encode(tokenizer, [normalize(t) for t in texts], max_len, truncation)


def encode_texts(run: LoadedRun, texts: list[str]) -> list[list[int]]:
    """Raw reviews -> the token ids ``run``'s model reads."""
    return encode_reviews(run.tokenizer, texts, run.max_len, run.truncation)


def encode_normalized(run: LoadedRun, texts: list[str]) -> tuple[list[list[int]], list[int]]:
    """Normalised reviews -> (the token ids ``run``'s model reads, each review's whole token count), from one
    tokenizer pass: the count tells whether truncation cut anything."""
    full = [e.ids for e in run.tokenizer.encode_batch(texts, add_special_tokens=False)]
    return [truncate(ids, run.max_len, run.truncation) for ids in full], [len(ids) for ids in full]


# ------------------------------------------------------------ raw texts (predict, serve)
def clip(text: str, run: LoadedRun) -> tuple[str, str | None]:
    """Cut a very long review to ``CHARS_PER_TOKEN`` characters per model position before tokenizing,
    keeping the same head/tail proportions as the token truncation, so a megabyte review costs no more
    than a long one. Reviews shorter than that are untouched."""
    budget = CHARS_PER_TOKEN * run.max_len
    if len(text) <= budget:
        return text, None
    # ``truncate`` slices any sequence: here characters, with the run's head/tail strategy.
    note = (f"truncated: {len(text):,} characters, of which the model read {run.max_len} tokens "
            f"({run.truncation})")
    return truncate(text, budget, run.truncation), note  # type: ignore[arg-type]


@dataclass
class TextResult:
    """One raw text through the model."""

    text: str                          # the text as tokenized (after ``clip``)
    normalized: str                    # ... and normalised (what the tokenizer saw)
    probabilities: np.ndarray | None   # None when nothing is left once HTML markup is removed
    notes: list[str]                   # what was truncated, for people


def classify_texts(run: LoadedRun, texts: list[str], device: torch.device, dtype: torch.dtype | None,
                   batch_size: int = 64, progress=None, max_tokens: int | None = None) -> list[TextResult]:
    """Raw review texts -> ``TextResult`` in input order: clipped, normalised, tokenized and
    predicted in length-bucketed batches (``batch_size``, ``progress``, ``max_tokens`` as in ``predict_ids``)."""
    results = []
    for text in texts:
        text, note = clip(text, run)
        results.append(TextResult(text, normalize(text), None, [note] if note else []))
    todo = [r for r in results if r.normalized]
    if not todo:
        return results
    ids, totals = encode_normalized(run, [r.normalized for r in todo])  # each review tokenized once
    probabilities = predict_ids(run.model, ids, device, dtype, batch_size, progress, max_tokens)
    for result, total, row in zip(todo, totals, probabilities):
        result.probabilities = row
        if total > run.max_len and not result.notes:  # (a clipped review's note already says so)
            result.notes.append(f"truncated: the model read {run.max_len} of its {total} tokens "
                                f"({run.truncation})")
    return results
