"""`Config`: every section of a run's config in one object, JSON in and out."""
from __future__ import annotations

import json
import typing
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional, Tuple

from gptpar.config.checks import Accelerator, check_run
from gptpar.config.sections import (DEEPSPEED_SECTION, SECTIONS, CheckpointConfig, DataConfig, LoggingConfig,
                                    ParallelConfig, TrainingConfig)
from gptpar.model.config import GPTConfig
from gptpar.model.partition import resolve_partition_method


@dataclass
class Config:
    """All sections; `check(world_size)` adds the checks that need several sections or the world size."""

    model: GPTConfig = field(default_factory=GPTConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=lambda: TrainingConfig(train_iters=10))
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # DeepSpeed's own keys, merged over the DeepSpeed config gptpar generates (nested objects merge key by key).
    # gptpar.training.engine.ds_config.check_deepspeed_overrides decides what may be there.
    deepspeed: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Plain JSON-able dict; `load_config` / `config_from_dict` of it gives an equal Config."""
        return dict({name: asdict(getattr(self, name)) for name in SECTIONS},
                    **{DEEPSPEED_SECTION: json.loads(json.dumps(self.deepspeed))})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def resolved_partition_method(self, pp_size: Optional[int] = None) -> str:
        """The resolved pipeline partitioning, `balanced` or `transformer` (what `auto` means here)."""
        pp = pp_size or self.parallel.pipeline_model_parallel_size
        return resolve_partition_method(self.parallel.partition_method, self.model.num_layers, pp,
                                        self.parallel.embedding_weight or 1)

    def check(self, world_size: int, accelerator: Optional[Accelerator] = None,
              installed: Optional[typing.Callable[[str], bool]] = None) -> Tuple[int, int, int]:
        """Cross-section checks for a run on `world_size` ranks; returns (tp, pp, dp)
        (gptpar.config.checks.check_run)."""
        return check_run(self, world_size, accelerator, installed)


__all__ = ["Config"]
