"""A step planned and compiled as one SPMD program: `Lowered` and `Compiled`, the
`jax.stages` surfaces `parallelize` returns for it (the module rewritten with the plan's
shardings, compiled by XLA's SPMD partitioner within the memory limit, its collectives and
memory read back beside the plan's prediction)."""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import jax
import numpy as np
from jax.extend.mlir import ir
from jax.sharding import Mesh, PartitionSpec

from rhino_jax.core.plan import Plan
from rhino_jax.core.plan_file import spec_problem
from rhino_jax.core.specs import ShardingSpec
from rhino_jax.hlo_passes import rewrite as rewrite_pass
from rhino_jax.hlo_passes.graph import Graph
from rhino_jax.hlo_passes.lowering import LoweredStep
from rhino_jax.hlo_passes.module import copy_module
from rhino_jax.runtime.compiled.collectives import CollectiveStats, collective_stats
from rhino_jax.runtime.compiled.compiled_cost import xla_cost_analysis
from rhino_jax.runtime.compiled.memory import CompiledMemory, compiled_memory
from rhino_jax.runtime.executable import Weights, compile_module
from rhino_jax.search.cost.cluster import BACKENDS, Cluster

from .errors import LayoutError
from .gpu_topology import refuse_described
from .host_callbacks import refuse_deadlocking
from .stages_facade import CompiledTrees


def _refuse_unlaid(plan: Plan, step: LoweredStep) -> None:
    """A LayoutError naming the first argument or result whose sharding jax cannot lay out on the
    array the user passes or gets (its own shape: a typed PRNG key's, not its key data's), said
    before XLA's compile, where jax would fail with an IndexError or an error naming no tensor."""
    sides = [(plan.arg_paths, jax.tree.leaves(step.lowered.in_avals), jax.tree.leaves(plan.input_shardings)),
             (plan.output_paths, jax.tree.leaves(step.lowered.out_info), jax.tree.leaves(plan.output_shardings))]
    for paths, avals, shardings in sides:
        for path, aval, sharding in zip(paths, avals, shardings):
            why = spec_problem(_as_spec(sharding.spec, len(aval.shape)), dict(sharding.mesh.shape), aval.shape)
            if why:
                keep = (f"pass constraints=[rj.op_trans({path!r}, replicate=True)]" if path.startswith("arg")
                        else "pin it in the step where it is returned, rj.annotate(x, P())")
                raise LayoutError(f"the plan lays out {path} ({aval.dtype}{list(aval.shape)}) as "
                                  f"P{tuple(sharding.spec)}, which jax cannot make: the spec {why}. To keep it "
                                  f"whole, {keep}")


def _as_spec(spec: PartitionSpec, rank: int) -> ShardingSpec:
    """A PartitionSpec as the plan's spec of an array of `rank` dims (the dims it leaves out not
    split); one of more entries than dims keeps them all, for `spec_problem` to refuse."""
    dims = tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec)
    return ShardingSpec(dims + ((),) * (rank - len(dims)))


class Compiled(CompiledTrees):
    """The step compiled for the mesh; call it like `jax.stages.Compiled`: with the dynamic
    arguments only (static ones were fixed when lowering)."""

    def __init__(self, lowered: "Lowered", executable: jax.stages.Compiled):
        self._lowered = lowered
        self._executable = self._trees_from = executable
        self.plan = lowered.plan
        self._in = tuple(jax.tree.leaves(executable.input_shardings))
        self._checked = False  # host_callbacks.refuse_deadlocking, once, at the first call

    @property
    def input_shardings(self):
        """The compiled program's argument shardings, as jax gives them: ((args...), {kwargs})."""
        return self._executable.input_shardings

    @property
    def output_shardings(self):
        """The compiled program's result shardings, in the structure of the step's result."""
        return self._executable.output_shardings

    @property
    def args_info(self):
        return self._executable.args_info

    def as_text(self) -> str:
        """The post-partitioning HLO text."""
        return self._executable.as_text()

    def memory_analysis(self):
        """XLA's memory analysis of the compiled program, as `jax.stages.Compiled` gives it."""
        return self._executable.memory_analysis()

    def cost_analysis(self):
        """XLA's cost analysis (FLOPs, bytes accessed) of the compiled program, as jax gives it; for
        described GPUs (`rj.gpu_topology`), for which jax gives None, XLA's generic analysis of the
        compiled HLO (`compiled_cost.xla_cost_analysis`)."""
        analysis = self._executable.cost_analysis()
        return analysis if analysis is not None else xla_cost_analysis(self._executable)

    @functools.cached_property
    def collectives(self) -> CollectiveStats:
        return collective_stats(self.as_text())

    @functools.cached_property
    def memory(self) -> CompiledMemory:
        return compiled_memory(self._executable)

    def __call__(self, *args, **kwargs):
        refuse_described(self._lowered.mesh)
        leaves, tree = jax.tree.flatten((args, kwargs))
        avals = tuple((tuple(np.shape(x)), str(jax.numpy.result_type(x))) for x in leaves)
        want_tree, _, want = self._lowered._signature
        if (tree, avals) != (want_tree, want):
            raise TypeError(
                "function compiled for arguments of structure/shapes\n"
                f"  {want_tree} {list(want)}\ncalled with\n  {tree} {list(avals)}")
        return self._dispatch(args, kwargs, leaves)

    def _dispatch(self, args: tuple, kwargs: dict, leaves: list):
        """Run the executable on a call's dynamic arguments (`leaves`: flattened; their shapes
        already checked): the arrays not yet in the program's layouts are put there, in one
        device_put; when all are, the call goes straight to the executable."""
        if not self._checked:
            refuse_deadlocking(self._lowered.graph, self._lowered.mesh)
            self._checked = True
        shardings = self._in
        moved = [i for i, (x, s) in enumerate(zip(leaves, shardings)) if getattr(x, "sharding", None) != s]
        if moved:
            put = jax.device_put([leaves[i] for i in moved], [shardings[i] for i in moved])
            leaves = list(leaves)
            for i, x in zip(moved, put):
                leaves[i] = x
            args, kwargs = jax.tree.unflatten(self._executable.in_tree, leaves)
        return self._executable(*args, **kwargs)

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
    """A step lowered and planned for one argument signature; like `jax.stages.Lowered`."""

    plan: Plan
    graph: Graph
    mesh: Mesh
    _step: LoweredStep
    _signature: tuple
    # The bytes a device may hold (`options.device_memory`): a GPU compile past it is compiled
    # again with remedies, priced on the cluster (`runtime.executable.compile_module`).
    memory_limit_bytes: int
    cluster: Cluster | None = None
    _compiled: Compiled | None = None
    # What compiling `_compiled` warned of, before `compile()` was called (it was compiled to be
    # weighed against other plans, `compiled_choice`): said at the first `compile()`.
    _said: tuple = ()

    def as_text(self, dialect: str | None = None) -> str:
        """The StableHLO the search read (inlined, before the plan's shardings); dialect="hlo":
        jax's HLO text of the same step (arguments replicated)."""
        if dialect in (None, "stablehlo"):
            return str(self._step.module)
        if dialect == "hlo":
            return self._step.lowered.as_text("hlo")
        raise ValueError(f"dialect must be 'stablehlo' or 'hlo', got {dialect!r}")

    def cost_analysis(self):
        """XLA's cost analysis of the step before partitioning, as `jax.stages.Lowered` gives it."""
        return self._step.lowered.cost_analysis()

    @property
    def in_tree(self):
        """The structure of the dynamic arguments, ((args...), {kwargs}), as jax gives it."""
        return self._step.lowered.in_tree

    @property
    def out_tree(self):
        return self._step.lowered.out_tree

    @property
    def out_info(self):
        """The result's shapes, dtypes and the plan's shardings (ShapeDtypeStructs in the
        result's structure)."""
        return jax.tree.map(lambda i, s: jax.ShapeDtypeStruct(i.shape, i.dtype, sharding=s),
                            self._step.lowered.out_info, self.plan.output_shardings)

    @property
    def args_info(self):
        return self._step.lowered.args_info

    def _rewritten(self) -> ir.Module:
        """The step's module with the plan's shardings, for XLA's partitioner (a copy)."""
        return rewrite_pass.rewrite(copy_module(self._step.module), self.graph, self.plan.value_specs,
                                    self.plan.read_specs, self.plan.read_paths, self.plan.arg_specs,
                                    self.plan.output_specs, self.plan.mesh_axes)

    def compile(self, compiler_options: dict | None = None) -> Compiled:
        """The plan's program compiled by XLA; `compiler_options`: XLA's options, as
        `jax.stages.Lowered.compile` takes them (e.g. {"xla_gpu_enable_latency_hiding_scheduler":
        False}). Compiled once without options; with them, anew at each call, as jax does. For
        GPUs, a program that XLA's schedule takes past `memory_limit_bytes` is compiled again
        with its latency-hiding scheduler held to the limit, tied to the program's order, then
        both, then without the scheduler unless `compiler_options` names it; the fastest that
        fits, priced as its schedule runs, is kept (`rj.CompiledMemoryWarning` says what each
        held and cost)."""
        if compiler_options is None and self._compiled is not None:
            said, self._said = self._said, ()
            for w in said:
                warnings.warn(w.message, w.category, stacklevel=2)
            return self._compiled
        _refuse_unlaid(self.plan, self._step)
        ins = jax.tree.leaves(self.plan.input_shardings)
        outs = jax.tree.leaves(self.plan.output_shardings)
        compiled = Compiled(self, compile_module(self._step.lowered, self._rewritten(), ins, outs, compiler_options,
                                                 self.memory_limit_bytes,
                                                 Weights.of(self.plan.arg_roles, self.plan.arg_specs), self.cluster))
        if compiler_options is None:
            self._compiled, self._said = compiled, ()  # this compile said its own warnings
        return compiled
