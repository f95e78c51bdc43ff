"""Compiled memory against depth : what XLA's GPU compiler gives a 70B-wide step per layer.

python -m benchmarks.memory_depth [--layers 4 8 16] [--out benchmarks/]
    the Llama-2-70B width (`benchmarks.scale`: per-layer `jax.checkpoint`, seq 2048, 8 sequences
    per device) at a few depths on 32 x 8 described H100s, compiled by XLA's GPU compiler: the
    hand FSDP plan with the layers as a Python loop and as `jax.lax.scan`, each with XLA's
    latency-hiding scheduler (its default) and without it, and rhino_jax's plan of each form.
    Writes memory_depth.json and memory_depth.md: temporaries per device at each depth (and all
    of it: arguments, outputs, temporaries, less the outputs that reuse donated arguments; the
    state is donated, as in training), and what each layer adds. Under `jax.checkpoint` a layer
    should add its saved input alone (its [8, 2048, 8192] bf16 activations: 0.25 GiB).

rhino_jax's plan is compiled as planned (no memory limit at compile), and as `compile()` makes
it: compiled again where XLA's program is over 80 GiB, tied to the program's order, then also
without the latency-hiding scheduler (`runtime.executable`); the row names the program kept.

python -m benchmarks.memory_depth --layers 4 8 16 80 --variants scan
    the plans whose label has "scan" at 80 layers too, the other rows kept from memory_depth.json
    (`--layers 32 80 --variants "rhino_jax, loop"`: rhino_jax's plan of the loop, 2-6 min a
    compile; `--layers 4 8 16 32 80 --variants tied`: that plan tied to its order).

A hand plan compiles in about 20 s; rhino_jax's plan adds its search (under a minute here).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

from benchmarks import RESULTS
from benchmarks.scale import kept_note

GIB = 1 << 30
MESH, AXES = (32, 8), ("data", "model")
# (label, plan, scan, XLA compiler options)
VARIANTS = [
    ("FSDP, loop of layers", "FSDP", False, {}),
    ("FSDP, loop, no latency-hiding scheduler", "FSDP", False, {"xla_gpu_enable_latency_hiding_scheduler": False}),
    ("FSDP, scan over layers", "FSDP", True, {}),
    ("FSDP, scan, no latency-hiding scheduler", "FSDP", True, {"xla_gpu_enable_latency_hiding_scheduler": False}),
    ("rhino_jax, loop of layers", "rhino_jax", False, {}),
    ("rhino_jax, loop, no latency-hiding scheduler", "rhino_jax", False,
     {"xla_gpu_enable_latency_hiding_scheduler": False}),
    ("rhino_jax, scan over layers", "rhino_jax", True, {}),
    # None: as compile() makes it (compiled again where over 80 GiB); the rows above are compiled
    # as planned
    ("rhino_jax, loop, as compile() makes it", "rhino_jax", False, None),
    # compiled tied to the program's order (`hlo_passes.program_order`) whatever its memory
    ("rhino_jax, loop, tied to the program's order", "rhino_jax tied", False, {}),
]


def compiled_temp(plan: str, layers: int, scan: bool, options: dict, limit_s: float) -> dict:
    """One compile for the described 32 x 8 H100s: XLA's memory analysis, in GiB per device."""
    import rhino_jax as rj
    from benchmarks.fixtures.llama import compile_hand, llama_step, model_shape
    from benchmarks.scale import compile_as_users_do
    from rhino_jax.runtime.compiled.memory import compiled_memory

    devices = rj.gpu_topology("h100", hosts=MESH[0], devices_per_host=MESH[1])
    mesh = rj.device_mesh(MESH, AXES, devices=devices)
    step, shapes = llama_step(model_shape("70b", layers), scan=scan)
    args = shapes(8 * MESH[0] * MESH[1])
    start = time.perf_counter()
    out = {}
    if plan.startswith("rhino_jax"):
        lowered = rj.parallelize(step, mesh=mesh, cluster="8x-h100", memory_limit_bytes=80 * GIB,
                                 solver_time_limit_s=limit_s, donate_argnums=(0, 1)).lower(*args)
        out["predicted_gib"] = lowered.plan.cost.memory_bytes / GIB
        if plan == "rhino_jax tied":
            compiled = _compiled_tied(lowered, options)
        elif options is None:
            compiled, out["kept"] = compile_as_users_do(lowered)
        else:  # no memory limit: no remedies
            compiled = dataclasses.replace(lowered, memory_limit_bytes=None).compile(options or None)._executable
    else:
        compiled = compile_hand(step, args, mesh, plan, donate=True, options=options)
    memory = compiled_memory(compiled)
    return dict(out, temp_gib=memory.temp_bytes / GIB, argument_gib=memory.argument_bytes / GIB,
                total_gib=memory.total / GIB, seconds=time.perf_counter() - start)


def _compiled_tied(lowered, options: dict):
    """rhino_jax's program tied to its order, compiled with `options` (no memory limit)."""
    import jax

    from rhino_jax.hlo_passes.jax_internals import compile_replacing_module
    from rhino_jax.runtime.executable import Weights, tied_to_order

    plan = lowered.plan
    rewritten = lowered._rewritten()
    module = tied_to_order(rewritten, Weights.of(plan.arg_roles, plan.arg_specs)) or rewritten  # None: nothing to tie
    return compile_replacing_module(lowered._step.lowered, module, jax.tree.leaves(plan.input_shardings),
                                    jax.tree.leaves(plan.output_shardings), options or None)


def table(rows: list[dict], depths: list[int]) -> str:
    lines = ["| plan | " + " | ".join(f"{n} layers: temp (all) GiB" for n in depths) + " | temp GiB per layer added |",
             "|---|" + "---|" * len(depths) + "---|"]
    for label, *_ in VARIANTS:
        got = {r["layers"]: r for r in rows if r["label"] == label}
        cells = []
        for n in depths:
            r = got.get(n)
            if r is None or "error" in r:
                cells.append(f"failed: {r['error'][:60]}" if r else "")
            else:
                total = f"{r['total_gib']:.1f}" if "total_gib" in r else "?"
                note = kept_note(r.get("kept", ""))
                cells.append(f"{r['temp_gib']:.1f} ({total}" + (f"; predicted {r['predicted_gib']:.1f}"
                                                                if "predicted_gib" in r else "")
                             + (f"; {note}" if note else "") + ")")
        ok = sorted(n for n in depths if n in got and "error" not in got[n])
        growth = (f"{(got[ok[-1]]['temp_gib'] - got[ok[0]]['temp_gib']) / (ok[-1] - ok[0]):.2f}" if len(ok) > 1
                  else "")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {growth} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="+", type=int, default=[4, 8, 16])
    parser.add_argument("--limit-s", type=float, default=100.0, help="rhino_jax's solver_time_limit_s")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--render-only", action="store_true", help="rewrite memory_depth.md from its json")
    parser.add_argument("--variants", nargs="+", help="rerun the plans whose label contains one of these at "
                        "--layers (the other rows kept from memory_depth.json)")
    args = parser.parse_args(argv)
    saved = args.out / "memory_depth.json"
    chosen = [v for v in VARIANTS if not args.variants or any(w in v[0] for w in args.variants)]
    rerun = {(v[0], n) for v in chosen for n in args.layers}
    rows = [r for r in (json.loads(saved.read_text()) if saved.exists() and (args.render_only or args.variants) else [])
            if args.render_only or (r["label"], r["layers"]) not in rerun]
    for label, plan, scan, options in [] if args.render_only else chosen:
        for layers in args.layers:
            try:
                got = compiled_temp(plan, layers, scan, options, args.limit_s)
            except Exception as e:  # noqa: BLE001 (recorded; the other variants go on)
                got = {"error": f"{type(e).__name__}: {e}"[:300]}
            rows.append(dict(label=label, layers=layers, command=" ".join(sys.argv[1:]), **got))
            print(f"{label}, {layers} layers: " + json.dumps(got), flush=True)
    (args.out / "memory_depth.json").write_text(json.dumps(rows, indent=1))
    text = table(rows, sorted({r["layers"] for r in rows}))
    print(text)
    (args.out / "memory_depth.md").write_text(
        "# Compiled memory against depth (benchmarks/memory_depth.py)\n\n"
        f"Llama-2-70B width on {MESH[0]} x {MESH[1]} described H100s, compiled by XLA's GPU compiler (temporaries "
        "per device, XLA's memory analysis; rhino_jax's prediction counts the arguments too). Commands: "
        + ", then ".join(f"`python -m benchmarks.memory_depth {c}`" for c in dict.fromkeys(r["command"] for r in rows))
        + f".\n\n{text}\n")


if __name__ == "__main__":
    main()
