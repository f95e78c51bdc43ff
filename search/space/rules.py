"""Sharding rules per op family, as loop spaces.

Every op we know is described as a nest of loops (Einstein-summation style): each operand and
result dimension is indexed by one loop, or by none when that dimension cannot be split without
communication inside the op (a sliced, padded or windowed dimension). Sharding a loop on a mesh
axis splits every dimension it indexes on that axis; operands that lack the loop are replicated
on it. A loop that indexes no result dimension is a reduction: splitting it leaves each device
with an addend (partial sum) when the combiner is `add`, or needs an all-reduce inside the op
for other combiners. An op with no rule keeps every tensor replicated (see `strategies`).
Reshapes are not loop nests: `strides.map_reshape` lays out one side from the other.
"""
from __future__ import annotations

from dataclasses import dataclass

from rhino_jax.core.ops import ELEMENTWISE

from ...hlo_passes.graph import Graph, Node

Dims = tuple[int | None, ...]  # loop index per tensor dimension


@dataclass(frozen=True)
class LoopSpace:
    sizes: tuple[int, ...]
    operands: tuple[Dims, ...]
    results: tuple[Dims, ...]
    # How split reduction loops combine. "sum" (XLA's dot and convolution handlers): the last
    # split loop's addends are left for the reader to settle, reduce-scattered into each dim the
    # reader splits; "sum_at_once" (its reduce and scatter handlers): every split loop's addends
    # are left for the reader, who settles them all in one all-reduce of the whole local buffer,
    # a reduce-scatter only where it splits one dim over all of them (`ShardingSpec.at_once`);
    # "other": combined inside the op (max, argmax, ...); "none": never split.
    reduce_kind: str = "none"

    def reduction_loops(self) -> tuple[int, ...]:
        in_result = {l for r in self.results for l in r if l is not None}
        return tuple(l for l in range(len(self.sizes)) if l not in in_result)




def _same(rank: int) -> Dims:
    return tuple(range(rank))


def loop_space(node: Node, graph: Graph) -> LoopSpace | None:
    """The op's loop space, or None when it has no sharding rule (replicated fallback)."""
    shapes_in = [graph.values[o].shape for o in node.operands]
    shapes_out = [graph.values[r].shape for r in node.results]
    kind = node.op.split(".", 1)[1] if "." in node.op else node.op
    a = node.attrs
    if node.op == "sdy.sharding_constraint" or node.op in ELEMENTWISE:
        out = shapes_out[0]
        # Scalar operands (clamp bounds, select predicates) broadcast: they have no dims.
        return LoopSpace(out, tuple(_same(len(s)) if len(s) == len(out) else () for s in shapes_in),
                         (_same(len(out)),))
    if kind == "bitcast_convert":
        # Between element types of different widths, the narrower side has one more (last) dim,
        # holding the pieces of one wide element: it stays whole, the shared dims split.
        (x,), (y,) = shapes_in, shapes_out
        shared = _same(min(len(x), len(y)))
        return LoopSpace(x[:len(shared)], (shared + (None,) * (len(x) - len(shared)),),
                         (shared + (None,) * (len(y) - len(shared)),))
    if kind == "dot_general":
        return _dot(a, shapes_in, shapes_out)
    if kind == "convolution":
        return _convolution(a, shapes_in, shapes_out)
    if kind == "broadcast_in_dim":
        out = shapes_out[0]
        dims = tuple(d if shapes_in[0][i] == out[d] else None for i, d in enumerate(a["dims"]))
        return LoopSpace(out, (dims,), (_same(len(out)),))
    if kind == "transpose":
        out = shapes_out[0]
        inv = [0] * len(out)
        for j, p in enumerate(a["perm"]):
            inv[p] = j
        return LoopSpace(out, (tuple(inv),), (_same(len(out)),))
    if kind == "reduce":
        return _reduce(a, shapes_in, shapes_out)
    if kind == "rng_bit_generator":
        # The state stays whole; the bits split freely: XLA hands every device its slice of the
        # single-device bits without communicating (checked on the CPU backend).
        (state,), (new_state, bits) = shapes_in, shapes_out
        return LoopSpace(bits, ((None,) * len(state),), ((None,) * len(new_state), _same(len(bits))))
    if kind in ("iota", "constant"):
        return LoopSpace(shapes_out[0], (), (_same(len(shapes_out[0])),))
    if kind == "slice":
        out = shapes_out[0]
        keep = tuple(d if (a["start"][d] == 0 and a["limit"][d] == shapes_in[0][d] and a["strides"][d] == 1)
                     else None for d in range(len(out)))
        return LoopSpace(out, (keep,), (keep,))
    if kind == "concatenate":
        out = shapes_out[0]
        dims = tuple(None if d == a["dim"] else d for d in range(len(out)))
        return LoopSpace(out, (dims,) * len(shapes_in), (dims,))
    if kind == "pad":
        out = shapes_out[0]
        dims = tuple(d if a["low"][d] == a["high"][d] == a["interior"][d] == 0 else None
                     for d in range(len(out)))
        return LoopSpace(out, (dims, ()), (dims,))
    if kind == "dynamic_slice":
        out = shapes_out[0]
        dims = tuple(d if a["sizes"][d] == shapes_in[0][d] else None for d in range(len(out)))
        return LoopSpace(out, (dims,) + ((),) * (len(shapes_in) - 1), (dims,))
    if kind == "dynamic_update_slice":
        out = shapes_out[0]
        dims = tuple(d if shapes_in[1][d] == out[d] else None for d in range(len(out)))
        return LoopSpace(out, (dims, dims) + ((),) * (len(shapes_in) - 2), (dims,))
    if kind == "sort":
        out = shapes_out[0]
        dims = tuple(None if d == a["dim"] else d for d in range(len(out)))
        return LoopSpace(out, (dims,) * len(shapes_in), (dims,) * len(shapes_out))
    if kind == "scan":
        # chlo.scan, the prefix scan jax lowers jnp.cumsum to for a GPU: inputs then inits, outputs
        # then carries; the rows along the other dims are independent (the inits and carries
        # have the scanned dim dropped), the scanned dim stays whole. XLA's GPU partitioner
        # splits the rows without a collective (checked on a deviceless H100 compile).
        x = shapes_in[0]
        rows = tuple(None if d == a["dim"] else d for d in range(len(x)))
        carried = tuple(d for d in range(len(x)) if d != a["dim"])
        n = len(shapes_in) // 2
        return LoopSpace(x, (rows,) * n + (carried,) * n, (rows,) * len(shapes_out[:n]) + (carried,) * n)
    if kind == "reduce_window":
        out = shapes_out[0]
        dims = _unwindowed(a, len(out))
        n = len(shapes_in) // 2
        return LoopSpace(out, (dims,) * n + ((),) * n, (dims,) * len(shapes_out))
    if kind == "select_and_scatter":
        # The max-pool gradient: operand and result have the pooled input's shape, the source
        # the pooled output's; an unwindowed dim has one size in all three.
        out = shapes_out[0]
        dims = _unwindowed(a, len(out))
        return LoopSpace(out, (dims, dims, ()), (dims,))
    if kind == "reverse":
        # A reversed dim split n ways would also reverse the order of its shards: not a loop.
        out = shapes_out[0]
        dims = tuple(None if d in a["dims"] else d for d in range(len(out)))
        return LoopSpace(out, (dims,), (dims,))
    if kind == "gather":
        return _gather(a, shapes_in, shapes_out)
    if kind == "scatter" and len(shapes_in) == 3:
        return _scatter(a, shapes_in, shapes_out)
    return None


def _unwindowed(a: dict, rank: int) -> Dims:
    """Dims a window does not cross (size 1, stride 1, no padding or base dilation): each output
    element reads only its own index there, so they are parallel loops; the rest are not."""
    return tuple(d if (a["window"][d] == 1 and a["strides"][d] == 1 and a["padding"][d] == 0
                       and a["base_dilations"][d] == 1) else None for d in range(rank))


def _dot(a: dict, shapes_in, shapes_out) -> LoopSpace:
    lhs, rhs = shapes_in
    lhs_free = [d for d in range(len(lhs)) if d not in a["lhs_batch"] and d not in a["lhs_contract"]]
    rhs_free = [d for d in range(len(rhs)) if d not in a["rhs_batch"] and d not in a["rhs_contract"]]
    nb, nl, nr = len(a["lhs_batch"]), len(lhs_free), len(rhs_free)
    sizes = ([lhs[d] for d in a["lhs_batch"]] + [lhs[d] for d in lhs_free] + [rhs[d] for d in rhs_free]
             + [lhs[d] for d in a["lhs_contract"]])
    lhs_dims: list[int | None] = [None] * len(lhs)
    rhs_dims: list[int | None] = [None] * len(rhs)
    for i, (dl, dr) in enumerate(zip(a["lhs_batch"], a["rhs_batch"])):
        lhs_dims[dl], rhs_dims[dr] = i, i
    for i, d in enumerate(lhs_free):
        lhs_dims[d] = nb + i
    for i, d in enumerate(rhs_free):
        rhs_dims[d] = nb + nl + i
    for i, (dl, dr) in enumerate(zip(a["lhs_contract"], a["rhs_contract"])):
        lhs_dims[dl], rhs_dims[dr] = nb + nl + nr + i, nb + nl + nr + i
    return LoopSpace(tuple(sizes), (tuple(lhs_dims), tuple(rhs_dims)), (_same(nb + nl + nr),), "sum")


def _convolution(a: dict, shapes_in, shapes_out) -> LoopSpace:
    """Batch, output feature and (summed) input feature are splittable; spatial dims are not."""
    x, k = shapes_in
    out = shapes_out[0]
    grouped = a["feature_groups"] != 1 or a["batch_groups"] != 1
    sizes = (out[a["out_batch"]], out[a["out_feature"]], x[a["in_feature"]])
    xd: list[int | None] = [None] * len(x)
    kd: list[int | None] = [None] * len(k)
    od: list[int | None] = [None] * len(out)
    xd[a["in_batch"]] = od[a["out_batch"]] = 0
    if not grouped:
        kd[a["k_out"]] = od[a["out_feature"]] = 1
        xd[a["in_feature"]] = kd[a["k_in"]] = 2
    return LoopSpace(sizes, (tuple(xd), tuple(kd)), (tuple(od),), "none" if grouped else "sum")


def _reduce(a: dict, shapes_in, shapes_out) -> LoopSpace:
    """Kept dims are parallel loops, reduced dims reduction loops. A single `add` leaves partial
    sums, which XLA's partitioner settles in one all-reduce over every split reduced dim's axes
    before the reader slices its piece (a reduce-scatter only when that slice splits one dim over
    all of them: "sum_at_once"). Any other body (max, and, argmax's two-operand
    compare-and-select, ...) is combined inside the op: XLA reduces each device's piece, then
    combines the pieces (an all-reduce, or for a variadic reduce an all-gather of the pieces and
    a second reduce). StableHLO leaves the order of a reduction to the implementation, so
    splitting it is always allowed."""
    n = len(shapes_in) // 2
    x = shapes_in[0]
    kept = [d for d in range(len(x)) if d not in a["dims"]]
    order = kept + list(a["dims"])  # result loops first, then reduction loops
    loop_of = {d: i for i, d in enumerate(order)}
    dims = tuple(loop_of[d] for d in range(len(x)))
    kind = "sum_at_once" if a["combiner"] == "stablehlo.add" and n == 1 else "other"
    return LoopSpace(tuple(x[d] for d in order), (dims,) * n + ((),) * n,
                     (tuple(range(len(kept))),) * len(shapes_out), kind)


def _new_loop(sizes: list[int], size: int) -> int:
    sizes.append(size)
    return len(sizes) - 1


def _gather(a: dict, shapes_in, shapes_out) -> LoopSpace:
    """Split the result's batch dims (the indices' dims, and the operand's batching dims paired
    with them: take_along_axis, an integer-label cross entropy), the operand's fully-sliced
    (passthrough) dims, and its indexed dims of slice size 1 (a vocabulary-split embedding table,
    Megatron's vocabulary-parallel embedding). The last are reduction loops: XLA's partitioner
    gathers the rows each device holds, zeroes the others and all-reduces the result inside the
    op (also for an `add` reader, so "other", not a partial sum). A window dim the slice cuts
    short, or whose start is indexed, is no loop."""
    operand, indices = shapes_in
    out = shapes_out[0]
    sizes: list[int] = []
    out_dims: list[int | None] = [None] * len(out)
    op_dims: list[int | None] = [None] * len(operand)
    idx_dims: list[int | None] = [None] * len(indices)
    batch_out = [d for d in range(len(out)) if d not in a["offset_dims"]]
    batch_idx = [d for d in range(len(indices)) if d != a["index_vector_dim"]]
    for od, idd in zip(batch_out, batch_idx):
        out_dims[od] = idx_dims[idd] = _new_loop(sizes, out[od])
    for opd, idd in zip(a["operand_batching"], a["indices_batching"]):
        op_dims[opd] = idx_dims[idd]
    window = [d for d in range(len(operand)) if d not in a["collapsed"] and d not in a["operand_batching"]]
    for od, wd in zip(a["offset_dims"], window):
        if a["sizes"][wd] == operand[wd] and wd not in a["start_index_map"]:
            out_dims[od] = op_dims[wd] = _new_loop(sizes, out[od])
    indexed = [d for d in a["start_index_map"] if a["sizes"][d] == 1]
    for d in indexed:
        op_dims[d] = _new_loop(sizes, operand[d])
    return LoopSpace(tuple(sizes), (tuple(op_dims), tuple(idx_dims)), (tuple(out_dims),),
                     "other" if indexed else "none")


def _scatter(a: dict, shapes_in, shapes_out) -> LoopSpace:
    """Operand and result share every loop. Batching dims (the gradient of take_along_axis and of
    an integer-label cross entropy) also index the indices and updates: parallel. An indexed dim
    the update window spans one element of (the vocabulary dim of that gradient) splits the
    operand alone: each device applies the updates that land in its rows. A dim neither indexed nor
    batched follows the operand (and the update window, when it spans the whole dim). With an
    `add` combiner the updates' other scatter dims are reduction loops: each device scatters its
    share of updates and the results sum, settled as a reduce's ("sum_at_once"; the partitioner
    sees the operand and keeps the result exact)."""
    operand, indices, updates = shapes_in
    rank = len(operand)
    sizes: list[int] = []
    op_dims: list[int | None] = [None] * rank
    idx_dims: list[int | None] = [None] * len(indices)
    upd_dims: list[int | None] = [None] * len(updates)
    scatter_upd = [d for d in range(len(updates)) if d not in a["update_window_dims"]]
    batch_idx = [d for d in range(len(indices)) if d != a["index_vector_dim"]]
    upd_of_idx = dict(zip(batch_idx, scatter_upd))
    window_operand = [d for d in range(rank)
                      if d not in a["inserted_window_dims"] and d not in a["input_batching"]]
    window_upd = dict(zip(window_operand, a["update_window_dims"]))  # operand dim -> updates dim
    batched = dict(zip(a["input_batching"], a["indices_batching"]))  # operand dim -> indices dim
    for d in range(rank):
        ud = window_upd.get(d)
        extent = 1 if ud is None else updates[ud]
        if d in batched:
            idd = batched[d]
            op_dims[d] = idx_dims[idd] = upd_dims[upd_of_idx[idd]] = _new_loop(sizes, operand[d])
        elif d not in a["scatter_dims_to_operand"] or extent == 1:
            op_dims[d] = _new_loop(sizes, operand[d])
            if ud is not None and extent == operand[d] and d not in a["scatter_dims_to_operand"]:
                upd_dims[ud] = op_dims[d]
    add = a["combiner"] == "stablehlo.add"
    if add:
        for idd, ud in upd_of_idx.items():
            if idx_dims[idd] is None:
                idx_dims[idd] = upd_dims[ud] = _new_loop(sizes, updates[ud])
    return LoopSpace(tuple(sizes), (tuple(op_dims), tuple(idx_dims), tuple(upd_dims)),
                     (tuple(op_dims),), "sum_at_once" if add else "none")
