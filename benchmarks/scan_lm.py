"""Scan-over-layers benchmark: a Flax LM whose blocks are `nn.scan(nn.remat(Block))` (stacked
[L, ...] parameters, one while loop forward and one backward), Adam(W), planned by rhino_jax and
as data parallelism (pinned through the same API), beside the same model written unrolled.

python -m benchmarks.scan_lm   → prints a table, writes benchmarks/scan_lm.md
Per mesh and form: predicted step (M8 preset) of rhino_jax's plan and of data parallelism, their
ratio, the plan's predicted and compiled collective bytes (loop bodies counted per trip), search
time, ops kept replicated, and max |Δ| of the compiled step against one device.
"""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import datetime  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import rhino_jax as rj  # noqa: E402

VOCAB, WIDTH, HEADS, SEQ, BATCH, LAYERS = 2048, 256, 8, 64, 32, 4


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        mask = nn.make_causal_mask(jnp.ones(h.shape[:2]))
        h = h + nn.SelfAttention(num_heads=HEADS, deterministic=True)(nn.LayerNorm()(h), mask=mask)
        return h + nn.Dense(WIDTH)(nn.gelu(nn.Dense(4 * WIDTH)(nn.LayerNorm()(h)))), None


class LM(nn.Module):
    scan: bool

    @nn.compact
    def __call__(self, tokens):
        h = nn.Embed(VOCAB, WIDTH)(tokens)
        if self.scan:
            h = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
                        length=LAYERS)()(h, None)[0]
        else:
            for _ in range(LAYERS):
                h = nn.remat(Block)()(h, None)[0]
        return nn.Dense(VOCAB)(nn.LayerNorm()(h))


def make_step(model, opt, data_axes=None):
    """The train step; with `data_axes`, pinned to data parallelism (state replicated)."""
    def replicated(tree):
        return jax.tree.map(lambda x: rj.annotate(x, P()), tree)

    def step(params, opt_state, tokens):
        if data_axes:
            params, opt_state = replicated(params), replicated(opt_state)
            tokens = rj.annotate(tokens, P(data_axes))

        def loss(p):
            logits = model.apply({"params": p}, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if data_axes:
            params, opt_state = replicated(params), replicated(opt_state)
        return params, opt_state, value
    return step


def measure(scan: bool, shape: tuple[int, ...], names: tuple[str, ...]) -> dict:
    model, opt = LM(scan), optax.adamw(1e-3)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (BATCH, SEQ), 0, VOCAB)
    params = model.init(jax.random.PRNGKey(0), tokens)["params"]
    args = (params, opt.init(params), tokens)
    mesh = rj.device_mesh(shape, names)
    start = time.perf_counter()
    lowered = rj.parallelize(make_step(model, opt), mesh=mesh).lower(*args)
    search_s = time.perf_counter() - start
    dp = rj.parallelize(make_step(model, opt, names), mesh=mesh).lower(*args).plan
    compiled = lowered.compile()
    reference = jax.jit(make_step(model, opt))(*args)
    delta = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(reference),
                                                                jax.tree.leaves(compiled(*args))))
    plan = lowered.plan
    return dict(form="nn.scan" if scan else "unrolled", mesh=shape, rhino_ms=plan.cost.total_s * 1e3,
                dp_ms=dp.cost.total_s * 1e3, predicted_mib=sum(c.bytes for c in plan.collectives) / 2**20,
                compiled_mib=compiled.collectives.bytes() / 2**20, search_s=search_s,
                fallback=len(plan.fallback_ops), delta=delta)


def main():
    rows = [measure(scan, shape, names) for shape, names in (((8,), ("data",)), ((2, 4), ("data", "model")))
            for scan in (True, False)]
    header = ("| form | mesh | rhino_jax ms | data parallel ms | ratio | predicted MiB | compiled MiB "
              "| search s | replicated ops | max abs diff |")
    lines = [header, "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['form']} | {r['mesh']} | {r['rhino_ms']:.3f} | {r['dp_ms']:.3f} | "
                     f"{r['rhino_ms'] / r['dp_ms']:.3f} | {r['predicted_mib']:.2f} | {r['compiled_mib']:.2f} | "
                     f"{r['search_s']:.1f} | {r['fallback']} | {r['delta']:.1e} |")
    table = "\n".join(lines)
    print(table)
    out = pathlib.Path(__file__).with_name("scan_lm.md")
    out.write_text(f"# Scan over layers: Flax LM, nn.scan(nn.remat(Block)) vs unrolled\n\n"
                   f"`python -m benchmarks.scan_lm` ({datetime.date.today()}): vocabulary {VOCAB}, width "
                   f"{WIDTH}, {HEADS} heads, sequence {SEQ}, batch {BATCH}, {LAYERS} layers, AdamW; "
                   f"predicted step on the M8 preset; collectives per device, loop bodies counted per trip.\n\n"
                   f"{table}\n")


if __name__ == "__main__":
    main()
