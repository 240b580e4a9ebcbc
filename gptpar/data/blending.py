"""Blend several datasets with weights, reproducing the proportions exactly (Megatron's greedy rule)."""
import numpy as np

from gptpar.data.indexed import DataError


def normalize_weights(weights):
    weights = np.asarray(weights, dtype=np.float64)
    if weights.ndim != 1 or len(weights) == 0 or np.any(~np.isfinite(weights)) or np.any(weights <= 0):
        raise DataError(f"blending weights must be positive numbers, got {weights.tolist()}")
    return weights / weights.sum()


def build_blending_indices(weights, num_samples):
    """For blended sample i: which dataset it comes from and that dataset's next sample number.

    Greedy error minimisation, as Megatron's `build_blending_indices` (helpers.cpp): sample i goes to the
    dataset furthest behind its target, argmax_d(w_d * max(i, 1) - taken_d); ties go to the lowest d. After
    n samples every dataset is within one sample of w_d * n, and sample i never depends on num_samples, so the
    blend of a longer run starts with the blend of a shorter one.

    Returns (dataset_index int64 (n,), dataset_sample_index int64 (n,)).
    """
    weights = normalize_weights(weights).tolist()
    num_datasets = len(weights)
    taken = [0] * num_datasets
    dataset_index = np.empty(num_samples, dtype=np.int64)
    dataset_sample_index = np.empty(num_samples, dtype=np.int64)
    # A plain Python loop over lists: the recurrence is sequential, and lists beat per-step numpy calls.
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


class BlendedDataset:
    """Sample i = datasets[dataset_index[i]][dataset_sample_index[i]]."""

    def __init__(self, datasets, weights, num_samples, dataset_index=None, dataset_sample_index=None):
        self.datasets = datasets
        self.weights = normalize_weights(weights)
        if dataset_index is None:
            dataset_index, dataset_sample_index = build_blending_indices(self.weights, num_samples)
        self.dataset_index, self.dataset_sample_index = dataset_index, dataset_sample_index
        for d, ds in enumerate(datasets):
            needed = int(np.count_nonzero(dataset_index == d))
            if len(ds) < needed:
                raise DataError(f"blended dataset {d} has {len(ds)} samples but the blend needs {needed}")

    def __len__(self):
        return len(self.dataset_index)

    def __getitem__(self, i):
        d = int(self.dataset_index[i])
        return self.datasets[d][int(self.dataset_sample_index[i])]
