"""Search: Graph IR + mesh + cluster → Plan (the spine's O2/O3: cones, then one ILP).

Units are entry arguments, ops and returned values (`units`). Units that read a single live
tensor join the cone of their reader (`cones`), whose root decides them by DP; the ILP then picks
one strategy per cone, with every read between cones an exact edge (`assembly`: a value that
several cones read, they read through its hub, so it is moved once per layout). Values that
depend on no argument (constants, iotas and their broadcasts) are left to XLA, which builds them
locally (those a scan hoists out of its loop are first sunk back into its body,
`hlo_passes.sinking`: carried, they would be buffers of the loop's). Under a memory limit,
`memory_limit`; the chosen strategies become a plan in `plan_making`.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
import warnings
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from rhino_jax.errors import ConstraintError, MemoryLimitError, SolverError, SolverTimeLimitWarning
from rhino_jax.core.diagnostics import IlpStage, SearchDiagnostics
from rhino_jax.core.plan import Plan

from ..hlo_passes.graph import Graph
from . import interrupt, progress
from .gc_pause import few_full_collections
from .assembly import add_hubs, ilp_problem
from .coarsening import coarse_axes
from .coarsening.cones import build_cones, replicated_choice, signature
from .coarsening.critical import backbone, with_parts
from .coarsening.repeats import group_segments, tie_repeats
from .cost.cluster import Cluster, MeshTopology
from .memory_limit import by_size, fit_memory, held_bytes, least_arguments, raise_memory_error
from .plan_making import make_plan
from .pricing import Prices
from .repin import KEPT_VARS, Repin
from .solvers import ilp, levels, windows
from .space.constraints import Named, apply_constraints
from .space.units import Unit, apply_pins, build_units
from .ties import SAME_STEP, seen, with_preferences


OVERLAP_ROUNDS = 3  # searches at most, with Cluster.overlap, to price what compute can hide
# The coarse search's share of the time on three axes (`_coarse_plan`): its memory-limit trials are
# most of the work; the fine search starts near a plan that fits, each op with a tenth of its strategies.
COARSE_SHARE = 0.6
START_SHARE = 0.3  # the coarse search's share where its plan is only the windows' start (`_starts`)
T = TypeVar("T")


def search(graph: Graph, topo: MeshTopology, cluster: Cluster, *, time_limit_s: float = 60.0, **options) -> Plan:
    """The plan of `_search`. With compute/communication overlap (`Cluster.overlap`), the ILP
    prices collectives off the compute chain at the share overlap leaves exposed, which holds
    only where there is compute to hide them behind: the plan's step is replayed as XLA's
    scheduler runs it (`overlap.replay`), and when it hides less than the ILP assumed, the search
    runs again with the share the plan hid (once it hides what it assumed, or in the last of
    `OVERLAP_ROUNDS`, with none: that plan is always among those replayed), and the best plan
    at its replayed cost wins; those of other layouts ride with it (`Plan.alternatives`), for a
    caller that can compile them to choose by their programs, which the replay only estimates.
    `time_limit_s` covers it all (`levels.Deadline`). A round with no plan within
    `memory_limit_bytes`: the first goes on with no overlap (its error stands if that finds none
    either); a later one ends the rounds at the plans so far.
    Ctrl-C: before the first plan, KeyboardInterrupt; after it, the best plan so far,
    `interrupted` (`interrupt`)."""
    deadline = levels.Deadline.after(time_limit_s)
    options = dict(options, built={})  # what every round builds alike: the units, the graph's backbone

    def at(overlap: float) -> Plan:
        return _found(_search(graph, dataclasses.replace(topo, overlap=overlap), cluster, deadline=deadline,
                              **options))

    with interrupt.session(), few_full_collections():
        overlap = topo.overlap
        try:
            plan = at(overlap)
        except MemoryLimitError:
            if not overlap or deadline.left() <= 0:
                raise
            # Priced as if hidden, gathering a whole weight looks free, and pricing the bytes a
            # device holds on average does not see the peak it makes: the search that hides
            # nothing (the rounds' last) may find a plan within the limit; else its error stands.
            progress.say("rhino_jax: overlap: no plan within memory_limit_bytes with overlap %.3g; searching again "
                         "with none", overlap)
            plan, overlap = at(0.0), 0.0
        tried = [plan]
        try:
            # a plan with nothing off the chain is priced alike at any share: the rounds end
            while overlap and plan.cost.off_chain_comm_s and not interrupt.pressed() and deadline.left() > 0:
                usable = min(topo.overlap, plan.cost.off_chain_hidden_s / plan.cost.off_chain_comm_s)
                # it hid what it was priced to hide, or the rounds are spent: last, the plan of a
                # search that hides nothing, replayed too (where the replay finds little to hide
                # behind, it can be the faster)
                overlap = usable if usable < overlap * 0.99 and len(tried) < OVERLAP_ROUNDS - 1 else 0.0
                progress.say("rhino_jax: overlap: the plan hides %.3g s of %.3g s of communication off the chain; "
                             "searching again with overlap %.3g", plan.cost.off_chain_hidden_s,
                             plan.cost.off_chain_comm_s, overlap)
                plan = at(overlap)
                tried.append(plan)
        except KeyboardInterrupt:  # before the next round's plan: the plans so far
            interrupt.press()
            interrupt.warn("the search for how much communication compute hides")
        except MemoryLimitError:  # a later round's prices found none within the limit: the plans so far
            progress.say("rhino_jax: overlap: no plan within memory_limit_bytes with overlap %.3g; keeping the "
                         "earlier rounds' plans", overlap)
        best = _least(tried)
        if len(tried) > 1:
            _found(best, "kept")
        return dataclasses.replace(best, alternatives=_other_layouts(best, tried),
                                   interrupted=best.interrupted or interrupt.pressed())


def _found(plan: Plan, what: str = "found") -> Plan:
    """Say a plan's predicted time as its report will (the progress line's best so far, where
    this search is of the whole step)."""
    progress.say("rhino_jax: plan %s: predicted %.4g ms", what, plan.cost.total_s * 1e3, best_s=plan.cost.total_s)
    return plan


def _least(plans: list[Plan]) -> Plan:
    """The plan of least predicted step; of plans that tie (to a millionth), the one that moves
    the least (what a tie leaves to chance, the link's time, is best not spent)."""
    fastest = min(p.cost.total_s for p in plans)
    return min((p for p in plans if p.cost.total_s <= fastest * (1 + SAME_STEP)), key=lambda p: p.cost.comm_s)


def _other_layouts(best: Plan, tried: list[Plan]) -> tuple[Plan, ...]:
    """The plans of `tried` that lay some value out otherwise than `best` and than each other,
    best predicted first, without their kept ILPs: what the replay could not tell apart from
    `best` for sure, for the caller to compile and price (`Plan.alternatives`). A plan priced
    exactly as one kept is left out (`_priced_alike`): compiling it would price one program twice."""
    kept = [best]
    for plan in sorted(tried, key=lambda p: p.cost.total_s):
        if not any(_same_layouts(plan, k) or _priced_alike(plan, k) for k in kept):
            kept.append(plan)
    return tuple(dataclasses.replace(p, repin=None) for p in kept[1:])


def _same_layouts(a: Plan, b: Plan) -> bool:
    return (a.arg_specs, a.output_specs, a.value_specs, a.read_specs) == \
        (b.arg_specs, b.output_specs, b.value_specs, b.read_specs)


def _priced_alike(a: Plan, b: Plan) -> bool:
    """The same predicted step (`SAME_STEP`), compute and memory, and the same collectives, each
    of the same bytes for the same op: two overlap rounds' plans that differ only in the layout of
    ops nothing prices (a broadcast scalar made whole or split where it is read split). Where seen,
    XLA's partitioner made one program of both (a Flax LM clipped by its global norm on 8 described
    H100s: two compiles of 12 s, the same memory and step to the nanosecond)."""
    return (math.isclose(a.cost.total_s, b.cost.total_s, rel_tol=SAME_STEP)
            and math.isclose(a.cost.compute_s, b.cost.compute_s, rel_tol=SAME_STEP)
            and a.cost.memory_bytes == b.cost.memory_bytes
            and collections.Counter(a.collectives) == collections.Counter(b.collectives))


def _search(graph: Graph, topo: MeshTopology, cluster: Cluster, *, deadline: levels.Deadline, opt_level: str = "O2",
            backend: str = "HIGHS", memory_limit_bytes: int | None = None, strided: bool = True,
            constraints: tuple[Named, ...] = (), with_choice: bool = False, built: dict | None = None):
    """O3: cones, then one ILP over the whole graph, started from O2's plan. O2: the same ILP
    with the cones of repeated segments tied together (`repeats`), solved whole when small,
    else by windows (`levels`); on three or more mesh axes, first on a mesh of one axis fewer
    (`coarse_axes`). Under a memory limit, the largest parameters and optimizer states may not
    stay replicated (`fit_memory`). `strided`: offer non-maximum strides where reshapes call for
    them. Every solve stops at the `deadline`, which also counts the build. `constraints`: the
    user's on what strategies the ops they name may take (`constraints`). `with_choice`: the
    plan and each unit's chosen strategy (the coarse pass's answer). `built`: what
    earlier searches of this step built that this one builds alike (`_once`)."""
    t0 = time.perf_counter()
    building = functools.partial(deadline.check, "it built the ILP")
    units, producer_unit, fallback, ties, constrained = _space(graph, topo, cluster, strided, constraints, built,
                                                               building)
    coarse_options = dict(backend=backend, memory_limit_bytes=memory_limit_bytes, strided=strided,
                          constraints=constraints, built=built)
    coarse = None
    if opt_level == "O2" and len(topo.axis_names) >= 3:
        coarse = _coarse_plan(graph, topo, cluster, COARSE_SHARE, deadline, coarse_options)
        if coarse is not None:
            _keep_near(units, *coarse, topo.axis_names)
    sizes = topo.sizes

    prices = Prices(graph, topo, [u.results for u in units],
                    _once({} if built is None else built, ("prices", topo.without_overlap(), graph.pins),
                          dict))

    def unit_key(m: int) -> tuple:  # units that share a strategy list have the same strategies
        return id(units[m].strategies), *prices.unit_key(m)
    groups = build_cones(units, producer_unit, prices.own, prices.reshard,
                         lambda v, starts, reads: prices.reads(v, starts, reads, uses=False)[0],
                         lambda spec, v: graph.values[v].nbytes // spec.shard_factor(sizes), building,
                         unit_key, prices.value_key)
    group_of = {m: gi for gi, g in enumerate(groups) for m in g.members}
    hub_of = add_hubs(graph, units, groups, group_of, producer_unit, prices,
                      lambda ms: signature(ms, units, producer_unit, {}, unit_key, prices.value_key))
    priced = ilp_problem(units, groups, group_of, producer_unit, prices, hub_of, building)
    problem = with_preferences(priced, [seen(units, g.members, g.choice, graph, sizes) for g in groups])
    bb = _once({} if built is None else built, "backbone", lambda: with_parts(backbone(graph), graph))  # the graph's
    segments = group_segments(units, groups, group_of, bb, producer_unit)
    loops = [(group_of[a], group_of[b]) for a, b in ties]
    repeats, tied_segments = tie_repeats(units, groups, segments, graph, producer_unit)
    building()
    similar_segments: int | None = None

    def similar() -> levels.Tying:  # only when the exact tying is too large to solve whole
        nonlocal similar_segments
        alike, similar_segments = tie_repeats(units, groups, segments, graph, producer_unit, exact=False)
        return levels.tying(problem, _merge_classes(alike, loops), segments)

    # untied, a loop's entry and exit still one class: O3's ILP, and what explain solves again (`repin`)
    untied = functools.cache(lambda: levels.tying(problem, _merge_classes(list(range(len(groups))), loops), segments))
    variables = windows.size(problem)
    solvers = levels.Levels(
        similar,
        levels.tying(problem, _merge_classes(repeats, loops), segments),
        untied, variables if tied_segments else 0, opt_level == "O3", backend,
        starts=lambda windowed: _starts(windowed, coarse, graph, topo, cluster, units, groups, deadline,
                                        coarse_options),
        price=lambda choice: ilp.evaluate(priced, choice))  # the step, less the ranks of tied strategies (`ties`)
    build_s = time.perf_counter() - t0
    progress.say("rhino_jax: %d ops → %d cones (%d critical nodes, %d segments, %d tied) in %.2f s",
                 len(graph.nodes), len(groups), len(bb.critical), bb.num_segments, tied_segments, build_s)

    held = functools.cache(lambda: held_bytes(graph, units, groups, sizes))

    def stats_of(solution: ilp.Solution, stages: tuple[IlpStage, ...], solved_windows: int, ilp_groups: int,
                 forced: list[int], weight_s: float) -> SearchDiagnostics:
        return SearchDiagnostics(
            ops=len(graph.nodes), critical_nodes=len(bb.critical), segments=bb.num_segments,
            tied_segments=tied_segments, similar_segments=similar_segments, groups=len(groups), hubs=len(hub_of),
            constraints=constrained, ilp_groups=ilp_groups, ilp_vars=solution.num_vars,
            ilp_constraints=solution.num_constraints, solver=solution.backend, status=solution.status,
            gap=solution.gap, objective_s=solution.objective_s, windows=solved_windows, build_s=build_s,
            solve_s=sum(st.solve_s for st in stages), ilp_stages=stages,
            not_replicated=tuple(units[groups[g].root].name for g in forced), memory_weight_s=weight_s)

    def kept_ilp(choice: list[int], forbidden: list[np.ndarray], forced: list[int], weight_s: float) -> Repin:
        """The plan's ILP, kept to be solved again with one argument pinned (`repin`)."""
        def make(chosen: list[int], solution: ilp.Solution) -> Plan:
            if not weight_s:  # the step without the tie ranks (else the objective prices memory too)
                solution = dataclasses.replace(solution, objective_s=ilp.evaluate(priced, chosen))
            stages = (IlpStage("one argument pinned, from the plan", len(groups), solution.status,
                               solution.objective_s, solution.solve_s),)
            return make_plan(graph, topo, cluster, units, groups, chosen, fallback, opt_level,
                             stats_of(solution, stages, 0, len(groups), forced, weight_s), prices)
        weighed = functools.cache(lambda: untied().weighed(weight_s, held())) if weight_s else untied
        return Repin(weighed, tuple(forbidden), tuple(choice), units, groups, group_of, producer_unit, sizes, backend,
                     make)

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
        choice, solution, stages, solved_windows = solvers.solve(deadline, forbidden, weight_s,
                                                                 held() if weight_s else None)
        progress.say("rhino_jax: ILP %s in %.2f s%s: the ILP's estimate of the step %.4g ms", solution.status,
                     solution.solve_s, " (its LP relaxation was integral)" if solution.relaxation_exact else "",
                     solution.objective_s * 1e3)
        st = stats_of(solution, stages, solved_windows, len(solvers.stages[-1][0].problem.costs), forced, weight_s)
        try:
            plan = make_plan(graph, topo, cluster, units, groups, choice, fallback, opt_level, st, prices)
        except KeyboardInterrupt:  # while the plan is assembled: assembled again, as the plan so far
            interrupt.press()
            st = dataclasses.replace(st, status="interrupted")
            plan = make_plan(graph, topo, cluster, units, groups, choice, fallback, opt_level, st, prices)
        if variables <= KEPT_VARS:  # explain's alternatives solve it again
            plan = dataclasses.replace(plan, repin=kept_ilp(choice, forbidden, forced, weight_s))
        gap = "no bound (solved by windows)" if np.isnan(solution.gap) else f"a gap of {solution.gap:.1%}"
        if st.status == "interrupted" and not answered:
            interrupt.warn(f"strategy search ({solution.solve_s:.1f} s of solving, {gap})", stacklevel=4)
        if st.status == "feasible":
            warnings.warn(f"strategy solver stopped at its {deadline.seconds:g} s time limit with {gap}; the plan is "
                          "feasible but may not be optimal (raise solver_time_limit_s for a better one)",
                          SolverTimeLimitWarning, stacklevel=4)
        plan = dataclasses.replace(plan, interrupted=st.status == "interrupted" or interrupt.pressed())
        if with_choice:
            made.append((plan, [groups[group_of[m]].choice[choice[group_of[m]]][m] for m in range(not_hubs)]))
        return plan

    not_hubs, made = len(units) - len(hub_of), []  # the units before the hubs
    plan = plan_with([])
    if memory_limit_bytes is not None and plan.cost.memory_bytes > memory_limit_bytes:
        if plan.search_stats.status == "interrupted":
            raise KeyboardInterrupt("the search was interrupted before it found a plan within memory_limit_bytes")
        least = least_arguments(graph, units, producer_unit, sizes)
        if least > memory_limit_bytes:  # no plan can fit: say so now rather than after every solve
            raise_memory_error([plan], memory_limit_bytes, graph, least)
        candidates = by_size(graph, units, groups, sizes)
        fitted = ("fitted", memory_limit_bytes, topo.axis_names, topo.axis_sizes)  # by an earlier overlap round
        plan = fit_memory(plan_with, candidates, [units[groups[g].root].ref for g in candidates],
                          plan, memory_limit_bytes, graph, least, deadline, (built or {}).get(fitted))
        if built is not None:
            built[fitted] = plan
    return (plan, next(ch for p, ch in made if p is plan)) if with_choice else plan


def _units(built: dict, graph: Graph, topo: MeshTopology, cluster: Cluster, strided: bool,
           check: Callable[[], None]) -> tuple[list[Unit], dict[int, int], list[str], list[tuple[int, int]]]:
    """`build_units`' answer, built once per mesh and pins in `built` (of one step's graph): the
    overlap rounds search the same units again, priced otherwise (a strategy's collectives do not
    depend on how much of them compute hides, only their prices do). Each search gets its own
    copy of every unit, whose strategies it may restrict (pins, constraints, the coarse plan's
    neighbourhood) and to which it adds hubs; the strategy lists stay shared."""
    units, producer_unit, fallback, ties = _once(built, (topo.without_overlap(), graph.pins, strided),
                                                 lambda: build_units(graph, topo, cluster, strided, check))
    return [Unit(**vars(u)) for u in units], dict(producer_unit), list(fallback), list(ties)  # shallow copies


def _once(built: dict, key, make: Callable[[], T]) -> T:
    """`built[key]`, made by `make` the first time."""
    if key not in built:
        built[key] = make()
    return built[key]


def _space(graph: Graph, topo: MeshTopology, cluster: Cluster, strided: bool, constraints: tuple[Named, ...],
           built: dict | None, check: Callable[[], None]
           ) -> tuple[list[Unit], dict[int, int], list[str], list[tuple[int, int]], dict]:
    """The units (`_units`) left the strategies the user's pins and constraints allow, and how
    many units each constraint restricted."""
    units, producer_unit, fallback, ties = _units({} if built is None else built, graph, topo, cluster, strided, check)
    apply_pins(graph, units, producer_unit, topo)
    return units, producer_unit, fallback, ties, apply_constraints(constraints, graph, units, topo)


def _never_fits(graph: Graph, topo: MeshTopology, cluster: Cluster, deadline: levels.Deadline, options: dict) -> bool:
    """Whether the arguments alone, each split as finely as its strategies allow, hold more than
    the memory limit on this mesh (`least_arguments`: a lower bound on every plan's memory). A
    search there ends in a `MemoryLimitError` after building its ILP and solving it once."""
    limit = options["memory_limit_bytes"]
    if limit is None:
        return False

    def least() -> int:
        units, producer_unit, *_ = _space(graph, topo, cluster, options["strided"], options["constraints"],
                                          options["built"], functools.partial(deadline.check, "it built the ILP"))
        return least_arguments(graph, units, producer_unit, topo.sizes)
    # the same at every overlap share: found once per search
    key = ("least arguments", topo.without_overlap(), graph.pins, options["strided"],
           options["constraints"])
    return _once({} if options["built"] is None else options["built"], key, least) > limit


def _starts(windowed: bool, coarse: "tuple[list, coarse_axes.Merge | coarse_axes.Drop] | None", graph: Graph,
            topo: MeshTopology, cluster: Cluster, units: list[Unit], groups: list, deadline: levels.Deadline,
            options: dict) -> list[list[int | None]]:
    """The plans the first solve must beat (`levels.Levels._start`): the one-device step run on
    every device, and where windows solve it, the coarse plan too (searched now on two axes;
    on three, the one the strategies were restricted near). Windows from the replicated plan
    stop at local optima: no single window can move to data parallelism, which needs every
    layer at once; a coarse plan can already be there."""
    starts = [replicated_choice(groups)]
    if windowed and len(topo.axis_names) >= 2:
        if coarse is None and len(topo.axis_names) == 2:  # on three axes it was searched already
            try:
                coarse = _coarse_plan(graph, topo, cluster, START_SHARE, deadline, options)
            except SolverError:  # its share ran out in its build: the windows start from the replicated plan
                coarse = None
        if coarse is not None:
            starts.append(_coarse_start(units, groups, *coarse, topo.axis_names))
    return starts


def _coarse_plan(graph: Graph, topo: MeshTopology, cluster: Cluster, share: float, deadline: levels.Deadline,
                 options: dict) -> "tuple[list, coarse_axes.Merge | coarse_axes.Drop] | None":
    """Each unit's strategy in the plan of the mesh one axis smaller (`coarse_axes.coarser`: two
    axes merged, or on hosts x GPUs the slower axis dropped), searched with `share` of the time
    left, and how the mesh was made smaller; None where no plan of the coarser mesh fits the
    memory limit or obeys the constraints (then the whole space is searched). Where that search
    runs out of time, so would the whole space's (`SolverError`)."""
    coarse, how = coarse_axes.coarser(topo)
    progress.say("rhino_jax: %d mesh axes: searching first on [%s]", len(topo.axis_names), ", ".join(coarse.axis_names))
    part = levels.Deadline(deadline.seconds, time.perf_counter() + share * deadline.left())
    graph = dataclasses.replace(graph, pins=how.pins(graph.pins))
    try:
        if _never_fits(graph, coarse, cluster, part, options):  # as its search would find, without the search
            raise MemoryLimitError(f"the arguments alone exceed memory_limit_bytes on [{', '.join(coarse.axis_names)}]")
        with warnings.catch_warnings():  # its time running out is the fine search's to say
            warnings.simplefilter("ignore", SolverTimeLimitWarning)
            with progress.part():
                _, chosen = _search(graph, coarse, cluster, deadline=part, opt_level="O2", with_choice=True, **options)
    except MemoryLimitError:
        progress.say("rhino_jax: no plan on [%s] fits the memory limit; searching the whole space",
                     ", ".join(coarse.axis_names))
        return None
    except ConstraintError:  # `parts` that the coarse mesh's axis sizes do not meet
        progress.say("rhino_jax: the constraints leave an op no strategy on [%s]; searching the whole space",
                     ", ".join(coarse.axis_names))
        return None
    return chosen, how


def _keep_near(units: list[Unit], chosen: list, how: "coarse_axes.Merge | coarse_axes.Drop",
               axes: tuple[str, ...]) -> None:
    """Restrict each unit to the strategies near its coarse plan's (`coarse_axes.near`)."""
    assert len(chosen) == len(units), "the coarse search built other units"
    kept: dict[tuple, tuple[list, list]] = {}  # the layers' identical ops share one strategy list
    for u, s in zip(units, chosen):
        key = (id(u.strategies), s)
        if key not in kept:
            kept[key] = (u.strategies, coarse_axes.near(u.strategies, how.anchor(s, axes), axes))
        u.strategies = kept[key][1]


def _coarse_start(units: list[Unit], groups: list, chosen: list, how: "coarse_axes.Merge | coarse_axes.Drop",
                  axes: tuple[str, ...]) -> list[int | None]:
    """The coarse plan on the real mesh: each cone's choice whose root places every axis where
    the coarse plan does (`anchor`; None where no choice does)."""
    assert len(chosen) == sum(u.kind != "hub" for u in units), "the coarse search built other units"

    def at(g) -> int | None:
        if units[g.root].kind == "hub":  # a hub is added after the units, in each search its own
            return None
        want = how.anchor(chosen[g.root], axes)
        return next((j for j, ch in enumerate(g.choice) if coarse_axes.placements(ch[g.root], axes) == want), None)
    return [at(g) for g in groups]


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
