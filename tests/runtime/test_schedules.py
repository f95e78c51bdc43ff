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
            # eager-1F1B: "On Optimizing the Communication of Model Parallelism" §4
            "eager-1f1b": lambda st: min(2 * (stages - st) - 1, micro_batches)}[name]
    assert s.in_flight() == tuple(held(st) for st in range(stages))


def test_without_transfers_the_three_schedules_take_the_same_time_and_eager_hides_transfers():
    p, m = 4, 8
    times = {name: schedules.make(name, p, m).makespan([1.0] * p, [2.0] * p) for name in schedules.NAMES}
    assert set(times.values()) == {(m + p - 1) * 3.0}
    slow = {name: schedules.make(name, p, m).makespan([1.0] * p, [2.0] * p, transfer_s=0.5)
            for name in schedules.NAMES}
    # "On Optimizing the Communication of Model Parallelism" §4: 1F1B cannot hide a transfer (each
    # task waits on the last), eager-1F1B can.
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


def _warm_up_rule(warm_up):
    """nnScaler's Table 4 with stage s's warm-up w(p, m, s): ① F(k) before F(k+1), ② B(k) before
    B(k+1), ③ F(k+w-1) before B(k), ④ B(k) before F(k+w)."""
    def rule(p, m):
        for s in range(p):
            w = min(warm_up(p, m, s), m)
            for k in range(m - 1):
                yield Task("F", s, k), Task("F", s, k + 1)
                yield Task("B", s, k), Task("B", s, k + 1)
            for k in range(m - w + 1):
                yield Task("F", s, k + w - 1), Task("B", s, k)
            for k in range(m - w):
                yield Task("B", s, k), Task("F", s, k + w)
    return rule


ORDERING = {"1f1b": _warm_up_rule(lambda p, m, s: p - s),
            "gpipe": _warm_up_rule(lambda p, m, s: m),
            "eager-1f1b": _warm_up_rule(lambda p, m, s: 2 * (p - s) - 1)}


@pytest.mark.parametrize("name", schedules.NAMES)
@pytest.mark.parametrize("stages,micro_batches", SHAPES)
def test_the_three_schedules_written_as_ordering_constraints_come_out_as_made(name, stages, micro_batches):
    derived = schedules.ordered(stages, micro_batches, ORDERING[name](stages, micro_batches), name=name)
    assert derived == schedules.make(name, stages, micro_batches)
    assert schedules.Schedule.parse(name, derived.rows(), micro_batches) == derived


def test_where_the_constraints_leave_a_choice_the_task_that_can_start_first_runs():
    """Only "forwards in order, backwards in order": each stage runs what it can as early as it
    can, a checked schedule that is never slower than GPipe and holds fewer micro-batches (the
    later stages start their backwards as soon as they can)."""
    p, m = 3, 6
    rule = [(Task(kind, s, k), Task(kind, s, k + 1)) for s in range(p) for k in range(m - 1) for kind in "FB"]
    free = schedules.ordered(p, m, rule)
    gpipe = schedules.make("gpipe", p, m)
    assert free.makespan([1.0] * p, [2.0] * p) <= gpipe.makespan([1.0] * p, [2.0] * p)
    assert sum(free.in_flight()) < sum(gpipe.in_flight())


def test_bad_ordering_constraints_are_refused():
    with pytest.raises(ScheduleError, match="B0@0 before F0@0|unable to run"):
        schedules.ordered(2, 2, [(Task("B", 0, 0), Task("F", 0, 0))])  # against F before B: a cycle
    with pytest.raises(ScheduleError, match="orders tasks of two stages"):
        schedules.ordered(2, 2, [(Task("F", 0, 0), Task("F", 1, 0))])
    with pytest.raises(ScheduleError, match="F5@0 is not a task of 2 stages and 2 micro-batches"):
        schedules.ordered(2, 2, [(Task("F", 0, 5), Task("F", 0, 0))])
    with pytest.raises(ScheduleError, match="a pair"):
        schedules.ordered(2, 2, [("F0", "F1")])
    # Stage 0 finishes micro-batch 0 first, stage 1 insists on micro-batch 1 first: each waits.
    stuck = [(Task("B", 0, 0), Task("F", 0, 1)), (Task("B", 1, 1), Task("F", 1, 0))]
    with pytest.raises(ScheduleError, match="unable to run"):
        schedules.ordered(2, 2, stuck)


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


@pytest.mark.parametrize("name", schedules.NAMES)
def test_an_interlaced_schedule_runs_every_device_task_on_every_stage_and_keeps_each_stage_order(name):
    """nnScaler's interlaced pipeline: places 0 and 3 (an embedding before 2 stages and its tied
    projection after them) run on every device. Each stage keeps its schedule's order; a shared
    task is in every stage's row, in one order, and overlaps no other task; the rows load back."""
    base = schedules.make(name, 2, 4)
    times = {0: (0.1, 0.2), 1: (1.0, 2.0), 2: (1.0, 2.0), 3: (0.5, 1.0)}  # place → (forward, backward)
    s = schedules.interlace(base, (0, 3), lambda t: times[t.stage][t.kind == "B"], transfer_s=0.05)
    assert s.groups() == (1, 2) and s.stages == 4
    for g, row, own in zip(s.groups(), s.order, base.order):
        assert [(t.kind, t.micro_batch) for t in row if t.stage == g] == [(t.kind, t.micro_batch) for t in own]
    assert [t for t in s.order[0] if t.stage in (0, 3)] == [t for t in s.order[1] if t.stage in (0, 3)]
    timeline = s.timeline(lambda t: times[t.stage][t.kind == "B"], transfer_s=0.05)
    for t, (start, end) in timeline.items():
        if t.stage in (0, 3):
            assert not any(u != t and u_start < end and start < u_end for u, (u_start, u_end) in timeline.items())
        for need in s.needs(t):
            assert start >= timeline[need][1] + (0.05 if need.stage != t.stage else 0.0) - 1e-12
    busy = sum(sum(times[x]) for x in (0, 3, 1)) * 4  # one stage's devices: its tasks and every shared one
    assert s.makespan([f for f, _ in times.values()], [b for _, b in times.values()], 0.05) >= busy
    assert schedules.Schedule.parse(name, s.rows(), 4, (0, 3)) == s
    if name != "gpipe":  # 1F1B's: the projection's backward follows its forward at once
        assert s.in_flight()[3] == 1


def test_shared_tasks_in_two_orders_deadlock_and_the_task_graph_follows_the_rows():
    s = schedules.interlace(schedules.make("1f1b", 2, 2), (0,), lambda t: 1.0)
    first = [t for t in s.order[0] if t.stage == 0]
    swapped = tuple(first[1] if t == first[0] else first[0] if t == first[1] else t for t in s.order[0])
    with pytest.raises(ScheduleError, match="deadlock"):
        dataclasses.replace(s, order=(swapped,) + s.order[1:]).check()
    order = task_graph.build(s).order()
    for g, row in zip(s.groups(), s.order):
        ran = [n.name for n in order if n.kind in ("forward", "backward") and n.name in {str(t) for t in row}]
        assert ran == [str(t) for t in row]
