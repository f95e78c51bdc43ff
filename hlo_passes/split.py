"""Programs made of part of a step's module: the values some ops make become arguments, the
return names the values wanted, and what no longer reaches the return is erased. Pipeline stages
and the compute-gradients / apply-gradients programs of micro-batching are such parts.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from jax.extend.mlir import ir
from jax.extend.mlir.dialects import func

from rhino_jax.errors import StagingError
from rhino_jax.core.specs import ShardingSpec

from . import module as mod
from .graph import Graph
from .rewrite import mesh_name

_EFFECTS = {"stablehlo.outfeed", "stablehlo.infeed", "stablehlo.send", "stablehlo.recv"}


def extract(module: ir.Module, graph: Graph, inputs: Sequence[int], outputs: Sequence[int],
            edit: Callable[[dict, dict], None] | None = None) -> ir.Module:
    """A copy of the (inlined) module whose @main takes its own arguments followed by `inputs`
    (values made inside it, which become arguments) and returns `outputs`; ops that no longer
    reach the return are erased. Donation is dropped (the outputs are new). `edit(table,
    arguments)` may change the copy first (value id → its ir.Value; input → its new argument)."""
    callbacks = [n.attrs["side_effect"] for n in graph.nodes if "side_effect" in n.attrs]
    if callbacks:
        raise StagingError(f"the step calls back to the host ({'; '.join(callbacks)}): in micro-batches or "
                           "pipeline stages each callback would run once per micro-batch, on part of the batch; "
                           "use num_micro_batches=1 and pipeline='off', or take the callback out of the step")
    new = mod.copy_module(module)
    table = mod.value_table(new)
    main = mod.entry_function(new)
    block = main.regions[0].blocks[0]
    mesh = mesh_name(new)
    with new.context, ir.Location.unknown():
        replaced = {}
        for v in list(inputs) + list(outputs):
            if graph.values[v].trips > 1:
                raise ValueError(f"value {v} is made inside a loop's body; cut before or after the loop")
            made = graph.nodes[graph.values[v].producer] if graph.values[v].producer >= 0 else None
            if made is not None and "branch" in made.attrs:
                raise StagingError(f"the step would be cut inside a conditional's branch ({made.name or made.op}): "
                                   "sums over the batch made in lax.cond/lax.switch cannot be split into micro-batches "
                                   "or stages yet; use num_micro_batches=1 and pipeline='off'")
        for v in inputs:
            if graph.values[v].producer < 0:
                raise ValueError(f"value {v} is an argument already; list made values only")
            replaced[v] = block.add_argument(table[v].type, ir.Location.unknown())
            table[v].replace_all_uses_with(replaced[v])
        if edit is not None:
            edit(table, replaced)
        ret = mod.entry_return(new)
        with ir.InsertionPoint(ret):
            func.ReturnOp([replaced.get(v, table[v]) for v in outputs])
        ret.erase()
        _erase_dead(block)

        def sharding(v: int) -> ir.DictAttr:
            spec = ShardingSpec.replicated(len(graph.values[v].shape))
            return ir.DictAttr.get({"sdy.sharding": ir.Attribute.parse(f"#sdy.sharding{spec.sdy(mesh)}")})

        args = [a.value for a in graph.args] + list(inputs)
        main.attributes["arg_attrs"] = ir.ArrayAttr.get([sharding(v) for v in args])
        main.attributes["res_attrs"] = ir.ArrayAttr.get([sharding(v) for v in outputs])
        main.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(
            [a.type for a in block.arguments], [replaced.get(v, table[v]).type for v in outputs]))
    return new


def drop_unused_arguments(module: ir.Module, count: int) -> tuple[int, ...]:
    """Erase, in place, those of @main's first `count` arguments that no op reads (a pipeline
    stage reads its own layers' parameters only; the others must not be fed to it, nor counted
    in its memory). Returns the indices of the arguments kept, in order."""
    main = mod.entry_function(module)
    block = main.regions[0].blocks[0]
    unused = {i for i in range(count) if not list(block.arguments[i].uses)}
    attrs = list(main.attributes["arg_attrs"])
    results = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value).results
    with module.context:
        for i in sorted(unused, reverse=True):
            block.erase_argument(i)
            del attrs[i]
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(attrs)
        main.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(
            [a.type for a in block.arguments], list(results)))
    return tuple(i for i in range(count) if i not in unused)


def on_mesh(module: ir.Module, axes: dict[str, int]) -> ir.Module:
    """A copy of the module whose mesh has these axis sizes (a stage's program on its sub-mesh,
    cut along the first axis): shardings name axes, so only the mesh's declaration changes."""
    new = mod.copy_module(module)
    with new.context:
        for op in new.body.operations:
            if op.operation.name == "sdy.mesh":
                listed = ", ".join(f'"{a}"={n}' for a, n in axes.items())
                op.operation.attributes["mesh"] = ir.Attribute.parse(f"#sdy.mesh<[{listed}]>")
                info = ", ".join(f'{{name = "{a}", size = {n} : i64}}' for a, n in axes.items())
                op.operation.attributes["stablehlo.mesh"] = ir.Attribute.parse(f"{{axes = [{info}]}}")
    return new


def _erase_dead(block: ir.Block) -> None:
    """Erase ops of the block (last first) whose results nothing uses and that have no effect."""
    changed = True
    while changed:
        changed = False
        for op in reversed(list(block.operations)):
            op = op.operation
            if op.name == "func.return" or _effectful(op):
                continue
            if all(not list(r.uses) for r in op.results):
                op.erase()
                changed = True


def _effectful(op: ir.Operation) -> bool:
    if op.name in _EFFECTS:
        return True
    return "has_side_effect" in op.attributes and ir.BoolAttr(op.attributes["has_side_effect"]).value
