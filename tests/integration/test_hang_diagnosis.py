"""A hang that names its rank, and the straggler report, on real ranks started by hand:

- 4 ranks (dp 4), rank 2 stopped with SIGSTOP, a 15 s collective timeout: the others write their diagnostics into
  <save>/diagnostics and exit 1 in one line; tools/diagnose_hang.py names rank 2 and no other rank.
- 2 ranks, rank 1 paused by a stop/continue duty cycle from this test: a `straggler:` line names rank 1, never rank 0.
- 2 ranks in one process each (gptpar.testing.run_distributed), with the default straggler settings: a balanced run
  prints no straggler line; a run whose rank 1 is slow outside the engine's step (its kill switch check on a slow
  file system, a patch made by this test inside that rank's process) names rank 1, never rank 0.
- the straggler rule itself (the others' median, the absolute gap, the intervals in a row) on numbers, and the
  clock's reads of CUDA events (stand-ins) without a wait for the device.
"""
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from gptpar.testing import run_distributed
from gptpar.training.straggler import SustainedStragglers, stragglers
from gptpar.testing.runs import ROOT, finish_ranks, launch_ranks, write_config
from gptpar.testing.deadline import Deadline, stretched


def _follow(proc, lines):
    """Read `proc`'s output into `lines` from a thread (the test signals the ranks meanwhile)."""
    thread = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    thread.start()
    return thread


def _wait_for(lines, prefix, timeout):
    deadline = Deadline(timeout)
    while not any(line.startswith(prefix) for line in list(lines)):
        assert not deadline.expired(), "".join(lines)
        time.sleep(0.05)


@pytest.mark.slow
def test_a_stopped_rank_is_named_by_diagnose_hang(tmp_path):
    ck = tmp_path / "ck"
    cfg = write_config(tmp_path / "c.json", parallel=dict(data_parallel_size=4, distributed_timeout_minutes=0.25),
                       training=dict(train_iters=100000), checkpoint=dict(save=str(ck)),
                       logging=dict(straggler_threshold=None))
    procs = launch_ranks(4, ["--config", cfg])
    lines = []
    reader = _follow(procs[0], lines)
    try:
        _wait_for(lines, " iteration        2/", timeout=180)
        procs[2].send_signal(signal.SIGSTOP)
        for rank in (1, 3):
            procs[rank].wait(timeout=stretched(180))
        procs[0].wait(timeout=stretched(60))
    finally:
        procs[2].kill()
    reader.join(timeout=10)
    codes, outs = finish_ranks(procs[1:], timeout=30)
    outs = {0: "".join(lines), 1: outs[0], 3: outs[2]}
    for rank in (0, 1, 3):
        assert procs[rank].returncode == 1, outs[rank]
        assert re.search(rf"^pretrain_gpt.py: rank {rank}: (a collective waited past parallel.distributed_timeout_"
                         rf"minutes = 0.25|another rank's process is gone).*in {ck}/diagnostics/rank_{rank}.json",
                         outs[rank], re.M), outs[rank]
        assert "Traceback" not in outs[rank], outs[rank]
    assert sorted(os.listdir(ck / "diagnostics")) == ["rank_0.json", "rank_1.json", "rank_3.json"]
    p = subprocess.run([sys.executable, "tools/diagnose_hang.py", str(ck / "diagnostics")], cwd=ROOT,
                       capture_output=True, text=True, timeout=stretched(60))
    assert p.returncode == 0, p.stderr
    report = p.stdout.splitlines()
    assert [line.split(" (")[0] for line in report if line.startswith("suspect:")] == ["suspect: rank 2"], p.stdout
    assert not any(re.search(r"\brank [013]\b", line) for line in report), p.stdout


def test_the_straggler_rule_uses_the_others_median():
    assert stragglers([1.0, 1.0, 3.0, 1.1], 1.2) == [(2, 3.0, 1.0)]
    assert stragglers([1.0, 2.0], 1.5) == [(1, 2.0, 1.0)]  # of two ranks, the slow one alone
    assert stragglers([1.0, 1.1, 1.05], 1.2) == []
    assert stragglers([0.010, 0.030], 1.2, min_gap_s=0.05) == []  # 3 x, but 20 ms: noise of short iterations
    assert stragglers([0.25, 1.0], 1.2, min_gap_s=0.5) == [(1, 4.0, 0.25)]


def test_a_straggler_is_named_only_when_sustained():
    rule = SustainedStragglers(1.2, 0.0, intervals=3)
    assert rule.update([1.0, 2.0]) == [] and rule.update([2.0, 1.0]) == []  # the ranks in turn: noise
    assert rule.update([1.0, 2.0]) == [] and rule.update([1.0, 2.0]) == []
    assert rule.update([1.0, 2.0]) == [(1, 2.0, 1.0, 3)]
    assert rule.update([1.0, 2.5]) == [(1, 2.5, 1.0, 4)]
    assert rule.update([1.0, 1.0]) == [] and rule.update([1.0, 2.0]) == []  # a balanced interval starts over


class _Event:
    """A stand-in of torch.cuda.Event on a fake device clock: `record` stamps the clock, `query` says whether the
    device has passed the stamp; `synchronize` (a wait for the device) fails the test."""
    device_now = 0.0
    clock = 0.0

    def __init__(self, enable_timing=True):
        self.at = None

    def record(self, stream=None):
        self.at = _Event.clock

    def query(self):
        return _Event.device_now >= self.at

    def synchronize(self):
        raise AssertionError("the straggler report waited for the device")

    def elapsed_time(self, other):
        assert self.query() and other.query(), "elapsed_time of an event the device has not reached waits for it"
        return 1e3 * (other.at - self.at)


def test_the_rank_clock_reads_device_events_one_interval_late_without_waiting(monkeypatch):
    """On a CUDA device the clock's laps are event pairs; the report reads the interval before the log line's, once
    its last event completed (queried), and never synchronizes: an interval the device has not finished is dropped.
    Each iteration takes 3 s of device time, 1 s of it inside a collective (subtracted)."""
    import torch

    from gptpar.training import collectives as col
    from gptpar.training.straggler import StragglerReport
    from types import SimpleNamespace

    monkeypatch.setattr(col.torch.cuda, "Event", _Event)
    monkeypatch.setattr(col.torch.cuda, "current_stream", lambda device=None: None)
    log = col.CollectiveLog()
    clock = log.rank_clock(torch.device("cuda", 0))
    report = StragglerReport(SimpleNamespace(world_size=2, rank=0, tp_size=1, pp_size=1, dp_size=2), None,
                             1.2, 0.0, 1)
    clock.start()

    def iteration(i):
        _Event.clock += 1.0
        before = clock.cuda_event(None)  # what the wrapper records around a collective on a CUDA tensor
        _Event.clock += 1.0
        clock.cuda_waits.append((before, clock.cuda_event(None)))
        _Event.clock += 1.0
        report.add(i, clock.lap())

    for i in (1, 2):
        iteration(i)
    assert report.interval_seconds() == -1.0  # the first log line: no interval before it
    for i in (3, 4):
        iteration(i)
    _Event.device_now = _Event.clock - 4.0  # the device is 4 s behind the host: iteration 4 not finished
    assert report.interval_seconds() == 2.0 and report.reported == (1, 2)  # read while the device still runs
    for i in (5, 6):
        iteration(i)
    _Event.device_now = _Event.clock - 4.0  # iterations 3-4 are done now, 5-6 not
    assert report.interval_seconds() == 2.0 and report.reported == (3, 4)
    _Event.device_now = _Event.clock - 10.0  # 5-6 not finished at the next log line: dropped, no wait
    assert report.interval_seconds() == -1.0 and report.reported is None


def test_a_rank_paused_by_a_duty_cycle_is_named_a_straggler(tmp_path):
    cfg = write_config(tmp_path / "c.json", training=dict(train_iters=100000),
                       logging=dict(log_interval=5, straggler_threshold=2.0, straggler_min_gap_seconds=0.01,
                                    straggler_intervals=2))
    procs = launch_ranks(2, ["--config", cfg])
    lines = []
    reader = _follow(procs[0], lines)
    try:
        _wait_for(lines, " iteration        5/", timeout=180)
        start = len(lines)
        deadline = Deadline(90)
        while sum(line.startswith(" iteration ") for line in lines[start:]) < 6 and not deadline.expired():
            procs[1].send_signal(signal.SIGSTOP)  # stopped 3/4 of the time
            time.sleep(0.03)
            procs[1].send_signal(signal.SIGCONT)
            time.sleep(0.01)
    finally:
        procs[1].send_signal(signal.SIGCONT)
        for p in procs:
            p.kill()
    reader.join(timeout=10)
    finish_ranks(procs, timeout=30)
    out = "".join(lines)
    named = re.findall(r"^straggler: rank (\d+) \(", out, re.M)
    assert "1" in named and "0" not in named, out
    assert re.search(r"^straggler: rank 1 \(\S+, pp 0/dp 1/tp 0\) computed [\d.]+ ms per iteration, [\d.]+ x the "
                     r"others' median", out, re.M), out


def test_a_save_folder_holding_only_diagnostics_starts_fresh(tmp_path):
    """A hang before the first save leaves `diagnostics/` alone in the save folder: resuming there starts fresh."""
    from gptpar.checkpoint.layout import resolve_load

    (tmp_path / "diagnostics").mkdir()
    (tmp_path / "diagnostics" / "rank_0.json").write_text("{}")
    assert resolve_load(str(tmp_path)) == (None, f"no checkpoint to load: {tmp_path} holds no checkpoint yet (only "
                                                 "diagnostics); starting from scratch")


def _record(rank, run, collectives, world=4):
    return {"rank": rank, "world_size": world, "sizes": {"pp": 1, "dp": world, "tp": 1}, "run_id": run,
            "hosts": [f"node{r}" for r in range(world)], "time": 100.0 + (run == "new"), "collectives": collectives}


def _call(seq, state, group="0"):
    return {"op": "all_reduce", "group": group, "group_ranks": [0, 1, 2, 3], "group_seq": seq, "caller": "x.py:1 f",
            "state": state}


def test_diagnose_names_who_never_entered_and_who_wrote_nothing(tmp_path):
    """Ranks 0 and 1 wait in call #7 of the group; rank 3 wrote its file but stopped at #6; rank 2 wrote nothing.
    A file of an earlier run (another run id) is not read."""
    import json

    waiting = [_call(6, "returned"), _call(7, "failed: DistBackendError")]
    files = {0: _record(0, "new", waiting), 1: _record(1, "new", waiting), 3: _record(3, "new", [_call(6, "returned")]),
             2: _record(2, "old", waiting)}
    for rank, record in files.items():
        (tmp_path / f"rank_{rank}.json").write_text(json.dumps(record))
    p = subprocess.run([sys.executable, "tools/diagnose_hang.py", str(tmp_path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=stretched(60))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == ("suspect: rank 2 (node2, pp 0/dp 2/tp 0): wrote nothing (stopped, hung outside a collective, "
                        "or gone before it could); its last collective unknown (it wrote nothing)")
    assert lines[1].startswith("suspect: rank 3 (node3, pp 0/dp 3/tp 0): never entered the collective the others "
                               "wait in (all_reduce #7 of the group of ranks [0, 1, 2, 3]")
    assert lines[2].startswith("2 of 4 ranks' files show them waiting in all_reduce #7") and len(lines) == 3
    empty = tmp_path / "empty"
    empty.mkdir()
    p = subprocess.run([sys.executable, "tools/diagnose_hang.py", str(empty)], cwd=ROOT, capture_output=True,
                       text=True, timeout=stretched(60))
    assert p.returncode == 2 and p.stderr.startswith("diagnose_hang.py: error: ") and "SIGUSR2" in p.stderr


def test_a_damaged_diagnostics_file_is_one_line_naming_it(tmp_path):
    """A rank's file cut in half, binary, a JSON list, `{}`, or with a collective missing its group: exit 2, one
    line on stderr naming the file and what is wrong, no traceback (each of these was a different traceback)."""
    import json

    whole = json.dumps(_record(0, "new", [_call(6, "returned")]), indent=1)
    no_group = _record(0, "new", [{k: v for k, v in _call(6, "entered").items() if k != "group"}])
    cases = {"half": (whole[:len(whole) // 2], "is not a whole diagnostics file: not valid JSON"),
             "binary": (b"\x80\x04\x95PK\x03\x04\xff\xfe" * 8, "is not a diagnostics file: not text"),
             "list": ("[1, 2]", "is not a diagnostics file: a JSON list, not an object"),
             "empty": ("{}", "is not a diagnostics file gptpar wrote: no world_size; no sizes; no time"),
             "no_group": (json.dumps(no_group), "is not a diagnostics file gptpar wrote: no collectives[0].group")}
    for name, (content, message) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "rank_1.json").write_text(json.dumps(_record(1, "new", [_call(6, "returned")])))
        bad = folder / "rank_0.json"
        bad.write_bytes(content) if isinstance(content, bytes) else bad.write_text(content)
        p = subprocess.run([sys.executable, "tools/diagnose_hang.py", str(folder)], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 2 and p.stdout == "", (name, p.stdout, p.stderr)
        assert p.stderr.startswith(f"diagnose_hang.py: error: {bad} {message}"), (name, p.stderr)
        assert len(p.stderr.splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr


def _balanced_then_slow(tmp: str) -> list:
    """Two runs of 2 ranks (dp 2) on this rank, with the default straggler settings and log_interval 2, each rank's
    lines kept: 42 balanced iterations, then 12 in which rank 1's kill switch check sits on a slow file system:
    each os.path.exists of the kill switch takes 0.5 s more (patched by this test inside rank 1's process), host
    work of the loop outside the engine's step. One process start for both (the start is most of the time)."""
    import time
    import torch.distributed as dist

    from gptpar.parallel import init_parallel
    from gptpar.training.assembly import build_trainer, setup_environment
    from gptpar.training.cli import parse
    from gptpar.training.collectives import CollectiveLog

    kill = os.path.join(tmp, "kill")
    collectives = CollectiveLog().install()
    setup_environment()
    logs, pstate = [], None
    for iters, slow_s in ((42, 0.0), (12, 0.5)):
        path = write_config(os.path.join(tmp, f"c{iters}_{dist.get_rank() if dist.is_initialized() else 0}.json"),
                            parallel=dict(data_parallel_size=2),
                            training=dict(train_iters=iters, eval_interval=None, kill_switch_path=kill),
                            logging=dict(log_interval=2))
        cfg, _, (tp, pp, dp) = parse(["--config", path])
        pstate = pstate or init_parallel(tp, pp, dp)
        if slow_s and pstate.rank == 1:
            real = os.path.exists

            def exists(path, real=real):
                if path == kill:
                    time.sleep(slow_s)
                return real(path)

            os.path.exists = exists
        lines = []
        trainer = build_trainer(cfg, pstate, lambda line, **_: lines.append(line), None, collectives=collectives)
        trainer.log = lambda line, **_: lines.append(line)
        trainer.train()
        logs.append("\n".join(lines))
    return logs


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """Rank 0's logs (it prints the log line) of `_balanced_then_slow`: (balanced, rank 1 slow)."""
    return run_distributed(_balanced_then_slow, 2, (str(tmp_path_factory.mktemp("straggler")),), timeout=900)[0]


def test_a_balanced_run_prints_no_straggler_line(two_rank_runs):
    """Two ranks doing the same work, on a host where other processes take the cores in turn: 20 log intervals
    reported, no straggler named (the default rule: the median of each interval, over 1.2 x and 0.25 s, three
    intervals in a row)."""
    out = two_rank_runs[0]
    assert len(re.findall(r"^ iteration ", out, re.M)) == 21, out
    assert "straggler:" not in out, out


def test_a_rank_slow_outside_the_step_is_named(two_rank_runs):
    """Rank 1 spends 0.5 s per iteration in its kill switch check, outside the engine's step; rank 0 waits for it in
    the loop's stop all-reduce (subtracted). Rank 1 is named from the 3rd interval over on, rank 0 never."""
    out = two_rank_runs[1]
    named = re.findall(r"^straggler: rank (\d+) \(", out, re.M)
    assert named and set(named) == {"1"}, out
    assert re.search(r"^straggler: rank 1 \(\S+, pp 0/dp 1/tp 0\) computed [\d.]+ ms per iteration, [\d.]+ x the "
                     r"others' median \([\d.]+ ms\) in iterations \d+-\d+, over for [3-9] log intervals in a row",
                     out, re.M), out
    seconds = [float(s) for s in re.findall(r"^straggler: rank 1 .* computed ([\d.]+) ms", out, re.M)]
    assert all(s >= 500 for s in seconds), out  # the sleep is in its own time
