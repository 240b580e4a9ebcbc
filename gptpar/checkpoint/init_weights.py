"""Starting a run from existing weights (Megatron's `--finetune`): `checkpoint.init_from`, or a weights-only
checkpoint given as `checkpoint.load`. Weights only: the run starts at iteration 0 with a fresh optimizer, LR
schedule, ramp-up and counters.

The weights may be a gptpar training checkpoint of any tp x pp (a checkpoint folder, or the save folder holding
`latest`), a weights-only gptpar checkpoint (tools/convert_checkpoint.py --to gptpar), a universal checkpoint
(gptpar's, or one DeepSpeed's ds_to_universal.py wrote from a gptpar or Megatron-DeepSpeed GPT/BLOOM run, whose
model shape is this run's config) or a local Hugging Face model directory: `gptpar.checkpoint.weights.read_weights`
reads each into one full (tp = 1) state dict, and every rank takes its blocks by the parameters' own tags (gptpar.model.sharding), a pipeline stage
naming its parameters through gptpar.model.pipeline.gpt_parameter_name. They go into the model before
DeepSpeed's engine is built, so the fp32 master weights (ZeRO-1, bf16's optimizer) start from them too.

Which wins (decided on rank 0 before anything is built, gptpar.training.preflight):
  checkpoint.load holds a training checkpoint   it is resumed; init_from is ignored, and the log says so. As in
                                                Megatron, the pretrained weights only seed a run that has no
                                                checkpoint yet, so a fine-tuning job restarted with
                                                checkpoint.load = checkpoint.save resumes itself.
  checkpoint.load is a weights-only checkpoint  the run starts from its weights (one line says so)
  otherwise                                     the run starts from checkpoint.init_from, if set
The source's model shape must be this config's (gptpar.checkpoint.checkpointer.MODEL_SHAPE_KEYS; its vocabulary may
be smaller than model.vocab_size, the missing rows start at zero): anything else is an error naming the field.
"""
from __future__ import annotations

import functools
import os
from typing import Optional, Tuple

from gptpar.checkpoint.exceptions import CheckpointError
from gptpar.checkpoint.layout import LoadTarget
from gptpar.checkpoint.resume import MODEL_SHAPE_KEYS, weights_only_target
from gptpar.model.config import GPTConfig

FRESH = "iteration 0, a fresh optimizer, LR schedule and counters"


def choose_start(init_from: Optional[str], target: Optional[LoadTarget],
                 note: Optional[str] = None) -> Tuple[Optional[LoadTarget], Optional[str], Optional[str]]:
    """(the checkpoint to resume, the weights to start from, the one line that says which): at most one of the
    first two is set. `target` and `note` are what checkpoint.load resolved to (gptpar.checkpoint.layout.resolve_load)."""
    if target is not None and weights_only_target(target):
        ignored = f" (checkpoint.init_from {init_from} ignored)" if init_from else ""
        return None, target.path, (f"checkpoint.load {target.path} is a weights-only checkpoint: starting from its "
                                   f"weights at {FRESH}{ignored}")
    if target is not None:
        return target, None, (f"checkpoint.init_from {init_from} ignored: resuming {target.path} (checkpoint.load "
                              "holds a checkpoint, and a resume wins)" if init_from else note)
    if init_from:
        return None, init_from, f"starting from the weights of checkpoint.init_from {init_from} at {FRESH}"
    return None, None, note


def check_weights_fit(path: str, model: GPTConfig, field: str = "checkpoint.init_from") -> None:
    """CheckpointError unless the weights at `path` exist, have `model`'s shape (every differing field named) and
    every file that will be read is whole (gptpar.checkpoint.weights.check_weight_files): before anything is built."""
    from gptpar.checkpoint.weights import check_weight_files, read_weights_config

    if not os.path.exists(path):
        raise CheckpointError(f"{field} {path} does not exist: give a gptpar checkpoint (its save folder or an "
                              "iter_N folder), a weights-only or universal checkpoint, or a local Hugging Face "
                              "model directory")
    try:
        source = read_weights_config(path, config=model)
    except (CheckpointError, OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{field} {path} cannot be read as model weights: {e}") from None
    diffs = [f"model.{key}: {field} has {getattr(source, key)!r}, the config {getattr(model, key)!r}"
             for key in MODEL_SHAPE_KEYS if key != "vocab_size" and getattr(source, key) != getattr(model, key)]
    if source.vocab_size > model.vocab_size:
        diffs.append(f"model.vocab_size: {field} has {source.vocab_size} tokens, the config {model.vocab_size} "
                     "(it may be larger, never smaller)")
    if diffs:
        raise CheckpointError(f"{field} {path} holds a model of another shape:\n  " + "\n  ".join(diffs)
                              + "\nset these model fields to the weights' values, or start from other weights")
    try:
        check_weight_files(path, config=model)
    except CheckpointError as e:
        raise CheckpointError(f"{field} {path}: {e}") from None


def load_initial_weights(model, cfg, pstate, path: str, log=print) -> None:
    """Put the weights at `path` into this rank's model (a GPTModel, or its PipelineModule stage for pp > 1), every
    file verified before it is parsed (checkpoint.verify_checksums)."""
    from gptpar.checkpoint.weights import read_weights
    from gptpar.model.pipeline import gpt_parameter_name
    from gptpar.model.sharding import load_full_state_dict

    try:
        state, _ = read_weights(path, config=cfg.model, log=log, verify=cfg.checkpoint.verify_checksums)
    except CheckpointError as e:
        raise CheckpointError(f"{'checkpoint.init_from' if path == cfg.checkpoint.init_from else 'checkpoint.load'} "
                              f"{path}: {e}") from None
    full_name = None
    if pstate.pp_size > 1:
        full_name = functools.partial(gpt_parameter_name, num_layers=cfg.model.num_layers,
                                      embedding_weight=cfg.parallel.embedding_weight or 1)
    try:
        load_full_state_dict(model, state, pstate.tp_group, full_name)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"the weights of {path} do not fit this model: {e}") from None


__all__ = ["choose_start", "check_weights_fit", "load_initial_weights"]
