"""Checkpoints: DeepSpeed's files plus gptpar's own state, and a `latest` pointer that is never half-written.

Layout of one checkpoint (tag `iter_{N:07d}`):

    {save}/latest                       "iter_0000300": written by rank 0 only after every rank finished
                                        (barrier), via a temporary file + atomic rename
    {save}/iter_0000300/                DeepSpeed's save_checkpoint(save, tag, save_latest=False): model
                                        states per (tp, pp) rank, ZeRO-1 optimizer shards per dp rank
    {save}/iter_0000300/gptpar_rank_00000.pt   per rank: counters, ramp-up and LR-schedule inputs, the RNG
                                        states (torch, numpy, python, the tp tracker's streams)
    {save}/iter_0000300/config.json     the resolved config of the run that saved it
    {save}/iter_0000300/gptpar_manifest.json   every file of the checkpoint and its size; written last, so a
                                        folder without it is partial (gptpar.training.checkpoint_files)

A save killed half-way leaves `latest` on the previous complete checkpoint, so a resume never reads a
partial one; the next start deletes the partial folder (gptpar.training.save_folder). `keep_last` deletes
the oldest complete checkpoints after `latest` moved on. A save that fails (a full disk, an I/O error)
raises CheckpointSaveError naming the folder and the cause; `latest` stays where it was.

Resume: what `checkpoint.load` points at is resolved and verified before training (checkpoint_files.
resolve_load / verify_checkpoint, then `plan_load`); the model shape stored with it must equal the current
config's (a clear error naming the key otherwise); every other key (LR, intervals, exit conditions, ...)
comes from the current config. A checkpoint of another parallel shape (tp, pp, dp, partitioning at pp > 1),
or saved with a precision whose optimizer files this run's does not load (gptpar.model.universal.
optimizer_files), is resumed through its universal form (gptpar.model.universal, docs/checkpoints.md): rank 0
converts it once into `checkpoint.universal_dir` (default: `{load folder}_universal/`, never inside the load
folder), with the save folder's lock held, or reuses the copy already there when it was converted from exactly
these files (`checkpoint_files.fingerprint`; else it is rebuilt, in one line), and every rank takes its slices
of each parameter's fp32 master weight and Adam moments from it. The counters (iteration, consumed samples and
tokens, the LR schedule's inputs) travel with it; the RNG streams are per rank and restart from the seed. A
universal folder without counters (one DeepSpeed's ds_to_universal.py wrote, from a gptpar or a Megatron-DeepSpeed
run) gives the weights, moments and Adam's step, and the counters and LR schedule start from 0. gptpar's own files are read with unpickling
disabled (`weights_only=True`); DeepSpeed's per-rank files are pickles, which its engine loads itself.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
import shutil
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from gptpar.model import universal
from gptpar.model.config import GPTConfig
from gptpar.model.sharding import shard_tensor
from gptpar.model.weight_files import load_torch_file
from gptpar.training.checkpoint_files import (CONFIG, LATEST, TAG_RE, CheckpointError, LoadTarget,
                                              complete_checkpoints, describe_write_failure, fingerprint,
                                              is_write_failure, read_latest, saved_world_size, state_file, tag_of,
                                              verify_checkpoint, write_latest, write_manifest)

FORMAT_VERSION = 3  # 2: a manifest marks a complete checkpoint; 3: numpy's RNG state saved as a tensor

# The keys that fix the shape of the weights and of the optimizer shards.
MODEL_SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                    "max_position_embeddings", "activation", "vocab_size", "position_embedding_type",
                    "embed_layernorm")
# Shape keys added after checkpoints were written without them: such a checkpoint has the default (None: not
# checked; older checkpoints record the padded vocabulary, which is compared instead).
_ADDED_SHAPE_KEYS = {"position_embedding_type": "learned", "embed_layernorm": False, "vocab_size": None,
                     "optimizer": "adamw"}
# What a rank file holds besides the counters the run continues from.
_NOT_COUNTERS = ("version", "shape", "rng", "config")
PARALLEL_SHAPE_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
                       "partition_method", "zero_stage")


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed (full disk, I/O error); the message names the folder and the cause."""


def shape_of(cfg_dict: dict, tp: int, pp: int, dp: int, padded_vocab: int, partition_method: str) -> dict:
    """What must match between a checkpoint and the run resuming from it."""
    model = {k: cfg_dict["model"].get(k) for k in MODEL_SHAPE_KEYS}
    model["padded_vocab_size"] = padded_vocab
    return {"model": model, "parallel": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                                         "data_parallel_size": dp, "partition_method": partition_method,
                                         "zero_stage": cfg_dict["training"]["zero_stage"]},
            # the optimizer state's layout: AdamW's fp32 moments or bitsandbytes' 8-bit ones
            "training": {"optimizer": cfg_dict["training"]["optimizer"]}}


def check_shape(saved: dict, current: dict, where: str) -> None:
    """Raise CheckpointError listing every model/parallel/optimizer key that differs."""
    def saved_value(section, key):
        return saved.get(section, {}).get(key, _ADDED_SHAPE_KEYS.get(key))

    def unrecorded(section, key):
        return key not in saved.get(section, {}) and key in _ADDED_SHAPE_KEYS and _ADDED_SHAPE_KEYS[key] is None

    def same(section, key, value):
        if (section, key) == ("parallel", "partition_method") and \
                not partitioning_counts(saved.get("parallel", {}), current.get("parallel", {})):
            return True
        return saved_value(section, key) == value

    diffs = [f"{section}.{key}: checkpoint {saved_value(section, key)!r}, config {value!r}"
             for section, values in current.items() for key, value in values.items()
             if not same(section, key, value) and not unrecorded(section, key)]
    if diffs:
        raise CheckpointError(f"checkpoint {where} does not fit this config's model/parallel shape or optimizer:\n  "
                              + "\n  ".join(diffs)
                              + "\nresume with the config it was saved with, or point checkpoint.load elsewhere")


def read_rank_state(path: str, rank: int = 0) -> dict:
    """gptpar's state file of `rank` in checkpoint folder `path`, loaded with unpickling disabled (format 2
    files also hold numpy's RNG state as an array: numpy arrays of plain dtypes are the one thing allowed
    besides tensors and plain values)."""
    file = os.path.join(path, state_file(rank))
    try:
        with torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS):
            return load_torch_file(file, CheckpointError, ": resume from an earlier checkpoint", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{file} holds more than tensors and plain values, so gptpar does not unpickle it "
                              f"({str(e).splitlines()[0]}): it is not a gptpar checkpoint's rank file") from None


# What torch's restricted unpickler needs to rebuild a numpy array (numpy's private module path is the one
# its pickles name).
_NUMPY_ARRAY_GLOBALS = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]


def carried_counters(rank_state: dict) -> dict:
    """What a universal copy carries of a rank file: the counters and client state the run continues from
    (iteration, consumed samples and tokens, the LR schedule's inputs, ...), without the per-rank RNG states."""
    return {k: v for k, v in rank_state.items() if k not in _NOT_COUNTERS}


def parallel_sizes(shape: dict) -> Tuple[int, int, int]:
    p = shape["parallel"]
    return (p["tensor_model_parallel_size"], p["pipeline_model_parallel_size"], p["data_parallel_size"])


def partitioning_counts(saved: dict, current: dict) -> bool:
    """Whether the pipeline partitioning of two `parallel` shape sections matters: not when both have one stage
    (a changed partition_method at pp = 1 lays nothing out differently)."""
    return not saved.get("pipeline_model_parallel_size") == current.get("pipeline_model_parallel_size") == 1


def same_layout(saved: dict, current: dict) -> bool:
    """Whether two shapes' `parallel` sections lay the weights and optimizer files out alike: every key equal,
    the partitioning only where it counts."""
    ignored = set() if partitioning_counts(saved, current) else {"partition_method"}
    return {k: v for k, v in saved.items() if k not in ignored} == \
        {k: v for k, v in current.items() if k not in ignored}


def saved_precision(path: str) -> str:
    """The training.precision checkpoint folder `path` was saved with (its config.json; fp32 when unrecorded)."""
    try:
        with open(os.path.join(path, CONFIG)) as f:
            return json.load(f).get("training", {}).get("precision", "fp32")
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{os.path.join(path, CONFIG)} is unreadable ({e}): resume from an earlier "
                              "checkpoint") from None


@dataclass(frozen=True)
class UniversalCopy:
    """A universal copy still to write before training (`write_universal_copy`, with the save folder's lock
    held): checkpoint `source` converted into `out`, carrying `counters`. `reason` starts the line printed once
    it is written; `stale`, when set, is the line saying why the earlier copy at `out` is replaced."""

    source: LoadTarget
    out: str
    counters: dict
    reason: str
    stale: Optional[str] = None


def plan_load(target: LoadTarget, shape: dict, world_size: int, universal_dir: Optional[str], precision: str,
              log: Callable[[str], None],
              model_config: Optional[GPTConfig] = None) -> Tuple[LoadTarget, Optional[UniversalCopy]]:
    """What this run loads for `target` (rank 0, before the model is built; reads, never writes): (the target to
    load, the universal copy still to write or None). The checkpoint itself when its files fit this run: the
    same model, parallel layout (tp, pp, dp, partitioning, ZeRO stage) and kind of optimizer files
    (gptpar.model.universal.optimizer_files of training.precision); else its universal copy in `universal_dir`
    (default `{target.directory}_universal`) under the checkpoint's tag: the one there when it was converted
    from exactly these files (checkpoint_files.fingerprint), else one to write. Raises CheckpointError for
    another model shape, a checkpoint that cannot be converted, or a universal copy that cannot be used; never
    writes inside `target.directory`. `model_config`: the run's model, the shape of a universal folder DeepSpeed
    wrote (its names and shapes are checked here)."""
    model = {"model": {k: v for k, v in shape["model"].items() if k != "padded_vocab_size"},
             "training": shape["training"]}  # a universal copy holds AdamW's moments (the default)
    to = parallel_sizes(shape)
    if target.universal is not None:
        meta = _read_universal_meta(target.universal, model_config)
        check_shape({"model": meta["model"]}, model, target.universal)
        _universal_call(universal.check_files, target.universal, meta)  # every file whole, before the engine
        iteration = meta["counters"].get("iteration")
        carried = (f"iteration {iteration}" if iteration is not None else "no counters in it (written by DeepSpeed, "
                   "or converted without gptpar's rank files): its weights, Adam moments and step, with iteration, "
                   "consumed samples and the LR schedule starting from 0")
        log(f"loading universal checkpoint {target.universal} ({carried}) at (tp, pp, dp) = {to}")
        return target, None
    verify_checkpoint(target, saved_world_size(target, world_size))  # every file there and whole, first
    saved = read_rank_state(target.path)
    check_shape(saved["shape"], model, target.path)
    was = saved_precision(target.path)
    layout = same_layout(saved["shape"]["parallel"], shape["parallel"]) and saved["shape"]["model"] == shape["model"]
    files = universal.optimizer_files(was) == universal.optimizer_files(precision)
    if layout and files:
        return target, None
    source = parallel_sizes(saved["shape"])
    if layout:
        what = (f"it was saved with training.precision={was}, whose optimizer files a {precision} run does not "
                "load")
        fix = f"resume it with training.precision={was}"
        reason = (f"checkpoint {target.path} was saved with training.precision={was}, whose optimizer files a "
                  f"{precision} run does not load: going through its universal form")
    else:
        what = "it has another parallel shape"
        fix = f"resume it at the shape it was saved with, (tp, pp, dp) = {source}"
        reason = f"reshaping checkpoint {target.path} from (tp,pp,dp) {source} to {to}"
    if precision == "fp16":
        raise CheckpointError(f"checkpoint {target.path}: {what}, and a training.precision=fp16 run cannot start "
                              f"from its universal form (the dynamic loss scale is not carried): {fix}")
    if shape["training"]["optimizer"] != "adamw":
        raise CheckpointError(f"checkpoint {target.path}: {what}, and training.optimizer="
                              f"{shape['training']['optimizer']} state cannot be reshaped through the universal form "
                              "(it carries AdamW's fp32 moments, not bitsandbytes' block-quantised ones): " + fix)
    _universal_call(universal.read_source, target.path)  # refuses what cannot be converted, before any folder
    out = os.path.join(universal_dir or f"{target.directory}_universal", target.tag)
    inside = os.path.commonpath([os.path.abspath(out), os.path.abspath(target.directory)])
    if inside == os.path.abspath(target.directory):
        raise CheckpointError(f"checkpoint.universal_dir puts the universal copy at {out}, inside the checkpoint "
                              f"folder {target.directory}: give it a folder outside it (nothing is written there)")
    copy = UniversalCopy(target, out, carried_counters(saved), reason)
    if universal.is_universal(out):
        meta = _read_universal_meta(out)
        if meta["source"]["path"] != os.path.abspath(target.path):
            raise CheckpointError(f"{out} holds the universal copy of {meta['source']['path']}, not of "
                                  f"{target.path}: delete it or set checkpoint.universal_dir elsewhere")
        if meta["source"].get("files") == fingerprint(target.path):
            log(f"{reason}: read from its existing universal copy {out}")
            return LoadTarget(target.directory, target.tag, universal=out), None
        copy = dataclasses.replace(copy, stale=(
            f"the universal copy {out} was converted from other files than {target.path} holds now (rewritten in "
            "place since, e.g. re-saved after a rollback; or converted by an older gptpar): rebuilding it"))
    return LoadTarget(target.directory, target.tag, universal=out), copy


def write_universal_copy(copy: UniversalCopy, log: Callable[[str], None], owner: Optional[dict] = None) -> None:
    """Convert `copy.source` into `copy.out` (rank 0, after plan_load, with the save folder's lock held),
    replacing a stale copy first. A write that fails (a full disk) raises CheckpointError saying so, as a
    failed save does; nothing is left behind (the converter removes its temporary folder). `owner`: the job,
    recorded in the temporary folder while it is written (gptpar.model.universal.convert_deepspeed_checkpoint)."""
    parent = os.path.dirname(os.path.abspath(copy.out))
    try:
        if copy.stale:
            log(copy.stale)
            shutil.rmtree(copy.out)
        os.makedirs(parent, exist_ok=True)
        universal.convert_deepspeed_checkpoint(copy.source.path, copy.out, log, counters=copy.counters,
                                               source_files=fingerprint(copy.source.path), owner=owner)
    except universal.UniversalCheckpointError as e:
        raise CheckpointError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - a full disk, no permission: torch's writer raises RuntimeError
        if not is_write_failure(e):
            raise
        raise CheckpointError(f"could not write the universal copy {copy.out}: {describe_write_failure(parent, e)}. "
                              "Free space there (the copy takes 12 bytes per parameter) or set "
                              "checkpoint.universal_dir to another folder, then start again") from None
    log(f"{copy.reason}: converted to its universal copy {copy.out}")


def _universal_call(function, *args):
    try:
        return function(*args)
    except universal.UniversalCheckpointError as e:
        raise CheckpointError(str(e)) from None


def _read_universal_meta(directory: str, model_config: Optional[GPTConfig] = None) -> dict:
    return _universal_call(universal.read_meta, directory, model_config)


def rng_states(tracker) -> dict:
    """Every generator's state, as tensors and plain values (loadable with weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                                                    gauss), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "tracker": tracker.get_states() if tracker is not None else None}


def set_rng_states(states: dict, tracker) -> None:
    random.setstate(states["python"])
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    keys = keys.numpy() if torch.is_tensor(keys) else keys  # an array in format 2
    np.random.set_state((kind, keys.astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(states["torch"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if tracker is not None and states.get("tracker") is not None:
        tracker.set_states(states["tracker"])


@dataclass
class Checkpointer:
    """Saves and loads the run's checkpoints on every rank (all calls are collective).

    `load_target` is what checkpoint.load resolved to before training (None = a fresh start)."""

    save_dir: Optional[str]
    load_target: Optional[LoadTarget]
    keep_last: Optional[int]
    rank: int
    world_size: int
    shape: dict
    config_json: str
    log: callable = print
    device: object = "cpu"  # where the all-reduces' flag lives (a GPU under NCCL)
    tp_rank: int = 0
    tp_size: int = 1
    # GPTModel's name of each of the engine's parameter names (gptpar.model.universal.gpt_parameter_name)
    parameter_name: Callable[[str], str] = field(default=lambda name: name)
    model_config: Optional[GPTConfig] = None  # the model of a universal folder DeepSpeed wrote (it has none)

    # -- save ----------------------------------------------------------------------------------
    def save(self, engine, iteration: int, client_state: dict, tracker) -> str:
        """Write checkpoint `iter_{iteration}` on every rank, then move `latest` to it. Returns the path."""
        tag = tag_of(iteration)
        path = os.path.join(self.save_dir, tag)
        with self._failures(tag, defer=True) as failed:
            if self.rank == 0:
                os.makedirs(path, exist_ok=True)
        _agree_or_raise(failed, self.device)
        # A rank failing inside DeepSpeed's save raises at once: DeepSpeed's own closing barrier cannot be
        # joined from here, so the others wait there until the launcher or the process-group timeout ends
        # them. `latest` does not move either way.
        with self._failures(tag):
            engine.save_checkpoint(self.save_dir, tag, {"gptpar_iteration": iteration})
        with self._failures(tag, defer=True) as failed:
            state = dict(client_state, version=FORMAT_VERSION, shape=self.shape, rng=rng_states(tracker))
            torch.save(state, os.path.join(path, state_file(self.rank)))
        _agree_or_raise(failed, self.device)  # every rank's files are on disk before the pointer moves
        with self._failures(tag, defer=True) as failed:
            if self.rank == 0:  # config.json and the manifest last: a folder without them is partial
                with open(os.path.join(path, CONFIG), "w") as f:
                    f.write(self.config_json)
                write_manifest(path, iteration, self.world_size)
                write_latest(self.save_dir, tag)
                self._prune(iteration)
        _agree_or_raise(failed, self.device)
        return path

    def _failures(self, tag: str, defer: bool = False) -> "_SaveFailure":
        return _SaveFailure(self.save_dir, tag, self.rank, defer)

    def _prune(self, newest: int) -> None:
        """Delete all but the newest `keep_last` complete checkpoints at or before the one `latest` points at."""
        if not self.keep_last:
            return
        done = [tag for tag in complete_checkpoints(self.save_dir) if int(TAG_RE.match(tag).group(1)) <= newest]
        for tag in done[:-self.keep_last]:
            shutil.rmtree(os.path.join(self.save_dir, tag), ignore_errors=True)

    # -- load ----------------------------------------------------------------------------------
    def load(self, engine, tracker) -> Optional[dict]:
        """Restore `load_target` (verified before training); its client state, or None to start fresh."""
        target = self.load_target
        if target is None:
            return None
        if target.universal is not None:
            return self._load_universal(engine, target.universal)
        path = target.path
        state = read_rank_state(path, self.rank)
        check_shape(state["shape"], self.shape, path)
        if not engine.load_checkpoint(target.directory, target.tag):
            raise CheckpointError(f"DeepSpeed could not load {path}")
        set_rng_states(state["rng"], tracker)
        self.log(f"resumed from {path}: iteration {state['iteration']}, "
                 f"{state['consumed_samples']} consumed samples")
        return state

    def _load_universal(self, engine, directory: str) -> Optional[dict]:
        """Every parameter of this rank: its tp slice (vocab padding re-added for this tp) of the full fp32
        master weight and Adam moments, set through the engine (which cuts this dp rank's ZeRO partition) with
        the parameter's Adam step. Returns the counters; None (a fresh start of the counters and schedule) for a
        folder without them (one DeepSpeed wrote, or converted without gptpar's rank files)."""
        meta = _read_universal_meta(directory, self.model_config)
        for name, param in engine.named_parameters():
            full_name = self.parameter_name(name)
            try:
                states = {key: shard_tensor(universal.read_state(directory, full_name, key, meta), param,
                                            self.tp_rank, self.tp_size).to(param.device) for key in universal.STATES}
                step = float(universal.read_state(directory, full_name, "step", meta))
            except universal.UniversalCheckpointError as e:
                raise CheckpointError(str(e)) from None
            engine.set_full_state(param, states.pop("fp32"), states, step)
        counters = meta["counters"] or None
        where = (f"iteration {counters['iteration']}, {counters['consumed_samples']} consumed samples" if counters
                 else "iteration 0 (no counters in it)")
        self.log(f"resumed from universal checkpoint {directory}: {where}, Adam step {step:g} (RNG streams "
                 "start from the seed: they are per rank)")
        return counters


class _SaveFailure:
    """Turns an OSError (or torch's writer error) inside a save into CheckpointSaveError naming the folder and
    the cause. `defer` collects it in the list `with` returns instead of raising, for the ranks to agree first."""

    def __init__(self, save_dir: str, tag: str, rank: int, defer: bool):
        self.save_dir, self.tag, self.rank, self.defer = save_dir, tag, rank, defer
        self.errors = []

    def __enter__(self):
        return self.errors

    def __exit__(self, exc_type, exc, tb):
        if exc is None or not isinstance(exc, (OSError, RuntimeError)) or isinstance(exc, CheckpointError):
            return False
        error = CheckpointSaveError(describe_save_failure(self.save_dir, self.tag, self.rank, exc))
        if not self.defer:
            raise error from exc
        self.errors.append(error)
        return True


def describe_save_failure(save_dir: str, tag: str, rank: int, exc: BaseException) -> str:
    """Where and why a save failed, the free space left, and what `latest` still points at."""
    try:
        kept = read_latest(save_dir)
    except CheckpointError:
        kept = None
    intact = f"`latest` still points at {kept}" if kept else "no earlier checkpoint there"
    return (f"rank {rank} could not save checkpoint {tag} in {save_dir}: {describe_write_failure(save_dir, exc)}; "
            f"{intact}. Free space or set checkpoint.save to another folder, then resume (the partial folder is "
            "deleted at the next start)")


def _agree_or_raise(errors: list, device) -> None:
    """All ranks learn whether any failed (one all-reduce MAX, also the barrier), so none moves on alone."""
    failed = torch.tensor([float(bool(errors))], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if errors:
        raise errors[0]
    if failed.item() > 0:
        raise CheckpointSaveError("another rank could not write its part of the checkpoint (its message says "
                                  "why); `latest` was not moved")


__all__ = ["Checkpointer", "CheckpointError", "CheckpointSaveError", "LoadTarget", "LATEST", "read_latest",
           "write_latest", "tag_of", "shape_of", "check_shape", "read_rank_state", "carried_counters",
           "partitioning_counts", "same_layout", "saved_precision", "UniversalCopy", "plan_load", "write_universal_copy",
           "rng_states", "set_rng_states"]
