"""One plan for every process of a jax.distributed job.

Under jax's multi-controller runtime each process lowers, plans and compiles the step itself,
and the compiled programs must be the same SPMD program everywhere. The search is deterministic
for the same program, mesh and options, but a solver that stops at its time limit, or a tie
broken differently, would give processes different plans: their collectives would not match and
the job would hang or compute garbage. So before anything compiles, every process's plan is
hashed (`digest`: the decisions only, not the timings) and the hashes are compared across
processes (`agree`); a mismatch is an error on every process, which says how to make the plans
the same.
"""
from __future__ import annotations

import hashlib

import jax
import numpy as np

from rhino_jax.core.plan import Plan

from .errors import RhinoError


class PlanMismatchError(RhinoError, RuntimeError):
    """The processes of a distributed job found different plans for the same step."""


def digest(plan: Plan) -> str:
    """A hash of what the plan decides (every layout, the mesh, the stages and programs), not of how long the
    search took: equal digests compile to the same program."""
    h = hashlib.sha256()
    for part in _decisions(plan):
        h.update(repr(part).encode())
    return h.hexdigest()


def _decisions(plan: Plan):
    yield plan.mesh_axes, plan.arg_specs, plan.output_specs
    yield sorted(plan.value_specs.items())
    yield sorted(plan.read_specs.items())
    yield sorted(plan.read_paths.items())
    for st in plan.stages:
        yield st.stage, st.devices, digest(st.forward), digest(st.backward) if st.backward else None
    yield sorted((name, digest(program)) for name, program in plan.programs.items())
    yield sorted(plan.placement.items())


def target_digest(plan: Plan) -> str:
    """A hash of what the plan was made for (`plan.target`: the step's program, its arguments'
    shapes and dtypes, the donated ones, the mesh): two processes can find the same layouts for
    different programs, e.g. a batch of another shape, and would then run different programs."""
    return hashlib.sha256(repr(plan.target).encode()).hexdigest()


def _spans_processes(plan: Plan) -> bool:
    """Does the plan's mesh hold devices of other processes? A mesh of this process's own devices
    (e.g. jax.local_devices()) runs a step of this process alone, which the others need not share
    (each process has its own mesh and may run another step, or none, at this point)."""
    if plan.target is None:
        return True
    return any(p != jax.process_index() for p in plan.target.processes)


def agree(plan: Plan) -> None:
    """Raise PlanMismatchError on every process unless all processes hold the same plan made for
    the same step (a no-op in a single-process run and for a mesh of this process's devices). A
    collective for a mesh across processes: every process must call it at the same point."""
    if jax.process_count() == 1 or not _spans_processes(plan):
        return
    from jax.experimental import multihost_utils  # noqa: PLC0415 (only in distributed runs)

    mine = np.frombuffer(bytes.fromhex(target_digest(plan) + digest(plan)), dtype=np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, 64]: target, then plan
    stepped = [p for p in range(every.shape[0]) if not np.array_equal(every[p, :32], every[0, :32])]
    if stepped:
        raise PlanMismatchError(
            f"processes {stepped} lowered a different step than process 0 (its program, the arguments' global "
            "shapes or dtypes, the donated arguments or the mesh differ); every process must run the same code "
            "with the same options and build each argument with the same global shape (e.g. "
            "jax.make_array_from_process_local_data(sharding, local_rows, global_shape))")
    differ = [p for p in range(every.shape[0]) if not np.array_equal(every[p], every[0])]
    if differ:
        raise PlanMismatchError(
            f"processes {differ} found a different plan than process 0 for the same step (other options of "
            "rj.parallelize: opt_level, memory_limit_bytes, num_micro_batches, pipeline, cluster...; or a solver time "
            "limit or a tie broken differently); every process must run the same one. Pass the same options "
            "everywhere, give the search more time (solver_time_limit_s), or plan once and pass the same saved plan "
            "to every process")
