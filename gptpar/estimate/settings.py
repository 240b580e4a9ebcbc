"""What the estimates read: the trainer's `Config` flattened into one dict of sizes, and the memory call.

`settings_of(cfg)` is the only bridge from the config to the formulas (gptpar.estimate.flops / memory), the
planner and the dry-run report, so every estimate sees the trainer's defaults and checks.
"""
from __future__ import annotations

from typing import Optional

from gptpar.estimate.memory import memory_per_gpu
from gptpar.model.config import recompute_mode
from gptpar.config import Config


def settings_of(cfg: Config, dp_size: Optional[int] = None) -> dict:
    """The keys the estimates read, from the trainer's `Config` (gptpar.config: the one config reader,
    so precision, ZeRO stage and recompute default as they do for the run). `dp_size` overrides the config's
    data_parallel_size (None there = 1)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    tp = p.tensor_model_parallel_size
    return {
        "num_layers": m.num_layers, "hidden_size": m.hidden_size, "num_attention_heads": m.num_attention_heads,
        "ffn_hidden_size": m.ffn_hidden_size, "seq_length": m.seq_length,
        "max_position_embeddings": m.max_position_embeddings, "vocab_size": m.vocab_size,
        "make_vocab_size_divisible_by": m.make_vocab_size_divisible_by, "activation": m.activation,
        "position_embedding_type": m.position_embedding_type, "embed_layernorm": m.embed_layernorm,
        "padded_vocab_size": m.padded_vocab_size(tp),
        "tp_size": tp, "pp_size": p.pipeline_model_parallel_size, "sequence_parallel": p.sequence_parallel, "dp_size": dp_size or p.data_parallel_size or 1,
        "partition_method": p.partition_method, "embedding_weight": p.embedding_weight or 1,
        "micro_batch_size": t.micro_batch_size, "global_batch_size": t.global_batch_size,
        "precision": t.precision, "fp8_recipe": t.fp8_recipe, "zero_stage": t.zero_stage, "optimizer": t.optimizer,
        "activation_checkpointing": recompute_mode(t.activation_checkpointing),
        "rampup_batch_size": t.rampup_batch_size,
        # what the run trains: training.train_samples, or train_iters global batches
        "train_samples": t.train_samples or t.train_iters * t.global_batch_size,
    }


def memory_of(s: dict, virtual_stages: int = 1) -> dict:
    """gptpar.estimate.memory.memory_per_gpu for settings `s`: the figures tools/memory.py and the dry run both print.
    virtual_stages > 1 prices the interleaved schedule's in-flight micro batches (the what-if --assume interleaved=V);
    settings with flash_attention False (a published run's unfused attention) store its s x s tensors."""
    return memory_per_gpu(num_layers=s["num_layers"], hidden_size=s["hidden_size"],
                          num_attention_heads=s["num_attention_heads"], vocab_size=s["vocab_size"],
                          seq_length=s["seq_length"], micro_batch_size=s["micro_batch_size"],
                          global_batch_size=s["global_batch_size"], tp_size=s["tp_size"], pp_size=s["pp_size"],
                          dp_size=s["dp_size"], partition_method=s["partition_method"],
                          embedding_weight=s["embedding_weight"], precision=s["precision"],
                          fp8_recipe=s.get("fp8_recipe", "tensorwise"),
                          zero_stage=s["zero_stage"], optimizer=s["optimizer"],
                          activation_checkpointing=s["activation_checkpointing"],
                          ffn_hidden_size=s["ffn_hidden_size"], max_position_embeddings=s["max_position_embeddings"],
                          make_vocab_size_divisible_by=s["make_vocab_size_divisible_by"],
                          sequence_parallel=s.get("sequence_parallel", False), virtual_stages=virtual_stages,
                          flash_attention=s.get("flash_attention", True),
                          **embedding_kind(s))


def embedding_kind(s: dict) -> dict:
    """The input embedding's options the parameter formulas take, from settings `s` (GPT-2's when unset, as
    for settings built from Megatron-style flags alone)."""
    return {"position_embedding_type": s.get("position_embedding_type", "learned"),
            "embed_layernorm": s.get("embed_layernorm", False)}


def require(s: dict, *keys: str) -> None:
    """ValueError naming the flag (and the fix) for every key that is unset or not positive."""
    for k in keys:
        v, flag = s.get(k), "--" + _FLAG.get(k, k).replace("_", "-")
        if v is None:
            where = "" if k in ("gpus", "sec_per_iter") else " or a --config that sets it"
            raise ValueError(f"missing {flag}: pass {flag}{where}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ValueError(f"{flag} must be a positive number, got {v!r}")


_FLAG = {"tp_size": "tensor_model_parallel_size", "pp_size": "pipeline_model_parallel_size"}


__all__ = ["settings_of", "memory_of", "embedding_kind", "require"]
