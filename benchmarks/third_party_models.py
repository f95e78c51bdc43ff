"""Train steps written the way Flax, NNX, Equinox and optax users write them, for benchmarks/third_party.py.

Nothing here knows about rhino_jax: each case is a plain step and its example arguments, plus
what a hand plan needs to know about it (which parameter paths Megatron splits, and on which dim).
Sizes are modest (d 256, 4 layers, seq 128, batch 16, vocab 1024) so a step compiles in seconds
on CPU.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

D, LAYERS, HEADS, SEQ, BATCH, VOCAB = 256, 4, 8, 128, 16, 1024
MLP_BATCH, MLP_CLASSES = 128, 16

__all__ = ["Case", "CASES", "QUICK"]


@dataclass(frozen=True)
class Case:
    """A third-party train step. `step(*args)` returns the updated state arguments then the loss:
    (params, opt_state, batch) -> (params, opt_state, loss), or (state, batch) -> (state, loss).
    The batch is the last argument. `tp_rules`: (regex on `jax.tree_util.keystr` of a leaf's path,
    dim) pairs Megatron splits on the model axis (negative dims, so stacked [L, ...] layers and
    their optimizer moments match too); the first matching rule wins, others stay replicated."""

    name: str
    framework: str
    step: Callable
    args: tuple
    tp_rules: tuple[tuple[str, int], ...]
    dtype: str = "float32"  # the matmuls' dtype: the FLOP rate the step is priced at


def _tokens(key=0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(key))
    return {"tokens": jax.random.randint(k1, (BATCH, SEQ), 0, VOCAB, jnp.int32),
            "targets": jax.random.randint(k2, (BATCH, SEQ), 0, VOCAB, jnp.int32)}


# Megatron on flax attention and MLP: q/k/v kernels [D, H, Dh] on heads, out [H, Dh, D] on heads,
# fc1 [D, 4D] on columns, fc2 [4D, D] on rows, the LM head [D, V] on the vocabulary.
_FLAX_TP = ((r"\['(query|key|value)'\]\['kernel'\]", -2), (r"\['(query|key|value)'\]\['bias'\]", -2),
            (r"\['out'\]\['kernel'\]", -3), (r"\['fc1'\]\['kernel'\]", -1), (r"\['fc1'\]\['bias'\]", -1),
            (r"\['fc2'\]\['kernel'\]", -2), (r"\['head'\]\['kernel'\]", -1), (r"\['head'\]\['bias'\]", -1))


# ------------------------------------------------------------------------------ Flax linen


class Block(nn.Module):
    """Pre-LN transformer block, causal self-attention (flax's MultiHeadDotProductAttention)."""

    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.LayerNorm(dtype=self.dtype, name="ln1")(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, dtype=self.dtype, name="attn")(h, mask=mask)
        h = nn.LayerNorm(dtype=self.dtype, name="ln2")(x)
        h = nn.Dense(4 * D, dtype=self.dtype, name="fc1")(h)
        return x + nn.Dense(D, dtype=self.dtype, name="fc2")(nn.gelu(h))


class ScanBlock(Block):
    """The block as nn.scan wants it: (carry, x) -> (carry, y)."""

    @nn.compact
    def __call__(self, x, _):
        return Block.__call__(self, x), None


class GPT(nn.Module):
    dtype: jnp.dtype = jnp.float32
    scan: bool = False

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D, dtype=self.dtype, name="embed")(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (SEQ, D))
        x = x + pos.astype(self.dtype)
        if self.scan:
            layers = nn.scan(nn.remat(ScanBlock), variable_axes={"params": 0}, split_rngs={"params": True},
                             length=LAYERS)
            x, _ = layers(dtype=self.dtype, name="layers")(x, None)
        else:
            for i in range(LAYERS):
                x = Block(dtype=self.dtype, name=f"block{i}")(x)
        x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)
        return nn.Dense(VOCAB, dtype=self.dtype, name="head")(x).astype(jnp.float32)


def _linen_lm(name: str, model: GPT, tx: optax.GradientTransformation, dtype: str = "float32") -> Case:
    batch = _tokens()
    params = model.init(jax.random.PRNGKey(1), batch["tokens"])["params"]
    opt_state = tx.init(params)

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            logits = model.apply({"params": p}, batch["tokens"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return Case(name, "flax.linen", train_step, (params, opt_state, batch), _FLAX_TP, dtype)


def linen_gpt() -> Case:
    return _linen_lm("linen_gpt", GPT(), optax.adamw(1e-3, weight_decay=0.1))


def linen_scan_remat() -> Case:
    return _linen_lm("linen_scan_remat", GPT(scan=True), optax.adamw(1e-3, weight_decay=0.1))


def linen_clip_adamw() -> Case:
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1))
    return _linen_lm("linen_clip_adamw", GPT(), tx)


def linen_bf16() -> Case:
    return _linen_lm("linen_bf16", GPT(dtype=jnp.bfloat16), optax.adamw(1e-3, weight_decay=0.1), "bfloat16")


# ------------------------------------------------------------------------------ Flax NNX


class NNXBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, rngs=rngs)
        self.fc1 = nnx.Linear(D, 4 * D, rngs=rngs)
        self.fc2 = nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))


class NNXGPT(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (SEQ, D)) * 0.02)
        self.blocks = nnx.List([NNXBlock(rngs) for _ in range(LAYERS)])
        self.ln_f = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        mask = nnx.make_causal_mask(tokens)
        x = self.embed(tokens) + self.pos[...]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


# NNX state paths hold the attribute names: ...['attn']['query']['kernel'] like linen, so the same
# rules apply; the moments in the optimizer's state repeat the parameter's path.
def nnx_gpt() -> Case:
    """The functional NNX step: split (model, optimizer) into a graphdef and a state pytree,
    merge inside the step, update with nnx.Optimizer, split again."""
    model = NNXGPT(nnx.Rngs(1))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3, weight_decay=0.1), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def train_step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            logits = model(batch["tokens"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return Case("nnx_gpt", "flax.nnx", train_step, (state, _tokens()), _FLAX_TP)


# ------------------------------------------------------------------------------ Equinox


class EqxMLP(eqx.Module):
    layers: list

    def __init__(self, key):
        keys = jax.random.split(key, LAYERS)
        sizes = [D] + [4 * D] * (LAYERS - 1) + [MLP_CLASSES]
        self.layers = [eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys)]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


def eqx_mlp() -> Case:
    model = EqxMLP(jax.random.PRNGKey(1))
    optim = optax.adamw(1e-3, weight_decay=0.1)
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    kx, ky = jax.random.split(jax.random.PRNGKey(2))
    batch = {"x": jax.random.normal(kx, (MLP_BATCH, D)),
             "y": jax.random.randint(ky, (MLP_BATCH,), 0, MLP_CLASSES, jnp.int32)}

    def loss_fn(model, x, y):
        logits = jax.vmap(model)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def train_step(model, opt_state, batch):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch["x"], batch["y"])
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    # eqx.nn.Linear's weight is [out, in]: columns are dim -2, rows dim -1. Layers alternate.
    rules = ((r"layers\[[02]\]\.weight", -2), (r"layers\[[02]\]\.bias", -1), (r"layers\[[13]\]\.weight", -1))
    return Case("eqx_mlp", "equinox", train_step, (model, opt_state, batch), rules)


CASES: dict[str, Callable[[], Case]] = {
    "linen_gpt": linen_gpt, "linen_scan_remat": linen_scan_remat, "nnx_gpt": nnx_gpt,
    "eqx_mlp": eqx_mlp, "linen_clip_adamw": linen_clip_adamw, "linen_bf16": linen_bf16,
}
QUICK = ("linen_gpt", "eqx_mlp")
