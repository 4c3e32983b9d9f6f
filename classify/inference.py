"""Running a trained classifier: load a model folder, and raw texts -> answers in three stages.

    run = load_run("runs/imdb", device)                      # a run folder, on PyTorch
    run = load_export("exports/imdb", threads=2)             # an exported folder, on ONNX Runtime
    results = classify_texts(run, ["A wonderful film."])     # -> [TextResult(label="pos", score=0.97, ...)]

``classify_texts`` is the one path from raw text to answers (``predict``, ``serve``; ``train`` and
``evaluate`` take its first two stages), as Hugging Face's pipelines split it:

1. prepare the texts: clip, normalise, tokenize, truncate, note what was cut (``text.prepare.Preprocessing``);
2. run the model on a backend: token ids -> logits (``backends``: PyTorch or ONNX Runtime);
3. turn logits into answers: softmax, label, score, notes (``answers``).
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.markup import escape
from tokenizers import Tokenizer

from .backends import Backend, OnnxBackend, TorchBackend, batched_logits
from .engine.config import InferenceConfig, recorded, runtime
from .engine.files import load_model_weights
from .engine.runfolder import TOKENIZER, WEIGHTS, newest_run, read_model_config
from .errors import ClassifyError
from .models import Classifier, ClassifierConfig
from .text.prepare import Prepared, Preprocessing
from .text.tokenize import load_tokenizer
from .train_config import TrainConfig

KIND = "classifier"
EXPORT_KIND = "classifier-onnx"   # config.json's kind in a folder written by classify.export
ONNX_MODEL = "model.onnx"
RUNS_DIR = Path("runs")


@dataclass
class LoadedRun:
    """A trained classifier ready for inference: how to prepare its texts, and a backend to run it on."""

    path: Path
    config: dict              # the whole config.json
    labels: list[str]         # class names, index = class id
    preprocessing: Preprocessing
    backend: Backend

    @property
    def tokenizer(self) -> Tokenizer:
        return self.preprocessing.tokenizer

    @property
    def max_len(self) -> int:
        return self.preprocessing.max_len

    @property
    def truncation(self) -> str:
        return self.preprocessing.truncation

    @property
    def weights(self) -> Path:
        """The file the backend runs (names the model in answers: ``serve.service.model_id``)."""
        return self.path / (WEIGHTS if self.backend.name == "torch" else ONNX_MODEL)

    @property
    def model(self) -> Classifier:
        """The PyTorch model (explanations and the trainers need its gradients or its branches)."""
        if not isinstance(self.backend, TorchBackend):
            raise ClassifyError(f"this needs the PyTorch model, and {self.path} is run on --backend "
                                f"{self.backend.name}: use --backend torch with the run folder")
        return self.backend.model


def _read(path: Path, kind: str) -> tuple[dict, ClassifierConfig, list[str], Preprocessing]:
    """config.json and tokenizer.json of a model folder, checked against each other: (config, model config,
    labels, how the run reads its texts)."""
    config, model_config = read_model_config(path, kind, ClassifierConfig)
    tokenizer = load_tokenizer(path / TOKENIZER)
    if tokenizer.get_vocab_size() != model_config.vocab_size:
        raise ClassifyError(f"tokenizer.json has {tokenizer.get_vocab_size()} tokens but the model's embedding "
                            f"has {model_config.vocab_size}: the folder mixes files from different runs")
    labels = config.get("labels") or [str(i) for i in range(model_config.num_classes)]
    train = config.get("train", {})   # runs from before a setting existed read as they were trained
    preprocessing = Preprocessing(tokenizer, model_config.max_len, recorded(TrainConfig, train, "truncation"),
                                  recorded(TrainConfig, train, "spelling"))
    return config, model_config, list(labels), preprocessing


def load_run(path: str | Path, device: torch.device, dtype: torch.dtype | None = None) -> LoadedRun:
    """A run folder (``config.json``, ``tokenizer.json``, ``model.safetensors``) on PyTorch; every way these can
    be missing, corrupt or mutually inconsistent is a ClassifyError with one clear line."""
    path = Path(path)
    config, model_config, labels, preprocessing = _read(path, KIND)
    model = Classifier(model_config)
    load_model_weights(model, path / WEIGHTS)
    if model.ngram is not None:
        model.ngram.compact()   # a quarter of the table's memory; nothing here fits or saves it
    backend = TorchBackend(model.to(device), device, dtype)
    return LoadedRun(path, config, labels, preprocessing, backend)


def load_export(path: str | Path, threads: int | None = None) -> LoadedRun:
    """A folder written by ``classify.export`` (``model.onnx`` beside the run's config and tokenizer) on ONNX
    Runtime with ``threads`` threads."""
    path = Path(path)
    config, model_config, labels, preprocessing = _read(path, EXPORT_KIND)
    if not (path / ONNX_MODEL).is_file():
        raise ClassifyError(f"{ONNX_MODEL} not found in {path}: export the run again with python -m classify.export")
    export = config.get("export", {})
    backend = OnnxBackend(path / ONNX_MODEL, model_config.pad_id, model_config.max_len, model_config.num_classes,
                          int(export.get("parameters", 0)), threads, export.get("weights", "fp32"))
    return LoadedRun(path, config, labels, preprocessing, backend)


def open_run(model: str | None, settings: InferenceConfig | Namespace, console: Console) -> LoadedRun:
    """The model a command runs: ``model`` (or the newest one under ``runs/``) on ``settings.backend``, with
    ``settings``' device, precision and threads (an ``InferenceConfig`` or the flags parsed from one);
    announced on ``console``."""
    onnx = settings.backend == "onnx"
    if onnx:
        if settings.device not in ("auto", "cpu") or settings.precision not in ("auto", "fp32"):
            raise ClassifyError("--backend onnx runs the exported model (fp32, or int8 weights if exported with "
                                "--int8) on the CPU; --device and --precision are for --backend torch")
        if settings.threads is not None and settings.threads < 1:
            raise ClassifyError(f"--threads must be at least 1, got {settings.threads}")
    kind, weights = (EXPORT_KIND, ONNX_MODEL) if onnx else (KIND, WEIGHTS)
    path = Path(model) if model is not None else newest_run(RUNS_DIR, kind, weights)
    if onnx and not (path / ONNX_MODEL).exists() and (path / WEIGHTS).exists():
        raise ClassifyError(f"{path} is a training run, not an export: write one with python -m classify.export "
                            f"--model {path} --output DIR and pass --model DIR, or use --backend torch")
    if not onnx and (path / ONNX_MODEL).exists() and not (path / WEIGHTS).exists():
        raise ClassifyError(f"{path} is an ONNX export: run it with --backend onnx (or pass the run folder)")
    if onnx:
        run = load_export(path, settings.threads)
    else:
        device, dtype = runtime(settings)
        run = load_run(path, device, dtype)
    if settings.spelling is not None:
        run.preprocessing = replace(run.preprocessing, spelling=settings.spelling)
    how = "" if model is not None else f" (the newest under {RUNS_DIR}/; choose another with --model)"
    r = run.backend.runtime
    console.print(f"model: {escape(str(path))}{how}, {'ONNX Runtime' if onnx else 'PyTorch'} on {r['device']}, "
                  f"{'autocast ' if not onnx and r['precision'] != 'fp32' else ''}{r['precision']}"
                  + (f", {settings.threads} threads" if onnx and settings.threads else ""))
    return run


# ------------------------------------------------------------------------ answers
@dataclass
class TextResult:
    """One raw text through the model."""

    text: str                          # the text as tokenized (after clipping)
    normalized: str                    # ... and normalised (what the tokenizer saw)
    probabilities: np.ndarray | None   # (C,); None when nothing is left once HTML markup is removed
    notes: list[str]                   # what was truncated, for people
    label: str | None = None           # the most probable class and its probability (None as above)
    score: float | None = None


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in float64 for the exponent."""
    z = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def answers(prepared: list[Prepared], logits: np.ndarray, labels: list[str]) -> list[TextResult]:
    """Stage 3: the prepared texts that had something to read (their logits (N, C), in order) -> answers;
    the others get none."""
    probabilities = iter(softmax(logits))
    results = []
    for p in prepared:
        result = TextResult(p.text, p.normalized, None, p.notes)
        if p.normalized:
            result.probabilities = row = next(probabilities)
            k = int(np.argmax(row))
            result.label, result.score = labels[k], float(row[k])
        results.append(result)
    return results


def classify_texts(run: LoadedRun, texts: list[str], batch_size: int = 64,
                   progress: Callable[[int], None] | None = None, max_tokens: int | None = None) -> list[TextResult]:
    """Raw review texts -> ``TextResult`` in input order: prepared, run on ``run``'s backend in length-bucketed
    batches (``batch_size``, or ``max_tokens`` padded tokens; ``progress(n_done)``), answered."""
    prepared = run.preprocessing(texts)
    ids = [p.ids for p in prepared if p.normalized]
    return answers(prepared, batched_logits(run.backend, ids, batch_size, max_tokens, progress), run.labels)
