"""Why this plan: plan.explain (a layout, its collectives, alternatives priced by searching again),
rj.diff (two plans of one step) and plan.render (one HTML page of SVG pictures)."""
import dataclasses
from html.parser import HTMLParser

import pytest

import rhino_jax as rj
from rhino_jax.errors import UnknownTensorError
from rhino_jax.hlo_passes.graph import Pin
from rhino_jax.models import gpt
from rhino_jax.runtime.schedules import make as make_schedule
from rhino_jax.search.cluster import MeshTopology, get_cluster
from rhino_jax.search.planner import search

from benchmarks.third_party_models import linen_gpt

KERNEL = "[0]['block0']['fc1']['kernel']"  # a path of plan.input_shardings; the report prints it with "arg" first


@pytest.fixture(scope="module")
def lowered():
    """A Flax LM (AdamW) planned on (8,): parameters replicated, optimizer states split (ZeRO)."""
    case = linen_gpt()
    return rj.parallelize(case.step, mesh=rj.device_mesh((8,), ("data",)), progress=False).lower(*case.args)


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
    assert f"layouts that differ: {len(differ)} of {len(a.arg_paths)} arguments" in text
    assert f"arg{KERNEL}" in text and f"{'[-, -]':<16} → [data, -]" in text
    assert rj.diff(a, a).changes == () and "b - a: step +0.0000 ms" in str(rj.diff(a, a))
    other = dataclasses.replace(b, arg_paths=b.arg_paths[:-1] + ("arg[9]",))
    with pytest.raises(ValueError, match=r"two plans of one step, but their argument paths differ .*'arg\[9\]' in b"):
        rj.diff(a, other)


class _Page(HTMLParser):
    """The sections of a rendered page: their <svg> count and the attributes of their elements."""

    def __init__(self):
        super().__init__()
        self.section, self.svgs, self.elements = None, {}, []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section":
            self.section = attrs["id"]
            self.svgs[self.section] = 0
        elif tag == "svg":
            self.svgs[self.section] += 1
        self.elements.append((self.section, tag, attrs))

    def handle_endtag(self, tag):
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


def test_render_of_a_pipeline_draws_its_schedule(tmp_path):
    config = dataclasses.replace(gpt.GPT_TINY, n_layers=4)
    plan = rj.parallelize(gpt.make_gpt_train_step(config), mesh=rj.device_mesh((2, 4), ("data", "model")), pipeline=2,
                          num_micro_batches=4, progress=False).lower(*gpt.gpt_example(config)).plan
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
