"""Checkpoint conversion: a gptpar training checkpoint of any tp x pp -> one full (tp = 1) state dict,
and from there to a Hugging Face GPT-2 or to any other tp.

The full form is `GPTModel`'s state dict at tp = 1 with the word embedding trimmed to the real
vocabulary: padding rows depend on tp (Megatron pads the vocab to a multiple of 128 x tp), so they are
dropped here and re-added by `gptpar.model.sharding.load_full_state_dict` for the target tp. (Universal
checkpoints, with the optimizer state, are gptpar.model.universal's.)

Which files DeepSpeed writes (one checkpoint directory, e.g. {save}/iter_0000300):
  pp = 1   mp_rank_{tp:02d}_model_states.pt                 key 'module': GPTModel's state dict
  pp > 1   layer_{idx:02d}-model_{tp:02d}-model_states.pt   one pipeline layer's state dict
           with the spec indices of gptpar.model.pipeline.layer_specs: embedding 0, transformer layer i at
           w + i, final LayerNorm at w + L, the tied output embedding at 2w + L (w = embedding weight).
Shards are merged by the parameters' own tags (`tensor_model_parallel`, `partition_dim`) read off a
`meta`-device model, never by name patterns.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Dict, Optional, Tuple

import torch

from gptpar.model import universal
from gptpar.model.config import GPTConfig
from gptpar.model.partition import partition_layers

StateDict = Dict[str, torch.Tensor]


class ConversionError(RuntimeError):
    """A checkpoint that cannot be read as a gptpar GPT; the message names the file and the problem."""


def resolve_checkpoint_dir(path: str, tag: Optional[str] = None) -> str:
    """`path` may be a checkpoint directory itself or a save directory holding `latest`."""
    if tag:
        path = os.path.join(path, tag)
    elif os.path.isfile(os.path.join(path, "latest")):
        with open(os.path.join(path, "latest")) as f:
            path = os.path.join(path, f.read().strip())
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConversionError(f"{path} holds no config.json: pass a gptpar checkpoint directory "
                              f"(e.g. checkpoints/run/iter_0000100) or the save directory with its `latest` file")
    return path


def _load(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConversionError(f"missing checkpoint file {path}: the checkpoint is incomplete")
    return torch.load(path, map_location="cpu", weights_only=False)


def _read_shards(ckpt: str, config: GPTConfig, tp: int, pp: int, embedding_weight: int):
    """For each tp rank, GPTModel-named tensors of that rank (all pipeline stages put together)."""
    shards = []
    for t in range(tp):
        if pp == 1:
            sd = _load(os.path.join(ckpt, f"mp_rank_{t:02d}_model_states.pt"))["module"]
            shards.append({k: v for k, v in sd.items()})
            continue
        sd = {}
        for index, prefix in universal.pipeline_layer_prefixes(config.num_layers, embedding_weight).items():
            for key, value in _load(os.path.join(ckpt, f"layer_{index:02d}-model_{t:02d}-model_states.pt")).items():
                sd[f"{prefix}.{key}"] = value
        shards.append(sd)
    return shards


def load_universal(path: str, tag: Optional[str] = None) -> Tuple[StateDict, GPTConfig, dict]:
    """Read a gptpar checkpoint (any tp x pp) into one tp = 1 state dict with the real vocab rows.

    Returns (state dict, model config, the run's full config dict)."""
    from gptpar.model.gpt import GPTModel

    ckpt = resolve_checkpoint_dir(path, tag)
    with open(os.path.join(ckpt, "config.json")) as f:
        run_config = json.load(f)
    config = GPTConfig(**run_config["model"])
    parallel = run_config.get("parallel", {})
    tp = parallel.get("tensor_model_parallel_size", 1)
    pp = parallel.get("pipeline_model_parallel_size", 1)
    weight = parallel.get("embedding_weight") or 1
    if pp > 1:
        plan = partition_layers(config.num_layers, pp, parallel.get("partition_method", "auto"), weight)
        weight = plan.embedding_weight if plan.method == "balanced" else weight
    if not glob.glob(os.path.join(ckpt, "*model_states.pt")):
        raise ConversionError(f"{ckpt} holds no DeepSpeed model states (*model_states.pt)")
    shards = _read_shards(ckpt, config, tp, pp, weight)

    reference = GPTModel(config, device="meta")  # carries the sharding tags
    full: StateDict = {}
    for name, param in reference.named_parameters():
        missing = [t for t, sd in enumerate(shards) if name not in sd]
        if missing:
            raise ConversionError(f"{ckpt}: tensor {name} missing on tp rank(s) {missing}")
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            full[name] = torch.cat([sd[name].float() for sd in shards], dim=param.partition_dim)
        else:
            full[name] = shards[0][name].float()
    emb = "embedding.word_embeddings.weight"
    full[emb] = full[emb][:config.vocab_size].clone()
    return full, config, run_config


def is_hf_model_dir(path: str) -> bool:
    """A local Hugging Face model directory: its config.json names a `model_type` (gptpar's names `model`)."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return False
    with open(config) as f:
        return "model_type" in json.load(f)


def read_weights(path: str, tag: Optional[str] = None) -> Tuple[StateDict, GPTConfig]:
    """Full (tp = 1) weights with the real vocab rows, and the model config, from whatever `path` holds:
    a gptpar checkpoint (any tp x pp; a checkpoint directory or the save directory holding `latest`), a
    universal checkpoint (its fp32 master weights, read with unpickling disabled) or a local Hugging Face
    model directory. The one reader for every tool that starts from existing weights."""
    if os.path.isdir(path) and universal.is_universal(path):
        try:
            return universal.read_weights(path)
        except universal.UniversalCheckpointError as e:
            raise ConversionError(str(e)) from None
    if os.path.isdir(path) and is_hf_model_dir(path):
        return load_hf(path)
    state, config, _ = load_universal(path, tag)
    return state, config


def save_hf(state: StateDict, config: GPTConfig, out_dir: str) -> None:
    """Write a Hugging Face GPT2LMHeadModel directory (config.json + weights) loadable offline."""
    try:
        import transformers
    except ImportError as e:
        raise ConversionError("exporting to Hugging Face needs transformers: pip install transformers") from e
    from gptpar.model.hf import to_hf_state_dict

    act = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}[config.activation]
    hf_config = transformers.GPT2Config(
        n_layer=config.num_layers, n_embd=config.hidden_size, n_head=config.num_attention_heads,
        n_inner=config.ffn_hidden_size, n_positions=config.max_position_embeddings, vocab_size=config.vocab_size,
        activation_function=act, layer_norm_epsilon=config.layernorm_epsilon, resid_pdrop=config.hidden_dropout,
        attn_pdrop=config.attention_dropout, embd_pdrop=config.hidden_dropout, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(hf_config)
    missing, unexpected = model.load_state_dict(to_hf_state_dict(state, config), strict=False)
    missing = [k for k in missing if not k.endswith(".attn.bias") and not k.endswith(".attn.masked_bias")]
    if missing or unexpected:
        raise ConversionError(f"Hugging Face GPT-2 did not take the weights: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(out_dir)


def load_hf(model_dir: str) -> Tuple[StateDict, GPTConfig]:
    """A local Hugging Face GPT-2 directory -> (universal state dict, GPTConfig)."""
    import transformers

    from gptpar.model.hf import config_from_hf, from_hf_state_dict

    model = transformers.GPT2LMHeadModel.from_pretrained(model_dir)
    config = config_from_hf(model.config)
    return from_hf_state_dict(model.state_dict(), config), config
