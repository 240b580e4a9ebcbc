"""The save folder before training: one job at a time, writable, room for a checkpoint, no leftovers.

Rank 0 runs these in this order (gptpar.training.preflight), after checkpoint.load was checked, so that a
refused run changes nothing:

    peek_lock       read-only: another live job holds the folder -> SaveFolderError (exit 2)
    JobLock.acquire create the folder, then `.gptpar.lock` = {pid, host, start time} of this rank 0; a lock
                    whose pid is dead on this host is taken over with a warning; a lock from another host
                    (its pid cannot be checked from here) needs checkpoint.override_lock=true
    probe_writable  a probe file written, fsynced and deleted: a read-only or full file system fails now,
                    not at the first save after hours of training
    clean_leftovers the temporary folders of killed saves (`iter_N.tmp-TOKEN`) and of killed prunes
                    (`iter_N.tmp-retired-TOKEN`), a re-save's swap cut short by a crash (`iter_N.old-TOKEN` put back
                    when `iter_N` is missing), and stale `.latest.tmp-PID` and probe files of dead jobs
    check_free_space room for one checkpoint (checkpoint_bytes), warn below 2x, error below 1x
    clean_conversion_leftovers  in checkpoint.universal_dir: `{tag}.tmp-PID` folders of universal conversions
                    whose job is gone (the preflight then converts, if it must, with the lock held)

The lock is released (deleted) when the run ends; a run killed with SIGKILL leaves it, and the next run on
the same host takes it over because its pid is dead. A pid is "alive" only if a process with that pid
exists *and* started at the recorded time (Linux /proc), so a reused pid is not mistaken for the job.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from typing import Callable, Optional

from gptpar.checkpoint.durable import RETIRED_TOKEN_PREFIX, fsync_dir, write_synced
from gptpar.checkpoint.exceptions import CheckpointError
from gptpar.checkpoint.layout import (LATEST_TMP_PREFIX, LOCK, OWNER, PROBE_PREFIX, TAG_RE, UNIVERSAL_META,
                                      is_complete, read_latest, staged)
from gptpar.config import deepspeed_precision
from gptpar.processes import pid_alive, process_start_ticks


# A universal copy is written as `{universal_dir}/{tag}.tmp-PID` first (gptpar.checkpoint.universal)
CONVERSION_TMP_RE = re.compile(r"^iter_\d{7,}\.tmp-(\d+)$")


class SaveFolderError(CheckpointError):
    """The save folder cannot be used by this run; the message names the folder, the cause and the fix."""


STATE_FILE_BYTES = 32 * 1024  # one rank's gptpar_rank_*.pt: counters and RNG states, with room to spare


def checkpoint_bytes(num_params: int, precision: str, zero_stage: int, world_size: int) -> int:
    """What one checkpoint of `num_params` parameters takes on disk with DeepSpeed and Adam.

    The weights in the model's dtype (4 or 2 bytes), and the optimizer state: with ZeRO or in bf16/fp16
    DeepSpeed keeps an fp32 copy of the weights beside Adam's two moments (12 bytes), a plain fp32 AdamW
    only the moments (8). Sharding over tp/pp/dp splits these bytes without adding any (the LayerNorms
    replicated per tp rank are left out); each rank adds its small gptpar state file."""
    precision = deepspeed_precision(precision)  # an fp8 run saves bf16's files
    weights = 4 if precision == "fp32" else 2
    optimizer = 8 if precision == "fp32" and zero_stage == 0 else 12
    return num_params * (weights + optimizer) + world_size * STATE_FILE_BYTES


# ---------------------------------------------------------------------------------------------
# The lock
# ---------------------------------------------------------------------------------------------

def this_job() -> dict:
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "start_ticks": process_start_ticks(pid),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "started_unix": time.time()}


def describe_job(lock: dict) -> str:
    return f"pid {lock.get('pid')} on {lock.get('host')}, started {lock.get('started')}"


def read_lock(directory: str) -> Optional[dict]:
    """The lock's contents; None without a lock; {} for a lock that cannot be read (being written, garbled)."""
    return read_job(os.path.join(directory, LOCK))


def read_job(path: str) -> Optional[dict]:
    """A job record (`this_job()`'s JSON) at `path`; None without the file; {} for one that cannot be read."""
    try:
        with open(path) as f:
            job = json.load(f)
        return job if isinstance(job, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def lock_state(lock: dict) -> str:
    """'alive' (a job on this host still runs), 'dead' (its pid is gone on this host) or 'unknown'."""
    if lock.get("host") != socket.gethostname() or not isinstance(lock.get("pid"), int):
        return "unknown"
    if lock["pid"] == os.getpid() and lock.get("start_ticks") == process_start_ticks(os.getpid()):
        return "dead"  # an earlier run in this very process (a test harness) that ended without releasing
    return "alive" if pid_alive(lock["pid"], lock.get("start_ticks")) else "dead"


def peek_lock(directory: Optional[str], override: bool) -> Optional[str]:
    """Read-only: raise SaveFolderError if another job holds `directory`; the warning a takeover will give."""
    if not directory or not os.path.isdir(directory):
        return None
    lock = read_lock(directory)
    if lock is None:
        return None
    path = os.path.join(directory, LOCK)
    state = lock_state(lock)
    if state == "alive":
        raise SaveFolderError(f"another job is writing checkpoints to {directory}: {describe_job(lock)} (lock "
                              f"{path}). Wait for it to end or stop it, or set checkpoint.save to another folder")
    if state == "dead":
        return (f"warning: taking over the lock {path} of a job that is gone ({describe_job(lock)}: no such "
                "process on this host)")
    if not override:
        who = describe_job(lock) if lock else "an unreadable lock file"
        raise SaveFolderError(f"{path} says another job writes checkpoints to {directory} ({who}) and its process "
                              "cannot be checked from this host. If that job has ended, set "
                              "checkpoint.override_lock=true (or delete the lock file); else set checkpoint.save to "
                              "another folder")
    who = describe_job(lock) if lock else "unreadable"
    return f"warning: checkpoint.override_lock=true: taking over the lock {path} ({who})"


class JobLock:
    """`.gptpar.lock` in the save folder, held by rank 0 for the whole run."""

    def __init__(self, directory: str):
        self.directory, self.path = directory, os.path.join(directory, LOCK)
        self.mine: Optional[dict] = None

    def acquire(self, override: bool, log: Callable[[str], None]) -> None:
        warning = peek_lock(self.directory, override)
        make_folder(self.directory)
        mine = this_job()
        # Written whole under a temporary name, then linked into place: the lock is never seen half-written,
        # and link() fails if another job's lock appeared meanwhile (atomic, also on NFS).
        tmp = f"{self.path}.tmp-{os.getpid()}"
        try:
            _write_json(tmp, mine)
        except OSError as e:
            _remove_quietly(tmp)
            raise SaveFolderError(f"checkpoint.save {self.directory} is not writable: writing {self.path} failed "
                                  f"({type(e).__name__}: {e.strerror}): fix the permissions or free space, or set "
                                  "checkpoint.save to another folder") from None
        try:
            os.link(tmp, self.path)
            os.remove(tmp)
        except FileExistsError:  # a stale lock (peek_lock said we may take it over), or one just created
            try:
                warning = peek_lock(self.directory, override) or warning
            except SaveFolderError:
                _remove_quietly(tmp)
                raise
            os.replace(tmp, self.path)
        except OSError:  # a file system without hard links: replace, after the check above
            os.replace(tmp, self.path)
        if read_lock(self.directory) != mine:  # two runs raced for a stale lock: the later replace won
            raise SaveFolderError(f"another job took the lock {self.path} at the same moment "
                                  f"({describe_job(read_lock(self.directory) or {})}): run one job per folder")
        self.mine = mine
        if warning:
            log(warning)

    def release(self) -> None:
        """Delete the lock if it is still ours."""
        if self.mine is not None and read_lock(self.directory) == self.mine:
            try:
                os.remove(self.path)
            except OSError:
                pass
        self.mine = None


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _write_json(path: str, obj: dict) -> None:
    write_synced(path, json.dumps(obj))


# ---------------------------------------------------------------------------------------------
# Writable, clean, room for a checkpoint
# ---------------------------------------------------------------------------------------------

def make_folder(directory: str) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise SaveFolderError(f"checkpoint.save {directory} cannot be created ({type(e).__name__}: {e.strerror}"
                              f"{': ' + e.filename if e.filename else ''}): give a folder on a writable file "
                              "system") from None


def probe_writable(directory: str, size: int = 1 << 16) -> None:
    """Write, fsync and delete a probe file: fails now on a read-only, full or broken file system."""
    path = os.path.join(directory, f"{PROBE_PREFIX}{os.getpid()}")
    try:
        with open(path, "wb") as f:
            f.write(os.urandom(size))
            f.flush()
            os.fsync(f.fileno())
        os.remove(path)
    except OSError as e:
        _remove_quietly(path)
        raise SaveFolderError(f"checkpoint.save {directory} is not writable: writing a probe file failed "
                              f"({type(e).__name__}: {e.strerror}): fix the permissions or free space, or set "
                              "checkpoint.save to another folder") from None


def clean_leftovers(directory: str, log: Callable[[str], None]) -> None:
    """Delete what killed saves left behind, and finish a swap a crash cut short (call with the lock held: no live
    job writes here). A tag's `.old-` folder is the complete checkpoint a re-save was replacing: put back when the
    new one never got its name, deleted when it did."""
    latest = read_latest(directory)
    for name in sorted(os.listdir(directory)):
        match, path = staged(name), os.path.join(directory, name)
        if match is None or not TAG_RE.match(match["target"]) or not os.path.isdir(path):
            continue
        target = os.path.join(directory, match["target"])
        if match["what"] == "old" and not os.path.lexists(target) and is_complete(path):
            log(f"restoring {target} from {path} (a re-save of that tag was cut short before the new folder took "
                "its place)")
            os.rename(path, target)
            fsync_dir(directory, log)
        elif match["token"].startswith(RETIRED_TOKEN_PREFIX):
            log(f"removing {path} (a checkpoint checkpoint.keep_last was deleting when its job ended; `latest` is "
                f"{latest or 'absent'})")
            shutil.rmtree(path, ignore_errors=True)
        else:
            what = "partial checkpoint" if match["what"] == "tmp" else "replaced checkpoint"
            log(f"removing {what} {path} (its save was interrupted; `latest` is {latest or 'absent'})")
            shutil.rmtree(path, ignore_errors=True)
    for name in os.listdir(directory):  # only this job's rank 0 writes them, and it has not yet
        if name.startswith((LATEST_TMP_PREFIX, PROBE_PREFIX)):
            log(f"removing stale temporary file {os.path.join(directory, name)}")
            os.remove(os.path.join(directory, name))


def clean_conversion_leftovers(directory: str, log: Callable[[str], None]) -> None:
    """Delete what killed universal conversions left in `directory` (checkpoint.universal_dir): `{tag}.tmp-PID`
    folders, as large as a copy, whose job is gone on this host (gptpar.checkpoint.universal.OWNER inside says which
    job wrote it; without it, a folder holding nothing but a universal copy's entries counts as the PID of its
    name on this host). One of a live job is left alone, one from another host (its process cannot be checked
    from here) is named with the fix."""
    if not os.path.isdir(directory):
        return
    for name in sorted(os.listdir(directory)):
        match, path = CONVERSION_TMP_RE.match(name), os.path.join(directory, name)
        if not match or not os.path.isdir(path):
            continue
        owner = read_job(os.path.join(path, OWNER))
        if owner is None:  # written by a gptpar before owners were recorded: only a folder of its own layout
            if set(os.listdir(path)) - {"zero", UNIVERSAL_META}:
                continue
            owner = {"pid": int(match.group(1)), "host": socket.gethostname()}
        state = lock_state(owner)
        if state == "dead":
            log(f"removing {path}: the temporary folder of a universal conversion that did not finish (its job, "
                f"{describe_job(owner)}, is gone)")
            shutil.rmtree(path, ignore_errors=True)
        elif state == "unknown":
            log(f"warning: leaving {path}, the temporary folder of a universal conversion by {describe_job(owner)}, "
                "which cannot be checked from this host: delete it if that job has ended")


def check_free_space(directory: str, need: int, log: Callable[[str], None]) -> None:
    """Error below one checkpoint's worth of free space, warning below two."""
    free = shutil.disk_usage(directory).free
    mib = 2 ** 20
    if free < need:
        raise SaveFolderError(f"checkpoint.save {directory} has {free / mib:.1f} MiB free, but one checkpoint of "
                              f"this model needs about {need / mib:.1f} MiB: free space or set checkpoint.save to "
                              "another file system")
    if free < 2 * need:
        log(f"warning: checkpoint.save {directory} has {free / mib:.1f} MiB free, room for fewer than two "
            f"checkpoints of about {need / mib:.1f} MiB each (keep_last needs the new one written before the old "
            "one is deleted)")


__all__ = ["SaveFolderError", "JobLock", "peek_lock", "read_lock", "read_job", "lock_state", "this_job",
           "checkpoint_bytes", "make_folder", "probe_writable", "clean_leftovers", "clean_conversion_leftovers",
           "check_free_space"]
