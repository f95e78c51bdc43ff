"""Counted loops: which `stablehlo.while` ops the search may look inside, and how often they run.

jax lowers `lax.scan`, `fori_loop` with constant bounds and flax's `nn.scan` to a while whose
condition compares one carried counter with a constant (`i < n`), whose body adds 1 to it, and
whose initial counter is a constant. Such a loop runs `n - init` times whatever the data, so its
body's ops can be planned like any others, each one charged once per trip (a nested counted loop's
ops once per trip of every loop around them). Any other loop (a data-dependent `while_loop`,
bounds passed in as arguments) stays one opaque op, replicated, with the reason in
`Counted.reason`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from jax.extend.mlir import ir


@dataclass(frozen=True)
class Counted:
    """A while op and, when it is a counted loop, its trip count; else why it is not one."""

    trips: int | None
    reason: str = ""


def _constant(value: ir.Value) -> int | None:
    """The integer a scalar value holds when a `stablehlo.constant` defines it, else None."""
    owner = value.owner
    if isinstance(owner, ir.Block) or owner.name != "stablehlo.constant":
        return None
    try:
        attr = owner.attributes["value"]
    except TypeError:  # complex elements, which the bindings cannot represent: no trip count
        return None
    if not isinstance(attr, ir.DenseIntElementsAttr):
        return None
    data = np.array(attr)
    return int(data.reshape(-1)[0]) if data.size == 1 else None


def _block_arg(value: ir.Value, block: ir.Block) -> int | None:
    if isinstance(value, ir.BlockArgument) and value.owner == block:
        return value.arg_number
    return None


def count_trips(op: ir.Operation) -> Counted:
    """The trip count of a `stablehlo.while` (see the module docstring for the form recognised)."""
    cond, body = op.regions[0].blocks[0], op.regions[1].blocks[0]
    ret = list(cond.operations)[-1].operation
    test = ret.operands[0].owner
    if isinstance(test, ir.Block) or test.name != "stablehlo.compare":
        return Counted(None, "its condition is not a comparison")
    direction = str(test.attributes["comparison_direction"])
    if "LT" not in direction:
        return Counted(None, f"its condition is not `counter < constant` ({direction})")
    slot, bound = _block_arg(test.operands[0], cond), _constant(test.operands[1])
    if slot is None or bound is None:
        return Counted(None, "its condition does not compare a carried counter with a constant "
                             "(bounds known only at run time)")
    start = _constant(op.operands[slot])
    if start is None:
        return Counted(None, "its counter does not start at a constant")
    step = list(body.operations)[-1].operation.operands[slot].owner
    if (isinstance(step, ir.Block) or step.name != "stablehlo.add"
            or _block_arg(step.operands[0], body) != slot or _constant(step.operands[1]) != 1):
        return Counted(None, "its body does not add 1 to the counter")
    if bound <= start:
        return Counted(None, "it never runs (its counter starts at its bound)")
    return Counted(bound - start)


def body_block(op: ir.Operation) -> ir.Block:
    return op.regions[1].blocks[0]
