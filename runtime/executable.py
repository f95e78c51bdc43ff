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
GiB per device, compiles to 573 GiB; `benchmarks/results/memory_depth.md`). `compile_module` checks
XLA's own memory analysis against the limit and compiles again with remedies until one fits.
Each costs step time (the latency-hiding scheduler hides communication behind compute; a
program tied to its order leaves it less to move), so each is priced from its compiled program
as its schedule runs (`compiled_cost.price_compiled`, overlapped) and the fastest that fits is
kept. First those that keep the scheduler: the scheduler held to the limit (its memory budget,
`xla_gpu_memory_limit_slop_factor`), and the program tied to its order; then both; last the
program without the latency-hiding scheduler.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.extend.mlir import ir
from jax.sharding import NamedSharding

from rhino_jax.errors import CompiledMemoryWarning
from rhino_jax.hlo_passes import module as mod
from rhino_jax.runtime.compiled.compiled_cost import price_compiled, program_device
from rhino_jax.runtime.compiled.memory import CompiledMemory, compiled_memory
from rhino_jax.hlo_passes.jax_internals import compile_replacing_module
from rhino_jax.hlo_passes.program_order import tie_to_program_order
from rhino_jax.search.cost.cluster import Cluster

__all__ = ["compile_module", "compile_program", "tied_to_order", "Weights", "LATENCY_HIDING"]

LATENCY_HIDING = "xla_gpu_enable_latency_hiding_scheduler"
# XLA's GPU scheduler keeps a program's temporaries within a budget: SCHEDULED_SHARE of the
# device's memory, less the program's arguments and outputs, times SLOP percent (DEFAULT_SLOP
# unless set). The same budget bounds its rematerialization.
SLOP, DEFAULT_SLOP, SCHEDULED_SHARE = "xla_gpu_memory_limit_slop_factor", 95, 0.8
REAIMS, REAIM_SHARE = 2, 0.95  # a held scheduler that overshoots the limit: aimed again, lower (`_held`)
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
                   memory_limit_bytes: int | None = None, weights: Weights = Weights(),
                   cluster: Cluster | None = None) -> jax.stages.Compiled:
    """`module` compiled in place of `lowered`'s own (`lowered`, maybe jax's cached one, left as
    it was), with XLA's `compiler_options`. For GPUs, where the program needs more than
    `memory_limit_bytes` per device (XLA's memory analysis: arguments, outputs and temporaries),
    it is compiled again with remedies (`_remedied`; `weights`: the parameters whose reads may
    be tied to the program's order), each priced on `cluster` as its schedule runs; the fastest
    that fits is kept, else the smallest, and a `CompiledMemoryWarning` says what each try held
    and cost. A program that fits at once, or is for CPUs, is compiled once, as planned."""
    compiled = compile_replacing_module(lowered, module, in_shardings, out_shardings, compiler_options)
    if memory_limit_bytes is None or program_device(compiled).platform != "gpu":
        return compiled
    planned = _Try.of("as planned", compiled, cluster)
    if planned.nbytes <= memory_limit_bytes:
        return compiled
    compile_again = lambda how, m, options: _Try.of(  # noqa: E731
        how, compile_replacing_module(lowered, m, in_shardings, out_shardings, options), cluster)
    tried = _remedied(compile_again, planned, module, dict(compiler_options or {}), weights, memory_limit_bytes,
                      cluster)
    fits = [t for t in tried if t.nbytes <= memory_limit_bytes]
    kept = min(fits, key=_Try.seconds) if fits else min(tried, key=lambda t: t.nbytes)
    steps = "; ".join(map(str, tried))
    limit = f"{_size(memory_limit_bytes)} per device (memory_limit_bytes, else the cluster's memory_per_device)"
    if fits:
        said = (f"XLA's GPU schedule of this program went past the limit of {limit}, so it was compiled again "
                f"({steps}); kept: {kept.how}{kept.slower_than(planned)}.")
        if LATENCY_HIDING in kept.how:
            said += (" Its collectives overlap less with compute; to keep the scheduler, pass "
                     f"compiler_options={{{LATENCY_HIDING!r}: True}} to compile().")
    else:
        said = (f"XLA's compile of this plan does not fit the limit of {limit} ({steps}); kept: {kept.how}. It will "
                "not fit on these devices: lower memory_limit_bytes (the search then plans for less memory), use "
                "more devices, or num_micro_batches / pipeline for less activation memory.")
    warnings.warn(said, CompiledMemoryWarning, stacklevel=3)
    return kept.program


def _remedied(compile_again: Callable[[str, ir.Module, dict], _Try], planned: _Try, module: ir.Module,
              options: dict, weights: Weights, limit: int, cluster: Cluster | None) -> list[_Try]:
    """The program as planned and its remedies, in rounds, each tried only where no program of
    the rounds before fits: those that keep the latency-hiding scheduler (held to the limit,
    `_held`; tied to the program's order), then both together, then the program (tied where it
    can be) without the scheduler, unless the caller's `options` name it."""
    tried, tied = [planned], tied_to_order(module, weights)
    fits = lambda: any(t.nbytes <= limit for t in tried)  # noqa: E731
    slop = _held_slop(planned, limit, cluster, options)
    if slop is not None:
        tried += _held(compile_again, "", module, options, slop, limit)
    if tied is not None:
        tried.append(compile_again("tied to the program's order", tied, options))
    if slop is not None and tied is not None and not fits():
        tried += _held(compile_again, "tied to the program's order and ", tied, options, slop, limit)
    if LATENCY_HIDING not in options and not fits():
        unscheduled = f"{LATENCY_HIDING}=False"
        tried.append(compile_again(unscheduled if tied is None else f"tied to the program's order and {unscheduled}",
                                   tied or module, dict(options, **{LATENCY_HIDING: False})))
    return tried


def _held(compile_again: Callable[[str, ir.Module, dict], _Try], what: str, module: ir.Module, options: dict,
          slop: int, limit: int) -> list[_Try]:
    """`module` compiled with the latency-hiding scheduler's budget at `slop`; where XLA's buffers
    still go past `limit`, aimed again (`REAIMS` times at most) at `REAIM_SHARE` of the room left
    for temporaries, lower by the share the last try's overshot: the scheduler's estimate of what
    it holds is not XLA's buffer assignment."""
    tries = []
    while True:
        tries.append(compile_again(f"{what}its latency-hiding scheduler held to the limit ({SLOP}={slop})", module,
                                   dict(options, **{SLOP: slop})))
        temp = tries[-1].memory.temp_bytes
        lower = int(slop * REAIM_SHARE * (limit - tries[-1].held_around) / temp) if temp else 0
        if tries[-1].nbytes <= limit or len(tries) > REAIMS or not 1 <= lower < slop:
            return tries
        slop = lower


@dataclass(frozen=True)
class _Try:
    """One compile of a program: how it was made, what XLA's memory analysis says it holds, and
    its step priced as its schedule runs (None without a cluster to price on)."""

    how: str
    program: jax.stages.Compiled
    memory: CompiledMemory
    overlapped_s: float | None

    @classmethod
    def of(cls, how: str, program: jax.stages.Compiled, cluster: Cluster | None) -> "_Try":
        priced = None if cluster is None else price_compiled(program, cluster).overlapped_s
        return cls(how, program, compiled_memory(program), priced)

    @property
    def nbytes(self) -> int:
        return self.memory.total

    @property
    def held_around(self) -> int:
        """What its arguments and outputs hold: all but the temporaries."""
        return self.memory.total - self.memory.temp_bytes

    def seconds(self) -> float:
        """The time the choice among programs that fit goes by; unpriced, they rank as tried."""
        return 0.0 if self.overlapped_s is None else self.overlapped_s

    def slower_than(self, planned: _Try) -> str:
        """What keeping this program costs against the one as planned, in words."""
        if self.overlapped_s is None or planned.overlapped_s is None:
            return ""
        return (f", its step priced {self.overlapped_s * 1e3:.4g} ms against {planned.overlapped_s * 1e3:.4g} ms "
                f"as planned ({self.overlapped_s / planned.overlapped_s - 1:+.1%})")

    def __str__(self) -> str:
        priced = "" if self.overlapped_s is None else f", {self.overlapped_s * 1e3:.4g} ms"
        return f"{self.how}: {_size(self.nbytes)}{priced}"


def _held_slop(planned: _Try, limit: int, cluster: Cluster | None, options: dict) -> int | None:
    """The slop factor that holds XLA's latency-hiding scheduler to `limit`, or None where it
    cannot tighten the scheduler's own budget. That budget is a share of the device's memory less
    what the program's arguments and outputs hold, in percent (`SCHEDULED_SHARE`, `SLOP`); the
    device's memory is the cluster's `memory_per_device`. The caller's own options win: one that
    sets the slop factor or turns the scheduler off is not held."""
    if cluster is None or SLOP in options or options.get(LATENCY_HIDING) is False:
        return None
    io = planned.held_around
    budget = SCHEDULED_SHARE * cluster.memory_per_device - io
    slop = int(100 * (limit - io) / budget) if budget > 0 else 0
    return slop if 1 <= slop < DEFAULT_SLOP else None


def tied_to_order(module: ir.Module, weights: Weights) -> ir.Module | None:
    """A copy of `module` tied to its program's order (`hlo_passes.program_order`; `weights`: the
    parameters whose reads may be tied), or None where there is nothing to tie."""
    tied = mod.copy_module(module)
    return tied if tie_to_program_order(tied, weights.parameters, weights.split) else None


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def compile_program(module: ir.Module, in_avals: Sequence[jax.ShapeDtypeStruct],
                    out_avals: Sequence[jax.ShapeDtypeStruct], in_shardings: Sequence[NamedSharding],
                    out_shardings: Sequence[NamedSharding], aliases: Mapping[int, int] | None = None,
                    compiler_options: dict | None = None, memory_limit_bytes: int | None = None,
                    weights: Weights = Weights(), cluster: Cluster | None = None) -> jax.stages.Compiled:
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
                          memory_limit_bytes, weights, cluster)
