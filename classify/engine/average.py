"""The mean of a model's weights over the last part of training (stochastic weight averaging).

Izmailov et al. 2018, "Averaging Weights Leads to Wider Optima and Better Generalization": the equal-weight mean
of the weights after every optimizer step from some point on, under the run's own learning-rate schedule. ``fit``
keeps one when ``--average-from`` is set, validates and saves the mean instead of the last weights, and keeps it
in ``last/`` so a resumed run averages exactly what an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..errors import ClassifyError


class WeightAverage:
    """The running mean of ``model``'s trainable floating-point parameters, one term per ``update()``.

    Frozen parameters (a fitted n-gram table) and buffers are left as they are: they do not change while training.
    The mean is kept in float32 whatever the parameters' dtype, so many small terms do not round away.
    """

    def __init__(self, model: nn.Module):
        self.params = {name: p for name, p in model.named_parameters()
                       if p.requires_grad and p.is_floating_point()}
        self.mean: dict[str, torch.Tensor] = {}   # by parameter name, empty before the first term: what last/ keeps
        self.count = 0

    @torch.no_grad()
    def update(self) -> None:
        """Add the current weights as one more term of the mean."""
        self.count += 1
        if self.count == 1:
            self.mean = {name: p.detach().float().clone() for name, p in self.params.items()}
            return
        for name, p in self.params.items():
            self.mean[name].lerp_(p.detach().float(), 1.0 / self.count)  # mean += (p - mean) / count

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Within the block the model holds the mean (if any terms were added); the trained weights come back after."""
        if not self.count:
            yield
            return
        trained = {name: p.detach().clone() for name, p in self.params.items()}
        self._copy_into_params(self.mean)
        try:
            yield
        finally:
            self._copy_into_params(trained)

    @torch.no_grad()
    def _copy_into_params(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, p in self.params.items():
            p.copy_(tensors[name])

    def load(self, tensors: dict[str, torch.Tensor], count: int) -> None:
        """Continue the mean ``tensors`` of ``count`` terms (``mean`` as saved, e.g. of a resumed run)."""
        if count and tensors.keys() != self.params.keys():
            differ = sorted(self.params.keys() ^ tensors.keys())[:3]
            raise ClassifyError(f"the weight average in last/ does not fit the model (e.g. {', '.join(differ)}): "
                                f"start afresh with --overwrite")
        self.mean = {name: t.float().to(self.params[name].device) for name, t in tensors.items()} if count else {}
        self.count = count
