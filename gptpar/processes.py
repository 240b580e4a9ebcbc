"""Processes on this host, read from /proc: whether a recorded process is still the one that was recorded (a
lock's job, a conversion's owner, a rank's launcher). A pid is "alive" only if a process with that pid exists *and*
started at the recorded time, so a reused pid is not mistaken for the job."""
from __future__ import annotations

import os
from typing import Optional, Tuple


def proc_stat(pid: int) -> Optional[Tuple[str, int, int]]:
    """(state, ppid, start ticks) from /proc/PID/stat; None when there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def process_start_ticks(pid: int) -> Optional[int]:
    """When `pid` started (clock ticks since boot); None if unknown or no such process."""
    st = proc_stat(pid)
    return st[2] if st is not None else None


def pid_alive(pid: int, start_ticks: Optional[int] = None) -> bool:
    """A process `pid` exists (and started at `start_ticks`, when both are known)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    if start_ticks is not None:
        now = process_start_ticks(pid)
        if now is not None and now != start_ticks:
            return False  # the pid was reused by another process
    return True


__all__ = ["proc_stat", "process_start_ticks", "pid_alive"]
