"""Of the plans a search weighed, the one whose compiled program runs fastest on the GPUs.

The search prices a plan by replaying its collectives beside its compute as XLA's latency-hiding
scheduler would (`search.cost.overlap`). What the scheduler makes of the program, which
collectives it leaves synchronous, what each kernel costs to launch and which memory remedy the
program needs, only the compiled program says. So where the search weighed plans of other
layouts (its overlap rounds, `Plan.alternatives`) and the program is for GPUs (real or
described), each is compiled as `compile()` compiles it (remedies included: a plan that fits
only tied to its order carries that cost) and priced as its schedule runs
(`compiled_cost.price_compiled`). The fastest that fits the devices' memory is kept; a plan ahead
in the search's order wins a tie. A plan predicted more than `SURE_GAP` slower than the
fastest one compiled so far that fits is not compiled: the replay is taken to order plans that
far apart as their programs run (on ten small steps for 8 described H100s it predicts the kept
plan's step at 0.77-1.01 times its compiled price, plans of one step alike). CPU programs run
their collectives synchronously: there the search's replay is what runs, and nothing is
compiled before `compile()`.
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from rhino_jax.core.diagnostics import CompiledCandidate
from rhino_jax.core.plan import Plan
from rhino_jax.runtime.compiled.compiled_cost import price_compiled
from rhino_jax.search import progress
from rhino_jax.search.cost.gemm_workspace import GPU_PLATFORMS
from rhino_jax.search.ties import SAME_STEP

from .one_program import Lowered


SURE_GAP = 0.15  # plans whose predicted steps differ by more than this share are not both compiled


@dataclass(frozen=True)
class _Compiled:
    """One candidate compiled: its step as its schedule runs, what XLA's memory analysis says it
    holds, and the warnings its compile gave (said again at `compile()` if it is kept)."""

    lowered: Lowered
    seconds: float
    nbytes: int
    said: tuple[warnings.WarningMessage, ...]
    compile_s: float  # what its compile and pricing took

    def fits(self) -> bool:
        return self.nbytes <= self.lowered.memory_limit_bytes


def fastest_compiled(candidates: list[Lowered], finish: Callable[[Plan], Plan] = lambda plan: plan) -> Lowered:
    """The first of `candidates` (the search's plan, then its alternatives, best predicted first)
    for CPUs or when it is alone; for GPUs, the one whose compiled program runs fastest among
    those that fit (none fitting: the first), compiled already, its plan's `search_stats`
    listing each candidate (`compiled_candidates`, in the search's order, with what each compile
    took: `lower()`'s time less theirs is the search's and the lowering's). `finish`: what an
    alternative's plan lacks until it is kept (the first's has it already)."""
    first = candidates[0]
    if len(candidates) == 1 or first.mesh.devices.flat[0].platform not in GPU_PLATFORMS:
        return first
    tried: list[_Compiled | None] = []
    for i, lowered in enumerate(candidates):
        fastest = min((t for t in tried if t is not None and t.fits()), key=lambda t: t.seconds, default=None)
        bar = float("inf") if fastest is None else fastest.lowered.plan.cost.total_s * (1 + SURE_GAP)
        tried.append(_compile(lowered, i, len(candidates)) if lowered.plan.cost.total_s <= bar else None)
    fitting = _fitting(tried)
    fastest = min(t.seconds for t in fitting)
    kept = next(t for t in fitting if t.seconds <= fastest * (1 + SAME_STEP))
    progress.say("rhino_jax: kept the plan %d of %d: %.4g ms as its schedule runs", tried.index(kept) + 1, len(tried),
                 kept.seconds * 1e3)
    chosen = kept.lowered
    if chosen is not first:
        chosen.plan = finish(chosen.plan)
    listed = tuple(CompiledCandidate(c.plan.cost.total_s) if t is None else
                   CompiledCandidate(c.plan.cost.total_s, t.seconds, t.nbytes, t.fits(), t is kept, t.compile_s)
                   for c, t in zip(candidates, tried))
    chosen.plan = dataclasses.replace(
        chosen.plan, search_stats=dataclasses.replace(chosen.plan.search_stats, compiled_candidates=listed))
    chosen._compiled.plan = chosen.plan
    chosen._said = kept.said
    return chosen


def _fitting(tried: list[_Compiled | None]) -> list[_Compiled]:
    """The compiled candidates that fit the devices' memory; none fitting, the first."""
    compiled = [t for t in tried if t is not None]
    return [t for t in compiled if t.fits()] or compiled[:1]


def _compile(lowered: Lowered, i: int, n: int) -> _Compiled:
    """`lowered` compiled (and kept compiled) with its warnings held back, and priced."""
    progress.say("rhino_jax: compiling the plan %d of %d the search weighed (predicted %.4g ms) to price it as XLA "
                 "schedules it", i + 1, n, lowered.plan.cost.total_s * 1e3)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        compiled = lowered.compile()
    seconds = price_compiled(compiled._executable, lowered.cluster).overlapped_s
    return _Compiled(lowered, seconds, compiled.memory.total, tuple(said), time.perf_counter() - t0)
