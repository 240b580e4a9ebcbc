"""Reading a run config: JSON files (a key given twice refused), `section.key=value` overrides, the command-line
flags that stand for them (every key's `--key-with-dashes`, and Megatron's own flags), and the keys gptpar once had,
named with what took their place."""
from __future__ import annotations

import json
import typing
from dataclasses import fields
from typing import Any, Dict, List, Optional, Sequence, Tuple

from gptpar.config.errors import ConfigError
from gptpar.config.fields import suggest, type_name, type_ok
from gptpar.config.run import Config
from gptpar.config.sections import ALL_SECTIONS, DEEPSPEED_SECTION, SECTIONS

# Keys gptpar had once: a config that still sets one is told what took its place.
REMOVED_KEYS = {
    ("logging", "wandb_project"): "the wandb writer was removed (nothing tested it); write TensorBoard events "
                                  "(logging.tensorboard_dir), which W&B imports (`wandb sync DIR`, or "
                                  "`wandb.init(sync_tensorboard=True)`)",
}


def _unknown_key(section: str, key: str, known: Sequence[str], where: str = "") -> ConfigError:
    removed = REMOVED_KEYS.get((section, key))
    if removed is not None:
        return ConfigError(f"{section}.{key}{where} is no longer a config key: {removed}. Remove it")
    return ConfigError(f"unknown key {section}.{key}{where}{suggest(key, known)}")



def _build_section(name: str, cls: type, values: dict):
    known = [f.name for f in fields(cls)]
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if key not in known:
            raise _unknown_key(name, key, known)
        if not type_ok(value, hints[key]):  # before __post_init__, which may compare it with numbers
            raise ConfigError(f"{name}.{key} must be {type_name(hints[key])}, got {value!r} "
                              f"({type(value).__name__}): fix the value in the config or --set")
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:  # GPTConfig raises ValueError naming model.<key>
        raise ConfigError(str(e)) from None


def config_from_dict(d: dict, overrides: Sequence[str] = ()) -> Config:
    """Build a Config from a (JSON) dict, then apply `section.key=value` overrides in order."""
    if not isinstance(d, dict):
        raise ConfigError(f"a config is a JSON object of sections {sorted(SECTIONS)}, got {type(d).__name__}")
    d = json.loads(json.dumps(d))  # a private deep copy
    for section in d:
        if section not in ALL_SECTIONS:
            raise ConfigError(f"unknown config section {section!r}{suggest(section, ALL_SECTIONS)}")
        if not isinstance(d[section], dict):
            raise ConfigError(f"config section {section!r} must be an object of keys")
    for item in overrides:
        for section, key, value in expand_override(item):
            _apply(d, section, key, value, item)
    built = {name: _build_section(name, cls, d.get(name, {})) for name, cls in SECTIONS.items()}
    return Config(**built, deepspeed=d.get(DEEPSPEED_SECTION, {}))


def _apply(d: dict, section: str, key: str, value: Any, item: str) -> None:
    if section == DEEPSPEED_SECTION:
        _set_nested(d.setdefault(section, {}), key, value, item)
    else:
        d.setdefault(section, {})[key] = value


def _set_nested(obj: dict, dotted: str, value: Any, item: str) -> None:
    """obj[a][b][c] = value for `a.b.c` (the deepspeed section's nested keys), creating objects on the way."""
    *path, last = dotted.split(".")
    for i, key in enumerate(path):
        obj = obj.setdefault(key, {})
        if not isinstance(obj, dict):
            raise ConfigError(f"override {item!r}: deepspeed.{'.'.join(path[:i + 1])} is {obj!r}, not an object "
                              "of keys")
    obj[last] = value


def unique_keys(pairs: Sequence[Tuple[str, Any]]) -> dict:
    """json's object_pairs_hook: a JSON object as a dict, refusing a key given twice, which a JSON reader would
    otherwise collapse to its last value without a word (two validation sets under one name, for instance)."""
    seen = set()
    for key, _ in pairs:
        if key in seen:
            names = ", ".join(repr(k) for k, _ in pairs)
            raise ConfigError(f"the key {key!r} appears twice in one JSON object (keys {names}): a JSON reader keeps "
                              "only the last, so the other would be dropped without a word; give each key once "
                              "(each data.valid_data_path set its own name)")
        seen.add(key)
    return dict(pairs)


def load_config(path: Optional[str], overrides: Sequence[str] = ()) -> Config:
    """Read a JSON config (None = all defaults) and apply `section.key=value` overrides."""
    d = {}
    if path is not None:
        try:
            with open(path) as f:
                d = json.load(f, object_pairs_hook=unique_keys)
        except ConfigError as e:
            raise ConfigError(f"config file {path}: {e}") from None
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found: pass --config configs/<name>.json") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {path} is a folder: pass a JSON file, --config configs/<name>.json")\
                from None
        except OSError as e:
            raise ConfigError(f"config file {path} cannot be read ({e.strerror or e}): pass a readable "
                              "--config FILE") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {path} is not valid JSON: {e}") from None
    return config_from_dict(d, overrides)


def expand_override(item: str) -> List[Tuple[str, str, Any]]:
    """An override as (section, key, value) settings: `section.key=value` is one (`parse_override`);
    `section={JSON object}` sets each of its keys as `section.key=value` would, and for `deepspeed` each nested
    key as `deepspeed.a.b=value` would, so that the object merges key by key, as the config file's does."""
    name, sep, raw = item.partition("=")
    section = name.strip()
    if not sep or "." in section or section not in ALL_SECTIONS:
        return [parse_override(item)]
    try:
        value = json.loads(raw, object_pairs_hook=unique_keys)
    except ConfigError as e:
        raise ConfigError(f"override {item!r}: {e}") from None
    except json.JSONDecodeError as e:
        value, problem = None, f"not valid JSON ({e})"
    else:
        problem = None if isinstance(value, dict) else f"a JSON {type(value).__name__}"
    if problem is not None:
        raise ConfigError(f"override {item!r}: `{section}=VALUE` takes a JSON object of the section's keys, got "
                          f"{problem}; e.g. --set '{section}={{\"key\": value}}' or --set {section}.key=value")
    if section == DEEPSPEED_SECTION:
        return [(section, ".".join(path), leaf) for path, leaf in _leaves(value, [])]
    known = [f.name for f in fields(SECTIONS[section])]
    for key in value:
        if key not in known:
            raise _unknown_key(section, key, known, f" in override {item!r}")
    return [(section, key, v) for key, v in value.items()]


def _leaves(obj: dict, path: List[str]):
    """(path, value) of every value in a nested object that is not itself a non-empty object."""
    for key, value in obj.items():
        if not key or "." in key:
            raise ConfigError(f"deepspeed key {key!r} in an override: DeepSpeed's keys are non-empty names "
                              "without dots")
        if isinstance(value, dict) and value:
            yield from _leaves(value, path + [key])
        else:
            yield path + [key], value


def parse_override(item: str) -> Tuple[str, str, Any]:
    """`section.key=value` -> (section, key, value); value parsed as JSON where it can be, else a string.

    A value that parses as JSON of a type the key does not take, while the key takes strings (e.g.
    `data.split=100`), stays the raw string.
    """
    name, sep, raw = item.partition("=")
    section, dot, key = name.strip().partition(".")
    if sep and not dot and section and section not in ALL_SECTIONS:
        raise ConfigError(f"unknown config section {section!r} in override {item!r}{suggest(section, ALL_SECTIONS)}")
    if not sep or not dot or not key:
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. training.micro_batch_size=4")
    if section not in ALL_SECTIONS:
        raise ConfigError(f"unknown config section {section!r} in override {item!r}"
                          f"{suggest(section, ALL_SECTIONS)}")
    if section == DEEPSPEED_SECTION:  # DeepSpeed's nested keys (`deepspeed.zero_optimization.reduce_bucket_size`)
        if any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r}: an empty key in {key!r}")
        try:
            return section, key, json.loads(raw)
        except json.JSONDecodeError:
            return section, key, raw
    cls = SECTIONS[section]
    known = [f.name for f in fields(cls)]
    if key not in known:
        raise _unknown_key(section, key, known, f" in override {item!r}")
    try:
        value = json.loads(raw, object_pairs_hook=unique_keys)
    except ConfigError as e:
        raise ConfigError(f"override {item!r}: {e}") from None
    except json.JSONDecodeError:
        return section, key, raw
    tp = typing.get_type_hints(cls).get(key, Any)
    if not type_ok(value, tp) and type_ok(raw, tp):
        value = raw
    return section, key, value


# Flags that are not `--<key-with-dashes>` of a unique key.
SPECIAL_ALIASES = {
    "--fp16": "training.precision=fp16",
    "--bf16": "training.precision=bf16",
    "--fp32": "training.precision=fp32",
    "--checkpoint-activations": "training.activation_checkpointing=true",
    "--recompute-activations": "training.activation_checkpointing=selective",  # Megatron-LM: selective
    "--log-num-zeros-in-grad": "logging.log_num_zeros=true",
    "--valid-weighted-split-paths": "data.valid_data_path",  # Megatron-DeepSpeed: "EN: 1.0 0.95:1 PREFIX" ...
    "--use-bnb-optimizer": "training.optimizer=adamw8bit",  # Megatron-DeepSpeed's switch
}
LIST_ALIASES = {"--data-path": None, "--rampup-batch-size": 3,  # nargs: None = one or more
                "--skip-train-iteration-range": None,  # Megatron-DeepSpeed: --skip-train-iteration-range 5-7 9-9
                "--valid-weighted-split-paths": None}
STRING_LISTS = ("--data-path", "--skip-train-iteration-range", "--valid-weighted-split-paths")  # kept as strings


def cli_aliases() -> Dict[str, str]:
    """`--flag` -> `section.key` for every key (dashes for underscores), plus SPECIAL_ALIASES."""
    aliases = {}
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            assert flag not in aliases, f"two sections have a key {f.name}: give one a special alias"
            aliases[flag] = f"{section}.{f.name}"
    aliases.update(SPECIAL_ALIASES)
    return aliases


__all__ = ["SPECIAL_ALIASES", "LIST_ALIASES", "STRING_LISTS", "cli_aliases", "REMOVED_KEYS", "config_from_dict",
           "expand_override", "load_config", "parse_override", "unique_keys"]
