"""Co-shard's rewrite ("nnScaler: Constraint-Guided Parallelization Plan Generation for Deep
Learning Training" §4.2): a group of ops run as C chunks, one after another, on the same devices.

How a group is cut is the search's (`search.space.coshard`): a `Chunking` says the dim of each
value the group makes and of each operand it reads from outside. This module rewrites the
module accordingly: each chunk's ops cloned on its slices, a value that leaves the group put
back together (concatenated, or added up where the loop is a sum), and chunk k+1's inputs
passed through one `optimization_barrier` with chunk k's results, so XLA cannot interleave the
chunks and hold them all.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from . import module as mod
from .graph import Graph

SUM = -1  # the dim of a value that leaves a group as a sum over its chunks


@dataclass(frozen=True)
class Chunking:
    """One group cut into `chunks`: `dims[value]` the dim of each value the group makes that is
    cut (`SUM`: added up over the chunks), `reads[node, operand]` the dim each operand
    made outside the group is sliced on (None: read whole)."""

    nodes: tuple[int, ...]
    chunks: int
    dims: dict[int, int]
    reads: dict[tuple[int, int], int | None]
    seed: int  # the group's largest value (the first made of equal ones): its cut names the cut
    copies: tuple[int, ...] = ()  # ops of earlier groups each chunk computes again (`recomputed`)


def chunk(module: ir.Module, graph: Graph, plans: Sequence[Chunking]) -> ir.Module:
    """A copy of the (inlined) module `graph` was imported from with each group of `plans` run in
    its chunks (see the module's doc). Later groups first: their chunks may copy the ops of
    earlier ones (`Chunking.copies`), which must still be there."""
    new = mod.copy_module(module)
    ops = [site.op for site in mod.entry_sites(new)]
    table = mod.value_table(new)
    constant = {table[v.id] for v in graph.values if v.constant}
    with new.context, ir.Location.unknown():
        for plan in sorted(plans, key=lambda p: -p.nodes[0]):
            _chunk_group(graph, ops, plan, table, constant)
    return new


def _chunk_group(graph: Graph, all_ops: list[ir.Operation], plan: Chunking, table: list[ir.Value],
                 constant: set[ir.Value]) -> None:
    c = plan.chunks
    ops = [all_ops[n].operation for n in plan.nodes]
    mine_ops = set(ops)
    block = ops[0].block
    order = {op: i for i, op in enumerate(block.operations)}
    # Block order, not node order: a later group's rewrite may have moved some of these ops.
    first, last = min(order[op] for op in ops), max(order[op] for op in ops)
    run = sorted(plan.nodes + plan.copies)  # what each chunk computes, in program order
    made = {table[v]: v for n in run for v in graph.nodes[n].results}
    # What leaves the group: read by an op outside it now (a later group's chunks may have taken
    # over all the readers of a value).
    leaving = [v for n in plan.nodes for v in graph.nodes[n].results
               if any(use.owner.operation not in mine_ops for use in table[v].uses)]
    # Ops between the group's first and last that read what it lets out move after it, with what reads them.
    later, tainted = [], {table[v] for v in leaving}
    for op in list(block.operations)[first:last]:
        op = op.operation
        if op not in mine_ops and any(v in tainted for v in _reads(op)):
            later.append(op)
            tainted.update(op.results)
    anchor = list(block.operations)[last + 1].operation  # there is one: the return is in no group
    ip = ir.InsertionPoint(anchor)
    loc = ops[0].location
    previous: list[ir.Value] = []  # the last chunk's values that leave the group
    pieces: dict[int, list[ir.Value]] = {v: [] for v in leaving}
    for k in range(c):
        sliced: dict[tuple, ir.Value] = {}
        for n in run:
            op = all_ops[n].operation
            for pos, operand in enumerate(op.operands):
                if operand in made:
                    continue
                key = (operand, plan.reads.get((n, pos)))
                if key not in sliced:
                    sliced[key] = operand if key[1] is None else _slice(operand, key[1], k, c, ip, op.location)
        # Constants are left out of the barrier: XLA builds them inside their readers' fusions.
        keys = [key for key in sliced if key[0] not in constant]
        if previous:  # chunk k starts once chunk k-1 has made what leaves it
            barrier = hlo.OptimizationBarrierOp(previous + [sliced[key] for key in keys], ip=ip, loc=loc)
            held = list(barrier.results)
            for v, value in zip(leaving, held[:len(previous)]):
                pieces[v][-1] = value
            sliced.update(zip(keys, held[len(previous):]))
        mine: dict[ir.Value, ir.Value] = {}
        for n in run:
            op = all_ops[n].operation
            clone = op.clone(ip=ip)
            for pos, operand in enumerate(op.operands):
                clone.operands[pos] = mine[operand] if operand in made else sliced[operand, plan.reads.get((n, pos))]
            for old, result in zip(op.results, clone.results):
                d = plan.dims[made[old]]
                if d != SUM:
                    result.set_type(_cut_type(old.type, d, c))
                mine[old] = result
            if op.name == "stablehlo.slice":
                _cut_limits(clone, plan.dims[made[op.results[0]]], c)
        previous = [mine[table[v]] for v in leaving]
        for v in leaving:
            pieces[v].append(mine[table[v]])
    for v in leaving:
        whole = _join(pieces[v], plan.dims[v], ip, table[v].owner.location)
        table[v].replace_all_uses_with(whole)
    for op in later:
        op.move_before(anchor)
    for op in reversed(ops):
        op.erase()


def _reads(op: ir.Operation) -> list[ir.Value]:
    """Every value `op` reads, in its regions too."""
    out = list(op.operands)
    for region in op.regions:
        for b in region.blocks:
            for inner in b.operations:
                out += _reads(inner.operation)
    return out


def _cut_type(t: ir.Type, dim: int, chunks: int) -> ir.Type:
    ranked = ir.RankedTensorType(t)
    shape = list(ranked.shape)
    shape[dim] //= chunks
    return ir.RankedTensorType.get(shape, ranked.element_type)


def _slice(value: ir.Value, dim: int, k: int, chunks: int, ip: ir.InsertionPoint, loc) -> ir.Value:
    shape = list(ir.RankedTensorType(value.type).shape)
    step = shape[dim] // chunks
    start = [0] * len(shape)
    limit = list(shape)
    start[dim], limit[dim] = k * step, (k + 1) * step
    return hlo.SliceOp(value, start, limit, [1] * len(shape), ip=ip, loc=loc).result


def _cut_limits(op: ir.Operation, dim: int, chunks: int) -> None:
    """A slice whose result is cut on `dim` reads that dim whole (its loop space keeps only
    unsliced dims): its limit there is the chunk's size."""
    limits = list(ir.DenseI64ArrayAttr(op.attributes["limit_indices"]))
    limits[dim] //= chunks
    op.attributes["limit_indices"] = ir.DenseI64ArrayAttr.get(limits)


def _join(pieces: list[ir.Value], dim: int, ip: ir.InsertionPoint, loc) -> ir.Value:
    if dim != SUM:
        return hlo.ConcatenateOp(pieces, dim, ip=ip, loc=loc).result
    total = pieces[0]
    for p in pieces[1:]:
        total = hlo.AddOp(total, p, ip=ip, loc=loc).result
    return total
