"""Cross-entropy over logits split along the vocabulary, without gathering them.

For logits x (..., V/tp) on each rank and a target t:
  m   = max_j x_j                       (local max, then all-reduce MAX)
  lse = log sum_j exp(x_j - m)          (local sum, then all-reduce SUM)
  x_t - m                               (only the rank owning t has it; all-reduce SUM)
  loss = lse - (x_t - m)
With label smoothing e over C real classes (torch's definition):
  loss = (1 - e) * (lse - (x_t - m)) + e * (lse - mean_j (x_j - m))
Backward, locally: softmax - (1 - e) * onehot(t) - e / C, times the incoming gradient.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gptpar.tensor_parallel.comm import Group, group_rank, group_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, label_smoothing, vocab_size):
        v_local = logits.shape[-1]
        start = group_rank(group) * v_local
        x = logits.float()  # (..., V/tp), computed in fp32 whatever the input dtype
        padded = None
        if vocab_size is not None and start + v_local > vocab_size:
            padded = torch.arange(start, start + v_local, device=x.device) >= vocab_size  # (V/tp,)
            x = x.masked_fill(padded, float("-inf"))

        local_max = x.max(dim=-1).values
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        x = x - local_max.unsqueeze(-1)  # shifted logits, max 0

        outside = (target < start) | (target >= start + v_local)
        local_t = (target - start).masked_fill(outside, 0)
        target_logit = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = x.exp()
        sums = [target_logit, exp.sum(dim=-1)]
        if label_smoothing > 0:
            sums.append(x.masked_fill(padded, 0.0).sum(dim=-1) if padded is not None else x.sum(dim=-1))
        sums = torch.stack(sums)  # one all-reduce for all the sums
        dist.all_reduce(sums, group=group)
        lse = sums[1].log()
        loss = lse - sums[0]
        n_classes = vocab_size if vocab_size is not None else v_local * group_size(group)
        if label_smoothing > 0:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - sums[2] / n_classes)
        ignored = target == ignore_index
        loss = loss.masked_fill(ignored, 0.0)

        exp.div_(sums[1].unsqueeze(-1))  # softmax, in place
        ctx.save_for_backward(exp, local_t, outside, ignored, padded if padded is not None else torch.empty(0))
        ctx.label_smoothing, ctx.n_classes, ctx.has_padding = label_smoothing, n_classes, padded is not None
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, outside, ignored, padded = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax  # reuse the saved buffer: backward runs once
        onehot_value = (~outside).to(grad.dtype) * (1.0 - eps)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -onehot_value.unsqueeze(-1))
        if eps > 0:
            smooth = torch.full((grad.shape[-1],), eps / ctx.n_classes, dtype=grad.dtype, device=grad.device)
            if ctx.has_padding:
                smooth.masked_fill_(padded, 0.0)
            grad.sub_(smooth)
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None, None


class _CrossEntropy(torch.autograd.Function):
    """tp = 1 without label smoothing: F.cross_entropy(reduction='none'), with a backward that allocates nothing.

    Forward saves the log-probabilities, as F.cross_entropy does. Its backward would allocate a zero-filled
    (N, V) one-hot gradient and then a fresh (N, V) gradient; here the saved buffer becomes the gradient in
    place: exp(log p) * g, minus g at the target (two passes, no new (N, V) memory to fault in)."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index):
        logp = F.log_softmax(logits, dim=-1)  # (N, V)
        ignored = target == ignore_index
        safe = target.masked_fill(ignored, 0)
        loss = logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1).neg().masked_fill(ignored, 0.0)
        ctx.save_for_backward(logp, safe, ignored)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        logp, safe, ignored = ctx.saved_tensors
        g = grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1)  # (N, 1)
        grad = logp.exp_().mul_(g)  # softmax * g, reusing the saved buffer: backward runs once
        grad.scatter_add_(-1, safe.unsqueeze(-1), g.neg())
        return grad, None, None


class LogitsWorkspace:
    """A reusable (N, V) logits buffer for `linear_cross_entropy` (tp = 1, CPU).

    PyTorch has no caching allocator on the CPU: a fresh 400 MB logits buffer every step is mmapped and
    page-faulted in again (~100k faults; ~3 us of system time each on the benchmark machine). One forward's graph
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


_ROWS_PER_CHUNK = 32  # 32 x 50k fp32 logits = 6.4 MB: each row block's passes run in cache


class _LinearCrossEntropy(torch.autograd.Function):
    """Output layer + cross-entropy at tp = 1: loss_i = -log softmax(h_i W[:V]^T)[t_i].

    The (N, V) logits are written once by the GEMM and then turned into log-probabilities in place, block of
    rows by block of rows while in cache (torch's log_softmax writes a second (N, V) tensor); backward turns
    them into the logits' gradient in place and runs the two GEMMs. The weight's gradient covers all its rows
    (zeros past V), so a padded table needs no slice and no zero-filled copy."""

    @staticmethod
    def forward(ctx, hidden, weight, target, vocab_size, ignore_index, workspace):
        w = weight[:vocab_size]  # leading rows: a view
        shape = (hidden.shape[0], vocab_size)
        logits = (torch.mm(hidden, w.t(), out=workspace.take(shape, hidden.dtype, hidden.device))
                  if workspace is not None else torch.mm(hidden, w.t()))
        for block in logits.split(_ROWS_PER_CHUNK):
            block.sub_(torch.logsumexp(block, dim=-1, keepdim=True))  # log-probabilities, in place
        ignored = target == ignore_index
        safe = target.masked_fill(ignored, 0)
        loss = logits.gather(-1, safe.unsqueeze(-1)).squeeze(-1).neg().masked_fill(ignored, 0.0)
        ctx.save_for_backward(hidden, weight, logits, safe, ignored)
        ctx.vocab_size, ctx.workspace = vocab_size, workspace
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        hidden, weight, logp, safe, ignored = ctx.saved_tensors
        v = ctx.vocab_size
        g = grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1)  # (N, 1)
        for block, g_block in zip(logp.split(_ROWS_PER_CHUNK), g.split(_ROWS_PER_CHUNK)):
            block.exp_().mul_(g_block)  # softmax * g
        grad = logp
        grad.scatter_add_(-1, safe.unsqueeze(-1), g.neg())  # - g at the target
        grad_hidden = torch.mm(grad, weight[:v]) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.empty_like(weight)
            torch.mm(grad.t(), hidden, out=grad_weight[:v])
            grad_weight[v:].zero_()
        if ctx.workspace is not None:
            ctx.workspace.give_back(grad)
        return grad_hidden, grad_weight, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                         vocab_size: Optional[int] = None, ignore_index: int = -100,
                         workspace: Optional[LogitsWorkspace] = None) -> torch.Tensor:
    """Per-token cross-entropy of the logits `hidden @ weight[:vocab_size].T`, without tensor parallelism.

    hidden (..., h), weight (V_padded, h), target (...) -> fp32 losses of `target`'s shape; equal to
    `F.cross_entropy(F.linear(hidden, weight[:vocab_size]), target, reduction='none')`, with less memory
    traffic (see `_LinearCrossEntropy`). For fp32 inputs; `workspace` reuses the logits buffer across steps.
    """
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    flat = hidden.reshape(-1, hidden.shape[-1])
    loss = _LinearCrossEntropy.apply(flat, weight, target.reshape(-1), vocab_size, ignore_index, workspace)
    return loss.view(target.shape)


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, *, group: Group = None,
                                 ignore_index: int = -100, label_smoothing: float = 0.0,
                                 vocab_size: Optional[int] = None) -> torch.Tensor:
    """Per-token cross-entropy (shape of `target`, fp32) of logits split along the vocabulary.

    `logits_shard` (..., V/tp) holds vocab ids [rank*V/tp, (rank+1)*V/tp); `target` (...) holds global ids.
    Positions whose target is `ignore_index` get loss 0 and no gradient. `vocab_size` (optional) is the
    number of real classes: logits of padding ids >= vocab_size are left out of the softmax.
    With `group=None` this equals `F.cross_entropy(..., reduction='none')`.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if group_size(group) == 1:
        flat = logits_shard.reshape(-1, logits_shard.shape[-1])
        if vocab_size is not None:
            flat = flat[:, :vocab_size]  # a view: .float() below makes the one copy (none if fp32)
        flat = flat.float()
        if label_smoothing > 0:
            loss = F.cross_entropy(flat, target.reshape(-1), reduction="none", ignore_index=ignore_index,
                                   label_smoothing=label_smoothing)
        else:
            loss = _CrossEntropy.apply(flat, target.reshape(-1), ignore_index)
        return loss.view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits_shard, target, group, ignore_index, label_smoothing,
                                            vocab_size)
