"""Per-GPU memory estimate: weights, gradients, optimizer state, activations and a fixed CUDA context.

Pure arithmetic, shared by tools/memory.py, the topology planner and the dry-run report.

Model states (bytes per parameter held by the rank), Adam:
    precision   replicated on every dp rank            sharded by ZeRO-1 over dp
    bf16/fp16   2 (half weights) + 4 (fp32 grads)       12 (fp32 master weights, exp_avg, exp_avg_sq)
    fp32        4 (weights) + 4 (grads)                  8 (exp_avg, exp_avg_sq)
so mixed precision costs 18 bytes/param at dp=1 (seed 000). DeepSpeed's BF16 optimizer accumulates
grads in fp32 (the 4 above); its fp16 path keeps 2-byte grads plus a 4-byte fp32 partition, which we
fold into the same 18 (documented in docs/planning.md).

Activations (Korthikanti et al. 2022, "Reducing activation recomputation", no sequence parallelism),
per transformer layer and micro batch of b sequences, in bytes with 2-byte activations:
    full layer (none)       s*b*h * (10 + 24/tp + 5*a*s/(h*tp))
    selective recompute     s*b*h * (10 + 24/tp)   (the attention core's s x s tensors, 5*a*s^2*b/tp bytes, are
                                                    recomputed; the paper's 34/tp adds sequence parallelism)
    full recompute          2*s*b*h            (only the layer input is kept; recomputed in backward)
Stage 0 of a 1F1B pipeline keeps min(pp, m) micro batches in flight (m = micro batches per step);
one layer (full) or one attention core (selective) is rematerialised at a time on top. The last stage also
holds the fp32 logits and their gradient (2 * 4 * s*b*V/tp).
SDPA's flash and memory-efficient kernels never store the s x s tensors, so on them `none` holds what
`selective` does; the 5as/h term describes an unfused attention (and the seed runs').
"""
from __future__ import annotations

from typing import Dict, Optional

from gptpar.flops import params_per_stage, stage_layer_ranges
from gptpar.model.config import pad_vocab_size, recompute_mode

GIB = 1024 ** 3
PRECISIONS = ("fp32", "bf16", "fp16")
# What `nvidia-smi` shows before any tensor exists: seed 000 measured 1271 MiB (V100) and 1573 MiB (A100 40GB).
CUDA_CONTEXT_BYTES = 1573 * 1024 ** 2


def state_bytes_per_param(precision: str, zero_stage: int = 1, dp_size: int = 1) -> float:
    """Bytes of weights + gradients + Adam state per parameter on one GPU (18 for mixed precision, dp=1)."""
    if precision not in PRECISIONS:
        raise ValueError(f"training.precision must be one of {PRECISIONS}, got {precision!r}")
    if zero_stage not in (0, 1):
        raise ValueError(f"training.zero_stage {zero_stage} is not modelled: the pipeline engine allows 0 or 1")
    if dp_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {dp_size}")
    replicated, sharded = (8, 8) if precision == "fp32" else (6, 12)
    return replicated + sharded / (dp_size if zero_stage == 1 else 1)


def model_state_bytes(params: int, precision: str, zero_stage: int = 1, dp_size: int = 1) -> Dict[str, float]:
    """Weights, gradients and optimizer bytes of `params` parameters on one GPU."""
    total = params * state_bytes_per_param(precision, zero_stage, dp_size)
    weights = params * (4 if precision == "fp32" else 2)
    grads = params * 4
    return {"weights": weights, "gradients": grads, "optimizer": total - weights - grads, "total": total}


def activation_bytes(*, seq_length: int, micro_batch_size: int, hidden_size: int, num_attention_heads: int,
                     layers_on_stage: int, tp_size: int = 1, pp_size: int = 1, num_micro_batches: int = 1,
                     activation_checkpointing=True, stage: int = 0,
                     vocab_size: Optional[int] = None) -> float:
    """Peak activation bytes of one pipeline stage (stage 0 is the worst: most micro batches in flight).

    activation_checkpointing: "none" | "selective" | "full" or a bool (True = full, False = none).
    vocab_size (padded) adds the fp32 logits + their gradient; pass it for the stage computing the loss.
    """
    s, b, h, a, t = seq_length, micro_batch_size, hidden_size, num_attention_heads, tp_size
    attention_core = s * b * h * 5 * a * s / (h * t)     # softmax input/output, dropout mask and output
    full_layer = s * b * h * (10 + 24 / t) + attention_core
    in_flight = max(1, min(pp_size - stage, num_micro_batches))
    mode = recompute_mode(activation_checkpointing)
    if mode == "full":
        per_mb = layers_on_stage * 2 * s * b * h
        total = in_flight * per_mb + full_layer          # + the layer being recomputed
    elif mode == "selective":
        total = in_flight * layers_on_stage * (full_layer - attention_core) + attention_core   # + one core
    else:
        total = in_flight * layers_on_stage * full_layer
    if vocab_size:
        total += 2 * 4 * s * b * vocab_size / t
    return total


def memory_per_gpu(*, num_layers: int, hidden_size: int, num_attention_heads: int, vocab_size: int,
                   seq_length: int, micro_batch_size: int, global_batch_size: int, tp_size: int = 1,
                   pp_size: int = 1, dp_size: int = 1, partition_method: str = "transformer",
                   precision: str = "bf16", zero_stage: int = 1, activation_checkpointing=True,
                   ffn_hidden_size: Optional[int] = None, make_vocab_size_divisible_by: int = 128,
                   max_position_embeddings: Optional[int] = None,
                   cuda_context_bytes: float = CUDA_CONTEXT_BYTES, embedding_weight: int = 1) -> Dict[str, dict]:
    """Bytes per GPU for every pipeline stage and for the heaviest one.

    Returns {"stages": [{"stage", "params", "weights", "gradients", "optimizer", "activations",
    "cuda_context", "total"}...], "max": <the stage dict with the largest total>}.
    """
    if global_batch_size % (micro_batch_size * dp_size):
        raise ValueError(f"global_batch_size ({global_batch_size}) must divide by micro_batch_size x dp "
                         f"({micro_batch_size} x {dp_size})")
    m = global_batch_size // (micro_batch_size * dp_size)
    per_rank = params_per_stage(num_layers=num_layers, hidden_size=hidden_size, vocab_size=vocab_size,
                                seq_length=seq_length, pp_size=pp_size, tp_size=tp_size,
                                partition_method=partition_method, ffn_hidden_size=ffn_hidden_size,
                                max_position_embeddings=max_position_embeddings,
                                make_vocab_size_divisible_by=make_vocab_size_divisible_by, per_tp_rank=True,
                                embedding_weight=embedding_weight)
    ranges = stage_layer_ranges(num_layers, pp_size, partition_method, embedding_weight)
    v_pad = pad_vocab_size(vocab_size, tp_size, make_vocab_size_divisible_by)
    stages = []
    for i, (params, (start, end)) in enumerate(zip(per_rank, ranges)):
        st = model_state_bytes(params, precision, zero_stage, dp_size)
        act = activation_bytes(seq_length=seq_length, micro_batch_size=micro_batch_size, hidden_size=hidden_size,
                               num_attention_heads=num_attention_heads, layers_on_stage=end - start,
                               tp_size=tp_size, pp_size=pp_size, num_micro_batches=m,
                               activation_checkpointing=activation_checkpointing, stage=i,
                               vocab_size=v_pad if i == pp_size - 1 else None)
        stages.append({"stage": i, "params": params, "weights": st["weights"], "gradients": st["gradients"],
                       "optimizer": st["optimizer"], "activations": act, "cuda_context": cuda_context_bytes,
                       "total": st["total"] + act + cuda_context_bytes})
    return {"stages": stages, "max": max(stages, key=lambda d: d["total"])}


__all__ = ["GIB", "PRECISIONS", "CUDA_CONTEXT_BYTES", "state_bytes_per_param", "model_state_bytes",
           "activation_bytes", "memory_per_gpu"]
