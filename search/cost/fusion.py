"""The kernels XLA makes of a step once it has fused it, and the bytes each moves to and from
device memory: what the roofline of an op (`space.strategies.compute_time`) is charged.

XLA fuses a chain of elementwise ops, and the views between them, into one loop kernel, and a
reduction into the kernel of the elementwise ops that feed it; a value passed inside a kernel
never reaches memory. A fusion never holds two ops with another kernel between them: one that
feeds a matmul cannot also read its product (a residual stream's adds are a kernel per layer,
not one kernel of every layer's), and a reduction's result read back over the tensor it
reduced (a mean subtracted from each element) is read by the next kernel. So a Flax layer norm
is two kernels (both means, then the normalization), an Adam update of one leaf one.

On Ampere and later GPUs, XLA's Triton fusions go further: a reduction along a tensor's last
dimension (a row: a softmax's max and sum, an RMS norm's mean) runs in one kernel with the ops
that read its result back along that row, a softmax in one kernel where it would be three
(`rows_fused`); the attention scores of a long sequence are read once, not three times. Where
two reductions' results are combined before they are read back (a layer norm's variance, its
mean of squares less its squared mean), XLA keeps the two kernels: so does this.

Not modelled: the merging of matmuls that share an operand, the layout copies XLA adds where a
matmul reads another's product in another order, gathers fused into their readers, and two
reductions of one step argument joined in one kernel. On ten small Flax, NNX and Equinox steps
planned for 8 described H100s the kernels counted here are 0.80-1.26 times those of the
compiled programs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rhino_jax.core.ops import FUSED_READERS, FUSIBLE

from ...hlo_passes.graph import Graph, Node

# Ops that launch no kernel of their own: XLA folds them into the kernels that read them (a
# broadcast, a slice read in place), or they only name a layout, a value or the end of a body.
_FOLDED = {"stablehlo.constant", "stablehlo.iota", "stablehlo.broadcast_in_dim", "stablehlo.slice",
           "stablehlo.dynamic_slice", "sdy.sharding_constraint", "stablehlo.optimization_barrier",
           "stablehlo.get_tuple_element", "stablehlo.tuple", "stablehlo.return"}

# A dynamic slice reads only its piece, and XLA updates a buffer in place (a scanned layer's
# parameters read from their stack, its saved activations written into theirs, once per trip).
_IN_PLACE = {"stablehlo.dynamic_slice", "stablehlo.dynamic_update_slice"}


@dataclass(frozen=True)
class Kernels:
    """A step's nodes as XLA fuses them (`fused_kernels`): what launches and traffic are read from."""

    of: tuple[int, ...]  # node id → its kernel (numbered from 0)
    rows: frozenset[int]  # the row reductions fused with their readers (`_lone_row_reductions`)


def fused_kernels(graph: Graph, rows_fused: bool = False) -> Kernels:
    """The kernel of each node, as XLA fuses: a fusible op joins the kernel of the fusible op or
    reduction that reads it (`_fusion_edge`), which XLA's multi-output fusion writes all at once
    (an Adam update's three results), unless that would put into one kernel ops that a kernel
    outside it runs between: a kernel cannot both feed a matmul and read its product. A scalar, or a broadcast of one, read by many is made again in
    each reader's kernel (`_copied`) and joins none. Each op's wave counts the kernel boundaries
    on the longest path before it (a read that is not fused: a matmul's operand, a reduction's
    result); a fusible op whose readers all fuse it waits for the earliest of them (a moment's
    `b1 * mu` runs in the kernel that adds the gradient's share to it). Ops join only within a
    wave, so no kernel runs another one inside it. `rows_fused`: a reduction along its operand's
    last dimension (`_lone_row_reductions`) is read by its fusible readers as a fusible op is."""
    made_by = {r: n.id for n in graph.nodes for r in n.results}
    producers = [[made_by[o] for o in dict.fromkeys(n.operands) if o in made_by] for n in graph.nodes]
    readers: list[list[int]] = [[] for _ in graph.nodes]
    for n in graph.nodes:
        for p in producers[n.id]:
            readers[p].append(n.id)
    rows = _lone_row_reductions(graph) if rows_fused else frozenset()
    fused = {(p, n.id): _fusion_edge(graph.nodes[p], n, graph, rows) for n in graph.nodes for p in producers[n.id]}
    wave = [0] * len(graph.nodes)
    for n in graph.nodes:  # program order: as early as its operands allow
        wave[n.id] = max((wave[p] + (not (fused[p, n.id] or _remade(graph.nodes[p], graph)))
                          for p in producers[n.id]), default=0)
    outputs = {made_by[o] for o in graph.outputs if o in made_by}
    for n in reversed(graph.nodes):  # as late as its readers allow, where every reader fuses it
        if n.id not in outputs and readers[n.id] and all(fused[n.id, m] for m in readers[n.id]):
            wave[n.id] = max(wave[n.id], min(wave[m] for m in readers[n.id]))
    return Kernels(graph.parts((p, n) for (p, n), edge in fused.items() if edge and wave[p] == wave[n]), rows)


def _fusion_edge(producer: Node, reader: Node, graph: Graph, rows: frozenset[int] = frozenset()) -> bool:
    """The reader may run the producer inside its own kernel: a fusible op read by a fusible op
    or a reduction (not a scalar, `_copied`, which each reader makes again); also a reduction of
    `rows` (`_lone_row_reductions`) read by a fusible op."""
    if producer.id in rows:
        return reader.op in FUSIBLE
    return reader.op in FUSED_READERS and producer.op in FUSIBLE and not _copied(producer, graph)


def _lone_row_reductions(graph: Graph) -> frozenset[int]:
    """The reductions along their operand's last dimension that Triton fuses with their readers
    (the module's docstring): those whose result, before it is broadcast back along the row, is
    not combined with another reduction's (a layer norm's variance, its mean of squares less its
    squared mean, joins two: XLA leaves both apart; a softmax's max and sum, an RMS norm's mean,
    each stand alone)."""
    of: dict[int, frozenset[int]] = {}  # value → the row reductions whose result it still is, reduced
    combined: set[int] = set()
    row = set()
    for n in graph.nodes:
        if n.op == "stablehlo.reduce":
            rank = len(graph.values[n.operands[0]].shape)
            if rank and list(n.attrs.get("dims", ())) == [rank - 1]:
                row.add(n.id)
                of.update((r, frozenset({n.id})) for r in n.results)
            continue
        if n.op not in FUSIBLE or not n.results:
            continue
        size = _elements(graph.values[n.results[0]].shape)
        found = frozenset().union(*(of[o] for o in n.operands
                                    if o in of and _elements(graph.values[o].shape) == size))
        if len(found) > 1:
            combined |= found
        if found:
            of[n.results[0]] = found
    return frozenset(row - combined)


def _elements(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def kernel_launches(graph: Graph, kernels: Kernels) -> dict[int, int]:
    """Kernels each node launches: the last node of each kernel in program
    order launches it. A kernel of views, constants and scalar arithmetic alone (a broadcast, a
    bitcast, a sharding constraint, a step count's power) launches none: XLA folds it into its
    readers."""
    members: dict[int, list[Node]] = {}
    for n, k in zip(graph.nodes, kernels.of):
        members.setdefault(k, []).append(n)
    out = dict.fromkeys((n.id for n in graph.nodes), 0)
    for nodes in members.values():
        if any(not (m.op in _FOLDED or _bitcast(m, graph) or _scalar(m, graph)) for m in nodes):
            out[max(m.id for m in nodes)] = 1
    return out


def memory_traffic(graph: Graph, kernels: Kernels) -> dict[int, int]:
    """Bytes each node moves to and from device memory once XLA has fused it into `kernels`:
    a kernel reads each value made outside it once (at its first reader) and writes only results
    read outside it (a value copied into each reader, `_copied`, is made again there: neither)."""
    kernel, rows = kernels.of, kernels.rows
    made_by = {r: n for n in graph.nodes for r in n.results}

    def inside(producer: Node | None, reader: Node) -> bool:
        """The value passes from producer to reader without reaching memory."""
        if producer is None:
            return False
        if kernel[producer.id] == kernel[reader.id] and _fusion_edge(producer, reader, graph, rows):
            return True
        return reader.op in FUSED_READERS and _remade(producer, graph)

    written = set(graph.outputs)
    for n in graph.nodes:
        written.update(o for o in n.operands if not inside(made_by.get(o), n))
    readers: dict[int, list[Node]] = {}
    for n in graph.nodes:
        for o in dict.fromkeys(n.operands):
            readers.setdefault(o, []).append(n)
    traffic = {}
    loaded: set[tuple[int, int]] = set()  # (kernel, value): a kernel reads a value once, at its first reader

    def load(n: Node, o: int) -> bool:
        if inside(made_by.get(o), n) or (kernel[n.id], o) in loaded:
            return False
        loaded.add((kernel[n.id], o))
        return True

    for n in graph.nodes:
        if _bitcast(n, graph):  # a view: its kernel reads what it views, where a reader of it is inside
            read_here = any(inside(n, m) for r in n.results for m in readers.get(r, ()))
            traffic[n.id] = sum(graph.values[o].nbytes for o in dict.fromkeys(n.operands) if read_here and load(n, o))
            continue
        if n.op in _IN_PLACE:  # touches only the piece it reads or writes
            piece = graph.values[n.results[0] if n.op == "stablehlo.dynamic_slice" else n.operands[1]].nbytes
            traffic[n.id] = 2 * piece
            continue
        reads = [o for o in dict.fromkeys(n.operands) if load(n, o)]
        writes = [r for r in n.results if r in written or (n.op not in FUSIBLE and r not in readers)]
        traffic[n.id] = sum(graph.values[v].nbytes for v in reads + writes)
    return traffic


def _scalar(node: Node, graph: Graph) -> bool:
    """Arithmetic on scalars alone (a learning rate's schedule, Adam's bias correction), which XLA
    computes inside each kernel that reads its result."""
    return all(not graph.values[v].shape for v in node.operands + node.results)


def _copied(node: Node, graph: Graph) -> bool:
    """A value XLA makes again inside each kernel that reads it rather than joining their kernels:
    a scalar, a constant, an iota, a broadcast of a scalar."""
    if not graph.values[node.results[0]].shape or node.op in ("stablehlo.constant", "stablehlo.iota"):
        return True
    return node.op == "stablehlo.broadcast_in_dim" and not graph.values[node.operands[0]].shape


def _remade(node: Node, graph: Graph) -> bool:
    """A fusible value each reader's kernel makes again (`_copied`): read without a boundary. A
    scalar a reduction made (a global norm) is read from memory, after the reduction's kernel."""
    return node.op in FUSIBLE and _copied(node, graph)


def _bitcast(node: Node, graph: Graph) -> bool:
    """A reshape or broadcast that only drops or adds size-1 dims (a scanned layer's slice of its
    stack, and the piece it writes back) keeps every element where it is: XLA makes it a bitcast."""
    if node.op not in ("stablehlo.reshape", "stablehlo.broadcast_in_dim"):
        return False
    src, dst = graph.values[node.operands[0]].shape, graph.values[node.results[0]].shape
    if node.op == "stablehlo.broadcast_in_dim" and list(node.attrs["dims"]) != sorted(node.attrs["dims"]):
        return False  # it transposes
    return tuple(d for d in src if d != 1) == tuple(d for d in dst if d != 1)
