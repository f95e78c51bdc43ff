"""The zoo's benchmark: every model of the zoo x mesh x method, planned by rhino_jax and by the
expert baselines of `benchmarks/fixtures/baselines.py`, all through the same API and cost model, compiled by
XLA's CPU compiler and by its GPU compiler.

python -m benchmarks.run [--models gpt moe ...] [--quick] [--out DIR] [--o3-limit S]
                         [--compiler cpu|gpu|both] [--meshes 8 2x4 2x8]
    → prints progress, writes DIR/RESULTS.md, DIR/results.json, DIR/throughput.png and
      DIR/search_time.png (DIR: benchmarks/ by default)

Per model: the tiny preset, planned, compiled and run on 8 emulated CPU devices and compared
with jax.jit on one device; and a paper-size preset (`run_matrix.PAPER`), planned and compiled from
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

GPU rows (`run_matrix.TARGETS`, compiler "gpu"): the paper-size preset's plans and baselines searched
under 8x-h100 on 8 described H100s (`rj.gpu_topology`), meshes (8,) and (2, 4), and under
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

This module is the command line: the matrix is in `run_matrix.py`, the measuring in
`run_measure.py`, the report and the plots in `run_report.py` and `run_plot.py`.
"""
import os

# LLVM's optimizations off: a third less CPU compile time, the same HLO (collectives, buffer sizes).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from benchmarks import RESULTS, compilers  # noqa: E402
from benchmarks.compilers import COMPILERS  # noqa: E402
from benchmarks.fixtures import baselines as B  # noqa: E402
from benchmarks.fixtures.models import MODELS  # noqa: E402
from benchmarks.run_matrix import LIMITED, PAPER, STRONG_SCALING_BATCH, TARGETS  # noqa: E402
from benchmarks.run_measure import run_case, search_vs_layers, strong_scaling  # noqa: E402
from benchmarks.run_plot import plot  # noqa: E402
from benchmarks.run_report import RHINO, _compiler, render  # noqa: E402


def _configuration(r: dict) -> tuple:
    """What a partial rerun replaces as a whole: one model preset on one compiler's mesh."""
    return r.get("model"), r.get("preset"), _compiler(r), r.get("mesh")


def _order(r: dict) -> tuple:
    """Rows in the order a full run makes them: model, preset (tiny first), target, method."""
    target = next((i for i, t in enumerate(TARGETS) if (t.compiler, t.label) == (_compiler(r), r.get("mesh"))), 99)
    methods = [*RHINO, LIMITED, *B.BASELINES]
    return (list(MODELS).index(r["model"]) if r.get("model") in MODELS else 99, r.get("kind") != "tiny", target,
            methods.index(r["method"]) if r.get("method") in methods else 99)


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
