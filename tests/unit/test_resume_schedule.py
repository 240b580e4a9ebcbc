"""A resume whose LR schedule differs from the checkpoint's: one line naming both schedules and the LR it jumps to,
and training.lr_schedule_on_resume=checkpoint keeping the checkpoint's schedule. The trainer's loop runs with a fake
engine that records the LR of every step and a fake checkpointer that hands the saved client state back; the LRs
are compared with Megatron's cosine schedule written out here."""
import types

import pytest
import torch

import gptpar.training.trainer as trainer_module
from gptpar.config import config_from_dict
from gptpar.schedules import LearningRateSchedule, resumed_schedule, saved_schedule
from gptpar.testing.runs import cosine_lr

LR, MIN_LR, WARMUP = 1e-3, 1e-4, 3
ONE_RANK = types.SimpleNamespace(dp_size=1, tp_size=1, world_size=1, rank=0, dp_rank=0, tp_rank=0,
                                 is_last_stage=True, device=torch.device("cpu"))


def megatron_cosine(k, decay_iters, warmup=WARMUP, max_lr=LR, min_lr=MIN_LR):
    """LR of the iteration after k completed ones (Megatron's AnnealingLR, cosine)."""
    return cosine_lr(k, warmup, decay_iters, max_lr, min_lr)


class Engine:
    """The trainer's engine surface, recording the LR each step trains at."""
    device, phase_seconds, loss_scale, grad_norm, step_applied = torch.device("cpu"), None, 1.0, 0.5, True

    def __init__(self):
        self.lrs = []

    def set_micro_batches(self, *args):
        pass

    def set_lr(self, lr):
        self.lrs.append(lr)

    def train_step(self, micro_batches, prepare_next=None):
        return 2.0

    def to_device(self, micro_batches):
        return micro_batches

    def parameters(self):
        return [torch.ones(2)]


class Checkpointer:
    """Keeps the client state of the last save; `load` hands it back (what the real one reads from disk)."""

    def __init__(self, state=None):
        self.state = state

    def due(self, iteration):
        return False  # no checkpoint.save_interval: the run's last iteration saves

    def save(self, engine, iteration, client_state, tracker, final=False):
        self.state = client_state
        return f"iter_{iteration}"

    def load(self, engine, tracker):
        return self.state

    def poll(self):
        pass

    def wait(self, *args):
        pass

    def failed(self):
        return False


def config(train_iters, **training):
    return config_from_dict({"model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                                       "seq_length": 16, "vocab_size": 200},
                             "training": {"micro_batch_size": 1, "global_batch_size": 2, "train_iters": train_iters,
                                          "lr": LR, "min_lr": MIN_LR, "lr_warmup_iters": WARMUP,
                                          "lr_decay_style": "cosine", "eval_interval": None, **training},
                             "data": {"synthetic": True}, "checkpoint": {"save": "unused"},
                             "logging": {"log_interval": 100}})


def run(cfg, checkpointer, monkeypatch):
    """Train `cfg` to its end (resuming from `checkpointer` first); (the LRs trained at, the lines printed)."""
    monkeypatch.setattr(trainer_module, "memory_usage", lambda device: {})
    printed, engine = [], Engine()
    source = types.SimpleNamespace(micro_batches=lambda consumed, gbs: [])
    trainer = trainer_module.Trainer(cfg, ONE_RANK, engine, source, {}, checkpointer, log=printed.append)
    trainer.resume()
    trainer.train()
    return engine.lrs, printed


@pytest.fixture
def saved(monkeypatch):
    """A checkpoint after 10 iterations of a 20-iteration cosine run (stopped by exit_interval, which saves)."""
    checkpointer = Checkpointer()
    lrs, _ = run(config(20, exit_interval=10), checkpointer, monkeypatch)
    assert lrs == pytest.approx([megatron_cosine(k, 20) for k in range(10)], rel=1e-12)
    assert checkpointer.state["iteration"] == 10
    return checkpointer.state


def schedule_lines(printed):
    return [line for line in printed if "LR schedule" in line]


def test_the_same_schedule_resumes_silently(saved, monkeypatch):
    lrs, printed = run(config(20), Checkpointer(saved), monkeypatch)
    assert lrs == pytest.approx([megatron_cosine(k, 20) for k in range(10, 20)], rel=1e-12)
    assert schedule_lines(printed) == []


def test_a_longer_run_follows_the_new_schedule_and_says_so(saved, monkeypatch):
    lrs, printed = run(config(40), Checkpointer(saved), monkeypatch)
    assert lrs == pytest.approx([megatron_cosine(k, 40) for k in range(10, 40)], rel=1e-12)
    assert schedule_lines(printed) == [
        "resume: the LR schedule changes (decay 20 -> 40 iterations): checkpoint cosine 0.001 -> 0.0001, warmup 3, "
        "decay 20 iterations, now cosine 0.001 -> 0.0001, warmup 3, decay 40 iterations; the learning rate jumps "
        f"from {megatron_cosine(10, 20):.3e} to {megatron_cosine(10, 40):.3e} at iteration 11 "
        "(training.lr_schedule_on_resume=checkpoint keeps the checkpoint's)"]


def test_the_option_keeps_the_checkpoints_schedule(saved, monkeypatch):
    cfg = config(40, lr=5e-4, lr_schedule_on_resume="checkpoint")
    lrs, printed = run(cfg, Checkpointer(saved), monkeypatch)
    # the old decay continues smoothly from iteration 11, then stays at min_lr after iteration 20
    assert lrs == pytest.approx([megatron_cosine(k, 20) for k in range(10, 40)], rel=1e-12)
    notes = schedule_lines(printed)
    assert len(notes) == 1
    assert "(lr 0.001 -> 0.0005, decay 20 -> 40 iterations)" in notes[0]
    assert notes[0].endswith(f"the learning rate continues at {megatron_cosine(10, 20):.3e} at iteration 11")


def test_a_switch_to_sample_based_training_is_said(saved, monkeypatch):
    cfg = config(None, train_samples=40, lr_warmup_iters=0, lr_warmup_samples=6, lr_decay_samples=50)
    lrs, printed = run(cfg, Checkpointer(saved), monkeypatch)
    assert lrs == pytest.approx([megatron_cosine(s, 50, warmup=6) for s in range(20, 40, 2)], rel=1e-12)
    assert schedule_lines(printed) == [
        "resume: the LR schedule changes (iterations-based -> samples-based): checkpoint cosine 0.001 -> 0.0001, "
        "warmup 3, decay 20 iterations, now cosine 0.001 -> 0.0001, warmup 6, decay 50 samples; the learning rate "
        f"jumps from {megatron_cosine(10, 20):.3e} to {megatron_cosine(20, 50, warmup=6):.3e} at iteration 11 "
        "(training.lr_schedule_on_resume=checkpoint keeps the checkpoint's)"]


@pytest.mark.parametrize("changed, said", [({"lr_warmup_iters": 5}, "warmup 3 -> 5 iterations"),
                                           ({"min_lr": 2e-4}, "min_lr 0.0001 -> 0.0002"),
                                           ({"lr_decay_style": "linear"}, "style cosine -> linear"),
                                           ({"global_batch_size": 4}, None)])
def test_each_schedule_parameter_is_compared(changed, said):
    """Iteration-based schedules compare in iterations: a new global batch size alone changes no LR."""
    old = LearningRateSchedule.from_config(config(20).training)
    new = LearningRateSchedule.from_config(config(20, **changed).training)
    assert new.changes_from(old) == ([said] if said else [])
    same = [new.lr_at(k, 0) == old.lr_at(k, 0) for k in range(25)]
    assert all(same) == (said is None)


def test_a_checkpoint_without_the_record_is_read_from_its_config(saved):
    """Checkpoints written before the schedule was recorded: rebuilt from the training section saved with them."""
    old = dict(saved)
    recorded = saved_schedule(old)
    del old["lr_schedule"]
    assert saved_schedule(old) == recorded == LearningRateSchedule.from_config(config(20).training)
    assert saved_schedule({"iteration": 3}) is None  # a universal copy without the config: nothing to compare
    schedule, note = resumed_schedule(None, recorded, 20, 40, 21, keep_saved=True)
    assert (schedule, note) == (recorded, "")
