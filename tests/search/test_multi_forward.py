"""Multi-forward steps (nnScaler §4.2's 3F1B): a recycling LM runs its
blocks three times per micro-batch, the first two passes under stop_gradient. Pipelined, each
pass of a block runs on the stage that holds it, the passes of consecutive micro-batches
interleave as Table 7's op_order rules say (the `schedule="1f1b"` of such a step), the step keeps
one device's numbers, and fewer micro-batches' activations are held than under GPipe."""
import jax
import pytest

import rhino_jax as rj
from rhino_jax.errors import ScheduleError
from rhino_jax.hlo_passes.stages import layer_of
from rhino_jax.several_programs import split_step
from rhino_jax.pipelined.staging import _loss_sum
from rhino_jax.runtime import schedules, task_graph
from rhino_jax.runtime.schedules import Task
from rhino_jax.search.staging import multi_forward
from rhino_jax.search.staging.stager import forward_ops

from benchmarks.fixtures.third_party_models import recycling_lm, tied_lm
from helpers import assert_same_adam_step
from helpers import _readme_example

LR = 1e-3  # the case's AdamW
P, M, R = 2, 4, 3  # stages, micro-batches, forward passes


@pytest.fixture(scope="module")
def case():
    c = recycling_lm()
    return c, jax.jit(c.step)(*c.args)


def _mesh():
    return rj.device_mesh((2, 4), ("stage", "model"))


def _readme(c) -> dict:
    """The README's multi-forward example (nnScaler's Table 7 as op_order rules) on `c`."""
    return _readme_example(5, c.step, _mesh())


def _lower(case, **options):
    return rj.parallelize(case.step, mesh=_mesh(), pipeline=P, num_micro_batches=M, progress=False,
                          **options).lower(*case.args)


def _forward(c):
    """The step's compute-gradients graph (one micro-batch) and its forward ops."""
    parallel = rj.parallelize(c.step, mesh=_mesh(), pipeline=P, num_micro_batches=M)
    cg = split_step(parallel.arguments.call(parallel._fn, c.args, {}), parallel.mesh, M, []).compute_graph
    return cg, forward_ops(cg, _loss_sum(cg))


def test_the_passes_are_found_from_the_layers_runs(case):
    cg, forward = _forward(case[0])
    found = multi_forward.find(cg, forward)
    assert found.count == R and found.layers == ("Recycle", "Block_0-Block_3")
    layer = layer_of(cg)
    assert {layer[i] for i in found.tied} == {"Recycle", *(f"Block_{i}" for i in range(4))}  # tied to the last's
    assert all(layer[found.tied[i]] == layer[i] and cg.nodes[found.tied[i]].op == cg.nodes[i].op for i in found.tied)
    assert not {i for i in forward if layer[i] in ("Embed", "head", "ln_f")} & found.earlier


def test_a_tied_embedding_is_not_a_second_pass():
    """The lookup and the output projection of one Embed are two runs of different ops."""
    cg, forward = _forward(tied_lm(vocab=512, width=64, layers=2))
    assert multi_forward.find(cg, forward).count == 1


def test_3f1b_by_op_order_runs_with_one_devices_numbers_and_holds_less_than_gpipe(case, tmp_path):
    c, reference = case
    readme = _readme(c)
    parallel = readme["step"]
    lowered = parallel.lower(*c.args)
    plan = lowered.plan
    # six places: pass r on stage s is place r * P + s; only the last pass runs a backward
    assert len(plan.stages) == R * P
    assert [st.backward is None for st in plan.stages] == [True] * (R - 1) * P + [False] * P
    for st in plan.stages:
        assert set(st.devices) == set(plan.stages[st.stage % P].devices)  # a pass runs on its stage's devices
    blocks = {st.stage % P: set(st.layers) for st in plan.stages[-P:]}
    for path, sharding in jax.tree_util.tree_flatten_with_path(plan.input_shardings[0])[0]:
        where = jax.tree_util.keystr(path)
        home = [s for s, layers in blocks.items() if any(f"'{name}'" in where for name in layers)]
        if home:  # a block's parameters live once, on the stage that runs all its passes
            assert {d.id for d in sharding.device_set} == set(plan.stages[home[0]].devices), where
    assert lowered.schedule.order == _lower(c).schedule.order  # Table 7 is the "1f1b" of a multi-forward step
    held = [st.in_flight for st in plan.stages[-P:]]  # GPipe's would be M each (below)
    assert held == [P - s for s in range(P)] and all(h < M for h in held)
    assert "over 3 forward passes of Recycle, Block_0-Block_3" in plan.report()
    assert "stage 1 pass 0" in plan.report() and "(no backward)" in plan.report()
    assert_same_adam_step(reference, parallel(*c.args), LR)
    plan.save(tmp_path / "plan.json")  # a saved plan replays: the same places and schedule
    again = rj.parallelize(c.step, mesh=_mesh(), pipeline=P, num_micro_batches=M,
                           constraints=[rj.op_order(readme["three_f_one_b"])], plan=str(tmp_path / "plan.json"))
    assert again.lower(*c.args).schedule == lowered.schedule
    assert_same_adam_step(reference, again(*c.args), LR)


def test_multi_forward_schedules_are_checked_and_simulated(case):
    table7 = schedules.ordered(P, M, _readme(case[0])["three_f_one_b"](P, M), passes=R)
    assert table7.order == schedules.make("1f1b", P, M, passes=R).order
    assert table7.in_flight() == (0,) * (R - 1) * P + (2, 1)
    assert schedules.make("gpipe", P, M, passes=R).in_flight() == (0,) * (R - 1) * P + (M, M)
    assert schedules.Schedule.parse("op_order", table7.rows(), M, passes=R) == table7
    graph = task_graph.build(table7)
    assert not [n for n in graph.nodes if n.kind == "backward" and n.stage < (R - 1) * P]
    assert len([n for n in graph.nodes if n.kind == "forward"]) == R * P * M
    with pytest.raises(ScheduleError, match=r"runs schedule 'gpipe' or '1f1b'"):
        schedules.make("eager-1f1b", P, M, passes=R)
    with pytest.raises(ScheduleError, match=r"forward_pass from 0 to 2, only for an F task"):
        schedules.ordered(P, M, [(Task("F", 0, 1, forward_pass=3), Task("B", 0, 0))], passes=R)
    with pytest.raises(ScheduleError, match=r"unable to run"):  # a cycle: pass 1 before pass 0 of one micro-batch
        schedules.ordered(P, M, [(Task("F", 0, 0, forward_pass=1), Task("F", 0, 0, forward_pass=0))], passes=R)
