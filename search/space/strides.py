"""Strided specs (Rhino §4.1) and where to offer them (§4.3.3 candidate generation).

A reshape moves no data, so the layout on one side determines the layout on the other: a
tensor [B, S, D] split on S reads, as [B·S, D], as dim 0 dealt in blocks of S/n, round robin
(stride S/n), which no maximum-stride spec can say. `map_reshape` finds that spec.

Candidates: every tensor may take maximum strides; another stride is offered only where a
comm-free merge carries one, starting from a reshape (the only op that turns maximum strides into
others) and spreading through the ops that keep a loop's layout (elementwise, broadcast,
transpose, reduce, dot). Rhino starts the merge at compute-heavy ops with maximum strides; in a
training graph every reshape's maximum-stride side is reached from one, so starting at reshapes
finds the same strides without enumerating the whole graph's maximum-stride specs.
"""
from __future__ import annotations

import itertools
from collections import defaultdict, deque

import numpy as np

from rhino_jax.core.ops import ELEMENTWISE
from rhino_jax.core.specs import ShardingSpec

from ...hlo_passes.graph import Graph, Node
from ..cost.cluster import MeshTopology
from .rules import loop_space

# Ops whose strided operands the rewrite can split (see hlo_passes/split_dims).
STRIDED_OPS = set(ELEMENTWISE) | {
    "stablehlo.broadcast_in_dim", "stablehlo.transpose", "stablehlo.reshape", "stablehlo.reduce",
    "stablehlo.dot_general"}

Fact = tuple[int, int, int]  # (dim, shard count, stride): the dim may be split n ways at this stride


def _minor(shape: tuple[int, ...]) -> list[int]:
    """Elements between consecutive indices of each dim, row-major."""
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return out


def map_reshape(spec: ShardingSpec, src: tuple[int, ...], dst: tuple[int, ...],
                sizes: dict[str, int]) -> ShardingSpec | None:
    """The spec of reshape(x, dst) that keeps every element on its device, for x laid out as
    `spec`; None when no spec can (the reshape would need communication).

    Each mesh axis on a dim deals blocks of `block` elements of the flattened tensor round robin.
    The same blocks are a dim of `dst` split at stride block / (elements per index of that dim),
    when that is whole; the axes landing on one dim must nest (major block = minor block · size)."""
    minor_src, minor_dst = _minor(src), _minor(dst)
    placed: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for p, axes in enumerate(spec.dims):
        inner = spec.stride(p) or src[p] // ShardingSpec.shard_factor_of(axes, sizes)
        for a in reversed(axes):
            block = inner * minor_src[p]
            q = next((q for q in range(len(dst)) if minor_dst[q] <= block < minor_dst[q] * dst[q]), None)
            if q is None or block % minor_dst[q]:
                return None
            placed[q].append((block // minor_dst[q], a))
            inner *= sizes[a]
    dims: list[tuple[str, ...]] = [()] * len(dst)
    strides = []
    for q, items in placed.items():
        items.sort(reverse=True)  # largest block first: the major axis
        if any(b1 != b2 * sizes[a2] for (b1, _), (b2, a2) in zip(items, items[1:])):
            return None
        dims[q] = tuple(a for _, a in items)
        stride, n = items[-1][0], ShardingSpec.shard_factor_of(dims[q], sizes)
        if dst[q] % (n * stride):
            return None
        if stride != dst[q] // n:
            strides.append((q, stride))
    return ShardingSpec(tuple(dims), spec.partial, tuple(sorted(strides)))


def shard_counts(topo: MeshTopology) -> list[int]:
    """How many ways one dim can be split: the products of the mesh's axis subsets."""
    counts = {int(np.prod(c)) for k in range(1, len(topo.axis_sizes) + 1)
              for c in itertools.combinations(topo.axis_sizes, k)}
    return sorted(counts - {1})


def _strided(spec: ShardingSpec | None, n: int) -> list[Fact]:
    if spec is None:
        return []
    return [(d, n, s) for d, s in spec.strides]


def _across_reshape(node: Node, graph: Graph, v: int, fact: Fact) -> list[tuple[int, Fact]]:
    """Facts on the other side of a reshape, for a fact (or a maximum stride) on `v`."""
    src, dst = node.operands[0], node.results[0]
    d, n, s = fact
    here, there = (src, dst) if v == src else (dst, src)
    shape = graph.values[here].shape
    dims = tuple(("_",) if i == d else () for i in range(len(shape)))
    spec = ShardingSpec(dims, (), ((d, s),) if s != shape[d] // n else ())
    mapped = map_reshape(spec, shape, graph.values[there].shape, {"_": n})
    return [(there, f) for f in _strided(mapped, n)]


def candidates(graph: Graph, topo: MeshTopology) -> dict[int, frozenset[Fact]]:
    """Per value, the non-maximum strides comm-free merging reaches (see the module doc)."""
    nodes = {n.id: n for n in graph.nodes if n.op in STRIDED_OPS}
    readers: dict[int, list[int]] = defaultdict(list)
    for n in nodes.values():
        for o in dict.fromkeys(n.operands):
            readers[o].append(n.id)
    counts = shard_counts(topo)
    found: dict[int, set[Fact]] = defaultdict(set)
    queue: deque[tuple[int, Fact]] = deque()

    def add(items):
        for v, f in items:
            if f not in found[v]:
                found[v].add(f)
                queue.append((v, f))

    for n in nodes.values():
        if n.op != "stablehlo.reshape":
            continue
        for v in (n.operands[0], n.results[0]):
            shape = graph.values[v].shape
            add(item for d, size in enumerate(shape) for k in counts if size % k == 0 and size > k
                for item in _across_reshape(n, graph, v, (d, k, size // k)))
    spaces = {}
    while queue:
        v, fact = queue.popleft()
        producer = graph.values[v].producer
        for nid in readers[v] + ([producer] if producer in nodes else []):
            node = nodes[nid]
            if node.op == "stablehlo.reshape":
                add(_across_reshape(node, graph, v, fact))
                continue
            if nid not in spaces:
                spaces[nid] = loop_space(node, graph)
            space = spaces[nid]
            if space is None:
                continue
            tensors = list(zip(node.operands, space.operands)) + list(zip(node.results, space.results))
            loops = {dims[fact[0]] for t, dims in tensors if t == v and len(dims) > fact[0]} - {None}
            add((t, (d, fact[1], fact[2])) for t, dims in tensors for d, loop in enumerate(dims)
                if loop in loops and not graph.values[t].constant)
    return {v: frozenset(f) for v, f in found.items()}
