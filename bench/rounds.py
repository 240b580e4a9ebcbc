"""The GPU speed protocol's rounds: several training runs held on one device together and given it in turns, so that
every ratio compares runs seconds apart on the same card, and the rounds' spread shows the noise.

    python bench/rounds.py --out OUT --rounds 3 --warmup 2 --timed 6 \
        --run "peer=python bench/bench_peer_loop.py --compile ..." \
        --run "bf16=python -m deepspeed.launcher.runner --master_port 29501 ... bench/pretrain_in_rounds.py ..."

The coordinator (this script) starts every run at once: their start-up, compilation and first iterations overlap,
and none of that is timed. Each run says when it is ready; then round r gives each run one turn, in an order rotated
by one place per round (over three rounds of three runs, each run takes each place once). In its turn a run does
`--warmup` untimed iterations (clocks and caches warm again after the wait), then `--timed` timed ones, waits for
its device work to finish and hands the turn back; between turns it holds its memory and queues nothing. So the
device has one run's work at a time, and all runs' memory at once (three 1.3B runs: ~115 GiB of an H200's 140).

A run takes part through `Turns` (its side of the protocol, configured from the environment this script sets:
ROUNDS_DIR, ROUNDS_NAME, ROUNDS, ROUNDS_WARMUP, ROUNDS_TIMED): bench/bench_peer_loop.py and
bench/pretrain_in_rounds.py (pretrain_gpt.py, gated) do. Files in OUT/rounds/: `ready.NAME`, `go.NAME.R` (run
NAME's turn in round R, 1-based), `done.NAME.R` (JSON: what the run timed in that turn, written by the run),
`turns.jsonl` (one line per turn: name, round, place, start and end in seconds since the coordinator started),
`NAME.log` (the run's output), `go.NAME.end` (every turn is over: the runs may exit). Exit 0 when every run took
every turn and exited 0.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

POLL_S = 0.005


def write_json(path: str, value) -> None:
    """Whole or not at all: a reader polling for `path` never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def turn_order(names: List[str], round_index: int) -> List[str]:
    """The order of round `round_index` (0-based): `names` rotated left by the round's index."""
    k = round_index % len(names)
    return names[k:] + names[:k]


class Turns:
    """A run's side of the rounds: `wait(r)` before its turn in round r (the first call says it is ready),
    `done(r, record)` after it, with its device work finished; the record gets `active`, the run's own wall-clock
    times (epoch seconds) of the turn's start and end. `rounds`, `warmup` and `timed` say what each turn holds."""

    def __init__(self, directory: str, name: str, rounds: int, warmup: int, timed: int):
        self.directory, self.name = directory, name
        self.rounds, self.warmup, self.timed = rounds, warmup, timed
        self.said_ready = False
        self.started = None

    @classmethod
    def from_env(cls) -> Optional["Turns"]:
        """The rounds this process takes part in, from the coordinator's environment; None outside rounds."""
        env = os.environ
        if "ROUNDS_DIR" not in env:
            return None
        return cls(env["ROUNDS_DIR"], env["ROUNDS_NAME"], int(env["ROUNDS"]), int(env["ROUNDS_WARMUP"]),
                   int(env["ROUNDS_TIMED"]))

    def wait(self, round_number: int) -> None:
        if not self.said_ready:
            write_json(os.path.join(self.directory, f"ready.{self.name}"), {"pid": os.getpid()})
            self.said_ready = True
        go = os.path.join(self.directory, f"go.{self.name}.{round_number}")
        while not os.path.exists(go):
            time.sleep(POLL_S)
        self.started = time.time()

    def done(self, round_number: int, record: dict) -> None:
        """The turn's record; after the last round's, wait until every run has had its turns (`go.NAME.end`): a
        run's exit (its memory and context released) must not fall into another run's turn."""
        record = dict(record, active=[self.started, time.time()])
        write_json(os.path.join(self.directory, f"done.{self.name}.{round_number}"), record)
        if round_number == self.rounds:
            end = os.path.join(self.directory, f"go.{self.name}.end")
            while not os.path.exists(end):
                time.sleep(POLL_S)


def _launch(name: str, command: str, args, directory: str) -> subprocess.Popen:
    """Start run `name`, its output in its log. Each run compiles into an inductor cache of its own: runs compiling
    at once into one cache read each other's half-written C++ precompiled headers on a CPU."""
    cache = os.path.join(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or "/tmp/torchinductor_rounds", name)
    env = dict(os.environ, ROUNDS_DIR=directory, ROUNDS_NAME=name, ROUNDS=str(args.rounds),
               ROUNDS_WARMUP=str(args.warmup), ROUNDS_TIMED=str(args.timed), TORCHINDUCTOR_CACHE_DIR=cache)
    log = open(os.path.join(directory, f"{name}.log"), "w")
    # its own process group: DeepSpeed's launcher starts the trainer as a grandchild, stopped with it
    return subprocess.Popen(shlex.split(command), stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _wait_for(path: str, proc: subprocess.Popen, deadline: float) -> bool:
    """Whether `path` appeared before `proc` ended or the deadline passed."""
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            return os.path.exists(path)
        time.sleep(POLL_S)
    return True


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def coordinate(runs: Dict[str, str], args) -> int:
    """Start `runs` ({name: command}), give turns, wait for their ends; 0 when everything ran."""
    directory = os.path.join(args.out, "rounds")
    os.makedirs(directory, exist_ok=True)
    start = time.monotonic()
    deadline = start + args.timeout
    procs = {name: _launch(name, command, args, directory) for name, command in runs.items()}
    failed = []
    live = dict(procs)
    for name, proc in procs.items():
        if not _wait_for(os.path.join(directory, f"ready.{name}"), proc, deadline):
            failed.append(f"{name}: not ready (exit code {proc.poll()})")
            live.pop(name)
    print(f"rounds: {', '.join(live)} ready after {time.monotonic() - start:.0f} s", flush=True)
    with open(os.path.join(directory, "turns.jsonl"), "w") as turns:
        for r in range(args.rounds):
            for place, name in enumerate(turn_order(list(runs), r)):
                if name not in live:
                    continue
                begin = time.monotonic()
                write_json(os.path.join(directory, f"go.{name}.{r + 1}"), {"round": r + 1})
                if not _wait_for(os.path.join(directory, f"done.{name}.{r + 1}"), live[name], deadline):
                    failed.append(f"{name}: no turn {r + 1} (exit code {live[name].poll()})")
                    _stop(live.pop(name))
                    continue
                end = time.monotonic()
                turns.write(json.dumps({"name": name, "round": r + 1, "place": place + 1,
                                        "start_s": begin - start, "end_s": end - start}) + "\n")
                turns.flush()
                print(f"rounds: round {r + 1} {name} {end - begin:.1f} s", flush=True)
    for name in live:
        write_json(os.path.join(directory, f"go.{name}.end"), {})
    for name, proc in live.items():
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _stop(proc)
            code = "none (stopped at the deadline)"
        if code != 0:
            failed.append(f"{name}: exit code {code}")
    for name in set(procs) - set(live):
        _stop(procs[name])
    print(f"rounds: {time.monotonic() - start:.0f} s" + (f"; failed: {'; '.join(failed)}" if failed else ""),
          flush=True)
    return 1 if failed else 0


def parse_runs(items: List[str]) -> Dict[str, str]:
    runs = {}
    for item in items:
        name, sep, command = item.partition("=")
        if not sep or not name.isidentifier() or not command.strip():
            raise SystemExit(f"rounds.py: --run takes NAME=COMMAND (NAME a word), got {item!r}")
        if name in runs:
            raise SystemExit(f"rounds.py: --run {name} given twice")
        runs[name] = command
    return runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the call's output folder (the rounds' files go to OUT/rounds/)")
    p.add_argument("--run", action="append", default=[], metavar="NAME=COMMAND", help="a run taking turns")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations at the start of each turn")
    p.add_argument("--timed", type=int, default=6, help="timed iterations per turn")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for everything, start-up included")
    args = p.parse_args(argv)
    runs = parse_runs(args.run)
    if not runs or args.rounds < 1 or args.timed < 1 or args.warmup < 0:
        raise SystemExit("rounds.py: needs --run NAME=COMMAND, --rounds >= 1, --timed >= 1, --warmup >= 0")
    return coordinate(runs, args)


if __name__ == "__main__":
    sys.exit(main())
