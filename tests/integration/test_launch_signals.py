"""Stopping a torchrun job from outside: SIGTERM to `python -m gptpar.launch` (torchrun) saves and ends quietly."""
import os
import signal
import subprocess
import sys
import time

from gptpar.checkpoint.layout import read_latest
from gptpar.testing.runs import ROOT, write_config
from gptpar.testing.deadline import Deadline, stretched


def test_sigterm_to_the_launcher_saves_and_ends_without_a_traceback(tmp_path):
    ck = str(tmp_path / "ck")
    cfg = write_config(tmp_path / "c.json", training=dict(train_iters=100000), checkpoint=dict(save=ck))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "gptpar.launch", "--nproc_per_node", "2", "pretrain_gpt.py",
                             "--config", cfg], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    seen, deadline = [], Deadline(180)
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(" iteration        1/"):
            break
        assert not deadline.expired(), "".join(seen)
    proc.send_signal(signal.SIGTERM)
    out = "".join(seen) + proc.communicate(timeout=stretched(120))[0]
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "Traceback" not in out and "SignalException" not in out, out
    assert "gptpar.launch: torchrun received SIGTERM" in out and "received SIGTERM" in out
    assert read_latest(ck) is not None and os.path.isfile(os.path.join(ck, read_latest(ck), "config.json")), out
