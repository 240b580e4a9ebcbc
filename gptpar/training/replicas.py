"""Replicas that must stay bitwise equal, checked: `check_replicas` compares a 64-bit digest of every replicated
parameter across its replicas and names the first that differs, with the ranks.

    every parameter               across the data-parallel ranks (ZeRO-1 partitions the optimizer, not the weights)
    LayerNorm weights and biases, across the tensor-parallel ranks (every parameter not marked
      row-parallel biases, the      `tensor_model_parallel`)
      position embedding
    the tied word embedding       across the first and last pipeline stage (DeepSpeed's tied-weight group)

A digest is `torch.hash_tensor` (an XOR of every element's bits, widened to 64 bits, computed on the device): any
element that differs changes it, while the same values in another order would not, which numerics never produce.
Each group costs one all-gather of (parameters,) int64 digests; the ranks then agree on the verdict over the host
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


def digests(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """(len(params),) int64: each parameter's 64-bit digest, on its device."""
    if not params:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack([torch.hash_tensor(p.detach()).view(torch.int64) for p in params])


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
    """The first parameter whose digests (table: (replicas, parameters)) differ, with which ranks hold which."""
    differs = (table != table[0]).any(dim=0).nonzero()
    if differs.numel() == 0:
        return None
    i = int(differs[0])
    holders = {}
    for rank, digest in zip(ranks, table[:, i].tolist()):
        holders.setdefault(digest, []).append(rank)
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


__all__ = ["ReplicaDivergenceError", "check_replicas", "digests", "replica_sets", "first_divergence"]
