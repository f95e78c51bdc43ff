"""Every use of jax's private API in rhino_jax, in one place.

The MLIR bindings (`ir`, the func/stablehlo/sdy dialects) are public in `jax.extend.mlir` and
imported from there. Two things have no public equivalent in jax 0.10.2 through 0.12.x (their
layout is the same in all three):

- compiling a StableHLO module we edited into a `jax.stages.Compiled` (`compile_replacing_module`):
  `jax.stages.Lowered` is only built by jax itself, from the private `Lowering` it keeps. The
  public alternatives fall short: `jax.extend.backend` compiles a module into a bare executable
  (no pytrees, shardings or donation), and `jax.export` only calls modules that it exported itself;
- XLA's cost analysis of an HLO module given as text (`hlo_cost_analysis`), for while-loop bodies
  priced on their own.

A third, an MLIR context with jax's dialects (`ir_context`), is made from public calls, but relies
on what `Lowered.compiler_ir` returns, which jax leaves unspecified. A fourth swaps one primitive's
lowering while a step is lowered (`top_k_lowered_as_sort`): jax registers lowerings in a private
table. A fifth, the PRNG implementation of a typed key's dtype (`key_impl_of`): jax gives it of a
key array only (`jax.random.key_impl`), and a program's result is known by its dtype before it is
made.

Each lookup that fails raises `UnsupportedJaxError` naming the jax range rhino_jax supports;
tests/hlo_passes/test_jax_versions.py exercises every one, so a jax that lays them out differently fails
there first, with that message.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax.extend.mlir import ir
from jax.sharding import NamedSharding

from rhino_jax.errors import RhinoError

# The jax (and jaxlib) versions whose internals match this module; setup.py pins the same range.
SUPPORTED_JAX = ">=0.10.2,<0.13"


class UnsupportedJaxError(RhinoError, RuntimeError):
    """The installed jax lays out an internal that rhino_jax relies on differently."""


def _unsupported(what: str, err: Exception) -> UnsupportedJaxError:
    return UnsupportedJaxError(
        f"jax {jax.__version__} lays out {what} differently than rhino_jax expects "
        f"({type(err).__name__}: {err}); rhino_jax supports jax{SUPPORTED_JAX}: "
        f"install a jax and jaxlib in that range (pip install 'jax{SUPPORTED_JAX}' 'jaxlib{SUPPORTED_JAX}')")


def _private(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise _unsupported(f"{module}.{name}", e) from e


def key_impl_of(dtype: Any) -> Any:
    """The PRNG implementation of a typed key's dtype (`key<fry>`), as `jax.random.wrap_key_data`
    takes it: to return a program's key data as the typed key the step returns."""
    impl = getattr(dtype, "_impl", None)
    if impl is None:
        raise _unsupported(f"the PRNG key dtype {dtype}", AttributeError("_impl"))
    return impl


@contextlib.contextmanager
def top_k_lowered_as_sort() -> Iterator[None]:
    """While a step is lowered, `lax.top_k` lowered as a stable sort and a slice (`_top_k_by_sort`).
    XLA computes its own TopK replicated: it gathers the rows first, split or not (measured with
    jax 0.10.2 and 0.12 on the CPU), where a sort along the last dim stays split along the others;
    an MoE router's top-2 over its [tokens, experts] logits is such a top_k."""
    mlir = importlib.import_module("jax._src.interpreters.mlir")
    table = getattr(mlir, "_lowerings", None)
    if not isinstance(table, dict) or jax.lax.top_k_p not in table:
        raise _unsupported("jax._src.interpreters.mlir._lowerings", KeyError("top_k"))
    own = table[jax.lax.top_k_p]
    mlir.register_lowering(jax.lax.top_k_p, mlir.lower_fun(_top_k_by_sort, multiple_results=True))
    try:
        yield
    finally:
        table[jax.lax.top_k_p] = own


def _top_k_by_sort(operand, *, k: int, axis: int = -1, **_):
    """The k largest along `axis` and their indices, as XLA's TopK gives them: ascending in the
    values' total order (-NaN < -inf < ... < -0.0 < 0.0 < ... < inf < NaN, an integer key of each
    float's bits), then by descending index, reversed and cut to k: equal values keep the lower
    index first."""
    lax = jax.lax
    axis %= operand.ndim
    index = lax.broadcasted_iota("int32", operand.shape, axis)
    key = operand
    if jax.numpy.issubdtype(operand.dtype, jax.numpy.floating):
        bits = lax.bitcast_convert_type(operand, f"int{operand.dtype.itemsize * 8}")
        key = jax.numpy.where(bits < 0, bits ^ jax.numpy.iinfo(bits.dtype).max, bits)
    _, negated, values = lax.sort((key, -index, operand), dimension=axis, num_keys=2, is_stable=True)
    values, negated = lax.rev(values, (axis,)), lax.rev(negated, (axis,))
    return [lax.slice_in_dim(values, 0, k, axis=axis), -lax.slice_in_dim(negated, 0, k, axis=axis)]


def ir_context() -> ir.Context:
    """A new MLIR context with the dialects of jax's modules (func, stablehlo, sdy, chlo, ...):
    the one jax made for lowering a trivial function (jax's own maker of such contexts is private;
    this relies only on `compiler_ir` returning an `ir.Module`, as hlo_passes.lowering does)."""
    module = jax.jit(lambda: 0).lower().compiler_ir("stablehlo")
    if not isinstance(module, ir.Module):
        raise _unsupported("Lowered.compiler_ir", TypeError(f"it returned a {type(module).__name__}, "
                                                            "not an MLIR module"))
    return module.context


def hlo_cost_analysis(hlo_text: str, device: jax.Device) -> Any:
    """XLA's cost analysis of the HLO module `hlo_text` on `device`'s backend, as jaxlib returns it
    (a dict of 'flops', 'bytes accessed', ...). Parse and analysis errors propagate unchanged."""
    parse = _private("jaxlib._hlo", "hlo_module_from_text")
    analyse = _private("jaxlib._jax", "hlo_module_cost_analysis")
    return analyse(device.client, parse(hlo_text))


def compile_replacing_module(lowered: jax.stages.Lowered, module: ir.Module,
                             in_shardings: Sequence[NamedSharding],
                             out_shardings: Sequence[NamedSharding],
                             compiler_options: dict | None = None) -> jax.stages.Compiled:
    """Compile `module` in place of `lowered`'s own, with these input and output shardings and
    XLA's `compiler_options` (as `jax.stages.Lowered.compile` takes them); the arguments, donation
    and device assignment stay `lowered`'s. `lowered` itself is left as it was (jax caches
    lowerings, and a lowering keeps the first executable it compiled), so we edit a copy of its
    `Lowering`."""
    try:
        original = lowered._lowering
        args = original.compile_args
        missing = [k for k in ("in_shardings", "out_shardings") if k not in args]
        if missing or not hasattr(original, "_hlo") or not hasattr(original, "_executable"):
            raise AttributeError(f"Lowering {type(original).__name__} has no _hlo, _executable or "
                                 f"compile_args {missing}")
        computation = copy.copy(original)
        computation._hlo = module
        computation._executable = None
        computation.compile_args = dict(args, in_shardings=tuple(in_shardings),
                                        out_shardings=tuple(out_shardings))
        mine = jax.stages.Lowered(computation, lowered.args_info, lowered.out_tree, lowered._no_kwargs,
                                  lowered._in_types, lowered._out_types)
    except (AttributeError, TypeError) as e:
        raise _unsupported("jax.stages.Lowered", e) from e
    return mine.compile(compiler_options=compiler_options)
