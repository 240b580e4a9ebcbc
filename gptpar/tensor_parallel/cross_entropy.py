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
