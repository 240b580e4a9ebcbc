"""Pure formulas for model size, parameters per pipeline stage / tensor rank, FLOPs, TFLOPs and MFU.

One source for the trainer's log line (`tflops_per_gpu` every iteration: cheap, no torch) and for
the planning tools. The architecture is gptpar's pre-LN GPT-2 with a tied output embedding:

    per layer   LN(2h) + QKV(3h^2+3h) + proj(h^2+h) + LN(2h) + fc1(h*f+f) + fc2(f*h+h)
                = 12h^2 + 13h with f = 4h
    embedding   V_padded * h word embedding (+ its tied copy on the last stage when pp > 1)
                + max_position_embeddings * h position embedding (first stage; none with ALiBi)
                + 2h embedding LayerNorm (first stage, with embed_layernorm: BLOOM)
    final LN    2h (last stage)

BLOOM-176B (ALiBi, embedding LayerNorm): 70 (12h^2 + 13h) + V h + 4h = 176,247,271,424 with h = 14336,
V = 250880. ALiBi adds no multiply: the FLOP counts below hold for both position embedding types.

Under tensor parallelism QKV/fc1 are column-parallel (weight and bias split), proj/fc2 row-parallel
(weight split, bias replicated); LayerNorms and position embeddings are replicated; the word
embedding is split along the vocab. See docs/planning.md for the derivations and the checks against the
reference runs.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from gptpar.model.config import check_tp_divides, pad_vocab_size, recompute_mode
from gptpar.model.partition import PARTITION_METHODS, partition_layers, resolve_partition_method  # noqa: F401

FORMULAS = ("improved", "legacy")


# ---------------------------------------------------------------------------------------------
# Parameter counts
# ---------------------------------------------------------------------------------------------

def model_size_formula(num_layers: int, hidden_size: int, vocab_size: int, seq_length: int) -> int:
    """The 200B sizing notes' estimate `L*(12h^2+13h) + V*h + s*h + 2h` (one tied embedding, final LN)."""
    h = hidden_size
    return num_layers * (12 * h * h + 13 * h) + vocab_size * h + seq_length * h + 2 * h


def layer_params(hidden_size: int, ffn_hidden_size: Optional[int] = None, tp_size: int = 1) -> int:
    """Parameters of one transformer block held by one tensor-parallel rank (12h^2+13h at tp=1, f=4h)."""
    h, f = hidden_size, ffn_hidden_size or 4 * hidden_size
    split = (3 * h * h + 3 * h) + h * h + (h * f + f) + f * h   # QKV, proj weight, fc1, fc2 weight
    replicated = 2 * h + 2 * h + h + h                           # two LayerNorms, proj and fc2 biases
    check_tp_divides(tp_size, hidden_size=h, ffn_hidden_size=f)
    return split // tp_size + replicated


def input_embedding_extra_params(hidden_size: int, max_position_embeddings: int,
                                 position_embedding_type: str = "learned", embed_layernorm: bool = False) -> int:
    """What the input embedding holds beside the word embedding: the position table (learned positions; ALiBi
    has none) and the embedding LayerNorm's weight and bias (embed_layernorm)."""
    positions = max_position_embeddings * hidden_size if position_embedding_type == "learned" else 0
    return positions + (2 * hidden_size if embed_layernorm else 0)


def stage_layer_ranges(num_layers: int, pp_size: int, partition_method: str = "transformer",
                       embedding_weight: int = 1) -> List[Tuple[int, int]]:
    """Half-open [start, end) transformer-layer ranges of each pipeline stage (gptpar.model.partition's rule)."""
    plan = partition_layers(num_layers, pp_size, partition_method, embedding_weight)
    return [(s.first_layer, s.first_layer + s.num_layers) for s in plan.stages]


def params_per_stage(*, num_layers: int, hidden_size: int, vocab_size: int, seq_length: int,
                     pp_size: int = 1, tp_size: int = 1, partition_method: str = "transformer",
                     ffn_hidden_size: Optional[int] = None, max_position_embeddings: Optional[int] = None,
                     make_vocab_size_divisible_by: int = 128, per_tp_rank: bool = False,
                     embedding_weight: int = 1, position_embedding_type: str = "learned",
                     embed_layernorm: bool = False) -> List[int]:
    """Parameters of each pipeline stage: its unique tensors (default) or what one tp rank holds.

    The word embedding is padded for tp (Megatron's rule). With pp > 1 the last stage holds the tied
    copy of it, so sum(stages) = exact_model_params + V_padded*h. Per tp rank, split tensors count 1/tp
    and replicated ones (LayerNorms, row-parallel biases, position embedding) count whole.
    """
    h = hidden_size
    v = pad_vocab_size(vocab_size, tp_size, make_vocab_size_divisible_by)
    extra = input_embedding_extra_params(h, max_position_embeddings or seq_length, position_embedding_type,
                                         embed_layernorm)
    tp = tp_size if per_tp_rank else 1
    block = layer_params(h, ffn_hidden_size, tp)
    out = []
    for i, (start, end) in enumerate(stage_layer_ranges(num_layers, pp_size, partition_method, embedding_weight)):
        first, last = i == 0, i == pp_size - 1
        total = (end - start) * block
        if first:
            total += v * h // tp + extra
        if last:
            total += 2 * h + (v * h // tp if pp_size > 1 else 0)
        out.append(total)
    return out


def exact_model_params(*, num_layers: int, hidden_size: int, vocab_size: int, seq_length: int,
                       tp_size: int = 1, ffn_hidden_size: Optional[int] = None,
                       max_position_embeddings: Optional[int] = None, make_vocab_size_divisible_by: int = 128,
                       position_embedding_type: str = "learned", embed_layernorm: bool = False) -> int:
    """Unique parameters of the (unsharded) model with the padded vocab: what a meta-device build counts."""
    h = hidden_size
    v = pad_vocab_size(vocab_size, tp_size, make_vocab_size_divisible_by)
    return (num_layers * layer_params(h, ffn_hidden_size, 1) + v * h + 2 * h
            + input_embedding_extra_params(h, max_position_embeddings or seq_length, position_embedding_type,
                                           embed_layernorm))


def legacy_param_count(num_layers: int, hidden_size: int, tp_size: int = 1) -> int:
    """The non-embedding count behind the early 176B prequel tables' TFLOPs (Megatron-DeepSpeed, before PR 251).

    The reference summed the parameters one rank holds in its transformer blocks and multiplied by the
    model-parallel size (tp * pp). Replicated tensors (two LayerNorms = 4h, the row-parallel output
    biases = 2h per block) are thereby counted tp times: L*(12h^2+13h) + 6h*(tp-1)*L. Word/position
    embeddings and the final LayerNorm are not in it (the best fit to all 31 legacy rows of the 176B prequel log).
    """
    h = hidden_size
    return num_layers * (12 * h * h + 13 * h) + 6 * h * (tp_size - 1) * num_layers


# ---------------------------------------------------------------------------------------------
# FLOPs and TFLOPs
# ---------------------------------------------------------------------------------------------

def model_flops_per_iteration(*, num_layers: int, hidden_size: int, vocab_size: int, seq_length: int,
                              global_batch_size: int, recompute=True, formula: str = "improved",
                              glu: bool = False, tp_size: int = 1, ffn_hidden_size: Optional[int] = None) -> float:
    """FLOPs one training iteration performs (all GPUs together), counting recomputation when enabled.

    recompute: "none", "selective", "full", or a bool (True = full, False = none).
    improved (Narayanan et al. 2021, eq. 3, generalised): forward FLOPs per layer and token are
    8h^2 (QKV, proj) + 4sh (QK^T, AV) + 4hf (MLP; 6hf for GLU), times ckpt (4 = fwd + bwd (2x) +
    recomputed fwd with full recompute, 3 without); logits 2hV per token times 3 (never recomputed). With f = 4h,
    no GLU and full recompute this is exactly 96 B s L h^2 (1 + s/(6h) + V/(16Lh)); without recompute the vocab
    term becomes V/(12Lh) (the reference kept V/(16Lh), which undercounts). Selective recompute redoes only
    the attention core's forward: ckpt 3 plus the 4sh of QK^T and AV once more per layer and token (the
    softmax and dropout are not counted, like everywhere else here). vocab_size is used as given (pass the
    padded size).
    legacy: legacy_param_count * ckpt * 2 * s * B (the 176B prequel log's early tables; tp changes the count; a
    parameter count has no attention term, so selective counts as no recompute there).
    """
    if formula not in FORMULAS:
        raise ValueError(f"formula must be one of {FORMULAS}, got {formula!r}")
    mode = recompute_mode(recompute)
    ckpt = 4 if mode == "full" else 3
    b, s, L, h, v = global_batch_size, seq_length, num_layers, hidden_size, vocab_size
    if formula == "legacy":
        return float(legacy_param_count(L, h, tp_size)) * ckpt * 2 * s * b
    f = ffn_hidden_size or 4 * h
    mlp = (6 if glu else 4) * h * f
    per_token_layer = 8 * h * h + mlp + 4 * s * h     # forward multiply-adds x 2, one layer, one token
    selective = L * 4 * s * h if mode == "selective" else 0   # QK^T and AV forward again, in backward
    return float(b * s) * (ckpt * L * per_token_layer + selective + 3 * 2 * h * v)


def tflops_per_gpu(*, num_layers: int, hidden_size: int, vocab_size: int, seq_length: int,
                   global_batch_size: int, sec_per_iter: float, num_gpus: int, recompute=True,
                   formula: str = "improved", glu: bool = False, tp_size: int = 1,
                   ffn_hidden_size: Optional[int] = None) -> float:
    """Achieved model TFLOPs per GPU: model_flops_per_iteration / (sec_per_iter * num_gpus * 1e12)."""
    if sec_per_iter <= 0 or num_gpus < 1:
        raise ValueError(f"sec_per_iter must be > 0 and num_gpus >= 1, got {sec_per_iter}, {num_gpus}")
    flops = model_flops_per_iteration(num_layers=num_layers, hidden_size=hidden_size, vocab_size=vocab_size,
                                      seq_length=seq_length, global_batch_size=global_batch_size,
                                      recompute=recompute, formula=formula, glu=glu, tp_size=tp_size,
                                      ffn_hidden_size=ffn_hidden_size)
    return flops / (sec_per_iter * num_gpus * 1e12)


def tflops_from_param_count(params: float, *, seq_length: int, global_batch_size: int, sec_per_iter: float,
                            num_gpus: int, recompute: bool = True) -> float:
    """The 104B tune-up notes' one-liner (BigScience's math): params * ckpt * 2 * s * B / (sec * n * 1e12)."""
    return params * (4 if recompute else 3) * 2 * seq_length * global_batch_size / (sec_per_iter * num_gpus * 1e12)


def mfu(*, peak_tflops: float, **tflops_kwargs) -> float:
    """Model FLOPs utilisation: achieved TFLOPs per GPU / the GPU's peak (e.g. 312 for A100 bf16).

    Use recompute=False for the strict MFU definition (recomputation is not useful work).
    """
    if peak_tflops <= 0:
        raise ValueError(f"peak_tflops must be > 0, got {peak_tflops}")
    return tflops_per_gpu(**tflops_kwargs) / peak_tflops


__all__ = ["model_size_formula", "layer_params", "resolve_partition_method", "stage_layer_ranges", "params_per_stage", "exact_model_params",
           "input_embedding_extra_params",
           "legacy_param_count", "model_flops_per_iteration", "tflops_per_gpu", "tflops_from_param_count", "mfu",
           "PARTITION_METHODS", "FORMULAS"]
