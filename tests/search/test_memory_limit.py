"""Rhino §4.4: under a memory limit the largest parameters lose replication first; the plan fits,
keeps the numbers, and an impossible limit gets an error with a true lower bound."""
import dataclasses
import re
import warnings

import jax
import pytest

import rhino_jax as rj
from benchmarks.fixtures import baselines as B
from benchmarks.fixtures.models import gpt
from rhino_jax.models import GPTConfig, gpt_example, make_gpt_train_step, make_mlp_train_step, mlp_example

from helpers import assert_same_numbers, on_host

WIDTHS, BATCH = (256, 256, 1024, 256), 16384  # two 1 MiB weights, one 0.25 MiB


def _lower(args, **kw):
    mesh = rj.device_mesh((8,), ("data",))
    return rj.parallelize(make_mlp_train_step(), mesh=mesh, donate_argnums=(0, 1), **kw).lower(*args)


def _state(plan):
    return [(p, shape, s) for p, shape, s, role in zip(plan.arg_paths, plan.arg_shapes, plan.arg_specs, plan.arg_roles)
            if role in ("parameter", "optimizer_state")]


def test_limit_shards_only_the_largest_weights():
    args = mlp_example(WIDTHS, BATCH, abstract=True)
    free = _lower(args).plan
    assert all(s.is_replicated() for _, _, s in _state(free))  # data parallel without a limit
    limit = free.cost.memory_bytes - (2 << 20)
    lowered = _lower(args, memory_limit_bytes=limit)
    plan = lowered.plan
    assert plan.cost.memory_bytes <= limit
    forced = plan.search_stats.not_replicated
    assert forced and "memory limit" in plan.report()
    big = [p for p, shape, _ in _state(plan) if 1024 in shape and len(shape) == 2]
    # Only 1 MiB weights (or their Adam moments) are forced off replication. The ILP may shard
    # others of its own accord where that costs no time: a sharded state's reduce-scatter and
    # all-gather join combined collectives whose launch is paid already.
    assert all(p in big for p in forced), forced
    assert lowered.compile().memory.argument_bytes <= limit


def test_limit_keeps_the_numbers():
    args = mlp_example((32, 64, 32), 64)
    step = make_mlp_train_step()
    reference = jax.jit(step)(*args)
    mesh = rj.device_mesh((8,), ("data",))
    free = rj.parallelize(step, mesh=mesh).lower(*args).plan
    limited = rj.parallelize(step, mesh=mesh, memory_limit_bytes=free.cost.memory_bytes * 9 // 10)
    assert limited.lower(*args).plan.search_stats.not_replicated
    assert_same_numbers(reference, limited(*args))


def test_a_limit_not_met_within_the_time_limit_says_which_limit_to_raise(solves_out_of_time):
    """One time limit covers the whole search, the memory limit's trials included: when it passes
    before any plan fits (here, before the first solve), no trial starts, and the error names
    the time limit rather than claiming no plan fits."""
    args = mlp_example(WIDTHS, BATCH, abstract=True)
    free = _lower(args).plan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rj.SolverTimeLimitWarning)  # the first solve may stop at the limit too
        with pytest.raises(rj.SolverError, match=r"solver_time_limit_s=60 before it found a plan within "
                                                 r"memory_limit_bytes.*the smallest of the 1 plans"):
            _lower(args, memory_limit_bytes=free.cost.memory_bytes - (2 << 20))


def test_impossible_limit_names_the_largest_tensors():
    args = mlp_example(WIDTHS, BATCH, abstract=True)
    with pytest.raises(rj.MemoryLimitError, match=r"more than the limit.*arg\[2\]\['x'\]"):
        _lower(args, memory_limit_bytes=1 << 20)


def test_bad_limit_value():
    with pytest.raises(ValueError, match="memory_limit_bytes must be a positive int"):
        rj.parallelize(lambda x: x, mesh=rj.device_mesh((8,), ("data",)), memory_limit_bytes=-5)


GPT = GPTConfig(vocab=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=128, batch=8)


@pytest.fixture(scope="module")
def tiny_lm():
    """GPT's step, its arguments, its one-device result and its plan without a limit, made once
    for the tests that compare with them."""
    step, args = make_gpt_train_step(GPT), gpt_example(GPT)
    return step, args, jax.jit(step)(*args), _gpt(step).lower(*args).plan


def _gpt(step, **kw):
    return rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), **kw)


@pytest.mark.parametrize("fraction", [0.99, 0.5])
def test_limit_below_the_free_plan(fraction, tiny_lm):
    """A plan within the limit is found whenever one is solved on the way: forcing the largest
    states off replication alone finds none at 0.5x (it replicates the activations instead)."""
    step, args, reference, free = tiny_lm
    limit = int(free.cost.memory_bytes * fraction)
    limited = _gpt(step, memory_limit_bytes=limit)
    plan = limited.lower(*args).plan
    assert plan.cost.memory_bytes <= limit
    assert plan.cost.total_s >= free.cost.total_s
    assert_same_numbers(reference, limited(*on_host(args)))


def test_impossible_limit_states_a_lower_bound(tiny_lm):
    """The bound the error states is below the memory of every plan, the fully sharded one too."""
    step, args, _, free = tiny_lm
    with pytest.raises(rj.MemoryLimitError, match="Raise the limit") as e:
        _gpt(step, memory_limit_bytes=20_000).lower(*args)
    bound = int(re.search(r"needs at least ([\d,]+) bytes", str(e.value)).group(1).replace(",", ""))
    zoo = gpt.Config(**{f: getattr(GPT, f) for f in ("vocab", "seq_len", "d_model", "n_heads", "n_layers",
                                                      "d_ff", "batch")}, tie_embeddings=False)
    mesh = rj.device_mesh((8,), ("data",))
    sharded = rj.parallelize(B.zero3(gpt, zoo, mesh, persistence_threshold=0),
                             mesh=mesh).lower(*gpt.example(zoo, abstract=True)).plan
    assert 20_000 < bound <= min(sharded.cost.memory_bytes, free.cost.memory_bytes)


@pytest.mark.parametrize("baseline", ["data parallel", "ZeRO-3"])
def test_predicted_memory_tracks_compiled(baseline):
    """Predicted per-device memory within 1.3x of XLA's (arguments + outputs + temporaries) for
    a tiny LM on (8,): fusions keep their intermediates out of memory, gathered copies count.
    Compiled for the CPU here, so predicted for it (`backend="cpu"`: it keeps local slices)."""
    cfg = gpt.Config(vocab=256, seq_len=32, d_model=64, n_heads=4, n_layers=2, d_ff=256, batch=32)
    mesh = rj.device_mesh((8,), ("data",))
    build = B.BASELINES[baseline].build
    step = build(gpt, cfg, mesh, persistence_threshold=0) if baseline == "ZeRO-3" else build(gpt, cfg, mesh)
    cpu = dataclasses.replace(rj.M8_V100, backend="cpu")
    lowered = rj.parallelize(step, mesh=mesh, donate_argnums=(0, 1), cluster=cpu).lower(*gpt.example(cfg, abstract=True))
    compiled = lowered.compile()
    predicted, actual = lowered.plan.cost.memory_bytes, compiled.memory.total
    assert actual / 1.3 <= predicted <= actual * 1.3, (predicted, actual)
    assert "memory: predicted" in compiled.report()


def test_a_cpu_compile_is_not_held_to_the_limit():
    """XLA's CPU compiler schedules and buffers unlike a GPU's (its memory analysis says little of
    a GPU's), so a CPU program over the limit is kept as compiled, without a
    `CompiledMemoryWarning`; a GPU's is compiled again tied to its order
    (`test_gpu_fidelity::test_a_plan_xlas_gpu_schedule_takes_past_the_limit_is_tied_to_its_order`)."""
    from benchmarks.fixtures.llama import Shape, llama_step

    step, shapes = llama_step(Shape(128, 4, 1, 1, 320, vocab=1024), seq=128)
    limit = 10 << 20
    lowered = rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), memory_limit_bytes=limit,
                             donate_argnums=(0, 1), progress=False).lower(*shapes(16))
    assert lowered.plan.cost.memory_bytes <= limit
    with warnings.catch_warnings():
        warnings.simplefilter("error", rj.CompiledMemoryWarning)
        compiled = lowered.compile()
    assert compiled.memory.total > limit, "XLA's CPU program is over the limit"


def test_a_later_overlap_round_starts_from_the_earlier_rounds_answer():
    """`fit_memory` with `near` (the plan an earlier overlap round kept): its k is tried first and
    kept where it fits, one solve instead of the gallop and bisection; where it no longer fits,
    the gallop goes on from it."""
    from rhino_jax.search.memory_limit import fit_memory
    base = rj.parallelize(make_mlp_train_step(), mesh=rj.device_mesh((8,), ("data",))).lower(
        *mlp_example((32, 64, 32), 64, abstract=True)).plan
    solved = []

    def plan_with(forced, weight_s=0.0):  # k arguments forced off replication: 10 bytes less, 1 s more each
        solved.append(len(forced))
        cost = dataclasses.replace(base.cost, memory_bytes=100 - 10 * len(forced), total_s=len(forced))
        return dataclasses.replace(base, cost=cost,
                                   search_stats=dataclasses.replace(base.search_stats,
                                                                    not_replicated=tuple(map(str, forced))))

    def fit(near=None):
        solved.clear()
        unlimited = plan_with([])
        solved.clear()
        return fit_memory(plan_with, list(range(12)), [], unlimited, 45, None, 0, near=near)
    alone = fit()
    assert len(alone.search_stats.not_replicated) == 6 and solved == [1, 3, 7, 5, 6]  # gallop, bisection
    assert fit(near=alone) is not None and solved == [6]
    assert len(fit(near=plan_with(range(5))).search_stats.not_replicated) == 6 and solved == [5, 6]


def test_a_limit_the_first_overlap_round_cannot_meet_is_searched_with_nothing_hidden():
    """With overlap (the GPU preset), the first round prices collectives off the chain as hidden:
    an MLP of 4096-wide weights then gathers whole weights, whose peak pricing memory on
    average does not lower. A limit its plans miss but the search that hides nothing meets gets
    that search's plan, not a MemoryLimitError."""
    step, args = make_mlp_train_step(), mlp_example((64, 4096, 4096, 4096, 64), 256, abstract=True)
    limit = 150_000_000
    plan = rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), cluster="8x-h100",
                          memory_limit_bytes=limit).lower(*args).plan
    assert plan.cost.memory_bytes <= limit
