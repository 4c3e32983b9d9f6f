"""Training machinery shared by every trainer (classifier, seq2seq): optimizer, schedule,
the optimizer step with mixed precision, stopping rules, seeding and the progress display."""

from __future__ import annotations

import math
import random
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch import nn

SCHEDULES = ("cosine", "linear", "constant", "inverse_sqrt")


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_optimizer(model: nn.Module, lr: float, weight_decay: float,
                    betas: tuple[float, float] = (0.9, 0.98),
                    lr_scale: Callable[[str], float] | None = None) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on weight matrices only.

    Norm gains, biases, token embeddings and learned positions are not decayed: shrinking
    them towards zero regularises nothing useful (and hurts rare-token embeddings).
    ``lr_scale(parameter name)`` (e.g. layer-wise decay when fine-tuning) splits the groups
    further by scale, stored as each group's ``lr_scale``, which ``set_lr`` applies.
    """
    decay, no_decay = [], []
    seen: dict[int, str] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen[id(param)] = name
        is_embedding = "embed" in name or name.endswith("positions")
        (no_decay if param.dim() < 2 or is_embedding else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if lr_scale is not None:
        scales = {pid: lr_scale(name) for pid, name in seen.items()}
        groups = [{"params": [p for p in g["params"] if scales[id(p)] == s], "weight_decay": g["weight_decay"],
                   "lr_scale": s}
                  for g in groups for s in sorted({scales[id(p)] for p in g["params"]}, reverse=True)]
    fused = {"fused": True} if next(model.parameters()).device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, **fused)


def lr_multiplier(step: int, warmup: int, total: int, schedule: str = "cosine", min_ratio: float = 0.0) -> float:
    """Learning-rate factor at optimizer step ``step`` (0-based): linear warmup, then decay.

    ``cosine``/``linear`` decay to ``min_ratio`` at ``total``; ``inverse_sqrt`` is the Noam
    schedule (peak at the end of warmup, then proportional to 1/sqrt(step)).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    if schedule == "inverse_sqrt":
        return math.sqrt(max(warmup, 1) / (step + 1))
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * shape


def budgeted_lr_multiplier(step: int, warmup: int, total: int, schedule: str, deadline: "Deadline") -> float:
    """``lr_multiplier``, except that under a time budget the decay after warmup advances with
    whichever runs out first, steps or time: a budgeted run ends with a decayed learning rate
    however fast the (shared) machine happens to be. The price: time enters the schedule, so such
    runs are not bit-reproducible across a resume."""
    if deadline.seconds and step >= warmup:
        by_time = warmup + deadline.elapsed / deadline.seconds * (total - warmup)
        step = max(step, min(int(by_time), total))
    return lr_multiplier(step, warmup, total, schedule)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def optimizer_step(loss: torch.Tensor, model: nn.Module, optimizer: torch.optim.Optimizer,
                   scaler: torch.amp.GradScaler, clip: float) -> float:
    """Backward, unscale, clip, step, zero. Returns the gradient norm before clipping."""
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


def record_evaluation(state: dict[str, Any], best_key: str, score: float, patience: int | None) -> tuple[bool, bool]:
    """Early-stopping bookkeeping in a run's resumable ``state``: is ``score`` (higher is better) a new
    best under ``state[best_key]`` (None = no evaluation yet), and has ``patience`` now run out?
    Returns ``(improved, patience_exhausted)``."""
    improved = state[best_key] is None or score > state[best_key]
    if improved:
        state[best_key], state["evals_since_best"] = score, 0
    else:
        state["evals_since_best"] += 1
    return improved, patience is not None and state["evals_since_best"] >= patience


class StopSignal:
    """Turns Ctrl-C / SIGTERM into a flag the loop checks between steps, so the run can
    save ``last/`` and exit cleanly instead of dying mid-write. A second Ctrl-C aborts."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "StopSignal":
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Deadline:
    """``--time-budget`` in minutes (None = unlimited), measured from construction."""

    def __init__(self, minutes: float | None, already_used_s: float = 0.0):
        self.start = time.monotonic() - already_used_s
        self.seconds = None if minutes is None else minutes * 60.0

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    @property
    def expired(self) -> bool:
        return self.seconds is not None and self.elapsed >= self.seconds


class TrainingProgress:
    """A rich progress bar on a terminal; on a pipe (CI logs) a plain line every ``log_every`` steps."""

    def __init__(self, total_steps: int, enabled: bool = True, log_every: int = 50, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.enabled = enabled
        self.interactive = enabled and self.console.is_terminal
        self.log_every = log_every
        self.total = total_steps
        self._progress: Progress | None = None
        if self.interactive:
            self._progress = Progress(
                TextColumn("[bold]epoch {task.fields[epoch]}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                console=self.console, transient=False,
            )
            self._task = self._progress.add_task("train", total=total_steps, epoch=0, stats="")

    def __enter__(self) -> "TrainingProgress":
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def update(self, step: int, epoch: int, stats: dict[str, float]) -> None:
        text = "  ".join(f"{k} {v:.4g}" for k, v in stats.items())
        if self._progress is not None:
            self._progress.update(self._task, completed=step, epoch=epoch, stats=text)
        elif self.enabled and step % self.log_every == 0:
            print(f"step {step}/{self.total} epoch {epoch}  {text}", file=sys.stderr, flush=True)

    def log(self, message: str) -> None:
        if self.enabled:
            self.console.print(message) if self.interactive else print(message, file=sys.stderr, flush=True)
