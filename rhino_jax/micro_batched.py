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
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from rhino_jax.hlo_passes import micro_batch
from rhino_jax.hlo_passes import rewrite as rewrite_pass
from rhino_jax.hlo_passes.graph import Graph, Pin
from rhino_jax.hlo_passes.compiled_cost import price_compiled
from rhino_jax.hlo_passes.importer import import_module
from rhino_jax.hlo_passes.lowering import LoweredStep, lower_on_mesh
from rhino_jax.hlo_passes.module import copy_module
from rhino_jax.runtime.executable import compile_program
from rhino_jax.search import interrupt
from rhino_jax.search.cluster import MeshTopology, get_cluster

from .errors import MeshError
from .mesh_search import plan_on
from .options import Options
from .plan import Plan, PlanCost


def micro_batch_args(args, roles: Sequence[str], k: int, paths: Sequence[str]) -> list[list]:
    """The flat arguments of each of k micro-batches: batch leaves cut along their first dim."""
    leaves = jax.tree.leaves(args)
    for x, role, path in zip(leaves, roles, paths):
        if role == "batch" and (not np.ndim(x) or np.shape(x)[0] % k):
            raise MeshError(f"num_micro_batches={k} does not divide the batch dim of {path} (shape {np.shape(x)}); "
                            "use a number of micro-batches that divides the batch size")
    return [[_piece(x, i, k) if role == "batch" else x for x, role in zip(leaves, roles)] for i in range(k)]


def micro_batches_of(lowered, args) -> list[list]:
    """The flat arguments of each micro-batch of a call, after checking the call's pytree."""
    tree = lowered._trees[0]
    if jax.tree.structure(args) != tree:
        raise TypeError(f"function compiled for arguments of structure {tree}, called with {jax.tree.structure(args)}")
    return micro_batch_args(args, lowered.plan.arg_roles, lowered.k, lowered.plan.arg_paths)


def named(mesh: Mesh, specs) -> list[NamedSharding]:
    return [NamedSharding(mesh, s.to_partition_spec()) for s in specs]


def _piece(x, i: int, k: int):
    """The i-th of k pieces of x along its first dim (of its shape alone, for an abstract x)."""
    b = np.shape(x)[0] // k
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((b,) + tuple(x.shape[1:]), x.dtype)
    return x[i * b:(i + 1) * b]


def _abstract(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x))


@dataclass(frozen=True)
class SplitStep:
    """A step lowered for the whole batch and for one micro-batch, and cut at its sums."""

    whole: LoweredStep
    parts: micro_batch.MicroSplit
    compute_graph: Graph  # compute-gradients' graph: the step's arguments → the sums
    apply_graph: Graph  # apply-gradients': the step's arguments and the sums → the outputs


def split_step(fn, args, mesh: Mesh, k: int, donate_argnums: tuple[int, ...] = ()) -> SplitStep:
    if donate_argnums:
        warnings.warn(f"donate_argnums={donate_argnums} is not used with micro-batches or pipeline stages yet: "
                      "the updated state comes back in new buffers (more memory, same numbers)", stacklevel=4)
    whole = lower_on_mesh(fn, args, mesh, ())
    flat_micro = micro_batch_args(jax.tree.map(_abstract, args), whole.arg_roles, k, whole.arg_paths)[0]  # shapes
    micro = lower_on_mesh(fn, jax.tree.unflatten(jax.tree.structure(args), flat_micro), mesh, ())
    graph = import_module(whole.module, whole.arg_paths, whole.arg_roles, whole.output_paths)
    micro_graph = import_module(micro.module, micro.arg_paths, micro.arg_roles, micro.output_paths)
    parts = micro_batch.split(whole.module, graph, micro.module, micro_graph)
    names = [f"sum[{i}]" for i in range(len(parts.boundary))]
    return SplitStep(whole, parts, import_module(parts.compute, whole.arg_paths, whole.arg_roles, names),
                     import_module(parts.apply, whole.arg_paths + names,
                                   whole.arg_roles + ["other"] * len(names), whole.output_paths))


class MicroBatchedLowered:
    """A step lowered for k micro-batches: `plan` sums up both programs; `programs` holds each."""

    @interrupt.session()  # its searches stop together at Ctrl-C, every plan marked interrupted
    def __init__(self, fn, args, mesh: Mesh, donate_argnums: tuple[int, ...], options: Options, signature):
        k = options.num_micro_batches
        step = split_step(fn, args, mesh, k, donate_argnums)
        whole, parts, compute_graph, apply_graph = step.whole, step.parts, step.compute_graph, step.apply_graph
        cluster = get_cluster(options.cluster)
        topo = MeshTopology.from_mesh(mesh, cluster)
        compute_plan = plan_on(compute_graph, topo, cluster, options)
        apply_graph = dataclasses.replace(apply_graph, pins=apply_graph.pins + _same_layouts(
            apply_graph, compute_graph, compute_plan))
        apply_plan = plan_on(apply_graph, topo, cluster, options)
        self.mesh, self.k, self._signature, self.cluster = mesh, k, signature, cluster
        self._parts, self._graphs = parts, (compute_graph, apply_graph)
        self._trees = (jax.tree.structure(args), whole.lowered.out_tree)
        self.programs = {"compute_gradients": compute_plan, "apply_gradients": apply_plan}
        self.plan = _summary(compute_plan, apply_plan, k, compute_graph, mesh, self._trees)
        self._compiled: MicroBatchedCompiled | None = None

    def compile(self) -> "MicroBatchedCompiled":
        if self._compiled is None:
            self._compiled = MicroBatchedCompiled(self)
        return self._compiled


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
    """One Plan for the step: apply-gradients' (the step's arguments and outputs), its cost k
    compute-gradients and one apply, the batch in compute-gradients' layout (per micro-batch);
    compute-gradients' memory counts the running sums beside it."""
    c, a = compute.cost, apply.cost
    sums = sum(compute_graph.values[v].nbytes // s.shard_factor(compute.mesh_axes)
               for v, s in zip(compute_graph.outputs, compute.output_specs))
    cost = PlanCost(k * c.compute_s + a.compute_s, k * c.comm_s + a.comm_s, k * c.total_s + a.total_s,
                    max(c.memory_bytes + sums, a.memory_bytes), k * c.hidden_s + a.hidden_s)
    n = len(compute_graph.args)
    specs = tuple(compute.arg_specs[i] if r == "batch" else apply.arg_specs[i] for i, r in enumerate(apply.arg_roles[:n]))
    stats = dict(apply.search_stats, micro_batches=k, compute_gradients=compute.search_stats,
                 status=apply.search_stats.get("status"))
    return dataclasses.replace(
        apply, arg_paths=apply.arg_paths[:n], arg_roles=apply.arg_roles[:n], arg_shapes=apply.arg_shapes[:n],
        arg_dtypes=apply.arg_dtypes[:n], arg_specs=specs, cost=cost, collectives=compute.collectives * k + apply.collectives,
        search_stats=stats, input_shardings=jax.tree.unflatten(trees[0], named(mesh, specs)),
        output_shardings=jax.tree.unflatten(trees[1], named(mesh, apply.output_specs)))


class MicroBatchedCompiled:
    """The two programs compiled; call it like the step (same pytrees, the whole batch)."""

    def __init__(self, lowered: MicroBatchedLowered):
        self._lowered, self.plan = lowered, lowered.plan
        mesh = lowered.mesh
        compute_plan, apply_plan = lowered.programs["compute_gradients"], lowered.programs["apply_gradients"]
        compute_graph, apply_graph = lowered._graphs
        self._compute = _compile(lowered._parts.compute, compute_graph, compute_plan, mesh)
        self._apply = _compile(lowered._parts.apply, apply_graph, apply_plan, mesh)
        self._add = jax.jit(lambda a, b: [x + y for x, y in zip(a, b)], out_shardings=named(mesh, compute_plan.output_specs),
                            donate_argnums=0)
        self._compute_in = named(mesh, compute_plan.arg_specs)
        self._apply_in = named(mesh, apply_plan.arg_specs)

    def __call__(self, *args):
        low = self._lowered
        total = None
        for flat in micro_batches_of(low, args):
            part = self._compute(*jax.device_put(flat, self._compute_in))
            total = list(part) if total is None else self._add(total, list(part))
        whole = jax.tree.leaves(args)
        n = len(whole)
        out = self._apply(*jax.device_put(whole, self._apply_in[:n]), *total)
        return jax.tree.unflatten(low._trees[1], list(out))

    def compiled_step_s(self, cluster=None) -> float:
        """The step's time with both programs priced from what XLA compiled
        (`compiled_cost.price_compiled`): k compute-gradients and one apply-gradients."""
        cluster = cluster or self._lowered.cluster
        return (self._lowered.k * price_compiled(self._compute, cluster).total_s
                + price_compiled(self._apply, cluster).total_s)

    def report(self) -> str:
        return "\n\n".join([self.plan.report()] + [f"{name}:\n{plan.report()}"
                                                   for name, plan in self._lowered.programs.items()]
                             + [f"step priced from the compiled programs: {self.compiled_step_s() * 1e3:.3f} ms "
                                f"(predicted {self.plan.cost.total_s * 1e3:.3f} ms)"])


def _compile(module, graph: Graph, plan: Plan, mesh: Mesh) -> jax.stages.Compiled:
    """A program of the step with its plan's shardings, compiled for the mesh."""
    rewritten = rewrite_pass.rewrite(copy_module(module), graph, plan.value_specs, plan.read_specs, plan.read_paths,
                                     plan.arg_specs, plan.output_specs, plan.mesh_axes)
    aval = lambda v: jax.ShapeDtypeStruct(graph.values[v].shape, graph.values[v].dtype)  # noqa: E731
    return compile_program(rewritten, [aval(a.value) for a in graph.args], [aval(v) for v in graph.outputs],
                           named(mesh, plan.arg_specs), named(mesh, plan.output_specs))

