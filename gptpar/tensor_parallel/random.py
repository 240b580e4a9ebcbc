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
"""
from __future__ import annotations

import contextlib
import functools
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
