"""Pricing compiled programs: XLA's FLOPs per device, loops per trip, collectives at α-β cost."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rhino_jax.runtime.compiled.compiled_cost import dot_dtype, price_compiled, program_device
from rhino_jax.runtime.compiled.collectives import collective_stats
from rhino_jax.runtime.compiled.kernels import program_kernels
from rhino_jax.search.cost.cluster import H100_8X, M8_V100

M, K, N = 64, 32, 16


def _mesh(shape, names) -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), names)


def _compile(f, mesh, in_specs, out_spec, *shapes, dtype=jnp.float32):
    ins = tuple(NamedSharding(mesh, s) for s in in_specs)
    args = [jax.ShapeDtypeStruct(s, dtype, sharding=sh) for s, sh in zip(shapes, ins)]
    return jax.jit(f, in_shardings=ins, out_shardings=NamedSharding(mesh, out_spec)).lower(*args).compile()


def _grad_w(w, x):
    return jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)


def _ring(n, nbytes, bw, lat, launch, factor):
    """The α-β ring time written out: factor 2 for all-reduce, 1 for gathers and scatters."""
    steps = factor * (n - 1)
    return launch + steps / n * nbytes / bw + steps * lat


def test_data_parallel_gradient_is_one_all_reduce_at_ring_cost():
    mesh = _mesh((8,), ("d",))
    compiled = _compile(_grad_w, mesh, (P(), P("d")), P(), (K, N), (M, K))
    cost = price_compiled(compiled, M8_V100)
    assert cost.collectives["all-reduce"] == (1, K * N * 4)
    assert sum(n for n, _ in cost.collectives.values()) == 1
    want = _ring(8, K * N * 4, M8_V100.intra_host_bandwidth, M8_V100.intra_host_latency,
                 M8_V100.collective_launch_s, 2)
    assert cost.comm_s == pytest.approx(want, rel=1e-12)
    assert cost.total_s == pytest.approx(cost.compute_s + cost.comm_s)


def test_groups_beyond_a_host_take_the_inter_host_link():
    cluster = dataclasses.replace(M8_V100, devices_per_host=4)
    mesh = _mesh((2, 4), ("data", "model"))
    # Both axes split the batch: the gradient's all-reduce spans all 8 devices, 2 hosts.
    across = price_compiled(_compile(_grad_w, mesh, (P(), P(("data", "model"))), P(), (K, N), (M, K)), cluster)
    assert across.collectives["all-reduce"] == (1, K * N * 4)
    assert across.comm_s == pytest.approx(_ring(8, K * N * 4, cluster.inter_host_bandwidth,
                                                cluster.inter_host_latency, cluster.collective_launch_s, 2))
    # Only 'model' splits it: groups of 4 inside a host.
    inside = price_compiled(_compile(_grad_w, mesh, (P(), P("model")), P(), (K, N), (M, K)), cluster)
    assert inside.collectives["all-reduce"] == (1, K * N * 4)
    assert inside.comm_s == pytest.approx(_ring(4, K * N * 4, cluster.intra_host_bandwidth,
                                                cluster.intra_host_latency, cluster.collective_launch_s, 2))


def test_strided_groups_of_an_outer_axis_cross_hosts_and_share_them():
    """Only 'data' splits the batch on (2, 4) with hosts of 4: groups of 2 devices, {i, i + 4},
    each one on two hosts. Read by size alone they would fit in a host; read by members they
    cross, and the 4 groups share each host's network."""
    cluster = dataclasses.replace(M8_V100, devices_per_host=4)
    mesh = _mesh((2, 4), ("data", "model"))
    cost = price_compiled(_compile(_grad_w, mesh, (P(), P("data")), P(), (K, N), (M, K)), cluster)
    assert cost.collectives["all-reduce"] == (1, K * N * 4)
    assert cost.comm_s == pytest.approx(_ring(2, K * N * 4, cluster.inter_host_bandwidth / 4,
                                              cluster.inter_host_latency, cluster.collective_launch_s, 2))


def test_all_gather_is_priced_one_ring_pass():
    mesh = _mesh((8,), ("d",))
    compiled = _compile(lambda x: x * 2.0, mesh, (P("d"),), P(), (M, K))
    cost = price_compiled(compiled, "8x-h100")
    n_ops, nbytes = cost.collectives["all-gather"]
    assert nbytes == M * K * 4 and n_ops == 1
    one = _ring(8, M * K * 4, H100_8X.intra_host_bandwidth, H100_8X.intra_host_latency,
                H100_8X.collective_launch_s, 1)
    assert cost.comm_s == pytest.approx(one)


def test_matmul_without_collectives_costs_its_flops_and_no_communication():
    compiled = jax.jit(lambda a, b: a @ b).lower(jnp.ones((M, K)), jnp.ones((K, N))).compile()
    cost = price_compiled(compiled, M8_V100)
    assert cost.flops == 2 * M * N * K
    assert cost.comm_s == 0.0 and all(n == 0 for n, _ in cost.collectives.values())
    assert cost.compute_s == max(cost.flops / M8_V100.flops("float32"),
                                 cost.bytes_accessed / M8_V100.memory_bandwidth)
    assert cost.memory.argument_bytes == (M * K + K * N) * 4


def test_flops_are_per_device():
    mesh = _mesh((8,), ("d",))
    compiled = _compile(lambda a, b: a @ b, mesh, (P("d"), P()), P("d"), (M, K), (K, N))
    assert price_compiled(compiled).flops == 2 * M * N * K / 8


def test_the_programs_device_comes_from_its_arguments_not_the_default_backend():
    """Pricing asks XLA's analysis of the program's own backend (a CPU program on a GPU machine is
    still read as CPU): the device is taken from the arguments' shardings."""
    upper = Mesh(np.array(jax.devices()[4:8]), ("d",))
    compiled = _compile(lambda a, b: a @ b, upper, (P("d"), P()), P("d"), (M, K), (K, N))
    assert program_device(compiled) == jax.devices()[4]
    assert program_device(jax.jit(lambda: jnp.ones(3)).lower().compile()) == jax.devices()[0]


def test_loop_bodies_count_once_per_trip_nested_too():
    w = jnp.ones((K, K))

    def inner(y):
        return jax.lax.fori_loop(0, 3, lambda j, y: jnp.tanh(y @ w), y)

    one = jax.jit(lambda x: jnp.tanh(x @ w)).lower(jnp.ones((M, K))).compile()
    single = price_compiled(one).flops
    assert single >= 2 * M * K * K
    looped = jax.jit(lambda x: jax.lax.fori_loop(0, 5, lambda i, x: inner(x), x)).lower(jnp.ones((M, K))).compile()
    assert jax.tree.leaves(looped.cost_analysis())  # XLA itself counts each body once
    cost = price_compiled(looped)
    assert cost.unknown_trip_loops == 0
    # 15 matmuls + tanh; the loop counters add a few integer ops per trip.
    assert 15 * single <= cost.flops <= 15 * single + 64


def test_each_kernel_is_priced_at_its_own_roofline():
    """A compute-bound matmul beside a memory-bound update of another array: the step pays the
    matmul's FLOPs and then the update's bytes (the kernels run one after the other), not one
    roofline over the program's totals, under which the update would be free."""
    n, big = 512, 1 << 24
    compiled = jax.jit(lambda a, b, v: (a @ b, v * 2.0 + 1.0)).lower(
        jax.ShapeDtypeStruct((n, n), jnp.float32), jax.ShapeDtypeStruct((n, n), jnp.float32),
        jax.ShapeDtypeStruct((big,), jnp.float32)).compile()
    cost = price_compiled(compiled, M8_V100)
    rate, bandwidth = M8_V100.flops("float32"), M8_V100.memory_bandwidth
    matmul, update = 2 * n ** 3 / rate, 2 * big * 4 / bandwidth
    assert matmul > 3 * n * n * 4 / bandwidth and update > 2 * big / rate  # one bound by each
    assert cost.compute_s == pytest.approx(matmul + update, rel=0.02)
    assert cost.compute_s > 1.05 * max(cost.flops / rate, cost.bytes_accessed / bandwidth)


def test_each_kernel_run_pays_the_clusters_launch_time():
    """Chains of n tiny kernels (a barrier ends each fusion), as benchmarks.gpu times them: each
    kernel run costs the cluster's kernel_launch_s on top of its roofline, loop trips counted."""
    def chain(x):
        for _ in range(5):
            x = jax.lax.optimization_barrier(jnp.sin(x) * 0.5)
        return jax.lax.fori_loop(0, 3, lambda i, c: jax.lax.optimization_barrier(jnp.cos(c) * 0.5), x)

    compiled = jax.jit(chain).lower(jax.ShapeDtypeStruct((64,), jnp.float32)).compile()
    free = price_compiled(compiled, M8_V100)
    launched = price_compiled(compiled, dataclasses.replace(M8_V100, kernel_launch_s=1e-3))
    assert free.kernel_runs == launched.kernel_runs >= 5 + 3
    assert launched.compute_s - free.compute_s == pytest.approx(launched.kernel_runs * 1e-3)
    assert launched.comm_s == free.comm_s


def test_dtype_picks_the_flop_rate():
    f = lambda a, b: a @ b  # noqa: E731
    compiled = jax.jit(f).lower(jnp.ones((256, 256)), jnp.ones((256, 256))).compile()
    assert dot_dtype(compiled.as_text()) == "float32"
    cluster = dataclasses.replace(M8_V100, flops_per_s={"float32": 1e9, "bfloat16": 4e9}, memory_bandwidth=1e15)
    f32 = price_compiled(compiled, cluster)
    bf16 = price_compiled(compiled, cluster, dtype="bfloat16")
    assert f32.dtype == "float32" and bf16.dtype == "bfloat16"
    assert f32.compute_s == pytest.approx(4 * bf16.compute_s)


def test_unknown_cluster_is_a_clear_error():
    compiled = jax.jit(lambda a: a + 1).lower(jnp.ones(4)).compile()
    with pytest.raises(ValueError, match="unknown cluster preset 'v100'"):
        price_compiled(compiled, "v100")


def test_collectives_in_a_loop_are_priced_per_trip():
    mesh = _mesh((8,), ("d",))

    def f(x):  # each trip reduces the sharded x against the carry: an all-reduce XLA cannot hoist
        return jax.lax.fori_loop(0, 3, lambda i, c: c + jnp.sum(jnp.sin(x * c)), jnp.float32(1.0))

    cost = price_compiled(_compile(f, mesh, (P("d"),), P(), (M,)), M8_V100)
    assert cost.collectives["all-reduce"] == (3, 3 * 4)
    one = _ring(8, 4, M8_V100.intra_host_bandwidth, M8_V100.intra_host_latency, M8_V100.collective_launch_s, 2)
    assert cost.comm_s == pytest.approx(3 * one)


def test_a_gradient_read_in_slices_is_priced_as_the_reduce_scatter_a_gpu_makes_of_it():
    """FSDP's gradient: the partitioner writes all-reduce + dynamic-slice (fused with the update
    on CPU); GPU XLA runs the pair as a reduce-scatter, half the ring traffic. Priced for a GPU
    cluster it is one; for a CPU cluster it stays the all-reduce the CPU runs. A gradient read
    whole (data parallel) stays an all-reduce for both."""
    mesh = _mesh((8,), ("d",))

    def sgd(w, x):
        return w - 0.1 * _grad_w(w, x)

    fsdp = _compile(sgd, mesh, (P("d"), P("d")), P("d"), (K, N), (M, K))
    (ar,) = [c for c in collective_stats(fsdp.as_text()).collectives if c.kind == "all-reduce"]
    assert ar.scattered == ar.bytes == K * N * 4
    want = _ring(8, K * N * 4, M8_V100.intra_host_bandwidth, M8_V100.intra_host_latency,
                 M8_V100.collective_launch_s, 1)
    assert price_compiled(fsdp, M8_V100).comm_by_kind["reduce-scatter"] == pytest.approx(want, rel=1e-12)
    assert price_compiled(fsdp, M8_V100).comm_by_kind["all-reduce"] == 0.0
    on_cpu = price_compiled(fsdp, dataclasses.replace(M8_V100, backend="cpu"))
    assert on_cpu.comm_by_kind["all-reduce"] == pytest.approx(
        _ring(8, K * N * 4, M8_V100.intra_host_bandwidth, M8_V100.intra_host_latency, M8_V100.collective_launch_s, 2))
    dp = _compile(sgd, mesh, (P(), P("d")), P(), (K, N), (M, K))
    assert [c.scattered for c in collective_stats(dp.as_text()).collectives] == [0]
    assert price_compiled(dp, M8_V100).comm_by_kind["reduce-scatter"] == 0.0


def test_a_gathers_buffers_are_priced_as_communication_not_as_memory_traffic():
    """XLA's CPU cost analysis counts the all-gather's operand and result as bytes accessed; the
    ring prices them already, so the program of one all-gather reads and writes nothing else."""
    mesh = _mesh((8,), ("d",))
    compiled = _compile(lambda x: x, mesh, (P("d"),), P(), (M, K))
    cost = price_compiled(compiled, M8_V100)
    assert cost.collectives["all-gather"][0] == 1 and cost.comm_s > 0
    assert cost.bytes_accessed == 0.0 and cost.compute_s == 0.0


_ADD = ("%add (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n  %b = f32[] parameter(1)\n"
        "  ROOT %s = f32[] add(%a, %b)\n}\n\n")
_GROUP = "channel_id=1, replica_groups=[1,8]<=[8], use_global_device_ids=true"
_ONE_COLLECTIVE = {  # kind -> (operand, result, op)
    "all-reduce": ("f32[64,32]", "f32[64,32]", f"all-reduce(%p), {_GROUP}, to_apply=%add"),
    "all-gather": ("f32[8,32]", "f32[64,32]", f"all-gather(%p), {_GROUP}, dimensions={{0}}"),
    "reduce-scatter": ("f32[64,32]", "f32[8,32]", f"reduce-scatter(%p), {_GROUP}, dimensions={{0}}, to_apply=%add"),
    "all-to-all": ("f32[64,32]", "f32[64,32]", "all-to-all(%p), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}"),
    "collective-permute": ("f32[64,32]", "f32[64,32]", "collective-permute(%p), channel_id=1, "
                           "source_target_pairs={{0,1},{1,2},{2,3},{3,4},{4,5},{5,6},{6,7},{7,0}}"),
}


@pytest.mark.parametrize("kind", sorted(_ONE_COLLECTIVE))
def test_no_collective_kind_is_priced_as_a_kernel(kind):
    """Communication prices the collectives; as kernels their buffers would be paid twice."""
    operand, result, op = _ONE_COLLECTIVE[kind]
    text = (f"HloModule m, num_partitions=8\n\n{_ADD}ENTRY %e (p: {operand}) -> {result} {{\n"
            f"  %p = {operand}{{1,0}} parameter(0)\n  ROOT %c = {result}{{1,0}} {op}\n}}\n")
    (c,) = collective_stats(text).collectives
    assert c.kind == kind
    assert program_kernels(text)[0] == ()


def _loop(op: str) -> str:
    """A 4-trip while loop whose body runs `op` on its f32[64,32] carry."""
    return f"""HloModule m, num_partitions=8

{_ADD}%cond (p: (s32[], f32[64,32])) -> pred[] {{
  %p = (s32[], f32[64,32]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}}

%body (q: (s32[], f32[64,32])) -> (s32[], f32[64,32]) {{
  %q = (s32[], f32[64,32]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%q), index=0
  %x = f32[64,32]{{1,0}} get-tuple-element(%q), index=1
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  %y = f32[64,32]{{1,0}} {op}
  ROOT %t = (s32[], f32[64,32]{{1,0}}) tuple(%j, %y)
}}

ENTRY %e (x0: f32[64,32]) -> f32[64,32] {{
  %x0 = f32[64,32]{{1,0}} parameter(0)
  %z = s32[] constant(0)
  %t0 = (s32[], f32[64,32]{{1,0}}) tuple(%z, %x0)
  %w = (s32[], f32[64,32]{{1,0}}) while(%t0), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"4"}}}}
  ROOT %r = f32[64,32]{{1,0}} get-tuple-element(%w), index=1
}}
"""


def test_a_loop_bodys_kernels_run_once_per_trip_and_its_collectives_are_none_of_them():
    """The negate in a 4-trip body is a kernel run 4 times, reading and writing its buffer each
    time; an all-reduce in its place is no kernel; the counter's add runs in both."""
    negated = {k.opcode: k for k in program_kernels(_loop("negate(%x)"))[0]}
    reduced = {k.opcode: k for k in program_kernels(_loop(f"all-reduce(%x), {_GROUP}, to_apply=%add"))[0]}
    assert negated["negate"].runs == 4 and negated["negate"].bytes_accessed == 2 * 64 * 32 * 4
    assert set(negated) - set(reduced) == {"negate"}
    assert reduced["add"].runs == 4 and reduced["compare"].runs == 5  # the condition runs once more
