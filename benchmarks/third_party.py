"""Issue 14's benchmark: third-party-style train steps (`third_party_models.py`), rhino_jax's plan
against hand plans compiled by plain jax, every program priced from its compiled HLO the same way
(`hlo_passes.compiled_cost.price_compiled`).

python -m benchmarks.third_party [--quick] [--models NAME ...] [--out DIR]
    → prints a table, writes DIR/THIRD_PARTY.md and DIR/third_party.json (DIR: benchmarks/)

Per model x mesh ((8,), (2, 4)) x cluster preset (m8-v100, 8x-h100):
- hand plans, `jax.jit(step, in_shardings=..., out_shardings=...)` on a `jax.sharding.Mesh` with
  Auto axes; outputs keep their inputs' shardings, the loss is replicated:
  data parallel: the batch split on every device, the state replicated;
  FSDP: the batch split likewise, every parameter and optimizer leaf split on its largest dim
  the device count divides (replicated when none does);
  Megatron: on (8,) the weights named in the model's `tp_rules` split 8 ways and the batch
  replicated; on (2, 4) the same on 'model' and the batch split on 'data' (DP x TP);
- rhino_jax: `rj.parallelize(step, mesh=rj.device_mesh(shape, names), opt_level='O2',
  cluster=preset)`, lowered (the search) and compiled.
Every compiled program is priced by `price_compiled(compiled, preset, dtype=model's matmul dtype)`.
The presets' hardware is GPUs but the compiler here is XLA's CPU backend, which combines only
all-reduces and writes reduce-scatters as all-reduces: both the search and the pricing take the
preset with `backend="cpu"` (`CLUSTERS`), so that rhino_jax plans for the program that is really
compiled and priced (a GPU compile would combine all-gathers too; that cannot be checked here).
Columns: compiled collectives (count / MiB per device) by kind, priced compute, communication and
total, rhino_jax's own predicted total, the ratio of rhino_jax's priced total to the best hand
plan's, rhino_jax's fallback ops (no sharding rule) and search time. Per model, rhino_jax's
step on the (2, 4) mesh is run and compared with jax.jit on one device (max |Δ| over every output).
--quick: linen_gpt and eqx_mlp only.
"""
import os

# LLVM's optimizations off: less CPU compile time, the same HLO (collectives, buffer sizes).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import rhino_jax as rj  # noqa: E402
from benchmarks.third_party_models import CASES, QUICK, Case  # noqa: E402
from rhino_jax.hlo_passes.compiled_cost import CompiledCost, price_compiled  # noqa: E402
from rhino_jax.search.cluster import get_cluster  # noqa: E402

HERE = pathlib.Path(__file__).parent
MESHES = (((8,), ("devices",)), ((2, 4), ("data", "model")))
PRESETS = ("m8-v100", "8x-h100")
CLUSTERS = {p: dataclasses.replace(get_cluster(p), backend="cpu") for p in PRESETS}
HAND = ("data parallel", "FSDP", "Megatron")
RHINO = "rhino_jax O2"
KIND_ABBR = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A",
             "collective-permute": "CP"}


# ------------------------------------------------------------------------------ hand plans


def _split(x, dim: int, axes, n: int) -> P:
    """`x` split on `dim` over `axes` when n divides it, else replicated."""
    if x.ndim == 0 or x.shape[dim] % n:
        return P()
    spec = [None] * x.ndim
    spec[dim] = axes
    return P(*spec)


def _largest_divisible(x, axes, n: int) -> P:
    dims = [d for d in range(x.ndim) if x.shape[d] % n == 0]
    if not dims:
        return P()
    return _split(x, max(dims, key=lambda d: x.shape[d]), axes, n)


def _tp(case: Case, path, x, axis: str, n: int) -> P:
    key = jax.tree_util.keystr(path)
    for pattern, dim in case.tp_rules:
        if re.search(pattern, key):
            return _split(x, dim % x.ndim, axis, n) if x.ndim else P()
    return P()


def hand_specs(case: Case, method: str, mesh: Mesh):
    """PartitionSpec pytrees (inputs, outputs) of a hand plan; outputs = the state inputs + loss."""
    names, sizes = mesh.axis_names, dict(zip(mesh.axis_names, mesh.devices.shape))
    every = names if len(names) > 1 else names[0]
    n_all = mesh.devices.size
    state, batch = case.args[:-1], case.args[-1]
    if method == "data parallel":
        state_specs = jax.tree.map(lambda x: P(), state)
        batch_specs = jax.tree.map(lambda x: _split(x, 0, every, n_all), batch)
    elif method == "FSDP":
        state_specs = jax.tree.map(lambda x: _largest_divisible(x, every, n_all), state)
        batch_specs = jax.tree.map(lambda x: _split(x, 0, every, n_all), batch)
    elif method == "Megatron":
        model = names[-1]
        state_specs = jax.tree_util.tree_map_with_path(lambda p, x: _tp(case, p, x, model, sizes[model]), state)
        data = names[0] if len(names) > 1 else None
        batch_specs = jax.tree.map(lambda x: _split(x, 0, data, sizes[data]) if data else P(), batch)
    else:
        raise ValueError(f"unknown hand plan {method!r}; choose one of {HAND}")
    return (*state_specs, batch_specs), (*state_specs, P())


def compile_hand(case: Case, method: str, mesh: Mesh):
    ins, outs = hand_specs(case, method, mesh)
    named = lambda specs: jax.tree.map(lambda s: NamedSharding(mesh, s), specs,  # noqa: E731
                                       is_leaf=lambda s: isinstance(s, P))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), case.args)
    return jax.jit(case.step, in_shardings=named(ins), out_shardings=named(outs)).lower(*abstract).compile()


# ------------------------------------------------------------------------------ one configuration


@dataclass
class Row:
    model: str
    framework: str
    mesh: str
    preset: str
    method: str
    cost: dict | None = None  # CompiledCost.to_dict()
    predicted_total_s: float | None = None  # rhino_jax's own prediction
    fallback_ops: int | None = None
    search_s: float | None = None
    compile_s: float | None = None
    error: str = ""
    extra: dict = field(default_factory=dict)


def _row(case, mesh_label, preset, method, cost: CompiledCost | None, **kw) -> Row:
    return Row(case.name, case.framework, mesh_label, preset, method,
               cost.to_dict() if cost is not None else None, **kw)


def run_case(case: Case, rows: list[Row], check_shape=(2, 4)) -> dict:
    """Every mesh x preset x method of one model; returns the agreement check."""
    check = {}
    for shape, names in MESHES:
        label = "x".join(map(str, shape))
        mesh = Mesh(np.array(jax.devices()).reshape(shape), names, axis_types=(AxisType.Auto,) * len(shape))
        for method in HAND:
            t0 = time.perf_counter()
            try:
                compiled = compile_hand(case, method, mesh)
            except Exception as e:  # reported, not hidden
                for preset in PRESETS:
                    rows.append(_row(case, label, preset, method, None, error=f"{type(e).__name__}: {e}"[:300]))
                continue
            compile_s = time.perf_counter() - t0
            for preset in PRESETS:
                rows.append(_row(case, label, preset, method, price_compiled(compiled, CLUSTERS[preset], case.dtype),
                                 compile_s=compile_s))
            print(f"  {case.name} {label} {method}: compiled in {compile_s:.1f}s", flush=True)
        for preset in PRESETS:
            try:
                step = rj.parallelize(case.step, mesh=rj.device_mesh(shape, names), opt_level="O2",
                                      cluster=CLUSTERS[preset])
                t0 = time.perf_counter()
                lowered = step.lower(*case.args)
                search_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                compiled = lowered.compile()
                compile_s = time.perf_counter() - t0
            except Exception as e:
                traceback.print_exc()
                rows.append(_row(case, label, preset, RHINO, None, error=f"{type(e).__name__}: {e}"[:300]))
                continue
            # rhino_jax's Compiled wraps the jax executable; price that, exactly as the hand plans.
            cost = price_compiled(compiled._executable, CLUSTERS[preset], case.dtype)
            rows.append(_row(case, label, preset, RHINO, cost, predicted_total_s=lowered.plan.cost.total_s,
                             fallback_ops=len(lowered.plan.fallback_ops), search_s=search_s, compile_s=compile_s,
                             extra={"predicted_compute_s": lowered.plan.cost.compute_s,
                                    "predicted_comm_s": lowered.plan.cost.comm_s}))
            print(f"  {case.name} {label} {RHINO} {preset}: search {search_s:.1f}s, compile {compile_s:.1f}s",
                  flush=True)
            if shape == check_shape and not check:
                check = agreement(case, compiled, label, preset)
    return check


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


def _collectives(cost: dict) -> str:
    parts = [f"{KIND_ABBR[k]} {n}/{b / 2**20:.2f}" for k, (n, b) in cost["collectives"].items() if n]
    return ", ".join(parts) or "none"


def summarize(rows: list[Row]) -> list[dict]:
    """Per model x mesh x preset: the best hand plan and rhino_jax's ratio to it."""
    out = []
    keys = dict.fromkeys((r.model, r.mesh, r.preset) for r in rows)
    for key in keys:
        group = [r for r in rows if (r.model, r.mesh, r.preset) == key]
        hand = [r for r in group if r.method in HAND and r.cost]
        rj_row = next((r for r in group if r.method == RHINO), None)
        best = min(hand, key=lambda r: r.cost["total_s"]) if hand else None
        ratio = (rj_row.cost["total_s"] / best.cost["total_s"]) if (best and rj_row and rj_row.cost) else None
        out.append({"model": key[0], "mesh": key[1], "preset": key[2], "best_hand": best.method if best else None,
                    "best_hand_total_s": best.cost["total_s"] if best else None,
                    "rhino_total_s": rj_row.cost["total_s"] if rj_row and rj_row.cost else None,
                    "ratio": ratio})
    return out


def table(rows: list[Row], summary: list[dict]) -> list[str]:
    ratio = {(s["model"], s["mesh"], s["preset"]): s["ratio"] for s in summary}
    lines = ["| model | mesh | preset | method | collectives (count/MiB per device) | compute ms | comm ms | "
             "total ms | rj predicted ms | rj / best hand | fallback ops | search s |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.cost is None:
            lines.append(f"| {r.model} | {r.mesh} | {r.preset} | {r.method} | error: {r.error} | | | | | | | |")
            continue
        c = r.cost
        is_rj = r.method == RHINO
        q = ratio.get((r.model, r.mesh, r.preset))
        lines.append(
            f"| {r.model} | {r.mesh} | {r.preset} | {r.method} | {_collectives(c)} | {_ms(c['compute_s'])} | "
            f"{_ms(c['comm_s'])} | {_ms(c['total_s'])} | {_ms(r.predicted_total_s) if is_rj else ''} | "
            f"{_ratio(q) if is_rj else ''} | {r.fallback_ops if is_rj else ''} | "
            f"{f'{r.search_s:.1f}' if is_rj else ''} |")
    return lines


def write(rows: list[Row], checks: dict, out: pathlib.Path, argv: list[str], wall_s: float) -> str:
    summary = summarize(rows)
    ratios = [s["ratio"] for s in summary if s["ratio"] is not None]
    failed = [f"{r.model} {r.mesh} {r.preset} {r.method}" for r in rows if r.error]
    worst = max(ratios) if ratios else None
    slower = [s for s in summary if s["ratio"] is not None and s["ratio"] > 1.0]
    goal = (f"found plan never slower than the best hand plan (priced from compiled HLO): "
            f"{'YES' if ratios and not slower and not any(RHINO in f for f in failed) else 'NO'} — "
            f"{len(ratios) - len(slower)}/{len(ratios)} configurations at ratio <= 1"
            + (f", worst {worst:.3f}" if worst is not None else ""))
    md = ["# Third-party train steps: rhino_jax vs hand plans, priced from compiled HLO", "",
          f"`python -m benchmarks.third_party {' '.join(argv)}` ({wall_s / 60:.1f} min, jax {jax.__version__}, "
          f"{len(jax.devices())} emulated CPU devices). Script docstring: what each plan is.", "",
          "Every program (hand plans compiled by `jax.jit` with in/out shardings, and rhino_jax's) is priced "
          "by `hlo_passes/compiled_cost.price_compiled`: compute = max(flops / F(dtype), bytes accessed / "
          "memory bandwidth) from XLA's per-device `cost_analysis()` (while-loop bodies per trip; the "
          "collectives' own operands and results, which it counts, left out: they are communication); "
          "communication = α-β ring time of each compiled collective (`search/collectives.Collective.time`). "
          "No overlap. The programs are compiled for CPU, so fusion and bf16 handling are the CPU compiler's "
          "(bf16 dots run in f32 there; linen_bf16 is priced at the bf16 rate all the same).", "",
          f"**Goal**: {goal}.", ""]
    if failed:
        md += ["Failures: " + "; ".join(failed), ""]
    md += ["## Agreement with one device (rhino_jax's step vs jax.jit)", "",
           "| model | mesh | preset | max abs diff | loss (1 device) | loss (rhino_jax) |", "|---|---|---|---:|---:|---:|"]
    for name, c in checks.items():
        if c:
            md.append(f"| {name} | {c['mesh']} | {c['preset']} | {c['max_abs_diff']:.2e} | "
                      f"{c['loss_one_device']:.6f} | {c['loss_rhino']:.6f} |")
        else:
            md.append(f"| {name} | - | - | not run (no rhino_jax plan compiled) | | |")
    md += ["", "## Plans", "", "Collectives: AR all-reduce, AG all-gather, RS reduce-scatter, A2A all-to-all, "
           "CP collective-permute; count/MiB per device. 'rj predicted' is rhino_jax's own cost model; "
           "'rj / best hand' its priced total over the best hand plan's.", ""]
    md += table(rows, summary)
    md += ["", "## Best hand plan per configuration", "", "| model | mesh | preset | best hand plan | its total ms | "
           "rhino_jax total ms | ratio |", "|---|---|---|---|---:|---:|---:|"]
    for s in summary:
        md.append(f"| {s['model']} | {s['mesh']} | {s['preset']} | {s['best_hand']} | {_ms(s['best_hand_total_s'])} | "
                  f"{_ms(s['rhino_total_s'])} | {_ratio(s['ratio'])} |")
    text = "\n".join(md) + "\n"
    (out / "THIRD_PARTY.md").write_text(text)
    (out / "third_party.json").write_text(json.dumps(
        {"argv": argv, "wall_s": wall_s, "goal": goal, "agreement": checks, "summary": summary,
         "rows": [r.__dict__ for r in rows]}, indent=1, default=str))
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--models", nargs="+", choices=sorted(CASES), help="these models only")
    parser.add_argument("--out", type=pathlib.Path, default=HERE)
    args = parser.parse_args(argv)
    names = args.models or (QUICK if args.quick else tuple(CASES))
    t0 = time.perf_counter()
    rows: list[Row] = []
    checks = {}
    args.out.mkdir(parents=True, exist_ok=True)
    argv = list(argv if argv is not None else sys.argv[1:])
    for name in names:
        print(f"{name}:", flush=True)
        checks[name] = run_case(CASES[name](), rows)
        text = write(rows, checks, args.out, argv, time.perf_counter() - t0)  # after each model: partial runs keep theirs
    print(text)


if __name__ == "__main__":
    main()
