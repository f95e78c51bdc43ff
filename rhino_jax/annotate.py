"""rj.annotate: pin one tensor's sharding inside the user's step."""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec

from .errors import ShardingPinError


def annotate(x: jax.Array, spec: PartitionSpec, name: str | None = None) -> jax.Array:
    """Pin `x` to `spec` on the mesh the step is parallelized over; the search obeys it.

    Outside `rj.parallelize` (no mesh in context) it returns `x` unchanged, so the same step
    still runs on one device. `name` labels the pin in errors and reports."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return x
    if not hasattr(x, "shape") or not hasattr(x, "ndim"):
        raise ShardingPinError(f"annotate{f'({name})' if name else ''}: x must be one array, got a "
                               f"{type(x).__name__}; annotate each array of a pytree on its own, e.g. "
                               "jax.tree.map(lambda a: rj.annotate(a, spec), tree)")
    label = name or f"tensor of shape {tuple(x.shape)}"
    if not isinstance(spec, (PartitionSpec, tuple, list)):
        raise ShardingPinError(f"annotate({label}): spec must be a PartitionSpec, e.g. P('data', None) for a "
                               f"rank-2 tensor split on its first dim; got {spec!r} (to leave the tensor to the "
                               "search, do not annotate it)")
    spec = PartitionSpec(*spec)
    if len(spec) > x.ndim:
        raise ShardingPinError(f"annotate({label}): spec {spec} has {len(spec)} entries for a rank-{x.ndim} tensor")
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    for dim, entry in enumerate(spec):
        axes = () if entry is None or entry is PartitionSpec.UNCONSTRAINED else (
            entry if isinstance(entry, tuple) else (entry,))
        for a in axes:
            if a not in sizes:
                raise ShardingPinError(f"annotate({label}): the mesh has no axis {a!r} "
                                       f"(its axes are {list(sizes)})")
        n = int(np.prod([sizes[a] for a in axes]))
        if x.shape[dim] % n:
            raise ShardingPinError(
                f"annotate({label}): dim {dim} of shape {tuple(x.shape)} has size {x.shape[dim]}, which "
                f"mesh axes {axes} ({n} devices) do not divide; change the spec or the mesh")
    if name:
        with jax.named_scope(name):
            return jax.lax.with_sharding_constraint(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)
