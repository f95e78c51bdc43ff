"""Dataclasses as JSON-ready plain data and back, driven by their type hints.

A plan is saved as plain JSON (numbers, strings, lists, objects) so that it can be read, diffed
and loaded without pickle, which would run code from the file. Typed fields take their natural
form: a tuple is a list, a dict with str keys an object, any other dict a list of [key, value]
pairs. A field at its default is left out (a sharding spec is mostly its dims), and a field
typed `object` holds a live value (a jax sharding) and is not written; it comes
back as its default. Free-form values (a field typed `dict` or `Any`, e.g. search statistics)
are written as they are where JSON keeps their type, and tagged where it would not: a tuple is
{"__tuple__": [...]}, a non-finite float {"__float__": "nan"}, a rhino_jax dataclass
{"__dataclass__": "module:Name", "fields": {...}}.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import types
import typing
from typing import Any

import numpy as np


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def to_plain(value, hint=Any):
    """`value` (of type `hint`) as JSON-ready data."""
    if value is None:
        return None
    if hint is Any or hint is dict:
        return _free_to_plain(value)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return to_plain(value, _not_none(args))
    if dataclasses.is_dataclass(hint):
        return {f.name: to_plain(getattr(value, f.name), _hints(hint)[f.name]) for f in dataclasses.fields(hint)
                if _hints(hint)[f.name] is not object and not _at_default(f, getattr(value, f.name))}
    if origin is tuple:
        return [to_plain(v, h) for v, h in zip(value, _item_hints(args, len(value)))]
    if origin is dict:
        key, val = args
        if key is str:
            return {k: to_plain(v, val) for k, v in value.items()}
        return [[to_plain(k, key), to_plain(v, val)] for k, v in value.items()]
    if hint is float:
        return float(value) if math.isfinite(value) else str(float(value))
    if hint in (int, bool, str):
        return hint(value)
    raise TypeError(f"no plain form for a field typed {hint}")


def from_plain(hint, data):
    """The value of type `hint` that `to_plain` wrote as `data`."""
    if data is None:
        return None
    if hint is Any or hint is dict:
        return _free_from_plain(data)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return from_plain(_not_none(args), data)
    if dataclasses.is_dataclass(hint):
        return _dataclass_from_plain(hint, data)
    if origin is tuple:
        return tuple(from_plain(h, v) for v, h in zip(data, _item_hints(args, len(data))))
    if origin is dict:
        key, val = args
        pairs = data.items() if key is str else data
        return {from_plain(key, k): from_plain(val, v) for k, v in pairs}
    if hint in (int, float, bool, str):
        return hint(data)
    raise TypeError(f"no plain form for a field typed {hint}")


def _dataclass_from_plain(cls: type, data: dict):
    if not isinstance(data, dict):
        raise ValueError(f"expected an object for {cls.__name__}, found {type(data).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{cls.__name__} has no field {unknown[0]!r} (the file was written by another version "
                         "of rhino_jax?)")
    missing = [n for n, f in known.items() if n not in data and _hints(cls)[n] is not object
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{cls.__name__} lacks field {missing[0]!r} (the file was written by another version "
                         "of rhino_jax?)")
    return cls(**{n: from_plain(_hints(cls)[n], v) for n, v in data.items()})


def _at_default(f: dataclasses.Field, value) -> bool:
    if f.default is not dataclasses.MISSING:
        return type(value) is type(f.default) and value == f.default
    return f.default_factory is not dataclasses.MISSING and value == f.default_factory()


def _not_none(args: tuple) -> Any:
    rest = [a for a in args if a is not type(None)]
    if len(rest) != 1:
        raise TypeError(f"no plain form for a union of {rest}")
    return rest[0]


def _item_hints(args: tuple, n: int) -> tuple:
    """The hint of each item of a tuple typed tuple[X, ...] or tuple[X, Y, ...]."""
    return (args[0],) * n if len(args) == 2 and args[1] is Ellipsis else args


def _free_to_plain(value):
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else {"__float__": str(float(value))}
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return [_free_to_plain(v) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [_free_to_plain(v) for v in value]}
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str) or k.startswith("__")]
        if bad:
            raise TypeError(f"free-form dict key {bad[0]!r}: only str keys not starting with '__' are saved")
        return {k: _free_to_plain(v) for k, v in value.items()}
    cls = type(value)
    if dataclasses.is_dataclass(cls) and cls.__module__.startswith("rhino_jax."):
        return {"__dataclass__": f"{cls.__module__}:{cls.__qualname__}", "fields": to_plain(value, cls)}
    raise TypeError(f"no plain form for a free-form value of type {cls.__name__}")


def _free_from_plain(data):
    if isinstance(data, list):
        return [_free_from_plain(v) for v in data]
    if not isinstance(data, dict):
        return data
    if data.keys() == {"__tuple__"}:
        return tuple(_free_from_plain(v) for v in data["__tuple__"])
    if data.keys() == {"__float__"}:
        return float(data["__float__"])
    if data.keys() == {"__dataclass__", "fields"}:
        return from_plain(_dataclass_named(data["__dataclass__"]), data["fields"])
    return {k: _free_from_plain(v) for k, v in data.items()}


def _dataclass_named(name: str) -> type:
    """A rhino_jax dataclass by its "module:Name"; nothing outside rhino_jax is imported."""
    module, _, qualname = name.partition(":")
    if not module.startswith("rhino_jax."):
        raise ValueError(f"free-form value names {name!r}: only rhino_jax dataclasses are loaded")
    cls = getattr(importlib.import_module(module), qualname, None)
    if not dataclasses.is_dataclass(cls):
        raise ValueError(f"free-form value names {name!r}, which is not a rhino_jax dataclass")
    return cls
