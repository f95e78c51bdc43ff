"""O2 and O3: which ILP is solved for a plan, and how.

O2 ties the cones of repeated segments (`repeats`) and solves the tied ILP whole when it is small
enough, else window by window (`windows`), so its time grows with depth, not faster. When tying
saves little (the untied ILP at most `UNTIED_GROWTH` times the tied one), O2 solves the untied ILP
too, from the tied plan: tying identical layers rules out plans that alternate between them
(Megatron's column/row split over two identical linear layers). O3 solves the whole graph's ILP,
starting from O2's choice: it never returns a worse plan than O2's, and its time limit covers
O2's solve and the build of its own model.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from rhino_jax.core.diagnostics import IlpStage
from rhino_jax.errors import SolverError

from .. import interrupt
from . import ilp, windows

UNTIED_GROWTH = 2.0  # O2 solves the untied ILP after the tied one when it is at most this much larger


GRACE = 0.2  # a search may overrun its limit by this share of it, no more (`Deadline.check`)


@dataclass(frozen=True)
class Deadline:
    """The one time limit of a search: its model build, every solve of every stage, the memory
    limit's trials and the overlap rounds all come out of it (`solver_time_limit_s`)."""

    seconds: float  # the limit as the user gave it (for messages)
    at: float  # time.perf_counter() when it passes

    @classmethod
    def after(cls, seconds: float) -> "Deadline":
        return cls(seconds, time.perf_counter() + seconds)

    def left(self) -> float:
        return self.at - time.perf_counter()

    def check(self, phase: str) -> None:
        """Raise `SolverError` once the search has run `GRACE` past its limit while `phase` has
        no plan to return (building the model): a search returns within 1.2 times its limit.
        After the build a plan exists (the replicated one at worst) and the solves stop at the
        limit with the best found."""
        if time.perf_counter() > self.at + GRACE * self.seconds:
            raise SolverError(
                f"the search ran past its solver_time_limit_s={self.seconds:g} while {phase}, before it had any "
                "plan: raise solver_time_limit_s, or plan for a mesh of fewer axes")


class Budget:
    """One `solver_time_limit_s` shared by the searches of one step (a pipeline's stager and
    programs, a micro-batched step's two programs, `pipeline="auto"`'s candidates, `mesh=None`'s
    mesh shapes): each search takes the time left in proportion to its weight (its ops) among
    the weight still to run, so the step's searches end within the limit (each within 1.2 times
    its share, `Deadline.check`). Time a search leaves unused goes to the ones after it.
    `until` (a `time.perf_counter()` time): where the budget is itself a share of an outer one,
    the outer share's end, so the time spent between taking it and starting this one counts."""

    def __init__(self, seconds: float, weight: float, until: float | None = None):
        self.seconds, self.at = seconds, time.perf_counter() + seconds if until is None else until
        self.weight_left = float(weight)

    def take(self, weight: float, what: str) -> float:
        """Seconds for the next search, `what` (named in the error when no time is left)."""
        left = self.at - time.perf_counter()
        if left <= 0:
            raise SolverError(f"the step's searches reached their solver_time_limit_s={self.seconds:g} "
                              f"before {what}: raise solver_time_limit_s")
        share = left * min(1.0, weight / max(self.weight_left, 1e-12))
        self.skip(weight)
        return share

    def skip(self, weight: float) -> None:
        """A search of `weight` that will not run (its plan is another's): its share goes to the rest."""
        self.weight_left = max(0.0, self.weight_left - weight)


@dataclass(frozen=True)
class Tying:
    """The problem with groups of one class taking one strategy."""

    index: tuple[int, ...]  # group → class
    problem: ilp.Problem  # over classes
    position: tuple[int, ...]  # class → the earliest segment of its groups (program order)

    def classes(self, per_group: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
        """Per-group masks of forbidden strategies, per class (any group's forbids it)."""
        out = [np.zeros(len(c), dtype=bool) for c in self.problem.costs]
        for g, mask in enumerate(per_group):
            out[self.index[g]] |= mask
        return tuple(out)

    def summed(self, per_group: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
        """Per-group values of the strategies, summed per class (as `ilp.tie` sums costs)."""
        out = [np.zeros(len(c)) for c in self.problem.costs]
        for g, values in enumerate(per_group):
            out[self.index[g]] = out[self.index[g]] + values
        return tuple(out)

    def weighed(self, weight_s: float, held: Sequence[np.ndarray]) -> "Tying":
        """This tying with `weight_s` seconds added per byte each group's strategy holds
        (`held`, per group), summed per class: memory priced in the objective."""
        return dataclasses.replace(self, problem=dataclasses.replace(self.problem, costs=tuple(
            c + weight_s * h for c, h in zip(self.problem.costs, self.summed(held)))))

    def of_groups(self, group_choice: Sequence[int]) -> tuple[int, ...]:
        """A choice of every group, as a choice of this tying's classes (groups of one class
        agree: each class here lies inside one class of the tying the choice came from)."""
        out = [0] * len(self.problem.costs)
        for g, j in enumerate(group_choice):
            out[self.index[g]] = j
        return tuple(out)


def tying(problem: ilp.Problem, class_of: list[int], segments: Sequence[int]) -> Tying:
    tied, index = ilp.tie(problem, class_of)
    position = [len(segments)] * len(tied.costs)
    for g, c in enumerate(index):
        position[c] = min(position[c], segments[g])
    return Tying(tuple(index), tied, tuple(position))


def solver_for(tied: Tying, backend: str, whole: bool) -> ilp.Model | windows.Windowed:
    return ilp.Model(tied.problem, backend) if whole else windows.Windowed(tied.problem, list(tied.position), backend)


class Levels:
    """The solvers of one search, each starting from the last one's choice. O2: the exact tying
    as one ILP when small enough (`windows.WHOLE_VARS`); when not, and layers alike tied make a
    small one, that one first and then the exact tying by windows from its plan; when even that
    is large, the exact tying by windows from `start`, then as one ILP in the time left: windows
    find local optima (a move to data parallelism needs every layer at once), and the one ILP
    may take longer than the time limit allows (a 485k-variable LP relaxation takes 40 s on a
    WR depth 50; the windows, 9 s for a plan 4 % off); then the untied ILP when tying saved little
    (`UNTIED_GROWTH`; `untied_vars`: its size, known before it is built, 0 when O2's tying tied
    no repeats and so is the untied ILP already). O3: the untied ILP after O2's, always. The
    first stage starts from the cheapest of `starts(windowed)`, called once, `windowed` saying
    whether that stage is solved by windows (`_start`). Built once, solved once per memory-limit
    trial, with strategies forbidden and memory priced (`memory_limit.fit_memory`)."""

    def __init__(self, similar: Callable[[], Tying], o2: Tying, untied: Callable[[], Tying], untied_vars: int,
                 whole_graph: bool, backend: str,
                 starts: Callable[[bool], Sequence[Sequence[int | None]]] = lambda windowed: (),
                 price: Callable[[list[int]], float] | None = None):
        # plans the first stage must beat: each group's strategy (None: its choice)
        self.starts = functools.cache(lambda: starts(not self.stages[0][1]))
        self.stages: list[tuple[Tying, bool]] = [(o2, True)]  # (tying, solved as one ILP)
        self.names = ["repeats tied"]  # each stage as the report names it
        tied_vars = windows.size(o2.problem)
        if tied_vars > windows.WHOLE_VARS:
            alike = similar()
            if windows.size(alike.problem) <= windows.WHOLE_VARS:
                self.stages, self.names = [(alike, True), (o2, False)], ["layers alike tied", "by windows"]
            else:
                self.stages, self.names = [(o2, False), (o2, True)], ["by windows", "repeats tied"]
        if whole_graph or 0 < untied_vars <= min(windows.WHOLE_VARS, UNTIED_GROWTH * tied_vars):
            self.stages.append((untied(), True))
            self.names.append("untied")
        self.backend = backend
        self.price = price  # each group's strategy → the step's predicted time, reported for a stage's plan
        self._solvers: dict[tuple[int, float], ilp.Model | windows.Windowed] = {}

    def _solver(self, k: int, weight_s: float, held: Sequence[np.ndarray] | None):
        if (k, weight_s) not in self._solvers:
            tied, whole = self.stages[k]
            if weight_s:
                tied = tied.weighed(weight_s, held)
            if weight_s and not any(w == weight_s for _, w in self._solvers):  # one weighted set at a time
                self._solvers = {key: v for key, v in self._solvers.items() if not key[1]}
            self._solvers[k, weight_s] = solver_for(tied, self.backend, whole)
        return self._solvers[k, weight_s]

    def _start(self, tied: Tying, forbidden: Sequence[np.ndarray]) -> tuple[int, ...] | None:
        """The cheapest of `starts` as a choice of `tied`'s classes, its forbidden strategies and
        its gaps filled greedily: an incumbent the relaxation's rounding must beat, and where the
        windows start. The rounding can miss a plan of no collectives at all when the family
        variables' relaxation pays a fraction of a launch (a latency-bound step, where one launch
        is a large share of the step); windows from there miss any plan that needs every layer
        to move at once (data parallelism), which a coarse plan holds (`planner._coarse_start`)."""
        stage = ilp.forbid(tied.problem, tied.classes(forbidden))
        found = []
        for start in self.starts():
            partial: list[int | None] = [None] * len(stage.costs)
            for g, j in enumerate(start):
                if j is not None and np.isfinite(stage.costs[tied.index[g]][j]):
                    partial[tied.index[g]] = j
            found.append(ilp.greedy(stage, partial))
        return min(found, key=lambda c: ilp.evaluate(stage, c), default=None)

    def solve(self, deadline: Deadline, forbidden: Sequence[np.ndarray], weight_s: float = 0.0,
              held: Sequence[np.ndarray] | None = None) -> tuple[list[int], ilp.Solution, tuple[IlpStage, ...], int]:
        """(each group's strategy, the last stage's solution, each stage run as the plan's search
        statistics list it, how many windows the last one solved). The stages left when the
        `deadline` passes are skipped (status "feasible"). Ctrl-C ends it with the plan of the
        last stage solved (a stage's solver returns its best so far; before any, a greedy plan),
        status "interrupted"."""
        choice: list[int] | None = None
        solution: ilp.Solution | None = None
        run: list[IlpStage] = []
        solved_windows = 0
        for k, (tied, _) in enumerate(self.stages):
            if deadline.left() <= 0 and solution is not None:  # out of time: the last stage's plan, as stopped at the limit
                return choice, dataclasses.replace(solution, status="feasible"), tuple(run), solved_windows
            if solution is not None and solution.status == "interrupted":  # Ctrl-C: the last stage's plan
                return choice, solution, tuple(run), solved_windows
            try:
                solver = self._solver(k, weight_s, held)
            except KeyboardInterrupt:  # while building a stage's model: the last stage's plan, or a greedy one
                interrupt.press()
                if solution is None:
                    stage = ilp.forbid(tied.problem, tied.classes(forbidden))
                    start = time.perf_counter()
                    greedy = ilp.greedy(stage)
                    solution = ilp.Solution(greedy, ilp.evaluate(stage, greedy), float("nan"), "interrupted",
                                            time.perf_counter() - start, self.backend, 0, 0)
                    choice = [greedy[c] for c in tied.index]
                return choice, dataclasses.replace(solution, status="interrupted"), tuple(run), solved_windows
            solution = solver.solve(max(1e-3, deadline.left()), tied.classes(forbidden),
                                    incumbent=self._start(tied, forbidden) if choice is None else tied.of_groups(choice))
            choice = [solution.choice[c] for c in tied.index]
            if self.price is not None and not weight_s:  # else its objective also prices memory
                solution = dataclasses.replace(solution, objective_s=self.price(choice))
            run.append(IlpStage(self.names[k], len(tied.problem.costs), solution.status, solution.objective_s,
                                solution.solve_s))
            solved_windows = len(getattr(solver, "windows", ()))
        return choice, solution, tuple(run), solved_windows
