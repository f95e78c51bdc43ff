"""The README works as written: its first two commands (the demo, and the tests as .ci/run runs
them), its Flax + Optax example, the files and benchmark modules it points to."""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from helpers import code_blocks

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def _commands(script: str) -> list[str]:
    """The commands of a shell script's lines (split at &&), pip's -q left out: quiet is not another command."""
    out = []
    for line in script.splitlines():
        for part in line.split("&&"):
            words = part.split()
            out.append(" ".join(w for w in words if not (words[:2] == ["pip", "install"] and w == "-q")))
    return out


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def test_the_readme_starts_with_the_demo_and_the_test_command_ci_runs():
    language, code, offset = code_blocks(README)[0]
    assert language == "bash" and README[:offset].strip() == "# rhino_jax"
    demo, tests = code.strip().splitlines()
    assert _commands(demo) == ["pip install -e .", "python -m rhino_jax.demo"]
    ci = _commands((REPO / ".ci" / "run").read_text())
    wanted = _commands(tests)
    at = [ci.index(c) for c in wanted]  # each in .ci/run (ValueError names the one missing) ...
    assert at == sorted(at)  # ... and in this order


def test_the_demo_command_runs(tmp_path):
    done = subprocess.run([sys.executable, "-m", "rhino_jax.demo"], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mesh {'data': 2, 'model': 4} on 8 cpu devices" in done.stdout
    assert "largest difference over all outputs" in done.stdout


def test_the_flax_optax_example_runs_as_written(tmp_path):
    section = README.index("## A Flax + Optax train step")
    language, code, _ = next(b for b in code_blocks(README) if b[2] > section)
    assert language == "python" and "import optax" in code and "rj.parallelize" in code
    (tmp_path / "example.py").write_text(code)
    done = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rhino_jax plan  mesh [data=2 × model=4]" in done.stdout
    assert re.search(r"step 2: loss [\d.]+, on one device [\d.]+", done.stdout), done.stdout[-2000:]


def test_the_files_and_benchmarks_the_readme_names_exist():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert links and [p for p in links if not (REPO / p).exists()] == []
    modules = set(re.findall(r"python -m (benchmarks\.\w+)", README))
    assert modules and [m for m in modules if not (REPO / (m.replace(".", "/") + ".py")).exists()] == []


def test_every_benchmark_the_readme_names_runs_as_a_module():
    """`python -m benchmarks.X` runs X's main: without the `__main__` guard it does nothing and
    exits 0, a benchmark that seems to run and measures nothing."""
    modules = set(re.findall(r"python -m (benchmarks\.\w+)", README))
    unguarded = [m for m in sorted(modules) if not any(
        isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)
        for n in ast.parse((REPO / (m.replace(".", "/") + ".py")).read_text()).body)]
    assert modules and unguarded == []
