"""A long search reports its progress and stops at Ctrl-C with the best plan found so far."""
import logging
import re
import threading

import jax
import numpy as np
import pytest

import rhino_jax as rj
from rhino_jax.errors import SolverInterruptedWarning
from rhino_jax.models import make_mlp_train_step, mlp_example
from rhino_jax.search import progress
from rhino_jax.search.solvers import ilp

from helpers import assert_same_numbers


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
    assert lowered.plan.search_stats.status == "interrupted"
    assert "interrupted" in lowered.plan.report()
    assert_same_numbers(jax.jit(step)(*args), lowered.compile()(*args))


def _lower_small(**options):
    mesh = rj.device_mesh((2, 4), ("data", "model"))
    return rj.parallelize(make_mlp_train_step(), mesh=mesh, **options).lower(*mlp_example((32, 64, 32), 16))


def test_a_search_shows_its_progress_on_one_line_of_stderr(monkeypatch, capsys):
    """After DELAY_S the search writes what it does, the elapsed time and the best predicted step
    so far to stderr (a plain line per period where stderr is no terminal, and one at the end)."""
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "LOG_PERIOD_S", 0.01)
    lowered = _lower_small()
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("rhino_jax ")]
    assert lines, "no progress line"
    assert re.fullmatch(r"rhino_jax +[\d.]+ s \| .+", lines[0])
    assert any("solving the ILP" in ln for ln in lines) or any("cones" in ln for ln in lines)
    best = re.search(r"best so far ([\d.e+-]+) ms$", lines[-1])
    assert best and float(best.group(1)) == pytest.approx(lowered.plan.cost.total_s * 1e3, rel=1e-3)
    assert not [t for t in threading.enumerate() if t.name == "rhino_jax progress"]


def test_the_best_so_far_of_a_step_run_as_programs_is_the_steps(monkeypatch, capsys):
    """Each program of a micro-batched step predicts one run of it, less than the step: the line's
    best so far is the step's prediction, as its report says it, never a program's."""
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "LOG_PERIOD_S", 0.01)
    lowered = _lower_small(num_micro_batches=2)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("rhino_jax ")]
    shown = {float(b) for b in re.findall(r"best so far ([\d.e+-]+) ms$", "\n".join(lines), re.M)}
    assert shown and all(b == pytest.approx(lowered.plan.cost.total_s * 1e3, rel=1e-3) for b in shown), shown


@pytest.mark.parametrize("off", ["option", "environment"])
def test_the_progress_line_can_be_turned_off(off, monkeypatch, capsys):
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "LOG_PERIOD_S", 0.01)
    if off == "environment":
        monkeypatch.setenv("RHINO_JAX_PROGRESS", "0")
    _lower_small(**({"progress": False} if off == "option" else {}))
    assert not [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("rhino_jax ")]
