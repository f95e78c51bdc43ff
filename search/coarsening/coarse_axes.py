"""Meshes of three or more axes, searched coarse to fine (O2).

Each op's strategies number (loops + 1) ** axes: a third axis makes a matmul's 25 strategies 125
and an edge between two of them 15,625 pairs, and the ILP of a 4-layer Llama on (4, 8, 8) holds
3.1M variables (20x two axes'). O2 therefore searches such a mesh twice:

1. coarse: two neighbouring mesh axes of the same link (both across hosts, or both inside one)
   merged into one axis of their product, the mesh one axis smaller (`merged`). A layout over
   the merged axis is the layout over the pair in mesh order (major, minor) on the same dim,
   so every coarse plan is a plan of the real mesh, priced alike.
2. fine: the real mesh, each unit offered only the strategies that place every mesh axis where
   the coarse plan placed it, except at most one axis (`near`): a matmul keeps 13 of its 125.
   The fine plan can part the merged pair (the batch over one, the sequence over the other) or
   move any single axis; its space holds the coarse plan, so a fine search solved to optimality
   is no worse than it.

O3 searches the whole space. Where O2 solves by windows, on two axes too, the coarse plan is also
where the windows may start (`planner._starts`): from the replicated plan alone they stop where no
single window can move to data parallelism.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from rhino_jax.core.specs import ShardingSpec

from ...hlo_passes.graph import Pin
from ..cost.cluster import MeshTopology
from ..space.strategies import Strategy

RADIUS = 1  # mesh axes a fine strategy may place elsewhere than the coarse plan did


@dataclass(frozen=True)
class Merge:
    """Two neighbouring mesh axes seen as one (`major` then `minor`, as the mesh orders them)."""

    major: str
    minor: str

    @property
    def name(self) -> str:
        return f"{self.major}*{self.minor}"

    def anchor(self, coarse: Strategy, axes: Sequence[str]) -> dict[str, tuple]:
        """The placements of the real mesh's axes in a coarse strategy: the merged pair both where
        their merged axis is."""
        found = placements(coarse, [self.name if a in (self.major, self.minor) else a for a in axes])
        return {a: found[self.name if a in (self.major, self.minor) else a] for a in axes}

    def pins(self, pins: Sequence[Pin]) -> tuple[Pin, ...]:
        """The user's pins on the coarse mesh: the merged pair on one dim becomes the merged axis;
        a dim that names one of the two alone is left open there (the fine search keeps the pin)."""
        def dim(axes):
            if axes is None or not {self.major, self.minor} & set(axes):
                return axes
            if self.major in axes and self.minor in axes:
                return tuple(self.name if a == self.major else a for a in axes if a != self.minor)
            return None
        return tuple(dataclasses.replace(p, dims=tuple(dim(axes) for axes in p.dims)) for p in pins)


@dataclass(frozen=True)
class Drop:
    """A mesh axis left out: the coarse plan replicates every tensor over it."""

    axis: str

    @property
    def name(self) -> str:
        return self.axis

    def anchor(self, coarse: Strategy, axes: Sequence[str]) -> dict[str, tuple]:
        """The placements of the real mesh's axes in a coarse strategy: the dropped axis nowhere."""
        found = placements(coarse, [a for a in axes if a != self.axis])
        return {a: found.get(a, (None,) * (len(coarse.operands) + len(coarse.results))) for a in axes}

    def pins(self, pins: Sequence[Pin]) -> tuple[Pin, ...]:
        """The user's pins without the dropped axis (the fine search keeps the pin)."""
        def dim(axes):
            return axes if axes is None else tuple(a for a in axes if a != self.axis)
        return tuple(dataclasses.replace(p, dims=tuple(dim(axes) for axes in p.dims)) for p in pins)


def _alike(topo: MeshTopology, i: int) -> bool:
    """Whether mesh axes i and i + 1 have the same link (bandwidth, and whether they cross hosts)."""
    crosses = topo.hosts_spanned or (1,) * len(topo.axis_names)
    return topo.bandwidth[i] == topo.bandwidth[i + 1] and (crosses[i] > 1) == (crosses[i + 1] > 1)


def merged(topo: MeshTopology) -> tuple[MeshTopology, Merge]:
    """The mesh with one pair of neighbouring axes made one. The pair is the outermost whose two
    axes have the same link (bandwidth and whether they cross hosts), else the outermost pair:
    axes alike in cost are the ones a plan most often uses together."""
    names = topo.axis_names
    i = next((i for i in range(len(names) - 1) if _alike(topo, i)), 0)
    merge = Merge(names[i], names[i + 1])

    def joined(values: Sequence, how) -> tuple:
        return tuple(values[:i]) + (how(values[i], values[i + 1]),) + tuple(values[i + 2:])

    coarse = dataclasses.replace(
        topo, axis_names=joined(names, lambda a, b: merge.name),
        axis_sizes=joined(topo.axis_sizes, lambda a, b: a * b), bandwidth=joined(topo.bandwidth, min),
        latency=joined(topo.latency, max),
        hosts_spanned=joined(topo.hosts_spanned, lambda a, b: a * b) if topo.hosts_spanned else ())
    assert math.prod(coarse.axis_sizes) == topo.num_devices
    return coarse, merge


def coarser(topo: MeshTopology) -> tuple[MeshTopology, Merge | Drop]:
    """The mesh one axis smaller that a coarse plan is searched on: two axes alike in link
    merged (`merged`); on a mesh of two unlike axes (hosts x GPUs), the slower one dropped, as
    merging them would price every collective over the pair at the slower link and leave the
    coarse plan replicated."""
    if len(topo.axis_names) != 2 or _alike(topo, 0):
        return merged(topo)
    i = 0 if topo.bandwidth[0] < topo.bandwidth[1] else 1
    keep = 1 - i

    def one(values: Sequence) -> tuple:
        return (values[keep],)
    coarse = dataclasses.replace(
        topo, axis_names=one(topo.axis_names), axis_sizes=one(topo.axis_sizes), bandwidth=one(topo.bandwidth),
        latency=one(topo.latency), hosts_spanned=one(topo.hosts_spanned) if topo.hosts_spanned else ())
    return coarse, Drop(topo.axis_names[i])


def placements(s: Strategy, axes: Sequence[str]) -> dict[str, tuple]:
    """Where each mesh axis is in a strategy: per operand and result, the dim it splits, "p"
    where the tensor is a partial sum over it, None where it replicates."""
    def where(spec: ShardingSpec, axis: str):
        return "p" if axis in spec.partial else spec.dim_of(axis)
    specs = s.operands + s.results
    return {a: tuple(where(spec, a) for spec in specs) for a in axes}


def near(strategies: Sequence[Strategy], at: dict[str, tuple], axes: Sequence[str]) -> list[Strategy]:
    """The strategies that place at most `RADIUS` mesh axes elsewhere than `at` (all of them when
    none does: a unit the coarse plan could not anchor keeps its whole space)."""
    kept = [s for s in strategies
            if sum(p != at[a] for a, p in placements(s, axes).items()) <= RADIUS]
    return kept or list(strategies)
