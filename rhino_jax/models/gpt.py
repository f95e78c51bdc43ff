"""GPT-2-style decoder-only language model in plain JAX.

This is the main benchmark workload for the auto-parallelizer.  It is written
with deliberately "vanilla" ops (``jnp.take`` embedding, reshape-based head
splitting, ``einsum`` attention, one-hot cross-entropy) so that the lowered
StableHLO contains the dot/gather/reduce patterns the sharding search must
handle, and every block is wrapped in ``jax.named_scope`` so the HLO carries
readable ``layerN/attn``-style names.

Parameter tree layout::

    {"wte": [V, D], "wpe": [S, D],
     "layers": [{"ln1": {"scale", "bias"},
                 "attn": {"qkv_w": [D, 3D], "qkv_b": [3D], "proj_w": [D, D], "proj_b": [D]},
                 "ln2": {"scale", "bias"},
                 "mlp": {"fc1_w": [D, F], "fc1_b": [F], "fc2_w": [F, D], "fc2_b": [D]}}, ...],
     "ln_f": {"scale", "bias"},
     "head": {"w": [D, V]}}
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from .adam import adam_init, adam_update

PyTree = Any
TrainStep = Callable[[PyTree, dict, dict], tuple[PyTree, dict, jax.Array]]

__all__ = [
    "GPTConfig",
    "GPT_TINY",
    "GPT2_SMALL",
    "init_gpt",
    "gpt_loss",
    "make_gpt_train_step",
    "gpt_example",
]

_LN_EPS = 1e-5
_MASK_VALUE = -1e9  # large negative logit; exp() underflows to exactly 0 in float32


@dataclass(frozen=True)
class GPTConfig:
    """Model and batch hyper-parameters (hashable, so usable as a static jit arg)."""

    vocab: int
    seq_len: int
    d_model: int
    n_heads: int
    n_layers: int
    d_ff: int
    batch: int
    d_ff_step: int = 0  # layer i's FFN is d_ff + i * d_ff_step wide: no two layers alike when > 0

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"d_model={self.d_model} not divisible by n_heads={self.n_heads}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def tiny(cls) -> "GPTConfig":
        """Few-kilobyte model for fast CPU tests."""
        return cls(vocab=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=128, batch=8)

    @classmethod
    def gpt2_small(cls) -> "GPTConfig":
        """GPT-2 small (124M) with vocab padded to a multiple of 128."""
        return cls(vocab=50304, seq_len=1024, d_model=768, n_heads=12, n_layers=12, d_ff=3072, batch=8)


GPT_TINY = GPTConfig.tiny()
GPT2_SMALL = GPTConfig.gpt2_small()


def _ln_params(d: int) -> dict:
    return {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)}


def init_gpt(key: jax.Array, cfg: GPTConfig) -> dict:
    """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2L)."""
    d, v = cfg.d_model, cfg.vocab
    std = 0.02
    resid_std = std / math.sqrt(2 * cfg.n_layers)
    k_wte, k_wpe, k_head, k_layers = jax.random.split(key, 4)

    def normal(k: jax.Array, shape: tuple[int, ...], s: float) -> jax.Array:
        return s * jax.random.normal(k, shape, jnp.float32)

    layers = []
    for i, lk in enumerate(jax.random.split(k_layers, cfg.n_layers)):
        k_qkv, k_proj, k_fc1, k_fc2 = jax.random.split(lk, 4)
        f = cfg.d_ff + i * cfg.d_ff_step
        layers.append(
            {
                "ln1": _ln_params(d),
                "attn": {
                    "qkv_w": normal(k_qkv, (d, 3 * d), std),
                    "qkv_b": jnp.zeros((3 * d,), jnp.float32),
                    "proj_w": normal(k_proj, (d, d), resid_std),
                    "proj_b": jnp.zeros((d,), jnp.float32),
                },
                "ln2": _ln_params(d),
                "mlp": {
                    "fc1_w": normal(k_fc1, (d, f), std),
                    "fc1_b": jnp.zeros((f,), jnp.float32),
                    "fc2_w": normal(k_fc2, (f, d), resid_std),
                    "fc2_b": jnp.zeros((d,), jnp.float32),
                },
            }
        )
    return {
        "wte": normal(k_wte, (v, d), std),
        "wpe": normal(k_wpe, (cfg.seq_len, d), 0.01),
        "layers": layers,
        "ln_f": _ln_params(d),
        "head": {"w": normal(k_head, (d, v), std)},
    }


def _layer_norm(x: jax.Array, p: dict) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + _LN_EPS) * p["scale"] + p["bias"]


def _attention(x: jax.Array, p: dict, n_heads: int) -> jax.Array:
    """Causal multi-head self-attention; heads split by reshape so they stay visible in HLO."""
    b, s, d = x.shape
    dh = d // n_heads
    qkv = x @ p["qkv_w"] + p["qkv_b"]  # [B, S, 3D]
    q, k, v = jnp.split(qkv, 3, axis=-1)
    q = q.reshape(b, s, n_heads, dh)
    k = k.reshape(b, s, n_heads, dh)
    v = v.reshape(b, s, n_heads, dh)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(dh))
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    scores = jnp.where(causal, scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)
    return out @ p["proj_w"] + p["proj_b"]


def _mlp(x: jax.Array, p: dict) -> jax.Array:
    h = jax.nn.gelu(x @ p["fc1_w"] + p["fc1_b"], approximate=True)
    return h @ p["fc2_w"] + p["fc2_b"]


def gpt_loss(params: dict, batch: dict, cfg: GPTConfig) -> jax.Array:
    """Mean next-token cross-entropy over all ``[B, S]`` positions."""
    tokens, targets = batch["tokens"], batch["targets"]
    s = tokens.shape[1]
    with jax.named_scope("embed"):
        x = jnp.take(params["wte"], tokens, axis=0) + params["wpe"][:s]
    for i, layer in enumerate(params["layers"]):
        with jax.named_scope(f"layer{i}"):
            with jax.named_scope("attn"):
                x = x + _attention(_layer_norm(x, layer["ln1"]), layer["attn"], cfg.n_heads)
            with jax.named_scope("mlp"):
                x = x + _mlp(_layer_norm(x, layer["ln2"]), layer["mlp"])
    with jax.named_scope("head"):
        x = _layer_norm(x, params["ln_f"])
        logits = x @ params["head"]["w"]  # [B, S, V]
        logp = jax.nn.log_softmax(logits, axis=-1)
        onehot = jax.nn.one_hot(targets, cfg.vocab, dtype=logp.dtype)
        return -jnp.mean(jnp.sum(onehot * logp, axis=-1))


def make_gpt_train_step(cfg: GPTConfig, lr: float = 1e-3) -> TrainStep:
    """Build an un-jitted ``train_step`` (loss, grads, Adam) closed over ``cfg``."""

    def loss_fn(params: dict, batch: dict) -> jax.Array:
        return gpt_loss(params, batch, cfg)

    def train_step(params: dict, opt_state: dict, batch: dict):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        params, opt_state = adam_update(grads, opt_state, params, lr=lr)
        return params, opt_state, loss

    return train_step


def gpt_example(
    cfg: GPTConfig, key: Optional[jax.Array] = None, abstract: bool = False
) -> tuple[dict, dict, dict]:
    """Return ``(params, opt_state, batch)``; ShapeDtypeStructs when ``abstract`` (no allocation).

    Targets are the input sequence shifted by one, as in real LM training.
    """
    if key is None:
        key = jax.random.PRNGKey(0)
    if abstract:
        return jax.eval_shape(functools.partial(_build_gpt_example, cfg=cfg), key)
    return _build_gpt_example_jit(key, cfg)


def _build_gpt_example(key: jax.Array, cfg: GPTConfig) -> tuple[dict, dict, dict]:
    """Pure builder shared by the abstract (eval_shape) and concrete (jit) paths."""
    kp, kt = jax.random.split(key)
    params = init_gpt(kp, cfg)
    seq = jax.random.randint(kt, (cfg.batch, cfg.seq_len + 1), 0, cfg.vocab, dtype=jnp.int32)
    batch = {"tokens": seq[:, :-1], "targets": seq[:, 1:]}
    return params, adam_init(params), batch


# One cached compiled call instead of hundreds of eager ops: much faster to materialise.
_build_gpt_example_jit = jax.jit(_build_gpt_example, static_argnums=1)
