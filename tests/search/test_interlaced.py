"""The interlaced pipeline (nnScaler §4.2): `rj.op_assign(where,
stage="all")` runs a T5-like LM's large tied embedding on every device, before the first stage
(the lookup) and after the last (the output projection and the loss), while its blocks are
pipelined on the stages' sub-meshes; the step keeps one device's numbers, and a saved plan
runs as made."""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import rhino_jax as rj
from rhino_jax.errors import StagingError
from rhino_jax.search.staging import stager

from benchmarks.fixtures.third_party_models import tied_lm
from helpers import assert_same_adam_step
from helpers import _readme_example

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


class NormGeluLM(nn.Module):
    """A T5-like LM whose blocks are `Dense(gelu(LayerNorm(x)))`, the norm and the dense of block i
    named `Norm_i` and `Block_i` (scopes of their own, each beside the others), the embedding tied
    to the output projection."""

    vocab: int = 32768
    width: int = 256
    layers: int = 4

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, self.width, name="Embed")
        x = embed(tokens)
        for i in range(self.layers):
            x = x + nn.Dense(self.width, name=f"Block_{i}")(nn.gelu(nn.LayerNorm(name=f"Norm_{i}")(x)))
        return embed.attend(nn.LayerNorm(name=f"Norm_{self.layers}")(x))


@pytest.fixture(scope="module")
def norm_gelu_lm():
    """NormGeluLM's clip + AdamW step on 8 x 16 random tokens, its arguments and one device's result."""
    model = NormGeluLM()
    k1, k2 = jax.random.split(jax.random.PRNGKey(2))
    batch = {"tokens": jax.random.randint(k1, (8, 16), 0, model.vocab, jnp.int32),
             "targets": jax.random.randint(k2, (8, 16), 0, model.vocab, jnp.int32)}
    params = model.init(jax.random.PRNGKey(1), batch["tokens"])["params"]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(LR))

    def step(params, opt_state, batch):
        def loss(p):
            logits = model.apply({"params": p}, batch["tokens"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    args = (params, tx.init(params), batch)
    return step, args, jax.jit(step)(*args)


def _unfolded(layers: tuple[str, ...]) -> set[str]:
    """A stage's layers with the runs `stages.fold` wrote as "Block_2-Block_3" written out."""
    out = set()
    for name in layers:
        run = re.fullmatch(r"(.*?)(\d+)-\1(\d+)", name)
        out |= {f"{run[1]}{i}" for i in range(int(run[2]), int(run[3]) + 1)} if run else {name}
    return out


def test_each_blocks_parameters_and_moments_live_on_the_devices_of_its_stage(norm_gelu_lm):
    """The every-device places hold the embedding's lookup and its projection only (and the loss
    after it, no layer of its own); each block's kernel, bias and Adam moments live on the devices
    of the stage the plan reports the block on, which its programs read them on, also the block
    that opens the second stage (its weight gradient reads an input the first stage made); with
    one device's numbers."""
    step, args, reference = norm_gelu_lm
    lowered = rj.parallelize(step, mesh=_mesh(), pipeline=2, num_micro_batches=4, memory_limit_bytes=LIMIT,
                             constraints=[rj.op_assign("*Embed*", stage="all")], progress=False).lower(*args)
    plan = lowered.plan
    assert [sorted(st.layers) for st in plan.stages if st.shared] == [["Embed"], ["Embed.attend"]]
    stage_of = {layer: set(st.devices) for st in plan.stages if not st.shared for layer in _unfolded(st.layers)}
    assert sorted(stage_of) == [f"{m}_{i}" for m in ("Block", "Norm") for i in range(4)] + ["Norm_4"]
    assert len({frozenset(d) for d in stage_of.values()}) == 2, "both stages hold blocks"
    held = {jax.tree_util.keystr(path): _devices(sharding)
            for path, sharding in jax.tree_util.tree_flatten_with_path(plan.input_shardings[:2])[0]}
    for i in range(4):
        mine = {where: devices for where, devices in held.items() if f"['Block_{i}']" in where}
        assert len(mine) == 2 * 3, mine  # kernel and bias, each with Adam's mu and nu
        assert all(devices == stage_of[f"Block_{i}"] for devices in mine.values()), (i, stage_of, mine)
    assert_same_adam_step(reference, lowered.compile()(*args), lr=LR)


def test_the_every_device_place_takes_no_op_a_stage_can_run():
    """Stage graph: a lookup (shared), four blocks, a projection (shared) and two loss ops. Within
    a quarter of a balanced share only the blocks on every device before the stages and the loss
    on the stages divide it; the blocks stay on the stages instead, the balance relaxed, and the
    loss, which only follows the projection, runs after the last stage beside it."""
    lookup, projection = 0, 5
    graph = stager.StageGraph((0.0, 1.0, 0.2, 0.2, 0.5, 10.0, 3.0, 3.0),
                              tuple((i, i + 1, 100.0 if i == projection else 1.0) for i in range(7)))
    shared = frozenset({lookup, projection})
    with pytest.raises(StagingError):
        stager.stage(graph, 2, 0.25, shared=shared)
    staging = stager.stage(graph, 2, 1.0, shared=shared)
    assert [slot % 2 for i, slot in enumerate(staging.stage) if i not in shared] == [1, 1, 1, 1, 0, 0]
    assert staging.stage[6:] == (4, 4) and staging.stage[projection] == 4
