"""The DeepSpeed config dict, generated from gptpar's run config (never kept by hand beside it), and the run
config's `deepspeed` section merged over it.

The `deepspeed` section takes DeepSpeed's own keys for what only tunes speed or memory (bucket sizes, overlap):
`TUNING_KEYS`, an allow-list, and `communication_data_type`, which changes the numerics on purpose and is said in
one line (`describe_overrides`). Every other key exits 2 naming it and why: a key gptpar generates (`OWNED_KEYS`,
with the gptpar key to set instead), one that breaks what is trained or resumed (`REFUSED`: DeepSpeed's
`load_from_fp32_weights=false` makes the first step after a resume write the start-of-run master weights back,
offloading is not supported end to end), and anything else. DeepSpeed alone would ignore an unknown top-level key
(`zero_optimisation`) and type-checks few values, so the keys admitted are also checked through DeepSpeed's own
model or parser (deepspeed_api.check_deepspeed_key). The command line calls `check_deepspeed_overrides` before any
process group (gptpar.training.cli.parse), and `deepspeed_config` again before merging.

Precision (DeepSpeed, chosen by the generated config, reported by `TrainEngine.precision_plan`):
    fp32        fp32 weights and gradients; ZeRO-1: DeepSpeedZeroOptimizer (fp32 partition copy)
    bf16        BF16_Optimizer: bf16 weights, fp32 gradient accumulation buffer, fp32 master weights and Adam
                state partitioned over dp (`data_types.grad_accum_dtype = fp32`, ZeRO stage 1)
    fp16        dynamic loss scaling; ZeRO-0: FP16_(Unfused)Optimizer, ZeRO-1: DeepSpeedZeroOptimizer
    fp8         bf16's, exactly: the float8 GEMMs happen inside gptpar's layers (gptpar.tensor_parallel.float8), so
                DeepSpeed, its optimizer and its checkpoint files see a bf16 run (`deepspeed_precision`)
"""
from __future__ import annotations

import math

from gptpar.config import Config, ConfigError, deepspeed_precision
from gptpar.config.fields import suggest
from gptpar.schedules import BatchSizeRampup

# Top-level DeepSpeed keys the `deepspeed` section may set, each checked by DeepSpeed's own config model or
# parser (deepspeed_api.check_deepspeed_key): what each does.
PASSED_THROUGH = {
    "zero_optimization": "ZeRO's tuning knobs (TUNING_KEYS): `reduce_bucket_size`, `allgather_bucket_size`, "
                         "`overlap_comm`, `reduce_scatter`, `contiguous_gradients`, `allgather_partitions`, "
                         "`use_multi_rank_bucket_allreduce` (its `stage` is training.zero_stage).",
    "communication_data_type": "The dtype gradients are reduced in over dp: `fp32`, `fp16` or `bf16` (gptpar "
                               "sets fp32 under bf16 and fp8; otherwise DeepSpeed's default, the model's dtype). "
                               "Changes the numerics on purpose: the start-up log says so.",
}
# The keys of `zero_optimization` that change speed or memory only, never what is trained, saved or resumed.
TUNING_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "reduce_scatter", "contiguous_gradients",
               "allgather_partitions", "use_multi_rank_bucket_allreduce")
# Keys of `zero_optimization` refused with what they would break (any other key outside TUNING_KEYS is refused too).
_OFFLOAD = ("gptpar does not support offloading end to end (its step, checkpoint and universal-copy code keep the "
            "optimizer state with the model); remove it")
REFUSED = {
    "load_from_fp32_weights": "false restores the fp32 master weights from the 16-bit ones at a resume, and under bf16 "
                              "the first step after it writes the start-of-run master weights back into the model; "
                              "remove it (DeepSpeed's default, true, is what gptpar resumes with)",
    "offload_optimizer": _OFFLOAD, "offload_param": _OFFLOAD, "cpu_offload": _OFFLOAD, "cpu_offload_param": _OFFLOAD,
    "cpu_offload_use_pin_memory": _OFFLOAD,
    "elastic_checkpoint": "it changes the layout of the optimizer files gptpar's universal converter and resume "
                          "read; remove it (gptpar reshapes through universal checkpoints)",
}
# DeepSpeed keys gptpar generates from its own config: the gptpar key that sets each.
OWNED_KEYS = {
    "train_batch_size": "training.global_batch_size",
    "train_micro_batch_size_per_gpu": "training.micro_batch_size",
    "gradient_accumulation_steps": "training.global_batch_size (micro-batches = global batch / (micro batch x dp))",
    "gradient_clipping": "training.clip_grad",
    "zero_optimization.stage": "training.zero_stage",
    "bf16": "training.precision",
    "fp16": "training.precision (and training.loss_scale, initial_loss_scale, loss_scale_window, hysteresis, "
            "min_loss_scale)",
    "amp": "training.precision",
    "data_types": "training.precision (bf16 accumulates gradients in fp32)",
    "optimizer": "training.optimizer (and training.lr, adam_beta1, adam_beta2, adam_eps, weight_decay)",
    "zero_allow_untested_optimizer": "training.optimizer",
    "scheduler": "training.lr_decay_style (and the other training.lr_* keys)",
    "steps_per_print": "logging.log_interval",
    "wall_clock_breakdown": "logging.timers",
    "timers": "logging.log_interval (gptpar's log line times the iterations; DeepSpeed's timer would synchronize "
              "the device twice per micro-batch)",
    "activation_checkpointing": "training.activation_checkpointing",
    "tensorboard": "logging.tensorboard_dir",
    "csv_monitor": "logging.metrics_file",
}


def check_deepspeed_overrides(overrides: dict) -> None:
    """Raise ConfigError naming the first key of a `deepspeed` section that DeepSpeed or gptpar would not take:
    a key gptpar generates (with the gptpar key to set instead), a top-level key outside PASSED_THROUGH, or a key
    or value DeepSpeed's own model or parser refuses (which imports DeepSpeed)."""
    import gptpar.training.engine.deepspeed_api as deepspeed_api

    for key, value in overrides.items():
        if key in OWNED_KEYS:
            raise ConfigError(f"deepspeed.{key} is set by gptpar from {OWNED_KEYS[key]}: set that instead")
        if key not in PASSED_THROUGH:
            raise ConfigError(f"unknown key deepspeed.{key}{suggest(key, [*PASSED_THROUGH, *OWNED_KEYS])}: the "
                              f"deepspeed section passes {', '.join(PASSED_THROUGH)} through to DeepSpeed")
        owned = next((f"{key}.{k}" for k in (value if isinstance(value, dict) else ()) if f"{key}.{k}" in OWNED_KEYS),
                     None)
        if owned is not None:
            raise ConfigError(f"deepspeed.{owned} is set by gptpar from {OWNED_KEYS[owned]}: set that instead")
        problem = deepspeed_api.check_deepspeed_key(key, value)
        if problem is not None:
            path, message, known = problem
            where = f"deepspeed.{key}" + (f".{path}" if path else "")
            hint = suggest(path, known) if known and "." not in path and path not in known else ""
            raise ConfigError(f"{where}: {message}{hint} (DeepSpeed's check of its `{key}` config)")
        if key == "zero_optimization":
            _check_tuning_keys(value)


def _check_tuning_keys(zero: dict) -> None:
    """ConfigError naming the first key of deepspeed.zero_optimization outside TUNING_KEYS, and why."""
    for sub in zero:
        if sub in TUNING_KEYS or f"zero_optimization.{sub}" in OWNED_KEYS:
            continue
        why = REFUSED.get(sub, "it is not one of the keys gptpar passes through, which change speed or memory only "
                               f"({', '.join(TUNING_KEYS)}): it changes what is trained, saved or resumed, or applies "
                               "to a ZeRO stage gptpar does not run (0 and 1 only); remove it")
        raise ConfigError(f"deepspeed.zero_optimization.{sub} is refused: {why}")


def describe_overrides(overrides: dict) -> list:
    """One line per override that changes the numerics on purpose (the start-up log prints them)."""
    lines = []
    if "communication_data_type" in overrides:
        lines.append(f"deepspeed.communication_data_type={overrides['communication_data_type']}: gradients are "
                     "reduced over dp in that dtype (gptpar reduces in fp32 under bf16 and fp8), so the optimizer "
                     "steps on sums rounded to it")
    return lines


def merge_overrides(generated: dict, overrides: dict) -> dict:
    """`generated` with `overrides` laid over it: nested objects merge key by key, anything else replaces."""
    out = dict(generated)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_overrides(out[key], value)
        else:
            out[key] = value
    return out


def deepspeed_config(cfg: Config, dp_size: int, consumed_samples: int = 0) -> dict:
    """The DeepSpeed config dict generated from `cfg` for `dp_size` data-parallel ranks.

    The batch size is the one in force at `consumed_samples` (the ramp-up start for a fresh run). There is
    no "optimizer" block: the engine is given a client torch.optim.AdamW (DeepSpeed's FusedAdam would
    JIT-compile on CPU), and no "scheduler": the trainer sets the LR from `LearningRateSchedule`. The run
    config's `deepspeed` section is merged over the result (`check_deepspeed_overrides` first).
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
        # DeepSpeed's throughput timer (on by default) synchronizes the device when each forward starts and each
        # step() ends - twice per micro-batch, each a full drain of the GPU's queue, after which the GPU waits
        # for the host to launch the next forward. gptpar's log line times the iterations itself.
        "timers": {"throughput": {"enabled": False}},
    }
    if t.optimizer != "adamw":
        # ZeRO refuses client optimizers outside its list (torch's Adam/AdamW, its own) unless told; bitsandbytes'
        # AdamW8bit steps on ZeRO's flat fp32 partitions like any torch optimizer (tests/integration/test_optimizer8bit.py).
        ds["zero_allow_untested_optimizer"] = True
    if precision == "bf16":
        # Without it DeepSpeed sums bf16 gradients over the micro-batches (ZeRO-1 picks its bf16 ZeRO
        # optimizer; the pipeline at stage 0 warns "not safe numerically"). fp32 selects BF16_Optimizer: bf16
        # weights, an fp32 gradient buffer each micro-batch is added into, fp32 master weights and Adam state
        # partitioned over dp - what BLOOM trained with. (zero_stage is 1 here: TrainingConfig promotes 0.)
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
        # Add each bf16 gradient into the fp32 buffer as soon as autograd produces it and free it, instead of
        # keeping every bf16 gradient alive until the end of backward: 2 bytes per parameter less at the peak.
        ds["bf16"]["immediate_grad_update"] = True
        # Reduce the gradients over dp in fp32, as Megatron-LM does under bf16 (accumulate_allreduce_grads_in_fp32).
        # DeepSpeed's default for a bf16 engine is bf16: it casts the fp32 sums to bf16 for the all-reduce and
        # copies them back every step, even at dp = 1, so the optimizer would step on bf16-rounded gradients and
        # pay two casts (docs/benchmarks.md). `deepspeed.communication_data_type = bf16` halves the all-reduce's
        # bytes at dp > 1 at that price.
        ds["communication_data_type"] = "fp32"
    if precision == "fp16":
        ds["fp16"].update({
            "loss_scale": t.loss_scale,  # 0 = dynamic
            "initial_scale_power": int(round(math.log2(t.initial_loss_scale))),
            "loss_scale_window": t.loss_scale_window,
            "hysteresis": t.hysteresis,
            "min_loss_scale": t.min_loss_scale,
        })
    if cfg.deepspeed:
        check_deepspeed_overrides(cfg.deepspeed)
        ds = merge_overrides(ds, cfg.deepspeed)
    return ds
