"""`parallelize(mesh=None)`: enumerate mesh shapes over the devices, plan on each, keep the best.

Rhino §3/§4: "We enumerate different device mesh configurations, run strategy search algorithms
for them in parallel, and pick out the best strategy." The shapes come from `search.meshes`
(1-, 2- and 3-axis meshes, inner axes inside one host). Each candidate is lowered on its own
mesh in this process (the mesh is the lowering's context: `rj.annotate` pins are checked there
and become Shardy constraints, and the module the plan rewrites carries that mesh), then searched;
the searches are plain functions of plain data (Graph, MeshTopology, Cluster pickle), so they can
run in worker processes ('spawn'). The candidate with the least predicted step time wins (ties:
fewer axes); every candidate and its prediction goes into `plan.mesh_candidates` and the report.

Progress goes to the `rhino_jax` logger at INFO and to the progress line on stderr (`search.progress`).
"""
from __future__ import annotations

import math
import multiprocessing
import os
import pickle
import signal
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace

from jax.sharding import Mesh

from rhino_jax.core.plan import MeshCandidate, Plan
from rhino_jax.hlo_passes.graph import Graph
from rhino_jax.hlo_passes.lowering import LoweredStep, import_step, lower_on_mesh
from rhino_jax.search import interrupt, progress
from rhino_jax.search.cost.cluster import Cluster, MeshTopology, get_cluster, host_ids
from rhino_jax.search.cost.combining import shares
from rhino_jax.search.space.constraints import check_matched
from rhino_jax.search.cost.gemm_workspace import with_gemm_workspaces
from rhino_jax.search.solvers.levels import Budget
from rhino_jax.search.space.meshes import candidate_meshes
from rhino_jax.search.planner import search

from .arguments import Call
from .errors import NoFeasibleMeshError, RhinoError
from .mesh import device_mesh
from .options import Options, budget_of, seconds_left, within


# With search_workers=None the first candidate is searched here, and its time decides whether the
# rest go to worker processes: a 'spawn' worker (a fresh interpreter importing jax and rhino_jax)
# takes about this long to start, and the pool must beat searching the rest here by a margin.
SPAWN_OVERHEAD_S = 3.0


@dataclass
class _Candidate:
    index: int
    shape: tuple[int, ...]
    names: tuple[str, ...]
    mesh: Mesh
    step: LoweredStep | None = None
    graph: Graph | None = None
    topo: MeshTopology | None = None
    plan: Plan | None = None
    error: str = ""
    seconds: float = 0.0  # lowering + import + search
    search_s: float = 0.0
    done: bool = False

    @property
    def label(self) -> str:
        return " × ".join(f"{a}={n}" for a, n in zip(self.names, self.shape))


def plan_on(graph: Graph, topo: MeshTopology, cluster: Cluster, options: Options, mesh: Mesh | None = None) -> Plan:
    """The search, with the user's options, on one mesh (Ctrl-C: `search.interrupt`), each
    collective with its share of the step's communication (`combining.shares`: what a report
    or a picture per layer shows beside the step); with the mesh at hand (not in a worker
    process), its memory counts the GEMM temporaries XLA makes for the mesh's devices
    (`gemm_workspace`)."""
    plan = search(graph, topo, cluster, opt_level=options.opt_level, backend=options.solver,
                  time_limit_s=seconds_left(options), memory_limit_bytes=options.memory_limit_bytes,
                  strided=options.strided_specs, constraints=options.constraints)
    return finished(plan, graph, topo, mesh)


def finished(plan: Plan, graph: Graph, topo: MeshTopology, mesh: Mesh | None) -> Plan:
    """A searched plan as `plan_on` returns it: each collective's share of the communication,
    and on a mesh at hand the GEMM temporaries in its memory. Its alternatives get the shares
    alone: which of them is kept only their compiled programs tell (`compiled_choice`), and that
    one is given its temporaries then (each distinct GEMM is a compile of its own)."""
    plan = replace(plan, collectives=tuple(replace(c, combined_s=s)
                                           for c, s in zip(plan.collectives, shares(plan.collectives, topo))),
                   alternatives=tuple(finished(p, graph, topo, None) for p in plan.alternatives))
    return plan if mesh is None else with_gemm_workspaces(plan, graph, topo, mesh.devices.flat[0])


def search_worker(graph: Graph, topo: MeshTopology, cluster: Cluster, options: Options):
    """Search one candidate, here or in a worker process: (plan, error, warnings, seconds).

    A RhinoError (a pin this mesh cannot satisfy, no solution) makes the candidate infeasible;
    any other exception is a bug and propagates. Warnings are returned to be re-issued by the
    caller (a worker's warnings would otherwise be lost)."""
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            plan = plan_on(graph, topo, cluster, options)
            error = ""
        except RhinoError as e:
            plan, error = None, f"{type(e).__name__}: {e}"
    return plan, error, [(str(w.message), w.category) for w in caught], time.perf_counter() - t0


def _lower(c: _Candidate, call: Call, cluster: Cluster) -> None:
    t0 = time.perf_counter()
    progress.say("rhino_jax: lowering on mesh [%s]", c.label)
    try:
        c.step = lower_on_mesh(call.fn, call.args, c.mesh, call.donate_argnums, call.kwargs, call.donate_argnames,
                               call.positions)
    except RhinoError as e:  # rj.annotate: unknown axis, or a size this mesh does not divide
        c.error, c.done = f"{type(e).__name__}: {e}", True
    except ValueError as e:  # jax.lax.with_sharding_constraint naming an axis this mesh lacks
        if "not found in mesh" not in str(e):
            raise
        c.error, c.done = f"{type(e).__name__}: {e}", True
    else:
        c.graph = import_step(c.step)
        c.topo = MeshTopology.from_mesh(c.mesh, cluster)
    c.seconds += time.perf_counter() - t0


def _record(c: _Candidate, result, n: int) -> None:
    plan, error, caught, seconds = result
    if plan is not None:  # searched without the mesh (perhaps in a worker process)
        plan = with_gemm_workspaces(plan, c.graph, c.topo, c.mesh.devices.flat[0])
    c.plan, c.error, c.search_s, c.seconds, c.done = plan, error, seconds, c.seconds + seconds, True
    for message, category in caught:
        warnings.warn(f"mesh [{c.label}]: {message}", category, stacklevel=4)
    if plan is not None:
        progress.say("rhino_jax: mesh [%s] (%d/%d): predicted step %.4g ms (searched in %.2f s)",
                     c.label, c.index + 1, n, plan.cost.total_s * 1e3, seconds, best_s=plan.cost.total_s)
    else:
        progress.say("rhino_jax: mesh [%s] (%d/%d): infeasible: %s", c.label, c.index + 1, n, error)


def _search_here(todo: list[_Candidate], cluster: Cluster, options: Options, n: int, budget: Budget) -> None:
    for c in todo:
        if interrupt.pressed():  # Ctrl-C: the user wants a plan now
            break
        progress.say("rhino_jax: searching mesh [%s] (%d/%d)", c.label, c.index + 1, n)
        try:
            mine = within(options, budget, 1, f"mesh [{c.label}]")
        except RhinoError as e:  # no time left for it
            c.error, c.done = f"{type(e).__name__}: {e}", True
            continue
        _record(c, search_worker(c.graph, c.topo, cluster, mine), n)


def _interrupted(cands: list[_Candidate]) -> None:
    """Ctrl-C outside a search's solver (in a search's cone building, or while waiting for the
    workers): the candidates planned so far stand, the others are marked not searched; with
    none planned, KeyboardInterrupt."""
    if not any(c.plan is not None for c in cands):
        raise KeyboardInterrupt("the mesh search was interrupted before any mesh shape had a plan")
    interrupt.press()
    interrupt.warn(f"mesh=None: the search over {len(cands)} mesh shapes", stacklevel=4)
    _not_searched(cands)


def _not_searched(cands: list[_Candidate]) -> None:
    for c in cands:
        if not c.done:
            c.error, c.done = "not searched: the search was interrupted (Ctrl-C)", True


def _main_is_spawn_safe() -> bool:
    """Will a 'spawn' worker start without re-running the user's script? Spawn imports the main
    module; a script without an `if __name__ == "__main__":` guard would run again in every
    worker. Interactive sessions and `python -m pkg` have nothing to re-run."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec = getattr(main, "__spec__", None)
    if path is None or (spec is not None and spec.name.endswith("__main__")):
        return True
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "__main__" in f.read()
    except OSError:
        return False


def _pool_size(options: Options, todo: int, first_s: float | None) -> int:
    """How many worker processes search the `todo` candidates left (0: search them here)."""
    cpus = os.cpu_count() or 1
    if options.search_workers is not None:
        return min(options.search_workers, todo) if options.search_workers > 1 and todo > 1 else 0
    workers = min(todo, cpus)
    if workers < 2 or first_s is None or not _main_is_spawn_safe():
        return 0
    # The first search (the 1-axis mesh, usually the quickest) stands in for each of the rest.
    pooled = SPAWN_OVERHEAD_S + math.ceil(todo / workers) * first_s
    return workers if pooled < 0.8 * todo * first_s else 0


def _ignore_ctrl_c() -> None:
    """A worker's start: Ctrl-C reaches the whole terminal's process group; the searching process
    answers it and ends the workers (`_stop_workers`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """End the pool's worker processes now, mid-search (their solver processes exit with them),
    and wait until they are gone. (ProcessPoolExecutor.terminate_workers does this from Python 3.14.)"""
    processes = list((pool._processes or {}).values())
    for p in processes:
        p.terminate()
    for p in processes:
        p.join()
    pool.shutdown(wait=True, cancel_futures=True)


def _search_pool(todo: list[_Candidate], workers: int, cluster: Cluster, options: Options, n: int,
                 budget: Budget) -> None:
    progress.say("rhino_jax: searching %d mesh shapes in %d worker processes: %s", len(todo), workers,
                 ", ".join(f"[{c.label}]" for c in todo))
    # `workers` searches at a time: each takes the time left over the rounds they need
    try:
        each = within(options, budget, len(todo), f"{len(todo)} mesh shapes")
    except RhinoError as e:  # the first search took all the time: these are not searched
        for c in todo:
            c.error, c.done = f"{type(e).__name__}: {e}", True
        return
    # (a limit per search, not the share's end: a worker's searches run one after another)
    each = replace(each, solver_time_limit_s=each.solver_time_limit_s / math.ceil(len(todo) / workers),
                   search_until=None)
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_ignore_ctrl_c) as pool:
            futures = {pool.submit(search_worker, c.graph, c.topo, cluster, each): c for c in todo}
            try:
                for future in as_completed(futures):
                    _record(futures[future], future.result(), n)
            except KeyboardInterrupt:
                _stop_workers(pool)
                raise
    except (BrokenProcessPool, pickle.PicklingError) as e:
        rest = [c for c in todo if not c.done]
        warnings.warn(f"searching mesh shapes in worker processes failed ({type(e).__name__}: {e}); searching "
                      f"the {len(rest)} left in this process. If your script has no `if __name__ == "
                      "'__main__':` guard, add one, or pass search_workers=0.", RuntimeWarning, stacklevel=4)
        _search_here(rest, cluster, options, n, budget)


def search_meshes(call: Call, devices, options: Options) -> tuple[Mesh, LoweredStep, Graph, Plan]:
    """Lower and search the call's step on every candidate mesh over `devices`; the best one's
    mesh, lowered step, graph and plan (with `mesh_candidates` filled in)."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError("rhino_jax: a mesh search started while a worker process was starting up: the "
                           "script runs again in each worker. Put its top-level code under `if __name__ == "
                           "'__main__':`, or pass search_workers=0.")
    import jax

    devices = list(jax.devices() if devices is None else devices)
    cluster = get_cluster(options.cluster, devices)
    shapes = candidate_meshes(host_ids(devices, cluster.devices_per_host), options.axis_names)
    n = len(shapes)
    progress.say("rhino_jax: mesh=None: %d candidate mesh shapes over %d devices: %s", n, len(devices),
                 ", ".join(str(s) for s, _ in shapes))
    cands = [_Candidate(i, s, names, device_mesh(s, names, devices)) for i, (s, names) in enumerate(shapes)]
    for c in cands:
        _lower(c, call, cluster)
    todo = [c for c in cands if not c.done]
    if todo:  # one step, alike on every mesh
        check_matched(options.constraints, todo[0].graph)
    budget = budget_of(options, len(todo))  # the candidates share the limit
    with interrupt.session():
        try:
            workers = _pool_size(options, len(todo), None)
            if not workers and todo:
                # Search one here; if that was slow, search the rest in worker processes.
                first, todo = todo[0], todo[1:]
                _search_here([first], cluster, options, n, budget)
                workers = _pool_size(options, len(todo), first.search_s)
            if workers and not interrupt.pressed():
                _search_pool(todo, workers, cluster, options, n, budget)
            else:
                _search_here(todo, cluster, options, n, budget)
        except KeyboardInterrupt:
            _interrupted(cands)
        _not_searched(cands)
        return _choose(cands, interrupt.pressed())


def _choose(cands: list[_Candidate], interrupted: bool) -> tuple[Mesh, LoweredStep, Graph, Plan]:
    key = lambda c: (c.plan.cost.total_s, len(c.shape), c.index)  # noqa: E731
    feasible = sorted((c for c in cands if c.plan is not None), key=key)
    if not feasible:
        reasons = "\n".join(f"  [{c.label}]: {c.error}" for c in cands)
        raise NoFeasibleMeshError(
            f"mesh=None: none of the {len(cands)} candidate meshes has a plan:\n{reasons}\n"
            "Pins (rj.annotate / with_sharding_constraint) must name axes of the enumerated meshes, whose "
            "k axes are the first k of axis_names (default ('data', 'model', 'extra')): rename the pinned "
            "axes, pass axis_names=(...) with the names your pins use, or pass an explicit "
            "mesh=rj.device_mesh(shape, axis_names).")
    best = feasible[0]
    table = [MeshCandidate(c.shape, c.names, c.plan.cost, c.seconds, chosen=c is best) for c in feasible]
    table += [MeshCandidate(c.shape, c.names, None, c.seconds, error=c.error) for c in cands if c.plan is None]
    progress.say("rhino_jax: chose mesh [%s]: predicted step %.4g ms", best.label, best.plan.cost.total_s * 1e3)
    return best.mesh, best.step, best.graph, replace(best.plan, mesh_candidates=tuple(table),
                                                     interrupted=best.plan.interrupted or interrupted)
