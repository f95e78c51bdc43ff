"""Import: StableHLO module (inlined) → Graph IR.

Each op of @main becomes a Node with the facts its sharding rule needs (dimension numbers,
reduce combiners, slice bounds, ...) as plain Python values. A counted loop's body is imported
op by op between the loop's entry and exit nodes (see `graph`), and a conditional's branches op by
op before its node; other ops with regions stay one node (their bodies are only read to name the
combiner); ops the rules do not know keep working through the replicated fallback of the strategy
space.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as shlo

from . import module as mod
from .graph import Arg, Graph, Node, Pin, Value

_ELEMENT_TYPES = {
    "f32": "float32", "f16": "float16", "bf16": "bfloat16", "f64": "float64",
    "i1": "bool", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
    "ui8": "uint8", "ui16": "uint16", "ui32": "uint32", "ui64": "uint64",
    "complex<f32>": "complex64", "complex<f64>": "complex128",
    "f8E4M3FN": "float8_e4m3fn", "f8E5M2": "float8_e5m2",
}


def _tensor_type(t: ir.Type) -> tuple[tuple[int, ...], str]:
    if isinstance(t, ir.RankedTensorType):
        rt = t
        return tuple(rt.shape), _ELEMENT_TYPES.get(str(rt.element_type), str(rt.element_type))
    return (), "token"  # tokens and other non-tensor values: no bytes, never sharded


def _ints(attr) -> list[int]:
    if attr is None:
        return []
    if isinstance(attr, (ir.DenseI64ArrayAttr, ir.DenseBoolArrayAttr)):
        return [int(x) for x in attr]
    if isinstance(attr, ir.DenseIntElementsAttr):
        return [int(x) for x in attr]
    raise TypeError(f"not an integer array attribute: {attr}")


def _int(attr) -> int:
    return ir.IntegerAttr(attr).value


def _attr(op: ir.Operation, name: str):
    return op.attributes[name] if name in op.attributes else None


def _combiner(op: ir.Operation, region: int = 0) -> str:
    """Name of the single op a reduction body applies ('stablehlo.add', ...), else 'complex'."""
    body = [o.operation.name for o in op.regions[region].blocks[0].operations]
    body = [n for n in body if n != "stablehlo.return"]
    return body[0] if len(body) == 1 else "complex"


def _window_attrs(op: ir.Operation) -> dict:
    """Window of a reduce_window or select_and_scatter, absent attributes at their defaults
    (select_and_scatter has no base dilations); padding as low + high per dim. Window dilations
    are left out: they only matter on dims a window crosses, which rules never split."""
    rank = len(_ints(op.attributes["window_dimensions"]))
    pad = _ints(_attr(op, "padding")) or [0] * (2 * rank)
    return dict(window=_ints(op.attributes["window_dimensions"]),
                strides=_ints(_attr(op, "window_strides")) or [1] * rank,
                padding=[pad[2 * i] + pad[2 * i + 1] for i in range(rank)],
                base_dilations=_ints(_attr(op, "base_dilations")) or [1] * rank)


def _zero_splat(dense: ir.DenseElementsAttr | None) -> bool:
    """A dense constant whose every element is 0 (micro-batching checks that carried sums start
    there); complex constants (None) are not known to be."""
    if dense is None or not dense.is_splat:
        return False
    element = dense.get_splat_value()
    for kind in (ir.FloatAttr, ir.IntegerAttr):
        try:
            return kind(element).value == 0
        except ValueError:
            continue
    return False


def _op_attrs(op: ir.Operation) -> dict:
    """The plain-data facts of one op that sharding rules and FLOP counts read."""
    name = op.name
    a: dict = {}
    if name == "stablehlo.dot_general":
        dn = shlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
        a.update(lhs_batch=list(dn.lhs_batching_dimensions), rhs_batch=list(dn.rhs_batching_dimensions),
                 lhs_contract=list(dn.lhs_contracting_dimensions),
                 rhs_contract=list(dn.rhs_contracting_dimensions))
    elif name == "stablehlo.convolution":
        dn = shlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
        a.update(in_batch=dn.input_batch_dimension, in_feature=dn.input_feature_dimension,
                 in_spatial=list(dn.input_spatial_dimensions),
                 k_in=dn.kernel_input_feature_dimension, k_out=dn.kernel_output_feature_dimension,
                 k_spatial=list(dn.kernel_spatial_dimensions),
                 out_batch=dn.output_batch_dimension, out_feature=dn.output_feature_dimension,
                 out_spatial=list(dn.output_spatial_dimensions),
                 feature_groups=_int(op.attributes["feature_group_count"]),
                 batch_groups=_int(op.attributes["batch_group_count"]))
    elif name == "stablehlo.broadcast_in_dim":
        a["dims"] = _ints(op.attributes["broadcast_dimensions"])
    elif name == "stablehlo.constant":
        a["zero"] = _zero_splat(mod.constant_value(op))
    elif name == "stablehlo.transpose":
        a["perm"] = _ints(op.attributes["permutation"])
    elif name == "stablehlo.reduce":
        a["dims"] = _ints(op.attributes["dimensions"])
        a["combiner"] = _combiner(op)
    elif name == "stablehlo.slice":
        a.update(start=_ints(op.attributes["start_indices"]), limit=_ints(op.attributes["limit_indices"]),
                 strides=_ints(op.attributes["strides"]))
    elif name == "stablehlo.concatenate":
        a["dim"] = _int(op.attributes["dimension"])
    elif name == "stablehlo.pad":
        a.update(low=_ints(op.attributes["edge_padding_low"]), high=_ints(op.attributes["edge_padding_high"]),
                 interior=_ints(op.attributes["interior_padding"]))
    elif name == "stablehlo.dynamic_slice":
        a["sizes"] = _ints(op.attributes["slice_sizes"])
    elif name == "stablehlo.gather":
        dn = shlo.GatherDimensionNumbers(op.attributes["dimension_numbers"])
        a.update(offset_dims=list(dn.offset_dims), collapsed=list(dn.collapsed_slice_dims),
                 operand_batching=list(dn.operand_batching_dims),
                 indices_batching=list(dn.start_indices_batching_dims),
                 start_index_map=list(dn.start_index_map), index_vector_dim=dn.index_vector_dim,
                 sizes=_ints(op.attributes["slice_sizes"]))
    elif name == "stablehlo.scatter":
        dn = shlo.ScatterDimensionNumbers(op.attributes["scatter_dimension_numbers"])
        a.update(update_window_dims=list(dn.update_window_dims),
                 inserted_window_dims=list(dn.inserted_window_dims),
                 input_batching=list(dn.input_batching_dims),
                 indices_batching=list(dn.scatter_indices_batching_dims),
                 scatter_dims_to_operand=list(dn.scattered_dims_to_operand_dims),
                 index_vector_dim=dn.index_vector_dim, combiner=_combiner(op))
    elif name == "stablehlo.reduce_window":
        a.update(_window_attrs(op), combiner=_combiner(op))
    elif name == "stablehlo.select_and_scatter":
        a.update(_window_attrs(op))
    elif name == "stablehlo.reverse":
        a["dims"] = _ints(op.attributes["dimensions"])
    elif name in ("stablehlo.sort", "chlo.scan"):
        a["dim"] = _int(op.attributes["dimension"])
    elif name == "stablehlo.iota":
        a["dim"] = _int(op.attributes["iota_dimension"])
    elif name == "stablehlo.custom_call":
        a["target"] = ir.StringAttr(op.attributes["call_target_name"]).value
    elif name == "sdy.sharding_constraint":
        a["sharding"] = str(op.attributes["sharding"])
    if "has_side_effect" in op.attributes and ir.BoolAttr(op.attributes["has_side_effect"]).value:
        # a host callback (io_callback, jax.debug.print): it runs once per step, which errors name
        a["side_effect"] = f"{mod.source_name(op).rstrip(':') or name} at {mod.source_line(op) or 'an unknown line'}"
    return a


def _flops(op: str, attrs: dict, in_shapes: Sequence[tuple], out_shapes: Sequence[tuple]) -> float:
    """FLOPs of one op: exact for dot/convolution, one per element for the rest."""
    out_elems = sum(int(np.prod(s, dtype=np.int64)) for s in out_shapes)
    if op == "stablehlo.dot_general":
        k = int(np.prod([in_shapes[0][d] for d in attrs["lhs_contract"]], dtype=np.int64))
        return 2.0 * out_elems * k
    if op == "stablehlo.convolution":
        kshape = in_shapes[1]
        window = int(np.prod([kshape[d] for d in attrs["k_spatial"]], dtype=np.int64))
        return 2.0 * out_elems * window * kshape[attrs["k_in"]]
    if op in ("stablehlo.reduce", "stablehlo.reduce_window"):
        return float(sum(int(np.prod(s, dtype=np.int64)) for s in in_shapes[: len(in_shapes) // 2]))
    if op.startswith("stablehlo.") and op[len("stablehlo."):] in _DATA_MOVEMENT:
        return 0.0
    return float(out_elems)


_DATA_MOVEMENT = {
    "broadcast_in_dim", "reshape", "transpose", "slice", "concatenate", "pad", "dynamic_slice",
    "dynamic_update_slice", "gather", "constant", "iota", "bitcast_convert", "reverse",
}

_SDY_DIMS = re.compile(r"\[(.*)\]")
_SDY_DIM = re.compile(r"\{([^}]*)\}")


def parse_sdy_dims(text: str) -> tuple[tuple[str, ...] | None, ...]:
    """'#sdy.sharding<@mesh, [{"data"}, {}, {?}]>' → (("data",), (), None). Open dims are None."""
    body = _SDY_DIMS.search(text)
    if not body:
        return ()
    dims = []
    for d in _SDY_DIM.findall(body.group(1)):
        axes = tuple(re.findall(r'"([^"]+)"', d))
        dims.append(None if ("?" in d and not axes) else axes)
    return tuple(dims)


def pinned_whole(graph: Graph, args: Sequence[bool], outputs: Sequence[bool]) -> Graph:
    """`graph` with the arguments and outputs flagged in `args` and `outputs` pinned whole (one
    program of a step cut in several passes a key on as its key data: `lowering.extended_leaves`
    of the step, flags of its own arguments and results)."""
    values = [a.value for a, flag in zip(graph.args, args) if flag]
    values += [v for v, flag in zip(graph.outputs, outputs) if flag]
    names = dict(zip(graph.outputs, graph.output_paths)) | {a.value: a.path for a in graph.args}
    whole = tuple(Pin(v, ((),) * len(graph.values[v].shape), names[v]) for v in dict.fromkeys(values))
    return graph.replace(pins=graph.pins + whole) if whole else graph


def import_module(module: ir.Module, arg_paths: Sequence[str], arg_roles: Sequence[str],
                  output_paths: Sequence[str]) -> Graph:
    """Build the Graph IR of an inlined module (see `module.inline_calls`).

    `arg_paths`/`arg_roles` describe @main's array arguments in order (the flattened user pytree);
    `output_paths` names its array results. The tokens of ordered effects (`module.is_token`) are
    values of the graph but neither arguments nor outputs: the rewrite leaves them where they are."""
    main = mod.entry_function(module)
    block = main.regions[0].blocks[0]
    ret = mod.entry_return(module)
    arrays, returned = mod.array_positions(block.arguments), mod.array_positions(ret.operands)
    if len(arrays) != len(arg_paths):
        raise ValueError(f"module has {len(arrays)} array arguments, expected {len(arg_paths)}")
    output_of = {r: k for k, r in enumerate(returned)}  # @main's result index -> the output's
    values: list[Value] = []
    ids: dict = {}

    def new_value(v: ir.Value, producer: int, constant: bool, trips: int = 1) -> int:
        shape, dtype = _tensor_type(v.type)
        vid = len(values)
        values.append(Value(vid, shape, dtype, producer, constant, trips))
        ids[v] = vid
        return vid

    arg_attrs = main.attributes["arg_attrs"] if "arg_attrs" in main.attributes else None
    args: list[Arg] = []
    # Tokens (ordered effects) are values the ops thread through, but no argument of the user's.
    for barg in block.arguments:
        new_value(barg, -1, False)
    for i, path, role in zip(arrays, arg_paths, arg_roles):
        donated = None
        if arg_attrs is not None:
            d = ir.DictAttr(arg_attrs[i])
            if "tf.aliasing_output" in d:
                donated = output_of[_int(d["tf.aliasing_output"])]
        args.append(Arg(len(args), path, role, ids[block.arguments[i]], donated))

    nodes: list[Node] = []
    pins: list[Pin] = []
    loop_nodes: list[int] = []  # the entry node of each counted loop the walk is inside
    for site, defined in mod.entry_values(module):
        op = site.op
        nid = len(nodes)
        operands = tuple(ids[reader.operands[at]] for reader, at in mod.read_places(site))
        constant = all(values[o].constant for o in operands)
        attrs = _op_attrs(op)
        if site.kind == "loop":
            loop_nodes.append(nid)
            results = tuple(new_value(a, nid, False, site.trips * site.loop_trips) for a in defined)
        elif site.kind == "loop_end":
            attrs["loop_entry"] = loop_nodes.pop()
            results = tuple(new_value(r, nid, False, site.trips // site.loop_trips) for r in defined)
        else:
            results = tuple(new_value(r, nid, constant, site.trips) for r in defined)
        if site.loop_trips:
            attrs["loop_trips"] = site.loop_trips
        if site.reason:
            attrs["opaque"] = site.reason
        if site.kind == "case":
            attrs["branches"], attrs["alternatives"] = len(op.regions), site.alternatives
        if site.branch:
            attrs["branch"] = site.branch
        flops = 0.0 if site.loop_trips else _flops(op.name, attrs, [values[o].shape for o in operands],
                                                   [values[r].shape for r in results])
        node = Node(nid, op.name, operands, results, attrs, flops, mod.source_name(op), site.trips)
        nodes.append(node)
        if op.name == "sdy.sharding_constraint":
            pins.append(Pin(results[0], parse_sdy_dims(attrs["sharding"]), node.name or f"%{nid}"))
    outputs = tuple(ids[ret.operands[r]] for r in returned)
    return Graph(tuple(nodes), tuple(values), tuple(args), outputs, tuple(output_paths), tuple(pins))
