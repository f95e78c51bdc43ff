"""The strategy ILP: the LP relaxation answers when it is integral, branch-and-bound when not, and
one model re-solves with strategies forbidden (the memory limit's search)."""
import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from rhino_jax.core.diagnostics import SearchDiagnostics
from rhino_jax.errors import SolverError, SolverTimeLimitWarning
from rhino_jax.search.solvers import ilp
from rhino_jax.search.memory_limit import fit_memory
from rhino_jax.core.specs import ShardingSpec


def _brute_force(problem: ilp.Problem) -> float:
    return min(ilp.evaluate(problem, c) for c in itertools.product(*(range(len(c)) for c in problem.costs)))


def _chain(seed: int, groups: int = 6, k: int = 3) -> ilp.Problem:
    rng = np.random.default_rng(seed)
    costs = tuple(rng.uniform(0, 1, k) for _ in range(groups))
    edges = tuple(ilp.Edge(g, g + 1, tuple(range(k)), tuple(range(k)), rng.uniform(0, 1, (k, k)))
                  for g in range(groups - 1))
    return ilp.Problem(costs, edges)


def test_a_tree_is_solved_by_its_lp_relaxation():
    # On a tree the transportation form's relaxation is integral: no branch-and-bound.
    for seed in range(3):
        problem = _chain(seed)
        solution = ilp.solve(problem)
        assert solution.status == "optimal" and solution.relaxation_exact
        assert solution.objective_s == pytest.approx(_brute_force(problem))
        assert solution.objective_s == pytest.approx(ilp.evaluate(problem, solution.choice))


def test_a_fractional_relaxation_falls_back_to_branch_and_bound():
    # Three groups in a triangle, each edge charging 1 when both ends agree: the relaxation puts
    # half on each strategy and pays nothing; every integral choice pays at least 1.
    agree = np.eye(2)
    problem = ilp.Problem(tuple(np.zeros(2) for _ in range(3)),
                          tuple(ilp.Edge(s, d, (0, 1), (0, 1), agree) for s, d in [(0, 1), (1, 2), (0, 2)]))
    solution = ilp.solve(problem)
    assert solution.status == "optimal" and not solution.relaxation_exact
    assert solution.objective_s == pytest.approx(1.0) == pytest.approx(_brute_force(problem))


def test_one_model_re_solves_with_strategies_forbidden():
    problem = _chain(7)
    model = ilp.Model(problem)
    first = model.solve()
    forbidden = tuple(np.arange(len(c)) == first.choice[g] for g, c in enumerate(problem.costs))
    again = model.solve(forbidden=forbidden)
    assert all(again.choice[g] != first.choice[g] for g in range(len(problem.costs)))
    assert again.objective_s == pytest.approx(_brute_force(ilp.forbid(problem, forbidden)))
    assert model.solve().objective_s == pytest.approx(first.objective_s)  # the bounds are reset
    with pytest.raises(SolverError, match="group 2 has no allowed strategy"):
        model.solve(forbidden=tuple(np.full(len(c), g == 2) for g, c in enumerate(problem.costs)))


def _shrinking_plans(n: int = 64):
    """A stand-in for the search's `plan_with` over n candidates: the plan that keeps k of them
    off replication needs 1000 - k bytes and takes k seconds. Returns it and the k's it solved."""
    sharded, replicated = ShardingSpec((("x",),)), ShardingSpec.replicated(1)
    solved = []

    def plan_with(forced):
        solved.append(len(forced))
        return SimpleNamespace(cost=SimpleNamespace(memory_bytes=1000 - len(forced), total_s=len(forced)),
                               mesh_axes={"x": 8}, search_stats=SearchDiagnostics(status="optimal"),
                               arg_specs=[sharded if i < len(forced) else replicated for i in range(n)])
    return plan_with, solved


@pytest.mark.parametrize("smallest", [1, 3, 37, 64])
def test_memory_search_finds_the_smallest_k_in_few_solves(smallest):
    """`fit_memory` on plans whose memory falls as more candidates are kept off replication: it
    returns the plan of the smallest k that fits, after about 2 log2(k) solves."""
    n = 64
    plan_with, solved = _shrinking_plans(n)
    unlimited = plan_with([])
    best = fit_memory(plan_with, list(range(n)), list(range(n)), unlimited, 1000 - smallest, graph=None, least=0)
    assert best.cost.memory_bytes == 1000 - smallest
    assert len(solved) - 1 <= 2 * np.log2(smallest) + 2, solved


@pytest.mark.parametrize("smallest, solves", [(None, [0, 512]), (5, [0, 512, 1, 3, 7, 5, 4]), (300, None)])
def test_a_large_model_tries_every_candidate_first(smallest, solves):
    """Past `PROBE_ALL` candidates, k = all is solved first: when it does not fit, no k does and
    the gallop over k is skipped for pricing memory; when it fits, the gallop stops below it."""
    n = 512
    plan_with, solved = _shrinking_plans(n)
    limit = 1000 - (smallest or n + 100)

    def with_weight(forced, weight_s=0.0):  # with memory priced: 100 bytes, slower
        plan = plan_with(forced)
        cost = SimpleNamespace(memory_bytes=100 if weight_s else plan.cost.memory_bytes,
                               total_s=1 + len(forced) + (1000 if weight_s else 0))
        return SimpleNamespace(**dict(vars(plan), cost=cost))
    best = fit_memory(with_weight, list(range(n)), list(range(n)), with_weight([]), limit, graph=None, least=0)
    if smallest is None:
        assert solved[:2] == solves and not any(solved[2:]), solved  # then priced, nothing forced
        assert best.cost.memory_bytes == 100
        return
    assert best.cost.memory_bytes == limit
    if solves:
        assert solved == solves
    else:
        assert len(solved) - 2 <= 2 * np.log2(smallest) + 2, solved


def test_memory_search_past_its_deadline_keeps_the_best_plan_that_fits():
    """No trial of `fit_memory` starts after the search's deadline: the best plan that fits so
    far is kept, with a warning that a faster one may exist; with none that fits, SolverError."""
    n = 64
    plan_with, solved = _shrinking_plans(n)

    def deadline(solves: int):  # passes once `solves` plans are solved
        return SimpleNamespace(seconds=7.0, left=lambda: 1.0 if len(solved) < solves else 0.0)

    unlimited = plan_with([])
    with pytest.warns(SolverTimeLimitWarning, match="stopped at its 7 s time limit after 4 plans"):
        best = fit_memory(plan_with, list(range(n)), list(range(n)), unlimited, 1000 - 5, None, 0, deadline(4))
    assert solved == [0, 1, 3, 7] and best.cost.memory_bytes == 1000 - 7  # the gallop's plan; no bisection
    solved.clear()
    unlimited = plan_with([])
    with pytest.raises(SolverError, match="reached its solver_time_limit_s=7 before .* smallest of the 3 plans"):
        fit_memory(plan_with, list(range(n)), list(range(n)), unlimited, 1000 - 37, None, 0, deadline(3))


def test_memory_priced_in_the_objective_is_searched_down_to_the_lowest_price_that_fits():
    """When no k fits (memory does not fall as arguments are kept off replication), memory is
    priced at w seconds per byte. A price that fits at once is lowered until one does not, then
    bisected: the plan returned is the fast one just within the limit, not the first that fit."""
    replicated = ShardingSpec.replicated(1)
    base = 1.0 / 2000  # the unlimited plan's seconds per byte: 1 s, 2000 bytes

    def plan_with(forced, weight_s=0.0):
        memory = 2000 / (1 + 64 * weight_s / base)  # 31 bytes at w = base, 400 at base / 16
        return SimpleNamespace(cost=SimpleNamespace(memory_bytes=memory, total_s=1 + weight_s / base),
                               mesh_axes={"x": 8}, search_stats=SearchDiagnostics(status="optimal"),
                               arg_specs=[replicated] * 4)
    best = fit_memory(plan_with, list(range(4)), list(range(4)), plan_with([]), 500, graph=None, least=0)
    assert best.cost.memory_bytes <= 500 and best.cost.total_s == pytest.approx(1 + 1 / 16)


def test_polish_past_its_deadline_sweeps_once():
    """Polishing thousands of groups takes seconds: past the deadline it stops after one sweep."""
    problem = _chain(3, groups=12, k=4)
    start = tuple(0 for _ in problem.costs)
    once = ilp.polish(problem, start, deadline=0.0)
    assert once == tuple(ilp._sweeps(problem, list(start), *ilp._edges_by_group(problem), sweeps=1))
    assert ilp.evaluate(problem, ilp.polish(problem, start)) < ilp.evaluate(problem, once)


def test_polish_leaves_no_group_that_could_do_better_alone():
    """The incumbent when the relaxation is fractional: rounded, then mended group by group."""
    problem = _chain(3, groups=12, k=4)
    start = tuple(0 for _ in problem.costs)
    polished = ilp.polish(problem, start)
    assert ilp.evaluate(problem, polished) < ilp.evaluate(problem, start)
    for g, c in enumerate(problem.costs):
        for j in range(len(c)):
            moved = polished[:g] + (j,) + polished[g + 1:]
            assert ilp.evaluate(problem, moved) >= ilp.evaluate(problem, polished) - 1e-12
