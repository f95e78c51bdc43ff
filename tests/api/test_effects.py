"""Host callbacks in a step: ordered io_callbacks (jax threads a token through the step for them),
unordered ones and jax.debug.print run on the mesh as under jax.jit, once per step, with the same
values and, for ordered ones, in the same order; micro-batches and pipeline stages would run them
once per micro-batch, so those are refused, naming the callback."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback
from jax.sharding import PartitionSpec as P

import rhino_jax as rj
from rhino_jax import host_callbacks
from rhino_jax.errors import StagingError

from helpers import assert_same_numbers


def _on_mesh(w, x):
    """Pinned so that the step runs sharded (alone, this small step would be kept replicated)."""
    return rj.annotate(w, P(None, "model")), rj.annotate(x, P("data", None))


def _example():
    w = jnp.arange(64 * 64, dtype=jnp.float32).reshape(64, 64) / 4096 - 0.5
    x = jnp.arange(32 * 64, dtype=jnp.float32).reshape(32, 64) / 2048
    return w, x


def _ordered_step(log: list):
    """Three ordered callbacks, one of which returns a value the step uses, one inside a loop."""
    def record(tag):
        return lambda v: log.append((tag, np.array(v)))

    def doubled(v):
        log.append(("doubled", np.array(v)))
        return np.asarray(2 * v, np.float32)

    def step(w, x):
        w, x = _on_mesh(w, x)

        def loss(w):
            return (jnp.tanh(x @ w) ** 2).mean()
        value, grad = jax.value_and_grad(loss)(w)
        io_callback(record("loss"), None, value, ordered=True)
        scale = io_callback(doubled, jax.ShapeDtypeStruct((), jnp.float32), grad.sum(), ordered=True)

        def body(i, carry):
            io_callback(record("loop"), None, carry, ordered=True)
            return carry * 0.5 + grad[i].sum()
        carry = jax.lax.fori_loop(0, 3, body, scale)
        return w - 0.1 * scale * grad, value + carry
    return step


def _unordered_step(log: list):
    def step(w, x):
        w, x = _on_mesh(w, x)
        y = jnp.tanh(x @ w)
        io_callback(lambda v: log.append(("y", np.array(v))), None, y, ordered=False)
        jax.debug.print("sum of squares {s:.4f}", s=(y ** 2).sum())
        return w - 0.1 * y.T @ x, (y ** 2).sum()
    return step


def _run(step) -> tuple:
    out = step(*_example())
    jax.effects_barrier()
    return out


@pytest.mark.parametrize("make_step", [_ordered_step, _unordered_step], ids=["ordered", "unordered+debug.print"])
def test_callbacks_run_once_per_step_with_one_devices_values(make_step, capfd):
    expected_log, log = [], []
    expected = _run(jax.jit(make_step(expected_log)))
    printed = capfd.readouterr().out
    step = rj.parallelize(make_step(log), mesh=rj.device_mesh((2, 4), ("data", "model")), donate_argnums=(0,))
    assert any(s.spec != P() for s in jax.tree.leaves(step.lower(*_example()).plan.input_shardings))  # sharded
    assert_same_numbers(expected, _run(step))
    assert [tag for tag, _ in log] == [tag for tag, _ in expected_log]  # same calls, in the same order
    for (_, got), (_, want) in zip(log, expected_log):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # the same lines, the printed sums equal up to their last digit (a sharded sum adds in another order)
    got, want = capfd.readouterr().out.splitlines(), printed.splitlines()
    assert [re.sub(r"[\d.]+", "#", line) for line in got] == [re.sub(r"[\d.]+", "#", line) for line in want]
    for line, ref in zip(got, want):
        np.testing.assert_allclose(_numbers(line), _numbers(ref), rtol=1e-5)


def _numbers(line: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+\.\d+", line)]


@pytest.mark.parametrize("options", [dict(num_micro_batches=2), dict(pipeline=2, num_micro_batches=2)],
                         ids=["micro-batches", "pipeline"])
@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "unordered"])
def test_callbacks_are_refused_in_micro_batches_and_pipelines(ordered, options):
    def step(w, x):
        value, grad = jax.value_and_grad(lambda w: (jnp.tanh(x @ w) ** 2).mean())(w)
        io_callback(lambda v: None, None, value, ordered=ordered)
        return w - 0.1 * grad, value

    mesh = rj.device_mesh((2, 4), ("data", "model"))
    with pytest.raises(StagingError, match=r"calls back to the host \(io_callback at .*test_effects\.py:\d+\).*"
                                           + re.escape("use num_micro_batches=1 and pipeline='off'")):
        rj.parallelize(step, mesh=mesh, **options).lower(*_example())


def _pure_callback_step(rows: int):
    """A pure_callback whose array result feeds the gradient: rows x 512 float32 to the host."""
    def host(a):
        return np.asarray(np.tanh(a) * 2, dtype=a.dtype)

    def step(w, x):
        w, x = _on_mesh(w, x)
        h = x[:rows] @ jnp.tile(w, (1, 8))
        s = jax.pure_callback(host, jax.ShapeDtypeStruct(h.shape, h.dtype), h)
        grad = jax.grad(lambda w: ((x[:rows] @ jnp.tile(w, (1, 8))) * s).mean())(w)
        return w - 0.1 * grad, s.sum()
    return step


@pytest.mark.parametrize("rows", [2, 32], ids=["4KiB", "64KiB"])
def test_a_pure_callback_runs_or_is_refused_never_hangs(rows):
    """jaxlib 0.10's CPU client can deadlock on a callback's large operands on a mesh of several
    CPU devices (plain jax.jit too; `rhino_jax.host_callbacks`): there the step is refused before
    it runs, with what to do; a small callback, and any on a newer jaxlib, runs with one device's
    numbers."""
    step, args = _pure_callback_step(rows), _example()
    parallel = rj.parallelize(step, mesh=rj.device_mesh((2, 4), ("data", "model")))
    old = host_callbacks._jaxlib() < host_callbacks.FIXED_IN
    if old and rows * 512 * 4 > host_callbacks.SAFE_OPERAND_BYTES:
        with pytest.raises(rj.HostCallbackError, match=r"pure_callback sends the host 64 KiB.*upgrade jax and jaxlib "
                                                       r"to 0\.12 or later"):
            parallel(*args)
    else:
        assert_same_numbers(jax.jit(step)(*args), parallel(*args))
