"""Cross-entropy over logits split along the vocabulary, without gathering them and without an fp32 copy of them.

For logits x (..., V/tp) on each rank and a target t:
  lse_r = log sum_j exp(x_j)             (this rank's columns)
  lse   = M + log sum_r exp(lse_r - M)   (M = max_r lse_r: one all-reduce MAX, then one SUM)
  x_t                                    (only the rank owning t has it; in the same SUM)
  loss  = lse - x_t
With label smoothing e over C real classes (torch's definition):
  loss = (1 - e) * (lse - x_t) + e * (lse - mean_j x_j)
Backward, locally: softmax - (1 - e) * onehot(t) - e / C, times the incoming gradient; softmax = exp(x - lse).

The logits are read in blocks of rows, each turned into fp32 on its own (`_block_rows`): the forward keeps only
per-token fp32 vectors (the log-sum-exp), never an (N, V/tp) fp32 tensor, whatever the logits' dtype, and backward
writes the gradient block by block into the logits' own buffer (bf16 logits: bf16 gradient, as before). Padding
columns (ids >= vocab_size, a suffix of the last ranks' slices) are left out: sliced off by the block loops, masked
in registers by the compiled kernels (`_real_mask`).

Two entry points share that arithmetic:
  `vocab_parallel_cross_entropy(logits, target)`: the loss of given logits (the pipeline's last stage, any model);
  `linear_cross_entropy(hidden, weight, target)`: the output layer and the loss in one function (GPTModel), which
      owns its logits buffer: the GEMM writes it, the loss reads it, backward overwrites it with the gradient.
Memory and traffic at the 1.3B shape, measured and worked out: docs/benchmarks.md (the cheaper loss).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from gptpar.tensor_parallel.comm import Group, group_rank, group_size
from gptpar.tensor_parallel.grad_accumulation import accumulate_weight_grad_

# Elements per fp32 block: on a GPU 16 MB, within an H100's 50 MB L2, with few enough blocks (~100 at 8192 x 50304)
# that kernel launches stay cheap; on a CPU 32 MB (~160 rows of 50k): fewer rows leave the row-parallel reductions
# too little work per thread (the sweep over 2^15..2^26 elements: docs/benchmarks.md, the cheaper loss).
_BLOCK_ELEMENTS = {"cpu": 1 << 23}
_BLOCK_ELEMENTS_ACCELERATOR = 1 << 22


def _block_rows(columns: int, device: torch.device) -> int:
    return max(1, _BLOCK_ELEMENTS.get(device.type, _BLOCK_ELEMENTS_ACCELERATOR) // max(1, columns))


def real_columns(vocab_start: int, local_vocab: int, vocab_size: Optional[int]) -> int:
    """How many of this rank's `local_vocab` columns [vocab_start, vocab_start + local_vocab) are real classes
    (< vocab_size); the rest are padding, always at the end of the slice."""
    if vocab_size is None:
        return local_vocab
    return max(0, min(local_vocab, vocab_size - vocab_start))


class _Targets(NamedTuple):
    """Where each token's target lies on this rank: `local` (its column here, 0 when elsewhere), `here`, `ignored`."""

    local: torch.Tensor
    here: torch.Tensor
    ignored: torch.Tensor


def _locate(target: torch.Tensor, vocab_start: int, local_vocab: int, ignore_index: int) -> _Targets:
    ignored = target == ignore_index
    here = (target >= vocab_start) & (target < vocab_start + local_vocab) & ~ignored
    return _Targets((target - vocab_start).masked_fill(~here, 0), here, ignored)


def _fp32_block(logits: torch.Tensor, r0: int, rows: int, real: int) -> torch.Tensor:
    """Rows [r0, r0 + rows) of the real columns in fp32: the buffer itself for fp32 logits, else a contiguous copy
    (converted whole-row, then sliced: a strided conversion is several times slower on a CPU)."""
    if logits.dtype == torch.float32:
        return logits[r0:r0 + rows, :real]
    block = logits[r0:r0 + rows].float()
    return block if real == block.shape[1] else block[:, :real].contiguous()


# ---------------------------------------------------------------------------------------------
# Compiled row kernels (`compiled=True`: training.compile). The block loops below launch ~8 small kernels per block
# (a fp32 copy, then logsumexp's max / subtract / exp / sum / log; in backward subtract, exp, multiply, scatter, copy
# back): ~1,500 launches and several passes over the logits per 1.3B micro-batch. Compiled, each direction is one
# fused pass: forward reads the logits once (in their dtype, fp32 arithmetic in registers, no fp32 copy at all) and
# writes per-row sums; backward reads them and writes their gradient into the same buffer. Same formulas, so the
# same results to fp32 rounding (tests/integration/test_loss.py). Shapes are static per run (one compile; eval's shape another).
# ---------------------------------------------------------------------------------------------

def _rows_forward(logits: torch.Tensor, local: torch.Tensor, here: torch.Tensor, real: int, column_sums: bool):
    """Per row of logits[:, :real]: fp32 log-sum-exp, the target's logit (0 when not here), the sum of the row.

    The log-sum-exp is written as max, then the sum of exp(x - max): the form inductor's pattern turns into one
    online-softmax pass over the logits on a GPU (a running max and sum). torch.logsumexp decomposes differently
    (it masks an infinite max before subtracting it), so inductor read the logits twice: one pass for the max,
    one for the sum (tests/integration/test_loss.py checks which form it matches). A non-finite row gives NaN, not inf.
    Whole rows are read and the padding columns masked in registers (`_real_mask`)."""
    x = logits.float()
    valid = _real_mask(logits, real)
    y = x if valid is None else torch.where(valid, x, float("-inf"))
    top = y.amax(dim=-1, keepdim=True)
    lse = (top + (y - top).exp().sum(dim=-1, keepdim=True).log()).squeeze(-1)
    target_logit = x.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)
    if not column_sums:
        return lse, target_logit, None
    return lse, target_logit, (x if valid is None else torch.where(valid, x, 0.0)).sum(dim=-1)


def _rows_backward_(logits: torch.Tensor, lse: torch.Tensor, local: torch.Tensor, here: torch.Tensor,
                    g: torch.Tensor, real: int, label_smoothing: float, n_classes: int) -> None:
    """logits (N, V) <- g * (softmax - (1 - e) onehot(target) - e / C) on the real columns, 0 on the padding."""
    p = torch.exp(logits.float() - lse.unsqueeze(-1))
    if label_smoothing > 0:
        p = p - label_smoothing / n_classes
    columns = torch.arange(logits.shape[1], device=logits.device)
    hit = (columns.unsqueeze(0) == local.unsqueeze(-1)) & here.unsqueeze(-1)
    grad = (p - torch.where(hit, 1.0 - label_smoothing, 0.0)) * g.unsqueeze(-1)
    valid = _real_mask(logits, real)
    logits.copy_(grad if valid is None else torch.where(valid, grad, 0.0))  # one fused write into the buffer


def _real_mask(logits: torch.Tensor, real: int) -> Optional[torch.Tensor]:
    """(1, V) True on the real columns [0, real) of `logits`, None when all are real.

    The compiled kernels read whole rows and select with this mask, rather than slicing logits[:, :real]: a slice
    of an odd width (50257 of 50304 at 1.3B) becomes Triton's load mask `column < 50257`, which Triton cannot
    prove constant over 8 neighbouring bf16 values, so it loads them one 2-byte value at a time instead of one
    16-byte vector (sm_90 PTX of the generated kernels: 8 x ld.global.b16 against 1 x ld.global.v4.b32 per
    thread). The mask here is computed in registers after an unmasked, vectorized load."""
    if real == logits.shape[1]:
        return None
    return (torch.arange(logits.shape[1], device=logits.device) < real).unsqueeze(0)


@functools.lru_cache(maxsize=None)
def _compiled(kernel):
    """`kernel` torch.compile'd. On a GPU its pointwise kernels are tiled rows x columns (`prefer_nd_tiling`)
    rather than flattened, so a row's log-sum-exp, target and incoming gradient can be loaded once per row of a
    tile rather than once per logit. By the sm_90 PTX of the backward (bench/sm90_loads.py), Triton 3.9 does so
    in every tile checked (4 such loads per 8 logits, flattened 16 per 4); Triton 3.6 (torch 2.11's) only in
    tiles whose threads each hold one row's columns (256 x 16), an autotuning candidate."""
    return torch.compile(kernel, options={"triton.prefer_nd_tiling": True})


def _loss_forward(logits: torch.Tensor, real: int, targets: _Targets, group: Group, label_smoothing: float,
                  n_classes: int, owned: bool = False, compiled: bool = False):
    """Per-token fp32 losses and log-sum-exp of `logits` (N, V/tp), any dtype; columns [real:] are padding; and
    whether `logits` now holds log-probabilities: with `owned` fp32 logits at tp = 1 each block becomes its
    log-probabilities in place while in cache, sparing backward a pass (the fused CPU loss's original algorithm).
    `compiled`: one compiled pass (`_rows_forward`) instead of the block loop."""
    n = logits.shape[0]
    compiled = compiled and real > 0  # (a rank whose slice is all padding holds no target: the loop's -inf)
    if compiled:
        local_lse, target_logit, column_sum = _compiled(_rows_forward)(logits, targets.local, targets.here, real,
                                                                       label_smoothing > 0)
    else:
        local_lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        column_sum = torch.zeros(n, dtype=torch.float32, device=logits.device) if label_smoothing > 0 else None
        target_logit = torch.zeros(n, dtype=torch.float32, device=logits.device)
        if real > 0:
            target_logit = (logits.gather(-1, targets.local.unsqueeze(-1)).squeeze(-1).float()
                            .masked_fill(~targets.here, 0))
    log_probs = owned and logits.dtype == torch.float32 and group_size(group) == 1 and not compiled
    rows = _block_rows(real, logits.device)
    for r0 in range(0, 0 if compiled else n, rows):
        block = _fp32_block(logits, r0, rows, real)
        lse = torch.logsumexp(block, dim=-1, out=local_lse[r0:r0 + rows])  # -inf on a rank holding only padding
        if column_sum is not None:
            column_sum[r0:r0 + rows] = block.sum(dim=-1)
        if log_probs:
            block.sub_(lse.unsqueeze(-1))
        del block  # before the next block is made
    if group_size(group) > 1:
        top = local_lse.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        sums = [torch.exp(local_lse - top), target_logit] + ([column_sum] if column_sum is not None else [])
        sums = torch.stack(sums)  # one all-reduce for all the sums
        dist.all_reduce(sums, group=group)
        lse, target_logit = top + sums[0].log(), sums[1]
        column_sum = sums[2] if column_sum is not None else None
    else:
        lse = local_lse
    loss = lse - target_logit
    if column_sum is not None:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - column_sum / n_classes)
    return loss.masked_fill_(targets.ignored, 0.0), lse, log_probs


def _loss_backward_(logits: torch.Tensor, real: int, lse: torch.Tensor, targets: _Targets, grad_loss: torch.Tensor,
                    label_smoothing: float, n_classes: int, log_probs: bool = False,
                    compiled: bool = False) -> torch.Tensor:
    """Overwrite `logits` (N, V/tp) - or the log-probabilities `_loss_forward` left in them - with
    d(sum grad_loss * loss)/d logits, block by block in fp32 (`compiled`: in one compiled pass); returns it."""
    g = grad_loss.float().masked_fill(targets.ignored, 0.0)  # (N,)
    if compiled and real > 0:
        _compiled(_rows_backward_)(logits, lse, targets.local, targets.here, g, real, label_smoothing, n_classes)
        return logits
    onehot = (targets.here.float() * (1.0 - label_smoothing)).mul_(g)  # what the target column loses
    rows = _block_rows(real, logits.device)
    for r0 in range(0, logits.shape[0] if real > 0 else 0, rows):
        block = logits[r0:r0 + rows, :real]
        x = _fp32_block(logits, r0, rows, real)  # fp32 logits: `block` itself, updated in place
        (x if log_probs else x.sub_(lse[r0:r0 + rows, None])).exp_()  # softmax
        if label_smoothing > 0:
            x.sub_(label_smoothing / n_classes)
        x.mul_(g[r0:r0 + rows, None])
        x.scatter_add_(-1, targets.local[r0:r0 + rows, None], -onehot[r0:r0 + rows, None])
        if x is not block:
            block.copy_(x)
        del x
    logits[:, real:].zero_()  # padding columns: no gradient
    return logits


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, label_smoothing, vocab_size, inplace_backward, compiled):
        local_vocab = logits.shape[-1]
        start = group_rank(group) * local_vocab
        flat = logits.reshape(-1, local_vocab)
        targets = _locate(target.reshape(-1), start, local_vocab, ignore_index)
        ctx.real = real_columns(start, local_vocab, vocab_size)
        ctx.n_classes = vocab_size if vocab_size is not None else local_vocab * group_size(group)
        ctx.label_smoothing, ctx.inplace_backward, ctx.logits_shape = label_smoothing, inplace_backward, logits.shape
        ctx.compiled = compiled
        loss, lse, _ = _loss_forward(flat, ctx.real, targets, group, label_smoothing, ctx.n_classes,
                                     compiled=compiled)
        ctx.save_for_backward(flat, lse, *targets)
        return loss.view(target.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        flat, lse, *targets = ctx.saved_tensors
        grad = flat if ctx.inplace_backward else flat.clone()
        _loss_backward_(grad, ctx.real, lse, _Targets(*targets), grad_loss.reshape(-1), ctx.label_smoothing,
                        ctx.n_classes, compiled=ctx.compiled)
        return grad.view(ctx.logits_shape), None, None, None, None, None, None, None


class LogitsWorkspace:
    """A reusable (N, V) logits buffer for `linear_cross_entropy` on a CPU.

    PyTorch has no caching allocator on the CPU: a fresh 400 MB logits buffer every step is mmapped and
    page-faulted in again, every page of it, in system time. One forward's graph
    borrows the buffer and its backward hands it back; a graph dropped without backward keeps it, and the
    next forward allocates anew, so reuse never aliases two live graphs."""

    def __init__(self):
        self._buffer: Optional[torch.Tensor] = None

    def take(self, shape, dtype, device) -> torch.Tensor:
        buf, self._buffer = self._buffer, None
        if buf is None or buf.shape != shape or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(shape, dtype=dtype, device=device)
        return buf

    def give_back(self, buf: torch.Tensor) -> None:
        self._buffer = buf


class _LinearCrossEntropy(torch.autograd.Function):
    """Output layer + vocab-parallel cross-entropy: loss_i = -log softmax(h_i W^T)[t_i], W this rank's (V/tp, h) rows.

    The GEMM writes the logits once (into `workspace` when given); the loss reads them block by block; backward
    turns them into their gradient in place and runs the two GEMMs. On a CPU the GEMM covers only the real vocab
    rows (fewer FLOPs); on a GPU all the padded rows, whose multiple-of-128 count keeps cuBLAS on its tensor-core
    kernels (50257 columns send the three output-layer GEMMs to a much slower fallback: docs/benchmarks.md). The
    weight's gradient covers all its rows (zeros on padding), so a padded
    table needs no slice and no zero-filled copy. Under autocast the GEMMs run in the autocast dtype; the loss is
    fp32 in every case. `reduce_input_grad`: all-reduce the hidden gradient over `group` (Megatron's f operator),
    overlapped with the weight-gradient GEMM; off under sequence parallelism, whose gather before the output layer
    reduce-scatters it instead. `main_grad` (the weight's fp32 buffer, gradient-accumulation fusion): the weight
    gradient is accumulated into its rows by the GEMM (gptpar.tensor_parallel.grad_accumulation) and autograd gets
    none."""

    @staticmethod
    def forward(ctx, hidden, weight, target, group, vocab_size, ignore_index, label_smoothing, reduce_input_grad,
                workspace, compiled, main_grad):
        local_vocab, device = weight.shape[0], hidden.device
        start = group_rank(group) * local_vocab
        real = real_columns(start, local_vocab, vocab_size)
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else hidden.dtype
        h, w = hidden.to(dtype), weight.to(dtype)
        w_rows = w[:real] if device.type == "cpu" else w  # leading rows: a view
        with torch.autocast(device.type, enabled=False):
            shape = (h.shape[0], w_rows.shape[0])
            logits = (torch.mm(h, w_rows.t(), out=workspace.take(shape, dtype, device)) if workspace is not None
                      else torch.mm(h, w_rows.t()))
            targets = _locate(target, start, local_vocab, ignore_index)
            n_classes = vocab_size if vocab_size is not None else local_vocab * group_size(group)
            loss, lse, ctx.log_probs = _loss_forward(logits, real, targets, group, label_smoothing, n_classes,
                                                     owned=True, compiled=compiled)
        ctx.save_for_backward(h, w, logits, lse, *targets)
        ctx.real, ctx.n_classes, ctx.label_smoothing = real, n_classes, label_smoothing
        ctx.group, ctx.reduce_input_grad, ctx.workspace = group, reduce_input_grad, workspace
        ctx.dtypes, ctx.compiled, ctx.main_grad = (hidden.dtype, weight.dtype), compiled, main_grad
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        h, w, logits, lse, *targets = ctx.saved_tensors
        grad = _loss_backward_(logits, ctx.real, lse, _Targets(*targets), grad_loss, ctx.label_smoothing, ctx.n_classes,
                               ctx.log_probs, ctx.compiled)
        rows = grad.shape[1]  # the GEMM's weight rows: real ones on a CPU, all on a GPU
        grad_hidden = grad_weight = handle = None
        if ctx.needs_input_grad[0]:
            grad_hidden = torch.mm(grad, w[:rows])
            if ctx.reduce_input_grad and group_size(ctx.group) > 1:
                handle = dist.all_reduce(grad_hidden, group=ctx.group, async_op=True)
        if ctx.needs_input_grad[1] and ctx.main_grad is not None:
            accumulate_weight_grad_(ctx.main_grad.data[:rows], grad, h)
        elif ctx.needs_input_grad[1]:
            grad_weight = torch.empty_like(w)
            torch.mm(grad.t(), h, out=grad_weight[:rows])
            grad_weight[rows:].zero_()
            grad_weight = grad_weight.to(ctx.dtypes[1])
        if handle is not None:
            handle.wait()
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(ctx.dtypes[0])
        if ctx.workspace is not None:
            ctx.workspace.give_back(grad)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, group: Group = None,
                         vocab_size: Optional[int] = None, ignore_index: int = -100, label_smoothing: float = 0.0,
                         reduce_input_grad: bool = True, workspace: Optional[LogitsWorkspace] = None,
                         compiled: bool = False) -> torch.Tensor:
    """Per-token fp32 cross-entropy of the logits `hidden @ weight.T`, the weight split along the vocabulary.

    hidden (..., h) replicated over `group`'s ranks; weight (V/tp, h), this rank's rows [rank*V/tp, (rank+1)*V/tp)
    of the (padded) table; target (...) global ids -> losses of `target`'s shape. `vocab_size` real classes (the
    rest is padding, left out of the softmax). Equal to `vocab_parallel_cross_entropy(F.linear(hidden, weight),
    ...)` after Megatron's f operator, without keeping more than the logits themselves (see `_LinearCrossEntropy`).
    With `group=None`: `F.cross_entropy(F.linear(hidden, weight[:vocab_size]), target, reduction='none')`.
    `reduce_input_grad=False` when the caller reduces the hidden gradient itself (sequence parallelism's gather).
    `workspace` (CPU) reuses the logits buffer across steps. `compiled` runs the loss's passes over the logits as
    two torch.compile'd kernels (training.compile) instead of the block loop. A weight with an fp32 `main_grad`
    gets its gradient accumulated there (gptpar.tensor_parallel.grad_accumulation), none through autograd.
    """
    _check_label_smoothing(label_smoothing)
    flat = hidden.reshape(-1, hidden.shape[-1])
    main_grad = getattr(weight, "main_grad", None)  # gradient-accumulation fusion (the engine installs it)
    loss = _LinearCrossEntropy.apply(flat, weight, target.reshape(-1), group, vocab_size, ignore_index,
                                     label_smoothing, reduce_input_grad, workspace, compiled, main_grad)
    return loss.view(target.shape)


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, *, group: Group = None,
                                 ignore_index: int = -100, label_smoothing: float = 0.0,
                                 vocab_size: Optional[int] = None, inplace_backward: bool = False,
                                 compiled: bool = False) -> torch.Tensor:
    """Per-token cross-entropy (shape of `target`, fp32) of logits split along the vocabulary.

    `logits_shard` (..., V/tp), any float dtype, holds vocab ids [rank*V/tp, (rank+1)*V/tp); `target` (...) holds
    global ids. Positions whose target is `ignore_index` get loss 0 and no gradient. `vocab_size` (optional) is the
    number of real classes: logits of padding ids >= vocab_size are left out of the softmax. With `group=None` this
    equals `F.cross_entropy(logits.float(), ..., reduction='none')`. No fp32 copy of the logits is made (they are
    read in fp32 blocks); the gradient has the logits' dtype. `inplace_backward=True` writes that gradient into the
    logits' own buffer (for a caller that owns them and reads them no more, like GPTLoss): no second (N, V/tp) tensor.
    `compiled=True` makes each pass over the logits one torch.compile'd kernel (same results to fp32 rounding).
    """
    _check_label_smoothing(label_smoothing)
    return _VocabParallelCrossEntropy.apply(logits_shard, target, group, ignore_index, label_smoothing, vocab_size,
                                            inplace_backward, compiled)


def _check_label_smoothing(label_smoothing: float) -> None:
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
