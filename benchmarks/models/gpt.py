"""GPT of Rhino Table 1 (§7.1), on top of ``rhino_jax.models.gpt``.

Presets follow Table 1 ("GPT Model weak scaling test configurations"): layers, hidden size, FFN
size and heads as listed; the table gives neither vocabulary nor sequence length, so we take
those of Alpa's GPT benchmark, one of the baselines the paper compares with (vocab 51200, 1024
tokens).

==============  ======  ==========  =====  ==========  =====  ============================
preset          layers  D_hidden    D_ffn  heads (Dh)  GPUs   parameters (ours / Table 1)
==============  ======  ==========  =====  ==========  =====  ============================
GPT-Medium      24      1024        4096   16 (64)     1      355.8M / 350M
GPT-Large       24      1536        6144   16 (96)     2      760.2M / 760M
GPT-XL          24      2048        8192   32 (64)     4      1.316B / 1.3B
GPT-2.7B        32      2560        10240  32 (80)     8      2.651B / 2.7B
GPT-6.7B        32      4096        16384  32 (128)    16     6.658B / 6.7B
tiny            2       32          128    4 (8)       -      for tests
==============  ======  ==========  =====  ==========  =====  ============================

Our counts are within 0.2% of Alpa's ``compute_gpt_parameter_count`` for these sizes.

Batch: the presets carry Table 1's global batch of the full-parallelism tests (64); the paper's
SPMD-only tests use 4 (``SPMD_ONLY_BATCH``; ``dataclasses.replace(cfg, batch=4)``).

Deviations and choices:
- The output head is tied to the token embedding (``tie_embeddings=True``, as Megatron and Alpa
  do; it is how Table 1's parameter counts come out). The parameter tree is then that of
  ``rhino_jax.models.gpt.init_gpt`` without ``"head"``; with ``tie_embeddings=False`` it is exactly
  rhino_jax's tree (untied ``head.w`` [D, V]) and the loss equals ``rhino_jax.models.gpt.gpt_loss``.
- No dropout (deterministic step, so a parallel step can be compared with one device).
- Pre-LN GPT-2 blocks, GELU (tanh), fp32 throughout (the paper: "full FP32").

The forward pass is written here (rather than calling ``gpt_loss``) only to place the
``constrain(x, role)`` hook; layer norm, the initialisation and the config come from
``rhino_jax.models.gpt``. ``attention``, ``mlp``, ``embed`` and ``lm_logits`` are reused by
``moe.py`` and ``bert.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from rhino_jax.models.gpt import _MASK_VALUE, GPTConfig, init_gpt
from rhino_jax.models.gpt import _layer_norm as layer_norm

from ._common import Constrain, build_example, no_constrain, softmax_cross_entropy, train_step_for

__all__ = ["Config", "PRESETS", "ROLES", "SPMD_ONLY_BATCH", "example", "make_train_step", "loss",
           "init_params", "attention", "mlp", "embed", "lm_logits", "layer_norm", "lm_batch"]


@dataclass(frozen=True)
class Config(GPTConfig):
    """rhino_jax's GPTConfig (vocab, seq_len, d_model, n_heads, n_layers, d_ff, batch) plus:"""

    tie_embeddings: bool = True  # output head = wte^T (no "head" leaf)
    lr: float = 1e-3  # Adam learning rate


SPMD_ONLY_BATCH = 4

PRESETS: dict[str, Config] = {
    "tiny": Config(vocab=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=128, batch=8),
    "GPT-Medium": Config(vocab=51200, seq_len=1024, d_model=1024, n_heads=16, n_layers=24, d_ff=4096, batch=64),
    "GPT-Large": Config(vocab=51200, seq_len=1024, d_model=1536, n_heads=16, n_layers=24, d_ff=6144, batch=64),
    "GPT-XL": Config(vocab=51200, seq_len=1024, d_model=2048, n_heads=32, n_layers=24, d_ff=8192, batch=64),
    "GPT-2.7B": Config(vocab=51200, seq_len=1024, d_model=2560, n_heads=32, n_layers=32, d_ff=10240, batch=64),
    "GPT-6.7B": Config(vocab=51200, seq_len=1024, d_model=4096, n_heads=32, n_layers=32, d_ff=16384, batch=64),
}

ROLES: dict[str, str] = {
    "hidden": "[B, S, D] residual-stream activations: the embedding output and the output projection "
              "of every attention and MLP block",
    "attn_heads": "[B, S, H, Dh] queries, keys and values per head (right after the QKV matmul) and the "
                  "attention output before the output projection",
    "attn_scores": "[B, H, S, S] attention logits q.k (before the mask and softmax)",
    "mlp_hidden": "[B, S, F] output of the MLP's first matmul (before GELU)",
    "logits": "[B, S, V] LM-head output",
}


# ----------------------------------------------------------------------------- shared pieces

def embed(params: dict, tokens: jax.Array, constrain: Constrain = no_constrain) -> jax.Array:
    """Token + learned position embedding, [B, S] -> [B, S, D]."""
    x = jnp.take(params["wte"], tokens, axis=0) + params["wpe"][: tokens.shape[1]]
    return constrain(x, "hidden")


def attention(x: jax.Array, p: dict, n_heads: int, constrain: Constrain = no_constrain,
              causal: bool = True) -> jax.Array:
    """Multi-head self-attention on rhino_jax's ``attn`` leaves (qkv_w [D, 3D], proj_w [D, D], biases)."""
    b, s, d = x.shape
    dh = d // n_heads
    qkv = x @ p["qkv_w"] + p["qkv_b"]  # [B, S, 3D]
    q, k, v = (constrain(t.reshape(b, s, n_heads, dh), "attn_heads") for t in jnp.split(qkv, 3, axis=-1))
    scores = constrain(jnp.einsum("bqhd,bkhd->bhqk", q, k), "attn_scores") / jnp.sqrt(jnp.float32(dh))
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((s, s), dtype=bool)), scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    out = constrain(jnp.einsum("bhqk,bkhd->bqhd", probs, v), "attn_heads").reshape(b, s, d)
    return constrain(out @ p["proj_w"] + p["proj_b"], "hidden")


def mlp(x: jax.Array, p: dict, constrain: Constrain = no_constrain) -> jax.Array:
    """GELU MLP on rhino_jax's ``mlp`` leaves (fc1_w [D, F], fc2_w [F, D], biases)."""
    h = jax.nn.gelu(constrain(x @ p["fc1_w"] + p["fc1_b"], "mlp_hidden"), approximate=True)
    return constrain(h @ p["fc2_w"] + p["fc2_b"], "hidden")


def lm_logits(x: jax.Array, params: dict, constrain: Constrain = no_constrain) -> jax.Array:
    """[B, S, D] -> [B, S, V]: the untied ``head.w`` when the tree has one, else wte^T."""
    if "head" in params:
        logits = x @ params["head"]["w"]
    else:
        logits = jnp.einsum("bsd,vd->bsv", x, params["wte"])
    return constrain(logits, "logits")


def lm_batch(key: jax.Array, config) -> dict:
    """Random next-token batch: targets are the tokens shifted by one (as rhino_jax.models.gpt)."""
    seq = jax.random.randint(key, (config.batch, config.seq_len + 1), 0, config.vocab, dtype=jnp.int32)
    return {"tokens": seq[:, :-1], "targets": seq[:, 1:]}


# ----------------------------------------------------------------------------- the model

def init_params(key: jax.Array, config: Config) -> dict:
    """rhino_jax.models.gpt.init_gpt's tree, less ``"head"`` when the embeddings are tied."""
    params = init_gpt(key, config)
    if config.tie_embeddings:
        del params["head"]
    return params


def loss(params: dict, batch: dict, config: Config, constrain: Constrain = no_constrain) -> jax.Array:
    """Mean next-token cross-entropy (the same numbers as rhino_jax.models.gpt.gpt_loss when untied)."""
    with jax.named_scope("embed"):
        x = embed(params, batch["tokens"], constrain)
    for i, layer in enumerate(params["layers"]):
        with jax.named_scope(f"layer{i}"):
            with jax.named_scope("attn"):
                x = x + attention(layer_norm(x, layer["ln1"]), layer["attn"], config.n_heads, constrain)
            with jax.named_scope("mlp"):
                x = x + mlp(layer_norm(x, layer["ln2"]), layer["mlp"], constrain)
    with jax.named_scope("head"):
        logits = lm_logits(layer_norm(x, params["ln_f"]), params, constrain)
        return jnp.mean(softmax_cross_entropy(logits, batch["targets"]))


def example(config: Config, abstract: bool = False, key: Optional[jax.Array] = None) -> tuple:
    """``(params, opt_state, batch)``; ShapeDtypeStructs when ``abstract`` (nothing allocated)."""
    return build_example(init_params, lm_batch, config, abstract, key)


def make_train_step(config: Config, constrain: Optional[Constrain] = None) -> Callable:
    """``step(params, opt_state, batch) -> (params, opt_state, loss)`` with Adam (lr = config.lr)."""
    return train_step_for(loss, config, constrain)
