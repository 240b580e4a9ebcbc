"""This rank's recent collectives and the time it spent blocked in them: `CollectiveLog`, a thin layer gptpar puts
around torch.distributed's collective functions (gptpar's own calls and DeepSpeed's, which go through the same
module attributes).

It keeps two things the flight recorder (which gptpar also turns on, gptpar.parallel) does not give:

    a ring of the last `size` calls     operation, the group (its name and global ranks), this rank's sequence
                                        number in that group, the first tensor's size and dtype, the caller outside torch and
                                        DeepSpeed (file:line function), and its state (entered, returned, or
                                        failed with an exception's type). The diagnostics
                                        written when a collective fails (gptpar.training.diagnostics) carry it, and
                                        tools/diagnose_hang.py reads it: the group's ranks and the caller are what
                                        the recorder's gloo entries lack.
    the time blocked in collectives     while a clock runs (`rank_clock()`, lapped at the end of each iteration):
                                        on the host, the seconds spent inside the calls on CPU tensors (gloo
                                        runs them in the calling thread's wait); on a CUDA device, a pair of
                                        events on the current stream around each call, whose gap is the time
                                        that stream waited for the collective (NCCL's kernel waits for the
                                        slowest peer). A rank's own time per iteration is the lap less these
                                        waits (gptpar.training.straggler).

Calls traced by torch.compile go straight to torch (the compiled graph holds its own collectives). Install it before
DeepSpeed builds its communication backend, which keeps references to some of these functions.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import sys
import threading
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

WRAPPED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
           "broadcast", "reduce", "barrier", "all_to_all_single", "all_to_all", "send", "recv", "gather", "scatter",
           "all_gather_object", "broadcast_object_list", "gather_object", "all_reduce_coalesced", "_all_gather_base",
           "_reduce_scatter_base")
_SKIPPED_FILES = (os.sep + "torch" + os.sep, os.sep + "deepspeed" + os.sep, __file__)


class CollectiveLog:
    """The ring and the blocked-time clock of one process (see the module docstring)."""

    def __init__(self, size: int = 256):
        self.ring = collections.deque(maxlen=size)
        self.group_seq: Dict[str, int] = collections.defaultdict(int)  # per process group (its name)
        self.calls = 0
        self._groups: Dict[int, tuple] = {}
        self._lock = threading.Lock()
        self._originals: Dict[str, object] = {}
        self._clock: Optional[RankClock] = None

    def install(self) -> "CollectiveLog":
        for name in WRAPPED:
            fn = getattr(dist, name, None)
            if fn is not None and not getattr(fn, "_gptpar_wrapped", False):
                self._originals[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        return self

    def uninstall(self) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()

    def rank_clock(self, device: torch.device) -> "RankClock":
        """A clock of this rank's own time per iteration (RankClock), not yet started."""
        return RankClock(self, device)

    def entries(self) -> List[dict]:
        """The ring, oldest first (copies, safe to serialise from another thread)."""
        with self._lock:
            return [dict(e) for e in self.ring]

    def _wrap(self, name: str, fn):
        @functools.wraps(fn)
        def collective(*args, **kwargs):
            if torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            entry, cuda = self._enter(name, args, kwargs)
            clock = self._clock
            if clock is not None and clock.thread != threading.get_ident():  # another thread's (a writer's) waits
                clock = None
            if clock is not None and cuda is not None:
                before = clock.cuda_event(cuda)
            start = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
                entry["state"] = "returned"
            except BaseException as e:
                entry["state"] = f"failed: {type(e).__name__}"
                raise
            finally:
                if clock is not None:
                    if cuda is not None:
                        clock.cuda_waits.append((before, clock.cuda_event(cuda)))
                    else:
                        clock.blocked += time.perf_counter() - start
            return result

        collective._gptpar_wrapped = True
        return collective

    def _enter(self, name: str, args, kwargs):
        group = kwargs.get("group")
        if group is None:
            group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        key, ranks = self._group_of(group or dist.GroupMember.WORLD)
        tensor = next(_tensors(args, kwargs), None)
        with self._lock:
            self.calls += 1
            self.group_seq[key] += 1
            entry = {"call": self.calls, "op": name, "group": key, "group_ranks": ranks,
                     "group_seq": self.group_seq[key], "size": None if tensor is None else list(tensor.shape),
                     "dtype": None if tensor is None else str(tensor.dtype), "caller": _caller(), "time": time.time(),
                     "state": "entered"}
            self.ring.append(entry)
        return entry, (tensor.device if tensor is not None and tensor.is_cuda else None)

    def _group_of(self, group) -> tuple:
        """(name, global ranks) of a process group, looked up once per group."""
        known = self._groups.get(id(group))
        if known is None or known[0] is not group:
            try:
                ranks = list(dist.get_process_group_ranks(group))
            except (RuntimeError, ValueError, AttributeError):
                ranks = []
            known = self._groups[id(group)] = (group, getattr(group, "group_name", None) or str(ranks), ranks)
        return known[1], known[2]


class RankClock:
    """A rank's own time per iteration, in laps from one iteration's end to the next's (`start`, then `lap()` at
    each end): everything the rank does in between (drawing its data, the step, the loop's host work) less the
    time it waited inside collectives, and less the blocks it was paused for (`with clock.paused():`, evaluation
    and saves). On the host the lap is wall time; on a CUDA device, the stream's time between events recorded at
    the lap's ends, less each collective's event pair, each pause's, and the host's waits in host collectives
    (the stream idles while its host waits for the others). No event is waited for: `Lap.ready()` queries."""

    def __init__(self, log: CollectiveLog, device: torch.device):
        self.log, self.device = log, device
        self.cuda = device.type == "cuda"
        self.running = False
        self.thread = threading.get_ident()  # the loop's thread: only its collectives are its waits

    def start(self) -> None:
        self.thread = threading.get_ident()
        self._begin(self.cuda_event(self.device) if self.cuda else None)
        self.running = True

    def stop(self) -> None:
        """No more laps: later collectives are no one's waits."""
        if self.log._clock is self:
            self.log._clock = None
        self.running = False

    def _begin(self, event) -> None:
        self._t0, self._event, self.paused_s = time.perf_counter(), event, 0.0
        self.blocked = 0.0
        self.cuda_waits: list = []
        self.log._clock = self

    def lap(self) -> "Lap":
        """Close this lap (its end is the next one's start) and return it."""
        end = self.cuda_event(self.device) if self.cuda else None
        lap = Lap(time.perf_counter() - self._t0 - self.paused_s, self.blocked, self._event, end, self.cuda_waits)
        self._begin(end)
        return lap

    @contextlib.contextmanager
    def paused(self):
        """Leave the block out of the lap, its collectives' waits included."""
        if not self.running or self.log._clock is not self:  # not started, or paused already
            yield
            return
        self.log._clock = None
        t0, before = time.perf_counter(), self.cuda_event(self.device) if self.cuda else None
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - t0
            if before is not None:
                self.cuda_waits.append((before, self.cuda_event(self.device)))
            self.log._clock = self

    @staticmethod
    def cuda_event(device):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event


@dataclasses.dataclass
class Lap:
    """One iteration of a RankClock: its host seconds (pauses left out), the host's seconds in collectives, and on
    CUDA its end events and the (before, after) event pairs to subtract."""

    wall: float
    blocked: float
    start: object = None
    end: object = None
    waits: list = dataclasses.field(default_factory=list)

    def ready(self) -> bool:
        """Whether `own_seconds` can be read without waiting: the device has passed the lap's end event (a
        query, never a synchronize)."""
        return self.end is None or self.end.query()

    def own_seconds(self) -> float:
        """The lap less its waits (see RankClock); on CUDA only once `ready()`."""
        if self.start is None:
            return max(0.0, self.wall - self.blocked)
        waited = sum(a.elapsed_time(b) for a, b in self.waits) / 1e3
        return max(0.0, self.start.elapsed_time(self.end) / 1e3 - waited - self.blocked)


def _tensors(args, kwargs):
    for value in list(args) + list(kwargs.values()):
        if torch.is_tensor(value):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if torch.is_tensor(v))


_SKIPPED_CODE: Dict[object, bool] = {}  # code object -> whether it lives in torch, DeepSpeed or this module


def _caller() -> str:
    """The first frame outside torch, DeepSpeed and this module: `file:line function`."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        skip = _SKIPPED_CODE.get(code)
        if skip is None:
            skip = _SKIPPED_CODE[code] = any(part in code.co_filename for part in _SKIPPED_FILES)
        if not skip:
            return f"{code.co_filename}:{frame.f_lineno} {code.co_name}"
        frame = frame.f_back
    return "?"


__all__ = ["CollectiveLog", "Lap", "RankClock", "WRAPPED"]
