"""Plan files: `plan.save(path)` / `rj.Plan.load(path)` give back the same plan, and a plan is
refused, naming the difference, when the program or mesh it is checked against is not its own."""
import dataclasses
import json

import jax
import pytest

import rhino_jax as rj
from rhino_jax.hlo_passes.lowering import lower_on_mesh
from rhino_jax.models import make_mlp_train_step, mlp_example
from rhino_jax.plan_target import PlanTarget, PlanTargetError

from helpers import assert_same_numbers

WIDTHS = (16, 32, 32, 32, 16)


def _target(step, args, mesh):
    return PlanTarget.of(lower_on_mesh(step, args, mesh, ()), mesh)


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
    assert json.loads((tmp_path / "plan.json").read_text())["rhino_jax_plan"] == 1


def test_the_plan_of_the_same_program_and_mesh_is_accepted_after_loading(tmp_path):
    step, args = make_mlp_train_step(), mlp_example(WIDTHS, 8, abstract=True)
    mesh = rj.device_mesh((2, 4), ("data", "model"))
    plan = dataclasses.replace(rj.parallelize(step, mesh=mesh).lower(*args).plan, target=_target(step, args, mesh))
    _round_trip(plan, tmp_path).check_matches(_target(make_mlp_train_step(), args, mesh))


@pytest.mark.parametrize("change,message", [
    ("program", "program differs"),
    ("shapes", r"argument arg\[2\]\['x'\] is float32\[16, 16\], the plan was made for .* float32\[8, 16\]"),
    ("mesh", r"made for the mesh \(data=2, model=4\) and is applied to \(data=4, model=2\)"),
    ("devices", "made for the devices"),
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
    else:
        other_mesh = rj.device_mesh((2, 4), ("data", "model"), devices=jax.devices()[::-1])
    with pytest.raises(PlanTargetError, match=message):
        loaded.check_matches(_target(other_step, other_args, other_mesh))


def test_a_plan_that_records_no_target_is_refused():
    step, args = make_mlp_train_step(), mlp_example(WIDTHS, 8, abstract=True)
    mesh = rj.device_mesh((8,), ("data",))
    plan = dataclasses.replace(rj.parallelize(step, mesh=mesh).lower(*args).plan, target=None)
    with pytest.raises(PlanTargetError, match="does not record the program and mesh"):
        plan.check_matches(_target(step, args, mesh))


@pytest.mark.parametrize("text,message", [
    ("not json", "plan.json: Expecting value"),
    ('{"mesh_axes": {"data": 8}}', "not a rhino_jax plan file of format 1 \\(found none\\)"),
    ('{"rhino_jax_plan": 1, "mesh_axes": {}, "colour": 1}', "Plan has no field 'colour'"),
    ('{"rhino_jax_plan": 1, "mesh_axes": {}}', "Plan lacks field 'cluster'"),
])
def test_a_file_that_is_not_a_plan_says_so(text, message, tmp_path):
    (tmp_path / "plan.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        rj.Plan.load(tmp_path / "plan.json")


def test_parallelize_records_the_target_and_runs_a_saved_plan_without_a_search(tmp_path, monkeypatch):
    step, args = make_mlp_train_step(), mlp_example(WIDTHS, 8)
    mesh = rj.device_mesh((2, 4), ("data", "model"))
    lowered = rj.parallelize(step, mesh=mesh).lower(*args)
    assert lowered.plan.target == _target(step, args, mesh)  # what a saved plan is checked against
    lowered.plan.save(tmp_path / "plan.json")

    def no_search(*_args, **_kwargs):
        raise AssertionError("searched although a plan was given")

    monkeypatch.setattr(rj.api, "plan_on", no_search)
    again = rj.parallelize(step, mesh=mesh, plan=tmp_path / "plan.json")
    assert again.lower(*args).plan.value_specs == lowered.plan.value_specs
    assert_same_numbers(jax.jit(step)(*args), again(*args))
    with pytest.raises(PlanTargetError, match="program differs"):  # another step, same shapes
        rj.parallelize(make_mlp_train_step(lr=0.5), mesh=mesh, plan=rj.Plan.load(tmp_path / "plan.json")).lower(*args)
    with pytest.raises(ValueError, match="plan= runs a saved SPMD plan on a given mesh"):
        rj.parallelize(step, plan=tmp_path / "plan.json")
    with pytest.raises(TypeError, match="plan must be a rhino_jax.Plan"):
        rj.parallelize(step, mesh=mesh, plan=42)
