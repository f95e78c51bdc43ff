"""pipeline=p: stages on sub-meshes run by a static schedule; the numbers of one device."""
import dataclasses
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rhino_jax as rj
from rhino_jax.errors import MemoryLimitError, MeshError, StagingError
from rhino_jax import controller
from rhino_jax.hlo_passes import stages
from rhino_jax.pipelined.programs import _compute_homes
from rhino_jax.models import gpt, make_mlp_train_step, mlp_example
from rhino_jax.options import Options
from rhino_jax.core.plan import Plan, PlanCost
from rhino_jax.search.cost.cluster import get_cluster

from benchmarks.fixtures.third_party_models import linen_clip_adamw
from helpers import assert_same_adam_step, assert_same_numbers

GPT4 = dataclasses.replace(gpt.GPT_TINY, n_layers=4)


def _case(model):
    if model == "mlp":
        return make_mlp_train_step(), mlp_example((16, 32, 32, 32, 16), 8)
    return gpt.make_gpt_train_step(GPT4), gpt.gpt_example(GPT4)


@pytest.mark.parametrize("model", ["mlp", "gpt"])
@pytest.mark.parametrize("shape,names", [((8,), ("data",)), ((2, 4), ("data", "model")), ((4, 2), ("data", "model"))])
def test_two_stages_keep_the_numbers_of_one_device(model, shape, names):
    step, args = _case(model)
    lowered = rj.parallelize(step, mesh=rj.device_mesh(shape, names), pipeline=2, num_micro_batches=4).lower(*args)
    assert_same_numbers(jax.jit(step)(*args), lowered.compile()(*args))
    first, second = lowered.stages
    assert set(first.devices).isdisjoint(second.devices) and len(first.devices) + len(second.devices) == 8
    assert "2 stages" in lowered.plan.report()
    assert "step priced from the compiled programs" in lowered.compile().report()
    graph = lowered.plan.task_graph  # what the executor ran: 2 stages × 4 micro-batches, apply-gradients on each
    assert sum(n.kind == "forward" for n in graph.nodes) == 8
    assert sorted(n.stage for n in graph.nodes if n.kind == "apply") == [0, 1]  # Adam: no stage waits for another
    assert graph.to_dot().startswith('digraph "1f1b"')


def _searched_programs(monkeypatch) -> list[int]:
    """The ops of each program the pipeline's next lowering searches (not given another's plan)."""
    from rhino_jax.pipelined import lowered as pipelined
    searched, real = [], pipelined.plan_on

    def recording(graph, *args, **kwargs):
        searched.append(len(graph.nodes))
        return real(graph, *args, **kwargs)
    monkeypatch.setattr(pipelined, "plan_on", recording)
    return searched


def test_alike_stages_are_searched_once(monkeypatch):
    """8 layers on 4 stages: the two middle stages run the same programs on alike sub-meshes, so
    each is searched once and the other takes its plan (renamed); the numbers stay one device's."""
    searched = _searched_programs(monkeypatch)
    cfg = dataclasses.replace(gpt.GPT_TINY, n_layers=8)
    step, args = gpt.make_gpt_train_step(cfg), gpt.gpt_example(cfg)
    lowered = rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), pipeline=4,
                             num_micro_batches=4).lower(*args)
    programs = 2 * 4 + len(lowered.plan.programs)  # forward and backward per stage, then apply-gradients'
    assert len(searched) < programs
    reused = {name: plan for name, plan in lowered.plan.program_plans().items() if plan.search_stats.plan_of}
    assert len(reused) == programs - len(searched)
    for name, plan in reused.items():
        original = lowered.plan.program_plans()[plan.search_stats.plan_of]
        assert plan.value_specs == original.value_specs and plan.arg_paths != original.arg_paths
    assert "alike programs searched once" in lowered.plan.report()
    assert_same_numbers(jax.jit(step)(*args), lowered.compile()(*args))


def test_a_constraint_naming_one_stages_layer_makes_it_searched_on_its_own(monkeypatch):
    """`op_trans` on layer 3's parameters, which one middle stage reads: that stage's programs are
    not alike the other's any more, and each is searched."""
    cfg = dataclasses.replace(gpt.GPT_TINY, n_layers=8)
    step, args = gpt.make_gpt_train_step(cfg), gpt.gpt_example(cfg)

    def reused(constraints) -> set[str]:
        lowered = rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), pipeline=4, num_micro_batches=4,
                                 constraints=constraints).lower(*args)
        return {n for n, plan in lowered.plan.program_plans().items() if plan.search_stats.plan_of}
    free = reused([])
    constrained = reused([rj.op_trans("*['layers'][3]*", replicate=True)])
    assert {n for n in free if n.startswith(("forward", "backward"))} \
        - {n for n in constrained if n.startswith(("forward", "backward"))}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "eager-1f1b"])
def test_four_stages_of_two_devices_under_every_schedule(schedule):
    step, args = _case("gpt")
    lowered = rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), pipeline=4, num_micro_batches=2,
                             schedule=schedule).lower(*args)
    assert [len(s.devices) for s in lowered.stages] == [2, 2, 2, 2]
    assert_same_numbers(jax.jit(step)(*args), lowered.compile()(*args))


def test_bad_pipelines_say_what_to_change():
    step, args = _case("gpt")
    with pytest.raises(MeshError, match=r"split into 3 equal parts; use pipeline=2, 4 or 8$"):  # no (3, ...) mesh
        rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), pipeline=3, num_micro_batches=2).lower(*args)
    two_rows = rj.device_mesh((2, 4), ("data", "model"))
    with pytest.raises(MeshError, match=r"use pipeline=2, or a mesh like rj.device_mesh\(\(4, "):
        rj.parallelize(step, mesh=two_rows, pipeline=4, num_micro_batches=2).lower(*args)
    with pytest.raises(ValueError, match="needs num_micro_batches >= 2"):
        rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), pipeline=2)
    with pytest.raises(ValueError, match="pipeline must be"):
        rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), pipeline=0)
    mlp, mlp_args = make_mlp_train_step(), mlp_example((16, 16), 8)  # one layer cannot fill 8 stages
    with pytest.raises(StagingError, match="stages"):
        rj.parallelize(mlp, mesh=rj.device_mesh((8,), ("data",)), pipeline=8, num_micro_batches=2).lower(*mlp_args)
    with pytest.raises(StagingError, match="use fewer stages than pipeline=8, or pipeline='auto'$"):  # not epsilon
        rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), pipeline=8, num_micro_batches=2).lower(*args)


def _scanned_step(params, batch):
    def loss_fn(p):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), batch["x"], p)
        return jnp.mean((h - batch["y"]) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(params)
    return params - 0.1 * g, loss


def test_a_step_that_is_one_scan_says_to_unroll_it():
    """The forward pass is one loop, which runs whole in one stage: the error says so."""
    params, batch = jnp.ones((4, 16, 16)) / 16, {"x": jnp.ones((8, 16)), "y": jnp.zeros((8, 16))}
    with pytest.raises(StagingError, match="unroll it"):
        rj.parallelize(_scanned_step, mesh=rj.device_mesh((8,), ("data",)), pipeline=2,
                       num_micro_batches=2).lower(params, batch)


def test_flax_with_global_norm_clipping_keeps_its_numbers_and_its_state_layouts():
    """With clipping, Adam's moments are read in one wave of apply-gradients (before the norm) and
    made in a later one: they still leave as the step takes them, so a training loop feeding them
    back moves nothing."""
    case = linen_clip_adamw()
    step = rj.parallelize(case.step, mesh=rj.device_mesh((2, 4), ("data", "model")), pipeline=2, num_micro_batches=2)
    lowered = step.lower(*case.args)
    plan = lowered.plan
    assert jax.tree.leaves(plan.input_shardings[:2]) == jax.tree.leaves(plan.output_shardings[:2])
    # A value one apply-gradients program hands a later wave of its stage is read in its own wave
    # too: one read only later (Adam's b1 * mu) is made beside its readers, not moved between programs.
    ag, cg = lowered._step.apply_graph, lowered._step.compute_graph
    at = {i: (s, w) for i, (_, s, w) in stages.assign_apply(ag, _compute_homes(lowered._programs, cg)).items()}
    readers = ag.consumers()
    handed = [(n, r) for n in ag.nodes if n.id in at for r in n.results
              if any(at.get(c, (None,))[0] == at[n.id][0] and at[c][1] > at[n.id][1] for c in readers[r])]
    assert handed, "no value crosses waves within a stage: nothing checked"
    for n, r in handed:
        assert any(at.get(c) == at[n.id] or at.get(c, (at[n.id][0],))[0] != at[n.id][0] for c in readers[r]), n.name
    out = step(*case.args)
    assert [x.sharding for x in jax.tree.leaves(out[:2])] == jax.tree.leaves(plan.input_shardings[:2])
    assert_same_adam_step(jax.jit(case.step)(*case.args), out, lr=1e-3)


def _clipped_step(params, batch):
    """An MLP step with global-norm clipping: the norm adds up every layer's gradient."""
    def loss_fn(p):
        h = batch["x"]
        for w in p:
            h = jnp.tanh(h @ w)
        return jnp.mean((h - batch["y"]) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(params)
    norm = jnp.sqrt(sum(jnp.sum(x * x) for x in g))
    scale = jnp.minimum(1.0, 0.5 / norm)
    return [w - 0.1 * scale * d for w, d in zip(params, g)], loss


def test_a_global_norm_waits_for_every_stage_and_the_updates_for_it():
    """apply-gradients' ops run on the stages in waves: each stage's squared norms (wave 0), the
    total on one stage (wave 1), the updates it scales on the other (wave 2); the task graph runs
    each after what it reads, and the numbers are one device's."""
    rng = np.random.default_rng(1)
    params = [jnp.asarray(rng.normal(size=(32, 32)) / 6, jnp.float32) for _ in range(4)]
    batch = {"x": jnp.asarray(rng.normal(size=(16, 32)), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)}
    lowered = rj.parallelize(_clipped_step, mesh=rj.device_mesh((8,), ("data",)), pipeline=2,
                             num_micro_batches=2).lower(params, batch)
    applies = lowered.plan.execution.applies
    assert {a.stage for a in applies} == {0, 1} and max(a.wave for a in applies) == 2
    for a in applies:
        assert all(w < a.wave for _, w in a.reads) and (a.wave == 0) == (not a.reads)
    assert set(lowered.compile().programs) >= {f"apply_gradients[{a.stage}.{a.wave}]" for a in applies}
    assert_same_numbers(jax.jit(_clipped_step)(params, batch), lowered.compile()(params, batch))


def _unet_step(params, batch):
    """Down 16 → 32 → 32 → 32, up with skips from the down path: stages must follow the skips."""
    def loss_fn(p):
        h0 = jnp.tanh(batch["x"] @ p["d0"])
        h1 = jnp.tanh(h0 @ p["d1"])
        h2 = jnp.tanh(h1 @ p["d2"])
        u1 = jnp.tanh(h2 @ p["u2"]) + h1
        u0 = jnp.tanh(u1 @ p["u1"]) + h0
        return jnp.mean((u0 @ p["out"] - batch["y"]) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), loss


def test_a_unet_with_skip_connections_keeps_its_numbers():
    rng = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(rng.normal(size=s) / np.sqrt(s[0]), jnp.float32)  # noqa: E731
    params = {"d0": w(16, 32), "d1": w(32, 32), "d2": w(32, 32), "u2": w(32, 32), "u1": w(32, 32), "out": w(32, 8)}
    batch = {"x": w(16, 16), "y": w(16, 8)}
    lowered = rj.parallelize(_unet_step, mesh=rj.device_mesh((8,), ("data",)), pipeline=2,
                             num_micro_batches=2).lower(params, batch)
    assert lowered.plan.search_stats.staging.cut_bytes > 0
    assert_same_numbers(jax.jit(_unet_step)(params, batch), lowered.compile()(params, batch))


def test_auto_compares_spmd_and_pipelines_and_runs_the_fastest():
    step, args = _case("gpt")
    lowered = rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), pipeline="auto",
                             num_micro_batches=2).lower(*args)
    table = lowered.plan.search_stats.pipeline_candidates
    assert {c.label.split(",")[0] for c in table} == {"SPMD only", "2 stages"}  # no more stages than micro-batches
    best = table[0].step_s
    assert all(c.step_s is None or best <= c.step_s for c in table)
    assert lowered.plan.cost.total_s == best
    assert "pipeline='auto'" in lowered.plan.report()
    assert_same_numbers(jax.jit(step)(*args), lowered.compile()(*args))


def test_auto_tries_no_more_stages_than_micro_batches():
    """Each stage of a 1F1B pipeline idles (p - 1) / (k + p - 1) of the step: with k micro-batches
    given, p up to k; without, every p that splits the first axis, each with 2p micro-batches."""
    def tried(k, first_axis=32):
        return [(o.pipeline, o.num_micro_batches) for o in controller.candidates(Options(num_micro_batches=k),
                                                                                  first_axis)]
    assert tried(8) == [("off", 8), (2, 8), (4, 8), (8, 8)]
    assert tried(1, 8) == [("off", 1), (2, 4), (4, 8), (8, 16)]
    assert tried(4, 2) == [("off", 4), (2, 4)]


def test_auto_takes_the_fastest_plan_that_fits_the_memory_limit():
    """The controller's choice on given candidates (each candidate's real search is tested above)."""
    costs = {"off": (3.0, 10 << 30), 2: (1.0, 40 << 30), 4: (2.0, 20 << 30)}  # step s, bytes/device

    class Fake:
        mesh = rj.device_mesh((4,), ("data",), devices=jax.devices()[:4])
        options = Options(memory_limit_bytes=32 << 30)

        def lower_with(self, options, args, key):
            step_s, memory = costs[options.pipeline]
            return SimpleNamespace(plan=Plan(**_EMPTY, cost=PlanCost(step_s, 0.0, step_s, memory)))

    chosen = controller.choose(Fake(), (), None)
    table = chosen.plan.search_stats.pipeline_candidates
    assert table[0].label.startswith("4 stages") and chosen.plan.cost.total_s == 2.0
    assert [c.why.startswith("needs 40.0 GiB/device") for c in table] == [False, False, True]
    Fake.options = Options(memory_limit_bytes=8 << 30)
    with pytest.raises(MemoryLimitError, match="no candidate fits memory_limit_bytes"):
        controller.choose(Fake(), (), None)
    Fake.options = Options(cluster=dataclasses.replace(get_cluster(None), memory_per_device=8 << 30))
    with pytest.warns(UserWarning, match="no candidate fits the 8.0 GiB"):
        assert controller.choose(Fake(), (), None).plan.cost.total_s == 1.0


_EMPTY = dict(mesh_axes={}, cluster="", opt_level="O2", arg_paths=(), arg_roles=(), arg_shapes=(), arg_dtypes=(),
              arg_specs=(), output_paths=(), output_specs=(), value_specs={})


def test_auto_under_a_memory_limit_no_candidate_meets_says_so():
    step, args = _case("gpt")
    with pytest.raises(MemoryLimitError, match="memory_limit_bytes"):
        rj.parallelize(step, mesh=rj.device_mesh((2, 4), ("data", "model")), pipeline="auto",
                       memory_limit_bytes=1024).lower(*args)


def test_auto_with_no_candidate_says_each_reason_whole_and_once():
    """Micro-batches of one example fail alike for every candidate: the error gives the reason
    once, whole, with the candidates it stopped (it repeated it cut at 160 characters)."""
    mlp, mlp_args = make_mlp_train_step(), mlp_example((16, 16), 8)
    once = (r"no candidate has a plan: SPMD only, 8 micro-batches / 2 stages, 8 micro-batches / 4 stages, 8 "
            r"micro-batches / 8 stages, 8 micro-batches: jax lowered [^/]*\(try another num_micro_batches\)$")
    with pytest.raises(rj.RhinoError, match=once):
        rj.parallelize(mlp, mesh=rj.device_mesh((8,), ("data",)), pipeline="auto", num_micro_batches=8).lower(*mlp_args)


def test_each_stage_reports_its_layers_sub_mesh_and_memory():
    step, args = _case("gpt")
    lowered = rj.parallelize(step, mesh=rj.device_mesh((2, 4), ("data", "model")), pipeline=2,
                             num_micro_batches=4).lower(*args)
    first, last = lowered.plan.stages
    assert first.layers[0] == "embed" and last.layers[-1] == "head"
    assert first.mesh_axes == last.mesh_axes == {"data": 1, "model": 4}
    assert (first.in_flight, last.in_flight) == (2, 1)  # 1F1B: stage s holds p - s micro-batches
    assert first.held_bytes > 0 and first.summed_bytes > 0 and first.kept_bytes > 0  # Adam's moments
    peak = max(first.forward.cost.memory_bytes, first.backward.cost.memory_bytes)
    assert first.memory_bytes == max(peak + first.held_bytes + first.summed_bytes + first.kept_bytes,
                                     first.apply_bytes)
    assert lowered.plan.cost.memory_bytes >= max(first.memory_bytes, last.memory_bytes)
    report = lowered.plan.report()
    assert "stage 0  [data=1 × model=4] devices 0-3" in report and "embed, layer0" in report


def test_a_stage_over_the_memory_limit_is_planned_again_to_fit():
    """A stage's programs are planned for one micro-batch; the other micro-batches in flight and
    the running sums come on top, so a stage over the limit is planned again under what is left."""
    step, args = _case("gpt")
    mesh = rj.device_mesh((2, 4), ("data", "model"))
    free = rj.parallelize(step, mesh=mesh, pipeline=2, num_micro_batches=4).lower(*args).stages
    limit = max(st.memory_bytes for st in free) - 1
    fitted = rj.parallelize(step, mesh=mesh, pipeline=2, num_micro_batches=4, memory_limit_bytes=limit).lower(*args)
    assert all(st.memory_bytes <= limit for st in fitted.stages)
    assert_same_numbers(jax.jit(step)(*args), fitted.compile()(*args))


def test_the_optimizer_runs_on_the_stage_of_the_parameters_it_updates():
    """apply-gradients' ops run where the parameters and gradient sums they read are: the step
    takes and returns each parameter and its Adam moments on one stage, in the same layouts, so
    that a training loop feeding them back moves nothing of them; on hosts of 4 devices, the moves
    left per step (the batch, Adam's step count, the odd gradient made on the next stage) cost a
    fraction of moving the parameters."""
    step, args = _case("gpt")
    by_host = dataclasses.replace(get_cluster(None), devices_per_host=4)
    lowered = rj.parallelize(step, mesh=rj.device_mesh((2, 4), ("data", "model")), pipeline=2, num_micro_batches=2,
                             cluster=by_host).lower(*args)
    plan = lowered.plan
    devices = lambda sharding: {d.id for d in sharding.device_set}  # noqa: E731
    params_in, state_in, _ = plan.input_shardings
    params_out, state_out, _ = plan.output_shardings
    held = [sum(devices(s) == set(st.devices) for s in jax.tree.leaves(params_in)) for st in plan.stages]
    assert sum(held) == len(jax.tree.leaves(params_in)) and min(held) > 0  # each on one stage, both stages hold some
    for moment in ("mu", "nu"):
        for p, m in zip(jax.tree.leaves(params_in), jax.tree.leaves(state_in[moment])):
            assert devices(p) == devices(m)
    assert jax.tree.leaves((params_in, state_in)) == jax.tree.leaves((params_out, state_out))  # fed back as taken
    s = plan.search_stats.staging
    all_params_s = sum(x.nbytes for x in jax.tree.leaves(args[0])) / by_host.inter_host_bandwidth
    assert s.arguments_in_s + s.sums_out_s < 0.01 * all_params_s
    assert "apply-gradients on the stages" in plan.report()
    assert_same_numbers(jax.jit(step)(*args), lowered.compile()(*args))


def _search_limits(monkeypatch) -> list[tuple[float, float]]:
    """(start, time limit) of every search of the step that runs next: each program's, each
    candidate's and the stager's."""
    from rhino_jax import mesh_search
    from rhino_jax.search.staging import stager

    found: list[tuple[float, float]] = []

    def recording(real):
        def run(*args, time_limit_s, **kwargs):
            found.append((time.perf_counter(), time_limit_s))
            return real(*args, time_limit_s=time_limit_s, **kwargs)
        return run
    monkeypatch.setattr(mesh_search, "search", recording(mesh_search.search))
    monkeypatch.setattr(stager, "stage", recording(stager.stage))
    return found


@pytest.mark.parametrize("how", [dict(pipeline=2, num_micro_batches=4), dict(num_micro_batches=4),
                                 dict(pipeline="auto", num_micro_batches=2),
                                 dict(mesh=None, search_workers=0)])
def test_the_searches_of_one_step_share_its_time_limit(monkeypatch, how):
    """A pipeline's stager and programs, a micro-batched step's two programs, pipeline='auto''s
    candidates, mesh=None's mesh shapes: each search takes a share of the time left, so each
    ends by the step's limit, however long the set-up between them takes (here, 2 s to split a
    step once the first search has run: a slow machine's tracing)."""
    from rhino_jax import micro_batched
    from rhino_jax.pipelined import lowered as pipelined
    limits = _search_limits(monkeypatch)
    split = micro_batched.split_step

    def slow_split(*args, **kwargs):
        if limits:
            time.sleep(2)
        return split(*args, **kwargs)
    for module in (micro_batched, pipelined):
        monkeypatch.setattr(module, "split_step", slow_split)
    step, args = _case("gpt")
    how = {"mesh": rj.device_mesh((8,), ("data",)), **how}
    rj.parallelize(step, solver_time_limit_s=40, **how).lower(*args)
    assert len(limits) >= 2
    first = limits[0][0]  # the limit counts from the lowering's end, just before the first search
    assert all(at + limit <= first + 40 for at, limit in limits), limits
    assert all(limit < 40 for _, limit in limits)


def test_a_step_whose_searches_run_out_of_time_says_which_was_next(monkeypatch):
    """The stager leaves no time for the programs: the error names the limit and the program."""
    from rhino_jax.search.staging import stager
    real = stager.stage

    def slow(*args, **kwargs):
        time.sleep(0.2)
        return real(*args, **kwargs)
    monkeypatch.setattr(stager, "stage", slow)
    step, args = _case("mlp")
    with pytest.raises(rj.SolverError, match=r"reached their solver_time_limit_s=0.1 before it searched program "
                                             r"forward\[0\]: raise solver_time_limit_s"):
        rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), pipeline=2, num_micro_batches=2,
                       solver_time_limit_s=0.1).lower(*args)
