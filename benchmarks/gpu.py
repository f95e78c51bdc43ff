"""What a real GPU says of the described one, the cost model and the compiled programs.

python -m benchmarks.gpu [--out DIR] [--budget-s 420] [--calibrate-models gpt bert ...]
    on a machine with one GPU (H100 or H200): one run of at most --budget-s seconds;
    writes DIR/gpu.json, DIR/gpu.md and DIR/calibration_measured.json (DIR: benchmarks/).
    Afterwards, on any machine: python -m benchmarks.calibrate fit --measured
    benchmarks/results/calibration_measured.json (the compute constants fitted to it).
python -m benchmarks.gpu --dry-run --out /tmp/gpu
    the same code on the CPU (the CPU standing for the real device), a short budget: the check
    that the one GPU run will go through.
python -m benchmarks.gpu --merge A/gpu.json B/gpu.json ... --out DIR [--note TEXT]
    one report of runs split over several calls (a lease's calls are short): each part from
    the runs that have it, a later run's row of a model in place of an earlier one's.

Parts, each within what is left of the budget, each recording its error and going on:
1. the device as XLA sees it: the `GpuTargetConfigProto` the GPU compiler dumps for a real
   compile, beside the description `rj.gpu_topology` compiles for (`rhino_jax.gpu_topology`);
2. one-device train steps (`benchmarks.fixtures.third_party_models.CASES`) compiled for the real GPU and
   for the described one (our description, and the device's own dump): memory, FLOPs, bytes,
   kernels (fusions and library calls) and the priced step, side by side;
3. kernel launches: chains of n tiny dependent kernels (an optimization barrier between each
   two keeps XLA from fusing them) timed for several n; the slope is what each kernel costs
   beyond its roofline inside one step, the intercept what one dispatch of a step costs;
4. the same steps timed on the GPU (jit, state donated, median of repetitions) beside the price of
   their compiled HLO (`compiled_cost.price_compiled`), its kernels run per step, and the plan's
   prediction on a one-device mesh; rhino_jax's step run there against jax.jit (largest
   difference of every output);
5. a plan made for a described GPU (on a one-device mesh: one GPU is what is here), saved, loaded
   on the real device, compiled and run: the flow of a described cluster's plan on a real one;
6. plans for 8 described GPUs compiled with our description and with the device's dumped one:
   whether the description changes the compiled collectives or memory;
7. `benchmarks.calibrate measure` on the zoo models given, in the time left (its rows are written
   as each step finishes, so a cut-off run keeps them).

One module of some 490 lines, by design: one run on a borrowed GPU, its parts and gpu.md's tables
(`markdown`) over one result, which each part writes a record of, the tables read and `--merge`
joins by the same keys: a part and its table change together.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys
import tempfile
import time

_DUMP = pathlib.Path(tempfile.mkdtemp(prefix="rhino_gpu_dump_"))
# XLA reads its flags once, when the backend starts: dump the probe's module only (its target
# configuration with it), before jax is imported.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={_DUMP}"
                           " --xla_dump_hlo_module_re=.*rhino_probe.*").strip()

import json  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import rhino_jax as rj  # noqa: E402
from benchmarks import RESULTS  # noqa: E402
from benchmarks.calibrate_measure import timed  # noqa: E402
from benchmarks.fixtures.third_party_models import CASES  # noqa: E402
from rhino_jax.gpu_topology import GPUS  # noqa: E402
from rhino_jax.runtime.compiled.compiled_cost import price_compiled, xla_cost_analysis  # noqa: E402

PRESET = {"h100": "8x-h100", "h200": "8x-h200", "a100": "8x-a100"}
PARTS = ["device", "compiles", "launch", "steps", "plan round trip", "described plans", "calibrate"]
LAUNCH_CHAINS = (1, 16, 64, 256)  # kernels per chain (part 3)


class Budget:
    """Seconds left of the run; each part asks before each unit of work."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()

    def part(self, seconds: float) -> "Budget":
        """At most `seconds` of what is left, for one part (so that the later parts get theirs)."""
        share = Budget(0.0)
        share.end = min(self.end, time.perf_counter() + seconds)
        return share


def _kind(device) -> str:
    """Our name of the device's GPU ("h100", ...); on the CPU (a dry run) the H100 stands in."""
    found = [k for k, spec in GPUS.items() if k.upper() in device.device_kind.upper()]
    return found[0] if found else "h100"


def _fields(text: str) -> dict[str, str]:
    """A text proto's scalar fields, nested names joined by '.' (enough to compare two)."""
    out, stack = {}, []
    for token in re.findall(r'\w+\s*\{|\}|\w+:\s*(?:"[^"]*"|[^\s{}]+)', text):
        if token.endswith("{"):
            stack.append(token[:-1].strip())
        elif token == "}":
            stack.pop()
        else:
            name, value = token.split(":", 1)
            out[".".join(stack + [name])] = value.strip().strip('"')
    return out


def device_facts(result: dict) -> str | None:
    """Part 1. The device, and its target configuration as XLA's GPU compiler dumped it."""
    dev = jax.devices()[0]
    kind = _kind(dev)
    facts = dict(device_kind=dev.device_kind, platform=dev.platform, jax=jax.__version__, kind=kind,
                 memory_bytes=(dev.memory_stats() or {}).get("bytes_limit"))
    def rhino_probe(x):  # the module name the dump is filtered by: jit_rhino_probe
        return jnp.tanh(x @ x).sum()

    jax.jit(rhino_probe)(jnp.ones((256, 256))).block_until_ready()
    dumped = sorted(_DUMP.glob("*rhino_probe*gpu_target_config.pbtxt"))
    device_config = dumped[0].read_text() if dumped else None
    ours = _fields(GPUS[kind].target_config())
    theirs = _fields(device_config) if device_config else {}
    facts["fields"] = {k: [ours.get(k), theirs.get(k)] for k in sorted(set(ours) | set(theirs))}
    facts["device_config_dumped"] = device_config is not None
    result["device"] = facts
    return device_config


def _kernels(text: str) -> dict[str, int]:
    """The entry computation's kernels by kind: fusions (Triton GEMMs apart) and library calls."""
    entry = text[text.index("\nENTRY"):] if "\nENTRY" in text else text
    entry = entry[:entry.index("\n}")]
    return {"fusions": len(re.findall(r"\bfusion\(", entry)),
            "triton gemms": len(re.findall(r"__triton_(?:nested_)?gemm_fusion", entry)),
            "library calls": len(re.findall(r"custom-call\(", entry))}


def _abstract(args):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)


def _compiled_facts(compiled, preset: str, dtype: str) -> dict:
    memory = compiled.memory_analysis()
    cost = xla_cost_analysis(compiled)
    priced = price_compiled(compiled, preset, dtype=dtype)
    return dict(temp_bytes=int(memory.temp_size_in_bytes), argument_bytes=int(memory.argument_size_in_bytes),
                output_bytes=int(memory.output_size_in_bytes), flops=float(cost.get("flops", 0.0)),
                bytes_accessed=float(cost.get("bytes accessed", 0.0)), priced_s=priced.total_s,
                priced_compute_s=priced.compute_s, **_kernels(compiled.as_text()))


def _one_device_compile(case, device) -> object:
    mesh = Mesh(np.array([device]), ("d",), axis_types=(AxisType.Auto,))
    replicated = jax.tree.map(lambda _: NamedSharding(mesh, P()), case.args)
    return jax.jit(case.step, in_shardings=replicated).lower(*_abstract(case.args)).compile()


def _described(config: str, n: int = 1, hosts: int = 1) -> list:
    topology = topologies.get_topology_desc(platform="cuda", target_config=config, topology=f"1x{hosts}x{n}")
    return sorted(topology.devices, key=lambda d: (d.process_index, d.id))


def compare_compiles(result: dict, cases: dict, device_config: str | None, budget: Budget) -> None:
    """Part 2. Each step compiled for the real device and for the described ones."""
    kind = result["device"]["kind"]
    preset = PRESET[kind]
    # The described compiles first: a real compile autotunes its GEMMs and caches the choices under
    # a key (compute capability, cores, clocks, bandwidth, L2, library versions) that a description
    # equal to the device's shares, so a described compile after it would reuse them.
    targets = {"described (ours)": _described(GPUS[kind].target_config())}
    if device_config:
        targets["described (device's dump)"] = _described(device_config)
    targets["real device"] = [jax.devices()[0]]
    rows = result.setdefault("compiles", [])
    for name, case in cases.items():
        for label, devices in targets.items():
            if budget.left() < 10:
                return
            t0 = time.perf_counter()
            compiled = _one_device_compile(case, devices[0])
            rows.append(dict(model=name, target=label, compile_s=time.perf_counter() - t0,
                             **_compiled_facts(compiled, preset, case.dtype)))


def _largest_difference(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)), initial=0.0))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _least_squares(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, intercept) of the line through (xs, ys) by least squares."""
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(slope), float(intercept)


def kernel_launches(result: dict, budget: Budget) -> None:
    """Part 3. Seconds per kernel of chains of tiny dependent kernels; the fit's slope is the
    cost of one kernel in a step (launch, or a command buffer's node), its intercept one dispatch."""
    device = jax.devices()[0]
    rows = []
    for n in LAUNCH_CHAINS:
        if budget.left() < 5:
            break

        def chain(x, n=n):
            for _ in range(n):  # the barrier ends each fusion: one kernel per link
                x = jax.lax.optimization_barrier(jnp.sin(x) * 0.5)
            return x

        x = jax.device_put(jnp.ones((1024,), jnp.float32), device)
        compiled = jax.jit(chain).lower(x).compile()
        runs = price_compiled(compiled, PRESET[result["device"]["kind"]]).kernel_runs
        rows.append(dict(chain=n, kernel_runs=runs, seconds=timed(lambda: compiled(x), min_total_s=0.2)))
    fit = None
    if len(rows) >= 2:
        slope, intercept = _least_squares([r["kernel_runs"] for r in rows], [r["seconds"] for r in rows])
        fit = dict(per_kernel_s=slope, dispatch_s=intercept)
    result["launch"] = dict(rows=rows, fit=fit)


def time_steps(result: dict, cases: dict, budget: Budget) -> None:
    """Part 4. Steps timed on the device beside their compiled price and the plan's prediction;
    rhino_jax's step against jax.jit's."""
    device = jax.devices()[0]
    preset = PRESET[result["device"]["kind"]]
    rows = result.setdefault("steps", [])
    mesh = rj.device_mesh((1,), ("data",), devices=[device])
    for name, case in cases.items():
        if budget.left() < 15:
            return
        n_state = len(case.args) - 1  # the state arguments, then the batch; the step returns the state, then the loss
        args = list(jax.device_put(jax.tree.map(np.asarray, case.args), device))  # copies: donated below
        step = jax.jit(case.step, donate_argnums=tuple(range(n_state))).lower(*args).compile()

        def run():
            out = step(*args)
            args[:n_state] = out[:n_state]
            return out[-1]

        seconds = timed(run, min_total_s=0.3)
        priced = price_compiled(step, preset, dtype=case.dtype)
        lowered = rj.parallelize(case.step, mesh=mesh, cluster=preset).lower(*case.args)
        fresh = jax.device_put(case.args, device)
        reference = jax.jit(case.step).lower(*fresh).compile()(*fresh)
        ours = lowered.compile()(*fresh)
        # The floor: jax.jit's step compiled once more (GEMM autotuning may pick other kernels,
        # another summation order) differs from the first by this much.
        again = jax.jit(case.step).lower(*fresh).compile()(*fresh)
        rows.append(dict(model=name, measured_s=seconds, priced_s=priced.total_s,
                         priced_compute_s=priced.compute_s, kernel_runs=priced.kernel_runs,
                         predicted_s=lowered.plan.cost.total_s, largest_difference=_largest_difference(reference, ours),
                         loss_difference=_largest_difference(reference[-1], ours[-1]),
                         recompiled_difference=_largest_difference(reference, again)))


def plan_roundtrip(result: dict, cases: dict, budget: Budget) -> None:
    """Part 5. A plan made for one described GPU runs on the real one."""
    if jax.devices()[0].platform != "gpu":
        result["plan_roundtrip"] = "no GPU here: a plan made for a described GPU does not run on this CPU"
        return
    if budget.left() < 15:
        return
    name, case = next(iter(cases.items()))
    kind = result["device"]["kind"]
    described = rj.device_mesh((1,), ("data",), devices=rj.gpu_topology(kind, devices_per_host=1))
    path = pathlib.Path(tempfile.mkdtemp()) / "plan.json"
    rj.parallelize(case.step, mesh=described).lower(*case.args).plan.save(path)
    real = rj.device_mesh((1,), ("data",), devices=jax.devices()[:1])
    out = rj.parallelize(case.step, mesh=real, plan=path)(*case.args)
    ref = jax.jit(case.step)(*jax.device_put(case.args, jax.devices()[0]))
    result["plan_roundtrip"] = dict(model=name, ran=True, largest_difference=_largest_difference(ref, out))


def described_plans(result: dict, cases: dict, device_config: str | None, budget: Budget) -> None:
    """Part 6. 8-GPU plans compiled for our description and for the device's own."""
    if device_config is None:
        result["described_plans"] = "no target configuration was dumped (not a GPU): nothing to compare"
        return
    kind = result["device"]["kind"]
    rows = result.setdefault("described_plans", [])
    for name, case in list(cases.items())[:2]:
        for shape, names in (((8,), ("data",)), ((2, 4), ("data", "model"))):
            lowered = None
            for label, config in (("ours", GPUS[kind].target_config()), ("device's", device_config)):
                if budget.left() < 15:
                    return
                mesh = rj.device_mesh(shape, names, devices=_described(config, 8))
                if lowered is None:  # one search; the same plan compiled for both descriptions
                    lowered = rj.parallelize(case.step, mesh=mesh, cluster=PRESET[kind]).lower(*case.args)
                    plan = lowered.plan
                compiled = rj.parallelize(case.step, mesh=mesh, plan=plan).lower(*case.args).compile()
                rows.append(dict(model=name, mesh=list(shape), description=label,
                                 collectives={k: list(v) for k, v in compiled.collectives.by_kind().items() if v[0]},
                                 memory_bytes=compiled.memory.total))


def calibrate(out: pathlib.Path, models: list[str], budget: Budget) -> None:
    """Part 7. benchmarks.calibrate's measurements, one model after another while time is left."""
    from benchmarks import calibrate_measure as cal  # noqa: PLC0415 (the zoo is imported on use)

    for model in models:
        if budget.left() < 60:
            return
        scratch = pathlib.Path(tempfile.mkdtemp())
        cal.measure(scratch, [model])
        measured = json.loads((scratch / "measured.json").read_text())
        path = out / "calibration_measured.json"
        if path.exists():
            whole = json.loads(path.read_text())
            whole["steps"] += measured["steps"]
            whole["ops"] += measured["ops"]
        else:
            whole = measured
        path.write_text(json.dumps(whole, indent=1))


def _table(rows: list[dict], columns: list[tuple[str, str, str]]) -> list[str]:
    """Markdown rows: (header, key, format) per column."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(format(r[k], f) if r.get(k) is not None else "" for _, k, f in columns) + " |")
    return lines


def markdown(result: dict) -> str:
    d = result.get("device", {})
    lines = ["# One real GPU against the described one and the cost model (benchmarks/gpu.py)", "",
             f"Device: {d.get('device_kind')} ({d.get('platform')}), jax {d.get('jax')}, "
             f"{(d.get('memory_bytes') or 0) / 2**30:.1f} GiB usable; run of {result.get('wall_s', 0):.0f} s "
             f"on {result.get('date')}. Command: `{result.get('command')}`.", ""]
    if result.get("notes"):
        lines += [result["notes"], ""]
    launch = (result.get("launch") or {}).get("fit") or {}
    per_kernel = launch.get("per_kernel_s")
    if d.get("fields"):
        differ = {k: v for k, v in d["fields"].items() if v[0] != v[1]}
        lines += ["## 1. The description beside the device's own (GpuTargetConfigProto fields)", "",
                  f"{len(d['fields']) - len(differ)} fields agree; those that differ (ours | the device's dump):", "",
                  "| field | ours | device |", "|---|---|---|"]
        lines += [f"| {k} | {a} | {b} |" for k, (a, b) in differ.items()]
    if launch:
        lines += ["", "## 3. Kernel launches: chains of n tiny dependent kernels", "",
                  f"Fit: {launch['per_kernel_s'] * 1e6:.2f} µs per kernel, {launch['dispatch_s'] * 1e6:.1f} µs "
                  "per dispatch of a step.", ""]
        lines += _table([dict(r, us=r["seconds"] * 1e6) for r in result["launch"]["rows"]],
                        [("chain", "chain", "d"), ("kernels run", "kernel_runs", "d"), ("µs per call", "us", ".1f")])
    for title, key, columns in (
        ("2. One-device steps compiled for the real and the described GPU", "compiles",
         [("model", "model", ""), ("target", "target", ""), ("temp MiB", "temp_mib", ".2f"),
          ("args MiB", "argument_mib", ".2f"), ("GFLOP", "gflop", ".3f"), ("MB accessed", "mb", ".1f"),
          ("fusions", "fusions", "d"), ("triton gemms", "triton gemms", "d"), ("library calls", "library calls", "d"),
          ("priced ms", "priced_ms", ".4f"), ("compile s", "compile_s", ".1f")]),
        ("4. Steps on the GPU: measured, priced from the compiled HLO, predicted by the plan", "steps",
         [("model", "model", ""), ("measured ms", "measured_ms", ".4f"), ("priced ms", "priced_ms", ".4f"),
          ("priced/measured", "priced_ratio", ".2f"), ("kernels run", "kernel_runs", "d"),
          ("priced + launches ms", "launched_ms", ".4f"), ("ratio", "launched_ratio", ".2f"),
          ("predicted ms", "predicted_ms", ".4f"), ("predicted/measured", "predicted_ratio", ".2f"),
          ("rhino vs jit max |Δ|", "largest_difference", ".2e"), ("loss |Δ|", "loss_difference", ".2e"),
          ("jit vs jit recompiled max |Δ|", "recompiled_difference", ".2e")]),
    ):
        rows = result.get(key)
        if isinstance(rows, list) and rows:
            shown = [dict(r, temp_mib=r.get("temp_bytes", 0) / 2**20, argument_mib=r.get("argument_bytes", 0) / 2**20,
                          gflop=r.get("flops", 0) / 1e9, mb=r.get("bytes_accessed", 0) / 1e6,
                          priced_ms=r.get("priced_s", 0) * 1e3, measured_ms=r.get("measured_s", 0) * 1e3,
                          predicted_ms=r.get("predicted_s", 0) * 1e3,
                          priced_ratio=r.get("priced_s", 0) / r["measured_s"] if r.get("measured_s") else None,
                          predicted_ratio=r.get("predicted_s", 0) / r["measured_s"] if r.get("measured_s") else None)
                     for r in rows]
            for r in shown:  # the step's price with each kernel's launch (part 3's slope) added
                if per_kernel is not None and r.get("kernel_runs") is not None and r.get("measured_s"):
                    r["launched_ms"] = r["priced_ms"] + per_kernel * r["kernel_runs"] * 1e3
                    r["launched_ratio"] = r["launched_ms"] / r["measured_ms"]
            lines += ["", f"## {title}", ""] + _table(shown, columns)
    steps = [r for r in result.get("steps") or [] if r.get("kernel_runs")]
    if len(steps) >= 2:  # what a kernel costs beyond its roofline, as the whole steps say it
        per_step = float(np.linalg.lstsq(np.array([[r["kernel_runs"]] for r in steps], float),
                                         np.array([r["measured_s"] - r["priced_s"] for r in steps]), rcond=None)[0][0])
        lines += ["", f"Measured minus priced, fitted as c × kernels run over the {len(steps)} steps: "
                  f"c = {per_step * 1e6:.2f} µs per kernel"
                  + (f" (the chains of part 3: {per_kernel * 1e6:.2f} µs)." if per_kernel is not None else ".")]
    if "plan_roundtrip" in result:
        r = result["plan_roundtrip"]
        lines += ["", "## 5. A plan made for a described GPU, run on the real one", "",
                  r if isinstance(r, str) else
                  f"{r['model']}: ran, largest difference to jax.jit {r['largest_difference']:.2e}."]
    plans = result.get("described_plans")
    if plans:
        lines += ["", "## 6. 8-GPU plans compiled for our description and the device's", ""]
        if isinstance(plans, str):
            lines.append(plans)
        else:
            lines += ["| model | mesh | description | collectives (count, bytes) | memory MiB |", "|---|---|---|---|---|"]
            lines += [f"| {r['model']} | {r['mesh']} | {r['description']} | {r['collectives']} | "
                      f"{r['memory_bytes'] / 2**20:.2f} |" for r in plans]
    if result.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {e}" for e in result["errors"]]
    return "\n".join(lines) + "\n"


def merged(results: list[dict], note: str | None) -> dict:
    """One result of several runs on the same device (`--merge`)."""
    out = {"date": results[-1]["date"], "device": results[0]["device"], "errors": [],
           "command": "; then ".join(r["command"] for r in results),
           "wall_s": sum(r.get("wall_s", 0.0) for r in results), "notes": note}
    for r in results:
        out["errors"] += r.get("errors", [])
        for key, value in r.items():
            if key in ("date", "device", "errors", "command", "wall_s", "notes"):
                continue
            if key in ("compiles", "steps", "described_plans") and isinstance(value, list):
                rows = {(row["model"], row.get("target"), str(row.get("mesh")), row.get("description")): row
                        for row in out.get(key, []) + value}  # a later run's row takes an earlier one's place
                out[key] = list(rows.values())
            else:
                out[key] = value
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--budget-s", type=float, default=420.0, help="the whole run's seconds")
    parser.add_argument("--models", nargs="+", default=None, help="third-party cases (default: all)")
    parser.add_argument("--calibrate-models", nargs="*", default=["gpt", "bert", "vgg19", "wresnet"])
    parser.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS, help="the parts to run (default all)")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU: two cases and no calibration (pass a "
                        "short --budget-s)")
    parser.add_argument("--merge", nargs="+", type=pathlib.Path, help="gpu.json files of runs to report as one")
    parser.add_argument("--note", help="with --merge: a paragraph for the report")
    args = parser.parse_args(argv)
    if args.merge:
        result = merged([json.loads(p.read_text()) for p in args.merge], args.note)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu.json").write_text(json.dumps(result, indent=1, default=str))
        (args.out / "gpu.md").write_text(markdown(result))
        print(markdown(result))
        return
    start = time.perf_counter()
    budget = Budget(args.budget_s)
    names = args.models or (["linen_gpt", "eqx_mlp"] if args.dry_run else list(CASES))
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(["python -m benchmarks.gpu"] + sys.argv[1:]),
              "errors": []}
    cases = {}
    for name in names:  # a case this machine's flax/optax cannot build is reported, the others run
        try:
            cases[name] = CASES[name]()
        except Exception as e:
            result["errors"].append(f"case {name}: {type(e).__name__}: {str(e)[:300]}")
    device_config = None
    # Each part's share of the budget, among the parts run; the calibration gets what the others leave.
    weights = {"compiles": 1.2, "launch": 0.3, "steps": 1.6, "plan round trip": 0.4, "described plans": 1.0,
               "calibrate": 2.8}
    unit = budget.left() / sum(w for p, w in weights.items() if p in args.parts)
    parts = [("device", lambda: device_facts(result)),
             ("compiles", lambda: compare_compiles(result, cases, device_config, budget.part(weights["compiles"] * unit))),
             ("launch", lambda: kernel_launches(result, budget.part(weights["launch"] * unit))),
             ("steps", lambda: time_steps(result, cases, budget.part(weights["steps"] * unit))),
             ("plan round trip", lambda: plan_roundtrip(result, cases, budget.part(weights["plan round trip"] * unit))),
             ("described plans", lambda: described_plans(result, cases, device_config,
                                                         budget.part(weights["described plans"] * unit))),
             ("calibrate", lambda: calibrate(args.out, [] if args.dry_run else args.calibrate_models, budget))]
    for label, part in parts:
        if label not in args.parts and label != "device":  # the device's facts name the run
            continue
        t0 = time.perf_counter()
        try:
            found = part()
            if label == "device":  # a dry run stands our description in for the device's, to run part 5
                device_config = found or (GPUS["h100"].target_config() if args.dry_run else None)
        except Exception as e:  # recorded and reported; the other parts still run
            traceback.print_exc()
            result["errors"].append(f"{label}: {type(e).__name__}: {str(e)[:400]}")
        print(f"[benchmarks.gpu] {label}: {time.perf_counter() - t0:.1f} s, {budget.left():.0f} s left", flush=True)
        result["wall_s"] = time.perf_counter() - start
        (args.out / "gpu.json").write_text(json.dumps(result, indent=1, default=str))
        (args.out / "gpu.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
