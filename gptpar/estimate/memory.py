"""Per-GPU memory estimate: weights, gradients, optimizer state, activations, the allocator's reserve and a CUDA
context, per pipeline stage at the steady state (docs/planning.md, Memory, has every term with its sources).

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

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198:
34sbh + 5as^2b bytes per layer and micro batch of b sequences, 2-byte activations, 1-byte dropout masks),
with tensor parallelism t and an FFN of width f (4h in the paper: 4*s*b*f/(t*s*b*h) = 16/t):
    kept by every layer     s*b*h * (10/t_sp + (8 + 4f/h)/t)      t_sp = t with sequence parallelism, else 1
                            (10 = the two LayerNorm inputs, the QKV and MLP inputs and the two dropout masks:
                             replicated over tp unless sequence parallelism shards them; 34/t with it at f = 4h)
    attention core          5*a*s^2*b/t  (softmax output, its dropout mask and output) - only an unfused
                            attention stores it; gptpar's SDPA (flash / memory-efficient) never does
    none                    every layer keeps both
    selective               every layer keeps the first; one core is rebuilt at a time in backward
    full                    every layer keeps its input, 2*s*b*h/t_sp; one whole layer is rebuilt at a time
Micro batches in flight on stage i: min(pp - i, m) for 1F1B (m = micro batches per step); with Megatron's
interleaved schedule of v model chunks per rank ((pp - i - 1)*2 + (v - 1)*pp + 1)/v micro batches' worth of the
stage's layers (stage 0: pp + (pp - 1)/v, the paper's L*(1 + (p - 1)/(p*m))), never more than m.
DeepSpeed's pipeline engine also keeps each in-flight micro batch's stage output until its backward (the next
stage's input, stored by no layer of this one): 2*s*b*h/t_sp per micro batch (per chunk when interleaved) on every
stage but the last. The last stage holds the logits, 2*s*b*V/t in the activation dtype: gptpar's vocab-parallel
cross-entropy makes no fp32 copy of them and writes their gradient into the same buffer
(gptpar.tensor_parallel.cross_entropy). fp32 training doubles every activation byte (masks too: a
slight overcount).
ALiBi adds its bias to the attention core: 2*a*s^2/t bytes per micro batch under a causal mask (b times that
with an explicit per-sample mask, not modelled); SDPA's memory-efficient kernel takes and keeps it.

The peak is the largest of the step's phases, each on top of the model states (which all exist from the first
optimizer step on: the steady state):
    forward/backward   + activations (+ pipe buffers, logits) + float8 casts
                       + 2 bytes/param of half-precision gradients when bf16 keeps them until the micro batch's
                         backward ends (DeepSpeed's default; gptpar sets bf16.immediate_grad_update: one at a time)
    dp reduction       + one flattened gradient bucket: DeepSpeed's pipeline engine reduces the gradients in
                         buckets of MEMORY_OPT_ALLREDUCE_SIZE = 5e8 elements (fp32 under bf16), copying each
and the allocator's reserve (PyTorch's caching allocator: segments it holds beyond the allocated peak,
ALLOCATOR_RESERVE_FRACTION of it, from gptpar's measured runs) and the CUDA context come on top: `total` is what
nvidia-smi shows, `peak_allocated` what torch.cuda.max_memory_allocated reports.
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


# What PyTorch's caching allocator holds beyond the allocated peak, as a fraction of it: the middle of the range
# gptpar's measured GPU runs reserved (docs/planning.md, Memory; tests/unit/test_memory.py reads the runs and checks
# it lies within). Not allocated, but not free to the job either.
ALLOCATOR_RESERVE_FRACTION = 0.08
# DeepSpeed's pipeline engine reduces the gradients over dp in flattened buckets of this many elements
# (deepspeed.runtime.engine.MEMORY_OPT_ALLREDUCE_SIZE): one bucket's copy exists at a time.
REDUCE_BUCKET_ELEMENTS = 500_000_000
# Bytes of one activation element per training precision (fp8's GEMMs keep bf16 inputs, see above).
ACTIVATION_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}
# Bytes per gradient element the dp reduction flattens: fp32 under bf16 (gptpar reduces in fp32), else the grads'.
_BUCKET_BYTES = {"fp32": 4, "bf16": 4, "fp16": 2}


def micro_batches_in_flight(pp_size: int, stage: int, num_micro_batches: int, virtual_stages: int = 1) -> float:
    """Micro batches whose activations stage `stage` holds at once, in units of the stage's whole set of layers.

    1F1B (virtual_stages 1, what gptpar runs): min(pp - stage, m). Megatron's interleaved schedule with v model
    chunks per rank runs (pp - stage - 1)*2 + (v - 1)*pp warm-up chunk forwards and one more before its first
    backward, each over 1/v of the stage's layers: ((pp - stage - 1)*2 + (v - 1)*pp + 1)/v (stage 0: pp + (pp-1)/v,
    Korthikanti et al.'s L*(1 + (p - 1)/(p*m))); never more than all m micro batches."""
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
    m = max(1, num_micro_batches)
    if virtual_stages == 1 or pp_size == 1:
        return float(max(1, min(pp_size - stage, m)))
    v = virtual_stages
    return min(((pp_size - stage - 1) * 2 + (v - 1) * pp_size + 1) / v, float(m))


def layer_activation_bytes(*, seq_length: int, micro_batch_size: int, hidden_size: int, num_attention_heads: int,
                           tp_size: int = 1, ffn_hidden_size: Optional[int] = None, sequence_parallel: bool = False,
                           flash_attention: bool = False, alibi: bool = False) -> Dict[str, float]:
    """One transformer layer's activations for one micro batch, in bytes of 2-byte activations (Korthikanti et al.
    2022): {"kept": what every layer keeps whatever the attention, "core": the attention core's s x s tensors (0
    with flash attention, + the ALiBi bias), "input": the layer input full recompute keeps}."""
    s, b, h, a, t = seq_length, micro_batch_size, hidden_size, num_attention_heads, tp_size
    f = ffn_hidden_size or 4 * h
    t_sp = t if sequence_parallel else 1
    sbh = s * b * h
    # 10 replicated (or sequence-sharded) + QKV's Q, K, V and the projection input (8) + the FFN's two (4f/h)
    kept = sbh * 10 / t_sp + (8 * sbh + 4 * s * b * f) / t
    core = 0.0 if flash_attention else 5 * a * s * s * b / t
    if alibi:  # the bias SDPA keeps, (a/tp, s, s) in 2 bytes shared by the micro batch; rebuilt with the core
        core += 2 * a * s * s / t
    return {"kept": kept, "core": core, "input": 2 * sbh / t_sp}


def activation_bytes(*, seq_length: int, micro_batch_size: int, hidden_size: int, num_attention_heads: int,
                     layers_on_stage: int, tp_size: int = 1, pp_size: int = 1, num_micro_batches: int = 1,
                     activation_checkpointing=True, stage: int = 0,
                     vocab_size: Optional[int] = None, alibi: bool = False, sequence_parallel: bool = False,
                     flash_attention: bool = False, virtual_stages: int = 1,
                     ffn_hidden_size: Optional[int] = None) -> float:
    """Peak activation bytes (2-byte activations) of one pipeline stage (stage 0 is the worst: most micro
    batches in flight).

    activation_checkpointing: "none" | "selective" | "full" or a bool (True = full, False = none).
    vocab_size (padded) adds the logits, 2*s*b*V/tp; pass it for the stage computing the loss.
    flash_attention: the attention stores no s x s tensors (gptpar's SDPA; memory_per_gpu's default); False is the
    paper's unfused attention. The pipeline engine's output buffers are memory_per_gpu's `pipe_buffers`.
    """
    layer = layer_activation_bytes(seq_length=seq_length, micro_batch_size=micro_batch_size,
                                   hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                                   tp_size=tp_size, ffn_hidden_size=ffn_hidden_size,
                                   sequence_parallel=sequence_parallel, flash_attention=flash_attention, alibi=alibi)
    kept, core = layer["kept"], layer["core"]
    in_flight = micro_batches_in_flight(pp_size, stage, num_micro_batches, virtual_stages)
    mode = recompute_mode(activation_checkpointing)
    if mode == "full":
        total = in_flight * layers_on_stage * layer["input"] + kept + core   # + the layer being recomputed
    elif mode == "selective":
        total = in_flight * layers_on_stage * kept + core                   # + one core rebuilt at a time
    else:
        total = in_flight * layers_on_stage * (kept + core)
    if vocab_size:
        total += 2 * seq_length * micro_batch_size * vocab_size / tp_size
    return total


def memory_per_gpu(*, num_layers: int, hidden_size: int, num_attention_heads: int, vocab_size: int,
                   seq_length: int, micro_batch_size: int, global_batch_size: int, tp_size: int = 1,
                   pp_size: int = 1, dp_size: int = 1, partition_method: str = "transformer",
                   precision: str = "bf16", zero_stage: int = 1, optimizer: str = "adamw",
                   activation_checkpointing=True, fp8_recipe: str = "tensorwise",
                   ffn_hidden_size: Optional[int] = None, make_vocab_size_divisible_by: int = 128,
                   max_position_embeddings: Optional[int] = None,
                   cuda_context_bytes: float = CUDA_CONTEXT_BYTES, embedding_weight: int = 1,
                   position_embedding_type: str = "learned", embed_layernorm: bool = False,
                   sequence_parallel: bool = False, virtual_stages: int = 1, flash_attention: bool = True,
                   immediate_grad_update: bool = True,
                   allocator_reserve_fraction: float = ALLOCATOR_RESERVE_FRACTION) -> Dict[str, dict]:
    """Bytes per GPU for every pipeline stage and for the heaviest one, at the steady state (after the first
    optimizer step: every optimizer state exists).

    sequence_parallel (parallel.sequence_parallel) shards the LayerNorm/dropout activations and the pipeline's
    buffers over tp; virtual_stages > 1 prices Megatron's interleaved schedule (a what-if: gptpar runs 1F1B);
    flash_attention False prices an unfused attention (Megatron's fused softmax: the 176B prequel's runs);
    immediate_grad_update False keeps bf16's half-precision gradients to the end of each backward (DeepSpeed's
    default, BLOOM's BF16_Optimizer); allocator_reserve_fraction: see ALLOCATOR_RESERVE_FRACTION.

    Returns {"stages": [{"stage", "params", "weights", "gradients", "optimizer", "activations", "pipe_buffers",
    "half_gradients", "reduce_bucket", "float8_casts", "peak_allocated", "allocator_reserve", "cuda_context",
    "total"}...], "max": <the stage dict with the largest total>}. peak_allocated = weights + gradients + optimizer
    + float8_casts + max(activations + pipe_buffers + half_gradients, reduce_bucket) (the forward/backward and the
    dp-reduction phases); total = peak_allocated + allocator_reserve + cuda_context. float8_casts is 0 unless
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
    if virtual_stages > 1 and any((end - start) % virtual_stages for start, end in ranges):
        raise ValueError(f"virtual_stages {virtual_stages} must divide every stage's layers "
                         f"({[end - start for start, end in ranges]})")
    v_pad = pad_vocab_size(vocab_size, tp_size, make_vocab_size_divisible_by)
    casts = cache = 0
    if precision == "fp8":
        gemms = layer_float8_gemms(hidden_size, ffn_hidden_size or 4 * hidden_size, tp_size)
        cached = fp8_recipe == "tensorwise"  # Float8Matmul.caches_weights
        casts = float8_cast_bytes(gemms, micro_batch_size * seq_length, weights_cached=cached)
        cache = float8_weight_cache_bytes(gemms) if cached else 0
    scale = ACTIVATION_ELEMENT_BYTES.get(precision, 2) / 2     # the formulas count 2-byte activations
    ds_precision = deepspeed_precision(precision) if precision in PRECISIONS else precision
    t_sp = tp_size if sequence_parallel else 1
    stages = []
    for i, (params, (start, end)) in enumerate(zip(per_rank, ranges)):
        st = model_state_bytes(params, precision, zero_stage, dp_size, optimizer)
        f8 = casts + cache * (end - start)
        act = scale * activation_bytes(
            seq_length=seq_length, micro_batch_size=micro_batch_size, hidden_size=hidden_size,
            num_attention_heads=num_attention_heads, layers_on_stage=end - start, tp_size=tp_size,
            pp_size=pp_size, num_micro_batches=m, activation_checkpointing=activation_checkpointing, stage=i,
            alibi=position_embedding_type == "alibi", vocab_size=v_pad if i == pp_size - 1 else None,
            sequence_parallel=sequence_parallel, flash_attention=flash_attention, virtual_stages=virtual_stages,
            ffn_hidden_size=ffn_hidden_size)
        pipe = 0.0
        if i < pp_size - 1:   # each in-flight micro batch's (chunk's) stage output, kept for its backward
            chunks = micro_batches_in_flight(pp_size, i, m, virtual_stages) * virtual_stages
            pipe = scale * chunks * 2 * seq_length * micro_batch_size * hidden_size / t_sp
        half_grads = 2 * params if ds_precision == "bf16" and not immediate_grad_update else 0
        bucket = _BUCKET_BYTES[ds_precision] * min(params, REDUCE_BUCKET_ELEMENTS)
        peak = st["total"] + f8 + max(act + pipe + half_grads, bucket)
        reserve = allocator_reserve_fraction * peak
        stages.append({"stage": i, "params": params, "weights": st["weights"], "gradients": st["gradients"],
                       "optimizer": st["optimizer"], "activations": act, "pipe_buffers": pipe,
                       "half_gradients": half_grads, "reduce_bucket": bucket, "float8_casts": f8,
                       "peak_allocated": peak, "allocator_reserve": reserve, "cuda_context": cuda_context_bytes,
                       "total": peak + reserve + cuda_context_bytes})
    return {"stages": stages, "max": max(stages, key=lambda d: d["total"])}


__all__ = ["GIB", "PRECISIONS", "MOMENT_BYTES", "CUDA_CONTEXT_BYTES", "ALLOCATOR_RESERVE_FRACTION",
           "REDUCE_BUCKET_ELEMENTS", "state_bytes_per_param", "model_state_bytes", "micro_batches_in_flight",
           "layer_activation_bytes", "activation_bytes", "memory_per_gpu"]
