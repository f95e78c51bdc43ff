"""Price a scheduled program as a timeline: compute and communication overlapped as XLA ordered them.

XLA's GPU compiler runs a latency-hiding scheduler: a collective is issued as a `*-start`
(`all-gather-start`, `reduce-scatter-start`, ..., or an `async-start` wrapping a computation that
runs one), kernels run while it moves data, and its `*-done` is where the program first needs
its result. A scheduled module (`is_scheduled=true` in its `HloModule` line) lists each
computation's instructions in the order they run, so the step can be replayed on two streams:

- the compute stream runs each kernel for its price (`kernel_s`, per run);
- the collective stream runs collectives one after another for their price (`comm_s`, per
  execution). A start enqueues its collective: it begins when the compute stream reaches the
  start and the collective stream is free. Its done makes the compute stream wait until it
  ends. A synchronous collective (no start and done, as the CPU compiles every one) does both
  at once: it blocks both streams.

While the compute stream waits, the collective stream is busy without a gap (a collective
begins no later than the compute stream reaches it), so every wait is charged, instant by
instant, to the collective then running: its exposed time. The step's exposed communication is
its time minus the compute stream's busy time.

Control flow: a `call` runs its computation in place; a while loop's body and condition are
timelines of their own, run trip-count times (and the condition once more; a loop XLA gave no
trip count runs once, as `collectives` counts it); a conditional runs its slowest branch. A loop
or conditional that communicates holds both streams while it runs (collectives in flight
around it finish first: one link, no two collectives at once); one that does not is compute.
Fusions and the computations of reductions are inside their kernel, not walked.

A module without a schedule (text from before scheduling) lists instructions in no running
order: it is priced serially, every collective exposed, with an `UnscheduledProgramWarning`.
"""
from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

from rhino_jax.errors import UnscheduledProgramWarning

from .collectives import _kind_of
from .hlo_text import _REF_RE, _call_of, _computations, _Instr, _op_name

__all__ = ["CollectiveExposure", "Timeline", "timeline", "is_scheduled"]

_WALKED = frozenset({"call", "while", "conditional"})  # control flow: their computations are walked


@dataclass(frozen=True)
class CollectiveExposure:
    """One collective instruction on the timeline, per step (loop trips counted)."""

    name: str
    kind: str
    op_name: str
    comm_s: float  # on the collective stream
    exposed_s: float  # of which the compute stream waited for


@dataclass(frozen=True)
class Timeline:
    """One step of a program replayed on a compute stream and a collective stream."""

    step_s: float  # the overlapped step: when both streams are done
    compute_s: float  # the compute stream's busy time
    comm_s: float  # the collective stream's busy time
    collectives: tuple[CollectiveExposure, ...]  # the most exposed first
    scheduled: bool  # False: the text had no schedule and was priced serially
    # One run of each computation replayed on its own (ENTRY, loop bodies and conditions,
    # conditionals' branches), in seconds: what XLA's scheduler reports per computation.
    computations: dict[str, float] = field(default_factory=dict)

    @property
    def serial_s(self) -> float:
        """The step with nothing overlapped: compute then communication."""
        return self.compute_s + self.comm_s

    @property
    def exposed_comm_s(self) -> float:
        """The time the compute stream waited on collectives."""
        return self.step_s - self.compute_s

    def exposed_by_scope(self) -> dict[str, float]:
        """Exposed seconds per source scope (`scope`), the most exposed first."""
        out: dict[str, float] = {}
        for c in self.collectives:
            out[scope(c.op_name)] = out.get(scope(c.op_name), 0.0) + c.exposed_s
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def scope(op_name: str) -> str:
    """The module path an op_name gives (`jit(step)/transpose(jvp(LM))/Block_0/Dense_1/dot_general`
    -> `Block_0/Dense_1`): transformations (a name with parentheses) and the primitive dropped;
    "" for an op outside any named module (a parameter's gather, named after its argument)."""
    parts = [p for p in op_name.split("/") if "(" not in p]
    return "/".join(parts[:-1])


def is_scheduled(text: str) -> bool:
    """Whether the module's text lists its instructions in XLA's schedule order."""
    header = re.search(r"^\s*HloModule\b.*$", text, re.MULTILINE)
    return header is not None and re.search(r"\bis_scheduled=true\b", header.group(0)) is not None


@dataclass
class _Span:
    """What one run of a computation costs: its duration and each stream's busy time."""

    duration: float = 0.0
    compute: float = 0.0
    comm: dict[str, float] = field(default_factory=dict)  # collective -> seconds on its stream
    exposed: dict[str, float] = field(default_factory=dict)  # collective -> seconds waited on

    def add(self, other: _Span, times: float) -> None:
        """Add `times` runs of `other`'s busy and waited times (the caller keeps the duration)."""
        self.compute += times * other.compute
        for mine, theirs in ((self.comm, other.comm), (self.exposed, other.exposed)):
            for name, s in theirs.items():
                mine[name] = mine.get(name, 0.0) + times * s


@dataclass
class _Streams:
    """The two streams while one run of a computation is replayed."""

    span: _Span = field(default_factory=_Span)
    compute: float = 0.0  # when the compute stream is free
    comm: float = 0.0  # when the collective stream is free
    running: list[tuple[float, float, str]] = field(default_factory=list)  # (begin, end, collective)
    in_flight: dict[str, float] = field(default_factory=dict)  # start instruction -> its collectives' end

    def kernel(self, seconds: float) -> None:
        self.compute += seconds
        self.span.compute += seconds

    def enqueue(self, name: str, seconds: float) -> float:
        begin = max(self.compute, self.comm)
        self.comm = begin + seconds
        self.running.append((begin, self.comm, name))
        self.span.comm[name] = self.span.comm.get(name, 0.0) + seconds
        return self.comm

    def wait(self, until: float) -> None:
        """The compute stream idles until `until`, charged to the collectives running meanwhile."""
        for begin, end, name in self.running:
            overlap = min(end, until) - max(begin, self.compute)
            if overlap > 0:
                self.span.exposed[name] = self.span.exposed.get(name, 0.0) + overlap
        self.compute = max(self.compute, until)
        self.running = [r for r in self.running if r[1] > self.compute]

    def block(self, inner: _Span) -> None:
        """Control flow that communicates: both streams held for its duration."""
        self.wait(self.comm)
        self.compute = self.comm = self.compute + inner.duration
        self.span.add(inner, 1)


class _Replay:
    """Replays a module's computations on the streams, each computation's span made once."""

    def __init__(self, text: str, kernel_s: Mapping[str, float], comm_s: Mapping[str, float], overlap: bool):
        self.comps, _, self.entry = _computations(text)
        self.kernel_s, self.comm_s, self.overlap = kernel_s, comm_s, overlap
        self.spans: dict[str, _Span] = {}
        self.instrs = {i.name: i for instrs in self.comps.values() for i in instrs}

    def span(self, comp: str) -> _Span:
        if comp not in self.spans:
            streams = _Streams()
            self.run(comp, streams)
            streams.wait(streams.comm)
            streams.span.duration = streams.compute
            self.spans[comp] = streams.span
        return self.spans[comp]

    def collectives(self, instr: _Instr) -> list[str]:
        """The collectives a start or synchronous op runs: itself, or those of the computation an
        `async-start` wraps."""
        if _kind_of(instr.opcode) is not None:
            return [instr.name]
        if instr.opcode != "async-start":
            return []
        call = _call_of(instr)
        return [i.name for comp, _ in (call.alternatives[0] if call else ()) for i in self.comps.get(comp, ())
                if _kind_of(i.opcode) is not None]

    def run(self, comp: str, streams: _Streams) -> None:
        for instr in self.comps.get(comp, ()):
            op, names = instr.opcode, self.collectives(instr)
            if names:
                ends = [streams.enqueue(n, self.comm_s[n]) for n in names]
                if self.overlap and op.endswith("start"):
                    streams.in_flight[instr.name] = ends[-1]
                else:
                    streams.wait(ends[-1])
            elif op.endswith("done"):
                started = _REF_RE.search(instr.operands)
                if started and started.group(1) in streams.in_flight:
                    streams.wait(streams.in_flight.pop(started.group(1)))
            elif op in _WALKED or op == "async-start":
                self.control(instr, streams)
            else:
                streams.kernel(self.kernel_s.get(instr.name, 0.0))

    def control(self, instr: _Instr, streams: _Streams) -> None:
        """A call (and async computation) in place; a loop's trips or a conditional's slowest
        branch as one block."""
        call = _call_of(instr)
        if call is None:
            return
        if instr.opcode in ("call", "async-start"):
            for comp, _ in call.alternatives[0]:
                self.run(comp, streams)
            return
        best: _Span | None = None
        for alternative in call.alternatives:
            inner = _Span()
            for comp, times in alternative:
                inner.add(self.span(comp), times)
                inner.duration += times * self.span(comp).duration
            if best is None or inner.duration > best.duration:
                best = inner
        if best is None:
            return
        if best.comm:
            streams.block(best)
        else:
            streams.kernel(best.duration)


def timeline(text: str, kernel_s: Mapping[str, float], comm_s: Mapping[str, float]) -> Timeline:
    """Replay one step of the module `text` (its ENTRY computation): `kernel_s` prices each
    kernel instruction per run (instructions it lacks cost nothing: parameters, bitcasts,
    tuples), `comm_s` each collective instruction per execution (by the name `collectives`
    gives it: a start's, or the collective an `async-start` wraps)."""
    scheduled = is_scheduled(text)
    if not scheduled:
        warnings.warn("the HLO module has no schedule (no is_scheduled=true in its HloModule line): its "
                      "timeline is priced serially, no communication overlapped; pass the compiled "
                      "program's text (compiled.as_text())", UnscheduledProgramWarning, stacklevel=2)
    replay = _Replay(text, kernel_s, comm_s, overlap=scheduled)
    if not replay.entry:
        raise ValueError("no ENTRY computation in the HLO text; pass compiled.as_text()")
    span = replay.span(replay.entry)
    exposures = []
    for name, seconds in span.comm.items():
        instr = replay.instrs[name]
        exposures.append(CollectiveExposure(name, _kind_of(instr.opcode)[0], _op_name(instr), seconds,
                                            span.exposed.get(name, 0.0)))
    exposures.sort(key=lambda c: (-c.exposed_s, -c.comm_s, c.name))
    return Timeline(span.duration, span.compute, sum(span.comm.values()), tuple(exposures), scheduled,
                    {comp: s.duration for comp, s in replay.spans.items()})
