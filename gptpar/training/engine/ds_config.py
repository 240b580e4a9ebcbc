"""The DeepSpeed config dict, generated from gptpar's run config (never kept by hand beside it).

Precision (DeepSpeed 0.19.8, chosen by the generated config, reported by `TrainEngine.precision_plan`):
    fp32        fp32 weights and gradients; ZeRO-1: DeepSpeedZeroOptimizer (fp32 partition copy)
    bf16        BF16_Optimizer: bf16 weights, fp32 gradient accumulation buffer, fp32 master weights and Adam
                state partitioned over dp (`data_types.grad_accum_dtype = fp32`, ZeRO stage 1)
    fp16        dynamic loss scaling; ZeRO-0: FP16_(Unfused)Optimizer, ZeRO-1: DeepSpeedZeroOptimizer
    fp8         bf16's, exactly: the float8 GEMMs happen inside gptpar's layers (gptpar.tensor_parallel.float8), so
                DeepSpeed, its optimizer and its checkpoint files see a bf16 run (`deepspeed_precision`)
"""
from __future__ import annotations

import math

from gptpar.training.config import Config, deepspeed_precision
from gptpar.training.schedules import BatchSizeRampup


def deepspeed_config(cfg: Config, dp_size: int, consumed_samples: int = 0) -> dict:
    """The DeepSpeed config dict generated from `cfg` for `dp_size` data-parallel ranks.

    The batch size is the one in force at `consumed_samples` (the ramp-up start for a fresh run). There is
    no "optimizer" block: the engine is given a client torch.optim.AdamW (DeepSpeed's FusedAdam would
    JIT-compile on CPU), and no "scheduler": the trainer sets the LR from `LearningRateSchedule`.
    """
    t = cfg.training
    precision = deepspeed_precision(t.precision)
    rampup = BatchSizeRampup.from_config(t, dp_size)
    gbs = rampup.global_batch_size(consumed_samples)
    ds = {
        "train_batch_size": gbs,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": rampup.num_micro_batches(consumed_samples),
        "gradient_clipping": t.clip_grad,
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "steps_per_print": 2 ** 31 - 1,  # gptpar prints its own log line
        "wall_clock_breakdown": False,
    }
    if t.optimizer != "adamw":
        # ZeRO refuses client optimizers outside its list (torch's Adam/AdamW, its own) unless told; bitsandbytes'
        # AdamW8bit steps on ZeRO's flat fp32 partitions like any torch optimizer (tests/test_optimizer8bit.py).
        ds["zero_allow_untested_optimizer"] = True
    if precision == "bf16":
        # Without it DeepSpeed 0.19.8 sums bf16 gradients over the micro-batches (ZeRO-1 picks its bf16 ZeRO
        # optimizer; the pipeline at stage 0 warns "not safe numerically"). fp32 selects BF16_Optimizer: bf16
        # weights, an fp32 gradient buffer each micro-batch is added into, fp32 master weights and Adam state
        # partitioned over dp - what BLOOM trained with. (zero_stage is 1 here: TrainingConfig promotes 0.)
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
        # Add each bf16 gradient into the fp32 buffer as soon as autograd produces it and free it, instead of
        # keeping every bf16 gradient alive until the end of backward: 2 bytes per parameter less at the peak.
        ds["bf16"]["immediate_grad_update"] = True
    if precision == "fp16":
        ds["fp16"].update({
            "loss_scale": t.loss_scale,  # 0 = dynamic
            "initial_scale_power": int(round(math.log2(t.initial_loss_scale))),
            "loss_scale_window": t.loss_scale_window,
            "hysteresis": t.hysteresis,
            "min_loss_scale": t.min_loss_scale,
        })
    return ds
