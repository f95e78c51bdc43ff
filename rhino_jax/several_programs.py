"""A step run as several programs, micro-batches or pipeline stages: the step split at its sums
into compute-gradients and apply-gradients (`hlo_passes.micro_batch`), its batch cut into
micro-batches, each program planned (or given a saved plan's), compiled within the memory
limit and priced; and the `jax.stages` surfaces (`SeveralProgramsLowered`, `SeveralPrograms`)
that `micro_batched` and `pipelined` build on."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rhino_jax.core.plan import Plan
from rhino_jax.core.plan_target import PlanTarget
from rhino_jax.hlo_passes import batch_positions, micro_batch
from rhino_jax.hlo_passes import rewrite as rewrite_pass
from rhino_jax.hlo_passes.graph import Graph
from rhino_jax.hlo_passes.importer import import_module, pinned_whole
from rhino_jax.hlo_passes.jax_internals import key_impl_of
from rhino_jax.hlo_passes.lowering import LoweredStep, extended_leaves, lower_on_mesh
from rhino_jax.hlo_passes.module import copy_module
from rhino_jax.runtime.executable import Weights, compile_program
from rhino_jax.search import progress
from rhino_jax.search.cost.cluster import Cluster
from rhino_jax.search.cost.memory import beside_bytes
from rhino_jax.search.space.constraints import check_matched

from .arguments import Call, donated_leaves
from .errors import MeshError
from .stages_facade import CompiledTrees


def micro_batch_args(args, roles: Sequence[str], k: int, paths: Sequence[str]) -> list[list]:
    """The flat arguments of each of k micro-batches: batch leaves cut along their first dim."""
    leaves = jax.tree.leaves(args)
    for x, role, path in zip(leaves, roles, paths):
        if role != "batch":
            continue
        if not np.ndim(x):
            raise MeshError(f"{path} is a scalar in the batch (an argument named batch, inputs, labels, ..., or the "
                            f"step's last): num_micro_batches={k} cuts every leaf of the batch along its first dim, "
                            "the examples'. Pass the scalar in another argument, or as a static one")
        if np.shape(x)[0] == 0:
            raise MeshError(f"{path} holds no examples (shape {np.shape(x)}); pass a batch of at least "
                            f"num_micro_batches={k} examples")
        if np.shape(x)[0] % k:
            raise MeshError(f"num_micro_batches={k} does not divide the batch dim of {path} (shape {np.shape(x)}); "
                            "use a number of micro-batches that divides the batch size")
    return [[_piece(x, i, k) if role == "batch" else x for x, role in zip(leaves, roles)] for i in range(k)]


def micro_batches_of(lowered, args: tuple, kwargs: dict) -> list[list]:
    """The flat arguments of each micro-batch of a call, after checking the call's pytree."""
    tree, given = lowered._trees[0], jax.tree.structure((args, kwargs))
    if given != tree:
        raise TypeError(f"function compiled for arguments of structure {tree}, called with {given}")
    return micro_batch_args(flat_call(args, kwargs), lowered.plan.arg_roles, lowered.k, lowered.plan.arg_paths)


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None) or np.float32, jax.dtypes.prng_key)


def flat_call(args: tuple, kwargs: dict) -> list:
    """A call's leaves as the step's programs take them: a typed PRNG key as its key data (the
    uint32 words jax lowers it to)."""
    return [jax.random.key_data(x) if _is_key(x) else x for x in jax.tree.leaves((args, kwargs))]


def accumulated(dtype, accumulate: str | None) -> np.dtype:
    """The dtype micro-batches' parts of a sum of `dtype` are added up in: `accumulate` (the
    option `accumulation_dtype`) for a narrower float (bf16, f16), so that the sum is rounded to
    `dtype` once, as the whole batch's is, not once per micro-batch; else `dtype`."""
    dtype = np.dtype(dtype)
    if accumulate is None or not jax.numpy.issubdtype(dtype, jax.numpy.floating):
        return dtype
    return max(dtype, np.dtype(accumulate), key=lambda d: d.itemsize)


def summed_bytes(nbytes: int, dtype, accumulate: str | None) -> int:
    """The bytes of a running sum of `nbytes` of `dtype`, held in its accumulation dtype."""
    return nbytes * accumulated(dtype, accumulate).itemsize // np.dtype(dtype).itemsize


def add_up(total, part):
    """A running sum with one more micro-batch's part: the sum in its accumulation dtype."""
    return total + part.astype(total.dtype)


def named(mesh: Mesh, specs) -> list[NamedSharding]:
    return [NamedSharding(mesh, s.to_partition_spec()) for s in specs]


def _piece(x, i: int, k: int):
    """The i-th of k pieces of x along its first dim (of its shape alone, for an abstract x)."""
    b = np.shape(x)[0] // k
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((b,) + tuple(x.shape[1:]), x.dtype)
    return x[i * b:(i + 1) * b]


def _abstract(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x))


@dataclass(frozen=True)
class SplitStep:
    """A step lowered for the whole batch and for one micro-batch, and cut at its sums."""

    whole: LoweredStep
    parts: micro_batch.MicroSplit
    compute_graph: Graph  # compute-gradients' graph: the step's arguments → the sums
    apply_graph: Graph  # apply-gradients': the step's arguments and the sums → the outputs
    # the step's flat arguments the user donates: apply-gradients, the last program to read them,
    # may overwrite them with its outputs
    donated: tuple[int, ...] = ()


_SHARED_SPLITS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("shared_splits", default=None)


@contextlib.contextmanager
def splits_shared():
    """Within it, a step is split once for each count of micro-batches (`split_step`): the
    candidates `pipeline="auto"` weighs (SPMD with micro-batches, and each count of stages) cut
    the same step for the same micro-batches, two lowerings and four imports of it each. Every
    reader of a split copies its modules before changing them (`split.extract`, the rewrite
    before a compile) and replaces its graphs, so one split serves them all."""
    token = _SHARED_SPLITS.set({})
    try:
        yield
    finally:
        _SHARED_SPLITS.reset(token)


def split_step(call: Call, mesh: Mesh, k: int, constraints: tuple = ()) -> SplitStep:
    """The step lowered whole and cut into compute-gradients and apply-gradients for `k`
    micro-batches; the user's `constraints` are checked against the whole step's names here, as
    each program holds only some of them. Inside `splits_shared`, made once per call, mesh, `k`
    and constraints."""
    shared = _SHARED_SPLITS.get()
    if shared is None:
        return _split_step(call, mesh, k, constraints)
    key = (id(call), id(mesh), k, constraints)  # the call and mesh outlive the context
    if key not in shared:
        shared[key] = _split_step(call, mesh, k, constraints)
    return shared[key]


def _split_step(call: Call, mesh: Mesh, k: int, constraints: tuple) -> SplitStep:
    whole = lower_on_mesh(call.fn, call.args, mesh, (), call.kwargs, (), call.positions)
    inputs = (call.args, call.kwargs)
    flat_micro = micro_batch_args(jax.tree.map(_abstract, inputs), whole.arg_roles, k, whole.arg_paths)[0]  # shapes
    args, kwargs = jax.tree.unflatten(jax.tree.structure(inputs), flat_micro)
    micro = lower_on_mesh(call.fn, args, mesh, (), kwargs, (), call.positions)
    graph = import_module(whole.module, whole.arg_paths, whole.arg_roles, whole.output_paths)
    check_matched(constraints, graph)
    micro_graph = import_module(micro.module, micro.arg_paths, micro.arg_roles, micro.output_paths)
    parts = micro_batch.split(whole.module, graph, micro.module, micro_graph)
    names = [f"sum[{i}]" for i in range(len(parts.boundary))]
    donated = donated_leaves(call)
    keys, returned_keys = extended_leaves(whole)  # key data in both programs: pinned whole, as in the step
    apply_graph = pinned_whole(import_module(parts.apply, whole.arg_paths + names,
                                             whole.arg_roles + ["other"] * len(names), whole.output_paths),
                               keys + [False] * len(names), returned_keys)
    compute_graph = pinned_whole(import_module(parts.compute, whole.arg_paths, whole.arg_roles, names),
                                 keys, [False] * len(names))
    return SplitStep(whole, parts, compute_graph, _with_donation(apply_graph, donated), donated)


def _with_donation(graph: Graph, donated: Sequence[int]) -> Graph:
    """`graph` with each donated argument aliasing the first output left of its shape and dtype,
    as jax pairs them, so that the search ties their layouts (the buffer is reused only then) and
    counts one buffer for both."""
    args, free = list(graph.args), list(range(len(graph.outputs)))
    for i in donated:
        value = graph.values[args[i].value]
        k = next((k for k in free if (graph.values[graph.outputs[k]].shape, graph.values[graph.outputs[k]].dtype)
                  == (value.shape, value.dtype)), None)
        if k is not None:
            free.remove(k)
            args[i] = dataclasses.replace(args[i], donated_to=k)
    return dataclasses.replace(graph, args=tuple(args))


class SeveralProgramsLowered:
    """The `jax.stages.Lowered` surface of a step lowered to several programs (micro-batches,
    pipeline stages): its arguments' and result's trees; no one module to show or analyse."""

    _step: SplitStep
    _trees: tuple
    plan: Plan
    _compiled: "SeveralPrograms | None" = None
    _compile_with: Callable[[dict | None], "SeveralPrograms"]  # the step's programs compiled with these options

    def compile(self, compiler_options: dict | None = None) -> "SeveralPrograms":
        """Every program compiled by XLA; `compiler_options`: XLA's options for each of them, as
        `jax.stages.Lowered.compile` takes them. Compiled once without options; with them, anew
        at each call, as jax does."""
        if compiler_options is not None:
            return self._compile_with(compiler_options)
        if self._compiled is None:
            self._compiled = self._compile_with(None)
        return self._compiled

    def _several(self, what: str) -> NotImplementedError:
        return NotImplementedError(f"{what}: this step runs as several programs ({type(self).__name__}); compile it "
                                   f"and call {what} on one of compiled.programs[name]")

    def as_text(self, dialect: str | None = None) -> str:
        raise self._several("as_text()")

    def cost_analysis(self):
        raise self._several("cost_analysis()")

    @property
    def in_tree(self):
        """The structure of the dynamic arguments, ((args...), {kwargs}), as jax gives it."""
        return self._trees[0]

    @property
    def out_tree(self):
        return self._trees[1]

    def returned(self, leaves: Sequence) -> Any:
        """The step's result from its programs' flat results: a typed PRNG key the step returns
        wrapped back from its key data."""
        info = jax.tree.leaves(self._step.whole.lowered.out_info)
        return jax.tree.unflatten(self._trees[1], [
            jax.random.wrap_key_data(x, impl=key_impl_of(i.dtype)) if _is_key(i) else x for x, i in zip(leaves, info)])

    @property
    def out_info(self):
        """The result's shapes, dtypes and the plan's shardings, in the result's structure."""
        return jax.tree.map(lambda i, s: jax.ShapeDtypeStruct(i.shape, i.dtype, sharding=s),
                            self._step.whole.lowered.out_info, self.plan.output_shardings)


class SeveralPrograms(CompiledTrees):
    """The `jax.stages.Compiled` surface of a step compiled to several programs: the step's
    argument and result shardings; XLA's text and analyses per program (`programs`)."""

    _lowered: SeveralProgramsLowered
    plan: Plan
    programs: dict[str, jax.stages.Compiled]

    def _several(self, what: str) -> NotImplementedError:
        return NotImplementedError(f"{what}: this step compiles to several programs ({', '.join(self.programs)}); call "
                                   f"{what} on one of compiled.programs[name]")

    def as_text(self) -> str:
        raise self._several("as_text()")

    def cost_analysis(self):
        raise self._several("cost_analysis()")

    def memory_analysis(self):
        raise self._several("memory_analysis()")

    @property
    def input_shardings(self):
        """The step's argument shardings, as jax gives them: ((args...), {kwargs})."""
        return jax.tree.unflatten(self._lowered.in_tree, jax.tree.leaves(self.plan.input_shardings))

    @property
    def output_shardings(self):
        return self.plan.output_shardings

    @property
    def _trees_from(self) -> SeveralProgramsLowered:
        return self._lowered

    def _dispatch(self, args: tuple, kwargs: dict, leaves: list):
        """Call the step on a call's dynamic arguments (`Parallelized.__call__`)."""
        return self(*args, **kwargs)


# An apply-gradients op's weight in the step's time limit beside a compute op's (`levels.Budget`):
# its arguments come pinned to the layouts compute-gradients chose, so its search is mostly the
# build, while an optimizer has more ops than the model (10-15 per parameter).
APPLY_WEIGHT = 0.1


def program_plan(name: str, target: PlanTarget, given: Plan | None, search: Callable[[], Plan]) -> Plan:
    """The plan of one program of the step (`name` as in `compiled.programs`) cut now as
    `target` (`lowering.program_target`): the saved plan's (`given`), once it is shown to be made
    for this program, else `search()`'s, recording the program it was made for. The progress
    line names the program first: what its search then predicts is one run of that program."""
    if given is not None:
        return given.program(name, target)
    progress.say("rhino_jax: program %s (what its search predicts is one run of it, not the step)", name)
    with progress.part():  # explain prices no alternatives of a program: it keeps no ILP (`Plan.repin`)
        return dataclasses.replace(search(), target=target, repin=None)


def searched_alone(graph: Graph, plan: Plan) -> Plan:
    """The program's plan as searched, with its memory less what the step holds beside it
    (`memory.beside_bytes`: the search weighed it), which the step's summary counts apart; a
    saved plan holds this."""
    beside = beside_bytes(graph, plan.arg_specs, plan.output_specs, plan.mesh_axes)
    if not beside:
        return plan
    return dataclasses.replace(plan, cost=dataclasses.replace(plan.cost, memory_bytes=plan.cost.memory_bytes - beside))


def say_step(plan: Plan, how: str) -> None:
    """Say the step's predicted time, as its report does, once its programs are planned: the
    progress line ends on it rather than on its last program's prediction."""
    progress.say("rhino_jax: %s: predicted step %.4g ms", how, plan.cost.total_s * 1e3, best_s=plan.cost.total_s)


def priced_s(cost, overlapped: bool) -> float:
    """A compiled program's time: as its schedule overlaps communication with compute, or serially."""
    return cost.overlapped_s if overlapped else cost.total_s


def priced_line(priced: Callable[..., float], plan: Plan) -> str:
    """The report's last line for a step run as several programs: priced both ways, and predicted."""
    return (f"step priced from the compiled programs: {priced() * 1e3:.3f} ms overlapped, "
            f"{priced(overlapped=False) * 1e3:.3f} ms serially (predicted {plan.cost.total_s * 1e3:.3f} ms)")


def _compile(module, graph: Graph, plan: Plan, mesh: Mesh, donated: Sequence[int] = (),
             returned_on: Mesh | None = None, compiler_options: dict | None = None,
             memory_limit_bytes: int | None = None,
             cluster: Cluster | None = None) -> tuple[jax.stages.Compiled, NamedSharding | None]:
    """A program of the step with its plan's shardings, compiled for the mesh with XLA's
    `compiler_options`, within `memory_limit_bytes` where XLA's GPU schedule allows, the
    remedies priced on `cluster` (`runtime.executable.compile_module`); its results named on
    `returned_on` (the user's mesh of the same devices) where given. A donated argument
    (positions `donated`) is overwritten by the output the graph pairs it with (`Arg.donated_to`)
    where the plan gives both one layout, as the search does when it knew of the donation. With
    the program, the layout of the micro-batch's index it takes last where it counts positions
    along the batch (`batch_positions`), else None."""
    aliases = {a.index: a.donated_to for a in graph.args if a.index in donated and a.donated_to is not None
               and plan.arg_specs[a.index] == plan.output_specs[a.donated_to]}
    rewritten = rewrite_pass.rewrite(copy_module(module), graph, plan.value_specs, plan.read_specs, plan.read_paths,
                                     plan.arg_specs, plan.output_specs, plan.mesh_axes)
    aval = lambda v: jax.ShapeDtypeStruct(graph.values[v].shape, graph.values[v].dtype)  # noqa: E731
    in_avals, in_shardings = [aval(a.value) for a in graph.args], named(mesh, plan.arg_specs)
    index = NamedSharding(mesh, PartitionSpec()) if batch_positions.with_micro_batch_index(rewritten) else None
    if index is not None:
        in_avals.append(jax.ShapeDtypeStruct((), np.int32))
        in_shardings.append(index)
    compiled = compile_program(rewritten, in_avals, [aval(v) for v in graph.outputs], in_shardings,
                               named(returned_on or mesh, plan.output_specs), aliases, compiler_options,
                               memory_limit_bytes, Weights.of(plan.arg_roles, plan.arg_specs), cluster)
    return compiled, index


def with_index(args: list, index: NamedSharding | None, micro_batch: int) -> list:
    """A micro-batch program's arguments, with the micro-batch's index last where it takes one."""
    return args if index is None else [*args, jax.device_put(np.int32(micro_batch), index)]
