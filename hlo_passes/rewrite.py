"""Rewrite: put a plan's shardings into the module, for XLA's SPMD partitioner to realise.

Arguments and results get `sdy.sharding`. Every value the plan fixes is followed by a closed
`sdy.sharding_constraint`, and where an op reads a value in another layout (a reshard the plan
paid for) one more constraint, shared by all readers of that layout, sits before the first
reader. Constraints, not op attributes: XLA keeps the shardings of constraint ops and drops
those on other ops when it imports the module, then re-propagates from what is left, which
is not the plan. Values the plan keeps as partial sums are left open: the partitioner settles
them at their readers' constraints, which is where the plan charged the reduction.
"""
from __future__ import annotations

from collections.abc import Sequence

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import sdy

from ..search.specs import ShardingSpec
from . import module as mod
from .graph import Graph


# Pins are already constraints; control flow carries its layout in its regions, which XLA
# propagates itself (an attribute on the op alone can disagree with its tuple shape).
_LEFT_TO_XLA = {"sdy.sharding_constraint", "stablehlo.while", "stablehlo.case", "stablehlo.if"}


def mesh_name(module: ir.Module) -> str:
    for op in module.body.operations:
        if op.operation.name == "sdy.mesh":
            return ir.StringAttr(op.operation.attributes["sym_name"]).value
    raise ValueError("the module has no sdy.mesh; lower it with shardings on the mesh first")


def _with_sharding(attrs: ir.ArrayAttr, specs: Sequence[ShardingSpec], name: str) -> ir.ArrayAttr:
    out = []
    for a, spec in zip(attrs, specs):
        entries = {n.name: n.attr for n in ir.DictAttr(a)}
        entries["sdy.sharding"] = ir.Attribute.parse(f"#sdy.sharding{spec.sdy(name)}")
        out.append(ir.DictAttr.get(entries))
    return ir.ArrayAttr.get(out)


def rewrite(module: ir.Module, graph: Graph, value_specs: dict[int, ShardingSpec],
            read_specs: dict[tuple[int, int], ShardingSpec],
            arg_specs: Sequence[ShardingSpec], out_specs: Sequence[ShardingSpec]) -> ir.Module:
    """Annotate `module` (the inlined module `graph` was imported from) in place.
    `read_specs[node, operand]`: the layout an op reads where it differs from the producer's."""
    name = mesh_name(module)
    main = mod.entry_function(module)

    def constrain(value: ir.Value, spec: ShardingSpec, before: ir.Operation) -> sdy.ShardingConstraintOp:
        with ir.InsertionPoint(before), before.location:
            return sdy.ShardingConstraintOp(value, ir.Attribute.parse(f"#sdy.sharding{spec.sdy(name)}"))

    with module.context:
        main.attributes["arg_attrs"] = _with_sharding(main.attributes["arg_attrs"], arg_specs, name)
        main.attributes["res_attrs"] = _with_sharding(main.attributes["res_attrs"], out_specs, name)
        reads: dict[tuple[int, ShardingSpec], ir.Value] = {}
        for node, op in zip(graph.nodes, list(mod.entry_ops(module))):
            assert node.op == op.name, "module and graph are out of step"
            if node.op in _LEFT_TO_XLA:
                continue
            for pos, v in enumerate(node.operands):
                spec = read_specs.get((node.id, pos))
                if spec is not None:
                    if (v, spec) not in reads:
                        reads[v, spec] = constrain(op.operands[pos], spec, op.operation).result
                    op.operands[pos] = reads[v, spec]
            for r, result in zip(node.results, op.results):
                spec = value_specs.get(r)
                if spec is None or spec.partial or graph.values[r].dtype == "token":
                    continue
                c = constrain(result, spec, op.operation)
                c.operation.move_after(op.operation)
                result.replace_all_uses_except(c.result, c.operation)
    return module
