"""Run folders: the only module that writes files into one.

A run folder (Hugging Face style)::

    RUN/
      config.json         {"format_version", "kind", "model": {...}, "train": {...}, "labels": [...]}
      tokenizer.json      Hugging Face tokenizers file
      model.safetensors   best weights on validation
      last/
        model-<step>.safetensors      latest weights
        optimizer-<step>.safetensors  optimizer tensors (flattened state dict)
        state.json                    names those files; step, epoch, scheduler, RNG, best metric, ...
      metrics.jsonl       one JSON line per evaluation
      test_metrics.json   one evaluation of the best model on the test split

Every file is written to a temporary file in the same folder and renamed into
place, so a kill at any instant leaves the previous complete version. Nothing is
ever unpickled: weights are safetensors, state is JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .errors import ClassifyError

FORMAT_VERSION = 1
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
WEIGHTS = "model.safetensors"
LAST = "last"
METRICS = "metrics.jsonl"
TEST_METRICS = "test_metrics.json"


# --------------------------------------------------------------------- atomic files
_UMASK = os.umask(0)
os.umask(_UMASK)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync and rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp_path, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the usual permissions
        os.replace(tmp_path, path)
    finally:
        tmp_path.unlink(missing_ok=True)


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """Append one line; the whole file is rewritten atomically so a kill never leaves half a line."""
    path = Path(path)
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    write_text(path, old + json.dumps(record) + "\n")


def read_json(path: str | Path, what: str) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ClassifyError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ClassifyError(f"{what} is corrupt ({path}): {err}") from None


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# -------------------------------------------------------------------------- tensors
def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    # safetensors refuses shared storage (tied weights) and non-contiguous views: store clones.
    flat = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    with atomic_path(path) as tmp:
        save_file(flat, str(tmp))


def load_tensors(path: str | Path, what: str = "weights") -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.exists():
        raise ClassifyError(f"{what} not found: {path}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ClassifyError(f"{what} file is corrupt or truncated ({path}): {err}") from None


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a weights file holds: the state dict of the underlying model (unwrapping DDP /
    torch.compile), each tensor once. A parameter tied to an earlier one (a shared embedding
    and output projection) is left out; ``load_model_weights`` restores it through the tie."""
    model = getattr(model, "module", model)
    model = getattr(model, "_orig_mod", model)
    tied = _tied_names(model)
    return {name: tensor for name, tensor in model.state_dict().items() if name not in tied}


def load_model_weights(model: torch.nn.Module, path: str | Path, only: tuple[str, ...] | None = None,
                       what: str = "weights") -> int:
    """Load safetensors weights into ``model``, with a clear error when they do not fit.

    ``only``: load just the parameters whose names start with these prefixes (e.g. a pretrained
    encoder into a classifier with a fresh head). Returns the number of tensors loaded.
    """
    tensors = load_tensors(path, what)
    model = getattr(model, "module", model)
    expected = model.state_dict()
    if only is not None:
        tensors = {k: v for k, v in tensors.items() if k.startswith(only)}
        expected = {k: v for k, v in expected.items() if k.startswith(only)}
    missing = sorted(set(expected) - set(tensors) - _tied_names(model))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ClassifyError(f"{what} in {path} do not match the model "
                            f"(missing: {missing[:3]}, unexpected: {unexpected[:3]})")
    for name, tensor in tensors.items():
        if tensor.shape != expected[name].shape:
            raise ClassifyError(f"{what} in {path} do not match the model: {name} has shape "
                                f"{tuple(tensor.shape)}, the model expects {tuple(expected[name].shape)}")
    model.load_state_dict(tensors, strict=False)
    return len(tensors)


def _tied_names(model: torch.nn.Module) -> set[str]:
    """Names under which ``model`` holds a tensor it already holds under an earlier name (tied weights)."""
    seen: set[int] = set()
    tied = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # the same Parameter object, not merely the same address (empty tensors share 0)
            tied.add(name)
        seen.add(id(tensor))
    return tied


# ------------------------------------------------------------------- optimizer state
def save_optimizer(path: str | Path, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
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


def load_optimizer(path: str | Path, optimizer: torch.optim.Optimizer, meta: dict[str, Any]) -> None:
    tensors = load_tensors(path, "optimizer state")
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    for pid, scalars in meta["scalars"].items():
        state.setdefault(int(pid), {}).update(scalars)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


# ------------------------------------------------------------------------- RNG state
def rng_state() -> dict[str, Any]:
    """Torch CPU (and CUDA) generator states as lists of ints (JSON-safe)."""
    state = {"torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


# ------------------------------------------------------------------------ run config
def write_config(run: str | Path, kind: str, model: dict[str, Any], **extra: Any) -> None:
    write_json(Path(run) / CONFIG, {"format_version": FORMAT_VERSION, "kind": kind, "model": model, **extra})


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


def prepare_run_folder(out: str | Path, kind: str, train: dict[str, Any], identity: tuple[str, ...],
                       model: dict[str, Any], overwrite: bool,
                       sized_by_tokenizer: tuple[str, ...] = ("vocab_size",)) -> bool:
    """Decide between a fresh run and continuing the one in ``out``. Returns True when resuming.

    A folder holding another kind of run, or a run whose ``identity`` training fields or model
    sizes differ, is refused unless ``overwrite`` (which deletes it). Sizes set by the tokenizer
    (``sized_by_tokenizer``) are known only after training it and are not compared.
    """
    out = Path(out)
    if not (out / CONFIG).exists():
        if out.exists() and any(out.iterdir()) and not overwrite:
            raise ClassifyError(f"{out} exists and is not a classify run folder; choose another --output "
                                f"or pass --overwrite")
        return False
    if overwrite:
        shutil.rmtree(out)
        return False
    old = read_config(out, kind)
    old_train, old_model = old.get("train", {}), old.get("model", {})
    diffs = [k for k in identity if old_train.get(k) != train.get(k)]
    diffs += [k for k in model if k not in sized_by_tokenizer and old_model.get(k) != model[k]]
    if diffs:
        raise ClassifyError(f"{out} holds a different run (differs in: {', '.join(diffs)}); "
                            f"choose another --output or pass --overwrite")
    return (out / LAST / "state.json").exists() or (out / WEIGHTS).exists()


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


def save_last(run: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              state: dict[str, Any]) -> None:
    """Everything needed to resume, committed by one atomic write of ``last/state.json``.

    Weights and optimizer tensors go to files named after the step; state.json, written
    last, names them. A kill before that rename leaves the previous state.json pointing
    at the previous (still present) files; older files are removed only afterwards.
    """
    last = Path(run) / LAST
    tag = f"{int(state['step']):09d}"
    weights, optim = f"model-{tag}.safetensors", f"optimizer-{tag}.safetensors"
    save_tensors(last / weights, model_state(model))
    optim_meta = save_optimizer(last / optim, optimizer)
    write_json(last / "state.json", {**state, "weights_file": weights, "optimizer_file": optim,
                                     "optimizer": optim_meta, "rng": rng_state()})
    for old in last.glob("*.safetensors"):
        if old.name not in (weights, optim):
            old.unlink(missing_ok=True)


def load_last(run: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """Restore ``last/`` into model and optimizer; returns the saved state, or None if there is none."""
    last = Path(run) / LAST
    if not (last / "state.json").exists():
        return None
    state = read_json(last / "state.json", "resume state")
    load_model_weights(model, last / state["weights_file"])
    load_optimizer(last / state["optimizer_file"], optimizer, state["optimizer"])
    set_rng_state(state["rng"])
    return state
