"""O2: segments that repeat (a model's identical layers) share one set of ILP variables.

Rhino solves structurally identical segments once. We keep every edge of the whole-graph ILP
exact and instead tie the cones of identical segments together: the k-th cone of each copy of a
segment takes the same strategy. The ILP then has one copy of each distinct segment, its costs
summed over the copies, so it grows with the number of distinct layers rather than with depth,
and reads between far-apart segments (a forward activation saved for the backward pass, a
parameter read by the optimizer) are still charged exactly. Segments come from `critical`.
"""
from __future__ import annotations

from collections.abc import Sequence

from ...hlo_passes.graph import Graph
from .cones import Cone
from .critical import Backbone


def group_segments(units, groups: Sequence[Cone], group_of: dict[int, int], backbone: Backbone,
                   producer_unit: dict[int, int]) -> list[int]:
    """Segment of each cone: its root op's, an argument's first reader's, an output's producer's."""
    seg = [-1] * len(groups)
    for gi, g in enumerate(groups):
        u = units[g.root]
        if u.kind == "node":
            seg[gi] = backbone.segment[u.ref]
    for gi, g in enumerate(groups):
        if units[g.root].kind == "output":
            seg[gi] = seg[group_of[producer_unit[units[g.root].operands[0]]]]
    readers: dict[int, list[int]] = {}
    for gi, g in enumerate(groups):
        for m in g.members:
            for v in units[m].live:
                readers.setdefault(group_of[producer_unit[v]], []).append(gi)
    for gi, g in enumerate(groups):
        if units[g.root].kind == "hub":  # after every other group: its producer's segment
            seg[gi] = seg[group_of[producer_unit[units[g.root].operands[0]]]]
        elif seg[gi] < 0:
            seg[gi] = min((seg[r] for r in readers.get(gi, ()) if seg[r] >= 0), default=0)
    return seg


class _Spaces:
    """Strategy lists numbered by their content. Units share one list where their strategies
    are alike (a repeated layer's ops), so each list is hashed once here rather than inside
    every segment's signature: two signatures still match exactly where their lists are equal."""

    def __init__(self, exact: bool):
        self.exact = exact
        self._of_list: dict[int, int] = {}  # id of a list (alive for the tying) → its number
        self._of_content: dict[tuple, int] = {}

    def number(self, strategies: list) -> int:
        n = self._of_list.get(id(strategies))
        if n is None:
            content = tuple(strategies) if self.exact else tuple((s.operands, s.results) for s in strategies)
            n = self._of_list[id(strategies)] = self._of_content.setdefault(content, len(self._of_content))
        return n


def _unit_signature(u, graph: Graph, local: dict[int, tuple[int, int]], producer_unit, spaces: _Spaces) -> tuple:
    """What two units must share to be tied: everything (`exact`), or their op, the ranks of
    their tensors and the layouts their strategies offer, in order (`similar`: the same layer
    with other widths)."""
    values = graph.values
    op = graph.nodes[u.ref].op if u.kind == "node" else u.kind
    if not spaces.exact:
        reads = tuple(local.get(producer_unit[v], ("outside", len(values[v].shape))) for v in u.live)
        return (op, tuple((len(values[v].shape), values[v].dtype) for v in u.operands + u.results), reads,
                spaces.number(u.strategies))
    attrs = repr(sorted(graph.nodes[u.ref].attrs.items())) if u.kind == "node" else ""
    reads = tuple(local.get(producer_unit[v], ("outside", values[v].shape)) for v in u.live)
    return (op, attrs, tuple((values[v].shape, values[v].dtype) for v in u.operands),
            tuple((values[v].shape, values[v].dtype) for v in u.results), reads, spaces.number(u.strategies))


def tie_repeats(units, groups: Sequence[Cone], segments: list[int], graph: Graph,
                producer_unit: dict[int, int], exact: bool = True) -> tuple[list[int], int]:
    """(class of each cone, number of segments tied to an earlier copy). Cones in one class
    take the same strategy; a cone that repeats nothing is a class of its own. Not `exact`:
    segments that differ only in their sizes are tied too (each class a union of the exact
    tying's classes), for a first plan of a model whose layers are alike but not identical."""
    by_segment: dict[int, list[int]] = {}
    for gi, s in enumerate(segments):
        by_segment.setdefault(s, []).append(gi)
    first_copy: dict[tuple, list[int]] = {}
    class_of = list(range(len(groups)))
    tied = 0
    spaces = _Spaces(exact)
    for s in sorted(by_segment):
        gs = by_segment[s]
        local = {m: (k, i) for k, gi in enumerate(gs) for i, m in enumerate(groups[gi].members)}
        signature = tuple(tuple(_unit_signature(units[m], graph, local, producer_unit, spaces)
                                for m in groups[gi].members)
                          for gi in gs)
        original = first_copy.setdefault(signature, gs)
        if original is not gs:
            tied += 1
            for gi, oi in zip(gs, original):
                class_of[gi] = class_of[oi]
    return class_of, tied
