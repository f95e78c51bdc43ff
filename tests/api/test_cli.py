"""python -m rhino_jax plan MODULE:FUNCTION: plans the step, prints the report, writes a plan file that
this process would accept for the same step; bad command lines name what to change."""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

import rhino_jax as rj
import rhino_jax.cli
from rhino_jax.cli import main
from rhino_jax.hlo_passes.lowering import lower_on_mesh, step_target
from rhino_jax.models import make_mlp_train_step, mlp_example
from rhino_jax.multiprocess import digest

WIDTHS = (16, 32, 32, 16)
STEP_MODULE = f"""
from rhino_jax.models import make_mlp_train_step, mlp_example


def setup():
    return make_mlp_train_step(), mlp_example({WIDTHS}, 8, abstract=True)


def wrong():
    return make_mlp_train_step()


def raising():
    def step(*state):
        raise ValueError("a bug in the user's step")
    return step, mlp_example({WIDTHS}, 8, abstract=True)
"""


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "tiny_step.py").write_text(textwrap.dedent(STEP_MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _run(args, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return subprocess.run([sys.executable, "-m", "rhino_jax", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_plan_writes_the_plan_this_process_finds_and_accepts(workdir):
    done = _run(["plan", "tiny_step:setup", "--mesh", "2x4", "--cpu-devices", "8", "--out", "tiny.json"], workdir)
    assert done.returncode == 0, done.stderr
    assert "rhino_jax plan  mesh [data=2 × model=4]  cluster m8-v100  opt O2" in done.stdout
    assert "plan written to tiny.json" in done.stdout
    loaded = rj.Plan.load(workdir / "tiny.json")
    step, args = make_mlp_train_step(), mlp_example(WIDTHS, 8, abstract=True)
    mesh = rj.device_mesh((2, 4), ("data", "model"))
    loaded.check_matches(step_target(lower_on_mesh(step, args, mesh, ()), mesh))
    assert digest(loaded) == digest(rj.parallelize(step, mesh=mesh).lower(*args).plan)


def test_plan_for_described_gpus_writes_the_plan_their_cluster_takes(workdir):
    """--topology h100:2x8: planned here for 2 hosts of 8 H100s, no GPU at hand; the plan names the
    GPU platform and a process per host, as the cluster's own devices will."""
    from helpers import _plugin_skip
    if _plugin_skip():
        pytest.skip(_plugin_skip())
    done = _run(["plan", "tiny_step:setup", "--topology", "h100:2x8", "--mesh", "2x8", "--out", "h100.json"], workdir)
    assert done.returncode == 0, done.stderr
    assert "of described NVIDIA H100" in done.stdout and "cluster 8x-h100" in done.stdout
    target = rj.Plan.load(workdir / "h100.json").target
    assert target.platform == "gpu" and target.mesh_shape == (2, 8) and target.processes == (0,) * 8 + (1,) * 8


def test_show_piped_into_a_reader_that_stops_early_is_not_an_error(workdir):
    """`python -m rhino_jax show plan.json | head -1`: the closed pipe is the reader's choice."""
    step, args = make_mlp_train_step(), mlp_example(WIDTHS, 8, abstract=True)
    rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",))).lower(*args).plan.save(workdir / "p.json")
    show = subprocess.Popen([sys.executable, "-m", "rhino_jax", "show", "p.json"], cwd=workdir,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    show.stdout.close()  # as head does after its lines; here before the report is written (jax still imports)
    _, err = show.communicate(timeout=120)
    assert show.returncode == 0 and b"error" not in err.lower(), err.decode()


def test_plan_takes_a_file_emulated_devices_and_axis_names_and_show_prints_it(workdir):
    done = _run(["plan", "tiny_step.py:setup", "--mesh", "4", "--axes", "batch", "--cpu-devices", "4",
                 "--opt", "O3", "--out", "four.json"], workdir)
    assert done.returncode == 0, done.stderr
    plan = rj.Plan.load(workdir / "four.json")
    assert plan.mesh_axes == {"batch": 4} and plan.opt_level == "O3"
    assert plan.target.processes == (0, 0, 0, 0) and plan.target.platform == "cpu"
    shown = _run(["show", "four.json"], workdir)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("rhino_jax plan  mesh [batch=4]  cluster m8-v100  opt O3")


@pytest.mark.parametrize("argv,message", [
    (["plan", "tiny_step"], "the step must be given as MODULE:FUNCTION"),
    (["plan", "no_such_module:setup"], "no module named 'no_such_module'"),
    (["plan", "missing/file.py:setup"], "no file missing/file.py"),
    (["plan", "tiny_step:nothing"], "tiny_step has no function 'nothing'"),
    (["plan", "tiny_step:wrong"], r"tiny_step:wrong\(\) must return \(step, args\)"),
    (["plan", "tiny_step:setup", "--mesh", "2by4"], "--mesh must be positive sizes joined by x"),
    (["plan", "tiny_step:setup", "--mesh", "2x0"], "--mesh must be positive sizes joined by x"),
    (["plan", "tiny_step:setup", "--mesh", "2x8"],
     r"--mesh 2x8 needs 16 devices, this machine has 8 \(cpu\); pass --cpu-devices 16"),
    (["plan", "tiny_step:setup", "--mesh", "2x4", "--axes", "data"], "give one name per axis"),
    (["plan", "tiny_step:setup", "--pipeline", "two"], "--pipeline must be off, auto or a number of stages"),
    (["plan", "tiny_step:setup", "--donate", "first"], "--donate must be integers joined by commas"),
    (["plan", "tiny_step:setup", "--topology", "h100:2by8"], r"--topology must be KIND:HOSTSxGPUS, e.g. h100:128x8"),
    (["plan", "tiny_step:setup", "--topology", "tpu:1x8"], r"unknown GPU kind 'tpu'; described GPUs are a100, h100"),
    (["plan", "tiny_step:setup", "--topology", "h100:1x8", "--cpu-devices", "8"], "pass one"),
])
def test_a_bad_command_line_says_what_to_change(argv, message, workdir, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_described_gpus_without_jax_cuda_plugin_are_one_line_not_a_traceback(workdir, capsys, monkeypatch):
    """--topology without the plugin: exit status 2, as for other bad command lines, and one line
    saying what is missing and which pip install gives it."""
    from jax.experimental import topologies

    def no_plugin(*_args, **_kwargs):  # what jax raises when no CUDA plugin is installed
        raise NotImplementedError("topology not implemented for cuda")

    monkeypatch.setattr(topologies, "get_topology_desc", no_plugin)
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "tiny_step:setup", "--topology", "h100:2x8", "--mesh", "2x8"])
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in errors[0], errors
    assert re.fullmatch(r"python -m rhino_jax: error: --topology h100:2x8: jax cannot describe h100 GPUs here "
                        r"\(NotImplementedError: topology not implemented for cuda\); pip install "
                        r"jax-cuda12-plugin==\S+ jax-cuda12-pjrt==\S+ .*", errors[0]), errors[0]


@pytest.mark.parametrize("argv,message", [
    (["plan", "tiny_step:setup", "--mesh", "2x4", "--schedule", "zigzag"], "schedule must be '1f1b'"),
    (["plan", "tiny_step:setup", "--mesh", "8", "--cluster", "tpu"], "unknown cluster preset 'tpu'"),
    (["show", "nothing.json"], "No such file"),
])
def test_an_option_rhino_jax_refuses_is_an_error_not_a_traceback(argv, message, workdir, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_show_refuses_a_hand_edited_plan_file_in_one_line(workdir, capsys):
    """As Plan.load refuses it: the file, the tensor and what to change, no traceback."""
    step, args = make_mlp_train_step(), mlp_example(WIDTHS, 8, abstract=True)
    rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",))).lower(*args).plan.save(workdir / "p.json")
    data = json.loads((workdir / "p.json").read_text())
    i = data["arg_paths"].index("arg[0][0]['w']")
    data["arg_specs"][i]["dims"][0] = ["model"]
    (workdir / "p.json").write_text(json.dumps(data))
    assert main(["show", "p.json"]) == 1
    shown = capsys.readouterr()
    assert shown.out == ""
    assert shown.err == (f"rhino_jax: error: p.json: the spec of arg[0][0]['w'] at arg_specs[{i}] names the axis "
                         "'model', which the mesh [data=8] lacks; name axes of the mesh (data)\n")


@pytest.mark.parametrize("out,message", [
    ("missing/plan.json", r"--out missing/plan.json: there is no directory \S*missing; give the path of a file in a "
                          "directory you may write"),
    (".", r"--out \.: is a directory, not a file; give the path of a file"),
], ids=["no-directory", "a-directory"])
def test_an_out_path_that_cannot_be_written_is_refused_before_the_search(out, message, workdir, capsys, monkeypatch):
    def no_search(*_args, **_kwargs):
        raise AssertionError("searched for a plan that cannot be written")

    monkeypatch.setattr(rhino_jax.cli, "parallelize", no_search)
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "tiny_step:setup", "--mesh", "8", "--out", out])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_an_error_raised_in_the_users_step_keeps_its_traceback(workdir):
    """Not the one line of an option rhino_jax refuses: the error propagates from the step."""
    with pytest.raises(ValueError, match="a bug in the user's step") as raised:
        main(["plan", "tiny_step:raising", "--mesh", "8"])
    assert any(entry.name == "step" for entry in raised.traceback)
