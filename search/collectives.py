"""Collectives and their α-β cost, and resharding a tensor from one spec to another.

Bytes follow the convention of `hlo_passes.hlo_stats` so that predicted and compiled
communication compare one to one: per device, all-reduce = its buffer, all-gather = the gathered
result, reduce-scatter = the un-scattered operand, all-to-all and collective-permute = its buffer.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cluster import MeshTopology
from .specs import ShardingSpec


@dataclass(frozen=True)
class Collective:
    kind: str
    axes: tuple[str, ...]
    bytes: int

    def time(self, topo: MeshTopology) -> float:
        """Ring algorithms: all-reduce moves 2(n-1)/n of the buffer, the others (n-1)/n; each
        step pays the link latency and each collective one launch. A collective-permute sends
        the whole buffer to one peer in one step."""
        n, bw, lat = topo.link(self.axes)
        if n <= 1:
            return 0.0
        if self.kind == "collective-permute":
            return topo.launch + self.bytes / bw + lat
        steps = (n - 1) * (2 if self.kind == "all-reduce" else 1)
        return topo.launch + steps / n * self.bytes / bw + steps * lat


def total_time(collectives: list[Collective], topo: MeshTopology) -> float:
    return sum(c.time(topo) for c in collectives)


def _local_bytes(spec: ShardingSpec, full_bytes: int, sizes: dict[str, int]) -> int:
    return full_bytes // spec.shard_factor(sizes)


def settle(src: ShardingSpec, dst: ShardingSpec) -> ShardingSpec:
    """`src` once its partial sums are settled on the way to `dst`: reduce-scattered into the
    dims where dst shards a partial axis (as that dim's minor axis), all-reduced elsewhere."""
    dims = [list(d) for d in src.dims]
    for a in src.partial:
        if dst.dim_of(a) is not None:
            dims[dst.dim_of(a)].append(a)
    return ShardingSpec(tuple(tuple(d) for d in dims), (), src.strides)


def _strides_align(size: int, n: int, a: int | None, b: int | None) -> bool:
    """Whether a dim of `size` split n ways at stride a can trade pieces with stride b (None:
    the maximum, size/n) by all-to-all: the larger stride must be a multiple of the smaller
    one's period (n times it), or divide it."""
    small, big = sorted(size // n if s is None else s for s in (a, b))
    return big % (n * small) == 0 or (n * small) % big == 0


def reshard(src: ShardingSpec, dst: ShardingSpec, full_bytes: int,
            sizes: dict[str, int], shape: tuple[int, ...]) -> list[Collective]:
    """The collectives that turn a tensor of `shape` laid out as `src` into `dst` (dst is never
    partial).

    Order: settle partial sums (reduce-scatter where dst shards on that axis, else all-reduce),
    slice locally into the axes dst adds (free), move axes between dims (all-to-all), and gather
    the axes dst drops last, so every collective works on the smallest buffer it can. A dim
    whose stride changes is exchanged by all-to-all and permuted into place where the strides
    align, and gathered (then sliced) where they do not: what XLA compiles for each."""
    if src == dst:
        return []
    out: list[Collective] = []
    dims = [list(d) for d in src.dims]
    cur = lambda: ShardingSpec(tuple(tuple(d) for d in dims))  # noqa: E731
    settled: set[str] = set()  # axes placed where dst wants them, at dst's stride
    # 1. partial sums
    if src.partial:
        before = _local_bytes(src, full_bytes, sizes)
        scatter = [a for a in src.partial if dst.dim_of(a) is not None]
        reduce = tuple(a for a in src.partial if a not in scatter)
        if reduce:
            out.append(Collective("all-reduce", reduce, before))
        if scatter:
            out.append(Collective("reduce-scatter", tuple(scatter), before))
            dims = [list(d) for d in settle(src, dst).dims]
            settled.update(scatter)
    # 2. free local slicing into axes that dst uses and the tensor does not use yet
    used = {a for d in dims for a in d}
    for d, axes in enumerate(dst.dims):
        for a in axes:
            if a not in used:
                dims[d].append(a)
                used.add(a)
                settled.add(a)
    # 3. a stride change: exchanged below where the strides align (then permuted into place),
    # else the dim's axes are gathered here and sliced back for free
    exchanged = False
    for d in range(len(dims)):
        axes = tuple(a for a in dims[d] if a in dst.dims[d] and a not in settled)
        if not axes or src.stride(d) == dst.stride(d):
            continue
        if _strides_align(shape[d], int(np.prod([sizes[a] for a in axes])), src.stride(d), dst.stride(d)):
            exchanged = True
            continue
        dims[d] = [a for a in dims[d] if a not in axes]
        out.append(Collective("all-gather", axes, _local_bytes(cur(), full_bytes, sizes)))
        dims[d] += axes
        settled.update(axes)
    # 4. axes on the wrong dim (or at another stride) move with all-to-all; 5. axes dst does
    # not use are gathered
    moves, gathers = [], []
    for d, axes in enumerate(dims):
        for a in axes:
            if a in dst.dims[d] and (a in settled or src.stride(d) == dst.stride(d)):
                continue
            (moves if dst.dim_of(a) is not None else gathers).append(a)
    if moves:
        out.append(Collective("all-to-all", tuple(moves), _local_bytes(cur(), full_bytes, sizes)))
        for d in range(len(dims)):
            dims[d] = [a for a in dims[d] if a not in moves]
        for a in moves:
            dims[dst.dim_of(a)].append(a)
    # XLA gathers one tensor dimension at a time (the minor one first), each on its own group.
    for d in reversed(range(len(dims))):
        axes = tuple(a for a in dims[d] if a in gathers)
        if axes:
            dims[d] = [a for a in dims[d] if a not in gathers]
            out.append(Collective("all-gather", axes, _local_bytes(cur(), full_bytes, sizes)))
    # Same axes on a dim but in another order (also after an all-to-all, which appends the axes
    # it moves as the minor ones, or changes a stride): each device's piece belongs to another
    # device, which XLA does with a collective-permute.
    if cur().dims != dst.dims or exchanged:
        axes = tuple(a for d in dst.dims for a in d)
        out.append(Collective("collective-permute", axes, _local_bytes(dst, full_bytes, sizes)))
    return out
