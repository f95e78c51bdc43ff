"""What a plan was made for: the program and the mesh, so a saved plan is never applied to another.

A plan names values by their position in the imported module and layouts by mesh axes, so it
only means something for the program it was searched on and a mesh of the same axes; laid on
other devices it would also move data the user did not expect. A target records a hash of
the step's StableHLO (as lowered for the search, before the plan's shardings), its arguments'
paths, shapes and dtypes, which are donated, and the mesh's shape, axis names, platform and
process layout (which process holds each device). Device ids are not compared: a plan made for a
described cluster (`rj.gpu_topology`) runs on a real one of the same shape, whose ids differ. A
consumer builds the target of what it is about to run and calls `Plan.check_matches`, which names
the first difference and what to change. The targets are built where the step is lowered
(`hlo_passes.lowering.step_target`, `program_target`); this is what they hold and how two differ.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from rhino_jax.errors import RhinoError


class PlanTargetError(RhinoError, ValueError):
    """A saved plan was made for another program or mesh than the one it is applied to."""


@dataclass(frozen=True)
class PlanTarget:
    program: str  # sha256 of the step's StableHLO as the search read it (`module.fingerprint`)
    arg_paths: tuple[str, ...]
    arg_shapes: tuple[tuple[int, ...], ...]
    arg_dtypes: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    platform: str  # the devices' ("gpu", "cpu"): XLA compiles the program differently for each
    processes: tuple[int, ...]  # the process of each of the mesh's devices, row-major
    jax_version: str  # the program's text may change with jax: named in the error when it differs
    # the flat arguments donated (`arguments.donated_leaves`): the search ties a donated
    # argument's layout to its output's, so a plan made otherwise would not reuse the buffers
    donated: tuple[int, ...] = ()

    def mismatch(self, other: "PlanTarget") -> str | None:
        """Why a plan made for this target cannot run on `other`, or None when it can."""
        mine = dict(zip(self.axis_names, self.mesh_shape))
        theirs = dict(zip(other.axis_names, other.mesh_shape))
        if mine != theirs or self.axis_names != other.axis_names:
            return (f"the plan was made for the mesh {_axes(mine)} and is applied to {_axes(theirs)}; build the mesh "
                    f"as rj.device_mesh({self.mesh_shape}, {self.axis_names}) or plan again")
        if self.platform != other.platform:
            return (f"the plan was made for {self.platform} devices and is applied to {other.platform} devices, "
                    f"which XLA compiles for otherwise; build the mesh of {self.platform} devices or plan again")
        if self.processes != other.processes:
            return (f"the plan was made for a mesh whose devices lie in the processes {_runs(self.processes)} "
                    f"(row-major) and is applied to one of {_runs(other.processes)}; build the mesh with each "
                    "process's devices where the plan had them (rj.device_mesh(shape, names, devices=...)) or plan "
                    "again")
        if len(self.arg_paths) != len(other.arg_paths):
            return (f"the plan was made for a step of {len(self.arg_paths)} array arguments and is applied to one "
                    f"of {len(other.arg_paths)}; plan again for these arguments")
        for path, shape, dtype, p, s, d in zip(self.arg_paths, self.arg_shapes, self.arg_dtypes,
                                               other.arg_paths, other.arg_shapes, other.arg_dtypes):
            if (path, shape, dtype) != (p, s, d):
                return (f"argument {p} is {d}{list(s)}, the plan was made for {path} {dtype}{list(shape)}; pass "
                        "arguments of the planned shapes or plan again for these")
        if self.donated != other.donated:
            return (f"the plan was made with the arguments {_paths(self)} donated and is applied with "
                    f"{_paths(other)} donated; pass the same donate_argnums or plan again")
        if self.program != other.program:
            version = (f" (the plan was made under jax {self.jax_version}, this is jax {other.jax_version})"
                       if self.jax_version != other.jax_version else "")
            return ("the step's program differs from the one the plan was made for, though its arguments match "
                    f"(changed code, closed-over values or static arguments){version}; plan again")
        return None


def _runs(processes: tuple[int, ...]) -> str:
    """[0 x8, 1 x8] for sixteen devices of two processes: a process layout in a line."""
    runs: list[list[int]] = []
    for p in processes:
        if runs and runs[-1][0] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return "[" + ", ".join(f"{p} x{n}" for p, n in runs) + "]"


def _axes(axes: dict[str, int]) -> str:
    return "(" + ", ".join(f"{a}={n}" for a, n in axes.items()) + ")"


def _paths(target: PlanTarget) -> str:
    """The donated arguments, one entry per argument of the step (donate_argnums names those), not
    one per array: a train state donated is hundreds of arrays."""
    counts: dict[str, int] = {}
    for i in target.donated:
        top = re.match(r"arg\[[^\]]*\]", target.arg_paths[i])
        key = top.group(0) if top else target.arg_paths[i]
        counts[key] = counts.get(key, 0) + 1
    return "[" + ", ".join(key if n == 1 else f"{key} ({n} arrays)" for key, n in counts.items()) + "]"
