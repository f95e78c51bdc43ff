"""Count and size the collectives in compiled (post-SPMD-partitioning) HLO text.

The cost model predicts communication from shardings; this module reads back what XLA really
compiled (`jax.jit(f).lower(...).compile().as_text()`) so the two can be compared. All sizes
are per device, in bytes, and counts are per run of the entry computation (one step), each
collective weighted by how often its computation runs (`hlo_text`: loop trips counted; a
conditional's collective-heaviest branch only, the others' collectives get `executions=0`, and a
loop XLA gave no trip count counted once, listed in `CollectiveStats.unknown_loops`, its totals
then a lower bound).

Bytes count the element type the compiled HLO carries, which is not always the program's:
XLA's CPU pipeline runs every bf16 collective in f32 (its all-reduce-promotion pass turns a
bf16 all-reduce or reduce-scatter into convert -> f32 collective -> convert, its bf16
float-normalization does the same to all-gather, all-to-all and collective-permute; f16 and
f32 are left alone). So on the CPU backend a bf16 program's collectives are counted at 4 bytes
per element, twice what the program's type (and the cost model, which prices it) says; other
backends need not upcast. `CompiledCollective.shapes` names the type that was counted.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from .groups import _first_group, _group_size, _module_devices, _pairs
from .hlo_text import (_REF_RE, CompiledLoop, ComputationRuns, _call_of, _computations, _elements, _Instr,
                       _leaf_bytes, _leaves, _op_name, _operand_shapes, _runs, _Shape)


COLLECTIVE_KINDS: tuple[str, ...] = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)


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
