"""What moves between a pipeline's places: each tensor one stage hands another by cross-mesh
resharding (after "On Optimizing the Communication of Model Parallelism"), planned once and
priced, a micro-batch's across the busiest boundary; and once per step the arguments a program
reads elsewhere, the sums apply-gradients takes from other stages, the outputs returned."""
from __future__ import annotations

import numpy as np
from jax.sharding import Mesh, NamedSharding

from rhino_jax.core.specs import ShardingSpec
from rhino_jax.runtime import resharding
from rhino_jax.search.cost.cluster import host_ids

from ..several_programs import named
from .programs import Planned


def _shardings(layouts: list[tuple[Mesh, ShardingSpec]]) -> list[NamedSharding]:
    return [NamedSharding(mesh, spec.to_partition_spec()) for mesh, spec in layouts]


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
