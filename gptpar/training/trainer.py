"""The training loop, with Megatron's semantics for batches, schedules, logging, evaluation and exits.

One iteration:
    gbs = ramp-up(consumed_samples)             global batch = micro batch x micro-batches x dp
    lr  = schedule(iterations, samples)         the LR this iteration uses (set before the step), from the
                                                counters of the steps applied so far (Megatron's scheduler)
    loss = engine.train_step(this rank's micro-batches)   mean over the global batch's tokens, every rank
    counters += (1, gbs, gbs x seq_length)
then, in Megatron's order: the log line every `log_interval`, evaluation every `eval_interval`, a checkpoint
every `save_interval`, and the exit checks (signal, kill switch file, exit_duration_in_mins, exit_interval), on
which all ranks agree through one all-reduce per iteration. An iteration in training.skip_train_iteration_range
draws its global batch and discards it: the counters (LR inputs included) advance as if it had trained, and it
writes no log line (a `skipped_data` record instead); evaluation, saves and exit checks run as usual.

With checkpoint.async_save a save returns once its snapshot is planned (gptpar.checkpoint.checkpointer): the loop then
says when it was written (`Checkpointer.poll`), stops every rank at the same iteration if it failed (a flag in
the stop all-reduce), and the end of the run waits for it.

Elapsed time per iteration is wall-clock time, as Megatron's interval timer measures it: each iteration's runs
from the end of the previous iteration's optimizer step to the end of its own, so the loop's own work between
steps (the log line, the exit checks' all-reduce, fetching the batch) is in it; evaluation, checkpoint saves,
skipped iterations, logging.profile's own work and torch.compile's compilation are not. The log line shows
its mean over the interval; samples/s and TFLOPs derive from it.
The log line is printed by the last pipeline stage's first data-parallel rank (tp rank 0); the same record
goes to the metrics JSONL and TensorBoard (gptpar.training.reporting). Skipped iterations are counted
from the engine's `step_applied`, NaN iterations from the loss, num zeros from the gradients the optimizer
steps on (only with logging.log_num_zeros, else omitted), params norm from the master weights (only with
logging.log_params_norm), TFLOPs from gptpar.estimate.flops; num zeros and params norm count each parameter
of the model once. After the first log line whose step was applied (the optimizer state then exists), every
rank of the first dp replica prints Megatron's memory report (`[Rank r] (after N iterations) memory (MB) | ...`);
each log line's memory in use, the largest over the ranks (reduced on the host), goes to TensorBoard and its peaks
to the record's memory fields. A log write that fails stops the run at that iteration's stop check, every rank
saving first (LogWriteError, exit 1).
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from dataclasses import asdict, dataclass, fields
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from gptpar.estimate.flops import tflops_per_gpu
from gptpar.parallel import host_group
from gptpar.training.engine import ZeroCounter
from gptpar.training.reporting import (IntervalStats, LogWriteError, MetricsWriter, TensorBoardWriter, eval_record,
                                     format_eval_block, format_log_line, format_memory_line, format_timers_line,
                                     memory_usage, peak_memory_fields)
from gptpar.training.profiling import IterationProfiler
from gptpar.training.replicas import ReplicaDivergenceError, check_replicas
from gptpar.training.straggler import StragglerReport
from gptpar.schedules import (BatchSizeRampup, LearningRateSchedule, SkipRanges, resumed_schedule, saved_schedule,
                              train_iters)

# SIGINT too: a launcher passes Ctrl-C on as SIGINT (torchrun's agent) and it must save like a preemption's SIGTERM,
# not end the rank in a KeyboardInterrupt
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class NonFiniteError(RuntimeError):
    """The run went NaN/Inf: too many non-finite iterations in a row, or a save asked of non-finite weights."""


@dataclass
class Counters:
    """Where training stands; saved in every checkpoint."""

    iteration: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0
    # The LR schedule's inputs advance only when the optimizer stepped (Megatron: a skipped fp16 step
    # does not move the scheduler), so they trail iteration / consumed_samples after overflows.
    lr_iterations: int = 0
    lr_samples: int = 0

    def advance(self, global_batch_size: int, seq_length: int, step_applied: bool) -> None:
        """One iteration done (trained, overflow-skipped or its data discarded)."""
        self.iteration += 1
        self.consumed_samples += global_batch_size
        self.consumed_tokens += global_batch_size * seq_length
        if step_applied:
            self.lr_iterations += 1
            self.lr_samples += global_batch_size


@dataclass
class StopFlags:
    """What the ranks agree on after every iteration, in one all-reduce MAX over the host group: each field is one
    rank's view, the reduced record every rank's (a stop signal's number, the others 0 or 1)."""

    signal: float = 0  # the number of a stop signal received (SIGTERM, SIGINT, SIGUSR1), 0 for none
    kill_switch: float = 0  # training.kill_switch_path exists
    out_of_time: float = 0  # training.exit_duration_in_mins passed
    stop_requested: float = 0  # asked from inside the process (the launcher watch)
    save_failed: float = 0  # an async save failed (every rank raises it at this iteration)
    log_failed: float = 0  # the log rank could not write its logs (save, then stop)

    def values(self) -> List[float]:
        return [float(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def count(cls) -> int:
        return len(fields(cls))

    @classmethod
    def from_values(cls, values: List[float]) -> "StopFlags":
        """The record from the first `count()` reduced values (what follows is the straggler report's)."""
        return cls(*values[:cls.count()])


class StopSignals:
    """SIGTERM / SIGINT / SIGUSR1 set a flag; the loop finishes the iteration, saves and exits 0. `request(reason)` does
    the same from inside the process (the launcher watch, when DeepSpeed's runner is gone)."""

    def __init__(self):
        self.received: Optional[int] = None
        self.requested: Optional[str] = None
        self._previous = {}

    def request(self, reason: str) -> None:
        """Stop after the current iteration, saving first, for `reason` (safe from another thread)."""
        self.requested = reason

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        self.received = signum


class CompileClock:
    """training.compile: the seconds torch.compile cost a block (`with clock:`, then `clock.spent`), and one line the
    first time it compiled. The trainer takes them out of the iteration's elapsed time, so the log line's time per
    iteration, samples/s and TFLOPs measure training, not the first iteration's compilation.

    Each rank compiles its own layers; a pipeline stage also waits while the others compile (forward down the stages,
    backward up), so the cost of a block is the sum over stages of their ranks' mean: the ranks' seconds summed (one
    all-reduce per iteration of one number, over the trainer's host group: a device tensor would make the host wait
    for the optimizer step queued before it, with the device then idle until the next forward is queued) over
    tp x dp."""

    def __init__(self, say, pstate, group=None):
        """`group`: the host (gloo) group of every rank; None for one rank."""
        from gptpar.model.gpt import compile_stats

        self.stats, self.say, self.pstate, self.group = compile_stats, say, pstate, group
        self.spent, self.announced = 0.0, False

    def __enter__(self):
        self._before = self.stats()["seconds"]

    def __exit__(self, exc_type, *exc):
        if exc_type is not None:  # the step failed: no collective that the other ranks may never reach
            return
        stats = self.stats()
        spent = stats["seconds"] - self._before
        if self.group is not None:
            spent = torch.tensor([spent], dtype=torch.float64)
            dist.all_reduce(spent, group=self.group)
            spent = spent.item()
        self.spent = spent / (self.pstate.tp_size * self.pstate.dp_size)
        if self.spent > 0 and not self.announced:
            self.announced = True
            self.say(f"training.compile: the transformer layers and the loss compiled in {self.spent:.1f} s during "
                     f"this iteration ({stats['graphs']} graph(s), {stats['graph_breaks']} graph break(s) so far), left "
                     "out of the log line's time per iteration, samples/s and TFLOPs")


class Trainer:
    """Runs the loop for one process; every method is called on every rank (they hold collectives)."""

    def __init__(self, cfg, pstate, engine, train_source, valid_sources, checkpointer=None, tracker=None,
                 log=print, collectives=None):
        """`valid_sources`: {validation set name, or None for the only unnamed set: BatchSource}. `collectives`: the
        process's gptpar.training.collectives.CollectiveLog (the straggler report's clock subtracts its waits)."""
        self.cfg, self.pstate, self.engine, self.log = cfg, pstate, engine, log
        self.train_source, self.valid_sources = train_source, valid_sources
        self.checkpointer, self.tracker = checkpointer, tracker
        t = cfg.training
        self.train_iters = train_iters(t, pstate.dp_size)
        self.rampup = BatchSizeRampup.from_config(t, pstate.dp_size)
        self.total_samples = self.rampup.samples_after(self.train_iters)  # what train_iters iterations consume
        self.schedule = LearningRateSchedule.from_config(t)
        self.skip_ranges = SkipRanges.parse(t.skip_train_iteration_range)
        self.skipping = None  # the skip range announced last
        self.counters = Counters()
        self.stats = IntervalStats()
        self.signals = StopSignals()
        self.engine_gbs = None
        self.prefetched = None  # ((consumed samples, global batch size), its micro-batches on the device)
        self.last = {}
        self.clock_mark = None  # perf_counter() at the end of the last timed step; None: the next starts the clock
        self.stats_step_seconds = 0.0  # the last iteration's elapsed time (the checkpointer records it with a save)
        self.evaluated_at = None
        self.nan_streak = 0  # consecutive iterations with a NaN/Inf loss (the same on every rank: the loss is)
        self.is_log_rank = pstate.is_last_stage and pstate.dp_rank == 0 and pstate.tp_rank == 0
        self.zeros = ZeroCounter(engine, pstate) if cfg.logging.log_num_zeros else None
        self.memory_reported = False  # Megatron's report_memory_flag: the per-rank report, once
        self.metrics = self.tensorboard = None
        self.log_failure = None  # why the log rank's metrics file or TensorBoard could not be written
        self.logs_failed = False  # some rank's log write failed (agreed in stop_reason): save, then stop
        if cfg.logging.timers:
            engine.time_phases()
        # The loop's per-iteration agreements (stop flags, compile seconds) go over a gloo group: the same all-reduce
        # of a device tensor, read back, would make the host wait for the optimizer step queued before it, and the
        # device then idle while the host logs and queues the next forward.
        self.host_group = host_group(cfg.parallel.distributed_timeout_minutes)
        self.compile_clock = (CompileClock(self._say, pstate, self.host_group) if t.compile
                              else contextlib.nullcontext())
        lg = cfg.logging
        self.profiler = (IterationProfiler(lg.profile, lg.profile_dir, pstate.rank, engine.device, self._say)
                         if lg.profile else None)
        self.collectives = collectives
        self.own_seconds = None  # this rank's, from the last log line, until the stop all-reduce sends it
        self.straggler = self.rank_clock = None
        if lg.straggler_threshold and self.host_group is not None and collectives is not None:
            self.straggler = StragglerReport(pstate, self.host_group, lg.straggler_threshold,
                                             lg.straggler_min_gap_seconds, lg.straggler_intervals)
            self.rank_clock = collectives.rank_clock(engine.device)

    # -- the loop ------------------------------------------------------------------------------
    def train(self) -> str:
        """Train to train_iters or an exit condition; returns why it stopped."""
        self._open_writers()
        self.signals.install()
        self.start_time = time.time()
        try:
            reason = self._loop()
            if self.profiler is not None:
                self.profiler.finish(self.counters.iteration)  # a stop inside logging.profile's range
            if self.checkpointer is not None:
                self.checkpointer.wait("exiting")  # an async save is whole (or its failure raised) before the end
            return reason
        finally:
            if self.rank_clock is not None:
                self.rank_clock.stop()
            self.signals.restore()
            self._close_writers()
            if self.zeros is not None:
                self.zeros.remove()

    def _loop(self) -> str:
        c, t = self.counters, self.cfg.training
        while c.iteration < self.train_iters:
            skip = self.skip_ranges.range_of(c.iteration + 1)
            if skip is not None:
                with self.off_the_clock():
                    self.skip_step(skip)
            else:
                if self.profiler is not None:  # starting, stopping and the report: off the clock
                    with self.off_the_clock():
                        self.profiler.before(c.iteration + 1)
                self.train_step()
                if self.profiler is not None:
                    with self.off_the_clock():
                        self.profiler.after(c.iteration)
                if c.iteration % self.cfg.logging.log_interval == 0 or self._nan_limit_reached():
                    self.log_interval()
            if self._nan_limit_reached():
                raise NonFiniteError(
                    f"stopping at iteration {c.iteration}: the loss was NaN/Inf in {self.nan_streak} consecutive "
                    f"iterations (training.exit_on_nan_iterations={t.exit_on_nan_iterations}); not saving"
                    f"{self._latest_note()}. Lower training.lr or check the data, then resume")
            if t.eval_interval and c.iteration % t.eval_interval == 0:
                with self.off_the_clock():
                    self.evaluate()
            if self.checkpointer is not None:
                self.checkpointer.poll()
            interval = t.check_replicas_interval
            saving = self.checkpointer is not None and self.checkpointer.due(c.iteration)
            if interval and c.iteration % interval == 0 and not saving:  # a save checks them itself
                self.check_replicas()
            reason = self.stop_reason()
            if self.checkpointer is not None and (self.checkpointer.due(c.iteration) or reason):
                with self.off_the_clock():
                    self.save(final=bool(reason))
            if reason and self.logs_failed:
                raise LogWriteError(self._after_log_failure(reason))
            if reason:
                self._say(f"stopping at iteration {c.iteration}: {reason}")
                return reason
        if t.eval_interval and self.evaluated_at != c.iteration and c.iteration > 0:
            self.evaluate()
        self.save(final=True)
        if self._any_rank(self.log_failure is not None):  # the last evaluation's records
            raise LogWriteError(self._after_log_failure(self.log_failure or ""))
        return "train_iters reached"

    def train_step(self) -> None:
        c, t = self.counters, self.cfg.training
        gbs = self.rampup.global_batch_size(c.consumed_samples)
        if gbs != self.engine_gbs:
            self.engine.set_micro_batches(gbs // (t.micro_batch_size * self.pstate.dp_size), t.micro_batch_size)
            self.engine_gbs = gbs
        lr = self.schedule.lr_at(c.lr_iterations, c.lr_samples)
        self.engine.set_lr(lr)
        if self.zeros is not None:
            self.zeros.reset()
        start = time.perf_counter() if self.clock_mark is None else self.clock_mark
        micro_batches = self._take_batches(c.consumed_samples, gbs)
        prefetch = self._prefetch_after(c.consumed_samples + gbs, c.iteration + 1)
        if self.rank_clock is not None and not self.rank_clock.running:  # the first lap starts with this step
            self.rank_clock.start()
        with self.compile_clock:
            loss = self.engine.train_step(micro_batches, prepare_next=prefetch)
        self.clock_mark = time.perf_counter()
        if self.rank_clock is not None:  # the lap: from the last iteration's end (the loop's work since) to here
            self.straggler.add(c.iteration + 1, self.rank_clock.lap())
        elapsed = self.clock_mark - start - getattr(self.compile_clock, "spent", 0.0)
        self.stats_step_seconds = elapsed
        applied = self.engine.step_applied
        c.advance(gbs, self.cfg.model.seq_length, applied)
        self.stats.add(loss, elapsed, skipped=not applied)
        self.nan_streak = 0 if math.isfinite(loss) else self.nan_streak + 1
        self.last = {"lr": lr, "global_batch_size": gbs, "grad_norm": self.engine.grad_norm if applied else None,
                     "step_applied": applied}

    def _take_batches(self, consumed: int, gbs: int) -> List[dict]:
        """The micro-batches of the global batch after `consumed` samples: the ones prefetched during the previous
        iteration when they are these, else drawn now."""
        ready, self.prefetched = self.prefetched, None
        if ready is not None and ready[0] == (consumed, gbs):
            return ready[1]
        return self.train_source.micro_batches(consumed, gbs)

    def _prefetch_after(self, consumed: int, iteration: int) -> Optional[Callable[[], None]]:
        """What the engine calls once iteration `iteration`'s last backward is queued, before the host next waits
        for the device (for the loss, or in DeepSpeed's own step for the gradient norm): draw the next global batch,
        the one after `consumed` samples, and queue its copy to the device, so that neither is left between that
        step's end and the next forward, with the device idle. None when the next iteration draws no batch to
        train on (there is none, or it is skipped). A batch that fails to draw is drawn again in its own
        iteration, which then fails: never the step of this one."""
        following = iteration + 1
        if following > self.train_iters or self.skip_ranges.range_of(following) is not None:
            return None
        gbs = self.rampup.global_batch_size(consumed)

        def prefetch() -> None:
            try:
                self.prefetched = ((consumed, gbs), self.engine.to_device(self.train_source.micro_batches(consumed,
                                                                                                        gbs)))
            except Exception:  # noqa: BLE001 - raised again, in its own iteration, by _take_batches
                self.prefetched = None
        return prefetch

    @contextlib.contextmanager
    def off_the_clock(self):
        """Leave the block's time out of the next iteration's elapsed time (evaluation, saves, skipped iterations,
        the profiler's own work)."""
        start = time.perf_counter()
        try:
            with self.rank_clock.paused() if self.rank_clock is not None else contextlib.nullcontext():
                yield
        finally:
            if self.clock_mark is not None:
                self.clock_mark += time.perf_counter() - start

    def skip_step(self, skip: tuple) -> None:
        """An iteration of a skip range: draw this global batch and discard it (no forward, backward or
        optimizer step); the counters advance as a trained iteration's would, LR schedule included."""
        c = self.counters
        if skip != self.skipping:
            self.skipping = skip
            self._say(f"skipping iterations {max(skip[0], c.iteration + 1)}-{min(skip[1], self.train_iters)} "
                      f"(training.skip_train_iteration_range): their global batches are drawn and discarded; "
                      "iterations, consumed samples and the LR schedule advance as if trained")
        gbs = self.rampup.global_batch_size(c.consumed_samples)
        lr = self.schedule.lr_at(c.lr_iterations, c.lr_samples)
        self.train_source.micro_batches(c.consumed_samples, gbs)  # drawn, as a data loader would, then dropped
        c.advance(gbs, self.cfg.model.seq_length, step_applied=True)
        if self.is_log_rank:
            with self.writing_logs():
                self.metrics.write_skipped_data(c.iteration, c.consumed_samples, c.consumed_tokens, gbs, lr)

    # -- the log line --------------------------------------------------------------------------
    def log_interval(self) -> None:
        """The log line, its record in the metrics file and TensorBoard, the timers and the memory (every rank:
        num zeros, params norm and the memory's maximum are collectives). The memory figures are the allocator's
        (or the process's) host-side counters, reduced on the host: the log line reads nothing from the device."""
        lg = self.cfg.logging
        iteration, iterations = self.counters.iteration, self.stats.iterations
        interval = self.stats.pop()
        num_zeros = self.zeros.total(self.last["step_applied"]) if self.zeros is not None else None
        params_norm = self.engine.params_norm() if lg.log_params_norm else None
        phases = self.phases_ms(iterations, interval["elapsed_s"])
        report_memory = not self.memory_reported and self.last["step_applied"]
        kept = lg.metrics_file or lg.tensorboard_dir  # where the memory figures go at every log line
        usage = memory_usage(self.pstate.device) if report_memory or kept else {}
        largest = self._largest_over_ranks(usage) if usage and kept else None
        if self.straggler is not None:  # every rank's goes out with this iteration's stop all-reduce
            self.own_seconds = self.straggler.interval_seconds()
        if self.is_log_rank:
            record = self.record(interval, num_zeros, params_norm, largest)
            self.log(format_log_line(**record))
            if phases is not None:
                self.log(format_timers_line(phases))
            with self.writing_logs():
                self.metrics.write(record)
                self.tensorboard.add_metrics(record)
                if phases is not None:
                    self.metrics.write_timers(iteration, phases)
                    self.tensorboard.add_timers(iteration, phases)
                if largest is not None:
                    self.tensorboard.add_memory(iteration, largest)
        if report_memory:
            self.memory_reported = True
            if self.pstate.dp_rank == 0 and usage:  # Megatron: one report per model-parallel rank
                self.log(format_memory_line(self.pstate.rank, iteration, usage))

    def _largest_over_ranks(self, usage: dict) -> dict:
        """Each of `memory_usage`'s numbers, the largest over all ranks: one all-reduce MAX over the host group (a
        device tensor read back would make the host wait for the work queued on the device)."""
        if self.host_group is None:
            return dict(usage)
        values = torch.tensor(list(usage.values()), dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.host_group)
        return dict(zip(usage, values.tolist()))

    def phases_ms(self, iterations: int, elapsed_s: float) -> Optional[dict]:
        """With logging.timers: ms per iteration of each timed phase over the interval, and the rest of the
        elapsed time (the loss's dp all-reduce, the loop's work between steps) as `other`; then the timers restart."""
        seconds = self.engine.phase_seconds
        if seconds is None:
            return None
        phases = {name: 1e3 * seconds.get(name, 0.0) / max(1, iterations)
                  for name in ("batch", "forward", "backward", "micro-step", "optimizer")}
        phases["other"] = 1e3 * elapsed_s - sum(phases.values())
        seconds.clear()
        return phases

    def record(self, interval: dict, num_zeros: Optional[float], params_norm: Optional[float] = None,
               memory: Optional[dict] = None) -> dict:
        """Every field of the log line and of a metrics-file object (`memory`: the largest `memory_usage` over the
        ranks, for the memory fields). The loss scale is the engine's (1.0 unless fp16 scales); the time left: the
        samples still to train at this interval's time per sample."""
        c, gbs, elapsed = self.counters, self.last["global_batch_size"], interval["elapsed_s"]
        seq = self.cfg.model.seq_length
        return {"iteration": c.iteration, "train_iters": self.train_iters, "consumed_samples": c.consumed_samples,
                "consumed_tokens": c.consumed_tokens, "elapsed_s": elapsed, "lr": self.last["lr"],
                "global_batch_size": gbs, "lm_loss": interval["lm_loss"],
                "loss_scale": self.engine.loss_scale,
                "grad_norm": self.last["grad_norm"], "num_zeros": num_zeros, "params_norm": params_norm,
                "skipped_iterations": interval["skipped_iterations"],
                "nan_iterations": interval["nan_iterations"], "samples_per_second": gbs / elapsed,
                "tokens_per_second": gbs * seq / elapsed, "tflops": self.tflops(gbs, elapsed),
                "time_left_s": max(0, self.total_samples - c.consumed_samples) * elapsed / gbs,
                **peak_memory_fields(memory)}

    def tflops(self, global_batch_size: int, sec_per_iter: float) -> float:
        m, p = self.cfg.model, self.pstate
        return tflops_per_gpu(num_layers=m.num_layers, hidden_size=m.hidden_size,
                              vocab_size=m.padded_vocab_size(p.tp_size), seq_length=m.seq_length,
                              global_batch_size=global_batch_size, sec_per_iter=sec_per_iter,
                              num_gpus=p.world_size, recompute=self.cfg.training.activation_checkpointing,
                              formula=self.cfg.logging.tflops_formula, tp_size=p.tp_size,
                              ffn_hidden_size=m.ffn_hidden_size)

    # -- evaluation ----------------------------------------------------------------------------
    def evaluate(self) -> Optional[float]:
        """Each validation set's mean lm loss over its first eval_iters global batches, logged per named set;
        returns the total: the mean over the sets (each read the same number of samples)."""
        t, c = self.cfg.training, self.counters
        self.evaluated_at = c.iteration
        if not self.valid_sources or t.eval_iters == 0:
            return None
        losses = {name: self._eval_loss(source) for name, source in self.valid_sources.items()}
        total = sum(losses.values()) / len(losses)
        if self.is_log_rank:
            per_set = {name: loss for name, loss in losses.items() if name is not None}
            self.log(format_eval_block(c.iteration, total, per_set))
            records = [eval_record(c.iteration, c.consumed_samples, c.consumed_tokens, loss, name)
                       for name, loss in per_set.items()]
            records.append(eval_record(c.iteration, c.consumed_samples, c.consumed_tokens, total))
            with self.writing_logs():
                for record in records:
                    self.metrics.write_eval(record)
                    self.tensorboard.add_eval(record)
        return total

    def _eval_loss(self, source) -> float:
        gbs, n = self.cfg.training.global_batch_size, self.cfg.training.eval_iters
        return sum(self.engine.eval_step(source.micro_batches(k * gbs, gbs)) for k in range(n)) / n

    # -- exits and checkpoints -----------------------------------------------------------------
    def stop_reason(self) -> Optional[str]:
        """Why to stop after this iteration, agreed by all ranks (one all-reduce MAX), or None."""
        t = self.cfg.training
        minutes = (time.time() - self.start_time) / 60.0
        killed = t.kill_switch_path is not None and os.path.exists(t.kill_switch_path)
        save_failed = self.checkpointer is not None and self.checkpointer.failed()  # an async save, seen here
        mine = StopFlags(signal=self.signals.received or 0, kill_switch=killed,
                         out_of_time=t.exit_duration_in_mins is not None and minutes > t.exit_duration_in_mins,
                         stop_requested=self.signals.requested is not None, save_failed=save_failed,
                         log_failed=self.log_failure is not None)
        values = mine.values()
        own, self.own_seconds = self.own_seconds, None
        if own is not None:  # a log line's iteration: each rank's own time in its own slot
            values += self.straggler.slots(own)
        if self.host_group is not None:  # on the host: no wait for the step queued on the device
            values = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.host_group)
            values = values.tolist()
        flags = StopFlags.from_values(values)
        if own is not None:
            self.report_stragglers(values[StopFlags.count():])
        if flags.save_failed:  # every rank raises the save's CheckpointSaveError here, at this iteration
            self.checkpointer.wait()
            from gptpar.checkpoint.exceptions import CheckpointSaveError

            raise CheckpointSaveError("another rank's checkpoint writer failed (its message says why); `latest` "
                                      "was not moved")
        if flags.log_failed:  # the loop saves, then raises LogWriteError on every rank
            self.logs_failed = True
            return self.log_failure or "the log rank could not write its logs (its line says why)"
        if flags.signal > 0:
            return f"received {signal.Signals(int(flags.signal)).name}"
        if flags.stop_requested:  # the reason is said by the ranks that asked (the others only see the flag)
            return self.signals.requested or "another rank asked to stop and save (its own line says why)"
        if flags.kill_switch:
            return f"kill switch {t.kill_switch_path} found (training.kill_switch_path); remove it to resume"
        if flags.out_of_time:
            return f"exit_duration_in_mins ({t.exit_duration_in_mins}) reached"
        if t.exit_interval and self.counters.iteration % t.exit_interval == 0:
            return f"exit_interval ({t.exit_interval}) reached"
        return None

    def report_stragglers(self, slots: List[float]) -> None:
        """The straggler lines and each rank's own time in TensorBoard, from the stop all-reduce's slots (of the
        interval before the last log line's)."""
        seconds = self.straggler.seconds_of(slots)
        if seconds is None or not self.is_log_rank:
            return
        for line in self.straggler.lines(seconds):
            self.log(line)
        self.tensorboard.add_rank_compute(self.straggler.reported[1], seconds)

    def _nan_limit_reached(self) -> bool:
        limit = self.cfg.training.exit_on_nan_iterations
        return bool(limit) and self.nan_streak >= limit

    def save(self, final: bool = False) -> None:
        """A checkpoint of this iteration, as the checkpointer's policy decides (gptpar.checkpoint.checkpointer:
        nothing without checkpoint.save or when saved already; refused while the weights hold NaN/Inf)."""
        if self.checkpointer is not None:
            self.checkpointer.iteration_seconds = self.stats_step_seconds
            self.checkpointer.save(self.engine, self.counters.iteration, self.client_state(), self.tracker, final)

    def check_replicas(self, saving: bool = False) -> None:
        """Raise ReplicaDivergenceError when replicated parameters differ across their replicas
        (gptpar.training.replicas; a collective: every rank calls it)."""
        divergence = check_replicas(self.engine, self.pstate, self.host_group)
        if divergence is None:
            return
        action = f"not saving iteration {self.counters.iteration}" if saving else \
            f"stopping at iteration {self.counters.iteration} without saving"
        raise ReplicaDivergenceError(
            f"replica check: {divergence}: {action}{self._latest_note()}. Replicas that must be bitwise equal are "
            "not: the ranks ran different kernels (training.compile without inductor's deterministic mode, "
            "nondeterministic kernels) or a device corrupted a value; resume from `latest` (look at the named "
            "ranks' devices first)")

    def _latest_note(self) -> str:
        return self.checkpointer.latest_note() if self.checkpointer is not None else ""

    def client_state(self) -> dict:
        c = self.counters
        return dict(asdict(c), global_batch_size=self.rampup.global_batch_size(c.consumed_samples),
                    lr=self.schedule.lr_at(c.lr_iterations, c.lr_samples), train_iters=self.train_iters,
                    lr_schedule=self.schedule.to_dict(), config=self.cfg.to_dict())

    def resume(self) -> None:
        """Load the checkpoint `checkpoint.load` points at (if any) and continue its counters and, when it was
        saved with another LR schedule, follow training.lr_schedule_on_resume (said in one line)."""
        if self.checkpointer is None:
            return
        state = self.checkpointer.load(self.engine, self.tracker)
        if state is not None:
            self.counters = c = Counters(**{k: state[k] for k in asdict(Counters())})
            self.schedule, note = resumed_schedule(saved_schedule(state), self.schedule, c.lr_iterations,
                                                   c.lr_samples, c.iteration + 1,
                                                   self.cfg.training.lr_schedule_on_resume == "checkpoint")
            if note and self.nothing_to_train() is None:  # a finished run trains no iteration under it
                self._say(note)

    def nothing_to_train(self) -> Optional[str]:
        """The line a resumed run that already reached train_iters ends with (None while there is training to do):
        pretrain_gpt.py then exits 0 without training, evaluating or saving."""
        c, t = self.counters, self.cfg.training
        if c.iteration == 0 or c.iteration < self.train_iters:
            return None
        limit = ("training.train_iters" if t.train_iters is not None
                 else f"the {self.train_iters} iterations of training.train_samples={t.train_samples}")
        return (f"nothing to train: the checkpoint is at iteration {c.iteration} "
                f"{'=' if c.iteration == self.train_iters else '>'} {limit}"
                f"{f' ({self.train_iters})' if t.train_iters is not None else ''}; raise "
                f"{'training.train_iters' if t.train_iters is not None else 'training.train_samples'} to train on")

    def _after_log_failure(self, reason: str) -> str:
        """The line a log write that failed ends the run with: why, and the checkpoint saved before stopping."""
        c, save = self.counters, self.cfg.checkpoint.save
        if save and self.checkpointer is not None and self.checkpointer.saved_at == c.iteration:
            kept = f"saved iteration {c.iteration} to {save} first: resume from it once the logs can be written"
        elif save:
            kept = f"nothing saved at iteration {c.iteration}{self._latest_note()}"
        else:
            kept = "not saved (checkpoint.save is unset)"
        return f"{reason} at iteration {c.iteration}; {kept}"

    def _any_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on some rank (one all-reduce MAX over the host group)."""
        if self.host_group is None:
            return flag
        value = torch.tensor([float(flag)], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.host_group)
        return value.item() > 0

    def _say(self, message: str) -> None:
        if self.is_log_rank:
            self.log(message)

    # -- writers -------------------------------------------------------------------------------
    def _open_writers(self) -> None:
        lg = self.cfg.logging
        on = self.is_log_rank
        self.metrics, self.tensorboard = MetricsWriter(None), TensorBoardWriter(None)
        with self.writing_logs():
            self.metrics = MetricsWriter(lg.metrics_file if on else None)
            self.tensorboard = TensorBoardWriter(lg.tensorboard_dir if on else None, lg.tensorboard_tags)

    @contextlib.contextmanager
    def writing_logs(self):
        """The log rank's writes to the metrics file and TensorBoard. One that fails is kept as `log_failure` and
        the writers are dropped: every rank learns it at this iteration's stop check, saves and stops (exit 1)."""
        try:
            yield
        except LogWriteError as e:
            self.log_failure = self.log_failure or str(e)
            self._close_writers()
            self.metrics, self.tensorboard = MetricsWriter(None), TensorBoardWriter(None)

    def _close_writers(self) -> None:
        if self.tensorboard is not None:
            try:
                self.tensorboard.close()
            except LogWriteError as e:  # its last events did not reach the disk
                self.log_failure = self.log_failure or str(e)


__all__ = ["Trainer", "NonFiniteError", "Counters", "StopSignals", "STOP_SIGNALS"]
