"""The search's overlapped step (`search.overlap.replay`): a collective on the chain is waited
for where it is made, a parameter's runs ahead from the step's start, a gradient's trails to the
step's end; one link runs them one after another. Exact, on hand-made steps."""
import dataclasses

import pytest

import rhino_jax as rj
from rhino_jax.search.cluster import get_cluster
from rhino_jax.search.combining import HEAD, TAIL
from rhino_jax.search.overlap import AHEAD, BEHIND, CHAIN, Event, how_it_runs, replay


def _k(seconds):
    return Event(seconds)


def _c(index, how):
    return Event(index=index, how=how)


def test_a_collective_on_the_chain_is_waited_for_where_it_is_made():
    assert replay([_k(10), _c(0, CHAIN), _k(10)], [5]) == 25


def test_a_parameters_gather_runs_ahead_behind_the_compute_before_its_reader():
    assert replay([_k(10), _c(0, AHEAD), _k(10)], [5]) == 20  # hidden under the first 10
    assert replay([_c(0, AHEAD), _k(10)], [5]) == 15  # nothing before its reader: exposed


def test_a_gradients_reduction_trails_to_the_steps_end():
    assert replay([_k(10), _c(0, BEHIND), _k(2)], [5]) == 15  # 3 of its 5 exposed at the end
    assert replay([_k(10), _c(0, BEHIND), _k(8)], [5]) == 18  # all hidden


def test_one_link_runs_the_collectives_one_after_another():
    assert replay([_c(0, AHEAD), _c(1, AHEAD), _k(3)], [5, 5]) == 13
    assert replay([_k(4), _c(0, BEHIND), _c(1, CHAIN), _k(1)], [5, 2]) == 12  # the chain's waits behind


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
