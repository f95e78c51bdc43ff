"""Co-shard ("nnScaler: Constraint-Guided Parallelization Plan Generation for Deep Learning
Training" §4.2): named ops run as C chunks, one after another, on the same devices, so that what
they make and drop inside takes about 1/C of the memory.

A group is a connected set of the ops a `rj.coshard` glob names (ops of @main's top level with a
sharding rule, `rules`), closed under paths: no value leaves it and comes back. Chunking
a group splits one loop of each op into C contiguous blocks, the same way sharding splits it
over a mesh axis of size C, except over time: every value the group makes is cut on the dim
that loop indexes (through reshapes as `strides.map_reshape` maps a layout), the values it
reads from outside are sliced there or read whole, and a value that leaves the group is put
back together: concatenated, or, where the loop is a sum the op reduces over (a weight's
gradient over the batch, an attention output's projection over the heads), added up. Chunk k+1
starts after chunk k has ended: its inputs pass through one `optimization_barrier` with chunk
k's results, so XLA cannot interleave the chunks and hold them all.

The rewrite itself is `hlo_passes.chunking`'s. The rewritten module is what the search then plans (`rhino_jax.coshard_search`): it prices the
chunks' ops, their slices and sums, and its memory model (liveness in program order) sees one
chunk's temporaries live at a time.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses

from rhino_jax.core.ops import ELEMENTWISE
from rhino_jax.core.specs import ShardingSpec

from ...hlo_passes.chunking import SUM, Chunking
from ...hlo_passes.graph import Graph, Node
from ..cost.combining import HEAD, combining_sides
from .rules import loop_space
from .strides import map_reshape

# Ops a chunk may hold: a loop space whose attributes name no size of a split dim (a slice's
# limits are rewritten). Loops, conditionals, gathers and scatters stay outside.
_CHUNKABLE = ELEMENTWISE | {f"stablehlo.{k}" for k in (
    "broadcast_in_dim", "transpose", "reshape", "dot_general", "reduce", "slice", "concatenate", "pad")} | {
    "sdy.sharding_constraint"}


def groups(graph: Graph, named: Callable[[str], bool]) -> list[tuple[int, ...]]:
    """The groups of ops `named` names (and of the unnamed ops between two of them): connected
    through the values they pass each other, cut where a path leaves the group and comes back
    (a remat's recomputed forward and the backward after the layers between). Ops that make
    only gradients on their way to the optimizer (a weight's gradient, off the compute chain:
    `search.combining`) stay out: they run once after the chunks, on the pieces put together,
    so that their sum over the devices trails with the other gradients' instead of holding up
    each chunk (a chunk's partial sums cannot pass its barrier unsettled). Ops in program
    order; groups by their first op."""
    trailing = {v for v, side in combining_sides(graph).items() if side != HEAD}
    eligible = {n.id for n in graph.nodes if _chunkable(n) and named(n.name)
                and not all(graph.values[r].constant or r in trailing for r in n.results)}
    producer = {r: n.id for n in graph.nodes for r in n.results}
    consumers = graph.consumers()
    # An unnamed op between named ones joins them (Flax's masking `select_n` has no name scope).
    eligible |= {n.id for n in graph.nodes if n.id not in eligible and _chunkable(n)
                 and any(producer.get(o) in eligible for o in n.operands)
                 and any(c in eligible for r in n.results for c in consumers[r])}
    parent = {n: n for n in eligible}

    def find(n: int) -> int:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in sorted(eligible):
        for o in graph.nodes[n].operands:
            p = producer.get(o)
            if p in eligible:
                parent[find(n)] = find(p)
    members: dict[int, list[int]] = {}
    for n in sorted(eligible):
        members.setdefault(find(n), []).append(n)
    out = []
    for nodes in members.values():
        out += _convex_parts(graph, nodes)
    return sorted(out)


def _chunkable(n: Node) -> bool:
    return n.op in _CHUNKABLE and n.trips == 1 and "branch" not in n.attrs


def _convex_parts(graph: Graph, nodes: list[int]) -> list[tuple[int, ...]]:
    """`nodes` cut into parts that no path leaves and re-enters: in program order, an op joins the
    current part unless it reads (through ops outside) a value the part made and then let out."""
    parts: list[list[int]] = [[]]
    inside: set[int] = set()
    tainted: set[int] = set()  # values outside the current part that depend on it
    first = nodes[0]
    members = set(nodes)
    for node in graph.nodes[first:nodes[-1] + 1]:
        if node.id in members:
            if any(o in tainted for o in node.operands):
                parts.append([])
                inside, tainted = set(), set()
            parts[-1].append(node.id)
            inside.update(node.results)
        elif any(o in inside or o in tainted for o in node.operands):
            tainted.update(node.results)
    return [tuple(p) for p in parts if p]


def chunkings(graph: Graph, nodes: Sequence[int], chunks: int, copies: Sequence[int] = ()) -> list[Chunking]:
    """Every way to cut the group into `chunks`: one per dim of its largest value that the cut
    reaches consistently through every op (a dim of every value the group keeps to itself,
    divisible by `chunks`); none when no dim can be. An op that reads nothing the group makes
    (a transpose of the incoming gradient) and cannot be cut so is left out, run whole before
    the chunks. `copies`: ops of earlier groups the chunks compute again for themselves
    (`recomputed`)."""
    consumers = graph.consumers()
    made = [r for n in nodes for r in graph.nodes[n].results]
    seed = max(made + [r for n in copies for r in graph.nodes[n].results], key=lambda v: graph.values[v].nbytes)
    out = []
    for d, size in enumerate(graph.values[seed].shape):
        kept = sorted(set(nodes) | set(copies))
        while size % chunks == 0:
            found = _propagate(graph, kept, consumers, seed, d, chunks)
            if isinstance(found, Chunking):
                out.append(dataclasses.replace(found, nodes=tuple(n for n in found.nodes if n not in copies),
                                               copies=tuple(n for n in found.nodes if n in copies)))
                break
            whole = _run_whole(graph, found, kept, consumers)
            if not whole or seed in {r for n in whole for r in graph.nodes[n].results}:
                break
            kept = [n for n in kept if n not in whole]
    return out


def saves_memory(graph: Graph, nodes: Sequence[int], copies: Sequence[int] = ()) -> bool:
    """Whether the group keeps to itself a value larger than any it reads: else its chunks
    would save nothing (a bias's gradient, a sum of the incoming gradient) but slice its inputs."""
    consumers = graph.consumers()
    members = set(nodes)
    kept = [graph.values[r].nbytes for n in nodes for r in graph.nodes[n].results
            if r not in graph.outputs and all(c in members for c in consumers[r])]
    return max(kept, default=0) > max(_read_sizes(graph, nodes, copies), default=0)


def _read_sizes(graph: Graph, nodes: Sequence[int], copies: Sequence[int]) -> list[int]:
    """The sizes of the values the group (with its copies) reads from outside, constants left out."""
    computed = set(nodes) | set(copies)
    inside = {r for n in computed for r in graph.nodes[n].results}
    return [graph.values[o].nbytes for n in computed for o in graph.nodes[n].operands
            if o not in inside and not graph.values[o].constant]


def recomputed(graph: Graph, groups: Sequence[tuple[int, ...]], k: int) -> tuple[int, ...]:
    """The ops of earlier groups that make what group k reads from them: its chunks can make
    those values again, each its own slice, instead of reading them whole (co-shard goes with
    recomputation: a remat's recomputed attention probabilities are not held whole for the
    backward pass, each backward chunk recomputes its own)."""
    earlier = {r: g for g in groups[:k] for n in g for r in graph.nodes[n].results}
    owner = {n: g for g in groups[:k] for n in g}
    wanted = [o for n in groups[k] for o in graph.nodes[n].operands if o in earlier]
    out: set[int] = set()
    while wanted:
        v = wanted.pop()
        n = graph.values[v].producer
        if n in out:
            continue
        out.add(n)
        wanted += [o for o in graph.nodes[n].operands if o in earlier and owner.get(graph.values[o].producer) is owner[n]]
    return tuple(sorted(out))


def _run_whole(graph: Graph, node: int, nodes: Sequence[int], consumers) -> set[int]:
    """The ops to take out of `nodes`, to run whole, so that the cut can pass `node`, where it
    failed: `node` if it reads nothing the others make (it runs before the chunks: a transpose
    of the incoming gradient); else those of the ops it reads from that read nothing the others
    make (a bias reshaped for its broadcast, a mask made ready for the scores); else `node` if
    none of the others reads what it makes (it runs after the chunks: a bias added to the sum
    of the heads' chunks). Empty where none is: the cut fails."""
    members = set(nodes)
    made = {r: n for n in nodes for r in graph.nodes[n].results}

    def reads_nothing(n: int) -> bool:
        return not any(o in made for o in graph.nodes[n].operands)

    if reads_nothing(node):
        return {node}
    before = {made[o] for o in graph.nodes[node].operands if o in made and reads_nothing(made[o])}
    if before:
        return before
    if not any(c in members for r in graph.nodes[node].results for c in consumers[r]):
        return {node}
    return set()


def _propagate(graph: Graph, nodes: Sequence[int], consumers, seed: int, dim: int, chunks: int) -> Chunking | int:
    """The cut that puts `seed` in chunks on `dim`, carried to every op of the group; else the op
    where it fails (a dim not divisible, a value made in chunks that it needs whole, a sum over
    the chunks that feeds anything but a transpose, reshape or add of sums)."""
    members = set(nodes)
    producer = {r: n for n in nodes for r in graph.nodes[n].results}
    dims: dict[int, int] = {seed: dim}
    reads: dict[tuple[int, int], int | None] = {}
    todo = [producer[seed]] + [c for c in consumers[seed] if c in members]
    done: set[int] = set()
    while todo:
        n = todo.pop()
        if n in done:
            continue
        node = graph.nodes[n]
        cut = _cut_node(graph, node, dims, producer, chunks)
        if cut is None:
            return n
        if cut is _WAIT:
            continue  # queued again when a value it touches gets its dim
        done.add(n)
        for pos, d in cut["reads"].items():
            reads[n, pos] = d
        for v, d in cut["values"].items():
            if dims.get(v, d) != d:
                return n
            if v not in dims:
                dims[v] = d
                todo += ([producer[v]] if v in producer else []) + [c for c in consumers[v] if c in members]
    left = [n for n in nodes if n not in done]
    if left:
        return left[0]
    return Chunking(tuple(nodes), chunks, dims, reads, seed)


_WAIT = {"values": {}, "reads": {}}  # not enough known yet to cut the op
# Ops that pass a sum over the chunks on as one: each chunk's addend goes through them exactly.
_SUM_PRESERVING = {"stablehlo.transpose", "stablehlo.reshape", "stablehlo.add"}


def _cut_node(graph: Graph, node: Node, dims: dict[int, int], producer, chunks: int) -> dict | None:
    """How one op is cut, given the dims already known of the values it reads and makes:
    {"values": {value the group makes: dim}, "reads": {operand position read from outside: dim or
    None}}; None where the known dims disagree or the op cannot be cut so; `_WAIT` where nothing
    known fixes its loop yet."""
    inside = [o in producer for o in node.operands]
    summed = [v for v in node.operands + node.results if v in producer and dims.get(v) == SUM]
    if any(v in node.operands for v in summed) or summed and node.op in _SUM_PRESERVING:
        # A sum over the chunks passes through exact linear ops, each chunk's addend on its own.
        if node.op not in _SUM_PRESERVING or not all(inside):
            return None
        return {"values": {v: SUM for v in node.operands + node.results}, "reads": {}}
    if node.op == "stablehlo.reshape":
        (x,), (y,) = node.operands, node.results
        src, dst = graph.values[x].shape, graph.values[y].shape
        if y in dims:
            d = _map_dim(dims[y], dst, src, chunks)
            if d is None:
                return None
            return {"values": {y: dims[y]} | ({x: d} if inside[0] else {}), "reads": {} if inside[0] else {0: d}}
        if x not in dims:
            return _WAIT
        d = _map_dim(dims[x], src, dst, chunks)
        return None if d is None else {"values": {y: d}, "reads": {}}
    space = loop_space(node, graph)
    if space is None:
        return None
    loop = None
    for tensors, values in ((space.operands, node.operands), (space.results, node.results)):
        for spec, v in zip(tensors, values):
            if v in dims and v in producer and dims[v] != SUM:
                if not spec or spec[dims[v]] is None or loop not in (None, spec[dims[v]]):
                    return None
                loop = spec[dims[v]]
    if loop is None:
        return _WAIT
    values, reads = {}, {}
    for pos, (spec, v) in enumerate(zip(space.operands, node.operands)):
        at = [i for i, l in enumerate(spec) if l == loop]
        if len(at) > 1:
            return None
        d = at[0] if at else None
        if inside[pos]:
            if d is None:
                return None  # every chunk would need the whole of a value made in chunks
            values[v] = d
        elif d is not None and graph.values[v].shape[d] % chunks:
            return None
        else:
            reads[pos] = d
    for spec, v in zip(space.results, node.results):
        at = [i for i, l in enumerate(spec) if l == loop]
        if len(at) > 1:
            return None
        if at:
            if graph.values[v].shape[at[0]] % chunks:
                return None
            values[v] = at[0]
        elif space.reduce_kind in ("sum", "sum_at_once") and _starts_at_zero(graph, node):
            values[v] = SUM  # reduced over the cut loop: each chunk makes an addend
        else:
            return None
    return {"values": values, "reads": reads}


def _starts_at_zero(graph: Graph, node: Node) -> bool:
    """A reduce's inits are zeros (each chunk's addend would add them again otherwise)."""
    if node.op != "stablehlo.reduce":
        return True
    inits = node.operands[len(node.operands) // 2:]
    return all(graph.is_zero(v) for v in inits)


def _map_dim(dim: int, src: tuple[int, ...], dst: tuple[int, ...], chunks: int) -> int | None:
    """The dim of reshape(x, dst) that holds x's chunks on `dim` as contiguous blocks, as the
    layout of a split over an axis of `chunks` maps (`strides.map_reshape`); None if none does."""
    spec = ShardingSpec(tuple(("chunk",) if d == dim else () for d in range(len(src))))
    mapped = map_reshape(spec, src, dst, {"chunk": chunks})
    if mapped is None or mapped.strides:
        return None
    return mapped.dim_of("chunk")


# ------------------------------------------------------------------------------ the rewrite
