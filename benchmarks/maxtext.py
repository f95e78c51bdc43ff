"""MaxText's own Llama2 train step: MaxText's shardings against rhino_jax's plan.

python -m benchmarks.maxtext [--cases NAME ...] [--out benchmarks/]
    each case: MaxText builds its Llama2 train step, abstract state and batch as its ahead-of-time
    compiler (`maxtext.trainers.pre_train.train_compile`) does for one 8-GPU H100 host
    (`compile_topology=a3`), on 8 described H100s (`rj.gpu_topology`: no GPU). MaxText's
    configurations (`CONFIGS`: base.yml's mesh axes and logical-axis rules under its
    `ici_*_parallelism`, the state's shardings and ZeRO-1 as train_compile makes them) compile by
    MaxText's `jit_and_compile` with its in/out shardings and activation constraints. rhino_jax is
    given the same step with those constraints made the identity (`unconstrained`) and plans it on
    an (8,) mesh; its plan compiles as `compile()` makes it. Every program is priced from its GPU
    HLO as `benchmarks.overlap` prices: serially and overlapped. Writes maxtext.json and maxtext.md.

Attention is MaxText's `dot_product` in every program: its GPU kernels (Transformer Engine's
cuDNN flash attention, Pallas flash attention) need a GPU or Transformer Engine to build.

Install, in a venv of its own (maxtext's declared requirements pin its whole TPU/GPU image, so it
goes in without them; the `maxtext` extra is what importing its trainer needs on jax 0.12):
    python3.12 -m venv venv_maxtext
    venv_maxtext/bin/pip install -e '.[maxtext]'
    venv_maxtext/bin/pip install --no-deps maxtext==0.2.5
"""
from __future__ import annotations

import argparse
import functools
import pathlib
import time
from dataclasses import dataclass
from typing import Callable
from unittest import mock

from benchmarks import RESULTS

from .overlap import priced, run_cases, table
from .scale import GIB, compile_as_users_do, kept_note

# MaxText's parallelism settings compared, as its users set them (the rest of the mesh axes 1).
CONFIGS = {
    "MaxText fsdp 8": {"ici_fsdp_parallelism": 8},
    "MaxText fsdp 4 x tensor 2": {"ici_fsdp_parallelism": 4, "ici_tensor_parallelism": 2},
    "MaxText fsdp 2 x tensor 4": {"ici_fsdp_parallelism": 2, "ici_tensor_parallelism": 4},
    "MaxText data 8, ZeRO-1": {"ici_data_parallelism": 8, "ici_fsdp_parallelism": 1,
                               "shard_optimizer_over_data": True},
}


@dataclass(frozen=True)
class Case:
    name: str
    yml: str  # MaxText's config file, under maxtext/configs
    d: int
    heads: int
    ffn: int
    seq: int
    batch: int  # sequences per step, over all 8 GPUs
    layers: int = 4


CASES = [
    # base.yml's defaults: layers under a scan, full remat
    Case("1k-4l", "base.yml", d=1024, heads=8, ffn=2752, seq=1024, batch=16),
    # MaxText's H100 recipe for Llama2-7B: layers unrolled, remat "minimal_with_context", iota embedding
    Case("1k-4l-gpu-recipe", "gpu/models/llama2_7b.yml", d=1024, heads=8, ffn=2752, seq=1024, batch=16),
    Case("7b-width-4l", "base.yml", d=4096, heads=32, ffn=11008, seq=2048, batch=8),
]


def maxtext_config(case: Case, parallelism: dict):
    """MaxText's config of `case` under `parallelism`, as train_compile parses it for an a3 host
    (8 H100s: the global batch is `per_device_batch_size` times 8). Its persistent compilation
    cache (on by default, in ~/jax_cache) is off: it would hold rhino_jax's programs too."""
    import maxtext
    from maxtext.configs import pyconfig
    yml = pathlib.Path(maxtext.__file__).parent / "configs" / case.yml
    return pyconfig.initialize(
        ["", str(yml)], model_name="llama2-7b", override_model_config=True, base_emb_dim=case.d,
        base_num_query_heads=case.heads, base_num_kv_heads=case.heads, head_dim=case.d // case.heads,
        base_mlp_dim=case.ffn, base_num_decoder_layers=case.layers, max_target_length=case.seq,
        per_device_batch_size=case.batch / 8, attention="dot_product", compile_topology="a3",
        compile_topology_num_slices=1, enable_checkpointing=False, skip_jax_distributed_system=True,
        jax_cache_dir="", **parallelism)


def maxtext_step(config, devices) -> dict:
    """MaxText's train step, its abstract (state, batch) and shardings on `devices`, built by the
    steps of train_compile's `main`; only the mesh is made here (train_compile takes GPUs from
    `jax.devices()`, which has none of the described ones)."""
    import jax
    from jax.sharding import Mesh
    from maxtext.trainers.pre_train import train, train_compile
    from maxtext.utils import maxtext_utils, sharding

    jax.config.update("jax_remove_size_one_mesh_axis_from_type", config.remove_size_one_mesh_axis_from_type)
    mesh = Mesh(maxtext_utils.create_device_mesh(config, devices), config.mesh_axes)
    args, kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, config)
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_shardings)
    input_state_shardings = sharding.build_zero1_input_state_mesh_shardings(config, state_shardings, params_shardings)
    data_sharding = sharding.get_input_data_sharding(config, mesh)
    step, in_shardings, out_shardings, static_argnums, donate_argnums = \
        maxtext_utils.get_functional_train_with_signature(
            train.train_step, data_sharding, input_state_shardings, model, config, params_shardings)
    return {"step": step, "args": args, "kwargs": kwargs, "mesh": mesh, "in_shardings": in_shardings,
            "out_shardings": out_shardings, "static_argnums": static_argnums, "donate_argnums": donate_argnums}


def compile_maxtext(config, built: dict):
    """The step compiled as train_compile compiles it (`jit_and_compile`: under the mesh and
    MaxText's logical-axis rules, the state donated)."""
    from flax.core.spmd import logical_axis_rules
    from maxtext.trainers.pre_train import train_compile
    return train_compile.jit_and_compile(
        built["step"], built["args"], built["kwargs"], built["mesh"], built["in_shardings"],
        built["out_shardings"], built["static_argnums"], built["donate_argnums"], config,
        logical_axis_rules(config.logical_axis_rules))


def unconstrained(step: Callable) -> Callable:
    """`step` with `jax.lax.with_sharding_constraint` the identity while it traces: every
    activation constraint of MaxText (auto shard mode) goes through it, so none is left for the
    planner to follow."""
    import jax

    @functools.wraps(step)
    def run(*args):
        with mock.patch.object(jax.lax, "with_sharding_constraint", lambda x, *_, **__: x):
            return step(*args)
    return run


def plan_rhino(built: dict, devices) -> dict:
    """rhino_jax's plan of MaxText's step on an (8,) mesh: the step unconstrained, the state
    donated as MaxText donates it, the inputs without MaxText's shardings; priced."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import rhino_jax as rj
    step = unconstrained(built["step"])
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), built["args"])
    assert "sharding_constraint" not in str(jax.make_jaxpr(step)(*args)), "a MaxText constraint was left"
    t0 = time.perf_counter()
    lowered = rj.parallelize(step, mesh=Mesh(np.array(devices), ("data",)), cluster="8x-h100",
                             memory_limit_bytes=80 * GIB, donate_argnums=built["donate_argnums"],
                             progress=False).lower(*args)
    compiled, said = compile_as_users_do(lowered)
    return {**priced(compiled), "note": kept_note(said), "plan_s": time.perf_counter() - t0,
            "predicted_s": lowered.plan.cost.total_s}


def run_case(case: Case) -> dict:
    """Each MaxText configuration of `case` and rhino_jax's plan of its step (the first
    configuration's step, constraints neutralised), compiled and priced."""
    import jax
    jax.config.update("jax_platforms", "cpu")
    import rhino_jax as rj

    devices = rj.gpu_topology("h100", hosts=1, devices_per_host=8)
    out, first = {}, None
    for label, parallelism in CONFIGS.items():
        try:
            t0 = time.perf_counter()
            config = maxtext_config(case, parallelism)
            built = maxtext_step(config, devices)
            first = first or built
            out[label] = {**priced(compile_maxtext(config, built)), "compile_s": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001 (recorded, the others go on)
            out[label] = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(label, out[label], flush=True)
    if first is not None:
        out["rhino_jax"] = plan_rhino(first, devices)
    return out


def main(argv: list[str] | None = None) -> None:
    """Run the cases asked for, keep the others' rows from maxtext.json, write both files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=[c.name for c in CASES])
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    from importlib.metadata import version

    versions = {"jax": version("jax"), "maxtext": version("maxtext")}
    run_cases(pathlib.Path(args.out), "maxtext", [c for c in CASES if c.name in args.cases], run_case, versions,
              f"# MaxText's Llama2 step: its shardings and rhino_jax's plan\n\n`python -m benchmarks.maxtext` "
              f"(jax {versions['jax']}, maxtext {versions['maxtext']}, 8 described H100s, the 8x-h100 preset)",
              lambda rows: table(rows, tuple(CONFIGS), "best MaxText"))


if __name__ == "__main__":
    main()
