"""Gradient-accumulation fusion (Megatron's `--gradient-accumulation-fusion`): a linear layer's weight gradient
added straight into an fp32 buffer, `weight.main_grad`, by the weight-gradient GEMM itself.

Without it a bf16 model's weight gradient is a bf16 tensor per micro-batch, which the optimizer wrapper then adds
into its fp32 accumulation buffer (DeepSpeed's BF16_Optimizer, gptpar.training.engine.deepspeed_api): 2 bytes
written by the GEMM, 2 + 4 read and 4 written by the add, per parameter per micro-batch - at the 1.3B shape 292
unvectorised mixed-dtype adds per micro-batch (their cost: docs/benchmarks.md). Fused, the GEMM reads and writes the
fp32 buffer in its epilogue (`torch.addmm(main_grad, g^T, x, out_dtype=float32, out=main_grad)`, cuBLAS with bf16
inputs and an fp32 C = D; torch >= 2.10) and autograd sees no weight gradient at all. The sums are also more
exact: each micro-batch's product is added in fp32 before any rounding to bf16.

Where no such GEMM exists (a CPU; a CUDA torch whose addmm refuses an fp32 `self` with bf16 inputs) the same
call computes the bf16 product and adds it in fp32, which is exactly what the unfused path computes: CPU tests
check the plumbing (every micro-batch added once, nothing through autograd) and get the unfused numbers.

The word embedding, tied to the output layer, has two gradients: the output layer's weight-gradient GEMM
(`gptpar.tensor_parallel.cross_entropy`, the same fused GEMM) and the lookup's, which `embedding_into_main_grad`
adds into the same buffer's rows by index (deterministic: CUDA's accumulating `index_put_` sorts the ids),
instead of a dense zero-filled (V/tp, h) bf16 gradient, its sum with the output layer's and the fp32 add of the
result (~2 GB moved per micro-batch at the 1.3B shape).

`weight.main_grad` is set by whoever owns the fp32 buffers (gptpar.training.engine installs DeepSpeed's, as
views with their own version counter); a layer whose weight has none runs the ordinary backward.
"""
from __future__ import annotations

from typing import Optional

import torch


def accumulate_weight_grad_(main_grad: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor) -> None:
    """main_grad (out, in) += grad_output (tokens, out)^T @ input (tokens, in), accumulated in main_grad's dtype.

    Writes through `main_grad.data`, so the tensor's autograd version counter does not move: autograd saved it
    for the backward of every micro-batch in flight (a pipeline runs several forwards before their backwards),
    and an add by one backward must not invalidate the others'."""
    target = main_grad.data
    if grad_output.dtype == target.dtype:
        target.addmm_(grad_output.t(), input)
    elif target.device.type == "cuda":
        torch.addmm(target, grad_output.t(), input, out_dtype=target.dtype, out=target)
    else:
        target.add_(grad_output.t().mm(input))


@torch.library.custom_op("gptpar::linear_backward_into_main_grad", mutates_args=())
def linear_backward_into_main_grad(grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor,
                                   main_grad: torch.Tensor) -> torch.Tensor:
    """A linear layer's backward with the weight gradient accumulated into `main_grad`: returns the input
    gradient `grad_output @ weight` (..., in) and adds `grad_output^T @ input` into `main_grad` (out, in).

    For torch.compile: one opaque op, declared without mutations although it adds into `main_grad` - on purpose.
    Nothing in any compiled graph reads `main_grad`, so no ordering inside a graph depends on the add; the op
    cannot be dropped, because the input gradient it returns is used; and a declared mutation of a forward input
    in backward would make autograd's saved-tensor version check fail as soon as two micro-batches are in flight
    (AOTAutograd saves the input for backward and checks its version there)."""
    grad_input = grad_output.matmul(weight)
    accumulate_weight_grad_(main_grad, grad_output.reshape(-1, grad_output.shape[-1]),
                            input.reshape(-1, input.shape[-1]))
    return grad_input


@linear_backward_into_main_grad.register_fake
def _(grad_output, input, weight, main_grad):
    return grad_output.new_empty(grad_output.shape[:-1] + (weight.shape[1],))


class _EmbeddingIntoMainGrad(torch.autograd.Function):
    """F.embedding(ids, weight) whose backward adds the weight's gradient into `main_grad` (by row, in its
    dtype) and returns none to autograd. `main_grad` is written through `.data`, as in `accumulate_weight_grad_`."""

    @staticmethod
    def forward(ctx, ids, weight, main_grad):
        ctx.save_for_backward(ids, main_grad)
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        ids, main_grad = ctx.saved_tensors
        target, ids = main_grad.data, ids.reshape(-1)
        rows = grad.reshape(-1, grad.shape[-1]).to(target.dtype)
        if target.device.type == "cuda":
            target.index_put_((ids,), rows, accumulate=True)  # sorts the ids: deterministic (index_add_ has atomics)
        else:
            target.index_add_(0, ids, rows)  # a CPU's index_add_ is deterministic (its accumulating index_put_ not)
        return None, None, None


def embedding_into_main_grad(ids: torch.Tensor, weight: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
    """`F.embedding(ids, weight)` with the weight's gradient accumulated into `main_grad` ((rows, h), fp32),
    none given to autograd: each looked-up row's gradient added in fp32 (repeated ids summed in a fixed order).
    Eager only: the engine compiles the transformer layers, not the embedding."""
    return _EmbeddingIntoMainGrad.apply(ids, weight, main_grad)


def fused_accumulation_unavailable(device: torch.device) -> Optional[str]:
    """None when `accumulate_weight_grad_` runs on `device` with bf16 inputs and an fp32 buffer, else why not.

    On CUDA it tries the fused GEMM once on tiny tensors (torch < 2.10 refuses an fp32 `self` for bf16 inputs);
    elsewhere it is always available (the bf16 product added in fp32: the unfused arithmetic)."""
    if device.type != "cuda":
        return None
    g = torch.Generator(device=device).manual_seed(0)
    grad = torch.randn(8, 16, device=device, generator=g).to(torch.bfloat16)
    x = torch.randn(8, 32, device=device, generator=g).to(torch.bfloat16)
    main_grad = torch.ones(16, 32, device=device)
    try:
        accumulate_weight_grad_(main_grad, grad, x)
    except RuntimeError as error:
        return (f"torch {torch.__version__}'s CUDA addmm has no fp32 output over bf16 inputs with an fp32 "
                f"`self` ({str(error).splitlines()[0]}); torch >= 2.10 has it")
    expected = 1.0 + grad.float().t() @ x.float()
    if not torch.allclose(main_grad, expected, rtol=1e-3, atol=1e-3):
        return "the fused addmm gave a wrong sum on this device"
    return None
