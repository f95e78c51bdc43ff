"""Cross-mesh resharding ("On Optimizing the Communication of Model Parallelism"): unit tasks,
load-balanced schedules, and execution that is bitwise what jax.device_put gives."""
import itertools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rhino_jax.runtime import resharding as R

from benchmarks.resharding import TABLE_2, table_2_case

@pytest.mark.parametrize("case", sorted(TABLE_2))
def test_table_2_reaches_the_lower_bound_and_never_loses_to_naive(case):
    tasks, hosts = table_2_case(case)
    best, base = R.plan(tasks, hosts), R.naive(tasks, hosts)
    assert best.makespan_s == pytest.approx(best.lower_bound_s)
    assert best.makespan_s <= base.makespan_s + 1e-12
    # No two tasks sharing a host overlap in time, and each sender holds its piece.
    end = [s + hosts.duration(t, hosts.host_of(d)) for t, d, s in zip(best.tasks, best.sender, best.start)]
    for i, j in itertools.combinations(range(len(tasks)), 2):
        hi = {hosts.host_of(best.sender[i])} | {hosts.host_of(r) for r in tasks[i].receivers}
        hj = {hosts.host_of(best.sender[j])} | {hosts.host_of(r) for r in tasks[j].receivers}
        if hi & hj:
            assert end[i] <= best.start[j] + 1e-12 or end[j] <= best.start[i] + 1e-12
    assert all(d in t.senders for t, d in zip(best.tasks, best.sender))


def test_load_balancing_beats_naive_where_senders_can_share_the_work():
    tasks, hosts = table_2_case(3)  # each source host holds half; naive sends to one host at a time
    assert R.plan(tasks, hosts).makespan_s < 0.7 * R.naive(tasks, hosts).makespan_s


def _mesh(ids, shape, names):
    devices = jax.devices()
    return Mesh(np.array([devices[i] for i in ids]).reshape(shape), names)


LAYOUTS = [(P("a"), P("x")), (P(None, "b"), P("x", "y")), (P(), P(("x", "y"))), (P("b", "a"), P("y")),
           (P(("a", "b")), P(None, None, "x"))]


@pytest.mark.parametrize("src_spec,dst_spec", LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_execution_is_bitwise_device_put_and_writes_each_element_once(src_spec, dst_spec, dtype):
    shape = (8, 4, 6)
    x_host = np.random.default_rng(0).normal(size=shape).astype(dtype) * 100
    src = NamedSharding(_mesh([0, 1, 2, 3], (2, 2), ("a", "b")), src_spec)
    dst = NamedSharding(_mesh([4, 5, 6, 7], (2, 2), ("x", "y")), dst_spec)
    x = jax.device_put(x_host, src)
    tasks = R.unit_tasks(R.sharding_map(src, shape), R.sharding_map(dst, shape), x.dtype.itemsize)
    target = R.sharding_map(dst, shape)
    for device, region in target.items():  # the pieces a device receives tile its region exactly
        mine = [t.region for t in tasks if device in t.receivers]
        covered = np.zeros([hi - lo for lo, hi in region], dtype=int)
        for piece in mine:
            covered[tuple(slice(lo - r0, hi - r0) for (lo, hi), (r0, _) in zip(piece, region))] += 1
        assert (covered == 1).all()
    hosts = R.Hosts(lambda d: d.id // 4, 12.5e9, 130e9)
    y = R.reshard(x, dst, R.plan(tasks, hosts))
    expected = jax.device_put(x_host, dst)
    assert y.sharding == dst
    for got, want in zip(sorted(y.addressable_shards, key=lambda s: s.device.id),
                         sorted(expected.addressable_shards, key=lambda s: s.device.id)):
        assert got.device == want.device and got.index == want.index
        assert np.array_equal(np.asarray(got.data), np.asarray(want.data))


def test_block_map_agrees_with_jax_where_sizes_divide():
    devices = np.array(jax.devices()).reshape(2, 4)
    mesh = Mesh(devices, ("a", "b"))
    for dims, spec in (([(0,), ()], P("a")), ([(1, 0), ()], P(("b", "a"))), ([(), (1,)], P(None, "b"))):
        assert R.block_map((8, 8), devices, dims) == R.sharding_map(NamedSharding(mesh, spec), (8, 8))


def test_host_level_tasks_drop_what_receivers_hold_and_merge_by_hosts():
    """Moving 64 rows from 8 devices (8 rows each) to the first 4 (16 each), hosts of 2 devices:
    device 0 holds half of its block already (only the other 8 rows move to it); device 1 gets
    its rows from devices 2 and 3, one host, so those two tasks merge."""
    shape = (64, 4)
    src = NamedSharding(_mesh(range(8), (8,), ("x",)), P("x"))
    dst = NamedSharding(_mesh(range(4), (4,), ("y",)), P("y"))
    tasks = R.unit_tasks(R.sharding_map(src, shape), R.sharding_map(dst, shape), 4)
    hosts = R.Hosts(lambda d: d.id // 2, 1e9, 1e10)
    merged = R.host_level(tasks, hosts)
    assert sum(t.nbytes for t in tasks) == 64 * 4 * 4
    assert sum(t.nbytes for t in merged) == (64 - 8) * 4 * 4
    keys = [({hosts.host_of(d) for d in t.senders}, {hosts.host_of(d) for d in t.receivers}) for t in merged]
    assert sorted((sorted(a), sorted(b)) for a, b in keys) == [([0], [0]), ([1], [0]), ([2], [1]), ([3], [1])]


@pytest.mark.parametrize("src_spec,dst_spec", [(P("a"), P(None, "b")), (P(("a", "b")), P("b", "a")), (P(), P("b"))])
def test_moves_between_the_whole_mesh_and_its_stages_equal_device_put(src_spec, dst_spec):
    """The SPMD programs that move arrays between processes (`runtime.transfer`) give what
    jax.device_put gives: whole mesh → a stage, a stage → another, a stage → the whole mesh."""
    from rhino_jax.runtime import transfer

    whole = _mesh(range(8), (4, 2), ("a", "b"))
    stages = [Mesh(whole.devices[2 * s:2 * s + 2], ("a", "b")) for s in range(2)]
    x = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(whole, src_spec))
    on_one = transfer.to_stage(x, whole, 2, 1, NamedSharding(stages[1], dst_spec))
    assert on_one.sharding == NamedSharding(stages[1], dst_spec)
    np.testing.assert_array_equal(np.asarray(on_one), np.asarray(x))
    on_zero = transfer.from_stage(on_one, whole, 2, 1, NamedSharding(stages[0], src_spec))
    back = transfer.from_stage(on_zero, whole, 2, 0, NamedSharding(whole, dst_spec))
    for moved, sharding in [(on_zero, NamedSharding(stages[0], src_spec)), (back, NamedSharding(whole, dst_spec))]:
        want = jax.device_put(x, sharding)
        assert moved.sharding == sharding
        for a, b in zip(moved.addressable_shards, want.addressable_shards):
            assert a.device == b.device and a.index == b.index
            np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
