"""GShard mixture-of-experts language model of Rhino Table 2 (§7.1), top-2 gating.

Presets follow Table 2 ("GShard MoE Model weak scaling test configurations"). Every other
layer's FFN (layers 1, 3, 5, ...) is a mixture of experts, as in GShard and in Alpa's MoE benchmark
(most of Table 2's rows are Alpa's MoE sizes); the others are dense FFNs of the same width D_ffn.
Vocabulary 32000 and 1024 tokens as in Alpa's MoE benchmark (the table gives neither); embeddings
tied with the output head.

================  ======  ========  =====  ==========  =======  ====  ======================
preset            layers  D_hidden  D_ffn  heads (Dh)  experts  GPUs  parameters (ours / T2)
================  ======  ========  =====  ==========  =======  ====  ======================
MoE-8E-380M       8       768       6144   16 (48)     8        1     384.1M / 380M (350M*)
MoE-8E-760M       16      768       6144   16 (48)     8        2     742.8M / 760M
MoE-16E-1.3B      16      768       6144   16 (48)     16       4     1.347B / 1.3B
MoE-16E-2.4B      16      1024      8192   16 (64)     16       8     2.383B / 2.4B
MoE-32E-10B       16      1536      12288  16 (96)     32       16    10.17B / 10B
tiny              2       32        64     4 (8)       4        -     for tests
================  ======  ========  =====  ==========  =======  ====  ======================

(*) Table 2's N_params column says 350M for the model it names 380M; we compare with the name.
Our counts are within 0.1% of Alpa's ``compute_moe_parameter_count`` for these sizes (which counts
expert biases that neither GShard's nor Alpa's expert layers have, and no position embeddings).

Batch: the presets carry Table 2's global batch of the full-parallelism tests (256); the
SPMD-only tests use 8 (``SPMD_ONLY_BATCH``).

The MoE layer (GShard, Lepikhin et al. 2020, Algorithm 1; Lingvo's ``top2_gating``):
- tokens [B, S, D] are flattened to [B*S, D] and cut into G = B*S / group_size groups of
  ``group_size`` tokens ([G, Sg, D], Sg = 2048 as in Alpa's benchmark; fewer tokens per step
  give one group); the gate is a [D, E] matmul and softmax per token;
- top-2: the best expert, then the best of the rest; each expert takes at most
  C = ceil(capacity_factor * 2 * Sg / E) tokens per group (capacity_factor = 1.0, i.e. GShard's
  2N/E), first come first served in token order, the first choices of all tokens before any
  second choice; overflowing tokens are dropped (their residual passes unchanged);
- dispatch and combine are one-hot einsums with the [G, Sg, E, C] dispatch/combine tensors;
  expert FFNs are ``wi`` [E, D, F] and ``wo`` [E, F, D] with ReLU, on [E, G*C, D] tokens;
- the load-balancing loss mean(gates) . mean(top-1 mask) * E^2 (Lingvo), weight ``aux_loss_coef``
  = 0.01, is added to the cross-entropy.
Deviations: GShard's random dispatch of the second expert (when its gate is small) is left out,
so the step is deterministic; the model is a decoder-only LM (pre-LN GPT blocks from
``gpt.py``), while GShard's was an encoder-decoder translation model; no dropout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from . import gpt
from ._common import Constrain, build_example, no_constrain, normal, softmax_cross_entropy, train_step_for

__all__ = ["Config", "PRESETS", "ROLES", "SPMD_ONLY_BATCH", "example", "make_train_step", "loss",
           "init_params", "top2_gating", "moe_ffn"]


@dataclass(frozen=True)
class Config:
    vocab: int
    seq_len: int
    d_model: int
    n_heads: int
    n_layers: int
    d_ff: int  # dense FFN and expert FFN width
    n_experts: int
    batch: int
    group_size: int = 2048  # tokens per gating group (GShard's S); capped at batch * seq_len
    capacity_factor: float = 1.0  # expert capacity C = capacity_factor * 2 * group / n_experts
    aux_loss_coef: float = 0.01
    lr: float = 1e-3

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} not divisible by n_heads={self.n_heads}")
        if (self.batch * self.seq_len) % self.group:
            raise ValueError(f"batch*seq_len={self.batch * self.seq_len} not divisible by group_size={self.group}")

    @property
    def group(self) -> int:
        """Tokens per gating group actually used."""
        return min(self.group_size, self.batch * self.seq_len)

    @property
    def n_groups(self) -> int:
        return self.batch * self.seq_len // self.group

    @property
    def capacity(self) -> int:
        return max(1, math.ceil(self.capacity_factor * 2 * self.group / self.n_experts))

    def is_moe_layer(self, i: int) -> bool:
        """Layers 1, 3, 5, ... are MoE layers (every other FFN, as GShard)."""
        return i % 2 == 1

    def as_gpt(self) -> gpt.Config:
        return gpt.Config(vocab=self.vocab, seq_len=self.seq_len, d_model=self.d_model, n_heads=self.n_heads,
                          n_layers=self.n_layers, d_ff=self.d_ff, batch=self.batch, tie_embeddings=True,
                          lr=self.lr)


SPMD_ONLY_BATCH = 8

_LM = dict(vocab=32000, seq_len=1024, n_heads=16, batch=256)
PRESETS: dict[str, Config] = {
    "tiny": Config(vocab=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=64, n_experts=4, batch=8,
                   group_size=32),
    "MoE-8E-380M": Config(d_model=768, n_layers=8, d_ff=6144, n_experts=8, **_LM),
    "MoE-8E-760M": Config(d_model=768, n_layers=16, d_ff=6144, n_experts=8, **_LM),
    "MoE-16E-1.3B": Config(d_model=768, n_layers=16, d_ff=6144, n_experts=16, **_LM),
    "MoE-16E-2.4B": Config(d_model=1024, n_layers=16, d_ff=8192, n_experts=16, **_LM),
    "MoE-32E-10B": Config(d_model=1536, n_layers=16, d_ff=12288, n_experts=32, **_LM),
}

ROLES: dict[str, str] = {
    **gpt.ROLES,
    "mlp_hidden": "[B, S, F] output of the dense (non-MoE) layers' first FFN matmul (before GELU)",
    "moe_tokens": "[G, Sg, D] MoE-layer input tokens, flattened [B*S, D] and cut into G gating groups",
    "gate_logits": "[G, Sg, E] gate matmul output",
    "expert_in": "[E, G*C, D] tokens dispatched to each expert (G groups x C capacity slots)",
    "expert_hidden": "[E, G*C, F] expert FFN first matmul output (before ReLU)",
    "expert_out": "[E, G*C, D] expert FFN output, before the combine einsum",
}
ROLES["hidden"] += "; also the combined MoE output"


def init_params(key: jax.Array, config: Config) -> dict:
    """gpt.init_params' tree; in MoE layers ``"moe": {"gate": {"w"}, "experts": {"wi", "wo"}}`` replaces ``"mlp"``."""
    params = gpt.init_params(key, config.as_gpt())
    d, f, e = config.d_model, config.d_ff, config.n_experts
    for i, k in enumerate(jax.random.split(jax.random.fold_in(key, 1), config.n_layers)):
        if not config.is_moe_layer(i):
            continue
        kg, ki, ko = jax.random.split(k, 3)
        del params["layers"][i]["mlp"]
        params["layers"][i]["moe"] = {
            "gate": {"w": normal(kg, (d, e), 0.02)},
            "experts": {"wi": normal(ki, (e, d, f), 1 / math.sqrt(d)),
                        "wo": normal(ko, (e, f, d), 1 / math.sqrt(f * 2 * config.n_layers))},
        }
    return params


def _exclusive_cumsum(mask: jax.Array) -> jax.Array:
    """Along axis 1 of [G, S, E]: how many earlier tokens of the group chose the same expert."""
    return jnp.cumsum(mask, axis=1) - mask


def top2_gating(gates: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[G, S, E] softmax gates -> (combine [G, S, E, C], dispatch [G, S, E, C], aux loss)."""
    n_experts = gates.shape[-1]
    index_1 = jnp.argmax(gates, axis=-1)
    mask_1 = jax.nn.one_hot(index_1, n_experts, dtype=gates.dtype)
    gates_wo_1 = gates * (1.0 - mask_1)
    index_2 = jnp.argmax(gates_wo_1, axis=-1)
    mask_2 = jax.nn.one_hot(index_2, n_experts, dtype=gates.dtype)

    # Load balancing (Lingvo): fraction of gate mass times fraction of first choices, per expert.
    aux = jnp.mean(jnp.mean(gates, axis=1) * jnp.mean(mask_1, axis=1)) * n_experts * n_experts

    pos_1 = _exclusive_cumsum(mask_1)
    mask_1 = mask_1 * (pos_1 < capacity)
    pos_2 = _exclusive_cumsum(mask_2) + jnp.sum(mask_1, axis=1, keepdims=True)
    mask_2 = mask_2 * (pos_2 < capacity)

    gate_1 = jnp.sum(gates * mask_1, axis=-1)  # [G, S], 0 where dropped
    gate_2 = jnp.sum(gates * mask_2, axis=-1)
    denom = gate_1 + gate_2
    denom = jnp.where(denom > 0, denom, 1.0)
    slot_1 = jax.nn.one_hot(jnp.sum(pos_1 * mask_1, axis=-1).astype(jnp.int32), capacity, dtype=gates.dtype)
    slot_2 = jax.nn.one_hot(jnp.sum(pos_2 * mask_2, axis=-1).astype(jnp.int32), capacity, dtype=gates.dtype)
    combine = (jnp.einsum("gse,gsc->gsec", (gate_1 / denom)[..., None] * mask_1, slot_1)
               + jnp.einsum("gse,gsc->gsec", (gate_2 / denom)[..., None] * mask_2, slot_2))
    dispatch = (combine > 0).astype(gates.dtype)
    return combine, dispatch, aux


def moe_ffn(x: jax.Array, p: dict, config: Config, constrain: Constrain = no_constrain) -> tuple[jax.Array, jax.Array]:
    """[B, S, D] -> ([B, S, D], aux loss): gate, top-2 dispatch, expert FFNs, combine."""
    b, s, d = x.shape
    g, sg, e, c = config.n_groups, config.group, config.n_experts, config.capacity
    tokens = constrain(x.reshape(g, sg, d), "moe_tokens")
    logits = constrain(jnp.einsum("gsd,de->gse", tokens, p["gate"]["w"]), "gate_logits")
    combine, dispatch, aux = top2_gating(jax.nn.softmax(logits, axis=-1), c)
    expert_in = jnp.einsum("gsec,gsd->egcd", dispatch, tokens).reshape(e, g * c, d)
    expert_in = constrain(expert_in, "expert_in")
    h = constrain(jnp.einsum("end,edf->enf", expert_in, p["experts"]["wi"]), "expert_hidden")
    out = constrain(jnp.einsum("enf,efd->end", jax.nn.relu(h), p["experts"]["wo"]), "expert_out")
    y = jnp.einsum("gsec,egcd->gsd", combine, out.reshape(e, g, c, d)).reshape(b, s, d)
    return constrain(y, "hidden"), aux


def loss(params: dict, batch: dict, config: Config, constrain: Constrain = no_constrain) -> jax.Array:
    """Next-token cross-entropy + aux_loss_coef * (sum of the MoE layers' load-balancing losses)."""
    ln = gpt.layer_norm
    aux_total = jnp.float32(0.0)
    with jax.named_scope("embed"):
        x = gpt.embed(params, batch["tokens"], constrain)
    for i, layer in enumerate(params["layers"]):
        with jax.named_scope(f"layer{i}"):
            with jax.named_scope("attn"):
                x = x + gpt.attention(ln(x, layer["ln1"]), layer["attn"], config.n_heads, constrain)
            if "moe" in layer:
                with jax.named_scope("moe"):
                    y, aux = moe_ffn(ln(x, layer["ln2"]), layer["moe"], config, constrain)
                    x, aux_total = x + y, aux_total + aux
            else:
                with jax.named_scope("mlp"):
                    x = x + gpt.mlp(ln(x, layer["ln2"]), layer["mlp"], constrain)
    with jax.named_scope("head"):
        logits = gpt.lm_logits(ln(x, params["ln_f"]), params, constrain)
        ce = jnp.mean(softmax_cross_entropy(logits, batch["targets"]))
    return ce + config.aux_loss_coef * aux_total


def example(config: Config, abstract: bool = False, key: Optional[jax.Array] = None) -> tuple:
    """``(params, opt_state, batch)``; ShapeDtypeStructs when ``abstract`` (nothing allocated)."""
    return build_example(init_params, gpt.lm_batch, config, abstract, key)


def make_train_step(config: Config, constrain: Optional[Constrain] = None) -> Callable:
    """``step(params, opt_state, batch) -> (params, opt_state, loss)`` with Adam (lr = config.lr)."""
    return train_step_for(loss, config, constrain)
