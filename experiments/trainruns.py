"""Running ``python -m classify.train`` from an experiment script and reading back its run folder.

The experiments drive the real command line (not the Python API) so that what they record is
exactly what a user's command would do; these helpers are the one place that knows how.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from classify.engine.device import bf16_supported
from classify.engine.files import write_json, write_text


def train_command(output: Path, flags: list[str], module: str = "classify.train") -> list[str]:
    """argv of a ``python -m module`` run (``classify.train`` or ``classify.pretrain``) into ``output``."""
    return [sys.executable, "-m", module, "--output", str(output), *flags]


def shown(command: list[str]) -> str:
    """A command as a user would type it (``python -m ...``)."""
    return " ".join(["python", *command[1:]])


def log_path(output: Path) -> Path:
    """Where the output of the run in ``output`` goes: beside it, ``<name>.log`` (dots in the name kept)."""
    return output.parent / f"{output.name}.log"


@dataclass
class Training:
    """A training process started by ``start_training``."""

    name: str
    output: Path
    process: subprocess.Popen
    started: float

    def wait(self) -> float:
        """Wait for the run to end; its wall seconds, or exit with the tail of its log if it failed."""
        if self.process.wait() != 0:
            log = log_path(self.output)
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            raise SystemExit(f"{self.name} failed (exit {self.process.returncode}); end of {log}:\n{tail}")
        return round(time.monotonic() - self.started, 1)


def start_training(name: str, output: Path, flags: list[str], threads: int,
                   module: str = "classify.train") -> Training:
    """Start ``python -m module`` into ``output`` limited to ``threads`` CPU threads, logging to ``log_path``."""
    output.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "RAYON_NUM_THREADS": str(threads)}
    with open(log_path(output), "w") as log:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(train_command(output, flags, module), env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
    return Training(name, output, process, time.monotonic())


def wait_all(group: list[Training]) -> list[float]:
    """Wait for every run of ``group``; their wall seconds. If one fails, stop the others, then exit."""
    try:
        return [training.wait() for training in group]
    except SystemExit:
        for training in group:
            if training.process.poll() is None:
                training.process.terminate()
                training.process.wait()
        raise


def run_training(name: str, output: Path, flags: list[str], threads: int) -> float:
    """One run in the foreground; its wall seconds."""
    return start_training(name, output, flags, threads).wait()


def evaluations(run: Path) -> list[dict]:
    """The run's validation records (``metrics.jsonl``), oldest first; [] before the first one."""
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_metrics(run: Path) -> dict | None:
    """The run's one test-split evaluation, or None when it has none (not finished, or ``--no-test``)."""
    path = run / "test_metrics.json"
    return json.loads(path.read_text()) if path.exists() else None


def experiment_meta(prog: str, argv: list[str]) -> dict:
    """What every experiment records about its own run: command, date, machine (and whether its CPU
    has bf16, which ``--precision auto`` follows) and its load."""
    return {"command": f"python -m {prog} {shlex.join(argv)}".rstrip(),   # quoted: it can be pasted back
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "bf16": bf16_supported(torch.device("cpu")),
            "load_average_at_end": os.getloadavg()}


def write_results(folder: Path, name: str, record: dict, report: str) -> None:
    """``folder/{name}.json`` and ``.md`` (each written atomically), and the report on stdout."""
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / f"{name}.json", record)
    write_text(folder / f"{name}.md", report)
    print(report)
