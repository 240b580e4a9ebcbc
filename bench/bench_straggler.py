"""What the straggler report costs an iteration (logging.straggler_threshold), at log_interval = 1 on the 2-rank CPU
config (configs/cpu_dp2.json, evaluation off):

    python bench/bench_straggler.py                  # 200 iterations, ~1 min on 2 shared CPU cores
    python bench/bench_straggler.py --iters 50

Two gloo ranks train with the report on. Its cost is the time its own code takes, timed where it runs (a difference
of two runs' iteration times would be noise on a shared machine, far above 1%):

    collective log      each collective's bookkeeping in gptpar.training.collectives (CollectiveLog._enter, the
                        ring entry, the caller's frame), summed over the run's calls: the hang diagnosis's ring,
                        kept with or without the report, so reported beside it
    rank clock          the clock of each rank's own time: its lap at each iteration's end, its pauses around
                        evaluation and saves, and reading a lap (RankClock.start, .lap, .paused; Lap.ready,
                        .own_seconds)
    report              the interval's median at each log line (one interval late), the rank's slot added to the
                        stop all-reduce, the rule and the wording (StragglerReport.add, .interval_seconds, .slots,
                        .lines, Trainer.report_stragglers)

Each part is timed in the main thread's CPU time (time.thread_time), and so is the iteration (the run's training
over its iterations): on a shared machine a wall-clock timer around a few microseconds of code also counts the
milliseconds the process waited for a core. Prints, per rank, each part in microseconds per iteration and the total
as a share of the iteration's CPU time (the wall time beside it), and the larger rank's share.
"""
import argparse
import functools
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def timed(cls, name, spent, key):
    real = getattr(cls, name)

    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        start = time.thread_time()
        try:
            return real(*args, **kwargs)
        finally:
            spent[key] += time.thread_time() - start

    setattr(cls, name, wrapper)


def rank_main(iters: int) -> dict:
    import collections

    from gptpar.parallel import init_parallel
    from gptpar.training.assembly import build_trainer, setup_environment
    from gptpar.training.cli import parse
    from gptpar.training.collectives import CollectiveLog, Lap, RankClock
    from gptpar.training.straggler import StragglerReport

    cfg, _, (tp, pp, dp) = parse(["--config", "configs/cpu_dp2.json", "--set", f"training.train_iters={iters}",
                                  "--set", "logging.log_interval=1", "--set", "training.eval_interval=null"])
    setup_environment()
    pstate = init_parallel(tp, pp, dp)
    collectives = CollectiveLog().install()
    spent = collections.defaultdict(float)
    timed(CollectiveLog, "_enter", spent, "collective log")
    for cls, names in ((RankClock, ("start", "lap", "paused")), (Lap, ("ready", "own_seconds"))):
        for name in names:
            timed(cls, name, spent, "rank clock")
    for name in ("add", "interval_seconds", "slots", "lines"):
        timed(StragglerReport, name, spent, "report")
    from gptpar.training.trainer import Trainer

    timed(Trainer, "report_stragglers", spent, "report")
    trainer = build_trainer(cfg, pstate, lambda *a, **k: None, None, collectives=collectives)
    start, cpu = time.perf_counter(), time.thread_time()
    trainer.train()
    seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
    return {"iteration_s": seconds / iters, "iteration_cpu_s": cpu / iters, "calls_per_iteration": collectives.calls / iters,
            "us_per_iteration": {k: 1e6 * v / iters for k, v in spent.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from gptpar.testing import run_distributed

    results = run_distributed(rank_main, 2, (args.iters,), timeout=1800)
    shares = {"straggler": [], "all": []}
    for rank, r in enumerate(results):
        us, cpu_us = r["us_per_iteration"], 1e6 * r["iteration_cpu_s"]
        own = us["rank clock"] + us["report"]
        shares["straggler"].append(own / cpu_us)
        shares["all"].append(sum(us.values()) / cpu_us)
        parts = ", ".join(f"{k} {v:.0f}" for k, v in sorted(us.items()))
        print(f"rank {rank}: iteration {r['iteration_cpu_s'] * 1e3:.1f} ms CPU ({r['iteration_s'] * 1e3:.1f} ms wall), "
              f"{r['calls_per_iteration']:.1f} collectives per iteration; us CPU per iteration: {parts}")
    print(f"straggler report (rank clock + report): {100 * max(shares['straggler']):.2f}% of an iteration's CPU time; "
          f"with the collective log (the ring the hang diagnosis reads, on with or without the report): "
          f"{100 * max(shares['all']):.2f}% (the larger rank's, log_interval = 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
