"""Measurement helpers shared by the benchmarks: interleaved timing, peak memory, machine facts, peak FLOP/s.

The machine these benchmarks were written on is a shared 2-core VM, so every comparison is
*interleaved*: the contenders take turns (A B, then B A, ...) on the same inputs, and a
ratio is the median over rounds of the per-round ratio. Load that comes and goes then
slows both sides of a round alike instead of whichever happened to run during it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from classify.engine.device import bf16_supported, synchronize

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- timing
@dataclass
class Sample:
    """One timed call: wall seconds and the work it did (tokens, reviews, ...)."""

    seconds: float
    work: float

    @property
    def rate(self) -> float:
        return self.work / self.seconds


def time_call(fn: Callable[[], float], device: torch.device) -> Sample:
    """Time ``fn`` (which returns its amount of work), waiting for queued device kernels on both sides."""
    synchronize(device)
    start = time.perf_counter()
    work = fn()
    synchronize(device)
    return Sample(time.perf_counter() - start, float(work))


def interleave(arms: dict[str, Callable[[], float]], repeats: int, device: torch.device,
               warmup: int = 1) -> dict[str, list[Sample]]:
    """Run each arm ``warmup`` times untimed, then ``repeats`` timed rounds.

    Round r runs the arms in the given order when r is even and reversed when odd (ABBA):
    a load that ramps up or down during the benchmark then costs every arm the same on
    average. Returns the timed samples per arm, round by round.
    """
    names = list(arms)
    for _ in range(warmup):
        for name in names:
            arms[name]()
    samples: dict[str, list[Sample]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            samples[name].append(time_call(arms[name], device))
    return samples


def summarize(samples: dict[str, list[Sample]]) -> dict[str, dict[str, Any]]:
    """Per arm: median rate over rounds (with min and max), median seconds per call, work per call."""
    return {name: {"rate_median": statistics.median(s.rate for s in runs), "rate_min": min(s.rate for s in runs),
                   "rate_max": max(s.rate for s in runs), "seconds_median": statistics.median(s.seconds for s in runs),
                   "work_per_call": runs[0].work, "rounds": len(runs)}
            for name, runs in samples.items()}


def paired_ratio(a: list[Sample], b: list[Sample]) -> float:
    """rate(a) / rate(b) as the median of the per-round ratios: paired, so drift between rounds cancels."""
    return statistics.median(x.rate / y.rate for x, y in zip(a, b))


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (``q`` in 0..100) of a non-empty list."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


# --------------------------------------------------------------------------- memory
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6") if platform.system() == "Linux" else None


def _proc_status_bytes(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE).group(1)) * 1024


class PeakMemory:
    """Peak memory a ``with`` block adds on top of what was live when it started.

    CUDA: ``torch.cuda.max_memory_allocated`` (tensor bytes, exact). CPU (Linux): the process's
    peak resident set size (VmHWM) minus its RSS at entry. Two steps make that a fair measure
    of what the block needs: ``malloc_trim(0)`` first hands memory freed by earlier work back
    to the OS (else the block could reuse it without raising RSS), then writing ``5`` to
    ``/proc/self/clear_refs`` resets VmHWM to the current RSS. ``bytes`` is None where neither
    works (other systems, or /proc not writable).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.bytes: int | None = None
        self._start = 0

    @staticmethod
    def method(device: torch.device) -> str:
        if device.type == "cuda":
            return "torch.cuda.max_memory_allocated minus allocated at start"
        return "peak RSS (VmHWM, reset via /proc/self/clear_refs after malloc_trim) minus RSS at start"

    def __enter__(self) -> "PeakMemory":
        synchronize(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        elif _LIBC is not None:
            _LIBC.malloc_trim(0)
            try:
                Path("/proc/self/clear_refs").write_text("5")
                self._start = _proc_status_bytes("VmRSS")
            except OSError:
                self._start = -1
        else:
            self._start = -1
        return self

    def __exit__(self, *exc: object) -> None:
        synchronize(self.device)
        if self.device.type == "cuda":
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._start
        elif self._start >= 0:
            self.bytes = _proc_status_bytes("VmHWM") - self._start


# -------------------------------------------------------------------------- machine
def cpu_model() -> str:
    """The CPU's marketing name (from /proc/cpuinfo on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The SIMD features that decide matmul speed here (AVX-512, its bf16 extension, AMX)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = set(re.search(r"^flags\s*:(.*)$", text, re.MULTILINE).group(1).split()) if "flags" in text else set()
    return sorted(f for f in flags if f.startswith(("avx512f", "avx512_bf16", "amx", "avx2")))


def git_commit() -> str | None:
    """Short commit of the checkout the benchmark ran from, with ``+dirty`` for uncommitted changes."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+dirty" if dirty else "")


def machine_info(device: torch.device) -> dict[str, Any]:
    """Everything needed to judge whether two benchmark results are comparable."""
    info: dict[str, Any] = {
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "device": str(device),
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "cpu_flags": cpu_flags(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "tokenizer_threads": os.environ.get("RAYON_NUM_THREADS", "all cores"),
        "bf16_supported": bf16_supported(device),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": git_commit(),
        "loadavg_at_start": load_average(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def load_average() -> list[float] | None:
    """1/5/15-minute load averages: how busy the shared machine was (None where unavailable)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ---------------------------------------------------------------------- peak FLOP/s
def matmul_probe(device: torch.device, dtype: torch.dtype, size: int = 2048) -> Callable[[], float]:
    """A call that multiplies two square ``size`` matrices in ``dtype`` and returns its FLOPs (2 n^3),
    warmed up once. Timed next to a workload, its rate is the peak that workload could have had
    under the same momentary load."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    flops = 2.0 * size**3

    def matmul() -> float:
        torch.mm(a, b)
        return flops

    matmul()  # first call: library initialisation and kernel selection
    return matmul


def peak_matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> dict[str, float]:
    """FLOP/s of square ``size`` matmuls in ``dtype``: the best of ``repeats`` (the machine's ceiling)
    and the median (what it gave under the load of the moment)."""
    matmul = matmul_probe(device, dtype, size)
    rates = [time_call(matmul, device).rate for _ in range(repeats)]
    return {"size": size, "peak_flops": max(rates), "median_flops": statistics.median(rates)}
