"""python -m rhino_jax: plan a train step from the shell, write the plan file, show a saved one.

    python -m rhino_jax plan MODULE:FUNCTION --mesh 2x4 [--axes data,model] [--opt O2] [--cluster NAME]
                             [--out plan.json] [--cpu-devices 8 | --topology h100:128x8] ...
    python -m rhino_jax show plan.json

FUNCTION takes no arguments and returns `(step, args)`: the train step and a tuple of its
positional arguments (arrays, or `jax.ShapeDtypeStruct`s: planning needs no data). MODULE is an
importable module (`pkg.mod`, found from the current directory or PYTHONPATH) or a file
(`path/to/file.py`). `--cpu-devices N` emulates N CPU devices: XLA reads XLA_FLAGS when jax
first builds its backend (importing jax does not), so setting it after parsing is in time.
`--topology KIND:HOSTSxGPUS` plans for described GPUs (`rj.gpu_topology`) on any machine: the
plan file is then run on the cluster with `parallelize(..., plan=...)`.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import os
import sys
from pathlib import Path

import jax

from rhino_jax.core.plan import Plan
from rhino_jax.core.plan_file import check_writable

from .api import parallelize
from .errors import GpuPluginError, RhinoError
from .gpu_topology import GPUS, gpu_topology
from .mesh import device_mesh

DEFAULT_AXES = ("data", "model", "extra")  # as parallelize(mesh=None) names enumerated meshes


class UsageError(Exception):
    """A bad command line: the message names the argument and what to change."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rhino_jax", description="Plan a JAX train step with rhino_jax.")
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="search a plan for a train step, print its report, write the plan file",
                               description="FUNCTION takes no arguments and returns (step, args).")
    plan.add_argument("target", metavar="MODULE:FUNCTION", help="e.g. mymodel:setup or path/to/mymodel.py:setup")
    plan.add_argument("--mesh", help="mesh shape, sizes joined by x (e.g. 2x4); default: search mesh shapes")
    plan.add_argument("--axes", help="mesh axis names joined by commas (default: data,model,extra, as many as needed)")
    plan.add_argument("--opt", default="O2", choices=("O2", "O3"), help="optimization level (default O2)")
    plan.add_argument("--cluster", help="cluster preset the cost model prices for (default m8-v100)")
    plan.add_argument("--memory-limit-gib", type=float, help="per-device memory the plan must fit, in GiB")
    plan.add_argument("--micro-batches", type=int, default=1, help="number of micro-batches (default 1)")
    plan.add_argument("--pipeline", default="off", help="off, auto or a number of stages (default off)")
    plan.add_argument("--schedule", help="1f1b, gpipe or eager-1f1b (default 1f1b)")
    plan.add_argument("--donate", help="positions of arguments the step may overwrite, e.g. 0,1")
    plan.add_argument("--time-limit", type=float, default=60.0, help="solver time limit in seconds (default 60)")
    plan.add_argument("--out", default="plan.json", help="where to write the plan (default plan.json)")
    plan.add_argument("--cpu-devices", type=int, help="emulate this many CPU devices (sets XLA_FLAGS)")
    plan.add_argument("--topology", help="plan for described GPUs, KIND:HOSTSxGPUS (e.g. h100:128x8; kinds: "
                      f"{', '.join(sorted(GPUS))}): no device needed, the cluster runs the plan file")
    show = commands.add_parser("show", help="print the report of a saved plan")
    show.add_argument("path", help="a plan file written by `plan` or Plan.save")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "show":
            print(_refused_as_one_line(Plan.load, args.path).report())
            return 0
        return _plan(args)
    except UsageError as e:
        parser.error(str(e))  # exits with status 2
    except BrokenPipeError:  # `show plan.json | head`: the reader has what it wanted
        _quiet_stdout()
        return 0
    except (RhinoError, Refused, OSError) as e:  # a bad option, no plan, an unreadable file
        print(f"rhino_jax: error: {e}", file=sys.stderr)
        return 1


class Refused(Exception):
    """An option or a plan file rhino_jax refuses (a ValueError of its checks): said in one line,
    where an error raised in the user's own code keeps its traceback."""


def _refused_as_one_line(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except ValueError as e:
        raise Refused(str(e)) from None


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so Python's flush at exit does not fail on the closed pipe again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _plan(args: argparse.Namespace) -> int:
    _writable(args.out)
    if args.cpu_devices is not None and args.topology is not None:
        raise UsageError("--cpu-devices and --topology both give the devices to plan for; pass one")
    if args.cpu_devices is not None:
        _emulate_cpu_devices(args.cpu_devices)
    devices = jax.devices() if args.topology is None else _described(args.topology)
    donate = _ints(args.donate, "--donate") or ()
    options = dict(opt_level=args.opt, cluster=args.cluster, num_micro_batches=args.micro_batches,
                   pipeline=_pipeline(args.pipeline), schedule=args.schedule, solver_time_limit_s=args.time_limit,
                   donate_argnums=donate,
                   memory_limit_bytes=None if args.memory_limit_gib is None else int(args.memory_limit_gib * 2**30))
    shape = _mesh_shape(args.mesh)
    names = tuple(args.axes.split(",")) if args.axes else None
    if shape is None:
        options["axis_names"] = names
        if args.topology is not None:
            options["devices"] = devices
    else:
        names = names or DEFAULT_AXES[:len(shape)]
        if len(names) != len(shape):
            raise UsageError(f"--axes names {len(names)} axes ({','.join(names)}) but --mesh {args.mesh} has "
                             f"{len(shape)}; give one name per axis")
        need = math.prod(shape)
        if need > len(devices):
            hint = f"; pass --cpu-devices {need} to emulate them on the CPU" if devices[0].platform == "cpu" else ""
            where = f"--topology {args.topology} describes" if args.topology else "this machine has"
            raise UsageError(f"--mesh {args.mesh} needs {need} devices, {where} {len(devices)} "
                             f"({devices[0].platform}){hint}")
        options["mesh"] = device_mesh(shape, names, devices[:need])
    step, step_args = _load_step(args.target)
    where = f"mesh {args.mesh} ({','.join(names)})" if shape else "every mesh shape"
    kind = f"described {devices[0].device_kind}" if args.topology else devices[0].platform
    print(f"rhino_jax: planning {args.target} on {where} of {kind} devices", flush=True)
    parallelized = _refused_as_one_line(parallelize, step, **options)
    plan = parallelized.lower(*step_args).plan  # records its target: the program and mesh
    print(plan.report())
    plan.save(args.out)
    print(f"\nplan written to {args.out} ({os.path.getsize(args.out) / 1024:.0f} KiB)")
    return 0


def _writable(out: str) -> None:
    """Refuse an --out the plan file cannot be written to before the search, not after it."""
    try:
        check_writable(out)
    except OSError as e:
        raise UsageError(f"--out {out}: {e.strerror}; give the path of a file in a directory you may write") from None


def _described(text: str) -> list:
    """The devices of --topology KIND:HOSTSxGPUS."""
    kind, colon, size = text.partition(":")
    hosts, x, per_host = size.partition("x")
    if not colon or not x or not hosts.isdigit() or not per_host.isdigit() or int(hosts) < 1 or int(per_host) < 1:
        raise UsageError(f"--topology must be KIND:HOSTSxGPUS, e.g. h100:128x8 (128 hosts of 8 H100s); got {text!r}")
    if kind.lower() not in GPUS:
        raise UsageError(f"--topology {text}: unknown GPU kind {kind!r}; described GPUs are {', '.join(sorted(GPUS))}")
    jax.config.update("jax_platforms", "cpu")  # no GPU runtime needed: the devices are described
    try:
        return gpu_topology(kind, int(hosts), int(per_host))
    except GpuPluginError as e:  # what this machine lacks for the flag, and the pip install that gives it
        raise UsageError(f"--topology {text}: {e}") from None


def _emulate_cpu_devices(n: int) -> None:
    if n < 1:
        raise UsageError(f"--cpu-devices must be >= 1, got {n}")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(
        "--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
    jax.config.update("jax_platforms", "cpu")


def _mesh_shape(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    parts = text.split("x")
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise UsageError(f"--mesh must be positive sizes joined by x, e.g. 2x4 or 8; got {text!r}")
    return tuple(int(p) for p in parts)


def _ints(text: str | None, flag: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise UsageError(f"{flag} must be integers joined by commas, got {text!r}") from None


def _pipeline(text: str) -> str | int:
    if text in ("off", "auto"):
        return text
    if not text.isdigit():
        raise UsageError(f"--pipeline must be off, auto or a number of stages, got {text!r}")
    return int(text)


def _load_step(spec: str):
    """Import MODULE, call FUNCTION(), check it returned (step, args)."""
    module_name, colon, function_name = spec.rpartition(":")
    if not colon or not module_name or not function_name:
        raise UsageError(f"the step must be given as MODULE:FUNCTION (e.g. mymodel:setup), got {spec!r}")
    module = _import(module_name)
    function = getattr(module, function_name, None)
    if not callable(function):
        raise UsageError(f"{module_name} has no function {function_name!r}")
    made = function()
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[0]) and isinstance(made[1], (tuple, list))):
        raise UsageError(f"{spec}() must return (step, args): the train step and a tuple of its positional "
                         f"arguments; it returned {type(made).__name__}")
    return made[0], tuple(made[1])


def _import(name: str):
    if name.endswith(".py"):
        path = Path(name)
        if not path.is_file():
            raise UsageError(f"no file {name}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise UsageError(f"no module named {name!r} (looked in the current directory and PYTHONPATH); "
                             "run from the directory that holds it or give a file: path/to/module.py:FUNCTION") \
                from None
        raise
