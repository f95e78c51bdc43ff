"""Shared checks: a parallel result must equal the single-device one. Helpers test files in
several folders share (tests/conftest.py puts this folder on sys.path)."""
import importlib.metadata
import re
from pathlib import Path

import jax
import numpy as np


def assert_same_numbers(reference, result, rtol=1e-4, atol=1e-5):
    assert jax.tree.structure(reference) == jax.tree.structure(result)
    for ref, out in zip(jax.tree.leaves(reference), jax.tree.leaves(result)):
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=rtol, atol=atol)


def assert_same_adam_step(reference, result, lr: float):
    """A train step's (params, opt_state, *rest) after one Adam update: the optimizer state (Adam's
    moments: the gradient) and the rest to float noise, the parameters to lr/4. Adam's first update
    is lr * g / (|g| + eps), so float noise in a near-zero gradient moves its parameter by up to lr."""
    (params_ref, *rest_ref), (params, *rest) = reference, result
    assert_same_numbers(tuple(rest_ref), tuple(rest), rtol=1e-4, atol=1e-8)
    assert_same_numbers(params_ref, params, rtol=1e-3, atol=lr / 4)


def on_host(tree):
    """The arrays as numpy: jax.device_put splits a host array by slicing it, where a jax array on
    one device costs a compiled slicing program per shape and layout (seconds per Flax step)."""
    return jax.tree.map(np.asarray, tree)


def topology(**sizes):
    """A mesh as the cost model sees it, every axis on the same link (M8's NVLink figures)."""
    from rhino_jax.search.cost.cluster import M8_V100, MeshTopology
    n = len(sizes)
    return MeshTopology(tuple(sizes), tuple(sizes.values()), (M8_V100.intra_host_bandwidth,) * n,
                        (M8_V100.intra_host_latency,) * n, M8_V100.collective_launch_s)


def code_blocks(text: str) -> list[tuple[str, str, int]]:
    """A Markdown text's fenced code blocks: (language, code, offset in the text)."""
    return [(m.group(1), m.group(2), m.start()) for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S)]


def scanned_attention_step(batch: int, heads: int, seq: int, head_dim: int):
    """step(w, x) -> (w', loss) of causal self-attention layers run by `jax.lax.scan` over a
    stacked [layers, d, d] weight, masked as Llama's are (`jnp.where(causal, scores, -1e9)`),
    rematerialised, plain SGD. jax's scan hoists what the body computes from constants alone, the
    mask and the -1e9 broadcast to the scores' [batch, heads, seq, seq], out of the loop and passes
    them in as values the body hands back unchanged."""
    import jax.numpy as jnp

    d = heads * head_dim

    def layer(h, w):
        q = (h @ w).reshape(batch, seq, heads, head_dim)
        scores = jnp.einsum("bqhe,bkhe->bhqk", q, q)
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        return h + jnp.einsum("bhqk,bkhe->bqhe", probs, q).reshape(batch, seq, d), None

    def loss(w, x):
        h, _ = jax.lax.scan(jax.checkpoint(layer), x, w)
        return jnp.mean(h ** 2)

    def step(w, x):
        value, grad = jax.value_and_grad(loss)(w, x)
        return w - 0.1 * grad, value

    return step


def _plugin_skip() -> str | None:
    """Why these tests cannot run here, or None: no CUDA plugin, or one of another version."""
    try:
        plugin = importlib.metadata.version("jax-cuda12-plugin")
    except importlib.metadata.PackageNotFoundError:
        return "jax's CUDA plugin is not installed (pip install -e '.[test]' on Python >= 3.12)"
    jaxlib = importlib.metadata.version("jaxlib")
    if plugin != jaxlib:
        return f"jax-cuda12-plugin {plugin} is not jaxlib's version {jaxlib}: pip install jax-cuda12-plugin=={jaxlib}"
    return None


def _readme_example(n: int, train_step, mesh) -> dict:
    """The README's n-th example on constraints, run as written with `train_step` and `mesh`:
    what it defines (its `step`, its functions)."""
    import rhino_jax as rj

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.index("## Constraining the search space")
    end = readme.index("\n## ", section + 1)
    blocks = [code for language, code, at in code_blocks(readme) if section < at < end and language == "python"]
    assert len(blocks) > n, "the README's section has fewer examples"
    scope = dict(rj=rj, train_step=train_step, mesh=mesh)
    exec(blocks[n], scope)
    return scope
