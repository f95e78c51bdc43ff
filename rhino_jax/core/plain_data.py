"""Dataclasses as JSON-ready plain data and back, driven by their type hints.

A plan is saved as plain JSON (numbers, strings, lists, objects) so that it can be read, diffed
and loaded without pickle, which would run code from the file. Typed fields take their natural
form: a tuple is a list, a dict with str keys an object, any other dict a list of [key, value]
pairs, a float that is not finite its string ("nan"). A field at its default is left out (a
sharding spec is mostly its dims), and a field typed `object` holds a live value (a jax
sharding) and is not written; it comes back as its default. Every field is typed: there are no
free-form values. Loading refuses a value not in the form its type is written in, naming where
it is (`PlainDataError`).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from typing import Any


class PlainDataError(ValueError):
    """Data that `to_plain` does not write for its type; `where` leads to it from the top (field
    names, keys, list positions), so that the error names the place to change in the file."""

    def __init__(self, why: str, where: tuple[str | int, ...] = ()):
        super().__init__(why, where)
        self.why, self.where = why, where

    def __str__(self) -> str:
        return f"{location(self.where)}: {self.why}" if self.where else self.why


def location(where: tuple[str | int, ...]) -> str:
    """A place in the data as a reader finds it in the file: arg_specs[5].dims[0]."""
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in where).lstrip(".")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def to_plain(value, hint):
    """`value` (of type `hint`) as JSON-ready data."""
    if value is None:
        return None
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
    """The value of type `hint` that `to_plain` wrote as `data`. PlainDataError, saying where, for
    data `to_plain` does not write: a hand-edited file fails here, not later in a wrong value (a
    string where a list belongs would be split into its characters)."""
    if data is None:
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return from_plain(_not_none(args), data)
    if dataclasses.is_dataclass(hint):
        return _dataclass_from_plain(hint, data)
    if origin is tuple:
        _expect(data, list)
        hints = _item_hints(args, len(data))
        if len(hints) != len(data):
            raise PlainDataError(f"expected a list of {len(hints)} items, found {len(data)}")
        return tuple(_within(i, h, v) for i, (v, h) in enumerate(zip(data, hints)))
    if origin is dict:
        key, val = args
        if key is str:
            _expect(data, dict)
            return {k: _within(k, val, v) for k, v in data.items()}
        _expect(data, list)
        return dict(_within(i, tuple[key, val], pair) for i, pair in enumerate(data))
    if hint in _JSON_FORMS:
        _expect(data, hint)
        try:
            return hint(data)
        except ValueError:  # a float written as a string is "nan", "inf" or "-inf"
            raise PlainDataError(f"expected a number, found the string {json.dumps(data)}") from None
    raise TypeError(f"no plain form for a field typed {hint}")


def _within(key: str | int, hint, data):
    """`from_plain` of the part of the data at `key`, an error in it located there."""
    try:
        return from_plain(hint, data)
    except PlainDataError as e:
        raise PlainDataError(e.why, (key, *e.where)) from None


# The JSON types `to_plain` writes for a field typed list (a tuple), dict or scalar; a float is
# written as a string when it is not finite ("nan").
_JSON_FORMS = {list: (list,), dict: (dict,), str: (str,), bool: (bool,), int: (int,), float: (int, float, str)}
_JSON_NAMES = {list: "a list", dict: "an object", str: "a string", bool: "true or false", int: "an integer",
               float: "a number"}


def _expect(data, form: type) -> None:
    """PlainDataError unless `data` is of the JSON type written for `form` (true is no number)."""
    if isinstance(data, _JSON_FORMS[form]) and (form is bool or not isinstance(data, bool)):
        return
    found = f"the string {json.dumps(data)}" if isinstance(data, str) else json.dumps(data)[:40]
    hint = f" (as a list of one item: [{json.dumps(data)}])" if form is list and isinstance(data, str) else ""
    raise PlainDataError(f"expected {_JSON_NAMES[form]}, found {found}{hint}")


def _dataclass_from_plain(cls: type, data: dict):
    _expect(data, dict)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise PlainDataError(f"{cls.__name__} has no field {unknown[0]!r} (the file was written by another version "
                             "of rhino_jax?)")
    missing = [n for n, f in known.items() if n not in data and _hints(cls)[n] is not object
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise PlainDataError(f"{cls.__name__} lacks field {missing[0]!r} (the file was written by another version "
                             "of rhino_jax?)")
    return cls(**{n: _within(n, _hints(cls)[n], v) for n, v in data.items()})


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
