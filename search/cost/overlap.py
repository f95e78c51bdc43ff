"""What XLA's latency-hiding scheduler hides: a plan's step replayed on a compute stream and a
collective stream, as a list scheduler runs it in program order.

XLA's GPU compiler issues a collective asynchronously and runs the kernels that do not need its
result beside it. Compute waits for a collective where it reads its result; where the collective
can start depends on where it stands in the step's dependences:
- on the compute chain (an activation's reshard, a layer's partial sums): where its value is
  made, in program order;
- a parameter's, before the chain reads it (`combining.HEAD`): from the step's start, so its
  reader waits only if the link has not finished it by then;
- after the chain (`combining.TAIL`, `DERIVED`: a gradient's reduction, an updated parameter's
  gather): where its value is made; what reads it (an optimizer's update) waits for it, and the
  step's end.
One link runs the collectives one after another. Where the next compute event waits, a later
one whose makers have run and that reads nothing pending runs first, as XLA's scheduler fills
the wait: a layer's weight gradient while its input gradient's partial sums are reduced, the
update of a gradient already reduced while another still is. So a collective hides behind the
independent compute between where it can start and where it is read: a partial sum read at
once by the next layer stays exposed, the first layer's parameter gathers and the gathers of
the last updates too.

A loop's body is one computation that XLA schedules on its own, trip after trip: a collective in
it starts no earlier than its trip does and is done before the trip ends, so it hides only
behind the compute of its own trip (a layer's gradient reduced inside a scan over layers waits
at the end of that layer's trip, not at the step's end, or sooner where the trip reads it: the
stacked gradients it is written into).

XLA combines independent collectives into one op (`combining.combine`), and that op is issued
once every member's operand is made: at its last member in program order, or, for parameters'
gathers run ahead of their readers, before its first member's reader. Issued member by member,
the early members of a gradients' combined reduction hid behind compute that in the compiled
program runs before the op exists (4 to 14 times the hidden time the compiled programs show on
small transformer steps).
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .combining import HEAD

CHAIN, AHEAD, BEHIND = "chain", "ahead", "behind"


@dataclass(frozen=True)
class Event:
    """One step of a plan in program order: compute of `seconds` (all trips of its loop's body
    together) that first waits for the collectives `reads` (their indices: what makes the
    values it reads) and runs after the compute of the units `after` (what makes them), unit
    `unit` (-1: compute of no unit, such as a layout copy; it runs in program order), or
    collective `index` (of the plan's planned collectives) that runs `how` (`CHAIN`, `AHEAD` or
    `BEHIND`) in trip `trip`; `trips`: the trips of the loop whose body holds it (1 outside
    loops)."""

    seconds: float = 0.0
    index: int = -1
    how: str = ""
    trips: int = 1
    trip: int = 0
    reads: tuple[int, ...] = ()
    unit: int = -1
    after: tuple[int, ...] = ()


def how_it_runs(combinable: bool, side: str | None) -> str:
    """How a collective can run beside compute: off the chain (`combinable`) ahead of its reader
    (a parameter's, `HEAD`) or behind its maker; else on the chain."""
    if not combinable:
        return CHAIN
    return AHEAD if side == HEAD else BEHIND


def issued(events: Sequence[Event], ops: Sequence[tuple[Sequence[int], float]], kernels: Sequence[float] = ()
           ) -> tuple[list[Event], list[float]]:
    """The events, and each collective's seconds, as XLA issues the combined `ops` (members'
    indices, the op's time): an op runs at its last member's event, or at its first where that
    runs `AHEAD`, with the whole op's time; its other members' events go. `kernels`: per op, the
    compute XLA adds around it (`combining.op_kernels_s`), run just before it is issued."""
    position = {e.index: k for k, e in enumerate(events) if e.index >= 0}
    seconds = [0.0] * (max(position, default=-1) + 1)
    before: dict[int, float] = {}
    op_of: dict[int, int] = {}  # member -> the index of the event its op is issued at
    makers: dict[int, tuple[int, ...]] = {}  # an op's event -> what makes any of its members
    for n, (group, time) in enumerate(ops):
        at = [position[i] for i in group]
        k = min(at) if events[min(at)].how == AHEAD else max(at)
        before[k] = kernels[n] if n < len(kernels) else 0.0
        seconds[events[k].index] = time
        op_of.update((i, events[k].index) for i in group)
        makers[events[k].index] = tuple(dict.fromkeys(u for i in group for u in events[position[i]].after))
    out: list[Event] = []
    for k, e in enumerate(events):
        if e.index >= 0 and k not in before:
            continue
        if before.get(k):
            out.append(Event(before[k], trips=e.trips))  # a body's ops are per trip: each trip runs one
        if e.reads:
            e = replace(e, reads=tuple(dict.fromkeys(op_of.get(i, i) for i in e.reads)))
        if e.index in makers:
            e = replace(e, after=makers[e.index])
        out.append(e)
    return out, seconds


def replay(events: Sequence[Event], durations: Sequence[float]) -> float:
    """The step's time (`exposure`)."""
    return exposure(events, durations)[0]


def exposure(events: Sequence[Event], durations: Sequence[float]) -> tuple[float, dict[int, float]]:
    """The step's time, and the seconds each collective (by index) is exposed: compute events on
    one stream, each collective (of `durations[index]` seconds) on one link, started as its `how`
    says and waited for where it is read; a loop's body (a run of events of the same `trips`)
    trip by trip, each trip's compute a share of its events' and its collectives done by the
    trip's end (the module's docstring). A collective of a value made outside the loop and read
    in its body runs once, before the loop. Where compute waits, the wait is the exposure of the
    collectives on the link meanwhile, each its share of the wait (one queued behind another
    waits for both); the link's run past the last compute is exposed too."""
    streams = _Streams()
    i = 0
    while i < len(events):
        trips, end = events[i].trips, i + 1
        if trips > 1:  # the body: up to its last event, past collectives of values made outside
            j = i
            while j < len(events) and (events[j].trips == trips or (events[j].index >= 0 and events[j].trips == 1)):
                end = j + 1 if events[j].trips == trips else end
                j += 1
        else:
            while end < len(events) and events[end].trips == 1:
                end += 1
        body = [e for e in events[i:end] if e.trips == trips]
        for e in events[i:end]:
            if e.trips != trips:
                streams.run(e, durations[e.index], 0.0)
        for trip in range(trips):
            begun = streams.compute
            link_done = streams.walk([e for e in body if e.index < 0 or e.trip == trip], trips, durations,
                                     begun if trips > 1 else 0.0)
            if trips > 1:  # a trip ends once its collectives are done
                streams.wait_until(link_done)
        i = end
    streams.wait_until(streams.link)
    return streams.compute, streams.exposed


LOOKAHEAD = 512  # events past a waiting one searched for compute that can run meanwhile


class _Streams:
    """Where the compute stream and the link are, in seconds from the step's start, and when
    each collective run so far ended."""

    def __init__(self) -> None:
        self.compute = self.link = 0.0
        self.done: dict[int, float] = {}
        self.runs: list[tuple[float, float, int]] = []  # (start, end, index) on the link, in order
        self.starts: list[float] = []
        self.exposed: dict[int, float] = {}

    def run(self, e: Event, seconds: float, earliest: float) -> float:
        """Collective `e` of `seconds` on the link, started no earlier than `earliest` (its
        trip's start); returns when it ends. Compute waits for it only where it is read."""
        start = max(self.link, earliest) if e.how == AHEAD else max(self.compute, self.link)
        self.link = self.done[e.index] = start + seconds
        self.runs.append((start, self.link, e.index))
        self.starts.append(start)
        return self.link

    def wait_until(self, t: float) -> None:
        """Compute idles until `t`: each collective on the link meanwhile is exposed for the part
        of its run within the wait."""
        if t <= self.compute:
            return
        # the runs are in order and apart: from the last that starts before t back to the wait's start
        for k in range(bisect.bisect_left(self.starts, t) - 1, -1, -1):
            start, end, index = self.runs[k]
            if end <= self.compute:
                break
            self.exposed[index] = self.exposed.get(index, 0.0) + min(end, t) - max(start, self.compute)
        self.compute = t

    def _ready_at(self, e: Event, unissued: set[int] = frozenset()) -> float:
        """When compute event `e` can start: once what it reads has run (a loop's later trips'
        collectives are not read in this one), never while it reads one of `unissued`."""
        if unissued.intersection(e.reads):
            return float("inf")
        return max([self.compute] + [self.done[i] for i in e.reads if i in self.done])

    def walk(self, events: Sequence[Event], trips: int, durations: Sequence[float], earliest: float) -> float:
        """One trip of `events` (`trips` of them share each compute event's seconds) as a list
        scheduler runs it: the first event in program order (within `LOOKAHEAD` of the first
        not run) whose makers have run and, for compute, whose reads are done; where none is,
        the one ready soonest. So a weight's gradient runs while its layer's input gradient is
        reduced, an optimizer's update of a gradient already reduced while another still is,
        and a reader of a combined op's early member waits until the op is issued at its last.
        Compute of no unit runs in program order. Returns when the trip's last collective ends
        (0 if none)."""
        here = {e.unit for e in events if e.unit >= 0}
        unissued = {e.index for e in events if e.index >= 0}
        ran: set[int] = set()
        taken = [False] * len(events)
        link_done, head = 0.0, 0
        while head < len(events):
            if taken[head]:
                head += 1
                continue
            first, soonest = None, float("inf")
            for k in range(head, min(len(events), head + LOOKAHEAD)):
                e = events[k]
                if taken[k] or (e.index < 0 and e.unit < 0 and k != head) \
                        or not all(u in ran or u not in here for u in e.after):
                    continue
                at = self.compute if e.index >= 0 else self._ready_at(e, unissued)
                if at < soonest:
                    first, soonest = k, at
                if at <= self.compute:
                    break
            if first is None:  # nothing near can run: the first runs on what has been issued
                first, soonest = head, self._ready_at(events[head])
            e, taken[first] = events[first], True
            if e.index >= 0:
                link_done = self.run(e, durations[e.index], earliest)
                unissued.discard(e.index)
            else:
                self.wait_until(soonest)
                self.compute += e.seconds / trips
                ran.add(e.unit)
        return link_done
