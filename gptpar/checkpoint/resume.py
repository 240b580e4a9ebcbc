"""What `checkpoint.load` means for this run, decided before the model is built (rank 0, read-only): the
checkpoint itself when its files fit this run, else its universal copy, reused or still to write.

A checkpoint of another parallel shape (tp, pp, dp, partitioning at pp > 1), or saved with a precision whose
optimizer files this run's does not load (gptpar.checkpoint.universal.optimizer_files), is resumed through its
universal form (docs/checkpoints.md): it is converted once into `checkpoint.universal_dir` (default:
`{load folder}_universal/`, never inside the load folder; by every rank, each a share of the parameters,
gptpar.training.preflight.convert_over_ranks), with the save folder's lock held, or rank 0 reuses the copy
already there when it was converted from exactly these files (`layout.fingerprint`; else it is rebuilt, in one
line). The model shape stored with a checkpoint must equal the current config's (a clear error naming the key
otherwise); every other key (LR, intervals, exit conditions, ...) comes from the current config.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import numpy as np
import torch

from gptpar.checkpoint import universal
from gptpar.checkpoint.continuity import check_tag_iteration, run_changes
from gptpar.checkpoint.durable import describe_write_failure, is_write_failure
from gptpar.checkpoint.exceptions import CheckpointError, UniversalCheckpointError
from gptpar.checkpoint.layout import CONFIG, LoadTarget, earlier_checkpoint_fix, fingerprint, state_file
from gptpar.checkpoint.manifest import (CHECKPOINT, WEIGHTS_ONLY, Verifier, damaged_message, open_folder,
                                        read_manifest, unlisted, unlisted_files)
from gptpar.model.config import GPTConfig

FORMAT_VERSION = 3  # of the rank files: 2 a manifest marks a complete checkpoint; 3 numpy's RNG state as a tensor

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


# What torch's restricted unpickler needs to rebuild a numpy array (numpy's private module path is the one
# its pickles name): rank files of format 2 hold numpy's RNG state as an array.
_NUMPY_ARRAY_GLOBALS = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]


def read_rank_state(path: str, rank: int, verifier: Verifier) -> dict:
    """gptpar's state file of `rank` in checkpoint folder `path`, read through `verifier` (checked against the
    manifest before it is parsed) with unpickling disabled."""
    file = os.path.join(path, state_file(rank))
    try:
        with torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS):
            return verifier.torch_load(file, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{file} holds more than tensors and plain values, so gptpar does not unpickle it "
                              f"({str(e).splitlines()[0]}): it is not a gptpar checkpoint's rank file") from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{file} cannot be read ({type(e).__name__}: {str(e).splitlines()[0]}): "
                              f"{verifier.fix}") from None


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


def saved_config(path: str, verifier: Verifier) -> dict:
    """The run config checkpoint folder `path` was saved with (its config.json, verified)."""
    file = os.path.join(path, CONFIG)
    try:
        return json.loads(verifier.read_text(file))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file} is unreadable ({type(e).__name__}: {e}): {verifier.fix}") from None


def open_checkpoint(target: LoadTarget, world_size: int, log: Callable[[str], None], verify: bool = True,
                    quiet: bool = False) -> Verifier:
    """Check that training checkpoint `target` is whole before anything is built: its manifest there and readable,
    of a training checkpoint, every file it lists there with its size and every torch file a whole zip archive,
    a state file per rank of the world that saved it, and no torch file there that the manifest does not list
    (a resume reads only listed files: an unlisted one is refused, naming it). Returns a Verifier (rank 0's: checks every file it
    reads). `verify` False (checkpoint.verify_checksums=false) skips the sha256 checks, said once."""
    fix = earlier_checkpoint_fix(target)
    verifier = open_folder(target.path, fix, log, verify, "checkpoint.verify_checksums=false", quiet=quiet)
    manifest = verifier.manifest
    if manifest is None:
        raise CheckpointError(f"{target.path} is not a gptpar checkpoint (no manifest, no state files): give the "
                              "folder checkpoint.save wrote, or one of its iter_N folders")
    if manifest.kind != CHECKPOINT:
        raise CheckpointError(f"{target.path} is a {manifest.kind} folder, not a training checkpoint: {fix}")
    saved = int(manifest.fields.get("world_size", world_size))
    needed = [state_file(r) for r in range(saved)] + [CONFIG]
    # DeepSpeed finds its files by name (its ZeRO shards by a pattern): every torch file there is one a resume may read
    needed += [rel for rel in unlisted_files(manifest) if os.path.dirname(rel) == "" and rel.endswith(".pt")]
    problems = [unlisted(os.path.join(target.path, rel), manifest) if os.path.exists(os.path.join(target.path, rel))
                else f"{os.path.join(target.path, rel)} is missing (not in the folder, nor listed in its manifest)"
                for rel in dict.fromkeys(needed) if rel not in manifest.files]
    if problems:
        raise CheckpointError(damaged_message(target.path, problems, fix))
    return verifier


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
    verify: bool = True


def plan_load(target: LoadTarget, shape: dict, world_size: int, universal_dir: Optional[str], precision: str,
              log: Callable[[str], None], model_config: Optional[GPTConfig] = None,
              verify: bool = True, run: Optional[dict] = None) -> Tuple[LoadTarget, Optional[UniversalCopy]]:
    """What this run loads for `target` (rank 0, before the model is built; reads, never writes): (the target to
    load, the universal copy still to write or None). The checkpoint itself when its files fit this run: the
    same model, parallel layout (tp, pp, dp, partitioning, ZeRO stage) and kind of optimizer files
    (gptpar.checkpoint.universal.optimizer_files of training.precision); else its universal copy in `universal_dir`
    (default `{target.directory}_universal`) under the checkpoint's tag: the one there when it was converted
    from exactly these files (layout.fingerprint), else one to write (the conversion verifies every file it reads
    in its pass). Raises CheckpointError for another model shape, a checkpoint that cannot be converted, or a
    universal copy that cannot be used; never writes inside `target.directory`. `model_config`: the run's model,
    the shape of a universal folder DeepSpeed wrote (its names and shapes are checked here). An `iter_N` folder
    holding another iteration is refused; `run` (this run's config as a dict): the run-defining keys that differ
    from the checkpoint's run are said (gptpar.checkpoint.continuity)."""
    model = {"model": {k: v for k, v in shape["model"].items() if k != "padded_vocab_size"},
             "training": shape["training"]}  # a universal copy holds AdamW's moments (the default)
    to = parallel_sizes(shape)
    if target.universal is not None:
        meta = universal.read_meta(universal.open_universal(target.universal, log, verify), model_config)
        check_shape({"model": meta["model"]}, model, target.universal)
        iteration = meta["counters"].get("iteration")
        carried = (f"iteration {iteration}" if iteration is not None else "no counters in it (written by DeepSpeed, "
                   "or converted without gptpar's rank files): its weights, Adam moments and step, with iteration, "
                   "consumed samples and the LR schedule starting from 0")
        log(f"loading universal checkpoint {target.universal} ({carried}) at (tp, pp, dp) = {to}")
        return target, None
    verifier = open_checkpoint(target, world_size, log, verify)
    saved = read_rank_state(target.path, 0, verifier)
    verifier.raise_problems()
    check_shape(saved["shape"], model, target.path)
    check_tag_iteration(target, saved["iteration"])
    saved_run = saved_config(target.path, verifier)
    for line in run_changes(saved_run, run) if run is not None else ():
        log(line)
    was = saved_run.get("training", {}).get("precision", "fp32")
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
    universal.read_source(target.path)  # refuses what cannot be converted, before any folder
    out = os.path.join(universal_dir or f"{target.directory}_universal", target.tag)
    inside = os.path.commonpath([os.path.abspath(out), os.path.abspath(target.directory)])
    if inside == os.path.abspath(target.directory):
        raise CheckpointError(f"checkpoint.universal_dir puts the universal copy at {out}, inside the checkpoint "
                              f"folder {target.directory}: give it a folder outside it (nothing is written there)")
    copy = UniversalCopy(target, out, carried_counters(saved), reason, verify=verify)
    if universal.is_universal(out):
        try:
            meta = universal.read_meta(universal.open_universal(out, log, verify=False, quiet=True))
        except UniversalCheckpointError as e:
            raise CheckpointError(f"{e}; delete {out} to have it converted again") from None
        if meta["source"]["path"] != os.path.abspath(target.path):
            raise CheckpointError(f"{out} holds the universal copy of {meta['source']['path']}, not of "
                                  f"{target.path}: delete it or set checkpoint.universal_dir elsewhere")
        if meta["source"].get("files") == fingerprint(target.path):
            log(f"{reason}: read from its existing universal copy {out}")
            return LoadTarget(target.directory, target.tag, universal=out), None
        copy = dataclasses.replace(copy, stale=(
            f"the universal copy {out} was converted from other files than {target.path} holds now (rewritten since, "
            "e.g. re-saved after a rollback; or converted by an older gptpar): rebuilding it"))
    return LoadTarget(target.directory, target.tag, universal=out), copy


def write_universal_copy(copy: UniversalCopy, log: Callable[[str], None], owner: Optional[dict] = None) -> None:
    """Convert `copy.source` into `copy.out` in this process (after plan_load, with the save folder's lock held),
    swapping out a stale copy; several ranks share the work through gptpar.training.preflight instead. Every file
    the conversion reads is checked against the checkpoint's manifest in the same pass (a damaged one refuses the
    copy, naming it). A write that fails (a full disk) raises CheckpointError saying so, as a failed save does;
    nothing is left behind. `owner`: the job, recorded in the temporary folder while it is written
    (gptpar.checkpoint.save_folder cleans up after a killed conversion)."""
    if copy.stale:
        log(copy.stale)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(copy.out)), exist_ok=True)
        universal.convert_deepspeed_checkpoint(copy.source.path, copy.out, log, counters=copy.counters,
                                               source_files=fingerprint(copy.source.path), owner=owner,
                                               verify=copy.verify, replace=copy.stale is not None,
                                               fix=earlier_checkpoint_fix(copy.source))
    except Exception as e:  # noqa: BLE001 - a full disk, no permission: torch's writer raises RuntimeError
        raise universal_copy_error(copy, e) from None
    log(f"{copy.reason}: converted to its universal copy {copy.out}")


def universal_copy_error(copy: UniversalCopy, e: Exception) -> Exception:
    """What a conversion into `copy.out` that raised `e` raises: a CheckpointError as it is; a write the file
    system refused as CheckpointError saying so, with the free space left; anything else as it is."""
    if isinstance(e, CheckpointError) or not is_write_failure(e):
        return e
    parent = os.path.dirname(os.path.abspath(copy.out))
    return CheckpointError(f"could not write the universal copy {copy.out}: {describe_write_failure(parent, e)}. "
                           "Free space there (the copy takes 12 bytes per parameter) or set "
                           "checkpoint.universal_dir to another folder, then start again")


def weights_only_target(target: LoadTarget) -> bool:
    """Whether `target` (what checkpoint.load resolved to) is a weights-only checkpoint (its manifest's kind)."""
    try:
        return read_manifest(target.path, "").kind == WEIGHTS_ONLY
    except CheckpointError:
        return False


__all__ = ["FORMAT_VERSION", "MODEL_SHAPE_KEYS", "PARALLEL_SHAPE_KEYS", "shape_of", "check_shape", "read_rank_state",
           "carried_counters", "parallel_sizes", "partitioning_counts", "same_layout", "saved_config",
           "open_checkpoint", "UniversalCopy", "plan_load", "write_universal_copy", "universal_copy_error",
           "weights_only_target"]
