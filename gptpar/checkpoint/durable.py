"""The one durable write, for every folder gptpar writes: iteration checkpoints (blocking and async), universal
copies (in a run and offline), weights-only checkpoints and Hugging Face exports.

    staged = StagedFolder(target)      `{target}.tmp-TOKEN`, beside the target, named after it
    staged.create()                    the files are written into staged.tmp, each fsynced as it is closed
    staged.commit(kind, records, ...)  the manifest last (every file's size and sha256), fsynced; the folder fsynced;
                                       renamed into place; the parent fsynced
    publish_latest(save_dir, tag)      `latest` written under a temporary name, fsynced, renamed; the save folder
                                       fsynced, so that `latest` names a folder that is on disk before anything
                                       older is pruned
    retire_folder(target)              a complete folder deleted (keep_last's pruning): renamed aside to
                                       `{target}.tmp-retired-TOKEN` first (the parent fsynced), its manifest
                                       removed, then the rest; a crash part-way leaves a temporary folder that the
                                       next start deletes, never an `iter_N` that still looks complete

POSIX orders neither a new file's directory entry nor a rename on disk without an fsync of the directory: without
these, a power loss can leave `latest` naming a folder that is missing or partial, with the older one pruned. A tag
that exists already (a rollback re-saving `iter_N`) is never rewritten in place: the new folder is written beside it
and swapped in (`{target}.old-TOKEN` holds the previous one until the parent is fsynced; a start-up after a crash in
between puts it back, gptpar.checkpoint.save_folder.recover_swaps). Some file systems refuse to fsync a directory
(EINVAL, ENOTSUP): that is tolerated and said once per file system.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
from typing import Callable, Dict, Optional

from gptpar.checkpoint.exceptions import CheckpointError
from gptpar.checkpoint.layout import LATEST, LATEST_TMP_PREFIX, MANIFEST, list_files
from gptpar.checkpoint.manifest import DIGEST, KINDS, VERSION, file_digest

# errno values of a file system that cannot fsync a directory (some network and FUSE file systems)
_DIR_FSYNC_UNSUPPORTED = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF)
_said_unsupported: set = set()  # the file systems (st_dev) already named in the log


def fsync_dir(path: str, log: Callable[[str], None] = print) -> None:
    """fsync the directory `path`, so that the entries created or renamed in it are on disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise
        device = os.fstat(fd).st_dev
        if device not in _said_unsupported:
            _said_unsupported.add(device)
            log(f"note: the file system of {path} does not fsync directories ({errno.errorcode.get(e.errno, e.errno)}): "
                "gptpar's folder renames there are as durable as that file system makes them")
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    """fsync a file that is already written and closed (one another library wrote)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: str, text: str) -> None:
    """Write `text` to `path` and fsync it (callers write a temporary name, then rename it into place)."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def replace_synced(tmp: str, path: str, log: Callable[[str], None] = print) -> None:
    """Rename `tmp` over `path` and fsync their folder: a reader sees the old or the new file, and after a crash
    the new one stays."""
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)), log)


def publish_latest(directory: str, tag: str, log: Callable[[str], None] = print) -> None:
    """Point `latest` at `tag` atomically and durably (the tag's folder must be in place and fsynced)."""
    tmp = os.path.join(directory, f"{LATEST_TMP_PREFIX}{os.getpid()}")
    write_synced(tmp, tag + "\n")
    replace_synced(tmp, os.path.join(directory, LATEST), log)


def write_manifest(folder: str, kind: str, records: Optional[Dict[str, dict]] = None, checksums: bool = True,
                   log: Callable[[str], None] = print, **fields) -> None:
    """Write `folder`'s manifest, last: `records` {relative path: {"size", DIGEST[, "rank"]}} of the files hashed
    as they were written; every other file there (config.json, DeepSpeed's recovery scripts, a library's output)
    is fsynced and recorded now, hashed with `checksums`. `fields` (iteration, world_size, ...) go in as they are."""
    assert kind in KINDS, kind
    files = dict(records or {})
    for rel, size in list_files(folder).items():
        if rel == MANIFEST or rel in files:
            continue
        full = os.path.join(folder, rel)
        fsync_file(full)
        files[rel] = {"size": size}
        if checksums:
            files[rel][DIGEST] = file_digest(full)
    folders = set()
    for rel in files:
        while os.path.dirname(rel):
            rel = os.path.dirname(rel)
            folders.add(rel)
    for rel in sorted(folders):  # the sub-folders' entries (a universal copy's zero/ and zero/{name}/)
        fsync_dir(os.path.join(folder, rel), log)
    manifest = dict({"version": VERSION, "kind": kind}, **fields, files=dict(sorted(files.items())))
    tmp = os.path.join(folder, f".{MANIFEST}.tmp-{os.getpid()}")
    write_synced(tmp, json.dumps(manifest, indent=1))
    os.replace(tmp, os.path.join(folder, MANIFEST))


class StagedFolder:
    """A folder written whole under `{target}.tmp-TOKEN` and renamed to `target` once its manifest is written
    (see the module docstring). `token` names the writer (default: this process's pid); every rank of a save
    writes into the same temporary folder, so they share rank 0's token."""

    def __init__(self, target: str, token: Optional[str] = None):
        self.target = os.path.normpath(target)
        self.token = str(token if token is not None else os.getpid())
        self.tmp = f"{self.target}.tmp-{self.token}"
        self.parent = os.path.dirname(os.path.abspath(self.target))

    def create(self) -> str:
        """Make the (empty) temporary folder; returns its path."""
        if os.path.lexists(self.tmp):
            shutil.rmtree(self.tmp)
        os.makedirs(self.tmp)
        return self.tmp

    def commit(self, kind: str, records: Optional[Dict[str, dict]] = None, checksums: bool = True,
               log: Callable[[str], None] = print, replace: bool = False, **fields) -> None:
        """The manifest last, then `publish`."""
        write_manifest(self.tmp, kind, records, checksums, log, **fields)
        self.publish(log, replace)

    def publish(self, log: Callable[[str], None] = print, replace: bool = False) -> None:
        """fsync the finished temporary folder, rename it to the target, and fsync the parent. A target already
        there is swapped out when `replace` (a re-saved tag, a stale copy) or when it is an empty folder; else
        CheckpointError (another writer got there first)."""
        fsync_dir(self.tmp, log)
        if os.path.lexists(self.target) and not replace and not _empty_folder(self.target):
            raise CheckpointError(f"{self.target} appeared while {self.tmp} was being written: another job wrote the "
                                  "same folder at the same time; run one job per folder")
        if not os.path.lexists(self.target):
            os.rename(self.tmp, self.target)
            fsync_dir(self.parent, log)
            return
        old = f"{self.target}.old-{self.token}"
        if os.path.lexists(old):
            shutil.rmtree(old)
        os.rename(self.target, old)
        os.rename(self.tmp, self.target)
        fsync_dir(self.parent, log)
        shutil.rmtree(old, ignore_errors=True)

    def abandon(self) -> None:
        """Remove what was written (a failed or refused write)."""
        shutil.rmtree(self.tmp, ignore_errors=True)


RETIRED_TOKEN_PREFIX = "retired-"  # `{target}.tmp-retired-TOKEN`: a folder being deleted (retire_folder)


def retire_folder(target: str, token: Optional[str] = None, log: Callable[[str], None] = print) -> None:
    """Delete the complete folder `target` so that no crash part-way leaves anything that counts as complete: one
    rename takes it out of its name (`iter_N` folders are what a resume, `latest`'s fix text and the start-up's
    clean-up look at; a `.tmp-` folder is deleted by the next start), the parent fsynced so the rename is on disk
    before any file goes, then the manifest first, then the rest. Raises OSError if the rename fails (the folder
    is then untouched)."""
    target = os.path.normpath(target)
    aside = f"{target}.tmp-{RETIRED_TOKEN_PREFIX}{token if token is not None else os.getpid()}"
    if os.path.lexists(aside):
        shutil.rmtree(aside)
    os.rename(target, aside)
    fsync_dir(os.path.dirname(os.path.abspath(target)), log)
    try:
        os.unlink(os.path.join(aside, MANIFEST))
    except FileNotFoundError:
        pass
    shutil.rmtree(aside, ignore_errors=True)


def is_write_failure(exc: BaseException) -> bool:
    """Whether `exc` is the file system refusing a write (full, read-only, file too large): an OSError, torch's
    writer's RuntimeError ("unexpected pos", "PytorchStreamWriter failed"), safetensors' I/O error."""
    text = str(exc)
    return (isinstance(exc, OSError)
            or (isinstance(exc, RuntimeError) and ("unexpected pos" in text or "PytorchStreamWriter" in text))
            or (type(exc).__name__ == "SafetensorError" and "I/O error" in text))


def describe_write_failure(folder: str, exc: BaseException) -> str:
    """What a failed write says, wherever gptpar writes (a checkpoint, a universal copy, a converted model): the
    cause, what its errno means (no space, a quota, a file-size limit: each has its own fix) and the free space
    left in `folder`. torch's writer gives no errno ("unexpected pos": it wrote fewer bytes than asked), so for it
    the process's file-size limit and the free space are looked at instead."""
    cause = f"{type(exc).__name__}: {exc}"
    while folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    try:
        free_bytes = shutil.disk_usage(folder or ".").free
        free = f"{free_bytes / 2 ** 20:.1f} MiB free there now"
    except OSError as e:
        free_bytes, free = None, f"free space unknown ({e.strerror})"
    code = _errno_of(exc)
    if code in _ERRNO_MEANINGS:
        cause += f" ({_ERRNO_MEANINGS[code]}{_file_size_limit() if code == errno.EFBIG else ''})"
    elif isinstance(exc, RuntimeError) and "unexpected pos" in str(exc):
        cause += f" (torch's writer wrote fewer bytes than asked, without an errno: {_likely_cause(free_bytes)})"
    return f"{cause}; {free}"


_ERRNO_MEANINGS = {
    errno.ENOSPC: "ENOSPC: no space left on the device: free space or write elsewhere",
    errno.EDQUOT: "EDQUOT: this user's disk quota is used up, though the disk may have room: free some of the "
                  "quota or write elsewhere",
    errno.EFBIG: "EFBIG: file too large for a limit, not a full disk: ",
}
_LOW_SPACE = 1 << 30  # below this much free space, a short write is most likely the disk filling up


def _errno_of(exc: BaseException) -> Optional[int]:
    """The errno of an OSError (or of one it was raised from), or the `os error N` safetensors' message names."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return seen.errno
        seen = seen.__cause__ or seen.__context__
    text = str(exc)
    marker = "(os error "
    if marker in text:
        digits = text.split(marker, 1)[1].split(")", 1)[0]
        return int(digits) if digits.isdigit() else None
    return None


def _file_size_limit() -> str:
    """The process's RLIMIT_FSIZE (`ulimit -f`) when it has one, else the file system's largest file."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):
        soft = None
    if soft is not None and soft != resource.RLIM_INFINITY:
        return f"this process's file-size limit RLIMIT_FSIZE (`ulimit -f`) is {soft} bytes: raise it"
    return "the file system's largest file (e.g. 4 GiB on FAT32): write to another file system"


def _likely_cause(free_bytes: Optional[int]) -> str:
    limit = _file_size_limit()
    if limit.startswith("this process's"):
        return f"likely EFBIG: {limit}"
    if free_bytes is not None and free_bytes < _LOW_SPACE:
        return "likely ENOSPC: the disk is (nearly) full"
    return ("not a full disk by the free space: a disk quota (EDQUOT), the file system's largest file (EFBIG) or an "
            "I/O error")


def _empty_folder(path: str) -> bool:
    return os.path.isdir(path) and not os.listdir(path)


__all__ = ["is_write_failure", "describe_write_failure", "fsync_dir", "fsync_file", "write_synced", "replace_synced", "publish_latest", "write_manifest",
           "StagedFolder", "retire_folder", "RETIRED_TOKEN_PREFIX"]
