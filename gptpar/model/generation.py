"""Text generation and held-out perplexity with a `GPTModel` at any tp (the library behind tools/generate.py and
tools/eval_harness.py). Prompts of different lengths generate together (`generate_batch`): left-padded, one
forward per step for the batch, each row computing what it would alone (gpt.padded_attention).

Every tp rank runs the same loop: the model's vocab-parallel logits are gathered into the full vocabulary on
every rank (an all-gather hands each rank identical tensors), and each rank draws from its own generator seeded
alike, so all ranks pick the same token without a broadcast, and tp = 2 draws what tp = 1 draws.

Sampling follows Hugging Face's order: temperature, then top-k, then top-p (the smallest set of most likely
tokens whose probability reaches p), then one draw from the rest. Greedy takes the argmax.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import torch

from gptpar.model.config import GPTConfig
from gptpar.model.gpt import GPTModel, KVCache, forward_with_cache, padded_attention
from gptpar.tensor_parallel.comm import gather_from_tensor_parallel_region


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. top_k = 0 and top_p = 1.0 turn those filters off."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 1234

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature} (greedy decoding takes the argmax "
                             f"instead)")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits (..., V) with the tokens outside the top-k and outside the top-p nucleus set to -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already hold p: the most likely one always stays.
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """One token from full-vocabulary logits (V,)."""
    if sampling.greedy:
        return int(logits.argmax())
    logits = filter_logits(logits.float() / sampling.temperature, sampling.top_k, sampling.top_p)
    return int(torch.multinomial(logits.softmax(dim=-1), 1, generator=generator))


def full_vocab_logits(model: GPTModel, logits: torch.Tensor) -> torch.Tensor:
    """This rank's logits (..., V/tp) -> the real vocabulary's (..., V) on every rank (padding rows dropped)."""
    logits = gather_from_tensor_parallel_region(logits, model.embedding.tp_group)
    return logits[..., :model.config.vocab_size]


@torch.no_grad()
def generate(model: GPTModel, prompt_ids: Sequence[int], max_new_tokens: int, sampling: Sampling, *,
             use_cache: bool = True, stop_id: Optional[int] = None) -> List[int]:
    """The ids that follow `prompt_ids`: `max_new_tokens` of them, or fewer when `stop_id` is drawn (kept last).

    With `use_cache` each step feeds only the newest token through the model (keys and values of the earlier
    ones come from a KVCache); without, each step reruns the model's own forward over the whole sequence."""
    return generate_batch(model, [prompt_ids], max_new_tokens, sampling, use_cache=use_cache, stop_id=stop_id)[0]


@torch.no_grad()
def generate_batch(model: GPTModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling, *,
                   use_cache: bool = True, stop_id: Optional[int] = None,
                   stop: Optional[Callable[[int, List[int]], bool]] = None) -> List[List[int]]:
    """The ids that follow each prompt, generated together: the prompts left-padded to the longest and one
    forward per step for the whole batch (gpt.padded_attention: each row computes what it would alone). Row i
    gets `max_new_tokens` ids, or fewer when it draws `stop_id` (kept last) or when `stop(i, its new ids)` says
    it is done (a stop string in its text, say); the loop ends when every row is. Sampling draws the rows in
    order from one generator, so a batch of one draws what it always did."""
    for prompt in prompts:
        check_length(model.config, len(prompt), max_new_tokens)
    model.eval()
    device = model.embedding.word_embeddings.weight.device
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    longest = max(len(prompt) for prompt in prompts)
    pads = [longest - len(prompt) for prompt in prompts]
    ids = torch.tensor([[0] * p + list(prompt) for p, prompt in zip(pads, prompts)], dtype=torch.long,
                       device=device)  # (b, s), left-padded with id 0 (masked)
    pad = torch.tensor(pads, device=device) if any(pads) else None
    cache = KVCache(len(model.layers), longest + max_new_tokens) if use_cache else None
    step_input, new, done = ids, [[] for _ in prompts], [False] * len(prompts)
    for _ in range(max_new_tokens):
        if use_cache:
            logits = forward_with_cache(model, step_input, cache, pad)  # (b, s, V/tp)
        elif pad is None:
            logits = model(step_input)
        else:
            position_ids, mask = padded_attention(pad, 0, step_input.shape[1], device)
            logits = model(step_input, position_ids=position_ids, attention_mask=mask)
        last = full_vocab_logits(model, logits[:, -1])  # (b, V)
        for i, row in enumerate(new):
            if not done[i]:
                row.append(next_token(last[i], sampling, generator))
                done[i] = row[-1] == stop_id or (stop is not None and stop(i, row))
        if all(done):
            break
        # A finished row goes on with its last token: its outputs are no longer read.
        token_ids = torch.tensor([[row[-1]] for row in new], dtype=torch.long, device=device)  # (b, 1)
        # The cache needs only the new tokens; without it the whole sequence goes in again.
        step_input = token_ids if use_cache else torch.cat([step_input, token_ids], dim=1)
    return new


def check_length(config: GPTConfig, prompt_length: int, max_new_tokens: int) -> None:
    """The prompt and the new tokens must fit the learned position table (ValueError naming the field). ALiBi
    has no table: its length is the caller's to choose, as Hugging Face's BLOOM leaves it (lm-eval's HFLM takes
    the tokenizer's model_max_length, else 2048)."""
    if prompt_length < 1 or max_new_tokens < 1:
        raise ValueError(f"need a non-empty prompt and max new tokens >= 1 (got {prompt_length} prompt tokens, "
                         f"{max_new_tokens} new)")
    limit = config.max_position_embeddings
    if config.learned_positions and prompt_length + max_new_tokens > limit:
        raise ValueError(f"{prompt_length} prompt tokens + {max_new_tokens} new tokens exceed the model's "
                         f"model.max_position_embeddings ({limit}): shorten the prompt or ask for fewer tokens")


@torch.no_grad()
def mean_token_loss(model: GPTModel, documents: Iterable[Sequence[int]], window: int) -> Tuple[float, int]:
    """(mean cross-entropy over every predicted token, number of tokens): each document is cut into windows of
    `window` inputs (each window predicts its next `window` tokens, no overlap), its first token never predicted.
    exp of the mean is the perplexity."""
    model.eval()
    device = model.embedding.word_embeddings.weight.device
    total, count = 0.0, 0
    for doc in documents:
        for start in range(0, len(doc) - 1, window):
            chunk = torch.tensor([list(doc[start:start + window + 1])], dtype=torch.long, device=device)
            labels = chunk[:, 1:]
            total += float(model(chunk[:, :-1], labels=labels)) * labels.numel()
            count += labels.numel()
    if count == 0:
        raise ValueError("no tokens to score: every document is shorter than 2 tokens")
    return total / count, count


__all__ = ["Sampling", "filter_logits", "next_token", "full_vocab_logits", "generate", "generate_batch", "check_length",
           "mean_token_loss"]
