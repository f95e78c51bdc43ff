"""What XLA's latency-hiding scheduler hides: a plan's step replayed in program order on a
compute stream and a collective stream.

XLA's GPU compiler issues a collective asynchronously and runs the kernels that do not need its
result beside it. Where a collective stands in the step's dependences decides what that can be:
- on the compute chain (an activation's reshard, a layer's partial sums): the chain waits for it;
- a parameter's, before the chain reads it (`combining.HEAD`): it can run from the step's start,
  so its reader waits only if the link has not finished it by then;
- after the chain (`combining.TAIL`, `DERIVED`: a gradient's reduction, an updated parameter's
  gather): it runs from where its value is made, and only the step's end waits for it.
One link runs the collectives one after another. So a collective hides behind the compute
between where it can start and where it is waited for: the first layer's parameter gathers and
the gathers of the last updates stay exposed, where a share of all off-chain communication hid
them before.

A loop's body is one computation that XLA schedules on its own, trip after trip: a collective in
it starts no earlier than its trip does and is done before the trip ends, so it hides only
behind the compute of its own trip (a layer's gradient reduced inside a scan over layers waits
at the end of that layer's trip, not at the step's end).

XLA combines independent collectives into one op (`combining.combine`), and that op is issued
once every member's operand is made: at its last member in program order, or, for parameters'
gathers run ahead of their readers, before its first member's reader. Issued member by member,
the early members of a gradients' combined reduction hid behind compute that in the compiled
program runs before the op exists (4 to 14 times the hidden time the compiled programs show on
small transformer steps).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .combining import HEAD

CHAIN, AHEAD, BEHIND = "chain", "ahead", "behind"


@dataclass(frozen=True)
class Event:
    """One step of a plan in program order: compute of `seconds` (all trips of its loop's body
    together), or collective `index` (of the plan's planned collectives) that runs `how`
    (`CHAIN`, `AHEAD` or `BEHIND`) in trip `trip`; `trips`: the trips of the loop whose body
    holds it (1 outside loops)."""

    seconds: float = 0.0
    index: int = -1
    how: str = ""
    trips: int = 1
    trip: int = 0


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
    for n, (group, time) in enumerate(ops):
        at = [position[i] for i in group]
        k = min(at) if events[min(at)].how == AHEAD else max(at)
        before[k] = kernels[n] if n < len(kernels) else 0.0
        seconds[events[k].index] = time
    out: list[Event] = []
    for k, e in enumerate(events):
        if e.index >= 0 and k not in before:
            continue
        if before.get(k):
            out.append(Event(before[k], trips=e.trips))  # a body's ops are per trip: each trip runs one
        out.append(e)
    return out, seconds


def replay(events: Sequence[Event], durations: Sequence[float]) -> float:
    """The step's time: compute events one after another, each collective (of `durations[index]`
    seconds) on one link, started and waited for as its `how` says; a loop's body (a run of
    events of the same `trips`) trip by trip, each trip's compute a share of its events' and its
    collectives done by the trip's end (the module's docstring). A collective of a value made
    outside the loop and read in its body runs once, before the loop."""
    streams = _Streams()
    i = 0
    while i < len(events):
        trips, end = events[i].trips, i + 1
        if trips > 1:  # the body: up to its last event, past collectives of values made outside
            j = i
            while j < len(events) and (events[j].trips == trips or (events[j].index >= 0 and events[j].trips == 1)):
                end = j + 1 if events[j].trips == trips else end
                j += 1
        body = [e for e in events[i:end] if e.trips == trips]
        for e in events[i:end]:
            if e.trips != trips:
                streams.run(e, durations[e.index], 0.0)
        _run_body(streams, body, trips, durations)
        i = end
    return max(streams.compute, streams.link)


def _run_body(streams: _Streams, body: Sequence[Event], trips: int, durations: Sequence[float]) -> None:
    """A loop's body (or one event outside loops, `trips` 1) trip by trip. Each trip's compute is
    a share of its events'; only the trip's own collectives are walked, each at the compute
    done before it in the body plus the waits before it in the trip."""
    done, by_trip = 0.0, {}
    for e in body:
        if e.index < 0:
            done += e.seconds / trips
        else:
            by_trip.setdefault(e.trip, []).append((done, e))
    for trip in range(trips):
        begun, link_done, waited = streams.compute, 0.0, 0.0
        for at, e in by_trip.get(trip, ()):
            streams.compute = begun + at + waited
            link_done = streams.run(e, durations[e.index], begun if trips > 1 else 0.0)
            waited = streams.compute - begun - at
        streams.compute = begun + done + waited
        if trips > 1:  # a trip ends once its collectives are done
            streams.compute = max(streams.compute, link_done)


class _Streams:
    """Where the compute stream and the link are, in seconds from the step's start."""

    def __init__(self) -> None:
        self.compute = self.link = 0.0

    def run(self, e: Event, seconds: float, earliest: float) -> float:
        """Collective `e` of `seconds` on the link, started no earlier than `earliest` (its
        trip's start); returns when it ends."""
        start = max(self.link, earliest) if e.how == AHEAD else max(self.compute, self.link)
        self.link = start + seconds
        if e.how != BEHIND:
            self.compute = max(self.compute, self.link)
        return self.link
