"""rj.coshard (nnScaler's co-shard): the named ops run in chunks one after another on the same
devices; the step keeps one device's numbers, what the chunks make and drop takes a fraction of
the memory, and a coshard that cannot be applied is an error that says what to change."""
import jax
import pytest

import rhino_jax as rj
from rhino_jax import coshard_search
from rhino_jax.errors import ConstraintError

from benchmarks.fixtures.third_party_models import masked_remat_lm, remat_lm
from helpers import assert_same_adam_step
from helpers import _plugin_skip, _readme_example

ATTENTION = "*MultiHeadDotProductAttention_0/*"
# Chunks planned: refused on a jax whose XLA runs them side by side (`coshard_search.ORDERED_FROM`).
chunked = pytest.mark.skipif(tuple(int(p) for p in jax.__version__.split(".")[:2]) < coshard_search.ORDERED_FROM,
                             reason=f"jax {jax.__version__}: co-shard is refused (its XLA runs the chunks side by side)")
LR = 1e-3  # remat_lm's AdamW


def lm_step(batch: int, seq: int, vocab: int = 64, width: int = 32):
    case = remat_lm(batch, seq, vocab, width)
    return case.step, case.args


@pytest.fixture(scope="module")
def small():
    step, args = lm_step(batch=8, seq=32)
    return step, args, jax.jit(step)(*args)


def _mesh():
    return rj.device_mesh((8,), ("data",))


def _lower(step, args, *constraints, **options):
    return rj.parallelize(step, mesh=_mesh(), constraints=list(constraints), progress=False, **options).lower(*args)


@chunked
def test_attention_in_chunks_keeps_one_devices_numbers(small, tmp_path):
    """Chunked attention (forward, recomputed forward and backward of both blocks) runs with one
    device's numbers; the program holds the chunks' slices and their order barriers; a saved plan
    cuts the step the same way when loaded."""
    step, args, reference = small
    coshard = rj.coshard(ATTENTION, chunks=4)
    lowered = _lower(step, args, coshard)
    plan = lowered.plan
    assert plan.execution.coshard, "no group was cut"
    assert {c.chunks for c in plan.execution.coshard} == {4}
    assert "co-shard" in plan.report() and "in 4 chunks" in plan.report()
    text = lowered.as_text()
    assert "stablehlo.optimization_barrier" in text and "stablehlo.slice" in text
    compiled = lowered.compile()
    assert_same_adam_step(reference, compiled(*args), LR)
    plan.save(tmp_path / "plan.json")
    again = rj.parallelize(step, mesh=_mesh(), plan=str(tmp_path / "plan.json"), constraints=[coshard],
                           progress=False).lower(*args)
    assert again.as_text() == text
    assert_same_adam_step(reference, again.compile()(*args), LR)


@chunked
def test_auto_picks_chunks_that_fit_the_memory_limit(small):
    """With chunks='auto' the search tries no chunks, 2, 4, ...: under a limit the plan without
    chunks exceeds, it keeps the fastest plan that fits (with chunks), and still one device's numbers."""
    step, args, reference = small
    free = _lower(step, args).plan
    limit = int(free.cost.memory_bytes * 0.9)
    lowered = _lower(step, args, rj.coshard(ATTENTION), memory_limit_bytes=limit)
    plan = lowered.plan
    tried = plan.search_stats.coshard_candidates
    assert [c.chunks for c in tried][0] > 1, "the plan without chunks exceeds the limit and is not among those kept"
    assert plan.cost.memory_bytes <= limit and plan.execution.coshard
    assert_same_adam_step(reference, lowered.compile()(*args), LR)


@chunked
def test_the_readme_coshard_example_runs_with_one_devices_numbers(small):
    step, args, reference = small
    lowered = _readme_example(3, step, _mesh())["step"].lower(*args)
    assert "co-shard" in lowered.plan.report()
    assert_same_adam_step(reference, lowered.compile()(*args), LR)


def _temporaries(case, mesh, *constraints):
    """The compiled step's temporaries (`memory_analysis()`) under the plan, and the compiled step."""
    lowered = rj.parallelize(case.step, mesh=mesh, constraints=list(constraints), progress=False).lower(*case.args)
    compiled = lowered.compile()
    return compiled.memory_analysis().temp_size_in_bytes, compiled


@chunked
def test_attention_given_its_mask_in_chunks_takes_at_most_six_tenths_of_the_temporaries():
    """The user's LM: the causal mask made once and handed to each remat block, attention with
    biases (d 128, 8 heads, seq 512, batch 8, (8,)). The bias reshapes and the mask's compare run
    whole before the chunks, the output bias is added after them, the weights' gradients after
    them too: the chunks cut the heads, and the CPU compile holds at most 0.6x the temporaries of
    the plan without chunks, with one device's numbers."""
    case = masked_remat_lm()
    free, _ = _temporaries(case, _mesh())
    chunked, compiled = _temporaries(case, _mesh(), rj.coshard(ATTENTION, chunks=4))
    assert chunked <= 0.6 * free, (chunked, free)
    assert_same_adam_step(jax.jit(case.step)(*case.args), compiled(*case.args), LR)


@chunked
@pytest.mark.skipif(_plugin_skip() is not None, reason=_plugin_skip() or "")
@pytest.mark.parametrize("model", [remat_lm, masked_remat_lm])
def test_chunked_attention_takes_at_most_six_tenths_of_the_temporaries_on_the_gpu_compile(model):
    """Seq 512 on 8 described H100s, data parallel: the attention's [batch, heads, seq, seq]
    tensors are most of the step's temporaries. In 4 chunks each backward chunk recomputes its
    own slice of the probabilities, the weights' gradients run after the chunks, and XLA's GPU
    compile (`memory_analysis()`) holds at most 0.6x the temporaries of the plan without chunks."""
    case = model()
    mesh = rj.device_mesh((8,), ("data",), devices=rj.gpu_topology("h100"))
    free, _ = _temporaries(case, mesh)
    chunked, _ = _temporaries(case, mesh, rj.coshard(ATTENTION, chunks=4))
    assert chunked <= 0.6 * free, (chunked, free)


@chunked
def test_a_fixed_number_of_chunks_that_saves_no_memory_is_refused(small):
    """A Dense layer's ops keep to themselves more than they read (the matmul before its bias),
    but what leaves them is as large: in chunks the plan holds no less, and the error says so,
    with both predictions and what to do instead."""
    step, args, _ = small
    with pytest.raises(ConstraintError, match=r"the plan in 4 chunks is predicted to hold [\d.]+ MiB per device, the "
                                              r"plan without chunks [\d.]+ MiB: chunking these ops saves no memory"):
        _lower(step, args, rj.coshard("*Dense_0/*", chunks=4))


@pytest.mark.parametrize("chunks", [4, "auto"])
def test_a_coshard_on_a_jax_whose_xla_runs_the_chunks_side_by_side_is_refused(small, monkeypatch, chunks):
    """The chunks' order barriers are dropped before XLA schedules (jax before 0.12, measured):
    the chunks would hold more than no chunks, so a coshard is refused, saying so and what to do."""
    step, args, _ = small
    monkeypatch.setattr(coshard_search, "ORDERED_FROM", (99, 0))
    with pytest.raises(ConstraintError, match=r"co-shard needs jax 99.0 or newer\. The XLA of jax .* so the "
                                              r"chunks run side by side .* Upgrade jax and jaxlib, or leave the coshard out"):
        _lower(step, args, rj.coshard(ATTENTION, chunks=chunks))


def test_a_coshard_of_ops_that_keep_nothing_larger_than_they_read_is_an_error(small):
    """A LayerNorm's ops make values of their input's size: no chunk would save anything."""
    step, args, _ = small
    with pytest.raises(ConstraintError, match=r"keeps to itself a value larger than what it reads .* so chunks would "
                                              r"save no memory"):
        _lower(step, args, rj.coshard("*LayerNorm_0/*", chunks=4))


@pytest.mark.parametrize("chunks", [1, 0, 2.5, "some", True])
def test_chunks_must_be_an_int_of_two_or_more_or_auto(chunks):
    with pytest.raises(ConstraintError, match="chunks must be an int >= 2 or 'auto'"):
        rj.coshard(ATTENTION, chunks=chunks)


def test_a_coshard_no_dim_of_which_divides_is_an_error_naming_it(small):
    """Heads 4, batch 8, seq 32: no dim of the attention's [8, 4, 32, 32] scores is divisible by 3."""
    step, args, _ = small
    with pytest.raises(ConstraintError, match=r"coshard\('\*MultiHeadDotProductAttention_0/\*', chunks=3\): none of "
                                              r"the \d+ groups of ops it names can be cut into 3 chunks"):
        _lower(step, args, rj.coshard(ATTENTION, chunks=3))


def test_a_coshard_that_names_nothing_is_an_error(small):
    step, args, _ = small
    with pytest.raises(ConstraintError, match="names no op or argument of the step"):
        _lower(step, args, rj.coshard("*NoSuchModule*/*", chunks=2))


def test_a_coshard_with_a_pipeline_is_an_error_saying_what_to_change(small):
    step, args, _ = small
    with pytest.raises(ConstraintError, match="pass mesh= and leave pipeline and num_micro_batches"):
        _lower(step, args, rj.coshard(ATTENTION, chunks=2), pipeline=2, num_micro_batches=2)


def test_a_coshard_that_names_arguments_only_says_how_to_name_ops(small):
    """A glob that names parameters but no op (as a Flax NNX module path would: NNX adds no name
    scope to its ops) is an error that says so and how to name the ops."""
    step, args, _ = small
    with pytest.raises(ConstraintError, match=r"names arguments only .* jax.named_scope"):
        _lower(step, args, rj.coshard("*MultiHeadDotProductAttention_0']['query']['kernel']", chunks=2))
