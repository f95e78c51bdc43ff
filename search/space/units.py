"""The search's units: entry arguments, ops, loop slots and returned values, each with every
strategy it may take (`strategies`), and the user's pins applied to them."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from rhino_jax.errors import ShardingPinError
from rhino_jax.core.ops import COMPUTE_HEAVY
from rhino_jax.core.specs import ShardingSpec

from ...hlo_passes.graph import Graph, Pin, slots
from ..cost.cluster import Cluster, MeshTopology
from ..cost.fusion import fused_kernels, kernel_launches, memory_traffic
from . import carried
from .strategies import Strategy, node_strategies, tensor_specs
from .strides import candidates as stride_candidates



@dataclass
class Unit:
    """An ILP unit: an argument, an op or a returned value, with its strategies."""

    kind: str  # "arg" | "node" | "slot" (one tensor of a node, `carried`) | "output" | "hub" (`add_hubs`)
    ref: int
    operands: tuple[int, ...]
    results: tuple[int, ...]
    strategies: list[Strategy]
    name: str
    live: tuple[int, ...] = ()  # distinct operand values that other units produce
    join: str = ""  # "reader" | "producer": the cone it may join (see `cones`), "" for a root
    slot: int = 0  # a "slot" unit (`carried`): the position of its first operand in the node


def _arg_strategies(graph: Graph, arg, topo: MeshTopology, cluster: Cluster) -> list[Strategy]:
    """Every layout of an argument. A batch is fed from the host every step, so its layout
    costs the transfer of each device's piece (reported under compute in `PlanCost`); the others
    stay on the devices between steps."""
    value = graph.values[arg.value]
    per_byte = 1.0 / cluster.host_to_device_bandwidth if arg.role == "batch" else 0.0
    return [Strategy((), (s,), value.nbytes // s.shard_factor(topo.sizes) * per_byte)
            for s in tensor_specs(value.shape, topo)]


def _check_pin(pin: Pin, graph: Graph, topo: MeshTopology) -> None:
    shape = graph.values[pin.value].shape
    if len(pin.dims) != len(shape):
        raise ShardingPinError(f"pin on {pin.name!r}: spec has {len(pin.dims)} dims, tensor has shape {shape}")
    for d, axes in enumerate(pin.dims):
        for a in axes or ():
            if a not in topo.sizes:
                raise ShardingPinError(f"pin on {pin.name!r}: mesh has no axis {a!r} "
                                       f"(axes: {list(topo.axis_names)})")
        order = [topo.axis_names.index(a) for a in axes or ()]
        if order != sorted(order):  # a layout of the search names a dim's axes in the mesh's order
            ordered = tuple(sorted(axes, key=topo.axis_names.index))
            raise ShardingPinError(
                f"pin on {pin.name!r}: dim {d} names the mesh axes {tuple(axes)} out of the mesh's order "
                f"{tuple(topo.axis_names)}; pin {ordered} instead, or build the mesh with its axes in that order")
        n = int(np.prod([topo.sizes[a] for a in axes or ()]))
        if shape[d] % n:
            raise ShardingPinError(
                f"pin on {pin.name!r}: dim {d} of shape {shape} has size {shape[d]}, which mesh "
                f"axes {axes} ({n} devices) do not divide; change the pin or the mesh")


def matches_pin(spec: ShardingSpec, pin: Pin, sizes: dict[str, int]) -> bool:
    """The spec makes the pinned layout (a pin's axes of size 1 split nothing: strategies name none)."""
    def splitting(axes) -> tuple[str, ...]:
        return tuple(a for a in axes if sizes[a] > 1)
    return not spec.partial and not spec.strides and all(p is None or splitting(p) == tuple(d)
                                                          for p, d in zip(pin.dims, spec.dims))


def tied_outputs(graph: Graph) -> dict[int, int]:
    """Output index → the argument whose layout it leaves in: a donated argument's aliased output
    (the buffer is reused, so it must be), and a result the training loop feeds back as that
    argument (`Graph.fed_back`), so the next step takes it as it is, without a reshard outside
    the program and outside every count. A result the user pins (rj.annotate on the returned
    value) is not tied: it leaves in its pinned layout, and the next step reshards it."""
    tied = {a.donated_to: a.index for a in graph.args if a.donated_to is not None}
    pinned = {p.value for p in graph.pins}
    for k, i in graph.fed_back().items():
        if k not in tied and i not in tied.values() and graph.outputs[k] not in pinned:
            tied[k] = i
    return tied


def build_units(graph: Graph, topo: MeshTopology, cluster: Cluster, strided: bool,
                check: Callable[[], None] = lambda: None):
    """The units of the graph with their strategies, the unit producing each value, the ops left
    replicated for want of a rule, and the (entry, exit) units of each loop slot; `check` is
    called per op (the search's deadline, `levels.Deadline.check`)."""
    units: list[Unit] = []
    producer_unit: dict[int, int] = {}  # value id → unit producing it
    fallback: list[str] = []
    aliased = tied_outputs(graph)
    tied_to = {i: k for k, i in aliased.items()}
    # One list per distinct strategy space, shared by the units that have it (the layers' weights
    # of one shape, one op repeated): `cones.signature` knows them alike by it.
    shared: dict[tuple, list[Strategy]] = {}
    for arg in graph.args:
        value = graph.values[arg.value]
        tied = arg.index in tied_to and graph.outputs[tied_to[arg.index]] != arg.value
        key = ("arg", value.shape, value.nbytes, arg.role == "batch", tied)
        if key not in shared:
            shared[key] = _arg_strategies(graph, arg, topo, cluster)
            if tied:  # as the argument's unit reads it (below)
                shared[key] = [Strategy((s.results[0],), s.results, 0.0) for s in shared[key]]
        strategies = shared[key]
        operands: tuple[int, ...] = ()
        if tied:
            # The argument and its tied output share one layout: the argument's unit reads the
            # output in its own layout, which prices the reshard from the output's producer.
            operands = (graph.outputs[tied_to[arg.index]],)
        producer_unit[arg.value] = len(units)
        units.append(Unit("arg", arg.index, operands, (arg.value,), strategies, arg.path))
    rows_fused = cluster.backend == "gpu" and bool(cluster.gpu)  # Triton's fusions: Ampere and later
    kernels = fused_kernels(graph, rows_fused)
    traffic, launches = memory_traffic(graph, kernels), kernel_launches(graph, kernels)
    facts = stride_candidates(graph, topo) if strided else {}
    known: dict[tuple, tuple[list[Strategy], bool]] = {}  # identical ops (repeated layers)
    consumers = graph.consumers()
    entries: dict[tuple[int, int], int] = {}  # (loop entry node, slot) → its unit
    ties: list[tuple[int, int]] = []  # a loop slot's entry and exit units: one layout
    for node in graph.nodes:
        check()
        if all(graph.values[r].constant for r in node.results):
            continue
        if carried.is_multi_slot(node):
            for k, (first, reads, r) in enumerate(slots(node)):
                if "loop_entry" in node.attrs:
                    ties.append((entries[node.attrs["loop_entry"], k], len(units)))
                elif "loop_trips" in node.attrs:
                    entries[node.id, k] = len(units)
                producer_unit[r] = len(units)
                strategies = carried.slot_strategies(graph, node, k, topo, consumers)
                units.append(Unit("slot", node.id, reads, (r,), strategies, node.name,
                                   _live(reads, graph, producer_unit), slot=first))
            continue
        if "opaque" in node.attrs:
            fallback.append(f"{node.op.split('.')[-1]} ({node.name or f'%{node.id}'}): {node.attrs['opaque']}")
        key = (node.op, repr(node.attrs), node.flops, traffic[node.id], launches[node.id],
               tuple((graph.values[v].shape, graph.values[v].dtype, facts.get(v))
                     for v in node.operands + node.results))
        if key not in known:
            known[key] = node_strategies(node, graph, topo, cluster, traffic[node.id], facts, launches[node.id])
        strategies, has_rule = known[key]
        if not has_rule and "opaque" not in node.attrs and any(graph.values[r].shape for r in node.results):
            fallback.append(f"{node.op.split('.')[-1]} ({node.name or f'%{node.id}'})")
        live = _live(node.operands, graph, producer_unit)
        for r in node.results:
            producer_unit[r] = len(units)
        units.append(Unit("node", node.id, node.operands, node.results, carried.per_trip(strategies, node.trips),
                           node.name, live, _join(node, live, has_rule, graph)))
    for k, out in enumerate(graph.outputs):
        if k in aliased or graph.values[out].constant:
            continue
        shape = graph.values[out].shape
        if ("output", shape) not in shared:
            shared["output", shape] = [Strategy((s,), (), 0.0) for s in tensor_specs(shape, topo)]
        strategies = shared["output", shape]
        units.append(Unit("output", k, (out,), (), strategies, graph.output_paths[k],
                           _live((out,), graph, producer_unit)))
    for u in units[:len(graph.args)]:  # tied arguments read their output
        u.live = _live(u.operands, graph, producer_unit)
    return units, producer_unit, fallback, ties


def _join(node, live: tuple[int, ...], has_rule: bool, graph: Graph) -> str:
    """Which cone a node may join: none for compute-heavy ops (the decisions that matter) and
    ops with several inputs; its producer's when it shrinks its input, else its reader's."""
    if not has_rule or len(live) != 1 or len(node.results) != 1 or node.op in COMPUTE_HEAVY:
        return ""
    return "producer" if graph.values[live[0]].nbytes > graph.values[node.results[0]].nbytes else "reader"


def _live(operands, graph: Graph, producer_unit: dict[int, int]) -> tuple[int, ...]:
    """Operands that another unit produces and that have a layout to choose (not scalars)."""
    return tuple(dict.fromkeys(o for o in operands if o in producer_unit and graph.values[o].shape))


def apply_pins(graph: Graph, units: list[Unit], producer_unit: dict[int, int], topo) -> None:
    """Restrict the pinned values' producers to strategies that make the pinned layout, and a
    pinned result to leave in it (the output could take a further split, a free local slice that
    saves memory). A value computed from constants alone (a causal mask from iota) has no unit:
    XLA builds it where it is used, and its pin, a constraint in the module, stays for XLA to keep."""
    for pin in graph.pins:
        _check_pin(pin, graph, topo)
        for u in units:
            if u.kind == "output" and u.operands == (pin.value,):
                u.strategies = [s for s in u.strategies if matches_pin(s.operands[0], pin, topo.sizes)]
        if pin.value not in producer_unit:
            continue
        u = units[producer_unit[pin.value]]
        pos = u.results.index(pin.value)
        kept = [s for s in u.strategies if matches_pin(s.results[pos], pin, topo.sizes)]
        if not kept:
            raise ShardingPinError(f"pin on {pin.name!r}: no strategy of {u.name or u.kind} "
                                   f"produces {pin.dims} on this mesh")
        u.strategies = kept


def read_branch(u: Unit, pos: int | None, graph: Graph) -> tuple[int, ...]:
    """The conditional branches (`Node.attrs["branch"]`) a unit's op runs in, or its read of
    operand `pos` does: a conditional's slot reads branch b's value at the end of branch b."""
    if u.kind not in ("node", "slot"):
        return ()
    attrs = graph.nodes[u.ref].attrs
    branch = attrs.get("branch", ())
    return branch + (attrs["alternatives"][pos],) if pos is not None and "alternatives" in attrs else branch
