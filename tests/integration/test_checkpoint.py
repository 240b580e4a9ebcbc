"""Checkpoint safety and exits, with real processes: SIGTERM -> save + exit 0 (all ranks agree), a save killed
with SIGKILL half-way leaves `latest` on the previous checkpoint, a stalled rank ends the run with a timeout
error, and the DeepSpeed CLI launch path. Exact resume is in test_trainer.py.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from gptpar.testing import free_port
from gptpar.checkpoint.durable import publish_latest
from gptpar.checkpoint.layout import read_latest, tag_of
from gptpar.training.reporting import parse_log_line
from gptpar.training.trainer import StopSignals
from gptpar.testing.runs import ROOT, finish_ranks as _finish, launch_ranks as _launch, log_lines, rank_env as _env, write_config

SCRIPT = os.path.join(ROOT, "pretrain_gpt.py")
from gptpar.testing import FAULTS  # pretrain_gpt.py with a fault injected
from gptpar.testing.deadline import Deadline, stretched


def test_latest_pointer_is_replaced_atomically(tmp_path):
    publish_latest(str(tmp_path), tag_of(3))
    publish_latest(str(tmp_path), tag_of(6))
    assert read_latest(str(tmp_path)) == "iter_0000006"
    assert os.listdir(tmp_path) == ["latest"]  # no temporary left behind
    assert read_latest(str(tmp_path / "missing")) is None


def test_sigusr1_sets_the_stop_flag():
    stop = StopSignals()
    previous = signal.getsignal(signal.SIGUSR1)
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = Deadline(10)  # the handler runs at the next bytecode boundary; poll, no fixed margin
        while stop.received is None and not deadline.expired():
            time.sleep(0.01)
        assert stop.received == signal.SIGUSR1
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGUSR1) is previous


@pytest.mark.slow  # too slow for make test's budget: in make test-slow
def test_sigterm_to_one_rank_saves_and_every_rank_exits_zero(tmp_path):
    ck = str(tmp_path / "ck")
    cfg = write_config(tmp_path / "c.json", training=dict(train_iters=100000), checkpoint=dict(save=ck, load=ck))
    procs = _launch(2, ["--config", cfg])
    seen = []
    deadline = Deadline(120)
    for line in procs[0].stdout:  # rank 0 prints the log line (dp=2)
        seen.append(line)
        if line.startswith(" iteration        2/"):
            break
        assert not deadline.expired(), "".join(seen)
    procs[1].send_signal(signal.SIGTERM)  # only rank 1: the all-reduce of the flag must stop rank 0 too
    codes, outs = _finish(procs)
    out0 = "".join(seen) + outs[0]
    assert codes == [0, 0], out0 + outs[1]
    assert "received SIGTERM" in out0
    tag = read_latest(ck)
    stopped = int(tag.split("_")[1])
    assert stopped >= 2 and os.path.isfile(os.path.join(ck, tag, "gptpar_rank_00001.pt"))

    # Loadable: the next run resumes from it and trains one more iteration.
    codes, outs = _finish(_launch(2, ["--config", cfg, "--set", f"training.train_iters={stopped + 1}"]))
    assert codes == [0, 0], outs[0] + outs[1]
    assert f"resumed from {os.path.join(ck, tag)}" in outs[0]
    assert [parse_log_line(line)["iteration"] for line in log_lines(outs[0])] == [stopped + 1]


def test_save_killed_half_way_leaves_latest_on_the_previous_checkpoint(tmp_path):
    ck = str(tmp_path / "ck")
    cfg = write_config(tmp_path / "c.json", parallel=dict(data_parallel_size=1),  # a blocking save (async:
                       checkpoint=dict(save=ck, load=ck, save_interval=2, async_save=False))  # test_async_checkpoint)
    codes, outs = _finish(_launch(1, ["--config", cfg], FAULTS, GPTPAR_TEST_KILL_IN_SAVE="4"))
    assert codes == [-signal.SIGKILL], outs[0]
    assert read_latest(ck) == "iter_0000002"
    assert not os.path.exists(os.path.join(ck, "iter_0000004"))  # written under a temporary name, never renamed
    (staged,) = [name for name in os.listdir(ck) if name.startswith("iter_0000004.tmp-")]
    partial = os.listdir(os.path.join(ck, staged))  # DeepSpeed's files, not gptpar's
    assert partial and "gptpar_rank_00000.pt" not in partial

    codes, outs = _finish(_launch(1, ["--config", cfg]))
    assert codes == [0], outs[0]
    assert f"removing partial checkpoint {os.path.join(ck, staged)}" in outs[0]
    assert f"resumed from {os.path.join(ck, 'iter_0000002')}" in outs[0]
    assert read_latest(ck) == "iter_0000006" and not os.path.exists(os.path.join(ck, staged))


def _until_iteration(proc, iteration, seen):
    """Read `proc`'s lines into `seen` until its log line of `iteration` (rank 0 prints them at dp = 2)."""
    deadline = Deadline(240)
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(f" iteration {iteration:8d}/"):
            return
        assert not deadline.expired(), "".join(seen)
    raise AssertionError("".join(seen))


def test_stopped_rank_ends_the_run_with_one_line_naming_the_timeout(tmp_path):
    """Rank 1 stopped with SIGSTOP after iteration 2: rank 0 waits in the next collective for
    parallel.distributed_timeout_minutes, then ends with one line naming it (exit 1), no traceback."""
    cfg = write_config(tmp_path / "c.json", training=dict(train_iters=100000),
                       parallel=dict(distributed_timeout_minutes=0.2))  # 12 s
    procs = _launch(2, ["--config", cfg])
    seen = []
    try:
        _until_iteration(procs[0], 2, seen)
        procs[1].send_signal(signal.SIGSTOP)
        out0 = "".join(seen) + procs[0].communicate(timeout=stretched(150))[0]
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert procs[0].returncode == 1, out0[-3000:]
    assert "pretrain_gpt.py: rank 0: a collective waited past parallel.distributed_timeout_minutes = 0.2 (12 s) " \
           "for another rank, which stopped answering" in out0, out0[-3000:]
    assert "Traceback" not in out0, out0[-3000:]


def _wait_for_a_slow_rank0(store_path):
    """On each of 2 harness ranks: a process group with a 1 s timeout, then wait_for_rank0 while rank 0 works
    4 s. Returns (what every rank got, seconds waited)."""
    import datetime
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from gptpar.training.preflight import wait_for_rank0

    rank = dist.get_rank()
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=1))
    start = time.monotonic()
    got = wait_for_rank0(lambda: time.sleep(4) or "rank 0's verdict",
                         SimpleNamespace(rank=rank, device=torch.device("cpu")), poll_seconds=0.25)
    return got, time.monotonic() - start


def test_the_preflight_wait_outlasts_the_collective_timeout(tmp_path):
    """The preflight's polled barrier: rank 1 waits 4 s for rank 0 under a 1 s collective timeout and gets its
    verdict (one short collective per poll; one wait for the whole work would time out)."""
    from gptpar.testing import run_distributed

    results = run_distributed(_wait_for_a_slow_rank0, 2, (str(tmp_path / "store"),), timeout=120)
    assert [got for got, _ in results] == ["rank 0's verdict"] * 2
    # Each rank waited well past the 1 s collective timeout. Not ">= 4": rank 1 starts its clock when it leaves the
    # process group's rendezvous, which on a loaded machine can be a moment after rank 0 began its 4 s of work.
    assert all(waited >= 2 for _, waited in results), results


@pytest.mark.slow
def test_a_conversion_longer_than_the_collective_timeout(tmp_path):
    """Both ranks convert a checkpoint to its universal form in the preflight, each its share: slowed to 20 s
    under a 12 s collective timeout, the polled waits outlast it and the reshaped run trains (slow:
    test_the_preflight_wait_outlasts_the_collective_timeout is the quick check)."""
    ck = str(tmp_path / "ck")
    cfg = write_config(tmp_path / "c.json", parallel=dict(data_parallel_size=None, distributed_timeout_minutes=0.2),
                       training=dict(train_iters=2, lr_warmup_iters=1), checkpoint=dict(save=ck, load=ck))
    codes, outs = _finish(_launch(1, ["--config", cfg]))  # saved at dp = 1
    assert codes == [0], outs[0][-3000:]
    codes, outs = _finish(_launch(2, ["--config", cfg, "--set", "training.train_iters=3"], FAULTS,
                                  GPTPAR_TEST_SLOW_CONVERSION="20"), timeout=300)
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert f"reshaping checkpoint {ck}/iter_0000002 from (tp,pp,dp) (1, 1, 1) to (1, 1, 2): converted" in outs[0]
    assert [parse_log_line(line)["iteration"] for line in log_lines(outs[0])] == [3]


def test_deepspeed_launcher_cli(tmp_path):
    """The README's path: `deepspeed --num_gpus 2 pretrain_gpt.py --config configs/cpu_dp2.json` on CPU."""
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2",
           "--master_port", str(free_port()), "pretrain_gpt.py", "--config", "configs/cpu_dp2.json",
           "--set", "training.train_iters=3", "--set", "training.eval_interval=null"]
    if not os.path.exists(cmd[0]):
        pytest.skip("deepspeed CLI not installed next to this python")
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=stretched(180))
    assert p.returncode == 0, p.stdout[-3000:]
    lines = log_lines(p.stdout)
    assert [(parse_log_line(line)["iteration"], parse_log_line(line)["train_iters"]) for line in lines] == \
        [(1, 3), (2, 3), (3, 3)]
    with open(os.path.join(ROOT, "configs", "cpu_dp2.json")) as f:
        gbs = json.load(f)["training"]["global_batch_size"]
    assert f"consumed samples: {3 * gbs:12d} |" in lines[-1]


# -- ranks die with their launcher; one job per save folder -------------------------------------------

def _start_launcher(cmd, first_line=" iteration "):
    """Start a launcher in its own session and wait for `first_line` in its output (read by a thread, so
    that the ranks never block on a full pipe). Returns (process, lines)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    deadline = Deadline(240)
    while not any(line.startswith(first_line) for line in list(lines)):
        assert proc.poll() is None and not deadline.expired(), "".join(lines)[-3000:]
        time.sleep(0.2)
    return proc, lines


def _ranks(launcher_pid):
    """The pretrain_gpt.py processes under a launcher (any depth)."""
    import psutil

    return [p for p in psutil.Process(launcher_pid).children(recursive=True)
            if any(a.endswith("pretrain_gpt.py") for a in p.cmdline())
            and "deepspeed.launcher.launch" not in p.cmdline()]


def _wait_gone(procs, seconds):
    """True once none of `procs` runs (exited or a zombie), polling for up to `seconds`."""
    import psutil

    deadline = Deadline(seconds)
    while not deadline.expired():
        alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.2)
    for p in procs:  # do not leave them running after a failure
        p.kill()
    return False


@pytest.mark.slow  # too slow for make test's budget: in make test-slow
def test_kill_9_of_torchrun_ends_its_ranks_and_a_second_job_is_refused(tmp_path):
    pytest.importorskip("psutil")
    ck = str(tmp_path / "ck")
    cfg = write_config(tmp_path / "c.json", training=dict(train_iters=100000),
                       checkpoint=dict(save=ck, load=ck, save_interval=50))
    agent, lines = _start_launcher([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                    "--master_port", str(free_port()), SCRIPT, "--config", cfg])
    try:
        ranks = _ranks(agent.pid)
        assert len(ranks) == 2
        # A second job on the same save folder, while the first runs: refused, naming the first.
        one = write_config(tmp_path / "one.json", parallel=dict(data_parallel_size=1),
                           training=dict(train_iters=100000), checkpoint=dict(save=ck, load=ck))
        codes, outs = _finish(_launch(1, ["--config", one]))
        assert codes == [2], outs[0]
        assert f"another job is writing checkpoints to {ck}: pid " in outs[0]
        holder = int(outs[0].split(f"writing checkpoints to {ck}: pid ")[1].split()[0])
        assert holder in [p.pid for p in ranks]
    finally:
        agent.kill()  # SIGKILL to the agent only: torchrun started the ranks in sessions of their own
    agent.wait()
    assert _wait_gone(ranks, 15), "ranks outlived their launcher"
    assert any("its launcher (pid" in line and "is gone; exiting without saving" in line for line in lines)


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGKILL, marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGKILL"])
def test_the_deepspeed_runner_gone_saves_and_ends_launch_py_and_the_ranks(tmp_path, sig):
    """DeepSpeed's runner forwards no signal on one node: SIGTERM ends it alone, as SIGKILL does. The
    ranks, whose launch.py still lives, save after their current iteration and exit 0; launch.py follows."""
    pytest.importorskip("psutil")
    import psutil

    runner_cmd = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    if not os.path.exists(runner_cmd):
        pytest.skip("deepspeed CLI not installed next to this python")
    ck = str(tmp_path / "ck")
    cfg = write_config(tmp_path / "c.json", training=dict(train_iters=100000),
                       checkpoint=dict(save=ck, load=ck, save_interval=100000))
    runner, lines = _start_launcher([runner_cmd, "--num_gpus", "2", "--master_port", str(free_port()), SCRIPT,
                                     "--config", cfg])
    try:
        below = psutil.Process(runner.pid).children(recursive=True)  # launch.py and the two ranks
        assert len(_ranks(runner.pid)) == 2 and len(below) == 3, [p.cmdline() for p in below]
    finally:
        runner.send_signal(sig)  # only the runner: launch.py is its child, the ranks are launch.py's
    runner.wait()
    assert _wait_gone(below, 120), "launch.py or a rank outlived the runner"
    text = "".join(lines)
    assert "is gone while launch.py" in text and "saving after the current iteration" in text, text[-3000:]
    tag = read_latest(ck)
    assert tag is not None and f"saved checkpoint {ck}/{tag}" in text, text[-3000:]
    assert f"stopping at iteration {int(tag.split('_')[1])}: " in text and "Traceback" not in text, text[-3000:]


def test_the_launcher_watch_policy(tmp_path):
    """In a process of its own (the watch ends it): launch.py (the parent) gone -> exit 1 at once, no save
    asked; the runner above it gone -> a save asked, then exit 1 once `save_seconds` pass without the process
    having ended. Stand-ins for both are sleeping processes, killed from here."""
    script = tmp_path / "watched.py"
    script.write_text("""
import subprocess, sys, time
from gptpar.processes import proc_stat
from gptpar.training.launcher_watch import LauncherWatch
SLEEP = "import os, sys, time\\nwhile os.getppid() == int(sys.argv[1]): time.sleep(0.1)"  # until we end
parent, runner = (subprocess.Popen([sys.executable, "-c", SLEEP, str(__import__("os").getpid())]) for _ in range(2))
chain = [(p.pid, proc_stat(p.pid)[2], "stand-in") for p in (parent, runner)]
watch = LauncherWatch(chain, interval=0.05, label="rank 0", save_seconds=1.0)
watch.save_with(lambda reason: print("save asked:", reason, flush=True))
watch.start()
(runner if sys.argv[1] == "runner" else parent).kill()
time.sleep(30)
print("not ended", flush=True)
""")
    for which, code, said, asked in (("runner", 1, "did not finish within 1 s", True),
                                     ("parent", 1, "is gone; exiting without saving", False)):
        p = subprocess.run([sys.executable, str(script), which], capture_output=True, text=True, timeout=stretched(60))
        assert p.returncode == code and said in p.stderr and ("save asked:" in p.stdout) == asked, \
            (which, p.stdout, p.stderr)
        assert "not ended" not in p.stdout  # ended inside its 30 s sleep (not timed: a busy machine starts slowly)

