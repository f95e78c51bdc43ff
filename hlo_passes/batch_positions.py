"""Positions along the batch in a micro-batch: iotas that number the examples.

A micro-batch is the whole batch's examples [i·m, (i+1)·m). Most of a step sees no difference,
but an iota along the batch does: `jnp.arange(batch.shape[0])` counts 0..m-1 in every
micro-batch where the whole batch counts i·m..(i+1)·m-1, and jax's partitionable threefry numbers
each random bit by its position (its counter is an iota along every dim of the draw's shape), so
dropout would draw the same bits in every micro-batch. Such an iota is given the whole batch's
values: the micro-batch's first position is added to it (`with_micro_batch_index`), which makes
each micro-batch compute exactly its share of the whole batch's values.

Where an iota's values index the micro-batch's own tensors instead (`x[jnp.arange(B), labels]`,
a gather's indices), they are right as they are and stay. An iota used both ways, and a
position that an op moves along the batch (a slice, a reverse, a sort, a concatenation along it:
jax's older, non-partitionable threefry splits its counters so), cannot be made exact: the step
is refused, naming the op and its source line. So are random bits the hardware generator draws
(`rng_bit_generator`, jax's "rbg" keys), which have no positions to offset.
"""
from __future__ import annotations

from collections.abc import Sequence

from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from rhino_jax.errors import StagingError

from . import module as mod
from .graph import SLOTWISE, Graph, Node, slots

# The attribute that marks an iota of a micro-batch's program with the size m of its micro-batch
# along its dimension: micro-batch i adds i·m (`with_micro_batch_index`).
MARK = "rhino_jax.micro_batch_stride"

_S = "stablehlo."
# Operand positions that index the operand's elements rather than carry values.
_INDEX_OPERANDS = {_S + "gather": lambda n: {1}, _S + "dynamic_slice": lambda n: set(range(1, n)),
                   _S + "dynamic_update_slice": lambda n: set(range(2, n)), _S + "scatter": lambda n: {n // 2}}
# Ops that may move elements from one position to another (the rest keep each element in place,
# as elementwise ops, broadcasts, reductions and products do): `_moves_positions` checks them.
_MOVING = {_S + op for op in ("slice", "pad", "concatenate", "reverse", "sort", "reduce_window",
                              "select_and_scatter", "scatter", "gather", "dynamic_slice", "dynamic_update_slice",
                              "convolution", "fft", "custom_call", "reshape")} | {"chlo.scan"}
_RANDOM = {_S + "rng_bit_generator", _S + "rng"}


def _varying(whole: Graph, micro: Graph, v: int) -> set[int]:
    """The dims of value v whose size differs between the whole batch and a micro-batch."""
    return {d for d, (a, b) in enumerate(zip(whole.values[v].shape, micro.values[v].shape)) if a != b}


def _groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """The dims of a reshape from shape a to shape b, grouped where their products meet."""
    out, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        ga, gb, pa, pb = [], [], 1, 1
        while True:
            if pa <= pb and i < len(a):
                pa *= a[i]
                ga.append(i)
                i += 1
            elif j < len(b):
                pb *= b[j]
                gb.append(j)
                j += 1
            else:
                break
            if pa == pb and (i == len(a) or a[i] != 1) and (j == len(b) or b[j] != 1):
                break
        out.append((ga, gb))
    return out


def _moves_positions(n: Node, whole: Graph, micro: Graph) -> bool:
    """Whether op n, reading a position along the batch, moves elements along a dim that differs
    between the whole batch and a micro-batch (so micro-batch i no longer holds positions
    i·m..(i+1)·m-1 of it in order)."""
    operand = n.operands[0]
    varying = _varying(whole, micro, operand)
    if n.op == _S + "reshape":  # a dim that differs must lead its group on both sides
        out = n.results[0]
        out_varying = _varying(whole, micro, out)
        for ga, gb in _groups(whole.values[operand].shape, whole.values[out].shape):
            inside = (varying & set(ga[1:])) or (out_varying & set(gb[1:]))
            if inside or bool(varying & set(ga)) != bool(out_varying & set(gb)):
                return True
        return False
    if n.op in (_S + "slice", _S + "pad"):  # whole along the dims that differ
        out = n.results[0]
        return any(whole.values[operand].shape[d] != whole.values[out].shape[d]
                   or micro.values[operand].shape[d] != micro.values[out].shape[d] for d in varying)
    if n.op in (_S + "reverse",):
        return bool(varying & set(n.attrs["dims"]))
    if n.op in (_S + "sort", _S + "concatenate", "chlo.scan"):
        return n.attrs["dim"] in (varying | _varying(whole, micro, n.results[0]))
    return bool(varying or any(_varying(whole, micro, o) for o in n.operands + n.results))


def _cone(graph: Graph, start: int, users: dict[int, list[int]], batch: set[int]
          ) -> tuple[set[int], set[int], bool]:
    """What an iota's values reach as values, not through the indices of a gather, a scatter or a
    dynamic slice: (every value, the ops before they meet the batch's data, whether those or the
    ops that meet it feed such indices). Past the batch's data, positions are the data's: an index
    made from them is the data's (an argmax's), not a position's."""
    pure, meets, indexes, stack, seen = set(), set(), False, [start], {start}
    while stack:
        v = stack.pop()
        for c in users[v]:
            n = graph.nodes[c]
            index_at = _INDEX_OPERANDS.get(n.op, lambda _: set())(len(n.operands))
            as_value = [k for k, o in enumerate(n.operands) if o == v and k not in index_at]
            if v not in batch or graph.values[v].producer in meets:
                indexes |= len(as_value) < n.operands.count(v)
            if not as_value:
                continue
            # a loop's entry or exit, or a barrier, passes a position on to its own slot, not the counter beside it
            made = [r for _, reads, r in slots(n) if v in reads] if n.op in SLOTWISE or "branches" in n.attrs \
                else n.results
            if v not in batch:
                (meets if set(made) & batch else pure).add(c)
            for r in made:
                if r not in seen:
                    seen.add(r)
                    stack.append(r)
    return seen, pure, indexes


def _refuse(n: Node, graph: Graph, table: list[ir.Value], why: str) -> StagingError:
    """The error for op n, named with the user's line: its own, else (an op of jax's own functions,
    `jax.random`'s) the first line among the ops its values reach."""
    users, stack, seen, line = graph.consumers(), [n.id], {n.id}, ""
    while stack and not line:
        op = graph.nodes[stack.pop(0)]
        owner = table[op.results[0]].owner if op.results else None
        line = mod.source_line(owner) if owner is not None and not isinstance(owner, ir.Block) else ""
        fresh = [c for r in op.results for c in users[r] if c not in seen]
        seen.update(fresh)
        stack.extend(fresh)
    where = f"{n.name or n.op}" + (f" (read at {line})" if line else "")
    return StagingError(f"{where} {why}; micro-batches would compute other values than the whole batch. Use "
                        "num_micro_batches=1 (and pipeline='off')")


def find(whole: Graph, micro: Graph, micro_module: ir.Module, batch: set[int]) -> dict[int, int]:
    """The iotas that number the batch's examples as values (node id → the micro-batch's size
    along the iota's dim), after refusing what cannot be made exact (see the module's docstring).
    `micro_module`: the micro-batch's module (its source lines, for the errors); `batch`: the
    values that depend on the batch's data."""
    table = mod.value_table(micro_module)
    users = whole.consumers()
    outputs = set(whole.outputs)
    found: dict[int, int] = {}
    for n in whole.nodes:
        if n.op in _RANDOM and any(_varying(whole, micro, r) for r in n.results):
            raise _refuse(n, whole, table, "draws random bits with the hardware generator (rng_bit_generator: an "
                                           "'rbg' key), whose bits for part of the batch are not the whole batch's "
                                           "part. Use jax's default threefry keys (jax.random.key(seed))")
        if n.op != _S + "iota" or n.attrs["dim"] not in _varying(whole, micro, n.results[0]):
            continue
        values, pure, indexes = _cone(whole, n.results[0], users, batch)
        if not values & outputs:  # it only indexes the micro-batch's own tensors: right as it is
            continue
        if indexes:
            raise _refuse(n, whole, table, "numbers the batch's examples both as indices and as values")
        moved = next((whole.nodes[c] for c in sorted(pure) if whole.nodes[c].op in _MOVING
                      and _moves_positions(whole.nodes[c], whole, micro)), None)
        if moved is not None:
            raise _refuse(moved, whole, table, f"moves the positions of the batch's examples ("
                                               f"{moved.op.split('.')[-1]} along the batch; jax's non-partitionable "
                                               "threefry does so: set jax.config.update("
                                               "'jax_threefry_partitionable', True))")
        dim = n.attrs["dim"]
        size, whole_size = micro.values[n.results[0]].shape[dim], whole.values[n.results[0]].shape[dim]
        if whole_size % size:
            raise _refuse(n, whole, table, "numbers positions along a dim that the micro-batches do not cut evenly")
        found[n.id] = size
    return found


def mark(module: ir.Module, graph: Graph, found: dict[int, int]) -> None:
    """Mark, in place, the iotas `find` found (node id → stride) in `module`, whose values are
    numbered as `graph`'s."""
    table = mod.value_table(module)
    with module.context:
        i64 = ir.IntegerType.get_signless(64)
        for nid, size in found.items():
            table[graph.nodes[nid].results[0]].owner.attributes[MARK] = ir.IntegerAttr.get(i64, size)


def _marked(op: ir.Operation, out: list[ir.Operation]) -> None:
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                if MARK in inner.operation.attributes:
                    out.append(inner.operation)
                _marked(inner.operation, out)


def with_micro_batch_index(module: ir.Module) -> bool:
    """Give the program, in place, a last argument: the index i of its micro-batch (an int32
    scalar); each marked iota then counts from i·m (`mark`), exactly as the whole batch's. False
    (and the module unchanged) where no iota is marked."""
    marked: list[ir.Operation] = []
    _marked(mod.entry_function(module), marked)
    if not marked:
        return False
    main = mod.entry_function(module)
    block = main.regions[0].blocks[0]
    with module.context, ir.Location.unknown():
        i32 = ir.IntegerType.get_signless(32)
        scalar = ir.RankedTensorType.get([], i32)
        index = block.add_argument(scalar, ir.Location.unknown())
        for op in marked:
            stride = ir.IntegerAttr(op.attributes[MARK]).value
            old = ir.RankedTensorType(op.results[0].type)
            wide = old.element_type if isinstance(old.element_type, ir.IntegerType) else i32
            counted = ir.RankedTensorType.get(old.shape, wide)
            with ir.InsertionPoint(op):
                iota = hlo.IotaOp(counted, op.attributes["iota_dimension"])
                first = hlo.MulOp(index, hlo.ConstantOp(ir.DenseElementsAttr.get_splat(
                    scalar, ir.IntegerAttr.get(i32, stride))))
                start = hlo.BroadcastInDimOp(counted, hlo.ConvertOp(ir.RankedTensorType.get([], wide), first),
                                             ir.DenseI64ArrayAttr.get([]))
                value = hlo.AddOp(iota, start)
                if counted != old:
                    value = hlo.ConvertOp(old, value)
            if "sdy.sharding" in op.attributes:
                value.operation.attributes["sdy.sharding"] = op.attributes["sdy.sharding"]
            op.results[0].replace_all_uses_with(value.result)
            op.erase()
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(list(main.attributes["arg_attrs"]) + [ir.DictAttr.get({})])
        results = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value).results
        main.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(
            [a.type for a in block.arguments], list(results)))
    return True
