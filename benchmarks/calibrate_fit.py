"""`python -m benchmarks.calibrate fit`: the cost model's compute constants fitted to the ops
`calibrate_measure` timed, and the measured steps predicted with them; calibration.md written.

rhino_jax is imported inside the functions: `python -m benchmarks.calibrate measure` imports this
module on the GPU machine, where rhino_jax's planner cannot be imported.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import numpy as np

from benchmarks import RESULTS
from benchmarks.calibrate_measure import COMPUTE_PRIMITIVES, DEPTH, MIN_MEMORY_BOUND_BYTES, configs, load_zoo

# Dots/convolutions below this many FLOPs are timed but left out of the fit: the fixed time per op
# dominates them and says nothing about the FLOP rate.
MIN_FIT_FLOPS = 1e9
LARGEST_OPS = 20  # rows of the per-op table in calibration.md


def _graph(fn, args):
    """rhino_jax's Graph IR of `fn(*args)` on one device: what the cost model reads."""
    from rhino_jax.hlo_passes.importer import import_module
    from rhino_jax.hlo_passes.lowering import lower_on_mesh
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    step = lower_on_mesh(fn, args, mesh, ())
    return import_module(step.module, step.arg_paths, step.arg_roles, step.output_paths)


def op_flops(stablehlo: str) -> float:
    """FLOPs of an op that `measure` stored as StableHLO text, as the cost model counts them: the
    sum of `Node.flops` over rhino_jax's Graph IR of the module (parsed, calls inlined, imported)."""
    from jax.extend.mlir import ir
    from rhino_jax.hlo_passes import module as mod
    from rhino_jax.hlo_passes.importer import import_module
    from rhino_jax.hlo_passes.jax_internals import ir_context
    with ir_context():
        module = mod.inline_calls(ir.Module.parse(stablehlo))
        n_args = len(mod.entry_function(module).regions[0].blocks[0].arguments)
        n_out = len(mod.entry_return(module).operands)
        graph = import_module(module, [f"arg{i}" for i in range(n_args)], ["other"] * n_args,
                              [f"out{i}" for i in range(n_out)])
        return float(sum(n.flops for n in graph.nodes))


def measured_ops(measured: dict) -> list[dict]:
    """The ops of a measured.json, each with its `flops` counted by `op_flops`."""
    out = []
    for i, o in enumerate(measured["ops"]):
        try:
            flops = op_flops(o["stablehlo"])
        except Exception as err:
            raise ValueError(f"op {i} ({o.get('model')}: {o['primitive']} {o['shapes']}): its StableHLO does "
                             f"not import: {type(err).__name__}: {err}") from err
        out.append(dict(o, flops=flops))
    return out


@dataclasses.dataclass(frozen=True)
class Fit:
    """t = max(flops / F[dtype], bytes / B) + per_op_s, fitted to ops timed alone."""

    flops_per_s: dict[str, float]
    memory_bandwidth: float
    per_op_s: float
    compute_ops: int
    memory_ops: int


def _slope_fit(work: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    """(rate, intercept) of seconds = work / rate + intercept, least squares on relative error,
    the intercept kept ≥ 0."""
    w = 1.0 / seconds
    a = np.stack([work * w, w], axis=1)
    (inv_rate, intercept), *_ = np.linalg.lstsq(a, seconds * w, rcond=None)
    if intercept < 0:
        inv_rate, intercept = float(np.sum(work * w) / np.sum((work * w) ** 2)), 0.0
    return 1.0 / inv_rate, float(intercept)


def fit(ops: list[dict], preset) -> Fit:
    """Fit F per dtype on the dots/convolutions of at least MIN_FIT_FLOPS, B on the memory-bound
    ops; a constant with fewer than three such ops to go on keeps the preset's value."""
    memory = [o for o in ops if o["primitive"] not in COMPUTE_PRIMITIVES]
    bandwidth, fixed = preset.memory_bandwidth, []
    if len(memory) >= 3:
        bandwidth, c = _slope_fit(np.array([o["bytes"] for o in memory], float),
                                  np.array([o["seconds"] for o in memory]))
        fixed.append(c)
    compute = [o for o in ops if o["primitive"] in COMPUTE_PRIMITIVES and o["flops"] >= MIN_FIT_FLOPS]
    rates = {}
    for dtype in sorted({o["dtype"] for o in compute}):
        rows = [o for o in compute if o["dtype"] == dtype]
        if len(rows) >= 3:
            rates[dtype], c = _slope_fit(np.array([o["flops"] for o in rows]), np.array([o["seconds"] for o in rows]))
            fixed.append(c)
    return Fit(rates, bandwidth, float(np.median(fixed)) if fixed else 0.0, len(compute), len(memory))


def _predicted_seconds(model: str, config, cluster, per_op_s: float = 0.0) -> tuple[float, int]:
    """Single-device compute time of the step as rhino_jax's cost model sums it, and the node
    count. `per_op_s` adds the fixed time per op that the roofline leaves out (reported only)."""
    from rhino_jax.core.ops import FUSIBLE
    from rhino_jax.search.cost.fusion import fused_kernels, memory_traffic
    from rhino_jax.search.space.strategies import compute_time
    module = load_zoo()[model]
    graph = _graph(module.make_train_step(config), module.example(config, abstract=True))
    traffic = memory_traffic(graph, fused_kernels(graph))
    total = sum(compute_time(n, graph.values, traffic[n.id], 1, cluster) for n in graph.nodes)
    kernels = sum(1 for n in graph.nodes if n.op not in FUSIBLE)
    return total + per_op_s * kernels, kernels


def fit_and_report(measured_path: pathlib.Path, preset: str = "8x-h100", out_dir: pathlib.Path = RESULTS) -> str:
    """Fit `preset`'s constants to the measured ops and write the report; returns its markdown."""
    from rhino_jax.search.cost.cluster import get_cluster
    measured = json.loads(measured_path.read_text())
    measured["ops"] = measured_ops(measured)
    before = get_cluster(preset)
    f = fit(measured["ops"], before)
    after = dataclasses.replace(before, flops_per_s={**before.flops_per_s, **f.flops_per_s},
                                memory_bandwidth=f.memory_bandwidth)
    rows = []
    for s in measured["steps"]:
        config = configs(s["model"])[s["label"]]
        old, kernels = _predicted_seconds(s["model"], config, before)
        new, _ = _predicted_seconds(s["model"], config, after)
        rows.append(dict(model=s["model"], label=s["label"], measured_ms=s["seconds"] * 1e3, kernels=kernels,
                         preset_ms=old * 1e3, fitted_ms=new * 1e3,
                         fitted_plus_fixed_ms=(new + f.per_op_s * kernels) * 1e3))
    layers = _per_layer(rows)
    out = dict(device=measured["device"], date=measured["date"], jax=measured["jax"], fit=dataclasses.asdict(f),
               preset_before=dict(flops_per_s=before.flops_per_s, memory_bandwidth=before.memory_bandwidth),
               steps=rows, per_layer=layers)
    text = _markdown(measured, f, before, rows, layers)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "calibration.json").write_text(json.dumps(out, indent=1))
    (out_dir / "calibration.md").write_text(text)
    return text


def _per_layer(rows: list[dict]) -> list[dict]:
    """Time of the layers added between a model's two medium depths, measured and predicted."""
    out = []
    for model, (field, (lo, hi)) in DEPTH.items():
        pair = [r for r in rows if r["model"] == model and r["label"].endswith((f"{field}={lo}", f"{field}={hi}"))]
        if len(pair) != 2:
            continue
        a, b = sorted(pair, key=lambda r: r["label"].endswith(f"{field}={hi}"))
        out.append(dict(model=model, what=f"{field} {lo}→{hi}", **{
            k: b[k] - a[k] for k in ("measured_ms", "preset_ms", "fitted_ms", "fitted_plus_fixed_ms")}))
    return out


def _markdown(measured: dict, f: Fit, before, rows: list[dict], layers: list[dict]) -> str:
    def ratio(p, m):
        return f"{p / m:.2f}" if m > 0 else "—"

    lines = [
        "# Cost-model calibration on a real GPU", "",
        f"Measured by `python -m benchmarks.calibrate measure` on one **{measured['device']}** "
        f"({measured['platform']}, jax {measured['jax']}) on {measured['date']}; fitted and predicted by "
        "`python -m benchmarks.calibrate fit` with rhino_jax's own graph of each step.", "",
        "## Fitted constants (ops timed alone)", "",
        "t = max(FLOPs / F, bytes / B) + c per op, least squares on relative error: "
        f"{f.compute_ops} distinct dots/convolutions of at least {MIN_FIT_FLOPS:.0e} FLOPs and {f.memory_ops} "
        f"memory-bound ops of at least {MIN_MEMORY_BOUND_BYTES >> 20} MiB, from the medium presets' steps "
        "(a constant with fewer than three ops to go on keeps the preset's value).", "",
        f"| constant | `{before.name}` preset before | fitted |", "|---|---|---|"]
    for dtype, rate in f.flops_per_s.items():
        lines.append(f"| F {dtype} (TFLOP/s) | {before.flops(dtype) / 1e12:.0f} | {rate / 1e12:.0f} |")
    lines += [f"| B (GB/s) | {before.memory_bandwidth / 1e9:.0f} | {f.memory_bandwidth / 1e9:.0f} |",
              f"| c, fixed time per op (µs) | not modelled | {f.per_op_s * 1e6:.1f} |", "",
              "## Whole train steps, one device", "",
              "predicted = the sum of `compute_time` over the step's graph (what the search charges on one "
              "device); kernels = graph nodes XLA does not fuse away (the count c multiplies in the last column).",
              "", "| model | preset | measured ms | predicted ms (preset) | ratio | predicted ms (fitted) | ratio "
              "| kernels | fitted + c·kernels ms | ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["measured_ms"]
        lines.append(f"| {r['model']} | {r['label']} | {m:.3f} | {r['preset_ms']:.3f} | {ratio(r['preset_ms'], m)} "
                     f"| {r['fitted_ms']:.3f} | {ratio(r['fitted_ms'], m)} | {r['kernels']} "
                     f"| {r['fitted_plus_fixed_ms']:.3f} | {ratio(r['fitted_plus_fixed_ms'], m)} |")
    lines += ["", "## Largest ops timed alone", "",
              "predicted = max(FLOPs / F, bytes / B) with the preset's constants and with the fitted ones (+ c).", "",
              "| op | dtype | operand shapes | GFLOP | MiB | measured µs | predicted µs (preset) | ratio "
              "| predicted µs (fitted) | ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for o in sorted(measured["ops"], key=lambda o: -o["seconds"])[:LARGEST_OPS]:
        m = o["seconds"] * 1e6
        old = max(o["flops"] / before.flops(o["dtype"]), o["bytes"] / before.memory_bandwidth) * 1e6
        new = (max(o["flops"] / f.flops_per_s.get(o["dtype"], before.flops(o["dtype"])), o["bytes"] / f.memory_bandwidth)
               + f.per_op_s) * 1e6
        lines.append(f"| {o['primitive']} | {o['dtype']} | {' '.join('x'.join(map(str, sh)) for sh in o['shapes'])} "
                     f"| {o['flops'] / 1e9:.2f} | {o['bytes'] / 2**20:.1f} | {m:.1f} | {old:.1f} | {ratio(old, m)} "
                     f"| {new:.1f} | {ratio(new, m)} |")
    lines += ["", "## Per layer (difference of two depths)", "",
              "| model | layers | measured ms | predicted ms (preset) | ratio | predicted ms (fitted) | ratio |",
              "|---|---|---|---|---|---|---|"]
    for r in layers:
        m = r["measured_ms"]
        lines.append(f"| {r['model']} | {r['what']} | {m:.2f} | {r['preset_ms']:.2f} | {ratio(r['preset_ms'], m)} "
                     f"| {r['fitted_ms']:.2f} | {ratio(r['fitted_ms'], m)} |")
    return "\n".join(lines) + "\n"
