"""`pipeline=p`: compute-gradients cut into p stages on p sub-meshes, run micro-batch by micro-batch
in a static schedule (Rhino §5-6), then one apply-gradients on the whole mesh.

The step is split at its sums as for micro-batching (`micro_batched.split_step`); the stager
places the forward ops of compute-gradients (balanced FLOPs, least bytes cut), the backward ops
follow (`hlo_passes.stages`), and each stage's forward and backward program is planned by the
SPMD search on its sub-mesh (the mesh cut along its first axis). Every tensor one stage hands
another moves by cross-mesh resharding (`runtime.resharding`, seeds/004), planned once and
priced: a micro-batch's transfers across the busiest boundary are the schedule's transfer time.
The step's arguments move to the stages that read them, and the sums to apply-gradients, once
per step (priced the same way). A stage's memory counts the micro-batches it holds in flight
and its running sums; over `memory_limit_bytes`, its programs are planned again under what is
left. The executor walks the task graph of the schedule (`runtime.task_graph`) and dispatches
each program with its inputs put on its sub-mesh (jax's asynchronous dispatch overlaps the
stages); between processes, moves are SPMD programs (`runtime.transfer`). The sums of each
micro-batch are added on the stage that makes them. Not yet: optimizer ops on the stage of the
parameters they update (apply-gradients runs on the whole mesh), a loop cut across stages.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from rhino_jax.hlo_passes import stages as stage_programs
from rhino_jax.hlo_passes.compiled_cost import price_compiled
from rhino_jax.hlo_passes.importer import import_module
from rhino_jax.hlo_passes.split import on_mesh
from rhino_jax.runtime import resharding, schedules, task_graph, transfer
from rhino_jax.search import interrupt, stager
from rhino_jax.search.cluster import MeshTopology, get_cluster, host_ids
from rhino_jax.search.memory import local_bytes

from .errors import MemoryLimitError, MeshError
from .mesh_search import plan_on
from .arguments import Call, call_tree
from .micro_batched import (SeveralPrograms, SeveralProgramsLowered, _compile, micro_batches_of, named,
                            program_plan, split_step)
from .options import Options
from .plan import Plan, PlanCost, StagePlan, program_name
from .plan_target import PlanTarget, PlanTargetError

EPSILON = 0.25  # the stages' compute may differ from a balanced share by this much


def sub_meshes(mesh: Mesh, p: int) -> list[Mesh]:
    """The mesh cut into p meshes along its first axis."""
    n = mesh.devices.shape[0]
    if p < 2 or n % p:
        raise MeshError(f"pipeline={p} stages need the mesh's first axis ({mesh.axis_names[0]}={n}) to split into "
                        f"{p} equal parts; use a mesh like rj.device_mesh(({p}, ...), ...)")
    size = n // p
    return [Mesh(mesh.devices[i * size:(i + 1) * size], mesh.axis_names, axis_types=mesh.axis_types) for i in range(p)]


class PipelinedLowered(SeveralProgramsLowered):
    """A step lowered for p stages and k micro-batches: `plan` sums it up, `stages` holds each stage."""

    @interrupt.session()  # its searches stop together at Ctrl-C, every plan marked interrupted
    def __init__(self, call: Call, mesh: Mesh, options: Options, signature, given: Plan | None = None):
        """`given`: a saved plan of this step to run instead of searching (`parallelize(plan=...)`):
        its placement of the ops and its programs' plans."""
        p, k = options.pipeline, options.num_micro_batches
        meshes = sub_meshes(mesh, p)
        step = split_step(call, mesh, k)
        target = PlanTarget.of(step.whole, mesh, step.donated)
        cg = step.compute_graph
        if given is None:
            loss = _loss_sum(cg)
            coarse, node_of = stager.forward_stage_graph(cg, loss)
            staging = stager.stage(coarse, p, EPSILON, backend=options.solver, time_limit_s=options.solver_time_limit_s)
            place = stage_programs.assign(cg, loss, {i: staging.stage[node_of[i]] for i in node_of})
            staged = {"stage_cut_bytes": staging.cut_bytes, "stage_flops": staging.stage_compute}
        else:
            given.check_matches(target)
            place, staged = _saved_placement(given, cg, p)
        programs = stage_programs.programs(step.parts.compute, cg, place)
        cluster = get_cluster(options.cluster)
        whole = step.whole
        plans: dict[tuple[str, int], tuple[stage_programs.Program, object, Plan]] = {}
        topology = {s: MeshTopology.from_mesh(sub, cluster) for s, sub in enumerate(meshes)}
        for prog in programs:
            prog = dataclasses.replace(prog, module=on_mesh(prog.module, dict(zip(mesh.axis_names,
                                                                                 meshes[prog.stage].devices.shape))))
            graph = import_module(prog.module, [whole.arg_paths[i] for i in prog.args] + [f"in[{v}]" for v in prog.inputs],
                                  [whole.arg_roles[i] for i in prog.args] + ["other"] * len(prog.inputs),
                                  [f"out[{v}]" for v in prog.outputs])
            plans[prog.kind, prog.stage] = (prog, graph, program_plan(
                program_name(prog.kind, prog.stage), prog.module, graph, meshes[prog.stage], given,
                lambda: plan_on(graph, topology[prog.stage], cluster, options)))
        self.schedule = schedules.make(options.schedule, p, k)
        in_flight = self.schedule.in_flight()
        sums = set(cg.outputs)

        def stage_plan(s: int) -> StagePlan:
            return StagePlan(s, dict(zip(mesh.axis_names, meshes[s].devices.shape)),
                             tuple(int(d.id) for d in meshes[s].devices.flat),
                             stage_programs.layers(cg, [i for i, (kind, at) in place.items() if kind == "F" and at == s]),
                             plans["F", s][2], plans["B", s][2], in_flight[s], _held_bytes(plans, s, meshes[s]),
                             _summed_bytes(plans, s, meshes[s], sums))

        stages = [stage_plan(s) for s in range(p)]
        limit = options.memory_limit_bytes if given is None else None  # a saved plan's stages are final
        for s, st in enumerate(stages):  # what the programs do not see (other micro-batches, the sums) off their limit
            extra = st.memory_bytes - max(st.forward.cost.memory_bytes, st.backward.cost.memory_bytes)
            if limit and st.memory_bytes > limit and extra < limit:
                tighter = dataclasses.replace(options, memory_limit_bytes=limit - extra)
                for kind in ("F", "B"):
                    prog, graph, _ = plans[kind, s]
                    try:
                        plans[kind, s] = (prog, graph, program_plan(
                            program_name(kind, s), prog.module, graph, meshes[s], None,
                            lambda: plan_on(graph, topology[s], cluster, tighter)))
                    except MemoryLimitError:
                        pass  # keeps the first plan; pipeline='auto' reports the stage over the limit
                stages[s] = stage_plan(s)
        apply_plan = program_plan("apply_gradients", step.parts.apply, step.apply_graph, mesh, given,
                                  lambda: plan_on(step.apply_graph, MeshTopology.from_mesh(mesh, cluster), cluster,
                                                  options))
        self.mesh, self.meshes, self.k, self._signature, self.cluster = mesh, meshes, k, signature, cluster
        self.transfers = _transfers(plans, meshes, cg, cluster)
        self.moves_s = _step_moves(plans, meshes, mesh, apply_plan, step, cluster)
        self._step, self._programs, self._apply_plan = step, plans, apply_plan
        self._trees = (jax.tree.structure((call.args, call.kwargs)), whole.lowered.out_tree)
        self.stages = tuple(stages)
        self.plan = dataclasses.replace(self._summary(staged), programs={"apply_gradients": apply_plan},
                                        placement=place, target=target)
        self._compiled: PipelinedCompiled | None = None

    def _summary(self, staged: dict) -> Plan:
        """apply-gradients' plan, for the step's arguments and outputs, with the pipeline's cost:
        the schedule's time for its stages' programs, then apply-gradients. `staged`: the stager's
        bytes cut and FLOPs per stage."""
        a = self._apply_plan
        fwd, bwd = [s.forward_s for s in self.stages], [s.backward_s for s in self.stages]
        per_boundary: dict[tuple[int, int], float] = {}
        for (src, dst, _, _), move in self.transfers.items():
            per_boundary[src, dst] = per_boundary.get((src, dst), 0.0) + move.makespan_s
        transfer_s = max(per_boundary.values(), default=0.0)  # a micro-batch's tensors across one boundary
        pipeline_s = self.schedule.makespan(fwd, bwd, transfer_s) + sum(self.moves_s)
        cost = PlanCost(a.cost.compute_s, a.cost.comm_s, pipeline_s + a.cost.total_s,
                        max([a.cost.memory_bytes] + [s.memory_bytes for s in self.stages]), a.cost.hidden_s)
        n = len(self._step.compute_graph.args)
        stats = dict(a.search_stats, pipeline=len(self.stages), schedule=self.schedule.name, micro_batches=self.k,
                     **staged, transfer_s=transfer_s, arguments_in_s=self.moves_s[0], sums_out_s=self.moves_s[1])
        stats.pop("compute_gradients", None)
        return dataclasses.replace(
            a, arg_paths=a.arg_paths[:n], arg_roles=a.arg_roles[:n], arg_shapes=a.arg_shapes[:n],
            arg_dtypes=a.arg_dtypes[:n], arg_specs=a.arg_specs[:n], cost=cost, search_stats=stats, stages=self.stages,
            input_shardings=call_tree(self._trees[0], named(self.mesh, a.arg_specs[:n])),
            output_shardings=jax.tree.unflatten(self._trees[1], named(self.mesh, a.output_specs)))

    def compile(self) -> "PipelinedCompiled":
        if self._compiled is None:
            self._compiled = PipelinedCompiled(self)
        return self._compiled


def _saved_placement(plan: Plan, cg, p: int) -> tuple[dict[int, tuple[str, int]], dict]:
    """A saved plan's stage of each op of compute-gradients, and the stager's figures, once they
    are shown to fit this step's compute-gradients and p stages."""
    place = plan.placement
    wrong = [(n, at) for n, at in place.items() if at[0] not in ("F", "B") or not 0 <= at[1] < p]
    stats = {key: plan.search_stats.get(key) for key in ("stage_cut_bytes", "stage_flops")}
    if set(place) != {n.id for n in cg.nodes} or wrong or None in stats.values():
        raise PlanTargetError(f"the plan places {len(place)} ops in {p} stages (e.g. {wrong[:1] or 'none misplaced'}), "
                              f"compute-gradients cut from this step has {len(cg.nodes)} ops: it was saved by another "
                              "version of rhino_jax or edited; plan again")
    return place, stats


def _transfers(plans, meshes: list[Mesh], cg, cluster) -> dict[tuple[int, int, int, str], resharding.ReshardPlan]:
    """(source stage, destination stage, value, destination program "F" or "B") → its cross-mesh
    resharding (seeds/004), for every tensor one stage's program hands another's: from the
    producer's output layout on its mesh to the consumer's argument layout on its mesh,
    load-balanced under the host-level model. A stage's forward and backward programs may take
    the same value in different layouts: each gets its own move."""
    made = {v: (prog, plan) for prog, _, plan in plans.values() for v in prog.outputs}
    hosts = _hosts(cluster)
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


def _hosts(cluster) -> resharding.Hosts:
    devices = jax.devices()
    host = dict(zip((d.id for d in devices), host_ids(devices, cluster.devices_per_host)))
    return resharding.Hosts(lambda d: host[d.id], cluster.inter_host_bandwidth, cluster.intra_host_bandwidth)


def _step_moves(plans, meshes: list[Mesh], mesh: Mesh, apply_plan: Plan, step, cluster) -> tuple[float, float]:
    """Seconds per step to bring each stage the step's arguments it reads, from the layouts the
    step takes them in (apply-gradients' arguments, on the whole mesh) to its programs', and to
    bring the stages' sums to apply-gradients. Priced as cross-mesh resharding under the
    host-level model, all of a direction's tensors in one plan (they share the hosts' links); a
    batch argument's micro-batches together move the whole of it."""
    hosts, cg = _hosts(cluster), step.compute_graph
    n, sums = len(cg.args), {v: j for j, v in enumerate(cg.outputs)}
    moves: tuple[dict, dict] = ({}, {})  # in, out; keyed so that a tensor moves once per layout

    def add(direction: dict, key, src: NamedSharding, dst: NamedSharding, shape, dtype) -> None:
        if key not in direction:
            direction[key] = resharding.unit_tasks(resharding.sharding_map(src, shape),
                                                   resharding.sharding_map(dst, shape), np.dtype(dtype).itemsize)

    for prog, _, plan in plans.values():
        sub = meshes[prog.stage]
        for pos, i in enumerate(prog.args):
            dst = NamedSharding(sub, plan.arg_specs[pos].to_partition_spec())
            add(moves[0], (i, dst), NamedSharding(mesh, apply_plan.arg_specs[i].to_partition_spec()), dst,
                apply_plan.arg_shapes[i], apply_plan.arg_dtypes[i])
        for v, spec in zip(prog.outputs, plan.output_specs):
            if v in sums:
                add(moves[1], v, NamedSharding(sub, spec.to_partition_spec()),
                    NamedSharding(mesh, apply_plan.arg_specs[n + sums[v]].to_partition_spec()),
                    cg.values[v].shape, cg.values[v].dtype)

    def seconds(direction: dict) -> float:
        tasks = resharding.host_level([t for ts in direction.values() for t in ts], hosts)
        return resharding.plan(tasks, hosts).makespan_s if tasks else 0.0

    return seconds(moves[0]), seconds(moves[1])


def _held_bytes(plans, s: int, mesh: Mesh) -> int:
    """Per device, the values stage s's forward program hands its own backward program: what the
    stage keeps of each micro-batch in flight."""
    return _output_bytes(plans["F", s], mesh, set(plans["B", s][0].inputs))


def _summed_bytes(plans, s: int, mesh: Mesh, sums: set[int]) -> int:
    """Per device, the running sums (gradients, loss) stage s adds its micro-batches' into."""
    return sum(_output_bytes(plans[kind, s], mesh, sums) for kind in ("F", "B"))


def _output_bytes(planned, mesh: Mesh, wanted: set[int]) -> int:
    program, graph, plan = planned
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    return sum(local_bytes(graph, out, spec, sizes)
               for v, out, spec in zip(program.outputs, graph.outputs, plan.output_specs) if v in wanted)


def _loss_sum(cg) -> int:
    """The sum the loss is made of: of compute-gradients' scalar sums, the one the most ops lead to
    (the loss depends on the whole forward pass; a counter or a metric on less)."""
    scalars = [v for v in cg.outputs if cg.values[v].shape == ()]
    if not scalars:
        raise MeshError("pipelining needs a scalar loss among the step's outputs")
    return max(scalars, key=lambda v: len(stage_programs.ancestors(cg, v)))


class PipelinedCompiled(SeveralPrograms):
    """The stage programs and apply-gradients compiled; call it like the step."""

    def __init__(self, lowered: PipelinedLowered):
        self._lowered, self.plan = lowered, lowered.plan
        self._run = {}
        for key, (prog, graph, plan) in lowered._programs.items():
            sub = lowered.meshes[prog.stage]
            self._run[key] = (prog, _compile(prog.module, graph, plan, sub), named(sub, plan.arg_specs))
        apply = lowered._apply_plan
        self._apply = _compile(lowered._step.parts.apply, lowered._step.apply_graph, apply, lowered.mesh,
                               lowered._step.donated)
        self._apply_in = named(lowered.mesh, apply.arg_specs)
        self._add = jax.jit(lambda a, b: a + b)
        self._stage_of = {v: prog.stage for prog, _, _ in lowered._programs.values() for v in prog.outputs}
        self.programs = {program_name(kind, stage): run
                         for (kind, stage), (_, run, _) in sorted(self._run.items(), key=lambda kv: kv[0][::-1])}
        self.programs["apply_gradients"] = self._apply

    def __call__(self, *args, **kwargs):
        low = self._lowered
        micro = micro_batches_of(low, args, kwargs)
        sums_of = set(low._step.compute_graph.outputs)
        made: dict[tuple[int, int], jax.Array] = {}  # (micro-batch, value) → array
        sums: dict[int, jax.Array] = {}
        placed: dict = {}  # (argument, sharding) → the argument on a stage: once per call, not per micro-batch
        batch = {i for i, role in enumerate(low.plan.arg_roles) if role == "batch"}

        p = len(low.stages)

        def to_stage(x, stage: int, sharding: NamedSharding) -> jax.Array:
            if isinstance(x, jax.Array) and transfer.needed(x, sharding):  # another process's devices
                return transfer.to_stage(x, low.mesh, p, stage, sharding)
            return jax.device_put(x, sharding)

        def put(i: int, mb: int, stage: int, sharding: NamedSharding) -> jax.Array:
            if i in batch:
                return to_stage(micro[mb][i], stage, sharding)
            if (i, sharding) not in placed:
                placed[i, sharding] = to_stage(micro[mb][i], stage, sharding)
            return placed[i, sharding]

        def move(x: jax.Array, stage: int, sharding: NamedSharding, planned) -> jax.Array:
            """A value made on `stage` to another stage's program or to apply-gradients."""
            if transfer.needed(x, sharding):
                return transfer.from_stage(x, low.mesh, p, stage, sharding)
            return resharding.reshard(x, sharding, planned) if planned else jax.device_put(x, sharding)

        for task in task_graph.build(low.schedule).order():
            if task.kind not in ("forward", "backward"):
                continue
            prog, run, shardings = self._run["F" if task.kind == "forward" else "B", task.stage]
            n = len(prog.args)
            ins = [put(i, task.micro_batch, task.stage, sharding) for i, sharding in zip(prog.args, shardings)]
            for k, v in enumerate(prog.inputs):  # across meshes by cross-mesh resharding, else device_put
                key = (self._stage_of[v], task.stage, v, prog.kind)
                ins.append(move(made[task.micro_batch, v], self._stage_of[v], shardings[n + k], low.transfers.get(key)))
            outs = run(*ins)
            for v, out in zip(prog.outputs, outs):
                made[task.micro_batch, v] = out
                if v in sums_of:
                    sums[v] = out if v not in sums else self._add(sums[v], out)
        whole = jax.device_put(jax.tree.leaves((args, kwargs)), self._apply_in[:len(micro[0])])
        totals = [move(sums[v], self._stage_of[v], sharding, None)
                  for v, sharding in zip(low._step.compute_graph.outputs, self._apply_in[len(whole):])]
        out = self._apply(*whole, *totals)
        return jax.tree.unflatten(low._trees[1], list(out))

    def compiled_step_s(self, cluster=None) -> float:
        """The step's time with each stage program and apply-gradients priced from what XLA
        compiled (`compiled_cost.price_compiled`: its cost analysis and the collectives it
        emits) in the plan's schedule, with the plan's transfers: the prediction's check."""
        low = self._lowered
        cluster = cluster or low.cluster
        price = {key: price_compiled(run, cluster).total_s for key, (_, run, _) in self._run.items()}
        p = len(low.stages)
        steps = low.schedule.makespan([price["F", s] for s in range(p)], [price["B", s] for s in range(p)],
                                      low.plan.search_stats["transfer_s"])
        return steps + sum(low.moves_s) + price_compiled(self._apply, cluster).total_s

    def report(self) -> str:
        return (f"{self.plan.report()}\n\nstep priced from the compiled programs: {self.compiled_step_s() * 1e3:.3f} ms "
                f"(predicted {self.plan.cost.total_s * 1e3:.3f} ms)")

