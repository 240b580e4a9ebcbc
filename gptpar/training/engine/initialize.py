"""The DeepSpeed engine built around gptpar's model: the client optimizer, the model-parallel unit DeepSpeed asks
for, the accelerator, and the clean-up of DeepSpeed's CPU shared-memory buffers.

`build_engine` takes the model (a plain `GPTModel` for pp = 1, a `PipelineModule` for pp > 1), the name of a
client optimizer (`make_optimizer`: torch's AdamW, so DeepSpeed does not JIT-build its CPU FusedAdam, or
bitsandbytes' 8-bit AdamW) and the dict `ds_config.deepspeed_config` generates, and returns a `TrainEngine`.
"""
from __future__ import annotations

import functools
import os
from typing import List, Optional

import torch
import torch.distributed as dist

from gptpar.model.kernels import make_adamw
from gptpar.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from gptpar.config import OPTIMIZERS, Accelerator
import gptpar.training.engine.deepspeed_api as deepspeed_api
from gptpar.training.engine.step import TrainEngine, clip_and_keep_norm


def detect_accelerator() -> Accelerator:
    """The device this process will train on, as DeepSpeed's accelerator sees it (CUDA, or its CPU
    accelerator, whose fp16 support depends on the CPU: oneDNN has fp16 kernels with AVX512-FP16 / AMX-FP16)."""
    if torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
        return Accelerator(f"CUDA ({torch.cuda.get_device_name()}, compute capability {capability[0]}.{capability[1]})",
                           fp16=True, fp8=capability >= (8, 9), torch_version=torch.__version__)
    acc = deepspeed_api.accelerator()
    fp16 = bool(acc.is_fp16_supported())
    # fp8 on a CPU runs torchao's emulation (gptpar.tensor_parallel.float8): exact float8 rounding, fp32 matmuls
    return Accelerator(f"DeepSpeed's {acc.device_name()} accelerator ({'reports' if fp16 else 'reports no'} fp16 "
                       "support: oneDNN's fp16 kernels need AVX512-FP16 or AMX-FP16)", fp16=fp16, fp8=True,
                       torch_version=torch.__version__)


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
                 has_attention_mask: bool = False, universal_checkpoint_info: Optional[dict] = None,
                 gradient_accumulation_fusion: bool = True, skip_on_device: bool = True) -> TrainEngine:
    """Wrap `model` in a DeepSpeed engine with the client `optimizer` (`make_optimizer`). Call on every rank.

    `gradient_accumulation_fusion` (training.gradient_accumulation_fusion): where DeepSpeed accumulates bf16
    gradients in fp32 (BF16_Optimizer), the bf16 GEMM weights of the tensor-parallel layers accumulate theirs
    into its fp32 buffers inside their backward (gptpar.tensor_parallel.grad_accumulation); the precision plan
    line says how many, or why none.

    `skip_on_device`: where the step can (deepspeed_api.DeviceSkip.install), a NaN/Inf gradient norm skips it on
    the device, without the host read DeepSpeed's step makes (the same iterations skipped, the same weights and
    optimizer state); False keeps DeepSpeed's read.

    `universal_checkpoint_info` (gptpar.checkpoint.universal.deepspeed_universal_info) is saved into every
    checkpoint, where DeepSpeed's ds_to_universal.py reads how the tp slices merge."""
    if universal_checkpoint_info is not None:
        deepspeed_api.attach_universal_info(model, universal_checkpoint_info)
    pipelined = deepspeed_api.is_pipeline_module(model)
    optimizer = make_optimizer(optimizer, optimizer_param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps,
                               weight_decay=weight_decay, device=pstate.device)
    engine = deepspeed_api.initialize(model, optimizer, ds_config, None if pipelined else ParallelStateMPU(pstate))
    release_shm_buffer(pstate)
    deepspeed_api.fuse_fp32_grad_accumulation(engine)  # bf16: one kernel per gradient into its fp32 buffer
    skip = deepspeed_api.DeviceSkip.install(engine) if skip_on_device else None
    # bf16: the step's norm and clip in a few kernels; with `skip`, no host read of the norm in the step at all
    if not deepspeed_api.foreach_norm_and_clip(engine, skip):
        skip = None
    deepspeed_api.clear_fp32_grads_once_per_step(engine)  # bf16: one zeroing of the fp32 gradients per step, not two
    fusion = _install_gradient_accumulation_fusion(engine, model) if gradient_accumulation_fusion else None
    if pipelined and has_attention_mask:
        engine.set_has_attention_mask(True)  # the mask travels as the last tensor between stages
    if not (engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization()):
        # Plain fp32 without ZeRO: DeepSpeed's clip_grad_norm_ drops the norm, and under the pipeline grid
        # counts the tied embedding copy and skips later stages' replicated (LayerNorm, bias) parameters.
        engine.clip_fp32_gradients = functools.partial(clip_and_keep_norm, engine, pstate)
    return TrainEngine(engine, pstate, pipelined, fusion, skip)


def _install_gradient_accumulation_fusion(engine, model: torch.nn.Module) -> Optional[str]:
    """Give the bf16 GEMM weights and the word embedding table (its lookup and the tied output layer) their fp32
    `main_grad` (deepspeed_api.install_main_grads); returns what the precision plan says about it (None where
    nothing accumulates bf16 gradients in fp32: fp32, fp16)."""
    from gptpar.tensor_parallel.grad_accumulation import fused_accumulation_unavailable

    gemms = [m.weight for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
             and m.float8 is None and m.weight.requires_grad]
    tables = [m.weight for m in model.modules() if isinstance(m, VocabParallelEmbedding) and m.weight.requires_grad]
    weights = gemms + tables
    if not weights or not deepspeed_api.has_fp32_grad_buffers(engine):
        return None
    device = torch.device(engine.device)
    unavailable = fused_accumulation_unavailable(device)
    if unavailable is not None:
        return f"gradient-accumulation fusion off: {unavailable}"
    deepspeed_api.install_main_grads(engine, weights)
    how = "in the GEMM (fp32 output)" if device.type == "cuda" else "after each GEMM (a CPU has no fp32-output one)"
    table = " and the word embedding (lookup and tied output layer)" if tables else ""
    return (f"gradient-accumulation fusion: {len(gemms)} GEMM weights{table} add their gradients into the fp32 "
            f"buffers {how}")


def shm_buffer_path(rank: int) -> str:
    """Where DeepSpeed's CPU shared-memory all-reduce keeps rank `rank`'s buffer (csrc/cpu/comm/shm.cpp:
    `deepspeed_allreduce_buffer_{uid}_{MASTER_ADDR}_{MASTER_PORT}_{rank}`, ~66 MB in RAM-backed /dev/shm)."""
    return (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")


def release_shm_buffer(pstate) -> None:
    """Unlink this rank's DeepSpeed shared-memory buffer once every rank has mapped every other's.

    DeepSpeed creates the buffer when all ranks share one host (the CPU accelerator) and never unlinks it, so
    without this every CPU run would leave one per rank in /dev/shm (RAM) for good (docs/reliability.md). Each
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

