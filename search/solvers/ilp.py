"""The strategy ILP (Rhino §4.2), solved with OR-Tools.

One-hot x[g, j] picks strategy j of group g. An edge's cost depends on the pair of strategies at
its ends; Rhino linearises the product with A ≥ x1 + x2 - 1. We use the tighter transportation
form instead: y[e, a, b] ≥ 0 with Σ_b y = x_src(class a) and Σ_a y = x_dst(class b), whose LP
relaxation is far stronger, so the solver closes the gap quickly. Strategies that present the
same spec at an edge share one class, which keeps the number of y variables small.

Collectives that XLA combines into one op (`search.combining`) share that op's launch and
latency: a family variable f ≥ every x and y whose strategy or edge entry uses the family pays it
once. With x integral, f is integral too, so the relaxation stays as tight as before.

One module of some 450 lines, by design: the problem, its greedy start and local polish, and
the MIP solved from them pass incumbents and bounds to one another over one representation
(edges by class, family users); apart, each half would import the other.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.sparse
from ortools.linear_solver.python import model_builder_helper as helper

from rhino_jax.errors import SolverError

from .. import interrupt
from . import solver_process

SCALE = 1e6  # seconds → microseconds: keeps coefficients in a range MIP solvers like
MIP_GAP = 1e-4  # relative gap at which a choice counts as optimal (HiGHS's and SCIP's default)


@dataclass(frozen=True)
class Edge:
    src: int
    dst: int
    src_class: tuple[int, ...]  # class of each src strategy
    dst_class: tuple[int, ...]
    matrix: np.ndarray  # cost in seconds, [src classes, dst classes]
    uses: np.ndarray | None = None  # [families, src classes, dst classes]: entries that use a family


@dataclass(frozen=True)
class Problem:
    costs: tuple[np.ndarray, ...]  # per group: seconds per strategy (inf: forbidden)
    edges: tuple[Edge, ...]
    fixed: tuple[float, ...] = ()  # per family: seconds paid once if any choice uses it
    uses: tuple[np.ndarray, ...] = ()  # per group: [families, strategies] bool; () for none

    def group_uses(self, g: int) -> np.ndarray:
        return self.uses[g] if self.uses else np.zeros((len(self.fixed), len(self.costs[g])), dtype=bool)

    def edge_uses(self, e: Edge) -> np.ndarray:
        return e.uses if e.uses is not None else np.zeros((len(self.fixed),) + e.matrix.shape, dtype=bool)


@dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]
    objective_s: float
    bound_s: float
    status: str  # "optimal" | "near-optimal" (within one combined launch) | "feasible" (time limit) | "interrupted" (Ctrl-C)
    # | "windowed" (`windows`: each window optimal given the rest, no global bound)
    solve_s: float
    backend: str
    num_vars: int
    num_constraints: int
    relaxation_exact: bool = False  # the LP relaxation's optimum was integral: no branch-and-bound

    @property
    def gap(self) -> float:
        """Relative distance to the bound; NaN without one (`windows`)."""
        if np.isnan(self.bound_s):
            return float("nan")
        if self.objective_s <= 0:
            return 0.0
        return max(0.0, (self.objective_s - self.bound_s) / self.objective_s)


def classes(keys: list) -> tuple[tuple[int, ...], list]:
    """Number equal keys alike: (class of each key, the distinct keys in class order)."""
    index: dict = {}
    return tuple(index.setdefault(k, len(index)) for k in keys), list(index)


def make_edge(src: int, dst: int, src_keys: list, dst_keys: list, cost, uses=None) -> Edge:
    """An edge whose strategies are classed by the spec they present; cost(a, b) in seconds,
    uses(a, b) the families the pair uses (a bool vector), if any."""
    sc, sk = classes(src_keys)
    dc, dk = classes(dst_keys)
    matrix = np.array([[cost(a, b) for b in dk] for a in sk], dtype=float)
    if uses is None:
        return Edge(src, dst, sc, dc, matrix)
    table = np.array([[uses(a, b) for b in dk] for a in sk], dtype=bool)  # [a, b, families]
    return Edge(src, dst, sc, dc, matrix, np.moveaxis(table, -1, 0))


def tie(problem: Problem, class_of: list[int]) -> tuple[Problem, list[int]]:
    """The problem in which groups of one class take the same strategy, and the index of each
    group's class in it. Costs add up; an edge inside a class becomes a cost of the class; edges
    between the same two classes merge into one."""
    index, owner = classes(class_of)
    costs = [np.zeros_like(problem.costs[g], dtype=float) for g in owner]
    uses = [np.zeros_like(problem.group_uses(g)) for g in owner]
    for g, c in enumerate(problem.costs):
        costs[index[g]] = costs[index[g]] + c
        uses[index[g]] |= problem.group_uses(g)
    between: dict[tuple[int, int], list[Edge]] = {}  # edges between two classes, merged below
    for e in problem.edges:
        src, dst = index[e.src], index[e.dst]
        if src == dst:
            eu = problem.edge_uses(e)
            costs[src] = costs[src] + e.matrix[list(e.src_class), list(e.dst_class)]
            uses[src] |= eu[:, list(e.src_class), list(e.dst_class)]
            continue
        between.setdefault((src, dst), []).append(e)
    merged = [_merged(problem, src, dst, es) for (src, dst), es in between.items()]
    return Problem(tuple(costs), tuple(merged), problem.fixed, tuple(uses)), list(index)


def _merged(problem: Problem, src: int, dst: int, edges: list[Edge]) -> Edge:
    """The edges between two classes as one: a strategy's class is the tuple of its classes in
    every edge, numbered by first appearance, and the matrices are added in the edges' order.
    Merging all at once rather than pairwise (one edge per tied layer: tens of merges per pair)
    keeps the classes, and each entry's sum, what the pairwise merges make."""
    first = edges[0]
    if len(edges) == 1:
        return Edge(src, dst, first.src_class, first.dst_class, first.matrix, problem.edge_uses(first))
    src_class, src_keys = classes(list(zip(*(e.src_class for e in edges))))
    dst_class, dst_keys = classes(list(zip(*(e.dst_class for e in edges))))
    a, b = np.array(src_keys).T, np.array(dst_keys).T  # [edge, merged class] → the edge's class
    matrix = first.matrix[np.ix_(a[0], b[0])]
    used = np.zeros((len(problem.fixed), len(src_keys), len(dst_keys)), dtype=bool)
    for k, e in enumerate(edges):
        if k:
            matrix = matrix + e.matrix[np.ix_(a[k], b[k])]
        if e.uses is not None and e.uses.any():  # most edges use no family
            used |= e.uses[:, a[k]][:, :, b[k]]
    return Edge(src, dst, src_class, dst_class, matrix, used)


def evaluate(problem: Problem, choice: tuple[int, ...]) -> float:
    """Objective (seconds) of an assignment."""
    total = sum(float(c[j]) for c, j in zip(problem.costs, choice))
    used = np.zeros(len(problem.fixed), dtype=bool)
    for g, j in enumerate(choice):
        used |= problem.group_uses(g)[:, j]
    for e in problem.edges:
        a, b = e.src_class[choice[e.src]], e.dst_class[choice[e.dst]]
        total += float(e.matrix[a, b])
        used |= problem.edge_uses(e)[:, a, b]
    return total + float(np.dot(problem.fixed, used)) if len(problem.fixed) else total


def polish(problem: Problem, choice: tuple[int, ...], sweeps: int = 50, deadline: float = float("inf")) -> tuple[int, ...]:
    """`choice` improved one group at a time (each takes its cheapest strategy given all the
    others, sweep after sweep, until none changes): rounding a fractional relaxation leaves a
    few groups at odds with their neighbours, and this mends them in a fraction of a second.
    A family's launch is paid once, so no single group can drop a family the others use: each
    family in use is also tried away as a whole (every group sweeps off it), kept when cheaper.
    After the first sweep, none starts past the `deadline` (a `time.perf_counter()` time): on a
    problem of thousands of groups the families' trials take seconds."""
    incoming, outgoing = _edges_by_group(problem)
    best = _sweeps(problem, list(choice), incoming, outgoing, sweeps, deadline=deadline)
    cost = evaluate(problem, best)
    while True:  # each accepted move lowers the cost: it ends
        for f in np.nonzero(_family_users(problem, best))[0]:
            if time.perf_counter() >= deadline:
                return tuple(best)
            trial = _sweeps(problem, list(best), incoming, outgoing, sweeps, without=int(f), deadline=deadline)
            trial = _sweeps(problem, trial, incoming, outgoing, sweeps, deadline=deadline)
            if evaluate(problem, trial) < cost - 1e-15:
                best, cost = trial, evaluate(problem, trial)
                break
        else:
            return tuple(best)


def _sweeps(problem: Problem, choice: list[int], incoming, outgoing, sweeps: int,
            without: int | None = None, deadline: float = float("inf")) -> list[int]:
    """One-group-at-a-time improvement of `choice` (in place), family launches included;
    `without`: strategies that would use that family are off limits while another is left.
    The sweeps after the first stop at the `deadline`."""
    fixed = np.asarray(problem.fixed)
    users = _family_users(problem, choice)
    for sweep in range(sweeps):
        if sweep and time.perf_counter() >= deadline:
            break
        changed = False
        for g, c in enumerate(problem.costs):
            cost = _cost_given(g, c, choice, incoming, outgoing)
            if len(fixed):
                mine = _uses_given(problem, g, choice, incoming, outgoing)  # [families, strategies]
                others = users - mine[:, choice[g]]
                cost = cost + fixed @ ((others[:, None] + mine) > 0)
                if without is not None:
                    banned = mine[without] > 0
                    if not banned.all():
                        cost = np.where(banned, np.inf, cost)
            j = int(np.argmin(cost))
            if cost[j] < cost[choice[g]] - 1e-15:
                if len(fixed):
                    users = others + mine[:, j]
                choice[g], changed = j, True
        if not changed:
            break
    return choice


def _family_users(problem: Problem, choice) -> np.ndarray:
    """How many groups and edges use each family under `choice`."""
    users = np.zeros(len(problem.fixed), dtype=int)
    for g, j in enumerate(choice):
        users += problem.group_uses(g)[:, j]
    for e in problem.edges:
        users += problem.edge_uses(e)[:, e.src_class[choice[e.src]], e.dst_class[choice[e.dst]]]
    return users


def _uses_given(problem: Problem, g: int, choice, incoming, outgoing) -> np.ndarray:
    """[families, strategies]: how many uses of each family group g and its edges bring, per
    strategy of g, with the other groups as `choice` has them."""
    uses = problem.group_uses(g).astype(int)
    for e in incoming.get(g, []):
        uses += problem.edge_uses(e)[:, e.src_class[choice[e.src]], list(e.dst_class)]
    for e in outgoing.get(g, []):
        uses += problem.edge_uses(e)[:, list(e.src_class), e.dst_class[choice[e.dst]]]
    return uses


def _edges_by_group(problem: Problem) -> tuple[dict[int, list[Edge]], dict[int, list[Edge]]]:
    incoming: dict[int, list[Edge]] = {}
    outgoing: dict[int, list[Edge]] = {}
    for e in problem.edges:
        incoming.setdefault(e.dst, []).append(e)
        outgoing.setdefault(e.src, []).append(e)
    return incoming, outgoing


def _cost_given(g: int, costs: np.ndarray, choice, incoming, outgoing) -> np.ndarray:
    """Each strategy's cost for group g, with the edges to the groups `choice` has decided."""
    cost = np.array(costs, dtype=float)
    for e in incoming.get(g, []):
        if choice[e.src] is not None:
            cost = cost + e.matrix[e.src_class[choice[e.src]], list(e.dst_class)]
    for e in outgoing.get(g, []):
        if choice[e.dst] is not None:
            cost = cost + e.matrix[list(e.src_class), e.dst_class[choice[e.dst]]]
    return cost


def greedy(problem: Problem, partial: Sequence[int | None] | None = None) -> tuple[int, ...]:
    """A feasible assignment in one pass (groups in program order, each picking its cheapest
    strategy given the groups already picked): the start of the incumbent (`polish`). The
    groups `partial` decides keep their choice."""
    incoming, outgoing = _edges_by_group(problem)
    choice: list[int | None] = list(partial) if partial is not None else [None] * len(problem.costs)
    for g, c in enumerate(problem.costs):
        if choice[g] is None:
            choice[g] = int(np.argmin(_cost_given(g, c, choice, incoming, outgoing)))
    return tuple(choice)


def forbid(problem: Problem, forbidden: tuple[np.ndarray, ...]) -> Problem:
    """The problem with the strategies marked in `forbidden` (a bool mask per group) priced at inf."""
    return Problem(tuple(np.where(f, np.inf, c) for c, f in zip(problem.costs, forbidden)), problem.edges,
                   problem.fixed, problem.uses)


class Model:
    """The ILP of a problem, built once and solved as often as needed with different strategies
    forbidden: the memory limit's search (Rhino §4.4) re-solves one problem with more and more
    parameters kept off replication. Built as one sparse matrix, which the solver process hands to
    OR-Tools' model builder whole: a window of `windows` is built in milliseconds, where one
    coefficient at a time took most of its solve."""

    def __init__(self, problem: Problem, backend: str = "HIGHS"):
        check_backend(backend)
        self.problem, self.backend = problem, backend
        sizes = [len(c) for c in problem.costs]
        x_at = np.concatenate([[0], np.cumsum(sizes, dtype=int)]).astype(int)  # group g's x: x_at[g] .. x_at[g+1]
        y_at = x_at[-1] + np.concatenate([[0], np.cumsum([e.matrix.size for e in problem.edges], dtype=int)]).astype(int)
        self._x_at = x_at
        rows: list[np.ndarray] = []  # (row, column, coefficient) triples, a block at a time
        cols: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        n_rows = 0

        def block(r, c, v):
            rows.append(np.asarray(r, dtype=np.int64))
            cols.append(np.asarray(c, dtype=np.int64))
            vals.append(np.broadcast_to(np.asarray(v, dtype=float), np.shape(r)))

        group_of_x = np.repeat(np.arange(len(sizes)), sizes)
        block(group_of_x, np.arange(x_at[-1]), 1.0)  # one strategy per group: Σ_j x = 1
        n_rows = len(sizes)
        family_users: list[list[np.ndarray]] = [[] for _ in problem.fixed]  # columns of each user
        for g in range(len(sizes)):
            uses = problem.group_uses(g)
            for f in np.nonzero(uses.any(axis=1))[0]:
                family_users[f].append(x_at[g] + np.nonzero(uses[f])[0])
        for e, edge in enumerate(problem.edges):
            na, nb = edge.matrix.shape
            y = y_at[e] + np.arange(na * nb).reshape(na, nb)
            src_class, dst_class = np.asarray(edge.src_class), np.asarray(edge.dst_class)
            # Σ_b y[a, b] = Σ x_src of class a; Σ_a y[a, b] = Σ x_dst of class b
            block(n_rows + np.repeat(np.arange(na), nb), y.ravel(), 1.0)
            block(n_rows + src_class, x_at[edge.src] + np.arange(len(src_class)), -1.0)
            block(n_rows + na + np.tile(np.arange(nb), na), y.ravel(), 1.0)
            block(n_rows + na + dst_class, x_at[edge.dst] + np.arange(len(dst_class)), -1.0)
            n_rows += na + nb
            uses = problem.edge_uses(edge)
            for f in np.nonzero(uses.any(axis=(1, 2)))[0]:
                family_users[f].append(y[uses[f]])
        used = [f for f, users in enumerate(family_users) if users]
        f_at = {f: y_at[-1] + k for k, f in enumerate(used)}
        first_at_least = n_rows
        for f in used:  # f ≥ each group's (edge's) share of choices that use the family
            for users in family_users[f]:
                block([n_rows], [f_at[f]], 1.0)
                block(np.full(len(users), n_rows), users, -1.0)
                n_rows += 1
        n_vars = int(y_at[-1]) + len(used)
        objective = np.zeros(n_vars)
        finite = np.concatenate(problem.costs) if sizes else np.zeros(0)
        objective[:x_at[-1]] = np.where(np.isfinite(finite), finite, 0.0) * SCALE
        for e, edge in enumerate(problem.edges):
            objective[y_at[e]:y_at[e + 1]] = edge.matrix.ravel() * SCALE
        for f in used:
            objective[f_at[f]] = float(problem.fixed[f]) * SCALE
        matrix = scipy.sparse.csr_matrix((np.concatenate(vals) if vals else np.zeros(0),
                                          (np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64),
                                           np.concatenate(cols) if cols else np.zeros(0, dtype=np.int64))),
                                         shape=(n_rows, n_vars))
        lower = np.zeros(n_rows)
        lower[:len(sizes)] = 1.0
        upper = np.where(np.arange(n_rows) < first_at_least, lower, np.inf)
        self._program = solver_process.Program(objective, matrix, lower, upper, np.zeros(n_vars), np.ones(n_vars))

    def solve(self, time_limit_s: float = 60.0, forbidden: tuple[np.ndarray, ...] | None = None,
              incumbent: tuple[int, ...] | None = None) -> Solution:
        """The best choice with the strategies of infinite cost, and those marked in `forbidden`
        (a bool mask per group), left out. The LP relaxation is solved first: when its x are
        integral it is the ILP's optimum (no integral point can beat the relaxation), and with the
        transportation form it usually is. Otherwise its rounding, `polish`ed, is the incumbent
        and its objective the bound, and branch-and-bound runs in the time left, unless that
        incumbent is already within the solvers' usual gap (`MIP_GAP`) or one family launch of
        the bound ("near-optimal"), or less time is left than the LP took (branch-and-bound
        starts by solving it again). `incumbent`: a known choice
        (O3 starts from O2's), returned unless a better one is found. Ctrl-C (KeyboardInterrupt)
        anywhere in it stops the solver and returns the best choice found so far ("interrupted";
        a greedy pass when there is none yet)."""
        start = time.perf_counter()
        if not self.problem.costs:  # nothing to decide (a step of constants alone)
            return Solution((), 0.0, 0.0, "optimal", 0.0, self.backend, 0, 0, relaxation_exact=True)
        problem = self.problem if forbidden is None else forbid(self.problem, forbidden)
        for g, c in enumerate(problem.costs):
            if np.isinf(c).all():
                raise SolverError(f"group {g} has no allowed strategy")
        upper = np.ones(len(self._program.var_upper))
        upper[:self._x_at[-1]] = np.isfinite(np.concatenate(problem.costs))
        self._program.var_upper = upper
        size = (self.backend, len(upper), self._program.matrix.shape[0])
        best = _Best(problem, sum(float(np.min(c)) for c in problem.costs))  # edges cost ≥ 0
        try:
            return self._solve(problem, time_limit_s, incumbent, best, start, size)
        except KeyboardInterrupt:
            interrupt.press()
            best.offer(incumbent)
            choice = best.choice if best.choice is not None else greedy(problem)
            obj = evaluate(problem, choice)
            return Solution(choice, obj, min(best.bound, obj), "interrupted", time.perf_counter() - start, *size)

    def _solve(self, problem: Problem, time_limit_s: float, incumbent: tuple[int, ...] | None, best: "_Best",
               start: float, size: tuple) -> Solution:
        lp = self._run(time_limit_s, integer=False)
        if lp.status == "INFEASIBLE":
            raise SolverError("the strategy ILP is infeasible (the pins and limits leave no plan)")
        solved = lp.status == "OPTIMAL"
        if solved:
            values = self._choices(lp.values)
            rounded = tuple(int(np.argmax(fs)) for fs in values)
            best.offer(rounded)
            if all(np.all(np.abs(fs - np.round(fs)) < 1e-6) for fs in values):
                best.offer(incumbent)  # within the LP's tolerance
                return Solution(best.choice, best.objective, best.objective, "optimal", time.perf_counter() - start,
                                *size, relaxation_exact=True)
            best.bound = max(best.bound, lp.objective / SCALE)
        # The incumbent: the relaxation's rounding, or without one (time limit) a greedy pass.
        best.offer(polish(problem, rounded if solved else incumbent or greedy(problem), deadline=start + time_limit_s))
        best.offer(incumbent)
        if solved:
            spent = time.perf_counter() - start
            if best.objective - best.bound <= MIP_GAP * best.objective:
                return best.solution("optimal", start, size)
            if self._near(problem, best.objective, best.bound):
                # Within one combined launch of the bound: the family variables' relaxation is
                # weak by about that much, and the plan's launch count is only as exact as the
                # combiner's replay. Branch-and-bound given 3 relaxations' time here found nothing
                # better on the model zoo's tiny presets and took 38 s of BERT tiny's 51 on (2, 4).
                return best.solution("near-optimal", start, size)
            budget = time_limit_s - spent
            if budget > spent:  # branch-and-bound first solves this LP again
                mip = self._run(budget, integer=True, hint=best.choice)
                if mip.status in ("OPTIMAL", "FEASIBLE"):  # the better incumbent
                    best.bound = max(best.bound, mip.bound / SCALE)
                    best.offer(tuple(int(np.argmax(fs)) for fs in self._choices(mip.values)))
                    if mip.status == "OPTIMAL":
                        return best.solution("optimal", start, size)
            if self._near(problem, best.objective, best.bound):
                return best.solution("near-optimal", start, size)
        return best.solution("feasible", start, size)

    def _choices(self, values: np.ndarray) -> list[np.ndarray]:
        """Each group's x in a solution's variable values."""
        return [values[self._x_at[g]:self._x_at[g + 1]] for g in range(len(self.problem.costs))]

    @staticmethod
    def _near(problem: Problem, obj: float, bound: float) -> bool:
        return obj - bound <= max(problem.fixed, default=0.0)

    def _run(self, time_limit_s: float, integer: bool, hint: tuple[int, ...] | None = None) -> solver_process.Result:
        """One solve of the model: the LP relaxation, or the ILP (x integral) from `hint`."""
        program = dataclasses.replace(self._program, integer=np.arange(self._x_at[-1]) if integer else
                                      np.zeros(0, dtype=np.int64))
        if hint is not None and self.backend != "HIGHS":  # OR-Tools' HiGHS wrapper crashes on hints (ortools 9.15)
            program.hint = (self._x_at[:-1] + np.asarray(hint), np.ones(len(hint)))
        return run(program, self.backend, time_limit_s)


@dataclass
class _Best:
    """The best choice a solve has found so far and its bound: what it returns, also at Ctrl-C."""

    problem: Problem
    bound: float
    choice: tuple[int, ...] | None = None
    objective: float = float("inf")

    def offer(self, choice: tuple[int, ...] | None) -> None:
        """Keep `choice` if it is cheaper than the best so far."""
        if choice is not None and (obj := evaluate(self.problem, choice)) < self.objective:
            self.choice, self.objective = choice, obj

    def solution(self, status: str, start: float, size: tuple) -> Solution:
        return Solution(self.choice, self.objective, min(self.bound, self.objective), status,
                        time.perf_counter() - start, *size)


def check_backend(backend: str) -> None:
    if not helper.ModelSolverHelper(backend).solver_is_supported():
        raise SolverError(f"OR-Tools has no MIP backend {backend!r}; use 'HIGHS', 'SCIP' or 'CP-SAT'")


def run(program: solver_process.Program, backend: str, time_limit_s: float) -> solver_process.Result:
    """Solve `program` once, in the helper process (`solver_process`: Ctrl-C stops it). Raises
    KeyboardInterrupt at once when the session was interrupted (`interrupt`)."""
    interrupt.check()
    parameters = ""
    if backend == "HIGHS":
        # HiGHS's presolve made the LP end at another of its optimal vertices from run to run
        # under load (one model, same objective, another plan); without it the simplex takes
        # one path, so a plan does not depend on the machine's load (and LPs of ours with a
        # million variables solve faster without it). Its banner is off too.
        parameters = "output_flag=false" + ("" if len(program.integer) else "\npresolve=off")
    return solver_process.solve(program, backend, time_limit_s, parameters)


def solve(problem: Problem, backend: str = "HIGHS", time_limit_s: float = 60.0) -> Solution:
    """Build the model of `problem` and solve it once."""
    return Model(problem, backend).solve(time_limit_s)
