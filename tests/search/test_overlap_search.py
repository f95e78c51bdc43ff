"""The search's overlapped step (`search.overlap.replay`): compute waits for a collective where
it reads its result; a collective on the chain starts where it is made, a parameter's runs ahead
from the step's start, a gradient's trails behind its maker; one link runs them one after
another. Exact, on hand-made steps."""
import dataclasses

import jax
import pytest

import rhino_jax as rj
from rhino_jax.search.cost.cluster import get_cluster
from rhino_jax.search.cost.combining import HEAD, TAIL
from rhino_jax.search.cost.overlap import AHEAD, BEHIND, CHAIN, Event, exposure, how_it_runs, issued, replay


def _k(seconds, reads=()):
    return Event(seconds, reads=reads)


def _c(index, how):
    return Event(index=index, how=how)


def test_a_collective_on_the_chain_is_waited_for_where_it_is_read():
    assert replay([_k(10), _c(0, CHAIN), _k(10, reads=(0,))], [5]) == 25


def test_a_collective_on_the_chain_hides_behind_the_independent_compute_before_its_reader():
    # a layer's input gradient reduced while its weight gradient (3 s) is computed: 3 of 5 hidden
    assert replay([_k(10), _c(0, CHAIN), _k(3), _k(10, reads=(0,))], [5]) == 25
    assert replay([_k(10), _c(0, CHAIN), _k(6), _k(10, reads=(0,))], [5]) == 26  # all hidden


def test_compute_that_reads_nothing_pending_runs_while_the_next_waits():
    """A list scheduler's order: the input gradient's reader waits for its reduction, and the
    weight gradient, later in program order but made from what has run, goes first."""
    made = Event(10, unit=0)
    reader, weight_grad = Event(5, reads=(0,), unit=1, after=(0,)), Event(3, unit=2, after=(0,))
    assert replay([made, _c(0, CHAIN), reader, weight_grad], [4]) == 19  # 10, 3 beside the 4, 5
    # one that needs the waiting event's result waits with it
    needs_reader = Event(3, unit=2, after=(1,))
    assert replay([made, _c(0, CHAIN), reader, needs_reader], [4]) == 22
    # one that reads a collective of the waiting event's result waits for both
    of_reader = Event(index=1, how=BEHIND, after=(1,))
    assert replay([made, _c(0, CHAIN), reader, of_reader, Event(3, reads=(1,), unit=2, after=(0,))], [4, 1]) == 23


def test_a_reader_of_a_combined_ops_first_member_waits_for_the_op():
    """Two gradients' reductions combined into one op, issued once the second is made: the
    first's reader, earlier in program order, runs after it, and what does not read it before."""
    first, second = Event(10, unit=0), Event(10, unit=1)
    reader, other = Event(2, reads=(0,), unit=2, after=(0,)), Event(5, unit=3, after=(0,))
    events = [first, Event(index=0, how=BEHIND, after=(0,)), reader, other, second,
              Event(index=1, how=BEHIND, after=(1,)), Event(1, unit=4, after=(1,))]
    kept, seconds = issued(events, [([0, 1], 6.0)])
    assert kept[1] == Event(2, reads=(1,), unit=2, after=(0,)) and kept[4].after == (0, 1)
    assert replay(kept, seconds) == 10 + 5 + 10 + 1 + 5 + 2  # the op from 25 to 31, read at 31


def test_a_parameters_gather_runs_ahead_behind_the_compute_before_its_reader():
    assert replay([_k(10), _c(0, AHEAD), _k(10, reads=(0,))], [5]) == 20  # hidden under the first 10
    assert replay([_c(0, AHEAD), _k(10, reads=(0,))], [5]) == 15  # nothing before its reader: exposed


def test_a_gradients_reduction_trails_to_the_steps_end():
    assert replay([_k(10), _c(0, BEHIND), _k(2)], [5]) == 15  # 3 of its 5 exposed at the end
    assert replay([_k(10), _c(0, BEHIND), _k(8)], [5]) == 18  # all hidden
    assert replay([_k(10), _c(0, BEHIND), _k(2, reads=(0,)), _k(6)], [5]) == 23  # read at once: waited for


def test_one_link_runs_the_collectives_one_after_another():
    assert replay([_c(0, AHEAD), _c(1, AHEAD), _k(3, reads=(0, 1))], [5, 5]) == 13
    assert replay([_k(4), _c(0, BEHIND), _c(1, CHAIN), _k(1, reads=(1,))], [5, 2]) == 12  # the chain's waits behind


def test_each_wait_is_the_exposure_of_the_collectives_on_the_link_meanwhile():
    """What the overlap rounds price off the chain at: each collective's part of the waits."""
    assert exposure([_k(10), _c(0, CHAIN), _k(10, reads=(0,))], [5]) == (25, {0: 5})
    assert exposure([_k(10), _c(0, BEHIND), _k(2)], [5]) == (15, {0: 3})  # the end waits for 3 of it
    assert exposure([_k(10), _c(0, BEHIND), _k(8)], [5]) == (18, {})
    # the chain's collective queued behind a gradient's: its reader waits for both (less what compute ran beside)
    assert exposure([_k(4), _c(0, BEHIND), _c(1, CHAIN), _k(1, reads=(1,))], [5, 2]) == (12, {0: 5, 1: 2})
    assert exposure([_k(4), _c(0, BEHIND), _k(2), _c(1, CHAIN), _k(1, reads=(1,))], [5, 2]) == (12, {0: 3, 1: 2})
    # a loop's trip ends once its collectives are done: each trip's wait
    body = [Event(4, trips=2, unit=0), Event(index=0, how=BEHIND, trips=2, trip=0),
            Event(index=1, how=BEHIND, trips=2, trip=1)]
    assert exposure(body, [3, 3]) == (2 * (2 + 3), {0: 3, 1: 3})


def test_a_combined_reduction_is_issued_at_its_last_member():
    # two gradients' reductions combined into one op of 6 s: it exists once the second is made
    events = [_k(10), _c(0, BEHIND), _k(10), _c(1, BEHIND), _k(1)]
    kept, seconds = issued(events, [([0, 1], 6.0)])
    assert kept == [_k(10), _k(10), _c(1, BEHIND), _k(1)] and seconds == [0.0, 6.0]
    assert replay(kept, seconds) == 26  # 5 of its 6 exposed at the end
    assert replay(events, [3.0, 3.0]) == 23  # issued member by member, the first hid behind 10
    # a reader of the first member's result reads the op's: it waits for the whole op
    kept, seconds = issued(events[:-1] + [_k(1, reads=(0,))], [([0, 1], 6.0)])
    assert kept[-1] == _k(1, reads=(1,)) and replay(kept, seconds) == 27


def test_the_kernels_xla_adds_around_a_combined_op_run_on_the_compute_stream_before_it():
    # the op's concatenation and slices (2 s) run just before it is issued: 2 s more compute,
    # and the op starts 2 s later
    events = [_k(10), _c(0, BEHIND), _k(10), _c(1, BEHIND), _k(1)]
    kept, seconds = issued(events, [([0, 1], 6.0)], [2.0])
    assert kept == [_k(10), _k(10), _k(2.0), _c(1, BEHIND), _k(1)]
    assert replay(kept, seconds) == 28  # 5 of its 6 exposed at the end, after 23 of compute


def test_a_combined_gather_run_ahead_is_issued_before_its_first_reader():
    events = [_k(4), _c(0, AHEAD), _k(10, reads=(0,)), _c(1, AHEAD), _k(10, reads=(1,))]
    kept, seconds = issued(events, [([0, 1], 6.0)])
    assert kept == [_k(4), _c(0, AHEAD), _k(10, reads=(0,)), _k(10, reads=(0,))] and seconds == [6.0, 0.0]
    assert replay(kept, seconds) == 26  # the first reader waits 2 s


@pytest.mark.parametrize("combinable,side,how", [(False, HEAD, CHAIN), (True, HEAD, AHEAD), (True, TAIL, BEHIND),
                                                 (True, None, BEHIND)])
def test_how_a_collective_runs_follows_its_side_of_the_chain(combinable, side, how):
    assert how_it_runs(combinable, side) == how


def test_a_plan_priced_with_overlap_hides_what_its_replay_hides():
    """A data-parallel MLP on the GPU preset: its gradients' all-reduce trails behind the
    backward pass; the plan's step is its replay, less than compute + communication, and the
    same plan searched with no overlap hides nothing."""
    from rhino_jax.models import make_mlp_train_step, mlp_example
    step, args = make_mlp_train_step(), mlp_example((64, 512, 512, 512, 64), 32768, abstract=True)
    mesh = rj.device_mesh((8,), ("data",))
    overlapped = rj.parallelize(step, mesh=mesh, cluster="8x-h100").lower(*args).plan.cost
    serial = rj.parallelize(step, mesh=mesh, cluster=dataclasses.replace(get_cluster("8x-h100"), overlap=0.0)
                            ).lower(*args).plan.cost
    assert serial.hidden_s == 0 and serial.total_s == pytest.approx(serial.compute_s + serial.comm_s)
    assert 0 < overlapped.hidden_s <= min(overlapped.compute_s, overlapped.comm_s)
    assert overlapped.total_s == pytest.approx(overlapped.compute_s + overlapped.comm_s - overlapped.hidden_s)
    assert overlapped.total_s < serial.total_s


def _body(seconds, trips, reads=()):
    return Event(seconds, trips=trips, reads=reads)


def _in_trip(index, how, trip, trips):
    return Event(index=index, how=how, trip=trip, trips=trips)


def test_a_loops_collective_hides_only_behind_its_own_trip():
    """Two trips of 10 s of compute, each ending in a gradient's 4 s reduction: each trip waits
    for its own (the next trip does not run beside it), where outside a loop the second would
    trail behind what follows."""
    body = [_body(20, 2), _in_trip(0, BEHIND, 0, 2), _in_trip(1, BEHIND, 1, 2)]
    assert replay(body + [_k(10)], [4, 4]) == 38  # 10 + 4, 10 + 4, then 10
    flat = [_k(10), _c(0, BEHIND), _k(10), _c(1, BEHIND), _k(10)]
    assert replay(flat, [4, 4]) == 30  # both hidden


def test_a_loops_gather_starts_with_its_trip():
    """A parameter's gather in a loop's body cannot run ahead of its trip: it hides behind the
    trip's compute before its reader, not behind the compute before the loop."""
    body = [_body(0, 2), _in_trip(0, AHEAD, 0, 2), _in_trip(1, AHEAD, 1, 2), _body(20, 2, reads=(0, 1))]
    assert replay([_k(10)] + body, [4, 4]) == 38  # each trip waits 4 s for its gather
    flat = [_k(10), _c(0, AHEAD), _k(10, reads=(0,)), _c(1, AHEAD), _k(10, reads=(1,))]
    assert replay(flat, [4, 4]) == 30


def test_a_collective_of_a_value_made_outside_the_loop_runs_once_before_it():
    """A reshard read in the body of a value made before the loop (trips 1) runs once, before
    the loop: the body is not cut in two around it."""
    body = [_body(10, 2), _c(0, CHAIN), _body(10, 2, reads=(0,))]
    assert replay(body, [3]) == 20  # 3 before the loop, hidden behind the first trip's first 5
    assert replay([_body(2, 2), _c(0, CHAIN), _body(10, 2, reads=(0,))], [3]) == 14  # 1, 2 waited, 5; then 1 + 5


def test_a_loops_reduction_read_in_its_trip_is_waited_for_there():
    """A layer's gradient reduced in a scan's body and written into the stacked gradients in
    the same trip: the write waits for it, where unread it would hide behind the rest of the
    trip."""
    reduce = [_in_trip(0, BEHIND, 0, 2), _in_trip(1, BEHIND, 1, 2)]
    assert replay([_body(20, 2)] + reduce + [_body(8, 2, reads=(0, 1))], [4, 4]) == 36  # 10, 4, 4; twice
    assert replay([_body(20, 2)] + reduce + [_body(8, 2)], [4, 4]) == 28


def test_a_plan_with_nothing_off_the_chain_is_searched_once(monkeypatch):
    """An optimizer's update alone has no compute chain, so nothing it moves can hide behind
    compute: a share of overlap prices its plans alike, and the search does not run again to
    price them at another (an apply-gradients program of a 70B Llama: a search of 4 s each)."""
    import jax.numpy as jnp
    import numpy as np

    from rhino_jax.search import planner
    calls = []
    search = planner._search
    monkeypatch.setattr(planner, "_search", lambda *a, **k: calls.append(1) or search(*a, **k))

    def apply(params, grads):
        return jax.tree.map(lambda p, g: p - 0.1 * g * jnp.tanh(p), params, grads)

    params = {f"w{i}": np.ones((64, 32), np.float32) for i in range(3)}
    plan = rj.parallelize(apply, mesh=rj.device_mesh((8,), ("data",)), cluster="8x-h100").lower(params, params).plan
    assert plan.cost.off_chain_comm_s == 0 and len(calls) == 1
