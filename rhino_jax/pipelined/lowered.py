"""A step lowered as a pipeline: its ops placed, its programs planned on their stages (again
under what a stage holds beside them, where that passes the memory limit), the moves priced, and
the plan that sums it up."""
from __future__ import annotations

import dataclasses
from collections import Counter

import jax
from jax.sharding import Mesh

from rhino_jax.core.diagnostics import Staging
from rhino_jax.core.plan import Execution, Plan, PlanCost, StagePlan, program_name
from rhino_jax.core.specs import ShardingSpec
from rhino_jax.hlo_passes import stages as stage_programs
from rhino_jax.hlo_passes.graph import Graph, Pin
from rhino_jax.hlo_passes.lowering import program_target, step_target
from rhino_jax.runtime import schedules
from rhino_jax.search import interrupt
from rhino_jax.search.cost.cluster import MeshTopology, get_cluster

from .. import alike_programs
from ..arguments import Call, call_tree
from ..errors import MemoryLimitError, SolverError, StagingError
from ..mesh_search import plan_on
from ..options import Options, budget_of, device_memory, within
from ..several_programs import (APPLY_WEIGHT, SeveralProgramsLowered, program_plan, say_step, searched_alone,
                                split_step)
from .executor import PipelinedCompiled
from .memory import _held_around, _held_bytes, _summed_bytes
from .moves import _shardings, _step_moves, _transfer_s, _transfers
from .programs import (Planned, _apply_homes, _apply_tasks, _compute_homes, _fed_back_names, _fed_back_pins,
                       _held_layouts, _on_stage, _searches, _state_copies, _taken_layout, _with_donation,
                       _with_state_beside)
from .staging import STAGER_SHARE, _saved_placement, _schedule, place_ops, sub_meshes


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
            place, chain, staged = place_ops(cg, p, options, budget)
        else:
            given.check_matches(target)
            place, chain, staged = _saved_placement(given, cg, p)
        shared, self.passes = chain.shared_places, chain.passes
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
                lambda: searched_alone(graph, plan_on(graph, topology[prog.stage], cluster,
                                                      within(opts, budget, weight, f"program {name}"),
                                                      meshes[prog.stage])))
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
        self.plan = dataclasses.replace(self._summary(chain, staged), placement=place, target=target)
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

    def _summary(self, chain: Execution, staged: Staging) -> Plan:
        """The step's plan: its arguments and results where the stages take and return them, the
        pipeline's cost (the schedule's time for the stages' programs, the moves once per step,
        then apply-gradients' programs, wave by wave, each wave as long as its slowest stage),
        and apply-gradients' searches as its search line; how it runs, the chain's places
        (`chain`) and the schedule. `staged`: the stager's figures, its moves not yet priced."""
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
        staging = dataclasses.replace(staged, arguments_in_s=self.moves_s[0], sums_out_s=self.moves_s[1],
                                      outputs_out_s=self.moves_s[2])
        stats = dataclasses.replace(_searches({program_name("A", prog.stage, prog.wave): plan.search_stats
                                               for prog, _, plan in self._applies}), staging=staging)
        rows = self.schedule.rows() if self.schedule.name == "op_order" or self.shared else ()
        execution = dataclasses.replace(chain, micro_batches=self.k, pipeline=len(self.stage_meshes),
                                        schedule=self.schedule.name, schedule_rows=rows, applies=self.apply_tasks,
                                        transfer_s=transfer_s)
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
            execution=execution, backend=plans[0].backend, stages=self.stages,
            programs={program_name("A", prog.stage, prog.wave): plan for prog, _, plan in self._applies},
            interrupted=any(plan.interrupted for plan in plans),
            input_shardings=call_tree(self._trees[0], _shardings(layouts)),
            output_shardings=jax.tree.unflatten(self._trees[1], _shardings(outputs)))

    def _compile_with(self, compiler_options: dict | None) -> "PipelinedCompiled":
        return PipelinedCompiled(self, compiler_options)
