"""`python -m benchmarks.calibrate measure`: the steps it measures and how it times them, on one
device of the GPU machine.

This module imports jax and numpy only, and the zoo without the body of `rhino_jax/__init__.py`
(`load_zoo`): on the GPU machine rhino_jax is not installed, its planner (rhino_jax.search,
rhino_jax.hlo_passes) and ortools cannot be imported, and jax is newer than rhino_jax pins.
`calibrate_fit` reads what it writes, and the same steps (`configs`).
"""
from __future__ import annotations

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
COMPUTE_PRIMITIVES = ("dot_general", "conv_general_dilated")


def load_zoo() -> dict:
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
    module = load_zoo()[model]
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
    zoo = load_zoo()
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
