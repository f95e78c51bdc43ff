"""Cone DP (Rhino §4.3.2, level 1): choices inside a cone that the DP alone cannot price."""
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import rhino_jax as rj

from helpers import assert_same_numbers


def test_layer_norm_of_a_split_batch_moves_nothing():
    """The mean's broadcast reads its input from another cone (the reduction joins its producer's):
    split or replicated reads tie inside the cone, and the split one must win, since reading the
    replicated mean would all-gather it."""
    def f(x, g):
        x = rj.annotate(x, P("d", None, None))
        m = jnp.mean(x, axis=-1, keepdims=True)
        v = jnp.mean((x - m) ** 2, axis=-1, keepdims=True)
        return rj.annotate((x - m) * jax.lax.rsqrt(v + 1e-5) * g, P("d", None, None))

    x = jax.random.normal(jax.random.PRNGKey(0), (16, 8, 64))
    g = jnp.linspace(0.5, 1.5, 64)
    lowered = rj.parallelize(f, mesh=rj.device_mesh((8,), ("d",))).lower(x, g)
    assert not lowered.plan.collectives, lowered.plan.collectives
    compiled = lowered.compile()
    assert not compiled.collectives.collectives, compiled.collectives
    assert_same_numbers(jax.jit(f)(x, g), compiled(x, g))
