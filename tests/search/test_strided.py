"""Strided specs (Rhino §4.1): comm-free reshapes, their rewrite, and the plans they win."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import rhino_jax as rj
from rhino_jax.models.adam import adam_init, adam_update
from rhino_jax.search.cost.collectives import reshard
from rhino_jax.core.specs import ShardingSpec
from rhino_jax.search.space.strides import map_reshape

from helpers import assert_same_numbers, topology

X8 = {"x": 8}
XY = {"x": 2, "y": 4}


def spec(*dims, strides=()):
    return ShardingSpec(tuple(tuple(d) for d in dims), (), strides)


def test_merging_a_split_minor_dim_gives_a_stride():
    # [B=2, S=4096] split on S: as [B*S] each device holds 2 blocks of 512 (stride 512, not 1024).
    merged = map_reshape(spec((), ("x",), ()), (2, 4096, 64), (8192, 64), X8)
    assert merged == spec(("x",), (), strides=((0, 512),))
    assert str(merged) == "[x/512, -]"
    # ... and back: the strided spec reads as S split at maximum stride.
    assert map_reshape(merged, (8192, 64), (2, 4096, 64), X8) == spec((), ("x",), ())
    # The major dim split keeps maximum strides on both sides (the usual, stride-free case).
    assert map_reshape(spec(("x",), ()), (16, 4096), (65536,), X8) == spec(("x",))


def test_axes_on_two_dims_merge_into_one_dim_when_they_nest():
    # B on x (2), S on y (4): the merged dim is split on (x, y), major to minor, at maximum stride.
    assert map_reshape(spec(("x",), ("y",)), (2, 64), (128,), XY) == spec(("x", "y"))
    # Two rows per y-device, each row halved on x: x's halves alternate inside y's block, a
    # pattern no (axes, stride) on the merged dim describes.
    assert map_reshape(spec(("y",), ("x",)), (8, 64), (512,), XY) is None


def test_a_reshape_that_would_move_data_has_no_layout():
    # 12 heads of 64 split 8 ways: a device's 96 features straddle a head boundary.
    assert map_reshape(spec((), ("x",)), (4, 768), (4, 12, 64), X8) is None


def test_split_turns_a_stride_into_a_tiled_dim():
    s = spec(("x",), (), strides=((0, 512),))
    assert s.split((8192, 64), X8) == ((2, 4096, 64), spec((), ("x",), ()))
    with pytest.raises(ValueError, match="strided"):
        s.to_partition_spec()


def test_changing_only_the_stride_exchanges_or_gathers():
    """Stride 512 (period 4096) to blocks of 1024 on 8192: the blocks tile the period, so the
    pieces are exchanged (all-to-all, then permuted into place). Stride 64 (period 512) to
    blocks of 3136 (VGG19's flattened 7x7x512 features): they do not, and XLA gathers."""
    src, topo = spec(("x",), (), strides=((0, 512),)), topology(x=8)
    moves = reshard(src, spec(("x",), ()), 8192 * 64 * 4, topo, (8192, 64))
    assert [c.kind for c in moves] == ["all-to-all", "collective-permute"]
    assert reshard(src, src, 8192 * 64 * 4, topo, (8192, 64)) == []
    moves = reshard(spec((), ("x",), strides=((1, 64),)), spec((), ("x",)), 16 * 25088 * 4, topo, (16, 25088))
    assert [(c.kind, c.bytes) for c in moves] == [("all-gather", 16 * 25088 * 4)]


@pytest.mark.parametrize("shape,pin,merged,read", [
    ((2, 4096, 64), P(None, "x", None), (8192, 64), P("x", None)),  # aligned: all-to-all + permute
    ((4, 49, 512), P(None, None, "x"), (4, 25088), P(None, "x")),  # not aligned: all-gather
])
def test_compiled_stride_change_matches_the_prediction(shape, pin, merged, read):
    """A split dim merged by a reshape (a strided layout), then read at maximum stride: what
    XLA compiles is what `reshard` predicts."""
    def f(x):
        y = jnp.sin(rj.annotate(x, pin).reshape(merged))
        return rj.annotate(jnp.cos(y), read)

    x = jax.random.normal(jax.random.PRNGKey(0), shape)
    lowered = rj.parallelize(f, mesh=rj.device_mesh((8,), ("x",))).lower(x)
    predicted = sorted((c.kind, c.bytes) for c in lowered.plan.collectives)
    compiled = lowered.compile()
    assert sorted((c.kind, c.bytes) for c in compiled.collectives.collectives) == predicted
    assert_same_numbers(jax.jit(f)(x), compiled(x))


# Two sequences, flattened to tokens for the MLP and back: on 8 devices the batch cannot be
# split 8 ways, so the tokens are split along the sequence, and the flattening reshape needs a
# stride (2 blocks per device) to stay free.
B, S, D, F = 2, 4096, 64, 256


def _loss(p, batch):
    x, y = batch["x"], batch["y"]
    h = x.reshape(B * S, D)
    h = jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"]
    h = h.reshape(B, S, D)
    h = h / (1 + jnp.sum(h * h, axis=-1, keepdims=True))
    return jnp.mean((h - y) ** 2)


def _step(p, opt, batch):
    loss, grads = jax.value_and_grad(_loss)(p, batch)
    p, opt = adam_update(grads, opt, p, lr=1e-3)
    return p, opt, loss


def _args():
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    p = {"w1": 0.1 * jax.random.normal(k[0], (D, F)), "b1": jnp.zeros(F),
         "w2": 0.1 * jax.random.normal(k[1], (F, D))}
    batch = {"x": jax.random.normal(k[2], (B, S, D)), "y": jax.random.normal(k[3], (B, S, D))}
    return p, adam_init(p), batch


def test_strided_plan_beats_max_stride_only_plan_on_flattened_tokens():
    mesh = rj.device_mesh((8,), ("x",))
    args = _args()
    strided = rj.parallelize(_step, mesh=mesh).lower(*args)
    plain = rj.parallelize(_step, mesh=mesh, strided_specs=False).lower(*args)
    stats = strided.plan.search_stats
    assert stats.strided_values > 0 and "strided specs" in strided.plan.report()
    assert not plain.plan.search_stats.strided_values
    assert strided.plan.cost.total_s < plain.plan.cost.total_s
    # The batch is split along the sequence; the strided plan moves no activations at all.
    assert strided.plan.arg_specs[-2:] == (spec((), ("x",), ()),) * 2
    fast, slow = strided.compile(), plain.compile()
    assert fast.collectives.bytes() * 10 < slow.collectives.bytes()
    assert fast.collectives.bytes("all-gather") + fast.collectives.bytes("all-to-all") < B * S * D * 4 // 8
    # The compiled program holds the split dims the stride became.
    assert "f32[2,512,256]" in fast.as_text()  # [B*S, F] as [2, 4096, F], 4096 split 8 ways
    assert_same_numbers(jax.jit(_step)(*args), fast(*args))
