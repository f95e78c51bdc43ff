"""One argument pinned to another layout, solved on the plan's own ILP: what `explain` prices an
alternative layout at, in seconds rather than a search.

The search that made a plan built its units, cones and their ILP (`planner`). Pinning an
argument there forbids the strategies of its cone that lay it out otherwise (as `units.apply_pins`
keeps only those that do), and the whole ILP, untied as O3 solves it (a loop's entry and exit
still one layout), is solved again from the plan's choice with that cone's filled in greedily;
a problem too large for one ILP is solved by windows, only those the change reaches
(`windows.Windowed.solve(settled=True)`), which stop at a local optimum a new search can
improve on. The plan's own restrictions stay: arguments a memory
limit kept off replication, and memory priced as the plan's solve priced it. What a new search
with the pin would do besides is not redone (cones built around the pinned layout, layers tied,
the overlap rounds): where the cone has no strategy that makes the layout, there is no answer
here, and the caller searches again.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rhino_jax.core.plan import Plan
from rhino_jax.core.specs import ShardingSpec

from ..hlo_passes.graph import Pin
from .coarsening.cones import Cone
from .solvers import ilp, levels, windows
from .space.units import Unit, matches_pin


# The largest ILP (variables, `windows.size`) a plan keeps: about 20 bytes a variable with its
# units and cones (measured: 206k variables, 4.5 MB), held as long as the plan is.
KEPT_VARS = 2_000_000


@dataclass(eq=False)
class Repin:
    """The plan's ILP and what it needs to solve it again with one argument pinned; `make` turns
    a choice of every group and its solution into a plan, as the search did."""

    # the plan's ILP untied (a loop's entry and exit one class), tie ranks included, memory weighted
    # as the plan's solve was; built when first asked for
    tied: Callable[[], levels.Tying]
    forbidden: tuple[np.ndarray, ...]  # per group: strategies the plan's solve forbade (memory limit trials)
    choice: tuple[int, ...]  # the plan's, per group
    units: list[Unit]
    groups: list[Cone]
    group_of: dict[int, int]
    producer_unit: dict[int, int]
    sizes: dict[str, int]
    backend: str
    make: Callable[[list[int], ilp.Solution], Plan]
    _solver: ilp.Model | windows.Windowed | None = field(default=None, repr=False)

    def __reduce__(self):
        # Not carried to another process (a plan searched in a worker): there, explain searches again.
        return _dropped, ()

    def __call__(self, value: int, layout: ShardingSpec, time_limit_s: float) -> Plan | None:
        """The best plan of this ILP with `value` (an argument) laid out as `layout`; None where
        its cone has no strategy that makes it."""
        m = self.producer_unit.get(value)
        if m is None:
            return None
        g, pos = self.group_of[m], self.units[m].results.index(value)
        pin = Pin(value, layout.dims, "")
        allowed = np.array([matches_pin(ch[m].results[pos], pin, self.sizes) for ch in self.groups[g].choice])
        forbidden = tuple(f | ~allowed if k == g else f for k, f in enumerate(self.forbidden))
        tied = self.tied()
        if not (allowed & ~self.forbidden[g] & np.isfinite(tied.problem.costs[tied.index[g]])).any():
            return None
        start: list[int | None] = list(tied.of_groups(self.choice))
        start[tied.index[g]] = None
        whole = windows.size(tied.problem) <= windows.WHOLE_VARS
        if self._solver is None:
            self._solver = levels.solver_for(tied, self.backend, whole)
        if whole:
            incumbent = ilp.greedy(ilp.forbid(tied.problem, tied.classes(forbidden)), start)
            solution = self._solver.solve(time_limit_s, tied.classes(forbidden), incumbent=incumbent)
        else:  # by windows, those the change reaches
            solution = self._solver.solve(time_limit_s, tied.classes(forbidden), incumbent=tuple(start), settled=True)
        return self.make([solution.choice[c] for c in tied.index], solution)


def _dropped() -> None:
    return None
