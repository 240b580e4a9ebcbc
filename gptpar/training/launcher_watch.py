"""Ranks die with their launcher: a rank whose launcher is gone exits at once, without saving; a rank whose
DeepSpeed runner is gone while DeepSpeed's launch.py lives saves first, then exits.

torchrun starts each rank in its own session, and DeepSpeed's runner starts launch.py which starts the ranks,
so `kill -9` of the launcher (or of its process group) leaves the ranks running: they keep training and
saving into checkpoint.save while the user may already have started the next job there. Each rank therefore
records, at start, the launcher processes above it and a daemon thread checks every `interval` seconds that
they still exist:

    torchrun              agent -> rank                 watches the agent (its parent)
    deepspeed             runner -> launch.py -> rank   watches launch.py (its parent) and the runner (its
                                                        grandparent)
    python / srun / tests (no launcher)                  watches nothing: a shell or a test harness dying
                                                         must not end a run started under nohup

What a rank does when one is gone:

    its parent (torchrun's agent, launch.py)     exit at once (exit 1), without saving: nothing above the rank
                                                 is left to stop it, and a save may race the next job
    the deepspeed runner, launch.py still alive  save after the current iteration, then exit 0 (as for SIGTERM);
                                                 if that has not happened within `save_seconds`
                                                 (parallel.distributed_timeout_minutes), exit 1 without saving.
                                                 Before training started (nothing to save) it exits at once.

Why the second: DeepSpeed's runner installs its signal handlers only for multi-node PDSH launches, so on
one node `kill PID` (SIGTERM) of the runner ends the runner alone while launch.py and the ranks go on; a rank
cannot tell that from `kill -9` of the runner. Either way launch.py still holds the ranks, nothing else writes
the save folder yet, and the user asked the job to stop: so the ranks save what they trained, as SIGTERM to
the ranks or to launch.py (which passes it on) makes them do.

prctl(PR_SET_PDEATHSIG) is not used: it covers only the direct parent (not DeepSpeed's runner), fires when
the parent *thread* that forked exits, and is Linux-only. A process counts as gone when it no longer
exists, is a zombie (a killed launcher whose own parent has not reaped it yet) or its pid was reused (its
start time differs); and the parent also when this rank was re-parented.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, List, Optional, Tuple

from gptpar.processes import proc_stat

TORCHRUN_MARKERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch", "torch/distributed/run.py")
DEEPSPEED_LAUNCH_MARKERS = ("deepspeed.launcher.launch", "deepspeed/launcher/launch.py")


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def launcher_chain(ppid: Optional[int] = None, environ=None) -> List[Tuple[int, int, str]]:
    """[(pid, start ticks, command)] of the launcher processes this rank must not outlive (see the docstring):
    its parent first, then (under DeepSpeed) the runner above launch.py."""
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
    """The daemon thread; `start()` returns at once, the thread ends the process when its parent launcher dies,
    or asks for a save and then ends it when a launcher above the parent (DeepSpeed's runner) dies."""

    def __init__(self, chain: List[Tuple[int, int, str]], interval: float = 0.5, label: str = "rank",
                 save_seconds: float = 1800.0):
        self.chain, self.interval, self.label, self.save_seconds = chain, interval, label, save_seconds
        self.parent = os.getppid()
        self.request_save: Optional[Callable[[str], None]] = None
        self.saving_since: Optional[float] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "LauncherWatch":
        if self.chain:
            self._thread = threading.Thread(target=self._run, name="gptpar-launcher-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def save_with(self, request_save: Callable[[str], None]) -> None:
        """From now on (training has started), a runner gone while the parent lives calls `request_save(reason)`
        (gptpar.training.trainer.StopSignals.request) instead of ending the process at once."""
        self.request_save = request_save

    def dead_launcher(self) -> Optional[Tuple[int, int, str]]:
        """The parent launcher, when it is gone (or this rank was re-parented)."""
        if self.chain and (os.getppid() != self.parent or gone(*self.chain[0][:2])):
            return self.chain[0]
        return None

    def dead_runner(self) -> Optional[Tuple[int, int, str]]:
        """A launcher above the parent (DeepSpeed's runner), when it is gone."""
        return next((entry for entry in self.chain[1:] if gone(entry[0], entry[1])), None)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            dead = self.dead_launcher()
            if dead is not None:
                self._exit(f"its launcher (pid {dead[0]}: {dead[2][:120]}) is gone; exiting without saving")
            if self.saving_since is None:
                runner = self.dead_runner()
                if runner is not None:
                    self._runner_gone(runner)
            elif time.monotonic() - self.saving_since > self.save_seconds:
                self._exit(f"the save asked for when its runner went away did not finish within "
                           f"{self.save_seconds:g} s (parallel.distributed_timeout_minutes); exiting without saving")

    def _runner_gone(self, runner: Tuple[int, int, str]) -> None:
        pid, _, command = runner
        what = (f"its launcher's runner (pid {pid}: {command[:120]}) is gone while launch.py (pid "
                f"{self.chain[0][0]}) lives")
        if self.request_save is None:
            self._exit(f"{what}; nothing trained yet: exiting without saving")
        self.saving_since = time.monotonic()
        self._say(f"{what}: saving after the current iteration, then exiting (within {self.save_seconds:g} s)")
        self.request_save(f"the deepspeed runner (pid {pid}) is gone (killed, or sent SIGTERM, which it does not "
                          "pass on when it runs on one node)")

    def _say(self, message: str) -> None:
        sys.stderr.write(f"pretrain_gpt.py: {self.label} {os.getpid()}: {message}\n")
        sys.stderr.flush()

    def _exit(self, message: str) -> None:
        self._say(message)
        os._exit(1)  # at once, from any state: no save, no collective, no atexit handlers


def watch_launcher(label: str = "rank", save_seconds: float = 1800.0) -> LauncherWatch:
    """Start watching the launcher of this process (nothing to watch without one)."""
    return LauncherWatch(launcher_chain(), label=label, save_seconds=save_seconds).start()


__all__ = ["LauncherWatch", "watch_launcher", "launcher_chain", "gone"]
