"""Compile a rewritten module for the mesh with XLA's SPMD partitioner.

jax has no public entry point that compiles a StableHLO module we edited, so we hand the
module to the `Lowered` that jax built for the same function: its arguments, donation and
device assignment already match; only the module and the input/output shardings change.
That step uses jax internals, kept with the others in `hlo_passes.jax_internals`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.extend.mlir import ir
from jax.sharding import NamedSharding

from rhino_jax.hlo_passes import module as mod
# compile_module(lowered, module, in_shardings, out_shardings, compiler_options=None): `module`
# compiled in place of `lowered`'s own, `lowered` (maybe jax's cached one) left as it was.
from rhino_jax.hlo_passes.jax_internals import compile_replacing_module as compile_module

__all__ = ["compile_module", "compile_program"]


def compile_program(module: ir.Module, in_avals: Sequence[jax.ShapeDtypeStruct],
                    out_avals: Sequence[jax.ShapeDtypeStruct], in_shardings: Sequence[NamedSharding],
                    out_shardings: Sequence[NamedSharding], aliases: Mapping[int, int] | None = None,
                    compiler_options: dict | None = None) -> jax.stages.Compiled:
    """Compile a module of ours that no jax function lowers to (a part of a step,
    `hlo_passes.split`): `compile_module` on the lowering of a stand-in with its signature.
    The compiled program takes and returns flat tuples of arrays. `aliases`: argument i → the
    output that overwrites it (same shape, dtype and sharding), as jax.jit's donation: the
    caller's array is deleted. Marked on `module`, in place; jax's own pairing for the stand-in
    (by each device's piece) might pair them otherwise."""
    aliases = dict(aliases or {})
    stand_in = jax.jit(lambda *args: tuple(jnp.zeros(a.shape, a.dtype) for a in out_avals),
                       in_shardings=tuple(in_shardings), out_shardings=tuple(out_shardings), keep_unused=True,
                       donate_argnums=tuple(aliases))
    if aliases:
        mod.set_aliases(module, aliases)
    return compile_module(stand_in.lower(*in_avals), module, in_shardings, out_shardings, compiler_options)
