"""Counted loops (lax.scan over layers, flax nn.scan(nn.remat(Block))): searched inside.

The body's ops are planned like any others and charged once per trip; a stacked parameter
keeps its layer dim whole and may split the others; the compiled loop runs the plan."""
import dataclasses
import jax
import jax.numpy as jnp
import pytest

import rhino_jax as rj

from helpers import assert_same_numbers

# The compiled programs checked here are the CPU's: plan for its combiner (all-reduces only).
CPU = dataclasses.replace(rj.M8_V100, backend="cpu")

L, D = 3, 128


def _scan_step(p, x):
    """A scanned tanh MLP with stacked [L, ...] weights and plain SGD."""
    def loss(p):
        def layer(h, w):
            return jnp.tanh(h @ w["w"] + w["b"]), None
        h, _ = jax.lax.scan(layer, x, p)
        return jnp.mean(h ** 2)

    value, grads = jax.value_and_grad(loss)(p)
    return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), value


def _scan_args(batch: int, d: int = D):
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    p = {"w": jax.random.normal(k1, (L, d, d)) * 0.1, "b": jnp.zeros((L, d))}
    return p, jax.random.normal(k2, (batch, d))


def _body_values(lowered):
    """Values the plan lays out inside a loop body (the entry node's block arguments included)."""
    g = lowered.graph
    return [v for v in g.values if v.trips > 1 and v.shape and v.id in lowered.plan.value_specs]


def test_scan_large_batch_is_data_parallel_inside_the_loop():
    mesh = rj.device_mesh((8,), ("data",))
    args = _scan_args(16384)
    step = rj.parallelize(_scan_step, mesh=mesh, cluster=CPU)
    lowered = step.lower(*args)
    plan = lowered.plan
    assert plan.fallback_ops == ()
    ops = {n.id: n.op for n in lowered.graph.nodes}
    activations = [v for v in _body_values(lowered)  # computed from the batch (not a bias broadcast)
                   if v.shape[-2:] == (16384, D) and ops[v.producer] != "stablehlo.broadcast_in_dim"]
    assert len(activations) > 10 and all(plan.value_specs[v.id].dims[-2] == ("data",) for v in activations)
    stats = lowered.compile().collectives
    assert stats.count("all-gather") == 0
    # one gradient sum per layer (XLA combines w's and b's), and the loss's
    assert stats.count("all-reduce") == L + 1
    predicted = sum(c.bytes for c in plan.collectives if c.kind in ("all-reduce", "reduce-scatter"))
    assert predicted == stats.bytes("all-reduce")
    assert_same_numbers(jax.jit(_scan_step)(*args), step(*args))


@pytest.mark.parametrize("shape,names", [((8,), ("data",)), ((2, 4), ("data", "model"))])
def test_stacked_weights_split_on_their_layer_dims_under_a_memory_limit(shape, names):
    mesh = rj.device_mesh(shape, names)
    args = _scan_args(16, 256)  # the stacked weight is most of the memory
    free = rj.parallelize(_scan_step, mesh=mesh, cluster=CPU).lower(*args).plan
    assert free.arg_specs[free.arg_paths.index("arg[0]['w']")].is_replicated()
    step = rj.parallelize(_scan_step, mesh=mesh, cluster=CPU, memory_limit_bytes=free.cost.memory_bytes * 8 // 10)
    lowered = step.lower(*args)
    plan, g = lowered.plan, lowered.graph
    w = plan.arg_specs[plan.arg_paths.index("arg[0]['w']")]
    assert not w.is_replicated() and w.dims[0] == ()
    # inside the loop the stacked weight keeps a split layout (not gathered before the loop)
    entries = [n for n in g.nodes if n.op == "stablehlo.while" and "loop_trips" in n.attrs]
    carried = [r for n in entries for r in n.results if g.values[r].shape == (L, 256, 256)]
    assert carried and any(not plan.value_specs[r].is_replicated() for r in carried)
    assert all(plan.value_specs[r].dims[0] == () for r in carried)
    assert plan.cost.memory_bytes <= free.cost.memory_bytes * 8 // 10
    assert_same_numbers(jax.jit(_scan_step)(*args), step(*args))


def test_nested_loops_are_searched_and_charged_per_inner_trip():
    def f(w, x):
        def outer(h, wi):
            h = jax.lax.fori_loop(0, 2, lambda i, h: jnp.tanh(h @ wi), h)
            return h, None
        h, _ = jax.lax.scan(outer, x, w)
        return jnp.sum(h ** 2)

    mesh = rj.device_mesh((8,), ("data",))
    w, x = jnp.stack([jnp.eye(D) * 0.5] * L), jax.random.normal(jax.random.PRNGKey(0), (8192, D))
    step = rj.parallelize(jax.value_and_grad(f), mesh=mesh, cluster=CPU)
    lowered = step.lower(w, x)
    plan = lowered.plan
    assert plan.fallback_ops == ()
    assert max(v.trips for v in lowered.graph.values) == L * 2
    stats = lowered.compile().collectives
    # data parallel: the weight's gradient summed once per inner trip, the loss once
    assert stats.count("all-gather") == 0 and stats.count("all-reduce") == L * 2 + 1
    assert stats.count() == len(plan.collectives) and stats.bytes() == sum(c.bytes for c in plan.collectives)
    assert_same_numbers(jax.jit(jax.value_and_grad(f))(w, x), step(w, x))


flax = pytest.importorskip("flax")
optax = pytest.importorskip("optax")


def _flax_step(scan: bool):
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            y = nn.Dense(4 * 32)(nn.LayerNorm()(h))
            return h + nn.Dense(32)(nn.gelu(y)), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            if scan:
                return nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
                               length=L)()(x, None)[0]
            for _ in range(L):
                x = nn.remat(Block)()(x, None)[0]
            return x

    model, opt = Model(), optax.adamw(1e-3)
    x = jax.random.normal(jax.random.PRNGKey(1), (16384, 32))
    params = model.init(jax.random.PRNGKey(0), x)["params"]

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(model.apply({"params": p}, batch) ** 2))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, opt.init(params), x)


@pytest.mark.parametrize("shape,names", [((8,), ("data",)), ((2, 4), ("data", "model"))])
def test_flax_scan_remat_adamw_matches_one_device_and_its_unrolled_twin(shape, names):
    mesh = rj.device_mesh(shape, names)
    step, args = _flax_step(scan=True)
    parallel = rj.parallelize(step, mesh=mesh, cluster=CPU)
    lowered = parallel.lower(*args)
    assert lowered.plan.fallback_ops == ()
    assert _body_values(lowered)
    assert_same_numbers(jax.jit(step)(*args), parallel(*args))
    unrolled_step, unrolled_args = _flax_step(scan=False)
    twin = rj.parallelize(unrolled_step, mesh=mesh, cluster=CPU).lower(*unrolled_args)
    assert twin.plan.fallback_ops == ()  # remat's optimization barriers pass each tensor on in its layout
    # The scan moves what its twin moves; XLA combines the twin's gradient all-reduces into one
    # op, and the scan's into one per trip (the body's instruction runs each trip): the plans price
    # the same, less those L - 1 launches, which the scan cannot avoid.
    scan_sum, twin_sum = lowered.plan.collective_summary(), twin.plan.collective_summary()
    assert {k: b for k, (_, b) in scan_sum.items()} == {k: b for k, (_, b) in twin_sum.items()}
    assert lowered.plan.cost.compute_s == pytest.approx(twin.plan.cost.compute_s, rel=0.10)
    compiled, planned = lowered.compile().collectives, lowered.plan.collectives
    assert compiled.bytes() == sum(c.bytes for c in planned)  # counted per trip on both sides
    if shape == (8,):  # data parallel inside the loop: one combined gradient all-reduce per trip, and the loss's
        assert scan_sum == {"all-reduce": compiled.by_kind()["all-reduce"]} and scan_sum["all-reduce"][0] == L + 1


def test_constants_a_scan_hoists_are_built_in_the_body_in_its_layout():
    """jax's scan passes the mask and the -1e9 that a masked softmax broadcasts to the scores'
    global shape into the loop, which hands them back unchanged: carried, each was a buffer of the
    loop's whose layout nothing priced, left replicated on every device and sliced each trip (a
    scanned Llama step on described GPUs, `test_gpu_fidelity`). They are built in the body, as the
    unrolled layers build them: in each reader's layout, no loop carries them, and the numbers
    are one device's."""
    from helpers import scanned_attention_step

    batch, heads, seq, head_dim = 32, 8, 128, 32
    step = scanned_attention_step(batch, heads, seq, head_dim)
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    args = (jax.random.normal(k1, (L, heads * head_dim, heads * head_dim)) * 0.1,
            jax.random.normal(k2, (batch, seq, heads * head_dim)))
    parallel = rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), cluster=CPU)
    lowered = parallel.lower(*args)
    g, scores = lowered.graph, (batch, heads, seq, seq)
    entries = [n for n in g.nodes if n.op == "stablehlo.while" and "loop_trips" in n.attrs]
    assert entries and not [o for n in entries for o in n.operands if g.values[o].shape == scores]
    assert lowered.plan.arg_specs[1].dims[0] == ("data",)
    assert f"[{batch},{heads},{seq},{seq}]" not in lowered.compile().as_text()
    assert_same_numbers(jax.jit(step)(*args), parallel(*args))


def test_roles_of_stacked_weights_come_from_the_dataflow_through_the_loop():
    """step(velocity, params, x), the optimizer's state first: by position the velocity would be
    the parameters. The stacked weights go into the scan's loop in slots of their own, apart from
    the activations, and meet them there in a contraction (and the biases in an add onto the
    activations): parameters. The velocity meets only the gradients, elementwise: optimizer
    state."""
    from rhino_jax.hlo_passes.lowering import lower_on_mesh

    def step(velocity, p, x):
        value, grads = jax.value_and_grad(lambda p: _scan_step(p, x)[1])(p)
        velocity = jax.tree.map(lambda v, g: 0.9 * v + g, velocity, grads)
        return velocity, jax.tree.map(lambda w, v: w - 0.1 * v, p, velocity), value

    p, x = _scan_args(8, 16)
    lowered = lower_on_mesh(step, (jax.tree.map(jnp.zeros_like, p), p, x), rj.device_mesh((8,), ("d",)), ())
    assert "stablehlo.while" in str(lowered.module)
    assert lowered.arg_roles == ["optimizer_state"] * 2 + ["parameter"] * 2 + ["batch"]
