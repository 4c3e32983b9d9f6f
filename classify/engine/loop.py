"""The one training loop: ``fit(task, config, run, ...)``, in the spirit of minGPT's small trainer.

A task (classifier training, MLM pretraining, the seq2seq example) says four things, and no
more (see ``Task``): its model, its training examples as lengths plus a ``collate`` that makes
a batch of them, the loss of one batch, and how to validate. ``fit`` owns the rest, the same
for every task: length-bucketed batches per epoch (``BucketBatchSampler``), resume from
``last/`` (mid-epoch, across a changed number of processes), the deadline and the schedule fitted
to it, Ctrl-C / SIGTERM, gradient accumulation, distributed sums under torchrun, validation,
patience, the best and last checkpoints, and the progress display.

Stopping has one rule: after each optimizer step every rank learns (in the step's one small
all-reduce) whether any rank was told to stop or ran out of time, and all stop after that step.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import signal
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from ..text.batching import BucketBatchSampler
from . import distributed
from .average import WeightAverage
from .config import runtime
from .device import autocast, grad_scaler, pin_memory, to_device, trim_heap_periodically
from .optim import budgeted_lr_multiplier, build_optimizer, optimizer_step, set_lr
from .progress import TrainingProgress
from .runfolder import LAST, RunFolder

Batch = dict[str, torch.Tensor]


class Task:
    """What a task gives ``fit``. Subclass it and set or define:

    ``model``                    the module trained, validated and saved (not wrapped in DDP)
    ``lengths``                  one length per training example: batches group similar lengths
    ``batch_size``, ``max_tokens``, ``pool_batches``   how examples become batches (``BucketBatchSampler``)
    ``collate(indices) -> Batch``  a batch of CPU tensors; a picklable object (DataLoader workers call it)
    ``loss(model, batch) -> (loss, sums)``  the batch's mean loss, and numbers to add up over
                                 micro-batches and ranks; ``sums["tokens"]`` counts its real tokens
    ``train_metrics(sums)``      what added-up ``sums`` mean, e.g. ``{"train_loss": ...}``
    ``validate(model)``          validation metrics, ``{"val_loss": ...}``: the same on every rank
    ``score(metrics)``           higher is better: picks model.safetensors and drives ``patience``
    ``keep_best()``              optional: the last ``validate`` found the best weights so far (saved as
                                 model.safetensors), so what it computed may be kept for after training
    ``lr_scale``                 optional parameter name -> learning-rate factor (layer-wise decay)
    """

    model: nn.Module
    lengths: list[int]
    collate: Callable[[list[int]], Batch]
    batch_size: int = 32
    max_tokens: int | None = None
    pool_batches: int = 50
    lr_scale: Callable[[str], float] | None = None

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def train_metrics(self, sums: dict[str, float]) -> dict[str, float | None]:
        raise NotImplementedError

    def validate(self, model: nn.Module) -> dict[str, float]:
        raise NotImplementedError

    def score(self, metrics: dict[str, float]) -> float:
        raise NotImplementedError

    def keep_best(self) -> None:
        pass


@dataclass
class FitResult:
    state: dict[str, Any]   # what last/state.json holds: step, epoch, best score, tokens, ...
    reason: str             # "finished", "time budget", "early stopping" or "interrupted"
    seconds: float          # training time, all sittings together

    @property
    def interrupted(self) -> bool:
        return self.reason == "interrupted"

    def print_summary(self, console: Console, title: str, run: RunFolder, rows: list[tuple[str, str]]) -> None:
        """The end-of-run table: how the run stopped and how long it trained, the task's ``rows``, the folder."""
        table = Table(title=f"{title}: {run.path}", show_header=False)
        state = self.state
        for name, value in [("stopped", self.reason), ("steps / epochs", f"{state['step']} / {state['epoch']}"),
                            ("tokens seen", f"{state['tokens'] / 1e6:.1f}M"),
                            ("training time", f"{self.seconds / 60:.1f} min"), *rows, ("run folder", str(run.path))]:
            table.add_row(name, value)
        console.print(table)


def run_trainer(kind: str, config, args: argparse.Namespace,
                train: Callable[[RunFolder, torch.device, torch.dtype | None, Console], int]) -> int:
    """What every trainer's ``main`` does around its ``train``: resolve the device, join torchrun's process
    group (a no-op without torchrun), hold the ``kind`` run folder ``args.output``, seed each rank (other
    dropout masks per rank; DDP gives all of them rank 0's weights) and log on rank 0 alone."""
    device, dtype = runtime(config)
    trim_heap_periodically()
    with distributed.process_group(device, args.dist_timeout), RunFolder(args.output, kind) as run:
        set_seed(config.seed + distributed.rank())
        console = Console(stderr=True, quiet=args.quiet or not distributed.is_main())
        return train(run, device, dtype, console)


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def fit(task: Task, config, run: RunFolder, device: torch.device, dtype: torch.dtype | None, *,
        resuming: bool, quiet: bool = False, validate_first: bool = False) -> FitResult:
    """Train ``task.model`` as ``config`` (a ``RunConfig``) says, writing into ``run`` (rank 0 only).

    ``resuming``: continue from ``run``'s last/. ``validate_first``: validate the untrained model
    too (the start of a validation curve). Under torchrun every rank calls it.
    """
    main, world, accum = distributed.is_main(), distributed.world_size(), config.grad_accum
    console = Console(stderr=True, quiet=quiet or not main)
    model = task.model
    optimizer = build_optimizer(model, config.lr, config.weight_decay, lr_scale=task.lr_scale)
    average = WeightAverage(model) if config.average_from is not None else None
    scaler = grad_scaler(device, dtype)
    sampler = BucketBatchSampler(task.lengths, batch_size=task.batch_size, max_tokens=task.max_tokens,
                                 seed=config.seed, rank=distributed.rank(), world_size=world, grad_accum=accum,
                                 pool_batches=task.pool_batches)
    # Under a token budget an epoch's batch count shifts a little with its shuffle: each epoch ends
    # with its own batch list, and the schedule spans their sum.
    total_steps = sum(epoch_batches(sampler, epoch) // (world * accum) for epoch in range(config.epochs))
    if config.max_steps:
        total_steps = min(total_steps, config.max_steps)

    # batch_in_epoch counts the epoch's global batches (all ranks) in ``layout``; see reshard_epoch.
    layout = {"batch_size": task.batch_size, "max_tokens": task.max_tokens, "batches_per_step": world * accum}
    state: dict[str, Any] = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "best": None, "evals_since_best": 0,
                             "train_seconds": 0.0, "tokens": 0, "layout": layout, "epoch_skip": [],
                             "since_eval": {"steps": 0, "sums": {}}}
    if resuming:
        # Rank 0 restores last/; the weights reach the other ranks when DDP wraps the model below.
        restored = distributed.on_main(lambda: run.restore(model, optimizer, average))
        if restored is not None:
            distributed.share_optimizer_state(optimizer)
            if average is not None and distributed.world_size() > 1:  # rank 0's mean on every rank: all validate it
                average.load(*distributed.broadcast_object(({k: v.cpu() for k, v in average.mean.items()},
                                                            average.count)))
            state.update({k: restored[k] for k in state if k in restored})
            reshard_epoch(state, layout, task.lengths, config.seed, task.pool_batches)
            console.log(f"resumed from {run.path / LAST} at step {state['step']} (epoch {state['epoch']})")
    ddp_model = distributed.wrap(model, device)  # trains; ``model`` (the same weights) validates and saves
    n_params = sum(p.numel() for p in model.parameters())
    console.log(f"model: {n_params / 1e6:.2f}M parameters, device {device}, threads {torch.get_num_threads()}, "
                f"autocast {dtype if dtype else 'off (fp32)'}, {world} process(es), {total_steps} steps")

    deadline = Deadline(config.time_budget, already_used_s=state["train_seconds"])
    # Training numbers since the last validation (all ranks); saved in last/ so that a resumed run logs
    # the same rows as an uninterrupted one.
    sums: dict[str, float] = defaultdict(float, state["since_eval"]["sums"])
    steps_since_eval, tokens_since, clock = state["since_eval"]["steps"], 0, time.monotonic()
    batches_this_epoch = 1
    reason: str | None = None

    def save_last() -> None:
        state["train_seconds"] = deadline.elapsed
        state["since_eval"] = {"steps": steps_since_eval, "sums": dict(sums)}
        if main:
            run.save_last(model, optimizer, state, average)

    def averaged() -> contextlib.AbstractContextManager:
        """Within the block the model holds the weight average, if the run keeps one: what is validated and kept."""
        return average.applied() if average is not None else contextlib.nullcontext()

    def validate() -> bool:
        """Validate, log, keep the best weights. Returns True when patience ran out."""
        nonlocal sums, steps_since_eval, tokens_since, clock
        started = time.monotonic()
        with averaged():   # one swap: the mean is validated and, if best, saved
            metrics = task.validate(model)
            epoch = state["epoch"] + state["batch_in_epoch"] / batches_this_epoch
            record = {"step": state["step"], "epoch": round(epoch, 3), **task.train_metrics(sums), **metrics,
                      "lr": optimizer.param_groups[0]["lr"], "elapsed_s": round(deadline.elapsed, 1),
                      "tokens": state["tokens"], "tokens_per_s": round(tokens_since / max(started - clock, 1e-9), 1),
                      "validation_s": round(time.monotonic() - started, 1),
                      **({"averaged_steps": average.count} if average is not None else {})}
            if main:
                run.log_metrics(record)
            shown = "  ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in record.items()
                              if k.startswith(("train_", "val_")) and v is not None)
            progress.log(f"step {record['step']}: {shown}  {record['tokens_per_s']:.0f} tok/s")
            improved, exhausted = record_evaluation(state, task.score(metrics), config.patience)
            if improved:
                task.keep_best()
                if main:   # after the record: a reader knows the weights are in once they are newer than it
                    run.save_best(model)
        model.train()
        sums, steps_since_eval, tokens_since, clock = defaultdict(float), 0, 0, time.monotonic()
        return exhausted

    model.train()
    step_sums: dict[str, float] = defaultdict(float)  # this rank's micro-batches of the current step
    with StopSignal() as stop, TrainingProgress(total_steps, enabled=not quiet and main) as progress:
        progress.update(state["step"], state["epoch"], {})
        if validate_first and state["step"] == 0 and state["best"] is None:
            validate()
        if distributed.all_sum([deadline.expired])[0]:
            reason = "time budget"  # resumed with the budget already spent
        while reason is None and state["step"] < total_steps and state["epoch"] < config.epochs:
            sampler.set_epoch(state["epoch"], state["epoch_skip"])
            batches = sampler.batches()
            batches_this_epoch = len(batches)
            first = state["batch_in_epoch"] // world  # resuming mid-epoch: the sampler replays the epoch's order
            mine = batches[distributed.rank() :: world][first:]
            for i, batch in enumerate(_collated(task, mine, config.num_workers, device), start=first):
                if i % accum == 0:  # a step's first micro-batch
                    used = deadline.used
                    if used is not None:  # time enters the schedule: all ranks go by rank 0's clock
                        used = distributed.from_main(used)
                    set_lr(optimizer, config.lr * budgeted_lr_multiplier(state["step"], config.warmup, total_steps,
                                                                         config.schedule, used))
                last = (i + 1) % accum == 0  # the step's last micro-batch: gradients are all-reduced, then step
                with distributed.micro_batch(ddp_model, last):
                    with autocast(device, dtype):
                        loss, batch_sums = task.loss(ddp_model, batch)
                    # Mean over micro-batches here, DDP's mean over ranks: a step's gradient is that of the mean
                    # loss of its ranks x accum batches, as if one process had trained on them all.
                    if last:
                        optimizer_step(loss / accum, model, optimizer, scaler, config.clip)
                    else:
                        scaler.scale(loss / accum).backward()
                for key, value in batch_sums.items():
                    step_sums[key] += value
                if not last:
                    continue
                # One small all-reduce per step: every rank gets the step's totals and learns whether any
                # rank was told to stop (Ctrl-C, SIGTERM, time budget), so all stop after the same step.
                *totals, interrupted, expired = distributed.all_sum([*step_sums.values(), stop.requested,
                                                                     deadline.expired])
                step_totals = dict(zip(step_sums, totals))
                step_sums.clear()
                for key, value in step_totals.items():
                    sums[key] += value
                step_tokens = int(step_totals["tokens"])
                tokens_since += step_tokens
                state["tokens"] += step_tokens
                state["step"] += 1
                state["batch_in_epoch"] = (i + 1) * world
                # The share of training done, as the schedule counts it: steps or time, whichever is further along.
                if average is not None and max(state["step"] / total_steps, used or 0.0) >= config.average_from:
                    average.update()
                steps_since_eval += 1
                if interrupted:
                    reason = "interrupted"
                elif expired:
                    reason = "time budget"
                shown = {k.removeprefix("train_"): v for k, v in task.train_metrics(sums).items() if v is not None}
                progress.update(state["step"], state["epoch"] + 1, {
                    **shown, "lr": optimizer.param_groups[0]["lr"],
                    "tok/s": tokens_since / max(time.monotonic() - clock, 1e-9)})
                epoch_done = state["batch_in_epoch"] >= batches_this_epoch
                due = state["step"] % config.eval_every == 0 if config.eval_every else epoch_done
                if (due or state["step"] == total_steps) and validate() and reason is None:
                    reason = "early stopping"
                if state["step"] % config.save_every == 0:
                    save_last()
                if state["step"] >= total_steps or reason is not None:
                    break
            if state["batch_in_epoch"] >= batches_this_epoch:
                state["epoch"] += 1
                state["batch_in_epoch"] = 0
                state["epoch_skip"] = []
        # (best is None: no validation yet, so no weights; the same answer on every rank, unlike a file check)
        if reason in (None, "time budget") and (steps_since_eval or state["best"] is None):
            validate()  # the final partial interval counts too (and a run always leaves weights)
        save_last()

    reason = reason or "finished"
    if reason == "interrupted":
        console.print(f"[yellow]interrupted at step {state['step']}; state saved in {run.path / LAST}. "
                      f"Re-run the same command to resume.[/]")
    return FitResult(state, reason, deadline.elapsed)


def _collated(task: Task, batches: list[list[int]], num_workers: int, device: torch.device) -> Iterator[Batch]:
    """The task's batches for these index lists, on ``device``; collated by worker processes when asked."""
    if num_workers == 0:
        for indices in batches:
            yield to_device(task.collate(indices), device)
        return
    # A private generator: creating an iterator otherwise draws from the global torch RNG, which would
    # make dropout after a mid-epoch resume differ from the uninterrupted run.
    loader = torch.utils.data.DataLoader(batches, batch_size=None, collate_fn=task.collate, num_workers=num_workers,
                                         pin_memory=pin_memory(device), generator=torch.Generator().manual_seed(0))
    for batch in loader:
        yield to_device(batch, device)


def epoch_batches(sampler: BucketBatchSampler, epoch: int) -> int:
    """The number of batches (all ranks) of ``epoch``."""
    sampler.set_epoch(epoch)
    return len(sampler.batches())


def reshard_epoch(state: dict[str, Any], layout: dict[str, Any], lengths: list[int], seed: int,
                  pool_batches: int = 50) -> None:
    """Carry a resumed epoch over to this run's batch layout.

    ``state["batch_in_epoch"]`` counts batches of the epoch's global batch list (all ranks),
    which depends on the batch size or token budget and on processes x grad-accum (``layout``).
    Unchanged layout: the epoch continues exactly where it stopped. Changed layout (e.g.
    another number of GPUs): the examples of the batches already trained on join
    ``epoch_skip``, and the epoch's remaining examples are batched anew; every example is
    still seen once per epoch.
    """
    old = state["layout"]
    if old != layout and state["batch_in_epoch"]:
        # The global list does not depend on the rank count, only on the batches per step.
        before = BucketBatchSampler(lengths, batch_size=old["batch_size"], max_tokens=old["max_tokens"], seed=seed,
                                    grad_accum=old["batches_per_step"], pool_batches=pool_batches)
        before.set_epoch(state["epoch"], state["epoch_skip"])
        seen = [i for batch in before.batches()[: state["batch_in_epoch"]] for i in batch]
        state["epoch_skip"] = sorted(state["epoch_skip"] + seen)
        state["batch_in_epoch"] = 0
    state["layout"] = layout


def record_evaluation(state: dict[str, Any], score: float, patience: int | None) -> tuple[bool, bool]:
    """Early-stopping bookkeeping in a run's resumable ``state``: is ``score`` (higher is better) a new
    best over ``state["best"]`` (None = no evaluation yet), and has ``patience`` now run out?
    Returns ``(improved, patience_exhausted)``."""
    improved = state["best"] is None or score > state["best"]
    if improved:
        state["best"], state["evals_since_best"] = score, 0
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

    @property
    def used(self) -> float | None:
        """The share of the budget spent (None without a budget)."""
        return self.elapsed / self.seconds if self.seconds else None
