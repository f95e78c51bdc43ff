"""parallelize(mesh=None): enumerate mesh shapes over the devices, plan on each, keep the best."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import rhino_jax as rj
from rhino_jax.models import make_mlp_train_step, mlp_example
from rhino_jax.search.cost.cluster import MeshTopology, host_ids
from rhino_jax.search.space.meshes import candidate_meshes, enumerate_mesh_shapes, factorizations

from helpers import assert_same_numbers

TWO_AXES = ("data", "model")  # fewer names, fewer axes: keeps the searches in these tests quick


def _cluster(devices_per_host):
    return rj.Cluster(name=f"hosts-of-{devices_per_host}", devices_per_host=devices_per_host,
                      intra_host_bandwidth=130e9, intra_host_latency=1e-6,
                      inter_host_bandwidth=12.5e9, inter_host_latency=20e-6,
                      flops_per_s={"float32": 12.5e12})


def test_shapes_for_8_devices_on_one_host():
    assert factorizations(8, 2) == [(2, 4), (4, 2)]
    assert factorizations(7, 2) == []
    assert enumerate_mesh_shapes([0] * 8) == [(8,), (2, 4), (4, 2), (2, 2, 2)]
    assert enumerate_mesh_shapes([0] * 8, max_axes=2) == [(8,), (2, 4), (4, 2)]
    assert enumerate_mesh_shapes([0] * 7) == [(7,)]
    assert enumerate_mesh_shapes([0]) == [(1,)]
    assert candidate_meshes([0] * 8) == [((8,), ("data",)), ((2, 4), ("data", "model")),
                                         ((4, 2), ("data", "model")), ((2, 2, 2), ("data", "model", "extra"))]
    assert candidate_meshes([0] * 4, ("dp", "tp")) == [((4,), ("dp",)), ((2, 2), ("dp", "tp"))]


def test_inner_axes_stay_inside_a_host():
    # 2 hosts of 4: every shape keeps its inner axes inside a host; only the outer axis crosses.
    assert enumerate_mesh_shapes([0, 0, 0, 0, 1, 1, 1, 1]) == [(8,), (2, 4), (4, 2), (2, 2, 2)]
    # 4 hosts of 2: (2, 4)'s inner axis and (2, 2, 2)'s middle axis would cross hosts.
    assert enumerate_mesh_shapes([0, 0, 1, 1, 2, 2, 3, 3]) == [(8,), (4, 2)]
    # The rule read from real devices and a custom cluster, and the cost model agrees with it.
    for per_host, want in ((4, [(8,), (2, 4), (4, 2), (2, 2, 2)]), (2, [(8,), (4, 2)])):
        cluster = _cluster(per_host)
        hosts = host_ids(jax.devices(), cluster.devices_per_host)
        assert hosts == [i // per_host for i in range(8)]
        shapes = [s for s, _ in candidate_meshes(hosts)]
        assert shapes == want
        for shape, names in candidate_meshes(hosts):
            topo = MeshTopology.from_mesh(rj.device_mesh(shape, names), cluster)
            assert all(bw == cluster.intra_host_bandwidth for bw in topo.bandwidth[1:]), (shape, topo)



def test_groups_crossing_hosts_share_the_host_network():
    # 2 hosts of 4: the 4 groups of the outer axis each send through a host's network at once.
    cluster = _cluster(4)
    nic = cluster.inter_host_bandwidth
    topo = MeshTopology.from_mesh(rj.device_mesh((2, 4), ("data", "model")), cluster)
    assert topo.hosts_spanned == (2, 1) and topo.host_devices == 4
    assert topo.link(("data",)) == (2, nic / 4, cluster.inter_host_latency)
    assert topo.link(("model",)) == (4, cluster.intra_host_bandwidth, cluster.intra_host_latency)
    assert topo.link(("data", "model"))[:2] == (8, nic)  # one ring over both hosts has it all
    # (4, 2): 2 members of each outer group per host, so 2 groups per host
    assert MeshTopology.from_mesh(rj.device_mesh((4, 2), ("data", "model")), cluster).link(("data",))[1] == nic / 2


def test_a_mesh_beyond_the_presets_hosts_is_refused():
    from rhino_jax.search.cost.cluster import PRESETS, get_cluster
    assert get_cluster("m8-v100-2hosts").hosts == 2 and "8x-h100-4hosts" in PRESETS
    small = dataclasses.replace(_cluster(2), hosts=2)
    with pytest.raises(ValueError, match="lie on 4 hosts of 2, but cluster .* has 2"):
        MeshTopology.from_mesh(rj.device_mesh((8,), ("data",)), small)
    MeshTopology.from_mesh(rj.device_mesh((4,), ("data",), devices=jax.devices()[:4]), small)  # 2 hosts fit

def test_mesh_none_gives_the_same_numbers_as_jit():
    step = make_mlp_train_step()
    args = mlp_example((16, 32, 8), 8)
    parallel = rj.parallelize(step, mesh=None, axis_names=TWO_AXES)
    lowered = parallel.lower(*args)
    assert parallel.lower(*args) is lowered  # cached per signature
    chosen = [c for c in lowered.plan.mesh_candidates if c.chosen]
    assert len(chosen) == 1 and chosen[0] is lowered.plan.mesh_candidates[0]
    assert dict(lowered.mesh.shape) == lowered.plan.mesh_axes == chosen[0].mesh_axes
    assert {s.mesh for s in jax.tree.leaves(lowered.plan.input_shardings)} == {lowered.mesh}
    assert_same_numbers(jax.jit(step)(*args), parallel(*args))


def test_mesh_none_over_given_devices():
    step = make_mlp_train_step()
    args = mlp_example((16, 32, 8), 8)
    devices = jax.devices()[:4]
    parallel = rj.parallelize(step, mesh=None, devices=devices, axis_names=TWO_AXES)
    lowered = parallel.lower(*args)
    assert sorted(c.shape for c in lowered.plan.mesh_candidates) == [(2, 2), (4,)]
    assert set(lowered.mesh.devices.flat) == set(devices)
    assert_same_numbers(jax.jit(step)(*args), parallel(*args))


def test_picks_least_predicted_cost_and_reports_runners_up():
    # Two hosts of 4 devices: a 1-axis mesh crosses the slow network, so the candidates differ.
    cluster = _cluster(4)
    step = make_mlp_train_step()
    args = mlp_example((1024, 1024, 1024), 512, abstract=True)
    lowered = rj.parallelize(step, mesh=None, axis_names=TWO_AXES, cluster=cluster,
                             donate_argnums=(0, 1)).lower(*args)
    plan = lowered.plan
    cands = plan.mesh_candidates
    assert [c.shape for c in sorted(cands, key=lambda c: c.shape)] == [(2, 4), (4, 2), (8,)]
    totals = [c.cost.total_s for c in cands]
    assert totals == sorted(totals) and cands[0].chosen and not any(c.chosen for c in cands[1:])
    assert plan.cost.total_s == min(totals)
    assert dict(lowered.mesh.shape) == cands[0].mesh_axes
    # Each candidate's figure is what searching its mesh directly predicts.
    for c in cands:
        direct = rj.parallelize(step, mesh=rj.device_mesh(c.shape, c.axis_names), cluster=cluster,
                                donate_argnums=(0, 1)).lower(*args)
        assert direct.plan.cost.total_s == pytest.approx(c.cost.total_s, rel=1e-9)
    report = plan.report()
    assert "mesh candidates (3 searched, 3 feasible" in report
    for label in ("data=8", "data=2 × model=4", "data=4 × model=2"):
        assert label in report
    assert len(json.loads(plan.to_json())["mesh_candidates"]) == 3


def test_pin_on_an_axis_some_candidates_lack_makes_them_infeasible():
    def f(w, x):
        h = rj.annotate(x @ w, P(None, "model"), name="hidden")
        return jnp.sum(jnp.tanh(h) ** 2)

    w, x = jnp.ones((16, 32)) * 0.1, jnp.ones((8, 16))
    parallel = rj.parallelize(jax.grad(f), mesh=None, axis_names=TWO_AXES)
    plan = parallel.lower(w, x).plan
    by_shape = {c.shape: c for c in plan.mesh_candidates}
    assert not by_shape[(8,)].feasible and "no axis 'model'" in by_shape[(8,)].error
    assert by_shape[(2, 4)].feasible and by_shape[(4, 2)].feasible
    assert plan.mesh_candidates[-1].shape == (8,)  # infeasible ones last
    assert "infeasible" in plan.report() and "model" in plan.mesh_axes
    assert_same_numbers(jax.jit(jax.grad(f))(w, x), parallel(w, x))


def test_pin_on_an_axis_no_candidate_has_is_a_clear_error():
    def pinned(x):
        return jnp.sum(rj.annotate(x, P("expert"), name="tokens"))

    def constrained(x):
        return jnp.sum(jax.lax.with_sharding_constraint(x, P("expert")))

    for f in (pinned, constrained):
        with pytest.raises(rj.NoFeasibleMeshError, match="(?s)none of the 4 candidate.*'expert'.*axis_names"):
            rj.parallelize(f, mesh=None).lower(jnp.ones((8, 4)))
    # Naming the axis makes it work.
    plan = rj.parallelize(pinned, mesh=None, axis_names=("expert",)).lower(jnp.ones((8, 4))).plan
    assert plan.mesh_axes == {"expert": 8}


def test_bad_mesh_search_options():
    step = make_mlp_train_step()
    with pytest.raises(rj.MeshError, match="axis_names"):
        rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), axis_names=("data",))
    with pytest.raises(rj.MeshError, match="distinct"):
        rj.parallelize(step, mesh=None, axis_names=("data", "data"))
    with pytest.raises(rj.MeshError, match="non-empty"):
        rj.parallelize(step, mesh=None, devices=[])
    with pytest.raises(ValueError, match="search_workers"):
        rj.parallelize(step, mesh=None, search_workers=-1)


def test_worker_processes_find_the_same_plans():
    step = make_mlp_train_step()
    args = mlp_example((16, 32, 8), 8, abstract=True)
    here = rj.parallelize(step, mesh=None, axis_names=TWO_AXES, search_workers=0).lower(*args).plan
    pooled = rj.parallelize(step, mesh=None, axis_names=TWO_AXES, search_workers=2).lower(*args).plan
    assert [(c.shape, c.cost) for c in pooled.mesh_candidates] == [(c.shape, c.cost) for c in here.mesh_candidates]
    assert pooled.arg_specs == here.arg_specs


def test_solver_warnings_name_the_candidate_mesh(solves_out_of_time):
    step = make_mlp_train_step()
    args = mlp_example((256,) * 9, 64, abstract=True)
    with pytest.warns(rj.SolverTimeLimitWarning, match=r"mesh \[data=8\]: .*gap of"):
        plan = rj.parallelize(step, mesh=None, axis_names=("data",), solver="SCIP").lower(*args).plan
    assert [c.shape for c in plan.mesh_candidates] == [(8,)]
