"""Collectives and their α-β cost, and resharding a tensor from one spec to another.

Bytes follow the convention of `runtime.compiled.collectives` so that predicted and compiled
communication compare one to one: per device, all-reduce = its buffer, all-gather = the gathered
result, reduce-scatter = the un-scattered operand, all-to-all and collective-permute = its buffer.

A reshard is a path of steps that XLA's SPMD partitioner compiles exactly as priced when the
rewrite pins every intermediate layout (`reshard_path`). Left to find its own way between two
distant layouts, XLA often replicates the whole tensor and slices it ("involuntary full
rematerialization") or adds permutes, so the plan fixes the way as well as the ends.
"""
from __future__ import annotations

import functools
import heapq
import itertools
from dataclasses import dataclass

import numpy as np

from rhino_jax.core.specs import ShardingSpec

from .cluster import MeshTopology


@dataclass(frozen=True)
class Collective:
    kind: str
    axes: tuple[str, ...]
    bytes: int
    # Bytes XLA copies to put its result in the program's layout (`_gather`): memory traffic
    # beside the communication, priced by `copy_time`.
    copied: int = 0

    def copy_time(self, topo: MeshTopology) -> float:
        """Seconds of the layout copy XLA adds around it: the buffer read and written once."""
        return 2 * self.copied / topo.memory_bandwidth

    def alone(self, topo: MeshTopology) -> float:
        """Seconds it costs uncombined: its communication and its layout copy (how reshard
        paths are compared)."""
        return self.time(topo) + self.copy_time(topo)

    def time(self, topo: MeshTopology, combined: bool = False, pairwise: bool = False) -> float:
        """Ring algorithms: all-reduce moves 2(n-1)/n of the buffer, the others (n-1)/n; each
        step pays the link latency and each collective one launch. A collective-permute sends
        the whole buffer to one peer in one step. Priced as the backend compiles it (a CPU
        reduce-scatter is an all-reduce). `combined`: XLA merges it with independent others,
        so it pays only its share of the launch and latency (`Combiner.latency_share`).
        `pairwise`: a permute whose pairs cross hosts, every device of a host at once (compiled
        pricing reads the pairs; a planned permute's are not known, and it is priced as one
        group over its axes: a known gap when its permutation crosses hosts device by device)."""
        kind = topo.combiner.compiled_kind(self.kind)
        n, bw, lat = topo.link(self.axes, pairwise)
        if n <= 1:
            return 0.0
        if kind == "collective-permute":
            fixed, steps = topo.launch + lat, 1.0
        else:
            steps = (n - 1) * (2 if kind == "all-reduce" else 1) / n
            fixed = topo.launch + steps * n * lat
        share = topo.combiner.latency_share(kind, self.bytes, n) if combined else 1.0
        return share * fixed + steps * self.bytes / bw


def _gather(axes: tuple[str, ...], after: ShardingSpec, d: int, shape: tuple[int, ...], full_bytes: int,
            sizes: dict[str, int]) -> Collective:
    """The all-gather of `axes` along dim d that leaves the tensor in layout `after`, with the copy
    XLA adds to it. Both backends' layout assignment (CPU's and GPU's `AddBackendConstraints`)
    makes an all-gather's gathered dim its result's major dim; when a dim before it holds more
    than one element per device, that is not the program's (row-major) layout, and the result is
    copied into it before a dot, a reduce or the step's output reads it (an elementwise reader
    fuses the copy: then the copy priced here is an upper bound). Dims of one element before the
    gathered one change no address, so they need no copy (the CPU copies such a buffer all the
    same when no fusion takes it: not priced). The operand side is ignored: its producer usually
    writes the gather's layout directly, and it is 1/n of the buffer."""
    nbytes = _local_bytes(after, full_bytes, sizes)
    local = [size // ShardingSpec.shard_factor_of(after.dims[e], sizes) for e, size in enumerate(shape)]
    return Collective("all-gather", axes, nbytes, nbytes if any(n > 1 for n in local[:d]) else 0)


@dataclass(frozen=True)
class Step:
    """One leg of a reshard: the collectives XLA runs and the layout they leave."""

    spec: ShardingSpec
    collectives: tuple[Collective, ...]


def _local_bytes(spec: ShardingSpec, full_bytes: int, sizes: dict[str, int]) -> int:
    return full_bytes // spec.shard_factor(sizes)


def _divides(dims, shape: tuple[int, ...], sizes: dict[str, int]) -> bool:
    return all(size % ShardingSpec.shard_factor_of(tuple(axes), sizes) == 0 for size, axes in zip(shape, dims))


def _settle(src: ShardingSpec, dst: ShardingSpec, shape: tuple[int, ...], sizes: dict[str, int]) -> ShardingSpec:
    """`src` once its partial sums are settled on the way to `dst`: reduce-scattered into the
    dim where dst shards a partial axis (as that dim's minor axis) when the dim still divides,
    all-reduced otherwise."""
    dims = [list(d) for d in src.dims]
    for a in src.partial:
        d = dst.dim_of(a)
        if d is not None and _divides([dims[d] + [a]], (shape[d],), sizes):
            dims[d].append(a)
    return ShardingSpec(tuple(tuple(d) for d in dims), (), src.strides)


def _settle_step(src: ShardingSpec, dst: ShardingSpec, full_bytes: int, sizes: dict[str, int],
                 shape: tuple[int, ...]) -> Step:
    """XLA's partitioner settles a partial sum one dim at a time: for each dim the partial axes
    are scattered into (the minor dim first), an all-reduce of the whole local buffer over
    that dim's axes, then one local slice of every such dim; the axes scattered nowhere are
    summed last, in an all-reduce of the sliced piece. An all-reduce whose result is sliced in
    one dim is a reduce-scatter (GPU XLA merges the pair, `Combiner.compiled_kind`); with
    several dims sliced at once it stays an all-reduce of the whole buffer on every backend.
    A reduce's partial sums (`ShardingSpec.at_once`) are all-reduced over every partial axis at
    once, a reduce-scatter only when all of them are scattered into one dim."""
    settled = _settle(src, dst, shape, sizes)
    before = _local_bytes(src, full_bytes, sizes)
    into: dict[int, tuple[str, ...]] = {}
    for a in src.partial:
        d = settled.dim_of(a)
        if d is not None:
            into[d] = into.get(d, ()) + (a,)
    if src.at_once and not (len(into) == 1 and len(next(iter(into.values()))) == len(src.partial)):
        # A reduce's partial sums: one all-reduce of the whole buffer over every partial axis,
        # then the reader's slices (XLA forms a reduce-scatter only of an all-reduce sliced over
        # its whole group).
        return Step(src.without_partial(), (Collective("all-reduce", src.partial, before),))
    kind = "reduce-scatter" if len(into) == 1 else "all-reduce"
    collectives = [Collective(kind, into[d], before) for d in sorted(into, reverse=True)]
    reduce = tuple(a for a in src.partial if settled.dim_of(a) is None)
    if reduce:
        sliced = ShardingSpec.shard_factor_of(tuple(a for axes in into.values() for a in axes), sizes)
        collectives.append(Collective("all-reduce", reduce, before // sliced))
    return Step(settled, tuple(collectives))


def _strides_align(size: int, n: int, a: int | None, b: int | None) -> bool:
    """Whether a dim of `size` split n ways at stride a can trade pieces with stride b (None:
    the maximum, size/n) by all-to-all: the larger stride must be a multiple of the smaller
    one's period (n times it), or divide it."""
    small, big = sorted(size // n if s is None else s for s in (a, b))
    return big % (n * small) == 0 or (n * small) % big == 0


def reshard(src: ShardingSpec, dst: ShardingSpec, full_bytes: int, topo: MeshTopology,
            shape: tuple[int, ...]) -> list[Collective]:
    """The collectives that turn a tensor of `shape` laid out as `src` into `dst`."""
    return [c for step in reshard_path(src, dst, full_bytes, topo, shape) for c in step.collectives]


def reshard_path(src: ShardingSpec, dst: ShardingSpec, full_bytes: int, topo: MeshTopology,
                 shape: tuple[int, ...]) -> tuple[Step, ...]:
    """The steps from `src` to `dst` (dst is never partial); the last step's spec is dst.

    Partial sums are settled first (`_settle`). Between maximum-stride layouts the path is the
    cheapest under the α-β model over moves that XLA compiles as one collective each
    (`_move_table`). A stride change keeps one direct step (`_strided`), as XLA compiles it."""
    if src == dst:
        return ()
    steps: list[Step] = []
    scattered: set[str] = set()  # partial axes reduce-scattered into the dim dst wants them on
    if src.partial:
        steps.append(_settle_step(src, dst, full_bytes, topo.sizes, shape))
        scattered = set(src.partial) & set(steps[-1].spec.used_axes())
        src = steps[-1].spec
    if src.strides or dst.strides:
        if steps and not src.strides:
            # A settled layout without strides is pinned like any step: the move from it starts
            # from a layout in place, with no axis at dst's stride yet.
            return (steps[0], Step(dst, tuple(_strided(src, dst, full_bytes, topo.sizes, shape, set()))))
        direct = tuple(_strided(src, dst, full_bytes, topo.sizes, shape, scattered))
        return (Step(dst, tuple(c for s in steps for c in s.collectives) + direct),)
    if src != dst:
        steps += _cheapest_paths(src, shape, full_bytes, topo)[dst]
    return tuple(steps)


def _layouts(shape: tuple[int, ...], sizes: tuple[tuple[str, int], ...]) -> tuple[ShardingSpec, ...]:
    """Every maximum-stride, non-partial layout of `shape` that divides it, axes in any order."""
    names, out = [a for a, _ in sizes], set()
    sz = dict(sizes)
    for where in itertools.product(range(-1, len(shape)), repeat=len(names)):
        for order in itertools.permutations(names):
            dims = [[a for a in order if where[names.index(a)] == d] for d in range(len(shape))]
            if _divides(dims, shape, sz):
                out.add(ShardingSpec(tuple(tuple(d) for d in dims)))
    return tuple(sorted(out))


def _moved_axes(a: ShardingSpec, b: ShardingSpec, sizes: dict[str, int]) -> tuple[str, ...]:
    """Axes whose devices hold another block of the tensor in b than in a (a permute's group).
    A size-1 axis never moves data, wherever it stands."""
    def place(spec, axis):
        d = spec.dim_of(axis)
        return None if d is None else (d, ShardingSpec.shard_factor_of(
            spec.dims[d][spec.dims[d].index(axis) + 1:], sizes))
    return tuple(x for x in sizes if sizes[x] > 1 and place(a, x) != place(b, x))


@dataclass(frozen=True)
class _MoveTable:
    """The layouts of one shape on one mesh and, per layout (by index), its moves:
    (next layout's index, collective kind or None when free, its axes, the shard factor of the
    piece it moves: bytes = full_bytes // factor, the dim an all-gather gathers or -1)."""

    layouts: tuple[ShardingSpec, ...]
    index: dict[ShardingSpec, int]
    moves: tuple[tuple[tuple[int, str | None, tuple[str, ...], int, int], ...], ...]


@functools.lru_cache(maxsize=1024)
def _move_table(shape: tuple[int, ...], sizes_items: tuple[tuple[str, int], ...]) -> _MoveTable:
    """Every move XLA compiles as one collective when both ends are pinned (checked layout pair
    by layout pair against compiled HLO in the tests):
    - all-gather of a dim's minor axes (gathering a major axis first needs a permute);
    - all-to-all of a dim's minor axes onto another dim, where they become the minor axes;
    - refinement: every block of the next layout lies in one block of this one (each dim cut
      into a multiple of its pieces): free where every device holds its new block already (this
      layout's axes stay major on each dim, or only size-1 axes move), else one collective-permute
      of the new blocks."""
    sizes = dict(sizes_items)
    layouts = _layouts(shape, sizes_items)
    index = {spec: i for i, spec in enumerate(layouts)}
    factor = [spec.shard_factor(sizes) for spec in layouts]
    counts = [tuple(ShardingSpec.shard_factor_of(d, sizes) for d in spec.dims) for spec in layouts]
    table = []
    for i, cur in enumerate(layouts):
        moves = []
        for d, axes in enumerate(cur.dims):
            for k in range(1, len(axes) + 1):
                keep, minor = axes[:-k], axes[-k:]
                gathered = index[ShardingSpec(cur.dims[:d] + (keep,) + cur.dims[d + 1:])]
                moves.append((gathered, "all-gather", minor, factor[gathered], d))
                for e in range(len(shape)):
                    moved = index.get(ShardingSpec(tuple(keep if j == d else dims + minor if j == e else dims
                                                         for j, dims in enumerate(cur.dims))))
                    if e != d and moved is not None:
                        moves.append((moved, "all-to-all", minor, factor[i], -1))
        for j, nxt in enumerate(layouts):
            if j == i or any(b % a for a, b in zip(counts[i], counts[j])):
                continue
            moved = _moved_axes(cur, nxt, sizes)
            if not moved or all(b[:len(a)] == a for a, b in zip(cur.dims, nxt.dims)):
                moves.append((j, None, (), factor[j], -1))
            else:
                moves.append((j, "collective-permute", moved, factor[j], -1))
        table.append(tuple(moves))
    return _MoveTable(layouts, index, tuple(table))


@functools.lru_cache(maxsize=4096)
def _cheapest_paths(src: ShardingSpec, shape: tuple[int, ...], full_bytes: int, topo: MeshTopology
                    ) -> dict[ShardingSpec, tuple[Step, ...]]:
    """Dijkstra from `src` over the layouts of `shape`: the cheapest steps to each one. Ties go
    to fewer bytes moved, then to fewer collectives."""
    table = _move_table(shape, tuple(topo.sizes.items()))
    priced: dict[tuple, tuple[Collective | None, tuple]] = {}  # (next, kind, axes, factor) -> (collective, cost)
    start = table.index[src]
    best: dict[int, tuple] = {start: (0.0, 0, 0)}
    back: dict[int, tuple[int, Collective | None]] = {}
    heap = [((0.0, 0, 0), start)]
    done: set[int] = set()
    while heap:
        cost, cur = heapq.heappop(heap)
        if cur in done:
            continue
        done.add(cur)
        for nxt, kind, axes, factor, d in table.moves[cur]:
            if nxt in done:
                continue
            key = (nxt if d >= 0 else -1, kind, axes, factor)  # a gather's copy depends on its result
            if key not in priced:
                if d >= 0:
                    c = _gather(axes, table.layouts[nxt], d, shape, full_bytes, topo.sizes)
                else:
                    c = Collective(kind, axes, full_bytes // factor) if kind else None
                priced[key] = (c, (c.alone(topo), c.bytes, 1) if c else (0.0, 0, 0))
            c, (t, b, n) = priced[key]
            new = (cost[0] + t, cost[1] + b, cost[2] + n)
            if nxt not in best or new < best[nxt]:
                best[nxt], back[nxt] = new, (cur, c)
                heapq.heappush(heap, (new, nxt))
    paths: dict[ShardingSpec, tuple[Step, ...]] = {}
    for i in best:
        legs, at = [], i
        while at != start:
            prev, c = back[at]
            legs.append(Step(table.layouts[at], (c,) if c else ()))
            at = prev
        paths[table.layouts[i]] = tuple(reversed(legs))
    return paths


def _strided(src: ShardingSpec, dst: ShardingSpec, full_bytes: int, sizes: dict[str, int],
             shape: tuple[int, ...], scattered: set[str]) -> list[Collective]:
    """Resharding where either end has a non-maximum stride (src is settled; `scattered`: its
    axes that a reduce-scatter just put where dst wants them), in one direct step:
    slice locally into the axes dst adds (free), move axes between dims (all-to-all), and gather
    the axes dst drops last. A dim whose stride changes is exchanged by all-to-all and permuted
    into place where the strides align, and gathered (then sliced) where they do not: what XLA
    compiles for each."""
    out: list[Collective] = []
    dims = [list(d) for d in src.dims]
    cur = lambda: ShardingSpec(tuple(tuple(d) for d in dims))  # noqa: E731
    settled = set(scattered)  # axes placed where dst wants them, at dst's stride
    # free local slicing into axes that dst uses and the tensor does not use yet
    used = {a for d in dims for a in d}
    for d, axes in enumerate(dst.dims):
        for a in axes:
            if a not in used:
                dims[d].append(a)
                used.add(a)
                settled.add(a)
    # a stride change: exchanged below where the strides align (then permuted into place),
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
        out.append(_gather(axes, cur(), d, shape, full_bytes, sizes))
        dims[d] += axes
        settled.update(axes)
    # axes on the wrong dim (or at another stride) move with all-to-all; axes dst does not
    # use are gathered
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
            out.append(_gather(axes, cur(), d, shape, full_bytes, sizes))
    # Same axes on a dim but in another order (also after an all-to-all, which appends the axes
    # it moves as the minor ones, or changes a stride): each device's piece belongs to another
    # device, which XLA does with a collective-permute.
    if cur().dims != dst.dims or exchanged:
        axes = tuple(a for d in dst.dims for a in d)
        out.append(Collective("collective-permute", axes, _local_bytes(dst, full_bytes, sizes)))
    return out
