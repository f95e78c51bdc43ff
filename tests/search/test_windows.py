"""O2 on graphs too large for one ILP: windows solved with the rest fixed, long edges and combined
launches priced exactly; a model whose layers differ only in width is planned as O3 plans it."""
import dataclasses
import itertools
from types import SimpleNamespace

import jax
import numpy as np
import pytest

import rhino_jax as rj
from rhino_jax.models import gpt
from rhino_jax.search.solvers import ilp, levels, windows

from helpers import assert_same_numbers, on_host


def _random_problem(seed: int, groups: int = 12, k: int = 3, families: int = 3) -> ilp.Problem:
    """A chain with long edges (g → g + 5, like an activation saved for the backward pass) and
    combined families used by strategies and by edge entries."""
    rng = np.random.default_rng(seed)
    costs = tuple(rng.uniform(0, 1, k) for _ in range(groups))
    uses = tuple(rng.uniform(size=(families, k)) < 0.3 for _ in range(groups))
    pairs = [(g, g + 1) for g in range(groups - 1)] + [(g, g + 5) for g in range(groups - 5)]
    edges = tuple(ilp.Edge(s, d, tuple(range(k)), tuple(range(k)), rng.uniform(0, 1, (k, k)),
                           rng.uniform(size=(families, k, k)) < 0.2) for s, d in pairs)
    return ilp.Problem(costs, edges, tuple(rng.uniform(0.5, 2.0, families)), uses)


@pytest.mark.parametrize("seed", range(4))
def test_a_window_prices_exactly_what_the_whole_problem_prices(seed):
    problem = _random_problem(seed)
    rng = np.random.default_rng(100 + seed)
    incidence = windows.Incidence(problem)
    for _ in range(20):
        choice = [int(j) for j in rng.integers(0, 3, len(problem.costs))]
        members = sorted(rng.choice(len(problem.costs), size=4, replace=False).tolist())
        outside = windows.family_users(problem, choice) - windows.share(problem, members, choice, incidence)
        sub = windows.restrict(problem, members, choice, incidence, outside)
        old = tuple(choice[g] for g in members)
        for new in itertools.product(range(3), repeat=4):
            moved = list(choice)
            for g, j in zip(members, new):
                moved[g] = j
            # Same difference in the window as in the whole: the window's optimum is the whole's
            # best move inside it, long edges and family launches included.
            assert ilp.evaluate(sub, new) - ilp.evaluate(sub, old) == pytest.approx(
                ilp.evaluate(problem, tuple(moved)) - ilp.evaluate(problem, tuple(choice)), abs=1e-9)


def test_windows_cover_every_group_and_respect_the_budget():
    problem = _random_problem(0, groups=40)
    found = windows.windows(problem, list(range(40)), budget=60)
    assert set(itertools.chain(*found)) == set(range(40))
    for w in found:
        inside = set(w)
        size = sum(len(problem.costs[g]) for g in w) + sum(
            e.matrix.size for e in problem.edges if e.src in inside and e.dst in inside)
        assert size <= 60


@pytest.mark.parametrize("seed", range(3))
def test_windowed_solve_never_loses_to_its_start_and_one_window_is_the_optimum(seed):
    problem = _random_problem(seed, groups=30)
    start = ilp.greedy(problem)
    small = windows.Windowed(problem, list(range(30)), budget=80)
    assert len(small.windows) > 1
    solution = small.solve(incumbent=start)
    assert solution.status == "windowed" and np.isnan(solution.gap)
    assert solution.objective_s == pytest.approx(ilp.evaluate(problem, solution.choice))
    assert solution.objective_s <= ilp.evaluate(problem, start) + 1e-12
    whole = ilp.solve(problem)
    assert solution.objective_s >= whole.objective_s - 1e-9
    one = windows.Windowed(problem, list(range(30)))  # the default budget holds all of it
    assert len(one.windows) == 1
    assert one.solve().objective_s == pytest.approx(whole.objective_s)


def test_o2_too_large_for_one_ilp_runs_windows_then_the_whole_ilp_in_the_time_left(monkeypatch):
    """When neither the exact tying nor layers alike make a small ILP, windows give a plan in
    seconds and the whole ILP improves it in the time left; a time limit that passes once the
    windows are done leaves their plan, not a greedy one."""
    problem = _random_problem(0, groups=30)
    tied = levels.tying(problem, list(range(30)), list(range(30)))
    monkeypatch.setattr(windows, "WHOLE_VARS", 100)
    monkeypatch.setattr(windows, "WINDOW_VARS", 80)
    allowed = [np.zeros(len(c), dtype=bool) for c in problem.costs]
    solvers = levels.Levels(lambda: tied, tied, lambda: tied, 0, False, "HIGHS")
    assert [whole for _, whole in solvers.stages] == [False, True]
    _, solution, stages, _ = solvers.solve(levels.Deadline.after(60.0), allowed)
    first, last = stages
    by_windows, best = first.objective_s, last.objective_s
    assert (first.status, last.status) == ("windowed", "optimal") and best <= by_windows + 1e-12
    assert solution.objective_s == pytest.approx(ilp.solve(problem).objective_s)

    windowed = []
    solve = windows.Windowed.solve
    monkeypatch.setattr(windows.Windowed, "solve", lambda self, *a, **k: windowed.append(1) or solve(self, *a, **k))
    out_of_time_after_windows = SimpleNamespace(seconds=1.0, left=lambda: 0.0 if windowed else 60.0)
    _, solution, stages, _ = levels.Levels(lambda: tied, tied, lambda: tied, 0, False, "HIGHS").solve(
        out_of_time_after_windows, allowed)
    assert solution.status == "feasible" and len(stages) == 1
    assert solution.objective_s == pytest.approx(by_windows)


def _distinct_widths(layers: int, abstract: bool):
    """A GPT whose FFN widths differ layer by layer: no two layers repeat, so O2 cannot tie them."""
    cfg = dataclasses.replace(gpt.GPT_TINY, n_layers=layers, d_ff=64, d_ff_step=32)
    return gpt.make_gpt_train_step(cfg), gpt.gpt_example(cfg, abstract=abstract)


@pytest.fixture(scope="module")
def tiny_windows():
    """Windows on a test-sized model: on (2, 4) its 4 layers tied alike make an ILP of about 80k
    variables, solved whole, and untied about 170k, solved by windows of at most 10k."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(windows, "WHOLE_VARS", 100_000)
        patch.setattr(windows, "WINDOW_VARS", 10_000)
        yield


@pytest.fixture(scope="module")
def windowed(tiny_windows):
    """The 4 distinct layers' step, its arguments and its O2 lowering on (2, 4), searched once for
    the test of its plan and the test of its numbers."""
    step, args = _distinct_widths(4, abstract=False)
    return step, args, rj.parallelize(step, mesh=rj.device_mesh((2, 4), ("data", "model")), opt_level="O2").lower(*args)


def test_distinct_layers_are_planned_by_windows_as_o3_plans_them(windowed):
    step, args, lowered = windowed
    o2 = lowered.plan
    o3 = rj.parallelize(step, mesh=lowered.mesh, opt_level="O3").lower(*args).plan
    # Attention repeats exactly, the FFNs only in kind: more segments are alike than identical.
    assert o2.search_stats.similar_segments > o2.search_stats.tied_segments
    assert o2.search_stats.status == "windowed" and o2.search_stats.windows > 1
    first, exact = o2.search_stats.ilp_stages  # layers alike tied, then windows over the exact problem
    assert first.classes < exact.classes and exact.objective_s <= first.objective_s + 1e-12
    assert o2.cost.total_s <= o3.cost.total_s * 1.03
    # O3 starts from O2's plan and never ends worse.
    assert o3.search_stats.objective_s <= o2.search_stats.objective_s * (1 + 1e-9)
    assert "windows" in o2.report()


def test_windowed_plan_matches_one_device(windowed):
    step, args, lowered = windowed
    assert lowered.plan.search_stats.status == "windowed"
    assert_same_numbers(jax.jit(step)(*args), lowered.compile()(*on_host(args)))


def test_o3_out_of_time_keeps_o2s_plan(solves_out_of_time):
    # With no time left after O2, the whole graph's ILP is not even built, and O3 returns O2's
    # plan, reported as stopped at the limit.
    step, args = _distinct_widths(2, abstract=True)
    mesh = rj.device_mesh((8,), ("data",))
    with pytest.warns(rj.SolverTimeLimitWarning):
        o3 = rj.parallelize(step, mesh=mesh, opt_level="O3").lower(*args).plan
    assert o3.search_stats.status == "feasible"
    assert len(o3.search_stats.ilp_stages) == 1
    assert o3.search_stats.objective_s == pytest.approx(o3.search_stats.ilp_stages[0].objective_s)
