"""The GPT model's shape, as a validated dataclass with Megatron's field names.

`GPTConfig` describes the *model* only. Parallel sizes are checked against it with
`GPTConfig.check_parallel(tp, pp, ...)` so that a bad combination fails before anything is allocated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

ACTIVATIONS = ("gelu", "gelu_tanh", "relu")
# Learned absolute positions (GPT-2) or ALiBi's per-head linear attention biases (BLOOM, Press et al. 2021).
POSITION_EMBEDDING_TYPES = ("learned", "alibi")
# Activation recompute in backward (Megatron's --recompute-granularity): nothing, only the attention core
# (QK^T, softmax, dropout, .V: the s x s tensors, cheap to redo), or each whole transformer layer.
RECOMPUTE_MODES = ("none", "selective", "full")


def recompute_mode(value) -> str:
    """'none' | 'selective' | 'full' from a mode name or the older boolean (True = full, False = none)."""
    if isinstance(value, bool):
        return "full" if value else "none"
    if value not in RECOMPUTE_MODES:
        raise ValueError(f"activation checkpointing must be one of {RECOMPUTE_MODES} (or true/false), "
                         f"got {value!r}")
    return value


def pad_vocab_size(vocab_size: int, tp_size: int = 1, divisible_by: int = 128) -> int:
    """Megatron's padding: the smallest size >= vocab_size that divides by divisible_by * tp_size.

    divisible_by <= 1 disables padding (the vocab must then divide by tp on its own).
    """
    multiple = max(divisible_by, 1) * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def check_tp_divides(tp_size: int, *, num_attention_heads: Optional[int] = None,
                     ffn_hidden_size: Optional[int] = None, hidden_size: Optional[int] = None) -> None:
    """The tensor-parallel split rule, in one place: tp must divide the heads, the FFN and the hidden size (each
    one given). ValueError naming the model key; the trainer's config check, the planner and the FLOP count
    call it."""
    for key, size in (("num_attention_heads", num_attention_heads), ("ffn_hidden_size", ffn_hidden_size),
                      ("hidden_size", hidden_size)):
        if size is not None and size % tp_size:
            raise ValueError(f"model.{key} ({size}) must divide by parallel.tensor_model_parallel_size "
                             f"({tp_size}): change one of them")


@dataclass
class GPTConfig:
    """Shape and regularisation of a pre-LayerNorm GPT-2 style model."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: Optional[int] = None  # default 4 * hidden_size
    seq_length: int = 64
    max_position_embeddings: Optional[int] = None  # default seq_length
    vocab_size: int = 256  # the tokenizer's size; the embedding holds padded_vocab_size(tp) rows
    make_vocab_size_divisible_by: int = 128
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    tie_word_embeddings: bool = True
    activation: str = "gelu"
    position_embedding_type: str = "learned"
    embed_layernorm: bool = False

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "seq_length", "max_position_embeddings", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError("model.make_vocab_size_divisible_by must be >= 1 (1 disables padding)")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must divide by model.num_attention_heads "
                f"({self.num_attention_heads}): pick heads that divide the hidden size")
        if self.position_embedding_type == "learned" and self.seq_length > self.max_position_embeddings:
            raise ValueError(
                f"model.seq_length ({self.seq_length}) exceeds model.max_position_embeddings "
                f"({self.max_position_embeddings}): raise max_position_embeddings or shorten seq_length")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"model.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.layernorm_epsilon <= 0 or self.init_method_std <= 0:
            raise ValueError("model.layernorm_epsilon and model.init_method_std must be > 0")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"model.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(f"model.position_embedding_type must be one of {POSITION_EMBEDDING_TYPES}, "
                             f"got {self.position_embedding_type!r}")
        if not isinstance(self.embed_layernorm, bool):
            raise ValueError(f"model.embed_layernorm must be true or false, got {self.embed_layernorm!r}")
        if not self.tie_word_embeddings:
            raise ValueError("model.tie_word_embeddings=false is not supported: gptpar's GPT ties the output "
                             "layer to the word embedding (set it to true)")

    @property
    def learned_positions(self) -> bool:
        """Whether the embedding holds a position table (ALiBi models have none)."""
        return self.position_embedding_type == "learned"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        return pad_vocab_size(self.vocab_size, tp_size, self.make_vocab_size_divisible_by)

    def check_parallel(self, tp_size: int = 1, pp_size: int = 1) -> None:
        """Raise ValueError naming the field and the fix when the model cannot be split tp x pp ways."""
        if tp_size < 1 or pp_size < 1:
            raise ValueError(f"parallel sizes must be >= 1, got tp={tp_size} pp={pp_size}")
        check_tp_divides(tp_size, num_attention_heads=self.num_attention_heads,
                         ffn_hidden_size=self.ffn_hidden_size, hidden_size=self.hidden_size)
        if self.padded_vocab_size(tp_size) % tp_size:
            raise ValueError(
                f"model.vocab_size ({self.vocab_size}) does not divide by tp={tp_size} and padding is off: "
                f"set model.make_vocab_size_divisible_by > 1")
        if pp_size > self.num_layers:
            raise ValueError(
                f"parallel.pipeline_model_parallel_size ({pp_size}) exceeds model.num_layers "
                f"({self.num_layers}): every pipeline stage needs at least one transformer layer")
