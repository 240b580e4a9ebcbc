"""Replicas that must stay bitwise equal, checked: `check_replicas` compares a 64-bit digest of every replicated
parameter across its replicas and names the first that differs, with the ranks.

    every parameter               across the data-parallel ranks (ZeRO-1 partitions the optimizer, not the weights)
    LayerNorm weights and biases, across the tensor-parallel ranks (every parameter not marked
      row-parallel biases, the      `tensor_model_parallel`)
      position embedding
    the tied word embedding       across the first and last pipeline stage (DeepSpeed's tied-weight group)

A digest is a position-dependent checksum in two 64-bit lanes, computed on the device (`digests`): each element's
bits, taken as an integer, are XORed with a key drawn from its index (splitmix64 of index + the lane's seed) and
mixed through splitmix64's finaliser (a bijection of 64 bits), and the results summed modulo 2^64. Changed elements
cancel only if their mixed differences sum to 0 in both lanes (about 2^-128 for changes that do not know the mix),
unlike an XOR of the bits, where two elements changed by the same bit pattern (two low mantissa bits, the typical
drift) cancel exactly; values moved to other positions change it too. A parameter is mixed in chunks of
`CHUNK_ELEMENTS`, so the temporaries stay a few hundred MB however large it is. Each group costs one all-gather of
(parameters, 2) int64 digests and one read of them to the host; the ranks then agree on the verdict over the host
group (one all-gather of a short message). Replicas drift apart when ranks run different kernels: inductor tunes its
reductions by timing them on each rank, so compiled runs set its deterministic mode (gptpar.model.gpt).

The save policy calls `check_replicas` before a save and refuses it (ReplicaDivergenceError) when one differs:
`latest` keeps the last checkpoint written while the replicas agreed.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


class ReplicaDivergenceError(RuntimeError):
    """Replicated parameters differ across their replicas; the message names the first and the ranks."""


# splitmix64 (Steele, Lea, Flood 2014): the golden-ratio increment and the finaliser's multipliers, as int64
GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
MIX2 = 0x94D049BB133111EB - (1 << 64)
LANE_SEEDS = (0x243F6A8885A308D3, 0x13198A2E03707344)  # two independent lanes (digits of pi)
CHUNK_ELEMENTS = 1 << 22  # elements mixed at once: 4 int64 temporaries of 32 MB
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _shift_right(z: torch.Tensor, k: int) -> torch.Tensor:
    """A logical right shift of int64 (torch's `>>` keeps the sign)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _finalise(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, in place on int64 (multiplication wraps modulo 2^64)."""
    z ^= _shift_right(z, 30)
    z *= MIX1
    z ^= _shift_right(z, 27)
    z *= MIX2
    z ^= _shift_right(z, 31)
    return z


def element_bits(t: torch.Tensor) -> torch.Tensor:
    """The elements' bits as int64 (sign-extended from their own width: one-to-one), flattened."""
    flat = t.detach().reshape(-1)
    return flat.view(_INT_OF_SIZE[flat.element_size()]).to(torch.int64)


def digest(t: torch.Tensor) -> torch.Tensor:
    """(2,) int64 on t's device: sum over elements i of finalise(bits_i XOR finalise(i * GOLDEN + seed)), per lane,
    modulo 2^64. No host read."""
    n = t.numel()
    out = torch.zeros(len(LANE_SEEDS), dtype=torch.int64, device=t.device)
    flat = t.detach().reshape(-1)
    for start in range(0, n, CHUNK_ELEMENTS):
        bits = element_bits(flat[start:start + CHUNK_ELEMENTS])
        index = torch.arange(start, start + bits.numel(), dtype=torch.int64, device=t.device) * GOLDEN
        for lane, seed in enumerate(LANE_SEEDS):
            key = _finalise(index + seed)
            out[lane] += _finalise(key.bitwise_xor_(bits)).sum()
    return out


def digests(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """(len(params), 2) int64: each parameter's two-lane digest (`digest`), on its device."""
    if not params:
        return torch.zeros(0, len(LANE_SEEDS), dtype=torch.int64)
    return torch.stack([digest(p) for p in params])


def replica_sets(engine, pstate) -> List[Tuple[str, object, List[Tuple[str, torch.Tensor]]]]:
    """(what the replicas are, their group, [(name, parameter)]) for every group this rank holds replicas in."""
    named = list(engine.named_parameters())
    sets = []
    if pstate.dp_size > 1:
        sets.append(("data-parallel", pstate.dp_group, named))
    if pstate.tp_size > 1:
        replicated = [(n, p) for n, p in named if not getattr(p, "tensor_model_parallel", False)]
        sets.append(("tensor-parallel", pstate.tp_group, replicated))
    names = {id(p): n for n, p in named}
    for weight, group in engine.tied_weights():
        sets.append(("tied (first and last pipeline stage)", group, [(names.get(id(weight), "tied weight"), weight)]))
    return sets


def first_divergence(kind: str, ranks: Sequence[int], names: Sequence[str], table: torch.Tensor) -> Optional[str]:
    """The first parameter whose digests (table: (replicas, parameters[, lanes])) differ, with which ranks hold
    which."""
    table = table.reshape(table.shape[0], table.shape[1], -1)
    differs = (table != table[0]).any(dim=2).any(dim=0).nonzero()
    if differs.numel() == 0:
        return None
    i = int(differs[0])
    holders = {}
    for rank, lanes in zip(ranks, table[:, i].tolist()):
        holders.setdefault(tuple(lanes), []).append(rank)
    sides = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} agree" if len(r) > 1 else
                      f"rank {r[0]} alone" for r in holders.values())
    more = int(differs.numel()) - 1
    return (f"parameter {names[i]} differs across its {kind} replicas (ranks {', '.join(map(str, ranks))}: "
            f"{sides}){f', and {more} more parameter(s) after it' if more else ''}")


def check_replicas(engine, pstate, host_group=None) -> Optional[str]:
    """The first divergence found on any rank (the same message on every rank), or None. Collective: every rank
    calls it."""
    if pstate.world_size == 1:  # no replica anywhere
        return None
    found = None
    for kind, group, named in replica_sets(engine, pstate):
        local = digests([p for _, p in named])
        size = dist.get_world_size(group)
        gathered = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(gathered, local, group=group)
        table = torch.stack(gathered).cpu()
        found = found or first_divergence(kind, dist.get_process_group_ranks(group), [n for n, _ in named], table)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return found
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, found, group=host_group)
    return next((v for v in verdicts if v is not None), None)


__all__ = ["ReplicaDivergenceError", "check_replicas", "digest", "digests", "element_bits", "replica_sets",
           "first_divergence"]
