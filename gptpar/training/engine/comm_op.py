"""DeepSpeed's CPU shared-memory communication op, built once and never waited on silently.

DeepSpeed JIT-builds the op (csrc/cpu/comm/shm*.cpp) through torch.utils.cpp_extension.load at its first
init_distributed on CPU. Each such load takes the folder's `lock` file (torch's FileBaton: an empty file, no owner
recorded) and runs ninja, even when the library is up to date. Two things went wrong with that:

- Rebuilds. ninja rebuilds whenever a command line changes, and the command holds the absolute paths of the
  sources and of torch's headers, taken from where Python imported DeepSpeed and torch. The same venv reached by
  two paths (a symlink, a logical vs a physical working directory: `make` and a shell's `.venv/bin/...`) writes two
  commands with identical flags, and each start from the other path rebuilds the op (a minute on 2 cores), each
  time a new chance for a killed build to leave its lock behind.
- Silent waits. A start after a killed build waits in FileBaton.wait on the stale lock forever, saying nothing.

So: after DeepSpeed has built and loaded the op once, gptpar writes a stamp next to the library (what it was built
from: Python, torch, the op's sources and headers, by content, and the library's size and time). A later start
whose stamp matches imports the library directly (no lock, no ninja, whatever path it came by); only a missing or
stale stamp goes through DeepSpeed's build, and while that waits on the lock, a line says which file it is, whether
a process is building in that folder and how to clear it, within seconds and then every minute.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import threading
import time
from typing import Callable, List, Optional, Tuple

STAMP = "gptpar_op_stamp.json"
FIRST_NOTICE_S = 5.0     # a build that starts takes the lock at once: 5 s of a held lock is a wait
NOTICE_EVERY_S = 60.0


def build_dir(name: str) -> str:
    """The folder torch builds the op `name` in (TORCH_EXTENSIONS_DIR/<name>, or torch's default root)."""
    from torch.utils.cpp_extension import _get_build_directory  # torch's own choice, so the two never differ

    return _get_build_directory(name, verbose=False)


def op_files(builder) -> List[str]:
    """The op's sources and the headers under its include folders: what its library is compiled from."""
    files = [os.path.realpath(builder.deepspeed_src_path(p)) for p in builder.sources()]
    for inc in builder.include_paths():
        root = os.path.realpath(builder.deepspeed_src_path(inc))
        for folder, _, names in sorted(os.walk(root)):
            files += [os.path.join(folder, n) for n in sorted(names)]
    return files


def build_key(builder) -> str:
    """What the library depends on, independent of the path Python took to reach it: the interpreter, torch's
    version and real folder, the op's name and flags, and its sources' and headers' bytes."""
    import torch

    h = hashlib.sha256()
    for part in (sys.version, torch.__version__, os.path.realpath(os.path.dirname(torch.__file__)), builder.name,
                 " ".join(builder.cxx_args())):
        h.update(part.encode() + b"\0")
    for path in op_files(builder):
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + f.read())
    return h.hexdigest()


def library_path(folder: str, name: str) -> str:
    return os.path.join(folder, f"{name}.so")


def read_stamp(folder: str) -> Optional[dict]:
    try:
        with open(os.path.join(folder, STAMP)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_stamp(folder: str, name: str, key: str) -> None:
    """Record that `folder`'s library, as it is now, was built from `key` (atomically: ranks write it together)."""
    st = os.stat(library_path(folder, name))
    tmp = os.path.join(folder, f".{STAMP}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump({"key": key, "size": st.st_size, "mtime_ns": st.st_mtime_ns}, f)
    os.replace(tmp, os.path.join(folder, STAMP))


def stamped(folder: str, name: str, key: str) -> bool:
    """Whether the library in `folder` is the one a gptpar start built and stamped from `key` (unchanged since)."""
    stamp = read_stamp(folder)
    try:
        st = os.stat(library_path(folder, name))
    except OSError:
        return False
    return stamp == {"key": key, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def import_library(folder: str, name: str):
    """The extension module `name` from `folder`'s library, as torch imports a JIT-built one."""
    spec = importlib.util.spec_from_file_location(name, library_path(folder, name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def builders_in(folder: str) -> List[Tuple[int, str]]:
    """(pid, command name) of this machine's processes working in `folder`: ninja and the compiler it runs work
    there (torch starts ninja with that working directory). Processes this user cannot inspect are not seen."""
    target, found = os.path.realpath(folder), []
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            if os.path.realpath(os.readlink(f"/proc/{pid}/cwd")) == target:
                with open(f"/proc/{pid}/comm") as f:
                    found.append((int(pid), f.read().strip()))
        except OSError:
            continue
    return found


def parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def started_here(pid: int) -> bool:
    """Whether `pid` descends from this process (the ninja this process's own build runs)."""
    while pid > 1:
        pid = parent_of(pid)
        if pid == os.getpid():
            return True
    return False


def lock_notice(lock: str) -> Optional[str]:
    """One line about the build lock `lock`: its age, whether a process is building, how to clear it; None
    where the build is this process's own."""
    try:
        age = f"{time.time() - os.stat(lock).st_mtime:.0f} s old"
    except OSError:
        age = "just released"
    who = builders_in(os.path.dirname(lock))
    if any(started_here(p) for p, _ in who):
        return None
    if who:
        state = ("a build is running there (" + ", ".join(f"pid {p} {c}" for p, c in who[:3])
                 + "); it takes about a minute on 2 cores")
    else:
        state = (f"no process on this machine is building there: a build was killed and left it. Remove it "
                 f"(rm {lock}) and the start goes on")
    return f"gptpar: DeepSpeed's CPU communication op: waiting on the build lock {lock} ({age}); {state}"


class LockWatch:
    """While DeepSpeed's load runs, say so on stderr when it waits on the build lock: after `first` seconds,
    then every `every` seconds, as long as the lock is there."""

    def __init__(self, lock: str, first: float = FIRST_NOTICE_S, every: float = NOTICE_EVERY_S,
                 say: Callable[[str], None] = None):
        self.lock, self.first, self.every = lock, first, every
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.watch, name="gptpar-op-lock-watch", daemon=True)

    def watch(self) -> None:
        wait, building = self.first, False
        while not self.done.wait(wait):
            wait = self.every
            if not os.path.exists(self.lock):
                continue
            line = lock_notice(self.lock)
            if line is None and not building:  # this process builds: said once
                building = True
                line = (f"gptpar: building DeepSpeed's CPU communication op in {os.path.dirname(self.lock)} "
                        "(once per venv; about a minute on 2 cores)")
            if line:
                self.say(line)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


def wait_for_release(lock: str, poll_s: float = 0.1) -> None:
    """Wait until `lock` is gone, as torch's FileBaton.wait does. Waiting here, before DeepSpeed's load, rather than
    inside it: a load that waited on a killed build's lock would then import a library that was never built."""
    while os.path.exists(lock):
        time.sleep(poll_s)


def load(builder, loaded: dict, *, first_notice: float = FIRST_NOTICE_S, say: Callable[[str], None] = None):
    """The op of `builder` (a DeepSpeed OpBuilder), also put in `loaded` (DeepSpeed's cache of loaded ops, which
    its own later `builder.load()` returns from). A library stamped by an earlier start is imported as it is (a
    stale lock beside it is named, by local rank 0, not waited on); otherwise DeepSpeed builds or loads it under a LockWatch and
    the result is stamped."""
    folder = build_dir(builder.name)
    lock, key = os.path.join(folder, "lock"), build_key(builder)
    if stamped(folder, builder.name, key):
        module = import_library(folder, builder.name)
        if os.path.exists(lock) and os.environ.get("LOCAL_RANK", "0") == "0" and not builders_in(folder):
            (say or (lambda line: print(line, file=sys.stderr, flush=True)))(
                f"gptpar: note: {lock} is a stale build lock (no process is building there); the op was loaded "
                f"without it. Remove it (rm {lock}): a start that rebuilds the op would wait on it")
    else:
        with LockWatch(lock, first=first_notice, say=say):
            wait_for_release(lock)  # then DeepSpeed's load builds what a killed build left unbuilt
            module = builder.load(verbose=False)
        if os.path.exists(library_path(folder, builder.name)):
            write_stamp(folder, builder.name, key)
    loaded[builder.name] = module
    return module
