"""Mesh shapes to try when the user gives devices but no mesh (Rhino §3/§4: enumerate the device
mesh configurations, search a strategy for each, keep the best).

Pure functions of the device count and each device's host, so they test without devices.

Convention (the same as `rj.device_mesh`): devices fill the mesh in order, inner (later) axes
taking consecutive devices. A candidate is kept only if every axis but the first (outer) one has
its groups inside one host, so the slow inter-host network is only ever crossed by the outer axis.
Axes have size ≥ 2 (a size-1 axis adds nothing to search); a k-axis mesh is named by the first k
of `axis_names` (default `DEFAULT_AXIS_NAMES`: ("data",), ("data", "model"),
("data", "model", "extra")), and there are at most `len(axis_names)` axes.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DEFAULT_AXIS_NAMES = ("data", "model", "extra")


def factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    """Ordered k-tuples of factors ≥ 2 whose product is n (k = 1: just (n,), even for n = 1)."""
    if k == 1:
        return [(n,)] if n >= 1 else []
    out = []
    for f in range(2, n + 1):
        if n % f == 0:
            out += [(f,) + rest for rest in factorizations(n // f, k - 1) if min(rest) >= 2]
    return out


def intra_host_axes(shape: Sequence[int], hosts: Sequence[int]) -> tuple[bool, ...]:
    """Per mesh axis: do all its device groups stay inside one host? `hosts[i]` is the host of the
    i-th device in mesh order (the test `MeshTopology.from_mesh` makes to pick each axis's link)."""
    host = np.asarray(hosts).reshape(tuple(shape))
    return tuple(bool(np.all(host == np.take(host, [0], axis=ax))) for ax in range(host.ndim))


def enumerate_mesh_shapes(hosts: Sequence[int], max_axes: int = 3) -> list[tuple[int, ...]]:
    """Mesh shapes over `len(hosts)` devices with 1..max_axes axes, every inner axis within a host.

    Ordered by number of axes, then by shape; the 1-D mesh is always there (its one axis is the
    outer one, so it may cross hosts)."""
    n = len(hosts)
    if n < 1:
        raise ValueError("no devices to build a mesh from")
    shapes = []
    for k in range(1, max_axes + 1):
        for shape in factorizations(n, k):
            if all(intra_host_axes(shape, hosts)[1:]):
                shapes.append(shape)
    return shapes


def axis_names_for(ndim: int, axis_names: Sequence[str] | None = None) -> tuple[str, ...]:
    names = tuple(DEFAULT_AXIS_NAMES if axis_names is None else axis_names)
    if ndim > len(names):
        raise ValueError(f"a {ndim}-axis mesh needs {ndim} axis names, got {names}")
    return names[:ndim]


def candidate_meshes(hosts: Sequence[int], axis_names: Sequence[str] | None = None
                     ) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """(shape, axis names) of every candidate mesh, in enumeration order."""
    names = tuple(DEFAULT_AXIS_NAMES if axis_names is None else axis_names)
    return [(s, axis_names_for(len(s), names)) for s in enumerate_mesh_shapes(hosts, len(names))]
