"""pretrain_gpt.py with test-only faults injected from outside the package (production code has no hooks):

    GPTPAR_TEST_KILL_IN_SAVE=N         rank 0 SIGKILLs itself while saving iteration N, after DeepSpeed's
                                       save_checkpoint returned (with checkpoint.async_save=false: its files written)
                                       and before the gptpar files and `latest`
    GPTPAR_TEST_SLOW_CONVERSION=S      a universal conversion (rank 0, in the preflight) first sleeps S seconds, as
                                       a large checkpoint's takes longer than parallel.distributed_timeout_minutes
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
from gptpar.checkpoint import universal  # noqa: E402
from gptpar.checkpoint import writer as checkpoint_writer  # noqa: E402
from gptpar.training.engine import TrainEngine  # noqa: E402


def kill_in_save(iteration: int) -> None:
    real = TrainEngine.save_checkpoint

    def save_checkpoint(self, save_dir, tag, client_state):
        real(self, save_dir, tag, client_state)
        if client_state["gptpar_iteration"] == iteration and self.pstate.rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    TrainEngine.save_checkpoint = save_checkpoint


def slow_conversion(seconds: float) -> None:
    real = universal.convert_deepspeed_checkpoint

    def convert(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    universal.convert_deepspeed_checkpoint = convert


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
    if "GPTPAR_TEST_SLOW_CONVERSION" in os.environ:
        slow_conversion(float(os.environ["GPTPAR_TEST_SLOW_CONVERSION"]))
    if "GPTPAR_TEST_KILL_IN_SAVE" in os.environ:
        kill_in_save(int(os.environ["GPTPAR_TEST_KILL_IN_SAVE"]))
    if "GPTPAR_TEST_SLOW_SAVE" in os.environ:
        iteration, seconds = os.environ["GPTPAR_TEST_SLOW_SAVE"].split(":")
        slow_save(int(iteration), float(seconds))
    code = pretrain_gpt.main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as pretrain_gpt.py's own __main__ does
