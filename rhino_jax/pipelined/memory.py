"""What a pipeline's stage holds per device beside the program it runs: the micro-batches in
flight, the running sums, what the places sharing its devices hold."""
from __future__ import annotations

from jax.sharding import Mesh

from rhino_jax.search.cost.memory import local_bytes

from ..several_programs import summed_bytes


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
    `accumulate`'s dtype where given (`several_programs.summed_bytes`)."""
    program, graph, plan = planned
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    return sum(summed_bytes(local_bytes(graph, out, spec, sizes), graph.values[out].dtype, accumulate)
               for v, out, spec in zip(program.outputs, graph.outputs, plan.output_specs) if v in wanted)
