"""Sharding rules of ops that used to fall back to replication: the max-pool gradient
(select_and_scatter), reverse, and a lookup in a vocabulary-split embedding table (gather)."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import rhino_jax as rj

from helpers import assert_same_numbers


def _mesh():
    return rj.device_mesh((8,), ("d",))


def _collectives(lowered, kind):
    return [c for c in lowered.compile().collectives.collectives if c.kind == kind]


def test_max_pool_gradient_stays_split_on_the_batch():
    """select_and_scatter has the rule of its unwindowed dims: with the images split on the batch,
    the max-pool's gradient is computed in place, and nothing is gathered."""
    def loss(x):
        x = rj.annotate(x, P("d", None, None, None))
        pooled = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        return jnp.sum(pooled ** 2)

    x = jax.random.normal(jax.random.PRNGKey(0), (16, 32, 32, 8))
    lowered = rj.parallelize(jax.grad(loss), mesh=_mesh()).lower(x)
    assert not [op for op in lowered.plan.fallback_ops if "select_and_scatter" in op], lowered.plan.fallback_ops
    assert not _collectives(lowered, "all-gather")
    assert_same_numbers(jax.jit(jax.grad(loss))(x), lowered.compile()(x))


def test_reverse_keeps_unreversed_dims_split():
    def f(x):
        x = rj.annotate(x, P("d", None))
        return jnp.flip(x, axis=1) * 2.0

    x = jnp.arange(64 * 512, dtype=jnp.float32).reshape(64, 512)
    lowered = rj.parallelize(f, mesh=_mesh()).lower(x)
    assert not lowered.plan.fallback_ops
    assert not lowered.compile().collectives.collectives
    assert_same_numbers(jax.jit(f)(x), lowered.compile()(x))


def test_reverse_of_a_split_dim_is_correct():
    """A dim split on the mesh and reversed cannot stay split in place (its shards would swap):
    the plan must move data, and the numbers stay right."""
    def f(x):
        return jnp.flip(rj.annotate(x, P(None, "d")), axis=1) + 1.0

    x = jnp.arange(64 * 512, dtype=jnp.float32).reshape(64, 512)
    lowered = rj.parallelize(f, mesh=_mesh()).lower(x)
    assert lowered.compile().collectives.collectives
    assert_same_numbers(jax.jit(f)(x), lowered.compile()(x))


def test_vocabulary_split_embedding_is_not_gathered():
    """Megatron's vocabulary-parallel embedding: each device looks up the rows it holds and the
    partial results are all-reduced, which moves the [B, S, D] output (128 KiB) instead of the
    [V, D] table (4 MiB)."""
    def loss(table, ids):
        table = rj.annotate(table, P("d", None))
        return jnp.sum(jnp.tanh(jnp.take(table, ids, axis=0)))

    table = jax.random.normal(jax.random.PRNGKey(0), (4096, 256))
    ids = jax.random.randint(jax.random.PRNGKey(1), (8, 16), 0, 4096)
    lowered = rj.parallelize(loss, mesh=_mesh()).lower(table, ids)
    gathered = [s for c in _collectives(lowered, "all-gather") for s in c.shapes]
    assert "f32[4096,256]" not in gathered, gathered
    assert any("f32[8,16,256]" in c.shapes for c in _collectives(lowered, "all-reduce")), \
        lowered.compile().collectives
    np.testing.assert_allclose(lowered.compile()(table, ids), jax.jit(loss)(table, ids), rtol=1e-5)
