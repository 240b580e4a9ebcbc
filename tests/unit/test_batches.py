"""Synthetic samples and the data-parallel batch layout: every topology sees the same global batches."""
import numpy as np
import pytest
import torch

from gptpar.training.batches import (SyntheticDataset, rank_micro_batches, rank_sample_indices,
                                     synthetic_sample_seed)


def test_synthetic_sample_definition():
    ds = SyntheticDataset(vocab_size=100, seq_length=16, seed=7)
    for i in (0, 1, 12345):
        g = torch.Generator().manual_seed((7 * 0x9E3779B9 + i) % 2 ** 32)  # the documented f(seed, i)
        assert torch.equal(ds[i], torch.randint(0, 100, (17,), generator=g))
    assert ds[3].dtype == torch.long and ds[3].shape == (17,)
    assert not torch.equal(ds[0], ds[1])
    assert not torch.equal(ds[0], SyntheticDataset(100, 16, seed=8)[0])
    # torch keeps 32 bits of a seed: f stays inside them, so nearby seeds and indices never collide
    assert len({synthetic_sample_seed(s, i) for s in range(20) for i in range(10000)}) == 20 * 10000
    assert all(0 <= synthetic_sample_seed(s, i) < 2 ** 32 for s in (0, 2 ** 40) for i in (0, 2 ** 33))
    with pytest.raises(ValueError):
        synthetic_sample_seed(0, -1)


def test_megatron_layout():
    # MegatronPretrainingSampler: rounds of mbs * dp indices; dp rank r takes [r * mbs, (r + 1) * mbs) of each
    assert rank_sample_indices(100, 8, 2, 0, 2) == [[100, 101], [104, 105]]
    assert rank_sample_indices(100, 8, 2, 1, 2) == [[102, 103], [106, 107]]


def reference_global_batch(ds, consumed, gbs):
    return torch.stack([ds[i] for i in range(consumed, consumed + gbs)])


@pytest.mark.parametrize("mbs, dp", [(1, 1), (4, 1), (1, 4), (2, 2), (8, 1), (1, 8)])
def test_every_topology_sees_the_same_global_batch(mbs, dp):
    ds = SyntheticDataset(vocab_size=50, seq_length=8, seed=3)
    gbs, consumed = 8, 24
    per_rank = [rank_micro_batches(ds, consumed, gbs, mbs, r, dp) for r in range(dp)]
    rows = []
    for j in range(gbs // (mbs * dp)):  # the micro-batch rounds, in order
        for r in range(dp):
            mb = per_rank[r][j]
            assert mb.shape == (mbs, 9) and mb.dtype == torch.long
            rows.append(mb)
    assert torch.equal(torch.cat(rows), reference_global_batch(ds, consumed, gbs))


class DictDataset:
    """Megatron's GPT dataset returns {"text": int32/int64 ndarray of seq + 1}."""

    def __getitem__(self, i):
        return {"text": np.arange(i, i + 5, dtype=np.int32)}


class ArrayDataset:
    def __getitem__(self, i):
        return np.arange(i, i + 5, dtype=np.uint16)


@pytest.mark.parametrize("ds", [DictDataset(), ArrayDataset()])
def test_dataset_item_types(ds):
    (mb,) = rank_micro_batches(ds, 10, 4, 2, 1, 2)
    assert mb.dtype == torch.long
    assert torch.equal(mb, torch.tensor([[12, 13, 14, 15, 16], [13, 14, 15, 16, 17]]))


def test_bad_layout():
    with pytest.raises(ValueError):
        rank_sample_indices(0, 6, 2, 0, 2)
    with pytest.raises(ValueError):
        rank_sample_indices(0, 8, 2, 2, 2)
