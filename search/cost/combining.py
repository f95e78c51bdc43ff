"""Which planned collectives XLA combines into one op, and what the combined ops cost.

XLA's combiner passes merge collectives of one kind over the same device groups when neither
depends on the other, up to a byte and a count threshold (`cluster.Combiner`). A train step's
gradient all-reduces are such a family: each hangs off the backward chain and feeds only the
optimizer, so data parallelism runs one all-reduce, not one per parameter. Priced one by one,
each paying a launch and the ring's latency, they made the search run from data parallelism.

Two prices, one model:
- the search sums a linear price per collective: one whose value is off the compute chain
  (`combining_sides`: no compute-heavy op before it, or none after it) pays only its share of a
  launch (`Collective.time(..., combined=True)`), and the ILP pays each family's launch once;
- the plan replays the combiner on the planned collectives in program order (a loop body's trip
  by trip) with their true dependencies (`combine`), and prices each combined op as one
  collective of the summed bytes.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from rhino_jax.core.ops import COMPUTE_HEAVY

from ...hlo_passes.graph import Graph
from .cluster import Combiner, MeshTopology, combiner_for
from .collectives import Collective


class Planned(Protocol):
    kind: str
    axes: tuple[str, ...]
    bytes: int
    group: int  # devices in each of its groups
    dtype: str  # element type: all-reduces and reduce-scatters combine per type
    depends_on: int  # bit i set: depends on the i-th planned collective
    trip: int  # which trip of its loop's body it runs in (0 outside loops)
    trips: int  # its loop's trip count (1 outside loops): only the same loop's collectives combine
    branch: tuple[int, ...]  # the conditional branches it runs in: only the same branch's combine
    combinable: bool  # off the compute chain: XLA may combine it (and overlap it, `Cluster.overlap`)


HEAD, TAIL, DERIVED = "head", "tail", "derived"


def combining_sides(graph: Graph) -> dict[int, str]:
    """Where each value off the compute chain stands; values on it, and values of a program
    with no chain (no matmul or convolution), are left out.
    - HEAD: no compute-heavy op among its ancestors, one among its descendants (parameters on
      their way into the forward pass);
    - TAIL: one among its ancestors, none among its descendants (gradients on their way to the
      optimizer, the optimizer's updates);
    - DERIVED: a reduction of gradients (a global norm's partial sums, a metric of the gradients:
      a reduce of a tail value of a parameter's shape) and what is computed from it.
    Collectives on HEAD values are independent of the chain and of one another, and so are those
    on TAIL values: XLA combines each side's into one op. A collective on the chain (a Megatron
    all-reduce between two layers) waits for the last and runs alone. The sides are separate
    families: one runs before the chain, the other after it."""
    heavy_before = {a.value: False for a in graph.args}
    for n in graph.nodes:
        before = n.op in COMPUTE_HEAVY or any(heavy_before.get(o, False) for o in n.operands)
        for r in n.results:
            heavy_before[r] = before
    heavy_after: dict[int, bool] = {}
    for n in reversed(graph.nodes):
        after = n.op in COMPUTE_HEAVY or any(heavy_after.get(r, False) for r in n.results)
        for o in n.operands:
            heavy_after[o] = heavy_after.get(o, False) or after
    sides: dict[int, str] = {a.value: HEAD for a in graph.args if heavy_after.get(a.value, False)}
    param_shapes = {graph.values[a.value].shape for a in graph.args if a.role == "parameter"}
    gradient_like: set[int] = set()  # tail values of a parameter's shape: gradients, their squares
    for n in graph.nodes:
        derived = any(sides.get(o) == DERIVED for o in n.operands) or (
            n.op == "stablehlo.reduce" and any(o in gradient_like for o in n.operands))
        for r in n.results:
            if not heavy_before.get(r, False):
                if heavy_after.get(r, False):
                    sides[r] = HEAD
            elif not heavy_after.get(r, False):
                sides[r] = DERIVED if derived else TAIL
                if sides[r] == TAIL and graph.values[r].shape in param_shapes:
                    gradient_like.add(r)
    return sides


def combined_alone(kind: str, side: str | None, combiner: Combiner) -> bool:
    """Whether a collective of this (compiled) kind on a value at this side runs as its own op.
    An all-reduce of a DERIVED value (a global norm's partial sums, a metric) follows the
    gradients' all-reduces one by one on the CPU: XLA's combiner, greedy in program order, closes a
    group at each such dependency, so neither it nor the gradient it follows is combined
    (measured: optax's clip_by_global_norm over 71 sharded gradients compiled to 71 all-reduces).
    The GPU compiler reduce-scatters the gradients instead and reassociates a sum of all-reduces
    into one (measured: the same clipped Flax LM's FSDP step compiles to one scalar all-reduce):
    there they are a family like any other."""
    if side is None:
        return True
    return side == DERIVED and kind == "all-reduce" and not combiner.reassociates


@dataclass(frozen=True)
class Families:
    """The families of collectives the backend combines on this mesh, (compiled kind, set of
    axes, side, trips of the loop that runs them) → index, and the launch and latency the
    combined ops of each pay in one step (`fixed`)."""

    index: dict[tuple[str, frozenset[str], str, int], int]
    fixed: tuple[float, ...]

    def of(self, collectives: Sequence[Collective], combiner: Combiner, side: str | None,
           trips: int = 1) -> frozenset[int]:
        keys = ((combiner.compiled_kind(c.kind), frozenset(c.axes), side, trips) for c in collectives)
        return frozenset(self.index[k] for k in keys if k in self.index)

    def vector(self, used: frozenset[int]) -> np.ndarray:
        out = np.zeros(len(self.fixed), dtype=bool)
        out[list(used)] = True
        return out


def families(topo: MeshTopology, trips: Sequence[int] = (1,)) -> Families:
    """Every family the backend combines: each kind with a combiner, over each set of mesh axes
    of more than one device, on each side of the compute chain (`combining_sides`), and per trip
    count of the loops that run them: a loop body's collectives combine within a trip, never
    across trips, so that family pays its launch once per trip."""
    index: dict[tuple[str, frozenset[str], str, int], int] = {}
    fixed: list[float] = []
    names = topo.axis_names
    for kind in ("all-reduce", "all-gather", "reduce-scatter"):
        if not topo.combiner.limit(kind) or topo.combiner.compiled_kind(kind) != kind:
            continue
        for k in range(1, len(names) + 1):
            for axes in itertools.combinations(names, k):
                if topo.link(axes)[0] == 1:
                    continue
                for side, n in itertools.product((HEAD, TAIL, DERIVED), sorted(set(trips))):
                    if not combined_alone(kind, side, topo.combiner):
                        index[kind, frozenset(axes), side, n] = len(fixed)
                        fixed.append(n * Collective(kind, axes, 0).time(topo) * topo.exposed(True))
    return Families(index, tuple(fixed))


def combine(planned: Sequence[Planned], combiner: Combiner) -> list[list[int]]:
    """The combined ops, as lists of indices into `planned`, the way XLA's combiners group them:
    walking in program order (a loop body's collectives trip by trip), a collective joins the
    open group of its kind and axes (and element type for all-reduces and reduce-scatters; in its
    loop and conditional branch: each is its own computation) unless it and a member depend on
    one another or the group would pass a threshold (counted as XLA counts it,
    `Combiner.counted`); then the group is closed and it opens the next. Kinds the backend does
    not combine stay alone."""
    groups: list[list[int]] = []
    open_group: dict[tuple, tuple[int, int, int, int]] = {}  # key → (group, members, their needs, bytes)
    for i in sorted(range(len(planned)), key=lambda i: (planned[i].trip, i)):
        c = planned[i]
        kind = combiner.compiled_kind(c.kind)
        limit = combiner.limit(kind)
        key = (kind, frozenset(c.axes), c.trips, c.branch, c.dtype if combiner.keyed_by_dtype(kind) else "")
        counted = combiner.counted(kind, c.bytes, c.group)
        if limit and key in open_group:
            g, members, needs, total = open_group[key]
            if not c.depends_on & members and not needs >> i & 1 and total + counted <= limit \
                    and len(groups[g]) < combiner.threshold_count:
                groups[g].append(i)
                open_group[key] = (g, members | 1 << i, needs | c.depends_on, total + counted)
                continue
        groups.append([i])
        open_group[key] = (len(groups) - 1, 1 << i, c.depends_on, counted)
    return groups


def _merged(planned: Sequence[Planned], group: list[int], combiner: Combiner) -> Collective:
    """One combined op (as the backend compiles it), with its members' bytes."""
    first = planned[group[0]]
    return Collective(combiner.compiled_kind(first.kind), first.axes, sum(planned[i].bytes for i in group))


def combined_kinds(planned: Sequence[Planned], backend: str) -> dict[str, tuple[int, int, int]]:
    """kind → (count, bytes, planned collectives merged into them) of the ops a backend's XLA
    compiles for the planned collectives, once its combiners have merged independent ones."""
    combiner = combiner_for(backend)
    out: dict[str, tuple[int, int, int]] = {}
    for group in combine(planned, combiner):
        c = _merged(planned, group, combiner)
        n, b, m = out.get(c.kind, (0, 0, 0))
        out[c.kind] = (n + 1, b + c.bytes, m + len(group))
    return out


def member_kernels_s(kind: str, nbytes: int, side: str | None, topo: MeshTopology) -> float:
    """Seconds of compute a collective of `kind` and `nbytes` on a value at `side` adds as a
    member of a combined op, where the backend runs that op on one contiguous buffer
    (`Combiner.contiguous_all_reduce`): the kernel that slices it out of the result, and its part
    of the concatenation into it, each reading and writing its bytes. The concatenation's own
    launch is its op's (`op_kernels_s`). None for the all-reduces of DERIVED values where the
    backend reassociates them: their sum is one all-reduce of one buffer (`combined_alone`)."""
    combiner = topo.combiner
    if not (combiner.contiguous_all_reduce and combiner.compiled_kind(kind) == "all-reduce") \
            or (side == DERIVED and combiner.reassociates):
        return 0.0
    return topo.kernel_launch_s + 4 * nbytes / topo.memory_bandwidth


def op_kernels_s(planned: Sequence[Planned], group: list[int], sides: Sequence[str | None],
                 topo: MeshTopology) -> float:
    """Seconds of compute XLA adds around one combined op (`member_kernels_s`; `sides`: each
    planned collective's value's side of the chain): none for a collective alone."""
    if len(group) < 2:
        return 0.0
    members = sum(member_kernels_s(planned[i].kind, planned[i].bytes, sides[i], topo) for i in group)
    return members + (topo.kernel_launch_s if members else 0.0)


def combined_ops(planned: Sequence[Planned], topo: MeshTopology) -> list[tuple[list[int], float]]:
    """The combined ops (`combine`), each with its time as one collective of its members' bytes."""
    return [(group, _merged(planned, group, topo.combiner).time(topo))
            for group in combine(planned, topo.combiner)]


def combined_time(planned: Sequence[Planned], topo: MeshTopology) -> tuple[float, float]:
    """Communication time of the planned collectives once XLA has combined them, and the part of
    it off the compute chain (ops of collectives XLA may combine), which may overlap compute."""
    ops = combined_ops(planned, topo)
    return sum(t for _, t in ops), sum(t for g, t in ops if planned[g[0]].combinable)


def shares(planned: Sequence[Planned], topo: MeshTopology) -> list[float]:
    """Each planned collective's share of `combined_time`'s total: the time of the op XLA
    combines it into, split among that op's members by their bytes. A layer's shares add up to
    what its collectives cost the step, where their times alone add up to far more (each pays
    a launch that the combined op pays once)."""
    out = [0.0] * len(planned)
    for group, time in combined_ops(planned, topo):
        total = sum(planned[i].bytes for i in group)
        for i in group:
            out[i] = time * planned[i].bytes / total if total else time / len(group)
    return out
