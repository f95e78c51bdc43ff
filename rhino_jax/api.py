"""rj.parallelize: a single-device train step in, a step that runs on the mesh out.

`step.lower(*args)` imports the step, searches a plan (cached per argument shapes, like jit),
and returns a `Lowered`; `.compile()` rewrites the module with the plan and compiles it with
XLA's SPMD partitioner; calling `step(*args)` does both once per signature and runs it.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from rhino_jax.hlo_passes import rewrite as rewrite_pass
from rhino_jax.hlo_passes.graph import Graph
from rhino_jax.hlo_passes.hlo_stats import CollectiveStats, CompiledMemory, collective_stats, compiled_memory
from rhino_jax.hlo_passes.importer import import_module
from rhino_jax.hlo_passes.lowering import LoweredStep, lower_on_mesh
from rhino_jax.hlo_passes.module import copy_module
from rhino_jax.runtime.executable import compile_module
from rhino_jax.search.cluster import BACKENDS, MeshTopology, get_cluster

from .errors import MeshError
from .mesh_search import plan_on, search_meshes
from .controller import choose
from .micro_batched import MicroBatchedLowered
from .multiprocess import agree
from .pipelined import PipelinedLowered
from .options import Options
from .plan import Plan
from .plan_target import PlanTarget


def _signature(args) -> tuple:
    leaves, tree = jax.tree.flatten_with_path(args)
    for path, x in leaves:
        if not isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, int, float, complex, bool)):
            raise TypeError(f"argument arg{jax.tree_util.keystr(path)} is a {type(x).__name__}, not an array: a "
                            "parallelized step takes arrays and numbers; close over other values (functools.partial)")
    return jax.tree.structure(args), tuple((tuple(np.shape(x)), str(jax.numpy.result_type(x))) for _, x in leaves)


class Compiled:
    """The step compiled for the mesh; call it like the function (same pytrees)."""

    def __init__(self, lowered: "Lowered", executable: jax.stages.Compiled):
        self._lowered = lowered
        self._executable = executable
        self.plan = lowered.plan

    @property
    def input_shardings(self):
        """The compiled program's argument shardings (the user's pytree structure)."""
        return self._executable.input_shardings[0]

    @property
    def output_shardings(self):
        return self._executable.output_shardings

    def as_text(self) -> str:
        return self._executable.as_text()

    def memory_analysis(self):
        """XLA's memory analysis of the compiled program, as `jax.stages.Compiled` gives it."""
        return self._executable.memory_analysis()

    def cost_analysis(self):
        """XLA's cost analysis (FLOPs, bytes accessed) of the compiled program, as jax gives it."""
        return self._executable.cost_analysis()

    @functools.cached_property
    def collectives(self) -> CollectiveStats:
        return collective_stats(self.as_text())

    @functools.cached_property
    def memory(self) -> CompiledMemory:
        return compiled_memory(self._executable)

    def __call__(self, *args):
        tree, avals = _signature(args)
        if (tree, avals) != self._lowered._signature:
            want_tree, want = self._lowered._signature
            raise TypeError(
                "function compiled for arguments of structure/shapes\n"
                f"  {want_tree} {list(want)}\ncalled with\n  {tree} {list(avals)}")
        args = jax.device_put(args, self.plan.input_shardings)
        return self._executable(*args)

    def report(self) -> str:
        """The plan's report, then its predicted communication beside the compiled HLO's (the
        prediction combined as this platform's XLA combines collectives)."""
        platform = self._lowered.mesh.devices.flat[0].platform
        backend = platform if platform in BACKENDS else self.plan.backend
        predicted = self.plan.collective_summary(backend)
        compiled = self.collectives.by_kind()
        lines = [self.plan.report(), "", f"communication: predicted (as XLA's {backend} backend combines it) "
                 "vs compiled HLO (per device)",
                 f"  {'collective':<20} {'pred ops':>9} {'pred MiB':>10} {'HLO ops':>9} {'HLO MiB':>10}"]
        for kind in compiled:
            pn, pb = predicted.get(kind, (0, 0))
            cn, cb = compiled[kind]
            if pn or cn:
                lines.append(f"  {kind:<20} {pn:>9} {pb / 2**20:>10.3f} {cn:>9} {cb / 2**20:>10.3f}")
        mem = self.memory
        lines.append(f"memory: predicted {self.plan.cost.memory_bytes / 2**20:.2f} MiB, compiled "
                     f"{mem.total / 2**20:.2f} MiB per device (arguments {mem.argument_bytes / 2**20:.2f}, outputs "
                     f"{mem.output_bytes / 2**20:.2f}, temporaries {mem.temp_bytes / 2**20:.2f}, donated "
                     f"{mem.alias_bytes / 2**20:.2f} counted once)")
        return "\n".join(lines)


@dataclass
class Lowered:
    """A step lowered and planned for one argument signature."""

    plan: Plan
    graph: Graph
    mesh: Mesh
    _step: LoweredStep
    _signature: tuple
    _compiled: Compiled | None = None

    def as_text(self) -> str:
        """The StableHLO the search read (inlined, before the plan's shardings)."""
        return str(self._step.module)

    def compile(self) -> Compiled:
        if self._compiled is None:
            module = rewrite_pass.rewrite(copy_module(self._step.module), self.graph, self.plan.value_specs,
                                          self.plan.read_specs, self.plan.read_paths, self.plan.arg_specs,
                                          self.plan.output_specs,
                                          self.plan.mesh_axes)
            ins = jax.tree.leaves(self.plan.input_shardings)
            outs = jax.tree.leaves(self.plan.output_shardings)
            executable = compile_module(self._step.lowered, module, ins, outs)
            self._compiled = Compiled(self, executable)
        return self._compiled


class Parallelized:
    """What `rj.parallelize` returns: call it, or `.lower(*args)` for the plan."""

    def __init__(self, fn: Callable, mesh: Mesh | None, options: Options, donate_argnums: tuple[int, ...],
                 devices: Sequence | None = None, plan: Plan | None = None):
        self._fn = fn
        self.mesh = mesh  # None: each lowering picks its mesh shape (then see `Lowered.mesh`)
        self.devices = devices  # with mesh=None: the devices to build meshes of (None: jax.devices())
        self.options = options
        self.donate_argnums = donate_argnums
        self.given_plan = plan  # a saved plan to run instead of searching (`parallelize(plan=...)`)
        self._cache: dict = {}
        functools.update_wrapper(self, getattr(fn, "_fun", fn))

    def lower(self, *args) -> Lowered:
        key = _signature(args)
        if key not in self._cache:
            if self.options.pipeline == "auto":
                lowered = choose(self, args, key)
            else:
                lowered = self.lower_with(self.options, args, key)
            agree(lowered.plan)  # the processes of a distributed job must compile one plan
            self._cache[key] = lowered
        return self._cache[key]

    def lower_with(self, options: Options, args, key):
        """The step lowered and planned under `options` (one candidate of `pipeline="auto"`)."""
        pipelined = options.pipeline not in ("off", 1)
        if options.num_micro_batches > 1 or pipelined:
            if self.mesh is None:
                raise MeshError("num_micro_batches > 1 and pipeline need a mesh: pass mesh=rj.device_mesh(...)")
            kind = PipelinedLowered if pipelined else MicroBatchedLowered
            return kind(self._fn, args, self.mesh, self.donate_argnums, options, key)
        if self.mesh is None:
            mesh, step, graph, plan = search_meshes(self._fn, args, self.donate_argnums, self.devices, options)
        else:
            mesh = self.mesh
            step = lower_on_mesh(self._fn, args, mesh, self.donate_argnums)
            graph = import_module(step.module, step.arg_paths, step.arg_roles, step.output_paths)
            if self.given_plan is not None:  # a saved plan: no search, once it is shown to fit
                self.given_plan.check_matches(PlanTarget.of(step, mesh))
                plan = self.given_plan
            else:
                cluster = get_cluster(options.cluster)
                plan = plan_on(graph, MeshTopology.from_mesh(mesh, cluster), cluster, options)
        tree = jax.tree.structure(args)
        out_tree = step.lowered.out_tree
        named = lambda specs: [NamedSharding(mesh, s.to_partition_spec()) for s in specs]  # noqa: E731
        plan = dataclasses.replace(plan, input_shardings=jax.tree.unflatten(tree, named(plan.arg_specs)),
                                   output_shardings=jax.tree.unflatten(out_tree, named(plan.output_specs)),
                                   target=PlanTarget.of(step, mesh))
        return Lowered(plan, graph, mesh, step, key)

    def __call__(self, *args, **kwargs):
        if kwargs:
            raise TypeError("a parallelized step takes positional arguments only; "
                            f"pass {sorted(kwargs)} positionally")
        return self.lower(*args).compile()(*args)


def parallelize(fn: Callable | None = None, *, mesh: Mesh | None = None, devices: Sequence | None = None,
                opt_level: str = "O2", memory_limit_bytes: int | None = None, cluster=None,
                num_micro_batches: int = 1, pipeline: str | int = "off", schedule: str = "1f1b",
                donate_argnums: int | Sequence[int] | None = None, solver: str = "HIGHS",
                solver_time_limit_s: float = 60.0, axis_names: Sequence[str] | None = None,
                search_workers: int | None = None, strided_specs: bool = True, plan: "Plan | str | None" = None):
    """Parallelize a train step over `mesh`. Usable as `parallelize(fn, mesh=...)` or as a
    decorator `@parallelize(mesh=...)`; `fn` may already be `jax.jit`-ed (its donation is kept).

    `mesh=None` searches over mesh shapes of `devices` (default: all): every 1-, 2- and 3-axis
    shape whose inner axes stay inside one host (`cluster.devices_per_host`), axes of size >= 2,
    a k-axis mesh named by the first k of `axis_names` (default ("data", "model", "extra"); give
    fewer names for fewer axes). The step is planned on each and the least predicted step time
    wins: `lowered.mesh` is the chosen mesh, `lowered.plan.mesh_candidates` (and the report) list
    every candidate, best first. A candidate whose axes a pin (`rj.annotate`) does not find is
    infeasible. `search_workers`: processes searching candidates in parallel ('spawn'; None:
    only when the first search is slow enough to pay for them; 0: in this process). Progress
    is logged to the `rhino_jax` logger at INFO. `strided_specs=False` restricts the search to
    maximum strides (each device holds one block per split dim), as most systems do.

    `plan`: a saved plan (`Plan.load(path)`, or the path) to run without a search; it must have
    been made for this step and mesh (`Plan.check_matches`: PlanTargetError otherwise). SPMD
    plans on a given mesh only: with `mesh=None`, micro-batches or pipelines, plan again."""
    options = Options(opt_level, memory_limit_bytes, cluster, num_micro_batches, pipeline, schedule,
                      solver, solver_time_limit_s, axis_names, search_workers, strided_specs)
    if mesh is not None and not isinstance(mesh, Mesh):
        raise MeshError(f"mesh must be a jax.sharding.Mesh, e.g. rj.device_mesh((2, 4), ('data', 'model')); "
                        f"got {mesh!r}")
    if mesh is None:
        if devices is not None:
            devices = list(devices)
            if not devices or len({d.id for d in devices}) != len(devices):
                raise MeshError("devices must be a non-empty list of distinct devices, e.g. jax.devices()[:4]")
    else:
        if axis_names is not None:
            raise MeshError("axis_names names the axes of enumerated meshes (mesh=None); with a given mesh, "
                            "name its axes in rj.device_mesh(shape, axis_names)")
        if devices is not None and set(d.id for d in devices) != set(d.id for d in mesh.devices.flat):
            raise MeshError("devices and mesh disagree: pass one of them")
    if mesh is not None and any(t != jax.sharding.AxisType.Auto for t in mesh.axis_types):
        raise MeshError("the mesh has Explicit/Manual axes, which reject added shardings; build it with "
                        "rj.device_mesh(...) or jax.sharding.Mesh(..., axis_types=(AxisType.Auto, ...))")

    if plan is not None:
        if isinstance(plan, (str, os.PathLike)):
            plan = Plan.load(plan)
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a rhino_jax.Plan or the path of a saved one, got {type(plan).__name__}")
        if mesh is None or num_micro_batches > 1 or pipeline not in ("off", 1):
            raise ValueError("plan= runs a saved SPMD plan on a given mesh: pass mesh=rj.device_mesh(...) as it was "
                             "planned, without num_micro_batches or pipeline (those plans are searched again)")

    def wrap(f: Callable) -> Parallelized:
        donate = donate_argnums
        if donate is None:
            info = getattr(f, "_jit_info", None)
            donate = getattr(info, "donate_argnums", ()) or ()
        donate = (donate,) if isinstance(donate, int) else tuple(donate)
        return Parallelized(f, mesh, options, donate, devices, plan)

    return wrap if fn is None else wrap(fn)
