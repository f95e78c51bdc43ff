"""Fast CPU checks for the plain-JAX models: they train, abstract shapes match, Adam is right."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rhino_jax.models import (
    GPT2_SMALL,
    GPT_TINY,
    adam_init,
    adam_update,
    gpt_example,
    make_gpt_train_step,
    make_mlp_train_step,
    mlp_example,
)

MLP_WIDTHS = (8, 32, 32, 4)


def _run_steps(step, params, opt_state, batch, n: int = 5) -> list[float]:
    step = jax.jit(step)
    losses = []
    for _ in range(n):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    assert int(opt_state["count"]) == n
    return losses


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: (make_mlp_train_step(lr=1e-2), mlp_example(MLP_WIDTHS, 16)), id="mlp"),
        pytest.param(lambda: (make_gpt_train_step(GPT_TINY, lr=1e-2), gpt_example(GPT_TINY)), id="gpt"),
    ],
)
def test_train_step_loss_decreases(make) -> None:
    step, example = make()
    losses = _run_steps(step, *example)
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], losses


def _shapes(tree):
    return jax.tree_util.tree_map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), tree)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda abstract: mlp_example(MLP_WIDTHS, 16, abstract=abstract), id="mlp"),
        pytest.param(lambda abstract: gpt_example(GPT_TINY, abstract=abstract), id="gpt"),
    ],
)
def test_abstract_example_matches_concrete(make) -> None:
    concrete, abstract = make(False), make(True)
    assert jax.tree_util.tree_structure(concrete) == jax.tree_util.tree_structure(abstract)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(abstract))
    assert _shapes(concrete) == _shapes(abstract)


def test_gpt_batch_dtypes_and_range() -> None:
    _, _, batch = gpt_example(GPT_TINY)
    for name in ("tokens", "targets"):
        arr = np.asarray(batch[name])
        assert arr.dtype == np.int32 and arr.shape == (GPT_TINY.batch, GPT_TINY.seq_len)
        assert arr.min() >= 0 and arr.max() < GPT_TINY.vocab


def test_gpt2_small_abstract_lowers() -> None:
    example = gpt_example(GPT2_SMALL, abstract=True)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(example[0]))
    assert 120e6 < n_params < 170e6  # ~124M + untied 38.6M head
    lowered = jax.jit(make_gpt_train_step(GPT2_SMALL)).lower(*example)
    assert "layer11" in lowered.as_text(debug_info=True)


def test_adam_matches_numpy() -> None:
    lr, b1, b2, eps = 0.1, 0.9, 0.999, 1e-8
    p = np.array([1.0, -2.0, 3.0], np.float32)
    g = np.array([0.5, 0.1, -4.0], np.float32)
    params = {"p": jnp.asarray(p)}
    state = adam_init(params)
    for t in (1, 2):  # two steps so both the moment recursion and bias correction matter
        new_params, state = adam_update({"p": jnp.asarray(g)}, state, params, lr, b1, b2, eps)
        params = new_params
    m1, v1 = (1 - b1) * g, (1 - b2) * g * g
    m2, v2 = b1 * m1 + (1 - b1) * g, b2 * v1 + (1 - b2) * g * g
    p1 = p - lr * (m1 / (1 - b1)) / (np.sqrt(v1 / (1 - b2)) + eps)
    p2 = p1 - lr * (m2 / (1 - b1**2)) / (np.sqrt(v2 / (1 - b2**2)) + eps)
    np.testing.assert_allclose(np.asarray(params["p"]), p2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state["mu"]["p"]), m2, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(state["nu"]["p"]), v2, rtol=1e-5)
    assert int(state["count"]) == 2
