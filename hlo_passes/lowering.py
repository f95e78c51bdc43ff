"""Lower a step on the mesh and describe its entry arguments (pytree path and role).

The step is lowered once, with every argument and result replicated on the mesh and the mesh
set as context (so `rj.annotate` pins become Shardy constraints). The search reads that module;
the rewrite later swaps in the plan's shardings without tracing the function again. What a plan
is made for (`PlanTarget`) is read from the lowered step here: a saved plan is checked against it.
An argument's role (parameter, optimizer state, batch) comes from the types around it, else from
the step's dataflow in the lowered module, else from its key names and position.
"""
from __future__ import annotations

import functools
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import jax
from jax.extend.mlir import ir
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rhino_jax.core.plan_target import PlanTarget

from . import module as mod
from .graph import SLOTWISE, Graph, reach
from .importer import import_module, pinned_whole
from .jax_internals import top_k_lowered_as_sort
from .sinking import sink_constants

_OPT_KEYS = ("opt", "optimizer", "count", "step")
_BATCH_KEYS = ("batch", "inputs", "input", "labels", "targets", "tokens", "images", "x", "y")
_STATE_ROLES = ("parameter", "optimizer_state")
_CONTRACTIONS = ("stablehlo.dot_general", "stablehlo.convolution")


@dataclass
class LoweredStep:
    lowered: jax.stages.Lowered
    # a private inlined copy, the constants a loop was handed sunk into it (`sinking`): import and rewrite work on it
    module: ir.Module
    arg_paths: list[str]
    arg_roles: list[str]
    output_paths: list[str]
    # the module as it was imported to find the roles, and its graph with those roles: what
    # `import_step` reads while the module is that one (a rewrite that swaps it is imported anew)
    imported: tuple[ir.Module, Graph] | None = field(default=None, repr=False, compare=False)


class FlatArgument(NamedTuple):
    """One leaf of a call, with the role its types, else its key names, else its argument's
    position give (`source`: "type", "name" or "position"); the step's dataflow may overrule
    the last two (`_dataflow_roles`)."""

    path: str
    role: str
    leaf: object
    source: str


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


def _named_role(keys: Sequence[str]) -> str | None:
    """The role key names give: an optimizer's or a counter's (a Flax `TrainState`'s step), a
    parameter's or a batch's; None without one. An optimizer's moments are not told by name (a
    VAE's mean layer is "mu" too): the step's dataflow tells them (`_dataflow_roles`)."""
    if any(k in _OPT_KEYS or k.startswith("opt") for k in keys):
        return "optimizer_state"
    if any(k in ("params", "param", "weights") for k in keys):
        return "parameter"
    if any(k in _BATCH_KEYS for k in keys):
        return "batch"
    return None


def infer_role(keys: Sequence[str], position: int, num_args: int) -> str:
    """Parameter, optimizer state or batch, from the argument position and the key names (`keys`:
    the argument's keyword, if passed by keyword, then the keys inside it), for a leaf its types
    give no role (`typed_roles`).

    The usual signature is step(params, opt_state, batch) or step(state, batch) with
    state.params / state.opt_state; keys that name an optimizer or a batch win over position.
    Keyword arguments count as passed positionally after the positional ones, in call order."""
    named = _named_role(keys)
    if named is not None:
        return named
    if num_args > 1 and position == num_args - 1:
        return "batch"
    return "parameter" if position == 0 else "optimizer_state"


def flat_arguments(args: Sequence, kwargs: dict | None = None, positions: Sequence[int] | None = None
                   ) -> list[FlatArgument]:
    """Each leaf of a call, in the order jax flattens (args, kwargs): paths `arg[i]...` for
    positional arguments (`positions[i]`: the user's position, when static arguments were taken
    out) and `arg['name']...` for keyword ones."""
    kwargs = kwargs or {}
    num_args = len(args) + len(kwargs)
    order = {name: len(args) + k for k, name in enumerate(kwargs)}
    typed = typed_roles((tuple(args), kwargs))
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
        typed_role = typed.get(jax.tree_util.keystr(path))
        if typed_role is not None:
            role, source = typed_role, "type"
        else:
            role, source = infer_role(keys, position, num_args), "name" if _named_role(keys) else "position"
        out.append(FlatArgument(label + jax.tree_util.keystr(rest), role, leaf, source))
    return out


def _read_by_the_model(graph: Graph, bits: Sequence[int], state: Sequence[int], data: Sequence[int]
                       ) -> dict[int, str]:
    """Argument index → "parameter" or "optimizer_state", for the leaves of `state` (the arguments
    the step feeds back) that the dataflow tells apart (`bits`: per value, the arguments it is
    made from, bit i for argument i): by the ops where a leaf's own value, not yet mixed with
    `data` (the arguments it does not feed back), meets a value that is. The model reads a
    parameter so: in a contraction, or broadcast, gathered or sliced to a shape not its own (a
    bias added to activations, an embedding looked up by the tokens). The update reads an
    optimizer's state only elementwise with the gradient, at its own shape (an Adam moment
    mirrors its parameter, yet meets only the gradient). Told are the float leaves with dims that
    meet the data: gradients are only of floats, and a scalar (a step count, a learning rate the
    state holds) is broadcast onto the update as a parameter is onto the activations."""
    leaves = {i: graph.values[graph.args[i].value] for i in state}
    told = [i for i, v in leaves.items()
            if v.shape and jax.numpy.issubdtype(jax.numpy.dtype(v.dtype), jax.numpy.inexact)]
    if not told or not data:
        return {}
    from_data = functools.reduce(operator.or_, (1 << i for i in data), 0)
    of_shape: dict[tuple[int, ...], int] = {}
    for i in told:
        of_shape[leaves[i].shape] = of_shape.get(leaves[i].shape, 0) | 1 << i
    candidates = functools.reduce(operator.or_, of_shape.values(), 0)
    met = model = 0
    for n in graph.nodes:
        if n.op in SLOTWISE or "branches" in n.attrs:  # passes values on (a loop kept whole: hides where it mixes)
            continue
        reads = [bits[o] for o in n.operands]
        if not any(b & from_data for b in reads):
            continue
        own = functools.reduce(operator.or_, (b for b in reads if not b & from_data), 0) & candidates
        kept = 0 if n.op in _CONTRACTIONS else \
            functools.reduce(operator.or_, (of_shape.get(graph.values[r].shape, 0) for r in n.results), 0)
        met, model = met | own, model | (own & ~kept)
    return {i: "parameter" if model >> i & 1 else "optimizer_state" for i in told if met >> i & 1}


_TOP_ARG = re.compile(r"arg\[[^\]]*\]")


def _dataflow_roles(flat: Sequence[FlatArgument], graph: Graph) -> list[str]:
    """The roles of a call's leaves, where the step's dataflow tells them (`graph`: the step
    imported with `flat`'s roles). A step returns the state it updates: an argument a result
    feeds back (`Graph.fed_back`), whole or in part, and is made from (not one that only shares
    its path and shape: predictions returned where the labels came in) holds state, whose leaves
    are parameters or optimizer state (`_read_by_the_model`; where it cannot tell, as types, names
    and position say, never a batch). An argument taken for optimizer state by its position
    alone that is not fed back is data after all (step(params, opt_state, x, y): x): a batch
    where each of its leaves' leading dim is the batch's (micro-batches split it then), else
    "other". Types decide before the dataflow (`typed_roles`)."""
    pairs = graph.fed_back()
    bits = reach(graph, {a.value: 1 << a.index for a in graph.args}) if pairs else []
    fed = {i for k, i in pairs.items() if bits[graph.outputs[k]] >> i & 1}
    tops: dict[str, list[int]] = {}
    for i, a in enumerate(flat):
        tops.setdefault(_TOP_ARG.match(a.path).group(0), []).append(i)
    state = [i for members in tops.values() if fed.intersection(members) for i in members]
    data = [i for members in tops.values() if not fed.intersection(members) for i in members]
    told = _read_by_the_model(graph, bits, state, data)
    roles = [a.role for a in flat]
    for i in state:
        if flat[i].source != "type":
            roles[i] = told.get(i) or (flat[i].role if flat[i].role in _STATE_ROLES else "optimizer_state")
    guessed = [members for members in tops.values() if not fed.intersection(members)
               and all(flat[i].role == "optimizer_state" and flat[i].source == "position" for i in members)]
    lead = lambda i: tuple(jax.numpy.shape(flat[i].leaf))[:1]  # noqa: E731
    batch = ({lead(i) for i, role in enumerate(roles) if role == "batch" and lead(i)}
             or {lead(i) for members in guessed for i in members if lead(i)})
    for members in guessed:
        batched = len(batch) == 1 and all(lead(i) in batch for i in members)
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
    paths = [a.path for a in flat]
    graph = import_module(module, paths, [a.role for a in flat], out_paths)
    roles = _dataflow_roles(flat, graph)
    graph = graph.replace(args=tuple(replace(a, role=roles[k]) for k, a in enumerate(graph.args)))
    return LoweredStep(lowered, module, paths, roles, out_paths, (module, graph))


def import_step(step: LoweredStep) -> Graph:
    """The Graph IR of a step lowered whole (`lower_on_mesh`), its typed PRNG keys (and any other
    leaf of an extended dtype) among its arguments and results pinned whole: jax lays such a
    leaf out along its own dims, while the module holds its key data, whose trailing dim of words
    the leaf lacks, so a split the search made of the key data would be one jax cannot make."""
    if step.imported is not None and step.imported[0] is step.module:
        graph = step.imported[1]
    else:
        graph = import_module(step.module, step.arg_paths, step.arg_roles, step.output_paths)
    return pinned_whole(graph, *extended_leaves(step))


def extended_leaves(step: LoweredStep) -> tuple[list[bool], list[bool]]:
    """Which of the step's arguments and results are leaves of an extended dtype (typed PRNG keys)."""
    def extended(aval) -> bool:
        return jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended)
    return ([extended(a) for a in jax.tree.leaves(step.lowered.in_avals)],
            [extended(o) for o in jax.tree.leaves(step.lowered.out_info)])


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
