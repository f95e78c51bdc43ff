"""A step closing over a large array: jax embeds it in the module, so the module is copied and
fingerprinted in memory, never printed whole or parsed from text (which cost seconds and GiBs per
copy for a 512 MiB constant; benchmarks/large_constants.py measures it)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.mlir import ir

import rhino_jax as rj
from rhino_jax.hlo_passes.lowering import lower_on_mesh, step_target

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
    first = step_target(lower_on_mesh(_step(_constant()), args, mesh, ()), mesh)
    second = step_target(lower_on_mesh(_step(_constant(changed)), args, mesh, ()), mesh)
    assert (first.program != second.program) == changed


def test_micro_batches_compare_the_large_constants_of_their_two_lowerings_by_bytes(monkeypatch):
    """Micro-batching lowers the step twice (whole batch, one micro-batch) and checks that their
    constants agree but for the batch size; a large one is compared by its data, not printed."""
    constant = _constant()[0]

    def step(w, x):
        value, grad = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh((x @ constant) * w) ** 2))(w)
        return w - 0.1 * grad, value

    w, x = jnp.float32(0.5), jnp.asarray(np.random.default_rng(0).normal(size=(16, SHAPE[1])), jnp.float32)
    expected = jax.jit(step)(w, x)
    printed = ir.DenseElementsAttr.__str__

    def small_only(attr):
        assert attr.is_splat or len(attr) <= 64, "a large constant was printed"
        return printed(attr)

    monkeypatch.setattr(ir.DenseElementsAttr, "__str__", small_only)
    out = rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), num_micro_batches=2)(w, x)
    assert_same_numbers(expected, out)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_complex_constant_is_imported_and_kept(micro_batches):
    """MLIR's Python bindings cannot read complex dense elements (reading the attribute raises):
    such a constant is still imported, compared and run."""
    phases = np.exp(1j * np.arange(16)).astype(np.complex64)

    def step(w, x):
        def loss(w):
            return jnp.mean(jnp.abs(jnp.fft.fft(jnp.tanh(x @ w), axis=-1) * phases) ** 2)
        value, grad = jax.value_and_grad(loss)(w)
        return w - 0.01 * grad, value

    w = jnp.full((16, 16), 0.1, jnp.float32)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(32, 16)), jnp.float32)
    mesh = rj.device_mesh((2, 4), ("data", "model"))
    out = rj.parallelize(step, mesh=mesh, num_micro_batches=micro_batches)(w, x)
    assert_same_numbers(jax.jit(step)(w, x), out)
