"""Rewrite: put a plan's shardings into the module, for XLA's SPMD partitioner to realise.

Arguments and results get `sdy.sharding`. Every value the plan fixes is followed by a closed
`sdy.sharding_constraint`, and where an op reads a value in another layout (a reshard the plan
paid for) one more constraint, shared by all readers of that layout, sits before the first
reader. Constraints, not op attributes: XLA keeps the shardings of constraint ops and drops
those on other ops when it imports the module, then re-propagates from what is left, which
is not the plan. A reshard of several steps (`collectives.reshard_path`) gets a constraint per
intermediate layout, so XLA runs the collectives the plan priced: the first settles partial
sums (reduce-scattered or all-reduced; values the plan keeps partial are left open, as a
sharding cannot say "partial").

Strided specs (Rhino §4.1) have no Shardy form, so the program is changed to hold them: a value
split n ways at stride s on a dim of size N gets the shape [..., N/(n·s), n·s, ...] with the
minor part split (`ShardingSpec.split`), and the ops that make and read it are retyped (and
their dimension attributes renumbered) to work on the split dims. Every row-major split keeps
element order, so reshapes stay reshapes, and a reader that wants another layout gets a reshape
to its own shape before its constraint. Arguments and results are never strided.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from jax.extend.mlir import ir
from jax.extend.mlir.dialects import sdy
from jax.extend.mlir.dialects import stablehlo as hlo

from rhino_jax.core.specs import ShardingSpec

from . import module as mod
from .graph import Graph, slots


# Pins are already constraints; a loop that is not counted carries its layout in its body, which
# XLA propagates itself (an attribute on the op alone can disagree with its tuple shape). A counted
# loop's carried values are pinned on the way in, at the top of the body, on the way out of the
# body and after the loop, all to the one layout the plan gives each; a conditional's results at
# each branch's return and after it.
_LEFT_TO_XLA = {"sdy.sharding_constraint", "stablehlo.while"}


def mesh_name(module: ir.Module) -> str:
    """The step's mesh; not the axis-less meshes that pin host callbacks to one device."""
    for op in module.body.operations:
        if op.operation.name == "sdy.mesh" and not str(op.operation.attributes["mesh"]).startswith("#sdy.mesh<[]"):
            return ir.StringAttr(op.operation.attributes["sym_name"]).value
    raise ValueError("the module has no sdy.mesh; lower it with shardings on the mesh first")


def _with_sharding(attrs: ir.ArrayAttr, positions: Sequence[int], specs: Sequence[ShardingSpec],
                   name: str) -> ir.ArrayAttr:
    """`attrs` with `specs[k]` as the sharding of entry `positions[k]` (the others, tokens, as they were)."""
    out = list(attrs)
    for i, spec in zip(positions, specs):
        entries = {n.name: n.attr for n in ir.DictAttr(attrs[i])}
        entries["sdy.sharding"] = ir.Attribute.parse(f"#sdy.sharding{spec.sdy(name)}")
        out[i] = ir.DictAttr.get(entries)
    return ir.ArrayAttr.get(out)


def _settled_after(node, v: int, spec: ShardingSpec, value_specs: dict[int, ShardingSpec],
                   read_paths: dict, readers: Counter) -> bool:
    """Whether a transpose's read of value v in `spec` is left unpinned: the transpose's result is
    pinned to `spec` permuted, v is read so by this op alone and no layout is strided or on the
    way, so the pin after the transpose settles the same reshard (a transpose moves no data
    between devices: the same collective, of the same bytes, on the other side of it). A pin
    between the transpose and the op making v keeps XLA from folding the two (a weight's gradient
    dot, partial, reduce-scattered for its transposed weight: the dot then makes the weight's
    order itself), and the layouts it assigns the dot instead ripple back into the kernels that
    feed the dot: on GPU, extra transposes and converts in the backward pass."""
    if node.op != "stablehlo.transpose" or spec.partial or spec.strides or (v, spec) in read_paths \
            or readers[v, spec] != 1:
        return False
    made, out = value_specs.get(v), value_specs.get(node.results[0])
    if (made is not None and made.strides) or out is None or out.partial or out.strides:
        return False
    return out.dims == tuple(spec.dims[d] for d in node.attrs["perm"])


def _dim_map(shape: tuple[int, ...], spec: ShardingSpec | None) -> list[list[int]]:
    """For each dim of a tensor, its dims once strided dims are split in two."""
    out, k = [], 0
    for d in range(len(shape)):
        width = 2 if spec is not None and spec.stride(d) is not None else 1
        out.append(list(range(k, k + width)))
        k += width
    return out


def _flat(dim_map: list[list[int]], dims) -> list[int]:
    return [n for d in dims for n in dim_map[d]]


def _renumber(op: ir.Operation, node, ins: list[list[list[int]]], outs: list[list[list[int]]]) -> None:
    """Rewrite the dimension attributes of `op` for split dims (`ins`/`outs`: `_dim_map` of each
    operand and result). Only ops in `strides.STRIDED_OPS` ever see a split dim."""
    a = node.attrs
    if node.op == "stablehlo.broadcast_in_dim":
        # A size-1 operand dim broadcast into a split dim maps onto its major part.
        op.attributes["broadcast_dimensions"] = ir.DenseI64ArrayAttr.get(
            [n for i, d in enumerate(a["dims"]) for n in (outs[0][d] if len(ins[0][i]) == 2 else outs[0][d][:1])])
    elif node.op == "stablehlo.transpose":
        op.attributes["permutation"] = ir.DenseI64ArrayAttr.get(_flat(ins[0], a["perm"]))
    elif node.op == "stablehlo.reduce":
        op.attributes["dimensions"] = ir.DenseI64ArrayAttr.get(_flat(ins[0], a["dims"]))
    elif node.op == "stablehlo.dot_general":
        op.attributes["dot_dimension_numbers"] = hlo.DotDimensionNumbers.get(
            lhs_batching_dimensions=_flat(ins[0], a["lhs_batch"]),
            rhs_batching_dimensions=_flat(ins[1], a["rhs_batch"]),
            lhs_contracting_dimensions=_flat(ins[0], a["lhs_contract"]),
            rhs_contracting_dimensions=_flat(ins[1], a["rhs_contract"]))


def rewrite(module: ir.Module, graph: Graph, value_specs: dict[int, ShardingSpec],
            read_specs: dict[tuple[int, int], ShardingSpec],
            read_paths: dict[tuple[int, ShardingSpec], tuple[ShardingSpec, ...]],
            arg_specs: Sequence[ShardingSpec], out_specs: Sequence[ShardingSpec],
            axis_sizes: dict[str, int]) -> ir.Module:
    """Annotate `module` (the inlined module `graph` was imported from) in place.
    `read_specs[node, operand]`: the layout an op reads where it differs from the producer's;
    `read_paths[value, layout read]`: the layouts it passes through on the way (`Plan.read_paths`)."""
    name = mesh_name(module)
    main = mod.entry_function(module)
    readers = Counter((graph.nodes[n].operands[pos], spec) for (n, pos), spec in read_specs.items())

    def split(v: int, spec: ShardingSpec | None) -> tuple[tuple[int, ...], ShardingSpec | None]:
        shape = graph.values[v].shape
        return (shape, None) if spec is None else spec.split(shape, axis_sizes)

    def constrain(value: ir.Value, spec: ShardingSpec, before: ir.Operation) -> ir.Value:
        with ir.InsertionPoint(before), before.location:
            return sdy.ShardingConstraintOp(value, ir.Attribute.parse(f"#sdy.sharding{spec.sdy(name)}")).result

    def reshaped(value: ir.Value, shape: tuple[int, ...], before: ir.Operation) -> ir.Value:
        if not isinstance(value.type, ir.RankedTensorType) or tuple(value.type.shape) == shape:
            return value  # tokens (ordered effects) pass as they are
        element = ir.RankedTensorType(value.type).element_type
        with ir.InsertionPoint(before), before.location:
            return hlo.ReshapeOp(ir.RankedTensorType.get(shape, element), value).result

    # A value pinned to a layout for its readers, by the block the constraint is in: readers in
    # that block or one inside it share it; a constraint in a conditional's branch is not seen
    # outside it (the plan prices such reshards alike, `plan_making._visible`).
    reads: dict[tuple[int, ShardingSpec, ir.Block], ir.Value] = {}

    def pinned(v: int, spec: ShardingSpec, before: ir.Operation, make) -> ir.Value:
        """The constraint of v to `spec` a reader at `before` sees, made by `make()` if none is."""
        block = before.block
        while True:
            if (v, spec, block) in reads:
                return reads[v, spec, block]
            owner = block.owner.operation
            if owner.name == "func.func":
                break
            block = owner.block
        reads[v, spec, before.block] = made = make()
        return made

    def pinned_path(v: int, spec: ShardingSpec, source: ir.Value, before: ir.Operation) -> ir.Value:
        """`source` (value v) pinned to each layout on the plan's way to `spec`, the last one excluded
        (partial sums settled, then one step per move): left to itself between distant layouts,
        XLA may go another, dearer way. A layout on the way of several reads is pinned once."""
        for mid in read_paths.get((v, spec), ()):
            source = pinned(v, mid, before, lambda src=source, mid=mid: constrain(src, mid, before))
        return source

    ret = mod.entry_return(module)
    arrays = {"arg_attrs": mod.array_positions(main.regions[0].blocks[0].arguments),
              "res_attrs": mod.array_positions(ret.operands)}  # the graph's args and outputs: not tokens
    with module.context:
        for key, specs in (("arg_attrs", arg_specs), ("res_attrs", out_specs)):
            if specs:  # a step without arguments (or results) has no such attribute
                main.attributes[key] = _with_sharding(main.attributes[key], arrays[key], specs, name)
        loops: list[ir.Operation] = []  # the counted loops (while ops) the walk is inside
        for node, site in zip(graph.nodes, list(mod.entry_sites(module))):
            op = site.op
            assert node.op == op.name, "module and graph are out of step"
            left = node.op in _LEFT_TO_XLA and site.kind == "opaque"
            slotwise = site.kind in ("loop", "loop_end", "case")
            passes_on = {first + k: r for first, reads, r in slots(node) for k in range(len(reads))} if slotwise else {}
            ins = []
            for pos, (v, (reader, at)) in enumerate(zip(node.operands, mod.read_places(site))):
                spec = read_specs.get((node.id, pos))
                if spec is not None and _settled_after(node, v, spec, value_specs, read_paths, readers):
                    spec = None
                if pos in passes_on and spec is None and graph.values[v].dtype != "token":  # the slot's one layout
                    spec = value_specs.get(passes_on[pos])
                if left or spec is None:  # read as produced (or, by ops left to XLA, unsplit)
                    wanted = None if left else value_specs.get(v)
                    source = reshaped(reader.operands[at], split(v, wanted)[0], reader)
                    if spec is not None and node.op == "sdy.sharding_constraint":
                        source = pinned_path(v, spec, source, reader)  # a pin: its own op is the last step
                    reader.operands[at] = source
                    ins.append(_dim_map(graph.values[v].shape, wanted))
                    continue
                def make(v=v, spec=spec, reader=reader, at=at) -> ir.Value:
                    shape, physical = split(v, spec)
                    source = pinned_path(v, spec, reader.operands[at], reader)
                    return constrain(reshaped(source, shape, reader), physical, reader)
                reader.operands[at] = pinned(v, spec, reader, make)
                ins.append(_dim_map(graph.values[v].shape, spec))
            if slotwise:
                if site.kind == "loop":
                    loops.append(op)
                    body = op.regions[1].blocks[0]
                    made, first = list(body.arguments), list(body.operations)[0].operation
                else:
                    loop = loops.pop() if site.kind == "loop_end" else op
                    made, first = list(loop.results), None
                for r, result in zip(node.results, made):
                    spec = value_specs.get(r)
                    if spec is None or graph.values[r].dtype == "token":
                        continue
                    c = constrain(result, spec, first if first is not None else loop)
                    if first is None:
                        c.owner.operation.move_after(loop)
                    result.replace_all_uses_except(c, c.owner.operation)
                continue
            if left:
                continue
            outs = [_dim_map(graph.values[r].shape, value_specs.get(r)) for r in node.results]
            if any(len(m) > 1 for dims in ins + outs for m in dims):
                _renumber(op.operation, node, ins, outs)
                for r, result in zip(node.results, op.results):
                    with op.location:
                        result.set_type(ir.RankedTensorType.get(split(r, value_specs.get(r))[0],
                                                                ir.RankedTensorType(result.type).element_type))
            for r, result in zip(node.results, op.results):
                spec = value_specs.get(r)
                if spec is None or spec.partial or graph.values[r].dtype == "token":
                    continue
                c = constrain(result, split(r, spec)[1], op.operation)
                c.owner.operation.move_after(op.operation)
                result.replace_all_uses_except(c, c.owner.operation)
        for k, (v, r) in enumerate(zip(graph.outputs, arrays["res_attrs"])):
            ret.operands[r] = pinned_path(v, out_specs[k], reshaped(ret.operands[r], graph.values[v].shape, ret),
                                          ret)
    return module
