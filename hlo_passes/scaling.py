"""A batch-wide scale in the backward pass: micro-batching a loss averaged over a count taken from
the batch (a mean over the tokens a mask keeps).

Such a loss is sum(terms) / count, both sums over the batch; its gradient spreads 1/count over
the examples (a broadcast of a sum over the batch: per-example values one micro-batch cannot
know). But the backward pass is linear in the cotangent it starts from, so every gradient is
1/count times what it would be with 1 in its place. The micro-batches therefore run with 1
(`unit_scale`), their sums add up as usual, and apply-gradients multiplies the sums that carry
the scale by the whole batch's 1/count, which it computes from the summed count anyway
(`apply_scale`). `find` proves the linearity op by op: a value that carries the scale may only
meet values that do not through ops linear in it (a product with one scaled factor, a sum of
scaled terms, a matmul with one scaled side, moves and reshapes...); anything else (batch
norm's x - mean, a nonlinearity of the scale) is refused by the caller's error.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from .graph import SLOTWISE, Graph

_S = "stablehlo."
# Ops linear in their first operand when the others (indices, shapes, padding 0) carry no scale.
_MOVES = {_S + op for op in ("convert", "reshape", "transpose", "broadcast_in_dim", "slice", "reverse", "negate",
                             "copy", "gather", "dynamic_slice", "pad", "real", "imag")}
# Ops whose data operands must all carry the scale or all not (zeros go with either).
_SUMS = {_S + op for op in ("add", "subtract", "concatenate", "dynamic_update_slice", "scatter", "reduce")}
# Ops linear in one operand at a time: a product with exactly one scaled factor.
_PRODUCTS = {_S + op for op in ("multiply", "dot_general", "convolution")}


@dataclass(frozen=True)
class Scaling:
    scale: int  # the scalar sum over the batch (1/count) that the backward pass spreads
    sites: tuple[int, ...]  # what the broadcasts that spread it over the examples make (value ids)
    scaled: tuple[int, ...]  # the boundary sums that carry it


class NotLinear(Exception):
    """The scale meets the per-example values other than linearly (the caller says why it refuses)."""


def find(graph: Graph, per_example: set[int], aggregate: set[int], zero: Mapping[int, bool]) -> Scaling | None:
    """The scale of the step, or None when no sum over the batch reaches per-example values by a
    broadcast of a scalar. `zero[v]`: v is a zero constant (it goes with scaled and unscaled
    values alike). Raises NotLinear when the step is not linear in it, or has several."""
    sites = [n for n in graph.nodes if n.op == _S + "broadcast_in_dim" and n.operands[0] in aggregate
             and graph.values[n.operands[0]].shape == () and n.results[0] in per_example]
    if not sites:
        return None
    scales = {n.operands[0] for n in sites}
    if len(scales) > 1:
        raise NotLinear("several sums over the batch scale the per-example values")
    if not graph.values[next(iter(scales))].dtype.startswith(("float", "bfloat")):
        raise NotLinear("the sum over the batch that scales the per-example values is not a float")
    scaled = {n.results[0] for n in sites}
    site_ids = {n.id for n in sites}
    # A sum over the batch outside loops is where the micro-batches stop (the boundary): from
    # there on apply-gradients has the whole batch's scale, so the scale is followed up to it.
    summed = {v for v in aggregate if graph.values[v].trips == 1}
    exit_of = {n.attrs["loop_entry"]: n for n in graph.nodes if "loop_entry" in n.attrs}
    changed = True
    while changed:  # a loop's carried slot carries the scale if it enters or comes back with it
        changed = False
        for n in graph.nodes:
            if n.id in site_ids:
                continue
            made = _carries(n, scaled - summed, zero, exit_of)
            changed |= any(r not in scaled for r in made)
            scaled.update(made)
    return Scaling(scales.pop(), tuple(n.results[0] for n in sites), tuple(sorted(scaled)))


def _carries(n, scaled: set[int], zero: Mapping[int, bool], exit_of: dict) -> list[int]:
    """The results of n that carry the scale, given which operands do; NotLinear if n is not
    linear in them."""
    on = [o in scaled for o in n.operands]
    if not any(on) and not (n.op == _S + "while" and any(y in scaled for y in exit_of[n.id].operands)):
        return []
    where = n.name or n.op
    if n.op in SLOTWISE:
        back = exit_of[n.id].operands if n.op == _S + "while" else [None] * len(n.operands)
        return [r for r, o, y in zip(n.results, n.operands, back) if o in scaled or y in scaled]
    if n.op in _MOVES:
        if any(on[1:]) or (n.op == _S + "pad" and not zero.get(n.operands[1], False)):
            raise NotLinear(f"{where} takes an index or padding that carries the scale, or pads with non-zeros")
        return list(n.results)
    if n.op in _PRODUCTS:
        if sum(on) > 1:
            raise NotLinear(f"{where} multiplies the scale by itself")
        return list(n.results)
    if n.op == _S + "divide":
        if on[1]:
            raise NotLinear(f"{where} divides by the scale")
        return list(n.results)
    if n.op == _S + "select":
        data = n.operands[1:]
        if on[0] or not _alike(data, scaled, zero):
            raise NotLinear(f"{where} selects between values with and without the scale")
        return list(n.results)
    if n.op in _SUMS:
        data, starts = list(n.operands), []
        if n.op == _S + "reduce":  # inputs, then their start values
            data, starts = data[:len(data) // 2], data[len(data) // 2:]
        elif n.op == _S + "scatter":  # operand, indices, updates
            data = [data[0], data[2]]
        elif n.op == _S + "dynamic_update_slice":  # operand, update, indices
            data = data[:2]
        adds = n.attrs.get("combiner", _S + "add") == _S + "add"
        if not _alike(data, scaled, zero) or not adds or not all(zero.get(v, False) for v in starts):
            raise NotLinear(f"{where} adds values with and without the scale, or combines them otherwise")
        return list(n.results)
    raise NotLinear(f"{where} ({n.op.split('.')[-1]}) is not linear in the scale")


def _alike(values: Sequence[int], scaled: set[int], zero: Mapping[int, bool]) -> bool:
    return len({v in scaled for v in values if not zero.get(v, False)}) <= 1


def unit_scale(table: Mapping[int, ir.Value], scaling: Scaling) -> None:
    """In place: each site broadcasts 1 instead of the scale (compute-gradients' micro-batches)."""
    for site in scaling.sites:
        op = table[site].owner
        scalar = op.operands[0].type
        with op.context, ir.Location.unknown(), ir.InsertionPoint(op):
            one = hlo.ConstantOp(ir.DenseElementsAttr.get_splat(
                scalar, ir.FloatAttr.get(ir.RankedTensorType(scalar).element_type, 1.0)))
        op.operands[0] = one.result


def apply_scale(value: ir.Value, scale: ir.Value) -> None:
    """In place: every use of `value` (a summed boundary value, an argument of apply-gradients)
    reads it times the scale, computed right after the scale is."""
    with scale.owner.context, ir.InsertionPoint.after(scale.owner), ir.Location.unknown():
        kind = ir.RankedTensorType(value.type)
        factor = scale
        if ir.RankedTensorType(scale.type).element_type != kind.element_type:
            factor = hlo.ConvertOp(ir.RankedTensorType.get([], kind.element_type), scale).result
        spread = hlo.BroadcastInDimOp(kind, factor, ir.DenseI64ArrayAttr.get([])).result
        product = hlo.MulOp(value, spread)
    value.replace_all_uses_except(product.result, product.operation)
