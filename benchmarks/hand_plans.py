"""Hand plans as users write them with plain jax: `jax.jit(step, in_shardings=..., out_shardings=...)`
over a mesh (data parallel, FSDP, ZeRO-1/2, Megatron), for the third-party steps
(`third_party_models.Case`). Outputs keep their inputs' shardings, the loss is replicated:

- data parallel: the batch split on every device, the state replicated;
- FSDP: the batch split likewise, every parameter and optimizer leaf split on its largest dim the
  device count divides (replicated when none does);
- ZeRO-1/2: data parallel with the Adam moments split as FSDP splits them;
- Megatron: the weights named in the model's `tp_rules` split over the last mesh axis, the batch
  split over the first on a 2-D mesh (DP x TP), replicated on a 1-D one.
"""
from __future__ import annotations

import re

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.third_party_models import Case

HAND = ("data parallel", "FSDP", "ZeRO-1/2", "Megatron")


def _split(x, dim: int, axes, n: int) -> P:
    """`x` split on `dim` over `axes` when n divides it, else replicated."""
    if x.ndim == 0 or x.shape[dim] % n:
        return P()
    spec = [None] * x.ndim
    spec[dim] = axes
    return P(*spec)


def _largest_divisible(x, axes, n: int) -> P:
    dims = [d for d in range(x.ndim) if x.shape[d] % n == 0]
    if not dims:
        return P()
    return _split(x, max(dims, key=lambda d: x.shape[d]), axes, n)


def _tp(case: Case, path, x, axis: str, n: int) -> P:
    key = jax.tree_util.keystr(path)
    for pattern, dim in case.tp_rules:
        if re.search(pattern, key):
            return _split(x, dim % x.ndim, axis, n) if x.ndim else P()
    return P()


# optax's Adam moments, by their place in the state's path: `.mu[...]` in a NamedTuple (linen,
# equinox), `['mu']` in an nnx.State.
_MOMENT = re.compile(r"(?:\.|\[')(?:mu|nu)(?:'\])?(?=[.\[]|$)")


def _is_moment(path) -> bool:
    return bool(_MOMENT.search(jax.tree_util.keystr(path)))


def hand_specs(case: Case, method: str, mesh: Mesh):
    """PartitionSpec pytrees (inputs, outputs) of a hand plan; outputs = the state inputs + loss."""
    names, sizes = mesh.axis_names, dict(zip(mesh.axis_names, mesh.devices.shape))
    every = names if len(names) > 1 else names[0]
    n_all = mesh.devices.size
    state, batch = case.args[:-1], case.args[-1]
    if method == "data parallel":
        state_specs = jax.tree.map(lambda x: P(), state)
        batch_specs = jax.tree.map(lambda x: _split(x, 0, every, n_all), batch)
    elif method == "FSDP":
        state_specs = jax.tree.map(lambda x: _largest_divisible(x, every, n_all), state)
        batch_specs = jax.tree.map(lambda x: _split(x, 0, every, n_all), batch)
    elif method == "ZeRO-1/2":
        state_specs = jax.tree_util.tree_map_with_path(
            lambda p, x: _largest_divisible(x, every, n_all) if _is_moment(p) else P(), state)
        batch_specs = jax.tree.map(lambda x: _split(x, 0, every, n_all), batch)
    elif method == "Megatron":
        model = names[-1]
        state_specs = jax.tree_util.tree_map_with_path(lambda p, x: _tp(case, p, x, model, sizes[model]), state)
        data = names[0] if len(names) > 1 else None
        batch_specs = jax.tree.map(lambda x: _split(x, 0, data, sizes[data]) if data else P(), batch)
    else:
        raise ValueError(f"unknown hand plan {method!r}; choose one of {HAND}")
    return (*state_specs, batch_specs), (*state_specs, P())


def compile_hand(case: Case, method: str, mesh: Mesh):
    ins, outs = hand_specs(case, method, mesh)
    named = lambda specs: jax.tree.map(lambda s: NamedSharding(mesh, s), specs,  # noqa: E731
                                       is_leaf=lambda s: isinstance(s, P))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), case.args)
    return jax.jit(case.step, in_shardings=named(ins), out_shardings=named(outs)).lower(*abstract).compile()
