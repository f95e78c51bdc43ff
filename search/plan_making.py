"""A solved choice of strategies → `Plan`: the specs of every value, the collectives in program
order (each reshard shared by the reads of one layout, as XLA shares it), the cost and memory."""
from __future__ import annotations

import dataclasses


from rhino_jax.core.diagnostics import SearchDiagnostics
from rhino_jax.core.plan import Plan, PlanCost, PlannedCollective
from rhino_jax.core.specs import ShardingSpec

from ..hlo_passes.graph import Graph
from .cost import overlap
from .cost.cluster import MeshTopology
from .cost.collectives import reshard_path
from .cost.combining import combined_ops, combined_time, op_kernels_s
from .cost.memory import plan_memory
from .pricing import Prices
from .space.strategies import Strategy
from .space.units import Unit, read_branch, tied_outputs


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
    `runtime.compiled.collectives` counts the compiled program's: an upper bound whichever branch
    runs. Dependency masks are renumbered (they hold every collective a collective waits for, so
    none is lost)."""
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


def _seen_as_constant(graph: Graph, u: Unit, pos: int) -> bool:
    """A constant operand XLA must see as the constant it is, not pinned: a prefix scan's inits.
    XLA's GPU compiler rewrites a `chlo.scan` whose inits are the reduction's identity into a
    tree of reduce-windows; a pinned init reaches it as a copy, and the scan is run as a loop of
    one element per trip instead (an MoE router's cumsum over 256 tokens: 256 trips of a few kernels
    each, where jax.jit's program has a few fusions). The scan's rows decide its inits' layout."""
    if u.kind != "node":
        return False
    node = graph.nodes[u.ref]
    return node.op == "chlo.scan" and pos >= len(node.operands) // 2


def make_plan(graph, topo, cluster, units, groups, choice, fallback, opt_level, stats: SearchDiagnostics,
              prices: Prices) -> Plan:
    chosen: dict[int, Strategy] = {}
    for g, j in zip(groups, choice):
        chosen.update((m, s) for m, s in g.choice[j].items() if units[m].kind != "hub")  # hubs: ILP only
    specs: dict[int, ShardingSpec] = {}
    for i, s in chosen.items():
        specs.update(zip(units[i].results, s.results))
    compute = sum(s.compute_s for s in chosen.values())  # and the layout copies of the reshards, below
    planned: list[PlannedCollective] = []
    sides: list[str | None] = []  # each planned collective's value's side of the chain (`combining_sides`)
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
    # What a reader of each value, and of each layout a value is resharded into, waits for on the
    # link: the collectives that make it (its maker's own, or the reshard's last step).
    made_by: dict[int, tuple[int, ...]] = {}
    maker: dict[int, int] = {}  # value -> the unit that makes it
    layout_made_by: dict[tuple[int, ShardingSpec], tuple[int, ...]] = {}

    events: list[overlap.Event] = []  # program order, for the overlapped step (`overlap.replay`)

    def add(c, u: Unit, dtype: str, together: bool, needs: int, trip: int = 0, trips: int = 1, branch=(),
            side: str | None = None, maker_unit: int | None = None) -> int:
        planned.append(PlannedCollective(c.kind, c.axes, c.bytes, c.time(topo), u.name or u.kind,
                                         together, needs, trip, trips, branch, topo.link(c.axes)[0], dtype))
        sides.append(side)
        events.append(overlap.Event(index=len(planned) - 1, how=overlap.how_it_runs(together, side), trips=trips,
                                    trip=trip, after=() if maker_unit is None else (maker_unit,)))
        return 1 << (len(planned) - 1)

    # Program order; arguments tied to an output read it at the end of the step.
    for i, s in sorted(chosen.items(), key=lambda item: (bool(units[item[0]].operands)
                                                          and units[item[0]].kind == "arg", item[0])):
        u = units[i]
        needs, reads = 0, []
        for pos, v in enumerate(u.operands):
            needs |= after.get(v, 0) | layout_after.get((v, s.operands[pos]), 0)
            reads += made_by.get(v, ()) + layout_made_by.get((v, s.operands[pos]), ())
            if graph.values[v].constant and graph.values[v].shape and not s.operands[pos].partial \
                    and u.kind in ("node", "slot") and not _seen_as_constant(graph, u, pos):
                # built locally, but split like its reader: left unpinned, XLA's partitioner may
                # split it over an axis the plan leaves idle and add collectives to undo that (on
                # (2, 8), an embedding gradient's zeros split over hosts cost an all-reduce and a
                # cross-host permute in five Flax models)
                read_specs[u.ref, u.slot + pos] = s.operands[pos]
            if graph.values[v].constant or v not in specs or specs[v] == s.operands[pos]:
                continue
            if u.kind in ("node", "slot"):
                read_specs[u.ref, u.slot + pos] = s.operands[pos]
            branch = read_branch(u, pos, graph)
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
                step_mask, first = 0, len(planned)
                for c in step.collectives:
                    compute += c.copy_time(topo) * graph.values[v].trips
                    events.append(overlap.Event(c.copy_time(topo) * graph.values[v].trips, trips=graph.values[v].trips))
                    for trip in range(graph.values[v].trips):  # in a loop's body: each trip after the last
                        step_mask |= add(c, u, graph.values[v].dtype, prices.combined(c, prices.sides.get(v)),
                                         mask | step_mask, trip, graph.values[v].trips, branch, prices.sides.get(v),
                                         maker.get(v))
                mask |= step_mask
                layout_after[v, step.spec] = mask
                layout_made_by[v, step.spec] = tuple(range(first, len(planned)))
            needs |= mask
            reads += layout_made_by.get((v, s.operands[pos]), ())
        side = prices.side_of(u.results)
        trips = graph.values[u.results[0]].trips if u.results else 1
        events.append(overlap.Event(s.compute_s, trips=trips, reads=tuple(dict.fromkeys(reads)), unit=i,
                                    after=tuple(dict.fromkeys(maker[v] for v in u.operands if v in maker))))
        per_trip = max(1, len(s.collectives) // trips)
        dtype = graph.values[u.results[0]].dtype if u.results else ""
        first = len(planned)
        for k, c in enumerate(s.collectives):  # in a loop's body listed once per trip (`carried.per_trip`)
            needs |= add(c, u, dtype, prices.combined(c, side), needs, k // per_trip, trips,
                         read_branch(u, None, graph), side, i)
        for r in u.results:
            after[r] = needs
            made_by[r] = tuple(range(first, len(planned)))
            maker[r] = i
    # behind compute as XLA's scheduler runs them (a collective of a branch not taken counted too)
    ops = combined_ops(planned, topo)
    kernels = [op_kernels_s(planned, group, sides, topo) for group, _ in ops]
    compute += sum(kernels)
    step, exposed = overlap.exposure(*overlap.issued(events, ops, kernels)) if cluster.overlap else (float("inf"), {})
    # what the ops off the chain hid (an op's exposure is its issuing member's): the next overlap
    # round's share; the chain's collectives hide too, behind independent compute
    off_ops = [(group, t) for group, t in ops if planned[group[0]].combinable]
    off_hidden = sum(t - sum(exposed.get(i, 0.0) for i in group) for group, t in off_ops) if exposed else 0.0
    planned = _taken_branches(planned, graph)
    comm, off_chain = combined_time(planned, topo)
    hidden = min(comm, max(0.0, compute + comm - step))
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
    stats = dataclasses.replace(stats, strided_values=len(strided), strided_examples=tuple(examples)[:3])
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
        cost=PlanCost(compute, comm, compute + comm - hidden, memory, hidden, off_chain,
                      min(off_chain, max(0.0, off_hidden))),
        collectives=tuple(planned),
        fallback_ops=tuple(fallback),
        search_stats=stats,
        backend=cluster.backend,
    )
