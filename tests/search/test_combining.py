"""Collectives XLA combines: which ones, how the plan counts them, how the search prices them."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rhino_jax as rj
from rhino_jax.hlo_passes.importer import import_module
from rhino_jax.hlo_passes.lowering import lower_on_mesh
from rhino_jax.models import mlp
from rhino_jax.core.plan import PlannedCollective
from rhino_jax.search import pricing
from rhino_jax.search.solvers import ilp
from rhino_jax.search.cost.cluster import MeshTopology, combiner_for, get_cluster
from rhino_jax.search.cost.combining import (DERIVED, HEAD, TAIL, combine, combining_sides, families,
                                             member_kernels_s, op_kernels_s)

from benchmarks.fixtures.third_party_models import linen_gpt
from helpers import assert_same_adam_step, assert_same_numbers, on_host

GPU, CPU = combiner_for("gpu"), combiner_for("cpu")


def _planned(kind, nbytes, depends_on=0, axes=("d",)):
    return PlannedCollective(kind, axes, nbytes, 0.0, "", True, depends_on)


def test_independent_collectives_combine_and_a_dependent_one_opens_a_new_op():
    planned = [_planned("all-reduce", 1024), _planned("all-reduce", 2048),
               _planned("all-reduce", 4, depends_on=0b11),  # a norm of both: waits for them
               _planned("all-reduce", 8, axes=("e",))]  # other device groups
    assert combine(planned, GPU) == [[0, 1], [2], [3]]


def test_only_collectives_of_one_conditional_branch_combine():
    branch = [(), (1,), (1,), (2,)]  # outside, twice in branch 1, in branch 2: each its own computation
    planned = [dataclasses.replace(_planned("all-reduce", 64), branch=b) for b in branch]
    assert combine(planned, CPU) == [[0], [1, 2], [3]]


def test_the_byte_threshold_splits_a_family():
    limit = GPU.limit("all-reduce")
    planned = [_planned("all-reduce", limit // 2)] * 3
    assert combine(planned, GPU) == [[0, 1], [2]]
    assert combine(planned, CPU) == [[0, 1, 2]]  # the CPU combines all-reduces whatever their size


def test_the_cpu_combines_only_all_reduces_and_runs_reduce_scatters_as_all_reduces():
    planned = [_planned("all-gather", 64), _planned("all-gather", 64),
               _planned("reduce-scatter", 64), _planned("all-reduce", 64)]
    assert combine(planned, GPU) == [[0, 1], [2], [3]]
    assert combine(planned, CPU) == [[0], [1], [2, 3]]


def test_a_reduce_scatter_counts_its_scattered_result_against_the_threshold():
    """XLA's combiner adds up results: 8 reduce-scatters over 8 devices whose operands are half
    the threshold each are one op (their results, 1/8 of that, fit), as 8 all-gathers are not."""
    limit = GPU.limit("reduce-scatter")
    scatters = [dataclasses.replace(_planned("reduce-scatter", limit // 2), group=8)] * 8
    gathers = [dataclasses.replace(_planned("all-gather", limit // 2), group=8)] * 8
    assert [len(g) for g in combine(scatters, GPU)] == [8]
    assert [len(g) for g in combine(gathers, GPU)] == [2] * 4


def test_all_reduces_and_reduce_scatters_combine_per_element_type_all_gathers_across():
    """A bf16 step's f32 LayerNorm gradients are reduce-scattered in an op of their own (measured
    on GPU compiles of a bf16 Flax LM); its all-gathers mix bf16 and f32 in one op."""
    for kind, groups in (("reduce-scatter", [[0, 2], [1]]), ("all-reduce", [[0, 2], [1]]), ("all-gather", [[0, 1, 2]])):
        planned = [dataclasses.replace(_planned(kind, 64), dtype=t) for t in ("bfloat16", "float32", "bfloat16")]
        assert combine(planned, GPU) == groups, kind


def test_a_global_norms_partial_all_reduces_are_one_family_on_the_gpu_only():
    """GPU XLA reassociates a sum of all-reduces into one; on the CPU each follows its gradient's
    all-reduce and runs alone (`combined_alone`)."""
    topo = MeshTopology(("d",), (8,), (1e11,), (1e-6,), 1e-5, combiner=GPU)
    derived = [key for key in families(topo).index if key[2] == DERIVED]
    assert [key[0] for key in derived] == ["all-reduce", "all-gather", "reduce-scatter"]
    cpu = families(dataclasses.replace(topo, combiner=CPU)).index
    assert not [key for key in cpu if key[2] == DERIVED]


def test_a_combined_gpu_all_reduce_costs_a_slice_per_member_and_one_concatenation():
    """GPU XLA runs a combined all-reduce on one buffer: a kernel concatenates its members into
    it and one per member slices each out, each reading and writing the member's bytes. Tuples
    elsewhere: reduce-scatters, and all-reduces on the CPU; a DERIVED sum reassociated into one
    all-reduce; a collective alone."""
    topo = MeshTopology(("d",), (8,), (1e11,), (1e-6,), 1e-5, combiner=GPU, memory_bandwidth=1e12,
                        kernel_launch_s=2e-6)
    planned = [_planned("all-reduce", 1000), _planned("all-reduce", 3000), _planned("reduce-scatter", 8000)]
    sides = [TAIL, TAIL, TAIL]
    assert op_kernels_s(planned, [0, 1], sides, topo) == pytest.approx(3 * 2e-6 + 4 * 4000 / 1e12)
    assert member_kernels_s("all-reduce", 1000, TAIL, topo) == pytest.approx(2e-6 + 4 * 1000 / 1e12)
    assert op_kernels_s(planned, [0], sides, topo) == 0.0
    assert op_kernels_s(planned, [0, 1], [DERIVED, DERIVED], topo) == 0.0
    assert member_kernels_s("reduce-scatter", 8000, TAIL, topo) == 0.0
    assert op_kernels_s(planned, [0, 1], sides, dataclasses.replace(topo, combiner=CPU)) == 0.0


def test_the_count_threshold_splits_a_family():
    planned = [_planned("all-reduce", 4)] * (GPU.threshold_count + 1)
    assert [len(g) for g in combine(planned, GPU)] == [GPU.threshold_count, 1]


def test_the_sides_of_the_compute_chain():
    """Weights are on the head side, weight gradients and their optimizer updates on the tail;
    an activation between two matmuls is on the chain (no side)."""
    step = mlp.make_mlp_train_step()
    args = mlp.mlp_example((16, 32, 32, 8), 8)
    lowered = lower_on_mesh(step, args, rj.device_mesh((8,), ("d",)), ())
    graph = import_module(lowered.module, lowered.arg_paths, lowered.arg_roles, lowered.output_paths)
    sides = combining_sides(graph)
    dots = [n for n in graph.nodes if n.op == "stablehlo.dot_general"]
    weights = {a.value for a in graph.args if a.role == "parameter"}
    # every weight-gradient dot's result (the last dot reading it per weight) feeds the optimizer only
    grads = [n.results[0] for n in dots if not any(o in weights for o in n.operands)
             and all(m.op != "stablehlo.dot_general" for m in graph.nodes if n.results[0] in m.operands)]
    assert grads and all(sides[g] == TAIL for g in grads)
    assert all(sides[w] == HEAD for w in weights)
    assert all(sides[o] == TAIL for o, path in zip(graph.outputs, graph.output_paths)
               if path.startswith("out[0]"))  # updated parameters
    hidden = dots[0].results[0]  # the first layer's output, read by the next layer's matmul
    assert hidden not in sides


def test_a_global_norm_of_the_gradients_is_derived():
    """Global-norm clipping reduces each gradient (its all-reduce, where the gradient is split,
    follows the gradient's own one by one, so XLA combines neither): the reductions and the
    clipped gradients are DERIVED, the unclipped gradients TAIL."""
    def step(params, batch):
        grads = jax.grad(mlp.mlp_loss)(params, batch)
        norm = jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grads)))
        return jax.tree.map(lambda p, g: p - 0.1 * g / jnp.maximum(norm, 1.0), params, grads)

    params, _, batch = mlp.mlp_example((16, 32, 8), 8)
    lowered = lower_on_mesh(step, (params, batch), rj.device_mesh((8,), ("d",)), ())
    graph = import_module(lowered.module, lowered.arg_paths, lowered.arg_roles, lowered.output_paths)
    sides = combining_sides(graph)
    norms = [r for n in graph.nodes if n.op == "stablehlo.reduce" for r in n.results if sides.get(r) == DERIVED]
    assert norms and all(graph.values[r].shape == () for r in norms)
    assert all(sides[o] == DERIVED for o in graph.outputs)  # clipped by the derived norm
    assert any(side == TAIL for side in sides.values())


def test_a_family_variable_pays_one_launch_for_all_its_users():
    """Two groups each choose between a strategy that uses a combined family (1.0 s) and one that
    does not (1.3 s); the family's launch is paid once, however many use it. With a launch of
    1.0 s neither takes it (both: 3.0 s, neither: 2.6 s); with 0.5 s both do (2.5 s)."""
    uses = (np.array([[True, False]]), np.array([[True, False]]))
    for fixed, want in ((1.0, (1, 1)), (0.5, (0, 0))):
        problem = ilp.Problem((np.array([1.0, 1.3]), np.array([1.0, 1.3])), (), (fixed,), uses)
        solution = ilp.solve(problem)
        assert solution.choice == want
        best = min(((a, b) for a in range(2) for b in range(2)), key=lambda c: ilp.evaluate(problem, c))
        assert solution.choice == best
        assert solution.objective_s == pytest.approx(ilp.evaluate(problem, best))


def test_polish_drops_a_family_no_single_group_can_leave():
    """Both groups use the family: alone, neither gains by leaving it (the other still pays its
    launch); together they do (2.6 s against 3.0 s)."""
    uses = (np.array([[True, False]]), np.array([[True, False]]))
    problem = ilp.Problem((np.array([1.0, 1.3]), np.array([1.0, 1.3])), (), (1.0,), uses)
    assert ilp.polish(problem, (0, 0)) == (1, 1)


def test_a_family_used_across_an_edge_and_kept_by_tie():
    """The family is used by an edge entry (a reshard between the groups): tying the two groups
    keeps it, as a cost of the tied class."""
    matrix = np.array([[0.0, 0.1], [0.1, 0.0]])
    edge = ilp.Edge(0, 1, (0, 1), (0, 1), matrix, np.array([[[False, True], [True, False]]]))
    problem = ilp.Problem((np.array([0.0, 0.05]), np.array([0.2, 0.0])), (edge,), (1.0,),
                          (np.zeros((1, 2), bool), np.zeros((1, 2), bool)))
    assert ilp.evaluate(problem, (0, 1)) == pytest.approx(0.0 + 0.0 + 0.1 + 1.0)
    assert ilp.solve(problem).choice in ((0, 0), (1, 1))  # no reshard, no launch
    tied, _ = ilp.tie(problem, [0, 0])
    assert not tied.uses[0].any()  # a tied pair takes one strategy: the edge's diagonal, no reshard


def _cpu(preset: str):
    """A preset as the compiler here sees it: XLA's CPU backend, whose combining we can check (and
    which runs every collective in line with compute: no overlap)."""
    return dataclasses.replace(get_cluster(preset), backend="cpu", overlap=0.0)


@pytest.fixture(scope="module")
def flax_lm():
    """benchmarks' linen_gpt and its one-device result, shared: each new step is a new function,
    which jax.jit compiles again (seconds for this LM)."""
    case = linen_gpt()
    return case, jax.jit(case.step)(*case.args)


@pytest.mark.parametrize("preset", ["m8-v100", "8x-h100"])
def test_data_parallel_is_chosen_and_compiles_one_gradient_all_reduce(preset, flax_lm):
    """A Flax GPT-like LM (4 layers, 71 parameters, adamw): data parallelism needs one combined
    all-reduce of the gradients, which the search now prices as such; priced per gradient, 71
    launches, it ran from data parallelism (`benchmarks/results/THIRD_PARTY.md`: 1.5-2.5x slower)."""
    case, expected = flax_lm
    lowered = rj.parallelize(case.step, mesh=rj.device_mesh((8,), ("data",)), cluster=_cpu(preset)).lower(*case.args)
    plan = lowered.plan
    assert all(s.shard_factor(plan.mesh_axes) == 1 for s, r in zip(plan.arg_specs, plan.arg_roles) if r != "batch")
    assert all(s.dims[0] == ("data",) for s, r in zip(plan.arg_specs, plan.arg_roles) if r == "batch")
    compiled = lowered.compile()
    assert compiled.collectives.count() == compiled.collectives.count("all-reduce") == 1
    assert plan.collective_summary() == {"all-reduce": compiled.collectives.by_kind()["all-reduce"]}
    assert_same_adam_step(expected, compiled(*on_host(case.args)), lr=1e-3)


def test_without_combining_the_search_ran_from_data_parallelism(monkeypatch, flax_lm):
    """The same step with every collective priced alone, as before: the plan was not data parallel."""
    monkeypatch.setattr(pricing, "combining_sides", lambda graph: {})
    case, _ = flax_lm
    plan = rj.parallelize(case.step, mesh=rj.device_mesh((8,), ("data",)), cluster=_cpu("m8-v100")).lower(
        *case.args).plan
    assert set(plan.collective_summary()) != {"all-reduce"}  # it gathered and exchanged activations


def test_overlap_hides_off_chain_collectives_behind_compute_and_no_more(flax_lm):
    """Cluster.overlap (1 on the GPU presets): the gradients' combined all-reduce runs behind
    compute (XLA GPU's latency-hiding scheduler), at most as long as the step computes; the
    numbers stay the same."""
    case, expected = flax_lm
    mesh = rj.device_mesh((8,), ("data",))
    serial = dataclasses.replace(get_cluster("8x-h100"), overlap=0.0)
    plain = rj.parallelize(case.step, mesh=mesh, cluster=serial).lower(*case.args).plan
    lowered = rj.parallelize(case.step, mesh=mesh, cluster="8x-h100").lower(*case.args)
    cost = lowered.plan.cost
    assert plain.cost.hidden_s == 0 and 0 < cost.hidden_s <= cost.compute_s
    assert cost.total_s == pytest.approx(cost.compute_s + cost.comm_s - cost.hidden_s)
    assert cost.total_s < plain.cost.total_s
    assert "hidden behind compute" in lowered.plan.report()
    assert_same_adam_step(expected, lowered.compile()(*on_host(case.args)), lr=1e-3)


@pytest.mark.parametrize("overlap,backend", [(1.5, "gpu"), (-0.1, "gpu"), (0.5, "cpu")])
def test_overlap_out_of_range_or_on_the_cpu_backend_is_refused(overlap, backend):
    with pytest.raises(ValueError, match="overlap"):
        dataclasses.replace(get_cluster("8x-h100"), overlap=overlap, backend=backend)
