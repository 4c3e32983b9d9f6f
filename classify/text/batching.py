"""Length-bucketed batching: batches of similar-length reviews carry little padding.

Each epoch the sampler shuffles all examples (seeded by ``seed + epoch``), cuts the
permutation into large pools, sorts each pool by length, cuts it into batches (by
example count or by a token budget), and shuffles the batches. Under
DistributedDataParallel each rank takes every ``world_size``-th batch; the batch list
is first made a multiple of ``world_size * grad_accum`` by splitting the largest
batches, so every example is seen exactly once per epoch and every rank runs the same
number of optimizer steps of ``grad_accum`` micro-batches each. Optimizer step ``s``
consumes the global batches ``[s * k, (s + 1) * k)`` with ``k = world_size * grad_accum``,
so the batch list, and what each step trains on, depends on ``k`` alone: 2 ranks
without accumulation and 1 process accumulating 2 micro-batches train on the same data.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch


class BucketBatchSampler(torch.utils.data.Sampler[list[int]]):
    def __init__(self, lengths: Sequence[int], batch_size: int = 32, max_tokens: int | None = None,
                 shuffle: bool = True, seed: int = 0, pool_batches: int = 50, rank: int = 0, world_size: int = 1,
                 grad_accum: int = 1):
        if len(lengths) == 0:
            raise ValueError("cannot batch an empty dataset")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.shuffle = shuffle
        self.seed = seed
        self.pool_size = batch_size * pool_batches
        self.rank = rank
        self.world_size = world_size
        self.grad_accum = grad_accum
        self.epoch = 0
        self.skip = np.zeros(0, dtype=np.int64)

    def set_epoch(self, epoch: int, skip: Sequence[int] = ()) -> None:
        """Serve epoch ``epoch``, leaving out the examples in ``skip`` (already trained on in this
        epoch before a resume that changed the batch layout)."""
        self.epoch = epoch
        self.skip = np.asarray(skip, dtype=np.int64)

    def _cut(self, order: np.ndarray) -> list[list[int]]:
        """Indices already sorted by length -> batches by count, or by padded-token budget."""
        if self.max_tokens is None:
            return [order[i : i + self.batch_size].tolist() for i in range(0, len(order), self.batch_size)]
        batches, current, longest = [], [], 0
        for index in order.tolist():
            longest_if_added = max(longest, int(self.lengths[index]))
            if current and longest_if_added * (len(current) + 1) > self.max_tokens:
                batches.append(current)
                current, longest_if_added = [], int(self.lengths[index])
            current.append(index)
            longest = longest_if_added
        if current:
            batches.append(current)
        return batches

    def batches(self) -> list[list[int]]:
        """All batches of this epoch (all ranks), in the order they will be served."""
        n = len(self.lengths)
        if self.shuffle:
            rng = np.random.default_rng(self.seed + self.epoch)
            order = rng.permutation(n)
        else:
            rng, order = None, np.arange(n)
        if len(self.skip):
            order = order[~np.isin(order, self.skip)]
        batches: list[list[int]] = []
        for start in range(0, len(order), self.pool_size):
            pool = order[start : start + self.pool_size]
            pool = pool[np.argsort(self.lengths[pool], kind="stable")]
            batches.extend(self._cut(pool))
        while len(batches) % (self.world_size * self.grad_accum):
            largest = max(range(len(batches)), key=lambda i: len(batches[i]))
            if len(batches[largest]) < 2:
                raise ValueError(f"{len(order)} examples cannot fill {self.world_size} ranks x "
                                 f"{self.grad_accum} micro-batches")
            batch = batches.pop(largest)
            batches[largest:largest] = [batch[: len(batch) // 2], batch[len(batch) // 2 :]]
        if rng is not None:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.batches()[self.rank :: self.world_size]

    def __len__(self) -> int:
        return len(self.batches()) // self.world_size


PAD_MULTIPLE = 8   # pad_multiple's answer for fp32 and on GPUs


def pad_multiple(device: torch.device, dtype: torch.dtype | None) -> int:
    """The multiple of positions that batches for a model run on ``device`` under autocast to ``dtype`` (None:
    fp32) are padded to (``pad_batch``'s ``multiple``).

    32 under bf16 or fp16 on a CPU: oneDNN builds and caches a kernel per input shape there (ideep's and oneDNN's
    primitive caches, up to 1,024 each). Padded to their longest text, batches came in ~500 lengths and the caches
    filled; in 16 lengths they stay small and hit: the README command peaked at 4.40 GB before and 2.47 GB after,
    and trained faster (experiments/RESULTS.md, "Peak memory"). 8 elsewhere: fp32 matrix products keep no cache per
    shape, and on a CPU the recipe's training batches run 1.08x the real tokens per second padded to 8 as to
    32 (6% of positions padding instead of 16%; padded to 1, not surely faster than 8, for four times the shapes:
    ``experiments.padding``, forty-eighth session). GPUs' matrix units work in multiples of 8 as well."""
    return 32 if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) else PAD_MULTIPLE


def padded_length(longest: int, max_len: int, multiple: int = PAD_MULTIPLE) -> int:
    """The length a batch whose longest text has ``longest`` tokens is padded to: rounded up to a multiple of
    ``multiple`` (``pad_multiple``), but not past ``max_len``."""
    return max(longest, min(max_len, -(-longest // multiple) * multiple))


def pad_batch(sequences: Sequence[Sequence[int]], pad_id: int = 0, length: int | None = None,
              max_len: int | None = None, multiple: int = PAD_MULTIPLE) -> torch.Tensor:
    """Right-pad id lists to one length -> LongTensor (B, T): a fixed ``length``; else the longest list's, rounded
    up as ``padded_length`` says when ``max_len`` is given."""
    longest = max(1, max(len(s) for s in sequences))
    if length is None and max_len is not None:
        length = padded_length(longest, max_len, multiple)
    longest = length or longest
    out = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    for i, seq in enumerate(sequences):
        out[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
    return out


class Collate:
    """Indices of examples -> a batch: ``{"tokens": (B, T) padded}``, plus ``"labels"`` when the examples
    have them: (B,) class ids, or (B, C) target distributions when ``labels`` is an (N, C) float array. Padded as
    ``pad_batch`` pads (``pad_to``: a fixed length; ``max_len``: the model's, for rounding up to ``multiple``).
    A class, not a closure, so DataLoader workers can pickle it.

    ``partner``: for paired examples, example i's partner (the index of another example, which the sampler does not
    serve itself: it comes with i), or -1. The partners of a batch's examples follow its own rows, and
    ``"pairs"`` (P, 2) holds each pair's two rows in the batch (example, partner), and ``"pair_weights"`` (P,) the
    served examples' ``partner_weight`` (1 without one)."""

    def __init__(self, ids: Sequence[Sequence[int]], labels: Sequence[int] | np.ndarray | None = None,
                 pad_id: int = 0, pad_to: int | None = None, max_len: int | None = None,
                 partner: np.ndarray | None = None, partner_weight: np.ndarray | None = None,
                 multiple: int = PAD_MULTIPLE):
        self.ids, self.labels, self.pad_id, self.pad_to, self.max_len = ids, labels, pad_id, pad_to, max_len
        self.partner, self.partner_weight, self.multiple = partner, partner_weight, multiple

    def __call__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        paired = {}
        if self.partner is not None:
            rows = [row for row, i in enumerate(indices) if self.partner[i] >= 0]
            served = [indices[row] for row in rows]
            paired = {"pairs": torch.tensor([(row, len(indices) + k) for k, row in enumerate(rows)],
                                            dtype=torch.long).reshape(-1, 2),
                      "pair_weights": torch.tensor([1.0 if self.partner_weight is None else
                                                    float(self.partner_weight[i]) for i in served],
                                                   dtype=torch.float32)}
            indices = list(indices) + [int(self.partner[i]) for i in served]
        batch = {"tokens": pad_batch([self.ids[i] for i in indices], self.pad_id, self.pad_to, self.max_len,
                                       self.multiple), **paired}
        if isinstance(self.labels, np.ndarray) and self.labels.ndim == 2:
            batch["labels"] = torch.from_numpy(self.labels[indices])
        elif self.labels is not None:
            batch["labels"] = torch.tensor([self.labels[i] for i in indices], dtype=torch.long)
        return batch
