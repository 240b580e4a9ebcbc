"""Which samples each data-parallel rank trains on, and a synthetic dataset that needs no files.

Global sample indices: the global batch that starts after `consumed_samples` samples holds dataset
indices consumed_samples .. consumed_samples + global_batch_size - 1, whatever the topology. Megatron's
`MegatronPretrainingSampler` splits it into micro-batch rounds of micro_batch_size x dp samples; inside
round j, dp rank r takes a contiguous slice of micro_batch_size:

    global position of (round j, dp rank r, row k) = j * (mbs * dp) + r * mbs + k        (k < mbs)

    e.g. gbs 8, mbs 2, dp 2:   round 0: rank 0 -> [0, 1], rank 1 -> [2, 3]
                               round 1: rank 0 -> [4, 5], rank 1 -> [6, 7]

So every topology trains on the same global batches (the loss is the mean over all of its tokens), and
tp / pp peers of a dp rank read the same samples.
"""
from __future__ import annotations

from typing import List

import numpy as np
import torch

SEED_MULTIPLIER = 0x9E3779B9  # odd, ~2**32 / golden ratio: different seeds land far apart in the 32-bit space


def synthetic_sample_seed(seed: int, index: int) -> int:
    """f(seed, i) = (seed * 0x9E3779B9 + i) mod 2**32.

    torch's CPU generator (mt19937) keeps only the low 32 bits of a seed (manual_seed(2**32) ==
    manual_seed(0)), so f maps into 32 bits on purpose: distinct for every index of one seed below 2**32, and
    two seeds only share samples at an index offset of (seed_a - seed_b) * 0x9E3779B9 mod 2**32 (billions).
    """
    if index < 0 or seed < 0:
        raise ValueError(f"synthetic sample seed needs seed >= 0 and index >= 0, got {seed}, {index}")
    return (seed * SEED_MULTIPLIER + index) % 2 ** 32


class SyntheticDataset:
    """Sample i = torch.randint(0, vocab_size, (seq_length + 1,)) from a generator seeded with
    `synthetic_sample_seed(seed, i)`: a pure function of (seed, i), never of the rank. Unbounded length."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int):
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed

    def __getitem__(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(synthetic_sample_seed(self.seed, int(index)))
        return torch.randint(0, self.vocab_size, (self.seq_length + 1,), generator=g)

    def __len__(self) -> int:
        return 2 ** 32


def sample_tokens(sample) -> torch.Tensor:
    """A dataset item (tensor, ndarray, or Megatron's {"text": ndarray}) as a 1-D int64 tensor."""
    if isinstance(sample, dict):
        sample = sample["text"]
    if isinstance(sample, np.ndarray):
        return torch.from_numpy(sample.astype(np.int64, copy=False))
    return torch.as_tensor(sample, dtype=torch.long)


def rank_sample_indices(consumed_samples: int, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                        dp_size: int) -> List[List[int]]:
    """Dataset indices of dp rank `dp_rank`'s micro-batches in the global batch after `consumed_samples`."""
    per_round = micro_batch_size * dp_size
    if global_batch_size % per_round:
        raise ValueError(f"global batch {global_batch_size} does not divide by micro batch {micro_batch_size} "
                         f"x dp {dp_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} outside dp size {dp_size}")
    first = consumed_samples + dp_rank * micro_batch_size
    return [list(range(first + j * per_round, first + j * per_round + micro_batch_size))
            for j in range(global_batch_size // per_round)]


def rank_micro_batches(dataset, consumed_samples: int, global_batch_size: int, micro_batch_size: int,
                       dp_rank: int, dp_size: int) -> List[torch.Tensor]:
    """This dp rank's micro-batches of the next global batch: a list of LongTensors (mbs, seq + 1)."""
    return [torch.stack([sample_tokens(dataset[i]) for i in indices])
            for indices in rank_sample_indices(consumed_samples, global_batch_size, micro_batch_size, dp_rank,
                                               dp_size)]


__all__ = ["SyntheticDataset", "synthetic_sample_seed", "sample_tokens", "rank_sample_indices",
           "rank_micro_batches"]
