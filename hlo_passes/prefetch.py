"""Parameter reads tied to the layer before theirs: gathered one layer ahead, no earlier.

A plan that splits the parameters (FSDP, ZeRO-3) gathers each weight before the matmul that
reads it. Those gathers depend on the parameters alone, and XLA's GPU memory scheduler places
them as early as their inputs allow: at the start of the program. A Llama-70B step of 80
unrolled layers so held every layer's gathered bf16 weights (1.6 GiB a layer, 128 GiB in all)
before layer 0's forward ran, 152.8 GiB of temporaries against the 52 the plan's program order
needs (`benchmarks/memory_depth.md`); jax's scan bounds this by its loop, a Python loop of layers
does not. Optimization barriers order what XLA cannot reorder: each weight's read chain (its
convert, its layouts, the gather the partitioner makes of them) starts from the weight passed
through a barrier with the activation the previous matmul group reads, so a layer's weights are
gathered while the layer before computes (prefetch one group ahead, as hand FSDP schedules do)
and live from there to their use.

Only the forward's first reads are tied: a backward under `jax.checkpoint` reads the weights
again behind jax's own barrier, which already waits for the layer's saved input.
"""
from __future__ import annotations

from collections.abc import Sequence

from jax.extend.mlir import ir
from jax.extend.mlir.dialects import sdy

from . import module as mod

HEAVY = ("stablehlo.dot_general", "stablehlo.dot", "stablehlo.convolution")
CONST, WEIGHT, OTHER = 0, 1, 2  # what a value is computed from: constants, tied weights (and constants), anything else


def tie_weight_reads(module: ir.Module, parameters: Sequence[int], split: Sequence[int]) -> int:
    """Tie, in place, the reads of the parameters at positions `split` (among @main's array
    arguments) by the matmuls and convolutions of @main's body to the activation that the group
    of parameter reads before theirs takes (of any of the `parameters`); returns how many groups
    were tied (0: the module is unchanged)."""
    main = mod.entry_function(module)
    block = main.regions[0].blocks[0]
    arrays = mod.array_positions(block.arguments)
    weights = {block.arguments[arrays[i]] for i in parameters}
    tied = {block.arguments[arrays[i]] for i in split}
    ops = [op.operation for op in block.operations]
    order = {op: i for i, op in enumerate(ops)}
    kind: dict[ir.Value, int] = {a: (WEIGHT if a in weights else OTHER) for a in block.arguments}
    for op in ops:
        made = OTHER if len(op.regions) else max((kind[v] for v in op.operands), default=CONST)
        kind.update((r, made) for r in op.results)

    # The groups of weight reads, in program order: the heavy ops that read a weight beside an
    # activation, grouped by that activation (q, k and v read one).
    groups: dict[ir.Value, list[ir.Operation]] = {}
    for op in ops:
        if op.name in HEAVY:
            acts = [v for v in op.operands if kind[v] == OTHER]
            if acts and any(kind[v] == WEIGHT for v in op.operands):
                groups.setdefault(acts[0], []).append(op)
    claimed: set[ir.Operation] = set()
    count = 0
    layouts = {a: ir.DictAttr(attrs)["sdy.sharding"] for a, attrs in zip(block.arguments, main.attributes["arg_attrs"])
               if a in tied}
    with module.context, ir.Location.unknown():
        previous = None
        for act, readers in groups.items():
            count += _tie(readers, previous, kind, order, claimed, layouts)
            previous = act
    return count


def _tie(readers: list[ir.Operation], act: ir.Value | None, kind: dict, order: dict, claimed: set,
         layouts: dict) -> int:
    """Start the chains from the tied weights (`layouts`: their arguments' shardings, kept) to
    `readers` after `act` is made; 1 if done, 0 where there is no such weight or no `act` (the
    first group, or one reading an argument), or a chain is read before `act` (left as it was).
    The chains are claimed either way: a later group reading them does not tie them again."""
    chain: dict[ir.Operation, None] = {}
    leaves: dict[ir.Value, None] = {}

    def visit(v: ir.Value) -> None:
        if kind[v] != WEIGHT:
            return
        if isinstance(v.owner, ir.Block):
            leaves[v] = None
            return
        op = v.owner.operation
        if op in chain or op in claimed:
            return
        for o in op.operands:
            visit(o)
        chain[op] = None

    for reader in readers:
        for v in reader.operands:
            visit(v)
    claimed.update(chain)
    leaves = [v for v in leaves if v in layouts]
    if not leaves or act is None or isinstance(act.owner, ir.Block):
        return 0
    made_at = act.owner.operation
    start = order[made_at]
    if any(order[_top(use.owner)] <= start for op in chain for r in op.results for use in r.uses):
        return 0
    barrier = ir.Operation.create("stablehlo.optimization_barrier", results=[v.type for v in (*leaves, act)],
                                  operands=[*leaves, act], loc=made_at.location, ip=ir.InsertionPoint(made_at))
    made_at.move_before(barrier)
    last, passed = barrier, {}
    for leaf, result in zip(leaves, barrier.results):
        pinned = sdy.ShardingConstraintOp(result, layouts[leaf], loc=made_at.location, ip=ir.InsertionPoint(barrier))
        pinned.operation.move_after(last)
        last = pinned.operation
        passed[leaf] = pinned.result
    for op in sorted(chain, key=order.__getitem__):
        if order[op] < start:
            op.move_after(last)
            last = op
    for op in (*chain, *readers):
        for i, v in enumerate(op.operands):
            if v in passed:
                op.operands[i] = passed[v]
    return 1


def _top(op) -> ir.Operation:
    """The op of @main's body that holds `op`: itself, or the loop or conditional around it."""
    op = op.operation
    while op.parent.name != "func.func":
        op = op.parent.operation
    return op
