"""The zoo's benchmark: every model of the zoo x mesh x method, planned by rhino_jax and by the
expert baselines of `benchmarks/baselines.py`, all through the same API and cost model, compiled by
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
import platform  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from collections import defaultdict  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import rhino_jax as rj  # noqa: E402
from benchmarks import baselines as B  # noqa: E402
from benchmarks import compilers  # noqa: E402
from benchmarks.compilers import COMPILERS, KIND_ABBR  # noqa: E402
from benchmarks.models import MODELS, sharding_memory_limit  # noqa: E402
from rhino_jax.runtime.compiled.compiled_cost import price_compiled  # noqa: E402
from rhino_jax.search.cluster import get_cluster  # noqa: E402

HERE = pathlib.Path(__file__).parent
M8, H100 = rj.M8_V100, rj.H100_8X
RHINO = ("rhino_jax O2", "rhino_jax O3")
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


def _is_rhino(method: str) -> bool:
    """A rhino_jax search (RHINO or LIMITED), not a pinned baseline."""
    return method.startswith("rhino_jax")

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


# ------------------------------------------------------------------------------ strong scaling

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


# ---------------------------------------------------------------------------------- report

def _fmt(v, digits=3):
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    if isinstance(v, float):
        if math.isnan(v):
            return "—"
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.2e}"
        return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


COLUMNS = [("mesh", "mesh"), ("method", "method"), ("status", "status"), ("search_s", "search s (M8)"),
           ("step_ms", "step ms M8"), ("compute_ms", "compute ms"), ("comm_ms", "comm ms"),
           ("step_ms_h100", "step ms H100"), ("samples_per_s", "samples/s M8"), ("pred_mib", "pred MiB"),
           ("pred_count", "pred colls"), ("hlo_count", "HLO colls"), ("count_fidelity", "HLO/pred colls"),
           ("hlo_mib", "HLO MiB"), ("fidelity", "HLO/pred"), ("mem_pred_gib", "mem pred GiB"), ("mem_hlo_gib", "mem HLO GiB"), ("fits", "fits 32 GiB")]
# The GPU compile's columns: predicted under the H100 preset of the row's mesh, compiled for described
# H100s, priced from that HLO (`price_compiled`) as its schedule runs and serially; `kinds` is
# predicted -> compiled per collective kind.
GPU_COLUMNS = [("mesh", "mesh"), ("method", "method"), ("status", "status"), ("search_s", "search s (H100)"),
               ("step_ms", "step ms H100 pred"), ("priced_ms", "priced ms (GPU HLO, overlapped)"),
               ("priced_serial_ms", "priced ms serially"), ("priced_compute_ms", "priced compute ms"),
               ("priced_comm_ms", "priced comm ms"), ("priced_exposed_ms", "of it exposed ms"),
               ("priced_over_pred", "priced/pred"), ("pred_count", "pred colls"), ("hlo_count", "HLO colls"),
               ("count_fidelity", "HLO/pred colls"), ("pred_mib", "pred MiB"), ("hlo_mib", "HLO MiB"),
               ("fidelity", "HLO/pred"), ("kinds", "per kind: pred → HLO (count/MiB)"),
               ("mem_pred_gib", "mem pred GiB"), ("mem_hlo_gib", "mem HLO GiB"), ("fits", "fits 80 GiB"),
               ("compile_s", "GPU compile s")]
TINY_COLUMNS = [("mesh", "mesh"), ("method", "method"), ("status", "status"), ("search_s", "search s"),
                ("step_ms", "step ms M8"), ("pred_mib", "pred MiB"), ("pred_count", "pred colls"),
                ("hlo_count", "HLO colls"), ("count_fidelity", "HLO/pred colls"), ("hlo_mib", "HLO MiB"),
                ("fidelity", "HLO/pred"), ("max_abs_diff", "max |Δ| vs 1 device")]


def _compiler(r) -> str:
    return r.get("compiler", "cpu")  # rows of runs before the GPU targets are the CPU's


def _kinds_cell(r) -> str:
    """'AR 25/581→25/1161, AG 3/232→3/232': each kind's predicted then compiled count/MiB."""
    pred, hlo = r.get("pred_kinds") or {}, r.get("hlo_kinds")
    if hlo is None:
        return "—"
    cell = lambda nb: f"{nb[0]}/{nb[1] / 2**20:.0f}" if nb else "0"  # noqa: E731
    return ", ".join(f"{KIND_ABBR[k]} {cell(pred.get(k))}→{cell(hlo.get(k))}" for k in KIND_ABBR
                     if k in pred or k in hlo) or "none"


def _skipped(r) -> bool:
    """A baseline written for other models or another mesh rank (listed under the table, not in it)."""
    return r["status"] == "n/a" and ("applies to" in r["note"] or "-D plan" in r["note"])


def _table(rows, columns) -> list[str]:
    lines = ["| " + " | ".join(h for _, h in columns) + " | note |", "|" + "---|" * (len(columns) + 1)]
    skipped = sorted({f"{r['method']} ({r['note']})" for r in rows if _skipped(r)})
    rows = [r for r in rows if not _skipped(r)]
    for r in rows:
        cells = []
        for k, _ in columns:
            if k == "kinds":
                cells.append(_kinds_cell(r))
            elif k == "fits":
                cells.append(_fmt(r.get("fits", r.get("fits_m8"))))  # fits_m8: results.json before the GPU rows
            else:
                cells.append(_fmt(r.get(k)) if k not in ("mesh", "method", "status") else str(r.get(k)))
        lines.append("| " + " | ".join(cells) + f" | {r.get('note', '')} |")
    if skipped:
        lines += ["", "Not applicable here: " + "; ".join(skipped) + "."]
    return lines


def _h100_ms(r) -> float | None:
    """A row's predicted step under the H100 preset: a GPU row's own search, or the second search
    of a CPU row (made when no GPU target runs)."""
    return r.get("step_ms") if _compiler(r) == "gpu" else r.get("step_ms_h100")


# Goal columns: (heading, which rows, the value compared).
GOAL_MEASURES = (("M8 predicted", "cpu", lambda r: r.get("step_ms")),
                 ("H100 predicted", "h100", _h100_ms),
                 ("H100 priced from GPU HLO, overlapped", "gpu", lambda r: r.get("priced_ms")),
                 ("H100 priced from GPU HLO, serially", "gpu", lambda r: r.get("priced_serial_ms")))


def goals(rows) -> tuple[list[str], dict]:
    """The goals on the paper-size rows, per model and mesh: rhino_jax's best step over the
    best baseline's, predicted under M8 (CPU rows) and H100 (the GPU rows' searches, else the CPU
    rows' second searches), and priced from the programs compiled for described H100s, as their
    schedules run and serially."""
    lines, verdict = [], {}
    by_case = defaultdict(list)
    for r in rows:
        if r.get("kind") == "paper":
            by_case[(r["model"], r["mesh"])].append(r)
    heads = [h for h, _, _ in GOAL_MEASURES]
    lines += ["| model | mesh | " + " | ".join(f"{h}: best rhino_jax ms | {h}: best baseline ms | ratio"
                                               for h in heads) + " | never worse | strictly better |",
              "|---|---|" + "---|---|---|" * len(heads) + "---|---|"]

    def best(rs, value):
        rs = [r for r in rs if value(r) is not None]
        return min(rs, key=value) if rs else None

    def cell(r, value, fits=False):
        if r is None:
            return "—"
        mark = "" if not fits or r.get("fits", r.get("fits_m8", True)) else ", > 32 GiB"
        return f"{value(r):.4g} ({r['method']}{mark})"

    f = lambda q: "—" if q is None else f"{q:.3f}"  # noqa: E731
    for (model, mesh), rs in by_case.items():
        ok = [r for r in rs if r["status"] in ("ok", "time limit")]
        gpu = any(_compiler(r) == "gpu" for r in ok)
        cells, out = [], []
        for head, which, value in GOAL_MEASURES:
            pick = {"cpu": "cpu", "gpu": "gpu", "h100": "gpu" if gpu else "cpu"}[which]
            mine = [r for r in ok if _compiler(r) == pick]
            r, b = best([r for r in mine if _is_rhino(r["method"])], value), best(
                [r for r in mine if not _is_rhino(r["method"])], value)
            ratio = value(r) / value(b) if r is not None and b is not None else None
            out.append((r, b, ratio, None if ratio is None else ratio <= 1 + 1e-9,
                        None if ratio is None else ratio < 1 - 1e-3))
            cells += [cell(r, value, which == "cpu"), cell(b, value, which == "cpu"), f(ratio)]
        verdict[(model, mesh)] = out
        lines.append(f"| {model} | {mesh} | " + " | ".join(cells) + " | "
                     + ", ".join(_fmt(o[3]) for o in out) + " | " + ", ".join(_fmt(o[4]) for o in out) + " |")
    lines += ["", "ratio = rhino_jax / best baseline (below 1: rhino_jax faster); never worse / strictly better in "
              "the order of the columns (M8, H100 predicted, H100 priced overlapped, then serially; — where not run). \"> 32 GiB\": the plan's "
              "predicted memory exceeds M8's device memory (for rhino_jax: its memory-limited search found no plan "
              "within it, see the notes). The 2x8 mesh (two hosts) is compiled for the GPU only."]
    return lines, verdict


def _fidelity_lines(rows) -> list[str]:
    """Per compiler: plans whose compiled collective bytes and counts are within ±10 % of predicted."""
    L = []
    for compiler in COMPILERS:
        fid = [r for r in rows if _compiler(r) == compiler and r.get("fidelity") is not None
               and r["status"] in ("ok", "time limit")]
        if not fid:
            continue
        how = f"predicted as XLA's {compiler.upper()} combiners merge them"
        for key, what in (("fidelity", "bytes"), ("count_fidelity", "ops")):
            have = [r for r in fid if r.get(key) is not None]
            bad = [r for r in have if abs(r[key] - 1) > 0.10]
            L += [f"{compiler.upper()} compile, fidelity of collective {what} (compiled / {how}) within ±10 %: "
                  f"{len(have) - len(bad)} of {len(have)} plans" + (": all." if not bad else "; outside: " + ", ".join(
                      f"{r['model']} {r['mesh']} {r['method']} ({r[key]:.2f})" for r in bad) + "."), ""]
    return L


def render(rows, scaling, layer_rows, out: pathlib.Path, quick: bool, started: float, minutes=None,
           argv=None, kept_from=None) -> str:
    minutes = (time.perf_counter() - started) / 60 if minutes is None else minutes
    command = " ".join(["python -m benchmarks.run", *(argv if argv is not None else ["--quick"] * quick)])
    kept = (f" What it did not rerun is kept from `{' '.join(['python -m benchmarks.run', *kept_from])}`."
            if kept_from is not None else "")
    L = ["# rhino_jax vs expert baselines", "",
         f"Written by `{command}` on {datetime.date.today()}; "
         f"jax {jax.__version__}, {platform.platform()}, {os.cpu_count()} CPU cores, 8 emulated CPU devices "
         f"(XLA host platform); whole run {minutes:.1f} min.{kept}", "",
         "Everything is planned by `rj.parallelize` and compiled by XLA's SPMD partitioner. Times are the cost "
         "model's predictions (per step, no compute/communication overlap) under the `m8-v100` preset (Rhino's "
         "M8: 8 V100-32GB, NVLink) and, from a separate search, under `8x-h100`; the CPU never runs the "
         "paper-size programs. The baselines (`benchmarks/baselines.py`) are expert plans pinned with "
         "`rj.annotate` on parameters, optimizer state, batch and activations; the search fills in what the "
         "pins leave open, under the same cost model. The baselines are SPMD only, so the manual \"3-D\" plan "
         "is 2-D: DP x TP (pipelines are compared in `benchmarks/controller.md`).", "",
         "Sizes: each model's heading says which paper configuration it is and what we changed. To keep the "
         "CPU rows under half an hour on 2 cores (about nine plans compiled per model and mesh), GPT, MoE, BERT and "
         "Wide-ResNet are planned and compiled at half their depth; VGG19 and U-Net at full size. The "
         "strong-scaling and search-time sections use GPT-Medium's full 24 layers (planned, not compiled). "
         "Compiles use `--xla_backend_optimization_level=0` (same HLO, a third less CPU time).", "",
         "Columns: search s = lowering + import + search (wall time, 2 shared cores); pred MiB = bytes the "
         "plan's collectives move per device (the buffer each collective works on); HLO colls / HLO MiB = "
         "count and bytes of the collectives in the compiled program; HLO/pred = fidelity (goal: within "
         "±10 %); mem pred = the plan's per-device peak estimate; mem HLO = arguments + outputs + "
         "temporaries − aliased from the compiled program's buffer assignment (CPU XLA: no rematerialization, "
         "so temporaries run high); fits 32 GiB = mem pred within M8's device memory. rhino_jax searches with "
         "`memory_limit_bytes` = device memory (32 GiB M8, 80 GiB H100); the baselines are not limited, only "
         "flagged. `n/a`: the baseline does not apply (skipped, not faked).", ""]
    if any(_compiler(r) == "gpu" for r in rows):
        L += ["GPU rows (paper sizes only; the tables' second half): the same plans and baselines compiled by XLA's "
              "GPU compiler (jax's CUDA plugin, compile-only) for described H100 SXM devices (`rj.gpu_topology`), "
              "meshes 8 and 2x4 on one host of 8, 2x8 on two hosts of 8 (the outer axis across the hosts); planned "
              "for `8x-h100` (2x8: `8x-h100-2hosts`), rhino_jax with `memory_limit_bytes` 80 GiB; predicted "
              "collectives combined as XLA's GPU combiners merge them; every program priced from its compiled HLO "
              "by `compiled_cost.price_compiled` (priced ms: compute from XLA's generic cost analysis of each kernel "
              "of the GPU HLO at its own roofline plus the preset's launch per kernel run, α-β time of each compiled "
              "collective, the program replayed as XLA scheduled it: an asynchronous collective runs beside the "
              "kernels between its start and its done, a synchronous one blocks; 'exposed' is the time compute "
              "waited on communication; serially: compute plus communication, the price before 2026-11-29); mem HLO is the GPU compiler's buffer "
              "assignment (it rematerializes towards 80 GiB). Nothing runs on described devices. The CPU rows' "
              "H100 column is then empty: the GPU rows' search is the H100 prediction.", ""]
    goal_lines, verdict = goals(rows)
    L += ["## Goals", ""] + goal_lines + [""]
    L += _fidelity_lines(rows)
    models = list(dict.fromkeys(r["model"] for r in rows))
    for m in models:
        paper = [r for r in rows if r["model"] == m and r.get("kind") == "paper"]
        tiny = [r for r in rows if r["model"] == m and r.get("kind") == "tiny"]
        L += [f"## {m}", ""]
        if paper:
            name, over, why = PAPER[m]
            over_text = ", ".join(f"{k}={v}" for k, v in over.items())
            L += [f"### {paper[0]['preset']}" + (f" ({over_text})" if over_text else "") + f" — {why}", ""]
            cpu = [r for r in paper if _compiler(r) == "cpu"]
            gpu = [r for r in paper if _compiler(r) == "gpu"]
            if cpu:
                L += ["Compiled by XLA's CPU compiler (8 emulated devices), planned for M8:", ""]
                L += _table(cpu, COLUMNS) + [""]
            if gpu:
                L += ["Compiled by XLA's GPU compiler for described H100s (8 on one host; 2x8: 16 on two hosts), "
                      "planned for 8x-h100 (2x8: 8x-h100-2hosts) and priced from the compiled HLO:", ""]
                L += _table(gpu, GPU_COLUMNS) + [""]
        if tiny:
            L += ["### tiny preset: run on the 8 devices, compared with jax.jit on one device", ""]
            L += _table(tiny, TINY_COLUMNS) + [""]
    if scaling:
        L += strong_scaling_section(scaling)
    if layer_rows:
        L += ["## Search time vs layers (GPT-Medium width, batch 8, mesh (8,), M8)", "",
              "| layers | opt | ops | ILP vars | solve s | search s | step ms | note |", "|---|---|---|---|---|---|---|---|"]
        L += [f"| {r['layers']} | {r['opt']} | {r['ops']} | {r['ilp_vars']} | {r['solve_s']:.2f} | "
              f"{r['search_s']:.2f} | {r['step_ms']:.4g} | {r['note']} |" for r in layer_rows]
        L += ["", "![search time](search_time.png)", ""]
    L += ["## Plots", "", "![predicted throughput](throughput.png)", ""]
    L += NOTES
    return "\n".join(L) + "\n"


# Hand-written (2026-11-23, revised 2026-11-25 against the tree of that day's run): what the numbers above rest on.
# Check them against the tables after a rerun on a newer rhino_jax.
NOTES = [
    "## Notes: what limits these numbers (rhino_jax as of this run)", "",
    "- **Pinned plans are completed by the search.** A baseline pins parameters, moments, batch and the "
    "model's `constrain` sites; the ops in between are planned by rhino_jax under the same cost model. "
    "On the tiny presets the completions are not textbook (data parallel gathers some 16-64 KiB "
    "activations in the backward pass, Megatron gathers the 8 KiB vocabulary-split table): the xfail "
    "test in `tests/test_baselines.py`. At these sizes latency dominates the cost model.",
    "- **A value read by several cones is moved once** (since 2026-11-25): it is read through a hub "
    "(search/assembly.py `add_hubs`), a unit of no cost whose strategies are the value's layouts, so the "
    "ILP pays the move to the hub's layout once and each reader cone from there, as the plan "
    "(`_shared_path`) and XLA do. Before, the ILP charged the move once per reader cone (up to about 1 % "
    "above the plan's cost; on a Flax step with global-norm clipping the embedding gradient's all-reduce "
    "three times, enough to pass over data parallelism, `THIRD_PARTY.md`). It is exact when the readers "
    "share one layout; readers in several layouts pay from the hub's. Hubs add cones (about 30 % on "
    "GPT-Medium) and search time.",
    "- **Since the previous run (2026-11-25, second)**: `solver_time_limit_s` is one deadline for the whole "
    "search (build, every stage, memory-limit trials), where each solve had its own. Wide-ResNet (2, 4)'s "
    "exact tying and its layers-alike tying are both too large for one ILP: O2 now runs windows from the "
    "replicated plan (9 s, 531 ms predicted) and then the whole ILP (its LP relaxation alone 38 s) in the "
    "time left, 52 s in all for 509 ms; O3 at its 45 s limit keeps the windows' plan (531 ms) where it "
    "found no plan within 90 s before; the H100 search is then skipped. O3 on GPT (2, 4) reached its "
    "untied ILP's plan within the limit this time (133.2 vs O2's 133.4 ms), and stops at MoE's with "
    "O2's plan. This run's machine was faster than the previous one's (21 min in all, 34 min before; the "
    "same search code): compare search times within one run only.",
    "- **Fixed since the first 2026-11-23 run**, which had MoE on (2, 4) at 1.14-1.18: a reshard is now a "
    "path of steps that XLA compiles exactly as priced, and the rewrite pins every intermediate layout "
    "(`search/collectives.py` `reshard_path`). Left to itself between two distant layouts, XLA often "
    "replicates the tensor (\"involuntary full rematerialization\") or adds collective-permutes (a gather or "
    "all-to-all of a dim's major axis): 34 of the 121 layout pairs of a (16, 32) tensor on (2, 4) compiled "
    "otherwise than priced; now every pair of rank 2 and 3 compiles to the priced collectives "
    "(`tests/test_collectives.py`); the path into a user's pin (a baseline's) and into a donated "
    "output's layout is pinned too (16 of 56 pinned argument/result pairs compiled otherwise). A partial "
    "sum is reduce-scattered only into a dim that still divides (MoE's combine cut 4 groups 8 ways). Earlier (2026-11-22 run): rules for `select_and_scatter`, "
    "`reverse` and a vocabulary-split lookup; cone DP ties; axes left in another order priced as permutes; "
    "partial sums settled as priced; stride changes priced as XLA compiles them.",
    "- **Before that (2026-11-25, first run)**: (1) the one-device step run whole on every device "
    "(each cone's replicated strategy) is the search's first incumbent: on the tiny presets the "
    "relaxation's rounding had stopped within one collective launch of its bound at sharded plans up to "
    "27 % costlier than replicated under the model's own prices (VGG19 (2, 4) 0.0267 vs 0.0210 ms, BERT "
    "(2, 4) 0.0509 vs 0.0370); every tiny preset is now replicated when unlimited. (2) A solve within one "
    "launch of its bound stops there (\"near-optimal\") without branch-and-bound, which found nothing "
    "better on the tiny presets and took most of their time: the memory-limited tiny searches on (2, 4) "
    "took up to 282 s (BERT), now at most 58 s. (3) O2 solves the untied ILP after the tied one when tying saves little "
    "(`search/levels.py`). (4) An all-gather along a dim with a longer dim before it pays the copy XLA "
    "adds to put its result back in the program's layout (`collectives._gather`): predicted steps rose by "
    "up to 0.3 % (Wide-ResNet (8,) 509.5 -> 510.9 ms). (5) The priced baselines in `THIRD_PARTY.md` no "
    "longer count collectives' buffers as memory traffic (not used here).",
    "- **Earlier the same day**: (1) a partial sum is settled as XLA's partitioner "
    "compiles it, one all-reduce of the whole local buffer per dim its axes are scattered into (a "
    "reduce-scatter only when there is one such dim), then the axes scattered nowhere on the slice "
    "(`search/collectives.py` `_settle_step`): GPT-Medium on (2, 4) had its gradients scattered into "
    "[data, model], which compiled to two full all-reduces where one reduce-scatter was priced (fidelity "
    "1.39), and MoE O3 on (2, 4) likewise (1.17); now the search settles them into one dim. (2) A "
    "settled layout pinned before a stride change is moved from as any layout (the stride change was "
    "priced free: MoE expert parallel's count fidelity 1.16). (3) The hub above. Every compiled plan is "
    "now within ±10 % of its predicted collective bytes and counts (tables above).",
    "- **Earlier (2026-11-23/24 runs)**: the ILP solves its LP relaxation first and stops there "
    "when it is integral; a value read in several layouts is priced as XLA moves it, once per layout from "
    "the nearest layout reached; a sum split on several loops is priced as XLA compiles it, one full "
    "all-reduce per loop.",
    "- **The memory limit (§4.4) constrains only parameters and optimizer states**: activations are "
    "not forced off replication. Every model here fits without that; a model whose activations alone "
    "overflow the device would get `MemoryLimitError` although a plan may exist.",
    "- **Fidelity** compares the buffers of the compiled collectives with the predicted ones: both count an "
    "all-reduce's buffer once and a reduce-scatter's full operand, so it checks that XLA did what the plan "
    "said, not the bytes on the wire. XLA's partitioner writes a reduce-scatter as an all-reduce of the "
    "same buffer and a local slice, which the GPU pipeline (ReduceScatterCreator) merges and the CPU's "
    "leaves as is: here predicted reduce-scatters compile to all-reduces, the bytes agree, the kind does not.",
    "- **Agreement with one device** (tiny rows): see the max |Δ| column. Unlimited, rhino_jax rightly "
    "replicates the tiny models (no collectives: a check that cannot fail), so each tiny table also has "
    "rhino_jax O2 under a memory limit that the replicated plan exceeds by half of what sharding all "
    "parameters and Adam moments would save (`models.sharding_memory_limit`): that plan shards state "
    "and runs with collectives. Its search takes 0.5-2.3 s on (8,) and 5-43 s on (2, 4) (§4.4: one ILP solve "
    "per trial k, about 2 log2(k) of them; a tiny model's ILP on (2, 4) is large, BERT's 115,000 variables). Adam's first step moves a weight "
    "by about lr·sign(g), so a weight whose gradient is ~1e-6 can differ by 2·lr where float rounding in "
    "the split reductions flips the sign (Wide-ResNet's Megatron and DP x TP rows). Not a plan error.",
    "- **Memory**: `mem HLO` is the CPU compiler's buffer assignment (no rematerialization, CPU scheduling); "
    "it is reported, not compared with a GPU. `mem pred` decides \"fits 32 GiB\".",
    "- **Baselines' own choices** are documented in `benchmarks/baselines.py` (ZeRO's persistence threshold, "
    "Megatron leaving the fused [q | k | v] weight to the search, the convolution column/row pairing). "
    "They are SPMD only (the 3-D plan is DP x TP); pipelines are compared in `benchmarks/controller.md`.",
    "- **Calibration**: the compute term uses the presets' datasheet-derived constants; "
    "`python -m benchmarks.calibrate` fits them on a GPU: on one H100 the fit is within 2 % of them, but no "
    "time per kernel is charged, so small steps run 2-5x their prediction (`benchmarks/gpu.md`).",
    "",
]


PAPER_SAYS = {2: "data parallel", 4: "DP, one variable of decoder layer 0 sharded (slightly less data moved)",
              8: "Q/K/V weights and their optimizer state sharded, ZeRO-2-like (P_os+g); the rest DP; "
                 "20 % less data moved than DP (the paper: \"20% data transfer size than DP\")"}


def _wire_mib(kinds: dict, n: int) -> float:
    """MiB each device sends in ring collectives over n devices: an all-reduce of S bytes sends
    2 S (n-1)/n, an all-gather, reduce-scatter or all-to-all S (n-1)/n of its (full) buffer."""
    return sum(b * (2 if k == "all-reduce" else 1) * (n - 1) / n for k, (_, b) in kinds.items())


def strong_scaling_section(scaling) -> list[str]:
    layers = scaling[0]["layers"]
    L = [f"## Strong scaling (Rhino §7.3): GPT-Medium ({layers} layers, batch {STRONG_SCALING_BATCH}) on 2/4/8 "
         "devices, M8, memory limit 32 GiB", "",
         "rhino_jax O2 next to data parallel and ZeRO under the same cost model (plans only, not compiled). "
         "buffer MiB = summed buffers of the predicted collectives (an all-reduce counts its buffer once, "
         "ZeRO's reduce-scatter + all-gather count it twice); wire MiB = what each device sends in ring "
         "collectives (all-reduce 2(n-1)/n of its buffer, the others (n-1)/n), the paper's \"data transfer "
         "size\"; vs DP = wire MiB / data parallel's.", "",
         "| devices | method | step ms | compute ms | comm ms | buffer MiB | wire MiB | vs DP | mem GiB | collectives |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    dp = {r["devices"]: _wire_mib(r["kinds"], r["devices"]) for r in scaling if r["method"] == "data parallel"}
    for r in scaling:
        wire = _wire_mib(r["kinds"], r["devices"])
        ratio = wire / dp[r["devices"]] if dp.get(r["devices"]) else float("nan")
        kinds = ", ".join(f"{k} {n}×/{b:.0f} MiB" for k, (n, b) in sorted(r["kinds"].items()))
        L.append(f"| {r['devices']} | {r['method']} | {r['step_ms']:.4g} | {r['compute_ms']:.4g} | "
                 f"{r['comm_ms']:.4g} | {r['pred_mib']:.0f} | {wire:.0f} | {ratio:.2f} | {r['mem_pred_gib']:.2f} | "
                 f"{kinds} |")
    L += ["", "| devices | paper (Rhino §7.3) | rhino_jax O2 chooses: non-replicated parameters / Adam moments "
          "(grouped over layers, largest first) | why: rhino_jax − data parallel | memory limit forced |",
          "|---|---|---|---|---|"]
    for r in scaling:
        if r["method"] != "rhino_jax O2":
            continue
        shown = r["sharded"][:8] + ([f"... {len(r['sharded']) - 8} smaller groups"] if len(r["sharded"]) > 8 else [])
        what = "; ".join(shown) or "nothing: every parameter and moment replicated (data parallel)"
        base = next(d for d in scaling if d["devices"] == r["devices"] and d["method"] == "data parallel")
        why = (f"compute {r['compute_ms'] - base['compute_ms']:+.1f} ms, comm {r['comm_ms'] - base['comm_ms']:+.1f} ms, "
               f"memory {r['mem_pred_gib'] - base['mem_pred_gib']:+.1f} GiB (DP: {base['mem_pred_gib']:.1f} GiB)")
        forced = f"yes: {r['not_replicated']} tensors" if r["not_replicated"] else "no"
        L.append(f"| {r['devices']} | {PAPER_SAYS[r['devices']]} | {what} | {why} | {forced} |")
    L += ["", "How to read it: under the cost model, sharding a weight's Adam moments (mu, nu) lets each device "
          "update 1/n of the weight, and the update is memory-bound elementwise work over the weight and both "
          "moments; the gradient is then reduce-scattered into the shards and the weight all-gathered, which "
          "sends the same bytes on the ring as data parallelism's all-reduce (slightly fewer where the search "
          "also saves activation traffic). So the search shards the moments of the largest weights (ZeRO-2-like, "
          "Rhino's P_os+g) and keeps the weights replicated, at every size; compute falls by about the update's "
          "cost and memory by the moments' share. The vocabulary-sized embedding (200 MiB) is sharded with its "
          "moments (ZeRO-3-like). Where data parallelism does not fit 32 GiB (the \"DP: ... GiB\" figure), the "
          "memory limit forces the largest weights themselves off replication (\"memory limit forced\"). The "
          "paper reports plain DP at 2 devices and a single sharded variable at 4: it does not give the batch "
          "or the memory at which it planned, and our cost model already rewards the sharded update at 2 and 4 "
          "devices, so rhino_jax shards earlier than the paper's Rhino."]
    report = next((r.get("report") for r in scaling if r.get("report")), None)
    if report:
        L += ["", "The 8-device plan's report:", "", "```", report, "```"]
    return L + [""]


def plot(rows, layer_rows, out: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paper = [r for r in rows if r.get("kind") == "paper" and r.get("step_ms") and r["status"] in ("ok", "time limit")]
    # One bar pair per (model, method, mesh): M8 from the CPU row, H100 from the GPU row where there is one.
    entries: dict[tuple, dict] = {}
    for r in paper:
        e = entries.setdefault((r["model"], r["method"], r["mesh"]), dict(
            model=r["model"], method=r["method"], mesh=r["mesh"], preset=r["preset"], batch=r["batch"], m8=None,
            h1=None, fits=True))
        if _compiler(r) == "cpu":
            e["m8"], e["fits"] = r["step_ms"], r.get("fits", r.get("fits_m8", True))
        if _h100_ms(r) is not None and (e["h1"] is None or _compiler(r) == "gpu"):
            e["h1"] = _h100_ms(r)
    models = list(dict.fromkeys(e["model"] for e in entries.values()))
    if models:
        cols = 3
        nrows = math.ceil(len(models) / cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 4.2 * nrows), squeeze=False)
        for ax, m in zip(axes.flat, models):
            rs = [e for e in entries.values() if e["model"] == m]
            labels = [f"{e['method']}\n({e['mesh']})" for e in rs]
            x = np.arange(len(rs))
            base = [e for e in rs if not _is_rhino(e["method"])]
            best_m8 = max((e["batch"] / e["m8"] for e in base if e["m8"]), default=None)
            best_h1 = max((e["batch"] / e["h1"] for e in base if e["h1"]), default=None)
            m8 = [e["batch"] / e["m8"] / best_m8 if best_m8 and e["m8"] else 0 for e in rs]
            h1 = [e["batch"] / e["h1"] / best_h1 if best_h1 and e["h1"] else 0 for e in rs]
            colors = ["tab:red" if _is_rhino(e["method"]) else "tab:blue" for e in rs]
            ax.bar(x - 0.2, m8, 0.4, color=colors, label="m8-v100")
            ax.bar(x + 0.2, h1, 0.4, color=colors, alpha=0.45, label="8x-h100")
            ax.axhline(1.0, color="k", lw=0.8, ls="--")
            for xi, e in zip(x, rs):
                if not e["fits"]:
                    ax.text(xi - 0.2, 0.02, "> 32 GiB", rotation=90, va="bottom", ha="center", fontsize=7)
            ax.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
            ax.set(title=f"{m} ({rs[0]['preset']}): best baseline {(best_m8 or 0) * 1e3:.3g} / "
                         f"{(best_h1 or 0) * 1e3:.3g} samples/s (M8 / H100)",
                   ylabel="predicted throughput / best baseline's")
            ax.title.set_fontsize(9)
            ax.grid(alpha=0.3, axis="y")
        for ax in list(axes.flat)[len(models):]:
            ax.axis("off")
        from matplotlib.patches import Patch
        fig.legend(handles=[Patch(color="tab:red", label="rhino_jax, m8-v100"),
                            Patch(color="tab:red", alpha=0.45, label="rhino_jax, 8x-h100"),
                            Patch(color="tab:blue", label="baseline, m8-v100"),
                            Patch(color="tab:blue", alpha=0.45, label="baseline, 8x-h100")],
                   loc="upper center", ncol=4, fontsize=9, frameon=False)
        fig.tight_layout(rect=(0, 0, 1, 0.96))
        fig.savefig(out / "throughput.png", dpi=90)
        plt.close(fig)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    srch = [r for r in paper if _is_rhino(r["method"]) and r["mesh"] == "8" and _compiler(r) == "cpu"]
    ms = list(dict.fromkeys(r["model"] for r in srch))
    for k, level in enumerate(("O2", "O3")):
        vals = [next((r["search_s"] for r in srch if r["model"] == m and r["method"].endswith(level)), 0) for m in ms]
        ax1.bar(np.arange(len(ms)) + (k - 0.5) * 0.4, vals, 0.4, label=level)
    ax1.set_xticks(np.arange(len(ms)), ms)
    ax1.set(ylabel="search s (lowering included)", title="search time, paper sizes, mesh (8,), M8")
    ax1.legend()
    ax1.grid(alpha=0.3, axis="y")
    for level, marker in (("O2", "o"), ("O3", "s")):
        rs = [r for r in layer_rows if r["opt"] == level]
        ax2.plot([r["layers"] for r in rs], [r["search_s"] for r in rs], marker=marker, label=level)
    ax2.set(xlabel="layers", ylabel="search s (lowering included)", title="search time vs layers (GPT-Medium width)")
    ax2.grid(alpha=0.3)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(out / "search_time.png", dpi=90)
    plt.close(fig)


def _log(row) -> None:
    keep = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
            if not k.startswith("_") and k not in ("report", "sharded", "kinds")}
    print(keep, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--quick", action="store_true", help="tiny presets only, 2-layer strong scaling")
    parser.add_argument("--out", type=pathlib.Path, default=HERE)
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
                      data.get("minutes"), data.get("argv"), data.get("kept_from"))
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
                  kept_from=done["kept_from"])
    (opts.out / "RESULTS.md").write_text(text)
    plot(done["rows"], done["layers"], opts.out)
    print(text)


if __name__ == "__main__":
    main()
