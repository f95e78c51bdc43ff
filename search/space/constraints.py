"""The user's constraints on the search space (nnScaler's op-trans and op-assign,
§3-§4): which strategies the ops and arguments a glob names may take (`OpTrans`), and which
pipeline stage the forward ops it names run on (`OpAssign`, applied by the stager).

A constraint names ops by their source names (the jax name stack, as the report prints it:
`jvp(LM)/Block_0/MultiHeadDotProductAttention_0/query/dot_general`) and arguments by their paths
(`arg[0]['Block_0']['MultiHeadDotProductAttention_0']['query']['kernel']`, also matched written
with slashes, `0/Block_0/MultiHeadDotProductAttention_0/query/kernel`, so that one glob on a Flax
module path names the module's ops and its parameters and optimizer state). It keeps the
strategies that split the unit's result only along the allowed dims (`dims`; a split of a
contracted dim leaves a partial sum, which splits no result dim), into an allowed number of parts
(`parts`), or not at all (`replicate`); the search then prices and picks among what is left.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

from rhino_jax.errors import ConstraintError

from ...hlo_passes.graph import Graph, path_tokens
from ..cost.cluster import MeshTopology
from .strategies import Strategy


@dataclass(frozen=True)
class Named:
    """What every constraint has: the glob naming its ops and arguments (see the module's doc)."""

    where: str

    def matches(self, names: tuple[str, ...]) -> bool:
        pattern = _glob(self.where)
        return any(pattern.fullmatch(n) for n in names)


@dataclass(frozen=True)
class OpTrans(Named):
    """`rj.op_trans`: the units `where` names may split their results only along `dims` (indices,
    negative from the end; None: any), only into a number of parts in `parts` (the product of the
    mesh axes a strategy uses; None: any), or not at all (`replicate`)."""

    dims: tuple[int, ...] | None = None
    parts: tuple[int, ...] | None = None
    replicate: bool = False

    def __str__(self) -> str:
        shown = [repr(self.where)] + [f"{k}={v!r}" for k, v in (("dims", self.dims), ("parts", self.parts))
                                      if v is not None] + (["replicate=True"] if self.replicate else [])
        return f"op_trans({', '.join(shown)})"

    def allows(self, s: Strategy, sizes: dict[str, int]) -> bool:
        """Whether strategy `s` of a unit splits its results as this constraint lets it."""
        used = {a for spec in s.results for a in spec.used_axes()}
        if self.replicate:
            return not used and not any(spec.used_axes() for spec in s.operands)
        if self.parts is not None and math.prod(sizes[a] for a in used) not in self.parts:
            return False
        if self.dims is None:
            return True
        for spec in s.results:
            rank = len(spec.dims)
            allowed = {d % rank for d in self.dims if -rank <= d < rank}
            if spec.partial or any(axes and d not in allowed for d, axes in enumerate(spec.dims)):
                return False
        return True


@dataclass(frozen=True)
class OpAssign(Named):
    """`rj.op_assign`: the forward ops `where` names run on pipeline stage `stage` (the backward
    ops follow the forward values they read, `hlo_passes.stages`); `stage="all"`: the ops it
    names, forward and backward, run on every device between the stages' programs (the
    interlaced pipeline)."""

    stage: int | str = 0

    def __str__(self) -> str:
        return f"op_assign({self.where!r}, stage={self.stage!r})"


SHARED = -1  # `fixed_stages`' stage of an op that runs on every device (op_assign(stage="all"))


@dataclass(frozen=True)
class CoShard(Named):
    """`rj.coshard`: the ops `where` names run as `chunks` chunks one after another on the same
    devices (`search.coshard`); "auto": the search picks the number."""

    chunks: int | str = "auto"

    def __str__(self) -> str:
        return f"coshard({self.where!r}, chunks={self.chunks!r})"


@functools.cache  # a glob is matched against every op's name, several times
def _glob(where: str) -> re.Pattern:
    """`*` any run of characters, `?` one; everything else literal (argument paths hold brackets,
    which fnmatch would read as character classes)."""
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in where), re.DOTALL)


def arg_names(path: str) -> tuple[str, ...]:
    """An argument's names for a glob: its path as the report prints it, that path without the
    leading "arg" (as `plan.input_shardings` prints it), and its index and keys joined by slashes."""
    own = path.split("]", 1)[0].rpartition("[")[2]
    return path, path.removeprefix("arg"), "/".join([own] + [text for _, text in path_tokens(path)])


def unit_names(u, graph: Graph) -> tuple[str, ...]:
    """What a unit answers to: an op's (or loop slot's) source name, an argument's path names;
    returned values and hubs are not constrained."""
    if u.kind in ("node", "slot"):
        return (graph.nodes[u.ref].name,) if graph.nodes[u.ref].name else ()
    return arg_names(u.name) if u.kind == "arg" else ()


def layout_allowed(constraints, path: str, spec, sizes: dict[str, int]) -> bool:
    """Whether every `op_trans` naming the argument at `path` lets it take layout `spec`."""
    names, held = arg_names(path), Strategy((), (spec,), 0.0)
    return all(c.allows(held, sizes) for c in constraints if isinstance(c, OpTrans) and c.matches(names))


def named(c: Named, graph: Graph) -> list[tuple[str, tuple[int, ...]]]:
    """The ops and arguments of `graph` that `c` names, each as the error messages call it and
    the shape of its result (an op's largest)."""
    ops = [(f"op {n.name!r}", max((graph.values[r].shape for r in n.results), key=len, default=()))
           for n in graph.nodes if n.name and c.matches((n.name,))]
    return ops + [(f"argument {a.path}", graph.values[a.value].shape)
                  for a in graph.args if c.matches(arg_names(a.path))]


def unmatched(constraints, graph: Graph) -> list:
    """The constraints that name no op and no argument of `graph` (the whole step's); an
    `rj.op_order` names tasks, not ops, and is not one of them."""
    return [c for c in constraints if isinstance(c, Named) and not named(c, graph)]


def check_matched(constraints, graph: Graph) -> None:
    """A constraint that names nothing is a typo, not a wish: refuse it, showing the names the
    step has; so is an `op_trans` dim that nothing it names has (`_check_dims`)."""
    missing = unmatched(constraints, graph)
    if missing:
        ops = [n.name for n in graph.nodes if n.name and n.op.endswith(("dot_general", "convolution"))][:3]
        args = [arg_names(a.path) for a in graph.args[:2]]
        raise ConstraintError(
            f"{missing[0]} names no op or argument of the step. Ops are named by their jax name stack, as "
            f"plan.report() prints them ({', '.join(repr(n) for n in ops) or 'none'}); arguments by their paths "
            f"({', '.join(repr(a[0]) + ' or ' + repr(a[2]) for a in args)}). Globs use * and ?, and match the "
            "whole name: start and end with * to match inside one")
    for c in constraints:
        if isinstance(c, OpTrans) and c.dims is not None:
            _check_dims(c, graph)


def _check_dims(c: OpTrans, graph: Graph) -> None:
    """Refuse a dim of `c` past the result of every op and argument it names: it would be
    dropped unseen, and with all its dims so, what it names would stay whole. A glob names
    results of several ranks (a layer's kernel and its bias), each split only along the dims it
    has, so a dim that some of them have is kept, the others staying whole along it."""
    what, shape = max(named(c, graph), key=lambda t: len(t[1]))
    rank = len(shape)
    past = [d for d in c.dims if not -rank <= d < rank]
    if past:
        raise ConstraintError(f"{c}: dim {past[0]} is past the result of every op and argument it names (the one "
                              f"of most dims is {what}, of shape {shape}); give dims d with {-rank} <= d < {rank} "
                              "(negative from the end), or replicate=True to keep what it names whole")


def check_parts(constraints, devices: int) -> None:
    """Refuse a number of `op_trans` parts that does not divide the step's `devices`: no split of
    them (its mesh's, a stage's, a candidate mesh's) makes it, so beside numbers that are made it
    would be dropped unseen. Where none is made, the search refuses the constraint at the first
    op it leaves no strategy, naming that op."""
    for c in constraints:
        if not isinstance(c, OpTrans) or c.parts is None:
            continue
        never = [p for p in c.parts if devices % p]
        if never and len(never) < len(c.parts):
            made = ", ".join(str(p) for p in range(1, devices + 1) if devices % p == 0)
            raise ConstraintError(f"{c}: no split of the step's {devices} devices is {never[0]} parts; give numbers "
                                  f"of parts that divide {devices} ({made})")


def apply_constraints(constraints, graph: Graph, units, topo: MeshTopology) -> dict[str, int]:
    """Keep each named unit's strategies that every constraint naming it allows; the number of
    units each constraint restricted. Units that shared a strategy list (a repeated layer's ops)
    share the restricted one, so alike cones stay alike (`cones.signature`). A unit left with no
    strategy is a `ConstraintError` naming it and the constraint."""
    kept: dict[tuple, list[Strategy]] = {}
    counts = {str(c): 0 for c in constraints if isinstance(c, OpTrans)}
    for u in units:
        names = unit_names(u, graph)
        mine = tuple(c for c in constraints if isinstance(c, OpTrans) and names and c.matches(names))
        if not mine:
            continue
        for c in mine:
            counts[str(c)] += 1
        key = (id(u.strategies), mine)
        if key not in kept:
            kept[key] = [s for s in u.strategies if all(c.allows(s, topo.sizes) for c in mine)]
            if not kept[key]:
                raise ConstraintError(_nothing_left(u, mine, graph, topo))
        u.strategies = kept[key]
    return counts


def _nothing_left(u, mine, graph: Graph, topo: MeshTopology) -> str:
    shapes = [graph.values[r].shape for r in u.results]
    what = f"{u.kind} {u.name!r}" + (f" ({graph.nodes[u.ref].op.split('.')[-1]})" if u.kind == "node" else "")
    return (f"{' and '.join(map(str, mine))} leaves {what}, of result shape {', '.join(map(str, shapes))}, no "
            f"strategy on the mesh {dict(topo.sizes)}"
            + (" beside its rj.annotate pin" if any(p.value in u.results for p in graph.pins) else "")
            + ": allow more dims or parts, or narrow the glob so it does not name this "
            + ("argument" if u.kind == "arg" else "op"))


def fixed_stages(constraints, graph: Graph, forward: set[int], stages: int) -> dict[int, int]:
    """Forward op → the stage the user's `op_assign`s put it on (`SHARED`: every device); an op
    two of them put on two stages, or one that names no forward op, is a `ConstraintError`
    (backward ops follow the forward values they read, and are not assigned, but for those an
    `op_assign(stage="all")` names: `shared_backward`)."""
    fixed: dict[int, tuple[int, OpAssign]] = {}
    for c in constraints:
        if not isinstance(c, OpAssign):
            continue
        if c.stage != "all" and not 0 <= c.stage < stages:
            raise ConstraintError(f"{c}: the pipeline has stages 0..{stages - 1}; assign to one of them")
        named = [i for i in sorted(forward) if graph.nodes[i].name and c.matches((graph.nodes[i].name,))]
        if not named:
            raise ConstraintError(f"{c} names no op of the forward pass (the ops the loss depends on), which is "
                                  "what stages divide; the backward ops run where the forward values they read "
                                  "were made")
        for i in named:
            k, other = fixed.setdefault(i, (SHARED if c.stage == "all" else c.stage, c))
            if k != (SHARED if c.stage == "all" else c.stage):
                raise ConstraintError(f"{c} and {other} put {graph.nodes[i].name!r} on two stages")
    return {i: k for i, (k, _) in fixed.items()}


def shared_backward(constraints, graph: Graph, forward: set[int]) -> set[int]:
    """The backward ops an `op_assign(stage="all")` names: they run on every device, as the
    forward ops it names do (an embedding's gradient scatter, by the table it adds into)."""
    shared = [c for c in constraints if isinstance(c, OpAssign) and c.stage == "all"]
    return {n.id for n in graph.nodes if n.id not in forward and n.name and any(c.matches((n.name,)) for c in shared)}
