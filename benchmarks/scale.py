"""Planning at scale: Llama-2 shapes on 256-1024 described H100s.

python -m benchmarks.scale [--cases NAME ...] [--limit-s 100] [--timeout-s 900] [--out benchmarks/]
    each case in its own process (its peak memory is its own): lower, search, the plan's
    prediction; writes scale.json and scale.md (the cases not rerun kept from the file there).
    On these GPUs `lower()` also compiles the plans the search weighed to keep the fastest
    (`rhino_jax/compiled_choice.py`: minutes each at 70B): "search s" is `lower()`'s time less
    the lowering and those compiles (each `CompiledCandidate.compile_s`), which have their own
    column.
python -m benchmarks.scale --small
    the small case only (7B shapes, 4 layers, (4, 8, 8)): the check CI's test runs.
python -m benchmarks.scale --compile [--cases ...]
    also compile the plan and the hand plans (`HAND`) for the described H100s with XLA's GPU
    compiler and price each from its GPU HLO (`compiled_cost.price_compiled`, bf16 matmuls): the
    referee, as the program's schedule runs (communication beside compute where XLA issued it
    asynchronously), the serial sum beside it. Minutes and GiBs per 70B compile.

The model and the hand plans (`fixtures/llama.py`) are written as users write them in plain JAX:
f32 parameters and AdamW states (`optax.adamw`), bf16 compute, each layer under `jax.checkpoint`,
integer tokens, seq 2048, 8 sequences per device. Devices are described H100s (`rj.gpu_topology`):
no GPU and no emulated devices, so any machine plans for any cluster. Needs jax's CUDA plugin (the
test extra).

Predicted MFU = 6 N T / step / devices / peak (N parameters, T tokens per step, dense bf16 peak
of an H100 SXM, 989 TFLOP/s), the formula of MaxText's published figure beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from benchmarks import RESULTS
from benchmarks.fixtures.llama import HAND, LLAMA, SEQ, compile_hand, llama_step, model_shape

HERE = pathlib.Path(__file__).parent
PER_DEVICE = 8
PEAK_FLOPS = 989e12  # H100 SXM, dense bf16 (NVIDIA's datasheet)
GIB = 1 << 30
# MaxText's Llama2-7B on 8 H100s (bf16, seq 4096, 2 sequences per GPU, FSDP 8): 0.721 s a step.
MAXTEXT_7B = {"step_s": 0.721, "devices": 8, "tokens": 8 * 2 * 4096}


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    mesh: tuple[int, ...]
    layers: int | None = None  # fewer layers than the model's (the small case)
    pipeline: str | int = "off"
    micro_batches: int = 1
    # solver_time_limit_s when it is not --limit-s: the searches of a pipeline (its stager and
    # programs; pipeline="auto": its candidates) share one limit
    limit_s: float | None = None
    scan: bool = False  # the layers as `jax.lax.scan` over stacked parameters (`llama_step`)

    @property
    def devices(self) -> int:
        n = 1
        for s in self.mesh:
            n *= s
        return n


AXES = {2: ("data", "model"), 3: ("replica", "data", "model")}
CASES = [
    Case("7b-4l-4x8x8", "7b", (4, 8, 8), layers=4),
    Case("7b-32x8", "7b", (32, 8)),
    Case("70b-32x8", "70b", (32, 8)),
    Case("70b-4l-32x8", "70b", (32, 8), layers=4),  # the 70B width at 4 layers: a GPU compile in minutes
    Case("70b-4x8x8", "70b", (4, 8, 8)),
    Case("70b-8x4x8", "70b", (8, 4, 8)),
    Case("7b-128x8", "7b", (128, 8)),
    Case("70b-128x8", "70b", (128, 8)),
    Case("70b-32x8-pp4", "70b", (32, 8), pipeline=4, micro_batches=8, limit_s=300.0),
    Case("70b-32x8-auto", "70b", (32, 8), pipeline="auto", micro_batches=8, limit_s=540.0),
    Case("70b-32x8-scan", "70b", (32, 8), scan=True),  # compiled in minutes: the loop is compiled once
]


def _hand_state_gib(case: dict, method: str) -> float:
    """Per device, the f32 parameters and AdamW moments (12 bytes a parameter) of a hand plan:
    FSDP in hosts splits them over one host's devices (the last axis), the others over every
    device (the Llama dims divide them: `llama.hand_state_spec`)."""
    shape = model_shape(case["model"], case["layers"])
    devices = 1
    for n in case["mesh"]:
        devices *= n
    return 12 * shape.parameters() / (case["mesh"][-1] if method == HAND[1] else devices) / GIB


def compile_as_users_do(lowered):
    """`lowered.compile()`'s executable, and what its `rj.CompiledMemoryWarning`s said ("" if none)."""
    import warnings

    import rhino_jax as rj
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", rj.CompiledMemoryWarning)
        compiled = lowered.compile()._executable
    return compiled, " ".join(str(w.message) for w in said if issubclass(w.category, rj.CompiledMemoryWarning))


def kept_note(said: str) -> str:
    """What a `CompiledMemoryWarning` says `compile()` kept and what that costs against the program
    as planned, for a table cell ("" if nothing was said)."""
    kept = re.search(r"kept: (.*?)(?:, its step priced|\. |\.$)", said)
    cost = re.search(r"as planned \(([+-][\d.]+%)\)", said)
    return ((f"kept: {kept.group(1)}" if kept else "") + (f" ({cost.group(1)} against as planned)" if cost else "")
            + ("; does not fit" if "will not fit" in said else ""))


def compile_and_price(step, args, mesh, lowered) -> dict:
    """The plan and each hand plan compiled for the described GPUs, the state donated as in
    training, priced from their GPU HLO: {name: (seconds as the schedule runs, GiB per device as
    XLA's buffer assignment counts it, how it was compiled, seconds serially)} or the error. rhino_jax's plan is compiled as
    `compile()` compiles it: where XLA's schedule does not fit 80 GiB, tied to the program's
    order, then also without XLA's latency-hiding scheduler (`runtime.executable.compile_module`)."""
    from rhino_jax.runtime.compiled.compiled_cost import price_compiled
    out = {}

    def priced(compiled, note: str = "") -> tuple[float, float, str, float]:
        cost = price_compiled(compiled, "8x-h100", "bfloat16")
        return cost.overlapped_s, cost.memory.total / GIB, note, cost.total_s

    try:
        out["rhino_jax"] = priced(*compile_as_users_do(lowered))
    except Exception as e:  # noqa: BLE001 (recorded, the hand plans go on)
        out["rhino_jax"] = f"{type(e).__name__}: {e}"[:300]
    for method in HAND:
        try:
            out[method] = priced(compile_hand(step, args, mesh, method, donate=True))
        except Exception as e:  # noqa: BLE001
            out[method] = f"{type(e).__name__}: {e}"[:300]
    return out


def run_case(case: Case, limit_s: float, compile_plans: bool = False) -> dict:
    """One case in this process: lower and search (and with `compile_plans`, the referee:
    `compile_and_price`); what it measured."""
    import jax
    jax.config.update("jax_platforms", "cpu")  # the devices are described: no GPU runtime
    import numpy as np
    from jax.sharding import Mesh

    import rhino_jax as rj

    shape = model_shape(case.model, case.layers)
    devices = rj.gpu_topology("h100", hosts=case.devices // 8, devices_per_host=8)
    mesh = Mesh(np.array(devices).reshape(case.mesh), AXES[len(case.mesh)])
    step, shapes = llama_step(shape, scan=case.scan)
    args = shapes(PER_DEVICE * case.devices)
    parallel = rj.parallelize(step, mesh=mesh, cluster="8x-h100", opt_level="O2", memory_limit_bytes=80 * GIB,
                              solver_time_limit_s=limit_s, pipeline=case.pipeline,
                              num_micro_batches=case.micro_batches, donate_argnums=(0, 1))
    t0 = time.perf_counter()
    jax.jit(step).lower(*args)  # what tracing and lowering alone take (the search lowers once more)
    lower_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    lowered = parallel.lower(*args)
    planned = time.perf_counter() - t0
    plan = lowered.plan
    stats = plan.search_stats
    # the plans compiled at lower() to choose among them (`compiled_choice`), each with its time
    chosen_s = sum(c.compile_s or 0.0 for c in stats.compiled_candidates)
    tokens = PER_DEVICE * case.devices * SEQ
    mfu = 6 * shape.parameters() * tokens / plan.cost.total_s / case.devices / PEAK_FLOPS
    out = {"lower_s": lower_s, "plan_s": planned, "search_s": planned - lower_s - chosen_s, "choice_s": chosen_s,
           "choice_compiled": sum(c.compile_s is not None for c in stats.compiled_candidates),
           "build_s": stats.build_s,
           "step_s": plan.cost.total_s, "gib_per_device": plan.cost.memory_bytes / GIB, "mfu": mfu,
           "parameters": shape.parameters(), "ilp_vars": stats.ilp_vars, "status": stats.status,
           "limit_s": limit_s,
           "candidates": [[c.label, c.step_s, c.why] for c in stats.pipeline_candidates]}
    if compile_plans:
        t0 = time.perf_counter()
        out["compiled"] = compile_and_price(step, args, mesh, lowered)
        out["compile_s"] = time.perf_counter() - t0
        out["donated"] = True  # the state (runs before this flag compiled it undonated)
    return out


def _priced_cell(got) -> str:
    """A compiled program's table cell: its step as scheduled, serially beside it, and memory (a
    row kept from a run before the scheduled price holds the serial sum alone)."""
    if not isinstance(got, list):
        return f"failed: {got[:80]}"
    if not _scheduled(got):
        return f"{got[0]:.3f} s serially (a run before the scheduled price), {got[1]:.1f} GiB"
    return f"{got[0]:.3f} s ({got[3]:.3f} s serially), {got[1]:.1f} GiB"


def _scheduled(got) -> bool:
    """A compiled program priced as its schedule runs (its serial sum fourth), not serially alone."""
    return isinstance(got, list) and len(got) > 3


def _child(case_name: str, limit_s: float, compile_plans: bool) -> None:
    case = next(c for c in CASES if c.name == case_name)
    try:
        out = {"ok": True, **run_case(case, limit_s, compile_plans)}
    except Exception as e:  # noqa: BLE001 (the parent records the error and goes on)
        out = {"ok": False, "error": f"{type(e).__name__}: {e}"[:600]}
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    print("RESULT " + json.dumps(out), flush=True)


def measure(case: Case, limit_s: float, timeout_s: float, compile_plans: bool = False) -> dict:
    """Run one case in a fresh process; a case over `timeout_s` is recorded as such."""
    t0 = time.perf_counter()
    env = dict(os.environ, RHINO_JAX_PROGRESS="0")
    try:
        done = subprocess.run([sys.executable, "-m", "benchmarks.scale", "--child", case.name, "--limit-s",
                               str(limit_s)] + (["--compile"] if compile_plans else []), capture_output=True,
                              text=True, timeout=timeout_s, env=env, cwd=HERE.parent)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"killed after {timeout_s:.0f} s", "wall_s": timeout_s}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return {"ok": False, "error": f"exit {done.returncode}: {done.stderr.strip()[-600:]}",
                "wall_s": time.perf_counter() - t0}
    return {**json.loads(lines[-1][len("RESULT "):]), "wall_s": time.perf_counter() - t0}


def table(rows: list[dict]) -> str:
    out = ["| case | devices | limit s | lower s | search s (build) | compiled choice s (plans) | wall s | peak RSS GiB | "
           "predicted step s | GiB/dev | predicted MFU |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    auto = []
    for r in rows:
        m = r["result"]
        head = f"| {r['case']['name']} | {r['devices']} | {m.get('limit_s') or '-'} "
        if not m["ok"]:
            out.append(head + f"| failed: {m['error'][:160]} | | | {m['wall_s']:.0f} | "
                       f"{m.get('peak_rss_gib', float('nan')):.1f} | | | |")
            continue
        # a row measured before the compiled choice was timed apart has no choice_s: "-"
        choice = f"{m['choice_s']:.0f} ({m['choice_compiled']})" if "choice_s" in m else "-"
        out.append(head + f"| {m['lower_s'] or 0:.1f} | {m['search_s'] or 0:.1f} ({m['build_s'] or 0:.1f}) | {choice} | "
                   f"{m['wall_s']:.0f} | {m['peak_rss_gib']:.2f} | {m['step_s']:.3f} | {m['gib_per_device']:.1f} | "
                   f"{100 * m['mfu']:.0f} % |")
        if m.get("candidates"):
            auto.append(f"- {r['case']['name']}: " + "; ".join(
                f"{label}: " + (f"{step:.3f} s" if step is not None else "no plan") + (f" ({why})" if why else "")
                for label, step, why in m["candidates"]))
    if auto:
        out += ["", "pipeline='auto' candidates (chosen first; predicted step, or why not):", *auto]
    compiled = [r for r in rows if r["result"].get("compiled")]
    if compiled:
        out += ["", "Priced from the GPU compile (8x-h100, bf16 matmuls; seconds per step as the program's schedule "
                "runs, communication beside compute where XLA issued it asynchronously, the serial sum in brackets; "
                "GiB per device as XLA's buffer assignment counts it, the state donated or not as the case says; MFU "
                "by the formula above on the scheduled step; a hand plan whose parameters and AdamW moments alone "
                "exceed 80 GiB per device cannot run and is not the best hand plan):", "",
                "| case | rhino_jax | " + " | ".join(HAND) + " | rhino_jax / best hand | rhino_jax MFU |",
                "|---|---|" + "---|" * len(HAND) + "---|---|"]
        for r in compiled:
            got = r["result"]["compiled"]
            state = {k: _hand_state_gib(r["case"], k) for k in HAND}
            cells = [_priced_cell(got[k]) for k in ("rhino_jax", *HAND)]
            cells[0] += f" (predicted {r['result']['step_s']:.3f} s, {r['result']['gib_per_device']:.1f} GiB)"
            said = got["rhino_jax"][2] if isinstance(got["rhino_jax"], list) and len(got["rhino_jax"]) > 2 else ""
            cells[0] += f"; compiled again, {kept_note(said)}" if said else ""
            cells[1:] = [c + (f" (state {state[k]:.1f} GiB > 80)" if state[k] > 80 else "") for c, k in zip(cells[1:], HAND)]
            hands = [k for k in HAND if isinstance(got[k], list) and state[k] <= 80]
            mine = got["rhino_jax"] if isinstance(got["rhino_jax"], list) else None
            ratio = (f"{mine[0] / min(got[k][0] for k in hands):.2f}" if hands and mine else "-")
            if hands and mine:  # the serial ratio beside; a kept row's first figure is serial
                ratio += (f" ({mine[3] / min(got[k][3] for k in hands):.2f} serially)" if _scheduled(mine)
                          else " serially")
            shape = model_shape(r["case"]["model"], r["case"]["layers"])
            mfu = (f"{100 * 6 * shape.parameters() * PER_DEVICE * SEQ / mine[0] / PEAK_FLOPS:.0f} %"
                   + ("" if _scheduled(mine) else " serially") if mine else "-")
            donated = "donated" if r["result"].get("donated") else "not donated"
            out.append(f"| {r['case']['name']} ({donated}) | " + " | ".join(cells) + f" | {ratio} | {mfu} |")
    maxtext = 6 * LLAMA["7b"].parameters() * MAXTEXT_7B["tokens"] / MAXTEXT_7B["step_s"] / 8 / PEAK_FLOPS
    out.append(f"\nPublished like-for-like figure: MaxText Llama2-7B, 8 H100, bf16, seq 4096, 2 sequences per "
               f"GPU, FSDP 8: {MAXTEXT_7B['step_s']} s a step, {100 * maxtext:.0f} % by the same formula.")
    return "\n".join(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=None)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--limit-s", type=float, default=100.0)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child, args.limit_s, args.compile)
    names = [CASES[0].name] if args.small else args.cases or [c.name for c in CASES]
    saved = args.out / "scale.json"
    kept = {r["case"]["name"]: r for r in json.loads(saved.read_text())} if saved.exists() else {}
    rows = []
    for name in names:
        case = next(c for c in CASES if c.name == name)
        result = measure(case, case.limit_s or args.limit_s, args.timeout_s, args.compile)
        rows.append({"case": asdict(case), "devices": case.devices, "result": result})
        print(f"{name}: " + json.dumps(result)[:400], flush=True)
    rows = sorted(rows + [r for n, r in kept.items() if n not in names],
                  key=lambda r: [c.name for c in CASES].index(r["case"]["name"]))
    text = table(rows)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scale.json").write_text(json.dumps(rows, indent=1))
    (args.out / "scale.md").write_text(f"# Planning at scale (benchmarks/scale.py)\n\n{text}\n")


if __name__ == "__main__":
    main()
