"""8 emulated CPU devices for every test; set before jax is imported anywhere. Fixtures several
test files share. How many processes `pytest -n auto` (pytest-xdist) runs the suite in, and
how it hands them the tests.

The tests sit in folders by the stage they test (hlo_passes/, search/, runtime/, api/,
end_to_end/); this folder goes on sys.path so that every one of them imports `helpers`.

The README runs them with `--dist loadgroup`: a worker is handed one test, or one group of tests
marked `xdist_group` (those that share a compiled plan), whenever it has two or fewer left, so
tests of a hundredth of a second and of two minutes (a GPU compile) even out between the workers;
xdist's default, `load`, hands out long runs of tests ahead: in a run on 2 cores the workers
spent 8 % of it idle. xdist tells its scheduler a test's group by appending it to the test's
node id, which pytest 9.2 keeps in a structured form that xdist 3.8 does not set: there
`pytest_collection_modifyitems` below sets it."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(scope="session")
def tiny_gpt():
    """GPT_TINY's step, its arguments and its one-device result, made once: each new step is a new
    function, which jax.jit compiles again (seconds)."""
    import jax
    from rhino_jax.models import gpt
    step, args = gpt.make_gpt_train_step(gpt.GPT_TINY), gpt.gpt_example(gpt.GPT_TINY)
    return step, args, jax.jit(step)(*args)


@pytest.fixture
def solves_out_of_time(monkeypatch):
    """The search's time limit has passed when its first solve starts, its model built: each
    solve stops at once with the best it has, and no memory-limit trial starts. (A limit that
    passes during the build is a `SolverError`, `levels.Deadline.check`.)"""
    from rhino_jax.search.solvers import levels
    monkeypatch.setattr(levels.Deadline, "left", lambda self: 0.0)


@pytest.fixture
def ctrl_c(monkeypatch):
    """Press Ctrl-C while the first solve runs: its first wait on the solver process raises
    KeyboardInterrupt, as SIGINT does there. `pressed` tells whether it was; `pid`, the solver
    process's id then."""
    from rhino_jax.search.solvers import solver_process

    class Press:
        pressed, pid = False, None

        @staticmethod
        def select(*args):
            if not Press.pressed:
                Press.pressed, Press.pid = True, solver_process.helper_pid()
                raise KeyboardInterrupt
            return real(*args)

    real = solver_process.select.select
    monkeypatch.setattr(solver_process, "select", Press)
    return Press


# A worker holds 8 emulated devices and XLA's compiles: 4.4 GiB at the peak of `.ci/run`'s largest.
WORKER_GIB = 5


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, as many as the machine's memory holds (at most 8): a
    64-core machine would otherwise start 64 workers of 8 devices each."""
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, int(memory_gib // WORKER_GIB), 8))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """In a worker of `--dist loadgroup`, after xdist's own hook: each test marked `xdist_group`
    whose node id does not name its group yet gets it appended (`id@group`, groups joined by
    "_"), as pytest-xdist appends it where pytest lets it set the node id (before 9.2). Without it
    the groups' tests are handed out one by one, and a plan two tests share may be made in both
    workers (a 90 s fixture, twice, in a run on 2 cores)."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                         for m in item.iter_markers("xdist_group")})
        if groups and "@" not in item.nodeid and hasattr(getattr(item, "_id", None), "parse"):
            item._id = type(item._id).parse(f"{item.nodeid}@{'_'.join(groups)}")
