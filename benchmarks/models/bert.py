"""Long-sequence BERT for DNA (DNABERT-like) of Rhino §7.4 and Table 3, masked-LM loss.

Table 3: DNABert, 162M parameters, batch 32 per device, 1 to 8 GPUs (batch scaled with the GPUs).
DNABERT (Ji et al. 2021) is BERT on overlapping k-mers of a DNA sequence: vocabulary 4^6 + 5 =
4101 for 6-mers (the 5 special tokens [PAD] [UNK] [CLS] [SEP] [MASK] are ids 0-4), 512 tokens.

The paper gives no architecture, and DNABERT's own (BERT-base: 12 layers, hidden 768) has only
about 89M parameters with this vocabulary. To reach Table 3's size we keep 12 layers and widen
to hidden 1024, 16 heads, FFN 4096: 156.9M parameters with 512 positions (3% below 162M).

===========  ======  ======  =====  ==============  ============================
preset       layers  hidden  seq    batch           parameters (ours / Table 3)
===========  ======  ======  =====  ==============  ============================
DNABert      12      1024    512    32 (1 GPU)      156.9M / 162M
DNABert-8gpu 12      1024    512    256 (8 x 32)    156.9M / 162M
DNABert-4k   12      1024    4096   8               160.6M (not in the paper: long
                                                    sequences, for token-dim sharding)
tiny         2       32      64     8               for tests
===========  ======  ======  =====  ==============  ============================

Model: BERT (post-LN) encoder with bidirectional attention; token + learned position embeddings,
then layer norm; each layer x = LN(x + attn(x)); x = LN(x + FFN(x)) with GELU, using the attention
and MLP of ``gpt.py`` (the leaves of rhino_jax's GPT tree: a layer's ``ln1`` follows attention,
``ln2`` the FFN); MLM head dense + GELU + LN, decoder tied to the token embedding, plus a bias.
Masked-LM: 15% of positions are replaced by [MASK] (BERT's 80/10/10 split is left out), loss
is the mean cross-entropy over the masked positions (logits are computed at all positions: the
vocabulary is small). Deviations: no token-type (segment) embeddings, no padding mask, no dropout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from . import gpt
from ._common import Constrain, build_example, no_constrain, softmax_cross_entropy, train_step_for

__all__ = ["Config", "PRESETS", "ROLES", "MASK_ID", "example", "make_train_step", "loss", "init_params"]

N_SPECIAL = 5
MASK_ID = 4


@dataclass(frozen=True)
class Config:
    vocab: int
    seq_len: int
    d_model: int
    n_heads: int
    n_layers: int
    d_ff: int
    batch: int
    mask_prob: float = 0.15
    lr: float = 1e-4

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} not divisible by n_heads={self.n_heads}")

    def as_gpt(self) -> gpt.Config:
        return gpt.Config(vocab=self.vocab, seq_len=self.seq_len, d_model=self.d_model, n_heads=self.n_heads,
                          n_layers=self.n_layers, d_ff=self.d_ff, batch=self.batch, tie_embeddings=True,
                          lr=self.lr)


_DNABERT = dict(vocab=4 ** 6 + N_SPECIAL, d_model=1024, n_heads=16, n_layers=12, d_ff=4096)
PRESETS: dict[str, Config] = {
    "tiny": Config(vocab=4 ** 3 + N_SPECIAL, seq_len=64, d_model=32, n_heads=4, n_layers=2, d_ff=128, batch=8,
                   lr=1e-3),
    "DNABert": Config(seq_len=512, batch=32, **_DNABERT),
    "DNABert-8gpu": Config(seq_len=512, batch=8 * 32, **_DNABERT),
    "DNABert-4k": Config(seq_len=4096, batch=8, **_DNABERT),
}

ROLES: dict[str, str] = {
    **gpt.ROLES,
    "hidden": "[B, S, D] residual-stream activations: the embedding output, the output projection of "
              "every attention and FFN block, and the MLM head's dense layer",
    "attn_scores": "[B, H, S, S] attention logits q.k (bidirectional, no mask)",
    "logits": "[B, S, V] MLM decoder output (all positions)",
}


def init_params(key: jax.Array, config: Config) -> dict:
    """gpt.init_params' tree (tied) with ``"ln_f"`` renamed ``"ln_emb"`` (BERT's embedding LN) and an
    MLM head ``"mlm": {"dense": {"w" [D, D], "b"}, "ln": {"scale", "bias"}, "bias" [V]}``."""
    params = gpt.init_params(key, config.as_gpt())
    d = config.d_model
    params["ln_emb"] = params.pop("ln_f")
    params["mlm"] = {
        "dense": {"w": 0.02 * jax.random.normal(jax.random.fold_in(key, 1), (d, d), jnp.float32),
                  "b": jnp.zeros((d,), jnp.float32)},
        "ln": {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)},
        "bias": jnp.zeros((config.vocab,), jnp.float32),
    }
    return params


def loss(params: dict, batch: dict, config: Config, constrain: Constrain = no_constrain) -> jax.Array:
    """Mean cross-entropy over the masked positions (``batch["weights"]`` 1.0 there, else 0.0)."""
    ln = gpt.layer_norm
    with jax.named_scope("embed"):
        x = ln(gpt.embed(params, batch["tokens"], constrain), params["ln_emb"])
    for i, layer in enumerate(params["layers"]):
        with jax.named_scope(f"layer{i}"):
            with jax.named_scope("attn"):
                x = ln(x + gpt.attention(x, layer["attn"], config.n_heads, constrain, causal=False), layer["ln1"])
            with jax.named_scope("mlp"):
                x = ln(x + gpt.mlp(x, layer["mlp"], constrain), layer["ln2"])
    with jax.named_scope("mlm"):
        p = params["mlm"]
        x = jax.nn.gelu(constrain(x @ p["dense"]["w"] + p["dense"]["b"], "hidden"), approximate=True)
        logits = constrain(gpt.lm_logits(ln(x, p["ln"]), params) + p["bias"], "logits")
        nll = softmax_cross_entropy(logits, batch["targets"])
        w = batch["weights"]
        return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)


def make_batch(key: jax.Array, config: Config) -> dict:
    """Random k-mer ids; ``mask_prob`` of the positions replaced by [MASK] and weighted 1 in the loss."""
    kt, km = jax.random.split(key)
    shape = (config.batch, config.seq_len)
    targets = jax.random.randint(kt, shape, N_SPECIAL, config.vocab, dtype=jnp.int32)
    masked = jax.random.bernoulli(km, config.mask_prob, shape)
    return {"tokens": jnp.where(masked, MASK_ID, targets), "targets": targets,
            "weights": masked.astype(jnp.float32)}


def example(config: Config, abstract: bool = False, key: Optional[jax.Array] = None) -> tuple:
    """``(params, opt_state, batch)``; ShapeDtypeStructs when ``abstract`` (nothing allocated)."""
    return build_example(init_params, make_batch, config, abstract, key)


def make_train_step(config: Config, constrain: Optional[Constrain] = None) -> Callable:
    """``step(params, opt_state, batch) -> (params, opt_state, loss)`` with Adam (lr = config.lr)."""
    return train_step_for(loss, config, constrain)
