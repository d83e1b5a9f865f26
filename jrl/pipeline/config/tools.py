"""Run configs: nested frozen dataclasses, `--set a.b=value` overrides, dict round trip.

Unknown keys and values of the wrong type are rejected when the config is built, with a message
that names the key, the value and what is allowed.
"""

from __future__ import annotations

import ast
import dataclasses
import types
import typing
from typing import Any

from jrl.checks import did_you_mean


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(key: str, raw: Any, typ: Any) -> Any:
    """Converts raw (a string from the CLI or a JSON value) to the annotated type."""
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for option in args:
            if option is type(None):
                continue
            try:
                return _coerce(key, raw, option)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(f"{key}={raw!r}: matches none of {args}: " + "; ".join(errors))
    if dataclasses.is_dataclass(typ):
        if isinstance(typ, type) and isinstance(raw, typ):
            return raw
        if isinstance(raw, dict):
            return from_dict(typ, raw, prefix=key + ".")
        raise ValueError(f"{key}={raw!r}: expected a {typ.__name__} section")
    if typ is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "1", "yes"):
            return True
        if isinstance(raw, str) and raw.lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"{key}={raw!r}: expected true or false")
    if typ is int:
        if isinstance(raw, bool):
            raise ValueError(f"{key}={raw!r}: expected an integer")
        if isinstance(raw, int):
            return raw
        try:
            return int(str(raw).replace("_", ""))
        except ValueError:
            raise ValueError(f"{key}={raw!r}: expected an integer") from None
    if typ is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        try:
            return float(str(raw))
        except ValueError:
            raise ValueError(f"{key}={raw!r}: expected a number") from None
    if typ is str:
        return str(raw)
    if origin is tuple:
        if isinstance(raw, str):
            try:
                raw = ast.literal_eval(raw) if raw.strip() else ()
            except (ValueError, SyntaxError):   # bare names: a,b or [a, b]
                bare = raw.strip()
                if bare.startswith("[") and bare.endswith("]"):
                    bare = bare[1:-1]
                raw = tuple(x.strip() for x in bare.split(",") if x.strip())
        if not isinstance(raw, (list, tuple)):
            raw = (raw,)
        inner = args[0] if args else Any
        return tuple(_coerce(key, x, inner) if inner is not Any else x for x in raw)
    if typ is Any:
        return raw
    raise ValueError(f"{key}: unsupported field type {typ}")


def from_dict(cls, data: dict, *, prefix: str = "") -> Any:
    """Builds dataclass `cls` from a (nested) dict, rejecting unknown keys."""
    types_ = _field_types(cls)
    unknown = sorted(set(data) - set(types_))
    if unknown:
        raise ValueError(f"unknown config key {prefix + unknown[0]!r}"
                         f"{did_you_mean(unknown[0], types_)}; allowed keys under "
                         f"{prefix or 'the top level'}: {sorted(types_)}")
    values = {name: _coerce(prefix + name, raw, types_[name]) for name, raw in data.items()}
    return cls(**values)


def to_dict(config: Any) -> dict:
    """Nested plain dict (tuples become lists) - JSON-serialisable."""
    def convert(x):
        if dataclasses.is_dataclass(x):
            return {f.name: convert(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, (tuple, list)):
            return [convert(v) for v in x]
        return x
    return convert(config)


def apply_overrides(config: Any, overrides: list[str]) -> Any:
    """Returns config with every "a.b.c=value" applied, validated once at the end (so fields
    that depend on each other can be changed together); unknown keys raise ValueError."""
    data = to_dict(config)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected key=value, e.g. train.steps=10")
        key, raw = (part.strip() for part in item.split("=", 1))
        path = key.split(".")
        node, cls = data, type(config)
        for depth, name in enumerate(path):
            types_ = _field_types(cls)
            if name not in types_:
                where = ".".join(path[:depth]) or "the top level"
                raise ValueError(f"unknown config key {key!r}: {name!r} is not a field of "
                                 f"{where}{did_you_mean(name, types_)}; allowed: "
                                 f"{sorted(types_)}")
            if depth == len(path) - 1:
                node[name] = raw
            else:
                cls = types_[name]
                if not dataclasses.is_dataclass(cls):
                    raise ValueError(f"config key {key!r}: {name!r} is not a section")
                node = node[name]
    return from_dict(type(config), data)
