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
goes to the metrics JSONL and TensorBoard (gptpar.training.logging). Skipped iterations are counted
from the engine's `step_applied`, NaN iterations from the loss, num zeros from the gradients the optimizer
steps on (only with logging.log_num_zeros, else omitted), params norm from the master weights (only with
logging.log_params_norm), TFLOPs from gptpar.estimate.flops; num zeros and params norm count each parameter
of the model once. After the first log line whose step was applied (the optimizer state then exists), every
rank of the first dp replica prints Megatron's memory report (`[Rank r] (after N iterations) memory (MB) | ...`);
each log line's memory in use, the largest over the ranks, goes to TensorBoard.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from gptpar.estimate.flops import tflops_per_gpu
from gptpar.parallel import host_group
from gptpar.training.engine import ZeroCounter
from gptpar.training.logging import (IntervalStats, MetricsWriter, TensorBoardWriter, eval_record, format_eval_block,
                                     format_log_line, format_memory_line, format_timers_line, memory_usage)
from gptpar.training.profiling import IterationProfiler
from gptpar.schedules import BatchSizeRampup, LearningRateSchedule, SkipRanges, train_iters

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


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


class StopSignals:
    """SIGTERM / SIGUSR1 set a flag; the loop finishes the iteration, saves and exits 0. `request(reason)` does
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
                 log=print):
        """`valid_sources`: {validation set name, or None for the only unnamed set: BatchSource}."""
        self.cfg, self.pstate, self.engine, self.log = cfg, pstate, engine, log
        self.train_source, self.valid_sources = train_source, valid_sources
        self.checkpointer, self.tracker = checkpointer, tracker
        t = cfg.training
        self.train_iters = train_iters(t, pstate.dp_size)
        self.rampup = BatchSizeRampup.from_config(t, pstate.dp_size)
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
        self.saved_at = self.evaluated_at = None
        self.nan_streak = 0  # consecutive iterations with a NaN/Inf loss (the same on every rank: the loss is)
        self.is_log_rank = pstate.is_last_stage and pstate.dp_rank == 0 and pstate.tp_rank == 0
        self.zeros = ZeroCounter(engine, pstate) if cfg.logging.log_num_zeros else None
        self.memory_reported = False  # Megatron's report_memory_flag: the per-rank report, once
        self.metrics = self.tensorboard = None
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
            reason = self.stop_reason()
            if self._save_due() or reason:
                with self.off_the_clock():
                    self.save(final=bool(reason))
            if reason:
                self._say(f"stopping at iteration {c.iteration}: {reason}")
                return reason
        if t.eval_interval and self.evaluated_at != c.iteration and c.iteration > 0:
            self.evaluate()
        if self.cfg.checkpoint.save and self.saved_at != c.iteration:
            self.save(final=True)
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
        with self.compile_clock:
            loss = self.engine.train_step(micro_batches, prepare_next=prefetch)
        self.clock_mark = time.perf_counter()
        elapsed = self.clock_mark - start - getattr(self.compile_clock, "spent", 0.0)
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
            self.metrics.write_skipped_data(c.iteration, c.consumed_samples, c.consumed_tokens, gbs, lr)

    # -- the log line --------------------------------------------------------------------------
    def log_interval(self) -> None:
        """The log line, its record in the metrics file and TensorBoard, the timers and the memory (every rank:
        num zeros, params norm and the memory's maximum are collectives)."""
        iteration, iterations = self.counters.iteration, self.stats.iterations
        interval = self.stats.pop()
        num_zeros = self.zeros.total(self.last["step_applied"]) if self.zeros is not None else None
        params_norm = self.engine.params_norm() if self.cfg.logging.log_params_norm else None
        phases = self.phases_ms(iterations, interval["elapsed_s"])
        report_memory = not self.memory_reported and self.last["step_applied"]
        usage = memory_usage(self.pstate.device) if report_memory or self.cfg.logging.tensorboard_dir else {}
        largest = self._largest_over_ranks(usage) if usage and self.cfg.logging.tensorboard_dir else None
        if self.is_log_rank:
            record = self.record(interval, num_zeros, params_norm)
            self.log(format_log_line(**record))
            self.metrics.write(record)
            self.tensorboard.add_metrics(record)
            if phases is not None:
                self.log(format_timers_line(phases))
                self.metrics.write_timers(iteration, phases)
                self.tensorboard.add_timers(iteration, phases)
            if largest is not None:
                self.tensorboard.add_memory(iteration, largest)
        if report_memory:
            self.memory_reported = True
            if self.pstate.dp_rank == 0 and usage:  # Megatron: one report per model-parallel rank
                self.log(format_memory_line(self.pstate.rank, iteration, usage))

    def _largest_over_ranks(self, usage: dict) -> dict:
        """Each of `memory_usage`'s numbers, the largest over all ranks (one all-reduce MAX)."""
        values = torch.tensor(list(usage.values()), dtype=torch.float64, device=self.pstate.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
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

    def record(self, interval: dict, num_zeros: Optional[float], params_norm: Optional[float] = None) -> dict:
        """Every field of the log line (and of a metrics-file object)."""
        c, gbs, elapsed = self.counters, self.last["global_batch_size"], interval["elapsed_s"]
        return {"iteration": c.iteration, "train_iters": self.train_iters, "consumed_samples": c.consumed_samples,
                "consumed_tokens": c.consumed_tokens, "elapsed_s": elapsed, "lr": self.last["lr"],
                "global_batch_size": gbs, "lm_loss": interval["lm_loss"], "loss_scale": self.engine.loss_scale,
                "grad_norm": self.last["grad_norm"], "num_zeros": num_zeros, "params_norm": params_norm,
                "skipped_iterations": interval["skipped_iterations"],
                "nan_iterations": interval["nan_iterations"], "samples_per_second": gbs / elapsed,
                "tflops": self.tflops(gbs, elapsed)}

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
        flags = [self.signals.received or 0, killed, t.exit_duration_in_mins is not None
                 and minutes > t.exit_duration_in_mins, self.signals.requested is not None, save_failed]
        if self.host_group is not None:  # on the host: no wait for the step queued on the device
            flags = torch.tensor(flags, dtype=torch.float64)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.host_group)
            flags = flags.tolist()
        if flags[4] > 0:  # every rank raises the save's CheckpointSaveError here, at this iteration
            self.checkpointer.wait()
            from gptpar.checkpoint.checkpointer import CheckpointSaveError

            raise CheckpointSaveError("another rank's checkpoint writer failed (its message says why); `latest` "
                                      "was not moved")
        if flags[0] > 0:
            return f"received {signal.Signals(int(flags[0])).name}"
        if flags[3] > 0:  # the reason is said by the ranks that asked (the others only see the flag)
            return self.signals.requested or "another rank asked to stop and save (its own line says why)"
        if flags[1] > 0:
            return f"kill switch {t.kill_switch_path} found (training.kill_switch_path); remove it to resume"
        if flags[2] > 0:
            return f"exit_duration_in_mins ({t.exit_duration_in_mins}) reached"
        if t.exit_interval and self.counters.iteration % t.exit_interval == 0:
            return f"exit_interval ({t.exit_interval}) reached"
        return None

    def _save_due(self) -> bool:
        ck = self.cfg.checkpoint
        return bool(ck.save and ck.save_interval and self.counters.iteration % ck.save_interval == 0)

    def _nan_limit_reached(self) -> bool:
        limit = self.cfg.training.exit_on_nan_iterations
        return bool(limit) and self.nan_streak >= limit

    def save(self, final: bool = False) -> None:
        """Save a checkpoint, unless the weights hold NaN/Inf: then refuse (`latest` keeps the last finite
        checkpoint); a refused final save ends the run with NonFiniteError."""
        if self.checkpointer is None or not self.cfg.checkpoint.save or self.saved_at == self.counters.iteration:
            return
        if not self.weights_finite():
            message = (f"not saving iteration {self.counters.iteration}: the weights hold NaN/Inf"
                       f"{self._latest_note()}")
            if final:
                raise NonFiniteError(message)
            self._say(f"warning: {message}")
            return
        start = time.time()
        path = self.checkpointer.save(self.engine, self.counters.iteration, self.client_state(), self.tracker)
        self.saved_at = self.counters.iteration
        if self.cfg.checkpoint.async_save:
            self._say(f"saving checkpoint {path} in the background (training stopped {time.time() - start:.2f} s "
                      "for it)")
        else:
            self._say(f"saved checkpoint {path} in {time.time() - start:.2f} s")

    def weights_finite(self) -> bool:
        """Whether every rank's weights are finite (one all-reduce MAX of a flag)."""
        bad = any(not bool(torch.isfinite(p).all()) for p in self.engine.parameters())
        flag = torch.tensor([float(bad)], device=self.pstate.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() == 0

    def _latest_note(self) -> str:
        from gptpar.checkpoint.checkpointer import CheckpointError, read_latest

        save = self.cfg.checkpoint.save
        if not save:
            return ""
        if self.checkpointer is not None:
            self.checkpointer.wait()  # `latest` as it will stay
        try:
            latest = read_latest(save)
        except CheckpointError:
            latest = None
        return f"; `latest` in {save} stays at {latest}" if latest else f"; {save} holds no checkpoint"

    def client_state(self) -> dict:
        c = self.counters
        return dict(asdict(c), global_batch_size=self.rampup.global_batch_size(c.consumed_samples),
                    lr=self.schedule.lr_at(c.lr_iterations, c.lr_samples), train_iters=self.train_iters,
                    config=self.cfg.to_dict())

    def resume(self) -> None:
        """Load the checkpoint `checkpoint.load` points at (if any) and continue its counters."""
        if self.checkpointer is None:
            return
        state = self.checkpointer.load(self.engine, self.tracker)
        if state is not None:
            self.counters = Counters(**{k: state[k] for k in asdict(Counters())})
            self.saved_at = self.counters.iteration

    def _say(self, message: str) -> None:
        if self.is_log_rank:
            self.log(message)

    # -- writers -------------------------------------------------------------------------------
    def _open_writers(self) -> None:
        lg = self.cfg.logging
        on = self.is_log_rank
        self.metrics = MetricsWriter(lg.metrics_file if on else None)
        self.tensorboard = TensorBoardWriter(lg.tensorboard_dir if on else None, lg.tensorboard_tags)

    def _close_writers(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


__all__ = ["Trainer", "NonFiniteError", "Counters", "StopSignals", "STOP_SIGNALS"]
