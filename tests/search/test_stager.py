"""The pipeline stager (Rhino §5): the least cut under balance, by topology, bounds that never
change the optimum, clear errors."""
import dataclasses
import itertools

import numpy as np
import pytest

import rhino_jax as rj
from rhino_jax.errors import StagingError
from rhino_jax.hlo_passes.importer import import_module
from rhino_jax.hlo_passes.lowering import lower_on_mesh
from rhino_jax.models import gpt
from rhino_jax.search.staging import stager
from rhino_jax.search.staging.stager import StageGraph


def _brute_force(g: StageGraph, stages: int, epsilon: float) -> float | None:
    """The least cut over every division that keeps topology and balance; None if there is none."""
    c = np.asarray(g.compute)
    share = c.sum() / stages
    best = None
    for assignment in itertools.product(range(stages), repeat=len(c)):
        if any(assignment[s] > assignment[t] for s, t, _ in g.edges):
            continue
        load = np.bincount(assignment, weights=c, minlength=stages)
        if (load > (1 + epsilon) * share + 1e-9).any() or (load < (1 - epsilon) * share - 1e-9).any():
            continue
        cut = sum(b for s, t, b in g.edges if assignment[s] != assignment[t])
        best = cut if best is None else min(best, cut)
    return best


def _random_dag(seed: int, n: int = 7) -> StageGraph:
    rng = np.random.default_rng(seed)
    edges = [(i, j, float(rng.integers(1, 100))) for i in range(n) for j in range(i + 1, n)
             if j == i + 1 or rng.uniform() < 0.25]
    return StageGraph(tuple(rng.uniform(1, 3, n).tolist()), tuple(edges))


def _check(g: StageGraph, result: stager.Staging, stages: int, epsilon: float) -> None:
    assert all(result.stage[s] <= result.stage[t] for s, t, _ in g.edges)  # topology
    share = sum(g.compute) / stages
    assert all((1 - epsilon) * share - 1e-6 <= load <= (1 + epsilon) * share + 1e-6 for load in result.stage_compute)
    assert result.cut_bytes == sum(b for s, t, b in g.edges if result.stage[s] != result.stage[t])


@pytest.mark.parametrize("seed,stages,epsilon", [(s, d, e) for s in range(4) for d, e in ((2, 0.2), (3, 0.4))])
def test_the_ilp_finds_the_brute_force_optimum_with_and_without_bounds(seed, stages, epsilon):
    g = _random_dag(seed)
    best = _brute_force(g, stages, epsilon)
    if best is None:
        with pytest.raises(StagingError, match="raise epsilon or use fewer stages"):
            stager.stage(g, stages, epsilon)
        return
    for tighten in (True, False):
        result = stager.stage(g, stages, epsilon, tighten=tighten)
        assert result.status == "optimal" and result.cut_bytes == pytest.approx(best)
        _check(g, result, stages, epsilon)


def test_skip_connections_are_staged_by_topology():
    """A U-Net: down 0-1-2, bottom 3, up 4-5-6, skips 0→6 and 1→5 carrying large tensors. A
    linear order would not know the skips; the stages keep every edge forward and pay for the
    skips they cut."""
    compute = (2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0)
    chain = [(i, i + 1, 10.0) for i in range(7)]
    skips = [(0, 7, 100.0), (1, 6, 50.0), (2, 5, 25.0)]
    g = StageGraph(compute, tuple(chain + skips))
    result = stager.stage(g, 2, epsilon=0.3)
    _check(g, result, 2, 0.3)
    assert result.cut_bytes == pytest.approx(_brute_force(g, 2, 0.3))


def test_bounds_never_change_the_optimum_and_remove_most_variables():
    rng = np.random.default_rng(0)
    n = 60
    edges = [(i, i + 1, 10.0) for i in range(n - 1)] + [(i, i + 4, float(rng.integers(1, 50))) for i in range(0, n - 4, 3)]
    g = StageGraph(tuple(rng.uniform(1, 2, n).tolist()), tuple(edges))
    tight = stager.stage(g, 4, 0.1)
    loose = stager.stage(g, 4, 0.1, tighten=False)
    assert tight.cut_bytes == pytest.approx(loose.cut_bytes)
    assert tight.num_vars < 0.6 * loose.num_vars
    lo, hi = stager.bounds(g, 4, 0.1)
    assert all(lo[i] <= loose.stage[i] <= hi[i] for i in range(n))  # the untightened optimum lies inside


def test_fixed_nodes_stay_where_the_user_puts_them_and_no_stage_is_left_empty():
    """A chain of four equal nodes: node 1 fixed on stage 1 takes its descendants along (1 share
    against 3: only a tolerance of a share allows it); no tolerance lets a stage go empty."""
    g = StageGraph((1.0,) * 4, tuple((i, i + 1, 1.0) for i in range(3)))
    assert stager.stage(g, 2, 0.25).stage == (0, 0, 1, 1)
    with pytest.raises(StagingError, match="puts node 1 on stage 1"):
        stager.stage(g, 2, 0.25, fixed={1: 1})
    assert stager.stage(g, 2, 1.0, fixed={1: 1}).stage == (0, 1, 1, 1)
    with pytest.raises(StagingError, match="no division"):
        stager.stage(g, 2, 1.0, fixed={0: 1})  # every node on stage 1, stage 0 empty


def test_bad_requests_get_clear_errors():
    g = StageGraph((1.0, 1.0, 1.0), ((0, 1, 1.0), (1, 2, 1.0)))
    with pytest.raises(StagingError, match="4 stages for a graph of 3 nodes"):
        stager.stage(g, 4)
    with pytest.raises(StagingError, match="alone computes"):
        stager.stage(StageGraph((1.0, 5.0, 1.0), g.edges), 2, 0.1)
    with pytest.raises(StagingError, match="cycle"):
        stager.stage(StageGraph((1.0, 1.0), ((0, 1, 1.0), (1, 0, 1.0))), 2)
    with pytest.raises(StagingError, match="epsilon"):
        stager.stage(g, 2, -0.1)


def test_a_gpt_forward_pass_is_staged_layer_by_layer():
    cfg = dataclasses.replace(gpt.GPT_TINY, n_layers=4)
    lowered = lower_on_mesh(gpt.make_gpt_train_step(cfg), gpt.gpt_example(cfg, abstract=True),
                            rj.device_mesh((8,), ("data",)), (0, 1))
    graph = import_module(lowered.module, lowered.arg_paths, lowered.arg_roles, lowered.output_paths)
    g, node_of = stager.forward_stage_graph(graph, graph.outputs[-1])  # the step returns the loss last
    assert all(s < t for s, t, _ in g.edges)  # segments follow data flow
    result = stager.stage(g, 2, epsilon=0.25)
    _check(g, result, 2, 0.25)
    assert 0 < result.cut_bytes
    # Each stage holds whole dots of the forward pass: the cut falls between them.
    assert len(set(result.stage)) == 2 and len(node_of) > len(g.compute)


def test_shared_nodes_run_between_the_stages_and_an_op_after_the_last_joins_them():
    """An embedding (node 0, heavy) and its tied projection (5, heavier than a stage's share) on
    every device (`shared`), four blocks between them, then the loss (6), which no stage can run
    after the projection: slots 0 (every device), 1 and 3 (the stages, balanced on the blocks'
    compute only), 4 (every device, with the loss)."""
    g = StageGraph((50.0, 1.0, 1.0, 1.0, 1.0, 100.0, 0.1),
                   tuple((i, i + 1, 10.0) for i in range(6)) + ((0, 5, 1.0),))
    with pytest.raises(StagingError, match="alone computes"):
        stager.stage(g, 2, 0.25)
    staged = stager.stage(g, 2, 0.25, shared=frozenset({0, 5}))
    assert staged.stage == (0, 1, 1, 3, 3, 4, 4)
    assert staged.stage_compute == (2.0, 2.0)
    assert staged.cut_bytes == 10.0 + 10.0 + 10.0 + 1.0  # 0→1, 2→3, 4→5 and the tie 0→5
