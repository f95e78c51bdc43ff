"""Plans an expert would sign where costs tie: no spec names an axis of size 1, a parameter's
optimizer moments share a layout, the solver returns the preferred of tied strategies, and
`explain` says when an alternative is a tie."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rhino_jax as rj
from rhino_jax.search.solvers import ilp
from rhino_jax.core.specs import ShardingSpec
from rhino_jax.search.ties import TIE_S, with_preferences

from helpers import assert_same_numbers


class Block(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.SelfAttention(num_heads=self.heads)(nn.LayerNorm()(x), mask=mask)
        h = nn.gelu(nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x)))
        return x + nn.Dense(x.shape[-1])(h)


class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 64)(tokens)
        for _ in range(2):
            x = Block(4)(x)
        return nn.Dense(64)(nn.LayerNorm()(x))


def _lm():
    model, optimizer = LM(), optax.adamw(1e-3)

    def step(params, opt_state, batch):
        def loss_fn(p):
            logits = model.apply({"params": p}, batch[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    batch = jax.random.randint(jax.random.key(0), (16, 17), 0, 64)
    params = model.init(jax.random.key(1), batch[:, :-1])["params"]
    return step, (params, optimizer.init(params), batch)


def _assert_same_moments_and_loss(step, args, lowered) -> None:
    """One device's numbers, as far as they are determined: Adam's first update scales a gradient
    that is zero up to rounding (the key bias's: softmax ignores it) to a step of about lr,
    whatever the plan, so the parameters are compared through their moments."""
    (_, state, loss), (_, one_state, one_loss) = lowered.compile()(*args), jax.jit(step)(*args)
    assert_same_numbers((one_state, one_loss), (state, loss))


def _specs(lowered) -> dict[str, jax.sharding.NamedSharding]:
    return {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_flatten_with_path(lowered.plan.input_shardings)[0]}


def test_a_pipelined_plan_lays_out_ties_as_a_person_would():
    step, args = _lm()
    lowered = rj.parallelize(step, mesh=rj.device_mesh((2, 4), ("data", "model")), pipeline=2,
                             num_micro_batches=4, progress=False).lower(*args)
    specs = _specs(lowered)
    for name, s in specs.items():  # a stage's sub-mesh has "data" of size 1: no spec names it
        named = [a for entry in s.spec if entry for a in ((entry,) if isinstance(entry, str) else entry)]
        assert all(s.mesh.shape[a] > 1 for a in named), (name, s.spec, dict(s.mesh.shape))
    # Adam's two moments of a parameter are read and written by the same elementwise update:
    # whatever layout that update runs in, they tie, and take one layout.
    moments = {n: (s.spec, specs[n.replace(".mu", ".nu")].spec) for n, s in specs.items() if ".mu" in n}
    assert len(moments) > 20 and all(mu == nu for mu, nu in moments.values()), moments
    _assert_same_moments_and_loss(step, args, lowered)


def test_an_axis_of_size_one_is_named_by_no_spec():
    step, args = _lm()
    lowered = rj.parallelize(step, mesh=rj.device_mesh((8, 1), ("data", "model")), progress=False).lower(*args)
    assert all("model" not in str(s.spec) for s in _specs(lowered).values())
    # a pin that names it pins the same layout without it
    pinned = rj.parallelize(lambda p, o, b: step(p, o, rj.annotate(b, jax.sharding.PartitionSpec(("data", "model")))),
                            mesh=rj.device_mesh((8, 1), ("data", "model")), progress=False).lower(*args)
    _assert_same_moments_and_loss(step, args, pinned)


def test_the_solver_returns_the_preferred_of_tied_strategies():
    # Two groups, each with two strategies of one cost; an edge charges a move between unlike
    # ones. Every solver answer before ranking was a tie; ranked, the split one (less memory),
    # then the one split on its leading dim.
    split0, split1, whole = (ShardingSpec((("x",), ())), ShardingSpec(((), ("x",))), ShardingSpec(((), ())))
    layouts = [split1, whole, split0]
    seen = [[[(b, s)] for b, s in zip((8, 32, 8), layouts)] for _ in range(2)]
    problem = ilp.Problem((np.ones(3), np.ones(3)),
                          (ilp.Edge(0, 1, (0, 1, 2), (0, 1, 2), 1.0 - np.eye(3)),))
    ranked = with_preferences(problem, seen)
    solution = ilp.solve(ranked)
    assert [layouts[j] for j in solution.choice] == [split0, split0]
    assert solution.objective_s == pytest.approx(ilp.evaluate(problem, solution.choice), abs=4 * TIE_S)


def test_explain_says_when_an_alternative_ties():
    # `spare` is carried through the step untouched: every layout of it costs no time, and the
    # plan holds it split 8 ways (of tied layouts, the least memory).
    def step(params, batch):
        loss, grads = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(batch @ w)))(params["w"])
        return {"w": params["w"] - 0.1 * grads, "spare": params["spare"]}, loss

    args = ({"w": jnp.ones((64, 64)) / 8, "spare": jnp.ones((64, 32))}, jnp.ones((16, 64)))
    lowered = rj.parallelize(step, mesh=rj.device_mesh((2, 4), ("data", "model")), progress=False).lower(*args)
    explained = lowered.plan.explain("[0]['spare']", alternatives=8)
    assert explained.layout.shard_factor({"data": 2, "model": 4}) == 8
    tied = [line for line in str(explained).splitlines() if "a tie: the same predicted step" in line]
    assert len(explained.alternatives) == len(tied) == 8, str(explained)
    assert all(a.delta_s == 0 for a in explained.alternatives)
