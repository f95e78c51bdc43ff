"""Every bad input gets a clear error, or a documented safe behaviour."""
import inspect

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import rhino_jax as rj
from rhino_jax.models import make_mlp_train_step, mlp_example

from helpers import assert_same_numbers


def test_op_without_rule_stays_replicated_and_is_reported():
    mesh = rj.device_mesh((2, 4), ("data", "model"))

    def f(w, x):  # a loop whose trip count depends on the data: not searched inside
        h, _ = jax.lax.while_loop(lambda c: jnp.sum(c[0] ** 2) > 1.0, lambda c: (jnp.tanh(c[0] @ w), c[1] + 1), (x, 0))
        return jnp.sum(h ** 2)

    w, x = jnp.eye(16) * 0.5, jnp.ones((8, 16))
    parallel = rj.parallelize(f, mesh=mesh)
    lowered = parallel.lower(w, x)
    assert any(op.startswith("while") and "loop without a known trip count" in op for op in lowered.plan.fallback_ops)
    assert "no sharding rule" in lowered.plan.report()
    while_nodes = [n for n in lowered.graph.nodes if n.op == "stablehlo.while"]
    assert all(lowered.plan.value_specs[r].is_replicated() for n in while_nodes for r in n.results)
    assert_same_numbers(jax.jit(f)(w, x), parallel(w, x))


def test_mesh_axis_that_does_not_divide_is_excluded():
    mesh = rj.device_mesh((8,), ("data",))
    step = make_mlp_train_step()
    args = mlp_example((12, 20, 6), 6)  # no dimension divisible by 8
    parallel = rj.parallelize(step, mesh=mesh)
    plan = parallel.lower(*args).plan
    assert all(s.is_replicated() for s in plan.arg_specs)
    assert_same_numbers(jax.jit(step)(*args), parallel(*args))


def test_pin_that_does_not_divide_names_the_tensor():
    mesh = rj.device_mesh((8,), ("data",))

    def f(x):
        return jnp.sum(rj.annotate(x * 2, P("data", None), name="scaled_input"))

    with pytest.raises(rj.ShardingPinError, match="scaled_input.*size 6"):
        rj.parallelize(f, mesh=mesh).lower(jnp.ones((6, 4)))


def test_pin_with_unknown_axis_names_the_tensor():
    mesh = rj.device_mesh((8,), ("data",))

    def f(x):
        return jnp.sum(rj.annotate(x, P("model"), name="activations"))

    with pytest.raises(rj.ShardingPinError, match="activations.*no axis 'model'"):
        rj.parallelize(f, mesh=mesh).lower(jnp.ones((8, 4)))


def test_pin_with_axes_out_of_the_mesh_order_says_so():
    mesh = rj.device_mesh((2, 4), ("data", "model"))

    def f(x):
        return jnp.sum(rj.annotate(x, P(("model", "data"), None), name="activations"))

    with pytest.raises(rj.ShardingPinError, match=r"activations.*\('model', 'data'\) out of the mesh's order "
                                                  r"\('data', 'model'\); pin \('data', 'model'\) instead"):
        rj.parallelize(f, mesh=mesh).lower(jnp.ones((8, 4)))


def test_solver_time_limit_gives_feasible_plan_and_warns_with_gap(solves_out_of_time):
    mesh = rj.device_mesh((2, 4), ("data", "model"))
    step = make_mlp_train_step()
    args = mlp_example((256,) * 9, 64, abstract=True)
    with pytest.warns(rj.SolverTimeLimitWarning, match="gap of"):
        lowered = rj.parallelize(step, mesh=mesh, solver="SCIP").lower(*args)
    assert lowered.plan.search_stats.status == "feasible"
    assert lowered.plan.cost.total_s > 0


def test_a_time_limit_passed_while_the_ilp_is_built_says_so():
    """A search returns within 1.2 times its limit: past it with no plan yet, an error names the
    phase and the option to raise."""
    mesh = rj.device_mesh((2, 4), ("data", "model"))
    args = mlp_example((256,) * 9, 64, abstract=True)
    with pytest.raises(rj.SolverError, match=r"ran past its solver_time_limit_s=0.001 while it built the ILP.*"
                                             r"raise solver_time_limit_s"):
        rj.parallelize(make_mlp_train_step(), mesh=mesh, solver_time_limit_s=0.001).lower(*args)


def test_wrong_argument_structure_is_a_type_error():
    mesh = rj.device_mesh((8,), ("data",))
    step = make_mlp_train_step()
    args = mlp_example((16, 16), 8)
    compiled = rj.parallelize(step, mesh=mesh).lower(*args).compile()
    with pytest.raises(TypeError, match="compiled for arguments"):
        compiled(args[0], args[1])
    with pytest.raises(TypeError, match="compiled for arguments"):
        compiled(*mlp_example((16, 16), 16))


def test_bad_options_and_meshes_are_rejected():
    mesh = rj.device_mesh((8,), ("data",))
    with pytest.raises(ValueError, match="opt_level"):
        rj.parallelize(lambda x: x, mesh=mesh, opt_level="O9")
    with pytest.raises(ValueError, match="unknown cluster preset"):
        rj.parallelize(lambda x: x, mesh=mesh, cluster="tpu-v9")
    with pytest.raises(rj.MeshError, match="needs 6 devices"):
        rj.device_mesh((2, 3), ("a", "b"))
    with pytest.raises(rj.MeshError) as too_many:  # no devices=jax.devices()[:16] advice with 8 devices
        rj.device_mesh((4, 4), ("a", "b"))
    assert str(too_many.value) == ("mesh shape (4, 4) needs 16 devices but 8 are given; pass a shape whose "
                                   "product is 8")
    manual = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Manual,))
    with pytest.raises(rj.MeshError, match="Manual axes .*parallelize the step outside shard_map"):
        rj.parallelize(lambda x: x, mesh=manual)


@pytest.mark.parametrize("pipeline", ["off", 1])
def test_a_schedule_without_a_pipeline_says_to_pass_one(pipeline):
    mesh = rj.device_mesh((8,), ("data",))
    with pytest.raises(ValueError, match=r"schedule='gpipe' orders the tasks of pipeline stages.*pass pipeline=N"):
        rj.parallelize(lambda x: x, mesh=mesh, pipeline=pipeline, schedule="gpipe")
    with pytest.raises(ValueError, match="schedule='1f1b'"):  # the default too, when given
        rj.parallelize(lambda x: x, mesh=mesh, pipeline=pipeline, schedule="1f1b")
    rj.parallelize(lambda x: x, mesh=mesh, pipeline=2, num_micro_batches=2, schedule="gpipe")


def test_an_unknown_option_names_the_closest():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'num_microbatches': did you mean "
                                        r"'num_micro_batches'\?"):
        rj.parallelize(lambda x: x, num_microbatches=4)
    assert "num_micro_batches" in inspect.signature(rj.parallelize).parameters  # help() shows the options


@pytest.mark.parametrize("spec", [None, "data"])
def test_annotate_needs_a_partition_spec(spec):
    mesh = rj.device_mesh((8,), ("data",))

    def f(x):
        return jnp.sum(rj.annotate(x * 2, spec, name="scaled"))

    with pytest.raises(rj.ShardingPinError, match="spec must be a PartitionSpec"):
        rj.parallelize(f, mesh=mesh).lower(jnp.ones((8, 4)))


def test_a_pin_on_a_value_made_of_constants_is_kept_for_xla():
    """A causal mask from iota depends on no argument: XLA builds it where used, under its pin."""
    mesh = rj.device_mesh((2, 4), ("data", "model"))

    def f(x):
        mask = rj.annotate(jnp.tril(jnp.ones((8, 8), bool)), P("data", None), name="mask")
        return jnp.sum(jnp.where(mask, x @ x.T, 0.0))

    x = jnp.arange(64.0).reshape(8, 8) / 64
    assert_same_numbers(jax.jit(f)(x), rj.parallelize(f, mesh=mesh)(x))


def test_a_string_argument_is_named_in_a_type_error():
    def f(x, activation):
        return jnp.sum(getattr(jnp, activation)(x))

    with pytest.raises(TypeError, match=r"arg\[1\] is a str, not an array"):
        rj.parallelize(f, mesh=rj.device_mesh((8,), ("data",))).lower(jnp.ones((8, 4)), "tanh")


def test_steps_without_arguments_or_results_run():
    mesh = rj.device_mesh((8,), ("data",))
    assert_same_numbers(jnp.ones(3) * 2, rj.parallelize(lambda: jnp.ones(3) * 2, mesh=mesh)())
    assert rj.parallelize(lambda x: None, mesh=mesh)(jnp.ones(8)) is None


@pytest.mark.parametrize("call,match", [
    (lambda: rj.parallelize(lambda x: x, mesh="data"), "mesh must be a jax.sharding.Mesh"),
    (lambda: rj.parallelize(lambda x: x, mesh=(2, 4)), "mesh must be a jax.sharding.Mesh"),
    (lambda: rj.device_mesh((-2, -4), ("a", "b")), "positive sizes"),
    (lambda: rj.device_mesh((2,), ("a",), devices=[jax.devices()[0]] * 2), "devices repeat"),
    (lambda: rj.parallelize(lambda x: x, mesh=rj.device_mesh((8,), ("d",)), solver_time_limit_s=float("nan")),
     "solver_time_limit_s must be a positive number"),
    (lambda: rj.parallelize(lambda x: x, mesh=rj.device_mesh((8,), ("d",)), solver_time_limit_s="60"),
     "solver_time_limit_s must be a positive number"),
    (lambda: rj.device_mesh(8, ("data",)), r"mesh shape must be a tuple of sizes, one per axis, e.g. \(8,\)"),
    (lambda: rj.device_mesh((8,), "data"), r"axis_names must be a tuple of names, one per axis, e.g. \('data',\)"),
    (lambda: rj.parallelize(lambda x: x, mesh=rj.device_mesh((8,), ("d",)), strided_specs="yes"),
     "strided_specs must be True or False"),
    (lambda: rj.parallelize(lambda x: x, mesh=rj.device_mesh((8,), ("d",)), solver="gurobi"),
     "solver must be one of 'HIGHS', 'SCIP', 'CP-SAT'"),
    (lambda: rj.Cluster(name="c", devices_per_host=8, intra_host_bandwidth=-1e9, intra_host_latency=1e-6,
                        inter_host_bandwidth=1e9, inter_host_latency=1e-5),
     "Cluster.intra_host_bandwidth must be a positive finite number"),
    (lambda: rj.Cluster(name="c", devices_per_host=8, intra_host_bandwidth=1e9, intra_host_latency=-1e-6,
                        inter_host_bandwidth=1e9, inter_host_latency=1e-5),
     "Cluster.intra_host_latency must be a non-negative finite number"),
    (lambda: rj.Cluster(name="c", devices_per_host=0, intra_host_bandwidth=1e9, intra_host_latency=1e-6,
                        inter_host_bandwidth=1e9, inter_host_latency=1e-5),
     "Cluster.devices_per_host must be an int >= 1"),
    (lambda: rj.Cluster(name="c", devices_per_host=8, intra_host_bandwidth=1e9, intra_host_latency=1e-6,
                        inter_host_bandwidth=1e9, inter_host_latency=1e-5, flops_per_s={"float32": -1.0}),
     "Cluster.flops_per_s must map dtypes to positive FLOP/s")])
def test_bad_meshes_and_limits_say_what_to_pass(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("option", ["donate_argnums", "static_argnums"])
def test_argument_positions_of_another_type_say_what_to_pass(option):
    with pytest.raises(TypeError, match=f"{option} must be an int or a sequence of ints, got 1.0"):
        rj.parallelize(lambda w, x: w, mesh=rj.device_mesh((8,), ("d",)), **{option: 1.0})


def test_annotate_of_a_pytree_says_to_annotate_each_array():
    def f(x):
        rj.annotate({"x": x}, P("data"))
        return jnp.sum(x)

    with pytest.raises(rj.ShardingPinError, match=r"x must be one array, got a dict; annotate each array"):
        rj.parallelize(f, mesh=rj.device_mesh((8,), ("data",))).lower(jnp.ones((8, 4)))


def test_a_solver_named_in_lower_case_plans_as_in_upper_case():
    """OR-Tools takes 'highs'; the HiGHS banner it then printed reached the solver helper's answers."""
    mesh = rj.device_mesh((8,), ("data",))
    step, args = make_mlp_train_step(), mlp_example((16, 32, 16), 16)
    lower = rj.parallelize(step, mesh=mesh, solver="highs").lower(*args).plan
    upper = rj.parallelize(step, mesh=mesh, solver="HIGHS").lower(*args).plan
    assert lower.arg_specs == upper.arg_specs and lower.cost == upper.cost
