"""A long search reports its progress and stops at Ctrl-C with the best plan found so far."""
import logging

import jax
import numpy as np
import pytest

import rhino_jax as rj
from rhino_jax.errors import SolverInterruptedWarning
from rhino_jax.models import make_mlp_train_step, mlp_example
from rhino_jax.search import ilp

from helpers import assert_same_numbers
from test_interrupt import ctrl_c  # noqa: F401 (the fixture)


@pytest.mark.parametrize("backend", ["HIGHS", "SCIP"])
def test_interrupted_solve_returns_a_valid_incumbent(ctrl_c, backend):
    rng = np.random.default_rng(0)
    costs = tuple(rng.uniform(0, 1, 4) for _ in range(30))
    edges = tuple(ilp.Edge(g, g + 1, (0, 1, 2, 3), (0, 1, 2, 3), rng.uniform(0, 1, (4, 4))) for g in range(29))
    problem = ilp.Problem(costs, edges)
    solution = ilp.solve(problem, backend, time_limit_s=5)
    assert ctrl_c.pressed and solution.status == "interrupted"
    assert len(solution.choice) == 30
    assert solution.objective_s == pytest.approx(ilp.evaluate(problem, solution.choice))
    assert solution.objective_s <= ilp.evaluate(problem, ilp.greedy(problem)) + 1e-12
    assert solution.bound_s <= solution.objective_s


def test_search_logs_its_levels_and_an_interrupted_plan_still_runs(ctrl_c, caplog):
    mesh = rj.device_mesh((8,), ("data",))
    step = make_mlp_train_step()
    args = mlp_example((32, 64, 32), 16)
    with caplog.at_level(logging.INFO, logger="rhino_jax"), pytest.warns(SolverInterruptedWarning):
        lowered = rj.parallelize(step, mesh=mesh).lower(*args)
    messages = [r.getMessage() for r in caplog.records]
    assert any("cones" in m and "critical nodes" in m for m in messages)
    assert any("solving the ILP" in m for m in messages)
    assert lowered.plan.search_stats["status"] == "interrupted"
    assert "interrupted" in lowered.plan.report()
    assert_same_numbers(jax.jit(step)(*args), lowered.compile()(*args))
