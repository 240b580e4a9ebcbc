"""The one config source: a run's JSON sections as validated dataclasses, and `--set` overrides.

    cfg = load_config("configs/cpu_tiny.json", ["training.micro_batch_size=4"])
    tp, pp, dp = cfg.check(world_size)          # cross-section checks, before any process group
    ds_config = gptpar.training.engine.deepspeed_config(cfg, dp)  # generated from it, in the DeepSpeed module

Sections and keys use Megatron's names: `model` (gptpar.model.config.GPTConfig), `parallel`, `training`,
`data`, `checkpoint`, `logging`. Each field's meaning lives in its `metadata["doc"]`; docs/config.md is
generated from it by tools/gen_config_docs.py. Every error is a `ConfigError` naming `section.key` and the fix.
A seventh section, `deepspeed`, is DeepSpeed's own keys merged into the generated DeepSpeed config: kept here
as a JSON object, checked against DeepSpeed by gptpar.training.engine.ds_config (`check_deepspeed_overrides`,
called by the command line before any process group).

    errors.py    ConfigError, which every part raises (importable from anywhere without a circle)
    fields.py    fields that carry their documentation; the type checks driven by their annotations
    sections.py  the sections: parallel, training, data, checkpoint, logging (their own checks in __post_init__)
    run.py       Config: all sections in one object, JSON in and out
    checks.py    the checks across sections and against the world size and the machine (Config.check)
    loading.py   JSON files, `section.key=value` overrides, the command-line flags (Megatron's too), removed keys

Pure: nothing here imports DeepSpeed or touches torch.distributed.
"""
from gptpar.config.checks import OPTIONAL_PACKAGES, Accelerator, package_installed
from gptpar.config.errors import ConfigError
from gptpar.config.loading import REMOVED_KEYS, config_from_dict, load_config, parse_override, unique_keys
from gptpar.config.run import Config
from gptpar.config.sections import (ALL_SECTIONS, DEEPSPEED_SECTION, FP8_RECIPES, MODEL_DOCS, OPTIMIZERS, PRECISIONS,
                                    SECTIONS, CheckpointConfig, DataConfig, LoggingConfig, ParallelConfig,
                                    TrainingConfig, deepspeed_precision, parse_range)
from gptpar.model.config import GPTConfig

__all__ = ["ConfigError", "Accelerator", "OPTIMIZERS", "PRECISIONS", "FP8_RECIPES", "OPTIONAL_PACKAGES",
           "deepspeed_precision", "parse_range", "package_installed", "Config", "ParallelConfig", "TrainingConfig",
           "DataConfig", "CheckpointConfig", "LoggingConfig", "GPTConfig", "SECTIONS", "DEEPSPEED_SECTION",
           "ALL_SECTIONS", "REMOVED_KEYS", "MODEL_DOCS", "load_config", "config_from_dict", "parse_override",
           "unique_keys"]
