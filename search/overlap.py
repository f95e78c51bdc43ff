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
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .combining import HEAD

CHAIN, AHEAD, BEHIND = "chain", "ahead", "behind"


@dataclass(frozen=True)
class Event:
    """One step of a plan in program order: compute of `seconds`, or collective `index` (of the
    plan's planned collectives) that runs `how` (`CHAIN`, `AHEAD` or `BEHIND`)."""

    seconds: float = 0.0
    index: int = -1
    how: str = ""


def how_it_runs(combinable: bool, side: str | None) -> str:
    """How a collective can run beside compute: off the chain (`combinable`) ahead of its reader
    (a parameter's, `HEAD`) or behind its maker; else on the chain."""
    if not combinable:
        return CHAIN
    return AHEAD if side == HEAD else BEHIND


def replay(events: Sequence[Event], durations: Sequence[float]) -> float:
    """The step's time: compute events one after another, each collective (of `durations[index]`
    seconds) on one link, started and waited for as its `how` says (the module's docstring)."""
    compute = link = 0.0
    for e in events:
        if e.index < 0:
            compute += e.seconds
            continue
        start = link if e.how == AHEAD else max(compute, link)
        link = start + durations[e.index]
        if e.how != BEHIND:
            compute = max(compute, link)
    return max(compute, link)
