"""Model zoo of the Rhino evaluation (benchmarks/fixtures/models): each model trains, rj.parallelize
gives the same numbers as jax.jit on 8 devices, and the paper presets have the paper's parameter counts."""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import rhino_jax as rj
from benchmarks.fixtures.models import MODELS, gpt, moe, sharding_memory_limit
from rhino_jax.models.gpt import gpt_loss

from helpers import assert_same_numbers

NAMES = list(MODELS)


@functools.lru_cache(maxsize=None)
def _reference(name):
    """The tiny preset's example, its step, the jitted step and the first step's outputs (compiled once)."""
    mod = MODELS[name]
    config = mod.PRESETS["tiny"]
    args = mod.example(config)
    step = mod.make_train_step(config)
    # Plain jax.jit(step) on one device, compiled as the parallel programs are: on jax 0.12, XLA's
    # CPU backend at xla_backend_optimization_level=0 changes wresnet's gradients by up to 7e-5
    # (mean 1e-3), which the default build and rhino_jax's plan agree on to 1e-8 (about 10 s more
    # compile time for the six tiny steps).
    jitted = jax.jit(step)
    return args, step, jitted, jitted(*args)


@pytest.mark.parametrize("name", NAMES)
def test_interface(name):
    mod = MODELS[name]
    assert dataclasses.is_dataclass(mod.Config) and mod.Config.__dataclass_params__.frozen
    assert "tiny" in mod.PRESETS and len(mod.PRESETS) > 1
    assert all(isinstance(c, mod.Config) and hash(c) == hash(dataclasses.replace(c)) for c in mod.PRESETS.values())
    # The hook is called on exactly the roles ROLES lists (traced abstractly: nothing compiles).
    seen = set()

    def record(x, role):
        seen.add(role)
        return x

    config = mod.PRESETS["tiny"]
    jax.eval_shape(mod.make_train_step(config, record), *mod.example(config, abstract=True))
    assert seen == set(mod.ROLES), (seen, set(mod.ROLES))


@pytest.mark.parametrize("name", NAMES)
def test_tiny_trains_on_one_device(name):
    args, _, jitted, _ = _reference(name)
    params, opt_state, batch = args
    losses = []
    for _ in range(3):
        params, opt_state, loss = jitted(params, opt_state, batch)
        losses.append(float(loss))
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[0] > losses[1] > losses[2], losses


@pytest.mark.parametrize("name", NAMES)
def test_parallel_matches_jit(name):
    """Under `sharding_memory_limit` (unlimited, the search rightly replicates a tiny model and the
    check would be vacuous): the plan shards state, runs with collectives, and gives the same numbers."""
    args, step, _, reference = _reference(name)
    mesh = rj.device_mesh((8,), ("d",))
    unlimited = rj.parallelize(step, mesh=mesh, opt_level="O2").lower(*args).plan
    limit = sharding_memory_limit(unlimited.cost.memory_bytes, args, 8)
    lowered = rj.parallelize(step, mesh=mesh, opt_level="O2", memory_limit_bytes=limit).lower(*args)
    assert lowered.plan.cost.memory_bytes <= limit < unlimited.cost.memory_bytes
    assert lowered.plan.search_stats.not_replicated
    compiled = lowered.compile()
    assert compiled.collectives.count() > 0
    assert_same_numbers(reference, compiled(*args))


@pytest.mark.parametrize("name", ["unet"])  # one model: the file must stay near 90 s on 2 cores
def test_data_parallel_pins_through_the_hook(name):
    """A baseline's pins through the hook: every activation whose ROLES shape starts with the batch
    dimension is pinned to P("d"), so the step really runs sharded (the tiny steps are otherwise
    planned nearly replicated); same numbers. UNet covers conv, conv_transpose, max-pool (and its
    select_and_scatter gradient) and skip concatenation sharded on the batch."""
    mod = MODELS[name]
    batch_roles = {r for r, shape in mod.ROLES.items() if shape.startswith(("[B,", "[N,"))}
    assert batch_roles

    def data_parallel(x, role):
        return rj.annotate(x, P("d", *(None,) * (x.ndim - 1))) if role in batch_roles else x

    args, _, _, reference = _reference(name)
    step = mod.make_train_step(mod.PRESETS["tiny"], data_parallel)
    lowered = rj.parallelize(step, mesh=rj.device_mesh((8,), ("d",)), opt_level="O2").lower(*args)
    assert_same_numbers(reference, lowered.compile()(*args))


def test_gpt_is_rhino_jax_gpt():
    """The tree is rhino_jax.models.gpt's less "head"; with head = wte^T rhino_jax's gpt_loss gives
    our tied loss, and our loss on the untied tree is rhino_jax's too."""
    config = gpt.PRESETS["tiny"]
    (params, _, batch), _, _, _ = _reference("gpt")
    untied = {**params, "head": {"w": params["wte"].T}}
    untied_config = dataclasses.replace(config, tie_embeddings=False)
    assert jax.tree.structure(untied) == jax.tree.structure(gpt.example(untied_config, abstract=True)[0])

    def losses(params, untied, batch):
        return gpt.loss(params, batch, config), gpt_loss(untied, batch, config), gpt.loss(untied, batch, untied_config)

    ours, theirs, ours_untied = jax.jit(losses)(params, untied, batch)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    np.testing.assert_allclose(ours_untied, theirs, rtol=1e-6)


def test_top2_gating_dispatches_within_capacity():
    g, s, e, c = 2, 32, 4, 10  # capacity below the 2 * 32 / 4 = 16 average: some choices are dropped
    gates = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(0), (g, s, e)), axis=-1)
    combine, dispatch, aux = jax.jit(moe.top2_gating, static_argnums=1)(gates, c)
    combine, dispatch = np.asarray(combine), np.asarray(dispatch)
    assert combine.shape == dispatch.shape == (g, s, e, c)
    per_token = dispatch.sum(axis=(2, 3))
    assert set(np.unique(per_token)) <= {0.0, 1.0, 2.0} and per_token.max() == 2
    assert per_token.sum() < 2 * g * s  # some second choices did not fit
    assert dispatch.sum(axis=1).max() == 1  # a capacity slot holds one token at most
    first = np.asarray(jnp.argmax(gates, axis=-1))
    kept_first = dispatch.sum(axis=3)[np.arange(g)[:, None], np.arange(s)[None], first]
    assert kept_first[:, :c].min() == 1  # the first c tokens of a group always get their first choice
    np.testing.assert_allclose(combine.sum(axis=(2, 3))[per_token > 0], 1.0, rtol=1e-6)
    assert np.isfinite(float(aux))


# ---------------------------------------------------------------------------- paper sizes
# Parameter counts from each table's sizes, written out independently of the model code.

def _gpt_layer(d, f):  # qkv + proj + fc1 + fc2 (weights and biases) + two layer norms
    return 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d


def _gpt_count(c):
    head = 0 if c.tie_embeddings else c.d_model * c.vocab
    return c.n_layers * _gpt_layer(c.d_model, c.d_ff) + (c.vocab + c.seq_len + 2) * c.d_model + head


def _moe_count(c):
    d, f, e = c.d_model, c.d_ff, c.n_experts
    moe_layer = 4 * d * d + 4 * d + 4 * d + d * e + 2 * e * d * f  # attention, LNs, gate, experts
    n_moe = c.n_layers // 2
    return (c.n_layers - n_moe) * _gpt_layer(d, f) + n_moe * moe_layer + (c.vocab + c.seq_len + 2) * d


def _conv(k, c_in, c_out, bias=True):
    return k * k * c_in * c_out + (c_out if bias else 0)


def _vgg_count(c):
    n, c_in = 0, c.in_channels
    for width, convs in zip(c.widths, c.convs):
        for _ in range(convs):
            n, c_in = n + _conv(3, c_in, width), width
    flat = (c.image_size // 32) ** 2 * c_in
    return n + flat * c.fc_dim + c.fc_dim + c.fc_dim * c.fc_dim + c.fc_dim + c.fc_dim * c.num_classes + c.num_classes


def _wresnet_count(c):
    n, c_in = _conv(7, c.in_channels, c.channels, False) + 2 * c.channels, c.channels
    for stage, blocks in enumerate(c.stage_sizes):
        f = c.channels * 2 ** stage
        for j in range(blocks):
            w = f * c.width_factor
            n += _conv(1, c_in, f, False) + _conv(3, f, w, False) + _conv(1, w, 4 * f, False) + 2 * (f + w + 4 * f)
            if j == 0:
                n += _conv(1, c_in, 4 * f, False) + 2 * 4 * f
            c_in = 4 * f
    return n + c_in * c.num_classes + c.num_classes


def _unet_count(c):
    w, n, c_in = c.widths, 0, c.in_channels
    for width in w:  # encoder levels and the bottom
        n, c_in = n + _conv(3, c_in, width) + _conv(3, width, width), width
    for hi, lo in zip(w[:0:-1], w[-2::-1]):  # decoder: up-conv, then two 3x3 on the concatenation
        n += _conv(2, hi, lo) + _conv(3, 2 * lo, lo) + _conv(3, lo, lo)
    return n + _conv(1, w[0], c.out_channels)


def _bert_count(c):
    d = c.d_model
    mlm = d * d + d + 2 * d + c.vocab
    return c.n_layers * _gpt_layer(d, c.d_ff) + (c.vocab + c.seq_len + 2) * d + mlm


# model -> (formula, {preset: the paper's parameter count}, relative tolerance to the paper's figure)
PAPER = {
    "gpt": (_gpt_count, {"GPT-Medium": 350e6, "GPT-Large": 760e6, "GPT-XL": 1.3e9, "GPT-2.7B": 2.7e9,
                         "GPT-6.7B": 6.7e9}, 0.03),
    # Table 2's names (its N_params column says 350M for the 380M model).
    "moe": (_moe_count, {"MoE-8E-380M": 380e6, "MoE-8E-760M": 760e6, "MoE-16E-1.3B": 1.3e9,
                         "MoE-16E-2.4B": 2.4e9, "MoE-32E-10B": 10e9}, 0.05),
    "vgg19": (_vgg_count, {"VGG19": 4.2e9, "VGG19-8gpu": 4.2e9}, 0.02),
    # Alpa's Wide-ResNet at Table 4's (depth, channels, width) has 0.67-0.80x Table 4's counts
    # (see wresnet.py); the tolerance says so rather than hides it.
    "wresnet": (_wresnet_count, {"WR-1.3B": 1.3e9, "WR-2.6B": 2.6e9, "WR-6B": 6e9, "WR-12B": 12e9}, 0.34),
    "unet": (_unet_count, {"UNet": 33e6, "UNet-8gpu": 33e6}, 0.07),
    "bert": (_bert_count, {"DNABert": 162e6, "DNABert-8gpu": 162e6}, 0.04),
}


@pytest.mark.parametrize("name,preset", [(n, p) for n in NAMES for p in PAPER[n][1]])
def test_paper_preset_parameter_count(name, preset):
    mod = MODELS[name]
    formula, paper, tolerance = PAPER[name]
    config = mod.PRESETS[preset]
    params, opt_state, batch = mod.example(config, abstract=True)
    leaves = jax.tree.leaves((params, opt_state, batch))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    assert count == formula(config)
    assert abs(count - paper[preset]) <= tolerance * paper[preset], (preset, count, paper[preset])
    assert jax.tree.structure(opt_state["mu"]) == jax.tree.structure(params)


def test_every_paper_preset_is_checked():
    for name, mod in MODELS.items():
        extra = {"tiny", "DNABert-4k"}
        assert set(mod.PRESETS) - extra == set(PAPER[name][1]), name
