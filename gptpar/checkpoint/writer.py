"""gptpar's checkpoint engine: every file of a checkpoint is written here, hashed as it is written and fsynced,
and, with `checkpoint.async_save`, written by a background thread while training goes on; every file DeepSpeed
loads back is read here too, only once it was verified against the manifest (gptpar.checkpoint.manifest.Verifier).

DeepSpeed's `save_checkpoint` writes each of its files through `engine.checkpoint_engine.save(state_dict, path)`
(by default its TorchCheckpointEngine: `torch.save`), the pipeline engine's per-layer files included, and loads
each through `checkpoint_engine.load`. The engine puts a `CheckpointWriter` there
(gptpar.training.engine.checkpointing.install_writer), and gptpar's own per-rank file goes through it too, so one
object sees every byte of a checkpoint:

- **sync** (`async_save` false): `save` writes the file at once, in the caller, as DeepSpeed's engine would:
  `torch.save` into a file object that feeds each chunk to sha256 (`checkpoint.checksums`) on its way to disk,
  then an fsync. A failure is kept, not raised, so every rank reaches the agreement that follows.
- **async**: `save` only takes a *snapshot plan* of the state dict: its structure deep-copied with every tensor
  replaced by a view of a host buffer of the same storage layout (tensors that share a storage in the original
  share one buffer, so `torch.save` of the copy writes the same bytes). A plan that fails (a host buffer that
  cannot be allocated) is kept like a failed write, never raised inside DeepSpeed's save, whose closing barrier
  the other ranks wait in. `start` hands the save to a thread that first copies every live storage into its
  buffer, then serialises, hashes, writes and fsyncs the files. The live tensors (weights, fp32 master weights,
  Adam moments) change next at the optimizer step, in place: `wait_for_snapshot`, hooked before the client
  optimizer's step, holds that step until the copy is done. So the copy overlaps the next iteration's batch,
  forward and backward, and the files hold the state of the save's iteration exactly. The host buffers are
  allocated at the first save and reused by every later one (a fresh buffer's first touch makes the copy several
  times slower: docs/checkpoints.md); their size is said once. On CUDA they are pinned and the copy runs on a side
  stream after the work queued before the save.

The writer neither agrees between ranks nor writes the manifest and `latest`: it runs the job it is given
(gptpar.checkpoint.checkpointer.Checkpointer's) with the files' records, once they are written. At most one save is
in flight: `wait` returns its outcome.
"""
from __future__ import annotations

import copy
import hashlib
import os
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from gptpar.checkpoint.manifest import DIGEST

# What a written file records: {"size": bytes, DIGEST: hex digest (with checksums)}.
FileRecord = Dict[str, object]


class _HashingFile:
    """A binary file that feeds every chunk torch.save writes to a hash (None: sizes only) on its way to disk."""

    def __init__(self, raw, digest):
        self.raw, self.digest, self.size = raw, digest, 0

    @property
    def name(self) -> str:
        return self.raw.name

    def write(self, data) -> int:
        if self.digest is not None:
            self.digest.update(data)  # hashlib releases the GIL on large chunks
        self.size += len(data)
        return self.raw.write(data)

    def flush(self) -> None:
        self.raw.flush()


def write_file(state, path: str, checksums: bool, zipfile_serialization: bool = True) -> FileRecord:
    """`torch.save(state, path)`, hashed as written and fsynced: the file's record."""
    with open(path, "wb") as raw:
        out = _HashingFile(raw, hashlib.new(DIGEST) if checksums else None)
        torch.save(state, out, _use_new_zipfile_serialization=zipfile_serialization)
        raw.flush()
        os.fsync(raw.fileno())
    record: FileRecord = {"size": out.size}
    if checksums:
        record[DIGEST] = out.digest.hexdigest()
    return record


class _HostBuffers:
    """Byte buffers for snapshots, kept from one save to the next (same sizes each save)."""

    def __init__(self):
        self.free: Dict[Tuple[int, bool], List[torch.Tensor]] = {}
        self.used: List[torch.Tensor] = []

    def take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        kept = self.free.get((nbytes, pinned))
        buf = kept.pop() if kept else torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.used.append(buf)
        return buf

    def held_bytes(self) -> int:
        return sum(buf.numel() for buf in self.used) + sum(buf.numel() for kept in self.free.values() for buf in kept)

    def recycle(self) -> None:
        """After a save: its buffers are the free ones of the next (any other is released)."""
        self.free = {}
        for buf in self.used:
            self.free.setdefault((buf.numel(), buf.is_pinned()), []).append(buf)
        self.used = []


def _tensors(obj, found: dict) -> None:
    """Every tensor in dicts, lists and tuples under `obj` (DeepSpeed's state dicts), by id."""
    if torch.is_tensor(obj):
        found[id(obj)] = obj
    elif isinstance(obj, dict):
        for value in obj.values():
            _tensors(value, found)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _tensors(value, found)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A storage as a flat uint8 tensor (for a whole-storage copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _Snapshot:
    """A state dict whose tensors are views of host buffers, and the copies that fill them.

    Built in the caller (cheap: allocation and structure only); `copy()` runs in the writer thread."""

    def __init__(self, state, buffers: _HostBuffers):
        found: dict = {}
        _tensors(state, found)
        storages: Dict[int, Tuple[torch.UntypedStorage, torch.Tensor]] = {}  # StorageImpl -> (live, host copy)
        memo = {}
        for key, t in found.items():
            live = t.untyped_storage()
            if live._cdata not in storages:  # the identity torch.save shares storages by
                storages[live._cdata] = (live, buffers.take(live.nbytes(), pinned=live.device.type == "cuda"))
            host = storages[live._cdata][1]
            view = torch.empty(0, dtype=t.dtype).set_(host.untyped_storage(), t.storage_offset(), t.size(),
                                                       t.stride())
            if isinstance(t, torch.nn.Parameter):
                view = torch.nn.Parameter(view, requires_grad=t.requires_grad)
            elif t.requires_grad:  # torch.save records the flag (ZeRO-1 saves views of its fp32 partitions)
                view.requires_grad_(True)
            memo[key] = view
        # Everything but the tensors (counters, the fp16 loss scaler object, DeepSpeed's config and param
        # mappings) is copied now: the caller may change it as soon as the save returns.
        self.state = copy.deepcopy(state, memo)
        self.copies = list(storages.values())
        self.ready = None  # on CUDA: the point of the caller's stream the copies must wait for
        if any(live.device.type == "cuda" for live, _ in self.copies):
            self.ready = torch.cuda.Event()
            self.ready.record()

    def copy(self) -> None:
        if self.ready is None:
            for live, host in self.copies:
                host.copy_(_bytes_of(live))
            return
        device = next(live.device for live, _ in self.copies if live.device.type == "cuda")
        with torch.cuda.device(device):  # this thread's current device is not the caller's
            stream = torch.cuda.Stream()
            stream.wait_event(self.ready)
            with torch.cuda.stream(stream):
                for live, host in self.copies:
                    host.copy_(_bytes_of(live), non_blocking=True)
            stream.synchronize()


class _Save:
    """One save in flight: its files, the events the training thread waits on, and the outcome."""

    def __init__(self, name: str, files: list,
                 job: Callable[[Dict[str, FileRecord], Optional[BaseException]], object]):
        self.name, self.files, self.job = name, files, job
        self.copied, self.done = threading.Event(), threading.Event()
        self.outcome = None
        self.error: Optional[BaseException] = None  # a failure before the writer thread started (the plan's)
        self.started = time.perf_counter()
        self.seconds: Optional[float] = None  # from start to the job's end


class CheckpointWriter:
    """DeepSpeed's checkpoint-engine interface (deepspeed/runtime/checkpoint_engine/checkpoint_engine.py) over
    gptpar's writer. One per rank; see the module docstring. The records it hands the job are keyed by each
    file's path as DeepSpeed gave it."""

    def __init__(self, async_save: bool, checksums: bool, zipfile_serialization: bool = True,
                 log: Callable[[str], None] = print):
        self.async_save, self.checksums, self.zipfile_serialization = async_save, checksums, zipfile_serialization
        self.log = log
        self.verifier = None  # gptpar.checkpoint.manifest.Verifier of the checkpoint being loaded
        self._buffers_said = False
        self.name = "gptpar"
        self._files: list = []  # this save's (path, state or _Snapshot)
        self._records: Dict[str, FileRecord] = {}  # sync: written so far
        self._error: Optional[BaseException] = None  # sync: the first failure
        self._save: Optional[_Save] = None  # the last save handed to the thread
        self._buffers = _HostBuffers()
        self.waited_s = 0.0  # the training thread's time blocked on the writer (snapshot and in-flight waits)

    # -- DeepSpeed's interface --------------------------------------------------------------------
    def create(self, info) -> None:
        """DeepSpeed starts a checkpoint: nothing a failed one planned carries over."""
        self._files, self._records, self._error = [], {}, None

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path: str) -> None:
        """One file of the checkpoint being saved (DeepSpeed calls this for each of its files)."""
        if self._error is not None:  # after a failure the rest is not written: the save is lost anyway
            return
        if self.async_save:
            try:
                self._files.append((path, _Snapshot(state_dict, self._buffers)))
            except (OSError, RuntimeError) as e:  # a host buffer that cannot be allocated (pinned memory)
                self._error = e
        else:  # after a failure the rest is not written: the save is lost anyway
            try:
                self._records[path] = write_file(state_dict, path, self.checksums, self.zipfile_serialization)
            except (OSError, RuntimeError) as e:  # torch reports a short write as RuntimeError
                self._error = e

    def load(self, path: str, map_location=None):
        """One file DeepSpeed loads, through the verifier the Checkpointer set for this load (its sha256 checked
        before by the rank that wrote it, and agreed on: gptpar.checkpoint.checkpointer.load); a file the manifest
        does not list is refused."""
        if self.verifier is not None:
            return self.verifier.torch_load(path, map_location=map_location, weights_only=False)
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info) -> bool:
        return True  # gptpar commits (manifest, `latest`) once every rank's files are whole

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        return False

    def set_commit_info(self, info) -> None:
        pass

    def get_commit_info(self):
        return None

    def cleanup(self) -> None:
        pass

    def preserves_storage_sharing(self) -> bool:
        # DeepSpeed then clones the pipeline's per-layer state dicts (views into ZeRO's flat buffers) before
        # saving them, so each layer file holds its own tensors, not the whole flat buffer.
        return True

    # -- gptpar's ---------------------------------------------------------------------------------
    def start(self, job: Callable[[Dict[str, FileRecord], Optional[BaseException]], object], name: str) -> None:
        """Every file of this save has been given: run `job(records by path, the first failure or None)` once
        they are written: now, in the caller (sync), or in the writer thread after the copy and the writes
        (async; what the job returns or raises becomes the save's `outcome`). `name`: what the log calls it."""
        files, self._files = self._files, []
        save = _Save(name, files, job)
        self._save = save
        if self.async_save:
            save.error, self._error = self._error, None
            if not self._buffers_said and save.error is None:
                self._buffers_said = True
                held = self._buffers.held_bytes()
                self.log(f"checkpoint.async_save: {held / 2 ** 30:.2f} GiB of host buffers on this rank hold the "
                         "snapshots (allocated at this first save, reused by every later one)")
            threading.Thread(target=self._run, args=(save,), name="gptpar-checkpoint-writer", daemon=True).start()
            return
        records, error, self._records, self._error = self._records, self._error, {}, None
        save.copied.set()
        try:
            save.outcome = job(records, error)
        finally:
            save.seconds = time.perf_counter() - save.started
            save.done.set()

    def _run(self, save: _Save) -> None:
        records, error = {}, save.error
        try:
            if error is not None:  # the snapshot plan failed: nothing to copy or write
                save.files = []
            try:
                for _, snapshot in save.files:
                    snapshot.copy()
            finally:
                save.copied.set()  # the training thread never waits on a copy that failed
            for path, snapshot in save.files:
                records[path] = write_file(snapshot.state, path, self.checksums, self.zipfile_serialization)
        except Exception as e:  # noqa: BLE001 - a full disk, an I/O error: the job reports it on every rank
            error = e
        save.files = []  # the snapshots' views go; their buffers serve the next save
        self._buffers.recycle()
        try:
            save.outcome = save.job(records, error)
        except BaseException as e:  # noqa: BLE001 - the training thread must learn it, never hang on `done`
            save.outcome = e
        finally:
            save.seconds = time.perf_counter() - save.started
            save.done.set()

    def wait_for_snapshot(self) -> None:
        """Before anything changes the live tensors (the optimizer step): the in-flight save's copy is done."""
        save = self._save
        if save is not None and not save.copied.is_set():
            start = time.perf_counter()
            save.copied.wait()
            self.waited_s += time.perf_counter() - start

    def in_flight(self) -> Optional[_Save]:
        """The save handed over last, while it is not done."""
        save = self._save
        return save if save is not None and not save.done.is_set() else None

    def finished(self) -> Optional[_Save]:
        """The save handed over last, once it is done (its `outcome`, `seconds`)."""
        save = self._save
        return save if save is not None and save.done.is_set() else None

    def wait(self):
        """Block until the last save is done; its job's outcome (None when there was none)."""
        save = self._save
        if save is None:
            return None
        if not save.done.is_set():
            start = time.perf_counter()
            save.done.wait()
            self.waited_s += time.perf_counter() - start
        return save.outcome


__all__ = ["CheckpointWriter", "FileRecord", "write_file"]
