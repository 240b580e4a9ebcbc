"""The one file of gptpar/training/engine/ that imports DeepSpeed (the pipeline-stage builder,
gptpar/model/pipeline.py, is the only other one in the package; tests/unit/test_package_structure.py keeps it so).

Every call into DeepSpeed goes through a function here, each importing DeepSpeed when first called (importing it
takes seconds, and config, schedules, logging and batches never need it). The rest of the engine package holds
gptpar's logic around those calls: `step.py` (the train/eval step and what the log line reads), `initialize.py` (the
DeepSpeed engine, client optimizer and accelerator), `ds_config.py` (the generated DeepSpeed config),
`checkpointing.py` (DeepSpeed's checkpoint files) and `optimizer_state.py` (one parameter's full optimizer state,
bytes held).

DeepSpeed 0.19.8 internals relied on (beyond `deepspeed.initialize` and the engine's public methods), where gptpar
uses them, and the test that breaks when one changes:
    `data_types.grad_accum_dtype = fp32` selects BF16_Optimizer        test_precision.py::test_bf16_accumulates_in_fp32_through_bf16_optimizer,
      (ds_config.py)                                                    ::test_precision_plans_name_the_real_optimizers
    the wrapper's `.optimizer` (the client AdamW) and its buffers      test_precision.py::test_state_bytes_match_the_memory_estimate,
      (optimizer_state.py: `precision_plan`, `held_state_bytes`;        ::test_zero1_shards_the_optimizer_state
      step.py: `ZeroCounter`)
    `engine.clip_fp32_gradients` replaced and `engine._global_grad_norm` test_trainer.py::test_pipeline_without_zero_clips_by_the_same_norm,
      written (fp32 without ZeRO; initialize.py, step.py)                    test_topology_equivalence.py (grad norms against serial)
    the fp16 scale in `loss_scale_config.cur_scale` / `cur_scale`      test_trainer_fp16.py::test_overflow_skips_halve_the_scale_and_hold_the_lr,
      (step.py: `fp16_loss_scale`), and in the optimizer shards'        test_precision.py::test_deepspeed_fp16_stage0_does_not_scale_the_loss
      `optimizer_state_dict.loss_scaler` (checkpointing.py:
      `checkpoint_loss_scale`)
    the CPU accelerator's `is_fp16_supported` / `supported_dtypes`     test_precision.py (every fp16 case runs through allow_fp16_on_cpu)
      (`accelerator`, patched by `allow_fp16_on_cpu`)
    `set_gradient_accumulation_boundary` after a ramp-up changes the   test_trainer.py::test_log_line_and_metrics_fields_recomputed (the ramp run)
      number of micro-batches (step.py)
    `save_checkpoint(..., save_latest=False)` / `load_checkpoint`      test_trainer.py::test_exact_resume
      (checkpointing.py)
    the CPU accelerator's `create_op_builder("ShareMemCommBuilder")`,   test_comm_op.py::test_deepspeed_takes_the_op_gptpar_loaded
      `deepspeed.ops.__compatible_ops__`, and `OpBuilder._loaded_ops`,
      the cache `builder.load()` returns from (`load_comm_op`)
    the module's `universal_checkpoint_info` saved into the model       test_universal_checkpoint.py::test_deepspeeds_own_converter_agrees
      states, as `ds_to_universal.py` reads it (`attach_universal_info`)
    `deepspeed.utils.safe_{set,get}_full_fp32_param` /                 test_universal_checkpoint.py::test_optimizer_state_moved_with_the_reshape,
      `safe_{set,get}_full_optimizer_state`, the parameters'            ::test_fp32_resumed_at_tp2_pp2_follows_the_uninterrupted_dp2_run,
      `_hp_mapping`, the optimizers' `_lazy_init_hp_params_optimizer_     ::test_bf16_resumed_at_tp2_pp2
      state` (optimizer_state.py: `set_full_state`, `full_state`)
    the ZeRO-1 / BF16_Optimizer shard files' `param_shapes`,             test_universal_checkpoint.py (every reshape), test_convert.py
      `param_slice_mappings`, `single_partition_of_fp32_groups`,
      `base_optimizer_state` (read by gptpar.checkpoint.universal)
    `zero_allow_untested_optimizer` lets ZeRO-1 and BF16_Optimizer      test_optimizer8bit.py (resume equals uninterrupted),
      wrap bitsandbytes' AdamW8bit, whose state_dict they save          test_precision.py (its bytes)
      (ds_config.py)
    the parameters' `_hp_mapping.hp_fragment` (a narrow view of the   test_log_norms.py (params norm against the serial
      flat fp32 partition the client optimizer steps on; None where      model, num zeros against DeepSpeed's gathered
      none of the parameter is on this dp rank) and the pipeline's        gradients, at (2,1,1), (1,2,1), (1,1,2), (2,2,1))
      `ds_pipe_replicated` mark on the tied embedding's later copies
      (optimizer_state.py: `master_fragment`, `grad_fragment_of`;
      step.py: `counted_once`, `params_norm`, `ZeroCounter`)
    DeepSpeedZeroConfig (a pydantic model that forbids unknown keys)   test_deepspeed_overrides.py (typos, types, the values
      and `get_communication_data_type`                                  read back from the built engine)
      (`check_deepspeed_key`, for ds_config.check_deepspeed_overrides)
    the engine's `communication_data_type` (the dp reduction dtype in   test_precision.py::test_precision_plans_name_the_real_optimizers
      optimizer_state.py's `precision_plan`)
    the engine's `checkpoint_engine` attribute, called for every file   test_async_checkpoint.py (async files equal blocking
      `save_checkpoint` writes and `load_checkpoint` reads (the           ones), test_reliability.py (corrupted files refused,
      pipeline engine passes it to `PipelineModule.save_state_dict`),     a full disk during a save)
      replaced by gptpar's CheckpointWriter after `initialize`
      (checkpointing.py: `install_writer`; gptpar/checkpoint/writer.py)
    BF16_Optimizer's `_update_hp_grad(lp, group_idx, param_idx,        test_precision.py::test_fused_fp32_grad_accumulation_equals_deepspeeds,
      clear_lp_grads)`, called by its `immediate_grad_update` hooks      ::test_bf16_first_step_gradient_is_close_to_fp32
      during backward, and its `fp32_groups_gradients` /
      `fp32_groups_has_gradients` (`fuse_fp32_grad_accumulation`,
      installed by initialize.py)
    BF16_Optimizer's `bf16_groups`, `grad_acc_dtype`,                  test_grad_accumulation_fusion.py (fused runs equal
      `fp32_groups_gradients`, `fp32_groups_has_gradients` and          unfused ones at tp 2 + sp and pp 2; the norm and
      `clear_hp_grads`; the pipeline's tied all-reduce reading          clipping see every fused weight)
      `_hp_grad` (`install_main_grads`, gradient-accumulation
      fusion, installed by initialize.py)
    BF16_Optimizer.step reading `get_global_norm_of_tensors`,          test_precision.py::test_foreach_norm_and_clip_equal_deepspeeds,
      `is_invalid_grad_norm` (before the clip) and                      ::test_bf16_training_with_gptpars_step_equals_deepspeeds,
      `clip_tensors_by_global_norm` from its module, and their          ::test_nonfinite_gradient_skips_gptpars_bf16_step
      signatures, `clip_grad`, `get_grads_for_norm` and
      `has_moe_layers` (`foreach_norm_and_clip`, installed by initialize.py)
    the engine's `_take_model_step` calling BF16_Optimizer.step, then   test_precision.py::test_bf16_training_with_gptpars_step_equals_deepspeeds
      its `zero_grad`, each clearing through the instance's
      `clear_hp_grads` (`clear_fp32_grads_once_per_step`, initialize.py)
    PipelineModule.get_tied_weights_and_groups: [(weight, group)] of    test_replicas.py::test_the_tied_embedding_is_checked_across_stages
      the tied weights this stage holds, each with the group of the
      stages that hold a copy (`tied_weights`, for the replica check)
    BF16_Optimizer.step going on to the client optimizer's step, the   test_precision.py::test_nonfinite_gradient_skip_decided_on_the_device_equals_deepspeeds,
      hp -> lp copy and the gradient clear when `is_invalid_grad_norm`   tests/integration/test_step_syncs.py::test_a_bf16_step_reads_nothing_from_the_device
      says no; its `overflow` and `_global_grad_norm`, and the engine's
      `_step_applied`, `skipped_steps`, `_global_grad_norm` and
      `lr_scheduler` as `_take_model_step` sets them after a skipped step
      (`DeviceSkip`, installed by initialize.py)
"""
from __future__ import annotations

import contextlib
from typing import List, Optional, Tuple

import torch

from gptpar.training.engine.host_scalar import HostScalar

# The DeepSpeed release the internals above are checked against: setup.py and the Makefile pin it.
DEEPSPEED_VERSION = "0.19.8"


def initialize(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: dict, mpu):
    """`deepspeed.initialize` with a client optimizer; returns DeepSpeed's engine (a PipelineEngine for a
    PipelineModule)."""
    import deepspeed

    load_comm_op()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
    return engine


def fuse_fp32_grad_accumulation(engine) -> bool:
    """BF16_Optimizer (with `immediate_grad_update`, ds_config.py) adds each bf16 gradient into its fp32 buffer as
    soon as autograd produces it, as `hp.add_(lp.grad.to(fp32))`: a full fp32 temporary per parameter per
    micro-batch, ~23 bytes of memory traffic per parameter where the sum needs 10 (read 2 + 4, write 4), on the
    stream that runs backward. Replace that step with `FusedGradAccumulation`: the one-kernel mixed-dtype add
    (the same fp32 sums bit for bit: the bf16 -> fp32 conversion is exact either way), the small gradients' adds
    batched into a few multi-tensor kernels at the end of each backward pass, on a CUDA device on a side stream
    so that the adds (memory-bound) overlap the rest of backward (GEMMs) instead of queueing between them.
    Returns whether it was installed: only on a BF16_Optimizer, and not where DeepSpeed corrects folded AutoEP
    gradients first (that branch stays DeepSpeed's)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    opt = engine.optimizer
    if not isinstance(opt, BF16_Optimizer) or getattr(opt, "autoep_folding_tp_group", None) is not None:
        return False
    device = torch.device(engine.device)
    opt._update_hp_grad = FusedGradAccumulation(opt, device)  # the instance's, called by its grad hooks
    return True


def has_fp32_grad_buffers(engine) -> bool:
    """Whether the engine's optimizer is a BF16_Optimizer that accumulates the gradients in fp32 buffers."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    opt = engine.optimizer
    return isinstance(opt, BF16_Optimizer) and opt.grad_acc_dtype == torch.float32


def install_main_grads(engine, weights: List[torch.Tensor]) -> int:
    """Gradient-accumulation fusion (gptpar.tensor_parallel.grad_accumulation) into BF16_Optimizer's buffers: give
    each of `weights` (GEMM weights and the word embedding of this rank's model) `main_grad`, a view of its fp32
    gradient in DeepSpeed's flat buffer, into which its layer's backward accumulates; autograd then gives the weight
    no gradient, so DeepSpeed's grad hook does not run for it (where a layer falls back to autograd, e.g. an input
    without gradient, the hook adds that gradient into the same buffer). What the hook would have done is done
    here once and kept:
    `_hp_grad` set (the pipeline's tied-gradient all-reduce reads it) and the weight's `fp32_groups_has_gradients`
    flag set again after each `clear_hp_grads` (the gradient norm and clipping read only flagged gradients; a
    fused weight's buffer always holds its gradient, zero before the first backward).

    The view is taken through `.data`: its autograd version counter is its own, so DeepSpeed zeroing the flat
    buffer after a step does not invalidate the copies autograd saved for micro-batches still in flight. Returns
    the number of weights fused: 0 without fp32 gradient buffers (`has_fp32_grad_buffers`)."""
    if not has_fp32_grad_buffers(engine):
        return 0
    opt = engine.optimizer
    where = {id(p): (i, j) for i, group in enumerate(opt.bf16_groups) for j, p in enumerate(group)}
    fused = []
    for weight in weights:
        i, j = where[id(weight)]
        hp_grad = opt.fp32_groups_gradients[i][j]
        weight.main_grad = hp_grad.data.view(weight.shape)
        weight._hp_grad = hp_grad
        fused.append((i, j))
    if not fused:
        return 0
    clear_hp_grads = opt.clear_hp_grads

    def clear_hp_grads_keeping_fused():
        clear_hp_grads()
        for i, j in fused:
            opt.fp32_groups_has_gradients[i][j] = True

    opt.clear_hp_grads = clear_hp_grads_keeping_fused
    for i, j in fused:
        opt.fp32_groups_has_gradients[i][j] = True
    return len(fused)


class FusedGradAccumulation:
    """BF16_Optimizer._update_hp_grad of DeepSpeed 0.19.8 without the fp32 temporary, `(lp, group_idx, param_idx,
    clear_lp_grads)`, called from the parameters' post-accumulate-grad hooks during backward.

    A gradient of `BATCHED_NUMEL` elements or more is added at once (one mixed-dtype add); smaller ones (the
    biases and LayerNorms, 194 per micro-batch at 1.3B where gradient-accumulation fusion takes the GEMM weights)
    are kept until the end of the backward pass and added together: one multi-tensor cast into fp32 staging and
    one multi-tensor add, a few launches instead of one each (their memory, <1% of the model's, stays held until
    then; a large gradient's is freed at once, as DeepSpeed's `immediate_grad_update` intends). The same fp32
    sums bit for bit: the bf16 -> fp32 conversion is exact either way.

    On a CUDA device the adds run on a side stream: it waits for the stream that produced the gradients, they are
    marked used by the side stream (the allocator keeps their memory until the adds are done, though DeepSpeed
    drops its reference right after this call), and the first call of each backward pass queues a callback at the
    end of that pass that adds the batched gradients and makes the backward's stream wait for the side stream. So
    every fp32 sum is complete when backward returns - before DeepSpeed's reductions, the pipeline's tied-gradient
    all-reduce, clipping or the step read it - and the next micro-batch's adds follow this one's on the side
    stream. Called outside a backward pass (nothing to wait for at its end), a call finishes its own adds; a call
    from a new backward pass first finishes what an earlier one left (a nested pass, or one that raised)."""

    BATCHED_NUMEL = 1 << 20

    def __init__(self, opt, device: torch.device):
        self.opt = opt
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.main = None  # the stream of the backward pass being joined (CUDA)
        self.task = None  # the autograd graph task whose end has `finish` queued
        self.batched = []  # (fp32 buffer, bf16 gradient) of small gradients, added at the end of the pass

    @torch.no_grad()
    def __call__(self, lp, group_idx, param_idx, clear_lp_grads):
        if lp.grad is None:
            return
        opt = self.opt
        hp_grad = opt.fp32_groups_gradients[group_idx][param_idx]
        assert hp_grad is not None, f"high precision param has no gradient, lp param_id = {id(lp)}"
        main = torch.cuda.current_stream(lp.grad.device) if self.stream is not None else None
        task = torch._C._current_graph_task_id()  # -1 outside a backward pass
        if task != self.task:  # the first call of a backward pass (or of a nested one, or after one that raised)
            self.finish()
            if task != -1:
                torch.autograd.Variable._execution_engine.queue_callback(self.finish)
                self.task, self.main = task, main
        grad = lp.grad.view(hp_grad.shape)
        if lp.grad.numel() < self.BATCHED_NUMEL and not clear_lp_grads:
            self.batched.append((hp_grad, grad))
        else:
            self._add([hp_grad], [grad], main, zero=lp.grad if clear_lp_grads else None)
        lp._hp_grad = hp_grad
        opt.fp32_groups_has_gradients[group_idx][param_idx] = True
        if task == -1:  # called outside a backward pass: nothing to wait for at its end
            self.main = main
            self.finish()

    def _add(self, hp_grads, grads, after, zero=None) -> None:
        """hp_grads[i] += grads[i] (fp32 += bf16), on the side stream where there is one, after the work queued on
        stream `after` (the gradients'); then `zero` zeroed."""
        stream = self.stream
        if stream is not None:
            stream.wait_stream(after)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if len(grads) == 1:
                hp_grads[0].add_(grads[0])
            else:  # multi-tensor kernels need one dtype per pair: cast into fp32 staging first
                staging = torch.empty(sum(g.numel() for g in grads), dtype=hp_grads[0].dtype, device=grads[0].device)
                staged = [t.view(g.shape) for t, g in zip(staging.split([g.numel() for g in grads]), grads)]
                torch._foreach_copy_(staged, list(grads))
                torch._foreach_add_(list(hp_grads), staged)
            if zero is not None:  # after the add, on its stream (the join orders the next backward after it)
                zero.zero_()
        if stream is not None:
            for g in grads:
                g.record_stream(stream)

    def finish(self) -> None:
        """End of a backward pass: the batched gradients added; the backward's stream waits for the side stream."""
        if self.batched:
            hp_grads, grads = zip(*self.batched)
            self.batched = []
            self._add(hp_grads, grads, self.main)
        if self.main is not None:
            self.main.wait_stream(self.stream)
            self.main = None
        self.task = None


def foreach_norm_and_clip(engine, skip: Optional["DeviceSkip"] = None) -> bool:
    """BF16_Optimizer.step with the gradient norm and the clip as multi-tensor kernels: `global_grad_norm` and
    `clip_by_global_norm` stand in for DeepSpeed's `get_global_norm_of_tensors` and `clip_tensors_by_global_norm`
    while the optimizer's `step` runs (the names `step` reads from its module, swapped back after it). DeepSpeed's
    own launch one norm and one multiply per parameter (292 + 292 at the 1.3B shape, the small ones each a launch
    the device waits for), and read the clip coefficient on the host. The same norm (each parameter's, squared
    and summed in the same order, summed over the model-parallel group, NaN/Inf marked -1) and the same clipped
    gradients (the same coefficient where it is below 1, as torch.nn.utils.clip_grad_norm_ a multiply by exactly
    1 where it is not).

    The clip is also queued before the step reads the norm on the host (`is_invalid_grad_norm`, its one wait for
    the device: NaN/Inf skips the step), not after: the device then has the clip's multiplies to run while the host
    comes back from that wait and queues AdamW, instead of idling (docs/benchmarks.md). A skipped step clears
    the gradients it clipped. With `skip` (a `DeviceSkip`) that read goes too: the step goes on and the client
    optimizer skips its update on the device. Returns whether it was installed: only on a BF16_Optimizer without
    MoE layers."""
    from deepspeed.runtime import bf16_optimizer

    opt = engine.optimizer
    if not isinstance(opt, bf16_optimizer.BF16_Optimizer) or opt.has_moe_layers:
        return False
    step = opt.step
    is_invalid = bf16_optimizer.is_invalid_grad_norm

    def step_with_foreach_norm_and_clip(closure=None):
        clipped = []

        def clip_then_check(norm) -> bool:  # the step's `is_invalid_grad_norm(norm)`
            if opt.clip_grad > 0.0 and torch.is_tensor(norm):
                clip_by_global_norm(opt.get_grads_for_norm(for_clipping=True), max_norm=opt.clip_grad,
                                    global_norm=norm, mpu=opt.mpu)
                clipped.append(True)
            return skip.decide(norm) if skip is not None else is_invalid(norm)

        def clip_unless_clipped(input_tensors, max_norm=1.0, global_norm=None, mpu=None, eps=1e-6):
            if clipped:
                return global_norm
            return clip_by_global_norm(input_tensors, max_norm=max_norm, global_norm=global_norm, mpu=mpu, eps=eps)

        theirs = (bf16_optimizer.get_global_norm_of_tensors, bf16_optimizer.clip_tensors_by_global_norm,
                  bf16_optimizer.is_invalid_grad_norm)
        bf16_optimizer.get_global_norm_of_tensors = global_grad_norm
        bf16_optimizer.clip_tensors_by_global_norm = clip_unless_clipped
        bf16_optimizer.is_invalid_grad_norm = clip_then_check
        try:
            return step(closure)
        finally:
            (bf16_optimizer.get_global_norm_of_tensors, bf16_optimizer.clip_tensors_by_global_norm,
             bf16_optimizer.is_invalid_grad_norm) = theirs
            if skip is not None:
                skip.step_done()

    opt.step = step_with_foreach_norm_and_clip
    return True


class DeviceSkip:
    """BF16_Optimizer's NaN/Inf skip decided on the device, read by the host later, where it reads anyway.

    DeepSpeed's step reads the gradient norm on the host (`is_invalid_grad_norm`) to choose between stepping and
    skipping: the host waits there for the backward, the reductions and the norm, and the device then idles until
    the host has queued AdamW. Here that read goes (`decide`, standing in for the read inside `foreach_norm_and_clip`'s
    step): the step always goes on, and torch's fused AdamW gets `found_inf`, 1.0 where the norm is NaN, Inf or
    negative (DeepSpeed's test, on the device), with which its kernel leaves the master weights and both moments
    untouched and takes its step count back. The rest of the step then does what a skip leaves unchanged: the
    bf16 copy of unchanged fp32 weights is the same bits, the gradients are cleared as after a skip. The host
    learns the outcome from the norm's host copy (`HostScalar`), which the log line reads every iteration anyway,
    and `settle` then does what DeepSpeed's engine does after a skipped step (`overflow`, the norm reported as
    inf, the step not applied, `skipped_steps` + 1; DeepSpeed steps no LR scheduler here: `install` requires none).
    The decision is DeepSpeed's predicate on the same norm, so the same iterations are skipped.

    A step stays DeepSpeed's (the host reads the norm) while the client optimizer holds no state: DeepSpeed's skip
    does not create it, an AdamW step does, even when it skips its update; that is the first step of a run only."""

    def __init__(self, engine, is_invalid):
        self.engine, self.opt, self.client = engine, engine.optimizer, engine.optimizer.optimizer
        self.is_invalid = is_invalid  # DeepSpeed's is_invalid_grad_norm
        self.pending: Optional[HostScalar] = None  # the norm of a step decided on the device, not settled yet

    @classmethod
    def install(cls, engine) -> Optional["DeviceSkip"]:
        """A DeviceSkip for `engine`, or None where the skip cannot be decided on the device: not a BF16_Optimizer
        (or one with MoE layers), a DeepSpeed LR scheduler (stepped by `_take_model_step` before the outcome is
        known), or a client optimizer other than torch's fused Adam / AdamW (apex's, bitsandbytes')."""
        from deepspeed.runtime import bf16_optimizer

        opt = engine.optimizer
        if not isinstance(opt, bf16_optimizer.BF16_Optimizer) or opt.has_moe_layers:
            return None
        client = opt.optimizer
        fused = isinstance(client, torch.optim.Adam) and all(g.get("fused") for g in client.param_groups)
        if not fused or getattr(engine, "lr_scheduler", None) is not None:
            return None
        return cls(engine, bf16_optimizer.is_invalid_grad_norm)

    def decide(self, norm) -> bool:
        """The step's `is_invalid_grad_norm(norm)`: False (step on) with the client's `found_inf` set on the
        device, for gptpar's norm (the tensor carrying its host copy) once the client optimizer has state;
        otherwise DeepSpeed's host read."""
        host = getattr(norm, "host_scalar", None)
        if host is None or not self._client_has_state():
            return self.is_invalid(norm)
        self.client.found_inf = (~torch.isfinite(norm) | (norm < 0)).float()
        self.pending = host
        return False

    def _client_has_state(self) -> bool:
        state = self.client.state  # a defaultdict: read with get, which adds no entry
        return all(state.get(p) for group in self.client.param_groups for p in group["params"])

    def step_done(self) -> None:
        vars(self.client).pop("found_inf", None)

    def settle(self) -> None:
        """Read the last decision (waits for the norm only, not for the step queued after it) and, for a skip,
        leave DeepSpeed's optimizer and engine as its own skipped step leaves them."""
        host, self.pending = self.pending, None
        if host is None or not self.is_invalid(host.value()):
            return
        self.opt.overflow = True
        self.opt._global_grad_norm = self.engine._global_grad_norm = float("inf")
        self.engine._step_applied = False
        self.engine.skipped_steps += 1


def clear_fp32_grads_once_per_step(engine) -> bool:
    """DeepSpeed zeroes BF16_Optimizer's fp32 gradient buffers twice per step: `BF16_Optimizer.step` ends with
    `clear_hp_grads` (also its skipped-step branch), and the `zero_grad` the engine's `_take_model_step` calls
    right after it clears them again, nothing written in between: 4 bytes per parameter written twice (5.3 GB at
    1.3B). While `_take_model_step` runs only the first clear
    zeroes; any later one in the same call returns at once. Returns whether it was installed: only on a
    BF16_Optimizer."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    opt = engine.optimizer
    if not isinstance(opt, BF16_Optimizer):
        return False
    take_model_step = engine._take_model_step

    def take_model_step_clearing_once(*args, **kwargs):
        clear = opt.clear_hp_grads  # DeepSpeed's, or install_main_grads' wrapper of it
        cleared = []

        def clear_once():
            if not cleared:
                clear()
                cleared.append(True)

        opt.clear_hp_grads = clear_once
        try:
            return take_model_step(*args, **kwargs)
        finally:
            opt.clear_hp_grads = clear

    engine._take_model_step = take_model_step_clearing_once
    return True


def _one_device(tensors) -> bool:
    return bool(tensors) and len({t.device for t in tensors}) == 1


@torch.no_grad()
def global_grad_norm(input_tensors, norm_type=2, mpu=None, moe_ep_group=None) -> torch.Tensor:
    """DeepSpeed 0.19.8's `get_global_norm_of_tensors` (L2, no MoE group) with the tensors' norms from one
    `torch._foreach_norm`: sqrt of the sum of their squares, summed over `mpu`'s model-parallel group; -1 where
    it is NaN or Inf, without a host sync. The tensor carries its copy for the host (`host_scalar`, read by
    TrainEngine.grad_norm). Other cases are DeepSpeed's function."""
    from deepspeed import comm as dist
    from deepspeed.runtime import utils as ds_utils

    tensors = [t.detach().float() for t in input_tensors]
    if float(norm_type) != 2.0 or moe_ep_group is not None or not _one_device(tensors):
        return ds_utils.get_global_norm_of_tensors(input_tensors, norm_type=norm_type, mpu=mpu,
                                                   moe_ep_group=moe_ep_group)
    total = torch.stack(torch._foreach_norm(tensors, 2.0)).pow(2.0).sum()
    if mpu is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
    total = total.pow(0.5)
    total.masked_fill_(~torch.isfinite(total), -1.0)
    total.host_scalar = HostScalar(total)  # for the log line, without waiting for the step queued after it
    return total


@torch.no_grad()
def clip_by_global_norm(input_tensors, max_norm=1.0, global_norm=None, mpu=None, eps=1e-6):
    """DeepSpeed's `clip_tensors_by_global_norm` as one `torch._foreach_mul_` by min(1, max_norm / (norm + eps)),
    a device tensor: no host sync to decide whether to clip. Returns the norm."""
    from deepspeed.runtime import utils as ds_utils

    if not torch.is_tensor(global_norm) or not _one_device(list(input_tensors) + [global_norm]):
        return ds_utils.clip_tensors_by_global_norm(input_tensors, max_norm=max_norm, global_norm=global_norm,
                                                    mpu=mpu, eps=eps)
    coef = torch.clamp(max_norm / (global_norm + eps), max=1.0)
    torch._foreach_mul_([t.detach() for t in input_tensors], coef)
    return global_norm


def tied_weights(model: torch.nn.Module) -> List[Tuple[torch.Tensor, object]]:
    """[(weight, group of the stages holding a copy)] of the pipeline's tied weights on this stage; [] for pp = 1."""
    if not is_pipeline_module(model):
        return []
    return list(model.get_tied_weights_and_groups())


def is_pipeline_module(model: torch.nn.Module) -> bool:
    from deepspeed.pipe import PipelineModule

    return isinstance(model, PipelineModule)


def attach_universal_info(model: torch.nn.Module, info: dict) -> None:
    """Set the attribute DeepSpeed saves into every checkpoint's model states and `ds_to_universal.py` reads."""
    from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                UNIVERSAL_CHECKPOINT_VERSION_VALUE)

    setattr(model, UNIVERSAL_CHECKPOINT_INFO, dict(info, **{UNIVERSAL_CHECKPOINT_VERSION_KEY:
                                                            UNIVERSAL_CHECKPOINT_VERSION_VALUE}))


def load_comm_op() -> None:
    """DeepSpeed's CPU shared-memory communication op loaded before DeepSpeed's init_distributed asks for it
    (gptpar.training.engine.comm_op: a library built once is imported as it is, a wait on a build lock is said).
    Only where DeepSpeed itself would load it: the CPU accelerator, the op compatible (Linux), not loaded yet."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder.builder import OpBuilder

    import gptpar.training.engine.comm_op as comm_op

    acc = get_accelerator()
    if acc._name != "cpu":
        return
    builder = acc.create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return
    if builder.name not in OpBuilder._loaded_ops:
        comm_op.load(builder, OpBuilder._loaded_ops)


def accelerator():
    """DeepSpeed's accelerator object for this process (CUDA, or its CPU accelerator)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator()


def set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    from deepspeed.utils import safe_set_full_fp32_param

    safe_set_full_fp32_param(param, value)


def set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, key: str) -> None:
    from deepspeed.utils import safe_set_full_optimizer_state

    safe_set_full_optimizer_state(param, value, key)


def get_full_fp32_param(param: torch.Tensor) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_fp32_param

    return safe_get_full_fp32_param(param)


def get_full_optimizer_state(param: torch.Tensor, key: str) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_optimizer_state

    return safe_get_full_optimizer_state(param, key)


def check_deepspeed_key(key: str, value) -> Optional[Tuple[str, str, List[str]]]:
    """DeepSpeed's own check of one top-level key of its config (`zero_optimization`: its pydantic model;
    `communication_data_type`: the parser DeepSpeedConfig calls). None when DeepSpeed takes
    `value`; else (the dotted path below `key` of the first problem, "" for the value itself; the message; the
    keys DeepSpeed knows directly under `key`, for a suggestion)."""
    if key == "communication_data_type":
        from deepspeed.runtime.config import get_communication_data_type

        if value is not None and not isinstance(value, str):  # DeepSpeed would fail on value.lower()
            return "", f"must be a string (fp32, fp16 or bf16) or null, got {value!r} ({type(value).__name__})", []
        try:
            get_communication_data_type({key: value})
        except ValueError as e:
            return "", str(e), []
        return None
    import pydantic

    if key != "zero_optimization":
        raise ValueError(f"no DeepSpeed check for {key!r}")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig as model

    if not isinstance(value, dict):
        return "", f"must be an object of keys, got {value!r} ({type(value).__name__})", []
    known = sorted(set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias})
    try:
        model(**value)
    except pydantic.ValidationError as e:
        error = e.errors()[0]
        path = ".".join(str(part) for part in error["loc"])
        if error["type"] == "extra_forbidden":
            return path, "unknown key", known
        return path, f"{error['msg']}, got {error.get('input')!r}", known
    except (AssertionError, ValueError, TypeError) as e:  # DeepSpeed's own checks after pydantic's
        return "", str(e), known
    return None


def quiet_deepspeed_log() -> None:
    """DeepSpeed's own log at WARNING: its INFO lines would drown gptpar's log line."""
    import logging

    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)


def allow_fp16_on_cpu() -> None:
    """Make DeepSpeed's CPU accelerator accept fp16 in this process (slow emulated math: tiny runs only), so
    that fp16 tests and smoke runs do not depend on whether this CPU has AVX512-FP16 / AMX-FP16."""
    cls = type(accelerator())
    cls.is_fp16_supported = lambda self: True
    cls.supported_dtypes = lambda self: [torch.float, torch.bfloat16, torch.float16]
