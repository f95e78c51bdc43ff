"""Lower a step on the mesh and describe its entry arguments (pytree path and role).

The step is lowered once, with every argument and result replicated on the mesh and the mesh
set as context (so `rj.annotate` pins become Shardy constraints). The search reads that module;
the rewrite later swaps in the plan's shardings without tracing the function again. What a plan
is made for (`PlanTarget`) is read from the lowered step here: a saved plan is checked against it.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import jax
from jax.extend.mlir import ir
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rhino_jax.core.plan_target import PlanTarget

from . import module as mod
from .graph import Graph, Leaf, feeds
from .jax_internals import top_k_lowered_as_sort
from .sinking import sink_constants

_OPT_KEYS = ("opt", "optimizer", "count", "step")
_MOMENT_KEYS = ("adam", "mu", "nu", "momentum", "velocity")  # also a model's names (a VAE's mean layer)
_BATCH_KEYS = ("batch", "inputs", "input", "labels", "targets", "tokens", "images", "x", "y")


@dataclass
class LoweredStep:
    lowered: jax.stages.Lowered
    # a private inlined copy, the constants a loop was handed sunk into it (`sinking`): import and rewrite work on it
    module: ir.Module
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


def _is_optimizer_state(node) -> bool:
    """An optimizer's state by its type: optax's states (a chain's tuple holds one per transform),
    and the variables Flax NNX's `Optimizer` keeps them in. Named by module, so that neither
    library need be installed."""
    kind = type(node)
    return (kind.__module__.split(".")[0] == "optax"
            or (kind.__module__.startswith("flax.nnx") and kind.__name__ in ("OptState", "OptArray", "OptVariable")))


def _is_parameter(node) -> bool:
    """A model's parameters by their type: a Flax NNX `Param`, an Equinox `Module`'s arrays."""
    kind = type(node)
    return ((kind.__module__.startswith("flax.nnx") and kind.__name__ == "Param")
            or any(c.__module__.split(".")[0] == "equinox" and c.__name__ == "Module" for c in kind.__mro__))


def typed_roles(tree) -> dict[str, str]:
    """Leaf path (`jax.tree_util.keystr`) → the role the types around it give: optimizer state
    inside an optimizer's state (`_is_optimizer_state`; an Adam state's moments mirror the
    parameters, modules and all), else a parameter inside a parameter's type (`_is_parameter`).
    Leaves in plain containers (a Flax linen params dict) have none."""
    out: dict[str, str] = {}
    for role, holds in (("optimizer_state", _is_optimizer_state), ("parameter", _is_parameter)):
        for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=holds)[0]:
            if holds(node):
                for inner, _ in jax.tree_util.tree_flatten_with_path(node)[0]:
                    out.setdefault(jax.tree_util.keystr((*path, *inner)), role)
    return out


def _named_role(keys: Sequence[str], state_typed: bool = False) -> str | None:
    """The role key names give: an optimizer's, a parameter's or a batch's; None without one.
    `state_typed`: the call's optimizer state is known by its type (`typed_roles`), so a moment's
    name (`_MOMENT_KEYS`) says nothing of another leaf; an optimizer's or a counter's still does
    (a Flax `TrainState`'s step)."""
    if any(k in _OPT_KEYS or k.startswith("opt") or (not state_typed and k in _MOMENT_KEYS) for k in keys):
        return "optimizer_state"
    if any(k in ("params", "param", "weights") for k in keys):
        return "parameter"
    if any(k in _BATCH_KEYS for k in keys):
        return "batch"
    return None


def infer_role(keys: Sequence[str], position: int, num_args: int, state_typed: bool = False) -> str:
    """Parameter, optimizer state or batch, from the argument position and the key names (`keys`:
    the argument's keyword, if passed by keyword, then the keys inside it), for a leaf its types
    give no role (`typed_roles`; `state_typed`: as `_named_role`).

    The usual signature is step(params, opt_state, batch) or step(state, batch) with
    state.params / state.opt_state; keys that name an optimizer or a batch win over position.
    Keyword arguments count as passed positionally after the positional ones, in call order."""
    named = _named_role(keys, state_typed)
    if named is not None:
        return named
    if num_args > 1 and position == num_args - 1:
        return "batch"
    if position == 0:
        return "parameter"
    return "optimizer_state" if position < num_args - 1 else "other"


def flat_arguments(args: Sequence, kwargs: dict | None = None, positions: Sequence[int] | None = None
                   ) -> list[tuple[str, str, object, bool]]:
    """(path, role, leaf, named) of each leaf of a call, in the order jax flattens (args, kwargs):
    paths `arg[i]...` for positional arguments (`positions[i]`: the user's position, when static
    arguments were taken out) and `arg['name']...` for keyword ones; `named`: the types around the
    leaf (`typed_roles`) or key names gave the role, not the position alone."""
    kwargs = kwargs or {}
    num_args = len(args) + len(kwargs)
    order = {name: len(args) + k for k, name in enumerate(kwargs)}
    typed = typed_roles((tuple(args), kwargs))
    state_typed = "optimizer_state" in typed.values()
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path((tuple(args), kwargs))[0]:
        top, rest = path[1], path[2:]
        inner = _keys(rest)
        if path[0].idx == 0:
            i = top.idx
            label = f"arg[{positions[i] if positions is not None else i}]"
            keys, position = inner, i
        else:
            label = f"arg[{top.key!r}]"
            keys, position = [str(top.key).lower()] + inner, order[top.key]
        role = typed.get(jax.tree_util.keystr(path))
        out.append((label + jax.tree_util.keystr(rest), role or infer_role(keys, position, num_args, state_typed),
                    leaf, role is not None or _named_role(keys, state_typed) is not None))
    return out


_TOP_ARG = re.compile(r"arg\[[^\]]*\]")


def _unfed_state_is_data(flat: list[tuple[str, str, object, bool]], outs: Sequence[Leaf]) -> list[str]:
    """The roles, where an argument taken for optimizer state by its position alone is not fed
    back: a step returns the optimizer state it updates, so that argument is data after all
    (step(params, opt_state, x, y): x). It is a batch where each of its leaves' leading dim is
    the batch's (micro-batches split it then), else "other"."""
    shape = lambda leaf: tuple(jax.numpy.shape(leaf))  # noqa: E731
    leaves = [(path[len("arg"):], shape(leaf), str(jax.numpy.result_type(leaf))) for path, _, leaf, _ in flat]
    fed = set(feeds(leaves, outs).values())
    batch = {shape(leaf)[0] for _, role, leaf, _ in flat if role == "batch" and shape(leaf)}
    tops: dict[str, list[int]] = {}
    for i, (path, _, _, _) in enumerate(flat):
        tops.setdefault(_TOP_ARG.match(path).group(0), []).append(i)
    roles = [role for _, role, _, _ in flat]
    for members in tops.values():
        guessed = all(flat[i][1] == "optimizer_state" and not flat[i][3] for i in members)
        if guessed and not fed.intersection(members):
            batched = len(batch) == 1 and all(shape(flat[i][2])[:1] == tuple(batch) for i in members)
            for i in members:
                roles[i] = "batch" if batched else "other"
    return roles


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
    with jax.set_mesh(mesh), top_k_lowered_as_sort():
        lowered = jitted.lower(*abstract[0], **abstract[1])
    module = sink_constants(mod.inline_calls(mod.copy_module(lowered.compiler_ir("stablehlo"))))
    flat = flat_arguments(args, kwargs, positions)
    n_out = lowered.out_tree.num_leaves
    out_leaves = jax.tree_util.tree_flatten_with_path(jax.tree_util.tree_unflatten(lowered.out_tree, range(n_out)))[0]
    out_paths = [f"out{jax.tree_util.keystr(p)}" for p, _ in out_leaves]
    outs = [(p[len("out"):], tuple(o.shape), str(o.dtype))
            for p, o in zip(out_paths, jax.tree.leaves(lowered.out_info))]
    return LoweredStep(lowered, module, [p for p, _, _, _ in flat], _unfed_state_is_data(flat, outs), out_paths)


def step_target(step: LoweredStep, mesh: Mesh, donated: tuple[int, ...] = ()) -> PlanTarget:
    """The target of a step lowered on `mesh` for the search (`lower_on_mesh`), with these flat
    arguments donated."""
    avals = jax.tree.leaves(step.lowered.in_avals)
    return PlanTarget(program=mod.fingerprint(step.module), arg_paths=tuple(step.arg_paths),
                      arg_shapes=tuple(tuple(int(d) for d in a.shape) for a in avals),
                      arg_dtypes=tuple(str(a.dtype) for a in avals), donated=tuple(donated), **_mesh_target(mesh))


def program_target(module: ir.Module, graph: Graph, mesh: Mesh) -> PlanTarget:
    """The target of one program cut from a step (micro-batches, pipeline stages) on its mesh or
    sub-mesh: a saved plan's program plan is checked against the program cut now."""
    values = [graph.values[a.value] for a in graph.args]
    return PlanTarget(program=mod.fingerprint(module), arg_paths=tuple(a.path for a in graph.args),
                      arg_shapes=tuple(v.shape for v in values), arg_dtypes=tuple(v.dtype for v in values),
                      donated=tuple(a.index for a in graph.args if a.donated_to is not None), **_mesh_target(mesh))


def _mesh_target(mesh: Mesh) -> dict:
    """A target's mesh fields: shape, axis names, platform, which process holds each device (row-major)."""
    return dict(mesh_shape=tuple(int(n) for n in mesh.devices.shape), axis_names=tuple(mesh.axis_names),
                platform=str(mesh.devices.flat[0].platform),
                processes=tuple(int(d.process_index) for d in mesh.devices.flat), jax_version=jax.__version__)
