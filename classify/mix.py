"""How the classifier's two branches are mixed: weights that depend on the text's length, fitted on held-out texts.

One fixed pair of weights, chosen on IMDB's ~230-word validation reviews, gave the n-gram branch three quarters
of the vote on a one-sentence text too, where few n-grams fire and the ones that do are often the wrong ones.
Here each branch's weight is linear in ``mix_features`` (1 and the log of the length), and ``fit_mix`` chooses
the four numbers on validation texts of many lengths: whole reviews and short windows cut from them
(``text.windows``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor


def mix_features(lengths: Tensor) -> Tensor:
    """lengths (B,) in tokens -> what the mix weights are linear in, (B, 2): 1 and log(length)."""
    return torch.stack([torch.ones(lengths.shape, dtype=torch.float32, device=lengths.device),
                        lengths.clamp(min=1).float().log()], dim=-1)


def fit_mix(transformer: np.ndarray, ngram: np.ndarray, lengths: np.ndarray, labels: list[int] | np.ndarray,
            l2: float = 1e-3, features_of: Callable[[Tensor], Tensor] = mix_features,
            weights: np.ndarray | None = None) -> np.ndarray:
    """The mix (2 branches, F features) that minimises the cross-entropy of
    ``(features @ mix[0]) * transformer + (features @ mix[1]) * ngram`` on held-out texts (each text counting
    ``weights[i]``, (N,), when given; alike otherwise), plus a small ``l2`` on the length terms (they stay near zero
    when the texts' lengths say nothing). ``features_of``: lengths (N,) -> (N, F), the first column 1
    (``mix_features``; experiments try others).

    transformer, ngram: (N, C) logits; lengths: (N,) tokens; N >= 1. Returns float64 (2, F)."""
    logits = torch.stack([torch.as_tensor(transformer), torch.as_tensor(ngram)]).double()      # (2, N, C)
    features = features_of(torch.as_tensor(np.asarray(lengths))).double()                       # (N, F)
    y = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    w = torch.ones(len(y), dtype=torch.float64) if weights is None else torch.as_tensor(weights, dtype=torch.float64)
    w = w / w.sum()
    mix = torch.zeros(2, features.shape[1], dtype=torch.float64)
    mix[:, 0] = 1.0
    mix.requires_grad_(True)
    solver = torch.optim.LBFGS([mix], lr=1.0, max_iter=500, line_search_fn="strong_wolfe")

    def loss() -> Tensor:
        solver.zero_grad()
        branch_weights = features @ mix.T                                                        # (N, 2)
        text_losses = F.cross_entropy(torch.einsum("nk,knc->nc", branch_weights, logits), y, reduction="none")
        value = (w * text_losses).sum() + l2 * mix[:, 1:].square().sum()
        value.backward()
        return value

    solver.step(loss)
    return mix.detach().numpy()


def mixed_logits(mix: np.ndarray, transformer: np.ndarray, ngram: np.ndarray, lengths: np.ndarray,
                 features_of: Callable[[Tensor], Tensor] = mix_features) -> np.ndarray:
    """What ``Classifier`` computes from its branches' logits, in NumPy: (N, C)."""
    weights = features_of(torch.as_tensor(np.asarray(lengths))).double().numpy() @ np.asarray(mix).T   # (N, 2)
    return weights[:, :1] * transformer + weights[:, 1:] * ngram
