"""Sharding rules of ops that user code reaches through common library calls and that used to
fall back to replication: CHLO elementwise ops (exact GELU's erfc, lgamma, ...), gathers and
scatters with batching dims (take_along_axis, optax's integer-label cross entropy and its
gradient), scatters into a table split on the indexed dim, and variadic reduces (argmax over a
split dim), bitcasts between element widths, random bits from an "rbg" key, and what MoE routing
calls: top_k (lowered as a sort), argsort, cumsum."""
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import rhino_jax as rj

from helpers import assert_same_numbers

lax = jax.lax

# One call per op that lowers to a CHLO elementwise op (or to count_leading_zeros); each maps
# (0.1, 0.9) into its domain.
ELEMENTWISE_CALLS = {
    "erf": lax.erf, "erfc": lax.erfc, "erf_inv": lax.erf_inv, "lgamma": lax.lgamma,
    "digamma": lax.digamma, "polygamma": lambda x: lax.polygamma(jnp.ones_like(x), x),
    "zeta": lambda x: lax.zeta(x + 1.5, x), "bessel_i1e": lax.bessel_i1e,
    "next_after": lambda x: lax.nextafter(x, x + 1.0), "acos": lax.acos, "asin": lax.asin,
    "atan": lax.atan, "acosh": lambda x: lax.acosh(x + 1.0), "asinh": lax.asinh, "atanh": lax.atanh,
    "cosh": lax.cosh, "sinh": lax.sinh, "square": lax.square,
    "count_leading_zeros": lambda x: lax.clz((x * 1000).astype(jnp.int32)).astype(x.dtype),
}


def _collectives(compiled, kind=None):
    return [c for c in compiled.collectives.collectives if kind is None or c.kind == kind]


def test_every_elementwise_op_stays_split():
    """Split in, split out: elementwise ops need no communication. Without their rules each one
    is kept replicated and its split input is all-gathered."""
    def f(x):
        x = rj.annotate(x, P("d", None))
        return {name: rj.annotate(op(x), P("d", None)) for name, op in ELEMENTWISE_CALLS.items()}

    x = jnp.linspace(0.1, 0.9, 64 * 128, dtype=jnp.float32).reshape(64, 128)
    lowered = rj.parallelize(f, mesh=rj.device_mesh((8,), ("d",))).lower(x)
    assert not lowered.plan.fallback_ops, lowered.plan.fallback_ops
    compiled = lowered.compile()
    assert not _collectives(compiled), compiled.collectives
    assert_same_numbers(jax.jit(f)(x), compiled(x))


def test_exact_gelu_mlp_gradient_keeps_activations_split():
    """HF Flax BERT's exact GELU lowers to chlo.erfc: with the batch split, the [B, H] hidden
    activations are never gathered (forward or backward)."""
    def loss(w1, w2, x):
        x = rj.annotate(x, P("d", None))
        h = jax.nn.gelu(x @ w1, approximate=False)
        return jnp.mean(rj.annotate(h @ w2, P("d", None)) ** 2)

    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    w1 = jax.random.normal(k1, (128, 512)) / 12
    w2 = jax.random.normal(k2, (512, 128)) / 24
    x = jax.random.normal(k3, (256, 128))
    step = jax.grad(loss, argnums=(0, 1))
    lowered = rj.parallelize(step, mesh=rj.device_mesh((8,), ("d",))).lower(w1, w2, x)
    assert not [op for op in lowered.plan.fallback_ops if "erfc" in op], lowered.plan.fallback_ops
    compiled = lowered.compile()
    gathered = [s for c in _collectives(compiled, "all-gather") for s in c.shapes]
    assert "f32[256,512]" not in gathered, compiled.collectives
    assert_same_numbers(step(w1, w2, x), compiled(w1, w2, x))


B, S, V = 8, 32, 32768  # logits of 32 MiB: gathering them must cost more than the rows' few all-reduces


def _largest_moved(compiled) -> int:
    return max((c.bytes for c in _collectives(compiled)), default=0)


@pytest.mark.parametrize("mesh_shape,axes,spec", [
    ((8,), ("d",), P("d", None, None)),         # data parallel: batch split
    ((8,), ("d",), P(None, None, "d")),         # Megatron's vocabulary-parallel cross entropy
    ((2, 4), ("a", "b"), P("a", None, "b")),    # both at once
])
def test_integer_label_cross_entropy_does_not_gather_logits(mesh_shape, axes, spec):
    """optax.softmax_cross_entropy_with_integer_labels picks each label's logit with a batched
    gather (take_along_axis) and its gradient scatters into [B, S, V] with batching dims. With the
    logits and their gradient split on the batch or the vocabulary, no collective moves more than
    a few values per row (the vocabulary split's row maxima, sums and picked logits), never
    logits."""
    def step(logits, labels):
        def loss(logits):
            return optax.softmax_cross_entropy_with_integer_labels(rj.annotate(logits, spec), labels).mean()
        value, grad = jax.value_and_grad(loss)(logits)
        return value, rj.annotate(grad, spec)

    logits = jax.random.normal(jax.random.PRNGKey(0), (B, S, V))
    labels = jax.random.randint(jax.random.PRNGKey(1), (B, S), 0, V)
    lowered = rj.parallelize(step, mesh=rj.device_mesh(mesh_shape, axes)).lower(logits, labels)
    assert not [op for op in lowered.plan.fallback_ops if op.startswith(("gather", "scatter"))], \
        lowered.plan.fallback_ops
    compiled = lowered.compile()
    assert _largest_moved(compiled) <= 8 * B * S * 4, compiled.collectives
    assert_same_numbers(jax.jit(step)(logits, labels), compiled(logits, labels))


def test_take_along_axis_with_batching_dims_in_the_middle():
    """take_along_axis on axis 1 of [B, S, D]: B and D are batching dims of the gather (and of
    its gradient's scatter); split on D, nothing moves."""
    def f(x, idx):
        x = rj.annotate(x, P(None, None, "d"))
        return rj.annotate(jnp.take_along_axis(x, idx, axis=1) * 2.0, P(None, None, "d"))

    x = jax.random.normal(jax.random.PRNGKey(0), (4, 64, 256))
    idx = jax.random.randint(jax.random.PRNGKey(1), (4, 16, 256), 0, 64)
    lowered = rj.parallelize(f, mesh=rj.device_mesh((8,), ("d",))).lower(x, idx)
    assert not lowered.plan.fallback_ops, lowered.plan.fallback_ops
    compiled = lowered.compile()
    assert not _collectives(compiled), compiled.collectives
    assert_same_numbers(jax.jit(f)(x, idx), compiled(x, idx))


@pytest.mark.parametrize("update", ["set", "add"])
def test_scatter_into_rows_split_table_stays_in_place(update):
    """An update of a row-split table (`table.at[ids].set(rows)`, an embedding gradient's
    scatter-add): each device applies the rows that land in its shard; the table is neither
    gathered nor transposed to another split."""
    def f(table, ids, rows):
        table = rj.annotate(table, P("d", None))
        return rj.annotate(getattr(table.at[ids], update)(rows), P("d", None))

    table = jax.random.normal(jax.random.PRNGKey(0), (4096, 256))
    ids = jax.random.randint(jax.random.PRNGKey(1), (64,), 0, 4096)
    rows = jax.random.normal(jax.random.PRNGKey(2), (64, 256))
    lowered = rj.parallelize(f, mesh=rj.device_mesh((8,), ("d",))).lower(table, ids, rows)
    compiled = lowered.compile()
    assert not _collectives(compiled), compiled.collectives
    assert_same_numbers(jax.jit(f)(table, ids, rows), compiled(table, ids, rows))


def test_bitcast_between_widths_keeps_shared_dims_split():
    """f32 -> u16 adds a last dim of 2 halves (and back removes it): the other dims stay split."""
    def f(x):
        halves = lax.bitcast_convert_type(rj.annotate(x, P("d", None)), jnp.uint16)
        return rj.annotate(lax.bitcast_convert_type(halves ^ jnp.uint16(1), jnp.float32), P("d", None))

    x = jax.random.normal(jax.random.PRNGKey(0), (256, 512))
    lowered = rj.parallelize(f, mesh=rj.device_mesh((8,), ("d",))).lower(x)
    assert not lowered.plan.fallback_ops, lowered.plan.fallback_ops
    compiled = lowered.compile()
    assert not _collectives(compiled), compiled.collectives
    assert_same_numbers(jax.jit(f)(x), compiled(x), rtol=0, atol=0)


def test_dropout_with_an_rbg_key_draws_split_bits():
    """Random bits from an "rbg" key (stablehlo.rng_bit_generator) split like the activations
    they mask, and every device draws exactly its slice of the single-device bits."""
    def dropout(x, key_data):
        key = jax.random.wrap_key_data(key_data, impl="rbg")
        x = rj.annotate(x, P("d", None))
        return rj.annotate(jnp.where(jax.random.bernoulli(key, 0.9, x.shape), x / 0.9, 0.0), P("d", None))

    x = jax.random.normal(jax.random.PRNGKey(0), (256, 512))
    key_data = jax.random.key_data(jax.random.key(3, impl="rbg"))
    lowered = rj.parallelize(dropout, mesh=rj.device_mesh((8,), ("d",))).lower(x, key_data)
    assert not lowered.plan.fallback_ops, lowered.plan.fallback_ops
    compiled = lowered.compile()
    assert not _collectives(compiled), compiled.collectives
    assert_same_numbers(jax.jit(dropout)(x, key_data), compiled(x, key_data), rtol=0, atol=0)


def test_argmax_over_a_split_vocabulary_combines_partial_results():
    """argmax is a two-operand reduce: with its reduced dim split, each device takes the argmax
    of its rows and XLA gathers the 8 partial (max, index) pairs per row, instead of the logits.
    Only the vocabulary divides by 8 here, so the plan cannot move the logits to another split."""
    rows, vocab = 7, 1 << 18

    def accuracy(logits, labels):
        logits = rj.annotate(logits, P(None, None, "d"))
        return jnp.mean(jnp.argmax(logits, axis=-1) == labels)

    logits = jax.random.normal(jax.random.PRNGKey(0), (1, rows, vocab))
    labels = jax.random.randint(jax.random.PRNGKey(1), (1, rows), 0, vocab)
    lowered = rj.parallelize(accuracy, mesh=rj.device_mesh((8,), ("d",))).lower(logits, labels)
    compiled = lowered.compile()
    assert _largest_moved(compiled) <= 8 * rows * 4, compiled.collectives
    assert_same_numbers(jax.jit(accuracy)(logits, labels), compiled(logits, labels))


@pytest.mark.parametrize("route", ["top_k", "argsort", "cumsum"])
def test_routing_ops_keep_their_rows_split(route):
    """What MoE routers and samplers call along the last dim (Mixtral's top-2 of the router's
    logits, a sort's order, a running count of each expert's slots) works row by row: split
    rows stay split, the logits are not gathered."""
    def route_tokens(logits):
        logits = rj.annotate(logits, P("d", None))
        if route == "top_k":
            values, index = lax.top_k(logits, 2)
            return jnp.sum(values * index)
        if route == "argsort":
            return jnp.sum(jnp.argsort(logits, axis=-1)[:, :2] * logits[:, :2])
        return jnp.sum(jnp.cumsum(logits, axis=-1) * logits)

    logits = jax.random.normal(jax.random.PRNGKey(0), (64, 4096))
    lowered = rj.parallelize(route_tokens, mesh=rj.device_mesh((8,), ("d",))).lower(logits)
    assert lowered.plan.fallback_ops == ()
    compiled = lowered.compile()
    assert _largest_moved(compiled) <= 64, compiled.collectives  # the sum's scalars, not rows of logits
    assert_same_numbers(jax.jit(route_tokens)(logits), compiled(logits))


def test_a_mixtral_style_moe_step_has_no_fallback_ops():
    """A Flax top-2 MoE LM (router top_k, GShard dispatch by cumsum and one-hot einsums, AdamW):
    every op has a rule, and the step keeps one device's numbers."""
    from benchmarks.fixtures.third_party_models import linen_moe
    from helpers import assert_same_adam_step

    case = linen_moe()
    lowered = rj.parallelize(case.step, mesh=rj.device_mesh((8,), ("data",))).lower(*case.args)
    assert lowered.plan.fallback_ops == ()
    assert_same_adam_step(jax.jit(case.step)(*case.args), lowered.compile()(*case.args), lr=1e-3)
