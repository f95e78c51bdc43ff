"""A scheduled program replayed on a compute stream and a collective stream: async collectives
hidden under the kernels XLA placed between their start and done, synchronous ones exposed, loop
bodies per trip, unscheduled text priced serially."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import rhino_jax as rj
from rhino_jax.errors import UnscheduledProgramWarning
from rhino_jax.runtime.compiled.compiled_cost import collective_seconds, price_compiled
from rhino_jax.runtime.compiled.collectives import collective_stats
from rhino_jax.runtime.compiled.kernels import program_kernels
from rhino_jax.runtime.compiled.timeline import scope, timeline
from rhino_jax.search.cost.cluster import H100_8X
from test_gpu_topology import _plugin_skip

CLUSTER = H100_8X
RATE, BANDWIDTH = CLUSTER.flops("float32"), CLUSTER.memory_bandwidth
GROUP = "channel_id=1, replica_groups=[1,8]<=[8], use_global_device_ids=true"
ADD = ("%add (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n  %b = f32[] parameter(1)\n"
       "  ROOT %s = f32[] add(%a, %b)\n}\n\n")


def _prices(text: str) -> tuple[dict[str, float], dict[str, float]]:
    """Each kernel's and each collective's price per run, as `price_compiled` hands them on."""
    kernels, _ = program_kernels(text)
    kernel_s = {k.name: k.run_seconds(RATE, BANDWIDTH) + CLUSTER.kernel_launch_s for k in kernels}
    comm_s = {c.name: sum(collective_seconds(c, CLUSTER, 8).values()) for c in collective_stats(text).collectives}
    return kernel_s, comm_s


def _replay(text: str):
    return timeline(text, *_prices(text))


def _gemm(m: int, k: int, n: int) -> float:
    """An f32 [m, k] x [k, n] dot at its roofline, with its launch."""
    return max(2 * m * k * n / RATE, (m * k + k * n + m * n) * 4 / BANDWIDTH) + CLUSTER.kernel_launch_s


def _gather(result_bytes: int) -> float:
    """An all-gather over the 8 devices of a host: one ring pass, each step one link latency."""
    return (CLUSTER.collective_launch_s + 7 * CLUSTER.intra_host_latency
            + 7 / 8 * result_bytes / CLUSTER.intra_host_bandwidth)


def _all_reduce(nbytes: int) -> float:
    return (CLUSTER.collective_launch_s + 14 * CLUSTER.intra_host_latency
            + 14 / 8 * nbytes / CLUSTER.intra_host_bandwidth)


def _module(params: str, body: str, scheduled: bool = True, computations: str = "") -> str:
    header = "HloModule m, is_scheduled=true, num_partitions=8" if scheduled else "HloModule m, num_partitions=8"
    lines = "\n".join(f"  {line}" for line in body.strip().splitlines())
    return f"{header}\n\n{ADD}{computations}ENTRY %e ({params}) -> f32[] {{\n{lines}\n}}\n"


def _gather_under_gemm(rows: int, m: int = 2048, scheduled: bool = True) -> str:
    """An all-gather of f32[rows/8, 1024] started before an [m, m] x [m, m] GEMM, done after it."""
    named = 'metadata={op_name="jit(step)/jvp(LM)/Block_0/Dense_0/all_gather"}'
    return _module(f"p: f32[{rows // 8},1024], a: f32[{m},{m}]", f"""
%p = f32[{rows // 8},1024]{{1,0}} parameter(0)
%a = f32[{m},{m}]{{1,0}} parameter(1)
%ags = ((f32[{rows // 8},1024]{{1,0}}), f32[{rows},1024]{{1,0}}) all-gather-start(%p), {GROUP}, dimensions={{0}}, {named}
%d = f32[{m},{m}]{{1,0}} dot(%a, %a), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
%agd = f32[{rows},1024]{{1,0}} all-gather-done(%ags)
ROOT %t = (f32[{rows},1024]{{1,0}}, f32[{m},{m}]{{1,0}}) tuple(%agd, %d)""", scheduled)


def test_an_async_gather_under_a_longer_gemm_is_hidden():
    text = _gather_under_gemm(rows=64)
    (gemm,) = program_kernels(text)[0]
    assert (gemm.flops, gemm.bytes_accessed) == (2 * 2048 ** 3, 3 * 2048 * 2048 * 4)  # the roofline's inputs
    gemm_s, gather_s = _gemm(2048, 2048, 2048), _gather(64 * 1024 * 4)
    assert gemm_s > gather_s
    line = _replay(text)
    assert line.step_s == pytest.approx(gemm_s, rel=1e-12, abs=1e-12)
    assert line.serial_s == pytest.approx(gemm_s + gather_s, rel=1e-12)
    assert line.exposed_comm_s == pytest.approx(0.0, abs=1e-12)
    (c,) = line.collectives
    assert (c.name, c.kind, c.exposed_s) == ("ags", "all-gather", 0.0)
    assert c.comm_s == pytest.approx(gather_s, rel=1e-12)


def test_an_async_gather_longer_than_the_gemm_is_exposed_by_the_difference():
    rows = 8 * 8192
    text = _gather_under_gemm(rows=rows)
    gemm_s, gather_s = _gemm(2048, 2048, 2048), _gather(rows * 1024 * 4)
    assert gather_s > gemm_s
    line = _replay(text)
    assert line.step_s == pytest.approx(gather_s, rel=1e-12)
    assert line.exposed_comm_s == pytest.approx(gather_s - gemm_s, rel=1e-9)
    assert line.collectives[0].exposed_s == pytest.approx(gather_s - gemm_s, rel=1e-9)
    assert line.exposed_by_scope() == {"Block_0/Dense_0": pytest.approx(gather_s - gemm_s, rel=1e-9)}


def test_two_collectives_in_flight_take_the_collective_stream_in_turn():
    """Both gathers start before the GEMM: the second waits for the link, and the GEMM hides
    the first whole and the second in part; the wait is charged to the second."""
    text = _module("p: f32[256,1024], a: f32[2048,2048]", f"""
%p = f32[256,1024]{{1,0}} parameter(0)
%a = f32[2048,2048]{{1,0}} parameter(1)
%g1 = ((f32[256,1024]{{1,0}}), f32[2048,1024]{{1,0}}) all-gather-start(%p), {GROUP}, dimensions={{0}}
%g2 = ((f32[256,1024]{{1,0}}), f32[2048,1024]{{1,0}}) all-gather-start(%p), {GROUP}, dimensions={{0}}
%d = f32[2048,2048]{{1,0}} dot(%a, %a), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
%d1 = f32[2048,1024]{{1,0}} all-gather-done(%g1)
%d2 = f32[2048,1024]{{1,0}} all-gather-done(%g2)
ROOT %t = (f32[2048,1024]{{1,0}}, f32[2048,1024]{{1,0}}, f32[2048,2048]{{1,0}}) tuple(%d1, %d2, %d)""")
    gemm_s, gather_s = _gemm(2048, 2048, 2048), _gather(2048 * 1024 * 4)
    assert gather_s < gemm_s < 2 * gather_s
    line = _replay(text)
    assert line.step_s == pytest.approx(2 * gather_s, rel=1e-12)
    assert {c.name: c.exposed_s for c in line.collectives} == {
        "g2": pytest.approx(2 * gather_s - gemm_s, rel=1e-9), "g1": 0.0}


def test_a_synchronous_all_reduce_between_two_kernels_blocks_both_streams():
    text = _module("p: f32[512,1024]", f"""
%p = f32[512,1024]{{1,0}} parameter(0)
%n = f32[512,1024]{{1,0}} negate(%p)
%ar = f32[512,1024]{{1,0}} all-reduce(%n), {GROUP}, to_apply=%add
ROOT %e2 = f32[512,1024]{{1,0}} exponential(%ar)""")
    kernel_s, comm_s = _prices(text)
    elementwise = 2 * 512 * 1024 * 4 / BANDWIDTH + CLUSTER.kernel_launch_s  # memory-bound: read + write
    assert kernel_s == {"n": pytest.approx(elementwise, rel=1e-12), "e2": pytest.approx(elementwise, rel=1e-12)}
    assert comm_s == {"ar": pytest.approx(_all_reduce(512 * 1024 * 4), rel=1e-12)}
    line = timeline(text, kernel_s, comm_s)
    assert line.step_s == pytest.approx(line.serial_s, rel=1e-12)
    assert line.step_s == pytest.approx(2 * elementwise + _all_reduce(512 * 1024 * 4), rel=1e-12)
    assert line.exposed_comm_s == pytest.approx(comm_s["ar"], rel=1e-9)


_BODY = f"""%body (q: (s32[], f32[512,1024])) -> (s32[], f32[512,1024]) {{
  %q = (s32[], f32[512,1024]{{1,0}}) parameter(0)
  %iq = s32[] get-tuple-element(%q), index=0
  %x = f32[512,1024]{{1,0}} get-tuple-element(%q), index=1
  %one = s32[] constant(1)
  %j = s32[] add(%iq, %one)
  %ars = f32[512,1024]{{1,0}} all-reduce-start(%x), {GROUP}, to_apply=%add
  %y = f32[512,1024]{{1,0}} negate(%x)
  %ard = f32[512,1024]{{1,0}} all-reduce-done(%ars)
  %sum = f32[512,1024]{{1,0}} add(%y, %ard)
  ROOT %t = (s32[], f32[512,1024]{{1,0}}) tuple(%j, %sum)
}}

%cond (p: (s32[], f32[512,1024])) -> pred[] {{
  %c = (s32[], f32[512,1024]{{1,0}}) parameter(0)
  %ic = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%ic, %n), direction=LT
}}

"""


def test_a_loop_body_is_its_own_timeline_run_once_per_trip():
    """4 trips of a body whose all-reduce is partly hidden under a negate; the condition runs 5
    times; the kernel before the loop runs once."""
    text = _module("x0: f32[512,1024]", """
%x0 = f32[512,1024]{1,0} parameter(0)
%e0 = f32[512,1024]{1,0} exponential(%x0)
%z = s32[] constant(0)
%t0 = (s32[], f32[512,1024]{1,0}) tuple(%z, %e0)
%w = (s32[], f32[512,1024]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
ROOT %r = f32[512,1024]{1,0} get-tuple-element(%w), index=1""", computations=_BODY)
    kernel_s, comm_s = _prices(text)
    assert set(kernel_s) == {"e0", "j", "y", "sum", "lt"} and set(comm_s) == {"ars"}
    exposed = comm_s["ars"] - kernel_s["y"]  # started after the counter's add: the negate runs meanwhile
    assert exposed > 0
    body = kernel_s["j"] + kernel_s["y"] + exposed + kernel_s["sum"]
    line = timeline(text, kernel_s, comm_s)
    assert line.step_s == pytest.approx(kernel_s["e0"] + 4 * body + 5 * kernel_s["lt"], rel=1e-12)
    assert line.exposed_comm_s == pytest.approx(4 * exposed, rel=1e-9)
    (c,) = line.collectives
    assert c.comm_s == pytest.approx(4 * comm_s["ars"], rel=1e-12)
    assert c.exposed_s == pytest.approx(4 * exposed, rel=1e-9)
    assert line.compute_s == pytest.approx(kernel_s["e0"] + 4 * (body - exposed) + 5 * kernel_s["lt"], rel=1e-12)


def test_a_communicating_loop_waits_for_the_collective_in_flight_around_it():
    """An all-gather started before the loop and done after it: the loop's own all-reduces need
    the link, so the loop begins when the gather ends."""
    gather = (f"%ags = ((f32[1024,1024]{{1,0}}), f32[8192,1024]{{1,0}}) all-gather-start(%g), {GROUP}, "
              "dimensions={0}")
    text = _module("x0: f32[512,1024], g: f32[1024,1024]", f"""
%x0 = f32[512,1024]{{1,0}} parameter(0)
%g = f32[1024,1024]{{1,0}} parameter(1)
{gather}
%z = s32[] constant(0)
%t0 = (s32[], f32[512,1024]{{1,0}}) tuple(%z, %x0)
%w = (s32[], f32[512,1024]{{1,0}}) while(%t0), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"4"}}}}
%agd = f32[8192,1024]{{1,0}} all-gather-done(%ags)
ROOT %r = f32[512,1024]{{1,0}} get-tuple-element(%w), index=1""", computations=_BODY)
    kernel_s, comm_s = _prices(text)
    alone = timeline(text.replace(gather, "").replace("%agd = f32[8192,1024]{1,0} all-gather-done(%ags)\n", ""),
                     kernel_s, comm_s)
    line = timeline(text, kernel_s, comm_s)
    assert line.step_s == pytest.approx(comm_s["ags"] + alone.step_s, rel=1e-12)
    assert {c.name: c.exposed_s for c in line.collectives}["ags"] == pytest.approx(comm_s["ags"], rel=1e-12)


def test_an_unscheduled_module_is_priced_serially_with_a_warning():
    text = _gather_under_gemm(rows=64, scheduled=False)
    with pytest.warns(UnscheduledProgramWarning, match="no schedule"):
        line = _replay(text)
    assert not line.scheduled
    assert line.step_s == pytest.approx(_gemm(2048, 2048, 2048) + _gather(64 * 1024 * 4), rel=1e-12)
    assert line.step_s == pytest.approx(line.serial_s, rel=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _replay(_gather_under_gemm(rows=64)).scheduled


def test_a_scope_is_the_module_path_of_an_op_name():
    assert scope("jit(step)/transpose(jvp(LM))/Block_0/Dense_1/dot_general") == "Block_0/Dense_1"
    assert scope("w1") == "" and scope("") == ""


def _fsdp_two_matmuls(devices):
    """An SGD step of two [1024, 1024] matmuls, weights and batch split over 8 devices (FSDP)."""
    mesh = Mesh(np.array(devices), ("d",))

    def step(w1, w2, x):
        g1, g2 = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w[0]) @ w[1]))((w1, w2))
        return w1 - 0.1 * g1, w2 - 0.1 * g2

    split = NamedSharding(mesh, P("d"))
    shapes = ((1024, 1024), (1024, 1024), (2048, 1024))
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=split) for s in shapes]
    return jax.jit(step, out_shardings=(split, split)).lower(*args).compile()


def test_a_cpu_compile_has_synchronous_collectives_only_its_timeline_is_the_serial_sum():
    cost = price_compiled(_fsdp_two_matmuls(jax.devices()[:8]), CLUSTER)
    assert sum(n for n, _ in cost.collectives.values()) >= 2
    assert cost.overlapped_s == pytest.approx(cost.total_s, rel=1e-12)
    assert cost.exposed_comm_s == pytest.approx(cost.comm_s, rel=1e-9)


@pytest.mark.skipif(_plugin_skip() is not None, reason=_plugin_skip() or "")
def test_a_gpu_compiles_async_collectives_overlap_its_kernels():
    compiled = _fsdp_two_matmuls(rj.gpu_topology("h100"))
    assert "all-gather-start" in compiled.as_text() and "reduce-scatter-start" in compiled.as_text()
    cost = price_compiled(compiled, CLUSTER)
    assert max(cost.compute_s, cost.comm_s) <= cost.overlapped_s < cost.total_s
    assert cost.overlapped_s - cost.compute_s == pytest.approx(cost.exposed_comm_s, rel=1e-12)
    assert sum(c.exposed_s for c in cost.exposure) == pytest.approx(cost.exposed_comm_s, rel=1e-9)
    assert sum(c.comm_s for c in cost.exposure) == pytest.approx(cost.comm_s, rel=1e-12)
    assert cost.to_dict()["exposure"][0]["exposed_s"] == cost.exposure[0].exposed_s
