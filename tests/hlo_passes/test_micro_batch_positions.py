"""Micro-batches and pipelines that number the batch's examples: dropout's random bits, an
arange over the batch, typed PRNG keys, bf16 sums. The numbers of the whole batch, or a refusal
that names the op and its line."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rhino_jax as rj
from rhino_jax.errors import MeshError, StagingError

from helpers import assert_same_numbers

MESH = ((2, 4), ("data", "model"))


def _mesh():
    return rj.device_mesh(*MESH)


def _dropout_step(w, key, x):
    def loss(w):
        return jnp.mean(jnp.where(jax.random.bernoulli(key, 0.5, x.shape), x, 0.0) @ w)
    value, grad = jax.value_and_grad(loss)(w)
    return w - 0.1 * grad, value


def _arange_step(w, x):
    def loss(w):  # each example weighted by its position in the batch
        return jnp.sum(jnp.arange(x.shape[0])[:, None] * jnp.tanh(x @ w))
    value, grad = jax.value_and_grad(loss)(w)
    return w - 0.01 * grad, value


def _x():
    return jax.random.normal(jax.random.PRNGKey(0), (64, 16))


@pytest.mark.parametrize("key", [jax.random.PRNGKey(1), jax.random.key(1)], ids=["raw", "typed"])
def test_dropout_draws_the_whole_batchs_bits_in_each_micro_batch(key):
    w = jnp.ones((16, 4))
    step = rj.parallelize(_dropout_step, mesh=_mesh(), num_micro_batches=4)
    assert_same_numbers(jax.jit(_dropout_step)(w, key, _x()), step(w, key, _x()))


def test_an_arange_over_the_batch_counts_the_whole_batch():
    w = jnp.ones((16, 4)) * 0.1
    step = rj.parallelize(_arange_step, mesh=_mesh(), num_micro_batches=4)
    assert_same_numbers(jax.jit(_arange_step)(w, _x()), step(w, _x()))


def test_an_arange_indexing_the_batch_stays_the_micro_batchs_own():
    def step(w, x, labels):  # x[arange(B), labels]: positions as indices into the micro-batch's rows
        def loss(w):
            logits = x @ w
            return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(x.shape[0]), labels])
        value, grad = jax.value_and_grad(loss)(w)
        return w - 0.1 * grad, value
    w, labels = jnp.ones((16, 4)) * 0.1, jnp.arange(64) % 4
    parallel = rj.parallelize(step, mesh=_mesh(), num_micro_batches=4)
    assert_same_numbers(jax.jit(step)(w, _x(), labels), parallel(w, _x(), labels))


class _DropoutLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 32)(tokens)
        for _ in range(2):
            h = nn.Dropout(0.3, deterministic=False)(nn.gelu(nn.Dense(64)(x)))
            x = x + nn.Dense(32)(h)
        return nn.Dense(64)(x)


def _flax_case(model: nn.Module, key, opt=optax.adam(1e-2)):
    """A train step of `model` (an LM drawing dropout from `key`) with `opt`, and its arguments."""

    def step(params, opt_state, key, tokens):
        def loss_fn(p):
            logits = model.apply({"params": p}, tokens[:, :-1], rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    tokens = jax.random.randint(jax.random.PRNGKey(0), (16, 9), 0, 64)
    params = model.init({"params": jax.random.PRNGKey(1), "dropout": jax.random.PRNGKey(5)}, tokens[:, :-1])["params"]
    return step, (params, opt.init(params), key, tokens)


@pytest.mark.parametrize("key", [jax.random.PRNGKey(2), jax.random.key(2)], ids=["raw", "typed"])
@pytest.mark.parametrize("pipeline", ["off", 2])
def test_flax_dropout_keeps_one_devices_numbers_micro_batched_and_pipelined(key, pipeline):
    step, args = _flax_case(_DropoutLM(), key)
    parallel = rj.parallelize(step, mesh=_mesh(), num_micro_batches=4, pipeline=pipeline)
    assert_same_numbers(jax.jit(step)(*args), parallel(*args))


class _ScannedBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.Dropout(0.3, deterministic=False)(nn.gelu(nn.Dense(64)(x)))
        return x + nn.Dense(32)(h), None


class _ScannedDropoutLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 32)(tokens)
        layers = nn.scan(nn.remat(_ScannedBlock), variable_axes={"params": 0},
                         split_rngs={"params": True, "dropout": True}, length=3)
        x, _ = layers()(x, None)
        return nn.Dense(64)(x)


def test_dropout_in_scanned_remat_layers_keeps_one_devices_numbers():
    """The draws inside the scan's loop body count from the micro-batch's first example too. (SGD:
    Adam divides by a gradient's root mean square, so where one is near zero the order in which
    the micro-batches add it up moves its update past the tolerance.)"""
    step, args = _flax_case(_ScannedDropoutLM(), jax.random.PRNGKey(2), optax.sgd(0.1))
    parallel = rj.parallelize(step, mesh=_mesh(), num_micro_batches=4)
    assert_same_numbers(jax.jit(step)(*args), parallel(*args))


def test_a_pipeline_counts_the_whole_batch():
    def step(params, x):
        def loss(p):
            h = jnp.tanh(x @ p["a"])
            return jnp.sum(jnp.arange(x.shape[0])[:, None] * jnp.tanh(h @ p["b"]))
        value, grad = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grad), value
    params = {"a": jnp.ones((16, 16)) * 0.1, "b": jnp.ones((16, 16)) * 0.1}
    parallel = rj.parallelize(step, mesh=_mesh(), num_micro_batches=4, pipeline=2)
    assert_same_numbers(jax.jit(step)(params, _x()), parallel(params, _x()))


def test_a_typed_key_passes_through_a_micro_batched_step():
    def step(w, key, x):
        draw, key = jax.random.split(key)
        new_w, loss = _dropout_step(w, draw, x)
        return new_w, loss, key
    w, key = jnp.ones((16, 4)), jax.random.key(3)
    expected, got = jax.jit(step)(w, key, _x()), rj.parallelize(step, mesh=_mesh(), num_micro_batches=4)(w, key, _x())
    assert jax.dtypes.issubdtype(got[2].dtype, jax.dtypes.prng_key)
    assert_same_numbers(jax.random.key_data(expected[2]), jax.random.key_data(got[2]))
    assert_same_numbers(expected[:2], got[:2])


def test_bits_of_the_hardware_generator_are_refused_with_the_op_and_line():
    key = jax.random.key(1, impl="rbg")
    with pytest.raises(StagingError, match=r"test_micro_batch_positions\.py:\d+.*rng_bit_generator.*"
                                           r"num_micro_batches=1"):
        rj.parallelize(_dropout_step, mesh=_mesh(), num_micro_batches=4).lower(jnp.ones((16, 4)), key, _x())


def test_non_partitionable_threefry_is_refused_with_the_op_and_line():
    with jax.threefry_partitionable(False):
        with pytest.raises(StagingError, match=r"test_micro_batch_positions\.py:\d+.*moves the positions.*"
                                               r"jax_threefry_partitionable"):
            rj.parallelize(_dropout_step, mesh=_mesh(), num_micro_batches=4).lower(
                jnp.ones((16, 4)), jax.random.PRNGKey(1), _x())


def _bf16_step(w, x, y):
    def loss(w):
        return jnp.mean((jnp.tanh(x @ w) - y).astype(jnp.float32) ** 2)
    value, grad = jax.value_and_grad(loss)(w)
    return grad, value


def test_bf16_gradients_are_added_up_in_float32_unless_asked():
    """Each micro-batch's part of a bf16 gradient is rounded to bf16 where the whole batch rounds
    the sum once: some difference stays. Added up in float32 (the default) the parts are rounded
    once more, not k - 1 times: fewer elements differ from the whole batch, by less, and the
    result is as close to the float32 step as the whole batch's."""
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    w = (jax.random.normal(ks[0], (64, 256)) * 0.1).astype(jnp.bfloat16)
    x = jax.random.normal(ks[1], (256, 64)).astype(jnp.bfloat16)
    y = jax.random.normal(ks[2], (256, 256)).astype(jnp.bfloat16)
    whole = np.asarray(jax.jit(_bf16_step)(w, x, y)[0], np.float32)
    exact = np.asarray(jax.jit(_bf16_step)(*(a.astype(jnp.float32) for a in (w, x, y)))[0])

    def grad(accumulation_dtype):
        step = rj.parallelize(_bf16_step, mesh=_mesh(), num_micro_batches=8, accumulation_dtype=accumulation_dtype)
        got = step(w, x, y)[0]
        assert got.dtype == jnp.bfloat16
        return np.asarray(got, np.float32)

    f32, own = grad("float32"), grad(None)
    assert (f32 != whole).sum() < 0.8 * (own != whole).sum()
    assert np.abs(f32 - whole).mean() < 0.6 * np.abs(own - whole).mean()
    assert np.abs(f32 - exact).mean() < 1.25 * np.abs(whole - exact).mean()


def test_bf16_running_sums_are_priced_in_their_accumulation_dtype():
    w, x, y = jnp.ones((64, 256), jnp.bfloat16), jnp.ones((4096, 64), jnp.bfloat16), jnp.ones((4096, 256), jnp.bfloat16)
    memory = {}
    for dtype in ("float32", None):
        lowered = rj.parallelize(_bf16_step, mesh=_mesh(), num_micro_batches=8, accumulation_dtype=dtype).lower(w, x, y)
        compute = lowered.programs["compute_gradients"].cost.memory_bytes
        memory[dtype] = lowered.plan.cost.memory_bytes - compute  # the running sums beside compute-gradients
    assert memory["float32"] > memory[None] > 0


def test_accumulation_dtype_is_checked():
    with pytest.raises(ValueError, match=r"accumulation_dtype must be 'float32'.*got 'bfloat16'"):
        rj.parallelize(_bf16_step, mesh=_mesh(), num_micro_batches=2, accumulation_dtype="bfloat16")


@pytest.mark.parametrize("batch,words", [
    ({"x": jnp.ones((8, 4)), "n": jnp.float32(3)}, r"\['n'\] is a scalar in the batch"),
    ({"x": jnp.ones((0, 4)), "n": jnp.ones((0,))}, r"holds no examples")])
def test_a_batch_micro_batches_cannot_cut_says_which_leaf(batch, words):
    def step(w, batch):
        value, grad = jax.value_and_grad(lambda w: jnp.sum(batch["x"] @ w) * jnp.sum(batch["n"]))(w)
        return w - grad, value
    with pytest.raises(MeshError, match=words):
        rj.parallelize(step, mesh=_mesh(), num_micro_batches=2).lower(jnp.ones((4, 2)), batch)
