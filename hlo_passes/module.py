"""StableHLO module handling shared by import and rewrite: copy, inline calls, walk the entry.

Import and rewrite must see exactly the same op sequence (node i of the Graph IR is the i-th op
of `entry_sites`), so both go through these functions on the same inlined module.
"""
from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from . import loops


def copy_module(module: ir.Module) -> ir.Module:
    """A deep copy, made in memory: its ops are clones, with their source locations (the op names
    the report shows); their attributes, large constants included, are shared (MLIR uniques
    attributes per context), so a copy costs the ops, not the bytes of the constants they hold
    (printing and parsing the text of a 512 MiB constant took 6 s and 2 GiB per copy)."""
    source = module.operation
    with module.context:
        new = ir.Module.create(source.location)
        for name in source.attributes:
            new.operation.attributes[name] = source.attributes[name]
        ip = ir.InsertionPoint(new.body)
        for op in module.body.operations:
            op.operation.clone(ip=ip)
    return new


# Constants with more elements than this are hashed from their bytes by `fingerprint`, not printed.
_PRINTED_ELEMENTS = 64


def fingerprint(module: ir.Module) -> str:
    """sha256 of the module as printed without locations (so moving the user's code does not change
    it), with every constant of more than `_PRINTED_ELEMENTS` elements hashed from its bytes in
    place of its text: the same for the same program in any process, and cheap for a program that
    closes over a large array (printing a 512 MiB constant as hex took 4 s and 2 GiB)."""
    digest = hashlib.sha256(module.operation.get_asm(binary=True, large_elements_limit=_PRINTED_ELEMENTS))

    def visit(op: ir.Operation) -> ir.WalkResult:
        for name in op.attributes:
            try:
                attr = op.attributes[name]  # downcast by the bindings: dense elements are DenseElementsAttr
            except TypeError:  # an attribute the bindings cannot represent (complex elements): print the op
                digest.update(op.get_asm(binary=True))
                continue
            if isinstance(attr, ir.DenseElementsAttr) and not attr.is_splat and len(attr) > _PRINTED_ELEMENTS:
                digest.update(_element_bytes(attr))  # the printer elided it
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return digest.hexdigest()


def _element_bytes(dense: ir.DenseElementsAttr) -> memoryview | bytes:
    """The constant's data as stored (no copy), or its text for element types MLIR gives no buffer
    of (bfloat16, float8)."""
    try:
        return memoryview(dense)
    except (BufferError, TypeError):
        return str(dense).encode()


def constant_value(op: ir.Operation) -> ir.DenseElementsAttr | None:
    """The value of a `stablehlo.constant`, or None where the bindings cannot represent its
    elements (complex numbers: reading the attribute raises)."""
    try:
        value = op.attributes["value"]
    except TypeError:
        return None
    return value if isinstance(value, ir.DenseElementsAttr) else None


def same_constant(a: ir.Operation, b: ir.Operation) -> bool:
    """Do two `stablehlo.constant` ops (of any modules) hold the same value? Large constants are
    compared by their bytes, not their text (see `fingerprint`)."""
    x, y = constant_value(a), constant_value(b)
    if x is None or y is None:  # complex elements: only the printed op tells
        return x is None and y is None and str(a).split("=", 1)[-1] == str(b).split("=", 1)[-1]
    if str(x.type) != str(y.type):
        return False
    if x.is_splat or y.is_splat or len(x) <= _PRINTED_ELEMENTS:
        return str(x) == str(y)
    return np.array_equal(np.frombuffer(_element_bytes(x), np.uint8), np.frombuffer(_element_bytes(y), np.uint8))


def functions(module: ir.Module) -> dict[str, ir.Operation]:
    out = {}
    for op in module.body.operations:
        if op.operation.name == "func.func":
            out[ir.StringAttr(op.operation.attributes["sym_name"]).value] = op.operation
    return out


def entry_function(module: ir.Module) -> ir.Operation:
    funcs = functions(module)
    if "main" not in funcs:
        raise ValueError("the lowered module has no @main function")
    return funcs["main"]


def _block(func: ir.Operation) -> ir.Block:
    return func.regions[0].blocks[0]


def _walk_calls(op: ir.Operation, out: list[ir.Operation]) -> None:
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                inner = inner.operation
                if inner.name == "func.call":
                    out.append(inner)
                else:
                    _walk_calls(inner, out)


def _remap_nested(op: ir.Operation, mapping: dict) -> None:
    """Point operands of `op` (and of ops nested in its regions) at the inlined values."""
    for i, operand in enumerate(op.operands):
        new = mapping.get(operand)
        if new is not None:
            op.operands[i] = new
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                _remap_nested(inner.operation, mapping)


def inline_calls(module: ir.Module) -> ir.Module:
    """Inline every func.call reachable from @main, in place; returns the module.

    Nested `jax.jit` functions lower to private functions called from @main; the search needs
    one flat graph, and the rewrite must be free to shard each call site differently, so calls
    are inlined (exact: a call is a pure function application) and dead private functions go.
    jax names a callee's ops from the callee's own scope ("gather" inside `jnp.take`); an
    inlined op is named under its call's name stack ("jvp(Embed)/jit(_take)/gather"), so that
    a glob on a module's path names the ops of the jax functions it calls.
    """
    funcs = functions(module)
    main = entry_function(module)
    with module.context, ir.Location.unknown():
        while True:
            calls: list[ir.Operation] = []
            _walk_calls(main, calls)
            if not calls:
                break
            for call in calls:
                callee = funcs[ir.FlatSymbolRefAttr(call.attributes["callee"]).value]
                body = _block(callee)
                mapping = {arg: operand for arg, operand in zip(body.arguments, call.operands)}
                ip = ir.InsertionPoint(call)
                returned = None
                for inner in body.operations:
                    inner = inner.operation
                    if inner.name == "func.return":
                        returned = [mapping.get(v, v) for v in inner.operands]
                        continue
                    clone = inner.clone(ip=ip)
                    _remap_nested(clone, mapping)
                    _name_under(clone, call)
                    for old, new in zip(inner.results, clone.results):
                        mapping[old] = new
                assert returned is not None, "function without return"
                for res, new in zip(call.results, returned):
                    res.replace_all_uses_with(new)
                call.erase()
        for name, func in funcs.items():
            if name != "main":
                func.erase()
    return module


def _name_under(op: ir.Operation, call: ir.Operation) -> None:
    """Name `op` (and the ops in its regions), inlined from `call`'s callee, under the call's
    name stack, keeping its own location beneath (file and line)."""
    outer = _LOC_NAME.search(str(call.location))
    if not outer:
        return
    inner = _LOC_NAME.search(str(op.location))
    if not (inner and inner.group(1).startswith(outer.group(1))):
        name = outer.group(1) + ("/" + inner.group(1) if inner else "")
        op.location = ir.Location.name(name, childLoc=op.location)
    for region in op.regions:
        for block in region.blocks:
            for nested in block.operations:
                _name_under(nested.operation, call)


@dataclass(frozen=True)
class Site:
    """One op of the walk that import and rewrite share. `kind`: "op" (an ordinary op), "loop" (a
    counted while: its node stands for the entry into the body), "loop_end" (that body's return:
    the exit from it), "case" (a conditional, after the ops of all its branches: it reads each
    branch's returned values and makes the conditional's results) or "opaque" (a loop kept whole,
    `reason` says why). `trips`: how often the op runs per step (the product of the trip counts
    of the loops around it, the "loop_end" in its loop's body); `loop_trips`: the trip count of
    the loop a "loop"/"loop_end" site enters or leaves. `branch`: the conditional branches the op
    is in (each branch of the module numbered in walk order), outermost first: it runs only when
    they are taken; `alternatives`: a "case" site's branches' numbers."""

    op: ir.Operation
    kind: str
    trips: int = 1
    reason: str = ""
    loop_trips: int = 0
    branch: tuple[int, ...] = ()
    alternatives: tuple[int, ...] = ()


def _opaque_reason(op: ir.Operation) -> str:
    counted = loops.count_trips(op)
    return "" if counted.trips is not None else f"loop without a known trip count: {counted.reason}"


def _sites(block: ir.Block, trips: int, numbers: Iterator[int], branch: tuple[int, ...]) -> Iterator[Site]:
    """The sites of `block`, which lies in the branches `branch`; `numbers` numbers the branches."""
    for op in block.operations:
        op = op.operation
        if op.name in ("func.return", "stablehlo.return"):
            continue
        if op.name in _CONDITIONALS:  # lax.cond / lax.switch: each branch's ops, then the results
            alternatives = tuple(next(numbers) for _ in op.regions)
            for region, b in zip(op.regions, alternatives):
                yield from _sites(region.blocks[0], trips, numbers, branch + (b,))
            yield Site(op, "case", trips, branch=branch, alternatives=alternatives)
            continue
        if op.name != "stablehlo.while":
            yield Site(op, "op", trips, branch=branch)
            continue
        reason = _opaque_reason(op)
        if reason:
            yield Site(op, "opaque", trips, reason, branch=branch)
            continue
        n = loops.count_trips(op).trips
        body = loops.body_block(op)
        yield Site(op, "loop", trips, loop_trips=n, branch=branch)
        yield from _sites(body, trips * n, numbers, branch)
        yield Site(list(body.operations)[-1].operation, "loop_end", trips * n, loop_trips=n, branch=branch)


_CONDITIONALS = {"stablehlo.case", "stablehlo.if"}


def read_places(site: Site) -> list[tuple[ir.Operation, int]]:
    """Where each operand of a site's node is read: (op, operand index). A conditional's node
    reads its branch index, then for each result k what each branch's return yields for it
    (branch order): slot k's operands lie together (`graph.slots`)."""
    op = site.op.operation
    if site.kind != "case":
        return [(op, k) for k in range(len(op.operands))]
    returns = [list(region.blocks[0].operations)[-1].operation for region in op.regions]
    return [(op, 0)] + [(ret, k) for k in range(len(op.results)) for ret in returns]


def entry_sites(module: ir.Module) -> Iterator[Site]:
    """The ops of @main in program order, without the final return; after each counted loop's
    while op (`loops.count_trips`), the ops of its body (nested counted loops alike), then the
    body's return; before each conditional, the ops of its branches in branch order."""
    yield from _sites(_block(entry_function(module)), 1, itertools.count(), ())


def entry_values(module: ir.Module) -> Iterator[tuple[Site, list[ir.Value]]]:
    """Each site of `entry_sites` with the values it defines, in the Graph IR's order of value
    ids (after @main's arguments): an op's results; for a counted loop's entry, its body's block
    arguments (the carried values inside); for the body's return, the loop's results."""
    open_loops: list[ir.Operation] = []
    for site in entry_sites(module):
        if site.kind == "loop":
            open_loops.append(site.op)
            yield site, list(site.op.regions[1].blocks[0].arguments)
        elif site.kind == "loop_end":
            yield site, list(open_loops.pop().results)
        else:
            yield site, list(site.op.results)


def value_table(module: ir.Module) -> list[ir.Value]:
    """The MLIR value of each Graph IR value id (`importer.import_module` numbers them so)."""
    table = list(_block(entry_function(module)).arguments)
    for _, defined in entry_values(module):
        table.extend(defined)
    return table


def is_token(value: ir.Value) -> bool:
    """A token: what jax threads through a step with ordered effects (an argument and a result of
    @main, then each ordered callback's operand and result), so that they run in program order."""
    return hlo.TokenType.isinstance(value.type)


def array_positions(values: Iterable[ir.Value]) -> list[int]:
    """Positions of the arrays among @main's arguments or returned values (the user's pytree
    leaves): all but the tokens."""
    return [i for i, v in enumerate(values) if not is_token(v)]


def set_aliases(module: ir.Module, aliases: dict[int, int]) -> None:
    """Mark, in place, @main's array argument i as overwritten by its array result aliases[i]
    (`tf.aliasing_output`, as jax marks a donated argument), beside the attributes it has.
    Positions count arrays only: a token argument or result is skipped, as jax skips them."""
    main = entry_function(module)
    args = array_positions(main.regions[0].blocks[0].arguments)
    results = array_positions(entry_return(module).operands)
    with module.context:
        attrs = list(main.attributes["arg_attrs"])
        i32 = ir.IntegerType.get_signless(32)
        for i, k in aliases.items():
            d = ir.DictAttr(attrs[args[i]])
            merged = {d[j].name: d[j].attr for j in range(len(d))}
            merged["tf.aliasing_output"] = ir.IntegerAttr.get(i32, results[k])
            attrs[args[i]] = ir.DictAttr.get(merged)
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(attrs)


def entry_return(module: ir.Module) -> ir.Operation:
    ops = list(_block(entry_function(module)).operations)
    return ops[-1].operation


_LOC_NAME = re.compile(r'loc\(\s*(?:fused\[)?\s*"([^"]*)"')


def source_name(op: ir.Operation) -> str:
    """The op's name from its location: jax writes 'jit(f)/scope/primitive' there."""
    m = _LOC_NAME.search(str(op.location))
    if not m:
        return ""
    name = m.group(1)
    # Drop the outer jit(...) frames: they are the same for every op of the step.
    parts = [p for p in name.split("/") if not p.startswith("jit(")]
    return "/".join(parts)


_LOC_LINE = re.compile(r'"([^"]+)":(\d+):\d+')


def source_line(op: ir.Operation) -> str:
    """'file.py:12': where in the user's code the op comes from (the innermost frame jax kept), or ''."""
    m = _LOC_LINE.search(str(op.location))
    return f"{m.group(1)}:{m.group(2)}" if m else ""
