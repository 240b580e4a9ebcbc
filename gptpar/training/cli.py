"""pretrain_gpt.py's command line: `--config FILE`, `--set section.key=value`, and Megatron-style aliases;
`parse` turns it into a checked `Config` and the (tp, pp, dp) grid, before any process group exists (the
`deepspeed` section included: `--set deepspeed.zero_optimization.reduce_bucket_size=5e8` sets a nested key).

Every config key also has a flag `--key-with-dashes VALUE` (e.g. `--micro-batch-size 4`), and a few Megatron flags
(`--fp16`, `--checkpoint-activations`, ...) map to values (gptpar.config.loading.cli_aliases). All of them become
`section.key=value` overrides applied by `gptpar.config.load_config`. `usage()` is `--help`: the options and one
line per config section, read from the sections, pointing at docs/config.md for every key.
"""
from __future__ import annotations

import json
import os
import textwrap
import typing
from typing import Any, Dict, List, Optional, Sequence, Tuple

from gptpar.config import SECTIONS, Config, ConfigError, load_config, package_installed
from gptpar.config.fields import suggest
from gptpar.config.loading import LIST_ALIASES, SPECIAL_ALIASES, STRING_LISTS, cli_aliases
from gptpar.config.sections import DEEPSPEED_DOC, DEEPSPEED_SECTION


USAGE = """usage: pretrain_gpt.py --config CONFIG.json [--set section.key=value ...] [--verbose]
                       [--dry-run [--json] [--gpu KIND] [--assume X ...] [--sec-per-iter S]
                                  [--calibration FILE|NAME ...]]
                       [Megatron-style aliases, e.g. --micro-batch-size 4 --train-iters 100 --bf16]

Trains a GPT on tp x pp x dp ranks from one JSON config; run it under deepspeed, torchrun or
`python -m gptpar.launch` for several ranks, or with plain python for one.

options:
  --config, -c FILE         the run's config (configs/*.json)
  --set section.key=VALUE   change one key, e.g. --set training.train_iters=50; repeatable; VALUE is read as
                            JSON where it can be; --set 'section={{"key": VALUE, ...}}' sets several (deepspeed's
                            nested objects merge key by key)
  --dry-run                 print the plan (GPUs, memory against the GPU's, seconds per iteration, days and
                            GPU-hours to train) and its details; starts nothing
  --sec-per-iter S          with --dry-run: a measured time per iteration, priced and rated (TFLOPs)
  --calibration FILE|NAME   with --dry-run: add a GPU kind (a bench/bench_layer.py --json file, or a shipped one: h100)
  --gpu KIND                with --dry-run: the GPU kind to plan for and rank by (a100-80gb, h100-80gb, h200)
  --assume X                with --dry-run: a what-if gptpar does not run (interleaved=V, tp-comm-overlap,
                            dp-comm-overlap, distributed-optimizer, ddp); repeatable
  --json                    with --dry-run: print the plan as one JSON object
  --verbose, -v             print the resolved config and DeepSpeed's info lines (by default the config is written
                            to the run's folder and its path printed)
  --help, -h                this text
  --local_rank N            accepted and ignored (the DeepSpeed launcher passes it; ranks come from the environment)

{aliases}

config sections (every key, its default and meaning: docs/config.md):
{sections}"""


def usage() -> str:
    """pretrain_gpt.py --help: the options, the Megatron switches and one line per config section, read from
    the sections themselves."""
    switches = ", ".join(flag for flag, target in SPECIAL_ALIASES.items() if "=" in target)
    aliases = textwrap.fill(f"Megatron-style aliases: every key as --<key-with-dashes> VALUE (e.g. "
                            f"--tensor-model-parallel-size 2; {', '.join(LIST_ALIASES)} take several values), "
                            f"and the switches {switches}.", width=115,
                            break_on_hyphens=False, break_long_words=False)
    docs = {name: " ".join((cls.__doc__ or "").split()) for name, cls in SECTIONS.items()}
    docs[DEEPSPEED_SECTION] = DEEPSPEED_DOC
    width = max(map(len, docs)) + 2
    sections = "\n".join(f"  {name:<{width}}{doc}" for name, doc in docs.items())
    return USAGE.format(aliases=aliases, sections=sections)


def parse_args(argv: Sequence[str]) -> Tuple[Optional[str], List[str], Dict[str, Any]]:
    """(config_path, overrides, flags) from a command line (without the program name).

    Overrides come out as `section.key=value` strings in command-line order, aliases included. flags holds
    `dry_run` (bool), `help` (bool), `verbose` (bool), `sec_per_iter` (float or None), `calibration` (a list),
    `gpu` (a kind or None), `assume` (a list) and `json` (bool), all for --dry-run, and `local_rank` (int or None,
    from the DeepSpeed launcher).
    """
    aliases = cli_aliases()
    config_path, overrides = None, []
    flags: Dict[str, Any] = {"dry_run": False, "help": False, "verbose": False, "sec_per_iter": None,
                             "calibration": [], "local_rank": None, "json": False, "gpu": None, "assume": []}
    args, i = list(argv), 0

    def value_of(flag: str, inline: Optional[str]) -> str:
        nonlocal i
        if inline is not None:
            return inline
        if i >= len(args) or args[i].startswith("--"):
            raise ConfigError(f"{flag} needs a value")
        i += 1
        return args[i - 1]

    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("-"):
            raise ConfigError(f"unexpected argument {arg!r}: options look like --config X or --set section.key=v")
        flag, eq, inline = arg.partition("=")
        inline = inline if eq else None
        if flag in ("--config", "-c"):
            config_path = value_of(flag, inline)
        elif flag == "--set":
            overrides.append(value_of(flag, inline))
        elif flag == "--dry-run":
            flags["dry_run"] = True
        elif flag in ("--help", "-h"):
            flags["help"] = True
        elif flag in ("--verbose", "-v"):
            flags["verbose"] = True
        elif flag == "--sec-per-iter":
            flags["sec_per_iter"] = _seconds(flag, value_of(flag, inline))
        elif flag == "--calibration":
            flags["calibration"].append(value_of(flag, inline))
        elif flag == "--gpu":
            flags["gpu"] = value_of(flag, inline)
        elif flag == "--assume":
            flags["assume"].append(value_of(flag, inline))
        elif flag == "--json":
            flags["json"] = True
        elif flag in ("--local_rank", "--local-rank"):
            flags["local_rank"] = int(value_of(flag, inline))
        elif flag in LIST_ALIASES:
            values = [inline] if inline is not None else []
            while i < len(args) and not args[i].startswith("--") and (inline is None):
                values.append(args[i])
                i += 1
            nargs = LIST_ALIASES[flag]
            if not values or (nargs is not None and len(values) != nargs):
                raise ConfigError(f"{flag} takes {nargs or 'one or more'} value(s), got {values}")
            target = aliases[flag]
            if flag == "--data-path" and len(values) == 1:
                overrides.append(f"{target}={values[0]}")
            else:
                parsed = [_json_or_str(v) for v in values]
                if flag in STRING_LISTS:
                    parsed = [str(v) for v in values]
                overrides.append(f"{target}={json.dumps(parsed)}")
        elif flag in aliases:
            target = aliases[flag]
            if "=" in target:  # a switch like --bf16
                if inline is not None:
                    raise ConfigError(f"{flag} takes no value")
                overrides.append(target)
                continue
            section, key = target.split(".")
            tp = typing.get_type_hints(SECTIONS[section])[key]
            no_value = inline is None and (i >= len(args) or args[i].startswith("--"))
            if tp is bool and no_value:  # Megatron's store_true flags
                overrides.append(f"{target}=true")
            else:
                overrides.append(f"{target}={value_of(flag, inline)}")
        else:
            known = list(aliases) + ["--config", "--set", "--dry-run", "--verbose", "--sec-per-iter", "--calibration",
                                     "--gpu", "--assume", "--json"]
            raise ConfigError(f"unknown option {flag}{suggest(flag, known)}")
    if (flags["sec_per_iter"] is not None or flags["calibration"] or flags["gpu"] or flags["assume"]
            or flags["json"]) and not flags["dry_run"]:
        raise ConfigError("--sec-per-iter, --calibration, --gpu, --assume and --json only apply to --dry-run: "
                          "add --dry-run")
    return config_path, overrides, flags


def _seconds(flag: str, value: str) -> float:
    """A positive number of seconds, or ConfigError naming the flag."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ConfigError(f"{flag} needs a positive number of seconds per iteration, got {value!r}")
    return seconds


def launched_world_size() -> Optional[int]:
    """The world size the launcher (or a test harness's process group) gave this process; None for a plain
    `python script.py`."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None


def parse(argv: Sequence[str]) -> Tuple[Optional[Config], Dict[str, Any], Optional[Tuple[int, int, int]]]:
    """(config, flags, (tp, pp, dp)) from a command line; raises ConfigError before anything distributed happens."""
    config_path, overrides, flags = parse_args(argv)
    if flags["help"]:
        return None, flags, None
    if config_path is None:
        raise ConfigError("no config given: pass --config configs/<name>.json")
    cfg = load_config(config_path, overrides)
    if cfg.deepspeed:  # DeepSpeed's own keys, checked through DeepSpeed's models (imports it: only when set)
        from gptpar.training.engine.ds_config import check_deepspeed_overrides

        check_deepspeed_overrides(cfg.deepspeed)
    p = cfg.parallel
    world = launched_world_size()
    if world is None:  # one rank, or the dry run's planned grid
        world = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * (p.data_parallel_size or 1) \
            if flags["dry_run"] else 1
    accelerator = None
    # What the device (fp16, fp8) or its torch (compiled sequence parallelism) decides; a dry run plans for GPUs.
    compiled_sp = cfg.training.compile and p.sequence_parallel and p.tensor_model_parallel_size > 1
    if (cfg.training.precision in ("fp16", "fp8") or compiled_sp) and not flags["dry_run"]:
        from gptpar.training.engine import detect_accelerator

        accelerator = detect_accelerator()
    return cfg, flags, cfg.check(world, accelerator, installed=None if flags["dry_run"] else package_installed)


def _json_or_str(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


__all__ = ["parse", "parse_args", "launched_world_size", "usage"]
