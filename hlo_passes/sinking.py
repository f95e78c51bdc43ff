"""Loop-invariant constants sunk back into the loops that read them.

jax's scan hoists what its body computes from constants alone (a causal mask from iotas, the
-1e9 of a masked softmax broadcast to the scores' shape) out of the loop, and passes it in as a
carried value that the body hands back unchanged. The search leaves constants to XLA, which
builds each where it is read, in its reader's layout and inside its reader's fusion: no buffer,
nothing to move (`search.planner`). A carried value is a buffer, though, whose one layout the
loop's slot sets, and XLA does not sink a broadcast back into the body: a scanned Llama step
carried the mask at the global [batch, heads, seq, seq] shape replicated on every device and
sliced it each trip (2 TiB per device at 70B scale, where the layers unrolled hold none).
Cloning the constant's computation into the body where the loop's slot was read, and dropping
the slot, gives the scanned step what its unrolled form has: each reader builds the constant in
its own layout. The clones are ops XLA fuses into their readers (`core.ops.FUSIBLE`), so
building them each trip costs no memory traffic.
"""
from __future__ import annotations

from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from rhino_jax.core.ops import FUSIBLE

from . import module as mod


def sink_constants(module: ir.Module) -> ir.Module:
    """Sink, in place, every loop-invariant constant operand of every `stablehlo.while` of @main
    (nested loops included: an outer loop first, so an inner loop then sees the clone) into the
    loop's regions; returns the module."""
    with module.context, ir.Location.unknown():
        while (found := _next_sinkable(mod.entry_function(module))) is not None:
            _sink(*found)
    return module


def _next_sinkable(op: ir.Operation) -> tuple[ir.Operation, list[int]] | None:
    """The first while (in program order, outer before inner) with slots to sink, and those slots."""
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                inner = inner.operation
                if inner.name == "stablehlo.while":
                    slots = [k for k in range(len(inner.operands)) if _sinkable(inner, k)]
                    if slots:
                        return inner, slots
                found = _next_sinkable(inner)
                if found is not None:
                    return found
    return None


def _sinkable(loop: ir.Operation, k: int) -> bool:
    """Slot k enters the loop computed from constants alone and the body hands it back as it is."""
    body = loop.regions[1].blocks[0]
    returned = list(body.operations)[-1].operation.operands[k]
    return returned == body.arguments[k] and constant_ops(loop.operands[k]) is not None


def constant_ops(value: ir.Value) -> list[ir.Operation] | None:
    """The ops that compute `value` from constants and iotas alone, each after its operands' ops,
    when all are ops XLA fuses into their readers; else None (a value that reads an argument or
    a block argument, or that some other op makes)."""
    ops: dict[ir.Operation, None] = {}

    def visit(v: ir.Value) -> bool:
        if isinstance(v.owner, ir.Block):
            return False
        op = v.owner.operation
        if op in ops:
            return True
        if op.name not in FUSIBLE or len(op.regions) or not all(visit(o) for o in op.operands):
            return False
        ops[op] = None
        return True

    return list(ops) if visit(value) else None


def _clone_into(block: ir.Block, ops: list[ir.Operation]) -> dict[ir.Value, ir.Value]:
    """Clone `ops` (each after its operands' ops) at the start of `block`; old value → clone."""
    mapping: dict[ir.Value, ir.Value] = {}
    first = list(block.operations)[0].operation
    for op in ops:
        clone = op.clone(ip=ir.InsertionPoint(first))
        for i, operand in enumerate(clone.operands):
            if operand in mapping:
                clone.operands[i] = mapping[operand]
        mapping.update(zip(op.results, clone.results))
    return mapping


def _sink(loop: ir.Operation, slots: list[int]) -> None:
    """Replace `loop` by a while without `slots`: each region that read one of them computes it
    itself (`constant_ops`, cloned), and the loop's results in those slots, equal to what entered,
    are what entered."""
    cond, body = (region.blocks[0] for region in loop.regions)
    outside: dict[ir.Operation, None] = {}  # the constants' ops before the loop
    for k in slots:
        ops = constant_ops(loop.operands[k])
        outside.update(dict.fromkeys(ops))
        for block in (cond, body):
            arg = block.arguments[k]
            if _used(arg):
                arg.replace_all_uses_with(_clone_into(block, ops)[loop.operands[k]])
        loop.results[k].replace_all_uses_with(loop.operands[k])
    kept = [k for k in range(len(loop.operands)) if k not in slots]
    ret = list(body.operations)[-1].operation
    hlo.ReturnOp([ret.operands[k] for k in kept], ip=ir.InsertionPoint(ret), loc=ret.location)
    ret.erase()
    for block in (cond, body):
        for k in reversed(slots):
            block.erase_argument(k)
    new = hlo.WhileOp([loop.results[k].type for k in kept], [loop.operands[k] for k in kept],
                      ip=ir.InsertionPoint(loop), loc=loop.location).operation
    for attr in loop.attributes:
        new.attributes[attr.name] = attr.attr
    for old_region, new_region in zip(loop.regions, new.regions):
        old_region.blocks[0].append_to(new_region)
    for k, result in zip(kept, new.results):
        loop.results[k].replace_all_uses_with(result)
    loop.erase()
    for op in reversed(outside):  # each after its readers among them: left unread, they go
        if not any(_used(r) for r in op.results):
            op.erase()


def _used(value: ir.Value) -> bool:
    return any(True for _ in value.uses)
