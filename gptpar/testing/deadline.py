"""Test deadlines that hold on a busy machine.

A test's timeout is there to end a hang, not to time the code. Each one is written as the seconds the wait may take
on an idle machine of the suite's size (2 cores) with room to spare; on a shared machine (a second `make test`
beside this one, other jobs) the same work takes as many times longer as there are runnable processes per core.
So a deadline here counts idle-equivalent seconds: each second of waiting counts 1 / (the machine's load per core,
measured while waiting: the 1-minute load average over the cores this process may run on), at least 1 and at most
MAX_STRETCH. A real hang still ends (after at most MAX_STRETCH times the stated seconds). GPTPAR_TEST_TIMEOUT_SCALE
fixes the factor instead (e.g. 1 on an idle machine, to see a hang sooner).
"""
from __future__ import annotations

import os
import subprocess
import time

MAX_STRETCH = 8.0


def load_factor() -> float:
    """How many times slower than idle this machine runs now (1 .. MAX_STRETCH)."""
    fixed = os.environ.get("GPTPAR_TEST_TIMEOUT_SCALE")
    if fixed:
        return float(fixed)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    return min(MAX_STRETCH, max(1.0, load / max(1, cores)))


def stretched(seconds: float) -> float:
    """`seconds` (stated for an idle machine) for a single timeout argument, at the load measured now."""
    return seconds * load_factor()


class Deadline:
    """`seconds` of idle-equivalent waiting, the load re-measured at every `expired()` call."""

    def __init__(self, seconds: float):
        self.seconds, self.used, self.last = seconds, 0.0, time.monotonic()

    def expired(self) -> bool:
        now = time.monotonic()
        self.used += (now - self.last) / load_factor()
        self.last = now
        return self.used > self.seconds


def communicate(proc: subprocess.Popen, seconds: float, poll: float = 2.0) -> str:
    """`proc.communicate()`'s output within a Deadline of `seconds`; subprocess.TimeoutExpired past it (the
    process left running, as communicate leaves it)."""
    deadline = Deadline(seconds)
    while True:
        try:
            return proc.communicate(timeout=poll)[0]
        except subprocess.TimeoutExpired:
            if deadline.expired():
                raise subprocess.TimeoutExpired(proc.args, seconds) from None
