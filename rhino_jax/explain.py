"""Why a plan is what it is: `explain`, one argument's layout, the collectives it causes, and what
the best plans with it laid out otherwise are predicted to cost (two plans of one step compared:
`plan_diff`).

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

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from jax.sharding import Mesh

from rhino_jax.core.plan import Plan, PlanCost
from rhino_jax.core.specs import ShardingSpec
from rhino_jax.hlo_passes.graph import Graph, Pin, dtype_size
from rhino_jax.search import progress as search_progress
from rhino_jax.search.cost.cluster import Cluster, MeshTopology, get_cluster
from rhino_jax.search.cost.collectives import reshard_path
from rhino_jax.search.space.constraints import layout_allowed
from rhino_jax.search.space.strategies import tensor_specs
from rhino_jax.search.ties import SAME_STEP
from rhino_jax.search.space.units import tied_outputs

from .errors import RhinoError
from .mesh_search import finished, plan_on
from .options import Options, seconds_left
from .plan_view import (all_collectives, arg_index, arg_layers, bytes_text, describe, kinds_text, ms_text, op_layer,
                        plan_axes)


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
    lines = [f"{path}: {plan.arg_roles[i]} {tuple(shape)} {plan.arg_dtypes[i]}, {bytes_text(nbytes)}",
             f"  layout        {layout}: {describe(layout, shape, axes)}; "
             f"{bytes_text(nbytes // layout.shard_factor(axes))} per device"]
    collectives = all_collectives(plan)
    own = [c for c in collectives if c.where == path]
    lines.append("  at it         " + (kinds_text(own) + " (its new value, made in another layout, brought back "
                                       "into this one for the next step)" if own else "no collectives"))
    inputs: SearchInputs | None = plan.search_inputs
    if inputs is not None:
        lines += _reads(plan, inputs, i)
    layers = arg_layers(plan)
    layer = layers[path]
    near = [c for c in collectives if c.where != path and op_layer(c.where, layers) == layer]
    lines.append(f"  its layer     {layer}: {kinds_text(near) if near else 'no collectives'}")
    c = plan.cost
    parts = "" if plan.stages else f" (compute {ms_text(c.compute_s)}, communication {ms_text(c.comm_s)})"
    lines.append(f"  plan          step {ms_text(c.total_s)}{parts}, {c.memory_bytes / 2**20:.2f} MiB/device")
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
        how = ", ".join(f"{c.kind} over {'+'.join(c.axes)} {bytes_text(c.bytes)} {c.alone(topo) * 1e6:.1f} µs"
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
    return (f"    {str(a.layout):<16} alternative step {ms_text(c.total_s)}: {ms_text(a.delta_s, sign=True)} "
            f"({a.delta_s / base.total_s:+.1%}); compute {ms_text(c.compute_s - base.compute_s, sign=True)}, "
            f"communication {ms_text(c.comm_s - base.comm_s, sign=True)}, memory "
            f"{(c.memory_bytes - base.memory_bytes) / 2**20:+.2f} MiB/device{cheaper}")
