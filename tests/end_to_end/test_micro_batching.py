"""num_micro_batches: the step as k micro-batches of compute-gradients, their sums added up, one
apply-gradients; the numbers of the whole batch, whatever the loss."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rhino_jax as rj
from rhino_jax.errors import MeshError, StagingError
from rhino_jax.hlo_passes import micro_batch
from rhino_jax.hlo_passes.importer import import_module
from rhino_jax.hlo_passes.lowering import lower_on_mesh
from rhino_jax.models import gpt, make_mlp_train_step, mlp_example

from benchmarks.fixtures import third_party_models
from benchmarks.fixtures.third_party_models import GPT, _tokens, linen_clip_adamw, linen_scan_remat
from helpers import assert_same_adam_step, assert_same_numbers, on_host

MESHES = [((8,), ("data",)), ((2, 4), ("data", "model"))]


@pytest.fixture(scope="module")
def small_flax_lms():
    """The third-party Flax LMs with a vocabulary of 256 and 2 layers. The plans stay of the same
    kind (the batch split over data+model, the sums reduced), but at 1024 HiGHS takes about 15 s
    to prove nn.scan's compute-gradients plan optimal, and each layer adds seconds of compiling."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(third_party_models, "VOCAB", 256)
        patch.setattr(third_party_models, "LAYERS", 2)
        yield


@pytest.mark.parametrize("shape,names", MESHES)
@pytest.mark.parametrize("k", [2, 4])
def test_a_gpt_with_adam_keeps_the_whole_batchs_numbers(shape, names, k, tiny_gpt):
    step, args, expected = tiny_gpt
    lowered = rj.parallelize(step, mesh=rj.device_mesh(shape, names), num_micro_batches=k).lower(*args)
    assert_same_numbers(expected, lowered.compile()(*on_host(args)))
    compute, apply = lowered.programs["compute_gradients"], lowered.programs["apply_gradients"]
    assert lowered.plan.cost.total_s == pytest.approx(k * compute.cost.total_s + apply.cost.total_s)
    assert f"{k} micro-batches" in lowered.plan.report()
    compiled = lowered.compile()  # the same programs priced from what XLA compiled
    assert 0 < compiled.compiled_step_s() <= compiled.compiled_step_s(overlapped=False) * (1 + 1e-9)  # CPU: equal
    assert re.search(r"priced from the compiled programs: [\d.]+ ms overlapped, [\d.]+ ms serially \(predicted",
                     compiled.report())


def test_flax_with_global_norm_clipping_keeps_its_numbers(small_flax_lms):
    case = linen_clip_adamw()  # optax.clip_by_global_norm + adamw: the norm is taken after the sums
    step = rj.parallelize(case.step, mesh=rj.device_mesh((2, 4), ("data", "model")), num_micro_batches=2)
    assert_same_adam_step(jax.jit(case.step)(*case.args), step(*on_host(case.args)), lr=1e-3)


def _masked_step(normalize: str):
    """An MLP regression whose loss averages over the examples the mask keeps."""
    def step(params, batch):
        def loss_fn(p):
            err = jnp.sum((jnp.tanh(batch["x"] @ p["w"]) - batch["y"]) ** 2, axis=-1) * batch["mask"]
            total = {"count": jnp.sum(batch["mask"]), "sum": 1.0 * batch["mask"].shape[0], "none": 1.0}[normalize]
            return jnp.sum(err) / total

        loss, g = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda p, d: p - 0.1 * d, params, g), loss

    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)}
    batch = {"x": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32), "y": jnp.asarray(rng.normal(size=(16, 4)), jnp.float32),
             "mask": jnp.asarray(rng.integers(0, 2, 16), jnp.float32)}
    return step, (params, batch)


@pytest.mark.parametrize("normalize", ["sum", "none"])
def test_a_loss_summed_or_divided_by_a_constant_keeps_its_numbers(normalize):
    step, args = _masked_step(normalize)
    out = rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), num_micro_batches=4)(*args)
    assert_same_numbers(jax.jit(step)(*args), out)


@pytest.mark.parametrize("shape,names", MESHES)
def test_a_loss_averaged_over_the_kept_examples_keeps_its_numbers(shape, names):
    """The gradient of each example divides by the whole batch's count of kept examples: the
    micro-batches compute with 1 in its place and apply-gradients divides the sums by it."""
    step, args = _masked_step("count")
    out = rj.parallelize(step, mesh=rj.device_mesh(shape, names), num_micro_batches=4)(*args)
    assert_same_numbers(jax.jit(step)(*args), out)


@pytest.fixture(scope="module")
def masked_flax_lm(small_flax_lms):
    """A Flax LM whose cross-entropy averages over the tokens a padding mask keeps, optax's
    global-norm clipping and AdamW: the step most LM trainers write; its arguments and its
    one-device result."""
    model, batch = GPT(), _tokens()
    batch = dict(batch, mask=(batch["targets"] % 3 != 0).astype(jnp.float32))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    params = model.init(jax.random.PRNGKey(1), batch["tokens"])["params"]

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            logits = model.apply({"params": p}, batch["tokens"])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
            return jnp.sum(ce * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    args = (params, tx.init(params), batch)
    return train_step, args, jax.jit(train_step)(*args)


@pytest.mark.parametrize("pipeline", ["off", 2])
def test_a_flax_lm_with_a_padding_mask_keeps_its_numbers(pipeline, masked_flax_lm):
    step, args, expected = masked_flax_lm
    mesh = rj.device_mesh((2, 4), ("data", "model"))
    out = rj.parallelize(step, mesh=mesh, num_micro_batches=2, pipeline=pipeline)(*on_host(args))
    assert_same_adam_step(expected, out, lr=1e-3)


def test_two_losses_averaged_over_different_counts_are_refused():
    """Each count scales its own loss's gradients: no one factor can be applied after the sums."""
    _, (params, batch) = _masked_step("count")

    def two(params, batch):
        def loss_fn(p):
            err = jnp.sum((jnp.tanh(batch["x"] @ p["w"]) - batch["y"]) ** 2, axis=-1)
            keep, drop = batch["mask"], 1.0 - batch["mask"]
            return jnp.sum(err * keep) / jnp.sum(keep) + jnp.sum(err * drop) / jnp.sum(drop)

        return jax.grad(loss_fn)(params)

    with pytest.raises(StagingError, match="several sums over the batch"):
        rj.parallelize(two, mesh=rj.device_mesh((8,), ("data",)), num_micro_batches=2).lower(params, batch)


def test_batch_statistics_are_refused():
    def step(w, batch):
        def loss_fn(w):
            h = batch @ w
            h = (h - h.mean(axis=0)) / (h.std(axis=0) + 1e-5)  # batch norm
            return jnp.mean(h ** 2)

        return w - 0.1 * jax.grad(loss_fn)(w)

    args = (jnp.ones((4, 4)), jnp.asarray(np.random.default_rng(0).normal(size=(8, 4)), jnp.float32))
    with pytest.raises(StagingError, match="batch statistics"):
        rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), num_micro_batches=2).lower(*args)


def _scanned_step(start):
    """Layers stacked [L, D, D] and run by lax.scan; the loop also carries a sum over the
    batch (its examples' activations) that starts at `start`."""
    def step(params, batch):
        def loss_fn(p):
            def body(carry, w):
                h, total = carry
                h = jnp.tanh(h @ w)
                return (h, total + h.sum(axis=0)), None

            (h, total), _ = jax.lax.scan(body, (batch["x"], start(h_dim)), p["ws"])
            return jnp.mean((h @ p["out"] - batch["y"]) ** 2) + 1e-3 * jnp.sum(total)

        loss, g = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), loss

    rng, h_dim = np.random.default_rng(0), 32
    params = {"ws": jnp.asarray(rng.normal(size=(4, h_dim, h_dim)) / 6, jnp.float32),
              "out": jnp.asarray(rng.normal(size=(h_dim, 8)), jnp.float32)}
    batch = {"x": jnp.asarray(rng.normal(size=(16, h_dim)), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)}
    return step, (params, batch)


@pytest.mark.parametrize("shape,names", MESHES)
def test_a_scan_over_layers_keeps_its_numbers(shape, names):
    """The backward scan adds each layer's weight gradient (a sum over examples) into its carry:
    the loop's results are the sums the micro-batches add up."""
    step, args = _scanned_step(jnp.zeros)
    out = rj.parallelize(step, mesh=rj.device_mesh(shape, names), num_micro_batches=2)(*args)
    assert_same_numbers(jax.jit(step)(*args), out)


def test_flax_scan_with_remat_keeps_its_numbers(small_flax_lms):
    case = linen_scan_remat()
    step = rj.parallelize(case.step, mesh=rj.device_mesh((2, 4), ("data", "model")), num_micro_batches=2)
    assert_same_adam_step(jax.jit(case.step)(*case.args), step(*on_host(case.args)), lr=1e-3)


def test_a_loop_sum_that_does_not_start_at_zero_is_refused():
    step, args = _scanned_step(jnp.ones)  # each micro-batch would add the start again
    with pytest.raises(StagingError, match="does not start at zero"):
        rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), num_micro_batches=2).lower(*args)


def test_a_scan_cannot_be_cut_into_stages_and_says_to_unroll_it():
    step, args = _scanned_step(jnp.zeros)
    with pytest.raises(StagingError, match="a loop runs whole in one stage"):
        rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), pipeline=2, num_micro_batches=2).lower(*args)


def test_micro_batches_that_do_not_divide_the_batch_are_refused():
    step, args = make_mlp_train_step(), mlp_example((8, 16, 8), 6)
    with pytest.raises(MeshError, match="does not divide the batch dim"):
        rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), num_micro_batches=4).lower(*args)
    with pytest.raises(ValueError, match="num_micro_batches must be an int"):
        rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), num_micro_batches=0)


def test_the_boundary_is_one_sum_per_parameter_and_the_loss():
    step, args = make_mlp_train_step(), mlp_example((8, 16, 8), 8, abstract=True)
    mesh = rj.device_mesh((8,), ("data",))
    whole = lower_on_mesh(step, args, mesh, ())
    micro_args = (args[0], args[1], jax.tree.map(lambda x: jax.ShapeDtypeStruct((4,) + x.shape[1:], x.dtype), args[2]))
    micro = lower_on_mesh(step, micro_args, mesh, ())
    graphs = [import_module(s.module, s.arg_paths, s.arg_roles, s.output_paths) for s in (whole, micro)]
    cut, scale = micro_batch.boundary(*graphs)
    assert scale is None  # a mean over a fixed batch size: no batch-wide scale
    params = [a for a in graphs[0].args if a.role == "parameter"]
    assert sorted(graphs[0].values[v].shape for v in cut) == sorted(
        [graphs[0].values[a.value].shape for a in params] + [()])


@pytest.mark.parametrize("limit", [2_200_000, 2_400_000, 2_600_000])
def test_the_step_with_its_running_sums_keeps_within_the_memory_limit(limit):
    """The sums each micro-batch's gradients are added to stay live while the next runs, beside
    compute-gradients: its search counts them, so the step keeps within the limit. (Searched as
    if alone, compute-gradients took 2,404,268 bytes with its sums under 2,400,000.)"""
    step, args = make_mlp_train_step(), mlp_example((64, 512, 512, 512, 64), 256, abstract=True)
    lowered = rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), num_micro_batches=2,
                             memory_limit_bytes=limit).lower(*args)
    compute, apply = (lowered.programs[name].cost.memory_bytes for name in ("compute_gradients", "apply_gradients"))
    assert max(compute, apply) <= lowered.plan.cost.memory_bytes <= limit


@pytest.mark.parametrize("options,donate", [(dict(num_micro_batches=2), (0, 1)),
                                            (dict(num_micro_batches=2, pipeline=2), (0, 1)),
                                            (dict(num_micro_batches=2, pipeline=2), (1,))],
                         ids=["micro-batches", "pipeline", "pipeline-optimizer-state-only"])
def test_donated_state_is_overwritten_by_apply_gradients(options, donate):
    """Donation as jax.jit does it: apply-gradients, the last program to read the parameters and
    optimizer state, aliases them to its outputs, and the donated arrays are deleted; the rest
    stays. In a pipeline, apply-gradients' programs on both stages read Adam's step count (each
    computes the bias corrections from it): neither may overwrite it, so it stays too. The
    updated state, fed back, runs the next step."""
    step, widths = make_mlp_train_step(), (16, 32, 32, 32, 16)  # enough layers for 2 stages
    reference = jax.jit(step)
    expected = reference(*mlp_example(widths, 8))
    parallel = rj.parallelize(step, mesh=rj.device_mesh((2, 4), ("data", "model")), donate_argnums=donate, **options)
    lowered = parallel.lower(*mlp_example(widths, 8, abstract=True))
    undonated = rj.parallelize(step, mesh=parallel.mesh, **options).lower(*mlp_example(widths, 8, abstract=True))
    memory = lambda low: sum(plan.cost.memory_bytes for name, plan in low.plan.programs.items()  # noqa: E731
                             if name.startswith("apply_gradients"))
    assert memory(lowered) < memory(undonated)  # the search counts one buffer for a state and its update
    args = jax.device_put(mlp_example(widths, 8), lowered.plan.input_shardings)
    compiled = lowered.compile()
    applies = [run for name, run in compiled.programs.items() if name.startswith("apply_gradients")]
    assert all(run.memory_analysis().alias_size_in_bytes > 0 for run in applies)
    out = compiled(*args)
    count = "pipeline" in options  # the step count, read on every stage
    for i, arg in enumerate(args):
        for path, x in jax.tree_util.tree_leaves_with_path(arg):
            assert x.is_deleted() == (i in donate and not (count and "count" in jax.tree_util.keystr(path)))
    assert_same_numbers(expected, out)
    batch = mlp_example(widths, 8)[2]
    assert_same_numbers(reference(*expected[:2], batch), compiled(*out[:2], batch))
