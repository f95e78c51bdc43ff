"""A pipelined step run: its programs compiled on their sub-meshes, dispatched as the task graph
orders them (jax's asynchronous dispatch overlaps the stages), each program's inputs put on its
sub-mesh; between processes, moves are SPMD programs (`runtime.transfer`)."""
from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding

from rhino_jax.core.plan import program_name
from rhino_jax.runtime import resharding, task_graph, transfer
from rhino_jax.runtime.compiled.compiled_cost import price_compiled

from ..gpu_topology import refuse_described
from ..several_programs import (SeveralPrograms, SeveralProgramsLowered, _compile, accumulated, add_up, flat_call,
                                micro_batches_of, named, priced_line, priced_s, with_index)


class PipelinedCompiled(SeveralPrograms):
    """The stage programs and apply-gradients' programs compiled; call it like the step."""

    def __init__(self, lowered: SeveralProgramsLowered, compiler_options: dict | None = None):
        """`lowered`: the pipelined step (`lowered.PipelinedLowered`), its programs planned."""
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
                                      low.plan.execution.transfer_s)
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
