"""Read the text of a compiled HLO module (`compiled.as_text()`): shapes, instructions, the
computations, and how often each computation runs per step.

Everything measured per computation (collectives, kernels) is weighted by these run counts:

- A computation inside a while loop (lax.scan, lax.fori_loop, flax nn.scan) runs once per
  trip, nested loops multiply. The trip count is the one XLA's loop analysis writes on the
  while op (`backend_config={..."known_trip_count":{"n":"4"}}`; jax 0.10.2's CPU compile
  writes it for scan, fori_loop and while_loop with constant bounds, nested ones included).
  When it is absent XLA's own analysis (constant init, step and bound) has already failed,
  in practice because the bound is known only at run time (a traced fori_loop bound, a
  data-dependent while_loop), so the condition is not re-derived here: such a loop counts
  as one trip (`CompiledLoop.trip_count` None). A loop's condition runs once more than its body.
- A conditional runs one branch, unknown until run time: only the branch with the largest
  weight (the most collective bytes per run, then the most collectives, then the first) is
  counted, so totals are an upper bound over the branches; or, asked for, every branch.
- Called computations (call, async-start wrappers, fusions) run as often as their caller.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class CompiledLoop:
    """One while loop of the compiled module, for reports on what the counts multiply and for
    re-pricing its body (compiled_cost).

    `trip_count` is XLA's `known_trip_count`, None when not recorded (then counted as 1).
    `entries` is how often the loop starts per step (enclosing trip counts multiplied).
    `collectives` is the number of collective executions in one trip of its body, nested
    loops multiplied (a condition's collectives, which run trips + 1 times, are not in it).
    `body` is the body computation's name, `parent` the computation holding the while.
    """

    name: str
    trip_count: int | None
    entries: int
    collectives: int
    body: str
    parent: str
    op_name: str = ""



# Bits per element. Sub-byte types are rounded up per array when converted to bytes.
_DTYPE_BITS: dict[str, int] = {
    "pred": 8, "s8": 8, "u8": 8,
    "f16": 16, "bf16": 16, "s16": 16, "u16": 16,
    "f32": 32, "s32": 32, "u32": 32,
    "f64": 64, "s64": 64, "u64": 64, "c64": 64,
    "c128": 128,
    "s4": 4, "u4": 4, "s2": 2, "u2": 2, "s1": 1, "u1": 1,
    "token": 0,
}  # fmt: skip

# A shape is a leaf like "f32[4,8]" (layout stripped) or a tuple of shapes.
_Shape = Union[str, tuple["_Shape", ...]]

_SKIP_RE = re.compile(r"(?:\s+|/\*.*?\*/)*")  # whitespace and /*index=5*/ comments in tuples
_LEAF_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_LAYOUT_RE = re.compile(r"\{[^{}]*\}")


def _dtype_bits(dtype: str) -> int:
    """Element width; every f8 variant is one byte, every f4 variant half a byte."""
    if dtype in _DTYPE_BITS:
        return _DTYPE_BITS[dtype]
    if dtype.startswith("f8"):
        return 8
    if dtype.startswith("f4"):
        return 4
    raise ValueError(f"unknown HLO element type {dtype!r}")


def _elements(leaf: str) -> int:
    """Elements of one array shape such as "f32[4,8]" or "f32[]" (a scalar: one)."""
    m = _LEAF_RE.fullmatch(leaf)
    if m is None:
        raise ValueError(f"not an array shape: {leaf!r}")
    # Bounded dynamic dimensions print as "<=16"; the buffer is sized for the bound.
    dims = filter(None, (x.strip() for x in m.group(2).split(",")))
    return math.prod(int(d.removeprefix("<=")) for d in dims)


def _leaf_bytes(leaf: str) -> int:
    """Bytes of one array shape; sub-byte types are rounded up per array."""
    return math.ceil(_elements(leaf) * _dtype_bits(_LEAF_RE.fullmatch(leaf).group(1)) / 8)


def _parse_shape(text: str, pos: int) -> tuple[_Shape, int]:
    """Parse one (possibly tuple) shape starting at `pos`; return it and the end position."""
    pos = _SKIP_RE.match(text, pos).end()
    if text.startswith("(", pos):
        elems: list[_Shape] = []
        pos += 1
        pos = _SKIP_RE.match(text, pos).end()
        if text.startswith(")", pos):
            return tuple(elems), pos + 1
        while True:
            elem, pos = _parse_shape(text, pos)
            elems.append(elem)
            pos = _SKIP_RE.match(text, pos).end()
            if text.startswith(",", pos):
                pos += 1
            elif text.startswith(")", pos):
                return tuple(elems), pos + 1
            else:
                raise ValueError(f"bad tuple shape at {text[pos:pos + 40]!r}")
    m = _LEAF_RE.match(text, pos)
    if m is None:
        raise ValueError(f"no shape at {text[pos:pos + 40]!r}")
    pos = m.end()
    layout = _LAYOUT_RE.match(text, pos)  # "{1,0}" and friends carry no size information
    if layout is not None:
        pos = layout.end()
    return f"{m.group(1)}[{m.group(2)}]", pos


def _leaves(shape: _Shape) -> list[str]:
    """Flatten a tuple shape into its array shapes, in order."""
    if isinstance(shape, str):
        return [shape]
    return [leaf for elem in shape for leaf in _leaves(elem)]


@dataclass(frozen=True)
class _Instr:
    name: str
    shape: _Shape
    opcode: str
    operands: str  # text between the opcode's parentheses
    attrs: str  # text after them (replica_groups, metadata, ...)


_INSTR_HEAD_RE = re.compile(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE_RE = re.compile(r"\s*([a-z][a-z0-9_\-]*)\(")


def _matching_close(text: str, pos: int) -> int:
    """Index just past the bracket that closes the one at `pos` (any of ([{ nest)."""
    depth = 0
    in_str = False
    i = pos
    while i < len(text):
        ch = text[i]
        if in_str:
            if ch == "\\":
                i += 1
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError(f"unbalanced brackets in {text[pos:pos + 60]!r}")


def _parse_instr(line: str) -> _Instr | None:
    """Parse an instruction line, or return None for anything else (headers, metadata tables)."""
    head = _INSTR_HEAD_RE.match(line)
    if head is None:
        return None
    try:
        shape, pos = _parse_shape(line, head.end())
    except ValueError:
        return None
    op = _OPCODE_RE.match(line, pos)
    if op is None:
        return None
    open_paren = op.end() - 1
    try:
        close = _matching_close(line, open_paren)
    except ValueError:
        return None
    return _Instr(
        name=head.group(1),
        shape=shape,
        opcode=op.group(1),
        operands=line[open_paren + 1 : close - 1],
        attrs=line[close:],
    )


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not nested inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _operand_shapes(instr: _Instr, shapes_by_name: dict[str, _Shape]) -> list[str] | None:
    """Array shapes of the operands: inline ("f32[8] %x") or looked up by name ("%x")."""
    out: list[str] = []
    for operand in _split_top_level(instr.operands):
        name = operand.split()[-1].lstrip("%")
        if operand.startswith("(") or _LEAF_RE.match(operand):
            try:
                shape, _ = _parse_shape(operand, 0)
            except ValueError:
                shape = shapes_by_name.get(name)
        else:
            shape = shapes_by_name.get(name)
        if shape is None:
            return None
        out.extend(_leaves(shape))
    return out



# "%name (params) -> result {" or "ENTRY %name ... {"; instruction lines have "=" after the name.
_COMP_HEAD_RE = re.compile(r"\s*(?:ENTRY\s+%?([\w.\-]+)\s*.*|%?([\w.\-]+)\s*\(.*\)\s*->.*)\{\s*$")
_CALLEE_RE = re.compile(
    r",\s*(calls|to_apply|body|condition|branch_computations|true_computation|false_computation"
    r"|called_computations|select|scatter)=(\{[^{}]*\}|%?[\w.\-]+)"
)
_TRIP_COUNT_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
# Async ops after the start name the computation the start already runs.
_ASYNC_CONTINUATIONS = ("async-update", "async-done")

_Weight = tuple[int, int]  # (collective bytes, collective count) of one run
_OP_NAME_RE = re.compile(r'\bop_name="((?:[^"\\]|\\.)*)"')


def _op_name(instr: _Instr) -> str:
    m = _OP_NAME_RE.search(instr.attrs)
    return m.group(1).replace('\\"', '"') if m else ""


def _computations(hlo_text: str) -> tuple[dict[str, list[_Instr]], dict[str, str], str]:
    """Instructions by computation, in text order (lines outside any computation go under "");
    each computation's text, head line to closing brace; the ENTRY's name ("" when none)."""
    comps: dict[str, list[_Instr]] = {}
    lines: dict[str, list[str]] = {}
    current, entry = "", ""
    for line in hlo_text.splitlines():
        head = _COMP_HEAD_RE.fullmatch(line)
        if head is not None:
            current = head.group(1) or head.group(2)
            entry = head.group(1) or entry
            comps.setdefault(current, [])
            lines[current] = [line]
        elif line.strip() == "}":
            if current:
                lines[current].append(line)
            current = ""
        else:
            if current:
                lines[current].append(line)
            instr = _parse_instr(line)
            if instr is not None:
                comps.setdefault(current, []).append(instr)
    return comps, {name: "\n".join(block) for name, block in lines.items()}, entry


@dataclass(frozen=True)
class _Call:
    """What one instruction runs: one of `alternatives` (a conditional's branches, else just
    one), each a tuple of (computation, runs per execution of the instruction)."""

    instr: _Instr
    alternatives: tuple[tuple[tuple[str, int], ...], ...]
    trip_count: int | None = None  # a while's, as XLA recorded it
    body: str = ""  # a while's


def _call_of(instr: _Instr) -> _Call | None:
    """The computations `instr` runs and how often, or None when it runs none."""
    refs: dict[str, list[str]] = {}
    for key, value in _CALLEE_RE.findall(instr.attrs):
        refs.setdefault(key, []).extend(re.findall(r"%?([\w.\-]+)", value))
    if not refs or instr.opcode in _ASYNC_CONTINUATIONS:
        return None
    if instr.opcode == "while":
        if len(refs.get("body", [])) != 1:
            raise ValueError(f"while {instr.name!r} names {len(refs.get('body', []))} body computations, "
                             "not one; not valid HLO")
        (body,) = refs["body"]
        m = _TRIP_COUNT_RE.search(instr.attrs)
        trips = int(m.group(1)) if m else None
        n = 1 if trips is None else trips
        # The condition runs before every trip and once more to stop.
        runs = [(body, n)] + [(c, n + 1) for c in refs.get("condition", [])]
        return _Call(instr, (tuple(runs),), trips, body)
    if instr.opcode == "conditional":
        branches = refs.get("branch_computations") or (
            refs.get("true_computation", []) + refs.get("false_computation", []))
        return _Call(instr, tuple(((b, 1),) for b in branches))
    return _Call(instr, (tuple((c, 1) for names in refs.values() for c in names),))


def _callers_first(calls: dict[str, list[_Call]]) -> list[str]:
    """Computations ordered so that every caller precedes its callees (HLO calls form a DAG)."""
    done: list[str] = []
    state: dict[str, int] = {}  # 1 on the DFS stack, 2 finished

    def visit(comp: str) -> None:
        state[comp] = 1
        for call in calls[comp]:
            for alt in call.alternatives:
                for callee, _ in alt:
                    if callee not in calls:
                        continue  # referenced but not in the text (a fragment)
                    if state.get(callee) == 1:
                        raise ValueError(f"computation {callee!r} calls itself (directly or through "
                                         "others); not valid HLO")
                    if callee not in state:
                        visit(callee)
        state[comp] = 2
        done.append(comp)

    for comp in calls:
        if comp not in state:
            visit(comp)
    return done[::-1]


def _runs(
    calls: dict[str, list[_Call]], own: dict[str, _Weight], every_branch: bool
) -> tuple[dict[str, int], tuple[CompiledLoop, ...]]:
    """How often each computation runs per step, and the module's while loops.

    Computations nobody calls (ENTRY, or every one of a text fragment) run once. A call's
    alternative with the largest weight (bytes, then count, then first) is the one counted,
    or, with `every_branch`, all of them.
    """
    order = _callers_first(calls)
    weight: dict[str, _Weight] = {}
    chosen: dict[int, int] = {}  # id(call) -> index of the counted alternative

    def alt_weight(alt: tuple[tuple[str, int], ...]) -> _Weight:
        pairs = [(weight[c][0] * n, weight[c][1] * n) for c, n in alt if c in weight]
        return sum(b for b, _ in pairs), sum(k for _, k in pairs)

    for comp in reversed(order):  # callees first
        total_b, total_n = own.get(comp, (0, 0))
        for call in calls[comp]:
            weights = [alt_weight(alt) for alt in call.alternatives]
            best = max(range(len(weights)), key=weights.__getitem__) if weights else 0
            chosen[id(call)] = best
            if weights:
                total_b, total_n = total_b + weights[best][0], total_n + weights[best][1]
        weight[comp] = (total_b, total_n)

    called = {c for cs in calls.values() for call in cs for alt in call.alternatives for c, _ in alt}
    runs = {comp: (0 if comp in called else 1) for comp in calls}
    loops: list[CompiledLoop] = []
    for comp in order:
        for call in calls[comp]:
            for i, alt in enumerate(call.alternatives):
                for callee, n in alt:
                    if callee in runs and (every_branch or i == chosen[id(call)]):
                        runs[callee] += runs[comp] * n
            if call.instr.opcode == "while":
                loops.append(CompiledLoop(
                    name=call.instr.name,
                    trip_count=call.trip_count,
                    entries=runs[comp],
                    collectives=weight[call.body][1] if call.body in weight else 0,
                    body=call.body,
                    parent=comp,
                    op_name=_op_name(call.instr),
                ))
    return runs, tuple(loops)


_REF_RE = re.compile(r"%([\w.\-]+)")


@dataclass(frozen=True)
class ComputationRuns:
    """How often each computation of a module runs per step: the weights of anything measured
    per computation (collectives here, kernels in `kernels.program_kernels`)."""

    runs: dict[str, int]  # computation -> runs per step (see the module docstring)
    loops: tuple[CompiledLoop, ...]  # every while loop, outermost first
    texts: dict[str, str]  # computation -> its text, head line to closing brace
    entry: str  # the ENTRY computation's name, "" when the text has none (a fragment)
