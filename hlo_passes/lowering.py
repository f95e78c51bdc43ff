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


def infer_role(keys: Sequence[str], position: int, num_args: int) -> str:
    """Parameter, optimizer state or batch, from the argument position and the key names (`keys`:
    the argument's keyword, if passed by keyword, then the keys inside it).

    The usual signature is step(params, opt_state, batch) or step(state, batch) with
    state.params / state.opt_state; keys that name an optimizer or a batch win over position.
    Keyword arguments count as passed positionally after the positional ones, in call order."""
    if any(k in _OPT_KEYS or k.startswith("opt") for k in keys):
        return "optimizer_state"
    if any(k in ("params", "param", "weights") for k in keys):
        return "parameter"
    if any(k in _BATCH_KEYS for k in keys) or (num_args > 1 and position == num_args - 1):
        return "batch"
    if position == 0:
        return "parameter"
    return "optimizer_state" if position < num_args - 1 else "other"


def flat_arguments(args: Sequence, kwargs: dict | None = None, positions: Sequence[int] | None = None
                   ) -> list[tuple[str, str, object]]:
    """(path, role, leaf) of each leaf of a call, in the order jax flattens (args, kwargs): paths
    `arg[i]...` for positional arguments (`positions[i]`: the user's position, when static
    arguments were taken out) and `arg['name']...` for keyword ones."""
    kwargs = kwargs or {}
    num_args = len(args) + len(kwargs)
    order = {name: len(args) + k for k, name in enumerate(kwargs)}
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path((tuple(args), kwargs))[0]:
        top, rest = path[1], path[2:]
        inner = _keys(rest)
        if path[0].idx == 0:
            i = top.idx
            label = f"arg[{positions[i] if positions is not None else i}]"
            role = infer_role(inner, i, num_args)
        else:
            label = f"arg[{top.key!r}]"
            role = infer_role([str(top.key).lower()] + inner, order[top.key], num_args)
        out.append((label + jax.tree_util.keystr(rest), role, leaf))
    return out


def lower_on_mesh(fn, args: Sequence, mesh: Mesh, donate_argnums: tuple[int, ...], kwargs: dict | None = None,
                  donate_argnames: tuple[str, ...] = (), positions: Sequence[int] | None = None) -> LoweredStep:
    """`fn(*args, **kwargs)` lowered on the mesh (arguments and results replicated); `positions`:
    the user's position of each of `args` (see `flat_arguments`)."""
    kwargs = kwargs or {}
    replicated = NamedSharding(mesh, PartitionSpec())
    # replicated through the arguments' shardings: jax.jit refuses keyword arguments with in_shardings
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x),
                                                           sharding=replicated), (tuple(args), kwargs))
    jitted = jax.jit(fn, out_shardings=replicated, donate_argnums=donate_argnums, donate_argnames=donate_argnames,
                     keep_unused=True)
    with jax.set_mesh(mesh):
        lowered = jitted.lower(*abstract[0], **abstract[1])
    module = mod.inline_calls(mod.copy_module(lowered.compiler_ir("stablehlo")))
    flat = flat_arguments(args, kwargs, positions)
    n_out = lowered.out_tree.num_leaves
    out_leaves = jax.tree_util.tree_flatten_with_path(jax.tree_util.tree_unflatten(lowered.out_tree, range(n_out)))[0]
    out_paths = [f"out{jax.tree_util.keystr(p)}" for p, _ in out_leaves]
    return LoweredStep(lowered, module, [p for p, _, _ in flat], [r for _, r, _ in flat], out_paths)
