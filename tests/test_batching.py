"""Length bucketing: coverage, padding waste, token budgets, distributed shards."""

import numpy as np
import pytest
import torch

from classify.text.batching import PAD_MULTIPLE, BucketBatchSampler, Collate, pad_batch, pad_multiple

LENGTHS = np.random.default_rng(0).integers(10, 500, size=1000).tolist()


def padding_fraction(batches, lengths) -> float:
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    return 1 - sum(lengths) / padded


def test_every_example_exactly_once_per_epoch_and_reshuffled():
    sampler = BucketBatchSampler(LENGTHS, batch_size=32, seed=0)
    first = list(sampler)
    assert sorted(i for b in first for i in b) == list(range(len(LENGTHS)))
    sampler.set_epoch(1)
    second = list(sampler)
    assert sorted(i for b in second for i in b) == list(range(len(LENGTHS)))
    assert first != second
    sampler.set_epoch(0)
    assert list(sampler) == first  # deterministic per (seed, epoch): resume replays the epoch


def test_padding_far_below_random_batching():
    bucketed = list(BucketBatchSampler(LENGTHS, batch_size=32, seed=0))
    order = np.random.default_rng(0).permutation(len(LENGTHS)).tolist()
    random_batches = [order[i : i + 32] for i in range(0, len(order), 32)]
    assert padding_fraction(bucketed, LENGTHS) < 0.05
    assert padding_fraction(random_batches, LENGTHS) > 0.3


def test_token_budget():
    sampler = BucketBatchSampler(LENGTHS, max_tokens=2000, seed=0)
    batches = list(sampler)
    assert all(max(LENGTHS[i] for i in b) * len(b) <= 2000 for b in batches)
    assert sorted(i for b in batches for i in b) == list(range(len(LENGTHS)))


@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_shards_cover_once_with_equal_steps(world_size):
    lengths = LENGTHS[:997]
    shards = [list(BucketBatchSampler(lengths, batch_size=32, seed=0, rank=r, world_size=world_size))
              for r in range(world_size)]
    assert len({len(s) for s in shards}) == 1
    assert sorted(i for s in shards for b in s for i in b) == list(range(len(lengths)))


def test_pad_batch():
    out = pad_batch([[5, 6, 7], [8]], pad_id=0)
    assert out.tolist() == [[5, 6, 7], [8, 0, 0]]


def test_pad_multiple_is_32_only_where_onednn_caches_a_kernel_per_shape():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert pad_multiple(cpu, torch.bfloat16) == pad_multiple(cpu, torch.float16) == 32
    assert pad_multiple(cpu, None) == pad_multiple(cuda, torch.bfloat16) == pad_multiple(cuda, None) == 8
    batch = Collate([[1] * 3, [2] * 9], [0, 1], max_len=512, multiple=32)([0, 1])
    assert batch["tokens"].shape == (2, 32)


def test_pad_batch_to_fixed_length():
    assert pad_batch([[5, 6], [7]], pad_id=0, length=4).tolist() == [[5, 6, 0, 0], [7, 0, 0, 0]]


def test_pad_batch_rounds_up_to_a_multiple_within_max_len():
    assert PAD_MULTIPLE == 8
    assert pad_batch([[5] * 3, [7]], pad_id=0, max_len=512).shape == (2, 8)
    assert pad_batch([[5] * 33], pad_id=0, max_len=512).shape == (1, 40)
    assert pad_batch([[5] * 3, [7]], pad_id=0, max_len=512, multiple=32).shape == (2, 32)
    assert pad_batch([[5] * 33], pad_id=0, max_len=512, multiple=32).shape == (1, 64)
    assert pad_batch([[5] * 64], pad_id=0, max_len=512, multiple=32).shape == (1, 64)     # already a multiple
    assert pad_batch([[5] * 99], pad_id=0, max_len=100).shape == (1, 100)    # never past the model's max_len
    assert pad_batch([[5] * 3], pad_id=0, max_len=512, length=5).shape == (1, 5)   # a fixed length wins
    assert pad_batch([[5] * 3, [7]], pad_id=9, max_len=512)[1, 1:].eq(9).all()
