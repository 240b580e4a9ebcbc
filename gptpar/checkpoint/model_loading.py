"""A trained model made ready for inference at any tensor-parallel size: the one loader behind tools/generate.py
and tools/eval_harness.py.

What the tools accept as `load` (gptpar.checkpoint.weights.read_weights reads each): a gptpar checkpoint saved at any
tp x pp (a checkpoint directory, or the save directory holding `latest`), a universal checkpoint, or a local
Hugging Face GPT-2 / BLOOM directory. Everything a bad argument could contradict (the model's shape, its
vocabulary, the tokenizer it came with) is read here without the weights, so a tool refuses it before reading
any; `load_model` then reads the files holding this rank's tensor-parallel blocks, once each, and keeps them.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from gptpar.checkpoint.weights import is_hf_model_dir, read_weights, resolve_checkpoint_dir, run_config_of
from gptpar.model.config import GPTConfig


def _checkpoint_tokenizer(load: str, tag: Optional[str] = None) -> Optional[str]:
    """The tokenizer a checkpoint comes with: a Hugging Face directory's own (when it holds tokenizer.json), or
    the training run's data.tokenizer_model (None when it names none)."""
    if os.path.isdir(load) and is_hf_model_dir(load):
        return load if os.path.isfile(os.path.join(load, "tokenizer.json")) else None
    return ((run_config_of(load, tag) or {}).get("data") or {}).get("tokenizer_model")


def tokenizer_path(load: str, tag: Optional[str] = None, given: Optional[str] = None) -> Optional[str]:
    """The tokenizer a tool encodes with: `given` (its --tokenizer), else the checkpoint's (None when it names
    none). ValueError when the run's data.tokenizer_model, a path relative to where it trained, is not found."""
    if given:
        return given
    path = _checkpoint_tokenizer(load, tag)
    if path and not os.path.exists(path):
        raise ValueError(f"{load} was trained with data.tokenizer_model {path}, not found from {os.getcwd()}: "
                         f"run from the training's directory or pass --tokenizer PATH")
    return path


def check_tokenizer_fits(config: GPTConfig, tokenizer) -> None:
    """ValueError unless every id the tokenizer makes has a row in the model's embedding (the model may have more
    rows than the tokenizer ids, as BLOOM's and other padded vocabularies do)."""
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's model.vocab_size is "
                         f"{config.vocab_size}: pass the tokenizer the model was trained with (--tokenizer)")


def checkpoint_provenance(load: str, tag: Optional[str] = None) -> dict:
    """Where the weights come from and how far their training had gone: {"checkpoint": absolute path,
    "iteration", "consumed_samples", "consumed_tokens"} (None where the source records no counters: a Hugging
    Face directory, a weights-only checkpoint, a universal folder written by DeepSpeed)."""
    from gptpar.checkpoint import universal
    from gptpar.checkpoint.layout import is_universal_folder, state_file
    from gptpar.checkpoint.manifest import open_folder
    from gptpar.checkpoint.resume import read_rank_state

    quiet = lambda *_: None  # noqa: E731 - the weights' read says what there is to say
    counters: dict = {}
    if os.path.isdir(load) and (is_universal_folder(load) or is_hf_model_dir(load)):
        path = load
        if is_universal_folder(load):
            verifier = universal.open_universal(load, quiet, quiet=True)
            if verifier.manifest is not None:
                counters = universal.read_meta(verifier).get("counters") or {}
    else:
        path = resolve_checkpoint_dir(load, tag)
        verifier = open_folder(path, "use another checkpoint", quiet, quiet=True)
        if verifier.manifest is not None and verifier.manifest.record(os.path.join(path, state_file(0))):
            counters = read_rank_state(path, 0, verifier)
    return {"checkpoint": os.path.abspath(path), "iteration": counters.get("iteration"),
            "consumed_samples": counters.get("consumed_samples"), "consumed_tokens": counters.get("consumed_tokens")}


def load_model(load: str, tag: Optional[str], pstate, dtype: Optional[torch.dtype] = None,
               log: Callable[[str], None] = print, verify: bool = True):
    """A GPTModel in eval mode on `pstate.device` holding this tp rank's blocks of the weights `load` holds, in
    `dtype` (default: fp32) (pp = 1). Each rank reads, and verifies before parsing, only the files that hold its
    blocks (gptpar.checkpoint.weights.shards_needed), each once; the tp ranks agree, so that a file one rank
    refuses ends every rank with its message."""
    from gptpar.model.gpt import GPTModel
    from gptpar.model.sharding import load_full_state_dict

    from gptpar.checkpoint.exceptions import CheckpointError

    try:
        state, config = read_weights(load, tag, log=log, verify=verify, for_rank=(pstate.tp_rank, pstate.tp_size))
        refused = None
    except CheckpointError as e:
        refused = e
    if pstate.tp_size > 1:  # ranks read different files: one that refuses its own ends every rank, in its words
        said = [None] * pstate.tp_size
        torch.distributed.all_gather_object(said, None if refused is None else (type(refused), str(refused)),
                                            group=pstate.tp_group)
        first = next((s for s in said if s is not None), None)
        if first is not None:
            raise first[0](first[1])
    elif refused is not None:
        raise refused
    model = GPTModel(config, tp_group=pstate.tp_group, device=pstate.device, dtype=dtype)
    load_full_state_dict(model, state, pstate.tp_group)
    return model.eval()


__all__ = ["tokenizer_path", "check_tokenizer_fits", "checkpoint_provenance", "load_model"]
