"""Sharding specs: how one tensor is laid out over the mesh.

A spec names, per tensor dimension, the mesh axes that split it (major to minor), and the mesh
axes over which the tensor is a partial sum (each device holds an addend). Every mesh axis
appears at most once in a spec; an axis that appears nowhere replicates the tensor.

Rhino §4.1's strides: a dim of size N split n ways holds, by default, one block of N/n
consecutive elements per device (maximum stride). With stride s it is dealt in blocks of s,
round robin: viewed as [N/(n·s), n, s], the middle dim is split. `strides` lists the dims whose
stride is not the maximum; the rewrite makes them real by splitting the dim in two (`split`).
"""
from __future__ import annotations

from dataclasses import dataclass

from jax.sharding import PartitionSpec


@dataclass(frozen=True, order=True)
class ShardingSpec:
    dims: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...] = ()
    strides: tuple[tuple[int, int], ...] = ()  # (dim, stride) where the stride is not the maximum
    # The partial sums are a reduce's or a scatter's: XLA settles them all in one all-reduce of
    # the whole local buffer (a reduce-scatter only where the reader splits one dim over all of
    # them), not one dim at a time as a dot's (`collectives._settle_step`).
    at_once: bool = False

    @staticmethod
    def replicated(rank: int) -> "ShardingSpec":
        return ShardingSpec(((),) * rank)

    @property
    def rank(self) -> int:
        return len(self.dims)

    def used_axes(self) -> tuple[str, ...]:
        return tuple(a for d in self.dims for a in d) + self.partial

    def dim_of(self, axis: str) -> int | None:
        for i, d in enumerate(self.dims):
            if axis in d:
                return i
        return None

    def is_replicated(self) -> bool:
        return not self.used_axes()

    def shard_factor(self, axis_sizes: dict[str, int]) -> int:
        """How many distinct pieces the tensor is cut into (partial axes do not cut)."""
        return self.shard_factor_of(tuple(a for d in self.dims for a in d), axis_sizes)

    def local_shape(self, shape: tuple[int, ...], axis_sizes: dict[str, int]) -> tuple[int, ...]:
        """The shape of one device's piece."""
        return tuple(n // self.shard_factor_of(axes, axis_sizes) for n, axes in zip(shape, self.dims))

    def without_partial(self) -> "ShardingSpec":
        return ShardingSpec(self.dims, (), self.strides)  # at_once goes with the partial sums

    def stride(self, dim: int) -> int | None:
        """The dim's stride, or None for the maximum."""
        return dict(self.strides).get(dim)

    def split(self, shape: tuple[int, ...], axis_sizes: dict[str, int]
              ) -> tuple[tuple[int, ...], "ShardingSpec"]:
        """The same layout with maximum strides only: each strided dim N becomes
        [N/(n·s), n·s], split on the minor part. Returns (shape, spec)."""
        if not self.strides:
            return shape, self
        out_shape: list[int] = []
        out_dims: list[tuple[str, ...]] = []
        for d, (size, axes) in enumerate(zip(shape, self.dims)):
            s = self.stride(d)
            if s is None:
                out_shape.append(size)
                out_dims.append(axes)
                continue
            period = s * self.shard_factor_of(axes, axis_sizes)
            out_shape += [size // period, period]
            out_dims += [(), axes]
        return tuple(out_shape), ShardingSpec(tuple(out_dims), self.partial, (), self.at_once)

    @staticmethod
    def shard_factor_of(axes: tuple[str, ...], axis_sizes: dict[str, int]) -> int:
        f = 1
        for a in axes:
            f *= axis_sizes[a]
        return f

    def to_partition_spec(self) -> PartitionSpec:
        if self.partial:
            raise ValueError("a partial-sum spec has no PartitionSpec")
        if self.strides:
            raise ValueError("a strided spec has no PartitionSpec; split its dims first (`split`)")
        entries = [None if not d else (d[0] if len(d) == 1 else d) for d in self.dims]
        while entries and entries[-1] is None:
            entries.pop()
        return PartitionSpec(*entries)

    def sdy(self, mesh_name: str = "mesh") -> str:
        """The Shardy attribute body, closed on every dim: the partitioner may not change it."""
        if self.strides:
            raise ValueError("a strided spec has no Shardy sharding; split its dims first (`split`)")
        dims = ", ".join("{" + ", ".join(f'"{a}"' for a in d) + "}" for d in self.dims)
        return f"<@{mesh_name}, [{dims}]>"

    def __str__(self) -> str:
        body = ", ".join("-" if not d else "+".join(d) + (f"/{self.stride(i)}" if self.stride(i) else "")
                         for i, d in enumerate(self.dims))
        text = f"[{body}]"
        if self.partial:
            text += " partial(" + ",".join(self.partial) + ")"
        return text
