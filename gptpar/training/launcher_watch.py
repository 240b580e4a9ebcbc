"""Ranks die with their launcher: a rank whose launcher is gone exits at once, without saving.

torchrun starts each rank in its own session, and DeepSpeed's runner starts launch.py which starts the ranks,
so `kill -9` of the launcher (or of its process group) leaves the ranks running: they keep training and
saving into checkpoint.save while the user may already have started the next job there. Each rank therefore
records, at start, the launcher processes above it and a daemon thread checks every `interval` seconds that
they still exist:

    torchrun              agent -> rank                 watches the agent (its parent)
    deepspeed             runner -> launch.py -> rank   watches launch.py and the runner (its grandparent)
    python / srun / tests (no launcher)                  watches nothing: a shell or a test harness dying
                                                         must not end a run started under nohup

prctl(PR_SET_PDEATHSIG) is not used: it covers only the direct parent (not DeepSpeed's runner), fires when
the parent *thread* that forked exits, and is Linux-only. A process counts as gone when it no longer
exists, is a zombie (a killed launcher whose own parent has not reaped it yet) or its pid was reused (its
start time differs); and the parent also when this rank was re-parented.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import List, Optional, Tuple

TORCHRUN_MARKERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch", "torch/distributed/run.py")
DEEPSPEED_LAUNCH_MARKERS = ("deepspeed.launcher.launch", "deepspeed/launcher/launch.py")


def proc_stat(pid: int) -> Optional[Tuple[str, int, int]]:
    """(state, ppid, start ticks) from /proc/PID/stat; None when there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def launcher_chain(ppid: Optional[int] = None, environ=None) -> List[Tuple[int, int, str]]:
    """[(pid, start ticks, command)] of the launcher processes this rank must not outlive (see the docstring)."""
    environ = os.environ if environ is None else environ
    ppid = os.getppid() if ppid is None else ppid
    parent, command = proc_stat(ppid), _cmdline(ppid)
    if parent is None:
        return []
    chain = [(ppid, parent[2], command)]
    if any(m in command for m in DEEPSPEED_LAUNCH_MARKERS):
        grand = proc_stat(parent[1])
        if grand is not None and parent[1] > 1:
            chain.append((parent[1], grand[2], _cmdline(parent[1])))
        return chain
    if any(m in command for m in TORCHRUN_MARKERS) or "TORCHELASTIC_RUN_ID" in environ:
        return chain
    return []


def gone(pid: int, start_ticks: int) -> bool:
    st = proc_stat(pid)
    return st is None or st[0] in ("Z", "X") or st[2] != start_ticks


class LauncherWatch:
    """The daemon thread; `start()` returns at once, the thread ends the process if a launcher dies."""

    def __init__(self, chain: List[Tuple[int, int, str]], interval: float = 0.5, label: str = "rank"):
        self.chain, self.interval, self.label = chain, interval, label
        self.parent = os.getppid()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "LauncherWatch":
        if self.chain:
            self._thread = threading.Thread(target=self._run, name="gptpar-launcher-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def dead_launcher(self) -> Optional[Tuple[int, int, str]]:
        if self.chain and os.getppid() != self.parent:
            return self.chain[0]
        return next((entry for entry in self.chain if gone(entry[0], entry[1])), None)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            dead = self.dead_launcher()
            if dead is not None:
                pid, _, command = dead
                sys.stderr.write(f"pretrain_gpt.py: {self.label} {os.getpid()}: its launcher (pid {pid}: "
                                 f"{command[:120]}) is gone; exiting without saving\n")
                sys.stderr.flush()
                os._exit(1)  # at once, from any state: no save, no collective, no atexit handlers


def watch_launcher(label: str = "rank") -> LauncherWatch:
    """Start watching the launcher of this process (nothing to watch without one)."""
    return LauncherWatch(launcher_chain(), label=label).start()


__all__ = ["LauncherWatch", "watch_launcher", "launcher_chain", "gone", "proc_stat"]
