"""DeepSpeed behind one module: the GPT under a DeepSpeed engine (ZeRO-1, gradient accumulation, clipping,
fp32/bf16/fp16), the generated DeepSpeed config, checkpoint calls, zero counting and the accelerator.

Nothing else in gptpar/ imports DeepSpeed except the pipeline-stage builder (gptpar/model/pipeline.py:
`PipelineModule`, `LayerSpec`, the topology); tests/test_package_structure.py keeps it so. The trainer and the
checkpointer talk to `TrainEngine`, never to the DeepSpeed engine it holds.

`build_engine` takes the model (a plain `GPTModel` for pp = 1, a `PipelineModule` for pp > 1), the name of a
client optimizer (`make_optimizer`: torch's AdamW, so DeepSpeed does not JIT-build its CPU FusedAdam, or
bitsandbytes' 8-bit AdamW) and the dict `deepspeed_config` generates.
`TrainEngine.train_step(micro_batches)` runs one optimizer step over the micro-batches of this
data-parallel rank, the same way for both kinds of model, and exposes what the log line needs.

A micro-batch is a dict: `input_ids` (b, s) and `labels` (b, s) long tensors, and optionally
`loss_mask` (b, s) float, `attention_mask` (b, 1, s, s) bool (True = may attend), `position_ids` (b, s).
The data pipeline builds them on the host; `train_step` / `eval_step` move every tensor to the engine's
device in one place (`to_device`) before anything else sees them, for pp = 1 and pp > 1 alike.

Precision (DeepSpeed 0.19.8, chosen by the generated config, reported by `precision_plan`):
    fp32        fp32 weights and gradients; ZeRO-1: DeepSpeedZeroOptimizer (fp32 partition copy)
    bf16        BF16_Optimizer: bf16 weights, fp32 gradient accumulation buffer, fp32 master weights and Adam
                state partitioned over dp (`data_types.grad_accum_dtype = fp32`, ZeRO stage 1)
    fp16        dynamic loss scaling; ZeRO-0: FP16_(Unfused)Optimizer, ZeRO-1: DeepSpeedZeroOptimizer

DeepSpeed 0.19.8 internals relied on (beyond `deepspeed.initialize` and the engine's public methods), and the
test that breaks when one changes:
    `data_types.grad_accum_dtype = fp32` selects BF16_Optimizer        test_precision.py::test_bf16_accumulates_in_fp32_through_bf16_optimizer,
                                                                        ::test_precision_plans_name_the_real_optimizers
    the wrapper's `.optimizer` (the client AdamW) and its buffers      test_precision.py::test_state_bytes_match_the_memory_estimate,
      (`precision_plan`, `held_state_bytes`, `ZeroCounter`)             ::test_zero1_shards_the_optimizer_state
    `engine.clip_fp32_gradients` replaced and `engine._global_grad_norm` test_trainer.py::test_pipeline_without_zero_clips_by_the_same_norm,
      written (fp32 without ZeRO)                                       test_topology_equivalence.py (grad norms against serial)
    ZeRO's `groups_padding` / `group_paddings` (ZeroCounter)           test_trainer.py::test_log_line_and_metrics_fields_recomputed (num zeros)
    the fp16 scale in `loss_scale_config.cur_scale` / `cur_scale`      test_trainer_fp16.py::test_overflow_skips_halve_the_scale_and_hold_the_lr,
      (`fp16_loss_scale`), and in the optimizer shards'                 test_precision.py::test_deepspeed_fp16_stage0_does_not_scale_the_loss
      `optimizer_state_dict.loss_scaler` (`checkpoint_loss_scale`)
    the CPU accelerator's `is_fp16_supported` / `supported_dtypes`     test_precision.py (every fp16 case runs through allow_fp16_on_cpu)
      (`detect_accelerator`, patched by `allow_fp16_on_cpu`)
    `set_gradient_accumulation_boundary` after a ramp-up changes the   test_trainer.py::test_log_line_and_metrics_fields_recomputed (the ramp run)
      number of micro-batches
    `save_checkpoint(..., save_latest=False)` / `load_checkpoint`      test_trainer.py::test_exact_resume
    the module's `universal_checkpoint_info` saved into the model       test_universal_checkpoint.py::test_deepspeeds_own_converter_agrees
      states, as `ds_to_universal.py` reads it
    `deepspeed.utils.safe_{set,get}_full_fp32_param` /                 test_universal_checkpoint.py::test_optimizer_state_moved_with_the_reshape,
      `safe_{set,get}_full_optimizer_state`, the parameters'            ::test_fp32_resumed_at_tp2_pp2_follows_the_uninterrupted_dp2_run,
      `_hp_mapping`, the optimizers' `_lazy_init_hp_params_optimizer_     ::test_bf16_resumed_at_tp2_pp2
      state` (`set_full_state`, `full_state`)
    the ZeRO-1 / BF16_Optimizer shard files' `param_shapes`,             test_universal_checkpoint.py (every reshape), test_convert.py
      `param_slice_mappings`, `single_partition_of_fp32_groups`,
      `base_optimizer_state` (read by gptpar.model.universal)
    `zero_allow_untested_optimizer` lets ZeRO-1 and BF16_Optimizer      test_optimizer8bit.py (resume equals uninterrupted),
      wrap bitsandbytes' AdamW8bit, whose state_dict they save          test_precision.py (its bytes)
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections import defaultdict
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from gptpar.model.kernels import make_adamw
from gptpar.training.config import OPTIMIZERS, Accelerator, Config
from gptpar.training.schedules import BatchSizeRampup


def detect_accelerator() -> Accelerator:
    """The device this process will train on, as DeepSpeed's accelerator sees it (CUDA, or its CPU
    accelerator, whose fp16 support depends on the CPU: oneDNN has fp16 kernels with AVX512-FP16 / AMX-FP16)."""
    if torch.cuda.is_available():
        return Accelerator(f"CUDA ({torch.cuda.get_device_name()})", fp16=True)
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    fp16 = bool(acc.is_fp16_supported())
    return Accelerator(f"DeepSpeed's {acc.device_name()} accelerator ({'reports' if fp16 else 'reports no'} fp16 "
                       "support: oneDNN's fp16 kernels need AVX512-FP16 or AMX-FP16)", fp16=fp16)


def to_device(micro_batch: dict, device) -> dict:
    """Every tensor of a micro-batch on `device` (non-blocking from pinned host memory on a GPU)."""
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in micro_batch.items()}


class ParallelStateMPU:
    """The model-parallel-unit interface DeepSpeed asks for, answered from a `ParallelState`.

    DeepSpeed takes its data-parallel group (gradient all-reduce, ZeRO sharding) and its model-parallel
    group (global gradient norm without double-counting replicated parameters) from here."""

    def __init__(self, pstate):
        self.pstate = pstate

    def get_model_parallel_rank(self):
        return self.pstate.tp_rank

    def get_model_parallel_world_size(self):
        return self.pstate.tp_size

    def get_model_parallel_group(self):
        return self.pstate.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self):
        return self.pstate.rank - self.pstate.tp_rank

    def get_data_parallel_rank(self):
        return self.pstate.dp_rank

    def get_data_parallel_world_size(self):
        return self.pstate.dp_size

    def get_data_parallel_group(self):
        return self.pstate.dp_group

    def get_pipeline_model_parallel_rank(self):
        return self.pstate.pp_rank

    def get_pipeline_model_parallel_world_size(self):
        return self.pstate.pp_size

    def get_pipeline_model_parallel_group(self):
        return self.pstate.pp_group

    def get_sequence_parallel_world_size(self):
        return 1  # DeepSpeed's Ulysses sequence parallelism is not used


def optimizer_param_groups(model: torch.nn.Module, weight_decay: float) -> List[dict]:
    """Megatron's split: weight decay on matrices, none on biases, LayerNorms and embeddings' 1-d params."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class TrainEngine:
    """One optimizer step per `train_step`, for a plain (pp = 1) or pipelined model."""

    def __init__(self, ds_engine, pstate, pipelined: bool):
        self.ds, self.pstate, self.pipelined = ds_engine, pstate, pipelined
        self.device = torch.device(ds_engine.device)
        self.phase_seconds: Optional[Dict[str, float]] = None  # `time_phases()` turns the timers on

    # -- the step ------------------------------------------------------------------------------
    def train_step(self, micro_batches: List[dict]) -> float:
        """Forward, backward and optimizer step over this dp rank's micro-batches.

        Returns the loss averaged over the micro-batches and the data-parallel ranks (on every rank)."""
        self.ds.train()
        with self._phase("batch"):
            micro_batches = [to_device(mb, self.device) for mb in micro_batches]
        if self.pipelined:
            loss = self.ds.train_batch(data_iter=iter([_pipe_batch(mb) for mb in micro_batches]))
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
            with self._phase("optimizer" if last else "micro-step"):  # reduce, clip, step / bookkeeping
                self.ds.step()
            losses.append(loss.detach().float())
        return _dp_mean(torch.stack(losses).mean(), self.pstate)

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
        """Mean loss over the micro-batches and dp ranks, without updating anything."""
        self.ds.eval()
        micro_batches = [to_device(mb, self.device) for mb in micro_batches]
        if self.pipelined:
            loss = self.ds.eval_batch(data_iter=iter([_pipe_batch(mb) for mb in micro_batches]),
                                      num_micro_batches=len(micro_batches))
            return float(loss)
        losses = [self.ds.module(**mb).float() for mb in micro_batches]
        return _dp_mean(torch.stack(losses).mean(), self.pstate)

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

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict) -> None:
        """DeepSpeed's part of checkpoint `tag` (model and optimizer shards); `latest` is gptpar's to move."""
        self.ds.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)

    def load_checkpoint(self, directory: str, tag: str) -> bool:
        """Restore DeepSpeed's part of checkpoint `tag`; False when DeepSpeed found nothing to load."""
        loaded, _ = self.ds.load_checkpoint(directory, tag=tag)
        return loaded is not None

    # -- one parameter's full state (universal checkpoints) ------------------------------------
    def named_parameters(self):
        """This rank's parameters under the names of the module it trains (GPTModel's or the PipelineModule's)."""
        return self.ds.module.named_parameters()

    @torch.no_grad()
    def set_full_state(self, param: torch.Tensor, fp32: torch.Tensor, moments: Dict[str, torch.Tensor],
                       step: float) -> None:
        """Give `param` (this rank's tp slice, whole over dp) its fp32 master weight, Adam moments and step.

        The model weight becomes the master weight in the model's dtype (what the optimizers copy back after
        a step); DeepSpeed's `safe_set_full_fp32_param` / `safe_set_full_optimizer_state` write the part of
        this dp rank's partition that the parameter's `_hp_mapping` covers (ZeRO-1, BF16_Optimizer). Without
        a partitioned optimizer (fp32 at ZeRO-0) the client AdamW's own state of `param` is set."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        param.copy_(fp32.to(param.dtype))
        self._init_optimizer_state(step)
        if hasattr(param, "_hp_mapping"):
            safe_set_full_fp32_param(param, fp32)
            for key, value in moments.items():
                safe_set_full_optimizer_state(param, value, key)
        else:
            state = self._optimizers()[1].state[param]
            for key, value in moments.items():
                state[key].copy_(value)

    def full_state(self, param: torch.Tensor) -> dict:
        """{"fp32", each Adam moment, "step"} of `param` (this rank's tp slice, gathered over dp: a collective
        over the dp group under ZeRO-1 / BF16_Optimizer), read back through DeepSpeed."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        inner = self._optimizers()[1]
        if not hasattr(param, "_hp_mapping"):
            state = inner.state[param]
            return dict({k: v.clone() for k, v in state.items() if k != "step"}, fp32=param.detach().float().clone(),
                        step=float(state["step"]))
        self._link_optimizer_state()
        keys = [k for k, v in next(iter(inner.state.values())).items() if k != "step" and torch.is_tensor(v)]
        out = {key: safe_get_full_optimizer_state(param, key).clone() for key in keys}
        out["fp32"] = safe_get_full_fp32_param(param).clone()
        group = inner.param_groups[0]
        out["step"] = float(group["step"] if "step" in group else next(iter(inner.state.values()))["step"])
        return out

    def _init_optimizer_state(self, step: float) -> None:
        """Adam's state for every tensor the client AdamW steps on (DeepSpeed's flat fp32 partitions, or the
        parameters themselves), as torch's AdamW creates it at its first step, with `step` as its count; then
        DeepSpeed links each parameter's fragment of it (`_lazy_init_hp_params_optimizer_state`, which its
        optimizers otherwise run after their first step)."""
        inner = self._optimizers()[1]
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if not state:
                    state.update(step=torch.zeros((), dtype=torch.float32, device=p.device),
                                 exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"].fill_(step)
            if "step" in group:  # apex FusedAdam counts steps per group
                group["step"] = int(step)
        self._link_optimizer_state()

    def _link_optimizer_state(self) -> None:
        """Let each parameter's `_hp_mapping` address its fragment of the Adam state (DeepSpeed does it lazily,
        after its first step)."""
        wrapper = self.ds.optimizer
        if hasattr(wrapper, "_lazy_init_hp_params_optimizer_state"):
            wrapper._lazy_init_hp_params_optimizer_state()

    # -- what the log line needs ---------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """The dynamic loss scale the fp16 optimizer holds now; 1.0 in fp32/bf16 (nothing is scaled)."""
        if not self.ds.fp16_enabled():
            return 1.0
        return float(fp16_loss_scale(self.ds.optimizer))

    def precision_plan(self) -> str:
        """One line: parameter, gradient-accumulation and master-weight dtypes and the optimizer wrapper
        DeepSpeed chose, read off the engine's real objects."""
        names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
        params = [p for p in self.ds.module.parameters() if p.requires_grad]
        wrapper, inner = self._optimizers()
        master = [p for g in inner.param_groups for p in g["params"]]
        own = {id(p) for p in params}
        if all(id(p) in own for p in master):
            where = "the parameters themselves"
        else:
            share = sum(p.numel() for p in master) / sum(p.numel() for p in params)
            where = f"a {names[master[0].dtype]} copy" + (
                f" of {share:.3g} of the parameters (partitioned over dp {self.pstate.dp_size})" if share < 0.99
                else " of every parameter")
        chain = type(inner).__name__ if wrapper is inner else f"{type(wrapper).__name__} around {type(inner).__name__}"
        return (f"precision plan: parameters {names[params[0].dtype]}, gradient accumulation "
                f"{names[self.ds.get_data_types()[1]]}, master weights {where}; optimizer {chain}")

    def held_state_bytes(self) -> dict:
        """Bytes this rank holds for parameters, gradients and the optimizer wrapper's buffers and state (each
        storage counted once, under the first of those it is found in): what gptpar.estimate.memory estimates."""
        seen, out = set(), {}
        params = list(self.ds.module.parameters())
        out["parameters"] = _storage_bytes(params, seen)
        out["gradients"] = _storage_bytes([p.grad for p in params], seen)
        wrapper, inner = self._optimizers()
        held = [list(vars(opt).values()) + [p.grad for g in opt.param_groups for p in g["params"]]
                for opt in {id(wrapper): wrapper, id(inner): inner}.values()]
        out["optimizer"] = _storage_bytes(held + [list(inner.state.values())], seen)
        out["total"] = sum(out.values())
        return out

    def optimizer_state_bytes(self) -> int:
        """Bytes of the client optimizer's own state on this rank: Adam's two moments (for adamw8bit their uint8
        codes, block scales and quantisation maps), without the master weights a DeepSpeed wrapper keeps."""
        return _storage_bytes(list(self._optimizers()[1].state.values()), set())

    def _optimizers(self):
        """(DeepSpeed's optimizer wrapper, the client optimizer inside it); the same object twice without one."""
        wrapper = self.ds.optimizer
        return wrapper, getattr(wrapper, "optimizer", wrapper)

    @property
    def grad_norm(self) -> Optional[float]:
        norm = self.ds.get_global_grad_norm()
        if norm is None:
            return None
        norm = float(norm)
        return None if norm < 0 else norm  # DeepSpeed reports -1 for an inf/nan norm

    @property
    def step_applied(self) -> bool:
        """False when the last step was skipped (fp16 overflow)."""
        return bool(self.ds.was_step_applied())

    @property
    def skipped_steps(self) -> int:
        return int(self.ds.skipped_steps)


_NO_TIMER = contextlib.nullcontext()


def _storage_bytes(obj, seen: set, depth: int = 0) -> int:
    """Bytes of the tensors in `obj` (nested lists, tuples and dicts: the optimizers keep theirs in attributes
    of those kinds), each storage counted once across calls sharing `seen`; meta tensors hold nothing."""
    if torch.is_tensor(obj):
        storage = obj.untyped_storage() if obj.device.type != "meta" else None
        if storage is None or storage.data_ptr() in seen or not storage.nbytes():
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if depth < 5 and isinstance(obj, (list, tuple, dict)):
        items = obj.values() if isinstance(obj, dict) else obj
        return sum(_storage_bytes(item, seen, depth + 1) for item in items)
    return 0


def _synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fp16_loss_scale(optimizer) -> float:
    """Where DeepSpeed 0.19.8 keeps the current scale: FP16_Optimizer / FP16_UnfusedOptimizer (ZeRO-0) in
    `loss_scale_config.cur_scale`, DeepSpeedZeroOptimizer (ZeRO-1) behind its `cur_scale` property (its
    `loss_scaler`). Anything else is an error: a constant in the log line would hide the real scale."""
    config = getattr(optimizer, "loss_scale_config", None)
    if config is not None:
        return config.cur_scale
    if isinstance(getattr(type(optimizer), "cur_scale", None), property):
        return optimizer.cur_scale
    raise RuntimeError(f"fp16: no loss scale found on DeepSpeed's {type(optimizer).__name__} (neither "
                       "loss_scale_config.cur_scale nor a cur_scale property): gptpar supports DeepSpeed 0.19.8's "
                       "fp16 optimizers; pin deepspeed==0.19.8 or teach gptpar.training.engine.fp16_loss_scale")


def checkpoint_loss_scale(iteration_dir: str) -> float:
    """The dynamic loss scale DeepSpeed 0.19.8's fp16 ZeRO-1 optimizer wrote into a checkpoint folder (each
    optimizer shard holds its loss scaler; they must agree): what `loss_scale` logged at that iteration."""
    import glob
    import os

    shards = sorted(glob.glob(os.path.join(iteration_dir, "*optim_states.pt")))
    if not shards:
        raise FileNotFoundError(f"{iteration_dir}: no DeepSpeed optimizer shards (*optim_states.pt)")
    scales = {float(torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]["loss_scaler"]
                    .cur_scale) for f in shards}
    if len(scales) != 1:
        raise ValueError(f"{iteration_dir}: the optimizer shards disagree on the loss scale: {sorted(scales)}")
    return scales.pop()


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


def _dp_mean(loss: torch.Tensor, pstate) -> float:
    if pstate.dp_size > 1:
        loss = loss.clone()
        dist.all_reduce(loss, group=pstate.dp_group)
        loss /= pstate.dp_size
    return float(loss)


def make_optimizer(name: str, param_groups: List[dict], *, lr: float, betas, eps: float, weight_decay: float,
                   device: torch.device) -> torch.optim.Optimizer:
    """The client optimizer `training.optimizer` names: `adamw` (gptpar.model.kernels.make_adamw) or `adamw8bit`
    (bitsandbytes' AdamW8bit, block-wise 8-bit moments; imported here only, Config.check said how to install it)."""
    if name == "adamw":
        return make_adamw(param_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, device=device)
    if name == "adamw8bit":
        import logging

        # On CPUs with AVX512-BF16 its CPU backend warns at import that an optional 4-bit GEMM kernel (another
        # package) is missing: nothing the optimizer uses.
        logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(param_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    raise ValueError(f"training.optimizer must be one of {OPTIMIZERS}, got {name!r}")


def build_engine(model: torch.nn.Module, pstate, ds_config: dict, *, optimizer: str = "adamw", lr: float = 1e-4,
                 weight_decay: float = 0.0, betas=(0.9, 0.999), eps: float = 1e-8,
                 has_attention_mask: bool = False, universal_checkpoint_info: Optional[dict] = None) -> TrainEngine:
    """Wrap `model` in a DeepSpeed engine with the client `optimizer` (`make_optimizer`). Call on every rank.

    `universal_checkpoint_info` (gptpar.model.universal.deepspeed_universal_info) is saved into every
    checkpoint, where DeepSpeed's ds_to_universal.py reads how the tp slices merge."""
    import deepspeed
    from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                UNIVERSAL_CHECKPOINT_VERSION_VALUE)
    from deepspeed.pipe import PipelineModule

    if universal_checkpoint_info is not None:
        setattr(model, UNIVERSAL_CHECKPOINT_INFO,
                dict(universal_checkpoint_info, **{UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}))
    pipelined = isinstance(model, PipelineModule)
    optimizer = make_optimizer(optimizer, optimizer_param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps,
                               weight_decay=weight_decay, device=pstate.device)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                           mpu=None if pipelined else ParallelStateMPU(pstate))
    release_shm_buffer(pstate)
    if pipelined and has_attention_mask:
        engine.set_has_attention_mask(True)  # the mask travels as the last tensor between stages
    if not (engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization()):
        # Plain fp32 without ZeRO: DeepSpeed's clip_grad_norm_ drops the norm, and under the pipeline grid
        # counts the tied embedding copy and skips later stages' replicated (LayerNorm, bias) parameters.
        engine.clip_fp32_gradients = functools.partial(_clip_and_keep_norm, engine, pstate)
    return TrainEngine(engine, pstate, pipelined)


def shm_buffer_path(rank: int) -> str:
    """Where DeepSpeed's CPU shared-memory all-reduce keeps rank `rank`'s buffer (csrc/cpu/comm/shm.cpp:
    `deepspeed_allreduce_buffer_{uid}_{MASTER_ADDR}_{MASTER_PORT}_{rank}`, ~66 MB in RAM-backed /dev/shm)."""
    return (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")


def release_shm_buffer(pstate) -> None:
    """Unlink this rank's DeepSpeed shared-memory buffer once every rank has mapped every other's.

    DeepSpeed 0.19.8 creates the buffer when all ranks share one host (the CPU accelerator) and never unlinks
    it, so every CPU run left one per rank in /dev/shm (RAM) for good: a day of test runs held 11 GB there. Each
    rank maps all the others' buffers inside DeepSpeed's init, so after a barrier the names are no longer
    needed; the mappings stay valid until the process exits, and nothing is left behind even on a kill."""
    if torch.cuda.is_available():
        return  # the shm op is DeepSpeed's CPU accelerator's
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()  # every rank past DeepSpeed's init: all buffers opened and mapped
    try:
        os.unlink(shm_buffer_path(pstate.rank))
    except FileNotFoundError:
        pass  # no shm op (ranks on several hosts, or the op not built)


def _clip_and_keep_norm(engine, pstate) -> None:
    """Clip to the global L2 norm over unique parameters (each tp shard once, replicas and the pipeline's
    tied embedding copy once), summed over the tp and pp ranks; keep the norm for the log line."""
    params = [p for p in engine.module.parameters() if p.grad is not None]
    counted = [p for p in params if not getattr(p, "ds_pipe_replicated", False)
               and (pstate.tp_rank == 0 or getattr(p, "tensor_model_parallel", False))]
    squares = torch.zeros(1, dtype=torch.float32, device=pstate.device)
    for p in counted:
        squares += p.grad.detach().float().norm() ** 2
    for group in (pstate.tp_group, pstate.pp_group):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(squares, group=group)
    norm = squares.sqrt()
    coef = torch.clamp(engine.gradient_clipping() / (norm + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coef)
    engine._global_grad_norm = float(norm)


class ZeroCounter:
    """Counts zero entries in the gradients the optimizer is about to step on (after clipping).

    A step-pre-hook on the client optimizer: under ZeRO-1 it sees this dp rank's flat fp32 partition
    (alignment padding subtracted), otherwise the full gradients. `total()` sums over the ranks that hold
    different parameters (a collective). Under ZeRO the flat partitions no longer say which parameter is a
    replica, so tensor-parallel replicas (LayerNorms, row-parallel biases) count once per tp rank and the
    pipeline's tied embedding once per stage holding it.
    """

    def __init__(self, engine: "TrainEngine", pstate, partitioned: bool):
        self.pstate, self.partitioned = pstate, partitioned
        self.ds_opt, inner = engine._optimizers()
        self.local: Optional[int] = None
        self._handle = inner.register_step_pre_hook(self._count)

    def reset(self) -> None:
        """Before each iteration (ZeRO steps the inner optimizer once per parameter group)."""
        self.local = None

    def _count(self, optimizer, args, kwargs) -> None:
        if self.local is None:  # the partitions' alignment padding is zero but not part of the model
            padding = getattr(self.ds_opt, "groups_padding", None) or getattr(self.ds_opt, "group_paddings", None)
            self.local = -(sum(padding) if self.partitioned and padding else 0)
        # summed on the device: one host sync in total(), not one per parameter per step
        self.local = self.local + sum((p.grad == 0).sum() for g in optimizer.param_groups for p in g["params"]
                                      if p.grad is not None)

    def total(self, step_applied: bool) -> Optional[float]:
        """Zeros over the whole model at the last step; None when it was skipped (an overflow is agreed by
        all ranks, so either every rank enters the all-reduces or none does)."""
        if not step_applied or self.local is None:
            return None
        count = torch.as_tensor(self.local, dtype=torch.float64, device=self.pstate.device).reshape(1)
        groups = [self.pstate.tp_group, self.pstate.pp_group] + ([self.pstate.dp_group] if self.partitioned else [])
        for group in groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(count, group=group)
        return float(count.item())

    def remove(self) -> None:
        self._handle.remove()


# ---------------------------------------------------------------------------------------------
# The DeepSpeed config
# ---------------------------------------------------------------------------------------------

def deepspeed_config(cfg: Config, dp_size: int, consumed_samples: int = 0) -> dict:
    """The DeepSpeed config dict generated from `cfg` for `dp_size` data-parallel ranks.

    The batch size is the one in force at `consumed_samples` (the ramp-up start for a fresh run). There is
    no "optimizer" block: the engine is given a client torch.optim.AdamW (DeepSpeed's FusedAdam would
    JIT-compile on CPU), and no "scheduler": the trainer sets the LR from `LearningRateSchedule`.
    """
    t = cfg.training
    rampup = BatchSizeRampup.from_config(t, dp_size)
    gbs = rampup.global_batch_size(consumed_samples)
    ds = {
        "train_batch_size": gbs,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": rampup.num_micro_batches(consumed_samples),
        "gradient_clipping": t.clip_grad,
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": t.precision == "fp16"},
        "steps_per_print": 2 ** 31 - 1,  # gptpar prints its own log line
        "wall_clock_breakdown": False,
    }
    if t.optimizer != "adamw":
        # ZeRO refuses client optimizers outside its list (torch's Adam/AdamW, its own) unless told; bitsandbytes'
        # AdamW8bit steps on ZeRO's flat fp32 partitions like any torch optimizer (tests/test_optimizer8bit.py).
        ds["zero_allow_untested_optimizer"] = True
    if t.precision == "bf16":
        # Without it DeepSpeed 0.19.8 sums bf16 gradients over the micro-batches (ZeRO-1 picks its bf16 ZeRO
        # optimizer; the pipeline at stage 0 warns "not safe numerically"). fp32 selects BF16_Optimizer: bf16
        # weights, an fp32 gradient buffer each micro-batch is added into, fp32 master weights and Adam state
        # partitioned over dp - what BLOOM trained with. (zero_stage is 1 here: TrainingConfig promotes 0.)
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
        # Add each bf16 gradient into the fp32 buffer as soon as autograd produces it and free it, instead of
        # keeping every bf16 gradient alive until the end of backward: 2 bytes per parameter less at the peak.
        ds["bf16"]["immediate_grad_update"] = True
    if t.precision == "fp16":
        ds["fp16"].update({
            "loss_scale": t.loss_scale,  # 0 = dynamic
            "initial_scale_power": int(round(math.log2(t.initial_loss_scale))),
            "loss_scale_window": t.loss_scale_window,
            "hysteresis": t.hysteresis,
            "min_loss_scale": t.min_loss_scale,
        })
    return ds

def quiet_deepspeed_log() -> None:
    """DeepSpeed's own log at WARNING: its INFO lines would drown gptpar's log line."""
    import logging

    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)


def allow_fp16_on_cpu() -> None:
    """Make DeepSpeed's CPU accelerator accept fp16 in this process (slow emulated math: tiny runs only), so
    that fp16 tests and smoke runs do not depend on whether this CPU has AVX512-FP16 / AMX-FP16."""
    from deepspeed.accelerator import get_accelerator

    cls = type(get_accelerator())
    cls.is_fp16_supported = lambda self: True
    cls.supported_dtypes = lambda self: [torch.float, torch.bfloat16, torch.float16]
