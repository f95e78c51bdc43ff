"""Of the plans a search weighed, the one whose compiled program runs fastest is kept
(`rhino_jax.compiled_choice`): for described H100s each candidate is compiled as `compile()`
compiles it and priced as its schedule runs; on CPUs nothing is compiled at `lower()`."""
import dataclasses
import functools

import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rhino_jax as rj
from benchmarks.fixtures.llama import Shape, llama_step
from rhino_jax.compiled_choice import fastest_compiled
from rhino_jax.mesh_search import plan_on
from rhino_jax.runtime.compiled.compiled_cost import price_compiled
from rhino_jax.search.cost.cluster import MeshTopology, get_cluster
from helpers import _plugin_skip

SHAPE = Shape(128, 4, 1, 1, 320, vocab=1024)


def _lowered(mesh, **options):
    """The step lowered on `mesh`; given `plan=`, compiled as it is, with no other plan to weigh."""
    step, shapes = llama_step(SHAPE, seq=128)
    return rj.parallelize(step, mesh=mesh, donate_argnums=(0, 1), progress=False, **options).lower(*shapes(16))


def _gpus():
    return rj.device_mesh((8,), ("data",), devices=rj.gpu_topology("h100"))


@functools.cache
def _searched():
    """The step's plan on described H100s, as the search makes it."""
    return _lowered(_gpus()).plan


@functools.cache
def _two_plans():
    """The step's plans on described H100s: the search's, and one with the parameters split over
    the 8 devices (`op_trans`), which holds less (no memory limit: each compiles once, untied).
    Its tests run in one pytest-xdist worker (`_TWO_PLANS`, `--dist loadgroup`)."""
    return _searched(), _lowered(_gpus(), constraints=[rj.op_trans("arg[0]*", parts=(8,))]).plan


_TWO_PLANS = pytest.mark.xdist_group("two_plans")


@pytest.mark.skipif(_plugin_skip() is not None, reason=_plugin_skip() or "")
@_TWO_PLANS
def test_the_faster_compiled_of_two_plans_is_kept_whatever_their_order(tmp_path):
    """Two plans of one step on described H100s (`_two_plans`): given slower first, the faster program is kept, as compiled, with both listed in its report
    and its saved file."""
    mesh, plans = _gpus(), _two_plans()
    assert plans[0].arg_specs != plans[1].arg_specs, "two layouts to choose from"
    given = [_lowered(mesh, plan=p) for p in plans]
    seconds = [price_compiled(g.compile()._executable, "8x-h100").overlapped_s for g in given]
    slower, faster = sorted(range(2), key=lambda i: -seconds[i])
    assert seconds[slower] > seconds[faster]
    candidates = [given[slower], given[faster]]  # compiled: weighed as they are
    kept = fastest_compiled(candidates)
    assert kept is candidates[1] and kept.plan.arg_specs == plans[faster].arg_specs
    listed = kept.plan.search_stats.compiled_candidates
    assert [c.kept for c in listed] == [False, True]
    assert [c.compiled_s for c in listed] == pytest.approx([seconds[slower], seconds[faster]])
    assert all(c.compile_s is not None and c.compile_s >= 0 for c in listed), "what each compile took"
    assert kept.compile() is kept._compiled and kept.compile().plan is kept.plan, "kept compiled, not compiled again"
    assert "compiled        " in kept.plan.report() and f"*{seconds[faster] * 1e3:.4g} ms" in kept.plan.report()
    assert "compiled in " in kept.plan.report()
    for i, plan in enumerate((kept.plan, plans[0])):  # the second lowered as users do, its candidates its search's
        plan.save(tmp_path / f"{i}.json")
        loaded = rj.Plan.load(tmp_path / f"{i}.json")
        assert loaded == plan and loaded.search_stats.compiled_candidates == plan.search_stats.compiled_candidates


@pytest.mark.skipif(_plugin_skip() is not None, reason=_plugin_skip() or "")
@_TWO_PLANS
def test_a_program_over_the_limit_is_not_kept():
    """Of two programs compiled, the one over the devices' memory is not kept, though listed
    first (the limit is set after they were compiled, so that no remedy brings the larger under)."""
    candidates = [_lowered(_gpus(), plan=p) for p in _two_plans()]
    sizes = [c.compile().memory.total for c in candidates]
    assert sizes[1] < sizes[0]
    for c in candidates:
        c.memory_limit_bytes = (sizes[0] + sizes[1]) // 2
    kept = fastest_compiled(candidates)
    assert kept is candidates[1]
    assert [c.fits for c in kept.plan.search_stats.compiled_candidates] == [False, True]


@pytest.mark.skipif(_plugin_skip() is not None, reason=_plugin_skip() or "")
@_TWO_PLANS
def test_gradients_are_reduce_scattered_where_a_combined_all_reduce_costs_a_kernel_per_gradient():
    """GPU XLA runs the gradients' combined all-reduce on one buffer: a kernel concatenates them
    into it and one per gradient slices each out (this step's 40 gradients: 76 µs of launches in
    0.87 ms). The search charges those kernels, so its plan reduce-scatters the gradients and
    gathers the updates instead, and runs faster than data parallel compiled by `jax.jit`."""
    plan, mesh = _searched(), _gpus()
    kinds = plan.collective_summary("gpu")
    assert kinds.get("reduce-scatter", (0, 0))[0] and not kinds.get("all-reduce", (0, 0))[0], kinds
    step, shapes = llama_step(SHAPE, seq=128)
    whole, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    data_parallel = jax.jit(step, in_shardings=(whole, whole, rows), out_shardings=(whole, whole, whole),
                            donate_argnums=(0, 1)).lower(*shapes(16)).compile()
    ours = min(c.compiled_s for c in plan.search_stats.compiled_candidates if c.compiled_s is not None)
    assert ours < price_compiled(data_parallel, "8x-h100").overlapped_s


def test_on_cpus_nothing_is_compiled_at_lower_though_the_search_weighed_other_plans():
    """CPU programs run their collectives synchronously: the search's replay is what runs."""
    mesh = rj.device_mesh((8,), ("data",))
    lowered = _lowered(mesh, cluster="8x-h100")
    inputs = lowered.plan.search_inputs
    cluster = get_cluster("8x-h100")
    assert plan_on(inputs.graph, MeshTopology.from_mesh(mesh, cluster), cluster, inputs.options).alternatives, \
        "the search weighed other layouts"
    assert lowered._compiled is None and not lowered.plan.search_stats.compiled_candidates


def test_a_plan_priced_alike_to_one_kept_is_not_weighed_beside_it():
    """Two overlap rounds' plans that differ only where nothing is priced (here one value's
    layout), of the same step, memory and collectives, are one program to XLA: one of them is
    weighed. A plan priced otherwise is weighed beside it."""
    from rhino_jax.models import make_mlp_train_step, mlp_example
    from rhino_jax.search.planner import _other_layouts

    step, args = make_mlp_train_step(), mlp_example((64, 256, 64), 1024, abstract=True)
    plan = rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), cluster="8x-h100").lower(*args).plan
    value, spec = next(iter(plan.value_specs.items()))
    other = next(s for s in plan.value_specs.values() if s != spec)
    twin = dataclasses.replace(plan, value_specs={**plan.value_specs, value: other})
    slower = dataclasses.replace(twin, cost=dataclasses.replace(plan.cost, total_s=plan.cost.total_s * 1.01))
    assert _other_layouts(plan, [plan, twin]) == ()
    assert [p.cost for p in _other_layouts(plan, [plan, twin, slower])] == [slower.cost]


def test_a_plan_predicted_far_slower_than_one_compiled_that_fits_is_not_compiled(monkeypatch):
    """Compiling is what costs (seconds to minutes a plan): a plan predicted more than
    `SURE_GAP` slower than the fastest compiled one that fits is not compiled; one within it is,
    though predicted above that program's compiled step (the replay can overestimate it), and a
    program over the devices' memory bars nothing."""
    from types import SimpleNamespace

    import numpy as np

    from rhino_jax import compiled_choice
    from rhino_jax.models import make_mlp_train_step, mlp_example

    step, args = make_mlp_train_step(), mlp_example((64, 256, 64), 1024, abstract=True)
    plan = rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), cluster="8x-h100").lower(*args).plan
    gpu = SimpleNamespace(devices=np.array([SimpleNamespace(platform="gpu")]))

    def candidate(predicted_ms: float, compiled_ms: float, nbytes: int):
        cost = dataclasses.replace(plan.cost, total_s=predicted_ms * 1e-3)
        return SimpleNamespace(plan=dataclasses.replace(plan, cost=cost), mesh=gpu, memory_limit_bytes=100,
                               _compiled=SimpleNamespace(plan=None), _said=(), compiled=(compiled_ms * 1e-3, nbytes))

    compiled = []
    monkeypatch.setattr(compiled_choice, "_compile", lambda c, i, n: compiled.append(i) or compiled_choice._Compiled(
        c, *c.compiled, (), 0.0))
    gap = 1 + compiled_choice.SURE_GAP
    # over the memory: bars nothing; fits, compiled at 0.8 ms where 1.0 was predicted; within the
    # gap of 1.0 (above 0.8), compiled, slower; past it, not compiled (had it been, the fastest)
    candidates = [candidate(0.9, 0.7, 200), candidate(1.0, 0.8, 50), candidate(0.99 * gap, 0.85, 50),
                  candidate(1.01 * gap, 0.1, 50)]
    kept = compiled_choice.fastest_compiled(candidates)
    assert compiled == [0, 1, 2]
    assert kept is candidates[1]
    assert [c.compiled_s is None for c in kept.plan.search_stats.compiled_candidates] == [False, False, False, True]
