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
  them) starts from the weights passed through a barrier with what the group before reads (its
  activation and weights, which it reads through the barrier): gathered while that group
  computes, one group ahead, as hand FSDP prefetches; so are the layouts the plan reads weights
  in at `jax.checkpoint`'s barrier before a layer's backward, one layer ahead;
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
BARRIER, PIN = "stablehlo.optimization_barrier", "sdy.sharding_constraint"
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
    ops, _ = _body(block)
    kind: dict[ir.Value, int] = {a: (WEIGHT if a in weights else OTHER) for a in block.arguments}
    for op in ops:
        made = OTHER if len(op.regions) else max((kind[v] for v in op.operands), default=CONST)
        kind.update((r, made) for r in op.results)
    # The groups of weight reads, in program order: the heavy ops that read a weight beside an
    # activation, grouped by that activation (q, k and v read one); and each barrier of jax's
    # that passes weights beside activations (`jax.checkpoint`'s, before a layer's backward
    # recomputes it), a group of its own. The layout the plan reads a weight in at such a
    # barrier is made before it, from the weight alone: untied, XLA gathers it at the program's
    # start, and its combiner merges it with other layers' gathers, all held to the end.
    groups: dict[ir.Value | ir.Operation, list[ir.Operation]] = {}
    for op in ops:
        reads = [kind[v] for v in op.operands]
        if op.name in HEAVY and OTHER in reads and WEIGHT in reads:
            groups.setdefault(op.operands[reads.index(OTHER)], []).append(op)
        elif op.name == BARRIER and OTHER in reads and any(
                kind[v] == WEIGHT and not isinstance(v.owner, ir.Block) for v in op.operands):
            groups[op] = [op]  # (a weight passed as it is, in its own layout, needs no tie)
    layouts = {a: ir.DictAttr(attrs)["sdy.sharding"] for a, attrs in zip(block.arguments, main.attributes["arg_attrs"])
               if a in tied}
    claimed: set[ir.Operation] = set()
    count, previous = 0, None
    for key, readers in groups.items():
        count += _tie_group(readers, previous, kind, claimed, layouts)
        # the next group waits for this one's activation and weights; past a barrier of jax's,
        # for what it passes on (a backward's next layer, one layer ahead, as the forward's are)
        previous = (key, readers) if isinstance(key, ir.Value) else (
            key.results[[kind[v] for v in key.operands].index(OTHER)], [])
    return count


def _tie_group(readers: list[ir.Operation], previous: tuple[ir.Value, list[ir.Operation]] | None, kind: dict,
               claimed: set, layouts: dict) -> int:
    """Start the chains from the tied weights (`layouts`: their arguments' shardings, kept) to
    `readers` once `previous` (the activation the group before reads, and its matmuls) can run;
    1 if done, 0 where there is no such weight or no group before (the first group, or one
    reading an argument). A chain that is read before that is left as it was (a norm's weight,
    read by the forward, that `jax.checkpoint`'s barrier passes again). The chains are claimed
    either way: a later group reading them (a backward that reads the forward's cast weights
    again) does not tie them again.

    The barrier passes what the matmuls before read, and they read it through the barrier: a
    barrier result no one reads is dropped by XLA's simplifications, its operand with it, and the
    tie with that. Passing one of their weights too makes this group's gather wait for theirs:
    XLA's combiner, which merges gathers that do not depend on one another, would otherwise merge
    the two into one op, issued just before the matmuls before, with nothing left to overlap."""
    act, before = previous if previous is not None and not isinstance(previous[0].owner, ir.Block) else (None, [])
    if act is None:
        anchor = None
    elif before:  # the barrier goes right before the first matmul before
        anchor = before[0]
    else:  # or right after `act` is made
        anchor = act.owner.operation

    def ahead(op) -> bool:
        """Whether `op` (or the op of @main's body around it) runs before the barrier."""
        op = _top(op)
        return op.is_before_in_block(anchor) or not before and op == anchor

    chain: dict[ir.Operation, None] = {}
    leaves: dict[ir.Value, None] = {}

    def visit(v: ir.Value, ops: dict, found: dict) -> None:
        if kind.get(v, OTHER) != WEIGHT:  # not in `kind`: a barrier's or its pin's, tied already
            return
        if isinstance(v.owner, ir.Block):
            found[v] = None
            return
        op = v.owner.operation
        if op in chain or op in ops or op in claimed:
            return
        for o in op.operands:
            visit(o, ops, found)
        ops[op] = None

    for reader in readers:
        for v in reader.operands:
            if reader.name == BARRIER and isinstance(v.owner, ir.Block):
                continue  # passed on in its own layout: nothing is made of it here
            ops, found = {}, {}
            visit(v, ops, found)
            claimed.update(ops)
            if anchor is None or any(ahead(use.owner) for op in ops for r in op.results for use in r.uses):
                continue
            chain.update(ops)
            leaves.update(found)
    leaves = [v for v in leaves if v in layouts]
    if not leaves:
        return 0
    # what the matmuls before read beside `act` in a layout the plan pins, made before the barrier
    held = list(dict.fromkeys(v for r in before for v in r.operands if v != act and not isinstance(v.owner, ir.Block)
                              and v.owner.operation.name == PIN and ahead(v.owner)))
    barrier = _barrier([*leaves, act, *held], anchor)
    if not before:
        anchor.move_before(barrier)
    last = barrier
    for k, v in enumerate([act, *held], start=len(leaves)):  # their readers read them through it
        through = _pinned_like(v, barrier.results[k], ip=ir.InsertionPoint(barrier))
        if through.owner.operation != barrier:
            through.owner.operation.move_after(last)
            last = through.owner.operation
        for use in list(v.uses):
            user = use.owner.operation
            if user in before or v == act and user != barrier and not ahead(user):
                use.owner.operands[use.operand_number] = through
    passed = {}
    for leaf, result in zip(leaves, barrier.results):
        pinned = sdy.ShardingConstraintOp(result, layouts[leaf], ip=ir.InsertionPoint(barrier))
        pinned.operation.move_after(last)
        last = pinned.operation
        passed[leaf] = pinned.result
    for op in chain:  # (in the order `visit` found them: each after what it reads)
        if ahead(op):
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
        waiting.operands[0] = _pinned_like(act, barrier.results[1], ip=ir.InsertionPoint(waiting))
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


def _pinned_like(v: ir.Value, passed: ir.Value, ip: ir.InsertionPoint) -> ir.Value:
    """`passed` (`v` through a barrier) pinned to the sharding the plan pins `v` to, where a
    constraint makes `v`; else `passed` itself."""
    if isinstance(v.owner, ir.Block) or v.owner.operation.name != PIN:
        return passed
    return sdy.ShardingConstraintOp(passed, v.owner.operation.attributes["sharding"], ip=ip).result


def _barrier(values: list[ir.Value], before: ir.Operation) -> ir.Operation:
    return ir.Operation.create(BARRIER, results=[v.type for v in values],
                               operands=values, loc=before.location, ip=ir.InsertionPoint(before))


def _top(op) -> ir.Operation:
    """The op of @main's body that holds `op`: itself, or the loop or conditional around it."""
    op = op.operation
    while op.parent.name != "func.func":
        op = op.parent.operation
    return op
