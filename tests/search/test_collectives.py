"""Resharding as the cost model prices it, against what XLA compiles for it."""
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rhino_jax as rj
from rhino_jax.runtime.compiled.collectives import collective_stats
from rhino_jax.search.cost.collectives import _layouts, reshard, reshard_path
from rhino_jax.core.specs import ShardingSpec

from helpers import assert_same_numbers, topology

XY = topology(x=2, y=4)


def spec(*dims):
    return ShardingSpec(tuple(tuple(d) for d in dims))


def test_axes_in_another_order_are_permuted():
    moves = reshard(spec(("x", "y"), ()), spec(("y", "x"), ()), 64 * 64 * 4, XY, (64, 64))
    assert [(c.kind, c.bytes) for c in moves] == [("collective-permute", 64 * 64 * 4 // 8)]


def test_size_one_axes_move_no_data():
    """A mesh may have size-1 axes (device_mesh((1, 1, 8))): where they stand changes no block."""
    topo = topology(u=1, v=1, w=8)
    assert reshard(spec(("u", "v"), ()), spec(("v", "u"), ()), 16 * 32 * 4, topo, (16, 32)) == []
    moves = reshard(spec(("u",), ("w",)), spec(("w",), ("u",)), 16 * 32 * 4, topo, (16, 32))
    assert [(c.kind, c.axes) for c in moves] == [("all-to-all", ("w",))]


def test_an_axis_moved_in_front_of_another_is_moved_then_permuted():
    """The all-to-all appends the axis it moves as the minor one; dst wants it major."""
    moves = reshard(spec(("y",), ("x",), ()), spec((), ("y", "x"), ()), 16 * 64 * 64 * 4, XY, (16, 64, 64))
    assert [c.kind for c in moves] == ["all-to-all", "collective-permute"]
    assert reshard(spec(("y",), ("x",), ()), spec((), ("x", "y"), ()), 16 * 64 * 64 * 4, XY, (16, 64, 64))[-1].kind == "all-to-all"


def _compiled_chain(mesh, shape, chain):
    """Collectives XLA compiles for a tensor laid out as chain[0], pinned to each next layout."""
    named = [NamedSharding(mesh, s.to_partition_spec()) for s in chain]

    def f(a):
        b = jax.lax.with_sharding_constraint(jnp.sin(a), named[0])
        for s in named[1:]:
            b = jax.lax.with_sharding_constraint(b, s)
        return jnp.cos(b)

    arg = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=named[0])
    return collective_stats(jax.jit(f, out_shardings=named[-1]).lower(arg).compile().as_text())


@pytest.mark.parametrize("shape", [(16, 32), (2, 4, 6)])
def test_every_reshard_path_compiles_as_priced(shape):
    """For every pair of layouts on a (2, 4) mesh, pinning the layouts of `reshard_path` makes
    XLA run exactly the collectives it prices, kind by kind and byte by byte. Left to itself
    between the two ends, XLA replicated the whole tensor or added permutes on 34 of the 121
    pairs of (16, 32) (the MoE plans' unpredicted permutes and gathers)."""
    mesh = rj.device_mesh((2, 4), ("x", "y"))
    full = int(np.prod(shape)) * 4
    for src, dst in itertools.product(_layouts(shape, tuple(XY.sizes.items())), repeat=2):
        path = reshard_path(src, dst, full, XY, shape)
        chain = [src] + [step.spec for step in path]
        priced = sorted((c.kind, c.bytes) for step in path for c in step.collectives)
        compiled = sorted((c.kind, c.bytes) for c in _compiled_chain(mesh, shape, chain).collectives)
        assert compiled == priced, (chain, compiled, priced)


def test_pins_and_donated_outputs_reach_their_layout_as_priced():
    """The rewrite pins the plan's path into a user's pin (its own constraint is the last step) and
    into a donated output's layout, as for any read: every pair of pinned argument layout and
    pinned result layout compiles to the predicted collectives. Left to XLA, 16 of these 56
    pairs compiled otherwise (another gather order, an extra permute)."""
    mesh = rj.device_mesh((2, 4), ("x", "y"))
    pins = [P("x", "y"), P("y", "x"), P(("x", "y"), None), P(None, ("x", "y")), P("x", None), P(None, "y"),
            P("y", None), P(None, None)]
    a = jnp.ones((16, 32))
    for arg_pin, result_pin in itertools.permutations(pins, 2):
        def f(a):
            return rj.annotate(jnp.sin(rj.annotate(a, arg_pin)), result_pin)

        lowered = rj.parallelize(f, mesh=mesh, donate_argnums=0).lower(a)
        predicted = sorted((c.kind, c.bytes) for c in lowered.plan.collectives)
        compiled = sorted((c.kind, c.bytes) for c in lowered.compile().collectives.collectives)
        assert compiled == predicted, (arg_pin, result_pin, compiled, predicted)


def test_major_axes_cost_a_permute_and_distant_layouts_go_step_by_step():
    """Gathering the major axis of a dim needs a permute first (XLA gathers minor axes). From
    [-, x] to [y, -] XLA replicates the whole tensor when left to itself; the path slices y in
    for free and gathers x. 16 MiB, so that bandwidth, not one more launch, decides."""
    shape = (1024, 4096)
    path = reshard_path(spec((), ("x", "y")), spec((), ("y",)), 1024 * 4096 * 4, XY, shape)
    assert sorted(c.kind for st in path for c in st.collectives) == ["all-gather", "collective-permute"], path
    path = reshard_path(spec((), ("x",)), spec(("y",), ()), 1024 * 4096 * 4, XY, shape)
    assert [st.spec for st in path] == [spec(("y",), ("x",)), spec(("y",), ())]
    assert [(c.kind, c.bytes) for st in path for c in st.collectives] == [("all-gather", 1024 * 4096 * 4 // 4)]


def test_compiled_reshard_matches_the_prediction():
    """XLA compiles the move from [x, y, -] to [-, x+y, -] as the model predicts it: x moves
    to dim 1 behind y, then the pieces are permuted into x-major order."""
    def f(a):
        b = rj.annotate(jnp.sin(a), P("x", "y", None))
        return rj.annotate(jnp.cos(b), P(None, ("x", "y"), None))

    a = jax.random.normal(jax.random.PRNGKey(0), (16, 64, 32))
    mesh = rj.device_mesh((2, 4), ("x", "y"))
    lowered = rj.parallelize(f, mesh=mesh).lower(a)
    predicted = sorted((c.kind, c.bytes) for c in lowered.plan.collectives)
    compiled = lowered.compile()
    found = sorted((c.kind, c.bytes) for c in compiled.collectives.collectives)
    assert ("collective-permute", 16 * 64 * 32 * 4 // 8) in predicted, predicted
    assert found == predicted, (found, predicted)
    assert_same_numbers(jax.jit(f)(a), compiled(a))
    assert lowered.plan.read_paths  # the reshard goes through a pinned intermediate layout
    assert json.loads(lowered.plan.to_json())["collectives"]  # a plan with paths writes its JSON


def _as_cpu_compiles(collectives) -> list[tuple[str, int]]:
    """(kind, bytes) of planned collectives as the CPU compiles them: XLA's partitioner writes a
    reduce-scatter as an all-reduce of the same buffer and a local slice; the GPU pipeline merges
    them (ReduceScatterCreator), the CPU's leaves them."""
    return sorted(("all-reduce" if c.kind == "reduce-scatter" else c.kind, c.bytes) for c in collectives)


def test_partial_sums_settle_where_the_plan_priced_them():
    """A matmul's partial sums (contraction split on x) read split on (x, y): the plan reduce-
    scatters into x behind y, then permutes; the rewrite pins the settled layout so that XLA
    does not settle them some other way (it gathered the operands instead, on MoE). The weight
    comes first, a parameter: the last argument is a batch fed from the host every step, which
    the plan would rather feed split 8 ways and gather."""
    def f(w, a):
        a = rj.annotate(a, P("y", "x"))
        w = rj.annotate(w, P("x", None))
        return rj.annotate(jnp.tanh(a @ w), P(("x", "y"), None))

    w = jax.random.normal(jax.random.PRNGKey(1), (256, 128))
    a = jax.random.normal(jax.random.PRNGKey(0), (64, 256))
    lowered = rj.parallelize(f, mesh=rj.device_mesh((2, 4), ("x", "y"))).lower(w, a)
    predicted = sorted((c.kind, c.bytes) for c in lowered.plan.collectives)
    compiled = lowered.compile()
    found = sorted((c.kind, c.bytes) for c in compiled.collectives.collectives)
    assert [k for k, _ in predicted] == ["collective-permute", "reduce-scatter"], predicted
    assert found == _as_cpu_compiles(lowered.plan.collectives), (found, predicted)
    assert_same_numbers(jax.jit(f)(w, a), compiled(w, a))


def test_a_reduces_partial_sums_settle_in_one_all_reduce_unless_scattered_over_them_all():
    """XLA's reduce handler (and its scatter's) sums the addends over every partial axis in one
    all-reduce of the whole buffer, and a reader split on only some of those axes slices it: no
    reduce-scatter, unlike a dot's sums, which settle one dim at a time. Only a reader split over
    all of them in one dim gets a reduce-scatter (an all-reduce sliced over its whole group)."""
    full = 1024 * 4
    dot_like = ShardingSpec(((),), ("x", "y"))
    reduce_like = ShardingSpec(((),), ("x", "y"), at_once=True)
    assert [(c.kind, c.axes) for c in reshard(dot_like, spec(("y",)), full, XY, (1024,))] == [
        ("reduce-scatter", ("y",)), ("all-reduce", ("x",))]
    assert [(c.kind, c.axes, c.bytes) for c in reshard(reduce_like, spec(("y",)), full, XY, (1024,))] == [
        ("all-reduce", ("x", "y"), full)]
    assert [(c.kind, c.axes) for c in reshard(reduce_like, spec(("x", "y")), full, XY, (1024,))] == [
        ("reduce-scatter", ("x", "y"))]
    assert [(c.kind, c.axes) for c in reshard(reduce_like, spec(()), full, XY, (1024,))] == [
        ("all-reduce", ("x", "y"))]


def test_partial_sums_are_scattered_only_into_a_dim_that_divides():
    """MoE's expert combine: [G=4, S, D] split 4 ways on G, a partial sum over the other axis,
    read split on that axis. Scattering it into G beside the first would cut 4 groups 8 ways;
    the sums are all-reduced instead and the layout then moves as any other. The contraction is
    long (65536) so that the search keeps the sums' rows on y: on a short one (4096) it gathers
    the operand over y instead, sums into [-, y] and reduce-scatters into G. The weight comes
    first, a parameter (see above)."""
    src = ShardingSpec((("y",), ()), ("x",))
    dst = spec(("x",), ())
    settled = reshard_path(src, dst, 4 * 64 * 4, XY, (4, 64))[0]
    assert settled.spec == spec(("y",), ()) and [c.kind for c in settled.collectives] == ["all-reduce"]
    settled = reshard_path(src, dst, 8 * 64 * 4, XY, (8, 64))[0]
    assert settled.spec == spec(("y", "x"), ()) and [c.kind for c in settled.collectives] == ["reduce-scatter"]

    def f(w, a):
        a = rj.annotate(a, P("y", "x"))
        w = rj.annotate(w, P("x", None))
        return rj.annotate(jnp.tanh(a @ w), P("x", None))

    w = jax.random.normal(jax.random.PRNGKey(1), (65536, 16))
    a = jax.random.normal(jax.random.PRNGKey(0), (4, 65536)) / 256  # sums of order 1: float32 split sums agree
    lowered = rj.parallelize(f, mesh=rj.device_mesh((2, 4), ("x", "y"))).lower(w, a)
    predicted = sorted((c.kind, c.bytes) for c in lowered.plan.collectives)
    compiled = lowered.compile()
    found = sorted((c.kind, c.bytes) for c in compiled.collectives.collectives)
    assert ("all-reduce", 4 * 16 * 4 // 4) in predicted, predicted
    assert found == predicted, (found, predicted)
    assert_same_numbers(jax.jit(f)(w, a), compiled(w, a))


def test_a_partial_sum_read_in_two_layouts_is_settled_once():
    """XLA settles a partial sum once and moves the result to the second layout; the plan prices
    the same (it used to settle it once per layout: twice the reduction, no move)."""
    def f(a, w):
        h = rj.annotate(a, P(None, "y")) @ rj.annotate(w, P("y", None))
        return rj.annotate(jnp.tanh(h), P("y", None)), rj.annotate(jnp.sin(h), P(None, "y"))

    # A contraction long enough that gathering a and w (then no partial sum) costs more.
    a = jax.random.normal(jax.random.PRNGKey(0), (64, 2048)) / 45  # sums of order 1: float32 split sums agree
    w = jax.random.normal(jax.random.PRNGKey(1), (2048, 128))
    lowered = rj.parallelize(f, mesh=rj.device_mesh((2, 4), ("x", "y"))).lower(a, w)
    kinds = [c.kind for c in lowered.plan.collectives]
    assert kinds.count("reduce-scatter") + kinds.count("all-reduce") == 1, kinds
    compiled = lowered.compile()
    found = sorted((c.kind, c.bytes) for c in compiled.collectives.collectives)
    assert found == _as_cpu_compiles(lowered.plan.collectives), (found, lowered.plan.collectives)
    assert_same_numbers(jax.jit(f)(a, w), compiled(a, w))


def test_a_contraction_split_on_two_loops_is_summed_one_loop_at_a_time():
    """A weight gradient with batch split on x and sequence on y, wanted whole: XLA all-reduces
    the full result over one axis, then over the other (not once over both), and the plan prices
    both. (Wanted split on y, XLA slices between the two and the second sums a quarter; the plan
    still prices it in full.) A sequence of 256: on a shorter one (128) gathering the operands
    over y costs less than the second all-reduce, and the plan does that instead."""
    def f(x, dy):
        return rj.annotate(jnp.einsum("bsd,bse->de", rj.annotate(x, P("x", "y", None)),
                                      rj.annotate(dy, P("x", "y", None))), P(None, None))

    x = jax.random.normal(jax.random.PRNGKey(0), (16, 256, 32)) / 64  # sums of order 1: float32 split sums agree
    dy = jax.random.normal(jax.random.PRNGKey(1), (16, 256, 64))
    lowered = rj.parallelize(f, mesh=rj.device_mesh((2, 4), ("x", "y"))).lower(x, dy)
    predicted = _as_cpu_compiles(lowered.plan.collectives)
    assert [k for k, _ in predicted] == ["all-reduce", "all-reduce"], predicted
    compiled = lowered.compile()
    found = sorted((c.kind, c.bytes) for c in compiled.collectives.collectives)
    assert found == predicted, (found, predicted)
    assert_same_numbers(jax.jit(f)(x, dy), compiled(x, dy))


@pytest.mark.parametrize("out", [P(), P("x", None), P(None, "x"), P("y", None), P("y", "x"),
                                 P(("x", "y"), None), P("x", "y")])
def test_a_matmul_with_partial_sums_compiles_as_priced_into_any_layout(out):
    """A matmul whose contraction is split on y, read in `out`: XLA sums the smallest piece it can
    (it slices x in first), and the plan, which splits the matmul's rows or columns on x where
    `out` wants them there, prices the same collectives."""
    def f(a, w):
        return rj.annotate(rj.annotate(a, P(None, "y")) @ rj.annotate(w, P("y", None)), out)

    a = jax.random.normal(jax.random.PRNGKey(0), (64, 256)) / 16
    w = jax.random.normal(jax.random.PRNGKey(1), (256, 128))
    lowered = rj.parallelize(f, mesh=rj.device_mesh((2, 4), ("x", "y"))).lower(a, w)
    compiled = lowered.compile()
    found = sorted((c.kind, c.bytes) for c in compiled.collectives.collectives)
    assert found == _as_cpu_compiles(lowered.plan.collectives), (found, lowered.plan.collectives)
    assert_same_numbers(jax.jit(f)(a, w), compiled(a, w))


@pytest.mark.parametrize("out", [P("x", "y"), P("y", "x"), P(("x", "y"), None), P(None, ("x", "y")),
                                 P("x", None), P(None, "y")])
def test_a_sum_split_over_two_axes_is_settled_one_dim_at_a_time(out):
    """A matmul whose contraction is split on both axes (data parallel on a 2-D mesh: a weight's
    gradient), read in `out`: XLA all-reduces the whole sum once per dim `out` splits on those
    axes (GPT-Medium's gradients, wanted [x, y] by the Adam moments, compiled to two full-size
    all-reduces where one reduce-scatter was priced), slices, and sums the axes `out` does not
    use on the slice. The plan prices the same collectives. A long contraction (4096) into a small
    result, so that settling the sums costs less than gathering the operands."""
    def f(a, w):
        return rj.annotate(rj.annotate(a, P(None, ("x", "y"))) @ rj.annotate(w, P(("x", "y"), None)), out)

    a = jax.random.normal(jax.random.PRNGKey(0), (32, 4096)) / 64  # sums of order 1
    w = jax.random.normal(jax.random.PRNGKey(1), (4096, 64))
    lowered = rj.parallelize(f, mesh=rj.device_mesh((2, 4), ("x", "y"))).lower(a, w)
    kinds = {c.kind for c in lowered.plan.collectives}
    assert kinds <= {"all-reduce", "reduce-scatter"}, lowered.plan.collectives  # settled, not gathered
    compiled = lowered.compile()
    found = sorted((c.kind, c.bytes) for c in compiled.collectives.collectives)
    assert found == _as_cpu_compiles(lowered.plan.collectives), (found, lowered.plan.collectives)
    assert_same_numbers(jax.jit(f)(a, w), compiled(a, w))


def test_a_partial_sum_read_strided_is_settled_then_moved_to_its_stride():
    """MoE's token gradient: a partial sum read at a stride (a reshape splits its dim in two). The
    rewrite pins the settled layout, at maximum stride, so the stride change after it moves data
    (all-to-all, then permute) as from any layout; the plan priced it as free, as if the sum were
    scattered straight into the stride (8 collectives of MoE's 59 missing from its count)."""
    def f(a, w):
        h = jnp.einsum("gdk,ks->gds", rj.annotate(a, P(None, None, "x")), rj.annotate(w, P("x", None)))
        return jnp.tanh(rj.annotate(h.reshape(4, 16, 2, 1024), P(None, None, None, "x")))

    a = jax.random.normal(jax.random.PRNGKey(0), (4, 16, 4096)) / 64  # sums of order 1
    w = jax.random.normal(jax.random.PRNGKey(1), (4096, 2048))
    lowered = rj.parallelize(f, mesh=rj.device_mesh((8,), ("x",))).lower(a, w)
    assert sorted(c.kind for c in lowered.plan.collectives) == ["all-to-all", "collective-permute", "reduce-scatter"]
    compiled = lowered.compile()
    found = sorted((c.kind, c.bytes) for c in compiled.collectives.collectives)
    assert found == _as_cpu_compiles(lowered.plan.collectives), (found, lowered.plan.collectives)
    assert_same_numbers(jax.jit(f)(a, w), compiled(a, w))


def test_a_gather_along_a_minor_dim_prices_the_copy_xla_adds():
    """XLA gathers along the major dim of the buffer (both backends' layout assignment), so a
    gather along dim 2 of [8, 64, 32] leaves a buffer that is copied into the program's layout
    for the step's output: read and written once, 2 x 64 KiB of memory traffic more than the
    gather along dim 0, which needs no copy. The model prices that copy; compiled pricing
    (collectives' own buffers aside) sees it as the bytes the copy moves."""
    from rhino_jax.runtime.compiled.compiled_cost import price_compiled
    from rhino_jax.search.cost.cluster import M8_V100

    topo = topology(d=8)
    shape, full = (8, 64, 32), 8 * 64 * 32 * 4
    (major,) = reshard(spec(("d",), (), ()), spec((), (), ()), full, topo, shape)
    (minor,) = reshard(spec((), (), ("d",)), spec((), (), ()), full, topo, shape)
    assert (major.kind, major.bytes, major.copied) == ("all-gather", full, 0)
    assert (minor.kind, minor.bytes, minor.copied) == ("all-gather", full, full)
    assert minor.copy_time(topo) == 2 * full / topo.memory_bandwidth

    mesh = rj.device_mesh((8,), ("d",))

    def compiled_bytes(pin):
        arg = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, pin))
        compiled = jax.jit(lambda a: a * 3.0, out_shardings=NamedSharding(mesh, P())).lower(arg).compile()
        assert [(c.kind, c.bytes) for c in collective_stats(compiled.as_text()).collectives] == [("all-gather", full)]
        return price_compiled(compiled, M8_V100).bytes_accessed

    assert compiled_bytes(P(None, None, "d")) - compiled_bytes(P("d")) == 2 * minor.copied


def test_a_plan_gathering_along_a_minor_dim_pays_the_copy_in_its_cost():
    """Pinned split on dim 1 and read whole, the value is gathered along a minor dim: the plan's
    predicted compute holds the copy of the gathered [64, 256] buffer."""
    mesh = rj.device_mesh((8,), ("d",))

    def step(split_on):
        def f(a):
            return jnp.tanh(rj.annotate(jnp.sin(rj.annotate(a, split_on)), P()))
        return rj.parallelize(f, mesh=mesh).lower(jnp.ones((64, 256))).plan

    major, minor = step(P("d", None)), step(P(None, "d"))
    assert [(c.kind, c.bytes) for c in minor.collectives] == [(c.kind, c.bytes) for c in major.collectives] == [
        ("all-gather", 64 * 256 * 4)]
    from rhino_jax.search.cost.cluster import M8_V100
    assert minor.cost.compute_s - major.cost.compute_s == pytest.approx(2 * 64 * 256 * 4 / M8_V100.memory_bandwidth)
