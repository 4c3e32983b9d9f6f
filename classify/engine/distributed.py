"""Multi-process training under ``torchrun``: the only module that calls ``torch.distributed``.

    with process_group(device, timeout_minutes=10):   # no-op for a plain ``python -m ...`` run
        model = Classifier(...).to(device)
        ddp = wrap(model, device)                     # DistributedDataParallel, or ``model`` itself
        if is_main(): ...write files...
        loss_sum, count = all_sum([loss_sum, count])  # the same totals on every rank

torchrun describes the job in the environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT``); ``classify.engine.device.resolve_device`` already puts each
rank on its ``LOCAL_RANK`` GPU. Every helper here also works in a single process, where
it does the obvious local thing, so the training loop has one code path.

Rank 0 alone reads and writes the run folder: on several machines the other ranks may
not even see it. What they need from it (the resume decision, the tokenizer, restored
state) reaches them through ``on_main`` and ``share_optimizer_state``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import ClassifyError

T = TypeVar("T")


def rank() -> int:
    """This process's global rank (0 when not distributed)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """Number of processes training together (1 when not distributed)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    """Whether this process writes files, logs and progress bars (rank 0)."""
    return rank() == 0


@contextlib.contextmanager
def process_group(device: torch.device, timeout_minutes: float = 10.0) -> Iterator[None]:
    """Join the job torchrun started (NCCL on CUDA, gloo otherwise) and leave it on exit.

    Without torchrun (``WORLD_SIZE`` unset or 1) nothing happens. ``timeout_minutes`` bounds
    how long a rank waits for the others, at start-up and in every collective, so a rank
    that hangs or never arrives ends the job with an error instead of blocking it forever.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        yield
        return
    cuda = device.type == "cuda"
    try:
        # device_id binds NCCL to this rank's GPU up front (and makes start-up errors surface here).
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=timeout_minutes),
                                device_id=device if cuda else None)
    except (RuntimeError, ValueError) as err:  # the store was unreachable or timed out, bad env, ...
        raise ClassifyError(f"could not join the distributed job (rank {os.environ.get('RANK')} of "
                            f"{os.environ.get('WORLD_SIZE')}): {err}") from None
    try:
        yield
    finally:
        dist.destroy_process_group()


def wrap(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` in DistributedDataParallel when distributed, else ``model`` itself.

    Wrapping copies rank 0's weights to every rank, so a checkpoint restored (or a model
    initialised) on rank 0 only is everyone's starting point. Buffers are synced then but not
    on each forward: the models' buffers (sinusoidal tables, the n-gram branch's scales and mix)
    do not change during training, and the 4 M-slot scales would cost 16 MB per step.
    """
    if world_size() == 1:
        return model
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                   forward_sync_buffers=False)


def micro_batch(model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """Context for one micro-batch's forward and backward with gradient accumulation: DDP's
    gradient all-reduce runs only in the ``last`` micro-batch of an optimizer step (``no_sync``
    for the others, whose gradients just add up locally). A no-op outside DDP."""
    if last or not isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()


def _collective_device() -> torch.device:
    """Where collective tensors must live: the current GPU for NCCL, the CPU for gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_sum(values: Sequence[float]) -> list[float]:
    """Element-wise sum of ``values`` over all ranks (one small all-reduce), returned on every rank.

    float64 keeps counts exact (up to 2**53) alongside the sums of losses.
    """
    if world_size() == 1:
        return [float(v) for v in values]
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(tensor)
    return tensor.tolist()


def from_main(value: float) -> float:
    """Rank 0's ``value`` on every rank (for quantities that differ between ranks, like clock readings,
    where every rank must act on the same number)."""
    if world_size() == 1:
        return value
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=_collective_device())
    dist.broadcast(tensor, src=0)
    return tensor.item()


def shard(items: Sequence[T]) -> list[T]:
    """This rank's share of ``items``: every world_size-th one, starting at its rank (balanced in length
    when the items are; all shards together are ``items`` exactly once)."""
    return list(items[rank() :: world_size()])


def broadcast_object(obj: T) -> T:
    """Rank 0's ``obj`` on every rank (pickled between our own processes; never read from disk)."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=_collective_device())
    return box[0]


def on_main(fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 only and return its result on every rank.

    A ClassifyError raised there is raised on every rank, so a bad ``--output`` stops the
    whole job with its one-line message instead of leaving the other ranks waiting. Any
    other exception is a bug: rank 0 raises it with its traceback, the others fail too.
    """
    if world_size() == 1:
        return fn()
    result, error = None, None
    if is_main():
        try:
            result = fn()
        except ClassifyError as err:
            error = str(err)
        except BaseException as err:
            broadcast_object((None, f"rank 0 failed: {type(err).__name__}: {err}"))
            raise
    result, error = broadcast_object((result, error))
    if error is not None:
        raise ClassifyError(error)
    return result


def share_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every rank rank 0's optimizer state (after rank 0 alone restored a checkpoint)."""
    if world_size() == 1:
        return
    state = None
    if is_main():
        state = optimizer.state_dict()
        # Tensors travel via the CPU; load_state_dict moves them onto each rank's own device.
        state["state"] = {pid: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()}
                          for pid, s in state["state"].items()}
    optimizer.load_state_dict(broadcast_object(state))
