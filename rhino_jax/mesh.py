"""Device meshes with Auto axes: the only kind that accepts the sharding constraints we add."""
from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from .errors import MeshError


def device_mesh(shape: Sequence[int], axis_names: Sequence[str], devices: Sequence | None = None) -> Mesh:
    """A `jax.sharding.Mesh` of `shape` over `devices` (default: all), every axis Auto.

    Inner (later) axes take consecutive devices, so on a multi-host cluster put the axes that
    should stay inside a host last."""
    if not isinstance(shape, (Sequence, np.ndarray)) or not all(isinstance(s, (int, np.integer)) for s in shape):
        raise MeshError(f"mesh shape must be a tuple of sizes, one per axis, e.g. (8,) or (2, 4); got {shape!r}")
    shape = tuple(int(s) for s in shape)
    if not shape or any(s < 1 for s in shape):
        raise MeshError(f"mesh shape must be positive sizes, one per axis, e.g. (2, 4); got {shape}")
    if isinstance(axis_names, str) or not isinstance(axis_names, Sequence):
        raise MeshError(f"axis_names must be a tuple of names, one per axis, e.g. ('data',) or ('data', 'model'); "
                        f"got {axis_names!r}")
    axis_names = tuple(axis_names)
    if len(shape) != len(axis_names):
        raise MeshError(f"mesh shape {shape} has {len(shape)} axes but {len(axis_names)} names {axis_names}")
    if len(set(axis_names)) != len(axis_names):
        raise MeshError(f"mesh axis names must be distinct, got {axis_names}")
    devices = list(jax.devices() if devices is None else devices)
    if len({d.id for d in devices}) != len(devices):
        raise MeshError("devices repeat: a mesh needs distinct devices, e.g. jax.devices()[:8]")
    n = int(np.prod(shape))
    if n != len(devices):
        fewer = f"pass devices=jax.devices()[:{n}] or " if n < len(devices) else ""  # never more than there are
        raise MeshError(f"mesh shape {shape} needs {n} devices but {len(devices)} are given; "
                        f"{fewer}pass a shape whose product is {len(devices)}")
    return Mesh(np.array(devices, dtype=object).reshape(shape), axis_names,
                axis_types=(AxisType.Auto,) * len(shape))


def auto_axes(mesh: Mesh) -> Mesh:
    """`mesh` with every axis Auto (the same devices and axis names): the kind of mesh the plan's
    added sharding constraints need. An Explicit mesh (`jax.make_mesh`'s default) is planned on
    this twin, and the plan's shardings name the user's mesh again."""
    if any(t == AxisType.Manual for t in mesh.axis_types):
        raise MeshError("the mesh has Manual axes (shard_map's): parallelize the step outside shard_map, on a "
                        "mesh of Auto or Explicit axes (jax.make_mesh(shape, names) or rj.device_mesh(shape, names))")
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def context_mesh() -> Mesh | None:
    """The mesh `jax.set_mesh` put in context, if any."""
    mesh = jax.sharding.get_mesh()
    return None if mesh is None or mesh.empty else mesh
