"""Run folders: every file a run writes, and the rule that one process writes at a time.

A run folder (Hugging Face style)::

    RUN/
      config.json         {"format_version", "kind", "model": {...}, "train": {...}, "labels": [...]}
      tokenizer.json      Hugging Face tokenizers file
      model.safetensors   best weights on validation (of the weight average, with --average-from)
      last/
        model-<step>.safetensors      latest weights
        optimizer-<step>.safetensors  optimizer tensors (flattened state dict)
        average-<step>.safetensors    the weight average so far (runs with --average-from)
        state.json                    names those files; step, epoch, scheduler, RNG, best metric, ...
      metrics.jsonl       one JSON line per evaluation
      pseudo_labels.json  the class probabilities a teacher gave the unlabelled reviews the run also trains on
      branch_validation.json  the n-gram branch's validation logits from its fit on the training part alone,
                          kept when the model's branch is fitted again on all labelled reviews
      test_metrics.json   one evaluation of the best model on the test split
      .lock               held (flock) by the process writing the run; holds its pid for the message

``RunFolder`` is the only writer of these files (rank 0 of a training owns one); the functions
at the top read them for inference. Every write is atomic (``classify.engine.files``): a kill at
any instant leaves the previous complete version, and an operating-system error while saving (a
full disk) becomes one line that says nothing was lost.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
from dataclasses import MISSING, asdict, fields
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from tokenizers import Tokenizer

from ..errors import ClassifyError
from ..text.tokenize import load_tokenizer
from . import distributed
from .average import WeightAverage
from .config import recorded
from .files import (append_jsonl, load_model_weights, load_tensors, model_state, read_json, read_jsonl, save_tensors,
                    write_json, write_text)

FORMAT_VERSION = 1
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
WEIGHTS = "model.safetensors"
LAST = "last"
METRICS = "metrics.jsonl"
TEST_METRICS = "test_metrics.json"
PSEUDO_LABELS = "pseudo_labels.json"
BRANCH_VALIDATION = "branch_validation.json"
LOCK = ".lock"


# -------------------------------------------------------------------------- reading
def read_config(run: str | Path, kind: str) -> dict[str, Any]:
    """config.json of a run folder, checked for format version and kind."""
    run = Path(run)
    if not run.is_dir():
        raise ClassifyError(f"run folder not found: {run}")
    config = read_json(run / CONFIG, "config.json")
    if not isinstance(config, dict) or "format_version" not in config:
        raise ClassifyError(f"{run / CONFIG} is not a classify run config (no format_version)")
    if config["format_version"] != FORMAT_VERSION:
        raise ClassifyError(f"{run / CONFIG} has format_version {config['format_version']!r}; "
                            f"this version of classify reads {FORMAT_VERSION}")
    if config.get("kind") != kind:
        raise ClassifyError(f"{run} holds a {config.get('kind')!r} run, not a {kind!r} run")
    return config


def read_model_config(run: str | Path, kind: str, config_class):
    """``(config.json as a dict, its model section as ``config_class``)``, validated; a malformed
    model section is a ClassifyError naming the file."""
    config = read_config(run, kind)
    try:
        model_config = config_class.from_dict(config["model"])
        model_config.validate()
    except (KeyError, TypeError, ValueError) as err:
        raise ClassifyError(f"{Path(run) / CONFIG} has an invalid model section: {err}") from None
    return config, model_config


def newest_run(root: Path, kind: str, weights: str = WEIGHTS) -> Path:
    """The folder under ``root`` of ``kind`` whose ``weights`` file was written last (folders of other kinds,
    e.g. translation models, live there too)."""
    found = sorted(root.rglob(weights), key=lambda p: p.stat().st_mtime) if root.is_dir() else []
    for path in reversed(found):
        try:
            if json.loads((path.parent / CONFIG).read_text(encoding="utf-8")).get("kind") == kind:
                return path.parent
        except (OSError, ValueError, AttributeError):
            continue  # no or unreadable config: not a usable folder
    what, make = ((f"trained {kind} run", "train one with python -m classify.train") if weights == WEIGHTS else
                  (f"{kind} export", "write one with python -m classify.export"))
    raise ClassifyError(f"no --model given and no {what} (a folder with {weights}) under {root}/; {make} "
                        f"or pass --model FOLDER")


# -------------------------------------------------------------------------- writing
class RunFolder:
    """The run folder of one training, written by one process at a time.

    ``open`` takes the folder's lock (``fcntl.flock`` on ``.lock``: the operating system
    releases it when the process ends, however it ends, so a killed run never blocks the
    next) and decides between a fresh run and a resume; the other methods write its files.
    Under torchrun every rank calls ``open``, ``tokenizer`` and ``record`` (rank 0 does the
    work, the others get its answer); the loop calls the rest on rank 0 alone. Use it as a
    context manager, or call ``release``.
    """

    def __init__(self, path: str | Path, kind: str):
        self.path = Path(path)
        self.kind = kind
        self._lock: int | None = None
        self._made = False  # this process created the folder (removed again if it stays empty)

    def __enter__(self) -> "RunFolder":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # ---- the one-writer lock
    def acquire(self) -> None:
        """Become the folder's only writer, or raise a ClassifyError naming the process that is."""
        self._made = not self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise ClassifyError(f"{self.path} is being written by another run ({holder}); wait for it to "
                                f"finish or choose another --output") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self._lock = fd

    def release(self) -> None:
        if self._lock is None:
            return
        if not (self.path / CONFIG).exists():  # a run that recorded nothing leaves the folder as it found it
            (self.path / LOCK).unlink(missing_ok=True)
            if self._made and not any(self.path.iterdir()):
                self.path.rmdir()
        os.close(self._lock)  # closing the descriptor releases the flock
        self._lock = None

    # ---- starting
    def open(self, config: Any, model: Any, overwrite: bool, resume: bool = False,
             sized_by_tokenizer: tuple[str, ...] = ("vocab_size", "ngram_negators", "ngram_breaks",
                                                     "ngram_auxiliaries")) -> bool:
        """Take the lock, then decide between a fresh run and continuing the one here, for the run
        settings ``config`` (a ``RunConfig``) and the model config ``model``. Returns True when resuming;
        ``resume`` (``--resume``) makes a fresh start an error. Every rank calls it; rank 0 decides.

        A folder holding another kind of run, or a run whose ``IDENTITY`` training fields or model
        sizes differ, is refused unless ``overwrite`` (which empties it); a run recorded before a setting existed
        counts as recorded with that setting's ``absent`` value (``config.recorded``). Sizes set by the tokenizer
        (``sized_by_tokenizer``: its size, the token ids of the negation scope) are known only after training it
        and are not compared.
        """
        def decide() -> bool:
            self.acquire()
            resuming = self._decide(config, model, overwrite, sized_by_tokenizer)
            if resume and not resuming:
                raise ClassifyError(f"--resume: {self.path} holds no run to continue (leave out --resume to "
                                    f"start one)")
            return resuming

        return distributed.on_main(decide)

    def _decide(self, config: Any, model: Any, overwrite: bool, sized_by_tokenizer: tuple[str, ...]) -> bool:
        others = [p for p in self.path.iterdir() if p.name != LOCK]
        if not (self.path / CONFIG).exists():
            if others and not overwrite:
                raise ClassifyError(f"{self.path} exists and is not a classify run folder; choose another "
                                    f"--output or pass --overwrite")
            return False
        if overwrite:
            for p in others:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            return False
        old = read_config(self.path, self.kind)
        old_train, old_model = old.get("train", {}), old.get("model", {})
        # Each differing setting: (the run's value, this command's).
        diffs = {k: (recorded(config, old_train, k), getattr(config, k)) for k in type(config).IDENTITY}
        # A model field the run's config.json lacks was added later: the run has its default, as loading reads it.
        before = {f.name: f.default for f in fields(model) if f.default is not MISSING}
        now = model.to_dict()
        diffs.update({k: (old_model.get(k, before.get(k)), now[k]) for k in now if k not in sized_by_tokenizer})
        named = [f"{k} ({old!r} there, {new!r} here)" for k, (old, new) in diffs.items() if old != new]
        if named:
            raise ClassifyError(f"{self.path} holds a different run (differs in: {', '.join(named)}); pass the "
                                f"settings it was started with to resume it, choose another --output or pass "
                                f"--overwrite")
        return (self.path / LAST / "state.json").exists() or (self.path / WEIGHTS).exists()

    def record(self, resuming: bool, tokenizer: Tokenizer, config: Any, model: Any, **extra: Any) -> None:
        """Write tokenizer.json and config.json of a fresh run; on resume keep the model section and the
        extras as they were and record the run settings ``config`` as the latest (budget, epochs, ... may
        change). Every rank calls it; rank 0 writes."""
        if not distributed.is_main():
            return
        if resuming:
            self._rewrite_settings(asdict(config))
        else:
            with self._writing(TOKENIZER):
                write_text(self.path / TOKENIZER, tokenizer.to_str())
            self._write_config(asdict(config), model.to_dict(), extra)

    def record_settings(self, config: Any) -> None:
        """Rewrite config.json's run settings as ``config``, model section and extras kept (a setting fixed after
        the run started: the training minutes of --finish-within). Every rank calls it; rank 0 writes."""
        if distributed.is_main():
            self._rewrite_settings(asdict(config))

    def _rewrite_settings(self, train: dict[str, Any]) -> None:
        old = read_config(self.path, self.kind)
        self._write_config(train, old["model"], {k: v for k, v in old.items()
                                                 if k not in ("format_version", "kind", "model", "train")})

    def _write_config(self, train: dict[str, Any], model: dict[str, Any], extra: dict[str, Any]) -> None:
        with self._writing(CONFIG):
            write_json(self.path / CONFIG, {"format_version": FORMAT_VERSION, "kind": self.kind, "model": model,
                                            "train": train, **extra})

    def tokenizer(self, resuming: bool, make: Callable[[], Tokenizer]) -> Tokenizer:
        """The run's tokenizer.json when resuming, else ``make()``. Rank 0 makes it and sends it to the
        others: identical everywhere, even where they cannot see the run folder."""
        text = distributed.on_main(lambda: (load_tokenizer(self.path / TOKENIZER) if resuming else make()).to_str())
        return Tokenizer.from_str(text)

    # ---- during training
    def save_best(self, model: torch.nn.Module) -> None:
        with self._writing(WEIGHTS):
            save_tensors(self.path / WEIGHTS, model_state(model))

    def log_metrics(self, record: dict[str, Any]) -> None:
        with self._writing(METRICS):
            append_jsonl(self.path / METRICS, record)

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path / METRICS)

    def save_last(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                  average: WeightAverage | None = None) -> None:
        """Everything needed to resume, committed by one atomic write of ``last/state.json``.

        Weights, optimizer tensors and the weight average (if the run keeps one) go to files named after
        the step; state.json, written last, names them. A kill before that rename leaves the previous
        state.json pointing at the previous (still present) files; older files are removed only afterwards.
        """
        last = self.path / LAST
        tag = f"{int(state['step']):09d}"
        names = {"weights_file": f"model-{tag}.safetensors", "optimizer_file": f"optimizer-{tag}.safetensors"}
        if average is not None:
            names["average_file"] = f"average-{tag}.safetensors"
        with self._writing(f"{LAST}/"):
            save_tensors(last / names["weights_file"], model_state(model))
            optim_meta = _save_optimizer(last / names["optimizer_file"], optimizer)
            if average is not None:
                save_tensors(last / names["average_file"], average.mean)
            write_json(last / "state.json", {**state, **names, "average_count": average.count if average else 0,
                                             "optimizer": optim_meta, "rng": _rng_state()})
        for old in last.glob("*.safetensors"):
            if old.name not in names.values():
                old.unlink(missing_ok=True)

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                average: WeightAverage | None = None) -> dict[str, Any] | None:
        """Load ``last/`` into model, optimizer, weight average and the RNG; returns the saved state, or None if
        there is none. A run that kept no average (an older one, or one without ``--average-from`` then) resumes
        with an empty ``average``.

        Evaluations logged after the saved step will be redone, so metrics.jsonl loses them here:
        a kill between a validation and the next save never leaves a row twice.
        """
        last = self.path / LAST
        if not (last / "state.json").exists():
            return None
        state = read_json(last / "state.json", "resume state")
        load_model_weights(model, last / state["weights_file"])
        _load_optimizer(last / state["optimizer_file"], optimizer, state["optimizer"])
        if average is not None and state.get("average_count"):
            average.load(load_tensors(last / state["average_file"], "weight average"), state["average_count"])
        _set_rng_state(state["rng"])
        kept = [r for r in self.metrics() if r["step"] <= state["step"]]
        with self._writing(METRICS):
            write_text(self.path / METRICS, "".join(json.dumps(r) + "\n" for r in kept))
        return state

    def save_pseudo_labels(self, probs: np.ndarray, teacher: str) -> None:
        """The class probabilities (N, C) ``teacher`` gave the unlabelled reviews, in their order, and each one's
        most likely class: a resumed run trains on the very same targets without fitting the teacher again.
        float32 values are written exactly (JSON keeps a float64 repr), so they read back bit for bit."""
        probs = np.asarray(probs, dtype=np.float32)
        with self._writing(PSEUDO_LABELS):
            write_json(self.path / PSEUDO_LABELS, {"teacher": teacher, "count": len(probs),
                                                   "labels": probs.argmax(1).tolist(), "probabilities": probs.tolist()})

    def pseudo_labels(self, num_classes: int) -> np.ndarray | None:
        """The probabilities ``save_pseudo_labels`` kept, (N, C) float32, or None if the run has none. A file
        of an older run holds the labels alone: each becomes a one-hot row."""
        if not (self.path / PSEUDO_LABELS).exists():
            return None
        data = read_json(self.path / PSEUDO_LABELS, "pseudo-labels")
        data = data if isinstance(data, dict) else {}
        try:
            if "probabilities" in data:
                probs = np.asarray(data["probabilities"], dtype=np.float32)
                if probs.ndim == 2 and probs.shape[1] == num_classes:
                    return probs
            else:
                labels = np.asarray(data["labels"], dtype=np.int64)
                if labels.ndim == 1 and ((labels >= 0) & (labels < num_classes)).all():
                    return np.eye(num_classes, dtype=np.float32)[labels]
        except (KeyError, TypeError, ValueError):
            pass
        raise ClassifyError(f"{self.path / PSEUDO_LABELS} is damaged: it holds no list of labels or probabilities")

    def save_branch_validation(self, logits: np.ndarray) -> None:
        """The n-gram branch's logits (N, C) for the validation reviews, from a fit that has not seen them: the
        mix is chosen on these after the model's branch is fitted again on all labelled reviews."""
        with self._writing(BRANCH_VALIDATION):
            write_json(self.path / BRANCH_VALIDATION, {"count": len(logits),
                                                       "logits": np.asarray(logits, dtype=np.float32).tolist()})

    def branch_validation(self, count: int, num_classes: int) -> np.ndarray | None:
        """The logits ``save_branch_validation`` kept, (count, C) float32, or None if the run has none."""
        if not (self.path / BRANCH_VALIDATION).exists():
            return None
        data = read_json(self.path / BRANCH_VALIDATION, "branch validation logits")
        try:
            logits = np.asarray(data["logits"], dtype=np.float32)
        except (KeyError, TypeError, ValueError):
            logits = None
        if logits is None or logits.shape != (count, num_classes):
            raise ClassifyError(f"{self.path / BRANCH_VALIDATION} is damaged or from another split: it does not "
                                f"hold {num_classes} logits for each of the {count} validation reviews")
        return logits

    def write_test_metrics(self, metrics: dict[str, Any]) -> None:
        with self._writing(TEST_METRICS):
            write_json(self.path / TEST_METRICS, metrics)

    @contextmanager
    def _writing(self, what: str) -> Iterator[None]:
        """An operating-system error while writing (a full disk, a lost permission) is the user's to
        fix: one line that says what failed, and that the last complete save is still there."""
        try:
            yield
        except (OSError, SafetensorError) as err:
            reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            state = self.path / LAST / "state.json"
            kept = (f"last/ still holds step {json.loads(state.read_text())['step']}" if state.exists()
                    else "no earlier state was saved")
            raise ClassifyError(f"could not write {what} in {self.path}: {reason}. The files written before are "
                                f"intact ({kept}); free space and re-run the same command to resume") from None


def _save_optimizer(path: str | Path, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Tensors of the optimizer state go to safetensors; the rest is returned for JSON."""
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, pstate in state["state"].items():
        for key, value in pstate.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{pid}.{key}"] = value
            else:
                scalars.setdefault(str(pid), {})[key] = value
    save_tensors(path, tensors)
    return {"param_groups": state["param_groups"], "scalars": scalars}


def _load_optimizer(path: str | Path, optimizer: torch.optim.Optimizer, meta: dict[str, Any]) -> None:
    tensors = load_tensors(path, "optimizer state")
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    for pid, scalars in meta["scalars"].items():
        state.setdefault(int(pid), {}).update(scalars)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


# ------------------------------------------------------------------------- RNG state
def _rng_state() -> dict[str, Any]:
    """Torch CPU (and CUDA) generator states as lists of ints (JSON-safe)."""
    state = {"torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


