"""A jax.distributed job of 2 processes × 4 CPU devices on this machine (`rhino_jax.launch`,
collectives over loopback): one plan on every process, the numbers of one device, and a dead
process that stops the job instead of hanging it."""
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent.parent  # tests/, beside conftest.py
STEP = HERE / "multiprocess_step.py"


def _launch(*args: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "rhino_jax.launch", "-n", "2", "--local-devices", "4",
                           "--timeout", str(timeout), *args], capture_output=True, text=True,
                          timeout=timeout + 60, cwd=HERE.parent)
    return done, time.monotonic() - start


def _digests(out: str) -> list[str]:
    """The plan digests the processes printed (C++ logging may split their lines: search, not parse)."""
    return re.findall(r"plan digest ([0-9a-f]{64})", out)


def _processes_saying(out: str, words: str) -> set[str]:
    return set(re.findall(rf"\[(\d)\] {words}", out))


def test_two_processes_hold_one_plan_and_match_one_device():
    done, _ = _launch(str(STEP), "run")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    digests = _digests(done.stdout)
    assert len(digests) == 2 and len(set(digests)) == 1
    assert _processes_saying(done.stdout, "same numbers as one device") == {"0", "1"}
    # the loss, made on the last stage (process 1), is returned on the whole mesh
    assert _processes_saying(done.stdout, "the loss read on this process") == {"0", "1"}


def test_a_dead_process_stops_the_job_within_a_minute():
    done, took = _launch(str(STEP), "die")
    assert done.returncode == 3 and took < 60
    assert "process 1 exited with code 3; stopped the other processes" in done.stderr


def test_an_exception_in_one_process_stops_the_job_with_its_code(tmp_path):
    """A Python error on one process, the others waiting in a collective with it: the failed
    process exits at once (no shutdown barrier) and the launcher stops the rest."""
    script = tmp_path / "fails.py"
    script.write_text("import jax\nfrom jax.experimental import multihost_utils\n"
                      "multihost_utils.sync_global_devices('start')\n"
                      "if jax.process_index() == 1:\n    raise ValueError('bad data on process 1')\n"
                      "multihost_utils.sync_global_devices('process 1 never comes')\n")
    done = subprocess.run([sys.executable, "-m", "rhino_jax.launch", "-n", "2", "--local-devices", "1",
                           "--timeout", "60", str(script)], capture_output=True, text=True, timeout=120,
                          cwd=HERE.parent)
    assert done.returncode == 1, done.stderr[-3000:]  # not 124: the job did not wait for its --timeout
    assert "ValueError: bad data on process 1" in done.stderr
    # process 0 may fail as well (its collective's peer is gone) and be reported first
    assert re.search(r"process [01] exited with code 1; stopped the other processes", done.stderr)


def test_the_launcher_refuses_bad_requests():
    for args, message in [(["-n", "0", str(STEP)], "-n must be at least 1"), (["-n", "2", "missing.py"], "no script")]:
        done = subprocess.run([sys.executable, "-m", "rhino_jax.launch", *args], capture_output=True, text=True,
                              timeout=60, cwd=HERE.parent)
        assert done.returncode == 2 and message in done.stderr


def test_plans_that_differ_across_processes_are_refused(monkeypatch):
    """`agree` on one process compares with the others; here two fake processes disagree."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    import rhino_jax as rj
    from rhino_jax import multiprocess
    from rhino_jax.models import make_mlp_train_step, mlp_example

    plan = rj.parallelize(make_mlp_train_step(), mesh=rj.device_mesh((8,), ("data",))).lower(
        *mlp_example((8, 8), 8)).plan
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multiprocess, "_spans_processes", lambda _plan: True)  # one process here: as if it did
    other = lambda x: np.concatenate([x[:32], np.roll(x[32:], 1)])  # noqa: E731 (same step, plan differs)
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.stack([x, other(x)]))
    with pytest.raises(multiprocess.PlanMismatchError, match=r"processes \[1\] found a different plan .*other "
                                                           r"options of rj.parallelize: opt_level"):
        multiprocess.agree(plan)
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.stack([x, x]))
    multiprocess.agree(plan)  # the same digest everywhere: nothing to say


def test_one_plan_for_steps_of_other_shapes_across_processes_is_refused(monkeypatch):
    """Process 1 lowered the step for a batch of another size: the layouts (and so the plan
    digests) are the same, the programs are not, and running them would mix different steps."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    import rhino_jax as rj
    from rhino_jax import multiprocess
    from rhino_jax.models import make_mlp_train_step, mlp_example

    step = rj.parallelize(make_mlp_train_step(), mesh=rj.device_mesh((8,), ("data",)))
    plan, theirs = (step.lower(*mlp_example((8, 8), n)).plan for n in (8, 16))
    assert multiprocess.digest(plan) == multiprocess.digest(theirs)
    mine, other = (np.frombuffer(bytes.fromhex(multiprocess.target_digest(p) + multiprocess.digest(p)), np.uint8)
                   for p in (plan, theirs))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multiprocess, "_spans_processes", lambda _plan: True)  # one process here: as if it did
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.stack([x, other]))
    with pytest.raises(multiprocess.PlanMismatchError, match=r"processes \[1\] lowered a different step"):
        multiprocess.agree(plan)


def test_a_step_on_this_process_devices_alone_is_not_compared_across_processes(monkeypatch):
    """A mesh of this process's devices (jax.local_devices()) runs a step of this process alone:
    the others hold other meshes (other device ids), so comparing would refuse a valid job."""
    import jax
    from jax.experimental import multihost_utils

    import rhino_jax as rj
    from rhino_jax import multiprocess
    from rhino_jax.models import make_mlp_train_step, mlp_example

    plan = rj.parallelize(make_mlp_train_step(), mesh=rj.device_mesh((8,), ("data",), jax.local_devices())).lower(
        *mlp_example((8, 8), 8)).plan
    monkeypatch.setattr(jax, "process_count", lambda: 2)

    def gather(_x):
        raise AssertionError("compared a process-local plan across processes")

    monkeypatch.setattr(multihost_utils, "process_allgather", gather)
    multiprocess.agree(plan)


def test_a_pipeline_stage_per_process_matches_one_device(tmp_path):
    """pipeline=2 on a (2, 4) mesh: each stage on one process's 4 devices; every move between
    the processes is an SPMD program over the whole mesh (`runtime.transfer`). The step runs
    from the plan process 0 saved, loaded by both without a search."""
    done, _ = _launch(str(STEP), "pipeline", str(tmp_path / "plan.json"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    digests = _digests(done.stdout)
    assert len(digests) == 4 and len(set(digests)) == 1  # searched and loaded, on both processes
    assert done.stdout.count("(loaded)") == 2
    assert _processes_saying(done.stdout, "same numbers as one device") == {"0", "1"}
