"""Lower a step on the mesh and describe its entry arguments (pytree path and role).

The step is lowered once, with every argument and result replicated on the mesh and the mesh
set as context (so `rj.annotate` pins become Shardy constraints). The search reads that module;
the rewrite later swaps in the plan's shardings without tracing the function again.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
from jax.extend.mlir import ir
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import module as mod

_OPT_KEYS = ("opt", "optimizer", "adam", "mu", "nu", "momentum", "velocity", "count", "step")
_BATCH_KEYS = ("batch", "inputs", "input", "labels", "targets", "tokens", "images", "x", "y")


@dataclass
class LoweredStep:
    lowered: jax.stages.Lowered
    module: ir.Module  # a private inlined copy: import and rewrite work on it
    arg_paths: list[str]
    arg_roles: list[str]
    output_paths: list[str]


def _keys(path) -> list[str]:
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)).lower())
                break
    return out


def infer_role(path, num_args: int) -> str:
    """Parameter, optimizer state or batch, from the argument position and the key names.

    The usual signature is step(params, opt_state, batch) or step(state, batch) with
    state.params / state.opt_state; keys that name an optimizer or a batch win over position."""
    keys = _keys(path)
    position = int(keys[0]) if keys and keys[0].isdigit() else 0
    inner = keys[1:]
    if any(k in _OPT_KEYS or k.startswith("opt") for k in inner):
        return "optimizer_state"
    if any(k in ("params", "param", "weights") for k in inner):
        return "parameter"
    if any(k in _BATCH_KEYS for k in inner) or (num_args > 1 and position == num_args - 1):
        return "batch"
    if position == 0:
        return "parameter"
    return "optimizer_state" if position < num_args - 1 else "other"


def lower_on_mesh(fn, args: Sequence, mesh: Mesh, donate_argnums: tuple[int, ...]) -> LoweredStep:
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x)), args)
    replicated = NamedSharding(mesh, PartitionSpec())
    jitted = jax.jit(fn, in_shardings=replicated, out_shardings=replicated,
                     donate_argnums=donate_argnums, keep_unused=True)
    with jax.set_mesh(mesh):
        lowered = jitted.lower(*abstract)
    module = mod.inline_calls(mod.copy_module(lowered.compiler_ir("stablehlo")))
    leaves = jax.tree_util.tree_flatten_with_path(tuple(args))[0]
    paths = [f"arg{jax.tree_util.keystr(p)}" for p, _ in leaves]
    roles = [infer_role(p, len(args)) for p, _ in leaves]
    n_out = lowered.out_tree.num_leaves
    out_leaves = jax.tree_util.tree_flatten_with_path(jax.tree_util.tree_unflatten(lowered.out_tree, range(n_out)))[0]
    out_paths = [f"out{jax.tree_util.keystr(p)}" for p, _ in out_leaves]
    return LoweredStep(lowered, module, paths, roles, out_paths)
