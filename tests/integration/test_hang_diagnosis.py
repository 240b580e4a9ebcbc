"""A hang that names its rank, and the straggler report, on real ranks started by hand:

- 4 ranks (dp 4), rank 2 stopped with SIGSTOP, a 15 s collective timeout: the others write their diagnostics into
  <save>/diagnostics and exit 1 in one line; tools/diagnose_hang.py names rank 2 and no other rank.
- 2 ranks, rank 1 paused by a stop/continue duty cycle from this test: a `straggler:` line names rank 1, never rank 0.
- the straggler rule itself (the others' median) on numbers.
"""
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from gptpar.training.straggler import stragglers
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


def test_a_rank_paused_by_a_duty_cycle_is_named_a_straggler(tmp_path):
    cfg = write_config(tmp_path / "c.json", training=dict(train_iters=100000),
                       logging=dict(log_interval=5, straggler_threshold=2.0))
    procs = launch_ranks(2, ["--config", cfg])
    lines = []
    reader = _follow(procs[0], lines)
    try:
        _wait_for(lines, " iteration        5/", timeout=180)
        start = len(lines)
        deadline = Deadline(90)
        while sum(line.startswith(" iteration ") for line in lines[start:]) < 4 and not deadline.expired():
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

