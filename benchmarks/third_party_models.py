"""Train steps written the way Flax, NNX, Equinox and optax users write them, for benchmarks/third_party.py.

Nothing here knows about rhino_jax: each case is a plain step and its example arguments, plus
what a hand plan needs to know about it (which parameter paths Megatron splits, and on which dim).
Sizes are modest (d 256, 4 layers, seq 128, batch 16, vocab 1024) so a step compiles in seconds
on CPU. Besides the GPT-2-like LMs: a linen ViT (32x32 images in 4x4 patches, class token),
an NNX Llama (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, no biases; f32 and
bf16 compute) and a linen Mixtral-like top-2 MoE (lax.top_k routing, GShard's one-hot
capacity dispatch, experts as stacked [E, D, F] weights; MoE and dense layers alternate).
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

# ViT: 32x32x3 images cut into 4x4 patches (64 patches + a class token), 64 classes.
IMAGE, PATCH, CHANNELS, CLASSES = 32, 4, 3, 64
# Llama: 16 query heads sharing 8 key/value heads (head dim 16), SwiGLU hidden 3D.
LLAMA_HEADS, LLAMA_KV_HEADS, LLAMA_FF = 16, 8, 3 * D
# MoE: 8 experts of hidden 2D, top-2, each sequence a gating group, capacity 2 * 2 * SEQ / 8.
EXPERTS, EXPERT_FF, TOP_K, CAPACITY_FACTOR = 8, 2 * D, 2, 2.0

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
    # Expert parallelism (MoE cases only): (regex, dim) pairs as tp_rules, the dim that holds the
    # experts, which an expert-parallel hand plan splits over the devices; empty: no experts.
    ep_rules: tuple[tuple[str, int], ...] = ()


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


def _linen_case(name: str, model: nn.Module, tx: optax.GradientTransformation, batch: dict, inputs: str,
                loss: Callable, rules, dtype: str = "float32", **extra) -> Case:
    """A linen step as users write it: `loss(params, batch)`'s value and gradient, optax's update."""
    params = model.init(jax.random.PRNGKey(1), batch[inputs])["params"]
    opt_state = tx.init(params)

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            return loss(p, batch)

        value, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return Case(name, "flax.linen", train_step, (params, opt_state, batch), rules, dtype, **extra)


def _cross_entropy(model: nn.Module, inputs: str, labels: str) -> Callable:
    def loss(params, batch):
        logits = model.apply({"params": params}, batch[inputs])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[labels]).mean()

    return loss


def _linen_lm(name: str, model: GPT, tx: optax.GradientTransformation, dtype: str = "float32") -> Case:
    return _linen_case(name, model, tx, _tokens(), "tokens", _cross_entropy(model, "tokens", "targets"), _FLAX_TP,
                       dtype)


def linen_gpt() -> Case:
    return _linen_lm("linen_gpt", GPT(), optax.adamw(1e-3, weight_decay=0.1))


def linen_scan_remat() -> Case:
    return _linen_lm("linen_scan_remat", GPT(scan=True), optax.adamw(1e-3, weight_decay=0.1))


def linen_clip_adamw() -> Case:
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1))
    return _linen_lm("linen_clip_adamw", GPT(), tx)


def linen_bf16() -> Case:
    return _linen_lm("linen_bf16", GPT(dtype=jnp.bfloat16), optax.adamw(1e-3, weight_decay=0.1), "bfloat16")


class SizedBlock(nn.Module):
    """A pre-LN block of any width and heads (`remat_lm`); the attention has no biases."""

    heads: int

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, use_bias=False, deterministic=True)(
            nn.LayerNorm()(x), mask=mask)
        return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))))


class SizedLM(nn.Module):
    """A decoder LM's sizes (`remat_lm`, `tied_lm`)."""

    vocab: int
    width: int
    heads: int
    layers: int


class RematLM(SizedLM):
    """A decoder LM whose blocks are recomputed in the backward pass (`nn.remat`)."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width)(tokens)
        for _ in range(self.layers):
            x = nn.remat(SizedBlock)(self.heads)(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


class MaskedBlock(nn.Module):
    """A pre-LN block as users often write it: the causal mask given, attention with biases
    called on (query, key/value) inputs."""

    heads: int

    @nn.compact
    def __call__(self, x, mask):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, deterministic=True)(h, h, mask=mask)
        return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))))


class MaskedRematLM(SizedLM):
    """A decoder LM that makes its causal mask once and hands it to each block under remat."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width)(tokens)
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.layers):
            x = nn.remat(MaskedBlock)(self.heads)(x, mask)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


class TiedLM(SizedLM):
    """A T5-like LM whose large embedding is also its output projection (`Embed.attend`)."""

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, self.width, name="Embed")
        x = embed(tokens)
        for i in range(self.layers):
            x = SizedBlock(self.heads, name=f"Block_{i}")(x)
        return embed.attend(nn.LayerNorm(name="ln_f")(x))


class Recycle(nn.Module):
    """AlphaFold2's recycling embedder: the previous pass's output, normalized and projected."""

    @nn.compact
    def __call__(self, prev):
        return nn.Dense(prev.shape[-1])(nn.LayerNorm()(prev))


class RecyclingLM(SizedLM):
    """An LM run `passes` times per step (AlphaFold2's recycling, nnScaler §4.2): each pass
    adds the previous pass's output, recycled, to the embedding and runs every block again; the
    passes before the last run under stop_gradient, so only the last is differentiated."""

    passes: int = 3

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width, name="Embed")(tokens)
        recycle, blocks = Recycle(name="Recycle"), [SizedBlock(self.heads, name=f"Block_{i}")
                                                    for i in range(self.layers)]
        prev = jnp.zeros_like(x)
        for r in range(self.passes):
            h = x + recycle(prev)
            for block in blocks:
                h = block(h)
            prev = h if r == self.passes - 1 else jax.lax.stop_gradient(h)
        return nn.Dense(self.vocab, name="head")(nn.LayerNorm(name="ln_f")(prev))


def _sized_case(name: str, model: SizedLM, batch: int, seq: int, key: int) -> Case:
    """A sized LM's step on random tokens and targets (from PRNGKey(key)), clip + AdamW."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(key))
    batch_ = {"tokens": jax.random.randint(k1, (batch, seq), 0, model.vocab, jnp.int32),
              "targets": jax.random.randint(k2, (batch, seq), 0, model.vocab, jnp.int32)}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    return _linen_case(name, model, tx, batch_, "tokens", _cross_entropy(model, "tokens", "targets"), ())


def remat_lm(batch: int = 16, seq: int = 512, vocab: int = 256, width: int = 64, heads: int = 4,
             layers: int = 2) -> Case:
    """Co-shard's case: long sequences, few heads, blocks under remat, so that the
    attention's [batch, heads, seq, seq] tensors are most of the step's temporaries; clip + AdamW."""
    return _sized_case("remat_lm", RematLM(vocab, width, heads, layers), batch, seq, key=1)


def masked_remat_lm(batch: int = 8, seq: int = 512, vocab: int = 256, width: int = 128, heads: int = 8,
                    layers: int = 2) -> Case:
    """Co-shard's case as a user wrote it: `remat_lm` with the mask passed into each block and
    attention biases, whose bias reshapes, mask compare and bias gradients sit among the
    attention's ops; clip + AdamW."""
    return _sized_case("masked_remat_lm", MaskedRematLM(vocab, width, heads, layers), batch, seq, key=1)


def tied_lm(batch: int = 8, seq: int = 16, vocab: int = 32768, width: int = 256, heads: int = 4,
            layers: int = 4) -> Case:
    """The interlaced pipeline's case (nnScaler §4.2, T5): a 32k x 256 embedding tied
    to the output projection, most of the step's parameters and of its FLOPs at short sequences,
    beside 4 small blocks; clip + AdamW."""
    return _sized_case("tied_lm", TiedLM(vocab, width, heads, layers), batch, seq, key=2)


def recycling_lm(batch: int = 8, seq: int = 32, vocab: int = 256, width: int = 64, heads: int = 4,
                 layers: int = 4, passes: int = 3) -> Case:
    """The multi-forward pipeline's case (nnScaler §4.2, AlphaFold2's 3F1B): every
    block runs `passes` times per micro-batch, the last pass differentiated; clip + AdamW."""
    return _sized_case("recycling_lm", RecyclingLM(vocab, width, heads, layers, passes), batch, seq, key=3)


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
def _nnx_lm(name: str, model: nnx.Module, tp_rules, dtype: str = "float32") -> Case:
    """The functional NNX step: split (model, optimizer) into a graphdef and a state pytree,
    merge inside the step, update with nnx.Optimizer, split again."""
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

    return Case(name, "flax.nnx", train_step, (state, _tokens()), tp_rules, dtype)


def nnx_gpt() -> Case:
    return _nnx_lm("nnx_gpt", NNXGPT(nnx.Rngs(1)), _FLAX_TP)


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


# ------------------------------------------------------------------------------ Flax linen ViT


class ViTBlock(nn.Module):
    """Pre-LN encoder block: bidirectional self-attention, GELU MLP (flax names as `Block`)."""

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(name="ln1")(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, name="attn")(h)
        h = nn.Dense(4 * D, name="fc1")(nn.LayerNorm(name="ln2")(x))
        return x + nn.Dense(D, name="fc2")(nn.gelu(h))


class ViT(nn.Module):
    """Patch embedding by a strided convolution, a class token, learned position embeddings,
    LAYERS encoder blocks, the class token's final LayerNorm into a linear head."""

    @nn.compact
    def __call__(self, images):
        x = nn.Conv(D, (PATCH, PATCH), strides=(PATCH, PATCH), padding="VALID", name="patch")(images)
        b, h, w, d = x.shape
        x = x.reshape(b, h * w, d)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, d))
        x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, d)), x], axis=1)
        x = x + self.param("pos", nn.initializers.normal(0.02), (h * w + 1, d))
        for i in range(LAYERS):
            x = ViTBlock(name=f"block{i}")(x)
        return nn.Dense(CLASSES, name="head")(nn.LayerNorm(name="ln_f")(x[:, 0]))


def vit() -> Case:
    model, tx = ViT(), optax.adamw(1e-3, weight_decay=0.05)
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    batch = {"images": jax.random.normal(k1, (BATCH, IMAGE, IMAGE, CHANNELS)),
             "labels": jax.random.randint(k2, (BATCH,), 0, CLASSES, jnp.int32)}
    # Megatron as on the GPT blocks; the patch embedding's kernel [P, P, C, D] on its output channels.
    rules = _FLAX_TP + ((r"\['patch'\]\['kernel'\]", -1), (r"\['patch'\]\['bias'\]", -1))
    return _linen_case("vit", model, tx, batch, "images", _cross_entropy(model, "images", "labels"), rules)


# ------------------------------------------------------------------------------ Flax NNX Llama


def _rope(x, positions):
    """Rotary position embedding on [B, S, H, Dh] (halves rotated, as Llama's HF port)."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]  # [S, half]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class LlamaAttention(nnx.Module):
    def __init__(self, dtype, rngs: nnx.Rngs):
        self.dh = D // LLAMA_HEADS
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs)  # noqa: E731
        self.q = lin(D, LLAMA_HEADS * self.dh)
        self.k = lin(D, LLAMA_KV_HEADS * self.dh)
        self.v = lin(D, LLAMA_KV_HEADS * self.dh)
        self.o = lin(LLAMA_HEADS * self.dh, D)

    def __call__(self, x, positions, mask):
        b, s, _ = x.shape
        q = _rope(self.q(x).reshape(b, s, LLAMA_HEADS, self.dh), positions)
        k = _rope(self.k(x).reshape(b, s, LLAMA_KV_HEADS, self.dh), positions)
        v = self.v(x).reshape(b, s, LLAMA_KV_HEADS, self.dh)
        groups = LLAMA_HEADS // LLAMA_KV_HEADS  # query heads per key/value head
        q = q.reshape(b, s, LLAMA_KV_HEADS, groups, self.dh)
        scores = jnp.einsum("bskgd,btkd->bkgst", q, k).astype(jnp.float32) / jnp.sqrt(self.dh)
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgst,btkd->bskgd", probs, v).reshape(b, s, LLAMA_HEADS * self.dh)
        return self.o(out)


class LlamaMLP(nnx.Module):
    def __init__(self, dtype, rngs: nnx.Rngs):
        self.gate = nnx.Linear(D, LLAMA_FF, use_bias=False, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(D, LLAMA_FF, use_bias=False, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(LLAMA_FF, D, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nnx.Module):
    def __init__(self, dtype, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(D, dtype=dtype, rngs=rngs)
        self.attn = LlamaAttention(dtype, rngs)
        self.mlp_norm = nnx.RMSNorm(D, dtype=dtype, rngs=rngs)
        self.mlp = LlamaMLP(dtype, rngs)

    def __call__(self, x, positions, mask):
        x = x + self.attn(self.attn_norm(x), positions, mask)
        return x + self.mlp(self.mlp_norm(x))


class NNXLlama(nnx.Module):
    """Llama-style decoder, untied LM head; parameters f32, compute in `dtype`."""

    def __init__(self, rngs: nnx.Rngs, dtype=jnp.float32):
        self.embed = nnx.Embed(VOCAB, D, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([LlamaBlock(dtype, rngs) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(D, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens):
        s = tokens.shape[1]
        positions = jnp.arange(s)
        mask = jnp.tril(jnp.ones((s, s), bool))
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions, mask)
        return self.head(self.norm(x)).astype(jnp.float32)


# Megatron on Llama: q/k/v and gate/up [D, out] on columns, o and down [in, D] on rows, the head
# [D, V] on the vocabulary.
_LLAMA_TP = ((r"\['(q|k|v|gate|up)'\]\['kernel'\]", -1), (r"\['(o|down)'\]\['kernel'\]", -2),
             (r"\['head'\]\['kernel'\]", -1))


def _nnx_llama(name: str, dtype, dtype_name: str) -> Case:
    return _nnx_lm(name, NNXLlama(nnx.Rngs(1), dtype=dtype), _LLAMA_TP, dtype_name)


def nnx_llama() -> Case:
    return _nnx_llama("nnx_llama", jnp.float32, "float32")


def nnx_llama_bf16() -> Case:
    return _nnx_llama("nnx_llama_bf16", jnp.bfloat16, "bfloat16")


# ------------------------------------------------------------------------------ Flax linen MoE


class MoE(nn.Module):
    """Mixtral-style top-2 mixture of SwiGLU experts: a router Dense, `lax.top_k` over its logits,
    the two gates a softmax of the two logits; tokens dispatched to [E, G, C, D] by GShard's
    one-hot dispatch (each sequence a group, C slots per expert, first choices before second
    ones, overflow dropped) and combined back with the gates; Switch's load-balancing loss sown
    as "aux"."""

    @nn.compact
    def __call__(self, x):
        g, s, d = x.shape
        e, c = EXPERTS, int(CAPACITY_FACTOR * TOP_K * s // EXPERTS)
        logits = nn.Dense(e, use_bias=False, name="router")(x).astype(jnp.float32)  # [G, S, E]
        top_logits, top_idx = jax.lax.top_k(logits, TOP_K)  # [G, S, K]
        gates = jax.nn.softmax(top_logits, axis=-1)
        masks = jax.nn.one_hot(top_idx, e, dtype=jnp.float32)  # [G, S, K, E]
        # Slot of each (token, choice) in its expert: first choices of the group, then second ones.
        ordered = masks.transpose(0, 2, 1, 3).reshape(g, TOP_K * s, e)
        slots = (jnp.cumsum(ordered, axis=1) - 1.0) * ordered
        slots = slots.reshape(g, TOP_K, s, e).transpose(0, 2, 1, 3)  # [G, S, K, E]
        kept = masks * (slots < c)
        slot_1hot = jax.nn.one_hot(jnp.sum(slots * kept, axis=-1).astype(jnp.int32), c)  # [G, S, K, C]
        dispatch = jnp.einsum("gske,gskc->gsec", kept, slot_1hot)
        combine = jnp.einsum("gske,gskc->gsec", kept * gates[..., None], slot_1hot)
        probs = jax.nn.softmax(logits, axis=-1)
        self.sow("intermediates", "aux", e * jnp.sum(jnp.mean(probs, (0, 1)) * jnp.mean(masks[:, :, 0], (0, 1))))

        init = nn.initializers.lecun_normal(batch_axis=(0,))
        w_gate = self.param("w_gate", init, (e, d, EXPERT_FF))
        w_up = self.param("w_up", init, (e, d, EXPERT_FF))
        w_down = self.param("w_down", init, (e, EXPERT_FF, d))
        tokens = jnp.einsum("gsec,gsd->egcd", dispatch, x)
        h = nn.silu(jnp.einsum("egcd,edf->egcf", tokens, w_gate)) * jnp.einsum("egcd,edf->egcf", tokens, w_up)
        out = jnp.einsum("egcf,efd->egcd", h, w_down)
        return jnp.einsum("gsec,egcd->gsd", combine, out)


class MoEBlock(nn.Module):
    moe: bool

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, use_bias=False, name="attn")(
            nn.RMSNorm(name="ln1")(x), mask=mask)
        h = nn.RMSNorm(name="ln2")(x)
        if self.moe:
            return x + MoE(name="moe")(h)
        h = nn.silu(nn.Dense(4 * D, use_bias=False, name="fc1")(h))
        return x + nn.Dense(D, use_bias=False, name="fc2")(h)


class MoELM(nn.Module):
    """Decoder LM; blocks 1, 3, ... are MoE blocks, the others dense."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D, name="embed")(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (SEQ, D))
        for i in range(LAYERS):
            x = MoEBlock(moe=i % 2 == 1, name=f"block{i}")(x)
        return nn.Dense(VOCAB, use_bias=False, name="head")(nn.RMSNorm(name="ln_f")(x))


def linen_moe() -> Case:
    model, tx = MoELM(), optax.adamw(1e-3, weight_decay=0.1)

    def loss(params, batch):  # cross-entropy and the routers' load-balancing losses (sown)
        logits, state = model.apply({"params": params}, batch["tokens"], mutable=["intermediates"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
        return ce + 0.01 * sum(jax.tree.leaves(state["intermediates"]))

    # Megatron: attention and the dense MLPs as _FLAX_TP, the experts' hidden dim F split like an
    # MLP's (w_gate, w_up [E, D, F] on columns, w_down [E, F, D] on rows). Expert parallelism:
    # the experts' dim of the three stacks.
    tp = _FLAX_TP + ((r"\['(w_gate|w_up)'\]", -1), (r"\['w_down'\]", -2))
    ep = ((r"\['(w_gate|w_up|w_down)'\]", -3),)
    return _linen_case("linen_moe", model, tx, _tokens(), "tokens", loss, tp, ep_rules=ep)


CASES: dict[str, Callable[[], Case]] = {
    "linen_gpt": linen_gpt, "linen_scan_remat": linen_scan_remat, "nnx_gpt": nnx_gpt,
    "eqx_mlp": eqx_mlp, "linen_clip_adamw": linen_clip_adamw, "linen_bf16": linen_bf16,
    "vit": vit, "nnx_llama": nnx_llama, "nnx_llama_bf16": nnx_llama_bf16, "linen_moe": linen_moe,
}
QUICK = ("linen_gpt", "eqx_mlp")
