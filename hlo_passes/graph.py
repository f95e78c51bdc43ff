"""Graph IR: the plain-data view of a lowered train step that the search works on.

One `Node` per StableHLO op of the (inlined) entry function, in program order, the ops of a
counted loop's body included (`hlo_passes.loops`); `Value`s are the tensors between them. Node i
corresponds to the i-th site that `hlo_passes.module.entry_sites` yields, which is how the
rewrite finds the op to annotate. A counted loop is two nodes around its body's: a
"stablehlo.while" node that reads the loop's initial values and makes the body's block arguments,
and a "stablehlo.return" node (the body's return) that reads the values the body yields and makes
the loop's results. Slot k of both is one loop-carried value, which keeps one layout throughout.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ROLES = ("parameter", "optimizer_state", "batch", "other")


@dataclass(frozen=True)
class Value:
    """A tensor: an entry argument or one result of a node."""

    id: int
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name, e.g. "float32"
    producer: int  # node id, or -1 for an entry argument
    constant: bool  # depends on no entry argument: XLA materialises it locally at no cost
    trips: int = 1  # made (and read) once per trip of the counted loop whose body holds it

    @functools.cached_property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * dtype_size(self.dtype)


@dataclass(frozen=True)
class Node:
    """One op. `attrs` holds the op-specific facts the sharding rules need (plain values)."""

    id: int
    op: str  # e.g. "stablehlo.dot_general"
    operands: tuple[int, ...]
    results: tuple[int, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    flops: float = 0.0
    name: str = ""  # source name from the op's location (named scopes, jax primitive)
    trips: int = 1  # runs once per trip of the counted loop whose body holds it


@dataclass(frozen=True)
class Arg:
    """An entry argument: where it came from in the user's pytree and what it is for."""

    index: int
    path: str  # e.g. "params['layers'][0]['w']"
    role: str  # one of ROLES
    value: int
    donated_to: int | None  # index of the output it aliases (donation), if any


@dataclass(frozen=True)
class Pin:
    """A user-fixed sharding of one value (rj.annotate / with_sharding_constraint).

    `dims[d]` is the tuple of mesh axes on dim d, or None where the user left it open."""

    value: int
    dims: tuple[tuple[str, ...] | None, ...]
    name: str


@dataclass(frozen=True)
class Graph:
    nodes: tuple[Node, ...]
    values: tuple[Value, ...]
    args: tuple[Arg, ...]
    outputs: tuple[int, ...]  # value ids returned by the entry function
    output_paths: tuple[str, ...]
    pins: tuple[Pin, ...]

    def consumers(self) -> dict[int, list[int]]:
        """value id -> ids of the nodes that read it (in program order, repeats kept once)."""
        users: dict[int, list[int]] = {v.id: [] for v in self.values}
        for n in self.nodes:
            for o in dict.fromkeys(n.operands):
                users[o].append(n.id)
        return users

    def op_histogram(self) -> dict[str, int]:
        hist: dict[str, int] = {}
        for n in self.nodes:
            hist[n.op] = hist.get(n.op, 0) + 1
        return hist

    def replace(self, **kw) -> "Graph":
        return dataclasses.replace(self, **kw)


_DTYPE_SIZES = {
    "bool": 1, "int8": 1, "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "float16": 2, "bfloat16": 2, "int16": 2, "uint16": 2,
    "float32": 4, "int32": 4, "uint32": 4,
    "float64": 8, "int64": 8, "uint64": 8, "complex64": 8, "complex128": 16,
}


def dtype_size(dtype: str) -> int:
    return _DTYPE_SIZES.get(dtype, 4)
