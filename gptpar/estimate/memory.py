"""Per-GPU memory estimate: weights, gradients, optimizer state, activations and a fixed CUDA context.

Pure arithmetic, shared by tools/memory.py, the topology planner and the dry-run report.

Model states: bytes per parameter that DeepSpeed holds on one rank at the optimizer step (their peak),
with the client AdamW gptpar passes (`training.optimizer=adamw`). Measured on CPU with the real optimizers
(tests/integration/test_precision.py reads every tensor the engine holds and compares with this table):

    precision, ZeRO   weights  grads (until the step)        sharded over dp (ZeRO-1)                 dp = 1
    fp32, 0           4        4                             - (Adam's 8 replicated)                  16
    fp32, 1           4        4                             4 master copy + 8 Adam + 4 grad partition  24
    bf16 (always 1)   2        4 fp32 accumulation           4 master + 8 Adam                        18
    fp16 (always 1)   2        2                             4 master + 8 Adam + 4 fp32 grad partition  20

fp8 holds bf16's model states exactly (to DeepSpeed it is bf16: gptpar.config.deepspeed_precision) and the
same activations (torchao's float8 GEMM keeps its bf16 input and weight for backward, as F.linear does, and a padded
GEMM keeps only its padded input); its float8 casts are transient, one GEMM's at a time:
`float8_casts` per stage = gptpar.tensor_parallel.float8_shapes.float8_cast_bytes of the layer's largest GEMM, plus, for
recipe tensorwise (the default), the weight casts cached per optimizer step (float8_weight_cache_bytes per layer on
the stage, 1 byte per weight element), whose GEMMs then cast no weight of their own; rowwise casts its weights in
every GEMM and caches none.

bf16 is DeepSpeed's BF16_Optimizer (`data_types.grad_accum_dtype = fp32`, `bf16.immediate_grad_update`): each
bf16 gradient is added into a full fp32 buffer as autograd produces it and freed, so the 4 gradient bytes are
not sharded - the 200B sizing notes' 18 bytes at dp = 1. Mixed precision always runs at ZeRO-1 (a zero_stage of 0 is
promoted, see gptpar.config); fp16 keeps its 2-byte gradients until the step, 2 more than the
notes' 18. Between steps the gradients are freed (bf16 keeps its fp32 buffer): 4 (fp32) and 2 + 4/dp (fp16) less.

`training.optimizer=adamw8bit` (bitsandbytes' AdamW8bit) replaces Adam's 8 bytes by its two uint8 moments and
one fp32 scale per 256-element block of each: 2 + 2*4/256 = 2.03 bytes, sharded or replicated as Adam's were
(so bf16 at dp = 1 holds 12.03 instead of 18). bitsandbytes keeps fp32 moments for tensors under 4096 elements;
under ZeRO-1 the optimizer steps on flat partitions, so that never applies, without ZeRO it applies to biases
and LayerNorms, a negligible share of a large model (the estimate ignores it).

Activations (Korthikanti et al. 2022, "Reducing activation recomputation", no sequence parallelism),
per transformer layer and micro batch of b sequences, in bytes with 2-byte activations:
    full layer (none)       s*b*h * (10 + 24/tp + 5*a*s/(h*tp))
    selective recompute     s*b*h * (10 + 24/tp)   (the attention core's s x s tensors, 5*a*s^2*b/tp bytes, are
                                                    recomputed; the paper's 34/tp adds sequence parallelism)
    full recompute          2*s*b*h            (only the layer input is kept; recomputed in backward)
Stage 0 of a 1F1B pipeline keeps min(pp, m) micro batches in flight (m = micro batches per step);
one layer (full) or one attention core (selective) is rematerialised at a time on top. The last stage also
holds the fp32 logits and their gradient (2 * 4 * s*b*V/tp).
ALiBi adds its bias to the attention core: 2*a*s^2/tp bytes per micro batch under a causal mask (b times that
with an explicit per-sample mask, not modelled).
SDPA's flash and memory-efficient kernels never store the s x s tensors, so on them `none` holds what
`selective` does; the 5as/h term describes an unfused attention (and the 176B prequel log's runs).
"""
from __future__ import annotations

from typing import Dict, Optional

from gptpar.estimate.flops import params_per_stage, stage_layer_ranges
from gptpar.model.config import pad_vocab_size, recompute_mode
from gptpar.tensor_parallel.float8_shapes import float8_cast_bytes, float8_weight_cache_bytes, layer_float8_gemms
from gptpar.config import PRECISIONS, deepspeed_precision

GIB = 1024 ** 3
# What `nvidia-smi` shows before any tensor exists: the A100 40GB figure of the 200B sizing notes (docs/planning.md).
CUDA_CONTEXT_BYTES = 1573 * 1024 ** 2


# (weights, gradients that every dp rank holds, the wrapper's bytes ZeRO-1 shards over dp: fp32 master copy and
# fp32 gradient partition) per parameter; see the table above. The optimizer's moments come on top.
_STATES = {("fp32", 0): (4, 4, 0), ("fp32", 1): (4, 4, 8), ("bf16", 1): (2, 4, 4), ("fp16", 1): (2, 2, 8)}
# The client optimizer's own state per parameter (training.optimizer): sharded at ZeRO-1, else replicated.
MOMENT_BYTES = {"adamw": 8.0,                    # exp_avg, exp_avg_sq in fp32
                "adamw8bit": 2 + 2 * 4 / 256}    # both in uint8, plus an fp32 absmax per 256-element block each


def _states(precision: str, zero_stage: int, dp_size: int, optimizer: str = "adamw"):
    if precision not in PRECISIONS:
        raise ValueError(f"training.precision must be one of {PRECISIONS}, got {precision!r}")
    if zero_stage not in (0, 1):
        raise ValueError(f"training.zero_stage {zero_stage} is not modelled: the pipeline engine allows 0 or 1")
    if dp_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {dp_size}")
    if optimizer not in MOMENT_BYTES:
        raise ValueError(f"training.optimizer must be one of {sorted(MOMENT_BYTES)}, got {optimizer!r}")
    precision = deepspeed_precision(precision)  # fp8's model states are bf16's
    if precision != "fp32":
        zero_stage = 1  # as the trainer runs mixed precision (gptpar.config)
    weights, grads, sharded = _STATES[precision, zero_stage]
    moments = MOMENT_BYTES[optimizer]
    optimizer_bytes = (sharded + moments) / dp_size if zero_stage == 1 else moments
    return weights, grads, optimizer_bytes


def state_bytes_per_param(precision: str, zero_stage: int = 1, dp_size: int = 1, optimizer: str = "adamw") -> float:
    """Bytes of weights + gradients + optimizer state per parameter on one GPU at the step (18 for bf16, dp=1)."""
    return sum(_states(precision, zero_stage, dp_size, optimizer))


def model_state_bytes(params: int, precision: str, zero_stage: int = 1, dp_size: int = 1,
                      optimizer: str = "adamw") -> Dict[str, float]:
    """Weights, gradients and optimizer bytes of `params` parameters on one GPU."""
    weights, grads, optimizer = _states(precision, zero_stage, dp_size, optimizer)
    return {"weights": params * weights, "gradients": params * grads, "optimizer": params * optimizer,
            "total": params * (weights + grads + optimizer)}


def activation_bytes(*, seq_length: int, micro_batch_size: int, hidden_size: int, num_attention_heads: int,
                     layers_on_stage: int, tp_size: int = 1, pp_size: int = 1, num_micro_batches: int = 1,
                     activation_checkpointing=True, stage: int = 0,
                     vocab_size: Optional[int] = None, alibi: bool = False) -> float:
    """Peak activation bytes of one pipeline stage (stage 0 is the worst: most micro batches in flight).

    activation_checkpointing: "none" | "selective" | "full" or a bool (True = full, False = none).
    vocab_size (padded) adds the fp32 logits + their gradient; pass it for the stage computing the loss.
    """
    s, b, h, a, t = seq_length, micro_batch_size, hidden_size, num_attention_heads, tp_size
    attention_core = s * b * h * 5 * a * s / (h * t)     # softmax input/output, dropout mask and output
    if alibi:  # + the ALiBi bias SDPA keeps, (a/tp, s, s) in 2 bytes shared by the micro batch; rebuilt with the core
        attention_core += 2 * a * s * s / t
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
                   precision: str = "bf16", zero_stage: int = 1, optimizer: str = "adamw",
                   activation_checkpointing=True, fp8_recipe: str = "tensorwise",
                   ffn_hidden_size: Optional[int] = None, make_vocab_size_divisible_by: int = 128,
                   max_position_embeddings: Optional[int] = None,
                   cuda_context_bytes: float = CUDA_CONTEXT_BYTES, embedding_weight: int = 1,
                   position_embedding_type: str = "learned", embed_layernorm: bool = False) -> Dict[str, dict]:
    """Bytes per GPU for every pipeline stage and for the heaviest one.

    Returns {"stages": [{"stage", "params", "weights", "gradients", "optimizer", "activations", "float8_casts",
    "cuda_context", "total"}...], "max": <the stage dict with the largest total>}; float8_casts is 0 unless
    precision is fp8.
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
                                embedding_weight=embedding_weight,
                                position_embedding_type=position_embedding_type, embed_layernorm=embed_layernorm)
    ranges = stage_layer_ranges(num_layers, pp_size, partition_method, embedding_weight)
    v_pad = pad_vocab_size(vocab_size, tp_size, make_vocab_size_divisible_by)
    casts = cache = 0
    if precision == "fp8":
        gemms = layer_float8_gemms(hidden_size, ffn_hidden_size or 4 * hidden_size, tp_size)
        cached = fp8_recipe == "tensorwise"  # Float8Matmul.caches_weights
        casts = float8_cast_bytes(gemms, micro_batch_size * seq_length, weights_cached=cached)
        cache = float8_weight_cache_bytes(gemms) if cached else 0
    stages = []
    for i, (params, (start, end)) in enumerate(zip(per_rank, ranges)):
        st = model_state_bytes(params, precision, zero_stage, dp_size, optimizer)
        f8 = casts + cache * (end - start)
        act = activation_bytes(seq_length=seq_length, micro_batch_size=micro_batch_size, hidden_size=hidden_size,
                               num_attention_heads=num_attention_heads, layers_on_stage=end - start,
                               tp_size=tp_size, pp_size=pp_size, num_micro_batches=m,
                               activation_checkpointing=activation_checkpointing, stage=i,
                               alibi=position_embedding_type == "alibi",
                               vocab_size=v_pad if i == pp_size - 1 else None)
        stages.append({"stage": i, "params": params, "weights": st["weights"], "gradients": st["gradients"],
                       "optimizer": st["optimizer"], "activations": act, "float8_casts": f8,
                       "cuda_context": cuda_context_bytes, "total": st["total"] + act + f8 + cuda_context_bytes})
    return {"stages": stages, "max": max(stages, key=lambda d: d["total"])}


__all__ = ["GIB", "PRECISIONS", "MOMENT_BYTES", "CUDA_CONTEXT_BYTES", "state_bytes_per_param", "model_state_bytes",
           "activation_bytes", "memory_per_gpu"]
