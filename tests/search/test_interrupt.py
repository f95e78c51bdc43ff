"""Ctrl-C during a search: before a plan exists it stops the search (KeyboardInterrupt); after, the
best plan so far comes back marked `interrupted`, with a warning, the solver stopped, and it runs
with one device's numbers, kept for the calls after it until `step.clear_cache()`."""
import multiprocessing
import os
import signal
import threading
import warnings

import jax
import numpy as np
import pytest

import rhino_jax as rj
from rhino_jax import api, coshard_search, mesh_search
from rhino_jax.errors import SolverInterruptedWarning
from rhino_jax.models import make_mlp_train_step, mlp_example
from rhino_jax.search import planner
from rhino_jax.search.solvers import ilp, levels, solver_process, windows

from helpers import assert_same_numbers

TWO_AXES = ("data", "model")


def _raising_on_call(monkeypatch, owner, name: str, call: int):
    """Replace owner.name by a function that raises KeyboardInterrupt (a Ctrl-C) at its `call`-th
    call and otherwise calls the original; returns the list of calls made."""
    original = getattr(owner, name)
    calls = []

    def pressed(*args, **kwargs):
        calls.append(args)
        if len(calls) == call:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, pressed)
    return calls


def _no_solver_left(pid: int | None = None):
    """Nothing of the solve runs on: no solver thread here, the solver process `pid` gone."""
    assert not [t for t in threading.enumerate() if t.name.startswith("rhino_jax")]
    if pid is not None:
        assert solver_process.helper_pid() is None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # killed and reaped


def _random_problem(n: int, k: int = 8) -> ilp.Problem:
    """Random costs on a ring of edges: its LP relaxation is fractional, so branch-and-bound runs
    for tens of seconds."""
    rng = np.random.default_rng(0)
    costs = tuple(rng.uniform(0, 1, k) for _ in range(n))
    edges = tuple(ilp.Edge(g, (g * 7 + 3) % n, tuple(range(k)), tuple(range(k)), rng.uniform(0, 1, (k, k)))
                  for g in range(n))
    return ilp.Problem(costs, edges)


@pytest.mark.parametrize("backend", ["HIGHS", "SCIP"])
def test_a_real_ctrl_c_stops_the_solver_process(monkeypatch, backend):
    """SIGINT to the main thread while branch-and-bound runs (OR-Tools cannot stop either backend
    from another thread): the solver process is killed, the incumbent comes back as "interrupted"."""
    solve = solver_process.solve
    killed = []

    def ctrl_c_during_branch_and_bound(program, *rest):
        if not len(program.integer):
            return solve(program, *rest)
        timer = threading.Timer(0.3, lambda: (killed.append(solver_process.helper_pid()),
                                              signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)))
        timer.start()
        try:
            return solve(program, *rest)
        finally:
            timer.cancel()
            timer.join()

    monkeypatch.setattr(solver_process, "solve", ctrl_c_during_branch_and_bound)
    problem = _random_problem(1000)
    # A process started in the background (`pytest ... &`) inherits SIGINT ignored; Ctrl-C reaches
    # a foreground one, which has Python's handler.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        solution = ilp.solve(problem, backend, time_limit_s=60)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert solution.status == "interrupted" and killed and killed[0] is not None
    _no_solver_left(killed[0])
    assert len(solution.choice) == len(problem.costs)
    assert solution.objective_s == pytest.approx(ilp.evaluate(problem, solution.choice))
    assert solution.bound_s <= solution.objective_s
    # The next solve starts a new solver process.
    small = ilp.Problem(problem.costs[:3], ())
    assert ilp.solve(small, backend).status == "optimal"


def test_ctrl_c_before_a_plan_stops_the_search_and_leaves_nothing(monkeypatch):
    mesh = rj.device_mesh((2, 4), TWO_AXES)
    step = make_mlp_train_step()
    args = mlp_example((16, 32, 8), 8)
    calls = _raising_on_call(monkeypatch, planner, "build_cones", 1)
    parallel = rj.parallelize(step, mesh=mesh)
    with pytest.raises(KeyboardInterrupt):
        parallel.lower(*args)
    assert calls
    _no_solver_left()
    monkeypatch.undo()
    plan = parallel.lower(*args).plan  # nothing was kept: a full search
    assert not plan.interrupted and plan.search_stats.status == "optimal"


@pytest.mark.parametrize("backend", ["HIGHS", "SCIP"])
def test_ctrl_c_during_the_solve_gives_the_plan_so_far(ctrl_c, tmp_path, backend):
    mesh = rj.device_mesh((2, 4), TWO_AXES)
    step = make_mlp_train_step()
    args = mlp_example((16, 32, 8), 8)
    with pytest.warns(SolverInterruptedWarning, match="interrupted .*Ctrl-C.*best found so far, not optimal"):
        lowered = rj.parallelize(step, mesh=mesh, solver=backend).lower(*args)
    plan = lowered.plan
    assert plan.interrupted and plan.search_stats.status == "interrupted"
    report = plan.report()
    assert "Ctrl-C stopped the search" in report and f"{backend} interrupted" in report
    assert "time limit" not in report
    assert ctrl_c.pressed
    _no_solver_left(ctrl_c.pid)
    assert_same_numbers(jax.jit(step)(*args), lowered.compile()(*args))
    plan.save(tmp_path / "plan.json")
    assert rj.Plan.load(tmp_path / "plan.json").interrupted


def test_the_plan_a_ctrl_c_cut_short_is_kept_until_the_cache_is_cleared(ctrl_c, monkeypatch):
    """The next call of those shapes runs the plan Ctrl-C cut short, without searching again (the
    user stopped a long search); the warning names step.clear_cache(), which searches in full."""
    mesh = rj.device_mesh((2, 4), TWO_AXES)
    step = make_mlp_train_step()
    parallel = rj.parallelize(step, mesh=mesh)
    args = mlp_example((16, 32, 8), 8)
    searches = _raising_on_call(monkeypatch, coshard_search, "plan_on", 0)  # counts, never raises
    with pytest.warns(SolverInterruptedWarning, match=r"best found so far.*step\.clear_cache\(\) for a full search"):
        assert_same_numbers(jax.jit(step)(*args), parallel(*args))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say: the kept plan runs
        assert_same_numbers(jax.jit(step)(*args), parallel(*args))
        assert parallel.lower(*args).plan.interrupted
    assert ctrl_c.pressed and len(searches) == 1
    parallel.clear_cache()
    assert not parallel.lower(*args).plan.interrupted and len(searches) == 2


def test_ctrl_c_before_o3_keeps_the_o2_plan(monkeypatch):
    """O3 starts from O2's choice: Ctrl-C while O3's model is built returns O2's plan."""
    mesh = rj.device_mesh((2, 4), TWO_AXES)
    step = make_mlp_train_step()
    args = mlp_example((16, 32, 8), 8)
    _raising_on_call(monkeypatch, levels, "solver_for", 2)
    with pytest.warns(SolverInterruptedWarning):
        lowered = rj.parallelize(step, mesh=mesh, opt_level="O3").lower(*args)
    plan = lowered.plan
    assert plan.interrupted and plan.search_stats.status == "interrupted"
    assert [s.status for s in plan.search_stats.ilp_stages] == ["optimal"]  # O2's stage only
    assert_same_numbers(jax.jit(step)(*args), lowered.compile()(*args))


def test_ctrl_c_between_windows_keeps_the_windows_solved(monkeypatch):
    problem = _random_problem(40, k=3)
    position = list(range(40))
    solver = windows.Windowed(problem, position, budget=120)
    assert len(solver.windows) > 2
    first = solver.windows[0]
    expected = ilp.Model(windows.restrict(problem, first, [None] * 40, windows.Incidence(problem),
                                          np.zeros(0, dtype=int))).solve().choice
    _raising_on_call(monkeypatch, windows, "restrict", 2)
    solution = solver.solve()
    assert solution.status == "interrupted"
    assert tuple(solution.choice[g] for g in first) == expected
    assert solution.objective_s == pytest.approx(ilp.evaluate(problem, solution.choice))


def test_ctrl_c_in_the_mesh_search_keeps_the_meshes_searched(monkeypatch):
    step = make_mlp_train_step()
    args = mlp_example((16, 32, 8), 8)
    parallel = rj.parallelize(step, mesh=None, axis_names=TWO_AXES, search_workers=0)
    calls = _raising_on_call(monkeypatch, mesh_search, "search_worker", 2)
    with pytest.warns(SolverInterruptedWarning, match="mesh shapes interrupted"):
        lowered = parallel.lower(*args)
    plan = lowered.plan
    assert len(calls) == 2 and plan.interrupted
    searched = [c for c in plan.mesh_candidates if c.feasible]
    assert len(searched) == 1 and searched[0].chosen
    assert all("not searched" in c.error for c in plan.mesh_candidates if not c.feasible)
    assert len(plan.mesh_candidates) > 2
    assert_same_numbers(jax.jit(step)(*args), lowered.compile()(*args))


def test_ctrl_c_before_any_mesh_has_a_plan_stops_the_mesh_search(monkeypatch):
    step = make_mlp_train_step()
    args = mlp_example((16, 32, 8), 8, abstract=True)
    _raising_on_call(monkeypatch, mesh_search, "search_worker", 1)
    with pytest.raises(KeyboardInterrupt):
        rj.parallelize(step, mesh=None, axis_names=TWO_AXES, search_workers=0).lower(*args)


def test_ctrl_c_ends_the_mesh_search_workers(monkeypatch):
    step = make_mlp_train_step()
    args = mlp_example((16, 32, 8), 8)
    completed = mesh_search.as_completed

    def first_then_ctrl_c(futures):
        for future in completed(futures):
            yield future
            raise KeyboardInterrupt

    monkeypatch.setattr(mesh_search, "as_completed", first_then_ctrl_c)
    with pytest.warns(SolverInterruptedWarning):
        lowered = rj.parallelize(step, mesh=None, axis_names=TWO_AXES, search_workers=2).lower(*args)
    assert not multiprocessing.active_children()  # the workers were ended, not left searching
    plan = lowered.plan
    assert plan.interrupted and sum(c.feasible for c in plan.mesh_candidates) == 1
    assert_same_numbers(jax.jit(step)(*args), lowered.compile()(*args))


def test_ctrl_c_in_pipeline_auto_keeps_the_candidates_lowered(monkeypatch):
    mesh = rj.device_mesh((2, 4), TWO_AXES)
    step = make_mlp_train_step()
    args = mlp_example((16, 32, 8), 8)
    calls = _raising_on_call(monkeypatch, api.Parallelized, "lower_with", 2)
    with pytest.warns(SolverInterruptedWarning, match="pipeline='auto'"):
        lowered = rj.parallelize(step, mesh=mesh, pipeline="auto").lower(*args)
    plan = lowered.plan
    assert len(calls) == 2 and plan.interrupted and not plan.stages
    assert [c.label for c in plan.search_stats.pipeline_candidates] == ["SPMD only, 1 micro-batch"]
    assert_same_numbers(jax.jit(step)(*args), lowered.compile()(*args))


def test_ctrl_c_in_one_program_stops_the_micro_batched_searches(ctrl_c, monkeypatch):
    """Ctrl-C in compute-gradients' search: apply-gradients' search solves nothing, and the step's
    plan is marked interrupted."""
    mesh = rj.device_mesh((2, 4), TWO_AXES)
    step = make_mlp_train_step()
    args = mlp_example((16, 32, 8), 8)
    solves = _raising_on_call(monkeypatch, solver_process, "solve", 0)  # counts, never raises
    with pytest.warns(SolverInterruptedWarning):
        lowered = rj.parallelize(step, mesh=mesh, num_micro_batches=2).lower(*args)
    assert ctrl_c.pressed and len(solves) == 1
    assert all(p.interrupted for p in lowered.programs.values()) and lowered.plan.interrupted
    assert_same_numbers(jax.jit(step)(*args), lowered.compile()(*args))
