"""The interlaced pipeline (nnScaler, seeds/002 §4.2; issue 32): `rj.op_assign(where,
stage="all")` runs a T5-like LM's large tied embedding on every device, before the first stage
(the lookup) and after the last (the output projection and the loss), while its blocks are
pipelined on the stages' sub-meshes; the step keeps one device's numbers, and a saved plan
runs as made."""
import jax
import pytest

import rhino_jax as rj
from rhino_jax.errors import StagingError

from benchmarks.third_party_models import tied_lm
from helpers import assert_same_adam_step
from test_constraints import _readme_example

LR = 1e-3  # tied_lm's AdamW
LIMIT = 100 << 20  # the README's: the table, its gradient sum and AdamW's moments (128 MiB) held whole do not fit


@pytest.fixture(scope="module")
def t5():
    case = tied_lm()
    return case, jax.jit(case.step)(*case.args)


def _mesh():
    return rj.device_mesh((2, 4), ("stage", "model"))


def _devices(sharding) -> set[int]:
    return {d.id for d in sharding.device_set}


def test_without_it_the_stager_refuses_the_output_projection(t5):
    case, _ = t5
    with pytest.raises(StagingError, match=r"Embed\.attend.* alone computes .* shares"):
        rj.parallelize(case.step, mesh=_mesh(), pipeline=2, num_micro_batches=4, progress=False).lower(*case.args)


def test_the_embedding_spans_every_device_and_each_block_its_stage(t5, tmp_path):
    """The README's example: the embedding's layout spans all 8 devices, each block's its stage's 4."""
    case, reference = t5
    lowered = _readme_example(4, case.step, _mesh())["step"].lower(*case.args)
    plan = lowered.plan
    stages = [set(st.devices) for st in plan.stages if not st.shared]
    assert [st.shared for st in plan.stages] == [True, False, False, True]  # lookup, 2 stages, projection + loss
    assert len(stages) == 2 and all(len(d) == 4 for d in stages)
    for path, sharding in jax.tree_util.tree_flatten_with_path(plan.input_shardings[0])[0]:
        where = jax.tree_util.keystr(path)
        if "Embed" in where:
            assert _devices(sharding) == set(range(8)), where
            assert sharding.spec != jax.sharding.PartitionSpec(), "the table is split over the devices, to fit"
        elif "Block_" in where:
            assert _devices(sharding) in stages, where
    report = plan.report()
    assert "interlaced with 2 places on every device" in report
    assert "every device before stage 0" in report and "every device after stage 1" in report
    plan.render(tmp_path / "plan.html")
    page = (tmp_path / "plan.html").read_text()
    assert "every device after stage 1" in page and page.count('data-stage="3"') == 2 * 4 + 1  # F, B per micro-batch, A

    schedule = plan.schedule()
    rows = [row.split() for row in schedule.rows()]
    shared = [[w for w in row if "@" in w] for row in rows]
    assert shared[0] == shared[1] and len(shared[0]) == 4 * 4  # every shared task on both stages, in one order
    assert [w for w in rows[0] if "@" not in w] == "F0 F1 B0 F2 B1 F3 B2 B3".split()  # stage 0 keeps 1F1B

    assert_same_adam_step(reference, lowered.compile()(*case.args), lr=LR)
    plan.save(tmp_path / "plan.json")
    again = rj.parallelize(case.step, mesh=_mesh(), pipeline=2,
                           num_micro_batches=4, memory_limit_bytes=LIMIT, plan=str(tmp_path / "plan.json"),
                           progress=False).lower(*case.args)
    assert again.plan.schedule() == schedule and again.plan.placement == plan.placement
    assert_same_adam_step(reference, again.compile()(*case.args), lr=LR)

