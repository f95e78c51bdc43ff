"""Helpers shared by the model-zoo modules (private: not part of the zoo's interface).

Every zoo module builds its step from the same three pieces: a ``constrain(x, role)`` hook
(identity unless a baseline passes one), an Adam train step around a loss
(``rhino_jax.models.adam``), and an example builder that allocates nothing when ``abstract``.
The convolution helpers are NHWC / HWIO throughout.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax

from rhino_jax.models.adam import adam_init, adam_update

PyTree = Any
Constrain = Callable[[jax.Array, str], jax.Array]
TrainStep = Callable[[PyTree, dict, dict], tuple[PyTree, dict, jax.Array]]


def no_constrain(x: jax.Array, role: str) -> jax.Array:
    """The default ``constrain`` hook: leave every activation to the parallelizer."""
    del role
    return x


def adam_step(loss_fn: Callable[[PyTree, dict], jax.Array], lr: float) -> TrainStep:
    """``step(params, opt_state, batch) -> (params, opt_state, loss)``: one Adam step on ``loss_fn``."""

    def train_step(params: PyTree, opt_state: dict, batch: dict):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        params, opt_state = adam_update(grads, opt_state, params, lr=lr)
        return params, opt_state, loss

    return train_step


def train_step_for(loss: Callable[..., jax.Array], config: Any, constrain: Optional[Constrain]) -> TrainStep:
    """The zoo's ``make_train_step``: Adam (lr = config.lr) on ``loss(params, batch, config, constrain)``."""
    constrain = constrain or no_constrain
    return adam_step(lambda params, batch: loss(params, batch, config, constrain), config.lr)


def image_classification_batch(key: jax.Array, config: Any) -> dict:
    """``images`` [batch, size, size, in_channels] and integer ``labels`` below ``num_classes``."""
    ki, kl = jax.random.split(key)
    s = config.image_size
    return {"images": jax.random.normal(ki, (config.batch, s, s, config.in_channels), jnp.float32),
            "labels": jax.random.randint(kl, (config.batch,), 0, config.num_classes, dtype=jnp.int32)}


def build_example(init: Callable[[jax.Array, Any], PyTree], make_batch: Callable[[jax.Array, Any], dict],
                  config: Any, abstract: bool, key: Optional[jax.Array] = None) -> tuple:
    """``(params, adam_init(params), batch)``; ShapeDtypeStructs (nothing allocated) when ``abstract``."""
    if key is None:
        key = jax.random.PRNGKey(0)
    if abstract:
        return jax.eval_shape(_builder(init, make_batch, config), key)
    return _jitted_builder(init, make_batch, config)(key)


@functools.lru_cache(maxsize=None)
def _builder(init, make_batch, config):
    def build(key: jax.Array):
        kp, kb = jax.random.split(key)
        params = init(kp, config)
        return params, adam_init(params), make_batch(kb, config)

    return build


@functools.lru_cache(maxsize=None)
def _jitted_builder(init, make_batch, config):
    # One cached compiled call instead of hundreds of eager ops (as rhino_jax.models.gpt does); it
    # runs once, so LLVM's optimizations are not worth their compile time (half of it on the CPU).
    return jax.jit(_builder(init, make_batch, config), compiler_options={"xla_backend_optimization_level": 0})


def param_count(tree: PyTree) -> int:
    """Number of scalars in a pytree of arrays or ShapeDtypeStructs."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-example cross-entropy (one-hot form, as rhino_jax.models.gpt, so the HLO has no gather)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logp.dtype)
    return -jnp.sum(onehot * logp, axis=-1)


# ----------------------------------------------------------------------------- convolutions

def normal(key: jax.Array, shape: tuple[int, ...], std: float) -> jax.Array:
    """N(0, std^2) of ``shape``, drawn flat and reshaped: XLA's CPU compiler takes seconds per distinct
    rank-3/4 shape of ``jax.random.normal`` (it dominated the tiny models' test time), not for rank 1."""
    return std * jax.random.normal(key, (math.prod(shape),), jnp.float32).reshape(shape)


def he_normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """He (fan-in) normal init; fan-in is every dimension but the last (HWIO kernels, [in, out] dense)."""
    return normal(key, shape, math.sqrt(2.0 / math.prod(shape[:-1])))


def conv_params(key: jax.Array, k: int, c_in: int, c_out: int, bias: bool = True) -> dict:
    p = {"w": he_normal(key, (k, k, c_in, c_out))}
    if bias:
        p["b"] = jnp.zeros((c_out,), jnp.float32)
    return p


def dense_params(key: jax.Array, d_in: int, d_out: int, scale: float = 1.0) -> dict:
    return {"w": normal(key, (d_in, d_out), scale / math.sqrt(d_in)), "b": jnp.zeros((d_out,), jnp.float32)}


def conv2d(x: jax.Array, p: dict, stride: int = 1, padding: Any = "SAME") -> jax.Array:
    """NHWC convolution with an HWIO kernel ``p["w"]`` (and bias ``p["b"]`` when present)."""
    y = lax.conv_general_dilated(x, p["w"], (stride, stride), padding,
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y + p["b"] if "b" in p else y


def max_pool(x: jax.Array, window: int, stride: int, padding: str = "VALID") -> jax.Array:
    """NHWC max pooling (lax.reduce_window)."""
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, window, window, 1), (1, stride, stride, 1), padding)


def batch_norm(x: jax.Array, p: dict, eps: float = 1e-5) -> jax.Array:
    """Training-mode batch norm over N, H, W with learned ``scale``/``bias`` (no running statistics)."""
    mean = jnp.mean(x, axis=(0, 1, 2), keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=(0, 1, 2), keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def norm_params(c: int, scale: float = 1.0) -> dict:
    return {"scale": jnp.full((c,), scale, jnp.float32), "bias": jnp.zeros((c,), jnp.float32)}
