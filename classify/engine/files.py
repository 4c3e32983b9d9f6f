"""Files that survive a kill: atomic writes, JSON, and safetensors weights (never pickle).

Every file is written to a temporary file in the same folder and renamed into place, so a
kill at any instant leaves the previous complete version. Nothing is ever unpickled:
weights are safetensors, everything else is JSON. ``classify.engine.runfolder`` builds the
run folder on these.

Weights files store a matrix whose rows are mostly zero (the n-gram branch's hashed table) as
the rows that are not (``pack_rows``); ``load_tensors`` gives it back as it was saved.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

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
# The safetensors header's metadata key that lists the packed tensors, as JSON: {name: {"shape", "antisymmetric",
# "dtype"}}.
PACKED = "classify.packed_rows"


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` to a safetensors file, each matrix in whichever of its two forms is smaller (``pack_rows``)."""
    flat: dict[str, torch.Tensor] = {}
    packed: dict[str, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        parts = pack_rows(tensor.detach())
        if parts is None:
            # safetensors refuses shared storage (tied weights) and non-contiguous views: store clones.
            flat[name] = tensor.detach().contiguous().clone()
        else:
            flat[f"{name}.rows"], flat[f"{name}.values"], packed[name] = parts
    with atomic_path(path) as tmp:
        save_file(flat, str(tmp), metadata={PACKED: json.dumps(packed)} if packed else None)


def load_tensors(path: str | Path, what: str = "weights") -> dict[str, torch.Tensor]:
    """The tensors ``save_tensors`` wrote, packed ones unpacked (also reads files written before packing)."""
    path = Path(path)
    if not path.exists():
        raise ClassifyError(f"{what} not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            packed = json.loads((f.metadata() or {}).get(PACKED, "{}"))
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        for name, layout in packed.items():
            tensors[name] = unpack_rows(tensors.pop(f"{name}.rows"), tensors.pop(f"{name}.values"), **layout)
    except (SafetensorError, OSError, ValueError, KeyError, TypeError, RuntimeError) as err:
        raise ClassifyError(f"{what} file is corrupt or truncated ({path}): {err}") from None
    return tensors


def signed_column(matrix: torch.Tensor) -> torch.Tensor | None:
    """(N, 2) whose two columns are exact negatives of each other (a two-class linear model fitted as one logit
    difference, split symmetrically) -> column 1, (N,), from which negation restores column 0 bit for bit; None
    for any other matrix."""
    if matrix.dim() != 2 or matrix.shape[1] != 2 or not torch.equal(matrix[:, 0], -matrix[:, 1]):
        return None
    return matrix[:, 1].clone()   # a clone: not a strided view


def exact_half(values: torch.Tensor) -> torch.Tensor:
    """``values`` in float16 where every one of them is a float16 number (the n-gram fits round to them), in
    half the bytes; otherwise unchanged."""
    half = values.to(torch.float16)
    return half if values.itemsize > half.itemsize and torch.equal(half.to(values.dtype), values) else values


def pack_rows(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]] | None:
    """A floating-point matrix (N, C) as the rows that are not all zero, or None when that is not smaller.

    Returns ``rows``, a bitmap of those rows (ceil(N / 8),) uint8 (``np.packbits``: row 0 is the first byte's
    high bit), ``values``, the rows themselves in order (K, C), and the layout ``unpack_rows`` needs. Lossless
    but for the sign of zero: a row of zeros comes back as +0.0. Two columns that are exact negatives of each
    other on every stored row (a two-class linear model fitted as one logit difference, split symmetrically)
    are stored once, column 1, (K,): negation restores column 0 bit for bit. Values that are all exactly
    float16 numbers (the n-gram branch's, which its fit rounds so) are stored as float16.
    """
    if matrix.dim() != 2 or not matrix.is_floating_point() or matrix.device.type != "cpu":
        return None
    live = (matrix != 0).any(dim=1)                                      # (N,) rows that carry weight
    values = matrix[live]                                                # (K, C)
    column = signed_column(values)
    antisymmetric = column is not None
    values = exact_half(column if antisymmetric else values)
    rows = torch.from_numpy(np.packbits(live.numpy()))
    if rows.nbytes + values.nbytes >= matrix.nbytes:
        return None
    dtype = str(matrix.dtype).removeprefix("torch.")
    return rows, values, {"shape": list(matrix.shape), "antisymmetric": antisymmetric, "dtype": dtype}


def unpack_rows(rows: torch.Tensor, values: torch.Tensor, shape: list[int], antisymmetric: bool,
                dtype: str) -> torch.Tensor:
    """``pack_rows`` undone: the ``dtype`` matrix ``shape`` (N, C) with ``values`` (K, C), or column 1 (K,) if
    ``antisymmetric``, in the rows the bitmap ``rows`` marks, zeros elsewhere."""
    live = torch.from_numpy(np.unpackbits(rows.numpy(), count=shape[0]).astype(bool))   # (N,)
    values = values.to(getattr(torch, dtype))
    if antisymmetric:
        values = torch.stack([-values, values], dim=1)
    matrix = torch.zeros(shape, dtype=values.dtype)
    matrix[live] = values
    return matrix


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
    """Load safetensors weights into ``model``, with a clear error when they do not fit. A submodule with an
    ``upgrade_state(tensors, prefix)`` method first rewrites, in place, tensors it stored in an older layout.

    ``only``: load just the parameters whose names start with these prefixes (e.g. a pretrained
    encoder into a classifier with a fresh head). Returns the number of tensors loaded.
    """
    tensors = load_tensors(path, what)
    model = getattr(model, "module", model)
    for prefix, module in model.named_modules():
        if hasattr(module, "upgrade_state"):  # a module that reads its tensors in an older layout too
            module.upgrade_state(tensors, f"{prefix}." if prefix else "")
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
