"""Search: Graph IR + mesh + cluster → Plan (the spine's O2/O3: cones, then one ILP).

Units are entry arguments, ops and returned values. Units that read a single live tensor join
the cone of their reader (`cones`), whose root decides them by DP; the ILP then picks one
strategy per cone, with every read between cones an exact edge (a value that several cones read,
they read through its hub, `_add_hubs`, so it is moved once per layout). Values that depend on no
argument (constants, iotas and their broadcasts) are left to XLA, which builds them locally.
"""
from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from rhino_jax.errors import MemoryLimitError, ShardingPinError, SolverError, SolverTimeLimitWarning
from rhino_jax.plan import Plan, PlanCost, PlannedCollective

from ..hlo_passes.graph import Graph, Pin, slots
from . import carried, coarse_axes, ilp, interrupt, levels, progress, windows
from .cluster import Cluster, MeshTopology
from .collectives import reshard_path
from .combining import combined_time
from .pricing import Prices
from .cones import Cone, build_cones
from .critical import backbone
from .repeats import group_segments, tie_repeats
from .memory import held_fractions, local_bytes, plan_memory
from .rules import COMPUTE_HEAVY
from .specs import ShardingSpec
from .strategies import Strategy, memory_traffic, node_strategies, tensor_specs
from .strides import candidates as stride_candidates


@dataclass
class _Unit:
    """An ILP unit: an argument, an op or a returned value, with its strategies."""

    kind: str  # "arg" | "node" | "slot" (one tensor of a node, `carried`) | "output" | "hub" (`_add_hubs`)
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


def _matches(spec: ShardingSpec, pin: Pin) -> bool:
    return not spec.partial and not spec.strides and all(p is None or tuple(p) == tuple(d) for p, d in zip(pin.dims, spec.dims))


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


def _build_units(graph: Graph, topo: MeshTopology, cluster: Cluster, strided: bool):
    units: list[_Unit] = []
    producer_unit: dict[int, int] = {}  # value id → unit producing it
    fallback: list[str] = []
    aliased = tied_outputs(graph)
    tied_to = {i: k for k, i in aliased.items()}
    for arg in graph.args:
        strategies = _arg_strategies(graph, arg, topo, cluster)
        operands: tuple[int, ...] = ()
        if arg.index in tied_to and graph.outputs[tied_to[arg.index]] != arg.value:
            # The argument and its tied output share one layout: the argument's unit reads the
            # output in its own layout, which prices the reshard from the output's producer.
            operands = (graph.outputs[tied_to[arg.index]],)
            strategies = [Strategy((s.results[0],), s.results, 0.0) for s in strategies]
        producer_unit[arg.value] = len(units)
        units.append(_Unit("arg", arg.index, operands, (arg.value,), strategies, arg.path))
    traffic = memory_traffic(graph)
    facts = stride_candidates(graph, topo) if strided else {}
    known: dict[tuple, tuple[list[Strategy], bool]] = {}  # identical ops (repeated layers)
    consumers = graph.consumers()
    entries: dict[tuple[int, int], int] = {}  # (loop entry node, slot) → its unit
    ties: list[tuple[int, int]] = []  # a loop slot's entry and exit units: one layout
    for node in graph.nodes:
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
                units.append(_Unit("slot", node.id, reads, (r,), strategies, node.name,
                                   _live(reads, graph, producer_unit), slot=first))
            continue
        if "opaque" in node.attrs:
            fallback.append(f"{node.op.split('.')[-1]} ({node.name or f'%{node.id}'}): {node.attrs['opaque']}")
        key = (node.op, repr(node.attrs), node.flops, traffic[node.id],
               tuple((graph.values[v].shape, graph.values[v].dtype, facts.get(v))
                     for v in node.operands + node.results))
        if key not in known:
            known[key] = node_strategies(node, graph, topo, cluster, traffic[node.id], facts)
        strategies, has_rule = known[key]
        if not has_rule and "opaque" not in node.attrs and any(graph.values[r].shape for r in node.results):
            fallback.append(f"{node.op.split('.')[-1]} ({node.name or f'%{node.id}'})")
        live = _live(node.operands, graph, producer_unit)
        for r in node.results:
            producer_unit[r] = len(units)
        units.append(_Unit("node", node.id, node.operands, node.results, carried.per_trip(strategies, node.trips),
                           node.name, live, _join(node, live, has_rule, graph)))
    for k, out in enumerate(graph.outputs):
        if k in aliased or graph.values[out].constant:
            continue
        shape = graph.values[out].shape
        strategies = [Strategy((s,), (), 0.0) for s in tensor_specs(shape, topo)]
        units.append(_Unit("output", k, (out,), (), strategies, graph.output_paths[k],
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


def _apply_pins(graph: Graph, units: list[_Unit], producer_unit: dict[int, int], topo) -> None:
    """Restrict the pinned values' producers to strategies that make the pinned layout, and a
    pinned result to leave in it (the output could take a further split, a free local slice that
    saves memory). A value computed from constants alone (a causal mask from iota) has no unit:
    XLA builds it where it is used, and its pin, a constraint in the module, stays for XLA to keep."""
    for pin in graph.pins:
        _check_pin(pin, graph, topo)
        for u in units:
            if u.kind == "output" and u.operands == (pin.value,):
                u.strategies = [s for s in u.strategies if _matches(s.operands[0], pin)]
        if pin.value not in producer_unit:
            continue
        u = units[producer_unit[pin.value]]
        pos = u.results.index(pin.value)
        kept = [s for s in u.strategies if _matches(s.results[pos], pin)]
        if not kept:
            raise ShardingPinError(f"pin on {pin.name!r}: no strategy of {u.name or u.kind} "
                                   f"produces {pin.dims} on this mesh")
        u.strategies = kept


def _result_spec(units, group: Cone, j: int, producer: int, v: int) -> ShardingSpec:
    s = group.choice[j][producer]
    return s.results[units[producer].results.index(v)]


OVERLAP_ROUNDS = 3  # searches at most, with Cluster.overlap, to price what compute can hide


def search(graph: Graph, topo: MeshTopology, cluster: Cluster, *, time_limit_s: float = 60.0, **options) -> Plan:
    """The plan of `_search`. With compute/communication overlap (`Cluster.overlap`), the ILP
    prices collectives off the compute chain at the share overlap leaves exposed, which holds
    only while there is compute to hide them behind: when the plan has more to hide than it
    computes, the search runs again with the overlap the plan can use (its compute over its
    off-chain communication), and the best plan at its exact cost wins. `time_limit_s` covers it
    all (`levels.Deadline`). Ctrl-C: before the first plan, KeyboardInterrupt; after it, the best
    plan so far, `interrupted` (`interrupt`)."""
    deadline = levels.Deadline.after(time_limit_s)
    with interrupt.session():
        plan = _search(graph, topo, cluster, deadline=deadline, **options)
        tried, overlap = [plan], topo.overlap
        try:
            while overlap and len(tried) < OVERLAP_ROUNDS and not interrupt.pressed() and deadline.left() > 0:
                usable = min(topo.overlap, plan.cost.compute_s / max(plan.search_stats["off_chain_comm_s"], 1e-30))
                if usable >= overlap * 0.99:
                    break
                overlap = usable
                progress.say("rhino_jax: overlap: %.3g s of compute hides %.3g s of communication; searching again "
                             "with overlap %.3g", plan.cost.compute_s, plan.search_stats["off_chain_comm_s"], overlap)
                plan = _search(graph, dataclasses.replace(topo, overlap=overlap), cluster, deadline=deadline, **options)
                plan = dataclasses.replace(plan, cost=dataclasses.replace(plan.cost, **_hidden(plan, topo.overlap)))
                tried.append(plan)
        except KeyboardInterrupt:  # before the next round's plan: the plans so far
            interrupt.press()
            interrupt.warn("the search for how much communication compute hides")
        best = min(tried, key=lambda p: p.cost.total_s)
        return dataclasses.replace(best, interrupted=True) if interrupt.pressed() else best


def _hidden(plan: Plan, overlap: float) -> dict:
    """A plan's hidden communication and total at the cluster's own overlap."""
    c = plan.cost
    hidden = min(overlap * plan.search_stats["off_chain_comm_s"], c.compute_s)
    return dict(hidden_s=hidden, total_s=c.compute_s + c.comm_s - hidden)


def _search(graph: Graph, topo: MeshTopology, cluster: Cluster, *, deadline: levels.Deadline, opt_level: str = "O2",
            backend: str = "HIGHS", memory_limit_bytes: int | None = None, strided: bool = True,
            with_choice: bool = False):
    """O3: cones, then one ILP over the whole graph, started from O2's plan. O2: the same ILP
    with the cones of repeated segments tied together (`repeats`), solved whole when small,
    else by windows (`levels`); on three or more mesh axes, first on a mesh of one axis fewer
    (`coarse_axes`). Under a memory limit, the largest parameters and optimizer states may not
    stay replicated (`_fit_memory`). `strided`: offer non-maximum strides where reshapes call for
    them. Every solve stops at the `deadline`, which also counts the build. `with_choice`: the
    plan and each unit's chosen strategy (the coarse pass's answer)."""
    t0 = time.perf_counter()
    units, producer_unit, fallback, ties = _build_units(graph, topo, cluster, strided)
    _apply_pins(graph, units, producer_unit, topo)
    if opt_level == "O2" and len(topo.axis_names) >= 3:
        _near_coarse_plan(graph, topo, cluster, units, deadline=deadline, backend=backend,
                          memory_limit_bytes=memory_limit_bytes, strided=strided)
    sizes = topo.sizes

    prices = Prices(graph, topo, [u.results for u in units])
    groups = build_cones(units, producer_unit, prices.own, prices.reshard,
                         lambda v, starts, reads: prices.reads(v, starts, reads, uses=False)[0],
                         lambda spec, v: graph.values[v].nbytes // spec.shard_factor(sizes))
    group_of = {m: gi for gi, g in enumerate(groups) for m in g.members}
    hub_of = _add_hubs(graph, units, groups, group_of, producer_unit, prices)
    problem = _problem(units, groups, group_of, producer_unit, prices, hub_of)
    bb = backbone(graph)
    stats = dict(bb.stats(len(graph.nodes)), units=len(units), groups=len(groups), edges=len(problem.edges),
                 hubs=len(hub_of))
    segments = group_segments(units, groups, group_of, bb, producer_unit)
    loops = [(group_of[a], group_of[b]) for a, b in ties]
    repeats, stats["tied_segments"] = tie_repeats(units, groups, segments, graph, producer_unit)

    def similar() -> levels.Tying:  # only when the exact tying is too large to solve whole
        alike, stats["similar_segments"] = tie_repeats(units, groups, segments, graph, producer_unit, exact=False)
        return levels.tying(problem, _merge_classes(alike, loops), segments)

    solvers = levels.Levels(
        similar,
        levels.tying(problem, _merge_classes(repeats, loops), segments),
        lambda: levels.tying(problem, _merge_classes(list(range(len(groups))), loops), segments),
        windows.size(problem) if stats["tied_segments"] else 0, opt_level == "O3", backend,
        start=_replicated_choice(units, groups))
    stats["build_s"] = time.perf_counter() - t0
    progress.say("rhino_jax: %d ops → %d cones (%d critical nodes, %d segments, %d tied) in %.2f s",
                 len(graph.nodes), len(groups), stats["critical_nodes"], stats["subgraphs"],
                 stats["tied_segments"], stats["build_s"])

    held_bytes = functools.cache(lambda: _held_bytes(graph, units, groups, sizes))

    def plan_with(forced: list[int], weight_s: float = 0.0) -> Plan:
        """The best plan in which the arguments of the `forced` groups are not replicated, with
        `weight_s` seconds added per byte a device holds on average (`_weigh_memory`)."""
        forbidden = [np.zeros(len(g.choice), dtype=bool) for g in groups]
        for g in forced:
            forbidden[g] |= [ch[groups[g].root].results[0].shard_factor(sizes) == 1 for ch in groups[g].choice]
        progress.say("rhino_jax: solving the ILP over %d groups%s (%.3g s left of the time limit; Ctrl-C stops at the "
                     "best plan so far)", len(solvers.stages[-1][0].problem.costs),
                     f", {len(forced)} arguments not replicated" if forced else "", max(deadline.left(), 0.0))
        answered = interrupt.pressed()  # a Ctrl-C before this solve: told already, this plan is greedy
        choice, solution, info = solvers.solve(deadline, forbidden, weight_s, held_bytes() if weight_s else None)
        unlimited = not forced and not weight_s  # else a trial under a memory limit (`_try`, `_try_weight`)
        progress.say("rhino_jax: ILP %s in %.2f s%s: predicted %.4g ms", solution.status, solution.solve_s,
                     " (its LP relaxation was integral)" if solution.relaxation_exact else "",
                     solution.objective_s * 1e3, best_s=solution.objective_s if unlimited else None)
        st = dict(stats, **info, ilp_groups=len(solvers.stages[-1][0].problem.costs), ilp_vars=solution.num_vars,
                  ilp_constraints=solution.num_constraints, solve_s=sum(st[3] for st in info["stages"]),
                  backend=solution.backend, status=solution.status, gap=solution.gap,
                  objective_s=solution.objective_s, relaxation_exact=solution.relaxation_exact,
                  not_replicated=tuple(units[groups[g].root].name for g in forced), memory_weight_s=weight_s)
        try:
            plan = _make_plan(graph, topo, cluster, units, groups, choice, fallback, opt_level, st, prices)
        except KeyboardInterrupt:  # while the plan is assembled: assembled again, as the plan so far
            interrupt.press()
            st["status"] = "interrupted"
            plan = _make_plan(graph, topo, cluster, units, groups, choice, fallback, opt_level, st, prices)
        gap = "no bound (solved by windows)" if np.isnan(solution.gap) else f"a gap of {solution.gap:.1%}"
        if st["status"] == "interrupted" and not answered:
            interrupt.warn(f"strategy search ({solution.solve_s:.1f} s of solving, {gap})", stacklevel=4)
        if st["status"] == "feasible":
            warnings.warn(f"strategy solver stopped at its {deadline.seconds:g} s time limit with {gap}; the plan is "
                          "feasible but may not be optimal (raise solver_time_limit_s for a better one)",
                          SolverTimeLimitWarning, stacklevel=4)
        plan = dataclasses.replace(plan, interrupted=st["status"] == "interrupted" or interrupt.pressed())
        if with_choice:
            made.append((plan, [groups[group_of[m]].choice[choice[group_of[m]]][m] for m in range(built)]))
        return plan

    built, made = len(units) - len(hub_of), []
    plan = plan_with([])
    if memory_limit_bytes is not None and plan.cost.memory_bytes > memory_limit_bytes:
        if plan.search_stats["status"] == "interrupted":
            raise KeyboardInterrupt("the search was interrupted before it found a plan within memory_limit_bytes")
        least = _least_arguments(graph, units, producer_unit, sizes)
        if least > memory_limit_bytes:  # no plan can fit: say so now rather than after every solve
            _raise_memory_error([plan], memory_limit_bytes, graph, least)
        candidates = _by_size(graph, units, groups, sizes)
        plan = _fit_memory(plan_with, candidates, [units[groups[g].root].ref for g in candidates],
                           plan, memory_limit_bytes, graph, least, deadline)
    return (plan, next(ch for p, ch in made if p is plan)) if with_choice else plan


def _near_coarse_plan(graph: Graph, topo: MeshTopology, cluster: Cluster, units: list[_Unit], *,
                      deadline: levels.Deadline, **options) -> None:
    """Restrict each unit to the strategies near the plan of the mesh with two axes merged
    (`coarse_axes`), searched first with half the time left. Where that search finds no plan
    (no plan of the coarser mesh fits the memory limit), the whole space is kept."""
    coarse, merge = coarse_axes.merged(topo)
    progress.say("rhino_jax: %d mesh axes: searching first with %s and %s as one axis", len(topo.axis_names),
                 merge.major, merge.minor)
    half = levels.Deadline(deadline.seconds, time.perf_counter() + deadline.left() / 2)
    try:
        _, chosen = _search(dataclasses.replace(graph, pins=coarse_axes.coarse_pins(graph.pins, merge)), coarse,
                            cluster, deadline=half, opt_level="O2", with_choice=True, **options)
    except (MemoryLimitError, SolverError) as e:
        progress.say("rhino_jax: no plan with %s merged (%s); searching the whole space", merge.name,
                     type(e).__name__)
        return
    assert len(chosen) == len(units), "the coarse search built other units"
    for u, s in zip(units, chosen):
        u.strategies = coarse_axes.near(u.strategies, coarse_axes.anchor(s, merge, topo.axis_names), topo.axis_names)


def _merge_classes(class_of: list[int], pairs: list[tuple[int, int]]) -> list[int]:
    """`class_of` with the classes of each pair of groups made one (union-find)."""
    parent = list(range(len(class_of)))

    def find(c: int) -> int:
        while parent[c] != c:
            parent[c] = parent[parent[c]]
            c = parent[c]
        return c

    for a, b in pairs:
        parent[find(class_of[a])] = find(class_of[b])
    return [find(c) for c in class_of]


def _by_size(graph: Graph, units, groups: list[Cone], sizes: dict[str, int]) -> list[int]:
    """Groups of the parameters and optimizer states that can be sharded, largest first."""
    found = []
    for g, cone in enumerate(groups):
        u = units[cone.root]
        if u.kind != "arg" or graph.args[u.ref].role not in ("parameter", "optimizer_state"):
            continue
        if any(ch[cone.root].results[0].shard_factor(sizes) > 1 for ch in cone.choice):
            found.append(g)
    return sorted(found, key=lambda g: -graph.values[units[groups[g].root].results[0]].nbytes)


def _fit_memory(plan_with, candidates: list[int], args: list[int], unlimited: Plan, limit: int,
                graph: Graph, least: int, deadline: levels.Deadline | None = None) -> Plan:
    """The fastest plan within the limit among every plan solved on the way.

    First Rhino §4.4: forbid replicating the k largest parameters (and optimizer states), k found
    by galloping up from the small end (k = 1, 2, 4, ...), then by bisection down to the smallest
    k that fits: about 2 log2(k) solves, as a few tensors usually hold most of the memory. A plan
    that keeps more of the leading candidates off replication than it was made to is also the
    best plan for those larger k, so a plan that does not fit rules them out too (`_leading`).
    Memory need not fall as k grows (a plan forced to shard its weights may replicate its
    activations instead), so when no k fits, the ILP prices memory itself (`_weigh_memory`).
    `least`: a lower bound on every plan's memory, for the error. No trial starts after the
    `deadline`: the best plan that fits so far, else a SolverError that says so."""
    tried = [unlimited]
    out_of_time = False

    def fits(plan: Plan) -> bool:
        return plan.cost.memory_bytes <= limit

    def stop() -> bool:
        """Whether to end the search here: interrupted, or out of time (Ctrl-C with no plan that
        fits: KeyboardInterrupt)."""
        nonlocal out_of_time
        _stop_if_interrupted(tried, fits)
        out_of_time = deadline is not None and deadline.left() <= 0
        return out_of_time or tried[-1].search_stats["status"] == "interrupted"

    lo, hi, step = _leading(unlimited, args), None, 1  # the plan with k = lo does not fit
    while lo < len(candidates) and not stop():  # gallop up to a k = hi that fits
        k = min(lo + step, len(candidates))
        tried.append(_try(plan_with, candidates, k, limit))
        if fits(tried[-1]):
            hi = k
            break
        lo, step = max(k, _leading(tried[-1], args)), 2 * step
    while hi is not None and hi - lo > 1 and not stop():
        k = (lo + hi) // 2  # bisect down to the smallest k that fits
        tried.append(_try(plan_with, candidates, k, limit))
        if fits(tried[-1]):
            hi = k
        else:
            lo = max(k, min(_leading(tried[-1], args), hi - 1))
    if hi is None and not stop():
        _weigh_memory(plan_with, tried, limit, fits, stop)
    fitting = [p for p in tried if fits(p)]
    if not fitting and out_of_time:
        smallest = min(p.cost.memory_bytes for p in tried)
        raise SolverError(
            f"the search reached its solver_time_limit_s={deadline.seconds:g} before it found a plan within "
            f"memory_limit_bytes={limit:,}: the smallest of the {len(tried)} plans solved needs {smallest:,} bytes "
            f"per device. Raise solver_time_limit_s (or memory_limit_bytes).")
    if not fitting:
        _raise_memory_error(tried, limit, graph, least)
    if out_of_time:
        warnings.warn(f"the memory limit's search stopped at its {deadline.seconds:g} s time limit after "
                      f"{len(tried)} plans: the plan fits memory_limit_bytes, but a faster one may (raise "
                      "solver_time_limit_s)", SolverTimeLimitWarning, stacklevel=4)
    return min(fitting, key=lambda p: p.cost.total_s)


def _weigh_memory(plan_with, tried: list[Plan], limit: int, fits, stop, steps: int = 8) -> None:
    """Plans of the ILP with each byte a device holds on average (`memory.held_fractions`) priced
    at w seconds, added to `tried` (whose first is the unlimited plan): w galloping up (x4) from
    the unlimited plan's seconds per byte until a plan fits, then two bisections (geometric) back
    down towards the fastest plan that fits, while `stop()` says go on. The average stands in
    for the peak, which is not linear in the choices; each plan's own peak decides whether it
    fits."""
    unlimited = tried[0]
    base = unlimited.cost.total_s / max(unlimited.cost.memory_bytes, 1)
    low, high = 0.0, None
    for i in range(steps):
        w = base * 4.0 ** i
        tried.append(_try_weight(plan_with, w, limit))
        if fits(tried[-1]):
            high = w
            break
        low = w
        if stop():
            return
    for _ in range(2 if high is not None and low else 0):
        if stop():
            return
        w = (low * high) ** 0.5
        tried.append(_try_weight(plan_with, w, limit))
        low, high = (low, w) if fits(tried[-1]) else (w, high)


def _held_bytes(graph: Graph, units, groups: list[Cone], sizes: dict[str, int]) -> list[np.ndarray]:
    """Per group and strategy: the bytes a device holds on average over the step (each value's
    local bytes times the fraction of the step it is held, `memory.held_fractions`)."""
    held = held_fractions(graph)
    return [np.array([sum(held.get(v, 0.0) * local_bytes(graph, v, spec, sizes)
                          for m, s in ch.items() if units[m].kind != "hub"
                          for v, spec in zip(units[m].results, s.results))
                      for ch in cone.choice]) for cone in groups]


def _least_arguments(graph: Graph, units, producer_unit: dict[int, int], sizes: dict[str, int]) -> int:
    """A lower bound on every plan's memory: the arguments, which stay for the whole step, each
    split as finely as the mesh and the pins allow."""
    return sum(min(local_bytes(graph, a.value, s.results[0], sizes) for s in units[producer_unit[a.value]].strategies)
               for a in graph.args)


def _leading(plan: Plan, args: list[int]) -> int:
    """How many of the leading candidate arguments `plan` keeps off replication."""
    k = 0
    while k < len(args) and plan.arg_specs[args[k]].shard_factor(plan.mesh_axes) > 1:
        k += 1
    return k


def _try(plan_with, candidates: list[int], k: int, limit: int) -> Plan:
    plan = plan_with(candidates[:k])
    progress.say("rhino_jax: memory limit: %d largest not replicated → %.1f MiB per device (limit %.1f)",
                 k, plan.cost.memory_bytes / 2**20, limit / 2**20, best_s=_fitting(plan, limit))
    return plan


def _try_weight(plan_with, weight_s: float, limit: int) -> Plan:
    plan = plan_with([], weight_s)
    progress.say("rhino_jax: memory limit: memory priced at %.3g s/GiB → %.1f MiB per device (limit %.1f)",
                 weight_s * 2**30, plan.cost.memory_bytes / 2**20, limit / 2**20, best_s=_fitting(plan, limit))
    return plan


def _fitting(plan: Plan, limit: int) -> float | None:
    """The plan's predicted step where it fits the memory limit (the best so far to show)."""
    return plan.cost.total_s if plan.cost.memory_bytes <= limit else None


def _stop_if_interrupted(tried: list[Plan], fits) -> None:
    """Ctrl-C during the search: stop, with no plan to return unless one fits already."""
    if tried[-1].search_stats["status"] == "interrupted" and not any(fits(p) for p in tried):
        raise KeyboardInterrupt("the search was interrupted before it found a plan within memory_limit_bytes")


def _raise_memory_error(tried: list[Plan], limit: int, graph: Graph, least: int):
    best = min(tried, key=lambda p: p.cost.memory_bytes)
    local = [local_bytes(graph, a.value, spec, best.mesh_axes) for a, spec in zip(graph.args, best.arg_specs)]
    largest = sorted(range(len(local)), key=lambda i: -local[i])[:5]
    listing = ", ".join(f"{best.arg_paths[i]} {tuple(best.arg_shapes[i])} {best.arg_specs[i]} "
                        f"({local[i] / 2**20:.1f} MiB)" for i in largest)
    donate = ("" if any(a.donated_to is not None for a in graph.args) else
              ", donate the parameters and optimizer state (donate_argnums) so the outputs reuse their buffers")
    raise MemoryLimitError(
        f"no plan fits memory_limit_bytes={limit:,}. Every plan needs at least {least:,} bytes per device "
        f"(a lower bound: the arguments alone, each split as finely as the mesh and pins allow). Of the "
        f"{len(tried)} plans solved, the smallest needs {best.cost.memory_bytes:,} bytes per device "
        f"({sum(local):,} in arguments, the rest in outputs and intermediates at the peak), "
        f"{best.cost.memory_bytes - limit:,} more than the limit; its largest arguments per device: "
        f"{listing}. Raise the limit, use more devices, or shrink the batch or model{donate}.")


def _replicated_choice(units: list[_Unit], groups: list[Cone]) -> list[int | None]:
    """Each cone's strategy in which every member works on whole tensors (None where it has
    none, a pinned cone): the one-device step run on every device, a plan the search must beat."""
    def whole(s: Strategy) -> bool:
        return not any(spec.used_axes() for spec in s.operands + s.results)
    return [next((j for j, ch in enumerate(g.choice) if all(whole(s) for s in ch.values())), None) for g in groups]


def _add_hubs(graph: Graph, units: list[_Unit], groups: list[Cone], group_of: dict[int, int],
              producer_unit: dict[int, int], prices: Prices) -> dict[int, int]:
    """Value → its hub: a value that cones other than its producer's read (two or more) is read
    through a unit of no cost whose strategies are the value's layouts, a cone of its own. The
    move to the hub's layout is paid once and each reader cone pays from there, as `_make_plan`
    (`_shared_path`) and XLA move a value once per layout read; without it each reader cone paid
    the move (an all-reduce of a gradient read by three cones, three times). Not for a value read
    in several conditional branches (a move in one branch is not seen in another). Hubs are
    appended to `units` and `groups` (after every other unit: cones and the DP inside them do
    not see them); the plan leaves them out (`_make_plan`), so reads stay reads of the value."""
    reads: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for m, u in enumerate(units):
        for pos, v in enumerate(u.operands):
            if v in producer_unit and graph.values[v].shape and group_of[m] != group_of[producer_unit[v]]:
                reads[v].append((m, pos))
    hub_of: dict[int, int] = {}
    for v, rs in sorted(reads.items(), key=lambda item: (producer_unit[item[0]], item[0])):
        branches = {_read_branch(units[m], pos, graph) for m, pos in rs}
        if len({group_of[m] for m, _ in rs}) < 2 or len(branches) > 1:
            continue
        p = producer_unit[v]
        made = [ch[p].results[units[p].results.index(v)] for ch in groups[group_of[p]].choice]
        read = [ch[m].operands[pos] for m, pos in rs for ch in groups[group_of[m]].choice]
        # Not partial (every read settles it first); strided only as made (not gone on from, `_shared_path`).
        layouts = dict.fromkeys([spec for spec in made if not spec.partial]
                                + [spec for spec in read if not spec.strides])
        hub_of[v] = h = len(units)
        units.append(_Unit("hub", v, (v,), (v,), [Strategy((spec,), (spec,), 0.0) for spec in layouts],
                           units[p].name, (v,)))
        prices.add_unit((v,))
        group_of[h] = len(groups)
        groups.append(Cone(h, [h], [{h: s} for s in units[h].strategies]))
    return hub_of


def _problem(units, groups: list[Cone], group_of: dict[int, int], producer_unit: dict[int, int],
             prices: Prices, hub_of: dict[int, int]) -> ilp.Problem:
    """The ILP over cones: a cost per cone strategy, and an edge per pair of cones with reads
    between them (reads inside a cone, or from a cone with one layout, fold into the costs); each
    with the combined families it uses (`pricing`)."""
    costs = [np.array([sum(prices.own(m, s) for m, s in ch.items()) for ch in g.choice]) for g in groups]
    uses = [[frozenset().union(*(prices.own_uses(m, s) for m, s in ch.items())) for ch in g.choice]
            for g in groups]

    def moves(values, src_specs, dst_specs) -> dict:
        """A value read in one layout by several readers is resharded once (as in `_make_plan`
        and in XLA, which shares the collective). In read order, not a set's hash order: a float
        sum's last bits, and so the ILP's ties, must not change with PYTHONHASHSEED."""
        return dict.fromkeys(zip(values, src_specs, dst_specs))

    def moves_cost(values, src_specs, dst_specs) -> float:
        return sum(prices.reshard(a, b, v) for v, a, b in moves(values, src_specs, dst_specs))

    def moves_uses(values, src_specs, dst_specs) -> frozenset[int]:
        return frozenset().union(*(prices.reshard_uses(a, b, v) for v, a, b in moves(values, src_specs, dst_specs)))

    reads: dict[tuple[int, int], list[tuple[int, int, int, int]]] = defaultdict(list)  # (v, reader, pos, source)
    for gi, g in enumerate(groups):
        for m in g.members:
            for pos, v in enumerate(units[m].operands):
                if v in producer_unit:
                    p = producer_unit[v]
                    if v in hub_of and m != hub_of[v] and gi != group_of[p]:
                        p = hub_of[v]  # read through the value's hub (`_add_hubs`)
                    reads[(group_of[p], gi)].append((v, m, pos, p))
    edges = []
    for (src, dst), rs in reads.items():
        gs, gd = groups[src], groups[dst]
        values = [v for v, _, _, _ in rs]
        if src == dst:
            for j in range(len(gs.choice)):
                read = (values, [_result_spec(units, gs, j, p, v) for v, _, _, p in rs],
                        [gd.choice[j][m].operands[pos] for _, m, pos, _ in rs])
                costs[src][j] += moves_cost(*read)
                uses[src][j] |= moves_uses(*read)
            continue
        src_keys = [tuple(_result_spec(units, gs, j, p, v) for v, _, _, p in rs) for j in range(len(gs.choice))]
        dst_keys = [tuple(gd.choice[j][m].operands[pos] for _, m, pos, _ in rs) for j in range(len(gd.choice))]
        edge = _read_edge(src, dst, values, src_keys, dst_keys, prices)
        if not edge.matrix.any():
            continue
        if edge.matrix.shape[0] == 1:
            costs[dst] += edge.matrix[0, list(edge.dst_class)]
            for j, b in enumerate(edge.dst_class):
                uses[dst][j] |= _indices(edge.uses[:, 0, b])
        elif edge.matrix.shape[1] == 1:
            costs[src] += edge.matrix[list(edge.src_class), 0]
            for j, a in enumerate(edge.src_class):
                uses[src][j] |= _indices(edge.uses[:, a, 0])
        else:
            edges.append(edge)
    return ilp.Problem(tuple(costs), tuple(edges), prices.families.fixed,
                       tuple(np.array([prices.families.vector(u) for u in g], dtype=bool).T.reshape(
                           len(prices.families.fixed), len(g)) for g in uses))


def _read_edge(src: int, dst: int, values: list[int], src_keys: list[tuple], dst_keys: list[tuple],
               prices: Prices) -> ilp.Edge:
    """The edge of the reads of `values` (one entry per read) from cone src by cone dst; a key
    holds each read's layout at its end. A value read in one layout by several readers is moved
    once (as in `_make_plan` and in XLA, which shares the collective); a value that several cones
    read, they read through its hub (`_add_hubs`), moved to once. Built per value from its few
    distinct moves, summed over each pair of classes by a matrix product: an edge has up to a
    thousand pairs."""
    src_class, src_layouts = ilp.classes(src_keys)
    dst_class, dst_layouts = ilp.classes(dst_keys)
    matrix = np.zeros((len(src_layouts), len(dst_layouts)))
    uses = np.zeros((len(prices.families.fixed),) + matrix.shape, dtype=bool)
    positions: dict[int, list[int]] = defaultdict(list)
    for p, v in enumerate(values):
        positions[v].append(p)
    for v, ps in positions.items():
        cost, used = prices.reads(v, [a[ps[0]] for a in src_layouts], [[b[p] for p in ps] for b in dst_layouts],
                                  uses=bool(uses.shape[0]))
        matrix += cost
        if used is not None:
            uses |= used
    return ilp.Edge(src, dst, src_class, dst_class, matrix, uses)


def _indices(mask: np.ndarray) -> frozenset[int]:
    return frozenset(np.nonzero(mask)[0].tolist())


def _read_branch(u: _Unit, pos: int | None, graph: Graph) -> tuple[int, ...]:
    """The conditional branches (`Node.attrs["branch"]`) a unit's op runs in, or its read of
    operand `pos` does: a conditional's slot reads branch b's value at the end of branch b."""
    if u.kind not in ("node", "slot"):
        return ()
    attrs = graph.nodes[u.ref].attrs
    branch = attrs.get("branch", ())
    return branch + (attrs["alternatives"][pos],) if pos is not None and "alternatives" in attrs else branch


def _visible(reached: dict, v: int, own: ShardingSpec, branch: tuple[int, ...]) -> dict:
    """The layouts value v takes that a read in `branch` can go on from: its own, and those a
    reshard made in that branch or around it (not in another branch, nor in one inside)."""
    seen = {own: ()}
    for k in range(len(branch) + 1):
        seen.update(reached.get((v, branch[:k]), {}))
    return seen


def _taken_branches(planned: list[PlannedCollective], graph: Graph) -> list[PlannedCollective]:
    """The collectives a step runs: of each conditional's branches (outer conditionals first) only
    the one with the most collective bytes (then the most collectives, then the first), as
    `hlo_stats` counts the compiled program's: an upper bound whichever branch runs. Dependency
    masks are renumbered (they hold every collective a collective waits for, so none is lost)."""
    cases = sorted((n for n in graph.nodes if "alternatives" in n.attrs), key=lambda n: len(n.attrs.get("branch", ())))
    kept = list(range(len(planned)))
    for case in cases:
        alternatives = case.attrs["alternatives"]
        weight = {b: (sum(planned[i].bytes for i in kept if b in planned[i].branch),
                      sum(b in planned[i].branch for i in kept)) for b in alternatives}
        taken = max(alternatives, key=lambda b: (weight[b], -b))
        kept = [i for i in kept if not any(b in planned[i].branch for b in alternatives if b != taken)]
    if len(kept) == len(planned):
        return planned
    index = {old: new for new, old in enumerate(kept)}

    def renumbered(mask: int) -> int:
        return sum(1 << index[i] for i in range(mask.bit_length()) if mask >> i & 1 and i in index)
    return [dataclasses.replace(planned[i], depends_on=renumbered(planned[i].depends_on)) for i in kept]


def _shared_path(reached: dict[ShardingSpec, tuple[ShardingSpec, ...]], dst: ShardingSpec, value,
                 topo: MeshTopology) -> tuple[tuple[ShardingSpec, ...], tuple]:
    """The cheapest way to `dst` from any layout the value already takes. `reached` maps each to
    the layouts on the way to it; its first key is the value's own layout. Returns the layouts on
    the whole way to `dst` and the new steps, the only ones to pay for: XLA does the same (a
    partial sum read in two layouts is settled once, then moved). Strided layouts on the way are
    not gone on from: the rewrite holds them in another shape. Adds the new layouts to `reached`."""
    source = next(iter(reached))
    best = None
    for start, way in reached.items():
        if start.strides and start != source:
            continue
        path = reshard_path(start, dst, value.nbytes, topo, value.shape)
        cost = sum(c.alone(topo) for step in path for c in step.collectives)
        if best is None or cost < best[0]:
            best = (cost, way + (start,) if start != source else (), path)
    _, way, path = best
    for step in path:
        reached.setdefault(step.spec, way)
        way = way + (step.spec,)
    return way[:-1], path


def _make_plan(graph, topo, cluster, units, groups, choice, fallback, opt_level, stats,
               prices: Prices) -> Plan:
    chosen: dict[int, Strategy] = {}
    for g, j in zip(groups, choice):
        chosen.update((m, s) for m, s in g.choice[j].items() if units[m].kind != "hub")  # hubs: ILP only
    specs: dict[int, ShardingSpec] = {}
    for i, s in chosen.items():
        specs.update(zip(units[i].results, s.results))
    compute = sum(s.compute_s for s in chosen.values())  # and the layout copies of the reshards, below
    planned: list[PlannedCollective] = []
    read_specs: dict[tuple[int, int], ShardingSpec] = {}
    # Layouts each resharded value already takes, with the layouts on the way to each, by the
    # conditional branches the reshard runs in: a value is resharded once per layout read, and a
    # later read may go on from one of them, if it runs there or outside (`_visible`).
    reached: dict[tuple[int, tuple[int, ...]], dict[ShardingSpec, tuple[ShardingSpec, ...]]] = {}
    read_paths: dict[tuple[int, ShardingSpec], tuple[ShardingSpec, ...]] = {}
    # What each value, and each layout a value is resharded into, waits for: a mask of planned
    # collectives (bit i: the i-th), so the combiner's replay knows which ones are independent.
    after: dict[int, int] = {}
    layout_after: dict[tuple[int, ShardingSpec], int] = {}

    def add(c, u: _Unit, dtype: str, together: bool, needs: int, trip: int = 0, trips: int = 1, branch=()) -> int:
        planned.append(PlannedCollective(c.kind, c.axes, c.bytes, c.time(topo), u.name or u.kind,
                                         together, needs, trip, trips, branch, topo.link(c.axes)[0], dtype))
        return 1 << (len(planned) - 1)

    # Program order; arguments tied to an output read it at the end of the step.
    for i, s in sorted(chosen.items(), key=lambda item: (bool(units[item[0]].operands)
                                                          and units[item[0]].kind == "arg", item[0])):
        u = units[i]
        needs = 0
        for pos, v in enumerate(u.operands):
            needs |= after.get(v, 0) | layout_after.get((v, s.operands[pos]), 0)
            if graph.values[v].constant and graph.values[v].shape and not s.operands[pos].partial \
                    and u.kind in ("node", "slot"):
                # built locally, but split like its reader: left unpinned, XLA's partitioner may
                # split it over an axis the plan leaves idle and add collectives to undo that (on
                # (2, 8), an embedding gradient's zeros split over hosts cost an all-reduce and a
                # cross-host permute in five Flax models)
                read_specs[u.ref, u.slot + pos] = s.operands[pos]
            if graph.values[v].constant or v not in specs or specs[v] == s.operands[pos]:
                continue
            if u.kind in ("node", "slot"):
                read_specs[u.ref, u.slot + pos] = s.operands[pos]
            branch = _read_branch(u, pos, graph)
            here = _visible(reached, v, specs[v], branch)
            if s.operands[pos] in here:
                continue
            known = set(here)
            way, path = _shared_path(here, s.operands[pos], graph.values[v], topo)
            reached.setdefault((v, branch), {}).update((k, w) for k, w in here.items() if k not in known)
            if way:
                read_paths[v, s.operands[pos]] = way
            mask = after.get(v, 0)
            for spec in way:
                mask |= layout_after.get((v, spec), 0)
            for step in path:
                step_mask = 0
                for c in step.collectives:
                    compute += c.copy_time(topo) * graph.values[v].trips
                    for trip in range(graph.values[v].trips):  # in a loop's body: each trip after the last
                        step_mask |= add(c, u, graph.values[v].dtype, prices.combined(c, prices.sides.get(v)),
                                         mask | step_mask, trip, graph.values[v].trips, branch)
                mask |= step_mask
                layout_after[v, step.spec] = mask
            needs |= mask
        side = prices.side_of(u.results)
        trips = graph.values[u.results[0]].trips if u.results else 1
        per_trip = max(1, len(s.collectives) // trips)
        dtype = graph.values[u.results[0]].dtype if u.results else ""
        for k, c in enumerate(s.collectives):  # in a loop's body listed once per trip (`carried.per_trip`)
            needs |= add(c, u, dtype, prices.combined(c, side), needs, k // per_trip, trips,
                         _read_branch(u, None, graph))
        for r in u.results:
            after[r] = needs
    planned = _taken_branches(planned, graph)
    comm, off_chain = combined_time(planned, topo)
    hidden = min(topo.overlap * off_chain, compute)  # behind compute, as XLA's scheduler overlaps
    arg_specs = tuple(specs[a.value] for a in graph.args)
    out_specs = []
    output_unit = {u.ref: i for i, u in enumerate(units) if u.kind == "output"}
    tied = tied_outputs(graph)
    for k, o in enumerate(graph.outputs):
        if k in tied:  # a donated or fed-back argument's layout
            out_specs.append(specs[graph.args[tied[k]].value])
        elif k in output_unit:
            out_specs.append(chosen[output_unit[k]].operands[0])
        else:
            out_specs.append(ShardingSpec.replicated(len(graph.values[o].shape)))
    memory = plan_memory(graph, specs, topo, read_specs, out_specs)
    strided = [v for v, spec in specs.items() if spec.strides]
    examples = dict.fromkeys(f"{graph.values[v].shape} {specs[v]}" for v in strided)
    stats = dict(stats, strided_values=len(strided), strided_examples=tuple(examples)[:3], off_chain_comm_s=off_chain)
    return Plan(
        mesh_axes=dict(zip(topo.axis_names, topo.axis_sizes)),
        cluster=cluster.name,
        opt_level=opt_level,
        arg_paths=tuple(a.path for a in graph.args),
        arg_roles=tuple(a.role for a in graph.args),
        arg_shapes=tuple(graph.values[a.value].shape for a in graph.args),
        arg_dtypes=tuple(graph.values[a.value].dtype for a in graph.args),
        arg_specs=arg_specs,
        output_paths=graph.output_paths,
        output_specs=tuple(out_specs),
        value_specs=specs,
        read_specs=read_specs,
        read_paths=read_paths,
        cost=PlanCost(compute, comm, compute + comm - hidden, memory, hidden),
        collectives=tuple(planned),
        fallback_ops=tuple(fallback),
        search_stats=dict(ops=len(graph.nodes), **stats),
        backend=cluster.backend,
    )
