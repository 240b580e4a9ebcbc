"""Checkpoints: DeepSpeed's files plus gptpar's own state, and a `latest` pointer that is never half-written.

Layout of one checkpoint (tag `iter_{N:07d}`):

    {save}/latest                       "iter_0000300": written by rank 0 only after every rank finished
                                        (barrier), via a temporary file + atomic rename
    {save}/iter_0000300/                DeepSpeed's save_checkpoint(save, tag, save_latest=False): model
                                        states per (tp, pp) rank, ZeRO-1 optimizer shards per dp rank
    {save}/iter_0000300/gptpar_rank_00000.pt   per rank: counters, ramp-up and LR-schedule inputs, the RNG
                                        states (torch, numpy, python, the tp tracker's streams)
    {save}/iter_0000300/config.json     the resolved config of the run that saved it
    {save}/iter_0000300/gptpar_manifest.json   every file of the checkpoint: its size, sha256 and writing rank;
                                        written last, so a folder without it is partial
                                        (gptpar.checkpoint.layout)

Every file goes through the engine's CheckpointWriter (gptpar.checkpoint.writer), which hashes
it as it is written and, with `checkpoint.async_save`, writes it from a host snapshot in a background thread
while training goes on. Once every rank's files are whole the ranks agree (over their own gloo group, from the
writer thread when async) and rank 0 writes config.json, the manifest and `latest` (`_agree_and_commit`). At
most one save is in flight: the next save and the end of the run wait for it (`wait`).

A save killed half-way leaves `latest` on the previous complete checkpoint, so a resume never reads a
partial one; the next start deletes the partial folder (gptpar.checkpoint.save_folder). `keep_last` deletes
the oldest complete checkpoints after `latest` moved on. A save that fails (a full disk, an I/O error)
raises CheckpointSaveError naming the folder and the cause, on every rank; `latest` stays where it was.

Resume: what `checkpoint.load` points at is resolved and verified before training (checkpoint_files.
resolve_load / verify_checkpoint, then `plan_load`; each rank checks the sha256 of the files it wrote,
gptpar.training.preflight.verify_own_files); the model shape stored with it must equal the current
config's (a clear error naming the key otherwise); every other key (LR, intervals, exit conditions, ...)
comes from the current config. A checkpoint of another parallel shape (tp, pp, dp, partitioning at pp > 1),
or saved with a precision whose optimizer files this run's does not load (gptpar.checkpoint.universal.
optimizer_files), is resumed through its universal form (gptpar.checkpoint.universal, docs/checkpoints.md): rank 0
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
import functools
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

from gptpar.checkpoint import universal
from gptpar.model.config import GPTConfig
from gptpar.model.sharding import shard_tensor
from gptpar.checkpoint.weight_files import load_torch_file
from gptpar.checkpoint.layout import (CONFIG, LATEST, TAG_RE, CheckpointError, LoadTarget,
                                              complete_checkpoints, damaged, describe_write_failure, fingerprint,
                                              is_write_failure, read_latest, saved_world_size, state_file, tag_of,
                                              verify_checkpoint, verify_digests, write_latest, write_manifest,
                                              write_synced)

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
              log: Callable[[str], None], model_config: Optional[GPTConfig] = None,
              checksums: bool = True) -> Tuple[LoadTarget, Optional[UniversalCopy]]:
    """What this run loads for `target` (rank 0, before the model is built; reads, never writes): (the target to
    load, the universal copy still to write or None). The checkpoint itself when its files fit this run: the
    same model, parallel layout (tp, pp, dp, partitioning, ZeRO stage) and kind of optimizer files
    (gptpar.checkpoint.universal.optimizer_files of training.precision); else its universal copy in `universal_dir`
    (default `{target.directory}_universal`) under the checkpoint's tag: the one there when it was converted
    from exactly these files (checkpoint_files.fingerprint), else one to write. Raises CheckpointError for
    another model shape, a checkpoint that cannot be converted, or a universal copy that cannot be used; never
    writes inside `target.directory`. `model_config`: the run's model, the shape of a universal folder DeepSpeed
    wrote (its names and shapes are checked here). `checksums` (checkpoint.checksums): before a copy is planned,
    every file it will be converted from is checked against the manifest's sha256 (CheckpointError naming each
    damaged one), so a conversion never carries a corrupted shard into the copy."""
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
    problems = verify_digests(target.path) if checksums else []
    if problems:
        raise CheckpointError(damaged(target, problems))
    return LoadTarget(target.directory, target.tag, universal=out), copy


def write_universal_copy(copy: UniversalCopy, log: Callable[[str], None], owner: Optional[dict] = None) -> None:
    """Convert `copy.source` into `copy.out` (rank 0, after plan_load, with the save folder's lock held),
    replacing a stale copy first. A write that fails (a full disk) raises CheckpointError saying so, as a
    failed save does; nothing is left behind (the converter removes its temporary folder). `owner`: the job,
    recorded in the temporary folder while it is written (gptpar.checkpoint.universal.convert_deepspeed_checkpoint)."""
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
    # GPTModel's name of each of the engine's parameter names (gptpar.checkpoint.universal.gpt_parameter_name)
    parameter_name: Callable[[str], str] = field(default=lambda name: name)
    model_config: Optional[GPTConfig] = None  # the model of a universal folder DeepSpeed wrote (it has none)

    # The engine's CheckpointWriter (every file of a save goes through it), the process group its jobs agree
    # over (gloo, separate from training's: an async job agrees from the writer thread), checksums on/off.
    writer: Optional[object] = None
    group: object = None
    checksums: bool = True
    _announced: set = field(default_factory=set)  # the waits said once (checkpoint.async_save)
    _reported: Optional[object] = None  # the save whose outcome was last handed to the trainer

    # -- save ----------------------------------------------------------------------------------
    def save(self, engine, iteration: int, client_state: dict, tracker) -> str:
        """Checkpoint `iter_{iteration}` on every rank. Every file (DeepSpeed's and this rank's state) goes
        through the engine's CheckpointWriter; once every rank's files are whole, rank 0 writes config.json, the
        manifest (sizes, checksums) and moves `latest` (`_agree_and_commit`). With checkpoint.async_save this
        returns as soon as the snapshot is planned and the writer thread does the rest (`wait`, `poll`);
        a save still in flight is waited for first. Returns the path."""
        self.wait("saving the next one")
        tag = tag_of(iteration)
        path = os.path.join(self.save_dir, tag)
        with self._failures(tag, defer=True) as failed:
            if self.rank == 0:
                os.makedirs(path, exist_ok=True)
        _agree_or_raise(failed, self.device)
        # A write that fails is kept by the writer and agreed on after all files were given (no rank leaves
        # DeepSpeed's closing barrier early); anything else failing inside DeepSpeed's save raises at once.
        with self._failures(tag):
            engine.save_checkpoint(self.save_dir, tag, {"gptpar_iteration": iteration})
        state = dict(client_state, version=FORMAT_VERSION, shape=self.shape, rng=rng_states(tracker))
        self.writer.save(state, os.path.join(path, state_file(self.rank)))
        self.writer.start(functools.partial(self._agree_and_commit, path, iteration), name=path)
        if not self.writer.async_save:
            self.wait()
        return path

    def _agree_and_commit(self, path: str, iteration: int, records: dict, error: Optional[BaseException]):
        """The end of a save, on every rank once its files are written (in the writer thread when async): the
        ranks exchange their files' records and failures over `group`; if none failed rank 0 writes config.json,
        the manifest and `latest`, and prunes. Returns the failure every rank reports (None: saved)."""
        tag = os.path.basename(path)
        mine = ({os.path.relpath(p, path): dict(r, rank=self.rank) for p, r in records.items()},
                describe_save_failure(self.save_dir, tag, self.rank, error) if error is not None else None)
        everyone = [mine]
        if self.group is not None:
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, mine, group=self.group)
        failures = [message for _, message in everyone if message]
        if not failures and self.rank == 0:
            try:
                write_synced(os.path.join(path, CONFIG), self.config_json)  # config.json and the manifest last:
                write_manifest(path, iteration, self.world_size,  # a folder without them is partial
                               records={rel: r for files, _ in everyone for rel, r in files.items()},
                               checksums=self.checksums)
                write_latest(self.save_dir, tag)
                self._prune(iteration)
            except (OSError, RuntimeError) as e:
                failures.append(describe_save_failure(self.save_dir, tag, self.rank, e))
        if self.group is not None:  # every rank learns whether rank 0 committed
            box = [failures]
            dist.broadcast_object_list(box, src=0, group=self.group)
            failures = box[0]
        return failures[0] if failures else None

    def wait(self, why: Optional[str] = None) -> None:
        """Block until the save in flight (checkpoint.async_save) is written; raise CheckpointSaveError, on
        every rank alike, if it failed. `why`: what waits, said once per kind of wait."""
        if self.writer is None:
            return
        save = self.writer.in_flight()
        if save is not None and why is not None and why not in self._announced:
            self._announced.add(why)
            self.log(f"waiting for checkpoint {save.name} to finish writing before {why} (checkpoint.async_save: "
                     "one save in flight at a time)", flush=True)
        self.writer.wait()
        self._consume()

    def poll(self) -> None:
        """Between iterations: say that an async save was written (rank 0's log). Its failure is left to the
        trainer, which agrees on it through `failed` (all ranks stop at the same iteration) and raises by `wait`."""
        save = self.writer.finished() if self.writer is not None else None
        if save is not None and save is not self._reported and save.outcome is None:
            self._consume()

    def failed(self) -> bool:
        """Whether the last save is known, on this rank, to have failed (not yet raised)."""
        save = self.writer.finished() if self.writer is not None else None
        return save is not None and save is not self._reported and save.outcome is not None

    def _consume(self) -> None:
        """Hand the outcome of the last finished save to the run, once."""
        save = self.writer.finished()
        if save is None or save is self._reported:
            return
        self._reported = save
        if isinstance(save.outcome, str):
            raise CheckpointSaveError(save.outcome)
        if save.outcome is not None:
            raise CheckpointSaveError(f"the checkpoint writer failed saving {save.name} "
                                      f"({type(save.outcome).__name__}: {save.outcome}); `latest` was not moved")
        if self.writer.async_save:
            self.log(f"saved checkpoint {save.name} in {save.seconds:.2f} s (written while training went on)",
                     flush=True)

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
