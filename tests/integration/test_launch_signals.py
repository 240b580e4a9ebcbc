"""Stopping a torchrun job from outside: SIGTERM or SIGINT (Ctrl-C) to `python -m gptpar.launch` saves and ends
quietly (143, 130), however long the save takes, within the shutdown grace gptpar.launch gives torchrun from the run
(gptpar.checkpoint.stop_grace); a save longer than the grace is killed and said so; a restart names the rank that
ended first by itself, not one the agent then stopped."""
import os
import signal
import subprocess
import sys
import time

import pytest

from gptpar import launch
from gptpar.checkpoint.layout import SAVE_TIMES, read_latest, tag_of
from gptpar.checkpoint.stop_grace import FLOOR_SECONDS, read_times
from gptpar.testing import FAULTS
from gptpar.testing.runs import ROOT, rank_env, write_config
from gptpar.testing.deadline import Deadline, stretched

SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}


def _launch_and_signal(tmp_path, sig, checkpoint=None, timeout=180, **faults):
    """Launch 2 ranks of the fault-injecting pretrain_gpt.py, send `sig` to the launcher once iteration 1 is logged,
    and return (exit code, all output, the save folder, seconds from the signal to the launcher's exit)."""
    ck = str(tmp_path / "ck")
    cfg = write_config(tmp_path / "c.json", training=dict(train_iters=100000),
                       checkpoint=dict(dict(save=ck), **(checkpoint or {})))
    proc = subprocess.Popen([sys.executable, "-m", "gptpar.launch", "--nproc_per_node", "2", FAULTS, "--config",
                             cfg], cwd=ROOT, env=rank_env(**faults), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen, deadline = [], Deadline(180)
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(" iteration        1/"):
            break
        assert not deadline.expired(), "".join(seen)
    proc.send_signal(sig)
    sent = time.monotonic()
    out = "".join(seen) + proc.communicate(timeout=stretched(timeout))[0]
    return proc.returncode, out, ck, time.monotonic() - sent


def _stopped_at(out):
    line = next(line for line in out.splitlines() if line.startswith("stopping at iteration "))
    return int(line.split()[3].rstrip(":"))


def _assert_saved_and_quiet(code, out, ck, name):
    assert code == 128 + SIGNALS[name], out
    for noise in ("Traceback", "KeyboardInterrupt", "SignalException"):
        assert noise not in out, out
    assert f"gptpar.launch: torchrun received {name} and passed it to the ranks, which save" in out, out
    assert f"received {name}" in out
    stopped = _stopped_at(out)
    assert read_latest(ck) == tag_of(stopped), out  # the iteration the ranks were in when the signal came
    assert os.path.isfile(os.path.join(ck, read_latest(ck), "config.json")), out
    assert read_times(ck)["iteration"] == stopped  # the save's duration recorded for the next start's grace


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_to_the_launcher_saves_and_ends_without_a_traceback(tmp_path, name):
    code, out, ck, _ = _launch_and_signal(tmp_path, SIGNALS[name])
    _assert_saved_and_quiet(code, out, ck, name)
    assert (f"gptpar.launch: on SIGTERM or SIGINT the ranks finish their iteration, save and exit; they get "
            f"{FLOOR_SECONDS} s (--shutdown-timeout from the default, no save measured in {ck} yet)") in out, out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_save_of_90_seconds_after_a_stop_signal_is_not_killed(tmp_path, name):
    """Rank 1 needs 90 s more for its save after the signal, three times torch's 30 s default grace."""
    code, out, ck, _ = _launch_and_signal(tmp_path, SIGNALS[name], timeout=400, GPTPAR_TEST_SLOW_STOP_SAVE="1:90")
    assert f"the save after {name} takes 90 s more" in out, out
    _assert_saved_and_quiet(code, out, ck, name)


def test_the_grace_comes_from_the_config_and_a_save_past_it_is_killed_and_said(tmp_path):
    """checkpoint.shutdown_grace_seconds = 5 reaches torchrun: rank 1's save, 60 s after SIGTERM, is killed 5 s
    after the signal, not at torch's default 30 s; the launcher says so, `latest` stays unset."""
    code, out, ck, seconds = _launch_and_signal(tmp_path, signal.SIGTERM, checkpoint=dict(shutdown_grace_seconds=5),
                                                GPTPAR_TEST_SLOW_STOP_SAVE="1:60")
    assert ("they get 5 s (--shutdown-timeout from checkpoint.shutdown_grace_seconds) before they are killed"
            in out), out
    assert code == 128 + signal.SIGTERM and "Traceback" not in out, out
    line = next(line for line in out.splitlines() if line.startswith("gptpar.launch: torchrun received SIGTERM"))
    assert "had not ended after the shutdown grace of 5 s and" in line and "killed (SIGKILL)" in line, out
    assert "1" in line.split(" had not ended")[0].split("rank")[-1], line
    assert read_latest(ck) is None and not os.path.exists(os.path.join(ck, SAVE_TIMES)), out
    assert seconds < 25, (seconds, out)  # torch's default grace would have ended it at 30 s


def test_a_given_shutdown_timeout_is_kept_and_the_measured_saves_set_the_default(tmp_path, monkeypatch):
    from torch.distributed.run import parse_args

    from gptpar.checkpoint import stop_grace

    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    ck = str(tmp_path / "ck")
    cfg = write_config(tmp_path / "c.json", checkpoint=dict(save=ck))
    assert launch.shutdown_grace(parse_args(["--shutdown-timeout", "7", "pretrain_gpt.py", "--config", cfg])) == \
        (None, "7 s (--shutdown-timeout, as given)")
    os.makedirs(ck)
    stop_grace.record(ck, 12, 150.0, 200.5)  # a 200B-sized iteration and save
    seconds, clause = launch.shutdown_grace(parse_args(["pretrain_gpt.py", "--config", cfg]))
    assert seconds == max(FLOOR_SECONDS, int(2 * (150.0 + 200.5) + 60 + 0.999)) == 761, clause
    assert "measured at iteration 12" in clause
    seconds, _ = launch.shutdown_grace(parse_args(["pretrain_gpt.py", "--config", cfg, "--set",
                                                   "checkpoint.shutdown_grace_seconds=42"]))
    assert seconds == 42
    assert launch.shutdown_grace(parse_args(["pretrain_gpt.py", "--config", str(tmp_path / "none.json")]))[0] is None


def test_the_restart_line_names_the_rank_that_ended_by_itself():
    """Two real worker processes under torch's process context: local rank 1 exits 1 at once, rank 0 runs on until
    the context stops it (SIGTERM, the same second). The likeliest cause is rank 1, not rank 0's SIGTERM."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    script = "import sys, time\nif sys.argv[1] == '1':\n    sys.exit(1)\ntime.sleep(60)\n"
    with launch.ended_alone():
        context = start_processes("worker", sys.executable, {i: ("-c", script, str(i)) for i in range(2)},
                                  {i: {} for i in range(2)}, DefaultLogsSpecs())
        result = None
        for _ in range(300):
            result = context.wait(0)
            if result is not None:
                break
            time.sleep(0.1)
    assert result is not None and result.is_failed()
    assert {rank: f.exitcode for rank, f in result.failures.items()} == {0: -signal.SIGTERM, 1: 1}
    rank, failure = launch.first_failure(result.failures)
    assert rank == 1 and launch.describe_exit(failure.exitcode) == "exit 1"
