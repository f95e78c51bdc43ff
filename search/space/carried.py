"""Ops that pass several tensors through unchanged: one ILP unit per tensor (slot).

A counted loop's entry and exit nodes (`hlo_passes.graph`) and `optimization_barrier` (what
`jax.checkpoint` leaves in a scanned body) hand each operand on as the result in the same slot;
a conditional (lax.cond, lax.switch) hands on, as result k, what the branch taken returns for it.
One strategy space over all slots would be the product of their layouts, so each slot becomes a
unit of its own whose layout passes through unchanged. The entry and exit units of one loop slot
are tied to one layout (the planner merges their ILP classes): a loop-carried value keeps one layout in and out of the body.

A stacked value a scanned body reads a layer of (`dynamic_slice` at the loop index) or writes one
into (`dynamic_update_slice`) keeps the dims the index cuts whole: each trip's piece is then local
on every device, and the other dims are free to split (a stacked parameter sharded like its layer).
"""
from __future__ import annotations

from rhino_jax.core.specs import ShardingSpec

from ...hlo_passes.graph import Graph, Node
from ..cost.cluster import MeshTopology
from .strategies import Strategy, tensor_specs


def is_multi_slot(node: Node) -> bool:
    return "loop_trips" in node.attrs or node.op == "stablehlo.optimization_barrier" or "branches" in node.attrs


def _cut_dims(graph: Graph, value: int, consumers: dict[int, list[int]]) -> set[int]:
    """Dims of `value` that a dynamic slice or update in its loop's body cuts short."""
    shape = graph.values[value].shape
    cut: set[int] = set()
    for n in consumers[value]:
        node = graph.nodes[n]
        if node.operands[0] != value:
            continue
        if node.op == "stablehlo.dynamic_slice":
            cut |= {d for d, size in enumerate(node.attrs["sizes"]) if size != shape[d]}
        elif node.op == "stablehlo.dynamic_update_slice":
            update = graph.values[node.operands[1]].shape
            cut |= {d for d, size in enumerate(update) if size != shape[d]}
    return cut


def slot_strategies(graph: Graph, node: Node, slot: int, topo: MeshTopology,
                    consumers: dict[int, list[int]]) -> list[Strategy]:
    """The layouts slot `slot` of a multi-slot node may pass through, in one order for a loop's
    entry and exit (their units are tied strategy by strategy). A conditional's slot reads every
    branch's value in the layout of its result: whichever branch runs, the result has one layout."""
    shape = graph.values[node.results[slot]].shape
    specs: list[ShardingSpec] = tensor_specs(shape, topo)
    if "loop_trips" in node.attrs:
        entry = graph.nodes[node.attrs.get("loop_entry", node.id)]
        cut = _cut_dims(graph, entry.results[slot], consumers)
        specs = [s for s in specs if not any(s.dims[d] for d in cut)]
    reads = node.attrs.get("branches", 1)
    return [Strategy((s,) * reads, (s,), 0.0) for s in specs]


def per_trip(strategies: list[Strategy], trips: int) -> list[Strategy]:
    """Strategies of an op that runs `trips` times per step: its compute and its collectives
    (listed once per run, as the compiled HLO counts them) are paid each time."""
    if trips == 1:
        return strategies
    return [Strategy(s.operands, s.results, s.compute_s * trips, s.collectives * trips) for s in strategies]
