"""O2 on graphs too large for one ILP: the ILP solved window by window (Rhino §4.3's levels 2
and 3, with the long edges kept).

Rhino cuts the graph at critical nodes into near-linear segments, solves an ILP per segment and
stitches the segments by DP over their boundary layouts. A train step is not a chain: an
activation saved for the backward pass, a parameter read by the optimizer, join segments far
apart in program order, and a DP over boundaries cannot price them. Here a window is a run of
consecutive segments (a core) grown along the edges that can cost the most (the coupling:
the spread of an edge's costs) up to a size budget, so that a layer's forward ops, their
backward ops and the optimizer's update of its weights fall into one window. Windows are solved
in program order, first with the later ones still undecided (their edges left out: Rhino's
stitching, one boundary at a time), then again with every other group fixed at its choice, so
each edge, long or short, is priced exactly, and a combined family's launch is paid by whichever
window uses it first (`restrict`). A window never makes the whole worse, sweeps stop when one
gains nothing, and each window's ILP is small: the time grows with the number of windows, so
linearly in depth.

There is no global bound: the status is "windowed" (each window optimal given the rest).
"""
from __future__ import annotations

import heapq
import time

import numpy as np

from .. import interrupt, progress
from . import ilp


WHOLE_VARS = 150_000  # a (tied) problem with at most this many variables is solved as one ILP
WINDOW_VARS = 25_000  # a window's variables (x and y), at most
CORE_SHARE = 3  # a window's core, consecutive in program order, takes a third of its budget
SWEEPS = 4  # at most this many sweeps over the windows after the first


def size(problem: ilp.Problem) -> int:
    """Variables of the problem's ILP: one x per strategy, one y per edge entry."""
    return sum(len(c) for c in problem.costs) + sum(e.matrix.size for e in problem.edges)


def windows(problem: ilp.Problem, position: list[int], budget: int) -> list[list[int]]:
    """Groups of each window, in program order (`position`: each group's segment). A core of
    consecutive groups, then its neighbours by decreasing coupling until the budget is spent."""
    n = len(problem.costs)
    adjacent: list[list[tuple[float, int, int]]] = [[] for _ in range(n)]  # (−coupling, neighbour, size)
    for e in problem.edges:
        spread = float(np.ptp(e.matrix)) if e.matrix.size else 0.0
        adjacent[e.src].append((-spread, e.dst, e.matrix.size))
        adjacent[e.dst].append((-spread, e.src, e.matrix.size))
    order = sorted(range(n), key=lambda g: (position[g], g))
    found: list[list[int]] = []
    start = 0
    while start < n:
        members: dict[int, None] = {}
        used = 0
        while start < n and (not members or used + len(problem.costs[order[start]]) <= budget // CORE_SHARE):
            g = order[start]
            used += len(problem.costs[g]) + sum(s for _, h, s in adjacent[g] if h in members)
            members[g] = None
            start += 1
        frontier = [item for g in members for item in adjacent[g] if item[1] not in members]
        heapq.heapify(frontier)
        while frontier:
            _, g, _ = heapq.heappop(frontier)
            if g in members:
                continue
            more = len(problem.costs[g]) + sum(s for _, h, s in adjacent[g] if h in members)
            if used + more > budget:
                continue
            members[g] = None
            used += more
            for item in adjacent[g]:
                if item[1] not in members:
                    heapq.heappush(frontier, item)
        found.append(sorted(members, key=lambda g: (position[g], g)))
    return found


class Incidence:
    """The edges at each group, to restrict the problem to a window in time linear in the window."""

    def __init__(self, problem: ilp.Problem):
        self.at: list[list[ilp.Edge]] = [[] for _ in problem.costs]
        for e in problem.edges:
            self.at[e.src].append(e)
            self.at[e.dst].append(e)


def family_users(problem: ilp.Problem, choice: list[int | None]) -> np.ndarray:
    """How many decided groups and edges between decided groups use each family."""
    users = np.zeros(len(problem.fixed), dtype=int)
    for g, j in enumerate(choice):
        if j is not None:
            users += problem.group_uses(g)[:, j]
    for e in problem.edges:
        if choice[e.src] is not None and choice[e.dst] is not None:
            users += problem.edge_uses(e)[:, e.src_class[choice[e.src]], e.dst_class[choice[e.dst]]]
    return users


def _touching(members: list[int], incidence: Incidence) -> list[ilp.Edge]:
    """The edges with an end among `members`, each once."""
    seen: dict[int, ilp.Edge] = {}
    for g in members:
        for e in incidence.at[g]:
            seen.setdefault(id(e), e)
    return list(seen.values())


def share(problem: ilp.Problem, members: list[int], choice: list[int | None], incidence: Incidence) -> np.ndarray:
    """The part of `family_users` that `members` and their edges bring."""
    users = np.zeros(len(problem.fixed), dtype=int)
    for g in members:
        if choice[g] is not None:
            users += problem.group_uses(g)[:, choice[g]]
    for e in _touching(members, incidence):
        if choice[e.src] is not None and choice[e.dst] is not None:
            users += problem.edge_uses(e)[:, e.src_class[choice[e.src]], e.dst_class[choice[e.dst]]]
    return users


def restrict(problem: ilp.Problem, members: list[int], choice: list[int | None], incidence: Incidence,
             outside: np.ndarray) -> ilp.Problem:
    """The problem over `members` with every other group at its `choice` (None: undecided, its
    edges left out). An edge to a decided outsider becomes a cost of the member's strategies;
    a family the outsiders use (`outside`: `family_users` less the members' `share`) is paid
    already, so it costs the window nothing. Its objective is the whole's minus a constant."""
    index = {g: i for i, g in enumerate(members)}
    costs = [np.array(problem.costs[g], dtype=float) for g in members]
    uses = [problem.group_uses(g).copy() for g in members]
    edges = []
    for e in _touching(members, incidence):
        eu = problem.edge_uses(e)
        src, dst = index.get(e.src), index.get(e.dst)
        if src is not None and dst is not None:
            edges.append(ilp.Edge(src, dst, e.src_class, e.dst_class, e.matrix, eu))
        elif src is not None and choice[e.dst] is not None:
            b = e.dst_class[choice[e.dst]]
            costs[src] += e.matrix[list(e.src_class), b]
            uses[src] |= eu[:, list(e.src_class), b]
        elif dst is not None and choice[e.src] is not None:
            a = e.src_class[choice[e.src]]
            costs[dst] += e.matrix[a, list(e.dst_class)]
            uses[dst] |= eu[:, a, list(e.dst_class)]
    fixed = np.where(outside > 0, 0.0, np.asarray(problem.fixed, dtype=float))
    return ilp.Problem(tuple(costs), tuple(edges), tuple(fixed.tolist()), tuple(uses))


class Windowed:
    """The solver of a problem too large for one ILP (`WHOLE_VARS`), with `ilp.Model`'s interface."""

    def __init__(self, problem: ilp.Problem, position: list[int], backend: str = "HIGHS",
                 budget: int | None = None):
        self.problem, self.backend = problem, backend
        self.windows = windows(problem, position, budget or WINDOW_VARS)
        self._incidence = Incidence(problem)
        # What a window's problem depends on besides its members: the groups at its edges.
        self._around = [sorted({h for g in w for e in self._incidence.at[g] for h in (e.src, e.dst)} - set(w))
                        for w in self.windows]

    def solve(self, time_limit_s: float = 60.0, forbidden: tuple[np.ndarray, ...] | None = None,
              incumbent: tuple[int | None, ...] | None = None, settled: bool = False) -> ilp.Solution:
        """Windows in program order, sweep after sweep, until none changes (at most `SWEEPS`
        after the first); from `incumbent` when given, else from nothing decided. A window
        whose members, neighbours and paid families are as when it was last solved is skipped:
        its answer would be the same. `settled`: the incumbent is this problem's solution but
        for its undecided groups, so a window none of whose members or neighbours is undecided
        counts as solved at it (a plan with one argument pinned anew re-solves the windows the
        change reaches, `repin`). Ctrl-C keeps the windows solved so far (the rest greedily)."""
        start = time.perf_counter()
        problem = self.problem if forbidden is None else ilp.forbid(self.problem, forbidden)
        choice: list[int | None] = list(incumbent) if incumbent is not None else [None] * len(problem.costs)
        undecided = choice.count(None)
        users = family_users(problem, choice)
        status, biggest = "windowed", (0, 0)
        solved: list[tuple | None] = [None] * len(self.windows)  # each window's inputs when last solved
        if settled:
            for w, members in enumerate(self.windows):
                if all(choice[g] is not None for g in members + self._around[w]):
                    before = share(problem, members, choice, self._incidence)
                    solved[w] = (tuple(choice[g] for g in members + self._around[w]), tuple(users - before > 0))
        try:
            for sweep in range(SWEEPS + 1):
                changed = False
                for w, members in enumerate(self.windows):
                    left = time_limit_s - (time.perf_counter() - start)
                    if left <= 0 and not undecided:
                        status = "feasible"
                        break
                    before = share(problem, members, choice, self._incidence)
                    key = (tuple(choice[g] for g in members + self._around[w]), tuple(users - before > 0))
                    if key == solved[w]:
                        continue
                    sub = restrict(problem, members, choice, self._incidence, users - before)
                    solution = ilp.Model(sub, self.backend).solve(max(left, 1e-3))
                    biggest = max(biggest, (solution.num_vars, solution.num_constraints))
                    current = tuple(choice[g] for g in members)
                    if None in current or ilp.evaluate(sub, solution.choice) < ilp.evaluate(sub, current):
                        changed = True
                        undecided -= current.count(None)
                        for g, j in zip(members, solution.choice):
                            choice[g] = j
                        after = share(problem, members, choice, self._incidence)
                        users += after - before
                        before = after
                    solved[w] = (tuple(choice[g] for g in members + self._around[w]), tuple(users - before > 0))
                    if solution.status == "interrupted":
                        status = "interrupted"
                        break
                if status != "windowed":
                    break
                predicted = ilp.evaluate(problem, tuple(choice))
                progress.say("rhino_jax: sweep %d over %d windows (at most %d variables each) in %.2f s: predicted "
                             "%.4g ms", sweep + 1, len(self.windows), biggest[0], time.perf_counter() - start,
                             predicted * 1e3)
                if not changed:
                    break
        except KeyboardInterrupt:  # in this loop's own work: the windows solved so far stand
            interrupt.press()
            status = "interrupted"
        final = ilp.greedy(problem, choice)  # groups an interruption left undecided: greedily
        return ilp.Solution(final, ilp.evaluate(problem, final), float("nan"), status,
                            time.perf_counter() - start, self.backend, *biggest)
