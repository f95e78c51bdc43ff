"""Compile a rewritten module for the mesh with XLA's SPMD partitioner.

jax has no public entry point that compiles a StableHLO module we edited, so we hand the
module to the `Lowered` that jax built for the same function: its arguments, donation and
device assignment already match; only the module and the input/output shardings change.
This touches jax internals (`Lowered._lowering`), which is why setup.py pins jax < 0.11.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax.sharding import NamedSharding


def compile_module(lowered: jax.stages.Lowered, module: ir.Module,
                   in_shardings: Sequence[NamedSharding],
                   out_shardings: Sequence[NamedSharding]) -> jax.stages.Compiled:
    """Compile `module` in place of `lowered`'s own. jax caches lowerings per function and
    shapes, and a lowering keeps the executable it compiled first, so we edit a copy: the
    cached one (another plan's, or a plain `jax.jit`'s) stays as it was."""
    original = lowered._lowering
    if not hasattr(original, "_hlo") or "in_shardings" not in original.compile_args:
        raise RuntimeError(f"jax {jax.__version__} lays out Lowered differently than rhino_jax "
                           "expects; install jax 0.10.x")
    computation = copy.copy(original)
    computation._hlo = module
    computation._executable = None
    computation.compile_args = dict(original.compile_args, in_shardings=tuple(in_shardings),
                                    out_shardings=tuple(out_shardings))
    mine = jax.stages.Lowered(computation, lowered.args_info, lowered.out_tree, lowered._no_kwargs,
                              lowered._in_types, lowered._out_types)
    return mine.compile()


def compile_program(module: ir.Module, in_avals: Sequence[jax.ShapeDtypeStruct],
                    out_avals: Sequence[jax.ShapeDtypeStruct], in_shardings: Sequence[NamedSharding],
                    out_shardings: Sequence[NamedSharding]) -> jax.stages.Compiled:
    """Compile a module of ours that no jax function lowers to (a part of a step,
    `hlo_passes.split`): `compile_module` on the lowering of a stand-in with its signature.
    The compiled program takes and returns flat tuples of arrays."""
    stand_in = jax.jit(lambda *args: tuple(jnp.zeros(a.shape, a.dtype) for a in out_avals),
                       in_shardings=tuple(in_shardings), out_shardings=tuple(out_shardings), keep_unused=True)
    return compile_module(stand_in.lower(*in_avals), module, in_shardings, out_shardings)
