"""Config fields that carry their documentation, and the checks driven by their annotations (JSON gives an int
where a float is meant: accepted and converted)."""
from __future__ import annotations

import difflib
import json
import typing
from dataclasses import field, fields
from typing import Any, Dict, List, Optional, Sequence, Union

from gptpar.config.errors import ConfigError


def doc_field(default: Any, doc: str, choices: Optional[Sequence] = None):
    """A dataclass field carrying its documentation (and allowed values) for checks and docs/config.md."""
    meta = {"doc": doc}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: json.loads(json.dumps(default)), metadata=meta)
    return field(default=default, metadata=meta)


def type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin is Union:
        return any(type_ok(value, arg) for arg in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin in (list, List):
        (item,) = typing.get_args(tp) or (Any,)
        return isinstance(value, list) and all(type_ok(v, item) for v in value)
    if origin in (dict, Dict):
        key, item = typing.get_args(tp) or (Any, Any)
        return isinstance(value, dict) and all(type_ok(k, key) and type_ok(v, item) for k, v in value.items())
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    raise TypeError(f"unsupported annotation {tp}")


def _accepts(tp: Any, t: type) -> bool:
    """Whether annotation `tp` names type `t` itself (not inside a list)."""
    if typing.get_origin(tp) is Union:
        return any(_accepts(a, t) for a in typing.get_args(tp))
    return tp is t


def type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Union:
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) in (list, List):
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    if typing.get_origin(tp) in (dict, Dict):
        return "{" + " : ".join(type_name(a) for a in typing.get_args(tp)) + "}"
    return {bool: "bool", int: "int", float: "float", str: "string"}.get(tp, str(tp))


def check_fields(section: str, obj: Any) -> None:
    """Type-check every field against its annotation and its `choices`; convert ints to floats."""
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        value, tp = getattr(obj, f.name), hints[f.name]
        if not type_ok(value, tp):
            raise ConfigError(f"{section}.{f.name} must be {type_name(tp)}, got {value!r} "
                              f"({type(value).__name__}): fix the value in the config or --set")
        if type(value) is int and _accepts(tp, float) and not _accepts(tp, int):
            setattr(obj, f.name, float(value))
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ConfigError(f"{section}.{f.name} must be one of {list(choices)}, got {value!r}")


def check_positive(section: str, obj: Any, *names: str, allow_none: bool = False, allow_zero: bool = False):
    for name in names:
        value = getattr(obj, name)
        if value is None and allow_none:
            continue
        if value is None or value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise ConfigError(f"{section}.{name} must be {bound}"
                              f"{' (or null)' if allow_none else ''}, got {value!r}")



def suggest(name: str, options: Sequence[str]) -> str:
    """" (did you mean 'x'?)" for a close option, else the list of known ones."""
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(options))})"


__all__ = ["doc_field", "type_ok", "type_name", "check_fields", "check_positive", "suggest"]
