"""The checkpoint folder's layout, read without modifying anything: what `checkpoint.load` points at, and
whether a checkpoint is complete.

    {dir}/latest                      the tag of the newest complete checkpoint ("iter_0000300")
    {dir}/iter_0000300/               one checkpoint; complete once gptpar_manifest.json exists
    {dir}/iter_0000300/gptpar_manifest.json   every file of the checkpoint: its size, its sha256 (unless
                                      checkpoint.checksums is off) and the rank that wrote it; written by rank 0
                                      after every rank's files are whole and before `latest` moves
    {dir}/.gptpar.lock                the job writing this folder (gptpar.checkpoint.save_folder)
    {dir}/.gptpar-probe-PID, .latest.tmp-PID   short-lived files of a write probe and of the pointer update

gptpar's own entries are the lock, probe and temporary files, the recovery scripts DeepSpeed copies
beside its checkpoints, and *partial* checkpoints (an `iter_N` without manifest or config.json: the save
that wrote it was killed). A folder holding nothing else has no checkpoint: loading from it starts fresh.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from gptpar.checkpoint.universal import is_deepspeed_universal, is_universal
from gptpar.checkpoint.weight_files import file_problem

LATEST = "latest"
TAG_RE = re.compile(r"^iter_(\d{7,})$")
MANIFEST = "gptpar_manifest.json"
CONFIG = "config.json"
LOCK = ".gptpar.lock"
PROBE_PREFIX = ".gptpar-probe-"
LATEST_TMP_PREFIX = f".{LATEST}.tmp-"
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # DeepSpeed copies them next to the checkpoints
DIGEST = "sha256"  # of each file's bytes, in the manifest: `sha256sum FILE` prints the same
MANIFEST_VERSION = 2  # 1: {file: size}; 2: {file: {"size", "sha256", "rank"}}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message names the path and the fix."""


def tag_of(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def state_file(rank: int) -> str:
    return f"gptpar_rank_{rank:05d}.pt"


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


def write_synced(path: str, text: str) -> None:
    """Write `text` to `path` and fsync it (callers write a temporary name, then move it into place)."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_latest(directory: str, tag: str) -> None:
    """Point `latest` at `tag` atomically: a reader sees the old or the new pointer, never a partial one."""
    tmp = os.path.join(directory, f"{LATEST_TMP_PREFIX}{os.getpid()}")
    write_synced(tmp, tag + "\n")
    os.replace(tmp, os.path.join(directory, LATEST))


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
    (a checkpoint re-saved in place after a rollback). Stat calls only, however large the checkpoint: the
    manifest is written under a temporary name and renamed over the old one at every save, so it gets a new
    inode number even where the clock is too coarse to change a modification time, and any file DeepSpeed
    rewrote gets a new modification time."""
    out = {}
    for rel in sorted(list_files(path)):
        st = os.stat(os.path.join(path, rel))
        out[rel] = [st.st_size, st.st_mtime_ns, st.st_ino]
    return out


def file_digest(path: str) -> str:
    """The hex DIGEST of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, DIGEST).hexdigest()


def write_manifest(path: str, iteration: int, world_size: int, weights_only: bool = False,
                   records: Optional[Dict[str, dict]] = None, checksums: bool = True) -> None:
    """Record every file of the finished checkpoint `path` (call after all ranks wrote theirs). `records`:
    {relative path: {"size", DIGEST, "rank"}} of the files the ranks wrote (hashed as they were written);
    every other file there (config.json, DeepSpeed's recovery scripts) is recorded now, as rank 0's, hashed
    here with `checksums`. `weights_only` marks a checkpoint of model weights alone
    (tools/convert_checkpoint.py --to gptpar): no optimizer, no counters, no per-rank state; loading it starts
    a run at iteration 0."""
    files = dict(records or {})
    for rel, size in list_files(path).items():
        if rel != MANIFEST and rel not in files:
            files[rel] = {"size": size, "rank": 0}
            if checksums:
                files[rel][DIGEST] = file_digest(os.path.join(path, rel))
    tmp = os.path.join(path, f".{MANIFEST}.tmp-{os.getpid()}")
    manifest = {"version": MANIFEST_VERSION, "iteration": iteration, "world_size": world_size,
                "files": dict(sorted(files.items()))}
    if weights_only:
        manifest["weights_only"] = True
    write_synced(tmp, json.dumps(manifest, indent=1))
    os.replace(tmp, os.path.join(path, MANIFEST))


def manifest_files(path: str) -> Dict[str, dict]:
    """{relative path: {"size"[, DIGEST, "rank"]}} from checkpoint `path`'s manifest (either version); raises
    OSError, ValueError, KeyError or TypeError when it is missing or unreadable."""
    with open(os.path.join(path, MANIFEST)) as f:
        files = json.load(f)["files"]
    return {rel: {"size": int(rec)} if isinstance(rec, int) else dict(rec, size=int(rec["size"]))
            for rel, rec in files.items()}


def is_weights_only(path: str) -> bool:
    """A checkpoint folder whose manifest marks it weights-only (see `write_manifest`)."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return json.load(f).get("weights_only") is True
    except (OSError, ValueError, AttributeError):
        return False


def is_complete(path: str) -> bool:
    """A finished checkpoint: it has a manifest, or (saved before manifests existed) its config.json."""
    return os.path.isfile(os.path.join(path, MANIFEST)) or os.path.isfile(os.path.join(path, CONFIG))


def is_own_entry(directory: str, name: str) -> bool:
    """An entry gptpar may find in a folder without it holding a checkpoint (see the module docstring)."""
    if name.startswith((LOCK, PROBE_PREFIX, LATEST_TMP_PREFIX, "resolved_config.json")) or name in RECOVERY_SCRIPTS:
        return True
    path = os.path.join(directory, name)
    return bool(TAG_RE.match(name)) and os.path.isdir(path) and not is_complete(path)


def partial_checkpoints(directory: str, latest: Optional[str]) -> List[str]:
    """Tags of the partial checkpoints in `directory` that a cleanup may delete: no manifest and no config.json,
    and newer than `latest` (an older incomplete folder is left alone: gptpar never wrote one)."""
    if not os.path.isdir(directory):
        return []
    newest = int(TAG_RE.match(latest).group(1)) if latest else -1
    return sorted(name for name in os.listdir(directory)
                  if TAG_RE.match(name) and int(TAG_RE.match(name).group(1)) > newest
                  and os.path.isdir(os.path.join(directory, name))
                  and not is_complete(os.path.join(directory, name)))


def complete_checkpoints(directory: str) -> List[str]:
    """Tags of the complete checkpoints in `directory`, oldest iteration first."""
    if not os.path.isdir(directory):
        return []
    return sorted((name for name in os.listdir(directory)
                   if TAG_RE.match(name) and is_complete(os.path.join(directory, name))),
                  key=lambda name: int(TAG_RE.match(name).group(1)))


# ---------------------------------------------------------------------------------------------
# What checkpoint.load means
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


def resolve_load(load: Optional[str]) -> Tuple[Optional[LoadTarget], Optional[str]]:
    """(the checkpoint to load or None for a fresh start, the line that says so); reads, never writes.

    A missing folder, or one holding only gptpar's own lock/probe/partial files, is a fresh start. A folder
    with a `latest` pointer loads what it points at; an `iter_N` folder, a universal checkpoint folder, or any
    folder holding a manifest (a weights-only checkpoint written by tools/convert_checkpoint.py) given
    directly is loaded itself.
    Anything else (a file, an empty or garbled `latest`, checkpoints without a `latest`, a folder of
    unknown files) raises CheckpointError: a wrong path must never start a run from scratch.
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
    if is_universal(load) or is_deepspeed_universal(load):
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
        complete = [e for e in others if TAG_RE.match(e)]
        if complete:
            raise CheckpointError(f"{load} holds checkpoints ({', '.join(complete[-3:])}) but no `{LATEST}` "
                                  f"pointer: point checkpoint.load at {os.path.join(load, complete[-1])} to resume "
                                  f"from it (or write its tag into {os.path.join(load, LATEST)})")
        raise CheckpointError(f"checkpoint.load {load} has no `{LATEST}` pointer and holds files that are not a "
                              f"gptpar checkpoint ({', '.join(others[:5])}): point checkpoint.load at the folder "
                              "checkpoint.save wrote, or at a new or empty folder for a fresh start")
    target = LoadTarget(load, tag)
    if not os.path.isdir(target.path):
        raise CheckpointError(f"{os.path.join(load, LATEST)} points at {tag}, but {target.path} does not exist: "
                              f"write the tag of an existing checkpoint into it ({_choices(load)})")
    return target, None


def verify_checkpoint(target: LoadTarget, world_size: int) -> None:
    """Raise CheckpointError unless every file of the checkpoint is there, whole, for `world_size` ranks.

    With a manifest every listed file must exist with its recorded size; every `.pt` must also open as a
    zip archive (torch's format keeps its directory at the end, so a truncated file fails here). The files'
    checksums are `verify_digests`' (each rank reads its own files)."""
    path = target.path
    fix = earlier_checkpoint_fix(target)
    problems = []
    if os.path.isfile(os.path.join(path, MANIFEST)):
        try:
            expected = manifest_files(path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{os.path.join(path, MANIFEST)} is unreadable ({e}): {fix}") from None
        for rel, record in sorted(expected.items()):
            full = os.path.join(path, rel)
            if not os.path.isfile(full):
                problems.append(f"{full} is missing")
            elif os.path.getsize(full) != record["size"]:
                problems.append(f"{full} has {os.path.getsize(full)} bytes, the manifest says {record['size']} "
                                "(truncated?)")
    elif not os.path.isfile(os.path.join(path, CONFIG)):
        raise CheckpointError(f"{path} is incomplete (no {MANIFEST}: the save that wrote it was interrupted): {fix}")
    for rank in range(world_size):
        if not os.path.isfile(os.path.join(path, state_file(rank))):
            problems.append(f"{os.path.join(path, state_file(rank))} is missing (saved by another world size, "
                            "or not by gptpar?)")
    for rel in sorted(list_files(path)):
        full = os.path.join(path, rel)
        problem = file_problem(full) if rel.endswith(".pt") else None
        if problem:
            problems.append(f"{full} {problem}")
    if problems:
        raise CheckpointError(damaged(target, problems))


def verify_digests(path: str, rank: Optional[int] = None) -> List[str]:
    """What is wrong with the checksums of checkpoint `path`'s files that `rank` wrote (None: every file):
    one line per file whose bytes no longer hash to its manifest's DIGEST. Reads those files whole; files
    without a digest (a manifest of version 1, or saved with checkpoint.checksums off) and missing ones
    (verify_checkpoint's) are skipped."""
    try:
        records = manifest_files(path)
    except (OSError, ValueError, KeyError, TypeError):
        return []  # no manifest (older checkpoints) or an unreadable one: verify_checkpoint reports it
    problems = []
    for rel, record in sorted(records.items()):
        full = os.path.join(path, rel)
        if DIGEST not in record or (rank is not None and record.get("rank", 0) != rank) or not os.path.isfile(full):
            continue
        digest = file_digest(full)
        if digest != record[DIGEST]:
            problems.append(f"{full} does not match its {DIGEST} in the manifest ({digest[:12]}..., recorded "
                            f"{record[DIGEST][:12]}...): its bytes changed after it was written (disk or copy "
                            "corruption)")
    return problems


def has_digests(path: str) -> bool:
    """Whether checkpoint `path`'s manifest records checksums."""
    try:
        return any(DIGEST in record for record in manifest_files(path).values())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def damaged(target: LoadTarget, problems: List[str]) -> str:
    """The message for checkpoint `target` and what is wrong with it."""
    return (f"checkpoint {target.path} is damaged:\n  " + "\n  ".join(dict.fromkeys(problems))
            + f"\n{earlier_checkpoint_fix(target)}")


def earlier_checkpoint_fix(target: LoadTarget) -> str:
    tags = [t for t in complete_checkpoints(target.directory) if t != target.tag]
    if not tags:
        return (f"resume from an earlier checkpoint instead (no other complete checkpoint in {target.directory}), "
                "or start afresh with a new checkpoint.save")
    return (f"resume from an earlier checkpoint instead: set checkpoint.load to one of the complete ones in "
            f"{target.directory} ({', '.join(tags[-3:])}), e.g. checkpoint.load={os.path.join(target.directory, tags[-1])}")


def saved_world_size(target: LoadTarget, default: int) -> int:
    """How many ranks saved checkpoint `target` (its manifest says; `default` for one saved before manifests,
    or an unreadable manifest, which verify_checkpoint then reports)."""
    try:
        with open(os.path.join(target.path, MANIFEST)) as f:
            return int(json.load(f)["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return default


def is_write_failure(exc: BaseException) -> bool:
    """Whether `exc` is the file system refusing a write (full, read-only, file too large): an OSError, torch's
    writer's RuntimeError ("unexpected pos", "PytorchStreamWriter failed"), safetensors' I/O error."""
    text = str(exc)
    return (isinstance(exc, OSError)
            or (isinstance(exc, RuntimeError) and ("unexpected pos" in text or "PytorchStreamWriter" in text))
            or (type(exc).__name__ == "SafetensorError" and "I/O error" in text))


def describe_write_failure(folder: str, exc: BaseException) -> str:
    """What a failed write says, wherever gptpar writes (a checkpoint, a universal copy, a converted model):
    the cause (torch's "unexpected pos" explained) and the free space left in `folder`."""
    cause = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, RuntimeError) and "unexpected pos" in str(exc):
        cause += " (torch's writer wrote fewer bytes than asked: usually a full disk)"
    while folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    try:
        free = f"{shutil.disk_usage(folder or '.').free / 2 ** 20:.1f} MiB free there now"
    except OSError as e:
        free = f"free space unknown ({e.strerror})"
    return f"{cause}; {free}"


def _choices(directory: str, exclude: Optional[str] = None) -> str:
    tags = [t for t in complete_checkpoints(directory) if t != exclude]
    if not tags:
        return f"no other complete checkpoint in {directory}"
    return "complete ones in " + directory + ": " + ", ".join(tags[-3:])


__all__ = ["LATEST", "TAG_RE", "MANIFEST", "LOCK", "DIGEST", "CheckpointError", "LoadTarget", "tag_of", "state_file",
           "read_latest", "write_synced", "write_latest", "file_digest", "write_manifest", "manifest_files",
           "verify_digests", "has_digests", "damaged", "earlier_checkpoint_fix", "list_files", "fingerprint",
           "is_write_failure", "describe_write_failure", "is_weights_only",
           "is_complete", "is_own_entry", "partial_checkpoints", "complete_checkpoints", "resolve_load",
           "verify_checkpoint", "saved_world_size"]
