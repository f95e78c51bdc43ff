"""Checks for the compiled-HLO collective parser, on real 8-device CPU programs and on text.

Real programs pin the parser to what this jax/XLA version prints; synthetic text covers forms
the CPU backend never emits (async pairs, iota replica groups, inline operand shapes).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rhino_jax.runtime.compiled.collectives import (COLLECTIVE_KINDS, CollectiveStats, CompiledCollective,
                                                    collective_stats, computation_runs)
from rhino_jax.runtime.compiled.hlo_text import CompiledLoop
from rhino_jax.runtime.compiled.memory import CompiledMemory, compiled_memory

F32 = jnp.float32


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    assert len(jax.devices()) >= 8, "tests/conftest.py sets 8 emulated CPU devices"
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


def _compile(mesh: Mesh, f, in_specs, out_specs, *shapes, dtype=F32, **jit_kwargs):
    """Compile `f` for abstract inputs (no device buffers needed) with the given specs."""
    in_sh = tuple(NamedSharding(mesh, s) for s in in_specs)
    out_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), out_specs,
                          is_leaf=lambda s: isinstance(s, P))
    args = [jax.ShapeDtypeStruct(s, dtype, sharding=sh) for s, sh in zip(shapes, in_sh)]
    jitted = jax.jit(f, in_shardings=in_sh, out_shardings=out_sh, **jit_kwargs)
    return jitted.lower(*args).compile()


def _stats(compiled) -> CollectiveStats:
    return collective_stats(compiled.as_text())


# ----------------------------------------------------------------------------------------------
# Real programs
# ----------------------------------------------------------------------------------------------


def test_contracting_dim_sharded_matmul_all_reduces_once(mesh):
    compiled = _compile(mesh, jnp.matmul, (P(None, "model"), P("model", None)), P(),
                        (16, 64), (64, 32))
    stats = _stats(compiled)
    assert stats.count() == 1
    assert stats.count("all-reduce") == 1
    (ar,) = stats.collectives
    assert ar.kind == "all-reduce"
    assert ar.bytes == 16 * 32 * 4
    assert ar.shapes == ("f32[16,32]",)
    assert ar.group_size == 4
    assert "dot_general" in ar.op_name
    assert ar.name
    assert stats.bytes() == stats.bytes("all-reduce") == 16 * 32 * 4
    assert stats.by_kind()["all-reduce"] == (1, 16 * 32 * 4)


def test_data_sharded_to_replicated_all_gathers_full_array(mesh):
    compiled = _compile(mesh, lambda x: x * 2, (P("data", None),), P(), (16, 64))
    stats = _stats(compiled)
    assert stats.count() == 1
    (ag,) = stats.collectives
    assert ag.kind == "all-gather"
    assert ag.bytes == 16 * 64 * 4
    assert ag.group_size == 2


def test_psum_scatter_reduce_scatter_sizes_its_operand(mesh):
    # GSPMD on CPU lowers "contract on model, shard output on model" to all-reduce plus a
    # dynamic-slice, so an explicit psum_scatter is how to get a real reduce-scatter.
    def f(x, w):
        def local(x, w):
            return jax.lax.psum_scatter(x @ w, "model", scatter_dimension=1, tiled=True)
        return jax.shard_map(local, mesh=mesh, in_specs=(P(None, "model"), P("model", None)),
                             out_specs=P(None, "model"))(x, w)

    compiled = _compile(mesh, f, (P(None, "model"), P("model", None)), P(None, "model"),
                        (16, 64), (64, 32))
    stats = _stats(compiled)
    assert stats.count() == 1
    (rs,) = stats.collectives
    assert rs.kind == "reduce-scatter"
    assert rs.bytes == 16 * 32 * 4  # the un-scattered local product, not the 16x8 result
    assert rs.shapes == ("f32[16,32]",)
    assert rs.group_size == 4


def test_scattered_matmul_output_costs_the_same_either_lowering(mesh):
    # Whether XLA emits reduce-scatter or all-reduce + slice, the byte convention agrees.
    compiled = _compile(mesh, jnp.matmul, (P(None, "model"), P("model", None)), P(None, "model"),
                        (16, 64), (64, 32))
    stats = _stats(compiled)
    assert stats.count() == 1
    (c,) = stats.collectives
    assert c.kind in ("all-reduce", "reduce-scatter")
    assert c.bytes == 16 * 32 * 4
    assert c.group_size == 4


def test_no_collectives(mesh):
    compiled = _compile(mesh, lambda x: x * 2, (P("data", "model"),), P("data", "model"),
                        (16, 64))
    stats = _stats(compiled)
    assert stats.collectives == ()
    assert stats.count() == 0 and stats.bytes() == 0
    assert stats.by_kind() == {k: (0, 0) for k in COLLECTIVE_KINDS}


def test_collective_in_while_body_counted_per_trip(mesh):
    def f(x, w):
        return jax.lax.fori_loop(0, 5, lambda i, c: jnp.tanh(c @ w), x)

    compiled = _compile(mesh, f, (P(None, "model"), P("model", None)), P(), (16, 64), (64, 64))
    stats = _stats(compiled)
    (ar,) = [c for c in stats.collectives if c.kind == "all-reduce"]
    assert ar.bytes == 16 * 64 * 4 and ar.group_size == 4 and ar.executions == 5
    assert stats.count("all-reduce") == 5
    assert stats.bytes("all-reduce") == 5 * 16 * 64 * 4
    (loop,) = stats.loops
    assert (loop.trip_count, loop.entries, loop.collectives) == (5, 1, 1)


# Inside shard_map every psum is exactly one all-reduce of the local (16, 16) f32 block over
# the 4 devices of "model": 1 KiB. Adding the carry keeps it varying across "model".
LOCAL_AR = 16 * 16 * 4


def _psum_step(c, _=None):
    return jnp.tanh(jax.lax.psum(c, "model") + c), None


def _compile_local(mesh: Mesh, body, *shapes, dtype=F32):
    """Compile `body` under shard_map with (16, 64) arrays split on columns over "model"."""
    spec = P(None, "model")
    f = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(shapes), out_specs=spec)
    return _compile(mesh, f, (spec,) * len(shapes), spec, *shapes, dtype=dtype)


def test_scan_counts_its_body_collective_once_per_trip(mesh):
    compiled = _compile_local(mesh, lambda x: jax.lax.scan(_psum_step, x, None, length=4)[0],
                              (16, 64))
    stats = _stats(compiled)
    (ar,) = stats.collectives
    assert (ar.kind, ar.bytes, ar.group_size, ar.executions) == ("all-reduce", LOCAL_AR, 4, 4)
    assert stats.count() == stats.count("all-reduce") == 4
    assert stats.bytes() == stats.bytes("all-reduce") == 4 * LOCAL_AR
    assert stats.by_kind()["all-reduce"] == (4, 4 * LOCAL_AR)
    (loop,) = stats.loops
    assert (loop.trip_count, loop.entries, loop.collectives) == (4, 1, 1)
    assert "while" in loop.op_name and loop.name
    assert stats.unknown_loops == ()
    assert "4 trips" in str(stats)


def _nested_scans(x):
    """A 3-trip scan around a 2-trip scan whose body all-reduces once."""
    def outer(c, _):
        return jax.lax.scan(_psum_step, c, None, length=2)[0], None
    return jax.lax.scan(outer, x, None, length=3)[0]


def test_nested_scans_multiply_trip_counts(mesh):
    stats = _stats(_compile_local(mesh, _nested_scans, (16, 64)))
    (ar,) = stats.collectives
    assert ar.executions == 6
    assert stats.count("all-reduce") == 6 and stats.bytes("all-reduce") == 6 * LOCAL_AR
    outer, inner = stats.loops  # outermost first
    assert (outer.trip_count, outer.entries, outer.collectives) == (3, 1, 2)
    assert (inner.trip_count, inner.entries, inner.collectives) == (2, 3, 1)


def test_computation_runs_of_nested_scans(mesh):
    text = _compile_local(mesh, _nested_scans, (16, 64)).as_text()
    module = computation_runs(text)
    outer, inner = module.loops
    assert module.runs[module.entry] == 1 and outer.parent == module.entry
    assert inner.parent == outer.body
    assert (module.runs[outer.body], module.runs[inner.body]) == (3, 6)
    # A loop's condition runs once more than its body, per entry into the loop.
    conditions = re.findall(r"condition=%?([\w.\-]+)", text)
    assert sorted(module.runs[c] for c in conditions) == [4, 9]  # 3 + 1, 3 * (2 + 1)
    assert module.texts[inner.body].splitlines()[-1] == "}"
    assert set(module.texts) == set(module.runs)


def test_fori_loop_beside_a_collective_outside_it(mesh):
    def body(x):
        y = jax.lax.fori_loop(0, 3, lambda i, c: _psum_step(c)[0], x)
        return jax.lax.psum(y, "model") + y

    stats = _stats(_compile_local(mesh, body, (16, 64)))
    assert sorted(c.executions for c in stats.collectives) == [1, 3]
    assert stats.count("all-reduce") == 4 and stats.bytes("all-reduce") == 4 * LOCAL_AR


def test_loop_without_collective_multiplies_nothing(mesh):
    def body(x):
        y = jax.lax.scan(lambda c, _: (jnp.tanh(c), None), x, None, length=4)[0]
        return jax.lax.psum(y, "model") + y

    stats = _stats(_compile_local(mesh, body, (16, 64)))
    (ar,) = stats.collectives
    assert ar.executions == 1 and stats.count() == 1 and stats.bytes() == LOCAL_AR
    (loop,) = stats.loops
    assert (loop.trip_count, loop.entries, loop.collectives) == (4, 1, 0)
    assert "loop" not in str(stats)  # loops without collectives do not clutter the table


def test_run_time_trip_count_is_flagged_and_counted_once(mesh):
    def f(x, w, n):
        return jax.lax.fori_loop(0, n, lambda i, c: jnp.tanh(c @ w), x)

    in_sh = (NamedSharding(mesh, P(None, "model")), NamedSharding(mesh, P("model", None)),
             NamedSharding(mesh, P()))
    args = (jax.ShapeDtypeStruct((16, 64), F32, sharding=in_sh[0]),
            jax.ShapeDtypeStruct((64, 64), F32, sharding=in_sh[1]),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=in_sh[2]))
    compiled = jax.jit(f, in_shardings=in_sh, out_shardings=NamedSharding(mesh, P()))
    stats = _stats(compiled.lower(*args).compile())
    (loop,) = stats.loops
    assert loop.trip_count is None and loop.collectives == 1
    assert stats.unknown_loops == (loop,)
    assert stats.count("all-reduce") == 1  # a lower bound: one trip
    assert "unknown trip count" in str(stats)


def test_collective_in_loop_condition_runs_once_more_than_the_body(mesh):
    # The condition's sum over the split columns needs an all-reduce of a scalar; the trip
    # count depends on the data, so one trip is counted: the condition runs twice.
    def body(x):
        return jax.lax.while_loop(lambda c: jax.lax.psum(jnp.sum(c), "model") < 100.0,
                                  lambda c: _psum_step(c)[0] + 1.0, x)

    stats = _stats(_compile_local(mesh, body, (16, 64)))
    by_bytes = {c.bytes: c.executions for c in stats.collectives}
    assert by_bytes == {LOCAL_AR: 1, 4: 2}
    (loop,) = stats.loops
    assert loop.trip_count is None and stats.unknown_loops == (loop,)
    assert stats.count("all-reduce") == 3 and stats.bytes("all-reduce") == LOCAL_AR + 2 * 4


def test_conditional_counts_its_heaviest_branch(mesh):
    def f(x, p):
        def local(x, p):
            return jax.lax.cond(p > 0, lambda x: _psum_step(x)[0],
                                lambda x: jax.lax.psum(x[:2], "model").sum() + x, x)
        return jax.shard_map(local, mesh=mesh, in_specs=(P(None, "model"), P()),
                             out_specs=P(None, "model"))(x, p)

    in_sh = (NamedSharding(mesh, P(None, "model")), NamedSharding(mesh, P()))
    args = (jax.ShapeDtypeStruct((16, 64), F32, sharding=in_sh[0]),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=in_sh[1]))
    compiled = jax.jit(f, in_shardings=in_sh, out_shardings=in_sh[0]).lower(*args).compile()
    assert "conditional(" in compiled.as_text()
    stats = _stats(compiled)
    assert sorted((c.bytes, c.executions) for c in stats.collectives) == [
        (2 * 16 * 4, 0), (LOCAL_AR, 1)]
    assert stats.count() == 1 and stats.bytes() == LOCAL_AR
    assert "not counted" in str(stats)


@pytest.mark.parametrize("op", ["psum", "all_gather"])
def test_cpu_compiles_bf16_collectives_in_f32(mesh, op):
    # XLA's CPU pipeline converts bf16 collectives to f32 (all-reduce-promotion for all-reduce,
    # bf16 float-normalization for all-gather): the bytes counted are f32 bytes.
    def body(x):
        if op == "psum":
            return jax.lax.psum(x, "model") + x
        return jax.lax.all_gather(x, "model", axis=1, tiled=True)[:, :16] + x

    text = _compile_local(mesh, body, (16, 64), dtype=jnp.bfloat16).as_text()
    (c,) = collective_stats(text).collectives
    assert c.shapes[0].startswith("f32[")
    assert c.bytes == (16 * 16 if op == "psum" else 16 * 64) * 4
    assert "bf16[" in text  # the program itself is bf16 around the collective


def test_psum_of_two_arrays_sums_bytes(mesh):
    def f(x, y):
        return jax.shard_map(lambda x, y: jax.lax.psum((x, y), "data"), mesh=mesh,
                             in_specs=(P("data"), P("data")), out_specs=(P(), P()))(x, y)

    compiled = _compile(mesh, f, (P("data"), P("data")), (P(), P()), (16, 64), (8,))
    stats = _stats(compiled)
    assert stats.count() == stats.count("all-reduce") >= 1  # one tuple all-reduce if combined
    assert stats.bytes("all-reduce") == 8 * 64 * 4 + 4 * 4
    assert all(c.group_size == 2 for c in stats.collectives)


def test_compiled_memory_is_per_device(mesh):
    compiled = _compile(mesh, jnp.matmul, (P("data", "model"), P("model", None)), P(),
                        (16, 64), (64, 32))
    mem = compiled_memory(compiled)
    assert isinstance(mem, CompiledMemory)
    assert mem.argument_bytes == (8 * 16 + 16 * 32) * 4  # shards, not the global arrays
    assert mem.output_bytes == 16 * 32 * 4
    assert mem.alias_bytes == 0
    assert mem.total == mem.argument_bytes + mem.output_bytes + mem.temp_bytes


def test_compiled_memory_subtracts_donated_buffers(mesh):
    compiled = _compile(mesh, lambda x: x + 1, (P("data", "model"),), P("data", "model"),
                        (16, 64), donate_argnums=0)
    mem = compiled_memory(compiled)
    assert mem.argument_bytes == mem.output_bytes == mem.alias_bytes == 8 * 16 * 4
    assert mem.total == mem.temp_bytes + 8 * 16 * 4


# ----------------------------------------------------------------------------------------------
# Synthetic text
# ----------------------------------------------------------------------------------------------

HEADER = "HloModule m, is_scheduled=true, num_partitions=8\n\n"
ADD = "%add (x: f32[], y: f32[]) -> f32[] {\n  %x = f32[] parameter(0)\n  %y = f32[] parameter(1)\n  ROOT %s = f32[] add(%x, %y)\n}\n\n"


def _module(*body: str, header: str = HEADER) -> str:
    lines = "\n".join(f"  {b}" for b in body)
    return f"{header}{ADD}ENTRY %main (p: f32[8,16]) -> f32[8,16] {{\n{lines}\n}}\n"


def test_tuple_all_reduce_sums_elements():
    text = _module(
        "%p = f32[4,8]{1,0} parameter(0)",
        "%q = bf16[16]{0} parameter(1)",
        "%ar = (f32[4,8]{1,0}, bf16[16]{0}) all-reduce(%p, %q), channel_id=1, "
        "replica_groups={{0,1},{2,3},{4,5},{6,7}}, use_global_device_ids=true, to_apply=%add, "
        'metadata={op_name="jit(f)/psum" source_file="x.py"}',
        "ROOT %g = f32[4,8]{1,0} get-tuple-element(%ar), index=0",
    )
    (ar,) = collective_stats(text).collectives
    assert ar == CompiledCollective(kind="all-reduce", bytes=4 * 8 * 4 + 16 * 2,
                                    shapes=("f32[4,8]", "bf16[16]"), group_size=2, name="ar",
                                    op_name="jit(f)/psum", group=(0, 1))


def test_all_reduce_results_read_only_in_group_slices_are_scattered():
    """A combined all-reduce (groups of 4): its first buffer is read only as a quarter, by a
    dynamic-slice behind a bitcast and inside a fusion (where the CPU puts it); the second by an
    add, and the third by a static slice too: only the first is a reduce-scatter for GPU XLA."""
    fused = ("%fused (a: f32[8,16], o: s32[]) -> f32[2,16] {\n  %a = f32[8,16]{1,0} parameter(0)\n"
             "  %o = s32[] parameter(1)\n  %z = s32[] constant(0)\n"
             "  %ds = f32[2,16]{1,0} dynamic-slice(%a, %o, %z), dynamic_slice_sizes={2,16}\n"
             "  ROOT %m = f32[2,16]{1,0} multiply(%ds, %ds)\n}\n\n")
    text = _module(
        "%p = f32[8,16]{1,0} parameter(0)",
        "%o = s32[] partition-id()",
        "%z = s32[] constant(0)",
        "%ar = (f32[8,16]{1,0}, f32[8,16]{1,0}, f32[4,4]{1,0}) all-reduce(%p, %p, %p), channel_id=1, "
        "replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add",
        "%g0 = f32[8,16]{1,0} get-tuple-element(%ar), index=0",
        "%g1 = f32[8,16]{1,0} get-tuple-element(%ar), index=1",
        "%g2 = f32[4,4]{1,0} get-tuple-element(%ar), index=2",
        "%b = f32[128]{0} bitcast(%g0)",
        "%f = f32[2,16]{1,0} fusion(%g0, %o), kind=kLoop, calls=%fused",
        "%d = f32[32]{0} dynamic-slice(%b, %o), dynamic_slice_sizes={32}",
        "%sum = f32[8,16]{1,0} add(%g1, %g1)",
        "%d2 = f32[1,4]{1,0} dynamic-slice(%g2, %o, %z), dynamic_slice_sizes={1,4}",
        "%s2 = f32[1,4]{1,0} slice(%g2), slice={[0:1], [0:4]}",
        "ROOT %t = (f32[2,16]{1,0}, f32[32]{0}, f32[8,16]{1,0}, f32[1,4]{1,0}, f32[1,4]{1,0}) tuple(%f, %d, %sum, %d2, %s2)",
    ).replace("ENTRY", fused + "ENTRY")
    (ar,) = collective_stats(text).collectives
    assert (ar.bytes, ar.scattered) == ((2 * 8 * 16 + 16) * 4, 8 * 16 * 4)


def test_long_tuple_with_index_comments():
    shapes = ", ".join(["f32[2]{0}"] * 5) + ", /*index=5*/f32[3]{0}"
    text = _module(f"%ar = ({shapes}) all-reduce(%a, %b, %c, %d, %e, %f), "
                   "replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add")
    (ar,) = collective_stats(text).collectives
    assert ar.bytes == 5 * 8 + 12 and len(ar.shapes) == 6 and ar.group_size == 8


def test_async_start_done_pairs_count_once():
    text = _module(
        "%p = f32[8,16]{1,0} parameter(0)",
        "%ars = f32[8,16]{1,0} all-reduce-start(%p), channel_id=1, replica_groups={{0,1}}, "
        "to_apply=%add",
        "%ard = f32[8,16]{1,0} all-reduce-done(%ars)",
        "%ags = (f32[8,16]{1,0}, f32[32,16]{1,0}) all-gather-start(f32[8,16]{1,0} %ard), "
        "channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true",
        "%agd = f32[32,16]{1,0} all-gather-done(%ags)",
        "%cps = (f32[32,16]{1,0}, f32[32,16]{1,0}, u32[], u32[]) collective-permute-start(%agd), "
        "channel_id=3, source_target_pairs={{0,1},{1,0}}",
        "ROOT %cpd = f32[32,16]{1,0} collective-permute-done(%cps)",
    )
    stats = collective_stats(text)
    assert stats.count() == 3
    assert [c.name for c in stats.collectives] == ["ars", "ags", "cps"]
    assert stats.by_kind() == {
        "all-reduce": (1, 8 * 16 * 4),
        "all-gather": (1, 32 * 16 * 4),  # the gathered output, not the tuple's input half
        "reduce-scatter": (0, 0),
        "all-to-all": (0, 0),
        "collective-permute": (1, 32 * 16 * 4),
    }
    assert [c.group_size for c in stats.collectives] == [2, 4, 0]


def test_an_all_reduce_start_returning_operands_and_outputs_counts_its_outputs():
    """GPU XLA (jax 0.12) writes an async all-reduce's start as ((operands), outputs): the
    buffer is counted once, not as both halves."""
    text = _module(
        "%p = f32[8,16]{1,0} parameter(0)",
        "%q = f32[4]{0} parameter(1)",
        "%ars = ((f32[8,16]{1,0}, f32[4]{0}), (f32[8,16]{1,0}, f32[4]{0})) all-reduce-start(%p, %q), "
        "channel_id=1, replica_groups={{0,1}}, to_apply=%add",
        "%one = ((f32[8,16]{1,0}), f32[8,16]{1,0}) all-reduce-start(%p), channel_id=2, "
        "replica_groups={{0,1}}, to_apply=%add",
        "ROOT %ard = (f32[8,16]{1,0}, f32[4]{0}) all-reduce-done(%ars)",
    )
    assert [c.bytes for c in collective_stats(text).collectives] == [(8 * 16 + 4) * 4, 8 * 16 * 4]


def test_async_wrapped_collective_counted_in_its_computation():
    text = HEADER + ADD + (
        "%wrapped (p0: f32[32,16]) -> f32[8,16] {\n"
        "  %p0 = f32[32,16]{1,0} parameter(0)\n"
        "  ROOT %rs = f32[8,16]{1,0} reduce-scatter(%p0), channel_id=1, "
        "replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, to_apply=%add\n"
        "}\n\n"
        "ENTRY %main (p: f32[32,16]) -> f32[8,16] {\n"
        "  %p = f32[32,16]{1,0} parameter(0)\n"
        "  %st = ((f32[32,16]{1,0}), f32[8,16]{1,0}) async-start(%p), calls=%wrapped\n"
        "  ROOT %dn = f32[8,16]{1,0} async-done(%st)\n"
        "}\n"
    )
    (rs,) = collective_stats(text).collectives
    assert (rs.kind, rs.bytes, rs.shapes, rs.group_size) == (
        "reduce-scatter", 32 * 16 * 4, ("f32[32,16]",), 4)


def test_reduce_scatter_operand_shape_lookup_and_inline():
    looked_up = _module(
        "%fusion.3 = f32[64,16]{1,0} fusion(%p), kind=kLoop, calls=%f",
        "ROOT %rs = f32[16,16]{1,0} reduce-scatter(%fusion.3), replica_groups={{0,1,2,3}}, "
        "dimensions={0}, to_apply=%add",
    )
    inline = _module(
        "ROOT %rs = f32[16,16]{1,0} reduce-scatter(f32[64,16]{1,0} %elsewhere), "
        "replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add",
    )
    for text in (looked_up, inline):
        (rs,) = collective_stats(text).collectives
        assert (rs.bytes, rs.shapes, rs.group_size) == (64 * 16 * 4, ("f32[64,16]",), 4)


def test_reduce_scatter_unknown_operand_falls_back_to_group_multiple():
    text = _module("ROOT %rs = f32[16,16]{1,0} reduce-scatter(%missing), "
                   "replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add")
    (rs,) = collective_stats(text).collectives
    assert rs.bytes == 4 * 16 * 16 * 4


@pytest.mark.parametrize(
    ("groups", "size"),
    [
        ("{{0,1},{2,3},{4,5},{6,7}}", 2),
        ("{{0,4},{1,5},{2,6},{3,7}}", 2),
        ("{{0,1,2,3,4,5,6,7}}", 8),
        ("[2,4]<=[8]", 4),
        ("[4,2]<=[4,2]T(1,0)", 2),
        ("[1,8]<=[2,4]T(1,0)", 8),
        ("mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}", 4),
        ("mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}", 2),
        ("mesh['axis_0'=8,'axis_1'=1] {'axis_0'}", 8),
        ("mesh['a'=2,'b'=4] {'a','b'}", 8),
        ("mesh['a'=8] {'a':(1)2}", 2),
        ("mesh['a'=8], device_ids=(7,6,5,4,3,2,1,0) {'a':(2)4}", 4),
        ("mesh[a=2,b=4] {b}", 4),
        ("maximal_mesh[device_id=3] {}", 1),
        ("{}", 8),  # all partitions (header num_partitions=8, channel_id present)
    ],
)
def test_replica_group_formats(groups, size):
    text = _module(f"ROOT %ar = f32[8,16]{{1,0}} all-reduce(%p), channel_id=1, "
                   f"replica_groups={groups}, use_global_device_ids=true, to_apply=%add")
    (ar,) = collective_stats(text).collectives
    assert ar.group_size == size


def test_undeterminable_group_size_is_zero():
    text = _module("ROOT %ar = f32[8]{0} all-reduce(%p), replica_groups={}, to_apply=%add",
                   header="")
    assert collective_stats(text).collectives[0].group_size == 0


@pytest.mark.parametrize(
    ("shape", "nbytes"),
    [
        ("f32[]", 4), ("pred[3]", 3), ("s8[5]", 5), ("u8[2,2]", 4), ("f16[3]", 6),
        ("bf16[5]", 10), ("s16[1]", 2), ("u16[3]", 6), ("s32[2,3]", 24), ("u32[]", 4),
        ("f64[2]", 16), ("s64[2]", 16), ("u64[1]", 8), ("c64[1]", 8), ("c128[]", 16),
        ("f8e4m3fn[2,2]", 4), ("f8e5m2[3]", 3), ("f8e4m3b11fnuz[1]", 1),
        ("f32[8,128]{1,0:T(8,128)}", 4096), ("f32[<=6,2]{1,0}", 48),
    ],
)
def test_dtype_sizes(shape, nbytes):
    text = _module(f"ROOT %ag = {shape} all-gather(%p), replica_groups={{{{0,1}}}}, "
                   "dimensions={0}")
    (ag,) = collective_stats(text).collectives
    assert ag.bytes == nbytes
    assert ag.shapes == (shape.split("{")[0],)  # layout dropped


def test_only_real_collective_instructions_count():
    text = HEADER + (
        "%all-reduce.clone (x: f32[], y: f32[]) -> f32[] {\n"
        "  %x = f32[] parameter(0)\n  %y = f32[] parameter(1)\n"
        '  ROOT %all-reduce.9 = f32[] add(%x, %y), metadata={op_name="all-reduce(x)"}\n'
        "}\n\n"
        "ENTRY %main (p: f32[8]) -> f32[8] {\n"
        "  %p = f32[8]{0} parameter(0)\n"
        '  %f = f32[8]{0} fusion(%p), kind=kLoop, calls=%c, metadata={op_name="all-gather"}\n'
        "  ROOT %a2a = (f32[4]{0}, f32[4]{0}) all-to-all(f32[4]{0} %f, f32[4]{0} %f), "
        "replica_groups={{0,1}}\n"
        "}\n"
    )
    stats = collective_stats(text)
    assert [(c.kind, c.bytes, c.group_size, c.op_name) for c in stats.collectives] == [
        ("all-to-all", 32, 2, "")]


def test_stats_api():
    a = CompiledCollective("all-reduce", 100, ("f32[25]",), 4, "a", "x")
    b = CompiledCollective("all-reduce", 20, ("f32[5]",), 4, "b")
    c = CompiledCollective("all-gather", 7, ("u8[7]",), 2, "c")
    stats = CollectiveStats((a, b, c))
    assert stats.count() == 3 and stats.bytes() == 127
    assert stats.count("all-reduce") == 2 and stats.bytes("all-reduce") == 120
    assert stats.count("all-to-all") == 0 and stats.bytes("all-to-all") == 0
    assert list(stats.by_kind()) == list(COLLECTIVE_KINDS)
    table = str(stats)
    assert "all-reduce" in table and "120" in table and "total" in table and "127" in table
    with pytest.raises(ValueError):
        stats.count("allreduce")


def test_stats_weight_by_executions():
    a = CompiledCollective("all-reduce", 100, ("f32[25]",), 4, "a", executions=3)
    b = CompiledCollective("all-gather", 7, ("u8[7]",), 2, "b", executions=0)
    known = CompiledLoop("while.1", 3, 1, 1, "body.1", "main")
    unknown = CompiledLoop("while.2", None, 1, 1, "body.2", "main")
    idle = CompiledLoop("while.3", None, 1, 0, "body.3", "main")
    stats = CollectiveStats((a, b), (known, unknown, idle))
    assert stats.count() == 3 and stats.bytes() == 300
    assert stats.by_kind()["all-gather"] == (0, 0)
    assert stats.unknown_loops == (unknown,)  # an unknown loop without collectives changes nothing
    table = str(stats)
    assert "while.1 (3 trips" in table and "while.2 (unknown trip count" in table
    assert "while.3" not in table and "1 collective instructions not counted" in table


# A while whose body holds an async-wrapped all-reduce (start and done both name the wrapped
# computation) and calls a computation holding an all-gather, which the entry also calls.
LOOP_MODULE = HEADER + ADD + """%wrapped (w0: f32[8]) -> f32[8] {
  %w0 = f32[8]{0} parameter(0)
  ROOT %ar = f32[8]{0} all-reduce(%w0), channel_id=1, replica_groups={{0,1}}, to_apply=%add
}

%gather (g0: f32[8]) -> f32[32] {
  %g0 = f32[8]{0} parameter(0)
  ROOT %ag = f32[32]{0} all-gather(%g0), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}
}

%body (b0: (s32[], f32[8])) -> (s32[], f32[8]) {
  %b0 = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%b0), index=0
  %v = f32[8]{0} get-tuple-element(%b0), index=1
  %st = ((f32[8]{0}), f32[8]{0}) async-start(%v), calls=%wrapped
  %dn = f32[8]{0} async-done(%st), calls=%wrapped
  %c = f32[32]{0} call(%dn), to_apply=%gather
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %dn)
}

%cond (c0: (s32[], f32[8])) -> pred[] {
  %c0 = (s32[], f32[8]{0}) parameter(0)
  %k = s32[] get-tuple-element(%c0), index=0
  %n = s32[] constant(TRIPS)
  ROOT %lt = pred[] compare(%k, %n), direction=LT
}

ENTRY %main (p: f32[8]) -> f32[32] {
  %p = f32[8]{0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%z, %p)
  %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, metadata={op_name="jit(f)/while"}BACKEND
  %out = f32[8]{0} get-tuple-element(%loop), index=1
  ROOT %once = f32[32]{0} call(%out), to_apply=%gather
}
"""


def _loop_module(trips: int, recorded: bool = True) -> str:
    config = f', backend_config={{"known_trip_count":{{"n":"{trips}"}}}}' if recorded else ""
    return LOOP_MODULE.replace("TRIPS", str(trips)).replace("BACKEND", config)


def test_calls_inside_a_loop_take_its_trip_count():
    stats = collective_stats(_loop_module(3))
    assert [(c.name, c.executions) for c in stats.collectives] == [("ar", 3), ("ag", 4)]
    assert stats.by_kind()["all-reduce"] == (3, 3 * 32)
    assert stats.by_kind()["all-gather"] == (4, 4 * 128)  # 3 trips + the entry's own call
    assert stats.loops == (CompiledLoop("loop", 3, 1, 2, "body", "main", "jit(f)/while"),)


def test_loop_trip_count_zero_and_unrecorded():
    zero = collective_stats(_loop_module(0))
    assert [(c.name, c.executions) for c in zero.collectives] == [("ar", 0), ("ag", 1)]
    # Without XLA's annotation the constant bound is not re-derived: one trip, flagged.
    unknown = collective_stats(_loop_module(3, recorded=False))
    assert [(c.name, c.executions) for c in unknown.collectives] == [("ar", 1), ("ag", 2)]
    assert [loop.name for loop in unknown.unknown_loops] == ["loop"]


def _conditional_module(branches_attr: str) -> str:
    return HEADER + ADD + """%light (l0: f32[8]) -> f32[8] {
  %l0 = f32[8]{0} parameter(0)
  ROOT %ar_light = f32[8]{0} all-reduce(%l0), replica_groups={{0,1}}, to_apply=%add
}

%heavy (h0: f32[8]) -> f32[8] {
  %h0 = f32[8]{0} parameter(0)
  %ar_heavy = f32[8]{0} all-reduce(%h0), replica_groups={{0,1}}, to_apply=%add
  ROOT %ar_heavy2 = f32[8]{0} all-reduce(%ar_heavy), replica_groups={{0,1}}, to_apply=%add
}

%none (n0: f32[8]) -> f32[8] {
  ROOT %n0 = f32[8]{0} parameter(0)
}

ENTRY %main (p: f32[8], i: s32[]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %i = s32[] parameter(1)
  ROOT %cnd = f32[8]{0} conditional(%i, %p, %p, %p), BRANCHES
}
""".replace("BRANCHES", branches_attr)


@pytest.mark.parametrize("branches", [
    "branch_computations={%light, %heavy, %none}",
    "true_computation=%heavy, false_computation=%light",
])
def test_conditional_counts_only_its_heaviest_branch(branches):
    stats = collective_stats(_conditional_module(branches))
    assert {c.name: c.executions for c in stats.collectives} == {
        "ar_light": 0, "ar_heavy": 1, "ar_heavy2": 1}
    assert stats.count() == 2 and stats.bytes() == 2 * 32
    # Costs other than collectives (compiled_cost) can ask for every branch as if taken.
    counted = computation_runs(_conditional_module(branches)).runs
    every = computation_runs(_conditional_module(branches), every_branch=True).runs
    assert (counted["light"], counted["heavy"], every["light"], every["heavy"]) == (0, 1, 1, 1)


def test_call_cycle_is_rejected():
    text = HEADER + (
        "%a (x: f32[]) -> f32[] {\n  %x = f32[] parameter(0)\n  ROOT %c = f32[] call(%x), to_apply=%b\n}\n\n"
        "%b (y: f32[]) -> f32[] {\n  %y = f32[] parameter(0)\n  ROOT %d = f32[] call(%y), to_apply=%a\n}\n"
    )
    with pytest.raises(ValueError, match="calls itself"):
        collective_stats(text)


@pytest.mark.parametrize("groups,first", [("{{0,8,16,24},{1,9,17,25}}", (0, 8, 16, 24)),
                                          ("[8,4]<=[4,8]T(1,0)", (0, 8, 16, 24)), ("[4,8]<=[32]", tuple(range(8))),
                                          ("mesh['a'=4,'b'=8] {'a'}", (0, 8, 16, 24)),
                                          ("mesh['a'=4,'b'=8], device_ids=([8,4]T(1,0)) {'b'}", (0, 4, 8, 12, 16, 20, 24, 28))])
def test_replica_groups_and_permute_pairs_are_read(groups, first):
    """Which devices a group holds (not only how many) tells whether it crosses hosts."""
    text = _module(
        "%p = f32[64]{0} parameter(0)",
        f"%ag = f32[256]{{0}} all-gather(%p), channel_id=1, replica_groups={groups}, dimensions={{0}}, "
        "use_global_device_ids=true",
        "%cp = f32[256]{0} collective-permute(%ag), channel_id=2, source_target_pairs={{0,0},{1,8},{8,1}}",
        "ROOT %r = f32[256]{0} copy(%cp)",
    )
    ag, cp = collective_stats(text).collectives
    assert ag.group == first and cp.pairs == ((0, 0), (1, 8), (8, 1))
