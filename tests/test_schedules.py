"""Pipeline schedules and task graphs as data: checked before they run."""
import dataclasses

import networkx as nx
import pytest

from rhino_jax.errors import ScheduleError
from rhino_jax.runtime import schedules, task_graph
from rhino_jax.runtime.schedules import Task

SHAPES = [(1, 1), (1, 4), (2, 6), (4, 2), (4, 8), (8, 16)]


@pytest.mark.parametrize("name", schedules.NAMES)
@pytest.mark.parametrize("stages,micro_batches", SHAPES)
def test_every_task_once_forward_before_backward_and_in_flight_as_the_papers_say(name, stages, micro_batches):
    s = schedules.make(name, stages, micro_batches)
    for stage, tasks in enumerate(s.order):
        assert sorted(tasks) == sorted(Task(k, stage, b) for k in "FB" for b in range(micro_batches))
        assert all(tasks.index(Task("F", stage, b)) < tasks.index(Task("B", stage, b)) for b in range(micro_batches))
    held = {"gpipe": lambda st: micro_batches,  # every forward first
            "1f1b": lambda st: min(stages - st, micro_batches),  # PipeDream-Flush / Rhino §6.2
            "eager-1f1b": lambda st: min(2 * (stages - st) - 1, micro_batches)}[name]  # seeds/004 §4
    assert s.in_flight() == tuple(held(st) for st in range(stages))


def test_without_transfers_the_three_schedules_take_the_same_time_and_eager_hides_transfers():
    p, m = 4, 8
    times = {name: schedules.make(name, p, m).makespan([1.0] * p, [2.0] * p) for name in schedules.NAMES}
    assert set(times.values()) == {(m + p - 1) * 3.0}
    slow = {name: schedules.make(name, p, m).makespan([1.0] * p, [2.0] * p, transfer_s=0.5)
            for name in schedules.NAMES}
    # seeds/004 §4: 1F1B cannot hide a transfer (each task waits on the last), eager-1F1B can.
    assert slow["eager-1f1b"] < slow["1f1b"]


def test_a_broken_schedule_is_refused():
    s = schedules.make("1f1b", 2, 2)
    swapped = (tuple(reversed(s.order[0])),) + s.order[1:]  # B1 first on stage 0
    with pytest.raises(ScheduleError, match="runs B"):
        dataclasses.replace(s, order=swapped).check()
    with pytest.raises(ScheduleError, match="missing"):
        dataclasses.replace(s, order=(s.order[0][1:],) + s.order[1:]).check()
    # Stage 1 insists on micro-batch 1 first, stage 0 on finishing micro-batch 0 first: each waits.
    stuck = ((Task("F", 0, 0), Task("B", 0, 0), Task("F", 0, 1), Task("B", 0, 1)),
             (Task("F", 1, 1), Task("B", 1, 1), Task("F", 1, 0), Task("B", 1, 0)))
    with pytest.raises(ScheduleError, match="deadlock"):
        dataclasses.replace(s, order=stuck).check()
    with pytest.raises(ScheduleError, match="unknown schedule"):
        schedules.make("interleaved", 2, 2)
    with pytest.raises(ScheduleError, match="at least one"):
        schedules.make("1f1b", 2, 0)


@pytest.mark.parametrize("name", schedules.NAMES)
def test_the_task_graph_holds_every_task_and_its_order_runs_the_schedule(name):
    p, m = 3, 4
    s = schedules.make(name, p, m)
    g = task_graph.build(s)
    kinds = [n.kind for n in g.nodes]
    assert kinds.count("forward") == kinds.count("backward") == p * m
    assert kinds.count("send") == kinds.count("recv") == 2 * (p - 1) * m  # activations and gradients
    assert kinds.count("accumulate") == p * m and kinds.count("apply") == 1
    order = g.order()
    assert order[0].name == "source" and order[-1].name == "sink"
    for stage, tasks in enumerate(s.order):  # each stage runs its tasks in the schedule's order
        ran = [n.name for n in order if n.stage == stage and n.kind in ("forward", "backward")]
        assert ran == [str(t) for t in tasks]
    digraph = nx.DiGraph(list(g.edges))
    apply = g.index("apply")
    assert all(nx.has_path(digraph, g.index(f"accumulate {k}@{j}"), apply) for k in range(m) for j in range(p))
    dot = g.to_dot()
    assert dot.startswith(f'digraph "{name}"') and "style=dashed" in dot and dot.count("->") == len(g.edges)


def test_pure_spmd_is_compute_then_apply():
    """Rhino Fig. 6(a): one stage, one micro-batch: no transfers and no accumulation."""
    g = task_graph.build(schedules.make("1f1b", 1, 1))
    assert [n.kind for n in g.order()] == ["source", "forward", "backward", "apply", "sink"]
