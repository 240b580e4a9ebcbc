"""Which transformer layers and embeddings each pipeline stage holds: pure functions, no torch.

Methods:
  balanced     each embedding counts as w units beside the L transformer layers (DeepSpeed's
               `type:transformer|embedding`): needs (L + 2w) % pp == 0. With a 250k vocab an embedding
               is as large as a layer or more, so the first and last stages get fewer layers.
  transformer  only transformer layers count: needs L % pp == 0; the embeddings ride on the first and
               last stages (what the 176B prequel log's measured runs used, docs/planning.md).
  auto         balanced where it divides, else transformer.
Every stage must hold at least one transformer layer: DeepSpeed hangs otherwise.

The one source of this rule: the pipeline builder, the config checks, the FLOP/memory formulas and the
planner all call `partition_layers`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

PARTITION_METHODS = ("auto", "balanced", "transformer")


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
                f"parallel.partition_method 'balanced' needs (num_layers + 2*{w}) % pp == 0, but model.num_layers "
                f"({num_layers}) + {2 * w} does not divide by parallel.pipeline_model_parallel_size ({pp}): use "
                f"{num_layers + (pp - total % pp)} layers, another pp, or partition_method 'transformer'")
        raise ValueError(
            f"parallel.partition_method 'transformer' needs model.num_layers ({num_layers}) to be a multiple of "
            f"parallel.pipeline_model_parallel_size ({pp}): the layers must divide by pp; change one of them, "
            f"or use 'balanced' where (num_layers + 2) % pp == 0")
    per_stage = total // pp
    stages, layer = [], 0
    for s in range(pp):
        units = per_stage - (w if s == 0 else 0) - (w if s == pp - 1 else 0)
        if units < 1:
            raise ValueError(
                f"parallel.partition_method '{method}': stage {s} of {pp} would hold no transformer layer "
                f"(model.num_layers = {num_layers}): DeepSpeed hangs on such a stage; lower pp or use more layers")
        stages.append(StagePlan(stage=s, first_layer=layer, num_layers=units, has_input_embedding=s == 0,
                                has_output_embedding=s == pp - 1, has_final_layernorm=s == pp - 1))
        layer += units
    # Spec-list boundaries: [emb, (w-1 units), L layers, final norm, (w-1 units), emb].
    lead = embedding_weight  # the embedding plus its markers
    parts = [0] + [lead + s.first_layer + s.num_layers for s in stages[:-1]] + \
            [lead + num_layers + 1 + (embedding_weight - 1) + 1]
    return PartitionPlan(method=method, embedding_weight=embedding_weight, stages=stages, parts=parts)
