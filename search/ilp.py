"""The strategy ILP (Rhino §4.2), solved with OR-Tools.

One-hot x[g, j] picks strategy j of group g. An edge's cost depends on the pair of strategies at
its ends; Rhino linearises the product with A ≥ x1 + x2 - 1. We use the tighter transportation
form instead: y[e, a, b] ≥ 0 with Σ_b y = x_src(class a) and Σ_a y = x_dst(class b), whose LP
relaxation is far stronger, so the solver closes the gap quickly. Strategies that present the
same spec at an edge share one class, which keeps the number of y variables small.

Collectives that XLA combines into one op (`search.combining`) share that op's launch and
latency: a family variable f ≥ every x and y whose strategy or edge entry uses the family pays it
once. With x integral, f is integral too, so the relaxation stays as tight as before.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp

from rhino_jax.errors import SolverError

SCALE = 1e6  # seconds → microseconds: keeps coefficients in a range MIP solvers like
MIP_GAP = 1e-4  # relative gap at which a choice counts as optimal (HiGHS's and SCIP's default)
NEAR_BUDGET = 3.0  # branch-and-bound's time, in LP solves, when the gap is within one family launch


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
    status: str  # "optimal" | "near-optimal" (within one combined launch) | "feasible" (time limit) | "interrupted"
    solve_s: float
    backend: str
    num_vars: int
    num_constraints: int
    relaxation_exact: bool = False  # the LP relaxation's optimum was integral: no branch-and-bound

    @property
    def gap(self) -> float:
        if self.objective_s <= 0:
            return 0.0
        return max(0.0, (self.objective_s - self.bound_s) / self.objective_s)


def _classes(keys: list) -> tuple[tuple[int, ...], list]:
    """Number equal keys alike: (class of each key, the distinct keys in class order)."""
    index: dict = {}
    return tuple(index.setdefault(k, len(index)) for k in keys), list(index)


def make_edge(src: int, dst: int, src_keys: list, dst_keys: list, cost, uses=None) -> Edge:
    """An edge whose strategies are classed by the spec they present; cost(a, b) in seconds,
    uses(a, b) the families the pair uses (a bool vector), if any."""
    sc, sk = _classes(src_keys)
    dc, dk = _classes(dst_keys)
    matrix = np.array([[cost(a, b) for b in dk] for a in sk], dtype=float)
    if uses is None:
        return Edge(src, dst, sc, dc, matrix)
    table = np.array([[uses(a, b) for b in dk] for a in sk], dtype=bool)  # [a, b, families]
    return Edge(src, dst, sc, dc, matrix, np.moveaxis(table, -1, 0))


def tie(problem: Problem, class_of: list[int]) -> tuple[Problem, list[int]]:
    """The problem in which groups of one class take the same strategy, and the index of each
    group's class in it. Costs add up; an edge inside a class becomes a cost of the class; edges
    between the same two classes merge into one."""
    index, owner = _classes(class_of)
    costs = [np.zeros_like(problem.costs[g], dtype=float) for g in owner]
    uses = [np.zeros_like(problem.group_uses(g)) for g in owner]
    for g, c in enumerate(problem.costs):
        costs[index[g]] = costs[index[g]] + c
        uses[index[g]] |= problem.group_uses(g)
    merged: dict[tuple[int, int], Edge] = {}
    for e in problem.edges:
        src, dst = index[e.src], index[e.dst]
        eu = problem.edge_uses(e)
        if src == dst:
            costs[src] = costs[src] + e.matrix[list(e.src_class), list(e.dst_class)]
            uses[src] |= eu[:, list(e.src_class), list(e.dst_class)]
            continue
        old = merged.get((src, dst))
        if old is None:
            merged[src, dst] = Edge(src, dst, e.src_class, e.dst_class, e.matrix, eu)
            continue
        merged[src, dst] = make_edge(
            src, dst, list(zip(old.src_class, e.src_class)), list(zip(old.dst_class, e.dst_class)),
            lambda a, b: old.matrix[a[0], b[0]] + e.matrix[a[1], b[1]],  # noqa: B023
            lambda a, b: old.uses[:, a[0], b[0]] | eu[:, a[1], b[1]])  # noqa: B023
    return Problem(tuple(costs), tuple(merged.values()), problem.fixed, tuple(uses)), list(index)


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


def polish(problem: Problem, choice: tuple[int, ...], sweeps: int = 50) -> tuple[int, ...]:
    """`choice` improved one group at a time (each takes its cheapest strategy given all the
    others, sweep after sweep, until none changes): rounding a fractional relaxation leaves a
    few groups at odds with their neighbours, and this mends them in a fraction of a second.
    A family's launch is paid once, so no single group can drop a family the others use: each
    family in use is also tried away as a whole (every group sweeps off it), kept when cheaper."""
    incoming, outgoing = _edges_by_group(problem)
    best = _sweeps(problem, list(choice), incoming, outgoing, sweeps)
    cost = evaluate(problem, best)
    while True:  # each accepted move lowers the cost: it ends
        for f in np.nonzero(_family_users(problem, best))[0]:
            trial = _sweeps(problem, list(best), incoming, outgoing, sweeps, without=int(f))
            trial = _sweeps(problem, trial, incoming, outgoing, sweeps)
            if evaluate(problem, trial) < cost - 1e-15:
                best, cost = trial, evaluate(problem, trial)
                break
        else:
            return tuple(best)


def _sweeps(problem: Problem, choice: list[int], incoming, outgoing, sweeps: int,
            without: int | None = None) -> list[int]:
    """One-group-at-a-time improvement of `choice` (in place), family launches included;
    `without`: strategies that would use that family are off limits while another is left."""
    fixed = np.asarray(problem.fixed)
    users = _family_users(problem, choice)
    for _ in range(sweeps):
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


def greedy(problem: Problem) -> tuple[int, ...]:
    """A feasible assignment in one pass (groups in program order, each picking its cheapest
    strategy given the groups already picked): the start of the incumbent (`polish`)."""
    incoming, outgoing = _edges_by_group(problem)
    choice: list[int | None] = [None] * len(problem.costs)
    for g, c in enumerate(problem.costs):
        choice[g] = int(np.argmin(_cost_given(g, c, choice, incoming, outgoing)))
    return tuple(choice)


def forbid(problem: Problem, forbidden: tuple[np.ndarray, ...]) -> Problem:
    """The problem with the strategies marked in `forbidden` (a bool mask per group) priced at inf."""
    return Problem(tuple(np.where(f, np.inf, c) for c, f in zip(problem.costs, forbidden)), problem.edges,
                   problem.fixed, problem.uses)


class Model:
    """The ILP of a problem, built once and solved as often as needed with different strategies
    forbidden: the memory limit's search (Rhino §4.4) re-solves one problem with more and more
    parameters kept off replication."""

    def __init__(self, problem: Problem, backend: str = "HIGHS"):
        solver = pywraplp.Solver.CreateSolver(backend)
        if solver is None:
            raise SolverError(f"OR-Tools has no MIP backend {backend!r}; use 'HIGHS', 'SCIP', 'CBC' or 'CP-SAT'")
        solver.SuppressOutput()
        if backend == "HIGHS":  # its banner on stdout at every solve, which SuppressOutput leaves
            solver.SetSolverSpecificParametersAsString("output_flag=false")
        self.problem, self.backend, self._solver = problem, backend, solver
        self._x = [[solver.BoolVar(f"x{g}_{j}") for j in range(len(c))] for g, c in enumerate(problem.costs)]
        objective = solver.Objective()
        family_users: list[list[list]] = [[] for _ in problem.fixed]
        for g, c in enumerate(problem.costs):
            _equal(solver, self._x[g], [], 1.0)
            for f, mask in enumerate(problem.group_uses(g)):
                if mask.any():
                    family_users[f].append([self._x[g][j] for j in np.nonzero(mask)[0]])
            for j, cost in enumerate(c):
                if np.isfinite(cost) and cost:
                    objective.SetCoefficient(self._x[g][j], float(cost) * SCALE)
        for e, edge in enumerate(problem.edges):
            na, nb = edge.matrix.shape
            y = [[solver.NumVar(0.0, 1.0, f"y{e}_{a}_{b}") for b in range(nb)] for a in range(na)]
            for a in range(na):
                _equal(solver, y[a], [self._x[edge.src][j] for j, cl in enumerate(edge.src_class) if cl == a])
            for b in range(nb):
                _equal(solver, [y[a][b] for a in range(na)],
                       [self._x[edge.dst][j] for j, cl in enumerate(edge.dst_class) if cl == b])
            for a, b in zip(*np.nonzero(edge.matrix)):
                objective.SetCoefficient(y[a][b], float(edge.matrix[a, b]) * SCALE)
            for f, mask in enumerate(problem.edge_uses(edge)):
                if mask.any():
                    family_users[f].append([y[a][b] for a, b in zip(*np.nonzero(mask))])
        for f, users in enumerate(family_users):
            if users:  # f ≥ each group's (edge's) share of choices that use the family
                used = solver.NumVar(0.0, 1.0, f"f{f}")
                objective.SetCoefficient(used, float(problem.fixed[f]) * SCALE)
                for vs in users:
                    _at_least(solver, used, vs)
        objective.SetMinimization()
        self._objective = objective

    def solve(self, time_limit_s: float = 60.0, forbidden: tuple[np.ndarray, ...] | None = None) -> Solution:
        """The best choice with the strategies of infinite cost, and those marked in `forbidden`
        (a bool mask per group), left out. The LP relaxation is solved first: when its x are
        integral it is the ILP's optimum (no integral point can beat the relaxation), and with the
        transportation form it usually is. Otherwise its rounding, `polish`ed, is the incumbent
        and its objective the bound, and branch-and-bound runs in the time left, unless that
        incumbent is already within the solvers' usual gap (`MIP_GAP`) or less time is left than
        the LP took (branch-and-bound starts by solving it again)."""
        start = time.perf_counter()
        problem = self.problem if forbidden is None else forbid(self.problem, forbidden)
        solver, x = self._solver, self._x
        for g, c in enumerate(problem.costs):
            if np.isinf(c).all():
                raise SolverError(f"group {g} has no allowed strategy")
            for j, cost in enumerate(c):
                x[g][j].SetUb(0.0 if np.isinf(cost) else 1.0)
        size = (self.backend, solver.NumVariables(), solver.NumConstraints())
        bound = sum(float(np.min(c)) for c in problem.costs)  # edges cost ≥ 0
        status, interrupted = self._run(time_limit_s, integer=False)
        if status == pywraplp.Solver.INFEASIBLE:
            raise SolverError("the strategy ILP is infeasible (the pins and limits leave no plan)")
        solved = status == pywraplp.Solver.OPTIMAL and not interrupted
        if solved:
            values = [[v.solution_value() for v in xs] for xs in x]
            rounded = tuple(int(np.argmax(fs)) for fs in values)
            if all(abs(f - round(f)) < 1e-6 for fs in values for f in fs):
                exact = evaluate(problem, rounded)
                return Solution(rounded, exact, exact, "optimal", time.perf_counter() - start, *size,
                                relaxation_exact=True)
            bound = max(bound, self._objective.Value() / SCALE)
        # The incumbent: the relaxation's rounding, or without one (Ctrl-C, time limit) a greedy pass.
        choice = polish(problem, rounded if solved else greedy(problem))
        obj = evaluate(problem, choice)
        if solved:
            spent = time.perf_counter() - start
            if obj - bound <= MIP_GAP * obj:
                return Solution(choice, obj, min(bound, obj), "optimal", spent, *size)
            budget = time_limit_s - spent
            if self._near(problem, obj, bound):
                # Within one combined launch of the bound: the family variables' relaxation is
                # weak by about that much, and the plan's launch count is only as exact as the
                # combiner's replay; branch-and-bound gets NEAR_BUDGET times the relaxation's time.
                budget = min(budget, NEAR_BUDGET * spent)
            if budget > spent:  # branch-and-bound first solves this LP again
                if self.backend != "HIGHS":  # OR-Tools' HiGHS wrapper crashes on hints (seen with ortools 9.15)
                    solver.SetHint([x[g][j] for g, j in enumerate(choice)], [1.0] * len(choice))
                status, interrupted = self._run(budget, integer=True)
                if status in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):  # the better incumbent
                    bound = max(bound, self._objective.BestBound() / SCALE)
                    found = tuple(int(np.argmax([v.solution_value() for v in xs])) for xs in x)
                    if evaluate(problem, found) < obj:
                        choice, obj = found, evaluate(problem, found)
                    if status == pywraplp.Solver.OPTIMAL and not interrupted:
                        return Solution(choice, obj, min(bound, obj), "optimal", time.perf_counter() - start, *size)
            if not interrupted and self._near(problem, obj, bound):
                return Solution(choice, obj, min(bound, obj), "near-optimal", time.perf_counter() - start, *size)
        return Solution(choice, obj, min(bound, obj), "interrupted" if interrupted else "feasible",
                        time.perf_counter() - start, *size)

    @staticmethod
    def _near(problem: Problem, obj: float, bound: float) -> bool:
        return obj - bound <= max(problem.fixed, default=0.0)

    def _run(self, time_limit_s: float, integer: bool) -> tuple[int | None, bool]:
        for xs in self._x:
            for v in xs:
                v.SetInteger(integer)
        if self.backend == "HIGHS" and not integer:
            # HiGHS's presolve made the LP end at another of its optimal vertices from run to run
            # under load (one model, same objective, another plan); without it the simplex takes
            # one path, so a plan does not depend on the machine's load (and LPs of ours with a
            # million variables solve faster without it).
            self._solver.SetSolverSpecificParametersAsString("output_flag=false\npresolve=off")
        elif self.backend == "HIGHS":
            self._solver.SetSolverSpecificParametersAsString("output_flag=false")
        self._solver.SetTimeLimit(max(1, int(time_limit_s * 1000)))
        return _solve_interruptibly(self._solver)


def _equal(solver: pywraplp.Solver, plus: list, minus: list, rhs: float = 0.0) -> None:
    """The constraint Σ plus − Σ minus = rhs, set coefficient by coefficient (OR-Tools' operator
    API builds Python expression trees: a build four times slower)."""
    ct = solver.Constraint(rhs, rhs)
    for v in plus:
        ct.SetCoefficient(v, 1.0)
    for v in minus:
        ct.SetCoefficient(v, -1.0)


def _at_least(solver: pywraplp.Solver, var, terms: list) -> None:
    """The constraint var ≥ Σ terms."""
    ct = solver.Constraint(0.0, solver.infinity())
    ct.SetCoefficient(var, 1.0)
    for v in terms:
        ct.SetCoefficient(v, -1.0)


def solve(problem: Problem, backend: str = "HIGHS", time_limit_s: float = 60.0) -> Solution:
    """Build the model of `problem` and solve it once."""
    return Model(problem, backend).solve(time_limit_s)


def _solve_interruptibly(solver: pywraplp.Solver) -> tuple[int | None, bool]:
    """Solve in a thread (OR-Tools releases the GIL) so Ctrl-C reaches Python: then stop the
    solver and keep its incumbent where the backend can stop (SCIP), or leave it to finish at
    its time limit in the background and go on without it (HiGHS cannot be interrupted).
    Returns (status or None when abandoned, whether interrupted)."""
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(solver.Solve()), daemon=True,
                              name="rhino_jax-ilp")
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.05)
    except KeyboardInterrupt:
        if solver.InterruptSolve():
            worker.join()
            return result[0], True
        return None, True
    return result[0], False
