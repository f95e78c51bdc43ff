"""A plan read as a person reads it: an argument by its name, a layout in words, the layers
tensors and collectives belong to, collectives by kind, which device holds which slice. What
`explain`, `diff` and `render` say, said one way."""
from __future__ import annotations

import difflib
from dataclasses import dataclass

import jax
import numpy as np

from rhino_jax.core.plan import Plan, PlannedCollective
from rhino_jax.core.specs import ShardingSpec
from rhino_jax.hlo_passes.graph import path_tokens

from .errors import UnknownTensorError


def arg_index(plan: Plan, name: str) -> int:
    """The argument `name` names: its path as the report prints it (arg[0]['w']) or as a path of
    `plan.input_shardings` ([0]['w']); UnknownTensorError listing the closest names otherwise."""
    names = {p: i for i, p in enumerate(plan.arg_paths)}
    names.update((p.removeprefix("arg"), i) for i, p in enumerate(plan.arg_paths))
    if plan.input_shardings is not None:  # with keyword arguments its paths start [0] (args) or [1] (kwargs)
        leaves = jax.tree_util.tree_flatten_with_path(plan.input_shardings)[0]
        if len(leaves) == len(plan.arg_paths):
            names.update((jax.tree_util.keystr(p), i) for i, (p, _) in enumerate(leaves))
    key = str(name).strip().replace('"', "'")
    if key in names:
        return names[key]
    close = dict.fromkeys(plan.arg_paths[names[c]] for c in difflib.get_close_matches(key, list(names), n=8))
    shown = list(close)[:5] or list(plan.arg_paths[:5])
    raise UnknownTensorError(
        f"the plan has no argument {name!r}; it has {len(plan.arg_paths)} arguments, named as plan.report() prints "
        f"them or as paths of plan.input_shardings (without the leading 'arg'). "
        + ("Closest: " if close else "The first: ") + ", ".join(shown))


def describe(spec: ShardingSpec, shape: tuple[int, ...], axes: dict[str, int]) -> str:
    """A layout in words: which mesh axes split which dim, and which replicate it."""
    split = [f"dim {d} ({shape[d]}) split over {'+'.join(a)} ({ShardingSpec.shard_factor_of(a, axes)} ways)"
             for d, a in enumerate(spec.dims) if a]
    if not split:
        return f"replicated on all {int(np.prod(list(axes.values())))} devices"
    rest = [a for a in axes if a not in spec.used_axes() and axes[a] > 1]
    return "; ".join(split) + (f"; replicated over {', '.join(rest)}" if rest else "")


def plan_axes(plan: Plan) -> dict[str, int]:
    """The axes an argument's layout is over: a pipeline's arguments live on their stage's
    sub-mesh (all stages alike; an interlaced pipeline's on every device use the same axes),
    others on the whole mesh."""
    return next((st.mesh_axes for st in plan.stages if not st.shared), plan.mesh_axes)


def all_collectives(plan: Plan) -> list[PlannedCollective]:
    """The collectives of one step that move data: a pipeline's apply-gradients programs' (in
    `plan.collectives`) and its stages' forward and backward programs', once per micro-batch. One
    over mesh axes of a single device (a layout naming an axis of size 1 on a stage's sub-mesh)
    moves nothing, costs nothing and is no op XLA compiles: left out."""
    k = plan.execution.micro_batches
    runs = [plan.collectives] + [p.collectives * k for st in plan.stages for p in (st.forward, st.backward) if p]
    return [c for run in runs for c in run if c.group > 1]


def _keys(path: str) -> list[str]:
    """An argument path's dict keys and indices from its first dict key on (the attributes and
    indices before it, an optimizer's chain and moment, left out): arg[1][0].mu['Block_0']['kernel']
    → ['Block_0', 'kernel']."""
    tokens = path_tokens(path)
    first = next((j for j, (kind, _) in enumerate(tokens) if kind == "key"), len(tokens))
    return [text for kind, text in tokens[first:] if kind != "attr"]


def arg_layers(plan: Plan) -> dict[str, str]:
    """Argument path → its layer: the keys of the parameter it belongs to, less the leaf's own
    name ("Block_0/Dense_0"), so a parameter and its optimizer moments share one (a state's path
    ends with its parameter's: arg[1]['mu']['head']['w'] and arg[0]['head']['w'] → "head"); a
    leaf alone in its path is its own layer, every batch argument in "(batch)"."""
    keys = [_keys(p) for p in plan.arg_paths]
    params = {tuple(k) for k, role in zip(keys, plan.arg_roles) if role == "parameter"}
    out = {}
    for path, role, k in zip(plan.arg_paths, plan.arg_roles, keys):
        own = next((k[j:] for j in range(len(k)) if tuple(k[j:]) in params), k)
        out[path] = "(batch)" if role == "batch" else "/".join(own[:-1]) or "/".join(own) or path
    return out


def op_layer(where: str, layers: dict[str, str]) -> str:
    """The layer of the op a collective serves (`PlannedCollective.where`): an argument's
    (`arg_layers`), else the named scopes in its source name less the transformations, einsum
    specs and the primitive ("transpose(jvp(LM))/Block_0/Dense_0/transpose" → "Block_0/Dense_0");
    "" for an op in no named scope."""
    if where in layers:
        return layers[where]
    parts = [p for p in where.split("/") if p and not any(c in p for c in "()->,")]
    # Flax names a module's scope twice where its method runs in it (.../SelfAttention_0/SelfAttention_0/query)
    return "/".join(p for k, p in enumerate(parts[:-1]) if k == 0 or p != parts[k - 1])


@dataclass(frozen=True)
class Kind:
    """Collectives of one kind, summed."""

    count: int = 0
    bytes: int = 0
    alone_s: float = 0.0  # each priced alone, before XLA combines them
    combined_s: float | None = 0.0  # their shares of the ops XLA combines them into; None: not kept

    def add(self, c: PlannedCollective) -> "Kind":
        combined = None if self.combined_s is None or c.combined_s is None else self.combined_s + c.combined_s
        return Kind(self.count + 1, self.bytes + c.bytes, self.alone_s + c.time_s, combined)


def by_kind(collectives: list[PlannedCollective]) -> dict[str, Kind]:
    """Kind → the collectives of that kind summed, kinds in the order they first run."""
    out: dict[str, Kind] = {}
    for c in collectives:
        out[c.kind] = out.get(c.kind, Kind()).add(c)
    return out


def kinds_text(collectives: list[PlannedCollective]) -> str:
    """Collectives summed by kind: "all-gather ×2 (512.0 KiB, 2.41 µs in the step, 37.6 µs alone)"."""
    return ", ".join(f"{kind} ×{k.count} ({bytes_text(k.bytes)}, {times(k)})" for kind, k in by_kind(collectives).items())


def times(k: Kind) -> str:
    """What collectives summed by kind cost: in the step (as XLA combines them) and alone."""
    alone = f"{k.alone_s * 1e6:.1f} µs alone"
    return alone if k.combined_s is None else f"{k.combined_s * 1e6:.3g} µs in the step ({alone})"


def bytes_text(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def ms_text(seconds: float, sign: bool = False) -> str:
    """Seconds in ms to the tenth of a µs (a difference of -0.00001 µs prints as +0.0000)."""
    return f"{round(seconds * 1e3, 4) + 0.0:{'+' if sign else ''}.4f} ms"


def holdings(spec: ShardingSpec, shape: tuple[int, ...], axes: dict[str, int], devices: tuple[int, ...]
             ) -> dict[int, tuple[tuple[int, int], ...]]:
    """Device → the [start, stop) of each dim it holds of a tensor of `shape` laid out as `spec`
    on a mesh of `axes` whose devices (ids or positions) are `devices`, row-major: what jax's
    `NamedSharding(mesh, spec).devices_indices_map(shape)` says, without needing the devices.
    A dim split over several axes takes the first as the major one, as a PartitionSpec does; a
    strided dim is read in its split form (`ShardingSpec.split`)."""
    shape, spec = spec.split(tuple(shape), axes)
    out = {}
    for device, at in zip(devices, np.ndindex(*axes.values())):
        coord = dict(zip(axes, at))
        held = []
        for size, dim_axes in zip(shape, spec.dims):
            k, n = 0, 1
            for axis in dim_axes:
                k, n = k * axes[axis] + coord[axis], n * axes[axis]
            held.append((k * size // n, (k + 1) * size // n))
        out[device] = tuple(held)
    return out


def arg_meshes(plan: Plan) -> list[tuple[dict[str, int], tuple[int, ...]]] | None:
    """Each argument's mesh, as (axis sizes, device ids row-major), from the plan's shardings (a
    pipeline's state on its stage's sub-mesh); None for a plan that has none."""
    leaves = jax.tree.leaves(plan.input_shardings) if plan.input_shardings is not None else []
    if len(leaves) != len(plan.arg_paths):
        return None
    return [(dict(zip(s.mesh.axis_names, s.mesh.devices.shape)), tuple(int(d.id) for d in s.mesh.devices.flat))
            for s in leaves]


def positions(plan: Plan) -> list[tuple[dict[str, int], tuple[int, ...]]]:
    """Each argument's mesh with its devices as positions: the mesh its layout names (a stage's
    sub-mesh for a pipeline, `plan_axes`)."""
    axes = plan_axes(plan)
    return [(axes, tuple(range(int(np.prod(list(axes.values()), dtype=np.int64)))))] * len(plan.arg_paths)
