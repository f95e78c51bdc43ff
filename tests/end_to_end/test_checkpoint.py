"""Orbax checkpoints of the state a plan produced (a Flax LM with AdamW): saved with
`ocp.StandardCheckpointer`, restored from an abstract state built from `plan.input_shardings`
(each leaf where the step takes it, on the mesh or, for a pipeline, on its stage's sub-mesh), and
trained on with the numbers of one device."""
import jax
import orbax.checkpoint as ocp
import pytest

import rhino_jax as rj
from benchmarks.fixtures.third_party_models import linen_gpt

from helpers import assert_same_adam_step, assert_same_numbers, on_host


def _abstract(state, shardings):
    """The state's shapes and dtypes, each leaf with the sharding the plan takes it in."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)


@pytest.mark.parametrize("layout", ["spmd", "pipeline"])
def test_a_checkpoint_restores_where_the_plan_takes_the_state(layout, tmp_path):
    case = linen_gpt()
    options = {"pipeline": 2, "num_micro_batches": 2} if layout == "pipeline" else {}
    step = rj.parallelize(case.step, mesh=rj.device_mesh((2, 4), ("data", "model")), **options)
    *state, batch = case.args
    plan = step.lower(*case.args).plan
    trained = step(*state, batch)[:2]

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "state", {"params": trained[0], "opt_state": trained[1]})
    checkpointer.wait_until_finished()
    abstract = _abstract({"params": trained[0], "opt_state": trained[1]},
                         {"params": plan.input_shardings[0], "opt_state": plan.input_shardings[1]})
    restored = checkpointer.restore(tmp_path / "state", abstract)
    checkpointer.close()

    restored = (restored["params"], restored["opt_state"])
    assert [x.sharding for x in jax.tree.leaves(restored)] == jax.tree.leaves(plan.input_shardings[:2])
    if layout == "pipeline":  # the stages' parameters on their own sub-meshes, not the whole mesh
        assert len({x.sharding.mesh for x in jax.tree.leaves(restored)}) == 2
    assert_same_numbers(on_host(trained), on_host(restored), rtol=0, atol=0)
    assert_same_adam_step(jax.jit(case.step)(*on_host(restored), batch), step(*restored, batch), lr=1e-3)
