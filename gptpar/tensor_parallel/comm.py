"""Communication primitives of tensor (and sequence) parallelism, as autograd functions.

Megatron's two conjugate operators (Shoeybi et al., 2019):
  f = `copy_to_tensor_parallel_region`:   identity forward, all-reduce backward (before a column-parallel layer)
  g = `reduce_from_tensor_parallel_region`: all-reduce forward, identity backward (after a row-parallel layer)
plus split/gather along the last (hidden or vocab) dimension.

Sequence parallelism (Korthikanti et al., 2022) splits activations along the **sequence dimension, dim 0**:
gptpar keeps activations as (s, b, h), as Megatron does, so each rank's slice is one contiguous block.
  `gather_from_sequence_parallel_region`:       all-gather fwd / reduce-scatter bwd (before column-parallel)
  `reduce_scatter_to_sequence_parallel_region`: reduce-scatter fwd / all-gather bwd (after row-parallel)
  `scatter_to_sequence_parallel_region`:        split fwd / all-gather bwd (entering the SP region)

Every primitive is the identity for `group=None` or a group of size 1. Autograd functions keep their group
on `ctx`; nothing here reads global state, so a tp=1 reference and a tp=N model can live in one process.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} does not divide by the tensor-parallel size {denominator}")
    return numerator // denominator


# ----------------------------------------------------------------------------------------------
# Raw collectives (no autograd)
# ----------------------------------------------------------------------------------------------

def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    chunk = divide(x.shape[dim], world, f"dimension {dim} of size")
    return x.narrow(dim, group_rank(group) * chunk, chunk).contiguous()


def _gather(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Sum over the group, keep this rank's block of `dim`.

    NCCL has a native reduce-scatter; gloo has none for most dtypes, so there we all-reduce and slice:
    the same result with twice the traffic (acceptable on CPU, where gloo is only used for testing).
    """
    world = group_size(group)
    if world == 1:
        return x
    chunk = divide(x.shape[dim], world, f"dimension {dim} of size")
    if dist.get_backend(group) == "nccl":
        x = x.movedim(dim, 0).contiguous()
        out = torch.empty((chunk,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x, group=group)
        return out.movedim(0, dim)
    return _all_reduce(x.clone(), group).narrow(dim, group_rank(group) * chunk, chunk).contiguous()


# ----------------------------------------------------------------------------------------------
# Autograd functions
# ----------------------------------------------------------------------------------------------

class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim), None, None


class _GatherFromRegion(torch.autograd.Function):
    """all-gather fwd; bwd either keeps this rank's slice (tp region: the output was replicated)
    or reduce-scatters (sequence parallelism: every rank's consumer contributed to each slice)."""

    @staticmethod
    def forward(ctx, x, group, dim, reduce_grads):
        ctx.group, ctx.dim, ctx.reduce_grads = group, dim, reduce_grads
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grads:
            return _reduce_scatter(grad, ctx.group, ctx.dim), None, None, None
        return _split(grad, ctx.group, ctx.dim), None, None, None


class _ReduceScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim), None, None


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------

def copy_to_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient backward."""
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's block of the last dim; backward all-gathers."""
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, group, -1)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather along the last dim; backward keeps this rank's block."""
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, group, -1, False)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(s, b, h) -> (s/tp, b, h): keep this rank's block of dim 0; backward all-gathers."""
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, group, 0)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(s/tp, b, h) -> (s, b, h) by all-gather; backward reduce-scatters."""
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, group, 0, True)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(s, b, h) partial sums -> (s/tp, b, h) reduced; backward all-gathers."""
    return x if group_size(group) == 1 else _ReduceScatterToRegion.apply(x, group, 0)


def _all_reduce_grad(grad: torch.Tensor, group: Group) -> torch.Tensor:
    grad = grad.contiguous()
    dist.all_reduce(grad, group=group)
    return grad


def mark_sequence_parallel(params, group: Group) -> None:
    """Sum over `group` the gradients of replicated parameters that only saw this rank's sequence block
    (under sequence parallelism: LayerNorms and row-parallel biases). A tensor hook sums each backward's
    contribution, so gradient accumulation over micro-batches stays a plain sum."""
    for param in params:
        param.sequence_parallel = True
        if group_size(group) > 1 and param.requires_grad:
            param.register_hook(functools.partial(_all_reduce_grad, group=group))
