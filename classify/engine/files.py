"""Files that survive a kill: atomic writes, JSON, and safetensors weights (never pickle).

Every file is written to a temporary file in the same folder and renamed into place, so a
kill at any instant leaves the previous complete version. Nothing is ever unpickled:
weights are safetensors, everything else is JSON. ``classify.engine.runfolder`` builds the
run folder on these.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import ClassifyError

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
    upgrade = getattr(model, "upgrade_state", None)   # a model that reads files of an older layout
    if upgrade is not None:
        tensors = upgrade(tensors)
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
