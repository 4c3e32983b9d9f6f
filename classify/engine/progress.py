"""Progress displays: a training's bar (or plain log lines on a pipe), and the inference bar of
``predict`` and ``evaluate``."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)


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


@contextmanager
def progress_bar(total: float | None, enabled: bool) -> Iterator[Callable[[float, str], None]]:
    """A transient progress bar on stderr when it is a terminal (silent otherwise, e.g. in CI logs);
    yields ``update(completed, info)``. stdout is left alone so results can be piped meanwhile."""
    console = Console(stderr=True)
    if not (enabled and console.is_terminal):
        yield lambda completed, info: None
        return
    with Progress(BarColumn(), TaskProgressColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                  TextColumn("eta"), TimeRemainingColumn(), console=console, transient=True,
                  redirect_stdout=False, redirect_stderr=False) as progress:
        task = progress.add_task("", total=total, info="")
        yield lambda completed, info: progress.update(task, completed=completed, info=info)
