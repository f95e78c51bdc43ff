"""O2 on meshes of three or more axes: first the mesh with two axes merged, then the real mesh
near that plan; on any mesh the windows' start (`search/coarsening/coarse_axes.py`)."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import rhino_jax as rj
from helpers import assert_same_adam_step, assert_same_numbers, topology
from rhino_jax.hlo_passes.graph import Pin
from rhino_jax.models import make_mlp_train_step, mlp_example
from rhino_jax.search.coarsening import coarse_axes
from rhino_jax.core.specs import ShardingSpec
from rhino_jax.search.space.strategies import Strategy


def test_the_merged_pair_is_the_outermost_pair_on_one_link():
    across = topology(a=2, b=2, c=2)  # every axis on one link: the outermost pair
    coarse, merge = coarse_axes.merged(across)
    assert (merge.major, merge.minor) == ("a", "b")
    assert coarse.axis_names == ("a*b", "c") and coarse.axis_sizes == (4, 2)
    # a crosses hosts, b and c do not: b and c are alike
    mixed = dataclasses.replace(across, bandwidth=(1e10, 1e11, 1e11), hosts_spanned=(2, 1, 1), host_devices=4)
    coarse, merge = coarse_axes.merged(mixed)
    assert (merge.major, merge.minor) == ("b", "c")
    assert coarse.axis_sizes == (2, 4) and coarse.bandwidth == (1e10, 1e11) and coarse.hosts_spanned == (2, 1)


def test_pins_on_the_coarse_mesh():
    merge = coarse_axes.Merge("a", "b")
    pins = (Pin(0, (("a", "b"), ("c",)), "both"), Pin(1, (("a",), None), "one"), Pin(2, (("c",), ()), "other"))
    assert [p.dims for p in merge.pins(pins)] == [
        (("a*b",), ("c",)), (None, None), (("c",), ())]


def test_on_hosts_by_gpus_the_coarse_mesh_drops_the_slower_axis():
    """Two unlike axes merged would price every collective at the network's speed, and the
    coarse plan would stay replicated: the slower axis is left out instead, its tensors
    replicated over it; two alike axes are merged."""
    hosts = dataclasses.replace(topology(h=2, g=8), bandwidth=(4.5e10, 3.7e11), hosts_spanned=(2, 1),
                                host_devices=8)
    coarse, how = coarse_axes.coarser(hosts)
    assert how == coarse_axes.Drop("h") and coarse.axis_names == ("g",) and coarse.axis_sizes == (8,)
    assert coarse.bandwidth == (3.7e11,) and coarse.hosts_spanned == (1,)
    assert coarse_axes.coarser(topology(a=2, b=4))[1] == coarse_axes.Merge("a", "b")
    split = Strategy((ShardingSpec((("g",), ())),), (ShardingSpec((("g",), ())),), 0.0)
    assert how.anchor(split, ("h", "g")) == {"h": (None, None), "g": (0, 0)}
    assert [p.dims for p in how.pins((Pin(0, (("h", "g"), None), "x"),))] == [(("g",), None)]


def test_near_keeps_the_strategies_that_move_at_most_one_axis():
    axes = ("a", "b", "c")

    def matmul(x_dims, w_dims, partial=()):
        x, w = ShardingSpec(x_dims), ShardingSpec(w_dims)
        out = ShardingSpec((x_dims[0], w_dims[1]), partial)
        return Strategy((x, w), (out,), 0.0)
    coarse = Strategy((ShardingSpec((("a*b",), ())), ShardingSpec(((), ("c",)))),
                      (ShardingSpec((("a*b",), ("c",))),), 0.0)
    at = coarse_axes.Merge("a", "b").anchor(coarse, axes)
    same = matmul((("a", "b"), ()), ((), ("c",)))
    one_moved = matmul((("a",), ()), ((), ("b", "c")))
    two_moved = matmul(((), ()), (("a", "b"), ("c",)), partial=("a", "b"))
    assert coarse_axes.near([same, one_moved, two_moved], at, axes) == [same, one_moved]
    assert coarse_axes.near([two_moved], at, axes) == [two_moved]  # nothing near: the whole space


@pytest.fixture(scope="module")
def mlp():
    step = make_mlp_train_step(lr=1e-2)
    args = mlp_example([256, 1024, 1024, 256], batch_size=256)
    return step, args, jax.jit(step)(*args)


def test_a_three_axis_mesh_plans_near_the_whole_space_optimum_with_a_smaller_ilp(mlp):
    step, args, reference = mlp
    mesh = rj.device_mesh((2, 2, 2), ("a", "b", "c"))
    o2 = rj.parallelize(step, mesh=mesh, cluster="8x-h100", opt_level="O2")
    o3 = rj.parallelize(step, mesh=mesh, cluster="8x-h100", opt_level="O3").lower(*args).plan
    plan = o2.lower(*args).plan
    assert any(spec.used_axes() for spec in plan.arg_specs), "a replicated plan checks nothing"
    assert plan.search_stats.ilp_vars < o3.search_stats.ilp_vars / 3
    assert plan.cost.total_s <= o3.cost.total_s * 1.01
    assert_same_adam_step(reference, o2(*args), lr=1e-2)


def test_a_pin_on_one_axis_of_the_merged_pair_is_kept(mlp):
    mesh = rj.device_mesh((2, 2, 2), ("a", "b", "c"))

    def loss(w, x):
        h = rj.annotate(jnp.tanh(x @ w), P("b", None), name="hidden")
        return jnp.sum(h ** 2)

    w, x = jnp.ones((16, 32)) / 16, jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) / 100
    parallel = rj.parallelize(jax.grad(loss), mesh=mesh, opt_level="O2")
    lowered = parallel.lower(w, x)
    assert all(lowered.plan.value_specs[p.value].dims == (("b",), ()) for p in lowered.graph.pins)
    assert_same_numbers(jax.jit(jax.grad(loss))(w, x), parallel(w, x))
