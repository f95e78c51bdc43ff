"""`pipeline=p`: compute-gradients cut into p stages on p sub-meshes, run micro-batch by micro-batch
in a static schedule (Rhino §5-6), then apply-gradients on the stages, each optimizer op beside
the parameters it updates.

The step is split at its sums as for micro-batching (`micro_batched.split_step`); the stager places
the forward ops of compute-gradients (balanced FLOPs, least bytes cut), the backward ops follow
(`hlo_passes.stages`), and each stage's forward and backward program is planned by the SPMD search
on its sub-mesh (the mesh cut along its first axis). apply-gradients' ops go where the bytes they
read are (`stages.assign_apply`): a layer's update on the stage of its parameters and gradient sums,
a global norm's total on one stage. Its programs, one per stage and wave (the stage changes before
them), are planned on their sub-meshes with their arguments pinned to the layouts the stage's
forward and backward programs hold them in, and a result the training loop feeds back tied to its
argument. So parameters and optimizer state live on their stage: the step takes and returns them
there (`plan.input_shardings`), and per step only the batch and what crosses stages moves. Each
tensor one stage hands another moves by cross-mesh resharding (`runtime.resharding`, after "On
Optimizing the Communication of Model Parallelism"), planned once and priced: a micro-batch's
transfers across the busiest boundary are the schedule's transfer time; the arguments a program
reads from elsewhere, and the sums and values apply-gradients' programs take from other stages, once
per step. A stage's memory counts the micro-batches it holds in flight, its running sums and its
optimizer state; over `memory_limit_bytes`, its programs are planned again under what is left. The
executor walks the task graph (`runtime.task_graph`) and dispatches each program with its inputs put
on its sub-mesh (jax's asynchronous dispatch overlaps the stages); between processes, moves are SPMD
programs (`runtime.transfer`). The sums of each micro-batch are added on the stage that makes them.
Not yet: a loop cut across stages.

Interlaced (`op_assign(where, stage="all")`, nnScaler §4.2): the stager also places ops before,
between and after the stages on every device; a micro-batch then passes through a chain of
places, the stages and those, each planned, moved between and scheduled as a stage is, the
latter on the whole mesh, their tasks interlaced with the stages' (`schedules.interlace`).

Multi-forward (nnScaler's 3F1B, `search.multi_forward`): a step that runs its layers R times per
micro-batch, the earlier passes under stop_gradient, has a chain of R·p places, pass r on stage s
being place r·p + s on stage s's sub-mesh; the places of one stage are one home for
apply-gradients and for memory, and only the last pass's places have a backward program.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from rhino_jax.hlo_passes import stages as stage_programs
from rhino_jax.runtime.compiled.compiled_cost import price_compiled
from rhino_jax.hlo_passes.graph import Graph, Pin
from rhino_jax.hlo_passes.importer import import_module
from rhino_jax.hlo_passes.lowering import program_target, step_target
from rhino_jax.hlo_passes.split import on_mesh
from rhino_jax.runtime import resharding, schedules, task_graph, transfer
from rhino_jax.search import interrupt, multi_forward, progress, stager
from rhino_jax.search.cluster import MeshTopology, get_cluster, host_ids
from rhino_jax.search.constraints import SHARED, OpAssign, fixed_stages, shared_backward
from rhino_jax.search.memory import local_bytes
from rhino_jax.core.plan import Plan, PlanCost, StagePlan, place_name, program_name
from rhino_jax.core.plan_target import PlanTargetError
from rhino_jax.core.specs import ShardingSpec

from . import alike_programs
from .constraints import OpOrder
from .errors import ConstraintError, MemoryLimitError, MeshError, SolverError, StagingError
from .gpu_topology import refuse_described
from .mesh_search import plan_on
from .arguments import Call, call_tree
from .micro_batched import (APPLY_WEIGHT, SeveralPrograms, SeveralProgramsLowered, _compile, micro_batches_of,
                            accumulated, add_up, flat_call, named, priced_line, priced_s, program_plan, say_step,
                            split_step, summed_bytes, with_index)
from .options import Options, budget_of, device_memory, seconds_left, within

# A program of the step, its graph and its plan.
Planned = tuple[stage_programs.Program, Graph, Plan]

EPSILON = 0.25  # the stages' compute may differ from a balanced share by this much
STAGER_SHARE = 0.05  # the stager's weight in the time limit, per op of the step (its programs': 1)


def _schedule(options: Options, p: int, k: int, given: Plan | None, passes: int) -> schedules.Schedule:
    """The schedule the stages run: a saved op_order or interlaced plan's own rows, else the one
    the user's `rj.op_order` rules call for, else the `schedule` option's (a saved plan's name,
    as `api._runs_as_planned` checked); a multi-forward step's, of `passes` passes."""
    if given is not None and "schedule_order" in given.search_stats:
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


class PipelinedLowered(SeveralProgramsLowered):
    """A step lowered for p stages and k micro-batches: `plan` sums it up, `stages` holds each stage."""

    @interrupt.session()  # its searches stop together at Ctrl-C, every plan marked interrupted
    def __init__(self, call: Call, mesh: Mesh, options: Options, signature, given: Plan | None = None,
                 named_on: Mesh | None = None):
        """`given`: a saved plan of this step to run instead of searching (`parallelize(plan=...)`):
        its placement of the ops and its programs' plans. `named_on`: the user's mesh (Explicit
        axes), which the whole-mesh layouts name (`mesh` is its Auto twin)."""
        p, k = options.pipeline, options.num_micro_batches
        self.stage_meshes = sub_meshes(mesh, p)
        step = split_step(call, mesh, k, options.constraints)
        target = step_target(step.whole, mesh, step.donated)
        cg, ag, whole = step.compute_graph, step.apply_graph, step.whole
        # One time limit for the stager and every program's search, shared by their ops.
        ops = len(cg.nodes)
        budget = budget_of(options, (1 + STAGER_SHARE) * ops + APPLY_WEIGHT * len(ag.nodes))
        if given is None:
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
            staged = {"stage_cut_bytes": staging.cut_bytes, "stage_flops": staging.stage_compute,
                      **({"stage_epsilon": epsilon} if epsilon > EPSILON else {}),
                      **({"shared_places": shared} if shared else {}),
                      **({"passes": found.count, "repeated_layers": found.layers} if found.count > 1 else {})}
        else:
            given.check_matches(target)
            place, staged = _saved_placement(given, cg, p)
            shared = staged.get("shared_places", ())
        self.passes = staged.get("passes", 1)
        # The places of a micro-batch's chain: the stages' sub-meshes, and the whole mesh for the
        # places that run on every device (an interlaced pipeline's); a multi-forward step's passes
        # each over the stages.
        stage_of = iter(self.stage_meshes * self.passes)
        meshes = [mesh if s in shared else next(stage_of) for s in range(p * self.passes + len(shared))]
        cluster = get_cluster(options.cluster, list(mesh.devices.flat))
        axes = [dict(zip(mesh.axis_names, sub.devices.shape)) for sub in meshes]
        topology = [MeshTopology.from_mesh(sub, cluster) for sub in meshes]
        self.mesh, self.meshes, self.k, self._signature, self.cluster = mesh, meshes, k, signature, cluster
        self.accumulate = options.accumulation_dtype
        self.memory_limit_bytes = device_memory(options, mesh.devices.flat)
        self.named_on = named_on or mesh
        self._step, self._place, self.shared = step, place, tuple(shared)
        base = self.schedule = _schedule(options, p, k, given, self.passes)

        searched: dict[tuple, Planned] = {}  # (what makes programs alike, their memory limit) → one of them

        def search(prog: stage_programs.Program, graph: Graph, opts: Options) -> Planned:
            """The program's plan: the saved plan's, an alike program's (`alike_programs`), renamed,
            or a search's."""
            name = program_name(prog.kind, prog.stage, prog.wave)
            weight = (APPLY_WEIGHT if prog.kind == "A" else 1) * len(graph.nodes)
            target = program_target(prog.module, graph, meshes[prog.stage])
            key = (alike_programs.alike_key(prog.kind, target.program, graph, axes[prog.stage], opts.constraints),
                   opts.memory_limit_bytes)
            if given is None and key in searched:  # an alike program's plan, renamed; its time to the rest
                budget.skip(weight)
                first, searched_graph, plan = searched[key]
                return prog, graph, program_plan(name, target, given, lambda: alike_programs.renamed(
                    plan, searched_graph, graph, program_name(first.kind, first.stage, first.wave)))
            searched[key] = prog, graph, program_plan(
                name, target, given,
                lambda: _own(graph, plan_on(graph, topology[prog.stage], cluster,
                                            within(opts, budget, weight, f"program {name}"), meshes[prog.stage])))
            return searched[key]

        def search_apply(i: int) -> Planned:
            """apply-gradients' program i, its arguments pinned to the stage's layouts of them, and
            its results fed back pinned to where the stage takes their arguments, when an earlier
            program (another wave) already fixed that."""
            prog, graph = cut[i]
            held = _held_layouts(self._programs, self._together(prog.stage), cg)
            pins = tuple(Pin(a.value, held[j].dims, a.path) for a, j in zip(graph.args, prog.args) if j in held)
            earlier = [self._programs[key] for key in sorted(self._programs, key=stage_programs.run_order)]
            pins += _fed_back_pins(prog, graph, earlier + self._applies[:i], ag, self._together(prog.stage))
            return search(prog, dataclasses.replace(graph, pins=graph.pins + pins), options)

        self._programs: dict[tuple[str, int], Planned] = {}
        copies = _state_copies(cg, whole.arg_roles)
        for prog in stage_programs.programs(step.parts.compute, cg, place):
            prog, graph = _on_stage(prog, axes[prog.stage], whole.arg_paths, whole.arg_roles,
                                    [f"out[{v}]" for v in prog.outputs])
            graph = _with_state_beside(graph, prog, cg, copies)
            self._programs[prog.kind, prog.stage] = search(prog, graph, options)
        home = _compute_homes(self._programs, cg)
        # the places of every device are one home for apply-gradients: the same devices
        together = {i: self._together(at)[0] for i, at in home.items()}
        programs = stage_programs.programs(step.parts.apply, ag, stage_programs.assign_apply(ag, together))
        if not programs:
            raise StagingError("the step has no ops after its gradient sums (an optimizer update) to run on the "
                               "stages; return the updated parameters, or use pipeline='off'")
        self._home = _apply_homes(home, programs, ag, whole.arg_roles)
        readers = Counter(i for prog in programs for i in prog.args)
        donated = {i for i in step.donated if readers[i] == 1}  # else a later apply program would read it gone
        cut = []
        for prog in programs:
            prog, graph = _on_stage(prog, axes[prog.stage], [a.path for a in ag.args], [a.role for a in ag.args],
                                    _fed_back_names(prog, ag))
            cut.append((prog, _with_donation(graph, prog, ag, donated)))
        self._applies: list[Planned] = []
        for i in range(len(cut)):  # in order: a later wave's results are pinned to an earlier's arguments
            self._applies.append(search_apply(i))

        if shared and given is None:
            self.schedule = self._interlaced(base)
        stages = [self._stage_plan(s) for s in range(len(meshes))]
        limit = options.memory_limit_bytes if given is None else None  # a saved plan's stages are final
        for s, st in enumerate(stages):  # what the programs do not see (other micro-batches, the sums) off their limit
            around = _held_around(stages, s, self.shared, self._passes_beside(s))
            if limit and st.memory_bytes + around > limit and st.beside_bytes + around < limit:
                tighter = dataclasses.replace(options, memory_limit_bytes=limit - st.beside_bytes - around)
                for kind in [kind for kind in "FB" if (kind, s) in self._programs]:
                    try:
                        self._programs[kind, s] = search(*self._programs[kind, s][:2], tighter)
                    except (MemoryLimitError, SolverError):  # none fits, or no time is left
                        pass  # keeps the first plan; pipeline='auto' reports the stage over the limit
                for i, (prog, _) in enumerate(cut):
                    if prog.stage == s:
                        try:
                            self._applies[i] = search_apply(i)  # pinned to the stage's new layouts
                        except (MemoryLimitError, SolverError):
                            pass  # keeps its plan: what it reads in other layouts moves, priced
                stages[s] = self._stage_plan(s)
        if shared and given is None and limit:  # the programs' times changed: interlace them again
            self.schedule = self._interlaced(base)
            stages = [self._stage_plan(s) for s in range(len(meshes))]
        self.stages = tuple(stages)
        self.transfers = _transfers(self._programs, meshes, cg, cluster)
        self.moves_s = _step_moves(self._programs, self._applies, _shardings(self._layouts()),
                                   _shardings(self._output_layouts()), step, meshes, cluster)
        self.apply_tasks = _apply_tasks(self._applies, self._home, len(cg.args))
        self._trees = (jax.tree.structure((call.args, call.kwargs)), whole.lowered.out_tree)
        self.plan = dataclasses.replace(self._summary(staged), placement=place, target=target)
        say_step(self.plan, f"pipeline of {p} stages ({self.schedule.name}, {k} micro-batches)")

    def _together(self, s: int) -> tuple[int, ...]:
        """The places that run on place s's devices: every device's places, a stage's passes, or s alone."""
        if s in self.shared:
            return self.shared
        p = len(self.stage_meshes)
        return tuple(range(s % p, len(self.meshes), p)) if self.passes > 1 else (s,)

    def _passes_beside(self, s: int) -> tuple[int, ...]:
        """A multi-forward step's places on place s's stage (none otherwise)."""
        return self._together(s) if self.passes > 1 else ()

    def _naming_mesh(self, s: int) -> Mesh:
        """The mesh place s's layouts name: the user's for a place on every device."""
        return self.named_on if self.meshes[s] is self.mesh else self.meshes[s]

    def _interlaced(self, base: schedules.Schedule) -> schedules.Schedule:
        """`base` (the stages' schedule) with the places of every device interlaced, placed with
        the programs' predicted times and the busiest boundary's transfer time (`_summary`)."""
        plans = {key: plan.cost.total_s for key, (_, _, plan) in self._programs.items()}
        transfer_s = _transfer_s(_transfers(self._programs, self.meshes, self._step.compute_graph, self.cluster))
        return schedules.interlace(base, self.shared, lambda t: plans[t.kind, t.stage], transfer_s)

    def _layouts(self) -> list[tuple[Mesh, ShardingSpec]]:
        """Where the step takes each argument: on its stage (`_home`) in the layout of the first
        of the stage's programs that reads it (forward, backward, then apply-gradients', which are
        pinned to the former), else of the result fed back into it; an argument of no stage (the
        batch) replicated on the whole mesh."""
        ag, n = self._step.apply_graph, len(self._step.compute_graph.args)
        everyone = [self._programs[key] for key in sorted(self._programs, key=stage_programs.run_order)]
        everyone += self._applies
        fed = {i: ag.outputs[k] for k, i in ag.fed_back().items()}
        out = []
        for i in range(n):
            s = self._home.get(i)
            spec = _taken_layout(everyone, self._together(s) if s is not None else (), i, fed.get(i))
            out.append((self.named_on, ShardingSpec.replicated(len(ag.values[ag.args[i].value].shape))) if spec is None
                       else (self._naming_mesh(s), spec))
        return out

    def _output_layouts(self) -> list[tuple[Mesh, ShardingSpec]]:
        """Where the step returns each output: one fed back into an argument (the state) where
        its stage's apply-gradients makes it; the others (the loss, metrics) replicated on the
        whole mesh, so every process can read them, as after `jax.jit` (`_step_moves` prices
        the move)."""
        ag = self._step.apply_graph
        fed = set(ag.fed_back())
        made = {v: (prog, plan) for prog, _, plan in self._applies for v in prog.outputs}
        return [(self._naming_mesh(made[v][0].stage), made[v][1].output_specs[made[v][0].outputs.index(v)]) if k in fed
                else (self.named_on, ShardingSpec.replicated(len(ag.values[v].shape)))
                for k, v in enumerate(ag.outputs)]

    def _stage_plan(self, s: int) -> StagePlan:
        cg, plans, sub = self._step.compute_graph, self._programs, self.meshes[s]
        mine = [plan for prog, _, plan in self._applies if prog.stage == s]
        forward_ops = [i for i, (kind, at) in self._place.items() if kind == "F" and at == s]
        return StagePlan(s, dict(zip(self.mesh.axis_names, sub.devices.shape)),
                         tuple(int(d.id) for d in sub.devices.flat), stage_programs.layers(cg, forward_ops),
                         plans["F", s][2], plans["B", s][2] if ("B", s) in plans else None,
                         self.schedule.in_flight()[s], _held_bytes(plans, s, sub),
                         _summed_bytes(plans, s, sub, set(cg.outputs), self.accumulate), self._kept_bytes(s),
                         sum(plan.cost.total_s for plan in mine),
                         max((plan.cost.memory_bytes for plan in mine), default=0), s in self.shared)

    def _kept_bytes(self, s: int) -> int:
        """Per device, the step's arguments stage s holds that its forward and backward programs
        do not read (the optimizer state of its layers)."""
        ag = self._step.apply_graph
        read = {i for x in self._together(s) for kind in "FB" if (kind, x) in self._programs
                for i in self._programs[kind, x][0].args}
        layouts, axes = self._layouts(), dict(zip(self.mesh.axis_names, self.meshes[s].devices.shape))
        return sum(ag.values[ag.args[i].value].nbytes // layouts[i][1].shard_factor(axes)
                   for i, at in self._home.items() if at == s and i < len(layouts) and i not in read)

    def _summary(self, staged: dict) -> Plan:
        """The step's plan: its arguments and results where the stages take and return them, the
        pipeline's cost (the schedule's time for the stages' programs, the moves once per step,
        then apply-gradients' programs, wave by wave, each wave as long as its slowest stage),
        and apply-gradients' searches as its search line. `staged`: the stager's bytes cut and
        FLOPs per stage."""
        fwd, bwd = [s.forward_s for s in self.stages], [s.backward_s for s in self.stages]
        transfer_s = _transfer_s(self.transfers)
        pipeline_s = self.schedule.makespan(fwd, bwd, transfer_s) + sum(self.moves_s)
        slowest = [max((plan for prog, _, plan in self._applies if prog.wave == w), key=lambda plan: plan.cost.total_s)
                   for w in sorted({prog.wave for prog, _, _ in self._applies})]
        total = lambda attr: sum(getattr(plan.cost, attr) for plan in slowest)  # noqa: E731
        cost = PlanCost(total("compute_s"), total("comm_s"), pipeline_s + total("total_s"),
                        max(st.memory_bytes + _held_around(self.stages, s, self.shared, self._passes_beside(s))
                            for s, st in enumerate(self.stages)), total("hidden_s"))
        whole, ag, n = self._step.whole, self._step.apply_graph, len(self._step.compute_graph.args)
        plans = [plan for _, _, plan in self._applies]
        stats = dict(_searches({program_name("A", prog.stage, prog.wave): plan.search_stats
                                for prog, _, plan in self._applies}), pipeline=len(self.stage_meshes),
                     schedule=self.schedule.name, micro_batches=self.k, **staged, transfer_s=transfer_s,
                     **({"schedule_order": self.schedule.rows()}
                        if self.schedule.name == "op_order" or self.shared else {}),
                     arguments_in_s=self.moves_s[0], sums_out_s=self.moves_s[1], outputs_out_s=self.moves_s[2],
                     applies=self.apply_tasks)
        outputs = self._output_layouts()
        layouts = self._layouts()
        return Plan(
            mesh_axes=dict(zip(self.mesh.axis_names, self.mesh.devices.shape)), cluster=plans[0].cluster,
            opt_level=plans[0].opt_level, arg_paths=tuple(whole.arg_paths), arg_roles=tuple(whole.arg_roles),
            arg_shapes=tuple(ag.values[a.value].shape for a in ag.args[:n]),
            arg_dtypes=tuple(ag.values[a.value].dtype for a in ag.args[:n]),
            arg_specs=tuple(spec for _, spec in layouts),
            output_paths=tuple(whole.output_paths), output_specs=tuple(spec for _, spec in outputs), value_specs={},
            cost=cost, collectives=tuple(c for plan in plans for c in plan.collectives),
            fallback_ops=tuple(dict.fromkeys(op for plan in plans for op in plan.fallback_ops)), search_stats=stats,
            backend=plans[0].backend, stages=self.stages,
            programs={program_name("A", prog.stage, prog.wave): plan for prog, _, plan in self._applies},
            interrupted=any(plan.interrupted for plan in plans),
            input_shardings=call_tree(self._trees[0], _shardings(layouts)),
            output_shardings=jax.tree.unflatten(self._trees[1], _shardings(outputs)))

    def _compile_with(self, compiler_options: dict | None) -> "PipelinedCompiled":
        return PipelinedCompiled(self, compiler_options)


def _state_copies(cg: Graph, roles) -> dict[tuple, int]:
    """(shape, dtype) of a parameter → the copies of it the step's state holds beside it: its
    optimizer's moments (the optimizer-state arguments of its shape, per parameter of that
    shape: Adam's two) and its gradient sum."""
    count: Counter = Counter()
    for a, role in zip(cg.args, roles):
        value = cg.values[a.value]
        count[role, value.shape, value.dtype] += 1
    return {(shape, dtype): round(count["optimizer_state", shape, dtype] / n) + 1
            for (role, shape, dtype), n in count.items() if role == "parameter"}


def _with_state_beside(graph: Graph, prog: stage_programs.Program, cg: Graph, copies: dict[tuple, int]) -> Graph:
    """A forward or backward program's graph with each parameter it reads marked with the copies
    of it its stage holds beside it (`Arg.held_beside`: the gradient sum, which the backward
    adds its micro-batch's gradient to, and the moments): a memory limit on the program then
    keeps the stage's state within it, which the apply-gradients programs are pinned to."""
    def marked(a):
        if a.index >= len(prog.args) or a.role != "parameter":
            return a
        value = cg.values[cg.args[prog.args[a.index]].value]
        return dataclasses.replace(a, held_beside=copies.get((value.shape, value.dtype), 1))
    return dataclasses.replace(graph, args=tuple(marked(a) for a in graph.args))


def _own(graph: Graph, plan: Plan) -> Plan:
    """The program's plan as searched with its memory less the copies held beside its arguments
    (`_with_state_beside`: the search weighed them), which the stage counts apart
    (`StagePlan.beside_bytes`); a saved plan holds this."""
    beside = sum(a.held_beside * local_bytes(graph, a.value, spec, plan.mesh_axes)
                 for a, spec in zip(graph.args, plan.arg_specs))
    if not beside:
        return plan
    return dataclasses.replace(plan, cost=dataclasses.replace(plan.cost, memory_bytes=plan.cost.memory_bytes - beside))


def _on_stage(prog: stage_programs.Program, axes: dict[str, int], paths, roles, output_paths
              ) -> tuple[stage_programs.Program, Graph]:
    """The program on its stage's sub-mesh, and its graph: the arguments it reads (named and
    cast as in the graph it was cut from), then the values it takes from other programs."""
    prog = dataclasses.replace(prog, module=on_mesh(prog.module, axes))
    graph = import_module(prog.module, [paths[i] for i in prog.args] + [f"in[{v}]" for v in prog.inputs],
                          [roles[i] for i in prog.args] + ["other"] * len(prog.inputs), output_paths)
    return prog, graph


def _shardings(layouts: list[tuple[Mesh, ShardingSpec]]) -> list[NamedSharding]:
    return [NamedSharding(mesh, spec.to_partition_spec()) for mesh, spec in layouts]


def _compute_homes(plans: dict[tuple[str, int], Planned], cg: Graph) -> dict[int, int]:
    """apply-gradients' arguments that live on a stage, and where: a step argument other than the
    batch on the stage of the first program that reads it (in a micro-batch's order), a sum on
    the stage that makes it (apply-gradients' argument len(args) + j is compute-gradients' sum j)."""
    n, sums = len(cg.args), {v: j for j, v in enumerate(cg.outputs)}
    home: dict[int, int] = {}
    for key in sorted(plans, key=stage_programs.run_order):
        prog = plans[key][0]
        home.update((i, prog.stage) for i in prog.args if cg.args[i].role != "batch" and i not in home)
        home.update((n + sums[v], prog.stage) for v in prog.outputs if v in sums)
    return home


def _apply_homes(home: dict[int, int], programs, ag: Graph, roles) -> dict[int, int]:
    """Where each step argument other than the batch lives: on the stage that makes the result
    fed back into it (a parameter where its update runs, its optimizer state with it), so that a
    training loop hands it back where it came from; else as `home` has it (compute-gradients'
    first reader); else on its first reader's among apply-gradients' programs. Sums as in `home`."""
    made = {v: prog.stage for prog in programs for v in prog.outputs}
    out = dict(home)
    for k, i in ag.fed_back().items():
        if i < len(roles) and roles[i] != "batch" and ag.outputs[k] in made:
            out[i] = made[ag.outputs[k]]
    for prog in programs:
        out.update((i, prog.stage) for i in prog.args if i < len(roles) and roles[i] != "batch" and i not in out)
    return out


def _fed_back_names(prog: stage_programs.Program, ag: Graph) -> list[str]:
    """Names of an apply-gradients program's results: a step result the training loop feeds back
    into an argument (`Graph.fed_back` of the whole step) is named as that argument ("out" for
    "arg"), so that the program's own search, which pairs names leaf by leaf, ties its layout to
    the argument's; the others by value."""
    fed = ag.fed_back()
    first = {v: k for k, v in reversed(list(enumerate(ag.outputs)))}
    return ["out" + ag.args[fed[first[v]]].path[len("arg"):] if first.get(v) in fed else f"out[{v}]"
            for v in prog.outputs]


def _with_donation(graph: Graph, prog: stage_programs.Program, ag: Graph, donated: set[int]) -> Graph:
    """The program's graph with each donated step argument (of `donated`) aliasing the result the
    step pairs it with (`micro_batched._with_donation`) where the program makes that result."""
    args = list(graph.args)
    for pos, i in enumerate(prog.args):
        k = ag.args[i].donated_to
        if i in donated and k is not None and ag.outputs[k] in prog.outputs:
            args[pos] = dataclasses.replace(args[pos], donated_to=prog.outputs.index(ag.outputs[k]))
    return dataclasses.replace(graph, args=tuple(args))


def _taken_layout(planned: list[Planned], places: tuple[int, ...], i: int, fed: int | None) -> ShardingSpec | None:
    """The layout a stage (its `places`: one, or every device's) takes step argument i in, as
    far as `planned` (in run order) fixes it: as the first of them that reads it, else as an
    apply-gradients program makes `fed`, the result fed back into it; None when none does."""
    read = [plan.arg_specs[prog.args.index(i)] for prog, _, plan in planned if prog.stage in places and i in prog.args]
    made = [plan.output_specs[prog.outputs.index(fed)] for prog, _, plan in planned
            if prog.kind == "A" and prog.stage in places and fed is not None and fed in prog.outputs]
    return (read + made + [None])[0]


def _fed_back_pins(prog: stage_programs.Program, graph: Graph, earlier: list[Planned], ag: Graph,
                   places: tuple[int, ...]) -> tuple[Pin, ...]:
    """Pins for an apply-gradients program's results that the training loop feeds back into an
    argument whose layout `earlier` programs of the stage fixed (an optimizer state read in one
    wave and made in a later one): the result leaves in it, else every step would reshard it
    outside every program and every count."""
    into = {ag.outputs[k]: i for k, i in ag.fed_back().items()}
    pins = []
    for pos, v in enumerate(prog.outputs):
        spec = _taken_layout(earlier, places, into[v], v) if v in into else None
        if spec is not None:
            pins.append(Pin(graph.outputs[pos], spec.dims, graph.output_paths[pos]))
    return tuple(pins)


def _held_layouts(plans: dict[tuple[str, int], Planned], places: tuple[int, ...], cg: Graph
                  ) -> dict[int, ShardingSpec]:
    """apply-gradients' argument → the layout a stage's (its `places`') forward (else backward)
    program holds it in: a parameter as it reads it, a sum as it makes it. apply-gradients'
    programs on the stage are pinned to these, so nothing moves between a stage's programs."""
    n, sums = len(cg.args), {v: j for j, v in enumerate(cg.outputs)}
    held: dict[int, ShardingSpec] = {}
    for kind, s in [(kind, s) for kind in ("F", "B") for s in places if (kind, s) in plans]:
        prog, _, plan = plans[kind, s]
        for pos, i in enumerate(prog.args):
            held.setdefault(i, plan.arg_specs[pos])
        for v, spec in zip(prog.outputs, plan.output_specs):
            if v in sums:
                held.setdefault(n + sums[v], spec)
    return held


def _apply_tasks(applies: list[Planned], home: dict[int, int], n: int) -> tuple[task_graph.Apply, ...]:
    """The task graph's apply tasks: each apply-gradients program after the stages whose sums it
    reads and the programs whose values it reads."""
    made = {v: prog for prog, _, _ in applies for v in prog.outputs}
    return tuple(task_graph.Apply(prog.stage, prog.wave, tuple(sorted({home[i] for i in prog.args if i >= n})),
                                  tuple(sorted({(made[v].stage, made[v].wave) for v in prog.inputs})))
                 for prog, _, _ in applies)


def _searches(named: dict[str, dict]) -> dict:
    """apply-gradients' programs' searches (by program name) as one search line: sizes and times
    added up (each program's ILPs one after another, named by their program), the worst status
    (interrupted, then any other than optimal) with its figures, the largest gap."""
    stats = list(named.values())
    worst = max(stats, key=lambda st: (st.get("status") == "interrupted", st.get("status") != "optimal"))
    out = dict(worst)
    for key in ("ops", "critical_nodes", "subgraphs", "groups", "tied_segments", "ilp_groups", "ilp_vars",
                "ilp_constraints", "solve_s", "build_s"):
        if all(key in st for st in stats):
            out[key] = sum(st[key] for st in stats)
    if "ops" in out:
        out["critical_proportion"] = out.get("critical_nodes", 0) / max(out["ops"], 1)
    gaps = [st.get("gap", 0.0) for st in stats]
    out["gap"] = float("nan") if any(np.isnan(g) for g in gaps) else max(gaps)
    out["not_replicated"] = tuple(x for st in stats for x in st.get("not_replicated", ()))
    out["stages"] = [x for st in stats for x in st.get("stages", ())]
    out["stage_names"] = [name if len(st.get("stage_names", ())) == 1 else f"{name} {x}"
                          for name, st in named.items() for x in st.get("stage_names", ())]
    return out


def _saved_placement(plan: Plan, cg, p: int) -> tuple[dict[int, tuple[str, int]], dict]:
    """A saved plan's stage of each op of compute-gradients, and the stager's figures, once they
    are shown to fit this step's compute-gradients and p stages (and the places of every device
    between them)."""
    place, shared = plan.placement, tuple(plan.search_stats.get("shared_places", ()))
    passes = plan.search_stats.get("passes", 1)
    wrong = [(n, at) for n, at in place.items()
             if at[0] not in ("F", "B") or not 0 <= at[1] < p * passes + len(shared)]
    stats = {key: plan.search_stats.get(key) for key in ("stage_cut_bytes", "stage_flops")}
    if set(place) != {n.id for n in cg.nodes} or wrong or None in stats.values():
        raise PlanTargetError(f"the plan places {len(place)} ops in {p} stages (e.g. {wrong[:1] or 'none misplaced'}), "
                              f"compute-gradients cut from this step has {len(cg.nodes)} ops: it was saved by another "
                              "version of rhino_jax or edited; plan again")
    relaxed = plan.search_stats.get("stage_epsilon")
    return place, dict(stats, **({"stage_epsilon": relaxed} if relaxed is not None else {}),
                       **({"shared_places": shared} if shared else {}),
                       **({"passes": passes, "repeated_layers": plan.search_stats["repeated_layers"]}
                          if passes > 1 else {}))


def _transfers(plans, meshes: list[Mesh], cg, cluster) -> dict[tuple[int, int, int, str], resharding.ReshardPlan]:
    """(source stage, destination stage, value, destination program "F" or "B") → its cross-mesh
    resharding ("On Optimizing the Communication of Model Parallelism"), for every tensor one
    stage's program hands another's: from the producer's output layout on its mesh to the consumer's
    argument layout on its mesh, load-balanced under the host-level model. A stage's forward and
    backward programs may take the same value in different layouts: each gets its own move."""
    made = {v: (prog, plan) for prog, _, plan in plans.values() for v in prog.outputs}
    hosts = _hosts(meshes, cluster)
    found = {}
    for prog, graph, plan in plans.values():
        n_args = len(graph.args) - len(prog.inputs)
        for k, v in enumerate(prog.inputs):
            src_prog, src_plan = made[v]
            if src_prog.stage == prog.stage:
                continue
            shape = cg.values[v].shape
            src = NamedSharding(meshes[src_prog.stage], src_plan.output_specs[src_prog.outputs.index(v)].to_partition_spec())
            dst = NamedSharding(meshes[prog.stage], plan.arg_specs[n_args + k].to_partition_spec())
            tasks = resharding.unit_tasks(resharding.sharding_map(src, shape), resharding.sharding_map(dst, shape),
                                          np.dtype(cg.values[v].dtype).itemsize)
            found[src_prog.stage, prog.stage, v, prog.kind] = resharding.plan(tasks, hosts)
    return found


def _hosts(meshes: list[Mesh], cluster) -> resharding.Hosts:
    """The host of each of the stages' devices (described GPUs: their process, `host_ids`)."""
    devices = list({d.id: d for mesh in meshes for d in mesh.devices.flat}.values())
    host = dict(zip((d.id for d in devices), host_ids(devices, cluster.devices_per_host)))
    return resharding.Hosts(lambda d: host[d.id], cluster.inter_host_bandwidth, cluster.intra_host_bandwidth)


def _step_moves(plans: dict[tuple[str, int], Planned], applies: list[Planned], layouts: list[NamedSharding],
                returned: list[NamedSharding], step, meshes: list[Mesh], cluster) -> tuple[float, float, float]:
    """Seconds per step (1) to bring each program the step's arguments it reads elsewhere or in
    another layout than the step takes them in (`layouts`; a batch argument's micro-batches
    together move the whole of it), (2) to bring apply-gradients' programs the sums and the
    values they read from other stages or in other layouts, (3) to return the outputs where the
    step returns them (`returned`: the loss and metrics replicated on the whole mesh). Priced as
    cross-mesh resharding under the host-level model, all of a direction's tensors in one plan
    (they share the hosts' links)."""
    hosts, ag, n = _hosts(meshes, cluster), step.apply_graph, len(step.compute_graph.args)
    sums = {v: j for j, v in enumerate(step.compute_graph.outputs)}
    source = {n + sums[v]: NamedSharding(meshes[prog.stage], spec.to_partition_spec())  # sum → where it is made
              for prog, _, plan in plans.values() for v, spec in zip(prog.outputs, plan.output_specs) if v in sums}
    source.update((i, layout) for i, layout in enumerate(layouts))
    made = {v: NamedSharding(meshes[prog.stage], spec.to_partition_spec())
            for prog, _, plan in applies for v, spec in zip(prog.outputs, plan.output_specs)}
    moves: tuple[dict, dict, dict] = ({}, {}, {})  # keyed so that a tensor moves once per layout

    def add(direction: dict, key, src: NamedSharding, dst: NamedSharding, value: int) -> None:
        shape, dtype = ag.values[value].shape, ag.values[value].dtype
        if key not in direction and not src.is_equivalent_to(dst, len(shape)):  # the user's mesh names Auto's devices
            direction[key] = resharding.unit_tasks(resharding.sharding_map(src, shape),
                                                   resharding.sharding_map(dst, shape), np.dtype(dtype).itemsize)

    for prog, _, plan in list(plans.values()) + applies:
        dst = named(meshes[prog.stage], plan.arg_specs)
        for pos, i in enumerate(prog.args):  # compute-gradients' arguments are the step's: the same indices
            add(moves[i >= n], ("arg", i, dst[pos]), source[i], dst[pos], ag.args[i].value)
        if prog.kind == "A":
            for v, to in zip(prog.inputs, dst[len(prog.args):]):
                add(moves[1], ("value", v, to), made[v], to, v)
    for v, to in zip(ag.outputs, returned):
        add(moves[2], ("output", v, to), made[v], to, v)

    def seconds(direction: dict) -> float:
        tasks = resharding.host_level([t for ts in direction.values() for t in ts], hosts)
        return resharding.plan(tasks, hosts).makespan_s if tasks else 0.0

    return seconds(moves[0]), seconds(moves[1]), seconds(moves[2])


def _transfer_s(transfers: dict) -> float:
    """A micro-batch's tensors across the busiest boundary between two places (`_transfers`)."""
    per_boundary: dict[tuple[int, int], float] = {}
    for (src, dst, _, _), move in transfers.items():
        per_boundary[src, dst] = per_boundary.get((src, dst), 0.0) + move.makespan_s
    return max(per_boundary.values(), default=0.0)


def _held_around(stages, s: int, shared: tuple[int, ...], passes: tuple[int, ...] = ()) -> int:
    """Per device, what the devices running place s hold for the other places they run while it
    runs: a stage's devices hold the places of every device's (`StagePlan.beside_bytes`), and
    those the busiest stage's too; a multi-forward step's stage its other passes' (`passes`:
    the stage's places)."""
    others = sum(stages[x].beside_bytes for x in (*shared, *passes) if x != s)
    if s not in shared or len(shared) == len(stages):
        return others
    return others + max(st.beside_bytes for x, st in enumerate(stages) if x not in shared)


def _held_bytes(plans, s: int, mesh: Mesh) -> int:
    """Per device, the values stage s's forward program hands its own backward program: what the
    stage keeps of each micro-batch in flight (none without a backward)."""
    return _output_bytes(plans["F", s], mesh, set(plans["B", s][0].inputs)) if ("B", s) in plans else 0


def _summed_bytes(plans, s: int, mesh: Mesh, sums: set[int], accumulate: str | None) -> int:
    """Per device, the running sums (gradients, loss) stage s adds its micro-batches' into, in
    their accumulation dtype."""
    return sum(_output_bytes(plans[kind, s], mesh, sums, accumulate) for kind in ("F", "B") if (kind, s) in plans)


def _output_bytes(planned, mesh: Mesh, wanted: set[int], accumulate: str | None = None) -> int:
    """Per device, the results of a program that `wanted` names; held as running sums in
    `accumulate`'s dtype where given (`micro_batched.summed_bytes`)."""
    program, graph, plan = planned
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    return sum(summed_bytes(local_bytes(graph, out, spec, sizes), graph.values[out].dtype, accumulate)
               for v, out, spec in zip(program.outputs, graph.outputs, plan.output_specs) if v in wanted)


def _loss_sum(cg) -> int:
    """The sum the loss is made of: of compute-gradients' scalar sums, the one the most ops lead to
    (the loss depends on the whole forward pass; a counter or a metric on less)."""
    scalars = [v for v in cg.outputs if cg.values[v].shape == ()]
    if not scalars:
        raise MeshError("pipelining needs a scalar loss among the step's outputs")
    return max(scalars, key=lambda v: len(stage_programs.ancestors(cg, v)))


class PipelinedCompiled(SeveralPrograms):
    """The stage programs and apply-gradients' programs compiled; call it like the step."""

    def __init__(self, lowered: PipelinedLowered, compiler_options: dict | None = None):
        self._lowered, self.plan = lowered, lowered.plan
        self._run, self._index = {}, {}  # a stage program's index layout: it counts positions along the batch
        for key, (prog, graph, plan) in lowered._programs.items():
            sub = lowered.meshes[prog.stage]
            run, self._index[key] = _compile(prog.module, graph, plan, sub, compiler_options=compiler_options,
                                             memory_limit_bytes=lowered.memory_limit_bytes, cluster=lowered.cluster)
            self._run[key] = (prog, run, named(sub, plan.arg_specs))
        self._apply = {}  # the task graph's name of each apply-gradients program → the program
        for task, (prog, graph, plan) in zip(lowered.apply_tasks, lowered._applies):
            sub = lowered.meshes[prog.stage]
            donated = tuple(a.index for a in graph.args if a.donated_to is not None)
            run, _ = _compile(prog.module, graph, plan, sub, donated, compiler_options=compiler_options,
                              memory_limit_bytes=lowered.memory_limit_bytes, cluster=lowered.cluster)
            self._apply[task.name] = (prog, run, named(sub, plan.arg_specs))
        self._add = jax.jit(add_up)
        cg = lowered._step.compute_graph  # each sum added up in its accumulation dtype, handed on in its own
        self._wide = {v: accumulated(cg.values[v].dtype, lowered.accumulate) for v in cg.outputs}
        self._narrow = lambda sums, v: sums[v].astype(cg.values[v].dtype)
        self._stage_of = {v: prog.stage for prog, _, _ in lowered._programs.values() for v in prog.outputs}
        self.programs = {program_name(kind, stage): run
                         for (kind, stage), (_, run, _) in sorted(self._run.items(), key=lambda kv: kv[0][::-1])}
        self.programs.update((program_name("A", prog.stage, prog.wave), run) for prog, run, _ in self._apply.values())

    def _to(self, x, sharding: NamedSharding, planned: resharding.ReshardPlan | None = None) -> jax.Array:
        """x (an argument of the step, or a value a program made) in a program's sharding: between
        processes by an SPMD program over the whole mesh (`runtime.transfer`), else by its planned
        cross-mesh resharding, else by jax.device_put."""
        low = self._lowered
        if isinstance(x, jax.Array) and transfer.needed(x, sharding):
            p, held = len(low.stage_meshes), _stage_holding(x.sharding.device_set, low.stage_meshes)
            if held is None:  # on the whole mesh
                return transfer.to_stage(x, low.mesh, p, _stage_holding(sharding.device_set, low.stage_meshes),
                                         sharding)
            return transfer.from_stage(x, low.mesh, p, held, sharding)
        return resharding.reshard(x, sharding, planned) if planned else jax.device_put(x, sharding)

    def __call__(self, *args, **kwargs):
        low = self._lowered
        refuse_described(low.mesh)
        micro = micro_batches_of(low, args, kwargs)
        whole = flat_call(args, kwargs)
        cg = low._step.compute_graph
        n, sums_of = len(cg.args), set(cg.outputs)
        made: dict[tuple[int, int], jax.Array] = {}  # (micro-batch, value) → array
        sums: dict[int, jax.Array] = {}
        applied: dict[int, jax.Array] = {}  # apply-gradients' value → array
        placed: dict = {}  # (argument, sharding) → the argument there: once per call, not per micro-batch
        batch = {i for i, role in enumerate(low.plan.arg_roles) if role == "batch"}

        def put(i: int, mb: int | None, sharding: NamedSharding) -> jax.Array:
            if i in batch and mb is not None:
                return self._to(micro[mb][i], sharding)
            if (i, sharding) not in placed:
                placed[i, sharding] = self._to(whole[i], sharding)
            return placed[i, sharding]

        for task in task_graph.build(low.schedule, low.apply_tasks).order():
            if task.kind in ("forward", "backward"):
                kind = "F" if task.kind == "forward" else "B"
                prog, run, shardings = self._run[kind, task.stage]
                ins = [put(i, task.micro_batch, sharding) for i, sharding in zip(prog.args, shardings)]
                for v, sharding in zip(prog.inputs, shardings[len(prog.args):]):  # by cross-mesh resharding
                    key = (self._stage_of[v], task.stage, v, prog.kind)
                    ins.append(self._to(made[task.micro_batch, v], sharding, low.transfers.get(key)))
                outs = run(*with_index(ins, self._index[kind, task.stage], task.micro_batch))
                for v, out in zip(prog.outputs, outs):
                    made[task.micro_batch, v] = out
                    if v in sums_of:
                        sums[v] = self._add(sums[v], out) if v in sums else out.astype(self._wide[v])
            elif task.kind == "apply":
                prog, run, shardings = self._apply[task.name]
                ins = [put(i, None, sharding) if i < n else self._to(self._narrow(sums, cg.outputs[i - n]), sharding)
                       for i, sharding in zip(prog.args, shardings)]
                ins += [self._to(applied[v], sharding) for v, sharding in zip(prog.inputs, shardings[len(prog.args):])]
                applied.update(zip(prog.outputs, run(*ins)))
        returned = jax.tree.leaves(low.plan.output_shardings)
        return low.returned([self._to(applied[v], sharding) for v, sharding
                             in zip(low._step.apply_graph.outputs, returned)])

    def compiled_step_s(self, cluster=None, overlapped: bool = True) -> float:
        """The step's time with each program priced from what XLA compiled (`compiled_cost.
        price_compiled`: its cost analysis and the collectives it emits; as its schedule overlaps
        communication with compute, or with `overlapped=False` serially) in the plan's schedule,
        with the plan's moves, then apply-gradients' programs wave by wave: the prediction's check."""
        low = self._lowered
        cluster = cluster or low.cluster
        price = {key: priced_s(price_compiled(run, cluster), overlapped) for key, (_, run, _) in self._run.items()}
        p = len(low.stages)
        steps = low.schedule.makespan([price["F", s] for s in range(p)], [price.get(("B", s), 0.0) for s in range(p)],
                                      low.plan.search_stats["transfer_s"])
        waves: dict[int, float] = {}
        for prog, run, _ in self._apply.values():
            waves[prog.wave] = max(waves.get(prog.wave, 0.0), priced_s(price_compiled(run, cluster), overlapped))
        return steps + sum(low.moves_s) + sum(waves.values())

    def report(self) -> str:
        return f"{self.plan.report()}\n\n{priced_line(self.compiled_step_s, self.plan)}"


def _stage_holding(devices, meshes: list[Mesh]) -> int | None:
    """The stage whose sub-mesh is exactly these devices (None: the whole mesh)."""
    ids = {d.id for d in devices}
    return next((s for s, m in enumerate(meshes) if {d.id for d in m.devices.flat} == ids), None)
