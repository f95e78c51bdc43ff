"""Why a plan is what it is: `explain` (one argument's layout, the collectives it causes, and what
the best plans with it laid out otherwise are predicted to cost) and `diff` (two plans of one step,
layout by layout and cost by cost).

The alternatives come from the search itself: the argument is pinned to another layout and the
plan's own ILP is solved again (`search.repin`: the plan's cones and prices, the argument's cone
left only the strategies that make the layout, started from the plan), seconds where a search
takes tens of them; where that ILP has no strategy making the layout, the step is searched again
with the `Pin` that `rj.annotate` makes. Either way an alternative's cost is the best plan found
under that choice, priced as every plan is.
That needs the step's graph and mesh, which a plan does not save: `parallelize` keeps them beside
the plans it makes (`SearchInputs`, not saved nor compared); a plan loaded from a file, or one run
as several programs (micro-batches, pipeline stages), explains its layouts and collectives only.
"""
from __future__ import annotations

import difflib
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.sharding import Mesh

from rhino_jax.hlo_passes.graph import Graph, Pin, dtype_size, path_tokens
from rhino_jax.search import progress as search_progress
from rhino_jax.search.cluster import Cluster, MeshTopology, get_cluster
from rhino_jax.search.collectives import reshard_path
from rhino_jax.search.units import tied_outputs
from rhino_jax.core.plan import Plan, PlanCost, PlannedCollective, as_plan
from rhino_jax.core.plan_file import mesh_label
from rhino_jax.core.specs import ShardingSpec
from rhino_jax.search.constraints import layout_allowed
from rhino_jax.search.strategies import tensor_specs
from rhino_jax.search.ties import SAME_STEP

from .errors import RhinoError, UnknownTensorError
from .mesh_search import finished, plan_on
from .options import Options, seconds_left


@dataclass(frozen=True)
class SearchInputs:
    """What an SPMD plan was searched on, kept beside it by `parallelize` so that `explain` can
    search the step again with one argument pinned."""

    graph: Graph
    mesh: Mesh
    options: Options
    # (argument, layout) → the alternative found, so that explaining an argument again searches nothing
    found: dict[tuple[int, ShardingSpec], "Alternative"] = field(default_factory=dict, compare=False, repr=False)

    @functools.cached_property
    def cluster(self) -> Cluster:
        return get_cluster(self.options.cluster, list(self.mesh.devices.flat))

    @functools.cached_property
    def topo(self) -> MeshTopology:
        return MeshTopology.from_mesh(self.mesh, self.cluster)


@dataclass(frozen=True)
class Alternative:
    """Another layout of the explained argument and the best plan the search finds with the
    argument pinned to it (`plan` None and `why` where there is none)."""

    layout: ShardingSpec
    plan: Plan | None = field(default=None, repr=False)
    delta_s: float = float("nan")  # its predicted step minus the explained plan's
    why: str = ""
    searched: bool = False  # found by a new search, not on the plan's own ILP (`search.repin`)


@dataclass(frozen=True)
class Explanation:
    """`plan.explain(name)`: print it, or read its parts."""

    name: str  # the argument's path, as the report prints it
    layout: ShardingSpec
    alternatives: tuple[Alternative, ...]  # cheapest first; empty where none were searched
    text: str = field(repr=False)

    def __str__(self) -> str:
        return self.text


def explain(plan: Plan, name: str, alternatives: int = 3) -> Explanation:
    """Argument `name`'s layout, the collectives at it and in its layer, and up to `alternatives`
    other layouts with the predicted step of the best plan under each (searched again, see the
    module's docstring)."""
    if isinstance(alternatives, bool) or not isinstance(alternatives, int) or alternatives < 0:
        raise ValueError(f"alternatives must be a number of layouts to search, 0 or more; got {alternatives!r}")
    i = arg_index(plan, name)
    path, shape, layout = plan.arg_paths[i], plan.arg_shapes[i], plan.arg_specs[i]
    axes = plan_axes(plan)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype_size(plan.arg_dtypes[i])
    lines = [f"{path}: {plan.arg_roles[i]} {tuple(shape)} {plan.arg_dtypes[i]}, {_bytes(nbytes)}",
             f"  layout        {layout}: {describe(layout, shape, axes)}; "
             f"{_bytes(nbytes // layout.shard_factor(axes))} per device"]
    collectives = all_collectives(plan)
    own = [c for c in collectives if c.where == path]
    lines.append("  at it         " + (_kinds(own) + " (its new value, made in another layout, brought back "
                                       "into this one for the next step)" if own else "no collectives"))
    inputs: SearchInputs | None = plan.search_inputs
    if inputs is not None:
        lines += _reads(plan, inputs, i)
    layers = arg_layers(plan)
    layer = layers[path]
    near = [c for c in collectives if c.where != path and op_layer(c.where, layers) == layer]
    lines.append(f"  its layer     {layer}: {_kinds(near) if near else 'no collectives'}")
    c = plan.cost
    parts = "" if plan.stages else f" (compute {_ms(c.compute_s)}, communication {_ms(c.comm_s)})"
    lines.append(f"  plan          step {_ms(c.total_s)}{parts}, {c.memory_bytes / 2**20:.2f} MiB/device")
    found: tuple[Alternative, ...] = ()
    if inputs is None:
        lines.append("  alternatives  not priced: they are found by searching the step again, and this plan keeps no "
                     "step to search (a plan loaded from a file, or one run as several programs: micro-batches or "
                     "pipeline stages); explain the plan of rj.parallelize(step, mesh=...).lower(*args)")
    else:
        found, said = _alternatives(plan, inputs, i, alternatives)
        lines.append("  alternatives  " + said)
        lines += [_alternative_line(a, plan.cost) for a in found]
    return Explanation(path, layout, found, "\n".join(lines))


def _reads(plan: Plan, inputs: SearchInputs, i: int) -> list[str]:
    """Lines on the layouts the argument's readers read it in, where not its own, and the moves
    there (priced alone, as the search compares reshard paths)."""
    graph, topo = inputs.graph, inputs.topo
    v = graph.args[i].value
    value = graph.values[v]
    lines = []
    for read, ops in _read_layouts(plan, graph, i).items():
        if read == plan.arg_specs[i]:
            continue
        moved = [c for step in reshard_path(plan.arg_specs[i], read, value.nbytes, topo, value.shape)
                 for c in step.collectives]
        how = ", ".join(f"{c.kind} over {'+'.join(c.axes)} {_bytes(c.bytes)} {c.alone(topo) * 1e6:.1f} µs"
                        for c in moved)
        lines.append(f"  read as       {read} by {len(ops)} op(s) ({', '.join(ops[:2])}{', ...' if len(ops) > 2 else ''}): "
                     + (how or "a local slice, no collective"))
    return lines


def _read_layouts(plan: Plan, graph: Graph, i: int) -> dict[ShardingSpec, list[str]]:
    """Each layout argument i is read in (its own where the reader takes it as it is), with the
    names of the ops reading it so."""
    v = graph.args[i].value
    out: dict[ShardingSpec, list[str]] = {}
    for n in graph.consumers()[v]:
        node = graph.nodes[n]
        for k, o in enumerate(node.operands):
            if o == v:
                out.setdefault(plan.read_specs.get((n, k), plan.arg_specs[i]), []).append(node.name or node.op)
    return out


def _alternatives(plan: Plan, inputs: SearchInputs, i: int, k: int) -> tuple[tuple[Alternative, ...], str]:
    """The best plans with argument i pinned to each of its k most promising other layouts, and
    a line saying how they were found. Promising: cheapest for the argument's own moves with
    the rest of the plan kept (`_moves_s`), roughly what the plan with only that change costs,
    which the search with the argument pinned there can only improve on."""
    graph, arg = inputs.graph, inputs.graph.args[i]
    if any(p.value == arg.value for p in graph.pins):
        return (), "none: the step pins this argument's layout (rj.annotate), the search did not choose it"
    chosen = plan.arg_specs[i]
    shaped = [s for s in tensor_specs(graph.values[arg.value].shape, inputs.topo) if s != chosen]
    others = [s for s in shaped if layout_allowed(inputs.options.constraints, arg.path, s, inputs.topo.sizes)]
    if not others:
        return (), ("none: no other layout of its shape divides it on this mesh" if not shaped else
                    f"none: the constraints allow it none of its {len(shaped)} other layouts")
    if k == 0:
        return (), f"not searched (alternatives=0; {len(others)} other layouts)"
    moves = _moves_s(plan, inputs, i)
    ranked = sorted(others, key=moves)[:k]
    t0 = time.perf_counter()
    known = sum((i, layout) in inputs.found for layout in ranked)
    with search_progress.shown(search_progress.enabled(inputs.options.progress)), search_progress.part():
        for layout in ranked:
            if (i, layout) not in inputs.found:
                inputs.found[i, layout] = _alternative(plan, inputs, i, layout)
    found = sorted((inputs.found[i, layout] for layout in ranked), key=lambda a: (a.plan is None, a.delta_s))
    which = (f"{len(ranked)} of its {len(others)} other layouts (those whose own moves cost least with the rest of "
             "the plan kept)" if len(ranked) < len(others) else f"its {len(others)} other layouts")
    searched = sum(a.searched for a in found)
    how = ("the plan's own ILP solved again" if not searched else
           f"searched again ({plan.opt_level}, this plan's options)" if searched == len(found) else
           f"the plan's own ILP solved again ({searched} searched again: no strategy of the plan's cone makes them)")
    said = (f"the best plan with it pinned to each layout below, {how}: {which}, in {time.perf_counter() - t0:.1f} s"
            + (f" ({known} found by an earlier explain of it)" if known else ""))
    return tuple(found), said


def _alternative(plan: Plan, inputs: SearchInputs, i: int, layout: ShardingSpec) -> Alternative:
    """The best plan with argument i pinned to `layout`: the plan's own ILP solved again with
    the pin (`search.repin`), or where that cannot (no strategy of the argument's cone makes the
    layout, a plan from another process), the step searched again with it."""
    arg = inputs.graph.args[i]
    try:
        alt = plan.repin(arg.value, layout, seconds_left(inputs.options)) if plan.repin is not None else None
        if alt is not None:
            alt = finished(alt, inputs.graph, inputs.topo, inputs.mesh)
            return Alternative(layout, alt, alt.cost.total_s - plan.cost.total_s)
        search_progress.say("rhino_jax: explain %s: searching with it pinned to %s", arg.path, layout)
        pinned = inputs.graph.replace(pins=inputs.graph.pins + (Pin(arg.value, layout.dims, arg.path),))
        alt = plan_on(pinned, inputs.topo, inputs.cluster, inputs.options, inputs.mesh)
    except RhinoError as e:  # a memory limit no plan with it fits, a solver out of time
        return Alternative(layout, why=f"{type(e).__name__}: {str(e).splitlines()[0]}", searched=True)
    return Alternative(layout, alt, alt.cost.total_s - plan.cost.total_s, searched=True)


def _moves_s(plan: Plan, inputs: SearchInputs, i: int) -> Callable[[ShardingSpec], float]:
    """Seconds argument i's own moves would take in a layout, every other tensor kept where the
    plan has it: to each layout its readers read, from its new value (fed back into it), and a
    batch's copy from the host."""
    graph, topo = inputs.graph, inputs.topo
    arg = graph.args[i]
    value = graph.values[arg.value]
    reads = [r for r in _read_layouts(plan, graph, i) if not r.partial]
    fed = {a: k for k, a in tied_outputs(graph).items()}
    new = graph.outputs[fed[i]] if i in fed else arg.value
    source = plan.value_specs.get(new) if new != arg.value else None

    def move(src: ShardingSpec, dst: ShardingSpec) -> float:
        return sum(c.alone(topo) for step in reshard_path(src, dst, value.nbytes, topo, value.shape)
                   for c in step.collectives)

    def cost(layout: ShardingSpec) -> float:
        total = sum(move(layout, r) for r in reads) + (move(source, layout) if source is not None else 0.0)
        if arg.role == "batch":
            total += value.nbytes / layout.shard_factor(topo.sizes) / inputs.cluster.host_to_device_bandwidth
        return total
    return cost


def _alternative_line(a: Alternative, base: PlanCost) -> str:
    if a.plan is None:
        return f"    {str(a.layout):<16} no plan: {a.why}"
    c = a.plan.cost
    tie = abs(a.delta_s) <= SAME_STEP * base.total_s
    cheaper = ("  (a tie: the same predicted step; of tied layouts the search keeps the one that holds the least "
               "memory, then splits the leading dims)" if tie else
               "  (cheaper: the search missed it; opt_level='O3' searches the whole graph)"
               if a.delta_s < 0 else "")
    return (f"    {str(a.layout):<16} alternative step {_ms(c.total_s)}: {_ms(a.delta_s, sign=True)} "
            f"({a.delta_s / base.total_s:+.1%}); compute {_ms(c.compute_s - base.compute_s, sign=True)}, "
            f"communication {_ms(c.comm_s - base.comm_s, sign=True)}, memory "
            f"{(c.memory_bytes - base.memory_bytes) / 2**20:+.2f} MiB/device{cheaper}")


def arg_index(plan: Plan, name: str) -> int:
    """The argument `name` names: its path as the report prints it (arg[0]['w']) or as a path of
    `plan.input_shardings` ([0]['w']); UnknownTensorError listing the closest names otherwise."""
    names = {p: i for i, p in enumerate(plan.arg_paths)}
    names.update((p.removeprefix("arg"), i) for i, p in enumerate(plan.arg_paths))
    if plan.input_shardings is not None:  # with keyword arguments its paths start [0] (args) or [1] (kwargs)
        leaves = jax.tree_util.tree_flatten_with_path(plan.input_shardings)[0]
        if len(leaves) == len(plan.arg_paths):
            names.update((jax.tree_util.keystr(p), i) for i, (p, _) in enumerate(leaves))
    key = str(name).strip().replace('"', "'")
    if key in names:
        return names[key]
    close = dict.fromkeys(plan.arg_paths[names[c]] for c in difflib.get_close_matches(key, list(names), n=8))
    shown = list(close)[:5] or list(plan.arg_paths[:5])
    raise UnknownTensorError(
        f"the plan has no argument {name!r}; it has {len(plan.arg_paths)} arguments, named as plan.report() prints "
        f"them or as paths of plan.input_shardings (without the leading 'arg'). "
        + ("Closest: " if close else "The first: ") + ", ".join(shown))


def describe(spec: ShardingSpec, shape: tuple[int, ...], axes: dict[str, int]) -> str:
    """A layout in words: which mesh axes split which dim, and which replicate it."""
    split = [f"dim {d} ({shape[d]}) split over {'+'.join(a)} ({ShardingSpec.shard_factor_of(a, axes)} ways)"
             for d, a in enumerate(spec.dims) if a]
    if not split:
        return f"replicated on all {int(np.prod(list(axes.values())))} devices"
    rest = [a for a in axes if a not in spec.used_axes() and axes[a] > 1]
    return "; ".join(split) + (f"; replicated over {', '.join(rest)}" if rest else "")


def plan_axes(plan: Plan) -> dict[str, int]:
    """The axes an argument's layout is over: a pipeline's arguments live on their stage's
    sub-mesh (all stages alike; an interlaced pipeline's on every device use the same axes),
    others on the whole mesh."""
    return next((st.mesh_axes for st in plan.stages if not st.shared), plan.mesh_axes)


def all_collectives(plan: Plan) -> list[PlannedCollective]:
    """The collectives of one step that move data: a pipeline's apply-gradients programs' (in
    `plan.collectives`) and its stages' forward and backward programs', once per micro-batch. One
    over mesh axes of a single device (a layout naming an axis of size 1 on a stage's sub-mesh)
    moves nothing, costs nothing and is no op XLA compiles: left out."""
    k = plan.search_stats.get("micro_batches", 1)
    runs = [plan.collectives] + [p.collectives * k for st in plan.stages for p in (st.forward, st.backward) if p]
    return [c for run in runs for c in run if c.group > 1]


def _keys(path: str) -> list[str]:
    """An argument path's dict keys and indices from its first dict key on (the attributes and
    indices before it, an optimizer's chain and moment, left out): arg[1][0].mu['Block_0']['kernel']
    → ['Block_0', 'kernel']."""
    tokens = path_tokens(path)
    first = next((j for j, (kind, _) in enumerate(tokens) if kind == "key"), len(tokens))
    return [text for kind, text in tokens[first:] if kind != "attr"]


def arg_layers(plan: Plan) -> dict[str, str]:
    """Argument path → its layer: the keys of the parameter it belongs to, less the leaf's own
    name ("Block_0/Dense_0"), so a parameter and its optimizer moments share one (a state's path
    ends with its parameter's: arg[1]['mu']['head']['w'] and arg[0]['head']['w'] → "head"); a
    leaf alone in its path is its own layer, every batch argument in "(batch)"."""
    keys = [_keys(p) for p in plan.arg_paths]
    params = {tuple(k) for k, role in zip(keys, plan.arg_roles) if role == "parameter"}
    out = {}
    for path, role, k in zip(plan.arg_paths, plan.arg_roles, keys):
        own = next((k[j:] for j in range(len(k)) if tuple(k[j:]) in params), k)
        out[path] = "(batch)" if role == "batch" else "/".join(own[:-1]) or "/".join(own) or path
    return out


def op_layer(where: str, layers: dict[str, str]) -> str:
    """The layer of the op a collective serves (`PlannedCollective.where`): an argument's
    (`arg_layers`), else the named scopes in its source name less the transformations, einsum
    specs and the primitive ("transpose(jvp(LM))/Block_0/Dense_0/transpose" → "Block_0/Dense_0");
    "" for an op in no named scope."""
    if where in layers:
        return layers[where]
    parts = [p for p in where.split("/") if p and not any(c in p for c in "()->,")]
    # Flax names a module's scope twice where its method runs in it (.../SelfAttention_0/SelfAttention_0/query)
    return "/".join(p for k, p in enumerate(parts[:-1]) if k == 0 or p != parts[k - 1])


@dataclass(frozen=True)
class Kind:
    """Collectives of one kind, summed."""

    count: int = 0
    bytes: int = 0
    alone_s: float = 0.0  # each priced alone, before XLA combines them
    combined_s: float | None = 0.0  # their shares of the ops XLA combines them into; None: not kept

    def add(self, c: PlannedCollective) -> "Kind":
        combined = None if self.combined_s is None or c.combined_s is None else self.combined_s + c.combined_s
        return Kind(self.count + 1, self.bytes + c.bytes, self.alone_s + c.time_s, combined)


def by_kind(collectives: list[PlannedCollective]) -> dict[str, Kind]:
    """Kind → the collectives of that kind summed, kinds in the order they first run."""
    out: dict[str, Kind] = {}
    for c in collectives:
        out[c.kind] = out.get(c.kind, Kind()).add(c)
    return out


def _kinds(collectives: list[PlannedCollective]) -> str:
    """Collectives summed by kind: "all-gather ×2 (512.0 KiB, 2.41 µs in the step, 37.6 µs alone)"."""
    return ", ".join(f"{kind} ×{k.count} ({_bytes(k.bytes)}, {times(k)})" for kind, k in by_kind(collectives).items())


def times(k: Kind) -> str:
    """What collectives summed by kind cost: in the step (as XLA combines them) and alone."""
    alone = f"{k.alone_s * 1e6:.1f} µs alone"
    return alone if k.combined_s is None else f"{k.combined_s * 1e6:.3g} µs in the step ({alone})"


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _ms(seconds: float, sign: bool = False) -> str:
    """Seconds in ms to the tenth of a µs (a difference of -0.00001 µs prints as +0.0000)."""
    return f"{round(seconds * 1e3, 4) + 0.0:{'+' if sign else ''}.4f} ms"


MAX_ROWS = 20  # layouts rj.diff lists; the rest are counted


@dataclass(frozen=True)
class LayoutChange:
    """One argument laid out differently by two plans."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    a: ShardingSpec
    b: ShardingSpec


@dataclass(frozen=True)
class PlanDiff:
    """`rj.diff(a, b)`: print it, or read the changes and the deltas (b minus a)."""

    changes: tuple[LayoutChange, ...]  # held otherwise by the devices; largest argument first
    renamed: tuple[LayoutChange, ...]  # named otherwise (other meshes), each device holding the same slice
    a: PlanCost
    b: PlanCost
    # b minus a
    step_s: float
    compute_s: float
    comm_s: float
    memory_bytes: int
    text: str = field(repr=False)

    def __str__(self) -> str:
        return self.text


def diff(a: Plan | str | os.PathLike, b: Plan | str | os.PathLike) -> PlanDiff:
    """The arguments two plans of one step (each a Plan or the path of a saved one) lay out
    differently, and what b costs more than a (step, compute, communication, memory, collectives
    as XLA combines them). Layouts are compared as the devices hold them (`holdings`): [data+model, -]
    on a (2, 4) mesh and [data, -] on an (8,) mesh of the same devices are one layout. Devices are
    the plans' own (`plan.input_shardings`) where both have them; where one has none (a plan loaded
    from a file, or made for described GPUs and saved) each device is its position in its mesh's
    device order, row-major, as `rj.device_mesh` lays devices out, so two plans are compared as if
    both meshes were built over one list of devices. ValueError for plans of different steps
    (other arguments)."""
    a, b = as_plan(a, "a of rj.diff(a, b)"), as_plan(b, "b of rj.diff(a, b)")
    for what, x, y in (("argument paths", a.arg_paths, b.arg_paths), ("argument shapes", a.arg_shapes, b.arg_shapes),
                       ("argument dtypes", a.arg_dtypes, b.arg_dtypes)):
        if tuple(x) != tuple(y):
            k = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            at = [repr(seq[k]) if k < len(seq) else "nothing" for seq in (x, y)]
            raise ValueError(f"rj.diff compares two plans of one step, but their {what} differ (a has {len(x)}, b "
                             f"{len(y)}; the first difference, at {k}: {at[0]} in a, {at[1]} in b)")
    meshes_a, meshes_b = arg_meshes(a), arg_meshes(b)
    by_ids = meshes_a is not None and meshes_b is not None
    if not by_ids:
        meshes_a, meshes_b = _positions(a), _positions(b)
    sizes = [int(np.prod(sh, dtype=np.int64)) * dtype_size(dt) for sh, dt in zip(a.arg_shapes, a.arg_dtypes)]
    changes: list[LayoutChange] = []
    renamed: list[LayoutChange] = []
    for i in sorted(range(len(a.arg_paths)), key=lambda i: -sizes[i]):
        if a.arg_specs[i] == b.arg_specs[i] and meshes_a[i] == meshes_b[i]:
            continue
        ch = LayoutChange(a.arg_paths[i], tuple(a.arg_shapes[i]), a.arg_dtypes[i], a.arg_specs[i], b.arg_specs[i])
        if holdings(ch.a, ch.shape, *meshes_a[i]) != holdings(ch.b, ch.shape, *meshes_b[i]):
            changes.append(ch)
        elif ch.a != ch.b:
            renamed.append(ch)
    ca, cb = a.cost, b.cost
    step, compute, comm = cb.total_s - ca.total_s, cb.compute_s - ca.compute_s, cb.comm_s - ca.comm_s
    memory = cb.memory_bytes - ca.memory_bytes
    lines = [f"plan {x}: mesh {mesh_label(p.mesh_axes)}, {p.opt_level}, step {_ms(p.cost.total_s)}, "
             f"{p.cost.memory_bytes / 2**20:.2f} MiB/device" for x, p in (("a", a), ("b", b))]
    lines.append(f"b - a: step {_ms(step, sign=True)} ({step / ca.total_s:+.1%}), compute {_ms(compute, sign=True)}, "
                 f"communication {_ms(comm, sign=True)}, memory {memory / 2**20:+.2f} MiB/device")
    sa, sb = a.collective_summary(), b.collective_summary()
    moved = [f"{kind} {sa.get(kind, (0, 0))[0]} → {sb.get(kind, (0, 0))[0]} ops, "
             f"{_bytes(sa.get(kind, (0, 0))[1])} → {_bytes(sb.get(kind, (0, 0))[1])}"
             for kind in sorted(set(sa) | set(sb)) if sa.get(kind) != sb.get(kind)]
    lines.append("collectives (as XLA combines them): " + ("; ".join(moved) or "the same"))
    devices = "device ids of the plans' meshes" if by_ids else "devices by their position in each mesh, row-major"
    lines.append(f"layouts that differ (which device holds which slice; {devices}): {len(changes)} of "
                 f"{len(a.arg_paths)} arguments" + (" (largest first):" if changes else ""))
    lines += _rows(changes[:MAX_ROWS], len(changes))
    if renamed:
        ch = renamed[0]
        lines.append(f"named otherwise, laid out alike: {len(renamed)} arguments (each device holds the same slice), "
                     f"e.g. {ch.path} {ch.a} on {mesh_label(plan_axes(a))}, {ch.b} on {mesh_label(plan_axes(b))}")
    return PlanDiff(tuple(changes), tuple(renamed), ca, cb, step, compute, comm, memory, "\n".join(lines))


def _rows(shown: list[LayoutChange], total: int) -> list[str]:
    """The changes shown, one a line, and how many more of `total` there are."""
    width = max((len(ch.path) for ch in shown), default=0)
    rows = [f"  {ch.path:<{width}}  {str(ch.shape):<16} {str(ch.a):<16} → {ch.b}" for ch in shown]
    return rows + ([f"  ... and {total - len(shown)} more"] if total > len(shown) else [])


def holdings(spec: ShardingSpec, shape: tuple[int, ...], axes: dict[str, int], devices: tuple[int, ...]
             ) -> dict[int, tuple[tuple[int, int], ...]]:
    """Device → the [start, stop) of each dim it holds of a tensor of `shape` laid out as `spec`
    on a mesh of `axes` whose devices (ids or positions) are `devices`, row-major: what jax's
    `NamedSharding(mesh, spec).devices_indices_map(shape)` says, without needing the devices.
    A dim split over several axes takes the first as the major one, as a PartitionSpec does; a
    strided dim is read in its split form (`ShardingSpec.split`)."""
    shape, spec = spec.split(tuple(shape), axes)
    out = {}
    for device, at in zip(devices, np.ndindex(*axes.values())):
        coord = dict(zip(axes, at))
        held = []
        for size, dim_axes in zip(shape, spec.dims):
            k, n = 0, 1
            for axis in dim_axes:
                k, n = k * axes[axis] + coord[axis], n * axes[axis]
            held.append((k * size // n, (k + 1) * size // n))
        out[device] = tuple(held)
    return out


def arg_meshes(plan: Plan) -> list[tuple[dict[str, int], tuple[int, ...]]] | None:
    """Each argument's mesh, as (axis sizes, device ids row-major), from the plan's shardings (a
    pipeline's state on its stage's sub-mesh); None for a plan that has none."""
    leaves = jax.tree.leaves(plan.input_shardings) if plan.input_shardings is not None else []
    if len(leaves) != len(plan.arg_paths):
        return None
    return [(dict(zip(s.mesh.axis_names, s.mesh.devices.shape)), tuple(int(d.id) for d in s.mesh.devices.flat))
            for s in leaves]


def _positions(plan: Plan) -> list[tuple[dict[str, int], tuple[int, ...]]]:
    """Each argument's mesh with its devices as positions: the mesh its layout names (a stage's
    sub-mesh for a pipeline, `plan_axes`)."""
    axes = plan_axes(plan)
    return [(axes, tuple(range(int(np.prod(list(axes.values()), dtype=np.int64)))))] * len(plan.arg_paths)
