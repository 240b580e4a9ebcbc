"""Conversion between Hugging Face `GPT2LMHeadModel` / `BloomForCausalLM` weights and gptpar's `GPTModel`
(tp = 1 layout). Which one a gptpar model maps to: `hf_architecture` (learned positions = GPT-2; ALiBi with
the embedding LayerNorm = BLOOM).

Hugging Face's GPT-2 uses `Conv1D` layers whose weight is (in, out) — the transpose of `nn.Linear` —
and orders the fused attention output as ({q, k, v}, head, head_dim). gptpar's fused QKV is a linear
(out, in) weight ordered (head, {q, k, v}, head_dim), so that a tensor-parallel split by rows gives each
rank whole heads (see gptpar/model/gpt.py). The word embedding is padded to the model's padded vocab.
Shard the result for tp > 1 with `gptpar.model.sharding.load_full_state_dict`.

BLOOM is Megatron-DeepSpeed's layout under other names: `nn.Linear` weights and a fused QKV already ordered
(head, {q, k, v}, head_dim) (its `_reshape` views the output as (heads, 3, head_dim)), biases everywhere,
a LayerNorm after the word embedding, no position table (ALiBi), the tanh GELU (`bloom_gelu_forward`) with
f = 4h, `layer_norm_epsilon` for every LayerNorm and `lm_head` tied to the word embedding. So its tensors
are renamed, never reordered.
"""
from __future__ import annotations

from typing import Dict

import torch

from gptpar.model.config import GPTConfig

_HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


# BLOOM trained at 2048 tokens; its Hugging Face config has no sequence length unless gptpar wrote one.
BLOOM_SEQ_LENGTH = 2048


def hf_architecture(config: GPTConfig) -> str:
    """'gpt2' or 'bloom': the Hugging Face model that has `config`'s architecture (ValueError if none has)."""
    if config.position_embedding_type == "learned" and not config.embed_layernorm:
        return "gpt2"
    if (config.position_embedding_type == "alibi" and config.embed_layernorm and config.activation == "gelu_tanh"
            and config.ffn_hidden_size == 4 * config.hidden_size):
        return "bloom"
    raise ValueError(
        f"no Hugging Face architecture matches position_embedding_type={config.position_embedding_type!r}, "
        f"embed_layernorm={config.embed_layernorm}, activation={config.activation!r}, ffn_hidden_size="
        f"{config.ffn_hidden_size}: GPT-2 needs learned positions without the embedding LayerNorm; BLOOM needs "
        f"alibi, embed_layernorm=true, activation gelu_tanh and ffn_hidden_size = 4 x hidden_size")


def config_from_hf(hf_config, **overrides) -> GPTConfig:
    """A GPTConfig with the shape of a transformers `GPT2Config` or `BloomConfig` (by its model_type; dropouts
    from it unless overridden)."""
    if hf_config.model_type == "bloom":
        return _config_from_bloom(hf_config, **overrides)
    if hf_config.model_type != "gpt2":
        raise ValueError(f"Hugging Face model_type {hf_config.model_type!r} is not supported: gptpar reads "
                         f"gpt2 (GPT2LMHeadModel) and bloom (BloomForCausalLM)")
    if hf_config.activation_function not in _HF_ACTIVATIONS:
        raise ValueError(f"GPT-2 activation {hf_config.activation_function!r} has no gptpar equivalent "
                         f"(supported: {sorted(_HF_ACTIVATIONS)})")
    fields = dict(num_layers=hf_config.n_layer, hidden_size=hf_config.n_embd,
                  num_attention_heads=hf_config.n_head, ffn_hidden_size=hf_config.n_inner or 4 * hf_config.n_embd,
                  seq_length=hf_config.n_positions, max_position_embeddings=hf_config.n_positions,
                  vocab_size=hf_config.vocab_size, layernorm_epsilon=hf_config.layer_norm_epsilon,
                  hidden_dropout=hf_config.resid_pdrop, attention_dropout=hf_config.attn_pdrop,
                  activation=_HF_ACTIVATIONS[hf_config.activation_function])
    fields.update(overrides)
    return GPTConfig(**fields)


def _config_from_bloom(hf_config, **overrides) -> GPTConfig:
    if hf_config.apply_residual_connection_post_layernorm:
        raise ValueError("BLOOM with apply_residual_connection_post_layernorm=true has no gptpar equivalent")
    seq_length = getattr(hf_config, "seq_length", None) or BLOOM_SEQ_LENGTH
    fields = dict(num_layers=hf_config.n_layer, hidden_size=hf_config.hidden_size,
                  num_attention_heads=hf_config.n_head, ffn_hidden_size=4 * hf_config.hidden_size,
                  seq_length=seq_length, vocab_size=hf_config.vocab_size,
                  layernorm_epsilon=hf_config.layer_norm_epsilon, init_method_std=hf_config.initializer_range,
                  hidden_dropout=hf_config.hidden_dropout, attention_dropout=hf_config.attention_dropout,
                  activation="gelu_tanh", position_embedding_type="alibi", embed_layernorm=True)
    fields.update(overrides)
    return GPTConfig(**fields)


def _bloom_names(config: GPTConfig):
    """(gptpar name, BLOOM name) of every tensor; the tied lm_head is left out."""
    p = "transformer."
    names = [("embedding.word_embeddings.weight", p + "word_embeddings.weight"),
             ("final_layernorm.norm.weight", p + "ln_f.weight"), ("final_layernorm.norm.bias", p + "ln_f.bias")]
    names += [(f"embedding.word_embeddings_layernorm.{t}", f"{p}word_embeddings_layernorm.{t}")
              for t in ("weight", "bias")]
    layer = {"input_layernorm": "input_layernorm", "query_key_value": "self_attention.query_key_value",
             "dense": "self_attention.dense", "post_attention_layernorm": "post_attention_layernorm",
             "dense_h_to_4h": "mlp.dense_h_to_4h", "dense_4h_to_h": "mlp.dense_4h_to_h"}
    for i in range(config.num_layers):
        names += [(f"layers.{i}.{g}.{t}", f"{p}h.{i}.{b}.{t}") for g, b in layer.items() for t in ("weight", "bias")]
    return names


def _qkv_hf_to_gptpar(w: torch.Tensor, heads: int) -> torch.Tensor:
    """(..., 3h) ordered (qkv, head, d) -> (..., 3h) ordered (head, qkv, d), on the last dim."""
    lead = w.shape[:-1]
    return w.reshape(*lead, 3, heads, -1).transpose(-3, -2).reshape(*lead, -1)


def _qkv_gptpar_to_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    lead = w.shape[:-1]
    return w.reshape(*lead, heads, 3, -1).transpose(-3, -2).reshape(*lead, -1)


def from_hf_state_dict(hf: Dict[str, torch.Tensor], config: GPTConfig) -> Dict[str, torch.Tensor]:
    """A transformers GPT2LMHeadModel or BloomForCausalLM state dict (`config`'s architecture) -> GPTModel's
    (tp = 1) state dict, in fp32."""
    if hf_architecture(config) == "bloom":
        return {g: hf[b].float().contiguous() for g, b in _bloom_names(config)}
    nh = config.num_attention_heads
    p = "transformer."
    out = {
        "embedding.word_embeddings.weight": hf[p + "wte.weight"],
        "embedding.position_embeddings.weight": hf[p + "wpe.weight"],
        "final_layernorm.norm.weight": hf[p + "ln_f.weight"],
        "final_layernorm.norm.bias": hf[p + "ln_f.bias"],
    }
    for i in range(config.num_layers):
        h, g = f"{p}h.{i}.", f"layers.{i}."
        out.update({
            g + "input_layernorm.weight": hf[h + "ln_1.weight"],
            g + "input_layernorm.bias": hf[h + "ln_1.bias"],
            # Conv1D (in, out) -> linear (out, in), with the fused output reordered to (head, qkv, d).
            g + "query_key_value.weight": _qkv_hf_to_gptpar(hf[h + "attn.c_attn.weight"], nh).t(),
            g + "query_key_value.bias": _qkv_hf_to_gptpar(hf[h + "attn.c_attn.bias"], nh),
            g + "dense.weight": hf[h + "attn.c_proj.weight"].t(),
            g + "dense.bias": hf[h + "attn.c_proj.bias"],
            g + "post_attention_layernorm.weight": hf[h + "ln_2.weight"],
            g + "post_attention_layernorm.bias": hf[h + "ln_2.bias"],
            g + "dense_h_to_4h.weight": hf[h + "mlp.c_fc.weight"].t(),
            g + "dense_h_to_4h.bias": hf[h + "mlp.c_fc.bias"],
            g + "dense_4h_to_h.weight": hf[h + "mlp.c_proj.weight"].t(),
            g + "dense_4h_to_h.bias": hf[h + "mlp.c_proj.bias"],
        })
    return {k: v.float().contiguous() for k, v in out.items()}


def to_hf_state_dict(sd: Dict[str, torch.Tensor], config: GPTConfig) -> Dict[str, torch.Tensor]:
    """GPTModel's (tp = 1) state dict -> a transformers GPT2LMHeadModel or BloomForCausalLM state dict
    (`config`'s architecture; padding rows dropped)."""
    nh, v = config.num_attention_heads, config.vocab_size
    if hf_architecture(config) == "bloom":
        out = {b: sd[g] for g, b in _bloom_names(config)}
        out["transformer.word_embeddings.weight"] = out["lm_head.weight"] = sd["embedding.word_embeddings.weight"][:v]
        return {k: t.contiguous() for k, t in out.items()}
    p = "transformer."
    wte = sd["embedding.word_embeddings.weight"][:v]
    out = {p + "wte.weight": wte, "lm_head.weight": wte,
           p + "wpe.weight": sd["embedding.position_embeddings.weight"],
           p + "ln_f.weight": sd["final_layernorm.norm.weight"], p + "ln_f.bias": sd["final_layernorm.norm.bias"]}
    for i in range(config.num_layers):
        h, g = f"{p}h.{i}.", f"layers.{i}."
        out.update({
            h + "ln_1.weight": sd[g + "input_layernorm.weight"], h + "ln_1.bias": sd[g + "input_layernorm.bias"],
            h + "attn.c_attn.weight": _qkv_gptpar_to_hf(sd[g + "query_key_value.weight"].t(), nh),
            h + "attn.c_attn.bias": _qkv_gptpar_to_hf(sd[g + "query_key_value.bias"], nh),
            h + "attn.c_proj.weight": sd[g + "dense.weight"].t(), h + "attn.c_proj.bias": sd[g + "dense.bias"],
            h + "ln_2.weight": sd[g + "post_attention_layernorm.weight"],
            h + "ln_2.bias": sd[g + "post_attention_layernorm.bias"],
            h + "mlp.c_fc.weight": sd[g + "dense_h_to_4h.weight"].t(), h + "mlp.c_fc.bias": sd[g + "dense_h_to_4h.bias"],
            h + "mlp.c_proj.weight": sd[g + "dense_4h_to_h.weight"].t(),
            h + "mlp.c_proj.bias": sd[g + "dense_4h_to_h.bias"],
        })
    return {k: t.contiguous() for k, t in out.items()}
