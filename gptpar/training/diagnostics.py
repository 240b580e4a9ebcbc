"""What each rank was doing when a collective failed: `<checkpoint.save>/diagnostics/rank_R.json` (or
`logging.diagnostics_dir`), read by tools/diagnose_hang.py to name the rank the others waited for.

One JSON object per rank: its rank, host, pid, (pp, dp, tp) coordinates and sizes, why it was written, its recent
collectives as gptpar's ring keeps them (gptpar.training.collectives: operation, the group's ranks, this rank's
sequence number in the group, the caller, whether the call returned), torch's flight recorder (every process
group's entries and status, gloo's included on torch >= 2.11; gptpar.parallel turns it on) and the Python stack of
every thread. Written when:

    a collective fails                 a timeout (another rank stopped answering) or a dead peer: pretrain_gpt.py
                                       writes it before its one line; a rank that is itself stopped or hung writes
                                       nothing, which is how diagnose_hang finds it
    SIGUSR2 arrives                    a live dump of a running or hung rank: the stacks go to stderr at once
                                       (faulthandler, from the signal handler, whatever the main thread does) and a
                                       helper thread writes the file (a Python handler would wait for the main
                                       thread to leave its collective; the thread wakes on the signal module's
                                       wakeup fd, which the C handler writes at delivery)
    NCCL's watchdog times out          it aborts the process before Python can write: the recorder's own dump
                                       (TORCH_FR_DUMP_TEMP_FILE, set here to `<dir>/nccl_trace_rank_`, one pickle per
                                       rank) lands in the same folder

Each file carries the run's id (rank 0's, shared at the start), so that tools/diagnose_hang.py reads one run's files
and not those an earlier run left. The folder is one of gptpar's own entries in a save folder (gptpar.checkpoint.layout.is_own_entry).
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from typing import Optional

from gptpar.checkpoint.layout import DIAGNOSTICS

NCCL_DUMP_PREFIX = "nccl_trace_rank_"
LIVE_DUMP_SIGNAL = signal.SIGUSR2


def diagnostics_dir(cfg) -> Optional[str]:
    """logging.diagnostics_dir, else `<checkpoint.save>/diagnostics`, else None (nowhere to write)."""
    if cfg.logging.diagnostics_dir:
        return cfg.logging.diagnostics_dir
    return os.path.join(cfg.checkpoint.save, DIAGNOSTICS) if cfg.checkpoint.save else None


def point_nccl_dump_at(directory: Optional[str]) -> None:
    """Before the process group exists: NCCL's flight recorder dumps into `directory` when its watchdog times out."""
    if directory is None or os.environ.get("TORCH_FR_DUMP_TEMP_FILE"):
        return
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(os.path.abspath(directory), NCCL_DUMP_PREFIX)
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")


def flight_recorder() -> Optional[dict]:
    """torch's flight recorder of this process (every group), parsed; None where torch offers no JSON dump."""
    try:
        import torch.distributed  # noqa: F401  (the c10d bindings)
        from torch._C._distributed_c10d import _dump_fr_trace_json
    except ImportError:
        return None
    try:
        return json.loads(_dump_fr_trace_json(includeCollectives=True, onlyActive=False))
    except Exception as e:  # noqa: BLE001 - the record is a help, never a second failure
        return {"error": f"{type(e).__name__}: {e}"}


def python_stacks() -> dict:
    """{thread name: its Python stack, innermost last} for every thread of this process."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return {f"{names.get(ident, 'thread')} ({ident})": traceback.format_stack(frame)
            for ident, frame in sys._current_frames().items()}


class Diagnostics:
    """Writes this rank's file (`write`) and serves the live dump on SIGUSR2 (`install`)."""

    def __init__(self, directory: Optional[str], pstate, collectives=None):
        """Collective when torch.distributed is initialised: every rank learns every rank's host (one all-gather), so
        that a rank that writes nothing is still placed by the files of the others."""
        self.directory, self.pstate, self.collectives = directory, pstate, collectives
        self._wakeup = None
        mine = (socket.gethostname(), uuid.uuid4().hex)
        gathered = [mine] * pstate.world_size
        if pstate.world_size > 1:
            import torch.distributed as dist

            dist.all_gather_object(gathered, mine)
        self.hosts = [host for host, _ in gathered]
        self.run_id = gathered[0][1]  # rank 0's: the same in every file of this run (an earlier run's differs)

    @property
    def path(self) -> Optional[str]:
        return None if self.directory is None else os.path.join(self.directory, f"rank_{self.pstate.rank}.json")

    def record(self, reason: str) -> dict:
        p = self.pstate
        return {"rank": p.rank, "world_size": p.world_size, "host": socket.gethostname(), "pid": os.getpid(),
                "coordinates": {"pp": p.pp_rank, "dp": p.dp_rank, "tp": p.tp_rank},
                "sizes": {"pp": p.pp_size, "dp": p.dp_size, "tp": p.tp_size}, "hosts": self.hosts, "run_id": self.run_id,
                "reason": reason,
                "time": time.time(),
                "collectives": self.collectives.entries() if self.collectives is not None else None,
                "flight_recorder": flight_recorder(), "stacks": python_stacks()}

    def write(self, reason: str) -> Optional[str]:
        """This rank's file, whole or not at all (a temporary file renamed into place); its path, or None when
        there is no folder or it cannot be written (the failure being reported matters more)."""
        if self.path is None:
            return None
        try:
            os.makedirs(self.directory, exist_ok=True)
            tmp = f"{self.path}.tmp-{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(self.record(reason), f, indent=1, default=str)
            os.replace(tmp, self.path)
            return self.path
        except OSError:
            return None

    def install(self) -> "Diagnostics":
        """SIGUSR2: the stacks to stderr at once and this rank's file from a helper thread (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        read_end, write_end = socket.socketpair()
        write_end.setblocking(False)
        self._previous = signal.signal(LIVE_DUMP_SIGNAL, lambda signum, frame: None)  # the C handler still writes
        self._previous_fd = signal.set_wakeup_fd(write_end.fileno(), warn_on_full_buffer=False)  # the wakeup fd
        try:
            faulthandler.register(LIVE_DUMP_SIGNAL, file=sys.__stderr__, all_threads=True, chain=True)
        except (AttributeError, ValueError, OSError):  # no real stderr: the file alone
            pass
        self._wakeup = (read_end, write_end)
        threading.Thread(target=self._serve, args=(read_end,), name="gptpar-diagnostics", daemon=True).start()
        return self

    def close(self) -> None:
        """Undo `install` (the signal, the wakeup fd, the helper thread, which ends when its socket closes)."""
        if self._wakeup is None:
            return
        faulthandler.unregister(LIVE_DUMP_SIGNAL)
        signal.set_wakeup_fd(self._previous_fd)
        signal.signal(LIVE_DUMP_SIGNAL, self._previous)
        for end in reversed(self._wakeup):
            end.close()
        self._wakeup = None

    def _serve(self, read_end) -> None:
        while True:
            try:
                data = read_end.recv(64)
            except OSError:
                return
            if not data:
                return
            if LIVE_DUMP_SIGNAL in data:
                path = self.write(f"live dump on {LIVE_DUMP_SIGNAL.name}")
                sys.stderr.write(f"gptpar: rank {self.pstate.rank}: {LIVE_DUMP_SIGNAL.name}: stacks above; "
                                 f"diagnostics {'in ' + path if path else 'not written (no folder)'}\n")
                sys.stderr.flush()


__all__ = ["Diagnostics", "diagnostics_dir", "point_nccl_dump_at", "flight_recorder", "python_stacks",
           "DIAGNOSTICS", "NCCL_DUMP_PREFIX", "LIVE_DUMP_SIGNAL"]
