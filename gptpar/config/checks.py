"""The checks that need several sections or the world size (`check_run`, which `Config.check` calls), and what
they need to know of the machine: the accelerator and which optional packages are installed."""
from __future__ import annotations

import re
import typing
from dataclasses import dataclass
from typing import Optional, Tuple

from gptpar.config.errors import ConfigError
from gptpar.config.sections import parse_range
from gptpar.model.partition import partition_layers
from gptpar.schedules import BatchSizeRampup
from gptpar.schedules import train_iters as total_train_iters
from gptpar.topology import resolve_sizes

# The optional package an option needs and how to get it; imported only by the run that uses the option.
OPTIONAL_PACKAGES = {("training", "optimizer", "adamw8bit"): ("bitsandbytes", "pip install bitsandbytes"),
                     ("training", "precision", "fp8"): ("torchao", "pip install torchao==0.18.0")}



def package_installed(name: str) -> bool:
    """Whether `name` can be imported, found without importing it."""
    import importlib.util

    return importlib.util.find_spec(name) is not None


@dataclass(frozen=True)
class Accelerator:
    """What `Config.check` needs to know of the device a run will use (filled in from DeepSpeed's accelerator by
    `gptpar.training.engine.detect_accelerator`; tests build one by hand)."""

    name: str    # says what it is and why, e.g. "DeepSpeed's CPU accelerator (oneDNN: no fp16 kernels)"
    fp16: bool   # whether fp16 training (loss-scaled) runs on it
    fp8: bool = True  # whether float8 matmuls run on it: natively (CUDA compute capability 8.9+), or emulated (CPU)
    torch_version: str = ""  # torch.__version__ of the process ("" = unknown: no version-specific check)


def _torch_older_than(version: str, major: int, minor: int) -> bool:
    """Whether a torch.__version__ string such as "2.11.0+cu130" is below `major.minor` ("" is not)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return found is not None and (int(found.group(1)), int(found.group(2))) < (major, minor)


def check_run(cfg, world_size: int, accelerator: Optional[Accelerator] = None,
              installed: Optional[typing.Callable[[str], bool]] = None) -> Tuple[int, int, int]:
    """Cross-section checks for `cfg` run on `world_size` ranks; returns (tp, pp, dp).

    Pure: call it before creating any process group. `accelerator` describes the device the run will use
    (its fp16 support decides whether precision fp16 can run); `installed(package)` says whether an optional
    package an option needs is there (`package_installed`). None skips either check (dry runs, planning).
    """
    p, t, m = cfg.parallel, cfg.training, cfg.model
    try:
        tp, pp, dp = resolve_sizes(world_size, p.tensor_model_parallel_size,
                                   p.pipeline_model_parallel_size, p.data_parallel_size)
        m.check_parallel(tp, pp)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None

    if pp > 1:
        try:
            partition_layers(m.num_layers, pp, p.partition_method, p.embedding_weight or 1)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.logging.timers and pp > 1:
        raise ConfigError("logging.timers times the phases at pp = 1 only (DeepSpeed's pipeline engine "
                          f"interleaves them across micro-batches), got pp = {pp}: set logging.timers=false")
    if p.sequence_parallel and m.seq_length % tp:
        raise ConfigError(f"parallel.sequence_parallel needs model.seq_length ({m.seq_length}) to divide by "
                          f"tensor_model_parallel_size ({tp})")
    if (t.compile and p.sequence_parallel and tp > 1 and accelerator is not None
            and _torch_older_than(accelerator.torch_version, 2, 12)):
        # torch 2.11's compiled backward of sequence parallelism's scatter and reduce-scatter (whose gradient is
        # an all-gather) gathered zeros instead of the gradient, silently; 2.12.1 and 2.13 are right. Seen on
        # CPU (gloo) with 2.11.0; refused on every device, as CUDA could not be checked.
        raise ConfigError(f"training.compile=true with parallel.sequence_parallel=true at tp {tp} computes "
                          f"wrong gradients under torch {accelerator.torch_version} (torch 2.11's compiled "
                          "backward loses sequence parallelism's gradient all-gathers): install torch >= 2.12, "
                          "or set training.compile=false or parallel.sequence_parallel=false")

    try:
        BatchSizeRampup.from_config(t, dp)  # the batch arithmetic's one home (gptpar.schedules)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.logging.profile is not None:
        last = parse_range(cfg.logging.profile)[1]
        iterations = total_train_iters(t, dp)
        if last > iterations:
            raise ConfigError(f"logging.profile {cfg.logging.profile!r} ends after the run's last iteration "
                              f"({iterations}, from training.train_iters / train_samples): its report would "
                              f"never print; pick a range within 1-{iterations}")

    if cfg.data.data_path is None and not cfg.data.synthetic:
        raise ConfigError("data.data_path is not set: give a preprocessed dataset prefix, or set "
                          "data.synthetic=true explicitly to train on synthetic tokens")
    if t.precision == "fp16" and accelerator is not None and not accelerator.fp16:
        raise ConfigError(f"training.precision fp16 is not supported here: {accelerator.name} has no fp16 "
                          "support. Use training.precision=bf16 (or fp32), or run on a GPU")
    if t.precision == "fp8" and accelerator is not None and not accelerator.fp8:
        raise ConfigError(f"training.precision fp8 is not supported here: {accelerator.name} has no float8 "
                          "matmuls (torch._scaled_mm needs compute capability 8.9+: H100, H200, L4, ...). Use "
                          "training.precision=bf16")
    if installed is not None:
        check_optional_packages(cfg, installed)
    return tp, pp, dp


def check_optional_packages(cfg, installed) -> None:
    for (section, key, value), (package, command) in OPTIONAL_PACKAGES.items():
        if getattr(getattr(cfg, section), key) == value and not installed(package):
            raise ConfigError(f"{section}.{key}={value} needs the {package} package, which is not installed: "
                              f"run `{command}` in this environment, or set {section}.{key} to another value")


__all__ = ["Accelerator", "OPTIONAL_PACKAGES", "package_installed", "check_run", "check_optional_packages"]
