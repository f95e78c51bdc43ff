"""Critical nodes and segments (Rhino §4.3.1): the top level of the graph coarsening.

With every op costing 1 and every transfer 0, an op's earliest start comes from a pass in
program order and its latest start from a pass in reverse; ops whose two times agree form the
backbone (the critical path). Compute-heavy ops on the backbone are the critical nodes, and
they cut the step into near-linear segments: an op belongs to the latest segment its inputs
come from (a critical node opens a new one). Ops that read only arguments and constants (an
optimizer's `b1 * m`, a mask) could start at once but are needed later: they belong to the
earliest segment among their readers', not to the first segment.

A step with no compute-heavy op (an optimizer's apply program) has no backbone to cut: its
segments are then its independent parts (`with_parts`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rhino_jax.core.ops import COMPUTE_HEAVY

from ...hlo_passes.graph import Graph


@dataclass(frozen=True)
class Backbone:
    earliest: tuple[int, ...]  # per node
    critical: tuple[int, ...]  # node ids of the critical nodes, by earliest time
    segment: tuple[int, ...]  # per node: 0 before the first critical node, k after the k-th

    @property
    def num_segments(self) -> int:
        return max(self.segment, default=0) + 1


def backbone(graph: Graph) -> Backbone:
    producer = {r: n.id for n in graph.nodes for r in n.results}
    preds = [[producer[o] for o in dict.fromkeys(n.operands) if o in producer] for n in graph.nodes]
    earliest = [0] * len(graph.nodes)
    for n in graph.nodes:  # program order is a topological order
        earliest[n.id] = max((earliest[p] + 1 for p in preds[n.id]), default=0)
    end = max(earliest, default=0)
    latest = [end] * len(graph.nodes)
    for n in reversed(graph.nodes):
        for p in preds[n.id]:
            latest[p] = min(latest[p], latest[n.id] - 1)
    critical = sorted((n.id for n in graph.nodes if n.op in COMPUTE_HEAVY and earliest[n.id] == latest[n.id]),
                      key=lambda i: earliest[i])
    pivot = {c: k + 1 for k, c in enumerate(critical)}
    segment: list[int | None] = [None] * len(graph.nodes)
    for n in graph.nodes:
        known = [segment[p] for p in preds[n.id] if segment[p] is not None]
        segment[n.id] = pivot.get(n.id, max(known, default=None))
    readers: list[list[int]] = [[] for _ in graph.nodes]
    for n in graph.nodes:
        for p in preds[n.id]:
            readers[p].append(n.id)
    for n in reversed(graph.nodes):
        if segment[n.id] is None:
            segment[n.id] = min((segment[r] for r in readers[n.id]), default=0)
    return Backbone(tuple(earliest), tuple(critical), tuple(segment))


def with_parts(bb: Backbone, graph: Graph) -> Backbone:
    """`bb`, or where it has no critical node, its one segment cut into the parts of the step
    that share no tensor, numbered in program order: an optimizer's apply program updates each
    parameter apart from the others, joined only through scalars (a step count, a global
    norm). Cut so, the parts of identical layers are repeats that share one set of ILP
    variables; one segment left the ILP a group per cone of every layer (a 70B Llama's apply
    program: 11,582 groups, 70 s of solves under the memory limit)."""
    if bb.critical:
        return bb
    producer = {r: n.id for n in graph.nodes for r in n.results}
    return dataclasses.replace(bb, segment=graph.parts(
        (n.id, producer[o]) for n in graph.nodes for o in n.operands
        if o in producer and graph.values[o].shape))  # a scalar read joins nothing
