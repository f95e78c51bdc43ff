"""End to end: parallelized steps give the single-device numbers on every mesh."""
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rhino_jax as rj
from rhino_jax.models import gpt, make_mlp_train_step, mlp_example

from helpers import assert_same_numbers, on_host

MESHES = [((8,), ("data",)), ((2, 4), ("data", "model")), ((4, 2), ("data", "model"))]


@pytest.mark.parametrize("shape,names", MESHES + [((1, 1, 8), ("a", "b", "c"))])  # size-1 axes too
def test_mlp_train_step_matches_one_device(shape, names):
    step = make_mlp_train_step()
    args = mlp_example((64, 128, 128, 32), 32)
    reference = jax.jit(step)(*args)
    result = rj.parallelize(step, mesh=rj.device_mesh(shape, names))(*args)
    assert_same_numbers(reference, result)


@pytest.mark.parametrize("shape,names", MESHES)
def test_transformer_adam_step_matches_one_device(shape, names, tiny_gpt):
    step, args, reference = tiny_gpt
    parallel = rj.parallelize(step, mesh=rj.device_mesh(shape, names), opt_level="O3")
    result = parallel(*on_host(args))
    assert_same_numbers(reference, result)
    plan = parallel.lower(*args).plan
    assert plan.search_stats.status == "optimal"
    assert "predicted step" in plan.report()


def test_decorator_on_jitted_function_keeps_donation():
    mesh = rj.device_mesh((2, 4), ("data", "model"))
    step = make_mlp_train_step()
    args = mlp_example((64, 128, 32), 32)
    reference = jax.jit(step)(*args)

    @rj.parallelize(mesh=mesh)
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch):
        return step(params, opt_state, batch)

    lowered = train_step.lower(*args)
    assert all(a.donated_to is not None for a in lowered.graph.args if a.role != "batch")
    params = jax.device_put(args[0], lowered.plan.input_shardings[0])
    result = train_step(params, args[1], args[2])
    assert_same_numbers(reference, result)
    assert all(x.is_deleted() for x in jax.tree.leaves(params)), "donated parameters were not donated"


def test_annotate_pins_a_tensor_and_keeps_numbers():
    mesh = rj.device_mesh((2, 4), ("data", "model"))

    def loss(w, x):
        h = rj.annotate(jnp.tanh(x @ w), P(None, "model"), name="hidden")
        return jnp.sum(h ** 2)

    w, x = jnp.ones((16, 32)) / 16, jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) / 100
    parallel = rj.parallelize(jax.grad(loss), mesh=mesh)
    lowered = parallel.lower(w, x)
    pins = lowered.graph.pins  # the forward value and, under grad, its cotangent
    assert len(pins) == 2 and all("hidden" in p.name for p in pins)
    assert all(lowered.plan.value_specs[p.value].dims == ((), ("model",)) for p in pins)
    assert_same_numbers(jax.jit(jax.grad(loss))(w, x), parallel(w, x))


def test_annotate_outside_parallelize_is_identity():
    x = jnp.ones((4, 4))
    assert rj.annotate(x, P("data", None)) is x


def test_with_sharding_constraint_is_honoured_as_pin():
    mesh = rj.device_mesh((8,), ("data",))

    def f(x, w):
        h = jax.lax.with_sharding_constraint(x @ w, P("data", None))
        return jnp.sum(jnp.sin(h))

    x, w = jnp.ones((16, 8)), jnp.ones((8, 8))
    lowered = rj.parallelize(f, mesh=mesh).lower(x, w)
    (pin,) = lowered.graph.pins
    assert lowered.plan.value_specs[pin.value].dims == (("data",), ())


def test_plan_input_shardings_follow_argument_pytree():
    mesh = rj.device_mesh((2, 4), ("data", "model"))
    step = make_mlp_train_step()
    args = mlp_example((32, 64, 16), 16)
    lowered = rj.parallelize(step, mesh=mesh).lower(*args)
    shardings = lowered.plan.input_shardings
    assert jax.tree.structure(shardings) == jax.tree.structure(args)
    assert all(isinstance(s, NamedSharding) for s in jax.tree.leaves(shardings))
    compiled = lowered.compile()
    assert jax.tree.structure(compiled.input_shardings) == jax.tree.structure((args, {}))  # as jax: (args, kwargs)
    assert all(c.is_equivalent_to(s, len(s.spec) + 1)
               for c, s in zip(jax.tree.leaves(compiled.input_shardings), jax.tree.leaves(shardings)))
    assert "HloModule" in compiled.as_text()


def test_plan_is_cached_per_signature():
    mesh = rj.device_mesh((8,), ("data",))
    step = make_mlp_train_step()
    parallel = rj.parallelize(step, mesh=mesh)
    args = mlp_example((16, 16), 8)
    assert parallel.lower(*args) is parallel.lower(*args)
    assert parallel.lower(*mlp_example((16, 16), 16)) is not parallel.lower(*args)


def test_two_plans_of_one_function_compile_to_their_own_programs():
    """jax caches a lowering per function and shapes; compiling a second plan of the same step
    must not return the first plan's executable."""
    step = make_mlp_train_step()
    args = mlp_example((256, 256, 1024, 256), 16384, abstract=True)
    mesh = rj.device_mesh((8,), ("data",))
    free = rj.parallelize(step, mesh=mesh, donate_argnums=(0, 1)).lower(*args)
    limit = free.plan.cost.memory_bytes - (2 << 20)
    limited = rj.parallelize(step, mesh=mesh, donate_argnums=(0, 1), memory_limit_bytes=limit).lower(*args)
    assert free.plan.arg_specs != limited.plan.arg_specs
    for lowered in (free, limited):
        compiled = lowered.compile()
        got = jax.tree.leaves(compiled.input_shardings)
        want = jax.tree.leaves(lowered.plan.input_shardings)
        assert all(g.is_equivalent_to(w, len(w.spec) + 1) for g, w in zip(got, want))


def test_compiled_answers_like_jax_stages_compiled():
    step, args = make_mlp_train_step(), mlp_example((8, 16, 8), 16)
    compiled = rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",))).lower(*args).compile()
    reference = jax.jit(step).lower(*args).compile()
    assert compiled.memory_analysis().argument_size_in_bytes > 0
    assert compiled.cost_analysis()["flops"] > 0
    assert set(compiled.cost_analysis()) == set(reference.cost_analysis())
