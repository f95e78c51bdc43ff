"""python -m rhino_jax.demo: parallelize a small GPT train step (Adam) on 8 emulated CPU devices.

Prints the plan the search found, its predicted communication beside the compiled HLO's, and
checks the parallel step against the single-device one.
"""
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import rhino_jax as rj  # noqa: E402
from rhino_jax.models import gpt  # noqa: E402


def main() -> None:
    cfg = gpt.GPTConfig(vocab=512, seq_len=64, d_model=128, n_heads=4, n_layers=2, d_ff=512, batch=32)
    mesh = rj.device_mesh((2, 4), ("data", "model"))
    train_step = gpt.make_gpt_train_step(cfg)
    params, opt_state, batch = gpt.gpt_example(cfg)
    print(f"GPT {cfg}\nmesh {dict(mesh.shape)} on {len(jax.devices())} {jax.devices()[0].platform} devices\n")

    step = rj.parallelize(train_step, mesh=mesh, opt_level="O2", donate_argnums=(0, 1))
    start = time.perf_counter()
    lowered = step.lower(params, opt_state, batch)
    print(f"lowered and searched in {time.perf_counter() - start:.1f} s")
    compiled = lowered.compile()
    print(compiled.report())

    reference = jax.jit(train_step)(params, opt_state, batch)
    result = compiled(params, opt_state, batch)
    worst = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(result)))
    print(f"\nloss: one device {float(reference[2]):.6f}, parallel {float(result[2]):.6f}; "
          f"largest difference over all outputs {worst:.2e}")
    if worst > 1e-4:
        raise SystemExit("the parallel step does not match the single-device step")


if __name__ == "__main__":
    main()
