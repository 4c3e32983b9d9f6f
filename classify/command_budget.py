"""``classify.train --finish-within``: a whole training command held to a wall-clock limit.

The time outside the transformer's training (tokenizing, the n-gram fits, the last validation, choosing the mix,
the test evaluation) is 6-10 minutes of the README command, and it depends on the CPU more than training does:
on a CPU without bf16 the test evaluation alone took 3.2 minutes (experiments/RESULTS.md, forty-third section).
A fixed ``--time-budget`` therefore cannot keep the command within a limit on every machine. ``--finish-within``
does: when the transformer is about to train, its budget becomes what the limit leaves, less an estimate of the
evaluations still to come, made from a forward pass timed on this machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .errors import ClassifyError

# The estimate is multiplied by this before it is set aside: in the first four runs of the README command with it
# (forty-fourth session, one CPU) the evaluations took 0.96, 1.00, 1.04 and 1.09 times the estimate (the test
# evaluation took 202, 218, 224 and 235 s, though the timed forward pass did not slow); in the next four, on the
# same CPU class, 0.90-1.13 times.
MARGIN = 1.2
# Training stops at its budget and validates once more (``engine.loop.fit``); the mix is fitted on that pass's
# logits (``train.ClassificationTask.best_logits``): one pass after the budget is spent. (Where an earlier
# validation scored best, as --eval-every can make happen, the mix takes a second pass, not counted here.)
VALIDATION_PASSES_AFTER = 1


@dataclass
class AfterTraining:
    """What is left once the transformer's budget is spent, and how fast this machine does it."""

    validation_tokens: int        # tokens of everything validated on (reviews, closing sentences, rule-made texts)
    test_tokens: float            # tokens the test evaluation will run (estimated before tokenizing the test split)
    tokens_per_s: float           # the model's forward pass here (both branches, evaluation batches)
    tokenize_s: float             # tokenizing the test split

    @property
    def seconds(self) -> float:
        tokens = VALIDATION_PASSES_AFTER * self.validation_tokens + self.test_tokens
        return tokens / self.tokens_per_s + self.tokenize_s

    def describe(self) -> str:
        return (f"the evaluations after training need about {self.seconds / 60:.1f} min "
                f"({self.tokens_per_s:,.0f} tokens/s forward here)")


def forward_rate(forward: Callable[[np.ndarray], object], batches: list[np.ndarray]) -> float:
    """Positions per second of ``forward`` (padded token ids (B, T) -> anything) over ``batches``, timed after a
    first call on the first batch (which pays the kernels' one-time setup: timed with it, the rate came out 30%
    low). Counted in padded positions, as the model runs them: a few hundred texts batch with far more padding
    than the thousands of the evaluations, whose length buckets are tight."""
    forward(batches[0])
    t0 = time.monotonic()
    for tokens in batches:
        forward(tokens)
    return sum(t.size for t in batches) / max(time.monotonic() - t0, 1e-9)


def training_minutes(finish_within: float, elapsed_s: float, after: AfterTraining) -> float:
    """The transformer's --time-budget: of ``finish_within`` minutes, what ``elapsed_s`` (spent so far) and the
    evaluations ``after`` training (with the ``MARGIN``) leave. At least a minute, or a ClassifyError saying where
    the time goes."""
    left_s = finish_within * 60 - elapsed_s - MARGIN * after.seconds
    if left_s < 60:
        raise ClassifyError(f"--finish-within {finish_within:g} leaves no time to train: {elapsed_s / 60:.1f} min "
                            f"went to the data and the n-gram stage, and {after.describe()}, {MARGIN:g}x that set "
                            f"aside ({MARGIN * after.seconds / 60:.1f} min); allow more minutes, or "
                            f"give the training minutes with --time-budget instead")
    return left_s / 60
