"""`rj.diff`: two plans of one step compared, layout by layout (by which device holds which
slice, so one split named on two meshes is one layout) and cost by cost."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from rhino_jax.core.plan import Plan, PlanCost, as_plan
from rhino_jax.core.plan_file import mesh_label
from rhino_jax.core.specs import ShardingSpec
from rhino_jax.hlo_passes.graph import dtype_size

from .plan_view import arg_meshes, bytes_text, holdings, ms_text, plan_axes, positions


MAX_ROWS = 20  # layouts rj.diff lists; the rest are counted


@dataclass(frozen=True)
class LayoutChange:
    """One argument laid out differently by two plans."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    a: ShardingSpec
    b: ShardingSpec


@dataclass(frozen=True)
class PlanDiff:
    """`rj.diff(a, b)`: print it, or read the changes and the deltas (b minus a)."""

    changes: tuple[LayoutChange, ...]  # held otherwise by the devices; largest argument first
    renamed: tuple[LayoutChange, ...]  # named otherwise (other meshes), each device holding the same slice
    a: PlanCost
    b: PlanCost
    # b minus a
    step_s: float
    compute_s: float
    comm_s: float
    memory_bytes: int
    text: str = field(repr=False)

    def __str__(self) -> str:
        return self.text


def diff(a: Plan | str | os.PathLike, b: Plan | str | os.PathLike) -> PlanDiff:
    """The arguments two plans of one step (each a Plan or the path of a saved one) lay out
    differently, and what b costs more than a (step, compute, communication, memory, collectives
    as XLA combines them). Layouts are compared as the devices hold them (`holdings`): [data+model, -]
    on a (2, 4) mesh and [data, -] on an (8,) mesh of the same devices are one layout. Devices are
    the plans' own (`plan.input_shardings`) where both have them; where one has none (a plan loaded
    from a file, or made for described GPUs and saved) each device is its position in its mesh's
    device order, row-major, as `rj.device_mesh` lays devices out, so two plans are compared as if
    both meshes were built over one list of devices. ValueError for plans of different steps
    (other arguments)."""
    a, b = as_plan(a, "a of rj.diff(a, b)"), as_plan(b, "b of rj.diff(a, b)")
    for what, x, y in (("argument paths", a.arg_paths, b.arg_paths), ("argument shapes", a.arg_shapes, b.arg_shapes),
                       ("argument dtypes", a.arg_dtypes, b.arg_dtypes)):
        if tuple(x) != tuple(y):
            k = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            at = [repr(seq[k]) if k < len(seq) else "nothing" for seq in (x, y)]
            raise ValueError(f"rj.diff compares two plans of one step, but their {what} differ (a has {len(x)}, b "
                             f"{len(y)}; the first difference, at {k}: {at[0]} in a, {at[1]} in b)")
    meshes_a, meshes_b = arg_meshes(a), arg_meshes(b)
    by_ids = meshes_a is not None and meshes_b is not None
    if not by_ids:
        meshes_a, meshes_b = positions(a), positions(b)
    sizes = [int(np.prod(sh, dtype=np.int64)) * dtype_size(dt) for sh, dt in zip(a.arg_shapes, a.arg_dtypes)]
    changes: list[LayoutChange] = []
    renamed: list[LayoutChange] = []
    for i in sorted(range(len(a.arg_paths)), key=lambda i: -sizes[i]):
        if a.arg_specs[i] == b.arg_specs[i] and meshes_a[i] == meshes_b[i]:
            continue
        ch = LayoutChange(a.arg_paths[i], tuple(a.arg_shapes[i]), a.arg_dtypes[i], a.arg_specs[i], b.arg_specs[i])
        if holdings(ch.a, ch.shape, *meshes_a[i]) != holdings(ch.b, ch.shape, *meshes_b[i]):
            changes.append(ch)
        elif ch.a != ch.b:
            renamed.append(ch)
    ca, cb = a.cost, b.cost
    step, compute, comm = cb.total_s - ca.total_s, cb.compute_s - ca.compute_s, cb.comm_s - ca.comm_s
    memory = cb.memory_bytes - ca.memory_bytes
    lines = [f"plan {x}: mesh {mesh_label(p.mesh_axes)}, {p.opt_level}, step {ms_text(p.cost.total_s)}, "
             f"{p.cost.memory_bytes / 2**20:.2f} MiB/device" for x, p in (("a", a), ("b", b))]
    lines.append(f"b - a: step {ms_text(step, sign=True)} ({step / ca.total_s:+.1%}), compute {ms_text(compute, sign=True)}, "
                 f"communication {ms_text(comm, sign=True)}, memory {memory / 2**20:+.2f} MiB/device")
    sa, sb = a.collective_summary(), b.collective_summary()
    moved = [f"{kind} {sa.get(kind, (0, 0))[0]} → {sb.get(kind, (0, 0))[0]} ops, "
             f"{bytes_text(sa.get(kind, (0, 0))[1])} → {bytes_text(sb.get(kind, (0, 0))[1])}"
             for kind in sorted(set(sa) | set(sb)) if sa.get(kind) != sb.get(kind)]
    lines.append("collectives (as XLA combines them): " + ("; ".join(moved) or "the same"))
    devices = "device ids of the plans' meshes" if by_ids else "devices by their position in each mesh, row-major"
    lines.append(f"layouts that differ (which device holds which slice; {devices}): {len(changes)} of "
                 f"{len(a.arg_paths)} arguments" + (" (largest first):" if changes else ""))
    lines += _rows(changes[:MAX_ROWS], len(changes))
    if renamed:
        ch = renamed[0]
        lines.append(f"named otherwise, laid out alike: {len(renamed)} arguments (each device holds the same slice), "
                     f"e.g. {ch.path} {ch.a} on {mesh_label(plan_axes(a))}, {ch.b} on {mesh_label(plan_axes(b))}")
    return PlanDiff(tuple(changes), tuple(renamed), ca, cb, step, compute, comm, memory, "\n".join(lines))


def _rows(shown: list[LayoutChange], total: int) -> list[str]:
    """The changes shown, one a line, and how many more of `total` there are."""
    width = max((len(ch.path) for ch in shown), default=0)
    rows = [f"  {ch.path:<{width}}  {str(ch.shape):<16} {str(ch.a):<16} → {ch.b}" for ch in shown]
    return rows + ([f"  ... and {total - len(shown)} more"] if total > len(shown) else [])
