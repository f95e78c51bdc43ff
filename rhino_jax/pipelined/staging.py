"""Where a pipelined step's ops run: the forward ops divided into stages by the stager (Rhino
§5.2), the backward ops after them, the places of an interlaced or multi-forward chain; the
schedule the stages run; a saved plan's placement checked against the step."""
from __future__ import annotations

from jax.sharding import Mesh

from rhino_jax.core.diagnostics import Staging
from rhino_jax.core.plan import Execution, Plan, place_name
from rhino_jax.core.plan_target import PlanTargetError
from rhino_jax.hlo_passes import stages as stage_programs
from rhino_jax.hlo_passes.graph import Graph
from rhino_jax.runtime import schedules
from rhino_jax.search import progress
from rhino_jax.search.staging import multi_forward, stager
from rhino_jax.search.space.constraints import SHARED, OpAssign, fixed_stages, shared_backward
from rhino_jax.search.solvers.levels import Budget

from ..constraints import OpOrder
from ..errors import ConstraintError, MeshError, StagingError
from ..options import Options, seconds_left, within

EPSILON = 0.25  # the stages' compute may differ from a balanced share by this much
STAGER_SHARE = 0.05  # the stager's weight in the time limit, per op of the step (its programs': 1)


def place_ops(cg: Graph, p: int, options: Options, budget: Budget
              ) -> tuple[dict[int, tuple[str, int]], Execution, Staging]:
    """Where each op of compute-gradients runs, ("F" | "B", place), the places of the chain (the
    `Execution`'s places and passes) and the stager's figures (its moves not yet priced): the
    forward ops divided into p stages (balanced FLOPs, least bytes cut, the user's `op_assign`s
    kept), a multi-forward step's passes over them, an interlaced pipeline's places on every
    device between them; each backward op after its forward ones (`hlo_passes.stages.assign`)."""
    ops = len(cg.nodes)
    loss = _loss_sum(cg)
    forward = stager.forward_ops(cg, loss)
    found = multi_forward.find(cg, forward)
    assigned = {i: at for i, at in fixed_stages(options.constraints, cg, forward, p).items()
                if i not in found.earlier}  # an earlier pass goes where its last pass goes
    if found.count > 1 and SHARED in assigned.values():
        raise ConstraintError(f"op_assign(stage='all') in a step of {found.count} forward passes "
                              f"({', '.join(found.layers)} repeat) is not built yet: drop the constraint")
    coarse, node_of = stager.forward_stage_graph(cg, loss, assigned, found.earlier, found.repeats)
    on_all = frozenset(node_of[i] for i, at in assigned.items() if at == SHARED)
    staging, epsilon = _staging(coarse, p, {node_of[i]: at for i, at in assigned.items() if at != SHARED},
                                on_all, within(options, budget, STAGER_SHARE * ops, "the stages"))
    stage_at = {i: staging.stage[node_of[i]] for i in node_of}
    if found.count > 1:  # place r·p + s: pass r on stage s
        forward_place, shared = found.places(cg, forward, stage_at, p), ()
    else:
        forward_place, shared = _places(stage_at, bool(on_all))
    place = stage_programs.assign(cg, loss, forward_place, frozenset(shared),
                                  frozenset(shared_backward(options.constraints, cg, forward)),
                                  first_backward=(found.count - 1) * p)
    _check_every_stage_works(place, p, shared, [c for c in options.constraints if isinstance(c, OpAssign)],
                             found.count)
    figures = Staging(staging.cut_bytes, epsilon if epsilon > EPSILON else None)
    chain = Execution(shared_places=tuple(shared), passes=found.count,
                      repeated_layers=tuple(found.layers) if found.count > 1 else ())
    return place, chain, figures


def _schedule(options: Options, p: int, k: int, given: Plan | None, passes: int) -> schedules.Schedule:
    """The schedule the stages run: a saved op_order or interlaced plan's own rows, else the one
    the user's `rj.op_order` rules call for, else the `schedule` option's (a saved plan's name,
    as `api._runs_as_planned` checked); a multi-forward step's, of `passes` passes."""
    if given is not None and given.execution.schedule_rows:
        return given.schedule()
    rules = [c for c in options.constraints if isinstance(c, OpOrder)]
    if not rules:
        return schedules.make(options.schedule, p, k, passes)
    pairs = []
    for c in rules:
        try:
            pairs += list(c.rule(p, k))
        except TypeError as e:
            raise ConstraintError(f"{c}: rule(stages, micro_batches) must return or yield pairs (a, b) of rj.Task; "
                                  f"calling it with ({p}, {k}) raised TypeError: {e}") from e
    return schedules.ordered(p, k, pairs, passes=passes)


def _check_every_stage_works(place: dict[int, tuple[str, int]], p: int, shared: tuple[int, ...],
                             assigned: list, passes: int = 1) -> None:
    """Each stage (and each place of every device) runs a forward and a backward program (a
    multi-forward step's earlier passes a forward only). A stage whose forward ops have their
    gradients taken elsewhere (an embedding lookup alone: its gradient is a scatter into the
    table, placed with the cotangent it reads, on the next stage) has no backward; only an
    `op_assign` leaves a stage that little, so it is the user's to change."""
    working = set(place.values())
    places = p * passes + len(shared)
    idle = [f"{'backward' if kind == 'B' else 'forward'} of {place_name(s, shared, passes, places)}"
            for s in range(places) for kind in ("FB" if s >= (passes - 1) * p else "F") if (kind, s) not in working]
    if idle:
        raise StagingError(f"this division into {p} stages leaves no ops in the {', '.join(idle)}"
                           + (f": {' and '.join(map(str, assigned))} leave{'s' if len(assigned) == 1 else ''} that "
                              "stage too little of the step; assign it more (e.g. a whole layer; for stage='all', a "
                              "glob such as '*Embed*' names a module's forward ops and their backward ops alike)"
                              if assigned else "; use fewer stages"))


def _places(slot: dict[int, int], interlaced: bool) -> tuple[dict[int, int], tuple[int, ...]]:
    """The stager's slots (`stager.stage`) as places of the chain: with an interlaced pipeline,
    the slots used, in order (stage k's slot 2k + 1, the even ones on every device); the places
    that run on every device."""
    if not interlaced:
        return slot, ()
    used = sorted(set(slot.values()))
    index = {at: j for j, at in enumerate(used)}
    return {i: index[at] for i, at in slot.items()}, tuple(index[at] for at in used if at % 2 == 0)


def _staging(coarse: stager.StageGraph, p: int, fixed: dict[int, int], shared: frozenset[int], options: Options):
    """The stager's division (and the balance it kept): within `EPSILON` of a balanced share; with
    the user's `op_assign`s (`fixed`: stage-graph node → stage; `shared`: nodes on every device),
    as much more imbalance as they need, up to none kept but that no stage is empty."""
    def division(epsilon: float):
        return stager.stage(coarse, p, epsilon, backend=options.solver, time_limit_s=seconds_left(options),
                            advice=f"use fewer stages than pipeline={p}, or pipeline='auto'", fixed=fixed,
                            shared=shared), epsilon

    tolerances = [EPSILON] + (sorted({e for e in (0.5, 1.0, p - 1.0) if e > EPSILON}) if fixed or shared else [])
    for epsilon in tolerances[:-1]:
        try:
            return division(epsilon)
        except StagingError:
            progress.say("rhino_jax: the op_assign constraints leave no division within %g of a balanced share; "
                         "relaxing the balance", epsilon)
    return division(tolerances[-1])


def sub_meshes(mesh: Mesh, p: int) -> list[Mesh]:
    """The mesh cut into p meshes along its first axis."""
    n = mesh.devices.shape[0]
    if p < 2 or n % p:
        raise MeshError(f"pipeline={p} stages need the mesh's first axis ({mesh.axis_names[0]}={n}) to split into "
                        f"{p} equal parts; use {_stage_counts(mesh, p)}")
    size = n // p
    return [Mesh(mesh.devices[i * size:(i + 1) * size], mesh.axis_names, axis_types=mesh.axis_types) for i in range(p)]


def _stage_counts(mesh: Mesh, p: int) -> str:
    """What to pass instead of p stages: the counts the mesh's first axis splits into, and a mesh
    of p rows only when the devices make one (3 stages cannot run on 8 devices)."""
    n = mesh.devices.shape[0]
    fits = [q for q in range(2, n + 1) if n % q == 0]
    listed = ", ".join(map(str, fits[:-1])) + " or " if len(fits) > 1 else ""
    counts = f"pipeline={listed}{fits[-1]}" if fits else "pipeline='off'"
    rows = f", or a mesh like rj.device_mesh(({p}, ...), ...)" if p >= 2 and mesh.devices.size % p == 0 else ""
    return counts + rows


def _saved_placement(plan: Plan, cg, p: int) -> tuple[dict[int, tuple[str, int]], Execution, Staging]:
    """A saved plan's stage of each op of compute-gradients, the places of its chain and the
    stager's figures, once they are shown to fit this step's compute-gradients and p stages (and
    the places of every device between them)."""
    place, e = plan.placement, plan.execution
    wrong = [(n, at) for n, at in place.items()
             if at[0] not in ("F", "B") or not 0 <= at[1] < p * e.passes + len(e.shared_places)]
    figures = plan.search_stats.staging
    if set(place) != {n.id for n in cg.nodes} or wrong or figures is None:
        raise PlanTargetError(f"the plan places {len(place)} ops in {p} stages (e.g. {wrong[:1] or 'none misplaced'}), "
                              f"compute-gradients cut from this step has {len(cg.nodes)} ops: it was saved by another "
                              "version of rhino_jax or edited; plan again")
    chain = Execution(shared_places=e.shared_places, passes=e.passes, repeated_layers=e.repeated_layers)
    return place, chain, figures


def _loss_sum(cg) -> int:
    """The sum the loss is made of: of compute-gradients' scalar sums, the one the most ops lead to
    (the loss depends on the whole forward pass; a counter or a metric on less)."""
    scalars = [v for v in cg.outputs if cg.values[v].shape == ()]
    if not scalars:
        raise MeshError("pipelining needs a scalar loss among the step's outputs")
    return max(scalars, key=lambda v: len(stage_programs.ancestors(cg, v)))
