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

With `checkpoint.async_host_buffer_mb` (a bound, `host_limit`) the snapshot goes through a bounded pool instead of
buffers for the whole state: each file's storages get host memory only when a copier thread reaches them, in the
order the file writes them, and give it back as soon as they are written, so at most `host_limit` bytes of host
memory (on CUDA: a pinned staging buffer included, through which each storage is copied in chunks) hold copies at
any time; a storage larger than the bound is taken alone when nothing else is held (said once). The optimizer step
then waits until the last storage is copied, i.e. until all but the bound's worth of the save is written. The
files are torch.save's bytes exactly (its own `torch.serialization._open_zipfile_writer` and `_save`, with the
storage records gated; torch 2.11 to 2.13); a writer with zipfile serialization off keeps whole buffers.

The writer neither agrees between ranks nor writes the manifest and `latest`: it runs the job it is given
(gptpar.checkpoint.checkpointer.Checkpointer's) with the files' records, once they are written. At most one save is
in flight: `wait` returns its outcome.
"""
from __future__ import annotations

import copy
import hashlib
import os
import pickle
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

    def take(self, nbytes: int, pinned: bool, lazy: bool = False) -> torch.Tensor:
        """A buffer of `nbytes`, kept for the next save. `lazy` (a bounded snapshot): a fresh pageable one, never
        kept: address space only until its copy touches it, freed once written (`_BoundedCopies`)."""
        if lazy:
            return torch.empty(nbytes, dtype=torch.uint8)
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


def _libc_malloc_trim():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def _return_freed_memory() -> None:
    """Give freed heap memory back to the system: glibc keeps freed blocks of up to 32 MiB (its dynamic mmap
    threshold) resident in its heap, so a bounded snapshot's freed storages would stay in the process's memory."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class _BoundedPool:
    """Host bytes lent to snapshot copies, at most `limit` at a time (one storage larger than the limit is lent
    alone). `peak` is the most ever held."""

    def __init__(self, limit: int):
        self.limit, self.held, self.peak = limit, 0, 0
        self.aborted = False
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> bool:
        """Block until `nbytes` fit (or nothing is held); False when the save was aborted meanwhile."""
        with self._cond:
            while not self.aborted and self.held and self.held + nbytes > self.limit:
                self._cond.wait()
            if self.aborted:
                return False
            self.held += nbytes
            self.peak = max(self.peak, self.held)
            return True

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.held -= nbytes
            self._cond.notify_all()

    def abort(self) -> None:
        with self._cond:
            self.aborted = True
            self._cond.notify_all()


class _StorageOrder:
    """A stand-in for torch's zip writer that records the storages torch.serialization._save would write, in its
    order (a dry run: no bytes)."""

    def __init__(self):
        self.storages: List[torch.UntypedStorage] = []

    def write_record(self, name, data, nbytes) -> None:
        if name.startswith("data/") and isinstance(data, torch.UntypedStorage):
            self.storages.append(data)


class _GatedZip:
    """torch's zip writer, with each storage record of a bounded snapshot written only once its copy is in host
    memory, and that memory given back to the pool right after."""

    def __init__(self, zip_file, bounded: "_BoundedCopies"):
        self.zip_file, self.bounded = zip_file, bounded

    def write_record(self, name, data, nbytes) -> None:
        slot = self.bounded.slot(data) if isinstance(data, torch.UntypedStorage) else None
        if slot is not None:
            slot.copied.wait()
            if self.bounded.failed is not None:
                raise RuntimeError(f"the snapshot copy failed: {self.bounded.failed}")
        self.zip_file.write_record(name, data, nbytes)
        if slot is not None:
            self.bounded.written(slot)

    def __getattr__(self, name):
        return getattr(self.zip_file, name)


class _Slot:
    """One storage of a bounded snapshot: its live storage, its host copy (memory taken only when copied)."""

    def __init__(self, live: torch.UntypedStorage, host: torch.Tensor):
        self.live, self.host, self.nbytes = live, host, live.nbytes()
        self.copied = threading.Event()


class _BoundedCopies:
    """A save's snapshots copied through a `_BoundedPool`: `run_copier` (a thread) copies the storages in the order
    the files write them, `write` writes a file through `_GatedZip`."""

    STAGING_BYTES = 64 * 2 ** 20  # CUDA: the pinned chunk each storage is copied through

    def __init__(self, snapshots: list, limit: int, log: Callable[[str], None]):
        self.snapshots, self.log = snapshots, log
        self.failed: Optional[BaseException] = None
        self.staging = None
        if any(live.device.type == "cuda" for snap in snapshots for live, _ in snap.copies):
            staging_bytes = min(self.STAGING_BYTES, max(limit // 4, 1))
            self.staging = torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=True)
            limit -= staging_bytes  # the pinned staging counts in the bound
        self.pool = _BoundedPool(max(limit, 0))
        self.staging_bytes = 0 if self.staging is None else self.staging.numel()
        self.order: List[_Slot] = []
        self._slots: Dict[int, _Slot] = {}
        for snap in snapshots:
            live_of = {host.untyped_storage()._cdata: live for live, host in snap.copies}
            dry = _StorageOrder()
            torch.serialization._save(snap.state, dry, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
            for storage in dry.storages:
                live = live_of.get(storage._cdata)
                if live is not None and storage._cdata not in self._slots:
                    slot = _Slot(live, _bytes_of(storage))
                    self._slots[storage._cdata] = slot
                    self.order.append(slot)

    def slot(self, storage: torch.UntypedStorage) -> Optional[_Slot]:
        return self._slots.get(storage._cdata)

    def peak_bytes(self) -> int:
        """The most host memory the snapshot held at once (the pinned staging included)."""
        return self.pool.peak + self.staging_bytes

    def run_copier(self, done: threading.Event) -> None:
        try:
            said = False
            for slot in self.order:
                if slot.nbytes > self.pool.limit and not said:
                    said = True
                    self.log(f"checkpoint.async_host_buffer_mb: a tensor of {slot.nbytes / 2 ** 20:.1f} MiB is larger "
                             "than the bound; it is copied alone")
                if not self.pool.acquire(slot.nbytes):
                    break
                self._copy(slot)  # its pages are touched (taken) now, given back once written
                slot.copied.set()
        except BaseException as e:  # noqa: BLE001 - the writer and the training thread must learn it, never hang
            self.failed = e
        finally:
            for slot in self.order:  # a writer waiting on a copy that will never come raises instead
                slot.copied.set()
            done.set()

    def _copy(self, slot: _Slot) -> None:
        source = _bytes_of(slot.live)
        if self.staging is None:
            slot.host.copy_(source)
            return
        with torch.cuda.device(slot.live.device):
            stream = torch.cuda.Stream()
            for start in range(0, slot.nbytes, self.staging.numel()):
                n = min(self.staging.numel(), slot.nbytes - start)
                with torch.cuda.stream(stream):
                    self.staging[:n].copy_(source[start:start + n], non_blocking=True)
                stream.synchronize()
                slot.host[start:start + n].copy_(self.staging[:n])

    def written(self, slot: _Slot) -> None:
        slot.host.untyped_storage().resize_(0)
        _return_freed_memory()
        self.pool.release(slot.nbytes)

    def abort(self) -> None:
        self.pool.abort()

    def write(self, state, path: str, checksums: bool) -> FileRecord:
        """`write_file` with the storage records gated on their copies: the same bytes."""
        with open(path, "wb") as raw:
            out = _HashingFile(raw, hashlib.new(DIGEST) if checksums else None)
            with torch.serialization._open_zipfile_writer(out) as zip_file:
                torch.serialization._save(state, _GatedZip(zip_file, self), pickle,
                                          torch.serialization.DEFAULT_PROTOCOL, False)
            raw.flush()
            os.fsync(raw.fileno())
        record: FileRecord = {"size": out.size}
        if checksums:
            record[DIGEST] = out.digest.hexdigest()
        return record


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

    def __init__(self, state, buffers: _HostBuffers, lazy: bool = False):
        """`lazy`: host storages that are only reserved (a bounded snapshot: `_BoundedCopies` fills and frees them)."""
        found: dict = {}
        _tensors(state, found)
        storages: Dict[int, Tuple[torch.UntypedStorage, torch.Tensor]] = {}  # StorageImpl -> (live, host copy)
        memo = {}
        for key, t in found.items():
            live = t.untyped_storage()
            if live._cdata not in storages:  # the identity torch.save shares storages by
                storages[live._cdata] = (live, buffers.take(live.nbytes(), pinned=live.device.type == "cuda",
                                                            lazy=lazy))
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
                 log: Callable[[str], None] = print, host_limit: Optional[int] = None):
        """`host_limit`: with `async_save`, the most bytes of host memory a snapshot holds at once (None: buffers for
        the whole state, kept between saves); see the module docstring."""
        self.async_save, self.checksums, self.zipfile_serialization = async_save, checksums, zipfile_serialization
        self.log = log
        self.host_limit = host_limit if async_save and zipfile_serialization else None
        self.snapshot_peak_bytes = 0  # a bounded snapshot's most host memory held at once, over the saves so far
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
                self._files.append((path, _Snapshot(state_dict, self._buffers, lazy=self.host_limit is not None)))
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
                if self.host_limit is not None:
                    self.log(f"checkpoint.async_save: at most {self.host_limit / 2 ** 20:.0f} MiB of host memory on "
                             "this rank hold a snapshot at once (checkpoint.async_host_buffer_mb; the optimizer step "
                             "after a save waits until all but that much is written)")
                else:
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
        if self.host_limit is not None:
            return self._run_bounded(save)
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
        self._finish(save, records, error)

    @staticmethod
    def _finish(save: _Save, records: dict, error) -> None:
        """The save's job (manifest, `latest`) on what was written; the training thread learns its outcome."""
        try:
            save.outcome = save.job(records, error)
        except BaseException as e:  # noqa: BLE001 - the training thread must learn it, never hang on `done`
            save.outcome = e
        finally:
            save.seconds = time.perf_counter() - save.started
            save.done.set()

    def _run_bounded(self, save: _Save) -> None:
        """`_run` through a bounded pool: a copier thread fills the storages in the order the files write them
        while this thread writes them, each storage's memory freed once written (`_BoundedCopies`)."""
        records, error = {}, save.error
        try:
            if error is None and save.files:
                copies = _BoundedCopies([snapshot for _, snapshot in save.files], self.host_limit, self.log)
                # the copier sets `copied` once the last storage is copied: the optimizer step goes on from there
                threading.Thread(target=copies.run_copier, args=(save.copied,), name="gptpar-checkpoint-copier",
                                 daemon=True).start()
                try:
                    for path, snapshot in save.files:
                        records[path] = copies.write(snapshot.state, path, self.checksums)
                finally:
                    copies.abort()  # a copier still waiting for room (a failed write) stops
                    save.copied.wait()
                if copies.failed is not None:
                    raise copies.failed
                self.snapshot_peak_bytes = max(self.snapshot_peak_bytes, copies.peak_bytes())
        except Exception as e:  # noqa: BLE001 - a full disk, an I/O error: the job reports it on every rank
            error = e
        finally:
            save.copied.set()  # the training thread never waits on a copy that failed
        save.files = []
        self._finish(save, records, error)

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
