"""A build lock held by a process working in its folder (as ninja does) is named as a running build, with its pid
(gptpar.training.engine.comm_op.lock_notice; the stale-lock cases are in tests/unit/test_comm_op.py)."""
import os
import signal
import subprocess
import sys

from gptpar.training.engine import comm_op


def test_a_running_build_is_named_as_running(tmp_path):
    """A process working in the folder (as ninja does) is reported as a running build, not a stale lock."""
    folder = tmp_path / "op"
    folder.mkdir()
    (folder / "lock").write_text("")
    # Not a child of this process (whose own build is said differently): started through one that exits at once.
    start = ("import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
             "stdout=subprocess.DEVNULL).pid)")
    pid = int(subprocess.check_output([sys.executable, "-c", start], cwd=folder))
    try:
        line = comm_op.lock_notice(str(folder / "lock"))
    finally:
        os.kill(pid, signal.SIGKILL)
    assert f"pid {pid}" in line and "a build is running there" in line
