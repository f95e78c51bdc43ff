"""rj.parallelize behaves like jax.jit at its surface: static arguments, keyword arguments, the
jax.stages Lowered/Compiled methods, a cache hit that moves nothing, a plan whose search was
interrupted kept until `clear_cache`, jax.set_mesh's mesh read when the step is called, typed
PRNG keys in the state."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import rhino_jax as rj
from rhino_jax import coshard_search
from rhino_jax.models import make_mlp_train_step, mlp_example

from helpers import assert_same_numbers

MESH = ((2, 4), ("data", "model"))


def _step(params, batch, mode="sgd", *, scale=1.0):
    """A small MLP step whose update depends on two Python values."""
    def loss(p):
        h = jnp.tanh(batch["x"] @ p["w1"])
        return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    lr = 0.1 if mode == "sgd" else 0.5
    return jax.tree.map(lambda p, g: p - lr * scale * g, params, grads), value


def _args():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (16, 32)), "w2": jax.random.normal(k2, (32, 8))}
    batch = {"x": jax.random.normal(k3, (16, 16)), "y": jnp.zeros((16, 8))}
    return params, batch


def _mesh():
    return rj.device_mesh(*MESH)


def test_static_argnums_and_argnames_give_jax_jit_numbers_and_their_own_plans():
    params, batch = _args()
    step = rj.parallelize(_step, mesh=_mesh(), static_argnums=(2,), static_argnames=("scale",))
    reference = jax.jit(_step, static_argnums=(2,), static_argnames=("scale",))
    results = {}
    for mode in ("sgd", "fast"):
        results[mode] = step(params, batch, mode, scale=2.0)
        assert_same_numbers(reference(params, batch, mode, scale=2.0), results[mode])
    assert not np.allclose(results["sgd"][0]["w1"], results["fast"][0]["w1"])  # the static value was used
    sgd = step.lower(params, batch, "sgd", scale=2.0)
    assert step.lower(params, batch, "sgd", scale=2.0) is sgd
    assert step.lower(params, batch, "fast", scale=2.0) is not sgd
    assert step.lower(params, batch, "sgd", scale=3.0) is not sgd
    assert sgd.plan.arg_paths == ("arg[0]['w1']", "arg[0]['w2']", "arg[1]['x']", "arg[1]['y']")


def test_static_argnames_infer_positions_like_jax_jit():
    """static_argnames=("mode",) makes `mode` static passed by position too (and the reverse)."""
    params, batch = _args()
    by_name = rj.parallelize(_step, mesh=_mesh(), static_argnames=("mode",))
    assert by_name.arguments.static_argnums == (2,)
    assert_same_numbers(jax.jit(_step, static_argnums=2)(params, batch, "fast"), by_name(params, batch, "fast"))
    assert rj.parallelize(_step, mesh=_mesh(), static_argnums=2).arguments.static_argnames == ("mode",)


def test_a_jitted_step_keeps_its_static_arguments():
    params, batch = _args()
    jitted = jax.jit(_step, static_argnums=(2,))
    step = rj.parallelize(jitted, mesh=_mesh())
    assert_same_numbers(jitted(params, batch, "fast"), step(params, batch, "fast"))


def test_bad_static_arguments_are_named():
    params, batch = _args()
    step = rj.parallelize(_step, mesh=_mesh(), static_argnums=(2,))
    with pytest.raises(TypeError, match=r"static argument arg\[2\] of _step is a list, which cannot be hashed"):
        step(params, batch, ["sgd"])
    with pytest.raises(TypeError, match=r"argument arg\[2\] is a str, not an array.*static_argnums=\(2,\)"):
        rj.parallelize(_step, mesh=_mesh())(params, batch, "sgd")
    with pytest.raises(TypeError, match=r"argument arg\['mode'\] is a str.*static_argnames=\('mode',\)"):
        rj.parallelize(_step, mesh=_mesh())(params, batch, mode="sgd")
    with pytest.raises(ValueError, match="_step takes 3 positional arguments"):
        rj.parallelize(_step, mesh=_mesh(), static_argnums=(5,))
    with pytest.raises(ValueError, match="_step has no parameter 'lr'"):
        rj.parallelize(_step, mesh=_mesh(), static_argnames=("lr",))
    with pytest.raises(ValueError, match="both static and donated"):
        rj.parallelize(_step, mesh=_mesh(), static_argnums=(0,), donate_argnums=(0,))


def test_keyword_arguments_like_jax_jit():
    params, batch = _args()
    step = rj.parallelize(_step, mesh=_mesh())
    assert_same_numbers(jax.jit(_step)(params, batch=batch), step(params, batch=batch))
    lowered = step.lower(params, batch=batch)
    assert lowered.plan.arg_paths[2:] == ("arg['batch']['x']", "arg['batch']['y']")
    assert lowered.plan.arg_roles[2:] == ("batch", "batch")
    shardings = lowered.plan.input_shardings  # (args, kwargs) for a call with keyword arguments
    assert jax.tree.structure(shardings) == jax.tree.structure(((params,), {"batch": batch}))
    jax_compiled = jax.jit(_step).lower(params, batch=batch).compile()
    compiled = lowered.compile()
    assert jax.tree.structure(compiled.input_shardings) == jax.tree.structure(jax_compiled.input_shardings)
    assert_same_numbers(jax_compiled(params, batch=batch), compiled(params, batch=batch))


def test_keyword_and_static_arguments_with_micro_batches():
    params, batch = _args()
    step = rj.parallelize(_step, mesh=_mesh(), num_micro_batches=2, static_argnames=("mode",))
    reference = jax.jit(_step, static_argnames=("mode",))(params, batch=batch, mode="fast")
    assert_same_numbers(reference, step(params, batch=batch, mode="fast"), rtol=1e-4, atol=1e-5)
    lowered = step.lower(params, batch=batch, mode="fast")
    assert lowered.plan.arg_roles[2:] == ("batch", "batch")
    assert jax.tree.structure(lowered.compile().input_shardings) == jax.tree.structure(((params,), {"batch": batch}))


def _momentum_step(p, s, x, y):
    """step(params, state, x, y): nothing names the arguments."""
    value, grads = jax.value_and_grad(lambda p: jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2))(p)
    s = jax.tree.map(lambda m, g: 0.9 * m + g, s, grads)
    return jax.tree.map(lambda w, m: w - 0.1 * m, p, s), s, value


def test_inputs_between_the_state_and_the_batch_are_batch_not_optimizer_state():
    """Optimizer state is taken from a middle argument's position alone, but a step gives its
    state back: x, which nothing feeds back and which leads with the batch's dim, is a batch and
    is split into micro-batches with y (it used to stay whole, and the step failed with a shape
    error); s, fed back, stays state."""
    params, batch = _args()
    state = jax.tree.map(jnp.zeros_like, params)
    args = (params, state, batch["x"], batch["y"])
    step = rj.parallelize(_momentum_step, mesh=_mesh(), num_micro_batches=2)
    lowered = step.lower(*args)
    assert lowered.plan.arg_roles == ("parameter",) * 2 + ("optimizer_state",) * 2 + ("batch",) * 2
    assert_same_numbers(jax.jit(_momentum_step)(*args), step(*args), rtol=1e-4, atol=1e-5)


def test_an_input_between_the_state_and_the_batch_that_is_not_batched_is_other():
    """As above, with a table that does not lead with the batch's dim (16): "other", not split."""
    def step(p, s, table, batch):
        p2, s2, value = _momentum_step(p, s, batch["x"] + jnp.sum(table), batch["y"])
        return p2, s2, value

    params, batch = _args()
    state = jax.tree.map(jnp.zeros_like, params)
    lowered = rj.parallelize(step, mesh=_mesh()).lower(params, state, jnp.ones((5, 3)), batch)
    assert lowered.plan.arg_roles == ("parameter",) * 2 + ("optimizer_state",) * 2 + ("other", "batch", "batch")


def test_lowered_and_compiled_answer_like_jax_stages():
    params, batch = _args()
    lowered = rj.parallelize(_step, mesh=_mesh()).lower(params, batch)
    jax_lowered = jax.jit(_step).lower(params, batch)
    assert "stablehlo" in lowered.as_text() and "HloModule" in lowered.as_text("hlo")
    assert lowered.cost_analysis()["flops"] == pytest.approx(jax_lowered.cost_analysis()["flops"], rel=1e-3)
    assert lowered.in_tree == jax_lowered.in_tree and lowered.out_tree == jax_lowered.out_tree
    assert jax.tree.structure(lowered.out_info) == jax.tree.structure(jax_lowered.out_info)
    compiled, jax_compiled = lowered.compile(), jax_lowered.compile()
    assert "HloModule" in compiled.as_text()
    for mine, theirs in ((compiled.input_shardings, jax_compiled.input_shardings),
                         (compiled.output_shardings, jax_compiled.output_shardings)):
        assert jax.tree.structure(mine) == jax.tree.structure(theirs)
    assert [i.shape for i in jax.tree.leaves(compiled.out_info)] == [i.shape for i in jax.tree.leaves(jax_compiled.out_info)]
    assert compiled.memory_analysis().argument_size_in_bytes > 0
    assert compiled.cost_analysis()["flops"] > 0
    assert compiled.in_tree == jax_compiled.in_tree


def test_micro_batched_stages_name_what_they_cannot_show():
    params, batch = _args()
    lowered = rj.parallelize(_step, mesh=_mesh(), num_micro_batches=2).lower(params, batch)
    with pytest.raises(NotImplementedError, match="several programs"):
        lowered.as_text()
    with pytest.raises(NotImplementedError, match="several programs"):
        lowered.cost_analysis()
    assert lowered.in_tree == jax.jit(_step).lower(params, batch).in_tree
    compiled = lowered.compile()
    assert set(compiled.programs) == {"compute_gradients", "apply_gradients"}
    assert "HloModule" in compiled.programs["apply_gradients"].as_text()
    for method in (compiled.as_text, compiled.memory_analysis, compiled.cost_analysis):
        with pytest.raises(NotImplementedError, match=r"compute_gradients, apply_gradients.*compiled.programs"):
            method()
    assert jax.tree.structure(compiled.output_shardings) == jax.tree.structure(compiled(params, batch))


def test_a_cache_hit_moves_no_array_already_in_place(monkeypatch):
    params, batch = _args()
    step = rj.parallelize(_step, mesh=_mesh())
    placed = jax.device_put((params, batch), step.lower(params, batch).plan.input_shardings)
    reference = step(params, batch)
    puts = []
    real_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: puts.append(a) or real_put(*a, **k))
    assert_same_numbers(reference, step(*placed))
    assert puts == []
    step(params, batch)  # arrays on one device: moved, in one call
    assert len(puts) == 1


def test_a_plan_whose_search_was_interrupted_is_kept_until_the_cache_is_cleared(monkeypatch):
    params, batch = _args()
    searches = []
    real_plan_on = coshard_search.plan_on  # the step's one search (no rj.coshard: one plan_on)

    def interrupted(*a, **k):
        searches.append(1)
        plan = real_plan_on(*a, **k)
        return dataclasses.replace(plan, interrupted=True, search_stats=dataclasses.replace(plan.search_stats, status="interrupted"))

    monkeypatch.setattr(coshard_search, "plan_on", interrupted)
    step = rj.parallelize(_step, mesh=_mesh())
    assert_same_numbers(jax.jit(_step)(params, batch), step(params, batch))
    step(params, batch)
    assert step.lower(params, batch).plan.interrupted and len(searches) == 1  # kept: no search again
    step.clear_cache()
    monkeypatch.setattr(coshard_search, "plan_on", lambda *a, **k: searches.append(1) or real_plan_on(*a, **k))
    assert_same_numbers(jax.jit(_step)(params, batch), step(params, batch))
    assert not step.lower(params, batch).plan.interrupted and len(searches) == 2


def test_donation_follows_the_arguments_around_static_ones():
    """donate_argnums name the user's positions; with a static argument before them, the donated
    arguments are still the ones the user named (and one passed by keyword is donated by name)."""
    def step(params, mode, batch):
        return _step(params, batch, mode)

    params, batch = _args()
    parallel = rj.parallelize(step, mesh=_mesh(), static_argnums=(1,), donate_argnums=(0,))
    for lowered in (parallel.lower(params, "sgd", batch), parallel.lower(params=params, mode="sgd", batch=batch)):
        donated = {a.path for a in lowered.graph.args if a.donated_to is not None}
        assert donated == {p for p in lowered.plan.arg_paths if "w" in p} and len(donated) == 2


def test_donated_leaves_are_the_ones_jax_donates():
    """`arguments.donated_leaves` (which leaves apply-gradients may overwrite under micro-batches)
    against jax.jit's own args_info, with a static argument and a donated keyword argument."""
    from rhino_jax.arguments import ArgSpec, donated_leaves

    def f(a, s, b, z=None, c=None):
        return a["x"] * 2, b, c

    a, b, c = {"x": jnp.ones(3), "y": jnp.ones(2)}, (jnp.ones(4), jnp.ones(5)), {"q": jnp.ones(6)}
    call = ArgSpec.of(f, static_argnums=1, donate_argnums=(2, 4)).call(f, (a, "s", b), {"c": c})
    lowered = jax.jit(f, static_argnums=1, donate_argnums=(2, 4)).lower(a, "s", b, c=c)
    jax_donates = [i for i, info in enumerate(jax.tree.leaves(lowered.args_info)) if info.donated]
    assert donated_leaves(call) == tuple(jax_donates) == (2, 3, 4)


def test_inside_jax_transformations_the_step_is_traced_as_written():
    """jax.eval_shape, jax.jit, jax.grad and jax.vmap of a parallelized step give the step's own
    shapes and numbers (the outer transformation compiles it, without the plan), and say so once."""
    step, args = make_mlp_train_step(), mlp_example((16, 32, 16), 16)
    parallel = rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)))
    with pytest.warns(rj.TracedCallWarning, match="without rhino_jax's plan; call it outside them") as said:
        shapes = jax.eval_shape(parallel, *args)
        assert_same_numbers(jax.jit(step)(*args), jax.jit(parallel)(*args))
        loss = lambda s: parallel(*args[:-1], jax.tree.map(lambda b: b * s, args[-1]))[-1]  # noqa: E731
        own = lambda s: step(*args[:-1], jax.tree.map(lambda b: b * s, args[-1]))[-1]  # noqa: E731
        assert_same_numbers(jax.grad(own)(2.0), jax.grad(loss)(2.0))
        assert_same_numbers(jax.vmap(own)(jnp.arange(1.0, 3.0)), jax.vmap(loss)(jnp.arange(1.0, 3.0)))
    assert len([w for w in said if w.category is rj.TracedCallWarning]) == 1
    assert jax.tree.map(lambda a: (a.shape, a.dtype), shapes) == jax.tree.map(
        lambda a: (a.shape, a.dtype), jax.eval_shape(step, *args))


def test_a_mesh_of_jax_make_mesh_is_planned_as_it_is():
    """jax.make_mesh's Explicit axes: the plan is made for its devices and axis names, its
    shardings and the step's results name the user's mesh, so they go on into jitted code under
    jax.set_mesh; same numbers as one device. parallelize() without a mesh takes jax.set_mesh's."""
    step, args = make_mlp_train_step(), mlp_example((16, 32, 16), 16)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    assert set(mesh.axis_types) == {jax.sharding.AxisType.Explicit}
    parallel = rj.parallelize(step, mesh=mesh)
    assert all(s.mesh == mesh for s in jax.tree.leaves(parallel.lower(*args).plan.input_shardings))
    out = parallel(*args)
    assert_same_numbers(jax.jit(step)(*args), out)
    assert all(x.sharding.mesh == mesh for x in jax.tree.leaves(out))
    with jax.set_mesh(mesh):
        doubled = jax.jit(lambda tree: jax.tree.map(lambda a: a * 2, tree))(out)  # the user's own code
        in_context = rj.parallelize(step)
        assert in_context.user_mesh is mesh
        assert_same_numbers(jax.jit(step)(*args), in_context(*args))
    assert_same_numbers(jax.tree.map(lambda a: a * 2, jax.jit(step)(*args)), doubled)


def test_a_step_made_without_a_mesh_plans_for_the_mesh_set_when_it_is_called():
    """rj.parallelize at module level, called under jax.set_mesh: planned for that mesh, as jax.jit
    reads it when tracing, its results on it; without a mesh set, mesh shapes are searched."""
    step, args = make_mlp_train_step(), mlp_example((16, 32, 16), 16)
    parallel = rj.parallelize(step, axis_names=("data",), search_workers=0)  # no mesh set here
    mesh = jax.make_mesh((4, 2), ("dp", "tp"))
    with jax.set_mesh(mesh):
        out = parallel(*args)
        lowered = parallel.lower(*args)
    assert_same_numbers(jax.jit(step)(*args), out)
    assert all(x.sharding.mesh.axis_names == ("dp", "tp") for x in jax.tree.leaves(out))
    assert lowered.plan.mesh_axes == {"dp": 4, "tp": 2} and not lowered.plan.mesh_candidates
    searched = parallel.lower(*args)  # no mesh set: the mesh shapes of axis_names
    assert searched.plan.mesh_axes == {"data": 8} and searched.plan.mesh_candidates
    with jax.set_mesh(mesh):
        assert parallel.lower(*args) is lowered  # that mesh's plan, kept


def _keyed_state():
    """A state holding a typed PRNG key and a uint32 count beside a weight."""
    return {"w": jnp.linspace(-1, 1, 512 * 512).reshape(512, 512), "key": jax.random.key(0),
            "count": jnp.uint32(0)}


def _keyed_step(state):
    return {"w": state["w"] * 0.5 + 1.0, "key": state["key"], "count": state["count"] + 1}


def _three_axes():
    return rj.device_mesh((2, 2, 2), ("data", "model", "extra"))


def test_a_typed_prng_key_in_the_state_stays_whole():
    """The search sees a typed key as its uint32 key data, whose words a split could name; jax
    lays out the key itself, of no dims, so it is kept whole and the step compiles."""
    state = _keyed_state()
    lowered = rj.parallelize(_keyed_step, mesh=_three_axes()).lower(state)
    shardings = lowered.plan.input_shardings[0]
    assert shardings["key"].spec == jax.sharding.PartitionSpec() and shardings["w"].spec != shardings["key"].spec
    out = lowered.compile()(state)
    expected = jax.jit(_keyed_step)(state)
    assert out["key"].dtype == expected["key"].dtype
    np.testing.assert_array_equal(jax.random.key_data(out["key"]), jax.random.key_data(expected["key"]))
    assert_same_numbers({k: v for k, v in expected.items() if k != "key"}, {k: v for k, v in out.items() if k != "key"})


def test_a_layout_jax_cannot_make_is_named_before_the_compile():
    """A plan (a saved one, edited) that splits the typed key of no dims: a LayoutError naming it and
    what to pass, not jax's IndexError from inside the compile."""
    state = _keyed_state()
    lowered = rj.parallelize(_keyed_step, mesh=_three_axes()).lower(state)
    plan = lowered.plan
    split = jax.tree.map(lambda s: s, plan.input_shardings)  # a copy
    split[0]["key"] = NamedSharding(split[0]["key"].mesh, jax.sharding.PartitionSpec("extra"))
    bad = dataclasses.replace(lowered, plan=dataclasses.replace(plan, input_shardings=split))
    with pytest.raises(rj.errors.LayoutError, match=r"arg\[0\]\['key'\] \(key<fry>\[\]\) as P\('extra',\), "
                       r"which jax cannot make: the spec has 1 dims for a tensor of shape \[\].*"
                       r"rj\.op_trans\(\"arg\[0\]\['key'\]\", replicate=True\)"):
        bad.compile()


@pytest.mark.parametrize("options", [dict(num_micro_batches=2), dict(pipeline=2, num_micro_batches=2)],
                         ids=["micro-batched", "pipelined"])
def test_a_jax_make_mesh_steps_results_off_the_stages_name_the_users_mesh(options):
    """A micro-batched step's results, and a pipelined step's loss and batch layout, name the
    user's Explicit mesh (not the Auto twin the programs are compiled on), so the user's jitted
    code under jax.set_mesh takes them; a pipelined step's state stays on its stages' sub-meshes."""
    from rhino_jax.models import gpt

    step, args = gpt.make_gpt_train_step(gpt.GPT_TINY), gpt.gpt_example(gpt.GPT_TINY)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    parallel = rj.parallelize(step, mesh=mesh, progress=False, **options)
    plan = parallel.lower(*args).plan
    out = parallel(*args)
    assert_same_numbers(jax.jit(step)(*args), out)
    *state, loss = jax.tree.leaves(out)
    batch = jax.tree.leaves(plan.input_shardings[-1])
    if "pipeline" in options:
        assert all(s.mesh == mesh for s in batch)
        assert all(len(x.sharding.device_set) == 4 for x in state)  # a stage's sub-mesh
    else:
        assert all(s.mesh == mesh for s in jax.tree.leaves(plan.input_shardings))
        assert all(x.sharding.mesh == mesh for x in state)
    assert loss.sharding.mesh == mesh
    with jax.set_mesh(mesh):
        doubled = jax.jit(lambda x: x * 2)(loss)  # the user's own code
    np.testing.assert_array_equal(np.asarray(doubled), 2 * np.asarray(loss))


def _vae_like_step(params, opt_state, batch):
    """An encoder whose mean and variance layers are named as a VAE's are ("mu", "nu" here), and
    Adam, whose moments are also "mu" and "nu"."""
    import optax

    def loss(p):
        h = jnp.tanh(batch["x"] @ p["enc"]["kernel"])
        return jnp.mean((h @ p["mu"]["kernel"] + jnp.exp(h @ p["nu"]["kernel"]) - batch["y"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optax.adam(1e-2).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def test_roles_come_from_the_optimizer_states_type_before_key_names():
    """A layer named "mu" is a parameter, though Adam's first moment is named so too: the
    optimizer state is known by its type (optax's states), and a key name no longer makes a
    parameter optimizer state (it did, and such a layer's kernel was planned and tied as state)."""
    import optax

    k1, k2, k3, k4 = jax.random.split(jax.random.key(1), 4)
    params = {"enc": {"kernel": jax.random.normal(k1, (16, 32))}, "mu": {"kernel": jax.random.normal(k2, (32, 8))},
              "nu": {"kernel": 0.1 * jax.random.normal(k3, (32, 8))}}
    batch = {"x": jax.random.normal(k4, (16, 16)), "y": jnp.zeros((16, 8))}
    args = (params, optax.adam(1e-2).init(params), batch)
    lowered = rj.parallelize(_vae_like_step, mesh=_mesh()).lower(*args)
    roles = dict(zip(lowered.plan.arg_paths, lowered.plan.arg_roles))
    assert [roles[f"arg[0]['{k}']['kernel']"] for k in ("enc", "mu", "nu")] == ["parameter"] * 3
    assert {r for p, r in roles.items() if p.startswith("arg[1]")} == {"optimizer_state"}
    assert [roles[f"arg[2]['{k}']"] for k in ("x", "y")] == ["batch"] * 2
    assert_same_numbers(jax.jit(_vae_like_step)(*args), lowered.compile()(*args))


def test_optimizer_state_passed_last_is_state_by_its_type():
    """step(params, batch, opt_state): the last argument is the batch by position, but an optax
    state is optimizer state wherever it is passed (SGD's momentum is a `trace`, which no key name
    says), and is not split into micro-batches."""
    import optax

    tx = optax.sgd(0.1, momentum=0.9)

    def step(p, batch, s):
        value, grads = jax.value_and_grad(lambda p: jnp.mean((jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"]
                                                              - batch["y"]) ** 2))(p)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    params, batch = _args()
    args = (params, batch, tx.init(params))
    lowered = rj.parallelize(step, mesh=_mesh(), num_micro_batches=2).lower(*args)
    assert lowered.plan.arg_roles == ("parameter",) * 2 + ("batch",) * 2 + ("optimizer_state",) * 2
    assert_same_numbers(jax.jit(step)(*args), lowered.compile()(*args), rtol=1e-4, atol=1e-5)


def _momentum(params, grads, velocity, count):
    """SGD with momentum written by hand: plain dicts, no type says which is state."""
    velocity = jax.tree.map(lambda v, g: 0.9 * v + g, velocity, grads)
    return jax.tree.map(lambda w, v: w - 0.05 * v, params, velocity), velocity, count + 1


def _named_like_state_step(params, opt_state, batch):
    """A model with a layer named "mu" (a VAE's mean) and a bias named "x", trained by a hand-written
    optimizer whose momentum is named "mu" too."""
    def loss(p):
        h = jnp.tanh(batch["x"] @ p["enc"]["kernel"])
        return jnp.mean((h @ p["mu"]["kernel"] + p["x"] - batch["y"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    params, mu, count = _momentum(params, grads, opt_state["mu"], opt_state["count"])
    return params, {"mu": mu, "count": count}, value


def test_the_dataflow_tells_a_layer_named_mu_and_a_parameter_named_x_from_a_hand_written_optimizers_state():
    """Key names mislead here: the layer "mu" is no moment, the bias "x" no batch. The dataflow
    tells them: both meet the batch in the model (a contraction, a broadcast onto the
    activations), the momentum only elementwise with the gradient, at its own shape. The step
    count, an integer no gradient reaches, keeps the role its name gives. Micro-batches split the
    batch alone (a bias "x" taken for a batch was cut in two, and the step failed)."""
    k1, k2, k3 = jax.random.split(jax.random.key(2), 3)
    params = {"enc": {"kernel": jax.random.normal(k1, (16, 32))}, "mu": {"kernel": jax.random.normal(k2, (32, 8))},
              "x": jnp.full((8,), 0.5)}
    opt_state = {"mu": jax.tree.map(jnp.zeros_like, params), "count": jnp.zeros((), jnp.int32)}
    batch = {"x": jax.random.normal(k3, (16, 16)), "y": jnp.zeros((16, 8))}
    args = (params, opt_state, batch)
    lowered = rj.parallelize(_named_like_state_step, mesh=_mesh(), num_micro_batches=2).lower(*args)
    roles = dict(zip(lowered.plan.arg_paths, lowered.plan.arg_roles))
    assert [roles[p] for p in ("arg[0]['enc']['kernel']", "arg[0]['mu']['kernel']", "arg[0]['x']")] == ["parameter"] * 3
    assert {r for p, r in roles.items() if p.startswith("arg[1]")} == {"optimizer_state"}
    assert [roles[f"arg[2]['{k}']"] for k in ("x", "y")] == ["batch"] * 2
    assert_same_numbers(jax.jit(_named_like_state_step)(*args), lowered.compile()(*args), rtol=1e-4, atol=1e-5)


def test_a_batch_between_the_parameters_and_a_hand_written_optimizers_state_is_the_batch():
    """step(params, data, velocity) with keys that name nothing: by position the velocity was the
    batch (cut into micro-batches, the step failed) and the data optimizer state. The velocity is
    fed back, so it is state, and read only by the update, so optimizer state; the data is not fed
    back and its leaves share one leading dim: the batch, split into micro-batches."""
    def step(p, data, velocity):
        value, grads = jax.value_and_grad(lambda p: jnp.mean((jnp.tanh(data["foo"] @ p["w1"]) @ p["w2"]
                                                              - data["bar"]) ** 2))(p)
        p, velocity, _ = _momentum(p, grads, velocity, 0)
        return p, value, velocity

    params, batch = _args()
    args = (params, {"foo": batch["x"], "bar": batch["y"]}, jax.tree.map(jnp.zeros_like, params))
    lowered = rj.parallelize(step, mesh=_mesh(), num_micro_batches=2).lower(*args)
    assert lowered.plan.arg_roles == ("parameter",) * 2 + ("batch",) * 2 + ("optimizer_state",) * 2
    assert_same_numbers(jax.jit(step)(*args), lowered.compile()(*args), rtol=1e-4, atol=1e-5)


def test_a_step_that_feeds_nothing_back_keeps_the_roles_names_and_positions_give():
    """An evaluation step returns no state, so its dataflow tells no role: the key names and
    positions do (the first argument the parameters, the last the batch)."""
    def evaluate(p, data):
        return jnp.mean((jnp.tanh(data["foo"] @ p["w1"]) @ p["w2"] - data["bar"]) ** 2)

    params, batch = _args()
    lowered = rj.parallelize(evaluate, mesh=_mesh()).lower(params, {"foo": batch["x"], "bar": batch["y"]})
    assert lowered.plan.arg_roles == ("parameter",) * 2 + ("batch",) * 2


def test_predictions_returned_where_the_labels_came_in_do_not_make_the_labels_state():
    """step(params, velocity, x, y) → (params, velocity, loss, predictions): the predictions share
    the labels' place, shape and dtype, so they would feed the labels back; but they are not made
    from the labels, so the labels are no state: the batch, as x is."""
    def step(p, velocity, x, y):
        def loss(p):
            predictions = jnp.tanh(x @ p["w1"]) @ p["w2"]
            return jnp.mean((predictions - y) ** 2), predictions

        (value, predictions), grads = jax.value_and_grad(loss, has_aux=True)(p)
        p, velocity, _ = _momentum(p, grads, velocity, 0)
        return p, velocity, value, predictions

    params, batch = _args()
    args = (params, jax.tree.map(jnp.zeros_like, params), batch["x"], batch["y"])
    lowered = rj.parallelize(step, mesh=_mesh()).lower(*args)
    assert lowered.plan.arg_roles == ("parameter",) * 2 + ("optimizer_state",) * 2 + ("batch",) * 2
    assert_same_numbers(jax.jit(step)(*args), lowered.compile()(*args))
