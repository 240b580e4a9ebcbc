"""gptpar's data index as first written (plain numpy and a Python loop): the reference that the faster index must
equal bit for bit, kept unchanged for the tests and bench/bench_data_index.py.

build_indices(sizes, documents, seq_length, seed, num_samples) -> (doc_order, doc_pos, offset, shuffle) and
build_blending_indices(weights, num_samples) -> (dataset_index, dataset_sample_index), with the same arguments and
results as gptpar.data.gpt_dataset.build_indices and gptpar.data.blending.build_blending_indices.
"""
import numpy as np


def build_blending_indices(weights, num_samples):
    """Megatron's greedy rule one sample at a time: sample i goes to argmax_d(w_d * max(i, 1) - taken_d)."""
    weights = np.asarray(weights, dtype=np.float64)
    weights = (weights / weights.sum()).tolist()
    num_datasets = len(weights)
    taken = [0] * num_datasets
    dataset_index = np.empty(num_samples, dtype=np.int64)
    dataset_sample_index = np.empty(num_samples, dtype=np.int64)
    for i in range(num_samples):
        step = max(i, 1.0)
        best, best_error = 0, weights[0] * step - taken[0]
        for d in range(1, num_datasets):
            error = weights[d] * step - taken[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[i] = best
        dataset_sample_index[i] = taken[best]
        taken[best] += 1
    return dataset_index, dataset_sample_index


def num_epoch_groups(tokens_per_epoch, seq_length, num_samples):
    return max(1, (max(num_samples, 1) - 1) * seq_length // tokens_per_epoch + 1)


def _rng(seed, epoch, stream):
    return np.random.Generator(np.random.PCG64([seed, epoch, stream]))


def build_doc_order(documents, num_epochs, seed):
    documents = np.asarray(documents, dtype=np.int64)
    return np.concatenate([documents[_rng(seed, e, 0).permutation(len(documents))] for e in range(num_epochs)])


def build_sample_idx(doc_sizes, seq_length, num_samples):
    ends = np.cumsum(doc_sizes, dtype=np.int64)
    starts = np.arange(num_samples, dtype=np.int64) * seq_length
    assert not num_samples or starts[-1] + seq_length < ends[-1]
    doc_pos = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[doc_pos] - np.asarray(doc_sizes, dtype=np.int64)[doc_pos])
    return doc_pos, offset


def build_shuffle_idx(num_samples_per_group, seed):
    parts, first = [], 0
    for e, n in enumerate(num_samples_per_group):
        parts.append(first + _rng(seed, e, 1).permutation(n))
        first += n
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def build_indices(sizes, documents, seq_length, seed, num_samples):
    doc_sizes = np.asarray(sizes, dtype=np.int64)[documents]
    tokens_per_epoch = int(doc_sizes.sum())
    groups = num_epoch_groups(tokens_per_epoch, seq_length, num_samples)
    total = -(-groups * tokens_per_epoch // seq_length)
    last_token = (total - 1) * seq_length + seq_length
    num_epochs = last_token // tokens_per_epoch + 1
    doc_order = build_doc_order(documents, num_epochs, seed)
    doc_pos, offset = build_sample_idx(np.asarray(sizes, dtype=np.int64)[doc_order], seq_length, total)
    group_starts = -(-np.arange(groups + 1, dtype=np.int64) * tokens_per_epoch // seq_length)
    shuffle = build_shuffle_idx(np.diff(group_starts).tolist(), seed)
    return tuple(_compact(a) for a in (doc_order, doc_pos, offset, shuffle))


def _compact(a):
    fits = len(a) == 0 or (a.min() >= 0 and a.max() < np.iinfo(np.int32).max)
    return a.astype(np.int32) if fits else a
