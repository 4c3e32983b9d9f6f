"""The model behind the server: a loaded run, the answers it gives, and what it says about itself.

``predict`` and ``explain`` do model arithmetic and block: the app calls them only on the
micro-batch worker thread. Both go through ``inference.classify_texts``, the path that
``classify.predict`` takes, on the run's backend (PyTorch or ONNX Runtime), so the server adds nothing of its own
to the model's arithmetic.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from ..engine.files import read_json, read_jsonl
from ..engine.runfolder import METRICS, TEST_METRICS
from ..errors import ClassifyError
from ..explain import Explanation, explain, explained_class
from ..inference import LoadedRun, TextResult, classify_texts


@dataclass
class Explained:
    result: TextResult
    explanation: Explanation | None    # None when the text had nothing to read


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    """The SHA-256 of a file, read in 1 MiB pieces (a model file can be hundreds of MiB: never all in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(chunk):
            digest.update(piece)
    return digest.hexdigest()


@dataclass(frozen=True)
class ModelIdentity:
    """Which model answers: the model folder's name, a version (the first 12 hex digits of the SHA-256 of the file
    the backend runs, so it changes exactly when the weights do) and the whole hash. Computed once, at load."""

    name: str
    sha256: str

    @property
    def version(self) -> str:
        return self.sha256[:12]

    @property
    def id(self) -> str:
        """``name@version``: the ``model`` of every answer and its X-Model-Version header."""
        return f"{self.name}@{self.version}"

    @classmethod
    def of(cls, run: LoadedRun) -> "ModelIdentity":
        return cls(run.path.name, file_sha256(run.weights))


class ModelService:
    def __init__(self, run: LoadedRun, batch_size: int, max_tokens: int | None = None):
        self.run, self.batch_size, self.max_tokens = run, batch_size, max_tokens
        self.identity = ModelIdentity.of(run)
        self.id = self.identity.id

    def predict(self, texts: list[str]) -> list[TextResult]:
        return classify_texts(self.run, texts, self.batch_size, max_tokens=self.max_tokens)

    def explain(self, texts: list[str], steps: int) -> list[Explained]:
        """Predict, then attribute each prediction to the words (integrated gradients, ``classify.explain``; the
        PyTorch backend only), towards ``explained_class`` (the positive class of two, whatever the answer)."""
        return [Explained(r, None if r.probabilities is None else
                          explain(self.run, r.text, explained_class(r.probabilities), steps, self.run.backend.device))
                for r in self.predict(texts)]

    def describe(self) -> dict[str, Any]:
        """The run's identity, sizes and recorded metrics (read from its folder now, so a corrupt
        metrics file is reported here rather than refusing to serve a model that loads)."""
        run = self.run
        return {
            "id": self.id,
            "name": self.identity.name,
            "version": self.identity.version,
            "sha256": self.identity.sha256,
            "run": str(run.path.resolve()),
            "labels": run.labels,
            "parameters": run.backend.parameters,
            "sizes": run.config.get("model", {}),
            "truncation": run.truncation,
            "training": {"config": run.config.get("train", {}), **_validation_metrics(run)},
            "test": _read_optional(run.path / TEST_METRICS, "test_metrics.json"),
        }


def _validation_metrics(run: LoadedRun) -> dict[str, Any]:
    try:
        records = [r for r in read_jsonl(run.path / METRICS) if "val_accuracy" in r]
    except (OSError, ValueError) as err:
        return {"note": f"{METRICS} is unreadable: {err}"}
    if not records:
        return {}
    best = max(records, key=lambda r: r["val_accuracy"])
    return {"last": records[-1], "best_val_accuracy": best["val_accuracy"], "best_step": best.get("step")}


def _read_optional(path: Path, what: str) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        return read_json(path, what)
    except ClassifyError as err:
        return {"note": str(err)}
