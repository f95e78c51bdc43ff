"""The zoo's benchmark: every model of the zoo x mesh x method, planned by rhino_jax and by the
expert baselines of `benchmarks/fixtures/baselines.py`, all through the same API and cost model, compiled by
XLA's CPU compiler and by its GPU compiler.

python -m benchmarks.run [--models gpt moe ...] [--quick] [--out DIR] [--o3-limit S]
                         [--compiler cpu|gpu|both] [--meshes 8 2x4 2x8]
    → prints progress, writes DIR/RESULTS.md, DIR/results.json, DIR/throughput.png and
      DIR/search_time.png (DIR: benchmarks/ by default)

Per model: the tiny preset, planned, compiled and run on 8 emulated CPU devices and compared
with jax.jit on one device; and a paper-size preset (PAPER below), planned and compiled from
ShapeDtypeStructs only, never run. Meshes (8,) and (2, 4) of CPU devices (the 2-D baselines on
the latter; the GPU rows below add (2, 8)).
Methods: rhino_jax O2 and O3 (O3's whole search, model build included, stops at --o3-limit; a
wall-clock alarm at twice that catches an overrun; either is reported as "time limit"), on the tiny preset also O2 under
`models.sharding_memory_limit` (so that agreement with one device checks a sharded plan), and every
baseline that applies (`baselines.BASELINES`). For each: search time,
predicted step time under the m8-v100 preset (Rhino's M8: 8 V100 with NVLink) and, from a
second search, under 8x-h100; predicted and compiled collective bytes (fidelity = compiled /
predicted); per-device memory (predicted, and arguments + outputs + temporaries - aliased from
the compiled program); for the tiny preset, the largest absolute difference from one device.
rhino_jax searches with `memory_limit_bytes` = the preset's device memory (32 GiB on M8, 80 GiB
on H100); the baselines are pinned and only flagged when they exceed it.
Then Rhino §7.3's strong scaling (GPT-Medium on 2, 4 and 8 devices) and search time vs layers
(planned on CPU devices, not compiled).

GPU rows (`TARGETS`, compiler "gpu"): the paper-size preset's plans and baselines searched under
8x-h100 on 8 described H100s (`rj.gpu_topology`), meshes (8,) and (2, 4), and under
8x-h100-2hosts on 16 described H100s on two hosts, mesh (2, 8) (the 2-D baselines only); compiled
by XLA's GPU compiler (jax's CUDA plugin, compile-only, JAX_PLATFORMS=cpu) and priced from that
HLO by `compiled_cost.price_compiled` as its schedule runs (communication beside compute where
XLA issued it asynchronously; the serial sum beside it), beside the predicted step, collectives (as XLA's GPU
combiners merge them, per kind) and memory. Their search is the H100 prediction: the CPU rows'
second search under 8x-h100 runs only without GPU targets (--compiler cpu). What is compiled for
the GPU, and why (measured 2026-11-26 on 2 cores shared with two other jobs): a GPU compile is
not cheaper than the CPU's here but 1.4-6 times dearer (GPT-Medium at 12 layers: 18-27 s against
7-15 s on the CPU; MoE-16E data parallel 29 s against 9 s; WR-12B data parallel 64 s against 10 s.
XLA's GPU HLO passes take two thirds of it (18 of 27 s for MoE), PTX and ptxas the rest; both
compilers get --xla_backend_optimization_level=0, and ptxas's optimizations off saved nothing). So the GPU rows
compile the paper-size presets only (the tiny ones are for running against one device, which
described devices cannot do, and unlimited their plans replicate) at the same sizes as the CPU
rows, every baseline and O2 on all three meshes, O3 on (8,) and (2, 4) but not where it hit its
time limit on the CPU's mesh of that shape, and not on (2, 8) (there GPT's O3 stopped at the 45 s
limit with a 65 % gap and O2's plan). Measured: `--models gpt --no-strong-scaling` took 11.6 min
(tiny 1.5, GPT-Medium on the CPU 3.6, on the GPU 6.4 of which 0.8 for O3 on (2, 8), since
dropped); `--models wresnet --compiler gpu --no-strong-scaling` 15.5 min (WR-12B, the largest:
searches up to 86 s on (2, 4), compiles 31-74 s; 1.6 of it O3 on (2, 4), which a full run skips
after the CPU's O3 there hit its limit). Scaled by each model's compile times of the last run, a
full run is about 70 min on this machine shared with two other jobs (CPU rows ~28, GPU rows
~40, strong scaling and search time ~3), probably about an hour on 2 idle cores (not measured); `--meshes 8 2x4`
saves the two-host rows (~10 min), and --compiler cpu is the run as before.
--quick: tiny presets and the strong-scaling/search-time sections at 2 layers (a smoke run).
"""
import os

# LLVM's optimizations off: a third less CPU compile time, the same HLO (collectives, buffer sizes).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import datetime  # noqa: E402
from dataclasses import dataclass  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import rhino_jax as rj  # noqa: E402
from benchmarks import RESULTS, compilers  # noqa: E402
from benchmarks.compilers import COMPILERS  # noqa: E402
from benchmarks.fixtures import baselines as B  # noqa: E402
from benchmarks.fixtures.models import MODELS, sharding_memory_limit  # noqa: E402
from benchmarks.run_plot import plot  # noqa: E402
from benchmarks.run_report import RHINO, _compiler, _is_rhino, render  # noqa: E402
from rhino_jax.runtime.compiled.compiled_cost import price_compiled  # noqa: E402
from rhino_jax.search.cost.cluster import get_cluster  # noqa: E402


M8, H100 = rj.M8_V100, rj.H100_8X


# Tiny presets only: O2 under `sharding_memory_limit`, so that agreement with one device checks a
# sharded plan (unlimited, the search replicates a tiny model: the right plan, and a vacuous check).
LIMITED = "rhino_jax O2, memory-limited"


@dataclass(frozen=True)
class Target:
    """A mesh of one compiler's devices and the cluster its plans are searched for. cpu: XLA's CPU
    compiler on the emulated devices, m8-v100 (the plan's collectives predicted as the CPU combines
    them, to compare with what is compiled); gpu: XLA's GPU compiler for described H100s
    (`rj.gpu_topology`, `hosts` of 8), the H100 presets as they are, every program also priced
    from its compiled HLO (`compiled_cost.price_compiled`)."""

    compiler: str  # "cpu" | "gpu"
    shape: tuple[int, ...]
    names: tuple[str, ...]
    cluster: rj.Cluster
    hosts: int = 1
    o3: bool = True  # search (and compile) O3 here too

    @property
    def label(self) -> str:
        return "x".join(map(str, self.shape))

    def mesh(self):
        return rj.device_mesh(self.shape, self.names, compilers.devices(self.compiler, math.prod(self.shape),
                                                                        self.hosts))


_1D, _2D = ("devices",), ("data", "model")


TARGETS = (Target("cpu", (8,), _1D, M8), Target("cpu", (2, 4), _2D, M8),
           Target("gpu", (8,), _1D, H100), Target("gpu", (2, 4), _2D, H100),
           Target("gpu", (2, 8), _2D, get_cluster("8x-h100-2hosts"), hosts=2, o3=False))


def _configuration(r: dict) -> tuple:
    """What a partial rerun replaces as a whole: one model preset on one compiler's mesh."""
    return r.get("model"), r.get("preset"), _compiler(r), r.get("mesh")


def _order(r: dict) -> tuple:
    """Rows in the order a full run makes them: model, preset (tiny first), target, method."""
    target = next((i for i, t in enumerate(TARGETS) if (t.compiler, t.label) == (_compiler(r), r.get("mesh"))), 99)
    methods = [*RHINO, LIMITED, *B.BASELINES]
    return (list(MODELS).index(r["model"]) if r.get("model") in MODELS else 99, r.get("kind") != "tiny", target,
            methods.index(r["method"]) if r.get("method") in methods else 99)


# model -> (paper preset, overrides, why). Batches: the zoo's presets carry the full-parallelism
# (pipelined) global batches; without pipelining we use the paper's SPMD-only batches where it
# gives them (Tables 1, 2), raised to 8 so that 8 devices can split them.
# Depth is halved where the CPU compile of ~9 plans per model would take minutes (so the whole run
# stays under half an hour on 2 cores): layers repeat, so per-layer costs and the choice of plan
# carry over, absolute step times are about half. Full depth: GPT-Medium's 24 layers are searched
# in the strong-scaling and search-time sections.
PAPER = {
    "gpt": ("GPT-Medium", {"batch": 8, "n_layers": 12},
            "Table 1 (the §7.3 strong-scaling model) at 12 of its 24 layers; SPMD-only batch 4 raised to 8"),
    "moe": ("MoE-16E-2.4B", {"batch": 8, "n_layers": 8},
            "Table 2's 8-GPU row at 8 of its 16 layers (4 MoE layers of 16 experts); SPMD-only batch 8"),
    "vgg19": ("VGG19-8gpu", {}, "Table 3, 8 GPUs x 128 images, million-class classifier (full size)"),
    "wresnet": ("WR-12B", {"batch": 8, "depth": 50},
                "Table 4's 8-GPU row (channels 320, width 12) at depth 50 instead of 101: 5.1B parameters, "
                "too many to replicate in 32 GiB; global batch 4 raised to 8"),
    "unet": ("UNet-8gpu", {}, "Table 3, 8 GPUs x 16 images (full size)"),
    "bert": ("DNABert-8gpu", {"n_layers": 6}, "Table 3, 8 GPUs x 32 sequences, at 6 of its 12 layers"),
}


STRONG_SCALING_BATCH = 8


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
                                                f"{lowered.plan.search_stats.get('gap', float('nan')):.1%}")
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
        kept = f"limit {_size(limit)} ({len(plan.search_stats['not_replicated'])} largest states kept off replication)"
        row["note"] = "; ".join(n for n in (kept, row["note"]) if n)
    if row["note"].startswith("time limit") or "; time limit" in row["note"]:
        row["status"] = "time limit"
    s = plan.search_stats
    # predicted as the target's compiler combines the plan's collectives, to compare with its program
    predicted = plan.collective_summary(target.compiler)
    row.update(solve_s=s.get("solve_s"), ops=s.get("ops"), step_ms=plan.cost.total_s * 1e3,
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
    45-90 s that would end the same way), nor on a target without `o3` (the module docstring says
    why)."""
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
                       not_replicated=len(plan.search_stats.get("not_replicated", ())),
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
            rows.append(dict(layers=layers, opt=level, search_s=seconds, solve_s=s["solve_s"], ops=s["ops"],
                             ilp_vars=s["ilp_vars"], step_ms=lowered.plan.cost.total_s * 1e3, note=note))
            log(rows[-1])
    return rows


def _log(row) -> None:
    keep = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
            if not k.startswith("_") and k not in ("report", "sharded", "kinds")}
    print(keep, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--quick", action="store_true", help="tiny presets only, 2-layer strong scaling")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--o3-limit", type=float, default=45.0,
                        help="O3's solver_time_limit_s (s), for its whole search; a wall-clock alarm stops it at twice this")
    parser.add_argument("--no-strong-scaling", action="store_true")
    parser.add_argument("--render-only", action="store_true", help="rewrite RESULTS.md and the plots from "
                        "OUT/results.json")
    parser.add_argument("--only-strong-scaling", action="store_true", help="rerun the strong-scaling section "
                        "into OUT/results.json and render")
    parser.add_argument("--compiler", choices=(*COMPILERS, "both"), default="both",
                        help="which XLA compiler's targets to run (default both; the GPU's for paper sizes only)")
    meshes = list(dict.fromkeys(t.label for t in TARGETS))
    parser.add_argument("--meshes", nargs="+", choices=meshes, default=meshes, help="these mesh shapes only")
    parser.add_argument("--keep", action="store_true", help="keep what is not rerun (model x preset x compiler x "
                        "mesh rows, the strong-scaling and search-time sections) from OUT/results.json")
    argv = sys.argv[1:]
    opts = parser.parse_args(argv)
    targets = [t for t in TARGETS if opts.compiler in ("both", t.compiler) and t.label in opts.meshes]
    if not targets:
        parser.error(f"no target is compiled by {opts.compiler} on meshes {' '.join(opts.meshes)}; targets: "
                     + ", ".join(f"{t.compiler} {t.label}" for t in TARGETS))
    if not opts.render_only:
        compilers.check_gpu(parser, {t.compiler for t in targets})
    opts.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if opts.only_strong_scaling:
        data = json.loads((opts.out / "results.json").read_text())
        data["scaling"] = strong_scaling(2 if opts.quick else None, _log)
        (opts.out / "results.json").write_text(json.dumps(data, indent=1, default=str))
        opts.render_only = True
    if opts.render_only:
        data = json.loads((opts.out / "results.json").read_text())
        text = render(data["rows"], data["scaling"], data["layers"], opts.out, opts.quick, started,
                      data.get("minutes"), data.get("argv"), data.get("kept_from"), configs=PAPER,
                      scaling_batch=STRONG_SCALING_BATCH)
        (opts.out / "RESULTS.md").write_text(text)
        plot(data["rows"], data["layers"], opts.out)
        print(text)
        return
    rows, scaling, layer_rows = [], [], []
    kept = dict(rows=[], scaling=[], layers=[], argv=None)
    if opts.keep and (opts.out / "results.json").exists():
        kept = json.loads((opts.out / "results.json").read_text())

    def merged() -> dict:
        """This run's results, over what `--keep` keeps."""
        return dict(rows=sorted(compilers.rerun_over(kept["rows"], rows, _configuration), key=_order),
                    scaling=scaling or kept["scaling"], layers=layer_rows or kept["layers"],
                    kept_from=kept["argv"] if opts.keep else None)

    def save():
        data = dict(merged(), jax=jax.__version__, date=str(datetime.date.today()),
                    minutes=(time.perf_counter() - started) / 60, argv=argv)
        (opts.out / "results.json").write_text(json.dumps(data, indent=1, default=str))

    for name in opts.models:
        model = MODELS[name]
        cases = [("tiny", model.PRESETS["tiny"], True)]
        if not opts.quick:
            preset, over, _ = PAPER[name]
            cases.append((preset, dataclasses.replace(model.PRESETS[preset], **over), False))
        for preset, cfg, concrete in cases:
            print(f"== {name} {preset}", flush=True)
            for r in run_case(name, model, preset, cfg, concrete, opts.o3_limit, _log, targets):
                r["kind"] = "tiny" if concrete else "paper"
                rows.append(r)
            save()
    if not opts.no_strong_scaling and ("gpt" in opts.models):
        print("== strong scaling", flush=True)
        scaling = strong_scaling(2 if opts.quick else None, _log)
        save()
        print("== search time vs layers", flush=True)
        layer_rows = search_vs_layers([1, 2] if opts.quick else [2, 6, 12, 24], opts.o3_limit, _log)
        save()
    done = merged()
    text = render(done["rows"], done["scaling"], done["layers"], opts.out, opts.quick, started, argv=argv,
                  kept_from=done["kept_from"], configs=PAPER, scaling_batch=STRONG_SCALING_BATCH)
    (opts.out / "RESULTS.md").write_text(text)
    plot(done["rows"], done["layers"], opts.out)
    print(text)


if __name__ == "__main__":
    main()
