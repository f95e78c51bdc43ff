"""Dispatch cost of a parallelized step on a cache hit, against jax.jit's.

python -m benchmarks.dispatch [--before DIR] [--calls N]   → prints a table, writes benchmarks/results/dispatch.md

Two steps (an MLP of 2 weight matrices: 4 argument leaves; and one of 160 weight matrices: 162
leaves), each on a 1-device mesh (the call is nearly all dispatch) and on the 8-device mesh. Each
step is called N times in a loop with the same arguments, already in the plan's layouts (what a
training loop feeds back), then the results are waited for: per-call µs is the loop's time / N,
the best of 7 loops (the variants' loops interleaved). jax.jit runs the same function with the plan's input and output shardings
(the same data placement, XLA's own program), "jax Compiled" calls rhino_jax's compiled program
through jax.stages.Compiled directly (the floor for rhino_jax). `--before DIR` runs rhino_jax as
checked out in DIR (a flat copy of the packages: DIR/rhino_jax with hlo_passes, search, runtime
inside) in a subprocess, beside jax.jit measured there too. Every variant's result is checked against jax.jit's.
"""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from benchmarks import RESULTS  # noqa: E402

CASES = [("small", 2, 1), ("small", 2, 8), ("160 leaves", 160, 1), ("160 leaves", 160, 8)]


def _step_and_args(n_weights: int):
    import jax
    import jax.numpy as jnp

    def step(params, batch):
        def loss(p):
            h = batch["x"]
            for k in sorted(p):
                h = jnp.tanh(h @ p[k])
            return jnp.mean((h - batch["y"]) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), value

    keys = jax.random.split(jax.random.key(0), n_weights + 1)
    params = {f"w{i:03d}": jax.random.normal(keys[i], (16, 16)) * 0.1 for i in range(n_weights)}
    batch = {"x": jax.random.normal(keys[-1], (8, 16)), "y": jnp.zeros((8, 16))}
    return step, (params, batch)


def _per_call_us(variants: dict, args, calls: int, loops: int = 7) -> tuple[dict, dict]:
    """Best per-call µs of each variant (fn of `args`) over `loops` loops, the variants' loops
    interleaved so that load from other processes falls on all of them alike; and their results."""
    import jax
    outs = {name: jax.block_until_ready(fn(*args)) for name, fn in variants.items()}
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(loops):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
            best[name] = min(best[name], (time.perf_counter() - t0) / calls * 1e6)
    return best, outs


def _close(a, b) -> bool:
    import jax
    import numpy as np
    return all(np.allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def measure(calls: int) -> list[dict]:
    import jax

    import rhino_jax as rj
    rows = []
    for name, n_weights, n_devices in CASES:
        step, args = _step_and_args(n_weights)
        mesh = rj.device_mesh((n_devices,), ("data",), devices=jax.devices()[:n_devices])
        parallel = rj.parallelize(step, mesh=mesh)
        lowered = parallel.lower(*args)
        placed = jax.device_put(args, lowered.plan.input_shardings)
        row = {"step": name, "leaves": len(jax.tree.leaves(args)), "devices": n_devices}
        jitted = jax.jit(step, in_shardings=tuple(lowered.plan.input_shardings),
                         out_shardings=lowered.plan.output_shardings)
        variants = {"rhino_jax_us": parallel, "jit_us": jitted, "compiled_us": lowered.compile()._executable}
        times, outs = _per_call_us(variants, placed, calls)
        row.update(times, same_numbers=_close(jitted(*placed), outs["rhino_jax_us"]))
        rows.append(row)
    return rows


def _before(directory: str, calls: int) -> list[dict]:
    """This benchmark's rows with the rhino_jax in `directory`, in a fresh process."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[2]);"
            "from benchmarks.dispatch import measure; print(json.dumps(measure(int(sys.argv[3]))))")
    root = str(pathlib.Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", code, directory, root, str(calls)], capture_output=True, text=True,
                          check=True, cwd="/")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict], before: list[dict] | None) -> str:
    head = "| step | leaves | devices | jax.jit µs/call | jax Compiled µs/call | rhino_jax µs/call | ratio to jax.jit |"
    line = "|---|---:|---:|---:|---:|---:|---:|"
    if before:
        head += " rhino_jax before µs/call | before: ratio to jax.jit |"
        line += "---:|---:|"
    lines = [head, line]
    for i, r in enumerate(rows):
        text = (f"| {r['step']} | {r['leaves']} | {r['devices']} | {r['jit_us']:.0f} | {r['compiled_us']:.0f} | "
                f"{r['rhino_jax_us']:.0f} | {r['rhino_jax_us'] / r['jit_us']:.2f} |")
        if before:
            b = before[i]
            text += f" {b['rhino_jax_us']:.0f} | {b['rhino_jax_us'] / b['jit_us']:.2f} |"
        lines.append(text)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="a flat copy of an older rhino_jax to compare with")
    parser.add_argument("--calls", type=int, default=500)
    opts = parser.parse_args()
    rows = measure(opts.calls)
    before = _before(opts.before, opts.calls) if opts.before else None
    if not all(r["same_numbers"] for r in rows + (before or [])):
        raise SystemExit("a variant's result differs from jax.jit's")
    text = table(rows, before)
    print(text)
    import jax
    doc = (f"# Dispatch on a cache hit\n\n`python -m benchmarks.dispatch{' --before DIR' if before else ''}` "
           f"({datetime.date.today()}, jax {jax.__version__}, CPU, {os.cpu_count()} cores, 8 emulated devices, "
           f"{opts.calls} calls per loop, best of 7 loops).\n\n{__doc__.split(chr(10), 3)[3].strip()}\n\n{text}\n")
    (RESULTS / "dispatch.md").write_text(doc)


if __name__ == "__main__":
    main()
