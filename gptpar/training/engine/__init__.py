"""DeepSpeed behind one package: the GPT under a DeepSpeed engine (ZeRO-1, gradient accumulation, clipping,
fp32/bf16/fp16), split by what changes together:

    deepspeed_api.py    the only file here that imports DeepSpeed; its docstring lists every DeepSpeed
                        internal gptpar relies on and the test that breaks when one changes
    step.py             TrainEngine: the train/eval step, the phase timers, what the log line reads (params norm);
                        ZeroCounter; counted_once, the one rule that counts each parameter once in model-wide sums
    initialize.py       build_engine: the client optimizer, the model-parallel unit, the accelerator, shm clean-up
    ds_config.py        deepspeed_config: the DeepSpeed config dict generated from gptpar's run config, with the run
                        config's `deepspeed` section merged over it (check_deepspeed_overrides: what may be there)
    checkpointing.py    DeepSpeed's checkpoint files of one tag (save, load, the fp16 loss scale saved in them)
    optimizer_state.py  one parameter's full optimizer state (universal checkpoints), the precision plan, bytes held
    host_scalar.py      HostScalar: the step's loss and grad norm read without waiting for the optimizer step
    comm_op.py          DeepSpeed's CPU communication op: built once per venv, imported as it is after; a wait on
                        its build lock is said (the lock, whether a build runs, how to clear it)

Nothing else in gptpar/ imports DeepSpeed except the pipeline-stage builder (gptpar/model/pipeline.py:
`PipelineModule`, `LayerSpec`, the topology); tests/unit/test_package_structure.py keeps it so. The trainer and the
checkpointer talk to `TrainEngine`, never to the DeepSpeed engine it holds.
"""
from gptpar.training.engine.initialize import (ParallelStateMPU, build_engine, detect_accelerator, make_optimizer,
                                          optimizer_param_groups, release_shm_buffer, shm_buffer_path)
from gptpar.training.engine.checkpointing import checkpoint_loss_scale
from gptpar.training.engine.deepspeed_api import allow_fp16_on_cpu, quiet_deepspeed_log
from gptpar.training.engine.ds_config import deepspeed_config
from gptpar.training.engine.step import TrainEngine, ZeroCounter, fp16_loss_scale, to_device

__all__ = ["ParallelStateMPU", "TrainEngine", "ZeroCounter", "allow_fp16_on_cpu", "build_engine",
           "checkpoint_loss_scale", "deepspeed_config", "detect_accelerator", "fp16_loss_scale", "make_optimizer",
           "optimizer_param_groups", "quiet_deepspeed_log", "release_shm_buffer", "shm_buffer_path", "to_device"]
