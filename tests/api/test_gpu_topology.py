"""Described GPU clusters (`rj.gpu_topology`): planned, compiled and priced for GPUs without one.

Needs jax's CUDA plugin (the test extra installs it on Python >= 3.12, where jax 0.11 and newer
run); the plugin compiles for the devices it is told about, no GPU or CUDA toolkit needed.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import rhino_jax as rj
from rhino_jax.runtime.compiled.compiled_cost import price_compiled, xla_cost_analysis
from rhino_jax.models.mlp import make_mlp_train_step, mlp_example
from rhino_jax.core.plan_target import PlanTargetError
from rhino_jax.search.cost.cluster import H100_8X, MeshTopology, get_cluster, host_ids

from helpers import _plugin_skip


pytestmark = pytest.mark.skipif(_plugin_skip() is not None, reason=_plugin_skip() or "")

WIDTHS = (64, 128, 64)


def _mlp():
    return make_mlp_train_step(), mlp_example(WIDTHS, 16, abstract=True)


def test_described_hosts_are_the_topologys_processes():
    devices = rj.gpu_topology("h100", hosts=2, devices_per_host=8)
    assert [d.process_index for d in devices] == [0] * 8 + [1] * 8
    assert {d.device_kind for d in devices} == {"NVIDIA H100 80GB HBM3"} and devices[0].platform == "gpu"
    assert host_ids(devices, devices_per_host=4) == [0] * 8 + [1] * 8  # the topology's, not the preset's
    topo = MeshTopology.from_mesh(rj.device_mesh((2, 8), ("data", "model"), devices=devices), H100_8X)
    assert topo.hosts_spanned == (2, 1)  # the outer axis crosses hosts, the inner one stays inside
    assert topo.bandwidth == (H100_8X.inter_host_bandwidth, H100_8X.intra_host_bandwidth)


@pytest.mark.parametrize("kind, preset", [("h100", "8x-h100"), ("h200", "8x-h200"), ("a100", "8x-a100")])
def test_each_gpu_kind_is_priced_by_its_preset_unless_told(kind, preset):
    devices = rj.gpu_topology(kind, devices_per_host=2)
    assert get_cluster(None, devices).name == preset
    assert get_cluster("m8-v100", devices).name == "m8-v100"
    assert get_cluster(None, jax.devices()).name == "m8-v100"  # CPU devices: the default preset


@pytest.mark.parametrize("call, message", [
    (lambda: rj.gpu_topology("v100"), r"unknown GPU kind 'v100'; described GPUs are \['a100', 'h100', 'h200'\]"),
    (lambda: rj.gpu_topology("h100", hosts=0), "hosts must be a positive int, got 0"),
    (lambda: rj.device_mesh((4, 8), ("data", "model"), devices=rj.gpu_topology("h100", hosts=2)),
     r"mesh shape \(4, 8\) needs 32 devices but 16 are given"),
])
def test_bad_topologies_say_what_to_change(call, message):
    with pytest.raises((ValueError, rj.MeshError), match=message):
        call()


def test_a_topology_of_more_hosts_than_the_cluster_is_refused():
    mesh = rj.device_mesh((4, 8), ("data", "model"), devices=rj.gpu_topology("h100", hosts=4))
    step, args = _mlp()
    with pytest.raises(ValueError, match="lie on 4 hosts of 8, but cluster '8x-h100-2hosts' has 2"):
        rj.parallelize(step, mesh=mesh, cluster="8x-h100-2hosts").lower(*args)


def test_a_described_step_compiles_and_is_analysed_but_not_called():
    step, args = _mlp()
    mesh = rj.device_mesh((2, 4), ("data", "model"), devices=rj.gpu_topology("h100"))
    parallel = rj.parallelize(step, mesh=mesh)
    lowered = parallel.lower(*args)
    assert lowered.plan.cluster == "8x-h100"
    compiled = lowered.compile()
    assert {d.device_kind for s in jax.tree.leaves(compiled.input_shardings) for d in s.device_set} == {
        "NVIDIA H100 80GB HBM3"}
    cost = compiled.cost_analysis()  # jax gives None for described devices: XLA's generic analysis
    batch, (d0, d1, d2) = 16, WIDTHS
    dense = 2 * batch * (d0 * d1 + d1 * d2)  # forward FLOPs of the MLP's two matmuls, whole batch
    assert dense * 3 / 8 <= cost["flops"] <= dense * 3 * 1.5  # at least the plan's share, at most all
    assert compiled.memory_analysis().argument_size_in_bytes > 0
    assert "as XLA's gpu backend combines it" in compiled.report()
    assert price_compiled(compiled, "8x-h100").compute_s > 0
    data = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), args)
    for call in (lambda: parallel(*data), lambda: compiled(*data)):
        with pytest.raises(rj.DescribedDeviceError, match=r"compiled for described devices \(8 x NVIDIA H100.*"
                                                          r"save the plan .* plan='plan.json'"):
            call()


def test_a_hand_plan_with_async_collectives_is_priced():
    """GPU XLA prints an async all-reduce's start with `output_to_operand_aliasing`, which XLA's
    HLO parser refuses there: the analysis parses the text without it."""
    step, args = _mlp()
    mesh = Mesh(np.array(rj.gpu_topology("h100")), ("data",), axis_types=(AxisType.Auto,))
    shard = lambda spec: jax.tree.map(lambda _: NamedSharding(mesh, spec), args[:2])  # noqa: E731
    compiled = jax.jit(step, in_shardings=(*shard(P()), NamedSharding(mesh, P("data"))),
                       out_shardings=(*shard(P()), NamedSharding(mesh, P()))).lower(*args).compile()
    assert "output_to_operand_aliasing" in compiled.as_text()
    cost = price_compiled(compiled, "8x-h100")
    assert cost.collectives["all-reduce"][0] >= 1 and cost.compute_s > 0


def test_a_described_micro_batched_step_is_not_called():
    step, args = _mlp()
    mesh = rj.device_mesh((8,), ("data",), devices=rj.gpu_topology("a100"))
    compiled = rj.parallelize(step, mesh=mesh, num_micro_batches=2).lower(*args).compile()
    with pytest.raises(rj.DescribedDeviceError, match="8 x NVIDIA A100-SXM4-80GB"):
        compiled(*jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), args))


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_compile_hands_xlas_options_to_every_program(micro_batches):
    """`compile(compiler_options=...)` as jax's `Lowered.compile`, for the step's one program or
    each of a micro-batched step's: with Triton GEMMs off the GEMMs (in the step, or in
    compute-gradients) are cuBLAS calls; an unknown option is XLA's error; without options the
    step compiles once, as before."""
    step, args = _mlp()
    mesh = rj.device_mesh((8,), ("data",), devices=rj.gpu_topology("h100"))
    lowered = rj.parallelize(step, mesh=mesh, num_micro_batches=micro_batches).lower(*args)

    def texts(compiled) -> list[str]:
        return [p.as_text() for p in getattr(compiled, "programs", {"": compiled}).values()]

    assert lowered.compile() is lowered.compile()
    assert not any("__cublas" in t for t in texts(lowered.compile()))
    library = lowered.compile(compiler_options={"xla_gpu_enable_triton_gemm": False})
    assert library is not lowered.compile()
    assert 'custom_call_target="__cublas' in texts(library)[0]  # the step, or its compute-gradients
    with pytest.raises(Exception, match="No such compile option: 'xla_no_such_option'"):
        lowered.compile(compiler_options={"xla_no_such_option": True})


def test_a_pipeline_over_two_described_hosts_prices_its_moves_between_them():
    """Stage moves are planned over the hosts the described devices' processes are (device ids
    past those of this machine's backend once raised KeyError)."""
    step, args = make_mlp_train_step(), mlp_example((64, 128, 128, 128, 64), 16, abstract=True)
    mesh = rj.device_mesh((2, 8), ("stage", "data"), devices=rj.gpu_topology("h100", hosts=2))
    plan = rj.parallelize(step, mesh=mesh, pipeline=2, num_micro_batches=2).lower(*args).plan
    assert [set(st.devices) for st in plan.stages] == [set(range(8)), set(range(8, 16))]
    assert plan.cost.total_s > plan.stages[0].forward_s + plan.stages[1].forward_s


def test_a_plan_for_a_described_cluster_runs_on_one_of_the_same_shape(tmp_path):
    """Device ids are not compared, the mesh, platform and process layout are: another topology of
    the same shape (a real cluster's devices, here another description) takes the plan."""
    step, args = _mlp()
    made = rj.device_mesh((2, 8), ("data", "model"), devices=rj.gpu_topology("h100", hosts=2))
    rj.parallelize(step, mesh=made).lower(*args).plan.save(tmp_path / "plan.json")
    same = rj.device_mesh((2, 8), ("data", "model"), devices=rj.gpu_topology("h100", hosts=2))
    loaded = rj.parallelize(step, mesh=same, plan=tmp_path / "plan.json").lower(*args)
    assert loaded.compile().collectives.count() >= 0
    one_host = rj.device_mesh((2, 8), ("data", "model"), devices=rj.gpu_topology("h100", devices_per_host=16))
    with pytest.raises(PlanTargetError, match=r"processes \[0 x8, 1 x8\] \(row-major\) and is applied to one of "
                                              r"\[0 x16\]"):
        rj.parallelize(step, mesh=one_host, plan=tmp_path / "plan.json").lower(*args)
    cpu = rj.device_mesh((8,), ("data",))
    plan = rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",), devices=rj.gpu_topology("h100"))).lower(*args).plan
    with pytest.raises(PlanTargetError, match="made for gpu devices and is applied to cpu devices"):
        plan.check_matches(dataclasses.replace(rj.parallelize(step, mesh=cpu).lower(*args).plan.target))


def test_an_abstract_mesh_is_planned_on_described_gpus_of_the_clusters_kind(tmp_path):
    """An AbstractMesh names sizes and axes, no devices: with a cluster of a described GPU kind it
    is planned on that many described GPUs in hosts of the cluster's size, and the saved plan
    runs on a cluster of that shape (here another description of it)."""
    from jax.sharding import AbstractMesh

    step, args = _mlp()
    abstract = AbstractMesh((4, 8), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    lowered = rj.parallelize(step, mesh=abstract, cluster="8x-h200").lower(*args)
    devices = list(lowered.mesh.devices.flat)
    assert lowered.mesh.shape == {"data": 4, "model": 8}
    assert {d.device_kind for d in devices} == {"NVIDIA H200"}
    assert [d.process_index for d in devices] == [h for h in range(4) for _ in range(8)]
    assert lowered.plan.cluster == "8x-h200" and lowered.compile().collectives.count() >= 0
    lowered.plan.save(tmp_path / "plan.json")
    cluster = rj.device_mesh((4, 8), ("data", "model"), devices=rj.gpu_topology("h200", hosts=4))
    rj.parallelize(step, mesh=cluster, plan=tmp_path / "plan.json").lower(*args)


@pytest.mark.parametrize("cluster, message", [
    (None, r"an AbstractMesh \({'data': 2, 'model': 8}\) names no devices: pass the cluster it stands for"),
    ("m8-v100", r"cluster 'm8-v100' names none \(Cluster.gpu=''"),
])
def test_an_abstract_mesh_needs_a_cluster_of_described_gpus(cluster, message):
    from jax.sharding import AbstractMesh

    step, _ = _mlp()
    with pytest.raises(rj.MeshError, match=message):
        rj.parallelize(step, mesh=AbstractMesh((2, 8), ("data", "model")), cluster=cluster)


def test_an_abstract_mesh_must_fill_the_clusters_hosts():
    from jax.sharding import AbstractMesh

    step, _ = _mlp()
    with pytest.raises(rj.MeshError, match="of 12 devices does not fill hosts of 8"):
        rj.parallelize(step, mesh=AbstractMesh((3, 4), ("data", "model")), cluster="8x-h100")


def test_a_programs_cublas_gemms_are_counted():
    """A real H200's compiler sent some GEMMs of a Llama step to cuBLAS (benchmarks/results/h200/gpu.md), whose
    FLOPs XLA's generic analysis does not count; 2 x output x contracted elements are added."""
    def loss(a, b):
        return jnp.sum(jnp.tanh(jnp.einsum("bij,bjk->bik", a, b)))

    mesh = Mesh(np.array(rj.gpu_topology("h100", devices_per_host=1)), ("d",), axis_types=(AxisType.Auto,))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1)), in_shardings=NamedSharding(mesh, P())).lower(
        jax.ShapeDtypeStruct((4, 256, 512), jnp.float32), jax.ShapeDtypeStruct((4, 512, 128), jnp.float32)
    ).compile(compiler_options={"xla_gpu_enable_triton_gemm": False})  # every GEMM a library call
    assert compiled.as_text().count('custom_call_target="__cublas') == 3
    gemms = 3 * 2 * 4 * 256 * 512 * 128  # forward and two gradients, each 2 x out x contracted
    assert gemms <= xla_cost_analysis(compiled)["flops"] <= 1.01 * gemms
    assert gemms <= price_compiled(compiled, "8x-h100").flops <= 1.01 * gemms


def test_a_described_programs_cudnn_convolutions_are_counted():
    """GPU XLA compiles convolutions to cuDNN calls, which XLA's generic analysis does not count:
    their FLOPs (forward, backward input as a forward convolution, backward filter) are added."""
    def loss(w, x):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                         feature_group_count=2)
        return jnp.sum(jnp.tanh(y) ** 2)

    mesh = Mesh(np.array(rj.gpu_topology("h100", devices_per_host=1)), ("d",), axis_types=(AxisType.Auto,))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1)), in_shardings=NamedSharding(mesh, P())).lower(
        jax.ShapeDtypeStruct((3, 3, 32, 64), jnp.float32), jax.ShapeDtypeStruct((8, 16, 16, 64), jnp.float32)).compile()
    assert "__cudnn$conv" in compiled.as_text()
    convolutions = 3 * 2 * (8 * 16 * 16 * 64) * (3 * 3 * 32)  # three of them, each 2 x out x kernel / out features
    assert convolutions <= xla_cost_analysis(compiled)["flops"] <= 1.01 * convolutions
    assert convolutions <= price_compiled(compiled, "8x-h100").flops <= 1.01 * convolutions
