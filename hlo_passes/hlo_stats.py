"""Count and size the collectives in compiled (post-SPMD-partitioning) HLO text.

The cost model predicts communication from shardings; this module reads back what XLA really
compiled (`jax.jit(f).lower(...).compile().as_text()`) so the two can be compared. All sizes
are per device, in bytes, and counts are per run of the entry computation (one step):

- A collective inside a while loop (lax.scan, lax.fori_loop, flax nn.scan) counts once per
  trip, nested loops multiply. The trip count is the one XLA's loop analysis writes on the
  while op (`backend_config={..."known_trip_count":{"n":"4"}}`; jax 0.10.2's CPU compile
  writes it for scan, fori_loop and while_loop with constant bounds, nested ones included).
  When it is absent XLA's own analysis (constant init, step and bound) has already failed,
  in practice because the bound is known only at run time (a traced fori_loop bound, a
  data-dependent while_loop), so the condition is not re-derived here: such a loop counts
  as one trip and is listed in `CollectiveStats.unknown_loops` (its totals are then a lower
  bound). A loop's condition runs once more than its body.
- A conditional runs one branch, unknown until run time: only the branch with the most
  collective bytes per run (then the most collectives, then the first) is counted, so totals
  are an upper bound over the branches; the other branches' collectives get `executions=0`.
- Collectives in called computations (call, async-start wrappers, fusions) count with their
  caller's multiplicity.

Bytes count the element type the compiled HLO carries, which is not always the program's:
XLA's CPU pipeline runs every bf16 collective in f32 (its all-reduce-promotion pass turns a
bf16 all-reduce or reduce-scatter into convert -> f32 collective -> convert, its bf16
float-normalization does the same to all-gather, all-to-all and collective-permute; f16 and
f32 are left alone). So on the CPU backend a bf16 program's collectives are counted at 4 bytes
per element, twice what the program's type (and the cost model, which prices it) says; other
backends need not upcast. `CompiledCollective.shapes` names the type that was counted.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any, Union

import numpy as np

__all__ = [
    "COLLECTIVE_KINDS",
    "CompiledCollective",
    "CompiledLoop",
    "CollectiveStats",
    "collective_stats",
    "ComputationRuns",
    "computation_runs",
    "CompiledMemory",
    "compiled_memory",
    "library_flops",
]

COLLECTIVE_KINDS: tuple[str, ...] = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)


# ----------------------------------------------------------------------------------------------
# Result types
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompiledCollective:
    """One collective instruction of the compiled module.

    `bytes` is the per-device buffer the cost model reasons about: the result for all-reduce,
    all-gather, all-to-all and collective-permute, the (un-scattered) operand for
    reduce-scatter. `shapes` are exactly the array shapes whose sizes add up to `bytes`
    (layouts dropped). `group_size` is the number of devices per replica group, 0 when the
    text does not say (collective-permute has pairs, not groups). `executions` is how often
    the instruction runs per step as counted (trip counts of the enclosing loops multiplied;
    0 in a conditional branch that is not counted).
    """

    kind: str
    bytes: int
    shapes: tuple[str, ...]
    group_size: int
    name: str
    op_name: str = ""
    executions: int = 1
    pairs: tuple[tuple[int, int], ...] = ()  # a collective-permute's (source, target) device pairs
    group: tuple[int, ...] = ()  # the devices of its first replica group, when the text says
    # An all-reduce's bytes that are only ever read as a 1/group_size dynamic slice: the
    # partitioner's form of a reduce-scatter, which GPU XLA (its reduce-scatter creator) runs
    # as one and the CPU leaves as it is (`_scattered_bytes`).
    scattered: int = 0


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


@dataclass(frozen=True)
class CollectiveStats:
    """All collectives of one compiled module, with per-step totals for comparisons.

    `collectives` lists each instruction once; `count` and `bytes` weight it by its
    `executions`. `loops` lists every while loop, outermost first.
    """

    collectives: tuple[CompiledCollective, ...]
    loops: tuple[CompiledLoop, ...] = ()

    def _select(self, kind: str | None) -> list[CompiledCollective]:
        # Reject unknown kinds: a typo would otherwise silently compare against zero.
        if kind is not None and kind not in COLLECTIVE_KINDS:
            raise ValueError(f"unknown collective kind {kind!r}; expected one of {COLLECTIVE_KINDS}")
        return [c for c in self.collectives if kind is None or c.kind == kind]

    def count(self, kind: str | None = None) -> int:
        """Collective executions per step (of `kind`, or of all kinds)."""
        return sum(c.executions for c in self._select(kind))

    def bytes(self, kind: str | None = None) -> int:
        """Summed per-device bytes per step (of `kind`, or of all kinds)."""
        return sum(c.bytes * c.executions for c in self._select(kind))

    def by_kind(self) -> dict[str, tuple[int, int]]:
        """(count, bytes) for every kind, zeros included so lookups never fail."""
        return {k: (self.count(k), self.bytes(k)) for k in COLLECTIVE_KINDS}

    @property
    def unknown_loops(self) -> tuple[CompiledLoop, ...]:
        """Loops that run collectives but whose trip count XLA did not record: counted as one
        trip, so `count` and `bytes` are lower bounds when this is not empty."""
        return tuple(loop for loop in self.loops
                     if loop.trip_count is None and loop.collectives and loop.entries)

    def __str__(self) -> str:
        rows = [("kind", "count", "bytes")]
        for kind, (n, b) in self.by_kind().items():
            rows.append((kind, str(n), f"{b:,}"))
        rows.append(("total", str(self.count()), f"{self.bytes():,}"))
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        w2 = max(len(r[2]) for r in rows)
        lines = [f"{a:<{w0}}  {b:>{w1}}  {c:>{w2}}" for a, b, c in rows]
        for loop in self.loops:
            if loop.collectives:
                trips = (f"{loop.trip_count} trips" if loop.trip_count is not None
                         else "unknown trip count, counted once")
                lines.append(f"loop {loop.name} ({trips}, entered {loop.entries}x): "
                             f"{loop.collectives} collectives per trip")
        skipped = sum(1 for c in self.collectives if c.executions == 0)
        if skipped:
            lines.append(f"{skipped} collective instructions not counted (untaken conditional "
                         "branches, loops of 0 trips)")
        return "\n".join(lines)


@dataclass(frozen=True)
class CompiledMemory:
    """Per-device memory of a compiled executable, from XLA's buffer assignment."""

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int

    @property
    def total(self) -> int:
        """Arguments + outputs + temporaries, not counting donated (aliased) buffers twice."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes


def compiled_memory(compiled: Any) -> CompiledMemory:
    """Read `compiled.memory_analysis()` (a jax `Compiled`; a stats object also works).

    The peak figure is deliberately not used: on CPU it is unreliable.
    """
    stats = compiled.memory_analysis() if hasattr(compiled, "memory_analysis") else compiled
    if isinstance(stats, (list, tuple)):  # some jax versions return one entry per executable
        if not stats:
            raise RuntimeError("memory_analysis() returned no entries")
        stats = stats[0]
    if stats is None:
        raise RuntimeError("memory_analysis() is not available for this executable")
    return CompiledMemory(
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
    )


# ----------------------------------------------------------------------------------------------
# Shapes
# ----------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------
# Instructions
# ----------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------
# Replica groups
# ----------------------------------------------------------------------------------------------

_IOTA_RE = re.compile(r"\[\s*(\d+)\s*,\s*(\d+)\s*\]\s*<=")
_MESH_AXIS_RE = re.compile(r"\s*(?:'([^']*)'|\"([^\"]*)\"|([\w.\-]+))\s*=\s*(\d+)\s*")
_GROUP_AXIS_RE = re.compile(
    r"\s*(?:'([^']*)'|\"([^\"]*)\"|([\w.\-]+))\s*(?::\s*\(\s*\d+\s*\)\s*(\d+))?\s*"
)


def _explicit_group_size(text: str) -> int | None:
    """`{{0,1},{2,3}}` -> 2; `{}` (all devices) -> None."""
    groups = re.findall(r"\{([^{}]*)\}", text[1:-1])
    sizes = [len([x for x in g.split(",") if x.strip()]) for g in groups]
    return max(sizes) if sizes else None


def _mesh_form(attrs: str, pos: int) -> tuple[dict[str, int], list[int] | None, list[tuple[str | None, int]]] | None:
    """`mesh['a'=2,'b'=4], device_ids=(...) {'b'}` read: the mesh's axis sizes in order, its
    device ids (None: in order), and the grouped axes as (name, size); a sub-axis `'b':(1)2`
    has no name of its own (None) and its own size. None when the text does not parse."""
    bracket = attrs.index("[", pos)
    end = _matching_close(attrs, bracket)
    sizes: dict[str, int] = {}
    for part in _split_top_level(attrs[bracket + 1 : end - 1]):
        m = _MESH_AXIS_RE.fullmatch(part)
        if m is not None:
            sizes[m.group(1) or m.group(2) or m.group(3)] = int(m.group(4))
    rest = attrs[end:]
    device_ids: list[int] | None = None
    dev = re.match(r"\s*,\s*device_ids\s*=\s*\(", rest)
    if dev is not None:
        close = _matching_close(rest, dev.end() - 1)
        device_ids = _device_ids(rest[dev.end():close - 1], math.prod(sizes.values()))
        rest = rest[close:]
    axes = re.match(r"\s*\{", rest)
    if axes is None:
        return None
    grouped: list[tuple[str | None, int]] = []
    for part in _split_top_level(rest[axes.end() - 1 : _matching_close(rest, axes.end() - 1)][1:-1]):
        m = _GROUP_AXIS_RE.fullmatch(part)
        if m is None:
            return None
        axis = m.group(1) or m.group(2) or m.group(3)
        if m.group(4) is not None:
            grouped.append((None, int(m.group(4))))
        elif axis in sizes:
            grouped.append((axis, sizes[axis]))
        else:
            return None
    return sizes, device_ids, grouped


def _device_ids(text: str, count: int) -> list[int]:
    """A mesh's device ids, listed (`0,2,1,3`) or as an iota (`[2,4]T(1,0)`); [] if unread."""
    iota = re.fullmatch(r"\s*\[([\d,\s]+)\](?:\s*T\(([\d,\s]+)\))?\s*", text)
    if iota is not None:
        dims = [int(x) for x in iota.group(1).split(",") if x.strip()]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(2):
            ids = ids.transpose([int(x) for x in iota.group(2).split(",") if x.strip()])
        return [int(x) for x in ids.reshape(-1)]
    listed = [int(x) for x in re.findall(r"\d+", text)]
    return listed if len(listed) == count else []


def _mesh_group_size(attrs: str, pos: int) -> int:
    """`mesh['a'=1,'b'=4], device_ids=(...) {'b'}` -> 4: product of the grouped axis sizes (a
    sub-axis `'b':(1)2` contributes its own size); an empty axis set: each device alone."""
    form = _mesh_form(attrs, pos)
    return 0 if form is None else math.prod(size for _, size in form[2])


def _mesh_first_group(attrs: str, pos: int) -> tuple[int, ...]:
    """The devices of the first group of the mesh form: every index of the grouped axes, the
    others at 0; () with sub-axes (not read here)."""
    form = _mesh_form(attrs, pos)
    if form is None or any(name is None for name, _ in form[2]) or form[1] == []:
        return ()
    sizes, device_ids, grouped = form
    names = list(sizes)
    ids = np.asarray(device_ids if device_ids is not None else range(math.prod(sizes.values()))).reshape(
        list(sizes.values()))
    order = [names.index(name) for name, _ in grouped]
    ids = ids.transpose(order + [i for i in range(len(names)) if i not in order])
    return tuple(int(x) for x in ids.reshape(math.prod(size for _, size in grouped), -1)[:, 0])


def _group_size(instr: _Instr, module_devices: tuple[int, int] | None) -> int:
    """Devices per replica group from any of XLA's printed forms; 0 when undeterminable.

    Forms: explicit `{{0,1},{2,3}}`, iota `[2,4]<=[8]` / `[2,4]<=[4,2]T(1,0)` (groups x size),
    mesh `mesh[...] {axes}`. Empty `{}` means one group of every participant, whose number
    comes from the module header (replicas, times partitions when a channel_id is present).
    """
    m = re.search(r"\breplica_groups\s*=\s*", instr.attrs)
    if m is None:
        return _all_devices(instr, module_devices)
    pos = m.end()
    text = instr.attrs[pos:]
    try:
        if text.startswith("{"):
            size = _explicit_group_size(text[: _matching_close(text, 0)])
            return size if size is not None else _all_devices(instr, module_devices)
        if text.startswith("["):
            iota = _IOTA_RE.match(text)
            return int(iota.group(2)) if iota is not None else 0
        if text.startswith("mesh"):
            return _mesh_group_size(instr.attrs, pos)
        if text.startswith("maximal_mesh"):
            return 1
    except ValueError:
        return 0
    return 0


def _all_devices(instr: _Instr, module_devices: tuple[int, int] | None) -> int:
    if module_devices is None:
        return 0
    replicas, partitions = module_devices
    return replicas * partitions if "channel_id=" in instr.attrs else replicas


def _module_devices(hlo_text: str) -> tuple[int, int] | None:
    """(replica_count, num_partitions) from the `HloModule` header line, defaults 1."""
    header = re.search(r"^\s*HloModule\b.*$", hlo_text, re.MULTILINE)
    if header is None:
        return None
    line = header.group(0)
    replicas = re.search(r"\breplica_count=(\d+)", line)
    partitions = re.search(r"\bnum_partitions=(\d+)", line)
    return (
        int(replicas.group(1)) if replicas else 1,
        int(partitions.group(1)) if partitions else 1,
    )


# ----------------------------------------------------------------------------------------------
# Computations and how often they run
# ----------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def _kind_of(opcode: str) -> tuple[str, bool] | None:
    """(kind, is_async_start) for a counted opcode; None for everything else (incl. -done)."""
    if opcode in COLLECTIVE_KINDS:
        return opcode, False
    if opcode.endswith("-start") and opcode[: -len("-start")] in COLLECTIVE_KINDS:
        return opcode[: -len("-start")], True
    return None


def _measure(
    instr: _Instr, kind: str, is_start: bool, shapes_by_name: dict[str, _Shape], group_size: int
) -> list[str]:
    """The array shapes whose sizes make up the collective's `bytes` (see CompiledCollective)."""
    result = instr.shape
    operand_part: _Shape | None = None
    # Async starts return (operands, outputs[, contexts...]); an all-reduce's start did so only
    # in newer XLA (GPU, jax 0.12: `((f32[n]), f32[n]) all-reduce-start(...)`, its operands a
    # tuple), in older XLA it returns its outputs (a combined one a tuple of leaves).
    split = kind != "all-reduce" or (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], tuple))
    if is_start and split and isinstance(result, tuple) and len(result) >= 2:
        operand_part, result = result[0], result[1]
    if kind != "reduce-scatter":
        return _leaves(result)
    if operand_part is not None:
        return _leaves(operand_part)
    found = _operand_shapes(instr, shapes_by_name)
    if found is not None:
        return found
    if group_size > 0:
        # The operand is the result concatenated group_size times along the scatter dimension.
        return _leaves(result) * group_size
    raise ValueError(f"cannot find the operand shape of reduce-scatter {instr.name!r}")


def _collective(
    instr: _Instr, shapes_by_name: dict[str, _Shape], module_devices: tuple[int, int] | None
) -> CompiledCollective | None:
    """The collective `instr` starts (run once), or None when it is not one."""
    kind_start = _kind_of(instr.opcode)
    if kind_start is None:
        return None
    kind, is_start = kind_start
    group_size = 0 if kind == "collective-permute" else _group_size(instr, module_devices)
    shapes = _measure(instr, kind, is_start, shapes_by_name, group_size)
    return CompiledCollective(
        kind=kind,
        bytes=sum(_leaf_bytes(s) for s in shapes),
        shapes=tuple(shapes),
        group_size=group_size,
        name=instr.name,
        op_name=_op_name(instr),
        pairs=_pairs(instr) if kind == "collective-permute" else (),
        group=() if kind == "collective-permute" else _first_group(instr),
    )


_IOTA_FULL_RE = re.compile(r"\[\s*(\d+)\s*,\s*(\d+)\s*\]\s*<=\s*\[([\d,\s]+)\](?:\s*T\(([\d,\s]+)\))?")


def _first_group(instr: _Instr) -> tuple[int, ...]:
    """The device ids of the first replica group, from the explicit (`{{0,8},{1,9}}`), iota
    (`[8,4]<=[4,8]T(1,0)`) or mesh form; () where not read. The groups are alike, so one tells
    whether they cross hosts."""
    m = re.search(r"\breplica_groups\s*=\s*", instr.attrs)
    if m is None:
        return ()
    text = instr.attrs[m.end():]
    if text.startswith("mesh"):
        return _mesh_first_group(instr.attrs, m.end())
    if text.startswith("{{"):
        first = re.match(r"\{\{([\d,\s]*)\}", text)
        return tuple(int(x) for x in first.group(1).split(",") if x.strip()) if first else ()
    iota = _IOTA_FULL_RE.match(text)
    if iota is None:
        return ()
    groups, size = int(iota.group(1)), int(iota.group(2))
    dims = [int(x) for x in iota.group(3).split(",") if x.strip()]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if iota.group(4):
        ids = ids.transpose([int(x) for x in iota.group(4).split(",") if x.strip()])
    return tuple(int(x) for x in ids.reshape(groups, size)[0])


_PAIRS_RE = re.compile(r"\bsource_target_pairs\s*=\s*\{((?:\{\d+,\d+\},?)*)\}")


def _pairs(instr: _Instr) -> tuple[tuple[int, int], ...]:
    """A collective-permute's (source, target) pairs; () when the text does not list them."""
    m = _PAIRS_RE.search(instr.attrs)
    return tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))) if m else ()


_REF_RE = re.compile(r"%([\w.\-]+)")
_GTE_INDEX_RE = re.compile(r"\bindex=(\d+)")
# Ops that pass a value on unchanged in content: a slice of what they make is a slice of it.
_PASS_ON = ("bitcast", "reshape", "copy", "all-reduce-done")


def _read_as_slices(value: str, elements: int, users: dict[str, list[_Instr]],
                    comps: dict[str, list[_Instr]]) -> bool:
    """Whether every use of `value` is a dynamic slice of it of `elements` elements, looking
    through ops that pass it on and into the fusions that read it (the CPU fuses the slice with
    what follows; GPU XLA forms reduce-scatters before it fuses)."""
    found = users.get(value, [])
    for u in found:
        operands = _REF_RE.findall(u.operands)
        if u.opcode == "dynamic-slice":
            if operands[0] != value or operands.count(value) > 1 or _elements(_leaves(u.shape)[0]) != elements:
                return False
        elif u.opcode in _PASS_ON:
            if not _read_as_slices(u.name, elements, users, comps):
                return False
        elif u.opcode == "fusion":
            callee = re.search(r"\bcalls=%?([\w.\-]+)", u.attrs)
            params = {i.operands.strip(): i.name for i in comps.get(callee.group(1) if callee else "", [])
                      if i.opcode == "parameter"}
            for k, name in enumerate(operands):
                if name == value and not (str(k) in params and
                                          _read_as_slices(params[str(k)], elements, users, comps)):
                    return False
        else:
            return False
    return bool(found)


def _scattered_bytes(instr: _Instr, c: CompiledCollective, users: dict[str, list[_Instr]],
                     comps: dict[str, list[_Instr]]) -> int:
    """The bytes of an all-reduce's buffers (each one of its results, or of its tuple) that are
    only read as a 1/group_size dynamic slice."""
    leaves = _leaves(instr.shape)
    if isinstance(instr.shape, str):
        values = {0: [instr.name]}
    else:
        values = {}
        for u in users.get(instr.name, []):
            m = _GTE_INDEX_RE.search(u.attrs)
            if u.opcode != "get-tuple-element" or m is None:
                return 0
            values.setdefault(int(m.group(1)), []).append(u.name)

    def sliced(k: int, names: list[str]) -> bool:
        n = _elements(leaves[k])
        return n % c.group_size == 0 and all(_read_as_slices(v, n // c.group_size, users, comps) for v in names)

    return sum(_leaf_bytes(leaves[k]) for k, names in values.items() if sliced(k, names))


def _with_scatter(c: CompiledCollective, instr: _Instr, users: dict[str, list[_Instr]],
                  comps: dict[str, list[_Instr]]) -> CompiledCollective:
    if c.kind != "all-reduce" or c.group_size <= 1:
        return c
    return replace(c, scattered=_scattered_bytes(instr, c, users, comps))


@dataclass(frozen=True)
class ComputationRuns:
    """How often each computation of a module runs per step: the weights of anything measured
    per computation (collectives here, kernels in `kernels.program_kernels`)."""

    runs: dict[str, int]  # computation -> runs per step (see the module docstring)
    loops: tuple[CompiledLoop, ...]  # every while loop, outermost first
    texts: dict[str, str]  # computation -> its text, head line to closing brace
    entry: str  # the ENTRY computation's name, "" when the text has none (a fragment)


def _analyse(hlo_text: str, every_branch: bool) -> tuple[dict[str, list[CompiledCollective]], ComputationRuns]:
    """The collectives of each computation (run once), and the run counts they weight."""
    comps, texts, entry = _computations(hlo_text)
    shapes_by_name = {i.name: i.shape for instrs in comps.values() for i in instrs}
    module_devices = _module_devices(hlo_text)
    users: dict[str, list[_Instr]] = {}
    for instrs in comps.values():
        for i in instrs:
            for name in dict.fromkeys(_REF_RE.findall(i.operands)):
                users.setdefault(name, []).append(i)
    found = {
        comp: [_with_scatter(c, i, users, comps) for i in instrs
               for c in (_collective(i, shapes_by_name, module_devices),) if c]
        for comp, instrs in comps.items()
    }
    calls = {comp: [c for c in map(_call_of, instrs) if c is not None] for comp, instrs in comps.items()}
    own = {comp: (sum(c.bytes for c in cs), len(cs)) for comp, cs in found.items()}
    runs, loops = _runs(calls, own, every_branch)
    return found, ComputationRuns(runs, loops, texts, entry)


def computation_runs(hlo_text: str, every_branch: bool = False) -> ComputationRuns:
    """How often each computation of the module runs per step, counted as `collective_stats`
    counts: while bodies once per trip (conditions once more), calls at their caller's count, a
    conditional's collective-heaviest branch only; with `every_branch`, every branch of a
    conditional as if taken (an upper bound, for costs that are not collectives)."""
    return _analyse(hlo_text, every_branch)[1]


def collective_stats(hlo_text: str) -> CollectiveStats:
    """Every collective instruction of the module, each weighted by how often it runs per step
    (see the module docstring for loops, conditionals and calls).

    Async `*-start` instructions count as their collective and `*-done` does not, so a pair
    counts once; collectives wrapped by `async-start` count in the wrapped computation, which
    runs as often as the start.
    """
    found, module = _analyse(hlo_text, every_branch=False)
    return CollectiveStats(
        tuple(replace(c, executions=module.runs[comp]) for comp, cs in found.items() for c in cs),
        module.loops,
    )


# ----------------------------------------------------------------------------------------------
# Library calls' FLOPs
# ----------------------------------------------------------------------------------------------

# Which of a cuDNN convolution's operands and result are the forward convolution's input, kernel
# and output (its dim_labels always describe the forward one).
_CONV_ROLES = {"convForward": ("input", "kernel", "output"), "convBiasActivationForward": ("input", "kernel", "output"),
               "convBackwardInput": ("output", "kernel", "input"), "convBackwardFilter": ("input", "output", "kernel")}
_CUDNN_RE = re.compile(r'custom_call_target="__cudnn\$(\w+)"')
_DIM_LABELS_RE = re.compile(r"\bdim_labels=(\w+)_(\w+)->(\w+)")
_CUBLAS_RE = re.compile(r'custom_call_target="__cublas\$[\w$]*(?:gemm|matmul)[\w$]*"')
_LHS_CONTRACTING_RE = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


def _dims(leaf: str) -> list[int]:
    return [int(d) for d in _LEAF_RE.match(leaf).group(2).split(",") if d.strip()]


def _conv_flops(instr: _Instr, operands: list) -> float | None:
    """A cuDNN convolution: 2 x its forward output's elements x the kernel's elements / its
    output features; a backward one as its forward twin, whose shapes its operands and result are."""
    target, labels = _CUDNN_RE.search(instr.attrs), _DIM_LABELS_RE.search(instr.attrs)
    if target is None or labels is None or target.group(1) not in _CONV_ROLES:
        return None
    tensors = dict(zip(_CONV_ROLES[target.group(1)], operands[:2] + [_leaves(instr.shape)[0]]))
    if any(not isinstance(t, str) for t in tensors.values()):
        return None  # an operand whose shape the text does not give: not counted
    kernel_dims = _dims(tensors["kernel"])
    return 2.0 * _elements(tensors["output"]) * math.prod(kernel_dims) / max(kernel_dims[labels.group(2).index("o")], 1)


def _gemm_flops(instr: _Instr, operands: list) -> float | None:
    """A cuBLAS GEMM: 2 x its output's elements (the result's first leaf; a workspace follows) x
    the left operand's contracted elements (the backend config's dot dimension numbers)."""
    contracting = _LHS_CONTRACTING_RE.search(instr.attrs)
    if _CUBLAS_RE.search(instr.attrs) is None or contracting is None or not isinstance(operands[0], str):
        return None
    lhs = _dims(operands[0])
    contracted = math.prod(lhs[int(d.strip().strip('"'))] for d in contracting.group(1).split(",") if d.strip())
    return 2.0 * _elements(_leaves(instr.shape)[0]) * contracted


def library_flops(hlo_text: str) -> dict[str, float]:
    """FLOPs of the library calls in each computation (each instruction once): GPU XLA compiles
    a convolution to a cuDNN call and may compile a dot to a cuBLAS one (the real device's
    compiler does, for some shapes), whose FLOPs XLA's generic cost analysis (what a GPU's
    program is priced by) does not count."""
    comps, _, _ = _computations(hlo_text)
    shapes = {i.name: i.shape for instrs in comps.values() for i in instrs}
    out: dict[str, float] = {}
    for comp, instrs in comps.items():
        for i in instrs:
            if i.opcode != "custom-call":
                continue
            operands = [shapes.get(name) for name in _REF_RE.findall(i.operands)]
            if not operands:
                continue
            flops = _conv_flops(i, operands)
            flops = _gemm_flops(i, operands) if flops is None else flops
            if flops is not None:
                out[comp] = out.get(comp, 0.0) + flops
    return out
