"""Optimization barriers that hold XLA's GPU schedule to the program's order, the order the
plan's memory was priced in (`search.memory`).

XLA's GPU schedulers reorder a training step in two ways that the priced peak does not see:
- the memory scheduler runs a chain that depends on the parameters alone as early as it can: a
  plan that splits the weights (FSDP, ZeRO-3) gets every layer's weights gathered at the
  program's start (a 70B loop of 80 layers held 128 GiB of gathered bf16 weights);
- the latency-hiding scheduler runs late what no matmul waits for: the weight-gradient GEMMs
  and the reshards after them move next to the optimizer update, and their inputs (activations
  gathered for them, 2 GiB each at 70B width) stay live across layers.
A 70B-wide loop of 80 layers, planned at 55.7 GiB per device, so compiled to 573 GiB; tied,
42.8 (`benchmarks/results/memory_depth.md`).
Barriers order both. XLA keeps them through scheduling (its GPU pipeline removes them after,
with `OptimizationBarrierExpander` in the post-scheduling passes), and a barrier passes values
through unchanged (the numbers change only where XLA fuses around it otherwise, by rounding):
- a matmul group's weight chain (its convert, layouts and the gather the partitioner makes of
  them) starts from the weights passed through a barrier with the activation that the group
  before reads: gathered while that group computes, one group ahead, as hand FSDP prefetches;
- a late matmul's result, with the reshards right after it (its reduce-scatter), passes a
  barrier with the activation of the matmul `LATE_SLACK` + 1 matmuls later on the step's
  chain, which so waits for it: the slack lets its collective overlap with those matmuls.
"""
from __future__ import annotations

from collections.abc import Sequence

from jax.extend.mlir import ir
from jax.extend.mlir.dialects import sdy

from . import module as mod

HEAVY = ("stablehlo.dot_general", "stablehlo.dot", "stablehlo.convolution")
CONTROL = ("stablehlo.while", "stablehlo.case", "stablehlo.if")
# What a late matmul's result passes through on its way to the optimizer that still belongs to
# it: its layouts (the reshards the plan priced), reshapes and casts.
FOLLOWS = ("sdy.sharding_constraint", "stablehlo.reshape", "stablehlo.convert")
LATE_SLACK = 2  # matmuls on the chain a late result may run beside before one must wait for it
CONST, WEIGHT, OTHER = 0, 1, 2  # what a value is computed from: constants, weights (and constants), anything else


def tie_to_program_order(module: ir.Module, parameters: Sequence[int], split: Sequence[int]) -> int:
    """Tie, in place, @main's reads of the parameters at positions `split` (among its array
    arguments; `parameters`: all of them) to the group of matmuls before theirs, and its late
    matmuls to the chain after them; returns how many barriers were added (0: unchanged)."""
    main = mod.entry_function(module)
    block = main.regions[0].blocks[0]
    with module.context, ir.Location.unknown():
        count = _tie_weight_reads(main, block, parameters, split)
        return count + _tie_late_results(block)


def _body(block: ir.Block) -> tuple[list[ir.Operation], dict[ir.Operation, int]]:
    ops = [op.operation for op in block.operations]
    return ops, {op: i for i, op in enumerate(ops)}


def _tie_weight_reads(main, block: ir.Block, parameters: Sequence[int], split: Sequence[int]) -> int:
    arrays = mod.array_positions(block.arguments)
    weights = {block.arguments[arrays[i]] for i in parameters}
    tied = {block.arguments[arrays[i]] for i in split}
    if not tied:
        return 0
    ops, order = _body(block)
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
    layouts = {a: ir.DictAttr(attrs)["sdy.sharding"] for a, attrs in zip(block.arguments, main.attributes["arg_attrs"])
               if a in tied}
    claimed: set[ir.Operation] = set()
    count, previous = 0, None
    for act, readers in groups.items():
        count += _tie_group(readers, previous, kind, order, claimed, layouts)
        previous = act
    return count


def _tie_group(readers: list[ir.Operation], act: ir.Value | None, kind: dict, order: dict, claimed: set,
               layouts: dict) -> int:
    """Start the chains from the tied weights (`layouts`: their arguments' shardings, kept) to
    `readers` after `act` is made; 1 if done, 0 where there is no such weight or no `act` (the
    first group, or one reading an argument), or a chain is read before `act` (left as it was).
    The chains are claimed either way: a later group reading them does not tie them again (a
    backward under `jax.checkpoint` reads the weights again behind jax's own barrier, which
    already waits for the layer's saved input)."""
    chain: dict[ir.Operation, None] = {}
    leaves: dict[ir.Value, None] = {}

    def visit(v: ir.Value) -> None:
        if kind.get(v, OTHER) != WEIGHT:  # not in `kind`: a barrier's or its pin's, tied already
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
    if any(order.get(_top(use.owner), -1) <= start for op in chain for r in op.results for use in r.uses):
        return 0  # (an op not in `order` was added by an earlier tie, before its group's activation)
    barrier = _barrier([*leaves, act], made_at)
    made_at.move_before(barrier)
    last, passed = barrier, {}
    for leaf, result in zip(leaves, barrier.results):
        pinned = sdy.ShardingConstraintOp(result, layouts[leaf], ip=ir.InsertionPoint(barrier))
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


def _tie_late_results(block: ir.Block) -> int:
    """Make each late matmul (one from whose results no matmul is reached: a weight gradient)
    finish, with the reshards that follow it, before the matmul `LATE_SLACK` + 1 places later on
    the chain (the matmuls from which a matmul is reached) reads its first operand."""
    ops, order = _body(block)
    reaches = [False] * len(ops)  # whether a matmul is reached from op i's results
    for i in range(len(ops) - 1, -1, -1):
        users = [_top(use.owner) for r in ops[i].results for use in r.uses]
        reaches[i] = any(u.name in HEAVY or u.name in CONTROL or reaches[order[u]] for u in users)
    chain = [i for i, op in enumerate(ops) if op.name in HEAVY and reaches[i]]
    count = 0
    for i, late in enumerate(ops):
        if late.name not in HEAVY or reaches[i] or len(late.results) != 1:
            continue
        after = [j for j in chain if j > i]
        if len(after) <= LATE_SLACK:
            continue
        waiting = ops[after[LATE_SLACK]]
        result = _followed(late.result)
        if order[_top(result.owner)] > after[LATE_SLACK]:
            result = late.result  # its reshard sits after the waiting matmul: tie the GEMM alone
        act = waiting.operands[0]  # its activation, or whatever it reads first: it waits either way
        barrier = _barrier([result, act], waiting)
        passed = barrier.results[1]
        layout = _layout(act)
        if layout is not None:
            passed = sdy.ShardingConstraintOp(passed, layout, ip=ir.InsertionPoint(waiting)).result
        waiting.operands[0] = passed
        count += 1
    return count


def _followed(v: ir.Value) -> ir.Value:
    """`v` after the ops of `FOLLOWS` that are its only reader, one after another, in @main's body."""
    while True:
        uses = list(v.uses)
        if len(uses) != 1:
            return v
        user = uses[0].owner.operation
        if user.name not in FOLLOWS or user.parent.name != "func.func":
            return v
        v = user.results[0]


def _layout(v: ir.Value):
    """The sharding the plan pins `v` to, where a constraint makes it."""
    if not isinstance(v.owner, ir.Block) and v.owner.operation.name == "sdy.sharding_constraint":
        return v.owner.operation.attributes["sharding"]
    return None


def _barrier(values: list[ir.Value], before: ir.Operation) -> ir.Operation:
    return ir.Operation.create("stablehlo.optimization_barrier", results=[v.type for v in values],
                               operands=values, loc=before.location, ip=ir.InsertionPoint(before))


def _top(op) -> ir.Operation:
    """The op of @main's body that holds `op`: itself, or the loop or conditional around it."""
    op = op.operation
    while op.parent.name != "func.func":
        op = op.parent.operation
    return op
