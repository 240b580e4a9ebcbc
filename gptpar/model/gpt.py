"""A pre-LayerNorm GPT-2 built from the tensor-parallel layers.

Activations flow as (s, b, h) — sequence first, as in Megatron — so that sequence parallelism splits a
contiguous block of dim 0. Under sequence parallelism (sp) the residual stream is (s/tp, b, h) between
the attention and MLP blocks; LayerNorms run on the local block and their gradients (and the row-parallel
biases') are summed over tp by gradient hooks.

Fused QKV layout: `attention.query_key_value.weight` is the ColumnParallelLinear of shape (3h, h) whose
output dim is ordered (head, {q, k, v}, head_dim) — Megatron's layout — so rank r's contiguous rows hold
whole heads [r*nh/tp, (r+1)*nh/tp), each with its q, k and v. Hugging Face's GPT-2 `c_attn` (a Conv1D,
(h, 3h)) orders its output ({q, k, v}, head, head_dim); `gptpar.model.hf` converts between the two.

Every block seeds its own initialisation (a per-block seed derived from the model seed), so a block's
weights are the same whichever pipeline stage builds it and whatever the tp size: any topology starts
from the same model as tp = pp = 1.

The blocks double as DeepSpeed pipeline layers: each takes and returns either a hidden tensor or a
tuple (hidden, attention_mask), so the same classes build the plain `GPTModel` and the `PipelineModule`.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptpar.model.alibi import alibi_attention_bias, rank_alibi_slopes
from gptpar.model.config import GPTConfig, recompute_mode
from gptpar.model.kernels import make_layer_norm
from gptpar.tensor_parallel.comm import (Group, divide, gather_from_sequence_parallel_region, group_rank,
                                         group_size, mark_sequence_parallel, scatter_to_sequence_parallel_region)
from gptpar.tensor_parallel.cross_entropy import (LogitsWorkspace, linear_cross_entropy,
                                                  vocab_parallel_cross_entropy)
from gptpar.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                           init_normal, linear_with_grad_all_reduce)
from gptpar.tensor_parallel.random import RNGStatesTracker, checkpoint, counter_dropout, dropout_seeds

_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "relu": F.relu}


@contextlib.contextmanager
def seeded(seed: int):
    """Run a block's construction on its own CPU generator state, leaving the caller's untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def block_seed(seed: int, index: int) -> int:
    """Seed of block `index` (0 = embedding, 1 + i = transformer layer i)."""
    return seed * 1000003 + index


def _split_mask(inputs):
    return inputs if isinstance(inputs, tuple) else (inputs, None)


def _join_mask(hidden, mask):
    return hidden if mask is None else (hidden, mask)


class _Dropout(nn.Module):
    """Dropout that draws from the tensor-parallel stream when its input differs across tp ranks."""

    def __init__(self, p: float, tracker: Optional[RNGStatesTracker], per_rank: bool):
        super().__init__()
        self.p, self.tracker, self.per_rank = p, tracker, per_rank

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        if self.per_rank and self.tracker is not None:
            with self.tracker.fork():
                return F.dropout(x, self.p, training=True)
        return F.dropout(x, self.p, training=True)


class GPTEmbedding(nn.Module):
    """Word (vocab-parallel) embedding, + learned position embeddings (position_embedding_type "learned"),
    then BLOOM's LayerNorm (embed_layernorm). (b, s) ids -> (s, b, h), or (s/tp, b, h) under sp.

    Input: ids, or a tuple (ids, position_ids, attention_mask) where either may be None.
    `words_only=True` builds the last pipeline stage's tied copy, which only needs the word embedding: the
    embedding stage alone owns the position table and the embedding LayerNorm.
    """

    def __init__(self, config: GPTConfig, *, tp_group: Group = None, sequence_parallel: bool = False,
                 rng_tracker: Optional[RNGStatesTracker] = None, seed: int = 1234,
                 words_only: bool = False, device=None, dtype=None):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        init = init_normal(config.init_method_std)
        with seeded(block_seed(seed, 0)):
            self.word_embeddings = VocabParallelEmbedding(
                config.padded_vocab_size(group_size(tp_group)), config.hidden_size, group=tp_group,
                init_method=init, device=device, dtype=dtype)
            self.position_embeddings = None
            if config.learned_positions and not words_only:
                self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                                        device=device, dtype=dtype)
                if self.position_embeddings.weight.device.type != "meta":
                    init(self.position_embeddings.weight.data)
        # Computed before the sequence-parallel scatter, on the whole (replicated) sequence: its gradients
        # are then the same on every tp rank and need no sequence-parallel reduction.
        self.word_embeddings_layernorm = None
        if config.embed_layernorm and not words_only:
            self.word_embeddings_layernorm = make_layer_norm(config.hidden_size, config.layernorm_epsilon,
                                                             device=device, dtype=dtype)
        self.dropout = _Dropout(config.hidden_dropout, rng_tracker, per_rank=sequence_parallel)

    def forward(self, inputs):
        if isinstance(inputs, tuple):
            ids, position_ids, mask = (tuple(inputs) + (None, None))[:3]
        else:
            ids, position_ids, mask = inputs, None, None
        x = self.word_embeddings(ids)  # (b, s, h)
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
            x = x + self.position_embeddings(position_ids)
        if self.word_embeddings_layernorm is not None:
            x = self.word_embeddings_layernorm(x)
        x = x.transpose(0, 1).contiguous()  # (s, b, h)
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)  # (s/tp, b, h)
        return _join_mask(self.dropout(x), mask)


class TransformerLayer(nn.Module):
    """x + attn(ln1(x)), then + mlp(ln2(x)). Input/output (s, b, h) (or (s/tp, b, h) under sp),
    optionally paired with a boolean attention mask (b, 1, s, s), True = may attend.

    `recompute_core_attention` is selective recompute: in training the attention core is recomputed in
    backward instead of keeping its (b, nh/tp, s, s) tensors, the linears and their inputs are kept.
    With ALiBi (gptpar.model.alibi) the core adds this rank's heads' distance biases to the scores.
    `float8` (gptpar.tensor_parallel.float8.Float8Matmul) runs the four linears' GEMMs in float8 (precision fp8).

    `compiled` (set by `compile_transformer_layers`) runs `body` through torch.compile; see `_forward_compiled`."""

    def __init__(self, config: GPTConfig, layer_number: int, *, tp_group: Group = None,
                 sequence_parallel: bool = False, rng_tracker: Optional[RNGStatesTracker] = None,
                 seed: int = 1234, recompute_core_attention: bool = False, float8=None, device=None, dtype=None):
        super().__init__()
        self.recompute_core_attention = recompute_core_attention
        tp = group_size(tp_group)
        h = config.hidden_size
        self.num_heads = divide(config.num_attention_heads, tp, "num_attention_heads")  # heads on this rank
        self.head_dim = config.head_dim
        self.attention_dropout = config.attention_dropout
        # fp32 slopes of this rank's heads (a plain tensor, not a buffer: a bf16 model must not round them).
        self.alibi_slopes = (rank_alibi_slopes(config.num_attention_heads, group_rank(tp_group), tp)
                             if config.position_embedding_type == "alibi" else None)
        self.activation = _ACTIVATIONS[config.activation]
        self.rng_tracker = rng_tracker
        init = init_normal(config.init_method_std)
        # GPT-2 / Megatron: the projections into the residual stream are scaled by 1/sqrt(2 * layers).
        out_init = init_normal(config.init_method_std / math.sqrt(2.0 * config.num_layers))
        tp_kw = dict(group=tp_group, sequence_parallel=sequence_parallel, float8=float8, device=device, dtype=dtype)
        with seeded(block_seed(seed, 1 + layer_number)):
            self.input_layernorm = make_layer_norm(h, config.layernorm_epsilon, device=device, dtype=dtype)
            self.query_key_value = ColumnParallelLinear(h, 3 * h, init_method=init, **tp_kw)
            self.dense = RowParallelLinear(h, h, init_method=out_init, **tp_kw)
            self.post_attention_layernorm = make_layer_norm(h, config.layernorm_epsilon, device=device,
                                                            dtype=dtype)
            self.dense_h_to_4h = ColumnParallelLinear(h, config.ffn_hidden_size, init_method=init, **tp_kw)
            self.dense_4h_to_h = RowParallelLinear(config.ffn_hidden_size, h, init_method=out_init, **tp_kw)
        if sequence_parallel:
            # (the row-parallel biases mark themselves)
            mark_sequence_parallel([*self.input_layernorm.parameters(), *self.post_attention_layernorm.parameters()],
                                   tp_group)
        self.hidden_dropout = _Dropout(config.hidden_dropout, rng_tracker, per_rank=sequence_parallel)
        # Under sequence parallelism this rank's (s/tp, b, h) block starts at element tp_rank * its numel of the
        # (s, b, h) tensor: the compiled dropout draws that block of the whole tensor's mask.
        self.sequence_block = group_rank(tp_group) if sequence_parallel else 0
        self.compiled = False

    def qkv_heads(self, x: torch.Tensor):
        """(s, b, h) -> q, k, v, each (b, nh/tp, s, d): the heads of this rank."""
        qkv = self.query_key_value(x)  # (s, b, 3h/tp), heads of this rank
        s, b = qkv.shape[0], qkv.shape[1]
        qkv = qkv.view(s, b, self.num_heads, 3, self.head_dim)
        # Strided views, no copies (SDPA takes any strides with a contiguous last dim). unbind, not three
        # selects: its backward stacks the three gradients into one (s, b, nh, 3, d) buffer, where each
        # select's backward would zero-fill a full-size buffer and the three would then be summed.
        return tuple(t.permute(1, 2, 0, 3) for t in qkv.unbind(dim=3))

    def attention_output(self, ctx: torch.Tensor) -> torch.Tensor:
        """The heads' context (b, nh/tp, s, d) -> the output projection (s, b, h), summed over tp.

        No copy on a GPU: CUDA's cuDNN and flash attention allocate their output in q's layout, here (s, b, nh, d)
        (qkv_heads' views of one (s, b, 3h/tp) GEMM output), so the permute and reshape are a view (a copy after
        the memory-efficient kernel and the math fallback, e.g. a CPU with dropout; tests/integration/test_model.py checks the
        CUDA kernels' layouts)."""
        b, _, s, _ = ctx.shape
        return self.dense(ctx.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.head_dim))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.activation(self.dense_h_to_4h(x)))

    def attention(self, x: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        q, k, v = self.qkv_heads(x)  # each (b, nh/tp, s, d)
        if self.recompute_core_attention and self.training:
            # Selective recompute (Korthikanti et al. 2022): q, k, v are kept, the core is redone in backward
            # with the same dropout mask (the tracker's streams are replayed). Its s x s tensors are what a
            # non-fused kernel keeps (5as/h of the layer's 34 + 5as/h bytes per sbh at tp=1); QK^T and .V
            # cost only 4sh of the layer's 24h^2 + 4sh forward FLOPs per token (f = 4h).
            # Compiled, the whole layer already runs in the tracker's stream, so the recompute needs no stream
            # replay of its own: torch's checkpoint, which the graph takes in (no graph break).
            ctx = checkpoint(self.core_attention, q, k, v, mask, tracker=None if self.compiled else self.rng_tracker)
        else:
            ctx = self.core_attention(q, k, v, mask)
        return self.attention_output(ctx)

    def core_attention(self, q, k, v, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """dropout(softmax(q k^T / sqrt(d) + mask [+ ALiBi])) v: q (b, nh/tp, sq, d), k and v (b, nh/tp, sk, d)
        -> (b, nh/tp, sq, d). Under selective recompute the ALiBi bias is rebuilt in backward, not kept."""
        dropout_p = self.attention_dropout if self.training else 0.0
        if self.alibi_slopes is not None:
            if self.alibi_slopes.device != q.device:  # moved once, not copied host-to-device every call
                self.alibi_slopes = self.alibi_slopes.to(q.device)
            # SDPA takes one attn_mask: the bias with the causal or explicit mask folded in.
            mask = alibi_attention_bias(self.alibi_slopes, q.shape[-2], k.shape[-2], mask, q.dtype)
            causal = False
        else:
            causal = mask is None
        # The attention probabilities belong to this rank's heads: their dropout draws per tp rank (compiled, the
        # stream is entered around the whole layer instead: `_forward_compiled`).
        forked = dropout_p > 0 and self.rng_tracker is not None and not self.compiled
        fork = self.rng_tracker.fork() if forked else contextlib.nullcontext()
        with fork:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal)

    def forward(self, inputs):
        x, mask = _split_mask(inputs)
        return _join_mask(self._forward_compiled(x, mask) if self.compiled else self.body(x, mask), mask)

    def body(self, x: torch.Tensor, mask: Optional[torch.Tensor], seeds: Optional[torch.Tensor] = None):
        """x + dropout(attn(ln1(x))), then + dropout(mlp(ln2(x))). With `seeds` (compiled) the two dropouts are
        `counter_dropout`s seeded by its two entries, else `hidden_dropout` (the generator's)."""
        x = x + self._residual_dropout(self.attention(self.input_layernorm(x), mask), seeds, 0)
        return x + self._residual_dropout(self.mlp(self.post_attention_layernorm(x)), seeds, 1)

    def _residual_dropout(self, y: torch.Tensor, seeds: Optional[torch.Tensor], site: int) -> torch.Tensor:
        if seeds is None:
            return self.hidden_dropout(y)
        return counter_dropout(y, self.hidden_dropout.p, seeds[site], offset=self.sequence_block * y.numel())

    def _forward_compiled(self, x: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """`body` through one torch.compile'd function shared by every layer (regional compilation: one graph for
        all layers, compile time independent of depth; parameter names untouched).

        Random numbers without a generator-state swap inside the graph (a graph break): the residual dropouts'
        seeds are drawn here from the default stream, the same on every tp rank, so their `counter_dropout` masks
        agree on replicated activations (and are the whole tensor's mask under sequence parallelism); then the
        graph runs inside the tracker's per-tp-rank stream, from which the attention dropout (SDPA's own draw, of
        this rank's heads) draws. Full recompute replays both: torch's checkpoint restores the default stream
        (the same seeds), gptpar's the tracker's; selective recompute is inside the graph (torch's checkpoint)."""
        if self.alibi_slopes is not None and self.alibi_slopes.device != x.device:
            self.alibi_slopes = self.alibi_slopes.to(x.device)  # outside the graph: no attribute mutation in it
        seeds = dropout_seeds(x.device) if self.training and self.hidden_dropout.p > 0 else None
        forked = self.training and self.attention_dropout > 0 and self.rng_tracker is not None
        with self.rng_tracker.fork() if forked else contextlib.nullcontext():
            return _compiled_body()(self, x, mask, seeds)


@functools.lru_cache(maxsize=None)
def _compiled_body():
    """The one torch.compile'd `TransformerLayer.body`: every layer calls it with itself as the first argument, so
    Dynamo traces one graph (per training/eval mode, mask kind and dtype) whose parameters are inputs."""
    return torch.compile(TransformerLayer.body)


def compile_transformer_layers(model: nn.Module) -> int:
    """training.compile: every TransformerLayer in `model` (a GPTModel or a pipeline stage) runs its body through
    the one compiled function (`TransformerLayer._forward_compiled`), and the loss (GPTModel's fused output layer
    and loss, or the last stage's GPTLoss) its passes over the logits as compiled kernels (`compiled=True` of
    gptpar.tensor_parallel.cross_entropy); returns how many layers."""
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.compiled = True
    for m in model.modules():
        if isinstance(getattr(m, "loss_fn", None), GPTLoss):  # GPTModel, DeepSpeed's PipelineModule
            m.loss_fn.compiled = True
    return len(layers)


def compile_stats() -> dict:
    """What torch.compile did in this process so far: {'seconds' (Dynamo's tracing + inductor's code generation,
    forward and backward), 'graphs', 'graph_breaks'}. Read from torch._dynamo.utils, whose counters are
    process-wide (tests/integration/test_compile.py pins these names)."""
    from torch._dynamo.utils import calculate_time_spent, counters

    return {"seconds": calculate_time_spent().get("total_wall_time", 0.0),
            "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values())}


class FinalLayerNorm(nn.Module):
    """The last LayerNorm; drops the attention mask, which the output layer does not need."""

    def __init__(self, config: GPTConfig, *, tp_group: Group = None, sequence_parallel: bool = False,
                 device=None, dtype=None):
        super().__init__()
        self.norm = make_layer_norm(config.hidden_size, config.layernorm_epsilon, device=device, dtype=dtype)
        if sequence_parallel:
            mark_sequence_parallel(self.norm.parameters(), tp_group)

    def forward(self, inputs):
        x, _ = _split_mask(inputs)
        return self.norm(x)


def lm_logits(embedding: GPTEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """The output layer, tied to the word embedding: (s, b, h) -> (s, b, V/tp) logits of this rank's vocab.

    Also the `forward_fn` of the last pipeline stage's tied embedding (a plain function, no lambda)."""
    weight = embedding.word_embeddings.weight
    main_grad = getattr(weight, "main_grad", None)  # gradient-accumulation fusion (the engine installs it)
    if embedding.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, embedding.tp_group)  # bwd: reduce-scatter
        return linear_with_grad_all_reduce(hidden, weight, None, None, main_grad)
    return linear_with_grad_all_reduce(hidden, weight, None, embedding.tp_group, main_grad)  # f + linear


def lm_loss(embedding: GPTEmbedding, hidden: torch.Tensor, labels: torch.Tensor, vocab_size: int,
            workspace: Optional[LogitsWorkspace] = None, compiled: bool = False) -> torch.Tensor:
    """The output layer and the loss in one function: (s, b, h) hidden and (s, b) labels -> (s, b) fp32 losses.

    Equals `vocab_parallel_cross_entropy(lm_logits(embedding, hidden), labels)` keeping only the logits themselves
    (no fp32 copy; their buffer becomes their gradient in backward), at any tp and dtype. `compiled`: the loss's
    passes over the logits as compiled kernels (training.compile)."""
    weight = embedding.word_embeddings.weight
    if embedding.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, embedding.tp_group)  # bwd: reduce-scatter
    return linear_cross_entropy(hidden, weight, labels, group=embedding.tp_group, vocab_size=vocab_size,
                                reduce_input_grad=not embedding.sequence_parallel,
                                workspace=workspace if hidden.device.type == "cpu" else None, compiled=compiled)


class GPTLoss:
    """Mean cross-entropy over the tokens whose loss mask is 1.

    Called as loss_fn(logits (s, b, V/tp), labels) with labels (b, s) or a tuple (labels, loss_mask): the pipeline's
    last stage (GPTModel fuses the output layer with the loss instead: `lm_loss`). It owns the logits it is given,
    so their gradient is written into their buffer. A plain callable object so DeepSpeed's pipeline can hold it.
    `compiled` (set by `compile_transformer_layers`, also read by GPTModel for its fused loss): the loss's passes
    over the logits run as compiled kernels."""

    def __init__(self, vocab_size: int, tp_group: Group = None):
        self.vocab_size, self.tp_group = vocab_size, tp_group
        self.compiled = False
        self.__name__ = "GPTLoss"

    def __call__(self, logits: torch.Tensor, labels) -> torch.Tensor:
        labels, loss_mask = labels if isinstance(labels, (tuple, list)) else (labels, None)
        losses = vocab_parallel_cross_entropy(logits, labels.t(), group=self.tp_group, vocab_size=self.vocab_size,
                                              inplace_backward=True, compiled=self.compiled)  # (s, b)
        return self.reduce(losses, loss_mask)

    @staticmethod
    def reduce(losses: torch.Tensor, loss_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Per-token losses (s, b) -> their mean over the tokens whose loss mask (b, s) is 1."""
        if loss_mask is None:
            return losses.mean()
        loss_mask = loss_mask.t().to(losses.dtype)
        return (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)


class GPTModel(nn.Module):
    """The whole GPT on one pipeline stage (pp = 1), for any tp and with or without sequence parallelism.

    forward(input_ids (b, s), position_ids=None, attention_mask=None, labels=None, loss_mask=None):
    the mean loss when `labels` is given, else this rank's logits (b, s, V/tp).

    activation_checkpointing: "none", "selective" (the attention core is recomputed in backward), "full"
    (each transformer layer is), or the older True (= full) / False (= none). `float8`: see TransformerLayer.
    """

    def __init__(self, config: GPTConfig, *, tp_group: Group = None, sequence_parallel: bool = False,
                 rng_tracker: Optional[RNGStatesTracker] = None, seed: int = 1234,
                 activation_checkpointing="none", float8=None, device=None, dtype=None):
        super().__init__()
        config.check_parallel(group_size(tp_group), 1)
        self.config = config
        self.recompute, self.rng_tracker = recompute_mode(activation_checkpointing), rng_tracker
        kw = dict(tp_group=tp_group, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.embedding = GPTEmbedding(config, rng_tracker=rng_tracker, seed=seed, **kw)
        self.layers = nn.ModuleList(TransformerLayer(config, i, rng_tracker=rng_tracker, seed=seed, float8=float8,
                                                     recompute_core_attention=self.recompute == "selective", **kw)
                                    for i in range(config.num_layers))
        self.final_layernorm = FinalLayerNorm(config, **kw)
        self.loss_fn = GPTLoss(config.vocab_size, tp_group)
        self._logits_workspace = LogitsWorkspace()  # the loss's reusable logits buffer on a CPU

    def forward(self, input_ids, position_ids=None, attention_mask=None, labels=None, loss_mask=None):
        x = self.embedding((input_ids, position_ids, attention_mask))
        for layer in self.layers:
            if self.recompute == "full" and self.training:
                x = checkpoint(layer, x, tracker=self.rng_tracker)
            else:
                x = layer(x)
        hidden = self.final_layernorm(x)
        if labels is None:
            return lm_logits(self.embedding, hidden).transpose(0, 1)  # (b, s, V/tp)
        losses = lm_loss(self.embedding, hidden, labels.t(), self.config.vocab_size, self._logits_workspace,
                         compiled=self.loss_fn.compiled)
        return self.loss_fn.reduce(losses, loss_mask)


# ---------------------------------------------------------------------------------------------------------------
# Inference with a key/value cache (tools/generate.py). The training forward above is untouched: this path reuses
# the layers' own pieces (qkv_heads, core_attention, attention_output, mlp), feeding each new token's query the
# keys and values of every earlier token from the cache instead of recomputing them.
# ---------------------------------------------------------------------------------------------------------------

class KVCache:
    """Each layer's keys and values (b, nh/tp, t, d) for the first `length` tokens, in buffers of `max_length`
    allocated at the first step (so a step writes its new tokens in place instead of re-concatenating)."""

    def __init__(self, num_layers: int, max_length: int):
        self.max_length, self.length = max_length, 0
        self.keys = [None] * num_layers
        self.values = [None] * num_layers

    def extend(self, index: int, k: torch.Tensor, v: torch.Tensor):
        """Store layer `index`'s new k, v (b, nh/tp, s, d) after the cached tokens; return the keys and values
        of all tokens so far, each (b, nh/tp, length + s, d)."""
        end = self.length + k.shape[2]
        if end > self.max_length:
            raise ValueError(f"KVCache holds {self.max_length} tokens; {end} were asked for")
        if self.keys[index] is None:
            shape = (k.shape[0], k.shape[1], self.max_length, k.shape[3])
            self.keys[index], self.values[index] = k.new_empty(shape), v.new_empty(shape)
        self.keys[index][:, :, self.length:end] = k
        self.values[index][:, :, self.length:end] = v
        return self.keys[index][:, :, :end], self.values[index][:, :, :end]


def padded_attention(pad: Optional[torch.Tensor], start: int, s: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Position ids (1 or b, s) and boolean attention mask (1 or b, 1, s, start + s), True = may attend, of s
    tokens that follow `start` earlier ones in rows left-padded with `pad` (b,) tokens (None: no padding).

    A token sees its row's earlier real tokens and itself, and its position counts only the real tokens before
    it, so each row of a padded batch computes what it would alone. A padding slot sees only itself, so that no
    query has an empty row: what attention gives for one differs by kernel (torch 2.13's SDPA on CPU returns
    zeros, a plain softmax NaN), and a NaN there would reach the real tokens through that slot's keys."""
    steps = torch.arange(start, start + s, device=device)  # the new tokens' slots in the row
    keys = torch.arange(start + s, device=device)
    causal = keys.unsqueeze(0) <= steps.unsqueeze(1)  # (s, start + s)
    if pad is None:
        return steps.unsqueeze(0), causal.view(1, 1, s, start + s)
    pad = pad.view(-1, 1, 1)
    real_key = keys.view(1, 1, -1) >= pad  # (b, 1, start + s)
    itself = keys.view(1, 1, -1) == steps.view(1, -1, 1)  # (1, s, start + s)
    position_ids = (steps.unsqueeze(0) - pad.view(-1, 1)).clamp(min=0)  # (b, s)
    return position_ids, ((causal.unsqueeze(0) & real_key) | itself).unsqueeze(1)


@torch.no_grad()
def forward_with_cache(model: GPTModel, input_ids: torch.Tensor, cache: KVCache,
                       pad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's logits (b, s, V/tp) of `input_ids` (b, s), the tokens that follow the `cache.length` cached
    ones; their keys and values join the cache. Equals the last s positions of `model(all ids)` in eval mode.
    `pad` (b,): the rows' left-padding (padded_attention), the same at every step of one batch."""
    if model.training or model.embedding.sequence_parallel:
        raise ValueError("forward_with_cache needs a model in eval mode built without sequence parallelism")
    start, s = cache.length, input_ids.shape[1]
    # New query i (slot start + i) sees keys 0 .. start + i: the causal mask offset by the cached tokens
    # (SDPA's is_causal would align the new queries with the first keys instead).
    position_ids, mask = padded_attention(pad, start, s, input_ids.device)
    x = model.embedding((input_ids, position_ids, None))  # (s, b, h)
    for index, layer in enumerate(model.layers):
        q, k, v = layer.qkv_heads(layer.input_layernorm(x))
        k, v = cache.extend(index, k, v)
        x = x + layer.attention_output(layer.core_attention(q, k, v, mask))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    cache.length += s
    return lm_logits(model.embedding, model.final_layernorm(x)).transpose(0, 1)  # (b, s, V/tp)
