"""Device choice, mixed precision and batch transfer: the only module that knows about CUDA/MPS.

    device = resolve_device("auto")              # cuda > mps > cpu (LOCAL_RANK-aware under torchrun)
    dtype = autocast_dtype(device, "auto")       # bf16 where supported, else fp16 on CUDA, else None
    with autocast(device, dtype): loss = ...
    scaler = grad_scaler(device, dtype)          # active only for fp16
    batch = to_device(batch, device)             # non_blocking from pinned memory on CUDA
    trim_heap_periodically()                     # glibc: free memory back to the system every 5 s (trainers)
    peak_memory()                                # "2.31 GB": peak resident memory so far, for logs
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import time
from typing import Any

import torch

from ..errors import ClassifyError

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
_heap_trimmer: threading.Thread | None = None


def trim_heap_periodically(seconds: float = 5.0) -> None:
    """Every ``seconds``, hand the heap's free pages back to the system (glibc's ``malloc_trim``, from a daemon
    thread started once per process; elsewhere nothing). Batches of ever-different shapes (length buckets,
    oneDNN's bf16 kernels) fragment glibc's heap, and freed memory between live blocks stays resident: training
    and then the test evaluation grew the README command by 3 GB. A fixed mmap threshold bounded it better but
    trained 24% slower; this costs no measurable speed (experiments/RESULTS.md)."""
    global _heap_trimmer
    if _heap_trimmer is not None:
        return
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return

    def trim_forever() -> None:
        while True:
            time.sleep(seconds)
            trim(0)

    _heap_trimmer = threading.Thread(target=trim_forever, name="heap-trim", daemon=True)
    _heap_trimmer.start()


def peak_memory() -> str:
    """The process's peak resident memory so far, for logs: "2.31 GB" (Linux and macOS; "?" elsewhere)."""
    try:
        import resource
    except ImportError:  # Windows
        return "?"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return f"{peak / (1e9 if sys.platform == 'darwin' else 1e6):.2f} GB"  # bytes on macOS, KiB on Linux


def resolve_device(name: str = "auto") -> torch.device:
    """``"auto"`` picks cuda > mps > cpu; under torchrun CUDA uses this process's ``LOCAL_RANK``."""
    if name == "auto":
        if torch.cuda.is_available():
            name = "cuda"
        elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            name = "mps"
        else:
            name = "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ClassifyError(f"unknown device {name!r}: use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ClassifyError("--device cuda was asked for but CUDA is not available on this machine")
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if device.index >= torch.cuda.device_count():
            raise ClassifyError(f"CUDA device {device.index} was asked for but this machine has "
                                f"{torch.cuda.device_count()} (use cuda:0 to cuda:{torch.cuda.device_count() - 1})")
        torch.cuda.set_device(device)
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ClassifyError("--device mps was asked for but MPS is not available on this machine")
    return device


def bf16_supported(device: torch.device) -> bool:
    """Whether bf16 autocast is fast and correct here (CPUs need AVX-512 BF16 / AMX via oneDNN)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if device.type == "mps":
        return True  # bf16 autocast on MPS (macOS 14+, torch >= 2.5)
    return False


def autocast_dtype(device: torch.device, precision: str = "auto") -> torch.dtype | None:
    """The autocast dtype for ``precision`` on ``device``; ``None`` means plain fp32."""
    if precision not in PRECISIONS:
        raise ClassifyError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp32":
        return None
    if precision == "bf16":
        if not bf16_supported(device):
            raise ClassifyError(f"bf16 is not supported on {device}; use --precision fp32 or auto")
        return torch.bfloat16
    if precision == "fp16":
        if device.type == "cpu":
            raise ClassifyError("fp16 autocast is for GPUs; on CPU use --precision bf16 or fp32")
        return torch.float16
    # auto
    if bf16_supported(device):
        return torch.bfloat16
    return torch.float16 if device.type == "cuda" else None


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Autocast context for ``dtype`` (no-op when ``dtype`` is None)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(device: torch.device, dtype: torch.dtype | None) -> torch.amp.GradScaler:
    """Loss scaler, enabled only for fp16 (bf16 has fp32's range and needs none)."""
    return torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)


def pin_memory(device: torch.device) -> bool:
    """Whether DataLoaders should pin host memory (only pays off for CUDA copies)."""
    return device.type == "cuda"


def to_device(batch: Any, device: torch.device) -> Any:
    """Move a tensor or a (nested) dict/list/tuple of tensors; asynchronous from pinned memory."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels (for honest timings)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
