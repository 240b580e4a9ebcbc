"""Tensor-parallel-aware random number streams.

Dropout on activations that are *replicated* across tp ranks (after a row-parallel layer) must draw the
same mask on every tp rank, or the replicas drift apart. Dropout on activations that are *split* across
tp ranks (attention probabilities of this rank's heads) must draw different masks per rank, or the model
would not equal its tp=1 counterpart in distribution. So:

  - the default generator is seeded identically on all tp ranks of a pipeline stage;
  - a named stream, `TENSOR_PARALLEL_STREAM`, is seeded with an offset by tp rank and entered with
    `tracker.fork()` around dropout inside tensor-parallel regions.

Forking swaps the state of the default generator of the device (CPU or CUDA) in and out, so plain
`F.dropout` inside the `with` block draws from the named stream. Works the same on CPU and CUDA.

Under torch.compile a state swap cannot be traced (`get_rng_state` is a graph break), so a compiled transformer
layer forks once, around its whole graph, and its dropout on replicated activations uses `counter_dropout`: a
mask that is a hash of (seed, element index), with seeds drawn from the default stream before the fork
(`dropout_seeds`) - the same on every tp rank, replayed by recompute like any draw, and free of generator state
inside the graph (gptpar/model/gpt.py, TransformerLayer).
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Dict, Optional

import torch

TENSOR_PARALLEL_STREAM = "tensor-parallel-rng"
_TP_SEED_OFFSET = 2718  # Megatron's offset, so the tp streams never coincide with the default seed
_PP_SEED_OFFSET = 100


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states for one device; `fork(name)` runs a block on that stream."""

    def __init__(self, device: Optional[torch.device] = None):
        self.device = torch.device(device or "cpu")
        self._states: Dict[str, torch.Tensor] = {}
        self._seeds: Dict[str, int] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        if seed in self._seeds.values():
            raise ValueError(f"seed {seed} is already used by another RNG stream")
        saved = _get_state(self.device)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self._states[name], self._seeds[name] = _get_state(self.device), seed
        _set_state(saved, self.device)

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL_STREAM):
        if name not in self._states:
            raise KeyError(f"RNG stream {name!r} was never added (known: {sorted(self._states)})")
        saved = _get_state(self.device)
        _set_state(self._states[name], self.device)
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device)
            _set_state(saved, self.device)

    def get_states(self) -> Dict[str, torch.Tensor]:
        """For checkpoints: the streams' current states (restore with `set_states`)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self._states = {name: state.clone() for name, state in states.items()}


def dropout_seeds(device: torch.device, count: int = 2) -> torch.Tensor:
    """`count` seeds in [0, 2^31) for `counter_dropout`, drawn from `device`'s default generator (int64)."""
    return torch.randint(0, 2 ** 31, (count,), device=device)


_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # Thomas Mueller's 32-bit integer hash constant (< 2^27: x * _MIX fits int64 for x < 2^32)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """An avalanching permutation of [0, 2^32), in int64 arithmetic that never overflows."""
    x = ((x >> 16) ^ x) * _MIX & _MASK32
    x = ((x >> 16) ^ x) * _MIX & _MASK32
    return (x >> 16) ^ x


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int32 bit patterns (>> is arithmetic on signed integers)."""
    return (x >> bits) & ((1 << (32 - bits)) - 1)


def _mix32_int32(x: torch.Tensor) -> torch.Tensor:
    """`_mix32` on int32 tensors holding the same 32 bits: the products wrap modulo 2^32 (two's complement), the
    shifts are logical, so every bit equals `_mix32`'s; 32-bit integer multiplies, where a GPU emulates int64
    ones with several instructions each (the int64 form made the fused dropout kernels compute-bound)."""
    x = (_shift_right(x, 16) ^ x) * _MIX
    x = (_shift_right(x, 16) ^ x) * _MIX
    return _shift_right(x, 16) ^ x


def counter_dropout(x: torch.Tensor, p: float, seed: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Dropout whose mask is a function of (`seed`, element index + `offset`) alone: no generator state, so
    torch.compile traces it into the layer's graph (inductor fuses it into one elementwise kernel) and a recompute
    with the same seed draws the same mask. Element i (row-major, plus `offset`) is kept when the top 24 bits of
    hash(i, seed) are >= p * 2^24; kept elements are scaled by 1 / (1 - p), as F.dropout does. A tensor that is
    block k of a larger one split along dim 0 (sequence parallelism) passes offset = k * numel and gets exactly
    its block of the larger tensor's mask. `seed`: an int64 scalar tensor in [0, 2^31) (`dropout_seeds`).
    Indices below 2^31 (every tensor of a shipped config) hash in int32 arithmetic, the rest in int64: the same
    mask bit for bit (tests/integration/test_compile.py::test_counter_dropout_int32_hash_is_the_int64_hash)."""
    if p == 0.0:
        return x
    threshold = round(p * (1 << 24))
    if offset + x.numel() <= 2 ** 31:  # the index's high 32 bits are 0
        index = torch.arange(offset, offset + x.numel(), device=x.device, dtype=torch.int32).view(x.shape)
        h = _mix32_int32(_mix32_int32(index) ^ seed.to(torch.int32))
        keep = _shift_right(h, 8) >= threshold
    else:
        keep = (_counter_hash_int64(x.shape, seed, offset, x.device) >> 8) >= threshold
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


def _counter_hash_int64(shape, seed: torch.Tensor, offset: int, device) -> torch.Tensor:
    """hash(index + offset, seed) in [0, 2^32) for every element of `shape`, in int64 arithmetic."""
    index = torch.arange(math.prod(shape), device=device, dtype=torch.int64).view(shape) + offset
    h = _mix32(index & _MASK32)
    return _mix32(h ^ seed ^ ((index >> 32) * _MIX & _MASK32))


def model_parallel_seed(seed: int, tp_rank: int = 0, pp_rank: int = 0,
                        device: Optional[torch.device] = None) -> RNGStatesTracker:
    """Seed the default generators (same on all tp ranks of a stage) and return a tracker whose
    tensor-parallel stream differs per tp rank. Call once per rank at start-up."""
    device = torch.device(device or "cpu")
    default_seed = seed + _PP_SEED_OFFSET * pp_rank
    torch.manual_seed(default_seed)  # also seeds every CUDA device
    tracker = RNGStatesTracker(device)
    tracker.add(TENSOR_PARALLEL_STREAM, default_seed + _TP_SEED_OFFSET + tp_rank)
    return tracker


def checkpoint(function, *args, tracker: Optional[RNGStatesTracker] = None):
    """Activation checkpointing that replays dropout exactly, the tracker's streams included.

    torch's non-reentrant checkpoint restores the default generators before recomputing; the tracker's
    named streams have moved on by then, so they are put back to their state at the original forward
    for the recomputation and restored afterwards.
    """
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    if tracker is None:
        return torch_checkpoint(function, *args, use_reentrant=False)
    return torch_checkpoint(function, *args, use_reentrant=False,
                            context_fn=functools.partial(_tracker_contexts, tracker))


def _tracker_contexts(tracker: RNGStatesTracker):
    saved: Dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def on_forward():
        saved.update(tracker.get_states())
        yield

    @contextlib.contextmanager
    def on_recompute():
        current = tracker.get_states()
        tracker.set_states(saved)
        try:
            yield
        finally:
            tracker.set_states(current)

    return on_forward(), on_recompute()
