"""`python -m benchmarks.run`'s measurements: one row per model preset, target and method
(searched, compiled, priced, and for the tiny presets run against one device), Rhino §7.3's
strong scaling, and search time against depth. `benchmarks/run.py` runs them, after setting XLA's
flags (8 emulated CPU devices, LLVM's optimizations off) before jax is imported.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
import signal
import time
import traceback
import warnings

import jax
import numpy as np

import rhino_jax as rj
from benchmarks.fixtures import baselines as B
from benchmarks.fixtures.models import MODELS, sharding_memory_limit
from benchmarks.run_matrix import H100, LIMITED, M8, STRONG_SCALING_BATCH, Target
from benchmarks.run_report import RHINO, _is_rhino
from rhino_jax.runtime.compiled.compiled_cost import price_compiled


def _mesh(shape, names):
    n = math.prod(shape)
    return rj.device_mesh(shape, names, jax.devices()[:n])


def _mesh_label(mesh) -> str:
    return "x".join(str(s) for s in mesh.devices.shape)


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 2**shift:
            return f"{nbytes / 2**shift:.3g} {unit}"
    return f"{nbytes} B"


def _tree_max_abs_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _same_plan(p, q) -> bool:
    return p.arg_specs == q.arg_specs and p.value_specs == q.value_specs and p.read_specs == q.read_specs


class WallTimeLimit(Exception):
    pass


def _alarm(signum, frame):
    raise WallTimeLimit()


def _lower(step, args, mesh, cluster, opt_level, memory_limit: int | None, o3_limit: float):
    """(lowered, search seconds, status note). `memory_limit`: rhino_jax's memory_limit_bytes (None:
    unlimited, as for the pinned baselines).
    O3's search keeps to o3_limit (solver_time_limit_s covers the whole search); a wall-clock alarm at
    2 x o3_limit catches an overrun: WallTimeLimit when it goes off."""
    if opt_level == "O3":
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, 2 * o3_limit)
        try:
            return _lower_once(step, args, mesh, cluster, opt_level, memory_limit, o3_limit)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    return _lower_once(step, args, mesh, cluster, opt_level, memory_limit, o3_limit)


def _lower_once(step, args, mesh, cluster, opt_level, memory_limit: int | None, o3_limit: float):
    opts = dict(mesh=mesh, donate_argnums=(0, 1), cluster=cluster, opt_level=opt_level,
                solver_time_limit_s=o3_limit if opt_level == "O3" else 300.0)
    note = ""
    if memory_limit is not None:
        opts["memory_limit_bytes"] = memory_limit
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", rj.SolverTimeLimitWarning)
        start = time.perf_counter()
        try:
            lowered = rj.parallelize(step, **opts).lower(*args)
        except rj.MemoryLimitError as e:
            note = f"no plan fits {_size(memory_limit)} ({str(e)[:90]}...); unconstrained plan"
            opts.pop("memory_limit_bytes")
            lowered = rj.parallelize(step, **opts).lower(*args)
        seconds = time.perf_counter() - start
    if any(issubclass(w.category, rj.SolverTimeLimitWarning) for w in caught):
        note = (note + "; " if note else "") + (f"time limit ({o3_limit:g} s), gap "
                                                f"{lowered.plan.search_stats.gap:.1%}")
    return lowered, seconds, note


def _kinds(summary: dict) -> dict[str, list[int]]:
    """kind -> [count, bytes] of the kinds present (JSON-friendly)."""
    return {k: [n, b] for k, (n, b) in summary.items() if n}


# Keys a row of O3 takes from O2's when their plans are the same (one compile for both).
_COMPILED_KEYS = ("compile_s", "hlo_count", "hlo_mib", "hlo_kinds", "mem_hlo_gib", "max_abs_diff", "priced_ms",
                  "priced_serial_ms", "priced_compute_ms", "priced_comm_ms", "priced_exposed_ms")


def measure(model, cfg, target: Target, mesh, method: str, *, concrete: bool, o3_limit: float, reference=None,
            o2_result=None, h100: bool = True) -> dict:
    """One row: `method` searched for the target's cluster on `mesh` (the target's devices),
    compiled by the target's compiler; on the GPU also priced from the compiled HLO. `o2_result`:
    (lowered, row) of O2 on the same case and target (O3 reuses its compile when the plans are the
    same). `h100`: a second search under 8x-h100 on the same mesh (the CPU rows' H100 estimate
    when no GPU target is run)."""
    cluster = target.cluster
    row = dict(method=method, mesh=_mesh_label(mesh), compiler=target.compiler, cluster=cluster.name, status="ok",
               note="")
    rhino = _is_rhino(method)
    args = model.example(cfg, abstract=True)
    if rhino:
        step = model.make_train_step(cfg)
        level = "O3" if method == "rhino_jax O3" else "O2"
        limit = cluster.memory_per_device
        if method == LIMITED:
            if o2_result is None:
                return dict(row, status="error", note="needs rhino_jax O2's plan, which failed")
            limit = sharding_memory_limit(o2_result[0].plan.cost.memory_bytes, args, mesh.size)
    else:
        base = B.BASELINES[method]
        why = base.applies(model, mesh)
        if why:
            return dict(row, status="n/a", note=why)
        build = base.build
        if concrete and method.startswith("ZeRO"):  # tiny models have only tensors below the threshold
            build = functools.partial(build, persistence_threshold=0)
        try:
            step = build(model, cfg, mesh)
        except B.NotApplicable as e:
            return dict(row, status="n/a", note=str(e))
        level, limit = "O2", None
    start = time.perf_counter()
    try:
        lowered, row["search_s"], row["note"] = _lower(step, args, mesh, cluster, level, limit, o3_limit)
    except rj.ShardingPinError as e:
        return dict(row, status="n/a", note=f"pin does not fit this mesh: {str(e).splitlines()[0][:160]}")
    except WallTimeLimit:
        return dict(row, status="time limit", search_s=time.perf_counter() - start,
                    note=f"search stopped after {2 * o3_limit:g} s wall time (no plan)")
    plan = lowered.plan
    if method == LIMITED:
        if "no plan fits" in row["note"]:  # the fallback is the unlimited plan: a check that cannot fail
            return dict(row, status="no plan")
        kept = f"limit {_size(limit)} ({len(plan.search_stats.not_replicated)} largest states kept off replication)"
        row["note"] = "; ".join(n for n in (kept, row["note"]) if n)
    if row["note"].startswith("time limit") or "; time limit" in row["note"]:
        row["status"] = "time limit"
    s = plan.search_stats
    # predicted as the target's compiler combines the plan's collectives, to compare with its program
    predicted = plan.collective_summary(target.compiler)
    row.update(solve_s=s.solve_s, ops=s.ops, step_ms=plan.cost.total_s * 1e3,
               compute_ms=plan.cost.compute_s * 1e3, comm_ms=plan.cost.comm_s * 1e3,
               pred_mib=sum(b for _, b in predicted.values()) / 2**20,
               pred_count=sum(n for n, _ in predicted.values()), pred_kinds=_kinds(predicted),
               mem_pred_gib=plan.cost.memory_bytes / 2**30, batch=getattr(cfg, "batch", None))
    row["samples_per_s"] = row["batch"] / plan.cost.total_s if plan.cost.total_s else None
    if method == "rhino_jax O3" and o2_result is not None and _same_plan(plan, o2_result[0].plan):
        for k in _COMPILED_KEYS:
            if k in o2_result[1]:
                row[k] = o2_result[1][k]
        row["note"] = (row["note"] + "; " if row["note"] else "") + "same plan as O2"
    else:
        start = time.perf_counter()
        compiled = lowered.compile()
        row["compile_s"] = time.perf_counter() - start
        stats, mem = compiled.collectives, compiled.memory
        row.update(hlo_count=stats.count(), hlo_mib=stats.bytes() / 2**20, hlo_kinds=_kinds(stats.by_kind()),
                   mem_hlo_gib=mem.total / 2**30)
        if target.compiler == "gpu":
            cost = price_compiled(compiled._executable, cluster)
            # the headline is the step as its schedule runs; the serial sum beside it
            row.update(priced_ms=cost.overlapped_s * 1e3, priced_serial_ms=cost.total_s * 1e3,
                       priced_compute_ms=cost.compute_s * 1e3, priced_comm_ms=cost.comm_s * 1e3,
                       priced_exposed_ms=cost.exposed_comm_s * 1e3)
        if concrete:
            out = compiled(*model.example(cfg))
            row["max_abs_diff"] = _tree_max_abs_diff(reference, out)
    row["fidelity"] = row["hlo_mib"] / row["pred_mib"] if row["pred_mib"] else None
    if row.get("priced_ms") is not None:
        row["priced_over_pred"] = row["priced_ms"] / row["step_ms"] if row["step_ms"] else None
    row["count_fidelity"] = row["hlo_count"] / row["pred_count"] if row["pred_count"] else None
    row["fits"] = row["mem_pred_gib"] <= cluster.memory_per_device / 2**30
    if h100 and row["status"] == "time limit" and rhino:
        row["note"] += "; H100 search not run (M8 search hit the limit)"
    elif h100:
        try:
            low_h, row["search_s_h100"], note_h = _lower(step, args, mesh, H100, level,
                                                         H100.memory_per_device if rhino else None, o3_limit)
            row["step_ms_h100"] = low_h.plan.cost.total_s * 1e3
            row["mem_pred_gib_h100"] = low_h.plan.cost.memory_bytes / 2**30
        except WallTimeLimit:
            note_h = f"search stopped after {2 * o3_limit:g} s wall time"
        if note_h:
            row["note"] = (row["note"] + "; " if row["note"] else "") + "H100: " + note_h
    row["_lowered"] = lowered
    return row


def run_case(name, model, preset, cfg, concrete: bool, o3_limit: float, log, targets) -> list[dict]:
    """Every target x method of one model preset. The tiny presets (`concrete`) run on the CPU only:
    they are there to be run and compared with one device, which described GPUs cannot do. O3 is
    not searched for the GPU where it hit its time limit on the CPU's mesh of that shape (another
    45-90 s that would end the same way), nor on a target without `o3` (`benchmarks/run.py`'s
    docstring says why)."""
    rows = []
    reference = jax.jit(model.make_train_step(cfg))(*model.example(cfg)) if concrete else None
    gpu = any(t.compiler == "gpu" for t in targets)
    o3_limited = set()  # mesh labels where the CPU's O3 search hit its time limit
    for target in targets:
        if concrete and target.compiler == "gpu":
            continue
        mesh = target.mesh()
        o2 = None
        methods = list(RHINO) + [LIMITED] * concrete + [b for b in B.BASELINES if B.BASELINES[b].mesh_rank == len(target.shape)]
        for method in methods:
            start = time.perf_counter()
            skip = method == "rhino_jax O3" and (
                "not searched on this mesh (see the script's docstring)" if not target.o3 else
                "not searched: O3 hit its time limit on the CPU's mesh" if target.label in o3_limited else "")
            if skip:
                row = dict(method=method, mesh=target.label, compiler=target.compiler, cluster=target.cluster.name,
                           status="time limit" if target.o3 else "skipped", note=skip)
            else:
                try:
                    row = measure(model, cfg, target, mesh, method, concrete=concrete, o3_limit=o3_limit,
                                  reference=reference, o2_result=o2,
                                  h100=not concrete and not gpu and target.compiler == "cpu")
                except Exception as e:  # a failure is a result: record it and go on
                    row = dict(method=method, mesh=target.label, compiler=target.compiler, cluster=target.cluster.name,
                               status="error",
                               note=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}" if str(e) else type(e).__name__)
                    traceback.print_exc()
            row.update(model=name, preset=preset, wall_s=time.perf_counter() - start)
            if method == "rhino_jax O2" and "_lowered" in row:
                o2 = (row["_lowered"], row)
            if method == "rhino_jax O3" and target.compiler == "cpu" and row["status"] == "time limit":
                o3_limited.add(target.label)
            rows.append(row)
            log(row)
        for r in rows:  # free the compiled programs of this mesh
            r.pop("_lowered", None)
    return rows


def sharded_summary(plan) -> list[str]:
    """Parameters and Adam moments the plan does not replicate, grouped over layers and over
    (parameter, mu, nu): e.g. "layers[*].mlp.fc1_w ×24: mu+nu [devices, -] (768 MiB)", largest first."""
    groups: dict[tuple[str, str], dict] = {}
    for path, role, shape, dtype, spec in zip(plan.arg_paths, plan.arg_roles, plan.arg_shapes, plan.arg_dtypes,
                                              plan.arg_specs):
        if role not in ("parameter", "optimizer_state") or spec.is_replicated():
            continue
        keys = re.findall(r"\['([^']*)'\]|\[(\d+)\]", re.sub(r"^arg\[\d+\]", "", path))
        names = [k or "*" for k, _ in keys]  # list indices (layers) become *
        which = "params" if role == "parameter" else names[0] if names[0] in ("mu", "nu") else "opt"
        leaf = ".".join(n if n != "*" else "[*]" for n in (names if which == "params" else names[1:]))
        leaf = leaf.replace(".[*]", "[*]")
        g = groups.setdefault((leaf, str(spec)), {"which": set(), "bytes": 0, "paths": set()})
        g["which"].add(which)
        g["bytes"] += math.prod(shape) * np.dtype(dtype).itemsize
        g["paths"].add(re.sub(r"^arg\[\d\](\['(mu|nu)'\])?", "", path))
    order = {"params": 0, "mu": 1, "nu": 2, "opt": 3}
    ranked = sorted(groups.items(), key=lambda kv: -kv[1]["bytes"])
    return [f"{leaf} ×{len(g['paths'])}: {'+'.join(sorted(g['which'], key=order.get))} {spec} "
            f"({g['bytes'] / 2**20:.0f} MiB)" for (leaf, spec), g in ranked]


def strong_scaling(layers: int | None, log) -> list[dict]:
    """Rhino §7.3: GPT-Medium on 2, 4 and 8 devices (M8, memory limit = 32 GiB), next to the
    data-parallel and ZeRO baselines under the same cost model."""
    model = MODELS["gpt"]
    cfg = dataclasses.replace(model.PRESETS["GPT-Medium"], batch=STRONG_SCALING_BATCH)
    if layers:
        cfg = dataclasses.replace(cfg, n_layers=layers)
    args = model.example(cfg, abstract=True)
    rows = []
    for n in (2, 4, 8):
        mesh = _mesh((n,), ("devices",))
        for method in ("rhino_jax O2", "data parallel", "ZeRO-2", "ZeRO-3"):
            rhino = _is_rhino(method)
            step = model.make_train_step(cfg) if rhino else B.BASELINES[method].build(model, cfg, mesh)
            lowered, search_s, note = _lower(step, args, mesh, M8, "O2", M8.memory_per_device if rhino else None,
                                             60.0)
            plan = lowered.plan
            kinds = plan.collective_summary()
            row = dict(devices=n, method=method, search_s=search_s, note=note, step_ms=plan.cost.total_s * 1e3,
                       compute_ms=plan.cost.compute_s * 1e3, comm_ms=plan.cost.comm_s * 1e3,
                       pred_mib=sum(c.bytes for c in plan.collectives) / 2**20,
                       mem_pred_gib=plan.cost.memory_bytes / 2**30,
                       kinds={k: [v[0], v[1] / 2**20] for k, v in kinds.items()},
                       sharded=sharded_summary(plan),
                       not_replicated=len(plan.search_stats.not_replicated),
                       layers=cfg.n_layers)
            if rhino and n == 8:
                row["report"] = plan.report(max_tensors=10)
            rows.append(row)
            log(row)
    return rows


def search_vs_layers(layer_counts, o3_limit: float, log) -> list[dict]:
    """Search time (lowering included) of GPT-Medium-wide models of increasing depth, O2 and O3."""
    model = MODELS["gpt"]
    mesh = _mesh((8,), ("devices",))
    rows = []
    for layers in layer_counts:
        cfg = dataclasses.replace(model.PRESETS["GPT-Medium"], batch=8, n_layers=layers)
        args = model.example(cfg, abstract=True)
        for level in ("O2", "O3"):
            lowered, seconds, note = _lower(model.make_train_step(cfg), args, mesh, M8, level, None, o3_limit)
            s = lowered.plan.search_stats
            rows.append(dict(layers=layers, opt=level, search_s=seconds, solve_s=s.solve_s, ops=s.ops,
                             ilp_vars=s.ilp_vars, step_ms=lowered.plan.cost.total_s * 1e3, note=note))
            log(rows[-1])
    return rows
