"""Many processes: planning time and plan size for GPT-Medium on the multi-host presets,
and, for a real job on this machine, the time from launch to the first step with 2 processes
vs 1 and what comparing the processes' plans costs.

Part 1 plans GPT-Medium (Rhino Table 1: 24 layers, d 1024, batch 64 per 2 hosts) on a (hosts, 8)
mesh of emulated devices in one process under each multi-host preset, SPMD only and with
`pipeline=2` (8 micro-batches): search seconds, the plan's JSON size (what a plan file or a
broadcast would carry), and the seconds to lower the step again from the saved file
(`parallelize(plan=path)`: load, check, cut into programs, no search). Part 2 launches
`python -m rhino_jax.launch` with 1 process of 8 CPU devices and with 2 processes of 4, each
running a 4-layer GPT (d 256) Adam step on a (2, 4) mesh, and reports, from process 0: launch
to the job joined, planning, the cross-process plan check (`multiprocess.agree`), compilation,
the first step, launch to first step.

Run: python -m benchmarks.multiprocess  (about 10 min on 2 cores) → benchmarks/results/multiprocess.md
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import RESULTS

HERE = Path(__file__).resolve().parent
PRESETS = ("m8-v100-2hosts", "8x-h100-2hosts", "m8-v100-4hosts", "8x-h100-4hosts")


def plan_sizes(hosts: int) -> list[dict]:
    """Part 1, in a process with 8 * hosts devices."""
    import rhino_jax as rj
    from benchmarks.fixtures.models import gpt

    config = dataclasses.replace(gpt.PRESETS["GPT-Medium"], batch=32 * hosts)
    step, args = gpt.make_train_step(config), gpt.example(config, abstract=True)
    mesh = rj.device_mesh((hosts, 8), ("data", "model"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        for preset in [p for p in PRESETS if p.endswith(f"{hosts}hosts")]:
            for pipeline in ("off", 2):
                options = dict(mesh=mesh, cluster=preset, pipeline=pipeline, num_micro_batches=8)
                start = time.perf_counter()
                lowered = rj.parallelize(step, **options).lower(*args)
                search_s = time.perf_counter() - start
                lowered.plan.save(path)
                start = time.perf_counter()
                again = rj.parallelize(step, plan=path, **options).lower(*args)
                assert again.plan == lowered.plan
                rows.append(dict(preset=preset, pipeline=pipeline, search_s=search_s,
                                 from_file_s=time.perf_counter() - start, plan_kib=path.stat().st_size / 1024,
                                 step_ms=lowered.plan.cost.total_s * 1e3))
    return rows


def first_step() -> dict:
    """Part 2, in each process of a launched job (process 0 reports)."""
    import jax
    import numpy as np

    joined = time.time()
    import rhino_jax as rj
    from rhino_jax import multiprocess
    from rhino_jax.models import gpt

    config = dataclasses.replace(gpt.GPT_TINY, n_layers=4, d_model=256, d_ff=1024, seq_len=64, batch=16)
    step = gpt.make_gpt_train_step(config)
    with jax.default_device(jax.local_devices()[0]):
        args = gpt.gpt_example(config)
    t = time.perf_counter()
    parallel = rj.parallelize(step, mesh=rj.device_mesh((2, 4), ("data", "model")))
    lowered = parallel.lower(*args)  # includes the plan check across processes
    planned = time.perf_counter() - t
    t = time.perf_counter()
    multiprocess.agree(lowered.plan)  # the check alone, once more
    agree_s = time.perf_counter() - t
    t = time.perf_counter()
    compiled = lowered.compile()
    compiled_s = time.perf_counter() - t
    data = jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: np.asarray(x)[i]),
                        args, lowered.plan.input_shardings)
    t = time.perf_counter()
    jax.block_until_ready(compiled(*data))
    stepped = time.time()
    launched = float(os.environ["RHINO_JAX_BENCH_LAUNCHED"])
    return dict(processes=jax.process_count(), join_s=joined - launched, plan_s=planned, agree_ms=agree_s * 1e3,
                compile_s=compiled_s, step_s=time.perf_counter() - t, launch_to_step_s=stepped - launched)


def _launch(n: int) -> dict:
    env = dict(os.environ, RHINO_JAX_BENCH_LAUNCHED=str(time.time()))
    done = subprocess.run([sys.executable, "-m", "rhino_jax.launch", "-n", str(n), "--local-devices", str(8 // n),
                           "--timeout", "600", str(Path(__file__)), "--first-step"], env=env, cwd=HERE.parent,
                          capture_output=True, text=True, check=True)
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("[0] {"))
    return json.loads(line[4:])


def main() -> None:
    if "--first-step" in sys.argv:
        import jax

        result = first_step()
        if jax.process_index() == 0:
            print(json.dumps(result), flush=True)
        return
    if "--plan-sizes" in sys.argv:
        print(json.dumps(plan_sizes(int(sys.argv[-1]))), flush=True)
        return
    sizes = []
    for hosts in (2, 4):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={8 * hosts}")
        done = subprocess.run([sys.executable, "-m", "benchmarks.multiprocess", "--plan-sizes", str(hosts)], env=env,
                              cwd=HERE.parent, capture_output=True, text=True, check=True)
        sizes += json.loads(done.stdout.strip().splitlines()[-1])
    jobs = [_launch(n) for n in (1, 2)]
    lines = ["## Planning GPT-Medium on the multi-host presets (one process, emulated devices)", "",
             "| preset | pipeline | search s | from the plan file s | plan JSON KiB | predicted step ms |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['preset']} | {r['pipeline']} | {r['search_s']:.1f} | {r['from_file_s']:.1f} | {r['plan_kib']:.0f} "
              f"| {r['step_ms']:.1f} |" for r in sizes]
    lines += ["", "## A job on this machine: 4-layer GPT (d 256) Adam step on a (2, 4) CPU mesh", "",
              "| processes x devices | launch to joined s | plan s | plan check ms | compile s | first step s | "
              "launch to first step s |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {j['processes']} x {8 // j['processes']} | {j['join_s']:.1f} | {j['plan_s']:.1f} | "
              f"{j['agree_ms']:.1f} | {j['compile_s']:.1f} | {j['step_s']:.2f} | {j['launch_to_step_s']:.1f} |"
              for j in jobs]
    text = "\n".join(lines)
    print(text)
    (RESULTS / "multiprocess.json").write_text(json.dumps(dict(plans=sizes, jobs=jobs), indent=1))
    (RESULTS / "multiprocess.md").write_text("# Many processes\n\n`python -m benchmarks.multiprocess`; see the "
                                             "module's docstring for the method.\n\n" + text + "\n")


if __name__ == "__main__":
    main()
