"""MIP solves in a helper process, so Ctrl-C stops them.

OR-Tools cannot stop its HiGHS or SCIP solves from another thread (`ModelSolverHelper.interrupt_solve`
returns True and the solve runs on to its time limit: its HiGHS and SCIP paths take no interrupter),
and a thread that cannot be stopped outlives the search. So each solve runs in one helper process
per searching process (this file run as a script: numpy, scipy and OR-Tools, no jax), started at the
first solve and kept for the next ones. Ctrl-C while it solves kills it: nothing is left running,
and the next solve starts a new one. The helper ignores Ctrl-C itself (its own session), and exits
when the searching process goes away (its requests' pipe closes).
"""
from __future__ import annotations

import os
import pickle
import select
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse


@dataclass
class Program:
    """min objective·v, row_lower ≤ matrix v ≤ row_upper, var_lower ≤ v ≤ var_upper, the
    `integer` columns integral; `hint`: (columns, values) of a known solution."""

    objective: np.ndarray
    matrix: scipy.sparse.csr_matrix
    row_lower: np.ndarray
    row_upper: np.ndarray
    var_lower: np.ndarray
    var_upper: np.ndarray
    integer: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    hint: tuple[np.ndarray, np.ndarray] | None = None


@dataclass(frozen=True)
class Result:
    status: str  # OR-Tools' SolveStatus name: "OPTIMAL", "FEASIBLE" (at the time limit), "INFEASIBLE", ...
    values: np.ndarray  # each variable's value (empty without a solution)
    objective: float
    bound: float  # the best objective bound (a MIP's; an LP's optimum)


_lock = threading.Lock()  # one solve at a time per helper
_helper: subprocess.Popen | None = None
_owner = 0  # the process that started the helper (a forked process inherits it, and starts its own)


def solve(program: Program, backend: str, time_limit_s: float, parameters: str = "") -> Result:
    """Solve `program` with OR-Tools' `backend` in the helper process. Ctrl-C (KeyboardInterrupt)
    kills the helper, waits for it to be gone, and propagates."""
    global _helper, _owner
    with _lock:
        try:
            if _helper is None or _helper.poll() is not None or _owner != os.getpid():
                _helper = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, start_new_session=True)
                _owner = os.getpid()
            # Plain values only: the helper runs this file as __main__, so it cannot load this module's classes.
            pickle.dump((vars(program), backend, time_limit_s, parameters), _helper.stdin,
                        protocol=pickle.HIGHEST_PROTOCOL)
            _helper.stdin.flush()
            while not select.select([_helper.stdout], [], [], 0.05)[0]:  # a Python-level wait: Ctrl-C lands here
                pass
            answer = pickle.load(_helper.stdout)
        except BaseException:
            stop()
            raise
    if isinstance(answer, str):
        raise RuntimeError(f"the MIP helper process failed: {answer}")
    return Result(*answer)


def stop() -> None:
    """Kill the helper process, if any, and wait until it is gone."""
    global _helper
    if _helper is not None and _owner == os.getpid():
        _helper.kill()
        _helper.wait()
        for pipe in (_helper.stdin, _helper.stdout):
            pipe.close()
    _helper = None


def helper_pid() -> int | None:
    """The helper process's id while one runs (tests check that Ctrl-C ends it)."""
    return None if _helper is None else _helper.pid


def _run(fields: dict, backend: str, time_limit_s: float, parameters: str) -> tuple:
    """In the helper: the solve of a `Program` (its fields), as a `Result`'s fields."""
    from ortools.linear_solver.python import model_builder_helper as mb

    program = Program(**fields)
    model = mb.ModelBuilderHelper()
    model.fill_model_from_sparse_data(program.var_lower, program.var_upper, program.objective, program.row_lower,
                                      program.row_upper, program.matrix)
    for i in program.integer.tolist():
        model.set_var_integrality(i, True)
    if program.hint is not None:
        for i, v in zip(*program.hint):
            model.add_hint(int(i), float(v))
    solver = mb.ModelSolverHelper(backend)
    solver.enable_output(False)
    if parameters:
        solver.set_solver_specific_parameters(parameters)
    solver.set_time_limit_in_seconds(max(1e-3, time_limit_s))
    solver.solve(model)
    status = solver.status().name
    solved = status in ("OPTIMAL", "FEASIBLE")
    return (status, np.asarray(solver.variable_values()) if solved else np.zeros(0),
            solver.objective_value(), solver.best_objective_bound())


def _answer(request, out) -> None:
    try:
        answer = _run(*request)
    except Exception as e:  # reported to the searching process, which raises it
        answer = f"{type(e).__name__}: {e}"
    pickle.dump(answer, out, protocol=pickle.HIGHEST_PROTOCOL)
    out.flush()


def _main() -> None:
    """Answer requests until the searching process goes away. Each solve runs in a thread (OR-Tools
    releases the GIL) while this one waits on the requests' pipe: its end, the searching process's
    exit, ends this process at once, mid-solve or not."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    requests, out = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what a solver prints itself (a banner) goes to stderr, not into the answers
    while True:
        try:
            request = pickle.load(requests)
        except (EOFError, pickle.UnpicklingError):  # gone, perhaps mid-request
            os._exit(0)
        threading.Thread(target=_answer, args=(request, out), daemon=True).start()


if __name__ == "__main__":
    _main()
