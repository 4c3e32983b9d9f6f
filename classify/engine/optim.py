"""The optimizer, the learning-rate schedule and one optimizer step with mixed precision."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

SCHEDULES = ("cosine", "linear", "constant", "inverse_sqrt")
# Devices with a fused AdamW kernel in torch 2.13, the project's floor.
FUSED_DEVICES = ("cpu", "cuda", "mps")


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
    # The fused kernel: one pass over each parameter instead of foreach's dozen. On a CPU that matters most: with the
    # recipe's 3.8M-row embedding a step of AdamW took 14.8 ms foreach and 1.7 ms fused (2 threads), a quarter of a
    # training step on short texts (experiments/RESULTS.md, twenty-ninth session). The same updates, to float
    # rounding; the state (step, moments) loads either way, so runs resume across the change.
    fused = next(model.parameters()).device.type in FUSED_DEVICES
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused)


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


def budgeted_lr_multiplier(step: int, warmup: int, total: int, schedule: str, budget_used: float | None) -> float:
    """``lr_multiplier``, except that under a time budget (``budget_used``: the share of it spent, None
    without one) the decay after warmup advances with whichever runs out first, steps or time: a
    budgeted run ends with a decayed learning rate however fast the (shared) machine happens to be.
    The price: time enters the schedule, so such runs are not bit-reproducible across a resume."""
    if budget_used is not None and step >= warmup:
        by_time = warmup + budget_used * (total - warmup)
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
