"""pretrain_gpt.py with test-only faults injected from outside the package (production code has no hooks):

    GPTPAR_TEST_STALL=RANK:ITERATION   that rank hangs before the stop all-reduce after ITERATION, so the others
                                       must end with the process-group timeout (parallel.distributed_timeout_minutes)
    GPTPAR_TEST_KILL_IN_SAVE=N         rank 0 SIGKILLs itself while saving iteration N, after DeepSpeed's
                                       save_checkpoint returned (with checkpoint.async_save=false: its files written)
                                       and before the gptpar files and `latest`
    GPTPAR_TEST_SLOW_SAVE=N:SECONDS    every rank's checkpoint writer writes the start of each file of iteration N,
                                       then sleeps SECONDS before writing it whole (with checkpoint.async_save the
                                       save stays in flight that long while training goes on)

    python tests/fault_injection.py --config c.json ...   (the same arguments as pretrain_gpt.py)
"""
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pretrain_gpt  # noqa: E402
from gptpar.training.engine import checkpoint_writer  # noqa: E402
from gptpar.training.engine import TrainEngine  # noqa: E402
from gptpar.training.trainer import Trainer  # noqa: E402


def stall_in_stop_reason(rank: int, iteration: int) -> None:
    real = Trainer.stop_reason

    def stop_reason(self):
        if (self.pstate.rank, self.counters.iteration) == (rank, iteration):
            time.sleep(3600)
        return real(self)

    Trainer.stop_reason = stop_reason


def kill_in_save(iteration: int) -> None:
    real = TrainEngine.save_checkpoint

    def save_checkpoint(self, save_dir, tag, client_state):
        real(self, save_dir, tag, client_state)
        if client_state["gptpar_iteration"] == iteration and self.pstate.rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    TrainEngine.save_checkpoint = save_checkpoint


def slow_save(iteration: int, seconds: float) -> None:
    real = checkpoint_writer.write_file

    def write_file(state, path, *args, **kwargs):
        if f"iter_{iteration:07d}" in path:
            with open(path, "wb") as partial:  # what a write cut short leaves
                partial.write(b"PK\x03\x04 the start of a file")
            time.sleep(seconds)
        return real(state, path, *args, **kwargs)

    checkpoint_writer.write_file = write_file


if __name__ == "__main__":
    if "GPTPAR_TEST_STALL" in os.environ:
        stall_in_stop_reason(*map(int, os.environ["GPTPAR_TEST_STALL"].split(":")))
    if "GPTPAR_TEST_KILL_IN_SAVE" in os.environ:
        kill_in_save(int(os.environ["GPTPAR_TEST_KILL_IN_SAVE"]))
    if "GPTPAR_TEST_SLOW_SAVE" in os.environ:
        iteration, seconds = os.environ["GPTPAR_TEST_SLOW_SAVE"].split(":")
        slow_save(int(iteration), float(seconds))
    code = pretrain_gpt.main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as pretrain_gpt.py's own __main__ does
