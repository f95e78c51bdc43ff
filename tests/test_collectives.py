"""Resharding as the cost model prices it, against what XLA compiles for it."""
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import rhino_jax as rj
from rhino_jax.search.collectives import reshard
from rhino_jax.search.specs import ShardingSpec

from helpers import assert_same_numbers

XY = {"x": 2, "y": 4}


def spec(*dims):
    return ShardingSpec(tuple(tuple(d) for d in dims))


def test_axes_in_another_order_are_permuted():
    moves = reshard(spec(("x", "y"), ()), spec(("y", "x"), ()), 64 * 64 * 4, XY, (64, 64))
    assert [(c.kind, c.bytes) for c in moves] == [("collective-permute", 64 * 64 * 4 // 8)]


def test_an_axis_moved_in_front_of_another_is_moved_then_permuted():
    """The all-to-all appends the axis it moves as the minor one; dst wants it major."""
    moves = reshard(spec(("y",), ("x",), ()), spec((), ("y", "x"), ()), 16 * 64 * 64 * 4, XY, (16, 64, 64))
    assert [c.kind for c in moves] == ["all-to-all", "collective-permute"]
    assert reshard(spec(("y",), ("x",), ()), spec((), ("x", "y"), ()), 16 * 64 * 64 * 4, XY, (16, 64, 64))[-1].kind == "all-to-all"


def test_compiled_reshard_matches_the_prediction():
    """XLA compiles the move from [x, y, -] to [-, x+y, -] as the model predicts it: x moves
    to dim 1 behind y, then the pieces are permuted into x-major order."""
    def f(a):
        b = rj.annotate(jnp.sin(a), P("x", "y", None))
        return rj.annotate(jnp.cos(b), P(None, ("x", "y"), None))

    a = jax.random.normal(jax.random.PRNGKey(0), (16, 64, 32))
    mesh = rj.device_mesh((2, 4), ("x", "y"))
    lowered = rj.parallelize(f, mesh=mesh).lower(a)
    predicted = sorted((c.kind, c.bytes) for c in lowered.plan.collectives)
    compiled = lowered.compile()
    found = sorted((c.kind, c.bytes) for c in compiled.collectives.collectives)
    assert ("collective-permute", 16 * 64 * 32 * 4 // 8) in predicted, predicted
    assert found == predicted, (found, predicted)
    assert_same_numbers(jax.jit(f)(a), compiled(a))


def test_partial_sums_settle_where_the_plan_priced_them():
    """A matmul's partial sums (contraction split on x) read split on (x, y): the plan reduce-
    scatters into x behind y, then permutes; the rewrite pins the settled layout so that XLA
    does not settle them some other way (it gathered the operands instead, on MoE)."""
    def f(a, w):
        a = rj.annotate(a, P("y", "x"))
        w = rj.annotate(w, P("x", None))
        return rj.annotate(jnp.tanh(a @ w), P(("x", "y"), None))

    a = jax.random.normal(jax.random.PRNGKey(0), (64, 256))
    w = jax.random.normal(jax.random.PRNGKey(1), (256, 128))
    lowered = rj.parallelize(f, mesh=rj.device_mesh((2, 4), ("x", "y"))).lower(a, w)
    predicted = sorted((c.kind, c.bytes) for c in lowered.plan.collectives)
    compiled = lowered.compile()
    found = sorted((c.kind, c.bytes) for c in compiled.collectives.collectives)
    assert [k for k, _ in predicted] == ["collective-permute", "reduce-scatter"], predicted
    assert sum(b for _, b in found) == sum(b for _, b in predicted), (found, predicted)
    assert_same_numbers(jax.jit(f)(a, w), compiled(a, w))
