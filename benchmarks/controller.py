"""pipeline='auto' on the multi-host presets: which plan the controller picks for GPT and U-Net,
beside what Rhino §7.2 reports.

Each row plans one train step (abstract arguments: nothing runs) on a (hosts, 8) mesh
("data", "model") of emulated CPU devices under a multi-host preset, with `pipeline="auto"` and
`memory_limit_bytes` = the preset's device memory: SPMD only and every 2, 4, ... stage pipeline
on the hosts axis are planned, and the fastest that fits is taken. The table lists each
candidate's predicted step and memory, the choice, and its predicted MFU: the one-device step's
FLOPs (XLA's cost analysis of the unpartitioned step) over step time × devices × peak FLOP/s
(V100-SXM2 FP32 15.7 TFLOP/s, H100-SXM TF32 dense 495 TFLOP/s: the NVIDIA datasheets; Rhino
divides by 15.6).

What Rhino §7.2 reports (Fig. 7, M8, 1 to 16 GPUs = 2 hosts, full parallelism, FP32): GPT at
54.0-75.9% MFU; it does not spell out the plans. Fig. 9: U-Net on one M8 host only, where
"Rhino prefers simple data parallelism". The paper has no 4-host or H100 runs: those rows are
ours alone.

Run: python -m benchmarks.controller  (about 20 min on 2 cores) → benchmarks/results/controller.md
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import RESULTS

HERE = Path(__file__).resolve().parent
PEAK = {"m8-v100": 15.7e12, "8x-h100": 495e12}  # FP32 / TF32 dense, per device (datasheets)
PAPER = {("GPT-6.7B", "m8-v100-2hosts"): "GPT on 16 V100: 54.0-75.9% MFU (range over 1-16 GPUs)",
         ("UNet", "m8-v100-2hosts"): "U-Net: one host only; data parallel preferred"}


NOTES = """Reading the table:
- Every number is predicted by rhino_jax's cost model for the preset (nothing runs on a GPU
  here; how the SPMD model tracks XLA's compiled programs is measured on smaller models in
  `benchmarks/results/THIRD_PARTY.md` and `benchmarks/results/RESULTS.md`); a pipeline's time is the
  1F1B makespan of the stages' predicted times plus the cross-mesh moves (`runtime/schedules.py`,
  `runtime/resharding.py`).
- Memory per device counts parameters, optimizer state, the activations each stage holds for the
  micro-batches in flight and the running gradient sums; a candidate over the preset's device
  memory is not taken. GPT-6.7B needs 8 micro-batches: with one, no candidate fits a V100.
- The stager balances forward FLOPs within 25% (`pipelined.staging.EPSILON`) and then cuts the fewest
  bytes, so the two stages of GPT-6.7B differ in predicted time (the LM head and the backward
  pass are not in that balance).
- Rhino does not publish its plans; its GPT MFU range is measured on real V100s, ours is a
  prediction.
"""


def rows(hosts: int) -> list[dict]:
    """The cases on `hosts` hosts: GPT-6.7B (Table 1's 16-GPU model, batch 64 per 2 hosts) with 8
    micro-batches (with one, no candidate fits a V100), and the U-Net of Table 3 at 16 images
    per device as the user would write it (one micro-batch; pipelines get 2 per stage)."""
    out = []
    for preset in ("m8-v100", "8x-h100"):
        cluster = f"{preset}-{hosts}hosts"
        common = dict(preset=preset, cluster=cluster, hosts=hosts)
        out.append(dict(model="GPT-6.7B", batch=32 * hosts, micro_batches=8, **common))
        out.append(dict(model="UNet", batch=16 * 8 * hosts, micro_batches=1, **common))
    return out


def run(case: dict) -> dict:
    import jax

    import rhino_jax as rj
    from benchmarks.fixtures.models import gpt, unet
    from rhino_jax.search.cost.cluster import get_cluster

    module, preset = (gpt, gpt.PRESETS["GPT-6.7B"]) if case["model"] == "GPT-6.7B" else (unet, unet.PRESETS["UNet"])
    config = dataclasses.replace(preset, batch=case["batch"])
    step, args = module.make_train_step(config), module.example(config, abstract=True)
    flops = jax.jit(step).lower(*args).cost_analysis()["flops"]
    cluster = get_cluster(case["cluster"])
    mesh = rj.device_mesh((case["hosts"], 8), ("data", "model"))
    start = time.perf_counter()
    try:
        lowered = rj.parallelize(step, mesh=mesh, pipeline="auto", cluster=cluster,
                                 memory_limit_bytes=cluster.memory_per_device,
                                 num_micro_batches=case["micro_batches"]).lower(*args)
    except rj.RhinoError as e:
        return dict(case, error=str(e).splitlines()[0], search_s=time.perf_counter() - start)
    plan = lowered.plan
    return dict(case, search_s=time.perf_counter() - start, flops=flops,
                candidates=[dataclasses.asdict(c) for c in plan.search_stats.pipeline_candidates],
                step_s=plan.cost.total_s, mfu=flops / (plan.cost.total_s * mesh.size * PEAK[case['preset']]),
                stages=[dict(stage=s.stage, layers=s.layers, memory_bytes=s.memory_bytes,
                             forward_s=s.forward_s, backward_s=s.backward_s) for s in plan.stages])


FIDELITY_LAYERS = 4  # GPT-Medium's width at 4 layers: small enough to compile every candidate here


def fidelity(hosts: int) -> list[dict]:
    """Each candidate of a smaller GPT compiled and priced from XLA's programs
    (`compiled_step_s`: cost analysis and the collectives XLA emits, in the plan's schedule) beside
    its prediction: does the controller's ranking hold on what XLA builds?"""
    import rhino_jax as rj
    from benchmarks.fixtures.models import gpt
    from rhino_jax.runtime.compiled.compiled_cost import price_compiled

    config = dataclasses.replace(gpt.PRESETS["GPT-Medium"], n_layers=FIDELITY_LAYERS, batch=8 * hosts)
    step, args = gpt.make_train_step(config), gpt.example(config, abstract=True)
    mesh = rj.device_mesh((hosts, 8), ("data", "model"))
    rows = []
    for preset in (f"m8-v100-{hosts}hosts", f"8x-h100-{hosts}hosts"):
        for pipeline, k in (("off", 1), ("off", 4), (2, 4)):
            lowered = rj.parallelize(step, mesh=mesh, cluster=preset, pipeline=pipeline,
                                     num_micro_batches=k).lower(*args)
            compiled = lowered.compile()
            priced = (compiled.compiled_step_s() if hasattr(compiled, "compiled_step_s")
                      else price_compiled(compiled._executable, preset).total_s)
            rows.append(dict(preset=preset, candidate=f"{'SPMD only' if pipeline == 'off' else '2 stages'}, {k} "
                             f"micro-batch{'es' if k > 1 else ''}", predicted_s=lowered.plan.cost.total_s,
                             compiled_s=priced))
    return rows


def fidelity_table(rows: list[dict]) -> str:
    lines = [f"| preset | candidate (GPT-Medium width, {FIDELITY_LAYERS} layers) | predicted ms | "
             "priced from compiled ms | compiled / predicted |", "|---|---|---|---|---|"]
    lines += [f"| {r['preset']} | {r['candidate']} | {r['predicted_s'] * 1e3:.1f} | {r['compiled_s'] * 1e3:.1f} | "
              f"{r['compiled_s'] / r['predicted_s']:.2f} |" for r in rows]
    return "\n".join(lines)


def table(results: list[dict]) -> str:
    lines = ["| model | batch | preset | mesh | candidates: predicted step s, GiB/device | chosen | "
             "predicted MFU | search s | Rhino §7.2 |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        paper = PAPER.get((r["model"], r["cluster"]), "-")
        mesh = f"({r['hosts']}, 8)"
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch']} | {r['cluster']} | {mesh} | {r['error'][:150]} | none | - | "
                         f"{r['search_s']:.0f} | {paper} |")
            continue
        cands = "; ".join(f"{c['label']}: " + (f"{c['step_s']:.3g} s, {c['memory_bytes'] / 2**30:.1f} GiB"
                                                 if c["step_s"] is not None else "no plan")
                          + (" (over the limit)" if c["why"].startswith("needs") else "") for c in r["candidates"])
        chosen = r["candidates"][0]["label"]
        if r["stages"]:
            chosen += " [" + " / ".join(", ".join(s["layers"]) for s in r["stages"]) + "]"
        lines.append(f"| {r['model']} | {r['batch']} | {r['cluster']} | {mesh} | {cands} | {chosen} | "
                     f"{r['mfu']:.1%} | {r['search_s']:.0f} | {paper} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # runs the cases of this many hosts
    opts = parser.parse_args()
    if opts.worker:
        for case in rows(opts.worker):
            print(json.dumps(run(case)), flush=True)
        print(json.dumps(dict(fidelity=fidelity(opts.worker))), flush=True)
        return
    results = []
    for hosts in opts.hosts:  # a process per device count: XLA's is fixed when jax starts
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={8 * hosts}")
        done = subprocess.run([sys.executable, "-m", "benchmarks.controller", "--worker", str(hosts)],
                              env=env, cwd=HERE.parent, capture_output=True, text=True, check=True)
        results += [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    checks = [row for r in results if "fidelity" in r for row in r["fidelity"]]
    results = [r for r in results if "fidelity" not in r]
    text = (table(results) + "\n\nThe same comparison priced from the programs XLA compiles (CPU compiler, "
            "cluster constants), for a model small enough to compile here:\n\n" + fidelity_table(checks))
    print(text)
    (RESULTS / "controller.json").write_text(json.dumps(dict(cases=results, fidelity=checks), indent=1))
    (RESULTS / "controller.md").write_text(
        "# pipeline='auto' on the multi-host presets\n\n`python -m benchmarks.controller`; see the module's "
        "docstring for the method.\n\n" + text + "\n\n" + NOTES)


if __name__ == "__main__":
    main()
