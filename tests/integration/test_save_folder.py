"""The save folder's lock and the launcher watch, on real processes (no training): who counts as alive,
what a failed lock write leaves behind, which processes a rank watches."""
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from gptpar.checkpoint import save_folder
from gptpar.processes import proc_stat
from gptpar.training.launcher_watch import gone, launcher_chain
from gptpar.checkpoint.save_folder import JobLock, SaveFolderError, lock_state

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")


def _sleeper(*marker):
    """A process whose command line carries `marker` (as a launcher's would), once it has exec'd."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"] + list(marker))
    for _ in range(200):  # until then /proc shows the forked copy of this process
        with open(f"/proc/{p.pid}/cmdline", "rb") as f:
            if b"time.sleep(60)" in f.read():
                return p
        time.sleep(0.05)
    raise AssertionError("the sleeper did not start")


def test_live_dead_and_reused_pids():
    p = _sleeper()
    ticks = proc_stat(p.pid)[2]
    here = socket.gethostname()
    try:
        assert lock_state({"pid": p.pid, "host": here, "start_ticks": ticks}) == "alive"
        assert lock_state({"pid": p.pid, "host": here, "start_ticks": ticks + 1}) == "dead"  # pid reused
        assert lock_state({"pid": p.pid, "host": "elsewhere", "start_ticks": ticks}) == "unknown"
    finally:
        p.kill()
        p.wait()
    assert lock_state({"pid": p.pid, "host": here, "start_ticks": ticks}) == "dead"


def test_lock_is_taken_released_and_refused(tmp_path):
    folder = str(tmp_path / "ck")
    first, second = JobLock(folder), JobLock(folder)
    first.acquire(override=False, log=print)
    with open(os.path.join(folder, ".gptpar.lock")) as f:
        assert json.load(f)["pid"] == os.getpid()
    # The same process counts as an earlier run of it (a harness), so fake another live holder.
    p = _sleeper()
    try:
        with open(os.path.join(folder, ".gptpar.lock"), "w") as f:
            json.dump({"pid": p.pid, "host": socket.gethostname(), "start_ticks": proc_stat(p.pid)[2]}, f)
        with pytest.raises(SaveFolderError, match=f"another job is writing checkpoints to {folder}: pid {p.pid}"):
            second.acquire(override=True, log=print)  # the override never applies to a live job here
    finally:
        p.kill()
        p.wait()
    said = []
    second.acquire(override=False, log=said.append)
    assert said and said[0].startswith("warning: taking over the lock")
    first.release()  # not first's any more: must not delete second's lock
    assert os.path.exists(os.path.join(folder, ".gptpar.lock"))
    second.release()
    assert os.listdir(folder) == []


def test_a_lock_that_cannot_be_written_leaves_nothing(tmp_path, monkeypatch):
    def full_disk(path, obj):
        open(path, "w").close()  # the inode was created, the data did not fit
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(save_folder, "_write_json", full_disk)
    folder = str(tmp_path / "ck")
    with pytest.raises(SaveFolderError, match="writing .*.gptpar.lock failed .*No space left on device"):
        JobLock(folder).acquire(override=False, log=print)
    assert os.listdir(folder) == []  # no half-written lock to block the next run


@pytest.mark.parametrize("marker,watched", [("torch.distributed.run", 1), ("deepspeed.launcher.launch", 2), ("", 0)])
def test_which_launchers_a_rank_watches(marker, watched):
    p = _sleeper(marker) if marker else _sleeper()
    try:
        chain = launcher_chain(ppid=p.pid, environ={})
        assert [pid for pid, _, _ in chain] == [p.pid, os.getpid()][:watched]
        if watched:
            assert not gone(p.pid, chain[0][1])
            os.kill(p.pid, signal.SIGKILL)
            for _ in range(100):  # not reaped yet: a zombie counts as gone
                if proc_stat(p.pid)[0] == "Z":
                    break
                time.sleep(0.05)
            assert gone(p.pid, chain[0][1])
    finally:
        p.kill()
        p.wait()
    assert launcher_chain(ppid=p.pid, environ={}) == []  # no such process any more
