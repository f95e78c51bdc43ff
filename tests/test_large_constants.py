"""A step closing over a large array: jax embeds it in the module, so the module is copied and
fingerprinted in memory, never printed whole or parsed from text (which cost seconds and GiBs per
copy for a 512 MiB constant; benchmarks/large_constants.py measures it)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.mlir import ir

import rhino_jax as rj
from rhino_jax.hlo_passes.lowering import lower_on_mesh
from rhino_jax.plan_target import PlanTarget

from helpers import assert_same_numbers

SHAPE = (16, 256, 256)  # 4 MiB of float32


def _constant(changed: bool = False) -> jax.Array:
    c = jnp.arange(np.prod(SHAPE), dtype=jnp.float32).reshape(SHAPE) / np.prod(SHAPE)
    return c.at[3, 100, 7].add(1.0) if changed else c


def _step(constant):
    def step(w, x):
        return ((constant @ x) * w).sum(), jnp.tanh(constant[:, :, :8] * w)
    return step


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"the module was {what}")
    return refuse


def test_a_large_closed_over_constant_is_neither_printed_nor_parsed(monkeypatch):
    step = _step(_constant())
    w, x = jnp.float32(0.5), jnp.ones((SHAPE[2], 8), jnp.float32) / 7
    expected = jax.jit(step)(w, x)
    monkeypatch.setattr(ir.Module, "parse", staticmethod(_refuse("parsed from text")))
    monkeypatch.setattr(ir.Module, "__str__", _refuse("printed whole"))
    out = rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)))(w, x)
    assert_same_numbers(expected, out)


@pytest.mark.parametrize("changed", [False, True], ids=["same", "one-element-changed"])
def test_the_program_fingerprint_reads_the_elements_it_does_not_print(changed):
    mesh = rj.device_mesh((8,), ("data",))
    args = (jnp.float32(0.5), jnp.ones((SHAPE[2], 8), jnp.float32))
    first = PlanTarget.of(lower_on_mesh(_step(_constant()), args, mesh, ()), mesh)
    second = PlanTarget.of(lower_on_mesh(_step(_constant(changed)), args, mesh, ()), mesh)
    assert (first.program != second.program) == changed
