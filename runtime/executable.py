"""Compile a rewritten module for the mesh with XLA's SPMD partitioner, within the devices' memory.

jax has no public entry point that compiles a StableHLO module we edited, so we hand the
module to the `Lowered` that jax built for the same function: its arguments, donation and
device assignment already match; only the module and the input/output shardings change.
That step uses jax internals, kept with the others in `hlo_passes.jax_internals`.

XLA's latency-hiding scheduler may hold buffers far longer than the program's order does, to
overlap collectives with compute: it runs each layer's weight-gradient GEMMs late, beside the
optimizer update, so their inputs stay live across many layers (a 70B loop of 32 layers
compiles to 114.6 GiB per device with it, 63.1 without; `benchmarks/memory_depth.md`). The
search prices the program's order, so a plan it fits to the memory limit can compile past it.
`compile_module` checks XLA's own memory analysis against the limit and, where the caller left
the scheduler to XLA, compiles again without it.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.extend.mlir import ir
from jax.sharding import NamedSharding

from rhino_jax.errors import CompiledMemoryWarning
from rhino_jax.hlo_passes import module as mod
from rhino_jax.hlo_passes.compiled_cost import program_device
from rhino_jax.hlo_passes.hlo_stats import compiled_memory
from rhino_jax.hlo_passes.jax_internals import compile_replacing_module

__all__ = ["compile_module", "compile_program", "LATENCY_HIDING"]

LATENCY_HIDING = "xla_gpu_enable_latency_hiding_scheduler"
GIB = 1 << 30


def compile_module(lowered: jax.stages.Lowered, module: ir.Module, in_shardings: Sequence[NamedSharding],
                   out_shardings: Sequence[NamedSharding], compiler_options: dict | None = None,
                   memory_limit_bytes: int | None = None) -> jax.stages.Compiled:
    """`module` compiled in place of `lowered`'s own (`lowered`, maybe jax's cached one, left as
    it was), with XLA's `compiler_options`. For GPUs, when the program needs more than
    `memory_limit_bytes` per device (XLA's memory analysis: arguments, outputs and temporaries)
    and `compiler_options` leave the latency-hiding scheduler to XLA, it is compiled again
    without it; the program that fits is kept, else the smaller, and a `CompiledMemoryWarning`
    says which, or that neither fits. A program that fits, or is for CPUs, is compiled once."""
    compiled = compile_replacing_module(lowered, module, in_shardings, out_shardings, compiler_options)
    if memory_limit_bytes is None or program_device(compiled).platform != "gpu":
        return compiled
    tried = [("as planned", compiled, compiled_memory(compiled).total)]
    if tried[0][2] <= memory_limit_bytes:
        return compiled
    if LATENCY_HIDING not in (compiler_options or {}):
        how = f"{LATENCY_HIDING}=False"
        program = compile_replacing_module(lowered, module, in_shardings, out_shardings,
                                           dict(compiler_options or {}, **{LATENCY_HIDING: False}))
        tried.append((how, program, compiled_memory(program).total))
    fits = [t for t in tried if t[2] <= memory_limit_bytes]
    how, kept, _ = fits[0] if fits else min(tried, key=lambda t: t[2])
    steps = "; ".join(f"{h}: {n / GIB:.2f} GiB" for h, _, n in tried)
    limit = f"{memory_limit_bytes / GIB:.2f} GiB per device (memory_limit_bytes, else the cluster's memory_per_device)"
    if fits:
        said = (f"XLA's latency-hiding scheduler took this program past the limit of {limit}, so it was compiled "
                f"again ({steps}); kept: {how}. Its collectives overlap less with compute; to keep the scheduler, "
                f"pass compiler_options={{{LATENCY_HIDING!r}: True}} to compile().")
    else:
        said = (f"XLA's compile of this plan does not fit the limit of {limit} ({steps}); kept: {how}. It will "
                "not fit on these devices: lower memory_limit_bytes (the search then plans for less memory), use "
                "more devices, or num_micro_batches / pipeline for less activation memory.")
    warnings.warn(said, CompiledMemoryWarning, stacklevel=3)
    return kept


def compile_program(module: ir.Module, in_avals: Sequence[jax.ShapeDtypeStruct],
                    out_avals: Sequence[jax.ShapeDtypeStruct], in_shardings: Sequence[NamedSharding],
                    out_shardings: Sequence[NamedSharding], aliases: Mapping[int, int] | None = None,
                    compiler_options: dict | None = None, memory_limit_bytes: int | None = None
                    ) -> jax.stages.Compiled:
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
    return compile_module(stand_in.lower(*in_avals), module, in_shardings, out_shardings, compiler_options,
                          memory_limit_bytes)
