"""Graph IR: the plain-data view of a lowered train step that the search works on.

One `Node` per StableHLO op of the (inlined) entry function, in program order, the ops of a
counted loop's body included (`hlo_passes.loops`); `Value`s are the tensors between them. Node i
corresponds to the i-th site that `hlo_passes.module.entry_sites` yields, which is how the
rewrite finds the op to annotate. A counted loop is two nodes around its body's: a
"stablehlo.while" node that reads the loop's initial values and makes the body's block arguments,
and a "stablehlo.return" node (the body's return) that reads the values the body yields and makes
the loop's results. Slot k of both is one loop-carried value, which keeps one layout throughout.
A conditional (lax.cond, lax.switch) is its branches' ops (attrs "branch": the branches they are
in, by number, outermost first; they run only when those are taken, but are planned and their
compute priced as if each ran) followed by one node of the conditional's op that reads the
branch index and each branch's returned values, and makes its results (attrs "branches": how
many, "alternatives": their numbers; `slots`).
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse
from scipy.sparse.csgraph import connected_components

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


def slots(node: Node) -> list[tuple[int, tuple[int, ...], int]]:
    """(position of the slot's first operand in the node, its operands, its result) per slot of a
    node that passes values on slot by slot. A loop's entry or exit, or a barrier: slot k reads
    operand k. A conditional: slot k reads, after the branch index, what each branch returns as
    result k (`importer`)."""
    if "branches" not in node.attrs:
        return [(k, (v,), r) for k, (v, r) in enumerate(zip(node.operands, node.results))]
    b = node.attrs["branches"]
    return [(1 + k * b, node.operands[1 + k * b:1 + (k + 1) * b], r) for k, r in enumerate(node.results)]


@dataclass(frozen=True)
class Arg:
    """An entry argument: where it came from in the user's pytree and what it is for."""

    index: int
    path: str  # e.g. "params['layers'][0]['w']"
    role: str  # one of ROLES
    value: int
    donated_to: int | None  # index of the output it aliases (donation), if any
    # Copies of it in its layout that the step holds beside this program the whole time (a
    # pipeline stage's gradient sum and optimizer moments of a parameter, `pipelined`): counted
    # in the program's memory, so a memory limit sees what the stage holds.
    held_beside: int = 0


_PATH_TOKEN = re.compile(r"\['((?:[^'\\]|\\.)*)'\]|\[(\d+)\]|\.(\w+)")


def path_tokens(path: str) -> list[tuple[str, str]]:
    """An argument path after the argument's own index, as (kind, text) pairs, kind "key" (a dict
    key), "index" or "attr": arg[1][0].mu['w'] → [("index", "0"), ("attr", "mu"), ("key", "w")]."""
    return [("key", m.group(1)) if m.group(1) is not None else ("index", m.group(2)) if m.group(2) is not None
            else ("attr", m.group(3))
            for m in _PATH_TOKEN.finditer(path.split("]", 1)[1] if "]" in path else "")]


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
    # "out" + the leaf's key path in the result pytree (`lowering`), as `Arg.path` is "arg" + its
    # path in the tuple of arguments: "out[0]['w']" for the leaf at result[0]['w']
    output_paths: tuple[str, ...]
    pins: tuple[Pin, ...]
    # Bytes the step holds beside this program the whole time in each output's layout, in
    # multiples of the output's own (micro-batches' running sums: 1, or 2 for a bf16 gradient
    # summed in f32; `micro_batched`): counted in the program's memory, as `Arg.held_beside` is.
    outputs_held_beside: tuple[int, ...] = ()

    def consumers(self) -> dict[int, list[int]]:
        """value id -> ids of the nodes that read it (in program order, repeats kept once)."""
        users: dict[int, list[int]] = {v.id: [] for v in self.values}
        for n in self.nodes:
            for o in dict.fromkeys(n.operands):
                users[o].append(n.id)
        return users

    def is_zero(self, v: int) -> bool:
        """Value v is a zero constant, maybe broadcast, reshaped or converted (a sum that starts
        there may be cut into parts, each part's sum added up after)."""
        producer = self.values[v].producer
        while producer >= 0 and self.nodes[producer].op in ("stablehlo.broadcast_in_dim", "stablehlo.reshape",
                                                            "stablehlo.convert"):
            producer = self.values[self.nodes[producer].operands[0]].producer
        return producer >= 0 and self.nodes[producer].op == "stablehlo.constant" and \
            self.nodes[producer].attrs.get("zero", False)

    def op_histogram(self) -> dict[str, int]:
        hist: dict[str, int] = {}
        for n in self.nodes:
            hist[n.op] = hist.get(n.op, 0) + 1
        return hist

    def fed_back(self) -> dict[int, int]:
        """Output index → index of the argument it feeds back into (the next step's input): `feeds`
        of the entry's arguments and results."""
        def leaf(path: str, prefix: str, v: int) -> tuple[str, tuple[int, ...], str]:
            return path[len(prefix):], self.values[v].shape, self.values[v].dtype

        return feeds([leaf(a.path, "arg", a.value) for a in self.args],
                     [leaf(p, "out", v) for p, v in zip(self.output_paths, self.outputs)])

    def parts(self, joined: Iterable[tuple[int, int]]) -> tuple[int, ...]:
        """Each node's part: the nodes linked, directly or through others, by the `joined` pairs
        of node ids, numbered in program order (the part of the first node is 0)."""
        pairs = list(joined)
        rows, cols = zip(*pairs) if pairs else ((), ())
        linked = scipy.sparse.coo_matrix((np.ones(len(pairs)), (rows, cols)), shape=(len(self.nodes),) * 2)
        return tuple(connected_components(linked, directed=False)[1].tolist())  # labelled from node 0 on

    def replace(self, **kw) -> "Graph":
        return dataclasses.replace(self, **kw)


# Ops that pass values on slot by slot: a counted loop's entry and exit, remat's barrier.
SLOTWISE = frozenset({"stablehlo.while", "stablehlo.return", "stablehlo.optimization_barrier"})


def reach(graph: Graph, seeds: dict[int, int]) -> list[int]:
    """Per value id, the bits of the seeds (value id → bits) it depends on, OR-ed together. Each
    slot of a counted loop, a barrier or a conditional passes on only what it is given (a loop's
    parameters stay clear of its activations), so this runs to a fixed point: a slot the body
    makes depend on a seed does so from the loop's entry on. An op kept whole (a loop without a
    known trip count) mixes all it reads."""
    bits = [seeds.get(v.id, 0) for v in graph.values]
    exit_of = {n.attrs["loop_entry"]: n for n in graph.nodes if "loop_entry" in n.attrs}
    changed = True
    while changed:
        changed = False
        for n in graph.nodes:
            if n.id in exit_of:
                made = [(r, bits[start] | bits[yielded])
                        for r, start, yielded in zip(n.results, n.operands, exit_of[n.id].operands)]
            elif (n.op in SLOTWISE and "opaque" not in n.attrs) or "branches" in n.attrs:
                index = bits[n.operands[0]] if "branches" in n.attrs else 0
                made = [(r, functools.reduce(operator.or_, (bits[o] for o in reads), index))
                        for _, reads, r in slots(n)]
            else:
                read = functools.reduce(operator.or_, (bits[o] for o in n.operands), 0)
                made = [(r, read) for r in n.results]
            for r, b in made:
                if b & ~bits[r]:
                    bits[r] |= b
                    changed = True
    return bits


Leaf = tuple[str, tuple[int, ...], str]  # (key path inside the arguments or the result, shape, dtype)


def feeds(args: Sequence[Leaf], outs: Sequence[Leaf]) -> dict[int, int]:
    """Output leaf index → index of the argument leaf it feeds back into (the next step's input).

    A training loop calls step(params, opt_state, batch) -> (params, opt_state, loss) or
    step(state, batch) -> (state, metrics) and feeds the results back in, so those results
    should leave in the layout their argument came in. The rule, by key path (relative to the
    result's element and to the argument) with equal shape and dtype at every leaf:
      1. a whole subtree: the result, or one element of a tuple/list result, whose leaves are
         exactly those of one argument (same relative paths, shapes, dtypes) feeds that
         argument: the argument at its own index when it is one of those, else the only one;
         so `return loss, params, opt_state` and `return new_params` match too;
      2. then leaf by leaf: result[k]<path> feeds arg[k]<path> where both exist;
    each argument is fed by the first result (in output order) that matches it. Results that
    match nothing (a loss, metrics) are free to take any layout."""
    by_arg: dict[int | None, list] = {}
    for i, (rel, shape, dtype) in enumerate(args):
        top, rest = _split_top(rel)
        by_arg.setdefault(top, []).append((rest, shape, dtype, i))
    arg_sig = {top: tuple(sorted(x[:3] for x in leaves)) for top, leaves in by_arg.items()}
    pairs: dict[int, int] = {}
    for sub in (_subtrees(outs, whole=True), _subtrees(outs, whole=False)):
        for top, leaves in sub.items():
            if any(k in pairs for _, _, _, k in leaves):
                continue
            sig = tuple(sorted(x[:3] for x in leaves))
            same = [j for j, s in arg_sig.items() if s == sig]
            j = top if top in same else same[0] if len(same) == 1 else None
            if j is not None:
                where = {x[0]: x[3] for x in by_arg[j]}
                pairs.update((k, where[rest]) for rest, _, _, k in leaves)
    by_path = {leaf: i for i, leaf in enumerate(args)}
    for k, leaf in enumerate(outs):
        if k not in pairs and leaf in by_path:
            pairs[k] = by_path[leaf]
    fed: dict[int, int] = {}
    for k in sorted(pairs):
        if pairs[k] not in fed.values():
            fed[k] = pairs[k]
    return fed


_TOP = re.compile(r"\[(\d+)\]")


def _split_top(rel: str) -> tuple[int | None, str]:
    """'[0]['w']' → (0, "['w']"): the index of a tuple/list element and the path inside it."""
    m = _TOP.match(rel)
    return (int(m.group(1)), rel[m.end():]) if m else (None, rel)


def _subtrees(outs: Sequence[Leaf], whole: bool) -> dict:
    """The result as one subtree (top index 0), or its tuple/list elements by index."""
    found: dict = {}
    for k, (rel, shape, dtype) in enumerate(outs):
        top, rest = (0, rel) if whole else _split_top(rel)
        if top is not None:
            found.setdefault(top, []).append((rest, shape, dtype, k))
    return found


_DTYPE_SIZES = {
    "bool": 1, "int8": 1, "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "float16": 2, "bfloat16": 2, "int16": 2, "uint16": 2,
    "float32": 4, "int32": 4, "uint32": 4,
    "float64": 8, "int64": 8, "uint64": 8, "complex64": 8, "complex128": 16,
}


def dtype_size(dtype: str) -> int:
    return _DTYPE_SIZES.get(dtype, 4)
