"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Weights keep PyTorch's `(out_features, in_features)` layout (fast `F.linear`, also in bf16 on CPU).
  ColumnParallelLinear: rank r holds rows    [r*out/tp, (r+1)*out/tp) of the full weight (and bias).
  RowParallelLinear:    rank r holds columns [r*in/tp,  (r+1)*in/tp)  of the full weight; the bias is full
                        and added once, after the reduction.
  VocabParallelEmbedding: rank r holds rows [r*V/tp, (r+1)*V/tp) of the (V, h) table.

With `group=None` (or a group of one rank) each layer computes exactly what nn.Linear / nn.Embedding does.

Initialisation is independent of tp: every rank generates the *full* weight from the default CPU
generator, row-block by row-block (blocks of ~4M elements whose boundaries depend only on the full
shape), and keeps its own slice. With the same seed, tp=1 and tp=N hold the same full weight, and a
weight with extra (padding) rows at the end has the same leading rows. Memory stays at one block, not the
full matrix, so 200B-sized layers initialise without materialising their weights; the cost is the time to
draw the full matrix on every rank. On the `meta` device nothing is initialised.

With `float8` (a gptpar.tensor_parallel.float8.Float8Matmul: training.precision fp8) Column- and RowParallelLinear
run their GEMMs in float8 through torchao, padded or kept in bf16 as `plan_float8_gemm` decides for this rank's
weight slice (`float8_gemm`); the parameters keep their shapes and dtype.

A weight given an fp32 `main_grad` tensor of its shape (Megatron's attribute; gptpar's engine installs DeepSpeed's
buffers there under training.gradient_accumulation_fusion) has its gradient accumulated into it by the layer's
backward, and autograd gets none for it (gptpar.tensor_parallel.grad_accumulation); so does the embedding table's,
by the lookup's backward and by the tied output layer's.

Sharded parameters carry Megatron's attributes `tensor_model_parallel`, `partition_dim`, `partition_stride`
(DeepSpeed's gradient norm and clipping read them; checkpoint conversion and parameter counting too).
Replicated parameters whose gradient must be summed over tp under sequence parallelism carry
`sequence_parallel = True` and a gradient hook that does the sum (`comm.mark_sequence_parallel`).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import _functional_collectives as funcol

from gptpar.tensor_parallel.comm import (
    Group, copy_to_tensor_parallel_region, divide, gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region, group_rank, group_size, mark_sequence_parallel,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region, scatter_to_tensor_parallel_region)
from gptpar.tensor_parallel.float8 import Float8Matmul, Float8WeightCache, plan_float8_gemm
from gptpar.tensor_parallel.grad_accumulation import (
    accumulate_weight_grad_, embedding_into_main_grad, linear_backward_into_main_grad)

InitMethod = Callable[[torch.Tensor], torch.Tensor]
_INIT_BLOCK_ELEMENTS = 1 << 22


def init_normal(std: float = 0.02) -> InitMethod:
    """Megatron's default: normal(0, std), applied in place. Init methods must be elementwise
    (normal_, uniform_, zeros_): they are applied to row blocks of the full weight."""
    return functools.partial(nn.init.normal_, mean=0.0, std=std)


def set_tensor_parallel_attributes(param: torch.Tensor, partition_dim: int, stride: int = 1) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride


def init_sharded_(shard: torch.Tensor, full_shape, partition_dim: int, rank: int, world: int,
                  init_method: InitMethod) -> None:
    """Fill `shard` with this rank's slice of a full `full_shape` (rows, cols) weight drawn on the CPU."""
    if shard.device.type == "meta":
        return
    rows, cols = full_shape
    per_rank = (rows if partition_dim == 0 else cols) // world
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    rows_per_block = max(1, _INIT_BLOCK_ELEMENTS // cols)
    out = torch.empty(shard.shape, dtype=torch.float32)
    for r0 in range(0, rows, rows_per_block):
        r1 = min(rows, r0 + rows_per_block)
        block = torch.empty(r1 - r0, cols, dtype=torch.float32)
        init_method(block)
        if partition_dim == 1:
            out[r0:r1] = block[:, lo:hi]
        elif r1 > lo and r0 < hi:
            a, b = max(r0, lo), min(r1, hi)
            out[a - lo:b - lo] = block[a - r0:b - r0]
    with torch.no_grad():
        shard.copy_(out)


class _Linear(torch.autograd.Function):
    """F.linear(x, weight, bias) with Megatron's two backward options (gptpar.tensor_parallel.grad_accumulation):
    the input gradient all-reduced over `group` (f + linear; None: no all-reduce), overlapped with the
    weight-gradient GEMM (Megatron's async tensor-parallel all-reduce); and, with `main_grad` (the weight's fp32
    buffer), the weight gradient accumulated into it by the GEMM instead of returned to autograd.

    Backward: grad_x = g W, start all-reduce(grad_x), then grad_W = g^T x (or main_grad += g^T x) and
    grad_b = sum g, then wait. Under torch.compile the fused backward is one opaque op (the input gradient and the
    accumulation) and the all-reduce a functional collective after it."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, main_grad):
        ctx.save_for_backward(x, weight, main_grad)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight, main_grad = ctx.saved_tensors
        grad_x = grad_w = grad_b = handle = None
        flat_grad = grad.reshape(-1, grad.shape[-1])
        fused = main_grad is not None and ctx.needs_input_grad[1]
        if fused and torch.compiler.is_compiling():  # x needs a gradient: linear_with_grad_all_reduce saw to it
            grad_x = linear_backward_into_main_grad(grad, x, weight, main_grad)  # see its docstring
            fused = False  # done
        elif ctx.needs_input_grad[0]:
            grad_x = grad.matmul(weight)  # (..., in): with a group, this rank's partial sum
        if grad_x is not None and ctx.group is not None:
            if torch.compiler.is_compiling():  # Dynamo cannot trace async_op=True; a functional all-reduce is
                grad_x = funcol.all_reduce(grad_x, "sum", ctx.group)  # waited for where grad_x is used
            else:
                handle = torch.distributed.all_reduce(grad_x, group=ctx.group, async_op=True)
        if fused:
            accumulate_weight_grad_(main_grad, flat_grad, x.reshape(-1, x.shape[-1]))
        elif ctx.needs_input_grad[1] and main_grad is None:
            grad_w = flat_grad.t().mm(x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = flat_grad.sum(0)
        if handle is not None:
            handle.wait()
        return grad_x, grad_w, grad_b, None, None


def linear_with_grad_all_reduce(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                group: Group, main_grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear(copy_to_tensor_parallel_region(x, group), weight, bias)`, overlapping the backward all-reduce;
    with `main_grad`, the weight gradient accumulated into it (gradient-accumulation fusion) - unless `x` needs no
    gradient (the fused op returns the input gradient, without which a compiled graph would drop it): then autograd
    gets the weight gradient as usual, and the optimizer wrapper adds it into the same buffer."""
    if main_grad is not None and not (x.requires_grad and torch.is_grad_enabled()):
        main_grad = None
    if group_size(group) == 1:
        if main_grad is None:
            return F.linear(x, weight, bias)
        group = None
    return _Linear.apply(x, weight, bias, group, main_grad)


def _set_float8(layer: nn.Module, float8: Optional[Float8Matmul]) -> None:
    """The layer's float8 decision (`float8_gemm`, None without fp8), the GEMM it runs in float8 (`float8`, None
    when kept in bf16), from its weight slice's shape, and where its weight's float8 cast is kept between
    optimizer steps (`float8_weight_cache`, empty until `refresh_float8_weights`; None for a recipe that recasts)."""
    layer.float8_gemm = plan_float8_gemm(*layer.weight.shape) if float8 is not None else None
    layer.float8 = float8 if layer.float8_gemm is not None and layer.float8_gemm.mode != "bf16" else None
    cached = layer.float8 is not None and getattr(layer.float8, "caches_weights", False)
    layer.float8_weight_cache = Float8WeightCache() if cached else None


def _gemm(layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x W^T (+ bias) with the layer's weight slice: in float8 when it has a float8 GEMM, else F.linear (its
    weight gradient accumulated into `weight.main_grad` when the weight has one)."""
    if layer.float8 is None:
        return linear_with_grad_all_reduce(x, layer.weight, bias, None, _main_grad(layer))
    y = layer.float8.linear(x, layer.weight, layer.float8_gemm, layer.float8_weight_cache)
    return y if bias is None else y + bias


def _main_grad(layer: nn.Module) -> Optional[torch.Tensor]:
    """The weight's fp32 gradient buffer when the optimizer wrapper installed one (gradient-accumulation fusion:
    gptpar.training.engine), else None. Float8 GEMMs keep torchao's backward, and no buffer is installed for them."""
    return getattr(layer.weight, "main_grad", None)


def _float8_repr(layer: nn.Module) -> str:
    return "" if layer.float8_gemm is None else f", fp8={layer.float8_gemm.mode}"


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its output dim: rank r computes Y[..., r*out/tp:(r+1)*out/tp].

    Input (..., in) replicated — or, with `sequence_parallel`, (s/tp, b, in) gathered along dim 0 first.
    Output (..., out/tp), or (..., out) with `gather_output`.
    """

    def __init__(self, in_features: int, out_features: int, *, group: Group = None, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 init_method: Optional[InitMethod] = None, float8: Optional[Float8Matmul] = None,
                 dtype=None, device=None):
        super().__init__()
        world = group_size(group)
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: sequence_parallel and gather_output exclude each other")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        out_per_rank = divide(out_features, world, "ColumnParallelLinear out_features")
        self.weight = nn.Parameter(torch.empty(out_per_rank, in_features, dtype=dtype, device=device))
        set_tensor_parallel_attributes(self.weight, partition_dim=0)
        init_sharded_(self.weight, (out_features, in_features), 0, group_rank(group), world,
                      init_method or init_normal())
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_per_rank, dtype=dtype, device=device))
            set_tensor_parallel_attributes(self.bias, partition_dim=0)
        else:
            self.register_parameter("bias", None)
        _set_float8(self, float8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.group)  # (s/tp, b, in) -> (s, b, in)
            y = _gemm(self, x, self.bias)  # (..., out/tp)
        elif self.float8 is not None:
            # f, then the float8 GEMM: torchao's backward computes both gradients in one call, so the input
            # gradient's all-reduce starts after the weight gradient instead of overlapping it
            y = _gemm(self, copy_to_tensor_parallel_region(x, self.group), self.bias)
        else:
            y = linear_with_grad_all_reduce(x, self.weight, self.bias, self.group, _main_grad(self))  # f + linear
        return gather_from_tensor_parallel_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"tp={group_size(self.group)}, bias={self.bias is not None}, sp={self.sequence_parallel}"
                + _float8_repr(self))


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its input dim: each rank multiplies its block of X's last dim,
    then the partial sums are all-reduced (g) — or reduce-scattered along dim 0 with `sequence_parallel`.

    Input (..., in/tp) when `input_is_parallel` (the usual case, after a ColumnParallelLinear),
    else (..., in) and split here. Output (..., out), or (s/tp, b, out) with `sequence_parallel`.
    """

    def __init__(self, in_features: int, out_features: int, *, group: Group = None, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 init_method: Optional[InitMethod] = None, float8: Optional[Float8Matmul] = None,
                 dtype=None, device=None):
        super().__init__()
        world = group_size(group)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        in_per_rank = divide(in_features, world, "RowParallelLinear in_features")
        self.weight = nn.Parameter(torch.empty(out_features, in_per_rank, dtype=dtype, device=device))
        set_tensor_parallel_attributes(self.weight, partition_dim=1)
        init_sharded_(self.weight, (out_features, in_features), 1, group_rank(group), world,
                      init_method or init_normal())
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
            self.bias.sequence_parallel = sequence_parallel
            if sequence_parallel:  # the replicated bias only sees this rank's sequence block
                mark_sequence_parallel([self.bias], group)
        else:
            self.register_parameter("bias", None)
        _set_float8(self, float8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)
        y = _gemm(self, x, None)  # partial sums (..., out), de-scaled before they are reduced
        if self.float8 is not None and not self.sequence_parallel and group_size(self.group) > 1:
            # torchao's autograd function returns a view of its result, which the in-place all-reduce below may not
            # modify under torch.compile ("a view created inside a custom Function"): one copy of the partial sums
            y = y.clone()
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.group)
        else:
            y = reduce_from_tensor_parallel_region(y, self.group)  # g
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"tp={group_size(self.group)}, bias={self.bias is not None}, sp={self.sequence_parallel}"
                + _float8_repr(self))


class VocabParallelEmbedding(nn.Module):
    """An embedding table split along the vocabulary: rank r holds ids [vocab_start, vocab_end).

    Ids outside this rank's range look up row 0 and are zeroed, then the ranks' outputs are summed (g),
    so every rank returns the full (..., embedding_dim) embedding.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: Group = None,
                 init_method: Optional[InitMethod] = None, dtype=None, device=None):
        super().__init__()
        world = group_size(group)
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        per_rank = divide(num_embeddings, world, "VocabParallelEmbedding num_embeddings")
        self.vocab_start = group_rank(group) * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, dtype=dtype, device=device))
        set_tensor_parallel_attributes(self.weight, partition_dim=0)
        init_sharded_(self.weight, (num_embeddings, embedding_dim), 0, group_rank(group), world,
                      init_method or init_normal())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.group) == 1:
            return self._lookup(ids)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = self._lookup(local).masked_fill(outside.unsqueeze(-1), 0.0)  # bwd: outside rows' gradients zeroed
        return reduce_from_tensor_parallel_region(out, self.group)

    def _lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        """F.embedding of this rank's rows; with `weight.main_grad`, its gradient accumulated there."""
        main_grad = _main_grad(self)
        if main_grad is None or not torch.is_grad_enabled():
            return F.embedding(local_ids, self.weight)
        return embedding_into_main_grad(local_ids, self.weight, main_grad)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, tp={group_size(self.group)}, "
                f"rows=[{self.vocab_start}, {self.vocab_end})")
