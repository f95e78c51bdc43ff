"""Calibrate the cost model's compute term on a real GPU.

Two steps, because the GPU machine and the planning machine differ:

python -m benchmarks.calibrate measure --out DIR      (on the GPU)
    Times, on one device, (a) every distinct dot/convolution of each measured train step in
    isolation, and the larger memory-bound ops, and (b) the whole train step of the zoo's tiny
    presets and of "medium" presets (paper sizes cut to fit one GPU), each at two depths so
    that the difference is the time of the added layers. Writes DIR/measured.json, with each
    op's StableHLO text. Needs only jax, numpy and the repo's benchmarks/ (run from the repo
    root): not an installed rhino_jax, its planner (rhino_jax.search, rhino_jax.hlo_passes) nor
    ortools, and not the jax version rhino_jax pins. The zoo is imported with the body of
    `rhino_jax/__init__.py` (which imports the planner) deferred; see `_zoo`.

python -m benchmarks.calibrate fit [--measured FILE] [--preset NAME] [--out-dir DIR]   (with rhino_jax)
    Counts each op's FLOPs as the cost model does, by importing its stored StableHLO into
    rhino_jax's Graph IR (`op_flops`); fits the compute roofline's constants (achievable FLOP/s
    per dtype, memory bandwidth, and the fixed time per op that the roofline leaves out) to the
    isolated ops, then predicts the measured steps from rhino_jax's own graph of each step
    (`import_module`, `memory_traffic`, `compute_time`) with the cluster preset (default
    `8x-h100`) as it was and as fitted. Writes calibration.md and calibration.json to DIR
    (default benchmarks/).

Ops are timed as XLA compiles them alone (jit of the one primitive), whole steps as jit
compiles them (fused). Every time is the median of several repetitions of back-to-back calls.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import pathlib
import platform
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import RESULTS

# model -> {label: (zoo preset, overrides)}. Medium presets keep the paper's widths and cut depth,
# batch or classes so that parameters, Adam state and activations fit one 80 GB GPU; each is
# measured at two depths (the second key of DEPTH) so that per-layer time is a difference.
MEDIUM = {
    "gpt": ("GPT-Medium", {"batch": 8}),
    "moe": ("MoE-16E-2.4B", {"batch": 8}),
    "bert": ("DNABert", {"batch": 32}),
    "vgg19": ("VGG19", {"batch": 32, "num_classes": 100_000}),
    "wresnet": ("WR-1.3B", {"batch": 8}),
    "unet": ("UNet", {"batch": 16}),
}
DEPTH = {"gpt": ("n_layers", (2, 4)), "moe": ("n_layers", (2, 4)), "bert": ("n_layers", (2, 4)),
         "wresnet": ("depth", (14, 26))}
# Ops timed alone: every dot and convolution, and memory-bound ops that move at least this many
# bytes (below it the fixed time per op dominates and says nothing about bandwidth).
MIN_MEMORY_BOUND_BYTES = 8 << 20
MAX_MEMORY_BOUND_OPS = 25  # per step, largest first: enough for a fit, few enough to keep the run short
MIN_FIT_FLOPS = 1e9  # dots/convolutions below it are timed but left out of the fit, for the same reason
COMPUTE_PRIMITIVES = ("dot_general", "conv_general_dilated")
LARGEST_OPS = 20  # rows of the per-op table in calibration.md


def _zoo() -> dict:
    """benchmarks.fixtures.models.MODELS, imported without running the body of `rhino_jax/__init__.py`.

    The zoo imports rhino_jax.models (plain JAX), and importing it runs its package's body, which
    imports the planner (rhino_jax.search, rhino_jax.hlo_passes, ortools). On the GPU machine
    rhino_jax is not installed (from the repo root the package is found, those subpackages are
    not) and jax is newer than rhino_jax pins, so `measure` must not run that body. Unless
    rhino_jax is imported already, it is registered with its body deferred to the first lookup of
    one of its names (`from rhino_jax import X`), so that later code in the process still sees
    the whole package."""
    spec = None if "rhino_jax" in sys.modules else importlib.util.find_spec("rhino_jax")
    if spec is not None and spec.submodule_search_locations is not None:
        package = importlib.util.module_from_spec(spec)

        def run_body(name: str):
            if name.startswith("__"):  # probes of module metadata do not need the body
                raise AttributeError(f"module 'rhino_jax' has no attribute {name!r}")
            del package.__getattr__
            spec.loader.exec_module(package)
            return getattr(package, name)

        package.__getattr__ = run_body
        sys.modules["rhino_jax"] = package
    from benchmarks.fixtures.models import MODELS
    return MODELS


def configs(model: str) -> dict[str, Any]:
    """label -> Config of every step measured for `model`: tiny, and medium at each depth."""
    module = _zoo()[model]
    out = {"tiny": module.PRESETS["tiny"]}
    preset, overrides = MEDIUM[model]
    base = dataclasses.replace(module.PRESETS[preset], **overrides)
    if model in DEPTH:
        field, depths = DEPTH[model]
        for d in depths:
            out[f"{preset} {field}={d}"] = dataclasses.replace(base, **{field: d})
    else:
        out[preset] = base
    return out


# ----------------------------------------------------------------------------- measuring (GPU)

def timed(fn: Callable[[], Any], min_total_s: float = 0.05, reps: int = 5) -> float:
    """Median seconds per call of `fn` over `reps` repetitions of back-to-back calls."""
    jax.block_until_ready(fn())
    start = time.perf_counter()
    jax.block_until_ready(fn())
    once = max(time.perf_counter() - start, 1e-6)
    calls = max(1, min(200, int(min_total_s / once)))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def _leaf_eqns(jaxpr) -> list:
    """Equations of a jaxpr and of every jaxpr nested in it, without the nesting ones."""
    out = []
    for eqn in jaxpr.eqns:
        subs = [v for v in eqn.params.values() if hasattr(v, "eqns") or hasattr(v, "jaxpr")]
        if subs:
            for s in subs:
                out.extend(_leaf_eqns(s.jaxpr if hasattr(s, "jaxpr") else s))
        else:
            out.append(eqn)
    return out


def _nbytes(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def _random_operand(aval, rng: np.random.Generator):
    """Normal values made on the host: jax.random would compile a kernel per operand shape,
    most of a measuring run's time."""
    if jnp.issubdtype(aval.dtype, jnp.floating):
        return jax.device_put(rng.standard_normal(aval.shape, dtype=np.float32).astype(aval.dtype))
    return jnp.zeros(aval.shape, aval.dtype)  # indices: zero is in range for every gather/slice


def _selected_eqns(step, args, seen: set) -> list:
    """The step's distinct compute ops, and its MAX_MEMORY_BOUND_OPS largest memory-bound ops of
    at least MIN_MEMORY_BOUND_BYTES, leaving out any in `seen` (timed for an earlier step)."""
    compute, memory = [], []
    for eqn in _leaf_eqns(jax.make_jaxpr(step)(*args).jaxpr):
        avals = [v.aval for v in eqn.invars + eqn.outvars]
        if not all(hasattr(a, "shape") for a in avals) or "random" in eqn.primitive.name:
            continue
        sig = (eqn.primitive.name, str(avals), repr(sorted(eqn.params.items(), key=lambda kv: kv[0])))
        if sig in seen:
            continue
        seen.add(sig)
        nbytes = sum(_nbytes(a) for a in avals)
        if eqn.primitive.name in COMPUTE_PRIMITIVES:
            compute.append(eqn)
        elif nbytes >= MIN_MEMORY_BOUND_BYTES:
            memory.append((nbytes, len(memory), eqn))
    return compute + [e for _, _, e in sorted(memory, key=lambda t: t[:2], reverse=True)[:MAX_MEMORY_BOUND_OPS]]


def time_ops(step, args, seen: set) -> list[dict]:
    """The ops `_selected_eqns` picks, each timed alone on the default device, with the StableHLO
    it was timed as (for `fit` to count its FLOPs with rhino_jax's importer: `op_flops`)."""
    rows = []
    rng = np.random.default_rng(1)
    for eqn in _selected_eqns(step, args, seen):
        name = eqn.primitive.name
        in_avals = [v.aval for v in eqn.invars]
        out_avals = [v.aval for v in eqn.outvars]
        literals = [getattr(v, "val", None) for v in eqn.invars]
        operands = [_random_operand(a, rng) for a, lit in zip(in_avals, literals) if lit is None]

        def one(*ops, eqn=eqn, literals=literals):
            it = iter(ops)
            return eqn.primitive.bind(*[next(it) if lit is None else lit for lit in literals], **eqn.params)

        try:
            fn = jax.jit(one)
            seconds = timed(lambda: fn(*operands))
            stablehlo = fn.lower(*operands).as_text()
        except Exception as err:  # an op that cannot run alone: say which, go on with the others
            print(f"  skipped {name}: {type(err).__name__}: {str(err)[:120]}")
            continue
        rows.append(dict(primitive=name, dtype=str(out_avals[0].dtype) if out_avals else "",
                         shapes=[list(a.shape) for a in in_avals], out=[list(a.shape) for a in out_avals],
                         bytes=sum(_nbytes(a) for a in in_avals + out_avals), seconds=seconds,
                         stablehlo=stablehlo))
    return rows


def time_step(module, config) -> float:
    """Seconds per train step (params and optimizer state donated, as in training)."""
    params, opt_state, batch = module.example(config)
    step = jax.jit(module.make_train_step(config), donate_argnums=(0, 1))
    state = [params, opt_state]

    def run():
        state[0], state[1], loss = step(state[0], state[1], batch)
        return loss

    return timed(run, min_total_s=0.2, reps=5)


def measure(out_dir: pathlib.Path, models: list[str], quick: bool = False) -> None:
    """`quick`: tiny presets only, their ops timed too (a smoke run of this script on any machine)."""
    zoo = _zoo()
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0]
    result = dict(device=dev.device_kind, platform=dev.platform, jax=jax.__version__,
                  date=datetime.date.today().isoformat(), host=platform.platform(), steps=[], ops=[])
    path = out_dir / "measured.json"
    seen: set = set()
    for model in models:
        module = zoo[model]
        for label, config in configs(model).items():
            if quick and label != "tiny":
                continue
            start = time.perf_counter()
            seconds = time_step(module, config)
            result["steps"].append(dict(model=model, label=label, config=repr(config), seconds=seconds))
            print(f"{model:8} {label:28} step {seconds * 1e3:9.3f} ms  ({time.perf_counter() - start:.0f} s)",
                  flush=True)
            if quick or label != "tiny":
                ops = time_ops(module.make_train_step(config), module.example(config, abstract=True), seen)
                result["ops"].extend(dict(model=model, **r) for r in ops)
                print(f"{'':8} {'':28} {len(ops)} ops timed alone", flush=True)
            path.write_text(json.dumps(result, indent=1))  # after each step: a cut-off run keeps its rows
            jax.clear_caches()


# ----------------------------------------------------------------------------- fitting (CPU)

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
    from rhino_jax.search.space.strategies import compute_time, memory_traffic
    module = _zoo()[model]
    graph = _graph(module.make_train_step(config), module.example(config, abstract=True))
    traffic = memory_traffic(graph)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", type=pathlib.Path, required=True)
    m.add_argument("--models", nargs="+", default=list(MEDIUM), choices=list(MEDIUM))
    m.add_argument("--quick", action="store_true", help="tiny presets only (a smoke run)")
    f = sub.add_parser("fit")
    f.add_argument("--measured", type=pathlib.Path, default=RESULTS / "calibration_measured.json")
    f.add_argument("--preset", default="8x-h100", help="the cluster preset whose constants are fitted")
    f.add_argument("--out-dir", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args()
    if args.cmd == "measure":
        measure(args.out, args.models, args.quick)
    else:
        print(fit_and_report(args.measured, args.preset, args.out_dir))


if __name__ == "__main__":
    main()
