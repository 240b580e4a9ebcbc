"""ALiBi (Press et al. 2021, "Train short, test long"), as BLOOM trained it: no position embedding; each head h
adds slope_h * (key position - query position) to its attention scores, a penalty growing with distance.

Slopes (BLOOM / Hugging Face's `BloomForCausalLM`): for n heads, n a power of two, head i gets 2^(-8(i+1)/n); for
other n, the n' = 2^floor(log2 n) slopes of n' heads, followed by every other slope of 2n' heads (its 1st, 3rd,
...) until there are n. Under tensor parallelism rank r holds heads [r n/tp, (r+1) n/tp) and must use exactly
those heads' slopes: using slopes [0, n/tp) on every rank was Megatron-DeepSpeed#227.

The bias is built from query and key positions, so a query block that is not square with the keys works: with
q_len queries and k_len keys, the queries sit at the last positions k_len - q_len .. k_len - 1 (a KV cache).
BLOOM's own code adds slope * key position only; per query row that differs from slope * (key - query) by a
constant, which the softmax ignores, so the two give the same attention. Position ids are not read: distances
come from the token order, and with `reset_attention_mask` the mask keeps documents apart.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch


def alibi_slopes(num_heads: int) -> List[float]:
    """The slopes of all `num_heads` heads, in head order."""
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * i / closest) for i in range(1, closest + 1)]
    extra = [2.0 ** (-8.0 * i / (2 * closest)) for i in range(1, 2 * closest + 1, 2)]
    return slopes + extra[:num_heads - closest]


def rank_alibi_slopes(num_heads: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """fp32 slopes (num_heads / tp,) of the heads tensor-parallel rank `tp_rank` holds."""
    per_rank = num_heads // tp_size
    return torch.tensor(alibi_slopes(num_heads)[tp_rank * per_rank:(tp_rank + 1) * per_rank],
                        dtype=torch.float32)


def alibi_attention_bias(slopes: torch.Tensor, q_len: int, k_len: int, mask: Optional[torch.Tensor],
                         dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask SDPA takes: ALiBi's bias with the attention mask folded in as -inf.

    slopes (nh,) fp32 on the attention's device; mask None (causal) or boolean (b, 1, q_len, k_len), True =
    may attend. Returns (1 or b, nh, q_len, k_len) in `dtype` (built in fp32, like Hugging Face's BLOOM).
    """
    device = slopes.device
    k_pos = torch.arange(k_len, device=device)
    q_pos = torch.arange(k_len - q_len, k_len, device=device)
    distance = (k_pos[None, :] - q_pos[:, None]).float()  # (q, k), <= 0 where causal attention may look
    bias = (slopes[:, None, None] * distance).unsqueeze(0)  # (1, nh, q, k)
    allowed = (distance <= 0) if mask is None else mask
    return bias.masked_fill(~allowed, float("-inf")).to(dtype)
