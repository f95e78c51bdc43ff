"""Compile a rewritten module for the mesh with XLA's SPMD partitioner, within the devices' memory.

jax has no public entry point that compiles a StableHLO module we edited, so we hand the
module to the `Lowered` that jax built for the same function: its arguments, donation and
device assignment already match; only the module and the input/output shardings change.
That step uses jax internals, kept with the others in `hlo_passes.jax_internals`.

XLA's GPU schedule can hold buffers far longer than the program's order, which the search
prices, so a plan fitted to the memory limit can compile past it. Its memory scheduler gathers
every split weight as early as it can, at the program's start, and its latency-hiding scheduler
runs each layer's weight-gradient GEMMs late, beside the optimizer update, so their inputs stay
live across layers (`hlo_passes.program_order`: a 70B-wide loop of 80 layers, planned at 55.7
GiB per device, compiles to 573 GiB; `benchmarks/memory_depth.md`). `compile_module` checks
XLA's own memory analysis against the limit and compiles again with remedies, in turn, until
the program fits: the program tied to its order by optimization barriers, then also without
the latency-hiding scheduler.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.extend.mlir import ir
from jax.sharding import NamedSharding

from rhino_jax.errors import CompiledMemoryWarning
from rhino_jax.hlo_passes import module as mod
from rhino_jax.hlo_passes.compiled_cost import program_device
from rhino_jax.hlo_passes.hlo_stats import compiled_memory
from rhino_jax.hlo_passes.jax_internals import compile_replacing_module
from rhino_jax.hlo_passes.program_order import tie_to_program_order

__all__ = ["compile_module", "compile_program", "tied_to_order", "Weights", "LATENCY_HIDING"]

LATENCY_HIDING = "xla_gpu_enable_latency_hiding_scheduler"
GIB = 1 << 30


@dataclass(frozen=True)
class Weights:
    """A program's parameters, by position among its array arguments, and those its plan splits:
    the reads `compile_module` may tie to the layer before (`hlo_passes.program_order`)."""

    parameters: tuple[int, ...] = ()
    split: tuple[int, ...] = ()

    @classmethod
    def of(cls, roles: Sequence[str], specs: Sequence) -> "Weights":
        """From a plan's `arg_roles` and `arg_specs`."""
        parameters = tuple(i for i, role in enumerate(roles) if role == "parameter")
        return cls(parameters, tuple(i for i in parameters if not specs[i].is_replicated()))


def compile_module(lowered: jax.stages.Lowered, module: ir.Module, in_shardings: Sequence[NamedSharding],
                   out_shardings: Sequence[NamedSharding], compiler_options: dict | None = None,
                   memory_limit_bytes: int | None = None, weights: Weights = Weights()) -> jax.stages.Compiled:
    """`module` compiled in place of `lowered`'s own (`lowered`, maybe jax's cached one, left as
    it was), with XLA's `compiler_options`. For GPUs, while the program needs more than
    `memory_limit_bytes` per device (XLA's memory analysis: arguments, outputs and temporaries),
    it is compiled again with one more remedy: tied to the program's order
    (`hlo_passes.program_order`; `weights`: the parameters whose reads may be tied), then,
    unless `compiler_options` names it, also without XLA's latency-hiding scheduler. The first
    program that fits is kept, else the smallest; a `CompiledMemoryWarning` says what was done,
    or that none fits. A program that fits at once, or is for CPUs, is compiled once, as planned."""
    compiled = compile_replacing_module(lowered, module, in_shardings, out_shardings, compiler_options)
    if memory_limit_bytes is None or program_device(compiled).platform != "gpu":
        return compiled
    tried = [("as planned", compiled, compiled_memory(compiled).total)]
    if tried[0][2] <= memory_limit_bytes:
        return compiled
    for how, (remedied, options) in _remedies(module, compiler_options, weights):
        program = compile_replacing_module(lowered, remedied, in_shardings, out_shardings, options)
        tried.append((how, program, compiled_memory(program).total))
        if tried[-1][2] <= memory_limit_bytes:
            break
    fits = [t for t in tried if t[2] <= memory_limit_bytes]
    how, kept, _ = fits[0] if fits else min(tried, key=lambda t: t[2])
    steps = "; ".join(f"{h}: {_size(n)}" for h, _, n in tried)
    limit = f"{_size(memory_limit_bytes)} per device (memory_limit_bytes, else the cluster's memory_per_device)"
    if fits:
        said = (f"XLA's GPU schedule of this program went past the limit of {limit}, so it was compiled again "
                f"({steps}); kept: {how}.")
        if LATENCY_HIDING in how:
            said += (" Its collectives overlap less with compute; to keep the scheduler, pass "
                     f"compiler_options={{{LATENCY_HIDING!r}: True}} to compile().")
    else:
        said = (f"XLA's compile of this plan does not fit the limit of {limit} ({steps}); kept: {how}. It will "
                "not fit on these devices: lower memory_limit_bytes (the search then plans for less memory), use "
                "more devices, or num_micro_batches / pipeline for less activation memory.")
    warnings.warn(said, CompiledMemoryWarning, stacklevel=3)
    return kept


def tied_to_order(module: ir.Module, weights: Weights) -> ir.Module | None:
    """A copy of `module` tied to its program's order (`hlo_passes.program_order`; `weights`: the
    parameters whose reads may be tied), or None where there is nothing to tie."""
    tied = mod.copy_module(module)
    return tied if tie_to_program_order(tied, weights.parameters, weights.split) else None


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def _remedies(module: ir.Module, compiler_options: dict | None,
              weights: Weights) -> Iterator[tuple[str, tuple[ir.Module, dict]]]:
    """(what it is, (module, compiler options)) of each next try, each adding to the one before:
    the program tied to its order, then no latency-hiding scheduler (unless the caller's options
    name it)."""
    options, tied = dict(compiler_options or {}), tied_to_order(module, weights)
    if tied is not None:
        yield "tied to the program's order", (tied, options)
    if LATENCY_HIDING not in options:
        yield (f"{'and ' if tied is not None else ''}{LATENCY_HIDING}=False",
               (tied or module, dict(options, **{LATENCY_HIDING: False})))


def compile_program(module: ir.Module, in_avals: Sequence[jax.ShapeDtypeStruct],
                    out_avals: Sequence[jax.ShapeDtypeStruct], in_shardings: Sequence[NamedSharding],
                    out_shardings: Sequence[NamedSharding], aliases: Mapping[int, int] | None = None,
                    compiler_options: dict | None = None, memory_limit_bytes: int | None = None,
                    weights: Weights = Weights()) -> jax.stages.Compiled:
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
                          memory_limit_bytes, weights)
