"""Plan files: written whole or not at all, and read back only when this rhino_jax can run them
(its format, and every argument's and result's spec one its mesh can lay out), with errors that
name the file, the place in it and the tensor. Plain data only: `plan` reads and writes through
these."""
from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from typing import Any

from rhino_jax.core.specs import ShardingSpec

from .plain_data import location

# The `rhino_jax_plan` entry of a plan file: bumped when the layout of the file changes (2: targets
# record the platform and process layout, not device ids; 3: how the programs run is the plan's
# `execution`, no longer among its search statistics; 4: the search statistics are typed,
# `SearchDiagnostics`, no longer a free-form object).
PLAN_FORMAT = 4
OLDEST_FORMAT = 3  # the oldest format this rhino_jax loads (`upgraded`)


def check_writable(path: str | os.PathLike) -> None:
    """OSError naming `path` where `Plan.save(path)` could not write a file there: a directory, a
    folder that is missing or not writable, a read-only file (refused, as writing it in place would
    be). A caller about to search for minutes checks first."""
    real = os.path.realpath(path)
    folder = os.path.dirname(real)
    if os.path.isdir(real):
        raise IsADirectoryError(errno.EISDIR, "is a directory, not a file", os.fspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(errno.ENOENT, f"there is no directory {folder}", os.fspath(path))
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, f"this user may not write in {folder}", os.fspath(path))
    if os.path.exists(real) and not os.access(real, os.W_OK):
        raise PermissionError(errno.EACCES, "the file is read-only", os.fspath(path))


def replace_file(path: str | os.PathLike, text: str) -> None:
    """Write `text` to a new file beside `path`, to the disk, then move it over `path`: a write
    that fails midway (a full disk, a quota) leaves the file that was there whole, and no new one.
    A link is followed, as writing in place would."""
    check_writable(path)
    path = os.path.realpath(path)
    temp = f"{path}.{secrets.token_hex(4)}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the mode open(path, "w") gives a new file
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(path):
            shutil.copymode(path, temp)
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise


def not_readable(data) -> str | None:
    """Why the JSON `data` is no plan file this rhino_jax reads, and what to do; None when it is
    one. The format is shown as the file has it: the string "2" is not the format 2."""
    if not isinstance(data, dict) or "rhino_jax_plan" not in data:
        held = "an object without" if isinstance(data, dict) else f"a JSON {type(data).__name__}, not an object with"
        return (f"not a rhino_jax plan file: it holds {held} a \"rhino_jax_plan\" format entry; give a file written "
                "by Plan.save or python -m rhino_jax plan")
    found = data["rhino_jax_plan"]
    if type(found) is int and OLDEST_FORMAT <= found <= PLAN_FORMAT:
        return None
    if type(found) is not int:
        what = "no rhino_jax writes that; plan again with this one"
    elif found > PLAN_FORMAT:
        what = "a newer rhino_jax wrote it; upgrade rhino_jax to load it, or plan again with this one"
    else:
        what = "an older rhino_jax wrote it; plan again with this one"
    return (f"the plan file is of format {json.dumps(found)} where this rhino_jax reads formats {OLDEST_FORMAT} to "
            f"{PLAN_FORMAT}: {what}")


def upgraded(data: dict) -> dict:
    """A readable plan file's data (`not_readable`) in the layout of `PLAN_FORMAT`: a plan of
    format 3, and each plan it holds, with its free-form search statistics as the data of a
    `SearchDiagnostics`."""
    if data["rhino_jax_plan"] == PLAN_FORMAT:
        return data
    return _upgraded_plan(data)


def _upgraded_plan(plan: dict, where: tuple[str | int, ...] = ()) -> dict:
    """A format 3 plan's data, and that of each plan it holds (its stages', its programs'), with
    `search_stats` as format 4 writes it; `where` leads to it in the file."""
    if not isinstance(plan, dict):
        return plan  # not a plan: loading it says what is wrong there
    out = dict(plan)
    if "search_stats" in plan:
        out["search_stats"] = _format3_stats(plan["search_stats"], (*where, "search_stats"))
    if isinstance(plan.get("stages"), list):
        out["stages"] = [{**st, **{attr: _upgraded_plan(st[attr], (*where, "stages", i, attr))
                                   for attr in ("forward", "backward") if st.get(attr) is not None}}
                         if isinstance(st, dict) else st for i, st in enumerate(plan["stages"])]
    if isinstance(plan.get("programs"), dict):
        out["programs"] = {name: _upgraded_plan(p, (*where, "programs", name)) for name, p in plan["programs"].items()}
    return out


# Format 3's search statistics kept under the same name in format 4.
_FORMAT3_KEPT = frozenset({
    "ops", "critical_nodes", "tied_segments", "similar_segments", "groups", "hubs", "constraints", "ilp_groups",
    "ilp_vars", "ilp_constraints", "status", "gap", "objective_s", "windows", "build_s", "solve_s", "not_replicated",
    "memory_weight_s", "strided_values", "strided_examples", "plan_of", "pipeline_candidates", "compiled_candidates"})
# What format 3's search statistics held that format 4's do not: the same figure again
# ("instructions": the ops; "critical_proportion": a property; "compute_gradients": the search
# statistics of the plan of that program, among the plan's programs), or what nothing read
# ("units", "edges", "relaxation_exact", "stage_flops").
_FORMAT3_LEFT_OUT = frozenset({"instructions", "critical_proportion", "compute_gradients", "units", "edges",
                               "relaxation_exact", "stage_flops"})
_FORMAT3_RENAMED = {"subgraphs": "segments", "backend": "solver"}
_FORMAT3_STAGING = {"stage_cut_bytes": "cut_bytes", "stage_epsilon": "epsilon", "arguments_in_s": "arguments_in_s",
                    "sums_out_s": "sums_out_s", "outputs_out_s": "outputs_out_s"}


def _format3_stats(stats, where: tuple[str | int, ...]):
    """Format 3's search statistics (a free-form object: a tuple written as {"__tuple__": [...]},
    a float not finite as {"__float__": "nan"}, a candidate as {"__dataclass__": ..., "fields":
    {...}}) as format 4 writes a `SearchDiagnostics`. A key format 3 never wrote is refused,
    naming it; loading refuses a value of the wrong form."""
    if not isinstance(stats, dict):
        return stats
    stats = _untagged(stats)
    unknown = sorted(set(stats) - _FORMAT3_LEFT_OUT - set(_FORMAT3_RENAMED) - set(_FORMAT3_STAGING)
                     - {"stages", "stage_names", "coshard_candidates"} - _FORMAT3_KEPT)
    if unknown:
        raise ValueError(f"{location((*where, unknown[0]))}: no rhino_jax of format 3 writes this search statistic; "
                         "plan again")
    out = {key: value for key, value in stats.items() if key in _FORMAT3_KEPT}
    out.update((new, stats[old]) for old, new in _FORMAT3_RENAMED.items() if old in stats)
    stages, names = stats.get("stages", []), stats.get("stage_names", [])
    if stages or names:
        if not (isinstance(stages, list) and isinstance(names, list) and len(stages) == len(names)
                and all(isinstance(st, list) and len(st) == 4 for st in stages)):
            raise ValueError(f"{location((*where, 'stages'))}: expected a list of [classes, status, objective_s, "
                             "solve_s] and as many stage_names")
        out["ilp_stages"] = [dict(name=name, classes=st[0], status=st[1], objective_s=st[2], solve_s=st[3])
                             for name, st in zip(names, stages)]
    if "coshard_candidates" in stats:
        out["coshard_candidates"] = [dict(zip(("chunks", "step_s", "memory_bytes"), c)) if isinstance(c, list) else c
                                     for c in stats["coshard_candidates"]]
    if "stage_cut_bytes" in stats:
        out["staging"] = {new: stats[old] for old, new in _FORMAT3_STAGING.items() if old in stats}
    return out


def _untagged(data):
    """Free-form data of format 3 with its tags taken off: a tuple is a list, a float not finite
    its string ("nan"), a dataclass its fields, as format 4 writes each typed."""
    if isinstance(data, list):
        return [_untagged(v) for v in data]
    if not isinstance(data, dict):
        return data
    if data.keys() == {"__tuple__"}:
        return _untagged(data["__tuple__"])
    if data.keys() == {"__float__"}:
        return data["__float__"]
    if data.keys() == {"__dataclass__", "fields"}:
        return data["fields"]
    return {k: _untagged(v) for k, v in data.items()}


# The field of a plan's data that names the tensor of each spec of a field of specs.
_SPEC_PATHS = {"arg_specs": "arg_paths", "output_specs": "output_paths"}


def spec_owner(data, where: tuple[str | int, ...]) -> str:
    """The words that name the tensor whose spec `where`, a place in a plan file's data, lies in
    (an argument's or output's, of the plan or a plan it holds): "the spec of arg[0]['w'] at "; ""
    elsewhere."""
    owner = ""
    for key, index in zip(where, where[1:]):
        if isinstance(data, dict) and key in _SPEC_PATHS and isinstance(index, int):
            paths = data.get(_SPEC_PATHS[key])
            if isinstance(paths, list) and index < len(paths):
                owner = f"the spec of {paths[index]} at "
        try:
            data = data[key]
        except (KeyError, IndexError, TypeError):
            break
    return owner


def _plans_in(plan: Any, where: tuple[str | int, ...] = ()) -> Iterator[tuple[tuple[str | int, ...], Any]]:
    """The plan and each plan it holds (its stages', its programs'), with where each lies in its
    saved data."""
    yield where, plan
    for i, st in enumerate(plan.stages):
        for attr in ("forward", "backward"):
            if getattr(st, attr):
                yield from _plans_in(getattr(st, attr), (*where, "stages", i, attr))
    for name, program in plan.programs.items():
        yield from _plans_in(program, (*where, "programs", name))


def check_specs(plan: Any) -> None:
    """ValueError naming the tensor, where its spec lies and what to change, for the first
    argument or output spec of `plan` (or a plan it holds) that its mesh cannot lay out: a
    hand-edited plan file fails when it is loaded, not in XLA."""
    for where, p in _plans_in(plan):
        for paths, fields in (("arg_paths", ("arg_roles", "arg_shapes", "arg_dtypes", "arg_specs")),
                              ("output_paths", ("output_specs",))):
            n = len(getattr(p, paths))
            for name in fields:
                if len(getattr(p, name)) != n:
                    raise ValueError(f"{location((*where, name))} has {len(getattr(p, name))} entries where "
                                     f"{location((*where, paths))} names {n} tensors; give one entry per tensor")
        axes = _laid_out_on(p)
        for specs, shapes in (("arg_specs", p.arg_shapes), ("output_specs", (None,) * len(p.output_specs))):
            for i, (spec, shape) in enumerate(zip(getattr(p, specs), shapes)):
                why = spec_problem(spec, axes, shape)
                if why:
                    tensor = getattr(p, _SPEC_PATHS[specs])[i]
                    raise ValueError(f"the spec of {tensor} at {location((*where, specs, i))} {why}")


def _laid_out_on(plan: Any) -> dict[str, int]:
    """The axis sizes a plan's argument and result specs are checked on: a pipeline's lay most
    of the state out on a stage's sub-mesh, where the first axis, the one cut into stages, has
    size 1 (so a split over it is not checked there)."""
    if not plan.stages:
        return plan.mesh_axes
    first = next(iter(plan.mesh_axes), None)
    return {a: 1 if a == first else n for a, n in plan.mesh_axes.items()}


def spec_problem(spec: ShardingSpec, mesh_axes: dict[str, int], shape: tuple[int, ...] | None) -> str | None:
    """Why the mesh cannot lay out a tensor of `shape` (None: not recorded, as an output's) as
    `spec`, and what to change; None when it can."""
    used = spec.used_axes()
    for axis in used:
        if axis not in mesh_axes:
            return (f"names the axis {axis!r}, which the mesh {mesh_label(mesh_axes)} lacks; name axes of the mesh "
                    f"({', '.join(mesh_axes)})")
        if used.count(axis) > 1:
            return f"names the axis {axis!r} more than once; a mesh axis splits one dim at most"
    if shape is None:
        return None
    if spec.rank != len(shape):
        return (f"has {spec.rank} dims for a tensor of shape {list(shape)}; give one entry per dim, {len(shape)} in "
                "all ([] for a dim not split)")
    for d, (size, axes) in enumerate(zip(shape, spec.dims)):
        ways, block = spec.shard_factor_of(axes, mesh_axes), spec.stride(d) or 1
        if size % (ways * block):
            blocks = f" in blocks of {block}" if block > 1 else ""
            return (f"splits dim {d} of size {size} {ways} ways over {'+'.join(axes)}{blocks}, but {size} is not a "
                    f"multiple of {ways * block}; split it over axes whose sizes divide {size}, or not at all ([])")
    return None


def mesh_label(mesh_axes: dict[str, int]) -> str:
    """A mesh as the report names it: "[data=2 × model=4]"."""
    return "[" + " × ".join(f"{a}={n}" for a, n in mesh_axes.items()) + "]"
