"""State that a training loop feeds back leaves the program in the layout it came in, donated or
not, and one step always gets one plan."""
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import rhino_jax as rj
from rhino_jax.hlo_passes.importer import import_module
from rhino_jax.hlo_passes.lowering import lower_on_mesh

from helpers import assert_same_numbers

BATCH, SEQ = 8, 16
VOCAB, WIDTH = 512, 256


class MlpLM(nn.Module):
    """Embedding, one residual MLP block, LM head: every parameter gets a real gradient (an
    attention's key bias would not, and Adam would scale its rounding noise into the update)."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, WIDTH)(tokens)
        x = x + nn.Dense(WIDTH)(nn.gelu(nn.Dense(2 * WIDTH)(nn.LayerNorm()(x))))
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


class AttentionLM(nn.Module):
    """Two pre-LN transformer blocks, vocabulary 64, width 32 (only searched, never run)."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 32)(tokens)
        for _ in range(2):
            x = x + nn.MultiHeadDotProductAttention(num_heads=4, deterministic=True)(nn.LayerNorm()(x))
            x = x + nn.Dense(32)(nn.gelu(nn.Dense(128)(nn.LayerNorm()(x))))
        return nn.Dense(64)(nn.LayerNorm()(x))


def _tokens(seed: int, vocab: int = VOCAB):
    return jax.random.randint(jax.random.PRNGKey(seed), (BATCH, SEQ), 0, vocab)


def _pinned(params):
    """The embedding split over 'model' by the user (`rj.annotate`): a model this small is fastest
    replicated, and state that stays replicated would check nothing. The rest is the search's."""
    embed = dict(params["Embed_0"], embedding=rj.annotate(params["Embed_0"]["embedding"], P("model", None)))
    return dict(params, Embed_0=embed)


def _loss(model, params, tokens):
    logits = model.apply({"params": params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def _adamw_setup(model, vocab: int = VOCAB, pin: bool = False):
    params = model.init(jax.random.PRNGKey(0), _tokens(0, vocab))["params"]
    tx = optax.adamw(1e-3)

    def step(params, opt_state, tokens):
        params = _pinned(params) if pin else params
        loss, grads = jax.value_and_grad(lambda p: _loss(model, p, tokens))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), _tokens(1, vocab))


def _mesh():
    return rj.device_mesh((2, 4), ("data", "model"))


def _same_path_pairs(lowered) -> list[tuple[int, int]]:
    """(output, argument) pairs at the same path under the same result/argument index, with the
    same shape and dtype: what a loop of step(params, opt_state, batch) feeds back."""
    graph = lowered.graph
    leaf = lambda v: (graph.values[v].shape, graph.values[v].dtype)  # noqa: E731
    args = {(a.path[len("arg"):],) + leaf(a.value): a.index for a in graph.args}
    return [(k, args[key]) for k, (path, v) in enumerate(zip(graph.output_paths, graph.outputs))
            if (key := (path[len("out"):],) + leaf(v)) in args]


def test_undonated_params_and_adamw_state_leave_in_their_input_layout():
    step, args = _adamw_setup(MlpLM(), pin=True)
    parallel = rj.parallelize(step, mesh=_mesh())
    lowered = parallel.lower(*args)
    plan = lowered.plan
    fed = _same_path_pairs(lowered)
    assert len(fed) == len(jax.tree.leaves(args[:2]))  # every parameter and optimizer state
    assert any(plan.arg_specs[i].shard_factor(plan.mesh_axes) > 1 for _, i in fed), "nothing sharded: no check"
    for k, i in fed:
        assert plan.output_specs[k] == plan.arg_specs[i], (plan.output_paths[k], plan.arg_specs[i],
                                                           plan.output_specs[k])

    compiled = lowered.compile()
    ins = jax.tree.leaves(compiled.input_shardings)
    outs = jax.tree.leaves(compiled.output_shardings)
    leaves = jax.tree.leaves(args)
    for k, i in fed:
        assert outs[k].is_equivalent_to(ins[i], leaves[i].ndim), plan.output_paths[k]

    reference = jax.jit(step)(*args)
    result = compiled(*args)
    assert_same_numbers(reference, result)

    # The next step takes the results as they are: no reshard outside the program.
    wanted, got = jax.tree.leaves(plan.input_shardings), jax.tree.leaves(result)
    for k, i in fed:
        assert got[k].sharding.is_equivalent_to(wanted[i], got[k].ndim), plan.output_paths[k]
    batch = _tokens(2)
    assert_same_numbers(jax.jit(step)(reference[0], reference[1], batch), parallel(result[0], result[1], batch))


def test_train_state_and_metrics_step_keeps_the_state_layout():
    """step(state, batch) -> (state, metrics), with flax's TrainState (step count, params, adamw)."""
    model = MlpLM()
    params = model.init(jax.random.PRNGKey(0), _tokens(0))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))

    def step(state, tokens):
        state = state.replace(params=_pinned(state.params))
        loss, grads = jax.value_and_grad(lambda p: _loss(model, p, tokens))(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    args = (state, _tokens(1))
    lowered = rj.parallelize(step, mesh=_mesh()).lower(*args)
    plan = lowered.plan
    fed = _same_path_pairs(lowered)
    assert len(fed) == len(jax.tree.leaves(state))  # the step count, parameters and adamw state
    assert any(plan.arg_specs[i].shard_factor(plan.mesh_axes) > 1 for _, i in fed), "nothing sharded: no check"
    assert [plan.output_specs[k] for k, _ in fed] == [plan.arg_specs[i] for _, i in fed]
    result = lowered.compile()(*args)
    assert_same_numbers(jax.jit(step)(*args), result)


def _graph(fn, args, donate=()):
    lowered = lower_on_mesh(fn, args, _mesh(), donate)
    return import_module(lowered.module, lowered.arg_paths, lowered.arg_roles, lowered.output_paths)


def test_fed_back_matches_whole_subtrees_at_another_index_or_as_the_whole_result():
    params = {"w": jnp.ones((8, 4)), "b": jnp.ones((4,))}
    opt = {"m": jnp.ones((8, 4)), "v": jnp.ones((8, 4))}
    batch = jnp.ones((16, 8))

    def update(params, opt, batch):
        g = jax.grad(lambda p: jnp.sum(jnp.tanh(batch @ p["w"] + p["b"])))(params)
        m = 0.9 * opt["m"] + g["w"]
        return {"w": params["w"] - m, "b": params["b"] - g["b"]}, {"m": m, "v": opt["v"] + g["w"] ** 2}

    def loss_first(params, opt, batch):  # the loss first: out[1] feeds arg 0, out[2] feeds arg 1
        new, new_opt = update(params, opt, batch)
        return jnp.sum(new["w"]), new, new_opt

    graph = _graph(loss_first, (params, opt, batch))
    fed = {graph.output_paths[k]: graph.args[i].path for k, i in graph.fed_back().items()}
    assert fed == {"out[1]['b']": "arg[0]['b']", "out[1]['w']": "arg[0]['w']",
                   "out[2]['m']": "arg[1]['m']", "out[2]['v']": "arg[1]['v']"}

    graph = _graph(lambda p, b: update(p, opt, b)[0], (params, batch))  # a bare pytree result
    fed = {graph.output_paths[k]: graph.args[i].path for k, i in graph.fed_back().items()}
    assert fed == {"out['b']": "arg[0]['b']", "out['w']": "arg[0]['w']"}

    def same_shapes(params, batch):  # m has w's shape, but its path is no argument's
        new, new_opt = update(params, opt, batch)
        return new, new_opt["m"]

    graph = _graph(same_shapes, (params, batch))
    fed = {graph.output_paths[k]: graph.args[i].path for k, i in graph.fed_back().items()}
    assert fed == {"out[0]['b']": "arg[0]['b']", "out[0]['w']": "arg[0]['w']"}


def _layout(plan) -> dict:
    """Everything a plan decides (its JSON less the search's timings), and the per-value maps."""
    d = json.loads(plan.to_json())
    d.pop("search_stats")
    return dict(d, value_specs=sorted(plan.value_specs.items()), read_specs=sorted(plan.read_specs.items()),
                read_paths=sorted(plan.read_paths.items()))


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_one_step_gets_one_plan_whatever_the_time_limit(opt_level):
    """An LM whose ILP has several optimal vertices: HiGHS's presolve picked one or another from run
    to run (more often under load). Searches with a 20x different time limit, both finishing
    optimal, must give the same plan."""
    step, args = _adamw_setup(AttentionLM(), vocab=64)
    plans = [rj.parallelize(step, mesh=_mesh(), opt_level=opt_level, solver_time_limit_s=limit).lower(*args).plan
             for limit in (30.0, 600.0, 30.0)]
    assert all(p.search_stats.status == "optimal" for p in plans)
    first = _layout(plans[0])
    assert all(_layout(p) == first for p in plans[1:])


def test_a_pinned_result_keeps_its_pin():
    """rj.annotate on a returned value still gives it the layout the user asked for, even where
    the argument comes in another one."""
    params = {"w": jnp.ones((64, 32)), "b": jnp.ones((32,))}
    batch = jnp.ones((16, 64))

    def step(params, batch):
        w = rj.annotate(params["w"], P(None, ("data", "model")))
        g = jax.grad(lambda w, b: jnp.sum(jnp.tanh(batch @ w + b)), argnums=(0, 1))(w, params["b"])
        return {"w": rj.annotate(w - 0.1 * g[0], P(("data", "model"), None)), "b": params["b"] - 0.1 * g[1]}

    lowered = rj.parallelize(step, mesh=_mesh()).lower(params, batch)
    plan = lowered.plan
    outs = dict(zip(plan.output_paths, plan.output_specs))
    args = dict(zip(plan.arg_paths, plan.arg_specs))
    assert str(outs["out['w']"]) == "[data+model, -]"
    assert args["arg[0]['w']"] != outs["out['w']"]
    assert outs["out['b']"] == args["arg[0]['b']"]
    assert_same_numbers(jax.jit(step)(params, batch), lowered.compile()(params, batch))


def test_a_result_pinned_less_split_than_it_could_be_leaves_as_pinned():
    """A result pinned to P("data", None) leaves in that layout, not split further along "model"
    (a local slice the search would take to save memory): the caller asked for that layout."""
    mesh = _mesh()

    def step(w, x):
        y = jnp.tanh(x @ w)
        return rj.annotate(w * 2.0 + y.sum(), P("data", None)), y.sum()

    w, x = jnp.ones((64, 64)), jnp.ones((16, 64))
    lowered = rj.parallelize(step, mesh=mesh).lower(w, x)
    assert str(lowered.plan.output_specs[0]) == "[data, -]"
    out = lowered.compile()(w, x)
    assert out[0].sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P("data", None)), 2)
    assert_same_numbers(jax.jit(step)(w, x), out)
