"""Per-device memory of a plan: arguments, outputs and the peak of live intermediates, as XLA's
buffer assignment counts them (arguments + outputs + temporaries, donated buffers once).

XLA fuses chains of elementwise ops into one kernel: only the tensors a fusion writes for readers
outside it reach memory, and the tensors it reads stay live until its last fused reader has run.
A tensor read in another layout than it was made in is moved into a buffer of its own, which
lives from the first to the last reader of that layout (XLA makes one move per layout, as the
planner prices it), unless the move is a local slice (no collective) and the backend is the GPU's,
which fuses the slice into its reader (checked on GPU compiles of five Flax models: no such
buffer is live at XLA's peak; the CPU's keeps it, in a tiny LM's ZeRO-3 step).

Partial sums are the exception: XLA's partitioner settles them in the op that makes them (a
weight gradient's GEMM is followed by its reduce-scatter), so a partial value read in another
layout is moved where it is made, not where it is read (`settled_at`). Counting the moves at
their readers kept every layer's full-size weight gradient live until the optimizer read it:
a predicted 79.5 GiB per device for a 32-layer 70B-wide step that XLA compiles in 36.9."""
from __future__ import annotations

import bisect
from collections.abc import Sequence

from rhino_jax.core.ops import FUSED_READERS, FUSIBLE
from rhino_jax.core.specs import ShardingSpec

from ...hlo_passes.graph import Graph
from .cluster import MeshTopology
from .collectives import reshard

VIEWS = {"stablehlo.reshape", "sdy.sharding_constraint"}  # XLA makes them bitcasts of their operand
BARRIER = "stablehlo.optimization_barrier"  # hands each operand's buffer on as its result, slot by slot


def local_bytes(graph: Graph, vid: int, spec: ShardingSpec | None, sizes: dict[str, int]) -> int:
    full = graph.values[vid].nbytes
    return full if spec is None else full // spec.shard_factor(sizes)


def beside_bytes(graph: Graph, arg_specs: Sequence[ShardingSpec | None], out_specs: Sequence[ShardingSpec | None],
                 sizes: dict[str, int]) -> int:
    """Bytes per device the step holds beside the program the whole time, each in the layout of
    what it is held beside: copies of arguments (`Arg.held_beside`: a pipeline stage's gradient
    sum and moments) and of outputs (`Graph.outputs_held_beside`: micro-batches' running sums)."""
    return (sum(a.held_beside * local_bytes(graph, a.value, spec, sizes) for a, spec in zip(graph.args, arg_specs))
            + sum(h * local_bytes(graph, o, spec, sizes)
                  for o, spec, h in zip(graph.outputs, out_specs, graph.outputs_held_beside)))


def plan_memory(graph: Graph, specs: dict[int, ShardingSpec], topo: MeshTopology,
                reads: dict[tuple[int, int], ShardingSpec] | None = None,
                out_specs: Sequence[ShardingSpec] | None = None, workspaces: dict[int, int] | None = None) -> int:
    """Bytes per device at the step's peak. `specs`: each value's layout; `reads`: the layout
    operand `pos` of node `id` is read in, keyed (id, pos), where it differs from the value's;
    `out_specs`: the layout each output is returned in (default: its value's), which is the
    buffer XLA returns (a ZeRO-like plan gathers its updated parameters into it); `workspaces`:
    node id → the temporary bytes the compiler adds to run it (`gemm_workspace`), live from the
    node to its result's first reader (where XLA sums a split GEMM's partial products)."""
    sizes = topo.sizes

    def moved_by_collectives(v: int, spec: ShardingSpec) -> bool:
        src = specs.get(v)
        value = graph.values[v]
        return src is None or topo.combiner.backend != "gpu" or bool(reshard(src, spec, value.nbytes, topo,
                                                                            value.shape))

    moves = {key: spec for key, spec in (reads or {}).items()
             if not graph.values[graph.nodes[key[0]].operands[key[1]]].constant
             and specs.get(graph.nodes[key[0]].operands[key[1]]) != spec
             and moved_by_collectives(graph.nodes[key[0]].operands[key[1]], spec)}
    stored = _stored(graph)
    end, moved = _lifetimes(graph, stored, moves, settled_at(graph, specs))
    # Outputs are counted apart, for the whole step, as XLA's figures count them (a donated
    # argument's buffer holds its output); the temporaries XLA puts in an output's buffer before
    # the output is written are not on the heap (`_heap_peak`).
    returned = {_buffer(graph, o) for o in graph.outputs}
    temporaries = [(n.id, end[r], local_bytes(graph, r, specs.get(r), sizes))
                   for n in graph.nodes for r in n.results
                   if stored[r] and r in end and r not in returned and not graph.values[r].constant]
    temporaries += [(first, last, local_bytes(graph, v, spec, sizes)) for (v, spec), (first, last) in moved.items()]
    if workspaces:
        first_read = _first_reads(graph)
        temporaries += [(n, max([n] + [first_read.get(r, n) for r in graph.nodes[n].results]), nbytes)
                        for n, nbytes in workspaces.items()]
    returned_specs = list(out_specs) if out_specs is not None else [specs.get(o) for o in graph.outputs]
    arg_specs = [specs.get(a.value) for a in graph.args]
    args = (sum(local_bytes(graph, a.value, spec, sizes) for a, spec in zip(graph.args, arg_specs))
            + beside_bytes(graph, arg_specs, returned_specs, sizes))
    donated = {a.donated_to for a in graph.args if a.donated_to is not None}
    rooms = []  # (bytes, step at which it is written) of each output buffer no argument holds
    for k, o in enumerate(graph.outputs):
        if k in donated or graph.values[o].constant:
            continue
        producer = graph.values[_buffer(graph, o)].producer
        # written where it is made, or at the step's end when it leaves in another layout
        written = len(graph.nodes) if producer < 0 or returned_specs[k] != specs.get(o) else producer
        rooms.append((local_bytes(graph, o, returned_specs[k], sizes), written))
    return args + sum(size for size, _ in rooms) + _heap_peak(temporaries, rooms, len(graph.nodes))


def _heap_peak(temporaries: list[tuple[int, int, int]], rooms: list[tuple[int, int]], steps: int) -> int:
    """The peak of the temporaries (first step, last step, bytes) that XLA's buffer assignment
    leaves in its temporary heap. It assigns buffers largest first, each to an allocation it fits
    and is free in: an output's allocation is free until the output is written (on GPU compiles
    of Flax models, activations and gradients held there; the outputs' allocations kept their
    outputs' sizes). Here each goes to the smallest output buffer (bytes, written at) that holds
    it and is free over its life, else to the heap."""
    order = sorted(range(len(rooms)), key=lambda k: rooms[k][0])
    sizes = [rooms[k][0] for k in order]
    busy: list[list[tuple[int, int]]] = [[] for _ in order]
    alloc = [0] * (steps + 2)  # bytes allocated at step t on the heap, freed after the last
    for first, last, nbytes in sorted(temporaries, key=lambda t: -t[2]):
        for i in range(bisect.bisect_left(sizes, nbytes), len(order)):
            if last < rooms[order[i]][1] and all(last < a or first > b for a, b in busy[i]):
                busy[i].append((first, last))
                break
        else:
            alloc[first] += nbytes
            alloc[last + 1] -= nbytes
    live = peak = 0
    for b in alloc:
        live += b
        peak = max(peak, live)
    return peak


def _first_reads(graph: Graph) -> dict[int, int]:
    """The step at which each value is first read."""
    first: dict[int, int] = {}
    for n in graph.nodes:
        for o in n.operands:
            first.setdefault(o, n.id)
    return first


def _slotwise(node) -> bool:
    """Whether `node` hands each operand's buffer on as the result in its slot: a counted loop's
    entry or exit (a carried value is one buffer in, through and out of the loop), or a barrier
    (`jax.checkpoint`'s: XLA's buffer assignment gives its results their operands' buffers)."""
    return "loop_trips" in node.attrs or node.op == BARRIER


def _aliases(graph: Graph, v: int) -> bool:
    """Whether `v` is a view of an operand's buffer: a reshape or sharding constraint's result, or
    what a slot-wise op hands on."""
    p = graph.values[v].producer
    return p >= 0 and (graph.nodes[p].op in VIEWS or _slotwise(graph.nodes[p]))


def _buffer(graph: Graph, v: int) -> int:
    """The value whose buffer `v` is (itself, or the source of the views it is)."""
    while _aliases(graph, v):
        node = graph.nodes[graph.values[v].producer]
        v = node.operands[node.results.index(v)] if _slotwise(node) else node.operands[0]
    return v


def _stored(graph: Graph, barrier_views: bool = True) -> list[bool]:
    """Whether each value has a buffer of its own: a result of a fusible op read only by fusible
    ops (or reductions, which fuse their input) stays inside the fusion, and a view (a reshape,
    a sharding constraint, what a slot-wise op hands on) is its operand's buffer; its readers
    count as its operand's. `barrier_views=False`: a barrier's results are buffers of their own."""
    fused_only = [True] * len(graph.values)
    for o in graph.outputs:
        fused_only[o] = False
    for n in reversed(graph.nodes):  # every reader of a value comes before its producer
        fused = all(fused_only[r] for r in n.results) if n.op in VIEWS else n.op in FUSED_READERS
        for o in n.operands:
            fused_only[o] = fused_only[o] and fused
    stored = [True] * len(graph.values)
    for n in graph.nodes:
        for r in n.results:
            if n.op in FUSIBLE:
                stored[r] = n.op not in VIEWS and not fused_only[r]
            elif "loop_trips" in n.attrs or (barrier_views and n.op == BARRIER):
                stored[r] = False
    return stored


def settled_at(graph: Graph, specs: dict[int, ShardingSpec]) -> dict[int, int]:
    """Partial value → the step at which XLA sums it: the op that made it, or for a fusible op
    on partial values (a transpose, a convert, an add of two gradients) the step its last operand
    is ready at (XLA settles each partial operand where it is made; the fusible op then runs on
    what is settled)."""
    out: dict[int, int] = {}
    for n in graph.nodes:
        partial = [r for r in n.results if specs.get(r) is not None and specs[r].partial]
        if not partial:
            continue
        at = n.id
        if n.op in FUSIBLE and any(o in out for o in n.operands):
            at = max(out.get(o, graph.values[o].producer) for o in n.operands)
        out.update(dict.fromkeys(partial, at))
    return out


def _lifetimes(graph: Graph, stored: list[bool], moves: dict[tuple[int, int], ShardingSpec],
               settled: dict[int, int] | None = None):
    """The last step at which each value is needed in its own layout (outputs: after the last
    node), and the first and last step of each (value, layout) it is moved into. An op whose
    results stay inside fusions runs where they are read: from the first of those steps to the
    last. A value is moved where its first reader in that layout runs, so it is needed until
    then; after that the moved copy is, until its last reader has run. `settled`: the partial
    values and where XLA sums them (`settled_at`): a partial value is moved there, and a fused op
    of partial results runs there."""
    settled = settled or {}
    end = {o: len(graph.nodes) for o in graph.outputs}
    start: dict[int, int] = {}  # value → the first step at which it is read
    moved: dict[int, dict[ShardingSpec, tuple[int, int]]] = {}
    for n in reversed(graph.nodes):  # every reader of a value comes before its producer
        for r in n.results:
            for first, _ in moved.get(r, {}).values():
                end[r] = max(end.get(r, first), first)
        first = last = n.id
        if n.results and all(r in settled for r in n.results):
            first = last = max(settled[r] for r in n.results)
        elif not all(stored[r] for r in n.results):
            first = min([start[r] for r in n.results if r in start], default=n.id)
            last = max([n.id] + [end[r] for r in n.results if r in end])
        slots = _slotwise(n) and not any(stored[r] for r in n.results) and len(n.operands) == len(n.results)
        for pos, o in enumerate(n.operands):
            if slots:  # each operand is needed as long as the result in its slot
                r = n.results[pos]
                first, last = start.get(r, n.id), max(n.id, end.get(r, n.id))
            start[o] = min(start.get(o, first), first)
            spec = moves.get((n.id, pos))
            if spec is None:
                end[o] = max(end.get(o, last), last)
                continue
            a, b = moved.setdefault(o, {}).get(spec, (settled.get(o, first), last))
            moved[o][spec] = (min(a, first), max(b, last))
    return end, {(v, spec): span for v, by_spec in moved.items() for spec, span in by_spec.items()}


def held_fractions(graph: Graph) -> dict[int, float]:
    """The fraction of the step each value holds a buffer of its own, whatever its layout:
    arguments all of it (and their copies held beside, `Arg.held_beside`), intermediates from
    their producer to their last reader (and outputs' copies held beside all of it,
    `Graph.outputs_held_beside`), values that stay inside fusions or are views none.
    Bytes times this fraction, summed, are the average memory of the step: a linear stand-in for
    its peak that the strategy ILP can price. A barrier's results count as buffers of their own
    here: the ILP prices each slot's layout alone, and a result laid out unlike its operand is
    the copy the move makes (left uncounted, reading a weight whole at `jax.checkpoint`'s
    barrier was free to the ILP, and the plans it solved overran a limit they could meet)."""
    stored = _stored(graph, barrier_views=False)
    end, _ = _lifetimes(graph, stored, {})
    steps = len(graph.nodes) + 1
    held = {a.value: 1.0 + a.held_beside for a in graph.args}
    for n in graph.nodes:
        for r in n.results:
            if stored[r] and r in end and not graph.values[r].constant:
                held[r] = (end[r] - n.id + 1) / steps
    for o, h in zip(graph.outputs, graph.outputs_held_beside):
        held[o] = held.get(o, 0.0) + h
    return held
