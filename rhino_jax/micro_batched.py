"""`num_micro_batches=k` without pipelining (Rhino Fig. 6(b)): the step runs as k micro-batches of
compute-gradients, their sums added up on the devices, then one apply-gradients
(`hlo_passes.micro_batch`: the boundary is where data parallelism would all-reduce, so the
numbers are the whole batch's whatever the loss).

Each program is planned by the SPMD search on the mesh. Compute-gradients is planned first;
apply-gradients then takes the parameters, the optimizer state's counterparts it shares, and the
sums in the layouts compute-gradients uses (pins), so nothing moves between the programs, and its
outputs fed back to the next step keep those layouts too.
"""
from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh

from rhino_jax.core.plan import Plan, PlanCost
from rhino_jax.hlo_passes.graph import Graph, Pin
from rhino_jax.hlo_passes.lowering import program_target, step_target
from rhino_jax.runtime.compiled.compiled_cost import price_compiled
from rhino_jax.search import interrupt
from rhino_jax.search.cost.cluster import MeshTopology, get_cluster
from rhino_jax.search.cost.memory import beside_bytes

from .arguments import Call, call_tree
from .gpu_topology import refuse_described
from .mesh_search import plan_on
from .options import Options, budget_of, device_memory, within
from .several_programs import (APPLY_WEIGHT, SeveralPrograms, SeveralProgramsLowered, _compile, accumulated, add_up,
                               flat_call, micro_batches_of, named, priced_line, priced_s, program_plan, say_step,
                               searched_alone, split_step, summed_bytes, with_index)


class MicroBatchedLowered(SeveralProgramsLowered):
    """A step lowered for k micro-batches: `plan` sums up both programs; `programs` holds each."""

    @interrupt.session()  # its searches stop together at Ctrl-C, every plan marked interrupted
    def __init__(self, call: Call, mesh: Mesh, options: Options, signature, given: Plan | None = None,
                 named_on: Mesh | None = None):
        """`given`: a saved plan of this step to run instead of searching (`parallelize(plan=...)`).
        `named_on`: the user's mesh (Explicit axes), which the step's layouts name (`mesh` is its
        Auto twin, the programs' own)."""
        k = options.num_micro_batches
        step = split_step(call, mesh, k, options.constraints)
        whole, parts, apply_graph = step.whole, step.parts, step.apply_graph
        compute_graph = _with_sums_beside(step.compute_graph, options.accumulation_dtype)
        target = step_target(whole, mesh, step.donated)
        if given is not None:
            given.check_matches(target)
        cluster = get_cluster(options.cluster, list(mesh.devices.flat))
        topo = MeshTopology.from_mesh(mesh, cluster)

        budget = budget_of(options, len(compute_graph.nodes) + APPLY_WEIGHT * len(apply_graph.nodes))

        def plan(name: str, module, graph: Graph, weight: float) -> Plan:
            return program_plan(name, program_target(module, graph, mesh), given, lambda: searched_alone(
                graph, plan_on(graph, topo, cluster, within(options, budget, weight * len(graph.nodes), name), mesh)))

        compute_plan = plan("compute_gradients", parts.compute, compute_graph, 1)
        apply_graph = dataclasses.replace(apply_graph, pins=apply_graph.pins + _same_layouts(
            apply_graph, compute_graph, compute_plan))
        apply_plan = plan("apply_gradients", parts.apply, apply_graph, APPLY_WEIGHT)
        self.mesh, self.k, self._signature, self.cluster = mesh, k, signature, cluster
        self.memory_limit_bytes = device_memory(options, mesh.devices.flat)
        self.named_on = named_on or mesh
        self._step, self._parts, self._graphs = step, parts, (compute_graph, apply_graph)
        self._trees = (jax.tree.structure((call.args, call.kwargs)), whole.lowered.out_tree)
        self.programs = {"compute_gradients": compute_plan, "apply_gradients": apply_plan}
        self.accumulate = options.accumulation_dtype
        summary = _summary(compute_plan, apply_plan, k, compute_graph, self.named_on, self._trees)
        self.plan = dataclasses.replace(summary,
                                        programs=self.programs, target=target)
        say_step(self.plan, f"{k} micro-batches")

    def _compile_with(self, compiler_options: dict | None) -> "MicroBatchedCompiled":
        return MicroBatchedCompiled(self, compiler_options)


def _with_sums_beside(graph: Graph, accumulate: str | None) -> Graph:
    """Compute-gradients' graph with the running sums its outputs are added to marked as held
    beside them (`Graph.outputs_held_beside`, in the accumulation dtype): the sums stay live
    while each micro-batch runs, so a memory limit on the program keeps the step within it."""
    held = tuple(summed_bytes(v.nbytes, v.dtype, accumulate) // v.nbytes if v.nbytes else 1
                 for v in (graph.values[o] for o in graph.outputs))
    return dataclasses.replace(graph, outputs_held_beside=held)


def _same_layouts(apply_graph: Graph, compute_graph: Graph, compute_plan: Plan) -> tuple[Pin, ...]:
    """Pins for apply-gradients: each argument compute-gradients reads (the parameters, not the
    batch) and each sum, in the layout compute-gradients gives it."""
    read = compute_graph.consumers()
    n = len(compute_graph.args)
    pins = [Pin(a.value, compute_plan.arg_specs[a.index].dims, a.path) for a in apply_graph.args[:n]
            if a.role != "batch" and read[compute_graph.args[a.index].value]]
    pins += [Pin(a.value, compute_plan.output_specs[a.index - n].dims, a.path) for a in apply_graph.args[n:]]
    return tuple(pins)


def _summary(compute: Plan, apply: Plan, k: int, compute_graph: Graph, mesh: Mesh, trees) -> Plan:
    """One Plan for the step: apply-gradients' (the step's arguments and outputs, the search
    statistics: compute-gradients' stay with its plan, in `programs`), its cost k
    compute-gradients and one apply, the batch in compute-gradients' layout (per micro-batch);
    compute-gradients' memory counts the running sums beside it (`_with_sums_beside`). The
    per-value layouts stay with the programs' plans (`programs`), not repeated here (a saved plan
    would hold them twice)."""
    c, a = compute.cost, apply.cost
    sums = beside_bytes(compute_graph, compute.arg_specs, compute.output_specs, compute.mesh_axes)
    cost = PlanCost(k * c.compute_s + a.compute_s, k * c.comm_s + a.comm_s, k * c.total_s + a.total_s,
                    max(c.memory_bytes + sums, a.memory_bytes), k * c.hidden_s + a.hidden_s)
    n = len(compute_graph.args)
    specs = tuple(compute.arg_specs[i] if r == "batch" else apply.arg_specs[i] for i, r in enumerate(apply.arg_roles[:n]))
    return dataclasses.replace(
        apply, arg_paths=apply.arg_paths[:n], arg_roles=apply.arg_roles[:n], arg_shapes=apply.arg_shapes[:n],
        arg_dtypes=apply.arg_dtypes[:n], arg_specs=specs, value_specs={}, read_specs={}, read_paths={}, cost=cost,
        collectives=compute.collectives * k + apply.collectives,
        execution=dataclasses.replace(apply.execution, micro_batches=k),
        input_shardings=call_tree(trees[0], named(mesh, specs)),
        output_shardings=jax.tree.unflatten(trees[1], named(mesh, apply.output_specs)))


class MicroBatchedCompiled(SeveralPrograms):
    """The two programs compiled; call it like the step (same pytrees, the whole batch)."""

    def __init__(self, lowered: MicroBatchedLowered, compiler_options: dict | None = None):
        self._lowered, self.plan = lowered, lowered.plan
        mesh = lowered.mesh
        compute_plan, apply_plan = lowered.programs["compute_gradients"], lowered.programs["apply_gradients"]
        compute_graph, apply_graph = lowered._graphs
        limit = lowered.memory_limit_bytes
        self._compute, self._index = _compile(lowered._parts.compute, compute_graph, compute_plan, mesh,
                                              compiler_options=compiler_options, memory_limit_bytes=limit,
                                              cluster=lowered.cluster)
        self._apply, _ = _compile(lowered._parts.apply, apply_graph, apply_plan, mesh, lowered._step.donated,
                                  returned_on=lowered.named_on, compiler_options=compiler_options,
                                  memory_limit_bytes=limit, cluster=lowered.cluster)
        sums = named(mesh, compute_plan.output_specs)
        wide = [accumulated(compute_graph.values[v].dtype, lowered.accumulate) for v in compute_graph.outputs]
        self._start = jax.jit(lambda b: [x.astype(d) for x, d in zip(b, wide)], out_shardings=sums)
        self._add = jax.jit(lambda a, b: [add_up(x, y) for x, y in zip(a, b)], out_shardings=sums, donate_argnums=0)
        narrow = [compute_graph.values[v].dtype for v in compute_graph.outputs]
        self._end = jax.jit(lambda a: [x.astype(d) for x, d in zip(a, narrow)], out_shardings=sums)
        self._compute_in = named(mesh, compute_plan.arg_specs)
        self._apply_in = named(mesh, apply_plan.arg_specs)
        self.programs = {"compute_gradients": self._compute, "apply_gradients": self._apply}

    def __call__(self, *args, **kwargs):
        low = self._lowered
        refuse_described(low.mesh)
        total = None
        for i, flat in enumerate(micro_batches_of(low, args, kwargs)):
            part = self._compute(*with_index(jax.device_put(flat, self._compute_in), self._index, i))
            total = self._start(list(part)) if total is None else self._add(total, list(part))
        whole = flat_call(args, kwargs)
        n = len(whole)
        out = self._apply(*jax.device_put(whole, self._apply_in[:n]), *self._end(total))
        return low.returned(out)

    def compiled_step_s(self, cluster=None, overlapped: bool = True) -> float:
        """The step's time with both programs priced from what XLA compiled
        (`compiled_cost.price_compiled`): k compute-gradients and one apply-gradients, each as its
        schedule overlaps communication with compute (`overlapped=False`: their serial sums)."""
        cluster = cluster or self._lowered.cluster
        return (self._lowered.k * priced_s(price_compiled(self._compute, cluster), overlapped)
                + priced_s(price_compiled(self._apply, cluster), overlapped))

    def report(self) -> str:
        return "\n\n".join([self.plan.report()] + [f"{name}:\n{plan.report()}"
                                                   for name, plan in self._lowered.programs.items()]
                             + [priced_line(self.compiled_step_s, self.plan)])
