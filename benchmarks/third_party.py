"""Third-party-style train steps (`fixtures/third_party_models.py`), rhino_jax's plan
against hand plans compiled by plain jax, every program priced from its compiled HLO the same way
(`runtime.compiled.compiled_cost.price_compiled`), as XLA's CPU compiler and as its GPU compiler build it.

python -m benchmarks.third_party [--quick] [--models NAME ...] [--compiler cpu|gpu|both]
                                 [--meshes 8 2x4 2x8] [--out DIR] [--keep]
    → prints a table, writes DIR/THIRD_PARTY.md and DIR/third_party.json (DIR: benchmarks/results/)

Per model x target x cluster preset, where a target is a mesh of one compiler's devices (`TARGETS`):
- cpu: XLA's CPU compiler on the 8 emulated CPU devices, meshes (8,) and (2, 4), presets m8-v100
  and 8x-h100. The CPU compiler combines only all-reduces and writes reduce-scatters as all-reduces:
  both the search and the pricing take the preset with `backend="cpu"`, so that rhino_jax plans for
  the program that is really compiled and priced.
- gpu: XLA's GPU compiler (jax's CUDA plugin, compile-only) for described H100 SXM devices
  (`rj.gpu_topology`): 8 on one host, meshes (8,) and (2, 4), preset 8x-h100; 16 on two hosts,
  mesh (2, 8) (the outer axis across the hosts), preset 8x-h100-2hosts. The presets are taken as
  they are (backend "gpu"): this compiler forms reduce-scatters, combines all-gathers too and
  keeps bf16 collectives bf16, as the cost model predicts for a GPU cluster. Programs compiled for
  described devices run nothing: they are lowered, compiled, analysed and priced only.
Methods:
- hand plans, `jax.jit(step, in_shardings=..., out_shardings=...)` on a `jax.sharding.Mesh` with
  Auto axes; outputs keep their inputs' shardings, the loss is replicated:
  data parallel: the batch split on every device, the state replicated;
  FSDP: the batch split likewise, every parameter and optimizer leaf split on its largest dim
  the device count divides (replicated when none does);
  ZeRO-1/2: data parallel with only the Adam moments (optax's `mu` and `nu`, found by their path;
  an optimizer without them gets data parallel's plan) split as FSDP splits them, the parameters
  replicated; jax.jit pins arguments and results only, so whether the gradients are
  reduce-scattered into the moments' shards (ZeRO-2) or all-reduced (ZeRO-1) is the compiler's
  choice;
  Megatron: on a 1-D mesh the weights named in the model's `tp_rules` split over it and the batch
  replicated; on a 2-D mesh the same on the last axis and the batch split on the first (DP x TP);
- rhino_jax: `rj.parallelize(step, mesh=rj.device_mesh(shape, names, devices), opt_level='O2',
  cluster=the target's cluster)`, lowered (the search) and compiled.
Every compiled program is priced by `price_compiled(compiled, cluster, dtype=model's matmul dtype)`,
with the cluster it was searched for, as its schedule runs (`overlapped_s`: communication beside
compute where XLA issued it asynchronously; the verdict) and serially (compute + communication)
beside it. Columns: compiled collectives (count / MiB per device) by kind, priced compute,
communication, the step overlapped and serially, compiled memory per device (arguments + outputs +
temporaries - donated); for rhino_jax also its own prediction of each (step time, collectives as the
target's compiler combines them, `plan.cost.memory_bytes`), so the cost model's fidelity is in the
table, the ratio of its priced step to the best hand plan's (overlapped, then serially), fallback
ops (no sharding rule) and search time. Per model, rhino_jax's step on the CPU (2, 4) mesh is run
and compared with jax.jit on one device (max |Δ| over every output); described devices cannot run
it.
--quick: linen_gpt and eqx_mlp only. --compiler and --meshes pick a subset of the targets. --keep:
the configurations not rerun stay as DIR/third_party.json has them (the tables say from which run).

One module of some 450 lines, by design: one benchmark's script, its targets, the measuring of a
configuration and THIRD_PARTY.md's tables over one record (`Row`) that the measuring fills, the
tables read and `--keep` reads back from third_party.json: a column is added to all three at once.
"""
import os

# LLVM's optimizations off: less CPU compile time, the same HLO (collectives, buffer sizes).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402

import rhino_jax as rj  # noqa: E402
from benchmarks import RESULTS, compilers  # noqa: E402
from benchmarks.compilers import COMPILERS, KIND_ABBR  # noqa: E402
from benchmarks.fixtures.hand_plans import HAND, compile_hand  # noqa: E402
from benchmarks.fixtures.third_party_models import CASES, QUICK, Case  # noqa: E402
from rhino_jax.runtime.compiled.compiled_cost import CompiledCost, price_compiled  # noqa: E402
from rhino_jax.search.cost.cluster import get_cluster  # noqa: E402

RHINO = "rhino_jax O2"


@dataclass(frozen=True)
class Target:
    """A mesh of one compiler's devices, and the presets its programs are searched and priced for.
    The CPU compiles for the emulated devices, so its presets get backend "cpu" (the combining that
    is really compiled); the GPU compiles for described H100s (`hosts` of 8), presets as they are."""

    compiler: str  # "cpu" | "gpu"
    shape: tuple[int, ...]
    names: tuple[str, ...]
    presets: tuple[str, ...]
    hosts: int = 1

    @property
    def label(self) -> str:
        return "x".join(map(str, self.shape))

    def devices(self) -> list:
        return compilers.devices(self.compiler, math.prod(self.shape), self.hosts)

    def cluster(self, preset: str):
        cluster = get_cluster(preset)
        return dataclasses.replace(cluster, backend="cpu", overlap=0.0) if self.compiler == "cpu" else cluster


_DATA_MODEL = ("data", "model")
TARGETS = (Target("cpu", (8,), ("devices",), ("m8-v100", "8x-h100")),
           Target("cpu", (2, 4), _DATA_MODEL, ("m8-v100", "8x-h100")),
           Target("gpu", (8,), ("devices",), ("8x-h100",)),
           Target("gpu", (2, 4), _DATA_MODEL, ("8x-h100",)),
           Target("gpu", (2, 8), _DATA_MODEL, ("8x-h100-2hosts",), hosts=2))


# ------------------------------------------------------------------------------ one configuration


@dataclass
class Row:
    model: str
    framework: str
    mesh: str
    compiler: str  # which XLA compiler built the program: "cpu" | "gpu" (see `Target`)
    preset: str
    method: str
    cost: dict | None = None  # CompiledCost.to_dict()
    predicted_total_s: float | None = None  # rhino_jax's own prediction
    # rhino_jax's own prediction of the compiled collectives, kind -> (count, bytes), combined as the
    # row's compiler combines them (`Plan.collective_summary`), and of the memory per device
    predicted_collectives: dict | None = None
    predicted_memory_bytes: int | None = None
    fallback_ops: int | None = None
    search_s: float | None = None
    compile_s: float | None = None
    error: str = ""
    extra: dict = field(default_factory=dict)


def _row(case, target: Target, preset, method, cost: CompiledCost | None, **kw) -> Row:
    return Row(case.name, case.framework, target.label, target.compiler, preset, method,
               cost.to_dict() if cost is not None else None, **kw)


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"[:300]


def run_hand(case: Case, target: Target, rows: list[Row]) -> None:
    """Every hand plan compiled once for the target's mesh and priced under each of its presets."""
    mesh = Mesh(np.array(target.devices()).reshape(target.shape), target.names,
                axis_types=(AxisType.Auto,) * len(target.shape))
    for method in HAND:
        t0 = time.perf_counter()
        try:
            compiled = compile_hand(case, method, mesh)
            compile_s = time.perf_counter() - t0
            costs = [(p, price_compiled(compiled, target.cluster(p), case.dtype)) for p in target.presets]
        except Exception as e:  # reported, not hidden
            rows += [_row(case, target, p, method, None, error=_error(e)) for p in target.presets]
            continue
        rows += [_row(case, target, p, method, cost, compile_s=compile_s) for p, cost in costs]
        print(f"  {case.name} {target.compiler} {target.label} {method}: compiled in {compile_s:.1f}s", flush=True)


def run_rhino(case: Case, target: Target, preset: str, rows: list[Row]):
    """rhino_jax searched for the target's cluster, compiled and priced; returns the compiled step
    (None when it failed)."""
    cluster = target.cluster(preset)
    try:
        step = rj.parallelize(case.step, mesh=rj.device_mesh(target.shape, target.names, devices=target.devices()),
                              opt_level="O2", cluster=cluster)
        t0 = time.perf_counter()
        lowered = step.lower(*case.args)
        search_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled = lowered.compile()
        compile_s = time.perf_counter() - t0
        # rhino_jax's Compiled wraps the jax executable; price that, exactly as the hand plans.
        cost = price_compiled(compiled._executable, cluster, case.dtype)
    except Exception as e:
        traceback.print_exc()
        rows.append(_row(case, target, preset, RHINO, None, error=_error(e)))
        return None
    plan = lowered.plan
    rows.append(_row(case, target, preset, RHINO, cost, predicted_total_s=plan.cost.total_s,
                     predicted_collectives=plan.collective_summary(target.compiler),
                     predicted_memory_bytes=plan.cost.memory_bytes, fallback_ops=len(plan.fallback_ops),
                     search_s=search_s, compile_s=compile_s,
                     extra={"predicted_compute_s": plan.cost.compute_s, "predicted_comm_s": plan.cost.comm_s}))
    print(f"  {case.name} {target.compiler} {target.label} {RHINO} {preset}: search {search_s:.1f}s, "
          f"compile {compile_s:.1f}s", flush=True)
    return compiled


def run_case(case: Case, targets, rows: list[Row], check=("cpu", (2, 4))) -> dict:
    """Every target x preset x method of one model; returns the agreement check (run on the first
    preset of the `check` target, when it is among `targets`)."""
    agreed = {}
    for target in targets:
        run_hand(case, target, rows)
        for preset in target.presets:
            compiled = run_rhino(case, target, preset, rows)
            if compiled is not None and (target.compiler, target.shape) == check and not agreed:
                agreed = agreement(case, compiled, target.label, preset)
    return agreed


def agreement(case: Case, compiled, mesh_label: str, preset: str) -> dict:
    """rhino_jax's step vs jax.jit on one device: the largest |Δ| over every output leaf."""
    one = jax.jit(case.step)(*case.args)
    out = compiled(*case.args)
    diffs = [float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
             for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(out)) if np.size(a)]
    return {"mesh": mesh_label, "preset": preset, "max_abs_diff": max(diffs),
            "loss_one_device": float(one[-1]), "loss_rhino": float(out[-1])}


# ------------------------------------------------------------------------------ report


def _ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:.3f}"


def _ratio(q) -> str:
    return "-" if q is None else f"{q:.3f}"


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.2f}"


def _collectives(kinds: dict | None) -> str:
    """kind -> (count, bytes) as 'AR 1/14.18, AG 3/2.00' (count/MiB per device)."""
    if kinds is None:
        return "-"
    parts = [f"{KIND_ABBR[k]} {n}/{b / 2**20:.2f}" for k, (n, b) in kinds.items() if n]
    return ", ".join(parts) or "none"


def _key(r) -> tuple:
    return r.model, r.mesh, r.compiler, r.preset


def summarize(rows: list[Row]) -> list[dict]:
    """Per model x mesh x compiler x preset: the best hand plan and rhino_jax's ratio to it, with
    the programs priced as their schedules run (overlapped: the verdict), and serially."""
    out = []
    for key in dict.fromkeys(map(_key, rows)):
        group = [r for r in rows if _key(r) == key]
        hand = [r for r in group if r.method in HAND and r.cost]
        rj_row = next((r for r in group if r.method == RHINO and r.cost), None)
        entry = {"model": key[0], "mesh": key[1], "compiler": key[2], "preset": key[3]}
        for price, suffix in (("overlapped_s", ""), ("total_s", "_serial")):
            best = min(hand, key=lambda r: r.cost[price]) if hand else None
            entry |= {f"best_hand{suffix}": best.method if best else None,
                      f"best_hand_s{suffix}": best.cost[price] if best else None,
                      f"rhino_s{suffix}": rj_row.cost[price] if rj_row else None,
                      f"ratio{suffix}": rj_row.cost[price] / best.cost[price] if best and rj_row else None}
        out.append(entry)
    return out


def table(rows: list[Row], summary: list[dict]) -> list[str]:
    by_key = {(s["model"], s["mesh"], s["compiler"], s["preset"]): s for s in summary}
    lines = ["| model | mesh | compiler | preset | method | collectives (count/MiB per device) | compute ms | "
             "comm ms | step ms, overlapped | serially | memory MiB | rj predicted ms | rj predicted collectives | "
             "rj predicted memory MiB | rj / best hand, overlapped (serially) | fallback ops | search s |",
             "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        head = f"| {r.model} | {r.mesh} | {r.compiler} | {r.preset} | {r.method} |"
        if r.cost is None:
            lines.append(f"{head} error: {r.error} | | | | | | | | | | | |")
            continue
        c = r.cost
        cells = [_collectives(c["collectives"]), _ms(c["compute_s"]), _ms(c["comm_s"]), _ms(c["overlapped_s"]),
                 _ms(c["total_s"]), _mib(c["memory"]["total"])]
        if r.method == RHINO:
            s = by_key.get(_key(r), {})
            cells += [_ms(r.predicted_total_s), _collectives(r.predicted_collectives),
                      _mib(r.predicted_memory_bytes),
                      f"{_ratio(s.get('ratio'))} ({_ratio(s.get('ratio_serial'))})", str(r.fallback_ops),
                      f"{r.search_s:.1f}"]
        else:
            cells += [""] * 6
        lines.append(f"{head} {' | '.join(cells)} |")
    return lines


def compilers_side_by_side(rows: list[Row]) -> list[str]:
    """Every program compiled by both compilers (same model, mesh shape, preset, method): what
    each compiler made of it. The hand plans are the same jax.jit programs on both; rhino_jax's
    plan is searched per compiler (its cluster's backend differs)."""
    by = {(r.model, r.mesh, r.preset, r.method, r.compiler): r for r in rows if r.cost}
    lines = ["| model | mesh | preset | method | CPU: collectives | CPU: step ms | CPU: memory MiB | "
             "GPU: collectives | GPU: step ms | GPU: memory MiB | GPU / CPU step |",
             "|---|---|---|---|---|---:|---:|---|---:|---:|---:|"]
    for (model, mesh, preset, method, compiler), cpu in by.items():
        gpu = by.get((model, mesh, preset, method, "gpu"))
        if compiler != "cpu" or gpu is None:
            continue
        a, b = cpu.cost, gpu.cost
        lines.append(f"| {model} | {mesh} | {preset} | {method} | {_collectives(a['collectives'])} | "
                     f"{_ms(a['overlapped_s'])} | {_mib(a['memory']['total'])} | {_collectives(b['collectives'])} | "
                     f"{_ms(b['overlapped_s'])} | {_mib(b['memory']['total'])} | "
                     f"{_ratio(b['overlapped_s'] / a['overlapped_s'])} |")
    return lines if len(lines) > 2 else []


def _goal(summary: list[dict], failed: list[str], compiler: str) -> str:
    """The verdict on the overlapped prices, the serial one beside it."""
    said = []
    for suffix, how in (("", "overlapped"), ("_serial", "serially")):
        ratios = [s[f"ratio{suffix}"] for s in summary if s["compiler"] == compiler and s[f"ratio{suffix}"] is not None]
        slower = [q for q in ratios if q > 1.0]
        ok = ratios and not slower and not any(RHINO in f and f" {compiler} " in f for f in failed)
        said.append(f"{'YES' if ok else 'NO'} {how}, {len(ratios) - len(slower)}/{len(ratios)} configurations at "
                    f"ratio <= 1" + (f", worst {max(ratios):.3f}" if ratios else ""))
    return f"{compiler}: {said[0]} ({said[1]})"


COMPILED_BY = {
    "cpu": "XLA's CPU compiler, 8 emulated CPU devices; the presets' backend replaced by \"cpu\" for the search "
           "and the pricing (its combiner merges all-reduces only; reduce-scatters are written as all-reduces; "
           "bf16 collectives and dots run in f32)",
    "gpu": "XLA's GPU compiler (jax's CUDA plugin, compile-only) for described H100 SXM devices "
           "(`rj.gpu_topology`): 8 on one host for meshes 8 and 2x4 (preset 8x-h100), 16 on two hosts for 2x8 "
           "(8x-h100-2hosts); presets as they are (backend \"gpu\"). Nothing runs on them",
}


def _order(r: Row) -> tuple:
    """Rows in the order the script runs them: model, target, method."""
    target = next(i for i, t in enumerate(TARGETS) if (t.compiler, t.label) == (r.compiler, r.mesh))
    methods = (*HAND, RHINO)
    return list(CASES).index(r.model), target, r.preset, methods.index(r.method) if r.method in methods else 99


def write(rows: list[Row], checks: dict, out: pathlib.Path, argv: list[str], wall_s: float,
          kept_from: list[str] | None = None) -> str:
    summary = summarize(rows)
    failed = [f"{r.model} {r.mesh} {r.compiler} {r.preset} {r.method}" for r in rows if r.error]
    ran = [c for c in COMPILERS if any(r.compiler == c for r in rows)]
    goal = "; ".join(_goal(summary, failed, c) for c in ran)
    kept = (f" The configurations it did not rerun are kept from "
            f"`{' '.join(['python -m benchmarks.third_party', *kept_from])}`." if kept_from is not None else "")
    md = ["# Third-party train steps: rhino_jax vs hand plans, priced from compiled HLO", "",
          f"`python -m benchmarks.third_party {' '.join(argv)}` ({wall_s / 60:.1f} min, jax {jax.__version__})."
          f"{kept} Script docstring: what each plan is.", "",
          "Which compiler made which row (column `compiler`):", ""]
    md += [f"- **{c}**: {COMPILED_BY[c]}." for c in ran]
    md += ["",
           "Every program (hand plans compiled by `jax.jit` with in/out shardings, and rhino_jax's) is priced "
           "by `runtime/compiled/compiled_cost.price_compiled` with the cluster it was made for: compute = the sum "
           "over the per-device program's kernels (fusions, library calls, copies) of max(flops / F(dtype), bytes "
           "accessed / memory bandwidth), each from XLA's generic cost analysis of that kernel alone "
           "(`runtime/compiled/kernels.py`; while-loop bodies' kernels per trip; collectives are not kernels: they are "
           "communication); communication = α-β ring time of "
           "each compiled collective (`search/collectives.Collective.time`). The step is both replayed in XLA's "
           "schedule on a compute stream and a collective stream (`runtime/compiled/timeline.py`: an asynchronous "
           "collective runs from its start to its done beside the kernels scheduled between; a synchronous one "
           "and a done waited for hold compute; the verdict), and summed serially (compute + communication), "
           "beside it; the CPU compiler issues its collectives synchronously, so its two prices are one. "
           "Fusion and bf16 handling "
           "are each compiler's own (on CPU bf16 dots run in f32; linen_bf16 is priced at the bf16 rate all the "
           "same). Memory = arguments + outputs + temporaries − donated, from the compiled program's buffer "
           "assignment; 'rj predicted' columns are rhino_jax's own cost model (collectives combined as the row's "
           "compiler combines them), so predicted vs compiled is the cost model's fidelity.", "",
           f"**Goal** (found plan never slower than the best hand plan, priced from compiled HLO as its schedule "
           f"runs; serially in brackets): {goal}.", ""]
    if failed:
        md += ["Failures: " + "; ".join(failed), ""]
    md += ["## Agreement with one device (rhino_jax's step vs jax.jit)", "",
           "| model | mesh | preset | max abs diff | loss (1 device) | loss (rhino_jax) |", "|---|---|---|---:|---:|---:|"]
    for name, c in checks.items():
        if c:
            md.append(f"| {name} | {c['mesh']} | {c['preset']} | {c['max_abs_diff']:.2e} | "
                      f"{c['loss_one_device']:.6f} | {c['loss_rhino']:.6f} |")
        else:
            md.append(f"| {name} | - | - | not run (no rhino_jax plan compiled for the CPU's 2x4 mesh) | | |")
    md += ["", "## Plans", "", "Collectives: AR all-reduce, AG all-gather, RS reduce-scatter, A2A all-to-all, "
           "CP collective-permute; count/MiB per device. 'rj predicted' is rhino_jax's own cost model; "
           "'rj / best hand' its priced step over the best hand plan's, overlapped (serially in brackets; same model, "
           "mesh, compiler, preset).", "",
           "A plan that leaves a mesh axis unused (every layout and collective on the other axes, the devices along "
           "it repeating the same work) prices as the plan on the smaller mesh: on 2 x 8 a plan that keeps to the "
           "in-host axis has the step, memory and FLOPs per device of the (8,) plan. It is the faster plan where the "
           "cross-host links cost more than halving the compute saves; the hand plans split over all 16 devices.", ""]
    md += table(rows, summary)
    md += ["", "## Best hand plan per configuration", "", "Overlapped (the verdict), then serially.", "",
           "| model | mesh | compiler | preset | best hand plan | its step ms | rhino_jax step ms | ratio | "
           "serially: best hand plan | its ms | rhino_jax ms | ratio |",
           "|---|---|---|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for s in summary:
        md.append(f"| {s['model']} | {s['mesh']} | {s['compiler']} | {s['preset']} | {s['best_hand']} | "
                  f"{_ms(s['best_hand_s'])} | {_ms(s['rhino_s'])} | {_ratio(s['ratio'])} | {s['best_hand_serial']} | "
                  f"{_ms(s['best_hand_s_serial'])} | {_ms(s['rhino_s_serial'])} | {_ratio(s['ratio_serial'])} |")
    side = compilers_side_by_side(rows)
    if side:
        md += ["", "## CPU vs GPU compiler, same program and preset", "",
               "The hand plans are the same `jax.jit` programs for both compilers; rhino_jax's plan is searched "
               "for each (the cluster's backend decides how it predicts the combining).", ""] + side
    text = "\n".join(md) + "\n"
    (out / "THIRD_PARTY.md").write_text(text)
    (out / "third_party.json").write_text(json.dumps(
        {"argv": argv, "kept_from": kept_from, "wall_s": wall_s, "compiled_by": {c: COMPILED_BY[c] for c in ran},
         "goal": goal,
         "agreement": checks, "summary": summary, "rows": [r.__dict__ for r in rows]}, indent=1, default=str))
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--models", nargs="+", choices=sorted(CASES), help="these models only")
    parser.add_argument("--compiler", choices=(*COMPILERS, "both"), default="both",
                        help="which XLA compiler's targets to run (default both)")
    meshes = sorted({t.label for t in TARGETS})
    parser.add_argument("--meshes", nargs="+", choices=meshes, default=meshes, help="these mesh shapes only")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--keep", action="store_true",
                        help="keep the configurations not rerun (model x mesh x compiler x preset) from OUT/third_party.json")
    args = parser.parse_args(argv)
    names = args.models or (QUICK if args.quick else tuple(CASES))
    targets = [t for t in TARGETS if args.compiler in ("both", t.compiler) and t.label in args.meshes]
    if not targets:
        parser.error(f"no target is compiled by {args.compiler} on meshes {' '.join(args.meshes)}; targets: "
                     + ", ".join(f"{t.compiler} {t.label}" for t in TARGETS))
    compilers.check_gpu(parser, {t.compiler for t in targets})
    t0 = time.perf_counter()
    rows: list[Row] = []
    checks = {}
    args.out.mkdir(parents=True, exist_ok=True)
    argv = list(argv if argv is not None else sys.argv[1:])
    kept_rows, kept_checks, kept_from = [], {}, None
    if args.keep and (args.out / "third_party.json").exists():
        saved = json.loads((args.out / "third_party.json").read_text())
        kept_rows, kept_checks, kept_from = [Row(**r) for r in saved["rows"]], saved["agreement"], saved["argv"]
    for name in names:
        print(f"{name}:", flush=True)
        checks[name] = run_case(CASES[name](), targets, rows)
        everything = sorted(compilers.rerun_over(kept_rows, rows, _key), key=_order)
        agreed = {**kept_checks, **{k: v for k, v in checks.items() if v or k not in kept_checks}}
        # after each model: partial runs keep theirs
        text = write(everything, {k: agreed[k] for k in CASES if k in agreed}, args.out, argv,
                     time.perf_counter() - t0, kept_from)
    print(text)


if __name__ == "__main__":
    main()
