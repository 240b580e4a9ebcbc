"""Pipeline stages on DeepSpeed's `PipelineModule`, with balanced embedding placement.

The layer list is
    [GPTEmbedding (tied 'embed'), (EmbeddingWeightUnit x (w-1)), TransformerLayer x L, FinalLayerNorm,
     (EmbeddingWeightUnit x (w-1)), GPTEmbedding (tied 'embed', forward_fn=lm_logits)]

Partition methods (`partition_layers` is the pure rule; DeepSpeed's partitioner is checked to agree):
  balanced     each embedding counts as w units beside the L transformer layers (DeepSpeed's
               `type:transformer|embedding`): needs (L + 2w) % pp == 0. With a 250k vocab an embedding
               is as large as a layer or more, so the first and last stages get fewer layers.
  transformer  only transformer layers count: needs L % pp == 0; the embeddings ride on the first and
               last stages (what the seeds' measured runs used).
  auto         balanced (w = 1) where it divides, else transformer.
An embedding weight w > 1 is expressed to DeepSpeed's own type-based partitioner with w - 1 parameterless
`EmbeddingWeightUnit` markers beside each embedding: the smallest override that needs no DeepSpeed patch.
Zero-weight layers (the final LayerNorm) stay with the preceding stage, as DeepSpeed's tie-break does.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional

import torch.nn as nn

from gptpar.model.config import GPTConfig
from gptpar.model.gpt import FinalLayerNorm, GPTEmbedding, GPTLoss, TransformerLayer, lm_logits
from gptpar.tensor_parallel.random import checkpoint

PARTITION_METHODS = ("auto", "balanced", "transformer")


class EmbeddingWeightUnit(nn.Module):
    """A parameterless pass-through that adds one partition unit next to an embedding (see module doc)."""

    def forward(self, inputs):
        return inputs


@dataclass(frozen=True)
class StagePlan:
    stage: int
    first_layer: int  # index of the first transformer layer on this stage
    num_layers: int  # transformer layers on this stage
    has_input_embedding: bool
    has_output_embedding: bool
    has_final_layernorm: bool


@dataclass(frozen=True)
class PartitionPlan:
    method: str  # the resolved method: "balanced" or "transformer"
    embedding_weight: int
    stages: List[StagePlan]
    parts: List[int]  # DeepSpeed's boundaries into the layer-spec list (len pp + 1)

    def describe(self) -> str:
        lines = [f"pipeline partition: method={self.method} (embedding weight {self.embedding_weight}), "
                 f"{len(self.stages)} stage(s)"]
        for s in self.stages:
            parts = (["embedding"] if s.has_input_embedding else []) + \
                    [f"layers {s.first_layer}-{s.first_layer + s.num_layers - 1}"] + \
                    (["final layernorm"] if s.has_final_layernorm else []) + \
                    (["tied output embedding"] if s.has_output_embedding else [])
            lines.append(f"  stage {s.stage}: " + " + ".join(parts))
        return "\n".join(lines)


def resolve_partition_method(method: str, num_layers: int, pp: int, embedding_weight: int = 1) -> str:
    if method not in PARTITION_METHODS:
        raise ValueError(f"parallel.partition_method must be one of {PARTITION_METHODS}, got {method!r}")
    if method == "auto":
        return "balanced" if (num_layers + 2 * embedding_weight) % pp == 0 else "transformer"
    return method


def partition_layers(num_layers: int, pp: int, method: str = "auto", embedding_weight: int = 1) -> PartitionPlan:
    """Which transformer layers and embeddings each pipeline stage holds. Pure; raises ValueError with the
    fix when the split is impossible or would leave a stage without a transformer layer (DeepSpeed hangs)."""
    if pp < 1 or num_layers < 1:
        raise ValueError(f"need num_layers >= 1 and pp >= 1, got {num_layers} and {pp}")
    if embedding_weight < 1:
        raise ValueError(f"parallel.embedding_weight must be >= 1, got {embedding_weight}")
    method = resolve_partition_method(method, num_layers, pp, embedding_weight)
    w = embedding_weight if method == "balanced" else 0
    total = num_layers + 2 * w
    if total % pp:
        if method == "balanced":
            raise ValueError(
                f"partition_method 'balanced' needs (num_layers + 2*{w}) % pp == 0, but "
                f"({num_layers} + {2 * w}) % {pp} = {total % pp}: use {num_layers + (pp - total % pp)} "
                f"layers, another pp, or partition_method 'transformer'")
        raise ValueError(
            f"partition_method 'transformer' needs num_layers % pp == 0, but {num_layers} % {pp} = "
            f"{num_layers % pp}: change num_layers or pp, or use 'balanced' if (layers + 2) % pp == 0")
    per_stage = total // pp
    stages, layer = [], 0
    for s in range(pp):
        units = per_stage - (w if s == 0 else 0) - (w if s == pp - 1 else 0)
        if units < 1:
            raise ValueError(
                f"stage {s} of {pp} would hold no transformer layer ({num_layers} layers, {method} "
                f"placement): DeepSpeed hangs on such a stage; lower pp or use more layers")
        stages.append(StagePlan(stage=s, first_layer=layer, num_layers=units, has_input_embedding=s == 0,
                                has_output_embedding=s == pp - 1, has_final_layernorm=s == pp - 1))
        layer += units
    # Spec-list boundaries: [emb, (w-1 units), L layers, final norm, (w-1 units), emb].
    lead = embedding_weight  # the embedding plus its markers
    parts = [0] + [lead + s.first_layer + s.num_layers for s in stages[:-1]] + \
            [lead + num_layers + 1 + (embedding_weight - 1) + 1]
    return PartitionPlan(method=method, embedding_weight=embedding_weight, stages=stages, parts=parts)


def deepspeed_partition_method(plan: PartitionPlan) -> str:
    if plan.method == "balanced":
        return "type:^(transformerlayer|gptembedding|embeddingweightunit)$"
    return "type:^transformerlayer$"


def layer_specs(config: GPTConfig, *, tp_group=None, sequence_parallel: bool = False, rng_tracker=None,
                seed: int = 1234, embedding_weight: int = 1, device=None, dtype=None) -> list:
    """DeepSpeed layer specs of the whole model (built lazily, stage by stage, by PipelineModule)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    kw = dict(tp_group=tp_group, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
    markers = [LayerSpec(EmbeddingWeightUnit) for _ in range(embedding_weight - 1)]
    return (
        [TiedLayerSpec("embed", GPTEmbedding, config, rng_tracker=rng_tracker, seed=seed,
                       tied_weight_attr="word_embeddings.weight", **kw)]
        + markers
        + [LayerSpec(TransformerLayer, config, i, rng_tracker=rng_tracker, seed=seed, **kw)
           for i in range(config.num_layers)]
        + [LayerSpec(FinalLayerNorm, config, **kw)]
        + markers
        + [TiedLayerSpec("embed", GPTEmbedding, config, rng_tracker=rng_tracker, seed=seed,
                         with_position_embeddings=False, forward_fn=lm_logits,
                         tied_weight_attr="word_embeddings.weight", **kw)]
    )


def build_pipeline_model(config: GPTConfig, pstate, *, partition_method: str = "auto", embedding_weight: int = 1,
                         sequence_parallel: bool = False, rng_tracker=None, seed: int = 1234,
                         activation_checkpointing: bool = False, dtype=None):
    """The GPT as a DeepSpeed `PipelineModule` over `pstate`'s grid; this rank builds only its stage."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    config.check_parallel(pstate.tp_size, pstate.pp_size)
    deepspeed.init_distributed(dist_backend=pstate.backend)  # adopts the existing process group
    plan = partition_layers(config.num_layers, pstate.pp_size, partition_method, embedding_weight)
    specs = layer_specs(config, tp_group=pstate.tp_group, sequence_parallel=sequence_parallel,
                        rng_tracker=rng_tracker, seed=seed, embedding_weight=plan.embedding_weight,
                        device=pstate.device, dtype=dtype)
    module = PipelineModule(
        layers=specs, loss_fn=GPTLoss(config.vocab_size, pstate.tp_group), topology=pstate.topology(),
        partition_method=deepspeed_partition_method(plan),
        activation_checkpoint_interval=1 if activation_checkpointing else 0,
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


_BLOCK_COUNTS: dict = {}  # a memo of pure results, not state: meta builds of 200B-sized blocks take ~0.1 s


def _block_parameter_counts(config: GPTConfig, tp: int) -> dict:
    config.check_parallel(tp, 1)
    padded = GPTConfig(**{**config.__dict__, "vocab_size": config.padded_vocab_size(tp),
                          "make_vocab_size_divisible_by": 1})
    return {
        "input_embedding": _count(GPTEmbedding(padded, device="meta"), tp),
        "output_embedding": _count(GPTEmbedding(padded, with_position_embeddings=False, device="meta"), tp),
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


def stage_report(config: GPTConfig, plan: PartitionPlan, tp: int = 1) -> str:
    lines = [plan.describe(), f"  {'stage':>5} {'layers':>6} {'embeddings':>10} {'params':>16} "
                              f"{'params/tp rank':>16}"]
    for row in stage_parameter_counts(config, plan, tp):
        lines.append(f"  {row['stage']:>5} {row['layers']:>6} {row['embeddings'] or '-':>10} "
                     f"{row['params']:>16,} {row['params_per_tp_rank']:>16,}")
    lines.append(f"  model parameters (tied embedding once): {model_parameter_count(config, tp):,}")
    return "\n".join(lines)
