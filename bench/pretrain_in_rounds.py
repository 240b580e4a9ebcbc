"""pretrain_gpt.py taking turns in bench/rounds.py's rounds (its arguments are pretrain_gpt.py's).

    ROUNDS_PRE=2 python bench/rounds.py --out OUT --run \
        "bf16=python -m deepspeed.launcher.runner --num_gpus 1 bench/pretrain_in_rounds.py --config ... \
         --set training.train_iters=N"            # N = ROUNDS_PRE + rounds x (warmup + timed)

ROUNDS_CODE_ROOT, when set, is the tree whose gptpar and pretrain_gpt.py run (an earlier commit's, to time a change
against it in the same rounds).

The trainer runs as pretrain_gpt.py does; only `Trainer.train_step` is wrapped. The first ROUNDS_PRE iterations
(compilation, the optimizer state's first step) run at once, alongside the other runs' start-up; then each round's
first iteration waits for the run's turn and its last one waits for the device's work and hands the turn back,
both off the trainer's clock (`Trainer.off_the_clock`), so the log line's time per iteration is the trainer's own
measure of its iterations. Each turn's `done` record names the iterations it timed (the last `timed` of its turn)
and the metrics file holding their times; the last one adds the process's memory peaks over the whole run
(gptpar.training.reporting.memory_usage: on CUDA the caching allocator's max allocated and max reserved).
"""
import os
import sys

# gptpar and pretrain_gpt.py from this tree, or from ROUNDS_CODE_ROOT (an earlier tree, bench/gpu.sh's `before`)
ROOT = os.environ.get("ROUNDS_CODE_ROOT") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rounds import Turns  # noqa: E402


def round_plan(pre: int, turns: Turns):
    """{iteration: round} for each round's first and last iteration, and each round's timed iterations."""
    per_round = turns.warmup + turns.timed
    first = {pre + r * per_round + 1: r + 1 for r in range(turns.rounds)}
    last = {pre + (r + 1) * per_round: r + 1 for r in range(turns.rounds)}
    timed = {r + 1: list(range(pre + r * per_round + turns.warmup + 1, pre + (r + 1) * per_round + 1))
             for r in range(turns.rounds)}
    return first, last, timed


def gate_train_step(turns: Turns, pre: int) -> None:
    """Wrap gptpar's Trainer.train_step in the rounds' turns (see the module's docstring)."""
    import torch

    from gptpar.training.reporting import memory_usage
    from gptpar.training.trainer import Trainer

    first, last, timed = round_plan(pre, turns)
    train_step = Trainer.train_step

    def gated(self) -> None:
        k = self.counters.iteration + 1
        expected = pre + turns.rounds * (turns.warmup + turns.timed)
        if self.train_iters != expected:
            raise SystemExit(f"pretrain_in_rounds.py: training.train_iters is {self.train_iters}; the rounds need "
                             f"ROUNDS_PRE + rounds x (warmup + timed) = {expected}: set "
                             f"training.train_iters={expected}")
        if k in first:
            with self.off_the_clock():
                turns.wait(first[k])
        train_step(self)
        if k in last:
            with self.off_the_clock():
                if self.engine.device.type == "cuda":
                    torch.cuda.synchronize(self.engine.device)
                r = last[k]
                record = {"timed_iterations": timed[r], "metrics_file": self.cfg.logging.metrics_file}
                if r == turns.rounds:
                    record["memory_bytes"] = memory_usage(self.engine.device)
                turns.done(r, record)

    Trainer.train_step = gated


if __name__ == "__main__":
    rounds = Turns.from_env()
    if rounds is None:
        raise SystemExit("pretrain_in_rounds.py: run it through bench/rounds.py (no ROUNDS_DIR in the environment)")
    gate_train_step(rounds, int(os.environ.get("ROUNDS_PRE", "2")))
    import pretrain_gpt

    code = pretrain_gpt.main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as pretrain_gpt.py: skip the interpreter's teardown
