"""Conditionals (lax.cond, lax.switch, optax.MultiSteps): searched inside their branches.

Each branch's ops are planned like any others; a result leaves every branch in one layout; the
plan counts the collectives of the heaviest branch only, as the compiled program's are counted,
and the compiled program runs the plan whichever branch is taken."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

import rhino_jax as rj
from rhino_jax.errors import StagingError

from helpers import assert_same_numbers

# The compiled programs checked here are the CPU's: plan for its combiner (all-reduces only).
CPU = dataclasses.replace(rj.M8_V100, backend="cpu")
D = 128


def _predicted_as_compiled(compiled) -> None:
    """Collectives per kind, as XLA combines them: the same count and bytes as the compiled HLO."""
    predicted = compiled.plan.collective_summary("cpu")
    assert predicted == {k: n for k, n in compiled.collectives.by_kind().items() if n[0]}


def _switch(w, x, k):
    h = jax.lax.switch(k, [lambda h: jnp.tanh(h @ w), lambda h: h @ w, lambda h: jax.nn.relu(h) @ w.T], x)
    return jnp.mean(h ** 2)


def test_switch_branches_are_data_parallel_inside_and_priced_as_compiled():
    mesh = rj.device_mesh((8,), ("data",))
    w, x = jax.random.normal(jax.random.PRNGKey(0), (D, D)) * 0.1, jax.random.normal(jax.random.PRNGKey(1), (8192, D))
    step = rj.parallelize(jax.value_and_grad(_switch), mesh=mesh, cluster=CPU)
    lowered = step.lower(w, x, jnp.int32(0))
    plan, graph = lowered.plan, lowered.graph
    assert plan.fallback_ops == ()
    inside = [v for n in graph.nodes if "branch" in n.attrs for v in n.results
              if graph.values[v].shape == (8192, D) and not graph.values[v].constant]
    assert len(inside) >= 3 and all(plan.value_specs[v].dims[0] == ("data",) for v in inside)
    compiled = lowered.compile()
    # each branch sums its weight gradient: one all-reduce in the branch XLA counts, and the loss's
    assert compiled.collectives.count("all-reduce") == 2
    _predicted_as_compiled(compiled)
    for k in range(3):
        index = jnp.int32(k)
        assert_same_numbers(jax.jit(jax.value_and_grad(_switch))(w, x, index), compiled(w, x, index))


def test_nested_conditionals_in_a_scan_on_a_2d_mesh():
    def f(w, x):
        def layer(h, wi):
            inner = lambda h: jax.lax.cond(jnp.max(h) > 1, lambda h: h @ wi, lambda h: jax.nn.relu(h @ wi.T), h)
            return jax.lax.cond(jnp.mean(h) > 0, lambda h: jnp.tanh(h @ wi), inner, h), None
        h, _ = jax.lax.scan(layer, x, w)
        return jnp.mean(h ** 2)

    mesh = rj.device_mesh((2, 4), ("data", "model"))
    w = jax.random.normal(jax.random.PRNGKey(0), (3, D, D)) * 0.1
    step = rj.parallelize(jax.value_and_grad(f), mesh=mesh, cluster=CPU)
    x = jax.random.normal(jax.random.PRNGKey(1), (4096, D))
    compiled = step.lower(w, x).compile()
    assert compiled.plan.fallback_ops == ()
    _predicted_as_compiled(compiled)
    for batch in (x, -jnp.abs(x)):  # the outer branch taken, then the inner ones
        assert_same_numbers(jax.jit(jax.value_and_grad(f))(w, batch), compiled(w, batch))


optax = pytest.importorskip("optax")


def _multi_steps(layers: int, width: int):
    """An MLP trained with optax.MultiSteps (gradient accumulation: a lax.cond between adding the
    gradient up and applying Adam), and its arguments."""
    opt = optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2)
    keys = jax.random.split(jax.random.PRNGKey(0), layers + 2)
    params = {f"w{i}": jax.random.normal(keys[i], (width, width)) * 0.05 for i in range(layers)}
    batch = (jax.random.normal(keys[-2], (256, width)), jax.random.normal(keys[-1], (256, width)))

    def loss_fn(params, batch):
        h, y = batch
        for i in range(layers):
            h = jax.nn.relu(h @ params[f"w{i}"])
        return jnp.mean((h - y) ** 2)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, params, opt.init(params), batch


def test_multisteps_state_is_sharded_through_its_conditional_under_a_memory_limit():
    step, params, state, batch = _multi_steps(2, 512)
    mesh = rj.device_mesh((8,), ("data",))
    parallel = rj.parallelize(step, mesh=mesh, cluster=CPU, memory_limit_bytes=4 << 20)  # replicated: 9 MiB
    lowered = parallel.lower(params, state, batch)
    plan = lowered.plan
    assert plan.fallback_ops == ()
    state_specs = {p: s for p, s in zip(plan.arg_paths, plan.arg_specs) if "acc_grads" in p or ".mu" in p or ".nu" in p}
    assert len(state_specs) == 6 and not any(s.is_replicated() for s in state_specs.values())
    compiled = lowered.compile()
    _predicted_as_compiled(compiled)  # before: 6 all-gathers (4.5 MiB) compiled for 2 (0.5 MiB) predicted
    assert compiled.memory_analysis().argument_size_in_bytes < 2 << 20
    for _ in range(2):  # the first step adds the gradient up, the second applies Adam
        expected = jax.jit(step)(params, state, batch)
        got = compiled(params, state, batch)
        assert_same_numbers(expected, got)
        params, state = got[0], got[1]


def test_multisteps_micro_batched_matches_one_device_and_cannot_be_pipelined():
    step, params, state, batch = _multi_steps(4, 128)
    mesh = rj.device_mesh((8,), ("data",))
    micro = rj.parallelize(step, mesh=mesh, cluster=CPU, num_micro_batches=2)  # the conditional applies the sums
    assert_same_numbers(jax.jit(step)(params, state, batch), micro(params, state, batch))
    with pytest.raises(StagingError, match="cannot cut through a conditional"):
        rj.parallelize(step, mesh=mesh, cluster=CPU, pipeline=2, num_micro_batches=2).lower(params, state, batch)
