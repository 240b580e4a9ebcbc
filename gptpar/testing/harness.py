"""Run a function on N local ranks over gloo: the harness behind the multi-rank tests and examples.

    results = run_distributed(fn, world_size=2, args=(...,))

`fn(*args)` runs on every rank after torch.distributed is initialised (gloo, a free local port) and
must be a module-level (picklable) function. Its return values come back as a list indexed by rank;
an exception on any rank is raised here with that rank's traceback; a rank that hangs past `timeout`
seconds (an idle machine's: a busy one stretches them by its measured load, gptpar.testing.deadline) gets every
rank killed and a TimeoutError raised, so a broken collective cannot hang CI.

Ranks are fresh interpreters (multiprocessing's spawn) unless `fork_ranks_from_server(preload)` was called: then
they are forked from one server process that imported `preload` (torch, DeepSpeed) once, instead of each spending
seconds on those imports (the test suite does this in tests/conftest.py).

`flip_a_byte_inside_a_tensor` damages a checkpoint file the way a disk or a copy does (same size, still a whole zip
archive), for the tests of the verification on read.

`LiveTensorBytes` counts the bytes of tensors created inside a block that are alive at once (a peak-memory count
that needs no CUDA and does not depend on the allocator: tests and bench/bench_loss_memory.py use it).
"""
from __future__ import annotations

import io
import os
import queue
import struct
import sys
import time
import zipfile
import traceback
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.multiprocessing as mp
import weakref
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gptpar.parallel import free_port  # noqa: F401 (re-exported for tests)
from gptpar.testing.deadline import Deadline


# None: spawn each rank; else the modules the forkserver imports before it forks ranks (fork_ranks_from_server).
_server_preload: Optional[List[str]] = None


def fork_ranks_from_server(preload: Sequence[str], freeze_gc: bool = True) -> None:
    """Later `run_distributed` calls fork their ranks from one server process (multiprocessing's forkserver) that
    imported the modules `preload` names once. A rank is still a new process holding nothing of an earlier one: it
    gets the caller's os.environ (as of the call), sys.path, working directory, stdout and stderr, as a spawned rank
    does; only what `preload` did at import time (with the environment of the first call) is shared. Call it
    before the first `run_distributed`.

    The server imports with a fresh interpreter's sys.path (Python 3.11's forkserver does not give its preloads the
    caller's) and silently skips a module that fails to import: every rank checks that each `preload` module is
    there, and fails naming the missing ones. `freeze_gc`: the server then moves what its imports made into the
    collector's permanent generation (gptpar/testing/freeze_gc.py), so that the ranks' collections never scan it."""
    global _server_preload
    _server_preload = list(preload)
    mp.get_context("forkserver").set_forkserver_preload(_server_preload + (["gptpar.testing.freeze_gc"] if freeze_gc else []))


class _CallerStdio:
    """Pickled with a forked rank's arguments: the caller's stdout and stderr file descriptors, sent to the rank
    (the forkserver's own are those of the call that started it), where `_take_stdio` makes them fds 1 and 2."""

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return _take_stdio, (DupFd(1), DupFd(2))


def _take_stdio(out, err) -> None:
    for target, sent in ((1, out), (2, err)):
        fd = sent.detach()
        os.dup2(fd, target)
        os.close(fd)


def _worker(rank: int, world_size: int, port: int, threads: int, fn: Callable, args: Sequence,
            env: dict, results, caller_env: Optional[dict] = None, stdio=None, preloaded: Sequence[str] = ()) -> None:
    missing = [m for m in preloaded if m not in sys.modules]  # before this rank imports anything itself
    if caller_env is not None:  # forked from the server: the caller's environment, not the server's
        os.environ.clear()
        os.environ.update(caller_env)
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        if missing:
            raise ImportError(f"the rank server did not import {missing}: not importable from a fresh interpreter's "
                              f"sys.path (the working directory, PYTHONPATH, site-packages), or their import failed")
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(*args)
        # Serialised to bytes here: tensors sent as-is travel as shared-memory handles that die with
        # this process, which exits right after.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, "ok", buf.getvalue()))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - surfaced to the parent with the traceback
        results.put((rank, "error", traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()  # flush the result to the parent before the hard exit
        os._exit(0)  # skip interpreter teardown: avoids rare aborts in torch/DeepSpeed exit handlers


class LiveTensorBytes(TorchDispatchMode):
    """`with LiveTensorBytes() as m: ...` then `m.peak`: the most bytes that storages created by the block's ops
    (backward included, when it runs inside) held at one time; `m.largest` the largest such storage and
    `m.created` every (bytes, dtype) created. Each storage is counted once, from the op that created it until its
    last tensor dies; views and in-place results add nothing; what existed before the block is not counted."""

    def __init__(self):
        super().__init__()
        self.current = self.peak = self.largest = 0
        self.created = []
        self._counted, self._before = set(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs)):  # storages the block did not create (views of them are free)
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t.untyped_storage(), self._before)
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and self._track(t.untyped_storage(),
                                                                                         self._counted):
                self.current += t.untyped_storage().nbytes()
                self.peak, self.largest = max(self.peak, self.current), max(self.largest,
                                                                            t.untyped_storage().nbytes())
                self.created.append((t.untyped_storage().nbytes(), t.dtype))
        return out

    def _track(self, storage, into: set) -> bool:
        """Add `storage` to `into` until it is freed; False if it was already known or is empty."""
        key = (storage.data_ptr(), storage.nbytes())
        if not key[1] or key in self._counted or key in self._before:
            return False
        into.add(key)
        weakref.finalize(storage, self._free, key)
        return True

    def _free(self, key) -> None:
        if key in self._counted:
            self._counted.discard(key)
            self.current -= key[1]
        self._before.discard(key)


def flip_a_byte_inside_a_tensor(path: str) -> None:
    """Change one byte in the middle of the largest record of a torch file (a tensor's storage): the file keeps
    its size and still opens as a zip archive."""
    with zipfile.ZipFile(path) as z:
        record = max(z.infolist(), key=lambda info: info.file_size)
    with open(path, "r+b") as f:
        f.seek(record.header_offset + 26)  # the local header: 30 bytes, then the name and the extra field
        name_length, extra_length = struct.unpack("<HH", f.read(4))
        f.seek(record.header_offset + 30 + name_length + extra_length + record.file_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x5A]))


def flip_byte_at(path: str, offset: int) -> None:
    """XOR one byte of `path` at `offset` (negative: from the end) with 0x5A: the file keeps its size."""
    with open(path, "r+b") as f:
        f.seek(offset % os.path.getsize(path))
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x5A]))


def spread_offsets(size: int, count: int = 10, edge: int = 200) -> List[int]:
    """`count` byte offsets spread over a file of `size` bytes: two inside its first `edge` bytes (a torch file's
    pickle header, a safetensors header), two inside its last `edge` (a zip's central directory and end record)
    and the rest evenly between."""
    inner = count - 4
    step = (size - 2 * edge) / (inner + 1)
    return sorted({7, edge // 2, *(edge + round(step * (i + 1)) for i in range(inner)), size - edge // 2, size - 7})


def run_distributed(fn: Callable, world_size: int, args: Sequence = (), *, timeout: float = 300.0,
                    threads: Optional[int] = None, env: Optional[dict] = None) -> List[Any]:
    """Run `fn(*args)` on `world_size` spawned gloo ranks and return the per-rank results."""
    ctx = mp.get_context("spawn" if _server_preload is None else "forkserver")
    results = ctx.Queue()
    port = free_port()
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    forked = () if _server_preload is None else (dict(os.environ), _CallerStdio(), tuple(_server_preload))
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, threads, fn, tuple(args), env or {}, results)
                         + forked, daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    out: List[Any] = [None] * world_size
    pending = set(range(world_size))
    deadline = Deadline(timeout)  # idle-equivalent seconds: a busy machine stretches it (gptpar.testing.deadline)
    start = time.monotonic()
    try:
        while pending:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r in pending if procs[r].exitcode not in (None, 0)]  # 0: result still in flight
                if dead:
                    raise RuntimeError(f"rank {dead[0]} of {world_size} died (exit code "
                                       f"{procs[dead[0]].exitcode}) in {fn.__name__} without a result")
                if deadline.expired():
                    raise TimeoutError(f"distributed run of {fn.__name__} on {world_size} ranks did not finish "
                                       f"within {timeout:.0f}s of an idle machine's time ({time.monotonic() - start:.0f}"
                                       f" s waited at the measured load; ranks {sorted(pending)} hung)") from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} of {world_size} failed in {fn.__name__}:\n{value}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
            pending.discard(rank)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return out


def load_script(path: str):
    """The module of a script outside the package (bench/*.py), imported from its path
    without touching sys.path; it is registered in sys.modules under its file name, so its dataclasses and pickles
    work."""
    import importlib.util

    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
