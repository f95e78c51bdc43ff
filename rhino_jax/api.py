"""rj.parallelize: a single-device train step in, a step that runs on the mesh out.

`step.lower(*args, **kwargs)` imports the step, searches a plan (cached per argument shapes and
static values, like jit), and returns a `Lowered`; `.compile()` rewrites the module with the plan
and compiles it with XLA's SPMD partitioner; calling `step(*args, **kwargs)` does both once per
signature and runs it. A call whose structure, avals and static values were seen before goes
straight to the compiled program, putting only arrays not yet in its layouts. A step given no
mesh and no devices plans for the mesh `jax.set_mesh` has in effect when it is lowered or called,
as jax.jit reads it when tracing (one plan cache per mesh); with none set, it searches mesh shapes.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from rhino_jax.hlo_passes.lowering import import_step, lower_on_mesh, step_target
from rhino_jax.search import progress as search_progress
from rhino_jax.search.gc_pause import few_full_collections
from rhino_jax.search.cost.cluster import MeshTopology, get_cluster
from rhino_jax.search.cost.gemm_workspace import with_gemm_workspaces
from rhino_jax.search.space.constraints import CoShard, OpAssign, check_matched, check_parts
from rhino_jax.core.plan import Plan

from .arguments import ArgSpec, Call, call_tree, donated_leaves
from .compiled_choice import fastest_compiled
from .constraints import OpOrder
from .errors import ConstraintError, MeshError, TracedCallWarning
from .explain import SearchInputs
from .gpu_topology import described_mesh, refuse_described
from .mesh import auto_axes, context_mesh
from . import coshard_search
from .mesh_search import search_meshes
from .controller import choose
from .micro_batched import MicroBatchedLowered
from .multiprocess import agree
from .pipelined import PipelinedLowered
from .one_program import Lowered
from .options import Options, device_memory, naming_the_closest


_ARRAYS = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, int, float, complex, bool)


def _signature(call: Call) -> tuple:
    """The plan cache's key of a call: its dynamic arguments' structure, shapes and dtypes, and its
    static values. A dynamic argument that is no array is a TypeError naming it."""
    tops = [(f"arg[{p}]", f"static_argnums=({p},)", a) for p, a in zip(call.positions, call.args)]
    tops += [(f"arg[{k!r}]", f"static_argnames=({k!r},)", v) for k, v in call.kwargs.items()]
    for label, option, value in tops:
        for path, x in jax.tree_util.tree_flatten_with_path(value)[0]:
            if not isinstance(x, _ARRAYS):
                raise TypeError(f"argument {label}{jax.tree_util.keystr(path)} is a {type(x).__name__}, not an array: "
                                "a parallelized step traces its arguments as arrays, as jax.jit does; pass "
                                f"{option} to rj.parallelize to make {label} a static Python value (hashed into the "
                                "plan cache), or close over it (functools.partial)")
    leaves, tree = jax.tree.flatten((call.args, call.kwargs))
    return tree, call.static, tuple((tuple(np.shape(x)), str(jax.numpy.result_type(x))) for x in leaves)


def _leaf_key(x):
    """A leaf's part of the fast cache key: a jax.Array's aval (shape, dtype, weak type; hashed by
    jax once), else its type, shape and dtype (a number's type is its dtype)."""
    aval = getattr(x, "aval", None)
    return aval if aval is not None else (type(x), np.shape(x), getattr(x, "dtype", None))


class Parallelized:
    """What `rj.parallelize` returns: call it like a jitted function, or `.lower(...)` for the plan."""

    def __init__(self, fn: Callable, mesh: Mesh | None, options: Options, arguments: ArgSpec,
                 devices: Sequence | None = None, plan: Plan | None = None):
        self._fn = fn
        # The mesh the plan names in its shardings (the user's, Explicit axes or Auto), and its
        # Auto twin that the step is lowered, searched and compiled on (`auto_axes`).
        self.user_mesh = mesh
        self.mesh = None if mesh is None else auto_axes(mesh)  # None: each lowering picks its mesh shape
        self.devices = devices  # with mesh=None: the devices to build meshes of (None: jax.devices())
        self.options = options
        self.arguments = arguments  # static and donated arguments
        self.given_plan = plan  # a saved plan to run instead of searching (`parallelize(plan=...)`)
        # `_signature` → Lowered; a plan Ctrl-C cut short stays too (marked interrupted), until
        # `clear_cache`: a call of those shapes should not stop for another long search unasked
        self._cache: dict = {}
        self._said_traced = False  # warned of a call inside a jax transformation (`_traced`)
        self._hits: dict = {}  # (structure, static values, leaf avals) → compiled: the call's fast path
        self._on_meshes: dict = {}  # jax.set_mesh's mesh → this step planned on it (`_in_context`)
        functools.update_wrapper(self, getattr(fn, "_fun", fn))

    @property
    def donate_argnums(self) -> tuple[int, ...]:
        return self.arguments.donate_argnums

    def clear_cache(self) -> None:
        """Forget every plan and compiled program, as `jax.jit(f).clear_cache()` does: the next
        call or `lower` searches again (after a Ctrl-C cut a search short, for the full search)."""
        self._cache.clear()
        self._hits.clear()
        self._on_meshes.clear()

    def _in_context(self) -> "Parallelized":
        """The step to lower or call now: given no mesh and no devices, the one planned on the mesh
        `jax.set_mesh` has in effect, as jax.jit reads it when tracing (kept per mesh, each with its
        own plans); else, or with no mesh set, this one."""
        if self.user_mesh is not None or self.devices is not None:
            return self
        mesh = context_mesh()
        if mesh is None:
            return self
        if mesh not in self._on_meshes:
            self._on_meshes[mesh] = Parallelized(self._fn, mesh, self.options, self.arguments)
        return self._on_meshes[mesh]

    def lower(self, *args, **kwargs) -> Lowered:
        """The step lowered and planned for these arguments (the search runs here; cached per
        shapes, dtypes, structure and static values, as jax.jit caches, and per `jax.set_mesh`
        mesh when `parallelize` was given none)."""
        here = self._in_context()
        if here is not self:
            return here.lower(*args, **kwargs)
        call = self.arguments.call(self._fn, args, kwargs)
        key = _signature(call)
        lowered = self._cache.get(key)
        if lowered is None:
            check_parts(self.options.constraints, len(self.devices or jax.devices()) if self.mesh is None
                        else self.mesh.size)
            with search_progress.shown(search_progress.enabled(self.options.progress)), few_full_collections():
                if self.options.pipeline == "auto":
                    lowered = choose(self, call, key)
                else:
                    lowered = self.lower_with(self.options, call, key)
            agree(lowered.plan)  # the processes of a distributed job must compile one plan
            self._cache[key] = lowered
        return lowered

    def lower_with(self, options: Options, call: Call, key):
        """The step lowered and planned under `options` (one candidate of `pipeline="auto"`)."""
        pipelined = options.pipeline not in ("off", 1)
        staged = [c for c in options.constraints if isinstance(c, (OpAssign, OpOrder))]
        if staged and not pipelined:  # with pipeline="auto", its SPMD candidate is infeasible
            least = max([2] + [c.stage + 1 for c in staged if isinstance(c, OpAssign) and c.stage != "all"])
            raise ConstraintError(f"{staged[0]} is about pipeline stages, and this plan has none: pass "
                                  f"pipeline={least} (or 'auto') with num_micro_batches")
        coshards = [c for c in options.constraints if isinstance(c, CoShard)]
        if coshards and (options.num_micro_batches > 1 or pipelined or self.mesh is None):
            raise ConstraintError(f"{coshards[0]} runs on one SPMD program over a given mesh: with pipelines, "
                                  "micro-batches or mesh=None it is not built yet; pass mesh= and leave pipeline and "
                                  "num_micro_batches at their defaults")
        if options.num_micro_batches > 1 or pipelined:
            if self.mesh is None:
                raise MeshError("num_micro_batches > 1 and pipeline need a mesh: pass mesh=rj.device_mesh(...)")
            kind = PipelinedLowered if pipelined else MicroBatchedLowered
            return kind(call, self.mesh, options, key, self.given_plan, self.user_mesh)
        if self.mesh is None:
            mesh, step, graph, plan = search_meshes(call, self.devices, options)
        else:
            mesh = self.mesh
            step = lower_on_mesh(call.fn, call.args, mesh, call.donate_argnums, call.kwargs, call.donate_argnames,
                                 call.positions)
            graph = import_step(step)
            if self.given_plan is not None:  # a saved plan: no search, once it is shown to fit
                step, graph = coshard_search.replay(step, graph, self.given_plan, options.constraints)
                self.given_plan.check_matches(step_target(step, mesh, donated_leaves(call)))
                plan = self.given_plan
            else:
                check_matched(options.constraints, graph)
                cluster = get_cluster(options.cluster, list(mesh.devices.flat))
                step, graph, plan = coshard_search.plan_with_coshards(step, graph, mesh, cluster, options)
        tree = jax.tree.structure((call.args, call.kwargs))
        out_tree = step.lowered.out_tree
        named_on = self.user_mesh if mesh is self.mesh and self.user_mesh is not None else mesh
        named = lambda specs: [NamedSharding(named_on, s.to_partition_spec()) for s in specs]  # noqa: E731
        target = step_target(step, mesh, donated_leaves(call))
        # explain searches again later, under the limit, not in this step's share
        inputs = SearchInputs(graph, mesh, dataclasses.replace(options, search_until=None))
        limit, cluster = device_memory(options, mesh.devices.flat), get_cluster(options.cluster, list(mesh.devices.flat))
        return fastest_compiled([
            Lowered(dataclasses.replace(p, input_shardings=call_tree(tree, named(p.arg_specs)),
                                        output_shardings=jax.tree.unflatten(out_tree, named(p.output_specs)),
                                        target=target, search_inputs=inputs, alternatives=()),
                    graph, mesh, step, key, limit, cluster)
            for p in (plan, *plan.alternatives)],
            finish=lambda p: with_gemm_workspaces(p, graph, MeshTopology.from_mesh(mesh, cluster), mesh.devices.flat[0]))

    def __call__(self, *args, **kwargs):
        dyn_args, dyn_kwargs, static = self.arguments.split(args, kwargs)
        leaves, tree = jax.tree.flatten((dyn_args, dyn_kwargs))
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            return self._traced(args, kwargs)
        here = self._in_context()
        key = (tree, static, *map(_leaf_key, leaves))
        compiled = here._hits.get(key)
        if compiled is None:
            refuse_described(here.mesh if here.mesh is not None else here.devices)  # before a search for nothing
            compiled = here._hits[key] = here.lower(*args, **kwargs).compile()
        return compiled._dispatch(dyn_args, dyn_kwargs, leaves)

    def _traced(self, args, kwargs):
        """Inside jax.jit, grad, vmap or eval_shape the step's arguments are tracers and the outer
        transformation compiles what it traces: the step as written (one device's numbers; its
        pins are not applied, as outside `parallelize`). The plan needs the call outside them."""
        if not self._said_traced:
            self._said_traced = True
            warnings.warn("a parallelized step called inside a jax transformation (jax.jit, jax.grad, jax.vmap, "
                          "jax.eval_shape) is traced as written and compiled by that transformation, without "
                          "rhino_jax's plan; call it outside them to run the plan (shapes and numbers are the "
                          "same either way)", TracedCallWarning, stacklevel=3)
        return self._fn(*args, **kwargs)


@naming_the_closest
def parallelize(fn: Callable | None = None, *, mesh: Mesh | AbstractMesh | None = None,
                devices: Sequence | None = None,
                opt_level: str = "O2", memory_limit_bytes: int | None = None, cluster=None,
                num_micro_batches: int = 1, pipeline: str | int = "off", schedule: str | None = None,
                accumulation_dtype: str | None = "float32",
                donate_argnums: int | Sequence[int] | None = None,
                static_argnums: int | Sequence[int] | None = None,
                static_argnames: str | Sequence[str] | None = None, solver: str = "HIGHS",
                solver_time_limit_s: float = 60.0, axis_names: Sequence[str] | None = None,
                search_workers: int | None = None, strided_specs: bool = True, plan: "Plan | str | None" = None,
                progress: bool = True, constraints: Sequence | None = None):
    """Parallelize a train step over `mesh`. Usable as `parallelize(fn, mesh=...)` or as a
    decorator `@parallelize(mesh=...)`; `fn` may already be `jax.jit`-ed (its donation and static
    arguments are kept).

    `static_argnums`/`static_argnames` as in `jax.jit`: those arguments are Python values (hashable;
    a new value plans and compiles again), the rest arrays; the step takes keyword arguments.

    `mesh`: a `jax.sharding.Mesh` of Auto or Explicit axes (`jax.make_mesh`, `rj.device_mesh`);
    `None` takes the mesh of `jax.set_mesh` when one is set (and `devices` is not given). The plan's
    shardings name the given mesh, so results can go on into the user's own jitted code. An
    `AbstractMesh` (sizes and axis names, no devices) with a `cluster` of a described GPU kind
    ('8x-h100', '8x-h200', '8x-a100'): planned for described GPUs of that kind in a mesh of its
    shape (`rj.gpu_topology`, jax's CUDA plugin), on any machine; save the plan and run it on the
    cluster (`plan=`).

    `mesh=None` (no mesh set) searches over mesh shapes of `devices` (default: all): every 1-, 2- and 3-axis
    shape whose inner axes stay inside one host (`cluster.devices_per_host`), axes of size >= 2,
    a k-axis mesh named by the first k of `axis_names` (default ("data", "model", "extra"); give
    fewer names for fewer axes). The step is planned on each and the least predicted step time
    wins: `lowered.mesh` is the chosen mesh, `lowered.plan.mesh_candidates` (and the report) list
    every candidate, best first. A candidate whose axes a pin (`rj.annotate`) does not find is
    infeasible. `search_workers`: processes searching candidates in parallel ('spawn'; None:
    only when the first search is slow enough to pay for them; 0: in this process). Progress
    is logged to the `rhino_jax` logger at INFO. `strided_specs=False` restricts the search to
    maximum strides (each device holds one block per split dim), as most systems do.
    `progress`: a search longer than a few seconds shows a one-line progress display on stderr
    (elapsed, what it does, the best predicted step so far); False or RHINO_JAX_PROGRESS=0: none.
    `constraints`: nnScaler's primitives, a list of `rj.op_trans(...)` (what the named ops and
    arguments may be split along, into how many parts, or not at all), `rj.op_assign(...)` (the
    pipeline stage of the named forward ops), `rj.op_order(...)` (the pipeline's schedule as
    ordering pairs of tasks) and `rj.coshard(...)` (the named ops run in chunks one after
    another, for memory); one that names nothing, has a dim past the result of all it names or a
    number of parts no split of the devices makes, leaves an op no strategy, asks for stages of
    an SPMD plan or chunks no dim of the named ops divides is a `ConstraintError`.

    `accumulation_dtype`: with micro-batches, the dtype their parts of a bf16 or f16 sum (a
    gradient) are added up in: "float32" (the default; the running sums' memory is priced so) or
    None, the sum's own dtype (half the memory, k roundings where the whole batch rounds once).

    `schedule`: a pipeline's ("1f1b", the default, "gpipe" or "eager-1f1b"); given without a
    pipeline (`pipeline="off"` or 1), it would order nothing, and is a ValueError.

    `plan`: a saved plan (`Plan.load(path)`, or the path) to run without a search; it must have
    been made for this step and mesh (`Plan.check_matches`: PlanTargetError otherwise), and is
    given with the mesh, micro-batches, stages and schedule it was made for."""
    options = Options(opt_level, memory_limit_bytes, cluster, num_micro_batches, pipeline, accumulation_dtype,
                      "1f1b" if schedule is None else schedule, solver, solver_time_limit_s, axis_names,
                      search_workers, strided_specs, progress, () if constraints is None else constraints)
    if schedule is not None and options.pipeline in ("off", 1):
        raise ValueError(f"schedule={schedule!r} orders the tasks of pipeline stages, and pipeline="
                         f"{options.pipeline!r} makes none: pass pipeline=N (N >= 2 stages, with num_micro_batches "
                         ">= 2) or pipeline='auto', or drop schedule")
    if mesh is None and devices is None:
        mesh = context_mesh()  # jax.set_mesh's, as jax.jit takes it
    if isinstance(mesh, AbstractMesh):
        mesh = described_mesh(mesh, cluster)
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
    if mesh is not None:
        auto_axes(mesh)  # refuses Manual axes

    if plan is not None:
        if isinstance(plan, (str, os.PathLike)):
            plan = Plan.load(plan)
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a rhino_jax.Plan or the path of a saved one, got {type(plan).__name__}")
        _runs_as_planned(plan, mesh, options)

    def wrap(f: Callable) -> Parallelized:
        arguments = ArgSpec.of(f, static_argnums, static_argnames, donate_argnums)
        return Parallelized(f, mesh, options, arguments, devices, plan)

    return wrap if fn is None else wrap(fn)


def _runs_as_planned(plan: Plan, mesh: Mesh | None, options: Options) -> None:
    """A saved plan runs on a mesh, with the micro-batches, stages and schedule it was made for:
    otherwise a ValueError says what to pass."""
    e = plan.execution
    planned = {"num_micro_batches": e.micro_batches, "pipeline": e.pipeline if e.pipeline > 1 else "off"}
    given = {"num_micro_batches": options.num_micro_batches,
             "pipeline": "off" if options.pipeline == 1 else options.pipeline}
    if e.pipeline > 1:
        ordered = any(isinstance(c, OpOrder) for c in options.constraints)
        planned["schedule"], given["schedule"] = e.schedule, "op_order" if ordered else options.schedule
    if mesh is None or given != planned:
        where = plan.target and f"rj.device_mesh({plan.target.mesh_shape}, {plan.target.axis_names})"
        def said(k: str, v) -> str:  # an op_order schedule comes from its constraint, not the option
            return "constraints=[rj.op_order(...)]" if (k, v) == ("schedule", "op_order") else f"{k}={v!r}"
        wanted = ", ".join([f"mesh={where or 'rj.device_mesh(...)'}"] + [said(k, v) for k, v in planned.items()])
        got = ([] if mesh is not None else ["mesh=None"]) + [said(k, v) for k, v in given.items() if planned[k] != v]
        raise ValueError(f"plan= runs a saved plan as it was made: pass {wanted} (got {', '.join(got)})")
