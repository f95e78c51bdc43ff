"""Plan files: `plan.save(path)` / `rj.Plan.load(path)` give back the same plan, and a plan is
refused, naming the difference, when the program or mesh it is checked against is not its own."""
import dataclasses
import errno
import json
import os
import pathlib
import re

import jax
import pytest

import rhino_jax as rj
from rhino_jax.hlo_passes.lowering import lower_on_mesh, step_target
from rhino_jax.models import make_mlp_train_step, mlp_example
from rhino_jax.core.diagnostics import CompiledCandidate, CoshardCandidate, IlpStage
from rhino_jax.core.plan import PLAN_FORMAT, Plan
from rhino_jax.core.plan_file import OLDEST_FORMAT
from rhino_jax.core.plan_target import PlanTargetError
from rhino_jax.search.staging import stager

from helpers import assert_same_numbers

WIDTHS = (16, 32, 32, 32, 16)


def _target(step, args, mesh):
    return step_target(lower_on_mesh(step, args, mesh, ()), mesh)


def _round_trip(plan, tmp_path):
    plan.save(tmp_path / "plan.json")
    return rj.Plan.load(tmp_path / "plan.json")


@pytest.mark.parametrize("options", [dict(), dict(pipeline="auto", num_micro_batches=2), dict(mesh=None)],
                         ids=["spmd", "pipeline-auto", "mesh-search"])
def test_a_saved_plan_loads_equal(options, tmp_path):
    step, args = make_mlp_train_step(), mlp_example(WIDTHS, 8, abstract=True)
    options = dict(dict(mesh=rj.device_mesh((2, 4), ("data", "model"))), **options)
    lowered = rj.parallelize(step, **options).lower(*args)
    plan = dataclasses.replace(lowered.plan, target=_target(step, args, lowered.mesh))
    loaded = _round_trip(plan, tmp_path)
    assert loaded == plan
    assert loaded.report() == plan.report()
    assert loaded.target == plan.target
    assert json.loads((tmp_path / "plan.json").read_text())["rhino_jax_plan"] == PLAN_FORMAT


def test_the_plan_of_the_same_program_and_mesh_is_accepted_after_loading(tmp_path):
    step, args = make_mlp_train_step(), mlp_example(WIDTHS, 8, abstract=True)
    mesh = rj.device_mesh((2, 4), ("data", "model"))
    plan = dataclasses.replace(rj.parallelize(step, mesh=mesh).lower(*args).plan, target=_target(step, args, mesh))
    _round_trip(plan, tmp_path).check_matches(_target(make_mlp_train_step(), args, mesh))


@pytest.mark.parametrize("change,message", [
    ("program", "program differs"),
    ("shapes", r"argument arg\[2\]\['x'\] is float32\[16, 16\], the plan was made for .* float32\[8, 16\]"),
    ("mesh", r"made for the mesh \(data=2, model=4\) and is applied to \(data=4, model=2\)"),
    ("processes", r"devices lie in the processes \[0 x8\] \(row-major\) and is applied to one of \[0 x4, 1 x4\]"),
])
def test_a_plan_for_another_program_or_mesh_is_refused(change, message, tmp_path):
    step, args = make_mlp_train_step(), mlp_example(WIDTHS, 8, abstract=True)
    mesh = rj.device_mesh((2, 4), ("data", "model"))
    plan = dataclasses.replace(rj.parallelize(step, mesh=mesh).lower(*args).plan, target=_target(step, args, mesh))
    loaded = _round_trip(plan, tmp_path)
    other_step, other_args, other_mesh = step, args, mesh
    if change == "program":
        other_step = make_mlp_train_step(lr=0.5)
    elif change == "shapes":
        other_args = mlp_example(WIDTHS, 16, abstract=True)
    elif change == "mesh":
        other_mesh = rj.device_mesh((4, 2), ("data", "model"))
    other = _target(other_step, other_args, other_mesh)
    if change == "processes":  # the same mesh shape over two processes' devices (a job of 2 hosts)
        other = dataclasses.replace(other, processes=(0,) * 4 + (1,) * 4)
    with pytest.raises(PlanTargetError, match=message):
        loaded.check_matches(other)


def test_a_plan_runs_on_the_same_mesh_shape_over_other_devices(tmp_path):
    """Device ids are not compared: the same processes' devices in another order take the plan
    (as a real cluster takes a plan made for its described twin, whose ids differ)."""
    step, args = make_mlp_train_step(), mlp_example(WIDTHS, 8, abstract=True)
    mesh = rj.device_mesh((2, 4), ("data", "model"))
    plan = dataclasses.replace(rj.parallelize(step, mesh=mesh).lower(*args).plan, target=_target(step, args, mesh))
    other = rj.device_mesh((2, 4), ("data", "model"), devices=jax.devices()[::-1])
    _round_trip(plan, tmp_path).check_matches(_target(step, args, other))


def test_a_plan_that_records_no_target_is_refused():
    step, args = make_mlp_train_step(), mlp_example(WIDTHS, 8, abstract=True)
    mesh = rj.device_mesh((8,), ("data",))
    plan = dataclasses.replace(rj.parallelize(step, mesh=mesh).lower(*args).plan, target=None)
    with pytest.raises(PlanTargetError, match="does not record the program and mesh"):
        plan.check_matches(_target(step, args, mesh))


@pytest.mark.parametrize("text,message", [
    ("not json", "plan.json: Expecting value"),
    ('{"mesh_axes": {"data": 8}}', 'not a rhino_jax plan file: it holds an object without a "rhino_jax_plan" format '
                                   'entry; give a file written by Plan.save or python -m rhino_jax plan'),
    (f'{{"rhino_jax_plan": {PLAN_FORMAT}, "mesh_axes": {{}}, "colour": 1}}', "Plan has no field 'colour'"),
    (f'{{"rhino_jax_plan": {PLAN_FORMAT}, "mesh_axes": {{}}}}', "Plan lacks field 'cluster'"),
])
def test_a_file_that_is_not_a_plan_says_so(text, message, tmp_path):
    (tmp_path / "plan.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        rj.Plan.load(tmp_path / "plan.json")


READS = f"where this rhino_jax reads formats {OLDEST_FORMAT} to {PLAN_FORMAT}"


@pytest.mark.parametrize("found,message", [
    (f'"{PLAN_FORMAT}"', f'format "{PLAN_FORMAT}" {READS}: no rhino_jax writes that; plan again'),
    (f"{OLDEST_FORMAT - 1}", f"format {OLDEST_FORMAT - 1} {READS}: an older rhino_jax wrote it; plan again"),
    (f"{PLAN_FORMAT + 1}", f"format {PLAN_FORMAT + 1} {READS}: a newer rhino_jax wrote it; upgrade rhino_jax to load "
                           "it, or plan again"),
], ids=["string", "older", "newer"])
def test_a_plan_file_of_another_format_names_both_formats_and_what_to_do(found, message, tmp_path):
    (tmp_path / "plan.json").write_text(f'{{"rhino_jax_plan": {found}, "mesh_axes": {{}}}}')
    with pytest.raises(ValueError) as refused:
        rj.Plan.load(tmp_path / "plan.json")
    assert str(refused.value) == f"{tmp_path / 'plan.json'}: the plan file is of {message} with this one"


# Plans of an MLP saved by the rhino_jax that wrote format 3 (search statistics as a free-form
# object), each beside the report that rhino_jax printed of it: pipeline="auto" over 2
# micro-batches (widths (16, 32, 32, 16), the SPMD candidate chosen), pipeline=2 over 2
# micro-batches (`WIDTHS`), and a memory limit of 0.9 of the free plan's on the mesh (2, 4).
FORMAT3 = pathlib.Path(__file__).parent / "plans_format3"


@pytest.mark.parametrize("name", ["pipeline_auto", "pipeline_2", "memory_limit"])
def test_a_plan_file_of_format_3_loads_and_reports_as_it_did(name, tmp_path):
    plan = rj.Plan.load(FORMAT3 / f"{name}.json")
    assert plan.report() == (FORMAT3 / f"{name}.report").read_text()
    s = plan.search_stats
    assert s.status in ("optimal", "near-optimal") and s.ilp_vars > 0
    assert all(p.search_stats.status for p in plan.program_plans().values())  # the plans it holds, too
    if name == "memory_limit":
        assert s.not_replicated == ("arg[0][1]['w']", "arg[1]['mu'][1]['w']", "arg[1]['nu'][1]['w']")
    if name == "pipeline_auto":
        assert [c.label for c in s.pipeline_candidates] == ["SPMD only, 2 micro-batches", "2 stages, 2 micro-batches"]
        assert s.pipeline_candidates[1].step_s is None and "no division into 2 stages" in s.pipeline_candidates[1].why
    if name == "pipeline_2":
        assert s.staging.cut_bytes > 0 and s.staging.epsilon is None
        assert [stage.name for stage in s.ilp_stages] == ["apply_gradients[0.0]", "apply_gradients[1.0]"]
    assert _round_trip(plan, tmp_path) == plan  # saved again in this format


def test_a_plan_file_of_format_3_pipelined_runs_its_saved_placement(monkeypatch):
    """The stager's figures a pipelined plan of format 3 saved among its search statistics are
    what a saved plan's placement is checked with (`pipelined.staging._saved_placement`)."""
    plan = rj.Plan.load(FORMAT3 / "pipeline_2.json")
    if plan.target.jax_version != jax.__version__:
        pytest.skip(f"saved with jax {plan.target.jax_version}, whose program text this jax's may not match")
    _no_search(monkeypatch)
    step, args = make_mlp_train_step(), mlp_example(WIDTHS, 8, abstract=True)
    again = rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), plan=plan, num_micro_batches=2, pipeline=2)
    assert again.lower(*args).plan.search_stats.staging.cut_bytes == plan.search_stats.staging.cut_bytes


def _format3(edit) -> dict:
    """The data of the format 3 plan of two stages, its search statistics changed by `edit`."""
    data = json.loads((FORMAT3 / "pipeline_2.json").read_text())
    edit(data["search_stats"])
    return data


def test_format_3_search_statistics_become_typed_fields(tmp_path):
    """What format 3 tagged in its free-form object (a tuple, a float that is not finite, a
    candidate's dataclass) and what format 4 names otherwise loads into its typed field."""
    def edit(stats):
        stats.update(gap={"__float__": "nan"}, status="windowed", stage_epsilon=0.5, similar_segments=3,
                     coshard_candidates=[[1, 0.002, 1000], [2, 0.003, 800]],
                     compiled_candidates={"__tuple__": [
                         {"__dataclass__": "rhino_jax.compiled_choice:CompiledCandidate",
                          "fields": {"predicted_s": 0.001, "compiled_s": 0.002, "memory_bytes": 10, "fits": True,
                                     "kept": True}},
                         {"__dataclass__": "rhino_jax.compiled_choice:CompiledCandidate",
                          "fields": {"predicted_s": "inf"}}]})
    (tmp_path / "plan.json").write_text(json.dumps(_format3(edit)))
    s = rj.Plan.load(tmp_path / "plan.json").search_stats
    assert s.gap != s.gap and s.status == "windowed" and s.similar_segments == 3 and s.staging.epsilon == 0.5
    assert (s.segments, s.solver) == (2, "HIGHS")  # format 3's "subgraphs" and "backend"
    assert s.ilp_stages[0] == IlpStage("apply_gradients[0.0]", 86, "optimal", 5.206878573470086e-05,
                                       0.005510426000910229)
    assert s.coshard_candidates == (CoshardCandidate(1, 0.002, 1000), CoshardCandidate(2, 0.003, 800))
    assert s.compiled_candidates == (CompiledCandidate(0.001, 0.002, 10, True, True),
                                     CompiledCandidate(float("inf")))


@pytest.mark.parametrize("edit,message", [
    (lambda stats: stats.update(colour=1), r"search_stats.colour: no rhino_jax of format 3 writes this search "
                                           "statistic"),
    (lambda stats: stats.pop("stage_names"), r"search_stats.stages: expected a list of \[classes, status, "
                                             r"objective_s, solve_s\] and as many stage_names"),
    (lambda stats: stats.update(ilp_vars="many"), r"search_stats.ilp_vars: expected an integer"),
], ids=["unknown key", "stages unnamed", "wrong type"])
def test_format_3_search_statistics_that_format_3_never_wrote_are_refused(edit, message, tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps(_format3(edit)))
    with pytest.raises(ValueError, match=message):
        rj.Plan.load(tmp_path / "plan.json")


def _edited(plan, tmp_path, edit):
    """The path of `plan` saved, then its data changed by `edit` as a hand would change the file."""
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("dims,message", [
    ([["nope"], []], r"names the axis 'nope', which the mesh \[data=2 × model=4\] lacks; name axes of the mesh "
                     r"\(data, model\)"),
    (["model", []], r'\.dims\[0\]: expected a list, found the string "model" \(as a list of one item: \["model"\]\)'),
    ([[], [], []], r"has 3 dims for a tensor of shape \[16, 12\]; give one entry per dim, 2 in all"),
    ([["data"], ["model", "data"]], "names the axis 'data' more than once"),
    ([[], ["data", "model"]], r"splits dim 1 of size 12 8 ways over data\+model, but 12 is not a multiple of 8; "
                              "split it over axes whose sizes divide 12"),
], ids=["axis", "string", "rank", "twice", "divisor"])
def test_a_hand_edited_spec_the_mesh_cannot_lay_out_names_the_file_and_the_tensor(dims, message, tmp_path):
    """Refused when the file is loaded, not later as XLA's error (or, for a string, split into
    its characters, one axis each)."""
    step, args = make_mlp_train_step(), mlp_example((16, 12, 16), 8, abstract=True)
    mesh = rj.device_mesh((2, 4), ("data", "model"))
    plan = rj.parallelize(step, mesh=mesh).lower(*args).plan
    i = plan.arg_paths.index("arg[0][0]['w']")

    def edit(data):
        data["arg_specs"][i]["dims"] = dims

    path = _edited(plan, tmp_path, edit)
    with pytest.raises(ValueError, match=message) as refused:
        rj.parallelize(step, mesh=mesh, plan=path)
    assert str(refused.value).startswith(f"{path}: the spec of arg[0][0]['w'] at arg_specs[{i}]")


def test_a_bad_spec_in_a_program_plan_names_where_it_lies(tmp_path):
    step, args = make_mlp_train_step(), mlp_example(WIDTHS, 8, abstract=True)
    plan = rj.parallelize(step, mesh=rj.device_mesh((2, 4), ("data", "model")), num_micro_batches=2).lower(*args).plan
    spec = f"the spec of {plan.programs['apply_gradients'].arg_paths[1]} at programs.apply_gradients.arg_specs[1]"

    def axis(data):
        data["programs"]["apply_gradients"]["arg_specs"][1]["dims"][0] = ["nope"]

    def string(data):
        data["programs"]["apply_gradients"]["arg_specs"][1]["dims"] = "data"

    with pytest.raises(ValueError, match=re.escape(f"{spec} names the axis 'nope'")):
        rj.Plan.load(_edited(plan, tmp_path, axis))
    with pytest.raises(ValueError, match=re.escape(f"{spec}.dims: expected a list")):
        rj.Plan.load(_edited(plan, tmp_path, string))


def test_a_plan_file_with_a_spec_missing_says_which_list_is_short(tmp_path):
    step, args = make_mlp_train_step(), mlp_example(WIDTHS, 8, abstract=True)
    plan = rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",))).lower(*args).plan
    n = len(plan.arg_paths)
    with pytest.raises(ValueError, match=f"arg_specs has {n - 1} entries where arg_paths names {n} tensors; give one "
                                         "entry per tensor"):
        rj.Plan.load(_edited(plan, tmp_path, lambda data: data["arg_specs"].pop()))


@pytest.mark.parametrize("failure", ["disk full", "not serialisable"])
def test_a_save_that_fails_leaves_the_plan_file_that_was_there(failure, tmp_path, monkeypatch):
    step, args = make_mlp_train_step(), mlp_example(WIDTHS, 8, abstract=True)
    plan = rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",))).lower(*args).plan
    path = tmp_path / "plan.json"
    plan.save(path)
    before = path.read_bytes()
    if failure == "disk full":  # the new plan written, then the disk refuses to hold it
        def full(_fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "fsync", full)
        other, raised = dataclasses.replace(plan, cluster="another"), OSError
    else:  # a search statistic JSON cannot hold: found only while the plan is serialised
        other, raised = dataclasses.replace(plan, search_stats=dataclasses.replace(plan.search_stats,
                                                                                   gap=object())), TypeError
    with pytest.raises(raised):
        other.save(path)
    assert path.read_bytes() == before
    assert rj.Plan.load(path) == plan
    assert os.listdir(tmp_path) == ["plan.json"]  # no temporary file left behind


def test_diff_takes_plan_files_and_refuses_what_is_not_a_plan(tmp_path):
    step, args = make_mlp_train_step(), mlp_example(WIDTHS, 8, abstract=True)
    a = rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",))).lower(*args).plan
    b = rj.parallelize(step, mesh=rj.device_mesh((2, 4), ("data", "model"))).lower(*args).plan
    a.save(tmp_path / "a.json")
    b.save(tmp_path / "b.json")
    loaded_a, loaded_b = Plan.load(tmp_path / "a.json"), Plan.load(tmp_path / "b.json")
    assert str(rj.diff(tmp_path / "a.json", str(tmp_path / "b.json"))) == str(rj.diff(loaded_a, loaded_b))
    assert str(rj.diff(a, tmp_path / "b.json")) == str(rj.diff(a, loaded_b))
    with pytest.raises(TypeError, match=r"b of rj.diff\(a, b\) must be a rhino_jax.Plan or the path of a saved one, "
                                        "got int"):
        rj.diff(a, 42)


def test_parallelize_records_the_target_and_runs_a_saved_plan_without_a_search(tmp_path, monkeypatch):
    step, args = make_mlp_train_step(), mlp_example(WIDTHS, 8)
    mesh = rj.device_mesh((2, 4), ("data", "model"))
    lowered = rj.parallelize(step, mesh=mesh).lower(*args)
    assert lowered.plan.target == _target(step, args, mesh)  # what a saved plan is checked against
    lowered.plan.save(tmp_path / "plan.json")

    def no_search(*_args, **_kwargs):
        raise AssertionError("searched although a plan was given")

    monkeypatch.setattr(rj.coshard_search, "plan_on", no_search)
    again = rj.parallelize(step, mesh=mesh, plan=tmp_path / "plan.json")
    assert again.lower(*args).plan.value_specs == lowered.plan.value_specs
    assert_same_numbers(jax.jit(step)(*args), again(*args))
    with pytest.raises(PlanTargetError, match="program differs"):  # another step, same shapes
        rj.parallelize(make_mlp_train_step(lr=0.5), mesh=mesh, plan=rj.Plan.load(tmp_path / "plan.json")).lower(*args)
    with pytest.raises(ValueError, match=r"plan= runs a saved plan as it was made: pass mesh=rj.device_mesh\(\(2, 4\), "
                       r"\('data', 'model'\)\), num_micro_batches=1, pipeline='off' \(got mesh=None\)"):
        rj.parallelize(step, plan=tmp_path / "plan.json")
    with pytest.raises(TypeError, match="plan must be a rhino_jax.Plan"):
        rj.parallelize(step, mesh=mesh, plan=42)


def test_a_plan_donating_other_arguments_names_them_per_argument_not_per_array():
    """A train state donated is hundreds of arrays: the error names the step's arguments."""
    step, args = make_mlp_train_step(), mlp_example(WIDTHS, 8, abstract=True)
    mesh = rj.device_mesh((2, 4), ("data", "model"))
    plan = rj.parallelize(step, mesh=mesh, donate_argnums=(0, 1)).lower(*args).plan
    with pytest.raises(PlanTargetError) as refused:
        rj.parallelize(step, mesh=mesh, plan=plan).lower(*args)
    n = [len(jax.tree.leaves(a)) for a in args[:2]]
    assert (f"made with the arguments [arg[0] ({n[0]} arrays), arg[1] ({n[1]} arrays)] donated and is applied "
            "with [] donated; pass the same donate_argnums") in str(refused.value)


def _no_search(monkeypatch):
    """Make every search (SPMD programs, the stager) fail the test."""
    def no_search(*_args, **_kwargs):
        raise AssertionError("searched although a plan was given")

    for module in (rj.coshard_search, rj.micro_batched, rj.pipelined.lowered):
        monkeypatch.setattr(module, "plan_on", no_search)
    monkeypatch.setattr(stager, "stage", no_search)


@pytest.mark.parametrize("options", [dict(num_micro_batches=2), dict(num_micro_batches=4, pipeline=2)],
                         ids=["micro-batches", "pipeline"])
def test_a_saved_plan_of_several_programs_runs_without_a_search(options, tmp_path, monkeypatch):
    step, args = make_mlp_train_step(), mlp_example(WIDTHS, 8)
    mesh = rj.device_mesh((2, 4), ("data", "model"))
    searched = rj.parallelize(step, mesh=mesh, **options).lower(*args)
    assert searched.plan.target is not None and searched.plan.programs
    searched.plan.save(tmp_path / "plan.json")
    _no_search(monkeypatch)
    again = rj.parallelize(step, mesh=mesh, plan=tmp_path / "plan.json", **options)
    plan = again.lower(*args).plan
    assert plan == searched.plan  # every program's plan, the placement of the ops, the predicted cost
    assert plan.program_plans().keys() == searched.compile().programs.keys()
    assert_same_numbers(jax.jit(step)(*args), again(*args))


def test_a_saved_pipelined_plan_is_refused_for_other_options_or_another_program(tmp_path, monkeypatch):
    step, args = make_mlp_train_step(), mlp_example(WIDTHS, 8, abstract=True)
    mesh = rj.device_mesh((2, 4), ("data", "model"))
    rj.parallelize(step, mesh=mesh, num_micro_batches=4, pipeline=2).lower(*args).plan.save(tmp_path / "plan.json")
    _no_search(monkeypatch)
    path = tmp_path / "plan.json"
    wanted = r"pass mesh=rj.device_mesh\(\(2, 4\), \('data', 'model'\)\), num_micro_batches=4, pipeline=2, " \
             r"schedule='1f1b'"
    with pytest.raises(ValueError, match=wanted + r" \(got num_micro_batches=1, pipeline='off'\)"):
        rj.parallelize(step, mesh=mesh, plan=path)
    with pytest.raises(ValueError, match=wanted + r" \(got pipeline='auto'\)"):
        rj.parallelize(step, mesh=mesh, plan=path, num_micro_batches=4, pipeline="auto")
    with pytest.raises(ValueError, match=r"\(got schedule='gpipe'\)"):
        rj.parallelize(step, mesh=mesh, plan=path, num_micro_batches=4, pipeline=2, schedule="gpipe")
    with pytest.raises(ValueError, match=wanted + r" \(got mesh=None\)"):
        rj.parallelize(step, plan=path, num_micro_batches=4, pipeline=2)
    with pytest.raises(PlanTargetError, match="program differs"):
        rj.parallelize(make_mlp_train_step(lr=0.5), mesh=mesh, plan=path, num_micro_batches=4, pipeline=2).lower(*args)
    with pytest.raises(PlanTargetError, match=r"made with the arguments \[\] donated and is applied with "
                                              r"\[arg\[1\] \(\d+ arrays\)\] donated; pass the same donate_argnums"):
        rj.parallelize(step, mesh=mesh, plan=path, num_micro_batches=4, pipeline=2, donate_argnums=1).lower(*args)
    edited = dataclasses.replace(rj.Plan.load(path), placement={})
    with pytest.raises(PlanTargetError, match="places 0 ops in 2 stages"):
        rj.parallelize(step, mesh=mesh, plan=edited, num_micro_batches=4, pipeline=2).lower(*args)


def test_a_saved_program_plan_made_for_another_program_is_refused(tmp_path, monkeypatch):
    step, args = make_mlp_train_step(), mlp_example(WIDTHS, 8, abstract=True)
    mesh = rj.device_mesh((2, 4), ("data", "model"))
    plan = rj.parallelize(step, mesh=mesh, num_micro_batches=2).lower(*args).plan
    apply = plan.programs["apply_gradients"]
    assert apply.target.arg_paths[-1].startswith("sum[")  # each program plan records the program it was made for
    cut = dataclasses.replace(plan, programs=dict(plan.programs, apply_gradients=dataclasses.replace(
        apply, target=dataclasses.replace(apply.target, program="0" * 64))))  # as if cut otherwise
    _no_search(monkeypatch)
    with pytest.raises(PlanTargetError, match="plan of the program apply_gradients was not made for the program cut "
                                              "from this step now .*program differs"):
        rj.parallelize(step, mesh=mesh, plan=cut, num_micro_batches=2).lower(*args)
