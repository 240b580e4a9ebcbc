"""Full (tp = 1) state dicts <-> tensor-parallel shards, driven by the parameters' own tags.

A parameter with `tensor_model_parallel=True` holds block `tp_rank` of its full tensor along
`partition_dim`; every other parameter is replicated. Nothing here matches on names, so the same
functions serve any model built from gptpar's layers (checkpoint conversion, loading Hugging Face
weights, gathering for export).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from gptpar.tensor_parallel.comm import Group, group_rank, group_size


def shard_tensor(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's block of `full` for `param` (one rank's shard), padding the partitioned dim with zeros if
    `full` is shorter (a vocabulary padded to a multiple of tp x 128)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    return _block(full, param.partition_dim, param.shape[param.partition_dim], tp_rank, tp_size)


def split_tensor(full: torch.Tensor, param: torch.Tensor, tp_size: int) -> List[torch.Tensor]:
    """Every tp rank's block of `full` for `param`, a parameter of the model built at tp = 1 with the padded
    size of the target tp (offline resharding: no process group). Replicated parameters repeat `full`."""
    if not getattr(param, "tensor_model_parallel", False):
        return [full] * tp_size
    dim = param.partition_dim
    if param.shape[dim] % tp_size:
        raise ValueError(f"{tuple(param.shape)} does not split {tp_size} ways along dim {dim}")
    return [_block(full, dim, param.shape[dim] // tp_size, rank, tp_size) for rank in range(tp_size)]


def _block(full: torch.Tensor, dim: int, per_rank: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Block `tp_rank` of `per_rank` rows along `dim`, `full` zero-padded to tp_size x per_rank there."""
    want = per_rank * tp_size
    if full.shape[dim] > want:
        raise ValueError(f"tensor of {full.shape[dim]} along dim {dim} does not fit {tp_size} x {per_rank}")
    start = tp_rank * per_rank
    if full.shape[dim] >= start + per_rank:
        return full.narrow(dim, start, per_rank)
    # This rank's block runs into the padding: only the block is built (never a padded copy of `full`).
    shape = list(full.shape)
    shape[dim] = per_rank
    block = full.new_zeros(shape)
    have = max(0, full.shape[dim] - start)
    if have:
        block.narrow(dim, 0, have).copy_(full.narrow(dim, start, have))
    return block


def load_full_state_dict(model: nn.Module, full: Dict[str, torch.Tensor], tp_group: Group = None,
                         full_name: Optional[Callable[[str], str]] = None) -> None:
    """Copy a tp = 1 state dict into a (possibly) tensor-parallel model, each rank taking its blocks.

    `full_name` maps the model's parameter names to `full`'s keys (e.g. a pipeline stage's to GPTModel's)."""
    rank, size = group_rank(tp_group), group_size(tp_group)
    full_name = full_name or (lambda name: name)
    params = {full_name(name): param for name, param in model.named_parameters()}
    missing = sorted(set(params) - set(full))
    if missing:
        raise KeyError(f"state dict lacks {missing[:5]}{'...' if len(missing) > 5 else ''}")
    with torch.no_grad():
        for name, param in params.items():
            block = shard_tensor(full[name], param, rank, size)
            if block.shape != param.shape:
                raise ValueError(f"{name}: expected {tuple(param.shape)} on this rank, got {tuple(block.shape)}")
            param.copy_(block)


def gather_full_state_dict(model: nn.Module, tp_group: Group = None) -> Dict[str, torch.Tensor]:
    """The tp = 1 state dict of a tensor-parallel model (a collective over `tp_group`; CPU tensors)."""
    size = group_size(tp_group)
    out = {}
    for name, param in model.named_parameters():
        t = param.detach()
        if size > 1 and getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(parts, t.contiguous(), group=tp_group)
            t = torch.cat(parts, dim=param.partition_dim)
        out[name] = t.cpu().clone()
    return out
