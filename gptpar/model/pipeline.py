"""Pipeline stages on DeepSpeed's `PipelineModule`, with balanced embedding placement.

The layer list is
    [GPTEmbedding (tied 'embed'), (EmbeddingWeightUnit x (w-1)), TransformerLayer x L, FinalLayerNorm,
     (EmbeddingWeightUnit x (w-1)), GPTEmbedding (tied 'embed', forward_fn=lm_logits)]

Partition methods: see gptpar/model/partition.py (the pure rule; DeepSpeed's partitioner is checked to
agree with it after every build). An embedding weight w > 1 is expressed to DeepSpeed's own type-based partitioner with w - 1 parameterless
`EmbeddingWeightUnit` markers beside each embedding: the smallest override that needs no DeepSpeed patch.
Zero-weight layers (the final LayerNorm) stay with the preceding stage, as DeepSpeed's tie-break does.
"""
from __future__ import annotations

import functools
from typing import Dict, List

import torch.nn as nn

from gptpar.model.config import GPTConfig, recompute_mode
from gptpar.model.gpt import FinalLayerNorm, GPTEmbedding, GPTLoss, TransformerLayer, lm_logits
from gptpar.model.partition import (PARTITION_METHODS, PartitionPlan, StagePlan,  # noqa: F401 (re-exported)
                                    partition_layers, resolve_partition_method)
from gptpar.parallel import check_topology_agrees
from gptpar.tensor_parallel.random import checkpoint

class EmbeddingWeightUnit(nn.Module):
    """A parameterless pass-through that adds one partition unit next to an embedding (see module doc)."""

    def forward(self, inputs):
        return inputs


def deepspeed_partition_method(plan: PartitionPlan) -> str:
    if plan.method == "balanced":
        return "type:^(transformerlayer|gptembedding|embeddingweightunit)$"
    return "type:^transformerlayer$"


def layer_specs(config: GPTConfig, *, tp_group=None, sequence_parallel: bool = False, rng_tracker=None,
                seed: int = 1234, embedding_weight: int = 1, recompute_core_attention: bool = False,
                float8=None, device=None, dtype=None) -> list:
    """DeepSpeed layer specs of the whole model (built lazily, stage by stage, by PipelineModule)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    kw = dict(tp_group=tp_group, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
    markers = [LayerSpec(EmbeddingWeightUnit) for _ in range(embedding_weight - 1)]
    return (
        [TiedLayerSpec("embed", GPTEmbedding, config, rng_tracker=rng_tracker, seed=seed,
                       tied_weight_attr="word_embeddings.weight", **kw)]
        + markers
        + [LayerSpec(TransformerLayer, config, i, rng_tracker=rng_tracker, seed=seed,
                     recompute_core_attention=recompute_core_attention, float8=float8, **kw)
           for i in range(config.num_layers)]
        + [LayerSpec(FinalLayerNorm, config, **kw)]
        + markers
        + [TiedLayerSpec("embed", GPTEmbedding, config, rng_tracker=rng_tracker, seed=seed,
                         words_only=True, forward_fn=lm_logits,
                         tied_weight_attr="word_embeddings.weight", **kw)]
    )


def gpt_layer_prefixes(num_layers: int, embedding_weight: int = 1) -> Dict[int, str]:
    """{index in `layer_specs`: GPTModel's name prefix} for every spec that holds GPTModel weights: the input
    embedding at 0, transformer layer i at w + i, the final LayerNorm at w + L. The markers hold nothing, and the
    tied output embedding at 2w + L shares the input embedding's weights (DeepSpeed writes no file for it).

    The one home of these indices: DeepSpeed names each stage's parameters `{index}.{name}` and its checkpoint
    files `layer_{index:02d}-model_{tp:02d}-model_states.pt` by them (gptpar.checkpoint.weights reads and writes those
    files; `gpt_parameter_name` maps a stage's parameters)."""
    w, L = embedding_weight, num_layers
    return {0: "embedding.", **{w + i: f"layers.{i}." for i in range(L)}, w + L: "final_layernorm."}


def gpt_parameter_name(name: str, num_layers: int, embedding_weight: int = 1) -> str:
    """GPTModel's name for a parameter of a `PipelineModule` stage: DeepSpeed registers the tied embedding as
    `tied_modules.embed.*` and every other spec's module as `{index}.*` (index into `layer_specs`)."""
    head, _, rest = name.partition(".")
    prefixes = gpt_layer_prefixes(num_layers, embedding_weight)
    if head == "tied_modules" and rest.startswith("embed."):
        return "embedding." + rest[len("embed."):]
    if head.isdigit() and int(head) in prefixes:
        return prefixes[int(head)] + rest
    raise ValueError(f"pipeline parameter {name!r} has no GPTModel name (layer specs of {num_layers} layers, "
                     f"embedding weight {embedding_weight})")


def deepspeed_topology(pstate):
    """DeepSpeed's `PipeModelDataParallelTopology` for `pstate`'s grid, checked to agree with ours."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topo = PipeModelDataParallelTopology(num_pp=pstate.pp_size, num_mp=pstate.tp_size, num_dp=pstate.dp_size)
    check_topology_agrees(topo, pstate.tp_size, pstate.pp_size, pstate.dp_size)
    return topo


def build_pipeline_model(config: GPTConfig, pstate, *, partition_method: str = "auto", embedding_weight: int = 1,
                         sequence_parallel: bool = False, rng_tracker=None, seed: int = 1234,
                         activation_checkpointing="none", float8=None, dtype=None):
    """The GPT as a DeepSpeed `PipelineModule` over `pstate`'s grid; this rank builds only its stage.

    activation_checkpointing "full" (or True) checkpoints every transformer layer through DeepSpeed's
    interval; "selective" makes each layer recompute its attention core itself."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    config.check_parallel(pstate.tp_size, pstate.pp_size)
    recompute = recompute_mode(activation_checkpointing)
    deepspeed.init_distributed(dist_backend=pstate.backend)  # adopts the existing process group
    plan = partition_layers(config.num_layers, pstate.pp_size, partition_method, embedding_weight)
    specs = layer_specs(config, tp_group=pstate.tp_group, sequence_parallel=sequence_parallel,
                        rng_tracker=rng_tracker, seed=seed, embedding_weight=plan.embedding_weight,
                        recompute_core_attention=recompute == "selective", float8=float8, device=pstate.device,
                        dtype=dtype)
    module = PipelineModule(
        layers=specs, loss_fn=GPTLoss(config.vocab_size, pstate.tp_group), topology=deepspeed_topology(pstate),
        partition_method=deepspeed_partition_method(plan),
        activation_checkpoint_interval=1 if recompute == "full" else 0,
        activation_checkpoint_func=functools.partial(checkpoint, tracker=rng_tracker),
        checkpointable_layers=["TransformerLayer"])
    if list(module.parts) != plan.parts:
        raise RuntimeError(f"DeepSpeed partitioned the layers as {module.parts}, gptpar planned {plan.parts}")
    return module, plan


# ---------------------------------------------------------------------------------------------
# Parameter accounting, from the real blocks built on the meta device
# ---------------------------------------------------------------------------------------------

def _count(module: nn.Module, tp: int):
    """(total over all tp ranks, on one tp rank) parameters of a block built at tp = 1."""
    total = sum(p.numel() for p in module.parameters())
    per_rank = sum(p.numel() // tp if getattr(p, "tensor_model_parallel", False) else p.numel()
                   for p in module.parameters())
    return total, per_rank


def block_parameter_counts(config: GPTConfig, tp: int = 1) -> dict:
    """Parameters of each kind of block: {name: (total, per tp rank)}; the vocab is padded for `tp`."""
    key = (tuple(sorted(config.__dict__.items())), tp)
    if key not in _BLOCK_COUNTS:
        _BLOCK_COUNTS[key] = _block_parameter_counts(config, tp)
    return _BLOCK_COUNTS[key]


_BLOCK_COUNTS: dict = {}  # a memo of pure results, not state: one process asks for the same meta builds again


def padded_config(config: GPTConfig, tp: int) -> GPTConfig:
    """`config` with the vocabulary already padded for `tp`: a model built from it at tp = 1 has the full
    (all tp ranks together) shape of every tensor of the model at `tp`."""
    return GPTConfig(**{**config.__dict__, "vocab_size": config.padded_vocab_size(tp),
                        "make_vocab_size_divisible_by": 1})


def _block_parameter_counts(config: GPTConfig, tp: int) -> dict:
    config.check_parallel(tp, 1)
    padded = padded_config(config, tp)
    return {
        "input_embedding": _count(GPTEmbedding(padded, device="meta"), tp),
        "output_embedding": _count(GPTEmbedding(padded, words_only=True, device="meta"), tp),
        "transformer_layer": _count(TransformerLayer(padded, 0, device="meta"), tp),
        "final_layernorm": _count(FinalLayerNorm(padded, device="meta"), tp),
    }


def stage_parameter_counts(config: GPTConfig, plan: PartitionPlan, tp: int = 1) -> List[dict]:
    """Per stage: {'stage', 'layers', 'params' (whole stage, all tp ranks), 'params_per_tp_rank'}.
    With pp > 1 the tied output embedding is a second copy on the last stage; with pp = 1 it is shared."""
    counts = block_parameter_counts(config, tp)
    rows = []
    for s in plan.stages:
        total, per_rank = (counts["transformer_layer"][0] * s.num_layers,
                           counts["transformer_layer"][1] * s.num_layers)
        for flag, key in ((s.has_input_embedding, "input_embedding"), (s.has_final_layernorm, "final_layernorm"),
                          (s.has_output_embedding and not s.has_input_embedding, "output_embedding")):
            if flag:
                total += counts[key][0]
                per_rank += counts[key][1]
        rows.append({"stage": s.stage, "layers": s.num_layers, "params": total, "params_per_tp_rank": per_rank,
                     "embeddings": ("in" if s.has_input_embedding else "") +
                                   ("+out" if s.has_output_embedding else "")})
    return rows


def model_parameter_count(config: GPTConfig, tp: int = 1) -> int:
    """Unique parameters of the whole model (the tied embedding counted once)."""
    counts = block_parameter_counts(config, tp)
    return (counts["input_embedding"][0] + config.num_layers * counts["transformer_layer"][0]
            + counts["final_layernorm"][0])

