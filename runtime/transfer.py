"""Moving arrays between a pipeline's meshes when they belong to different processes.

jax moves an array between shardings of one device set (`jax.device_put`), and within one process
between any devices; across processes it refuses different device sets (CPU and GPU runtimes). Each
move here is therefore an SPMD program over the whole mesh, which contains every stage's sub-mesh,
compiled and run by XLA on every process alike: XLA's partitioner emits the collectives that carry
the data (the cross-mesh resharding of "On Optimizing the Communication of Model Parallelism", done
by XLA's own transfers). The whole mesh is viewed as (stage, *sub-mesh): its first axis, of size n,
as (p stages, n/p); an array on stage s's sub-mesh is the s-th slice of a stacked [p, ...] array
whose other slices are zeros, made on their devices, so no data moves to build it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

STAGE = "__stage"


def needed(x: jax.Array, destination: NamedSharding) -> bool:
    """Whether `jax.device_put` cannot make this move: another process's devices, another set."""
    return (jax.process_count() > 1
            and set(x.sharding.device_set) != set(destination.device_set))


def to_stage(x: jax.Array, whole: Mesh, p: int, stage: int, destination: NamedSharding) -> jax.Array:
    """x (on the whole mesh) to stage `stage`'s sub-mesh in `destination`'s layout."""
    view = _view(whole, p)
    source = _on_view(x, view, whole)
    stacked = _stacked_spec(destination.spec)
    moved = _place(stage, p, NamedSharding(view, stacked))(source)
    return _slice_of(moved, stage, destination)


def from_stage(x: jax.Array, whole: Mesh, p: int, stage: int, destination: NamedSharding) -> jax.Array:
    """x (on stage `stage`'s sub-mesh) to `destination`: a sharding of the whole mesh, or of
    another stage's sub-mesh (`to` names it)."""
    view = _view(whole, p)
    stacked = _stack(x, view, p, stage)
    if destination.mesh.devices.size == whole.devices.size:
        spec = _on_view_spec(destination.spec, whole.axis_names[0])
        moved = _take(stage, NamedSharding(view, spec))(stacked)
        return jax.make_array_from_single_device_arrays(
            x.shape, destination, [s.data for s in moved.addressable_shards], dtype=x.dtype)
    to = _stage_of(destination, view)
    moved = _take_place(stage, to, p, NamedSharding(view, _stacked_spec(destination.spec)))(stacked)
    return _slice_of(moved, to, destination)


def _view(whole: Mesh, p: int) -> Mesh:
    devices = whole.devices.reshape((p, whole.devices.shape[0] // p) + whole.devices.shape[1:])
    return Mesh(devices, (STAGE,) + tuple(whole.axis_names), axis_types=(whole.axis_types[0],) + whole.axis_types)


def _on_view_spec(spec: PartitionSpec, first: str) -> PartitionSpec:
    """A whole-mesh spec on the view: its first axis is (stage, first), major to minor."""
    def swap(entry):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        out = tuple(n for a in names for n in ((STAGE, a) if a == first else (a,)))
        return out if out else None
    return PartitionSpec(*(swap(e) for e in spec))


def _on_view(x: jax.Array, view: Mesh, whole: Mesh) -> jax.Array:
    sharding = NamedSharding(view, _on_view_spec(x.sharding.spec, whole.axis_names[0]))
    return jax.make_array_from_single_device_arrays(x.shape, sharding, [s.data for s in x.addressable_shards],
                                                   dtype=x.dtype)


def _stacked_spec(spec: PartitionSpec) -> PartitionSpec:
    return PartitionSpec(STAGE, *spec)


def _stack(x: jax.Array, view: Mesh, p: int, stage: int) -> jax.Array:
    """The [p, ...] array whose slice `stage` is x (its shards, as they are) and the others zeros."""
    shape = (p,) + x.shape
    sharding = NamedSharding(view, _stacked_spec(x.sharding.spec))
    mine = {s.device: s.data for s in x.addressable_shards}
    shards = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        if index[0].start == stage:
            shards.append(mine[device][None])
        else:
            block = tuple(len(range(*i.indices(n))) for i, n in zip(index, shape))
            shards.append(jax.device_put(np.zeros(block, x.dtype), device))
    return jax.make_array_from_single_device_arrays(shape, sharding, shards, dtype=x.dtype)


def _slice_of(stacked: jax.Array, stage: int, destination: NamedSharding) -> jax.Array:
    shards = [jax.device_put(s.data[0], s.device) for s in stacked.addressable_shards if s.index[0].start == stage]
    return jax.make_array_from_single_device_arrays(stacked.shape[1:], destination, shards, dtype=stacked.dtype)


def _stage_of(destination: NamedSharding, view: Mesh) -> int:
    ids = {d.id for d in destination.device_set}
    return next(s for s in range(view.devices.shape[0]) if {d.id for d in view.devices[s].flat} == ids)


@functools.cache
def _place(stage: int, p: int, out: NamedSharding):
    """x → the [p, ...] array whose slice `stage` is x, the others zeros."""
    return jax.jit(lambda x: jnp.zeros((p,) + x.shape, x.dtype).at[stage].set(x), out_shardings=out)


@functools.cache
def _take(stage: int, out: NamedSharding):
    return jax.jit(lambda stacked: stacked[stage], out_shardings=out)


@functools.cache
def _take_place(source: int, to: int, p: int, out: NamedSharding):
    return jax.jit(lambda stacked: jnp.zeros_like(stacked).at[to].set(stacked[source]), out_shardings=out)
