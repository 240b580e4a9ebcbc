"""The step: `TrainEngine` runs one optimizer step per `train_step` over this data-parallel rank's micro-batches,
the same way for a plain (pp = 1) and a pipelined model, and exposes what the log line reads (loss scale, grad
norm, params norm, skipped steps, the phase timers); `ZeroCounter` counts the zero gradients. Every model-wide
sum counts each parameter once (`counted_once`).

A micro-batch is a dict: `input_ids` (b, s) and `labels` (b, s) long tensors, and optionally
`loss_mask` (b, s) float, `attention_mask` (b, 1, s, s) bool (True = may attend), `position_ids` (b, s).
The data pipeline builds them on the host; `train_step` / `eval_step` move every tensor to the engine's
device in one place (`to_device`) before anything else sees them, for pp = 1 and pp > 1 alike.

The trainer and the checkpointer talk to `TrainEngine`, never to the DeepSpeed engine it holds (`.ds`); its
checkpoint and optimizer-state methods are one-line doors into checkpointing.py and optimizer_state.py.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

import gptpar.training.engine.checkpointing as checkpointing
import gptpar.training.engine.optimizer_state as optimizer_state
from gptpar.tensor_parallel.float8 import invalidate_float8_weights, refresh_float8_weights
from gptpar.training.engine.deepspeed_api import DEEPSPEED_VERSION
from gptpar.training.engine.host_scalar import HostScalar


class TrainEngine:
    """One optimizer step per `train_step`, for a plain (pp = 1) or pipelined model."""

    def __init__(self, ds_engine, pstate, pipelined: bool, fusion: Optional[str] = None, skip=None):
        self.ds, self.pstate, self.pipelined = ds_engine, pstate, pipelined
        self.fusion = fusion  # what build_engine did about gradient-accumulation fusion (None: not asked for)
        # deepspeed_api.DeviceSkip where the NaN/Inf skip is decided on the device: its outcome is settled into
        # DeepSpeed's counters before anything reads them (`_settle`)
        self.skip = skip
        self.device = torch.device(ds_engine.device)
        self.checkpoint_writer = None  # gptpar's CheckpointWriter once `install_checkpoint_writer` ran
        self.phase_seconds: Optional[Dict[str, float]] = None  # `time_phases()` turns the timers on

    # -- the step ------------------------------------------------------------------------------
    def train_step(self, micro_batches: List[dict], prepare_next: Optional[Callable[[], None]] = None) -> float:
        """Forward, backward and optimizer step over this dp rank's micro-batches.

        Returns the loss averaged over the micro-batches and the data-parallel ranks (on every rank).
        `prepare_next` (the trainer's prefetch of the next batch) is called once the last backward is queued,
        before the optimizer step is queued and the loss read (the host's next wait for the device). Under
        precision fp8 the weights' float8 casts are made once here, used by every micro-batch, and invalidated
        when the step ends (DeepSpeed's update writes the weights where no forward can see it)."""
        self._settle()
        with self._float8_weights_cast():
            return self._train_step(micro_batches, prepare_next)

    def to_device(self, micro_batches: List[dict]) -> List[dict]:
        """The micro-batches' tensors on this rank's device (copies queued, non-blocking from pinned memory)."""
        return [to_device(mb, self.device) for mb in micro_batches]

    @contextlib.contextmanager
    def _float8_weights_cast(self):
        """gptpar.tensor_parallel.float8.refresh_float8_weights for the step, then invalidate (a no-op without fp8)."""
        refresh_float8_weights(self.ds.module)
        try:
            yield
        finally:
            invalidate_float8_weights(self.ds.module)

    def _settle(self) -> None:
        """The last step's outcome, where the device decided it, into DeepSpeed's counters (skipped steps, step
        applied, grad norm): read from the norm's host copy, without waiting for the optimizer step."""
        if self.skip is not None:
            self.skip.settle()

    def _train_step(self, micro_batches: List[dict], prepare_next) -> float:
        self.ds.train()
        with self._phase("batch"):
            micro_batches = self.to_device(micro_batches)  # a no-op for prefetched ones
        if self.pipelined:  # DeepSpeed's schedule runs the step inside train_batch
            loss = self.ds.train_batch(data_iter=iter([_pipe_batch(mb) for mb in micro_batches]))
            if prepare_next is not None:
                prepare_next()
            return float(loss)
        losses = []
        for i, mb in enumerate(micro_batches):
            # Explicit boundary: DeepSpeed's micro-step counter misplaces it after a ramp-up changes the
            # number of micro-batches (a step mid-batch, then a skipped one).
            last = i == len(micro_batches) - 1
            self.ds.set_gradient_accumulation_boundary(last)
            with self._phase("forward"):
                loss = self.ds(**mb)
            with self._phase("backward"):
                self.ds.backward(loss)
            losses.append(loss.detach().float())
            if last:
                # The mean is read as soon as the work queued before it is done, not after the optimizer step
                # queued below: the host then logs and queues the next forward while the device still steps.
                mean = HostScalar(_dp_mean(torch.stack(losses).mean(), self.pstate))
                if prepare_next is not None:
                    prepare_next()
            with self._phase("optimizer" if last else "micro-step"):  # reduce, clip, step / bookkeeping
                self.ds.step()
        return mean.value()

    def time_phases(self) -> None:
        """Time each phase of `train_step` from now on (pp = 1): seconds summed in `phase_seconds`."""
        if self.pipelined:
            raise ValueError("logging.timers: the phases are timed at pp = 1 only (DeepSpeed's pipeline engine "
                             "interleaves them across micro-batches); set it false for pp > 1")
        self.phase_seconds = defaultdict(float)

    def _phase(self, name: str):
        """A context that times `name` when the timers are on, else a shared no-op (the step's hot path)."""
        return _NO_TIMER if self.phase_seconds is None else self._timed(name)

    @contextlib.contextmanager
    def _timed(self, name: str):
        _synchronize(self.device)
        start = time.perf_counter()
        yield
        _synchronize(self.device)
        self.phase_seconds[name] += time.perf_counter() - start

    @torch.no_grad()
    def eval_step(self, micro_batches: List[dict]) -> float:
        """Mean loss over the micro-batches and dp ranks, without updating anything (fp8: casts as train_step)."""
        self._settle()
        with self._float8_weights_cast():
            return self._eval_step(micro_batches)

    def _eval_step(self, micro_batches: List[dict]) -> float:
        self.ds.eval()
        micro_batches = [to_device(mb, self.device) for mb in micro_batches]
        if self.pipelined:
            loss = self.ds.eval_batch(data_iter=iter([_pipe_batch(mb) for mb in micro_batches]),
                                      num_micro_batches=len(micro_batches))
            return float(loss)
        losses = [self.ds.module(**mb).float() for mb in micro_batches]
        return float(_dp_mean(torch.stack(losses).mean(), self.pstate))

    def set_lr(self, lr: float) -> None:
        for group in self.ds.optimizer.param_groups:
            group["lr"] = lr

    def set_micro_batches(self, num_micro_batches: int, micro_batch_size: int) -> None:
        """Follow a batch-size ramp-up: the engine's accumulation steps and train batch size."""
        self.ds.set_train_batch_size(num_micro_batches * micro_batch_size * self.pstate.dp_size)

    # -- what the trainer and the checkpointer need --------------------------------------------
    def parameters(self):
        """This rank's model parameters (its tp shard of its pipeline stage)."""
        return self.ds.module.parameters()

    def named_parameters(self):
        """This rank's parameters under the names of the module it trains (GPTModel's or the PipelineModule's)."""
        return self.ds.module.named_parameters()

    def tied_weights(self):
        """[(weight, group)] of the pipeline's tied weights on this stage (the embedding on the first and last);
        [] at pp = 1."""
        from gptpar.training.engine.deepspeed_api import tied_weights

        return tied_weights(self.ds.module)

    # -- checkpoints (checkpointing.py) and one parameter's full optimizer state (optimizer_state.py) -------------
    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict) -> None:
        """DeepSpeed's part of checkpoint `tag` (model and optimizer shards); `latest` is gptpar's to move."""
        self._settle()  # DeepSpeed saves its skipped steps
        checkpointing.save(self.ds, save_dir, tag, client_state)

    def install_checkpoint_writer(self, writer) -> None:
        """Route every checkpoint file through `writer` (gptpar.checkpoint.writer.CheckpointWriter: checksums, async)."""
        checkpointing.install_writer(self.ds, writer)
        self.checkpoint_writer = writer

    def load_checkpoint(self, directory: str, tag: str) -> bool:
        """Restore DeepSpeed's part of checkpoint `tag`; False when DeepSpeed found nothing to load."""
        self._settle()
        return checkpointing.load(self.ds, directory, tag)

    def set_full_state(self, param: torch.Tensor, fp32: torch.Tensor, moments: Dict[str, torch.Tensor],
                       step: float) -> None:
        """Give `param` (this rank's tp slice, whole over dp) its fp32 master weight, Adam moments and step."""
        optimizer_state.set_full_state(self.ds, param, fp32, moments, step)

    def full_state(self, param: torch.Tensor) -> dict:
        """{"fp32", each Adam moment, "step"} of `param` (this rank's tp slice, gathered over dp)."""
        return optimizer_state.full_state(self.ds, param)

    def precision_plan(self) -> str:
        """One line: the dtypes and optimizer wrapper DeepSpeed chose, read off the engine's real objects, and
        what became of gradient-accumulation fusion."""
        plan = optimizer_state.precision_plan(self.ds, self.pstate.dp_size)
        return plan if self.fusion is None else f"{plan}; {self.fusion}"

    def held_state_bytes(self) -> dict:
        """Bytes this rank holds for parameters, gradients and the optimizer (what gptpar.estimate.memory estimates)."""
        return optimizer_state.held_state_bytes(self.ds)

    def optimizer_state_bytes(self) -> int:
        """Bytes of the client optimizer's own state on this rank (Adam's moments)."""
        return optimizer_state.optimizer_state_bytes(self.ds)

    # -- what the log line needs ---------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """The dynamic loss scale the fp16 optimizer holds now; 1.0 in fp32/bf16 (nothing is scaled)."""
        if not self.ds.fp16_enabled():
            return 1.0
        return float(fp16_loss_scale(self.ds.optimizer))

    @property
    def grad_norm(self) -> Optional[float]:
        self._settle()
        norm = self.ds.get_global_grad_norm()
        if norm is None:
            return None
        norm = HostScalar.read(norm)  # gptpar's norm (deepspeed_api.global_grad_norm) comes with its copy
        return None if norm < 0 else norm  # DeepSpeed reports -1 for an inf/nan norm

    @property
    def step_applied(self) -> bool:
        """False when the last step was skipped (fp16 overflow; bf16: a NaN/Inf gradient norm)."""
        self._settle()
        return bool(self.ds.was_step_applied())

    @property
    def skipped_steps(self) -> int:
        self._settle()
        return int(self.ds.skipped_steps)

    def params_norm(self) -> float:
        """The L2 norm of the model's master weights, each parameter once (a collective over every rank)."""
        return params_norm(self.ds, self.pstate)


_NO_TIMER = contextlib.nullcontext()


def _synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fp16_loss_scale(optimizer) -> float:
    """Where DeepSpeed keeps the current scale: FP16_Optimizer / FP16_UnfusedOptimizer (ZeRO-0) in
    `loss_scale_config.cur_scale`, DeepSpeedZeroOptimizer (ZeRO-1) behind its `cur_scale` property (its
    `loss_scaler`). Anything else is an error: a constant in the log line would hide the real scale."""
    config = getattr(optimizer, "loss_scale_config", None)
    if config is not None:
        return config.cur_scale
    if isinstance(getattr(type(optimizer), "cur_scale", None), property):
        return optimizer.cur_scale
    raise RuntimeError(f"fp16: no loss scale found on DeepSpeed's {type(optimizer).__name__} (neither "
                       "loss_scale_config.cur_scale nor a cur_scale property): gptpar supports DeepSpeed "
                       f"{DEEPSPEED_VERSION}'s fp16 optimizers; pin deepspeed=={DEEPSPEED_VERSION} or teach "
                       "gptpar.training.engine.step.fp16_loss_scale")


def to_device(micro_batch: dict, device) -> dict:
    """Every tensor of a micro-batch on `device` (non-blocking from pinned host memory on a GPU)."""
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in micro_batch.items()}


def _pipe_batch(mb: dict):
    """(inputs, labels) as DeepSpeed's pipeline wants them: tensors or tuples of tensors only."""
    if mb.get("attention_mask") is not None or mb.get("position_ids") is not None:
        ids = mb["input_ids"]
        positions = mb.get("position_ids")
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        inputs = (ids, positions) if mb.get("attention_mask") is None else (ids, positions, mb["attention_mask"])
    else:
        inputs = mb["input_ids"]
    labels = mb["labels"] if mb.get("loss_mask") is None else (mb["labels"], mb["loss_mask"])
    return inputs, labels


def _dp_mean(loss: torch.Tensor, pstate) -> torch.Tensor:
    if pstate.dp_size > 1:
        loss = loss.clone()
        dist.all_reduce(loss, group=pstate.dp_group)
        loss /= pstate.dp_size
    return loss


def counted_once(param: torch.Tensor, pstate) -> bool:
    """Whether this rank counts `param` in a model-wide sum (grad norm, params norm, num zeros), so that every
    parameter of the model is counted exactly once over the tp and pp ranks: tensor-parallel shards on every tp
    rank, replicated parameters (LayerNorms, row-parallel biases, position embeddings) on tp rank 0 only, and the
    pipeline's tied embedding on its first stage only (DeepSpeed marks the other copies `ds_pipe_replicated`)."""
    return not getattr(param, "ds_pipe_replicated", False) and (
        pstate.tp_rank == 0 or getattr(param, "tensor_model_parallel", False))


def _sum_over(value: torch.Tensor, groups) -> torch.Tensor:
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(value, group=group)
    return value


def clip_and_keep_norm(engine, pstate) -> None:
    """Clip to the global L2 norm over unique parameters (`counted_once`), summed over the tp and pp ranks;
    keep the norm for the log line."""
    params = [p for p in engine.module.parameters() if p.grad is not None]
    squares = torch.zeros(1, dtype=torch.float32, device=pstate.device)
    for p in params:
        if counted_once(p, pstate):
            squares += p.grad.detach().float().norm() ** 2
    norm = _sum_over(squares, (pstate.tp_group, pstate.pp_group)).sqrt()
    coef = torch.clamp(engine.gradient_clipping() / (norm + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coef)
    engine._global_grad_norm = float(norm)


@torch.no_grad()
def params_norm(ds, pstate) -> float:
    """The L2 norm of the whole model's master weights (Megatron's `params norm`), each parameter counted once
    (`counted_once`). Where DeepSpeed keeps fp32 master weights (ZeRO-1, BF16_Optimizer) the norm is theirs,
    partitioned over dp and summed over it, as Megatron-LM reads `main_param`: what the optimizer steps on,
    not its bf16 rounding; without them (fp32 at ZeRO-0) the parameters are the master weights. A collective
    over every rank."""
    squares = torch.zeros(1, dtype=torch.float64, device=pstate.device)
    for p in ds.module.parameters():
        if counted_once(p, pstate):
            fragment = optimizer_state.master_fragment(p)
            if fragment.numel():
                squares += torch.linalg.vector_norm(fragment.float()).double() ** 2
    groups = (pstate.tp_group, pstate.pp_group)
    if optimizer_state.partitioned(ds):
        groups += (pstate.dp_group,)
    return float(_sum_over(squares, groups).sqrt())


class ZeroCounter:
    """Counts zero entries in the gradients the optimizer is about to step on (after clipping), each parameter
    of the model once (`counted_once`: a tensor-parallel replica on tp rank 0 only, the tied embedding on its
    first stage only).

    A step-pre-hook on the client optimizer. Under a partitioned optimizer (ZeRO-1, BF16_Optimizer) it steps on
    this dp rank's flat fp32 partitions; each counted parameter's fragment of them is read where its
    `_hp_mapping` puts it (the alignment padding, no parameter's, is never read), and `total()` sums over dp too.
    Otherwise it steps on the parameters, whose full gradients every dp rank holds.
    """

    def __init__(self, engine: "TrainEngine", pstate):
        self.pstate = pstate
        self.partitioned = optimizer_state.partitioned(engine.ds)
        self.counted = [p for p in engine.parameters() if counted_once(p, pstate)]
        self.local: Optional[torch.Tensor] = None
        self._handle = optimizer_state.optimizers(engine.ds)[1].register_step_pre_hook(self._count)

    def reset(self) -> None:
        """Before each iteration (ZeRO steps the inner optimizer once per parameter group)."""
        self.local = None

    def _count(self, optimizer, args, kwargs) -> None:
        stepped = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if self.partitioned:
            grads = [grad for flat in stepped for p in self.counted
                     if (grad := optimizer_state.grad_fragment_of(flat, p)) is not None]
        else:
            mine = {id(p) for p in self.counted}
            grads = [p.grad for p in stepped if id(p) in mine]
        # summed on the device: one host sync in total(), not one per parameter per step
        zeros = sum(((g == 0).sum() for g in grads), torch.zeros((), dtype=torch.int64, device=self.pstate.device))
        self.local = zeros if self.local is None else self.local + zeros

    def total(self, step_applied: bool) -> Optional[float]:
        """Zeros over the whole model at the last step; None when it was skipped (an overflow is agreed by
        all ranks, so either every rank enters the all-reduces or none does)."""
        if not step_applied or self.local is None:
            return None
        count = self.local.to(torch.float64).reshape(1)
        groups = (self.pstate.tp_group, self.pstate.pp_group) + ((self.pstate.dp_group,) if self.partitioned else ())
        return float(_sum_over(count, groups).item())

    def remove(self) -> None:
        self._handle.remove()
