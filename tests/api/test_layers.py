"""Imports run one way: down the stages, to plain types that import nothing of ours.

Each folder is a stage, ranked in the order data flows (`docs/DESIGN.md`): the errors and the
ground floor (`rhino_jax.core`), plain types every stage raises, reads and writes, below all;
then import (hlo_passes), search (its sub-packages ranked too), runtime, and the API on top
(rhino_jax). A module may import
from its own rank or below, never above, deferred imports and imports for type checking
included; and no modules import each other around a loop. What several stages read stands on
the floor; what reads a stage above it (a plan's report, its schedule) is reached through a
table filled from above (`rhino_jax.core.plan.READERS`).
"""
from __future__ import annotations

import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parents[2]
FOLDERS = {"rhino_jax": "rhino_jax", "hlo_passes": "rhino_jax.hlo_passes", "search": "rhino_jax.search",
           "runtime": "rhino_jax.runtime"}
GROUND = {"rhino_jax.errors"}
RANK = {"rhino_jax.core": 0, "rhino_jax.hlo_passes": 1, "rhino_jax.search": 2, "rhino_jax.runtime": 3,
        "rhino_jax": 4}
# Inside the search, its sub-packages in the order they build on each other: what the search says
# and how Ctrl-C stops it, then the cost model, the strategy space it prices, the cones over that
# space, the solvers and the stager; the planner and what ties the stages together on top.
RANK.update({f"rhino_jax.search.{name}": 2 + k / 10 for k, name in enumerate(
    ("progress", "interrupt", "cost", "space", "coarsening", "solvers", "staging"))}, **{"rhino_jax.search": 2.9})


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            out[".".join((package, *parts))] = path
    return out


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The modules of ours that `name` imports anywhere in its file (deferred and TYPE_CHECKING
    imports too); `from package import module` names the module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # a name inside a module: the module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        graph.add_edges_from((name, t) for t in _imports(name, path, set(modules)))
    return graph


def _rank(module: str) -> int:
    if module in GROUND:
        return 0
    package = max((p for p in RANK if module == p or module.startswith(p + ".")), key=len)  # the innermost
    return RANK[package]


def test_imports_run_down_the_stages():
    graph = _graph()
    upward = {(a, b) for a, b in graph.edges if _rank(b) > _rank(a) and b not in FOLDERS.values()}
    assert not upward, f"imports from a lower stage to a higher one: {sorted(upward)}"


def test_no_import_loops():
    loops = [c for c in nx.strongly_connected_components(_graph()) if len(c) > 1]
    assert not loops, f"modules that import each other around a loop: {sorted(map(sorted, loops))}"
