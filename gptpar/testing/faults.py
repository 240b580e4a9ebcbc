"""pretrain_gpt.py with test-only faults injected from outside the package (production code has no hooks):

    GPTPAR_TEST_KILL_IN_SAVE=N         rank 0 SIGKILLs itself while saving iteration N, after DeepSpeed's
                                       save_checkpoint returned (with checkpoint.async_save=false: its files written)
                                       and before the gptpar files and `latest`
    GPTPAR_TEST_SLOW_CONVERSION=S      each rank's share of a universal conversion (in the preflight) first sleeps S
                                       seconds, as a large checkpoint's takes longer than
                                       parallel.distributed_timeout_minutes
    GPTPAR_TEST_SLOW_SAVE=N:SECONDS    every rank's checkpoint writer writes the start of each file of iteration N,
                                       then sleeps SECONDS before writing it whole (with checkpoint.async_save the
                                       save stays in flight that long while training goes on)
    GPTPAR_TEST_SLOW_STOP_SAVE=R:SECONDS  rank R, asked to stop by a signal (SIGTERM, SIGINT), sleeps SECONDS before
                                       the save that follows (a large model's save under a preemption)
    GPTPAR_TEST_KILL_AT=R:N            rank R SIGKILLs itself right after iteration N's step, in the first attempt
                                       of a launcher that restarts ranks (TORCHELASTIC_RESTART_COUNT 0 or unset)
    GPTPAR_TEST_PERTURB=N:R:NAME[:bit] before the save of iteration N, rank R adds 1 to the first element of its first
                                       parameter whose name contains NAME (a replica that drifted apart); with
                                       `:bit`, flips the lowest bit of its first two elements instead (the same bit
                                       pattern in two elements: an XOR of the bits would not see it)

    python gptpar/testing/faults.py --config c.json ...   (the same arguments as pretrain_gpt.py)
"""
import os
import signal
import time

from gptpar.checkpoint import universal
from gptpar.checkpoint import writer as checkpoint_writer
from gptpar.training.engine import TrainEngine
from gptpar.training.pretrain import exit_now, main
from gptpar.training.trainer import Trainer


def kill_in_save(iteration: int) -> None:
    real = TrainEngine.save_checkpoint

    def save_checkpoint(self, save_dir, tag, client_state):
        real(self, save_dir, tag, client_state)
        if client_state["gptpar_iteration"] == iteration and self.pstate.rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    TrainEngine.save_checkpoint = save_checkpoint


def kill_at(rank: int, iteration: int) -> None:
    real = Trainer.train_step

    def train_step(self):
        real(self)
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and self.pstate.rank == rank and self.counters.iteration == iteration:
            os.kill(os.getpid(), signal.SIGKILL)

    Trainer.train_step = train_step


def perturb(iteration: int, rank: int, name: str, how: str = "add") -> None:
    import torch

    real = Trainer.save

    def save(self, final=False):
        if self.pstate.rank == rank and self.counters.iteration == iteration:
            param = next(p for n, p in self.engine.named_parameters() if name in n)
            with torch.no_grad():
                if how == "bit":
                    flat = param.view(-1)
                    flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])[:2] ^= 1
                else:
                    param.view(-1)[0] += 1.0
        real(self, final)

    Trainer.save = save


def slow_stop_save(rank: int, seconds: float) -> None:
    real = Trainer.save

    def save(self, final=False):
        if final and self.signals.received is not None and self.pstate.rank == rank:
            print(f"rank {rank}: the save after {signal.Signals(self.signals.received).name} takes {seconds:g} s more",
                  flush=True)
            time.sleep(seconds)
        real(self, final)

    Trainer.save = save


def slow_conversion(seconds: float) -> None:
    real = universal.convert_share

    def convert(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    universal.convert_share = convert


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
    if "GPTPAR_TEST_KILL_AT" in os.environ:
        rank, iteration = os.environ["GPTPAR_TEST_KILL_AT"].split(":")
        kill_at(int(rank), int(iteration))
    if "GPTPAR_TEST_PERTURB" in os.environ:
        iteration, rank, name, *how = os.environ["GPTPAR_TEST_PERTURB"].split(":")
        perturb(int(iteration), int(rank), name, *how)
    if "GPTPAR_TEST_SLOW_STOP_SAVE" in os.environ:
        rank, seconds = os.environ["GPTPAR_TEST_SLOW_STOP_SAVE"].split(":")
        slow_stop_save(int(rank), float(seconds))
    if "GPTPAR_TEST_SLOW_SAVE" in os.environ:
        iteration, seconds = os.environ["GPTPAR_TEST_SLOW_SAVE"].split(":")
        slow_save(int(iteration), float(seconds))
    exit_now(main())
