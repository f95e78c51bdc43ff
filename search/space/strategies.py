"""Strategy space: every way to split one op's loops over the mesh axes, with its cost.

A strategy assigns each mesh axis to one loop of the op (or to none). It fixes the spec every
operand must arrive in, the spec of every result (partial on axes that split a dot's or a
convolution's summed loop), the compute time of the local piece, and collectives the op needs
inside itself (a reduce's or a scatter's, or a dot's sum split on several loops: all but the
last loop's; `rules.LoopSpace.reduce_kind`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from rhino_jax.core.specs import ShardingSpec

from ...hlo_passes.graph import Graph, Node, Value
from ..cost.cluster import Cluster, MeshTopology
from ..cost.collectives import Collective
from .rules import LoopSpace, loop_space
from .strides import STRIDED_OPS, Fact, map_reshape


@dataclass(frozen=True)
class Strategy:
    operands: tuple[ShardingSpec, ...]
    results: tuple[ShardingSpec, ...]
    compute_s: float
    collectives: tuple[Collective, ...] = ()


def _divides(n: int, size: int) -> bool:
    return size % n == 0


def _spec(dims: tuple[int | None, ...], asg: "_Assigned", partial=(), at_once: bool = False) -> ShardingSpec:
    return ShardingSpec(tuple(() if l is None else asg.loop_axes[l] for l in dims), tuple(partial),
                        tuple((d, asg.strides[l]) for d, l in enumerate(dims)
                              if l is not None and asg.strides[l] is not None), bool(partial) and at_once)


def tensor_specs(shape: tuple[int, ...], topo: MeshTopology, facts: frozenset[Fact] = frozenset()
                 ) -> list[ShardingSpec]:
    """Every non-partial spec of a tensor on the mesh that divides its dims evenly, with maximum
    strides and the candidate strides in `facts`."""
    space = LoopSpace(shape, (), (tuple(range(len(shape))),))
    return [asg.results[0] for asg in _assignments(space, [shape], topo, facts_by_loop(facts))]


def facts_by_loop(facts, dims: tuple[int | None, ...] | None = None) -> dict[int, set[tuple[int, int]]]:
    """(shard count, stride) candidates per loop, from a tensor's facts and its loop per dim."""
    out: dict[int, set[tuple[int, int]]] = {}
    for d, n, s in facts:
        loop = d if dims is None else dims[d]
        if loop is not None:
            out.setdefault(loop, set()).add((n, s))
    return out


def _assignments(space: LoopSpace, shapes: list[tuple[int, ...]], topo: MeshTopology,
                 loop_strides: dict[int, set[tuple[int, int]]]):
    """Yield every valid assignment of mesh axes (and candidate strides) to loops."""
    loops = len(space.sizes)
    reductions = set(space.reduction_loops())
    all_dims = list(space.operands) + list(space.results)
    # An axis of size 1 splits nothing: naming it would only add a spec equal to one without it,
    # a tie the solver breaks by chance (and a spec a reader takes for a split).
    per_axis = [range(-1, loops) if topo.sizes[a] > 1 else (-1,) for a in topo.axis_names]
    for choice in itertools.product(*per_axis):
        loop_axes: list[tuple[str, ...]] = [()] * loops
        ok = True
        for axis, l in zip(topo.axis_names, choice):
            if l < 0:
                continue
            if l in reductions and space.reduce_kind == "none":
                ok = False
                break
            loop_axes[l] = loop_axes[l] + (axis,)
        if not ok:
            continue
        split = [int(np.prod([topo.sizes[a] for a in ax])) if ax else 1 for ax in loop_axes]
        for dims, shape in zip(all_dims, shapes):
            if any(l is not None and not _divides(split[l], shape[d]) for d, l in enumerate(dims)):
                ok = False
                break
        if not ok or any(not _divides(split[l], space.sizes[l]) for l in range(loops)):
            continue
        options = [[None] + sorted(s for n, s in loop_strides.get(l, ()) if n == split[l] > 1)
                   for l in range(loops)]
        for strides in itertools.product(*options):
            yield _Assigned(space, loop_axes, split, strides)


@dataclass
class _Assigned:
    space: LoopSpace
    loop_axes: list[tuple[str, ...]]
    split: list[int]
    strides: tuple[int | None, ...]  # per loop: None for the maximum stride

    @property
    def results(self) -> list[ShardingSpec]:
        return [_spec(d, self) for d in self.space.results]


def compute_time(node: Node, values: tuple[Value, ...], traffic: int, split: float,
                 cluster: Cluster, launches: int = 0) -> float:
    """Roofline of the local piece (FLOPs at the dtype's rate or its memory traffic at memory
    bandwidth), and the kernels it launches (`fusion.kernel_launches`), which no split makes shorter."""
    out = values[node.results[0]] if node.results else None
    dtype = out.dtype if out is not None else "float32"
    roofline = max(node.flops / cluster.flops(dtype), traffic / cluster.memory_bandwidth) / split
    return roofline + launches * cluster.kernel_launch_s


def node_strategies(node: Node, graph: Graph, topo: MeshTopology, cluster: Cluster, traffic: int,
                    facts: dict[int, frozenset[Fact]], launches: int = 0) -> tuple[list[Strategy], bool]:
    """All strategies of a node, and whether it had a sharding rule (False: replicated only).
    `traffic` is the node's memory traffic from `memory_traffic`, `launches` its kernels from
    `kernel_launches`; `facts` the candidate strides
    per value (`strides.candidates`)."""
    if node.op == "stablehlo.reshape":
        return _reshape_strategies(node, graph, topo, cluster, traffic, facts, launches), True
    space = loop_space(node, graph)
    in_shapes = [graph.values[o].shape for o in node.operands]
    out_shapes = [graph.values[r].shape for r in node.results]
    if space is None:
        rep = Strategy(tuple(ShardingSpec.replicated(len(s)) for s in in_shapes),
                       tuple(ShardingSpec.replicated(len(s)) for s in out_shapes),
                       compute_time(node, graph.values, traffic, 1, cluster, launches))
        return [rep], False
    loop_strides: dict[int, set[tuple[int, int]]] = {}
    if node.op in STRIDED_OPS:
        for v, dims in zip(node.operands + node.results, space.operands + space.results):
            for loop, found in facts_by_loop(facts.get(v, ()), dims).items():
                loop_strides.setdefault(loop, set()).update(found)
    reductions = space.reduction_loops()
    out: list[Strategy] = []
    for asg in _assignments(space, in_shapes + out_shapes, topo, loop_strides):
        groups = [asg.loop_axes[l] for l in reductions if asg.loop_axes[l]]
        reduced: tuple[str, ...] = tuple(a for g in groups for a in g) if space.reduce_kind == "other" else ()
        partial: tuple[str, ...] = ()
        if space.reduce_kind == "sum" and groups:
            # XLA's dot sums the pieces of one split reduction loop at a time, each in a
            # full-size all-reduce; only the last loop's sum is left for the reader to settle.
            reduced, partial = tuple(a for g in groups[:-1] for a in g), tuple(groups[-1])
        elif space.reduce_kind == "sum_at_once" and groups:
            partial = tuple(a for g in groups for a in g)  # settled by the reader, all at once
        at_once = space.reduce_kind == "sum_at_once"
        operands = tuple(_spec(d, asg) for d in space.operands)
        results = tuple(_spec(d, asg, partial, at_once) for d in space.results)
        split = float(np.prod(asg.split))
        inner: tuple[Collective, ...] = ()
        if reduced:
            local = sum(graph.values[r].nbytes // s.shard_factor(topo.sizes)
                        for r, s in zip(node.results, results))
            inner = (Collective("all-reduce", reduced, local),)
        out.append(Strategy(operands, results, compute_time(node, graph.values, traffic, split, cluster, launches),
                            inner))
    return out, True


def _reshape_strategies(node: Node, graph: Graph, topo: MeshTopology, cluster: Cluster, traffic: int,
                        facts: dict[int, frozenset[Fact]], launches: int) -> list[Strategy]:
    """A reshape moves no data: every layout of its input (or output) that the other side can
    keep without communication (`strides.map_reshape`)."""
    (src,), (dst,) = node.operands, node.results
    pairs: set[tuple[ShardingSpec, ShardingSpec]] = set()
    for here, there, flip in ((src, dst, False), (dst, src, True)):
        shape = graph.values[here].shape
        for spec in tensor_specs(shape, topo, facts.get(here, frozenset())):
            mapped = map_reshape(spec, shape, graph.values[there].shape, topo.sizes)
            if mapped is not None:
                pairs.add((mapped, spec) if flip else (spec, mapped))
    return [Strategy((a,), (b,), compute_time(node, graph.values, traffic, a.shard_factor(topo.sizes), cluster,
                                              launches))
            for a, b in sorted(pairs)]
