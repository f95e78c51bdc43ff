"""Why this plan: plan.explain (a layout, its collectives, alternatives priced by searching again),
rj.diff (two plans of one step) and plan.render (one HTML page of SVG pictures)."""
import contextlib
import dataclasses
import logging
import pickle
import re
from html.parser import HTMLParser

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

import rhino_jax as rj
from rhino_jax import explain as explain_module
from rhino_jax.errors import UnknownTensorError
from rhino_jax.plan_diff import MAX_ROWS
from rhino_jax.plan_view import holdings
from rhino_jax.hlo_passes.graph import Pin
from rhino_jax.models import gpt
from rhino_jax.runtime.schedules import make as make_schedule
from rhino_jax.search.cost.cluster import MeshTopology, get_cluster
from rhino_jax.search.planner import search
from rhino_jax.core.specs import ShardingSpec

from benchmarks.fixtures.third_party_models import linen_gpt, linen_scan_remat
from helpers import assert_same_adam_step

KERNEL = "[0]['block0']['fc1']['kernel']"  # a path of plan.input_shardings; the report prints it with "arg" first


@pytest.fixture(scope="module")
def lowered():
    """A Flax LM (AdamW) planned on (8,): parameters replicated, optimizer states split (ZeRO)."""
    case = linen_gpt()
    return rj.parallelize(case.step, mesh=rj.device_mesh((8,), ("data",)), progress=False).lower(*case.args)


@contextlib.contextmanager
def _said():
    """The messages the search says to the rhino_jax logger (the progress line's) while the block runs."""
    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("rhino_jax")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture(scope="module")
def pipelined():
    """A GPT of 4 layers in 2 stages of (1, 4) and 4 micro-batches, and what its search said."""
    config = dataclasses.replace(gpt.GPT_TINY, n_layers=4)
    with _said() as messages:
        plan = rj.parallelize(gpt.make_gpt_train_step(config), mesh=rj.device_mesh((2, 4), ("data", "model")),
                              pipeline=2, num_micro_batches=4, progress=False).lower(*gpt.gpt_example(config)).plan
    return plan, messages


@pytest.fixture(scope="module")
def pinned(lowered):
    """The plan searched again with the kernel pinned to [data, -], by the search's own entry
    point: what explain's first alternative must be."""
    graph, mesh = lowered.graph, lowered.mesh
    arg = graph.args[lowered.plan.arg_paths.index("arg" + KERNEL)]
    cluster = get_cluster(None, list(mesh.devices.flat))
    return search(graph.replace(pins=graph.pins + (Pin(arg.value, (("data",), ()), arg.path),)),
                  MeshTopology.from_mesh(mesh, cluster), cluster)


def test_explain_says_the_layout_its_collectives_and_what_alternatives_cost(lowered, pinned):
    plan = lowered.plan
    i = plan.arg_paths.index("arg" + KERNEL)
    by_path = plan.explain(KERNEL)
    text = str(by_path)
    assert by_path.name == "arg" + KERNEL and by_path.layout == plan.arg_specs[i]
    assert f"layout        {plan.arg_specs[i]}: replicated on all 8 devices" in text
    assert "all-gather ×1 (1.0 MiB" in text  # its update brought back replicated, as the plan's collectives say
    assert "its layer     block0/fc1: reduce-scatter" in text  # its gradient's, reduced onto the split moments
    # Every other layout of a [256, 1024] kernel on (8,) searched again with the kernel pinned there.
    assert sorted(str(a.layout) for a in by_path.alternatives) == ["[-, data]", "[data, -]"]
    for alt in by_path.alternatives:
        assert alt.plan.arg_specs[i] == alt.layout
        assert alt.delta_s == alt.plan.cost.total_s - plan.cost.total_s
        assert f"{alt.layout}" in text and f"alternative step {alt.plan.cost.total_s * 1e3:.4f} ms: " \
            f"{alt.delta_s * 1e3:+.4f} ms" in text
    assert [a.delta_s for a in by_path.alternatives] == sorted(a.delta_s for a in by_path.alternatives)
    split = next(a for a in by_path.alternatives if str(a.layout) == "[data, -]")
    assert split.plan.cost == pinned.cost  # the number comes from the search, re-derived here
    assert split.delta_s > 0  # the search chose the cheaper layout
    # The name as the report prints it explains the same argument, with the same alternatives.
    assert f"  arg{KERNEL}" in plan.report(max_tensors=40)
    by_name = plan.explain("arg" + KERNEL, alternatives=1)
    (alt,) = by_name.alternatives
    assert by_name.name == by_path.name
    assert alt.plan.cost == next(a.plan.cost for a in by_path.alternatives if a.layout == alt.layout)


def test_explaining_an_argument_again_searches_nothing_again(lowered, monkeypatch):
    """The alternatives found for an argument are kept beside the plan: a second explain of it (by
    either name, fewer alternatives) reuses them."""
    first = lowered.plan.explain(KERNEL, alternatives=2)
    monkeypatch.setattr(explain_module, "plan_on", lambda *args, **kwargs: pytest.fail("searched again"))
    again = lowered.plan.explain("arg" + KERNEL, alternatives=1)
    (alt,) = again.alternatives
    assert alt in first.alternatives and "(1 found by an earlier explain of it)" in str(again)


def test_alternatives_are_solved_on_the_plans_own_ilp_without_a_search(lowered, monkeypatch):
    """The plan keeps its ILP: an alternative is that ILP solved again with the argument's cone
    left the strategies that make the layout, no new search; each alternative plan lays the
    argument out so and predicts no less than the plan (which the same ILP chose). The ILP is
    not carried to another process: a plan from a worker searches again."""
    plan = dataclasses.replace(lowered.plan, search_inputs=dataclasses.replace(lowered.plan.search_inputs, found={}))
    monkeypatch.setattr(explain_module, "plan_on", lambda *args, **kwargs: pytest.fail("searched again"))
    explained = plan.explain(KERNEL)
    i = plan.arg_paths.index("arg" + KERNEL)
    assert explained.alternatives and "the plan's own ILP solved again" in str(explained)
    for alt in explained.alternatives:
        assert not alt.searched and alt.plan.arg_specs[i] == alt.layout
        assert alt.plan.cost.total_s >= plan.cost.total_s * (1 - 1e-6)
    assert pickle.loads(pickle.dumps(plan.repin)) is None


def test_an_alternative_for_a_scanned_layers_kernel_runs_with_one_devices_numbers():
    """A stacked kernel of nn.scan layers, its loop's carried layouts one in and out: the
    alternative the plan's ILP gives, applied as a plan, runs with one device's numbers."""
    case = linen_scan_remat()
    mesh = rj.device_mesh((2, 4), ("data", "model"))
    lowered = rj.parallelize(case.step, mesh=mesh, progress=False).lower(*case.args)
    (alt,) = lowered.plan.explain("[0]['layers']['fc1']['kernel']", alternatives=1).alternatives
    i = lowered.plan.arg_paths.index("arg[0]['layers']['fc1']['kernel']")
    assert not alt.searched and alt.plan.arg_specs[i] == alt.layout != lowered.plan.arg_specs[i]
    applied = rj.parallelize(case.step, mesh=mesh, plan=dataclasses.replace(alt.plan, target=lowered.plan.target),
                             progress=False).lower(*case.args)
    assert_same_adam_step(jax.jit(case.step)(*case.args), applied.compile()(*case.args), 1e-3)


def test_a_plan_chosen_by_pipeline_auto_explains_after_its_search_ended():
    """The SPMD candidate of pipeline='auto' searched within a share of the step's time limit;
    explain, run after that share ended, searches its alternatives under the limit all the same."""
    case = linen_gpt()
    lowered = rj.parallelize(case.step, mesh=rj.device_mesh((8,), ("data",)), pipeline="auto",
                             progress=False).lower(*case.args)
    assert not lowered.plan.stages  # one micro-batch: SPMD only
    (alt,) = lowered.plan.explain(KERNEL, alternatives=1).alternatives
    assert alt.plan is not None and not alt.why


def test_explain_of_an_unknown_name_lists_the_names_there_are(lowered):
    with pytest.raises(UnknownTensorError) as e:
        lowered.plan.explain("[0]['block0']['fc1']['kernal']")
    assert isinstance(e.value, KeyError)
    message = str(e.value)
    assert f"it has {len(lowered.plan.arg_paths)} arguments" in message
    assert "Closest: arg[0]['block0']['fc1']['kernel']" in message
    with pytest.raises(ValueError, match="alternatives must be"):
        lowered.plan.explain(KERNEL, alternatives=-1)


def test_a_loaded_plan_explains_its_layout_not_its_alternatives(lowered, tmp_path):
    lowered.plan.save(tmp_path / "plan.json")
    loaded = rj.Plan.load(tmp_path / "plan.json")
    assert loaded == lowered.plan  # what explain keeps beside a plan is neither saved nor compared
    explained = loaded.explain("arg" + KERNEL)
    assert explained.alternatives == () and "alternatives  not priced" in str(explained)


def test_diff_lists_the_layouts_that_differ_and_the_cost_deltas(lowered, pinned):
    a, b = lowered.plan, pinned
    d = rj.diff(a, b)
    differ = [p for p, x, y in zip(a.arg_paths, a.arg_specs, b.arg_specs) if x != y]
    assert sorted(ch.path for ch in d.changes) == sorted(differ) and "arg" + KERNEL in differ
    kernel = next(ch for ch in d.changes if ch.path == "arg" + KERNEL)
    assert (str(kernel.a), str(kernel.b)) == ("[-, -]", "[data, -]")
    assert d.step_s == b.cost.total_s - a.cost.total_s and d.comm_s == b.cost.comm_s - a.cost.comm_s
    assert d.memory_bytes == b.cost.memory_bytes - a.cost.memory_bytes
    text = str(d)
    assert f"b - a: step {d.step_s * 1e3:+.4f} ms" in text
    # the search's own plan has no shardings, so devices are named by their place in the mesh
    assert f"layouts that differ (which device holds which slice; devices by their position in each mesh, " \
        f"row-major): {len(differ)} of {len(a.arg_paths)} arguments" in text
    assert f"arg{KERNEL}" in text and f"{'[-, -]':<16} → [data, -]" in text
    assert rj.diff(a, a).changes == () and "b - a: step +0.0000 ms" in str(rj.diff(a, a))
    other = dataclasses.replace(b, arg_paths=b.arg_paths[:-1] + ("arg[9]",))
    with pytest.raises(ValueError, match=r"two plans of one step, but their argument paths differ .*'arg\[9\]' in b"):
        rj.diff(a, other)


def _named_on(plan, mesh, rename: dict[str, tuple[str, ...]], specs=None):
    """`plan` with its arguments' layouts (`specs`, default its own) named on `mesh`, each axis
    renamed to the axes `rename` gives it, its shardings on that mesh's devices."""
    specs = tuple(ShardingSpec(tuple(tuple(x for axis in d for x in rename.get(axis, (axis,))) for d in spec.dims))
                  for spec in (specs or plan.arg_specs))
    shardings = [NamedSharding(mesh, spec.to_partition_spec()) for spec in specs]
    return dataclasses.replace(plan, mesh_axes=dict(mesh.shape), arg_specs=specs,
                               input_shardings=jax.tree.unflatten(jax.tree.structure(plan.input_shardings), shardings))


def test_diff_compares_which_device_holds_which_slice(lowered):
    """The (8,) plan's layouts named on a (2, 4) mesh of the same devices, data+model where it says
    data: every device holds the same slices, so no layout differs; [model+data] splits 8 ways too,
    but hands the devices other slices: a difference."""
    a = lowered.plan
    b = _named_on(a, rj.device_mesh((2, 4), ("data", "model")), {"data": ("data", "model")})
    split = [p for p, spec in zip(a.arg_paths, a.arg_specs) if not spec.is_replicated()]
    assert len(split) > MAX_ROWS
    for other, devices in ((b, "device ids of the plans' meshes"),
                           (dataclasses.replace(b, input_shardings=None), "devices by their position in each mesh")):
        d = rj.diff(a, other)
        assert d.changes == () and sorted(ch.path for ch in d.renamed) == sorted(split)
        text = str(d)
        assert f"layouts that differ (which device holds which slice; {devices}" in text
        assert f"): 0 of {len(a.arg_paths)} arguments" in text and " → " not in text
        assert f"named otherwise, laid out alike: {len(split)} arguments" in text
    i = a.arg_paths.index(split[0])
    swapped = b.arg_specs[:i] + (ShardingSpec(tuple(d[::-1] for d in b.arg_specs[i].dims)),) + b.arg_specs[i + 1:]
    d = rj.diff(a, _named_on(b, rj.device_mesh((2, 4), ("data", "model")), {}, swapped))
    assert [ch.path for ch in d.changes] == [split[0]] and f"{split[0]}" in str(d) and "→ [model+data" in str(d)


def test_holdings_are_what_jax_says_each_device_holds():
    mesh = rj.device_mesh((2, 4), ("data", "model"))
    axes, ids = dict(mesh.shape), tuple(int(d.id) for d in mesh.devices.flat)
    shape = (8, 16, 4)
    for dims in [((), (), ()), (("data",), ("model",), ()), (("model", "data"), (), ()), ((), ("data", "model"), ())]:
        spec = ShardingSpec(dims)
        expected = {d.id: tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape))
                    for d, index in NamedSharding(mesh, spec.to_partition_spec()).devices_indices_map(shape).items()}
        assert holdings(spec, shape, axes, ids) == expected


def test_diff_lists_at_most_20_layouts_and_counts_the_rest(lowered):
    a = lowered.plan
    flipped = tuple(ShardingSpec.replicated(spec.rank) if not spec.is_replicated() else spec for spec in a.arg_specs)
    d = rj.diff(a, dataclasses.replace(a, arg_specs=flipped))
    assert len(d.changes) > MAX_ROWS
    rows = [line for line in str(d).splitlines() if " → " in line]
    assert len(rows) == MAX_ROWS and [ch.path for ch in d.changes[:MAX_ROWS]] == [r.split()[0] for r in rows]
    assert str(d).endswith(f"  ... and {len(d.changes) - MAX_ROWS} more")


def test_the_report_says_the_solver_times_the_progress_line_says():
    """The progress line says each solve's time and estimate ("ILP optimal in 0.13 s ...: the
    ILP's estimate of the step 0.0078 ms", its last ILP's) and ends on the plan's predicted step;
    the report's search line adds up the ILPs, each named with its time, and gives the ILP's
    estimate beside the predicted step."""
    with _said() as messages:
        plan = rj.parallelize(gpt.make_gpt_train_step(gpt.GPT_TINY), mesh=rj.device_mesh((8,), ("data",)),
                              progress=False).lower(*gpt.gpt_example(gpt.GPT_TINY)).plan
    s = plan.search_stats
    assert len(s.ilp_stages) >= 2 and all(stage.name for stage in s.ilp_stages)  # repeats tied, then untied
    assert re.fullmatch(r"rhino_jax: plan (found|kept): predicted (\S+) ms", messages[-1]).group(2) == \
        f"{plan.cost.total_s * 1e3:.4g}"
    solve = next(m for m in reversed(messages) if m.startswith("rhino_jax: ILP "))
    seconds, predicted = re.search(r"ILP \S+ in ([\d.]+) s.*: the ILP's estimate of the step (\S+) ms", solve).groups()
    line = next(line for line in plan.report().splitlines() if line.startswith("search "))
    assert f"in {s.solve_s:.2f} s (" in line and f"then {s.ilp_stages[-1].name} {seconds} s)" in line
    assert f"the ILP's estimate of the step {predicted} ms" in line


def test_both_reports_predict_the_same_collectives(lowered):
    """Planned for V100s (XLA's GPU combiners: reduce-scatters) on 8 CPU devices (all-reduces): the
    plan's report gives both, and compile().report() sets the CPU figures beside the compiled ones."""
    plan, report = lowered.plan, lowered.plan.report()
    compiled = lowered.compile().report().split("vs compiled HLO")[1]
    table = re.findall(r"^  (\S+) +(\d+) +([\d.]+) +\d+ +[\d.]+$", compiled, re.M)  # predicted ops, MiB; HLO's
    rows = [(kind, int(n), mib) for kind, n, mib in table]
    assert {kind for kind, n, _ in rows if n} == {"all-gather", "all-reduce"}
    here = report.split("as XLA's cpu backend compiles them for this plan's cpu devices")[1].split("slowest alone")[0]
    for kind, n, mib in rows:
        assert (f"  {kind:<16} {n:>5} ops {mib:>10}" in here) == (n > 0)
    assert "  reduce-scatter       1 ops" in report.split("as XLA's cpu backend")[0]  # what the step prices
    shown = report.split("slowest alone, before XLA combines them")[1].splitlines()
    assert shown[0] == f" (showing 6 of {len(plan.collectives)}):" and len(plan.collectives) > 6
    assert len([line for line in shown[1:] if " at " in line]) == 6
    assert f"largest arguments (showing 12 of {len(plan.arg_paths)}):" in report


def test_a_pipeline_says_its_step_last_and_names_each_programs_prediction(pipelined):
    """Each program's search predicts one run of that program, far less than the step: the progress
    line says which program before it, and ends on the step's prediction, the report's."""
    plan, messages = pipelined
    assert messages[-1] == (f"rhino_jax: pipeline of 2 stages (1f1b, 4 micro-batches): predicted step "
                            f"{plan.cost.total_s * 1e3:.4g} ms")
    for k, message in enumerate(messages):
        if re.match(r"rhino_jax: (ILP |plan found)", message):
            program = next(m for m in reversed(messages[:k]) if m.startswith("rhino_jax: program "))
            assert re.match(r"rhino_jax: program (forward|backward|apply_gradients)\[", program)


class _Page(HTMLParser):
    """The sections of a rendered page: their <svg> count and the attributes of their elements."""

    def __init__(self):
        super().__init__()
        self.section, self.svgs, self.elements, self.texts, self.in_text = None, {}, [], [], False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section":
            self.section = attrs["id"]
            self.svgs[self.section] = 0
        elif tag == "svg":
            self.svgs[self.section] += 1
        self.elements.append((self.section, tag, attrs))
        self.in_text = tag == "text"

    def handle_data(self, data):
        section, tag, attrs = self.elements[-1] if self.elements else (None, None, {})
        if tag == "text" and self.in_text:
            self.texts.append((section, attrs, data))

    def handle_endtag(self, tag):
        self.in_text = False
        if tag == "section":
            self.section = None


def _read(path) -> _Page:
    text = path.read_text()
    assert text.startswith("<!DOCTYPE html>") and "<script" not in text and "src=" not in text and "href=" not in text
    page = _Page()
    page.feed(text)
    return page


def test_render_draws_every_layers_tensors_and_collectives(lowered, tmp_path):
    plan = lowered.plan
    plan.render(tmp_path / "plan.html")
    page = _read(tmp_path / "plan.html")
    assert page.svgs == {"layouts": 1, "collectives": 1}  # no schedule: one program
    drawn = {a["data-path"]: a["data-layout"] for s, tag, a in page.elements if s == "layouts" and tag == "g"}
    assert drawn == {p: str(spec) for p, spec, shape in zip(plan.arg_paths, plan.arg_specs, plan.arg_shapes)
                     if len(shape) >= 2}
    bars = [a for s, tag, a in page.elements if s == "collectives" and a.get("class") == "collective"]
    assert {a["data-kind"] for a in bars} == {c.kind for c in plan.collectives}
    assert {"block0/fc1", "block3/attn/query"} <= {a["data-layer"] for a in bars}


def test_render_sizes_collectives_by_their_time_in_the_step(lowered, tmp_path):
    """A bar is as long as its collectives' share of the step's communication (XLA combines a
    LayerNorm's 2 KiB gradient with the others; alone it would cost a launch, as much as a
    kernel's), on a scale in µs; the bars add up to the step's communication."""
    plan = lowered.plan
    plan.render(tmp_path / "plan.html")
    page = _read(tmp_path / "plan.html")
    bars = [a for s, tag, a in page.elements if s == "collectives" and a.get("class") == "collective"]
    seconds = {(a["data-layer"], a["data-kind"]): float(a["data-seconds"]) for a in bars}
    assert sum(seconds.values()) == pytest.approx(plan.cost.comm_s, rel=1e-5)
    per_second = [float(a["width"]) / float(a["data-seconds"]) for a in bars if float(a["width"]) > 20]
    assert len(per_second) > 1 and max(per_second) == pytest.approx(min(per_second), rel=1e-2)  # one scale
    norm, dense = seconds["block0/ln1", "reduce-scatter"], seconds["block0/fc1", "reduce-scatter"]
    assert 0 < norm < dense / 100
    ticks = [text for s, a, text in page.texts if s == "collectives" and a.get("class") == "tick"]
    assert ticks[0] == "0 µs" and len(ticks) >= 3 and all(t.endswith(" µs") for t in ticks)
    said = [text for s, a, text in page.texts if s == "collectives" and "in all" in text]
    assert said == [f"{plan.cost.comm_s * 1e3:.4g} ms in all: the predicted step's communication"]
    # a plan saved before collectives kept their time in the step: drawn alone, and said so
    older = dataclasses.replace(plan, collectives=tuple(dataclasses.replace(c, combined_s=None)
                                                        for c in plan.collectives))
    older.render(tmp_path / "older.html")
    said = [text for s, a, text in _read(tmp_path / "older.html").texts if s == "collectives" and "in all" in text]
    assert len(said) == 1 and said[0].startswith("Each collective alone (this plan was saved without")


def test_render_of_a_pipeline_draws_its_schedule(pipelined, tmp_path):
    plan, _ = pipelined
    plan.render(tmp_path / "pipeline.html")
    page = _read(tmp_path / "pipeline.html")
    assert page.svgs == {"layouts": 1, "collectives": 1, "schedule": 1}
    tasks = [a for s, tag, a in page.elements if s == "schedule" and a.get("class") == "task"]
    passes = sorted((int(a["data-stage"]), a["data-pass"], int(a["data-micro-batch"])) for a in tasks)
    assert passes == sorted([(s, p, k) for s in range(2) for p in "FB" for k in range(4)] + [(0, "A", -1), (1, "A", -1)])
    # Each stage runs its passes in the 1F1B order, one after another; stage 0's backward of a
    # micro-batch after stage 1's.
    order = make_schedule("1f1b", 2, 4).order
    box = {(int(a["data-stage"]), a["data-pass"], int(a["data-micro-batch"])): (float(a["x"]), float(a["width"]))
           for a in tasks}
    for s in range(2):
        row = sorted((k for k in box if k[0] == s), key=lambda k: box[k][0])
        assert [(p, k) for _, p, k in row if p != "A"] == [(t.kind, t.micro_batch) for t in order[s]]
        assert row[-1][1] == "A"
        assert all(box[x][0] + box[x][1] <= box[y][0] + 0.02 for x, y in zip(row, row[1:]))
    assert all(box[0, "B", k][0] >= sum(box[1, "B", k]) - 0.02 for k in range(4))


def test_render_of_a_pipeline_names_only_axes_its_legend_shows_and_draws_no_empty_bars(pipelined, tmp_path):
    """The stages' sub-meshes are (data=1, model=4): data splits nothing there, so no layout names
    it, the picture and its label say what splits (model), as the legend does, and no collective
    over data alone (which would move nothing) is drawn."""
    plan, _ = pipelined
    assert plan.arg_specs and not any("data" in spec.used_axes() for spec in plan.arg_specs)
    plan.render(tmp_path / "pipeline.html")
    page = _read(tmp_path / "pipeline.html")
    legend = {text for s, a, text in page.texts if s == "layouts" and a.get("y") == "16"}
    labels = {text for s, a, text in page.texts if s == "layouts" and text.startswith("[")}
    named = {axis for label in labels for dims in label.strip("[]").split(", ") for axis in dims.split("+")} - {"-"}
    assert named and named <= {axis for key in legend for axis in key.split("+")}
    bars = [a for s, tag, a in page.elements if s == "collectives" and a.get("class") == "collective"]
    assert bars and all(float(a["data-seconds"]) > 0 and float(a["width"]) >= 1 for a in bars)
    shown = [text for s, a, text in page.texts if s == "collectives" and " KiB, " in text]
    assert shown and not [t for t in shown if re.search(r"(?<![\d.])0(\.0+)? µs", t)]
