"""The on-disk names of everything gptpar writes, and the save folder's layout, read without changing anything:
which checkpoints are complete, what `latest` points at, what `checkpoint.load` means.

    {save}/latest                         the tag of the newest complete checkpoint ("iter_0000300")
    {save}/iter_0000300/                  one checkpoint; complete once its manifest exists (gptpar.checkpoint.manifest)
    {save}/iter_0000300/gptpar_manifest.json   every file of the folder: size, sha256, the rank that wrote it;
                                          written last, inside the temporary folder, before the rename
    {save}/iter_0000300.tmp-PID/          a checkpoint being written (gptpar.checkpoint.durable.StagedFolder)
    {save}/iter_0000300.old-PID/          the previous folder of a tag being re-saved, during the swap
    {save}/.gptpar.lock                   the job writing this folder (gptpar.checkpoint.save_folder)
    {save}/.gptpar-probe-PID, .latest.tmp-PID   short-lived files of a write probe and of the pointer update
    {save}/diagnostics/                   what each rank was doing when a collective failed (gptpar.training.diagnostics)
    {save}/resolved_config.json           the run's resolved config, without metrics_file or TensorBoard folder
    {save}/.gptpar-save-times.json        how long the last save and iteration took: gptpar.launch's stop grace
                                          (gptpar.checkpoint.stop_grace)

gptpar's own entries are the lock, probe and temporary files and folders, the save times, the diagnostics folder, and the recovery
scripts DeepSpeed copies beside its checkpoints. A folder holding nothing else has no checkpoint: loading from it starts fresh. An `iter_N`
folder without a manifest is never gptpar's doing (saves are written under a temporary name and renamed whole): it
is refused, never taken for a fresh start or for a checkpoint.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from gptpar.checkpoint.exceptions import CheckpointError

LATEST = "latest"
TAG_RE = re.compile(r"^iter_(\d{7,})$")
MANIFEST = "gptpar_manifest.json"
CONFIG = "config.json"
LOCK = ".gptpar.lock"
PROBE_PREFIX = ".gptpar-probe-"
LATEST_TMP_PREFIX = f".{LATEST}.tmp-"
# A folder being written beside its target (`{target}.tmp-TOKEN`), and a re-saved tag's previous folder during the
# swap (`{target}.old-TOKEN`): gptpar.checkpoint.durable.
STAGED_RE = re.compile(r"^(?P<target>.+)\.(?P<what>tmp|old)-(?P<token>[0-9A-Za-z_-]+)$")
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # DeepSpeed copies them next to the checkpoints
STATE_FILE_RE = re.compile(r"^gptpar_rank_\d{5}\.pt$")
UNIVERSAL_META = "gptpar_universal.json"  # a universal copy's metadata (gptpar.checkpoint.universal)
OWNER = ".gptpar-owner.json"  # in a universal copy being converted: the job writing it
DIAGNOSTICS = "diagnostics"  # written when a collective fails (gptpar.training.diagnostics)
SAVE_TIMES = ".gptpar-save-times.json"  # the last save's and iteration's seconds (gptpar.checkpoint.stop_grace)
RESOLVED_CONFIG = "resolved_config.json"  # the run's resolved config, when it is written here (gptpar.training.assembly)


def tag_of(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def state_file(rank: int) -> str:
    """gptpar's own file of `rank` in a training checkpoint: counters, RNG states, the run's shape."""
    return f"gptpar_rank_{rank:05d}.pt"


def model_states_file(tp_rank: int) -> str:
    """DeepSpeed's model-states file of tp rank `tp_rank` at pp = 1 (key 'module': GPTModel's state dict)."""
    return f"mp_rank_{tp_rank:02d}_model_states.pt"


def layer_file(index: int, tp_rank: int) -> str:
    """DeepSpeed's file of pipeline layer spec `index` (gptpar.model.pipeline.gpt_layer_prefixes) of tp rank
    `tp_rank` at pp > 1: that layer's state dict."""
    return f"layer_{index:02d}-model_{tp_rank:02d}-model_states.pt"


def staged(name: str) -> Optional[re.Match]:
    """The match of a temporary (`.tmp-`) or swapped-out (`.old-`) folder's name, else None."""
    return STAGED_RE.match(name)


def read_latest(directory: Optional[str]) -> Optional[str]:
    """The tag `latest` points at; None when the directory or the pointer does not exist.

    An empty or garbled pointer is an error, never "no checkpoint": the folder did hold one."""
    if not directory:
        return None
    path = os.path.join(directory, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        raw = f.read(256)
    tag = raw.decode("utf-8", "replace").strip()
    if not TAG_RE.match(tag):
        what = "is empty" if not tag else f"holds {raw[:60]!r}, not a checkpoint tag"
        raise CheckpointError(f"{path} {what}: write the tag of a complete checkpoint folder beside it into it "
                              f"(e.g. `echo iter_0000300 > {path}`), or point checkpoint.load at an iter_N folder")
    return tag


def list_files(path: str) -> Dict[str, int]:
    """{relative path: size} of every file under `path`."""
    out = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            out[os.path.relpath(full, path)] = os.path.getsize(full)
    return out


def fingerprint(path: str) -> Dict[str, List[int]]:
    """{relative path: [size, modification time (ns), inode number]} of every file under checkpoint `path`:
    what a universal copy records of the files it was converted from, to tell whether they were rewritten since
    (a checkpoint re-saved after a rollback is a new folder swapped in: new inode numbers). Stat calls only,
    however large the checkpoint."""
    out = {}
    for rel in sorted(list_files(path)):
        st = os.stat(os.path.join(path, rel))
        out[rel] = [st.st_size, st.st_mtime_ns, st.st_ino]
    return out


def is_complete(path: str) -> bool:
    """A finished checkpoint folder: its manifest exists (written last, before the folder got its name)."""
    return os.path.isfile(os.path.join(path, MANIFEST))


def is_own_entry(directory: str, name: str) -> bool:
    """An entry gptpar may find in a folder without it holding a checkpoint (see the module docstring)."""
    if name.startswith((LOCK, PROBE_PREFIX, LATEST_TMP_PREFIX, SAVE_TIMES)) or name in RECOVERY_SCRIPTS or \
            name in (DIAGNOSTICS, RESOLVED_CONFIG):
        return True
    return staged(name) is not None and os.path.isdir(os.path.join(directory, name))


def checkpoint_tags(directory: str) -> List[str]:
    """Tags of the `iter_N` folders in `directory` (complete or not), oldest iteration first."""
    if not os.path.isdir(directory):
        return []
    return sorted((name for name in os.listdir(directory)
                   if TAG_RE.match(name) and os.path.isdir(os.path.join(directory, name))),
                  key=lambda name: int(TAG_RE.match(name).group(1)))


def complete_checkpoints(directory: str) -> List[str]:
    """Tags of the complete checkpoints in `directory`, oldest iteration first."""
    return [tag for tag in checkpoint_tags(directory) if is_complete(os.path.join(directory, tag))]


# ---------------------------------------------------------------------------------------------
# What checkpoint.load (or a tool's --load) means
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoadTarget:
    """The checkpoint to resume: folder `tag` inside `directory` (DeepSpeed's (load_dir, tag)); `universal`, when
    set, the universal checkpoint folder to load instead (gptpar.checkpoint.universal; the checkpoint's own copy
    at another parallel shape, or what checkpoint.load points at)."""

    directory: str
    tag: str
    universal: Optional[str] = None

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.tag)


def is_universal_folder(path: str) -> bool:
    """A universal checkpoint folder: gptpar's (its metadata file) or one DeepSpeed's ds_to_universal.py wrote (its
    `zero/{name}/*.pt` files)."""
    return os.path.isfile(os.path.join(path, UNIVERSAL_META)) or os.path.isdir(os.path.join(path, "zero"))


def resolve_load(load: Optional[str]) -> Tuple[Optional[LoadTarget], Optional[str]]:
    """(the checkpoint to load or None for a fresh start, the line that says so); reads, never writes.

    A missing folder, or one holding only gptpar's own lock/probe/temporary entries, is a fresh start. A folder
    with a `latest` pointer loads what it points at, which must exist and be complete; an `iter_N` folder, a
    universal checkpoint folder (`is_universal_folder`), or any folder holding a manifest (a weights-only checkpoint)
    given directly is loaded itself. Anything else (a file, an empty or garbled `latest`, checkpoints without a
    `latest`, a folder of unknown files) raises CheckpointError: a wrong path must never start a run from scratch.
    """
    if load is None:
        return None, None
    if not os.path.exists(load):
        return None, f"no checkpoint to load: {load} does not exist; starting from scratch"
    if not os.path.isdir(load):
        raise CheckpointError(f"checkpoint.load {load} is a file, not a checkpoint folder: give the folder "
                              "checkpoint.save wrote (it holds `latest`) or one of its iter_N folders")
    load = os.path.normpath(load)
    name = os.path.basename(load)
    if is_universal_folder(load):
        return LoadTarget(os.path.dirname(load), name, universal=load), None
    if (TAG_RE.match(name) or os.path.isfile(os.path.join(load, MANIFEST))) and \
            not os.path.exists(os.path.join(load, LATEST)):
        return LoadTarget(os.path.dirname(load), name), None  # a checkpoint folder itself (e.g. weights-only)
    tag = read_latest(load)
    if tag is None:
        entries = sorted(os.listdir(load))
        others = [e for e in entries if not is_own_entry(load, e)]
        if not others:
            what = "is empty" if not entries else "holds no checkpoint yet (only " + ", ".join(entries[:5]) + ")"
            return None, f"no checkpoint to load: {load} {what}; starting from scratch"
        if any(TAG_RE.match(e) for e in others):
            raise CheckpointError(_no_latest(load))
        raise CheckpointError(f"{load} has no `{LATEST}` pointer and holds files that are not a gptpar checkpoint "
                              f"({', '.join(others[:5])}): give the folder checkpoint.save wrote, or a new or empty "
                              "folder for a fresh start")
    target = LoadTarget(load, tag)
    if not os.path.isdir(target.path):
        raise CheckpointError(f"{os.path.join(load, LATEST)} points at {tag}, but {target.path} does not exist: "
                              f"{_newest_complete(load)}")
    if not is_complete(target.path):
        raise CheckpointError(f"{os.path.join(load, LATEST)} points at {tag}, but {target.path} is incomplete (it "
                              f"has no {MANIFEST}): {_newest_complete(load, exclude=tag)}")
    return target, None


def _no_latest(directory: str) -> str:
    """The message for a folder holding iter_N folders but no `latest`: which are complete, which to load."""
    complete = complete_checkpoints(directory)
    incomplete = [t for t in checkpoint_tags(directory) if t not in complete]
    unfinished = f"; incomplete (no {MANIFEST}): {', '.join(incomplete[-3:])}" if incomplete else ""
    if not complete:
        return (f"{directory} holds only incomplete checkpoint folders ({', '.join(incomplete[-3:])}: no {MANIFEST}) "
                "and no `latest` pointer: nothing there can be resumed; point checkpoint.load elsewhere")
    return (f"{directory} holds checkpoints ({', '.join(complete[-3:])}) but no `{LATEST}` pointer: point "
            f"checkpoint.load at {os.path.join(directory, complete[-1])} to resume from it (or write its tag into "
            f"{os.path.join(directory, LATEST)}){unfinished}")


def _newest_complete(directory: str, exclude: Optional[str] = None) -> str:
    """The fix for a `latest` that names no usable checkpoint: the newest complete one, or that there is none."""
    tags = [t for t in complete_checkpoints(directory) if t != exclude]
    if not tags:
        return (f"no other complete checkpoint is in {directory}; found: {', '.join(checkpoint_tags(directory)) or 'none'}"
                " (start afresh with a new checkpoint.save)")
    return (f"the newest complete checkpoint there is {tags[-1]}: write it into {os.path.join(directory, LATEST)} "
            f"or point checkpoint.load (--load) at {os.path.join(directory, tags[-1])}")


def earlier_checkpoint_fix(target: LoadTarget) -> str:
    """The fix for a damaged or incomplete checkpoint `target`: the complete ones beside it."""
    tags = [t for t in complete_checkpoints(target.directory) if t != target.tag]
    if not tags:
        return (f"resume from an earlier checkpoint instead (no other complete checkpoint in {target.directory}), "
                "or start afresh with a new checkpoint.save")
    return (f"resume from an earlier checkpoint instead: set checkpoint.load to one of the complete ones in "
            f"{target.directory} ({', '.join(tags[-3:])}), e.g. checkpoint.load={os.path.join(target.directory, tags[-1])}")


__all__ = ["LATEST", "TAG_RE", "MANIFEST", "CONFIG", "LOCK", "UNIVERSAL_META", "OWNER", "LoadTarget", "tag_of",
           "state_file", "model_states_file", "layer_file", "staged", "read_latest", "list_files", "fingerprint",
           "is_complete", "is_own_entry", "is_universal_folder", "checkpoint_tags", "complete_checkpoints", "resolve_load",
           "earlier_checkpoint_fix"]
