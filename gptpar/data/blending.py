"""Blend several datasets with weights, reproducing the proportions exactly (Megatron's greedy rule).

The greedy recurrence is sequential (sample i depends on every earlier choice) and its float ties decide the order,
so it runs as a few lines of C, compiled once with the system C compiler into a cache folder and loaded with ctypes
(as fast as Megatron-Core's helpers.cpp: about 40x the Python loop); with no C compiler the same loop runs in Python.
"""
import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile

import numpy as np

from gptpar.data.indexed import DataError

# Megatron's helpers.cpp build_blending_indices, operation for operation: error = w_d * max(i, 1) - taken_d in
# double, the first maximum wins. -ffp-contract=off keeps the multiply and subtract two roundings (no FMA), as in
# Python and in Megatron's x86-64 build.
_SOURCE = r"""
#include <stdint.h>
void gptpar_build_blending_indices(const double *weights, int64_t num_datasets, int64_t first, int64_t num_samples,
                                   int64_t *taken, int64_t *dataset_index, int64_t *dataset_sample_index) {
    for (int64_t i = 0; i < num_samples; ++i) {
        double step = i + first > 1 ? (double)(i + first) : 1.0;
        int64_t best = 0;
        double best_error = weights[0] * step - (double)taken[0];
        for (int64_t d = 1; d < num_datasets; ++d) {
            double error = weights[d] * step - (double)taken[d];
            if (error > best_error) {
                best = d;
                best_error = error;
            }
        }
        dataset_index[i] = best;
        dataset_sample_index[i] = taken[best];
        taken[best] += 1;
    }
}
"""
_FLAGS = ["-O2", "-ffp-contract=off", "-shared", "-fPIC"]
_CHUNK = 1 << 22  # samples per call: the int64 dataset numbers pass through a buffer of this size
_helper = None  # the loaded C function, False once it could not be built in this process


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

    Returns (dataset_index (n,), dataset_sample_index int64 (n,)); dataset_index is int16 (int32 past 32,767
    datasets), as Megatron's: 2 bytes a sample instead of 8, which counts at hundreds of millions of samples.
    """
    weights = normalize_weights(weights)
    dataset_index = np.empty(num_samples, dtype=np.int16 if len(weights) <= np.iinfo(np.int16).max else np.int32)
    dataset_sample_index = np.empty(num_samples, dtype=np.int64)
    helper = _compiled_helper()
    if not helper:
        _build_in_python(weights.tolist(), num_samples, dataset_index, dataset_sample_index)
        return dataset_index, dataset_sample_index
    taken = np.zeros(len(weights), dtype=np.int64)
    buffer = np.empty(min(num_samples, _CHUNK), dtype=np.int64)
    for first in range(0, num_samples, _CHUNK):
        n = min(_CHUNK, num_samples - first)
        helper(weights, len(weights), first, n, taken, buffer, dataset_sample_index[first:first + n])
        dataset_index[first:first + n] = buffer[:n]
    return dataset_index, dataset_sample_index


def _build_in_python(weights, num_samples, dataset_index, dataset_sample_index):
    # The same loop over plain lists (they beat per-step numpy calls): for hosts without a C compiler.
    taken = [0] * len(weights)
    for i in range(num_samples):
        step = max(i, 1.0)
        best, best_error = 0, weights[0] * step - taken[0]
        for d in range(1, len(weights)):
            error = weights[d] * step - taken[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[i] = best
        dataset_sample_index[i] = taken[best]
        taken[best] += 1


def helper_folder():
    """Where the compiled helper is kept: next to DeepSpeed's JIT ops (TORCH_EXTENSIONS_DIR) when set."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "gptpar")
    return os.path.join(base, "gptpar_blending")


def _compiled_helper():
    global _helper
    if _helper is None:
        try:
            _helper = _load_or_compile()
        except (OSError, subprocess.SubprocessError) as e:
            why = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            print(f"[gptpar.data] no compiled blending helper ({why}); building the blending index in Python "
                  "(about 40x slower)", file=sys.stderr, flush=True)
            _helper = False
    return _helper


def _load_or_compile():
    compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()
    # The file name carries the source, flags, compiler and machine: a change builds a new file, never a stale one.
    key = hashlib.sha1(repr((_SOURCE, _FLAGS, compiler, sys.platform, platform.machine())).encode()).hexdigest()[:16]
    folder = helper_folder()
    path = os.path.join(folder, f"blending_{key}.so")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        # Each process builds under its own name and renames: ranks building at once never load half a file,
        # so no lock is needed (the last rename wins with an identical file).
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            source = os.path.join(tmp, "blending.c")
            with open(source, "w") as f:
                f.write(_SOURCE)
            built = os.path.join(tmp, "blending.so")
            out = subprocess.run(compiler + _FLAGS + ["-o", built, source], capture_output=True, text=True,
                                 timeout=120)
            if out.returncode != 0:
                raise OSError(f"{' '.join(compiler)} failed: {out.stderr.strip() or out.returncode}")
            os.replace(built, path)
    function = ctypes.CDLL(path).gptpar_build_blending_indices
    doubles = np.ctypeslib.ndpointer(np.float64, ndim=1, flags="C_CONTIGUOUS")
    longs = np.ctypeslib.ndpointer(np.int64, ndim=1, flags="C_CONTIGUOUS,WRITEABLE")
    function.argtypes = [doubles, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, longs, longs, longs]
    function.restype = None
    return function


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
