"""Learning-rate schedule and batch-size ramp-up, as pure functions of the training counters.

Nothing here holds state that advances: the LR and the batch size are recomputed from (iteration,
consumed_samples), which the checkpoint stores, so a resumed run continues exactly.

Megatron's semantics (AnnealingLR / RampupBatchsizeNumMicroBatches):
- the schedule counts "steps" in samples: for iteration-based training warmup and decay lengths are
  `iters * global_batch_size` and the step count after k iterations is `k * global_batch_size`;
  for sample-based training they are the sample counts and the step count is consumed_samples;
- the LR used by an iteration is the one computed from the counters *before* it (the scheduler steps
  after the optimizer), so a run with warmup trains its first iteration at LR 0, as Megatron does.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Optional, Tuple


@dataclass(frozen=True)
class LearningRateSchedule:
    """Linear warmup 0 -> max_lr over warmup_steps, then constant/linear/cosine decay to min_lr at decay_steps.

    `by_samples` False: steps = iteration * global_batch_size (iteration-based training, constant batch);
    True: steps = consumed_samples.
    """

    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    decay_style: str = "linear"
    by_samples: bool = False
    global_batch_size: int = 1

    def __post_init__(self):
        if self.decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"decay_style must be constant, linear or cosine, got {self.decay_style!r}")
        if self.decay_steps <= 0 or not 0 <= self.warmup_steps < self.decay_steps:
            raise ValueError(f"need 0 <= warmup_steps ({self.warmup_steps}) < decay_steps ({self.decay_steps})")

    @classmethod
    def from_config(cls, training) -> "LearningRateSchedule":
        """From a `TrainingConfig` (lengths converted to samples, as Megatron does)."""
        t = training
        if t.train_iters is not None:
            gbs = t.global_batch_size
            return cls(t.lr, t.min_lr, t.lr_warmup_iters * gbs, (t.lr_decay_iters or t.train_iters) * gbs,
                       t.lr_decay_style, by_samples=False, global_batch_size=gbs)
        return cls(t.lr, t.min_lr, t.lr_warmup_samples, t.lr_decay_samples or t.train_samples,
                   t.lr_decay_style, by_samples=True)

    @classmethod
    def from_dict(cls, fields: dict) -> "LearningRateSchedule":
        """From `to_dict`'s output (a checkpoint's client state)."""
        return cls(**fields)

    def to_dict(self) -> dict:
        """The schedule's own parameters, plain values (saved in every checkpoint, compared at resume)."""
        return asdict(self)

    def terms(self) -> dict:
        """The schedule in the config's units: iteration-based lengths in iterations (steps / global batch size,
        so a changed batch size alone changes nothing), sample-based ones in samples."""
        unit = self.global_batch_size if not self.by_samples else 1
        return {"style": self.decay_style, "lr": self.max_lr, "min_lr": self.min_lr,
                "warmup": self.warmup_steps // unit, "decay": self.decay_steps // unit,
                "unit": "samples" if self.by_samples else "iterations"}

    def describe(self) -> str:
        """One phrase: `cosine 0.001 -> 0.0001, warmup 15, decay 150 iterations`."""
        t = self.terms()
        if t["style"] == "constant":
            return f"constant {t['lr']:g}, warmup {t['warmup']} {t['unit']}"
        return f"{t['style']} {t['lr']:g} -> {t['min_lr']:g}, warmup {t['warmup']}, decay {t['decay']} {t['unit']}"

    def changes_from(self, old: "LearningRateSchedule") -> list:
        """What differs from schedule `old`, in the config's units (`decay 150 -> 300 iterations`); empty when
        both give the same learning rates (a constant schedule has no decay or minimum)."""
        a, b = old.terms(), self.terms()
        if a["unit"] != b["unit"]:
            return [f"{a['unit']}-based -> {b['unit']}-based"]
        keys = ["style", "lr", "warmup"]
        if not a["style"] == b["style"] == "constant":
            keys += ["min_lr", "decay"]
        unit = {"warmup": f" {b['unit']}", "decay": f" {b['unit']}"}
        return [f"{key} {a[key]:g} -> {b[key]:g}{unit.get(key, '')}" if key != "style" else
                f"style {a[key]} -> {b[key]}" for key in keys if a[key] != b[key]]

    def steps(self, iteration: int, consumed_samples: int) -> int:
        return consumed_samples if self.by_samples else iteration * self.global_batch_size

    def lr_at(self, iteration: int, consumed_samples: int) -> float:
        """LR of the iteration that runs after `iteration` completed iterations and `consumed_samples` samples."""
        return self.lr_at_step(self.steps(iteration, consumed_samples))

    def lr_at_step(self, num_steps: int) -> float:
        # Megatron's AnnealingLR.get_lr, term for term.
        if self.warmup_steps > 0 and num_steps <= self.warmup_steps:
            return self.max_lr * float(num_steps) / float(self.warmup_steps)
        if self.decay_style == "constant":
            return self.max_lr
        if num_steps > self.decay_steps:
            return self.min_lr
        decay_ratio = float(num_steps - self.warmup_steps) / float(self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - decay_ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)


def saved_schedule(state: dict) -> Optional[LearningRateSchedule]:
    """The LR schedule a checkpoint's client state was trained with: its own record, else (a checkpoint written
    before it was recorded) rebuilt from the training section of the config saved with it; None when neither is
    there (a universal folder converted from DeepSpeed's files carries no counters)."""
    if state.get("lr_schedule") is not None:
        return LearningRateSchedule.from_dict(state["lr_schedule"])
    training = (state.get("config") or {}).get("training")
    try:
        return LearningRateSchedule.from_config(SimpleNamespace(**training))
    except (TypeError, AttributeError, ValueError):
        return None


def resumed_schedule(saved: Optional[LearningRateSchedule], configured: LearningRateSchedule,
                     lr_iterations: int, lr_samples: int, next_iteration: int,
                     keep_saved: bool) -> Tuple[LearningRateSchedule, str]:
    """The schedule a resumed run follows and the line that says so ("" when the checkpoint's and the config's give
    the same learning rates): the config's, or with `keep_saved` (training.lr_schedule_on_resume=checkpoint) the
    checkpoint's. The line names what changed, both schedules and the learning rate of `next_iteration`, the first
    after the resume (the LR inputs `lr_iterations`, `lr_samples` are the checkpoint's counters)."""
    changes = configured.changes_from(saved) if saved is not None else []
    if not changes:
        return configured, ""
    before, after = saved.lr_at(lr_iterations, lr_samples), configured.lr_at(lr_iterations, lr_samples)
    at, changed = f"at iteration {next_iteration}", ", ".join(changes)
    if keep_saved:
        return saved, (f"resume: this config's LR schedule ({configured.describe()}) differs from the checkpoint's "
                       f"({changed}); keeping the checkpoint's ({saved.describe()}, training.lr_schedule_on_resume="
                       f"checkpoint): the learning rate continues at {before:.3e} {at}")
    move = f"jumps from {before:.3e} to {after:.3e}" if after != before else f"stays at {after:.3e}"
    return configured, (f"resume: the LR schedule changes ({changed}): checkpoint {saved.describe()}, now "
                        f"{configured.describe()}; the learning rate {move} {at} "
                        "(training.lr_schedule_on_resume=checkpoint keeps the checkpoint's)")


def rampup_split_problem(start: int, increment: int, micro_batch_size: int, dp_size: int) -> Optional[str]:
    """Why a ramp-up's batches do not split into whole micro-batches on dp_size ranks, or None (the rule
    `BatchSizeRampup` enforces and the topology planner flags)."""
    unit = micro_batch_size * dp_size
    for what, value in (("start", start), ("increment", increment)):
        if value % unit:
            return (f"training.rampup_batch_size {what} ({value}) must divide by training.micro_batch_size "
                    f"({micro_batch_size}) x data-parallel size ({dp_size}) = {unit} so that every ramp-up batch "
                    "splits into whole micro-batches")
    return None


@dataclass(frozen=True)
class BatchSizeRampup:
    """Global batch size as a function of consumed samples (Megatron's RampupBatchsizeNumMicroBatches).

    The batch starts at `start` and grows by `increment` every `samples / num_increments` consumed samples
    until `samples` have been consumed; after that it is `final_batch_size` (training.global_batch_size).
    `start=None` = constant.
    """

    final_batch_size: int
    micro_batch_size: int
    dp_size: int
    start: Optional[int] = None
    increment: int = 0
    samples: int = 0

    def __post_init__(self):
        # The one home of the batch arithmetic: Config.check calls this before any process group exists, so
        # the messages name the config keys.
        mbs, dp, unit = self.micro_batch_size, self.dp_size, self.micro_batch_size * self.dp_size
        if mbs < 1 or dp < 1:
            raise ValueError(f"training.micro_batch_size ({mbs}) and the data-parallel size ({dp}) must be >= 1")
        if self.final_batch_size < 1 or self.final_batch_size % unit:
            raise ValueError(
                f"training.global_batch_size ({self.final_batch_size}) must divide by training.micro_batch_size "
                f"({mbs}) x data-parallel size ({dp}) = {unit}: change the batch sizes")
        if self.start is None:
            return
        start, increment, samples = self.start, self.increment, self.samples
        if start < 1 or increment < 1 or samples < 0:
            raise ValueError(f"training.rampup_batch_size {[start, increment, samples]}: start and increment "
                             "must be > 0 and samples >= 0")
        if start >= self.final_batch_size:
            raise ValueError(f"training.rampup_batch_size start ({start}) must be below training.global_batch_size "
                             f"({self.final_batch_size}): lower it, or set rampup_batch_size to null for a constant "
                             "batch size")
        if (self.final_batch_size - start) % increment:
            raise ValueError(f"training.rampup_batch_size: global_batch_size - start ({self.final_batch_size} - "
                             f"{start}) must divide by the increment ({increment})")
        problem = rampup_split_problem(start, increment, mbs, dp)
        if problem:
            raise ValueError(problem)

    @classmethod
    def from_config(cls, training, dp_size: int) -> "BatchSizeRampup":
        r = training.rampup_batch_size
        start, increment, samples = r if r is not None else (None, 0, 0)
        return cls(training.global_batch_size, training.micro_batch_size, dp_size, start, increment, samples)

    def global_batch_size(self, consumed_samples: int) -> int:
        """The global batch size of the iteration that starts after `consumed_samples` samples."""
        if self.start is None or consumed_samples > self.samples:
            return self.final_batch_size
        num_increments = (self.final_batch_size - self.start) // self.increment
        samples_per_increment = self.samples / num_increments  # a float, as in Megatron
        steps = int(consumed_samples / samples_per_increment)
        return self.start + steps * self.increment

    def num_micro_batches(self, consumed_samples: int) -> int:
        """Micro-batches per data-parallel rank (gradient accumulation steps) at this point."""
        return self.global_batch_size(consumed_samples) // (self.micro_batch_size * self.dp_size)

    def samples_after(self, iterations: int) -> int:
        """Samples the first `iterations` iterations consume (the batches of the ramp, then the final one)."""
        consumed = done = 0
        while self.start is not None and done < iterations and consumed <= self.samples:
            consumed += self.global_batch_size(consumed)
            done += 1
        return consumed + (iterations - done) * self.final_batch_size

    def train_iters(self, train_samples: int) -> int:
        """Iterations that `train_samples` takes (Megatron's update_train_iters; a partial last batch is dropped)."""
        if self.start is None:
            return train_samples // self.final_batch_size
        iterations = consumed = 0
        while consumed <= self.samples:
            consumed += self.global_batch_size(consumed)
            iterations += 1
        return iterations + (train_samples - consumed) // self.final_batch_size


@dataclass(frozen=True)
class SkipRanges:
    """Iterations whose global batches are drawn and discarded (Megatron-DeepSpeed's
    --skip-train-iteration-range: `["101-200", "1001-1100"]`, 1-based, both ends included).

    A skipped iteration still counts: iteration number, consumed samples/tokens and the LR schedule advance as
    if it had trained, so the rest of the run sees the same data and LR it would have without the bad batches.
    """

    ranges: tuple = ()  # ((start, end), ...) sorted, disjoint

    @classmethod
    def parse(cls, items) -> "SkipRanges":
        """From the config's list of "start-end" strings; ValueError naming the item and the fix."""
        ranges = []
        for item in items or ():
            m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", str(item))
            if m is None:
                raise ValueError(f"training.skip_train_iteration_range item {item!r} must be \"START-END\" (two "
                                 "iteration numbers, both included), e.g. \"101-200\"")
            start, end = int(m.group(1)), int(m.group(2))
            if start < 1 or end < start:
                raise ValueError(f"training.skip_train_iteration_range item {item!r}: need 1 <= START <= END "
                                 f"(iterations count from 1), e.g. \"{max(1, min(start, end))}-{max(start, end)}\"")
            ranges.append((start, end))
        ranges.sort()
        for (a, b), (c, d) in zip(ranges, ranges[1:]):
            if c <= b:
                raise ValueError(f"training.skip_train_iteration_range: ranges {a}-{b} and {c}-{d} overlap: merge "
                                 f"them into one (\"{a}-{max(b, d)}\")")
        return cls(tuple(ranges))

    def range_of(self, iteration: int) -> Optional[tuple]:
        """The (start, end) holding this 1-based iteration, or None if it trains."""
        return next(((a, b) for a, b in self.ranges if a <= iteration <= b), None)


def train_iters(training, dp_size: int) -> int:
    """Total iterations of a `TrainingConfig`: train_iters, or derived from train_samples (with ramp-up)."""
    if training.train_iters is not None:
        return training.train_iters
    return BatchSizeRampup.from_config(training, dp_size).train_iters(training.train_samples)


__all__ = ["LearningRateSchedule", "BatchSizeRampup", "SkipRanges", "rampup_split_problem", "train_iters",
           "saved_schedule", "resumed_schedule"]
