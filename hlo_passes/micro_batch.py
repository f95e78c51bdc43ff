"""Micro-batching as data parallelism over time: the gradient boundary, and the two programs.

Data parallelism splits the batch over devices; each computes its examples' terms, and the
all-reduces add up the sums over examples (a weight's gradient, a loss's numerator, a token
count) before anything nonlinear uses them. Micro-batching splits the batch over time instead,
and the same sums are where to stop, add up, and go on: whatever the loss (a mean, a sum, a
mean over non-masked tokens), adding the micro-batches' partial sums gives the whole batch's.

The step is lowered twice, for the whole batch and for one micro-batch; jax lowers both to the
same ops. A value whose shape differs between the two is per example (it has the batch dim); a
value of the batch with the same shape in both is a sum over examples (an aggregate). The
boundary is the first aggregates: made from per-example values by a summing op (reduce-add,
a matmul or convolution over the batch dim, scatter-add), or coming out of a loop. Then:
- compute-gradients (CG): the micro-batch program up to the boundary, with the whole batch's
  constants (a mean's 1/B, its cotangent) put in place of the micro-batch's, so that each
  micro-batch computes exactly its share of the whole program's sums, and its iotas along the
  batch (positions, random bits' counters) count from its first example (`batch_positions`);
- apply-gradients (AG): the whole-batch program from the boundary on.
A loss averaged over a count taken from the batch (the tokens a mask keeps) scales every
example's gradient by 1/count, a sum over the whole batch: the backward pass is linear in it, so
the micro-batches run with 1 in its place and apply-gradients applies the whole batch's
(`scaling`). A step whose per-example values need a sum over the batch otherwise (batch norm's
statistics) cannot be split so: an error says why.
"""
from __future__ import annotations

from dataclasses import dataclass

from jax.extend.mlir import ir

from rhino_jax.errors import StagingError

from . import batch_positions, scaling
from . import module as mod
from .graph import SLOTWISE, Graph, reach
from .split import extract

# Ops that may turn per-example values into a sum over examples (the combiner is checked).
_SUMMING = {"stablehlo.reduce", "stablehlo.dot_general", "stablehlo.convolution", "stablehlo.scatter"}


def _check_carried_sums(graph: Graph, node, aggregate: set[int]) -> None:
    """A loop that adds per-example terms into a carried value (a scan's weight gradients) adds
    up over micro-batches like any sum, provided the carry starts at zero: else each micro-batch
    would add its start again."""
    ret = next(n for n in graph.nodes if n.attrs.get("loop_entry") == node.id)
    for slot, (init, inside, carried) in enumerate(zip(node.operands, node.results, ret.operands)):
        if (inside in aggregate or carried in aggregate) and not graph.is_zero(init):
            raise StagingError(f"{node.name or 'a loop'} carries a sum over the batch (slot {slot}) that does not "
                               "start at zero; micro-batches would each add its start. Use num_micro_batches=1")


@dataclass(frozen=True)
class MicroSplit:
    boundary: tuple[int, ...]  # value ids (the same in both graphs): the sums to add up
    compute: ir.Module  # one micro-batch: the step's arguments (micro-batch shapes) → the boundary
    apply: ir.Module  # the step's arguments (whole batch) and the summed boundary → the outputs


def _batch(graph: Graph) -> set[int]:
    """The values that depend on the batch (`reach`)."""
    bits = reach(graph, {a.value: 1 for a in graph.args if a.role == "batch"})
    return {v for v, b in enumerate(bits) if b}


def _check_alike(whole: Graph, micro: Graph) -> None:
    if len(whole.nodes) != len(micro.nodes) or any(a.op != b.op for a, b in zip(whole.nodes, micro.nodes)):
        raise StagingError("jax lowered the step to different ops for one micro-batch than for the whole batch; "
                           "micro-batching needs one program shape for both (try another num_micro_batches)")


def boundary(whole: Graph, micro: Graph) -> tuple[tuple[int, ...], scaling.Scaling | None]:
    """The sums over examples the outputs read (see the module's docstring), in program order,
    and the batch-wide scale of the backward pass if there is one (`scaling`)."""
    _check_alike(whole, micro)
    batch = _batch(whole)
    per_example = {v.id for v in whole.values if v.shape != micro.values[v.id].shape}
    aggregate = batch - per_example
    producer = {r: n for n in whole.nodes for r in n.results}
    try:
        scale, why_not = scaling.find(whole, per_example, aggregate,
                                      {v.id: True for v in whole.values if whole.is_zero(v.id)}), ""
    except scaling.NotLinear as e:
        scale, why_not = None, f" (here {e})"
    spread = set(scale.sites) if scale else set()
    for n in whole.nodes:
        made = [r for r in n.results if r in aggregate]
        if n.op in SLOTWISE:  # slot k in, slot k out: a sum is checked where it is made
            if n.op == "stablehlo.while":
                _check_carried_sums(whole, n, aggregate)
            continue
        if not made or not any(o in per_example for o in n.operands):
            continue
        combiner = n.attrs.get("combiner", "stablehlo.add")
        if n.op not in _SUMMING or combiner != "stablehlo.add":
            raise StagingError(f"micro-batching adds up sums over the batch, but {n.name or n.op} "
                               f"({n.op.split('.')[-1]}) combines the examples otherwise; use num_micro_batches=1")
    for n in whole.nodes:
        if n.op in SLOTWISE or spread & set(n.results):
            continue
        if any(r in per_example for r in n.results) and any(o in aggregate for o in n.operands):
            raise StagingError(f"{n.name or n.op} computes per-example values from a sum over the whole batch "
                               f"(batch statistics{why_not}), which one micro-batch cannot know; micro-batching "
                               "would change the numbers. Use num_micro_batches=1, or a normalization that does not "
                               "depend on the batch")

    def first(v: int) -> bool:  # an aggregate made from per-example values, or leaving a loop's body
        n = producer.get(v)
        return (v in aggregate and whole.values[v].trips == 1 and n is not None
                and any(o in per_example or whole.values[o].trips > 1 for o in n.operands))

    found: set[int] = set()
    for k, out in enumerate(whole.outputs):
        stack, seen = [out], set()
        while stack:
            v = stack.pop()
            if v in seen or v not in batch:
                continue
            seen.add(v)
            if first(v):
                found.add(v)
            elif v in producer and v not in per_example:
                stack.extend(producer[v].operands)
            else:
                raise StagingError(f"{whole.output_paths[k]} returns per-example values of the batch; micro-"
                                   "batching can only add up sums over it. Use num_micro_batches=1")
    return tuple(sorted(found)), scale


def _with_whole_constants(micro_module: ir.Module, whole_module: ir.Module, micro: Graph) -> ir.Module:
    """A copy of the micro-batch module whose constants that depend on the batch size (a mean's
    1/B and its cotangent) take the whole batch's values, so each micro-batch computes its share
    of the whole program's sums. A splat keeps the micro-batch's shape; any other constant that
    differs is an error."""
    new = mod.copy_module(micro_module)
    ours, theirs = mod.value_table(new), mod.value_table(whole_module)
    with new.context:
        for n in micro.nodes:
            if n.op != "stablehlo.constant":
                continue
            op, whole_op = ours[n.results[0]].owner, theirs[n.results[0]].owner
            if mod.same_constant(op, whole_op):
                continue
            dense, whole_dense = mod.constant_value(op), mod.constant_value(whole_op)
            if dense is None or whole_dense is None or not (dense.is_splat and whole_dense.is_splat):
                raise StagingError(f"{n.name or 'a constant'} depends on the batch size element by element; "
                                   "micro-batching cannot give it the whole batch's values. Use num_micro_batches=1")
            element = ir.Attribute.parse(str(whole_dense.get_splat_value()))  # into this module's context
            op.attributes["value"] = ir.DenseElementsAttr.get_splat(dense.type, element)
    return new


def split(whole_module: ir.Module, whole: Graph, micro_module: ir.Module, micro: Graph) -> MicroSplit:
    """The boundary and the two programs of a step lowered for the whole batch and for one
    micro-batch (`boundary`)."""
    cut, scale = boundary(whole, micro)
    micro_module = _with_whole_constants(micro_module, whole_module, micro)
    batch_positions.mark(micro_module, micro, batch_positions.find(whole, micro, micro_module, _batch(whole)))
    compute = extract(micro_module, micro, [], cut,
                      (lambda table, _: scaling.unit_scale(table, scale)) if scale else None)

    def rescale(table: dict, arguments: dict) -> None:
        for v in set(cut) & set(scale.scaled):
            scaling.apply_scale(arguments[v], table[scale.scale])

    apply = extract(whole_module, whole, cut, whole.outputs, rescale if scale else None)
    return MicroSplit(cut, compute, apply)
