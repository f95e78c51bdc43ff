"""Pipeline stages (Rhino §5): which of d stages each node of a DAG runs in.

The ILP: x[i, k] = 1 puts node i in stage k, and B_i = Σ_k k·x[i, k] is its stage. A consumer
never runs in an earlier stage than its producer (B_j ≥ B_i on each edge), so stages follow the
graph's topology, not a linear order: a skip connection may span several stages. F_e marks a
cut edge by big-M, F_e ≤ B_j − B_i ≤ (d − 1)·F_e, and the objective is the bytes of the cut
edges. Each stage computes within ε of a balanced share T = Σ c / d: (1 − ε)T ≤ Σ_i c_i·x[i, k]
≤ (1 + ε)T.

Bound tightening (§5.2): a node's ancestors run in its stage or before, its descendants in its
stage or after. With at most (1 + ε)T per stage, stages 0..B_i hold A_i + c_i (A_i: the compute
of i's ancestors) and stages B_i..d−1 hold c_i + D_i (D_i: of its descendants), so
    ⌈(A_i + c_i) / ((1 + ε)T)⌉ − 1 ≤ B_i ≤ d − ⌈(c_i + D_i) / ((1 + ε)T)⌉.
Rhino writes the tolerance in stages (B_i ≥ ⌊A_i/T − ε⌋); stated as the balance constraint's
capacity, the bounds are implied by it: they never change the optimum, and they remove every x
outside a node's window, most of them on a long graph.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import scipy.sparse

from rhino_jax.errors import SolverError, StagingError

from ...hlo_passes.graph import Graph
from ..coarsening.critical import backbone
from ..solvers import ilp, solver_process
from ..space.constraints import SHARED

_AFTER_SHARED = -2  # `forward_stage_graph`'s label of an unnamed op after ops of every device


@dataclass(frozen=True)
class StageGraph:
    """What the stager sees: nodes with their compute, edges with the bytes they carry."""

    compute: tuple[float, ...]  # per node (FLOPs or seconds: only ratios matter)
    edges: tuple[tuple[int, int, float], ...]  # (producer, consumer, bytes)
    names: tuple[str, ...] = ()


@dataclass(frozen=True)
class Staging:
    stage: tuple[int, ...]  # per node
    cut_bytes: float
    stage_compute: tuple[float, ...]  # per stage
    status: str  # "optimal" | "feasible" (time limit)
    solve_s: float
    num_vars: int
    num_constraints: int


def _order(g: StageGraph) -> list[int]:
    """A topological order of the nodes; a cycle is an error."""
    n = len(g.compute)
    preds_left = [0] * n
    succs: list[list[int]] = [[] for _ in range(n)]
    for s, d, _ in g.edges:
        if not (0 <= s < n and 0 <= d < n) or s == d:
            raise StagingError(f"edge ({s}, {d}) does not join two distinct nodes of the {n}")
        succs[s].append(d)
        preds_left[d] += 1
    ready = [i for i in range(n) if not preds_left[i]]
    order = []
    while ready:
        i = ready.pop()
        order.append(i)
        for j in succs[i]:
            preds_left[j] -= 1
            if not preds_left[j]:
                ready.append(j)
    if len(order) < n:
        raise StagingError("the stage graph has a cycle: stages need a DAG (an op_assign that takes some ops "
                           "from between others of one segment, which then feed each other, makes one; widen "
                           "its glob to whole layers)")
    return order


def ancestors(g: StageGraph) -> np.ndarray:
    """[i, j]: node j is an ancestor of node i."""
    n = len(g.compute)
    preds: list[list[int]] = [[] for _ in range(n)]
    for s, d, _ in g.edges:
        preds[d].append(s)
    found = np.zeros((n, n), dtype=bool)
    for i in _order(g):
        for p in preds[i]:
            found[i] |= found[p]
            found[i, p] = True
    return found


def reach_compute(g: StageGraph) -> tuple[np.ndarray, np.ndarray]:
    """(A, D): per node, the compute of its ancestors and of its descendants (each counted once,
    however many paths lead there)."""
    above = ancestors(g)
    c = np.asarray(g.compute, dtype=float)
    return above @ c, above.T @ c


def bounds(g: StageGraph, stages: int, epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """Each node's earliest and latest stage implied by balance within ε (§5.2, see above)."""
    c = np.asarray(g.compute, dtype=float)
    cap = (1 + epsilon) * c.sum() / stages
    before, after = reach_compute(g)
    lo = np.ceil((before + c) / cap - 1e-9).astype(int) - 1
    hi = stages - np.ceil((c + after) / cap - 1e-9).astype(int)
    return np.maximum(lo, 0), np.minimum(hi, stages - 1)


def stage(g: StageGraph, stages: int, epsilon: float = 0.1, *, tighten: bool = True,
          backend: str = "HIGHS", time_limit_s: float = 60.0,
          advice: str = "raise epsilon or use fewer stages", fixed: dict[int, int] | None = None,
          shared: frozenset[int] = frozenset()) -> Staging:
    """The division of g into `stages` stages balanced within `epsilon` that cuts the fewest bytes.
    `advice`: what an unbalanceable graph's error tells the caller to change (a caller whose
    user cannot change epsilon says what they can). `fixed`: node → the stage it must run in
    (the user's `op_assign`), where the balance's bounds allow it.

    `shared`: nodes that run on every device, between the stages (`op_assign(stage="all")`, the
    interlaced pipeline). Then the division is into 2·stages + 1 slots: stage k is slot 2k + 1,
    and the even slots, before, between and after the stages, run on every device, unbalanced;
    a shared node goes in an even slot, another node in a stage or, after a shared node there,
    in the last slot (`_after_shared`). `Staging.stage` holds slots; the balance counts the
    stages' nodes."""
    start = time.perf_counter()
    n, d = len(g.compute), stages
    if d < 1 or d > n - len(shared):
        nodes = f" ({'; '.join(g.names)})" if g.names and any(g.names) else ""  # a loop says to unroll it
        raise StagingError(f"{d} stages for a graph of {n - len(shared)} nodes{nodes}: use between 1 and "
                           f"{n - len(shared)} stages")
    if epsilon < 0:
        raise StagingError(f"epsilon (the imbalance allowed between stages) must be >= 0, got {epsilon}")
    c = np.asarray(g.compute, dtype=float)
    staged = np.array([i not in shared for i in range(n)])
    share = c[staged].sum() / d
    if not share > 0:
        raise StagingError("the stage graph computes nothing: there is nothing to balance")
    _order(g)
    slots = 2 * d + 1 if shared else d
    slot_of = (lambda k: 2 * k + 1) if shared else (lambda k: k)  # stage k's slot
    if shared or not tighten:  # with unbalanced slots the bounds below do not hold
        lo, hi = np.zeros(n, dtype=int), np.full(n, slots - 1)
    else:
        lo, hi = bounds(g, d, epsilon)
    heaviest = int(np.argmax(np.where(staged, c, -1.0)))
    if c[heaviest] > (1 + epsilon) * share:
        name = g.names[heaviest] if g.names else f"node {heaviest}"
        raise StagingError(f"no division into {d} stages within epsilon={epsilon:g} of a balanced share: {name} "
                           f"alone computes {c[heaviest] / share:.2f} shares; {advice}")
    for i, k in (fixed or {}).items():
        if not lo[i] <= slot_of(k) <= hi[i]:
            name = g.names[i] if g.names and g.names[i] else f"node {i}"
            raise StagingError(f"no division into {d} stages within epsilon={epsilon:g} of a balanced share puts "
                               f"{name} on stage {k} (it may run in stages {lo[i]}..{hi[i]}); {advice}")
        lo[i] = hi[i] = slot_of(k)
    if (lo > hi).any():
        stuck = int(np.argmax(lo > hi))
        name = g.names[stuck] if g.names and g.names[stuck] else f"node {stuck}"
        raise StagingError(f"no division into {d} stages within epsilon={epsilon:g} of a balanced share: the "
                           f"graph's dependencies leave {name} no stage; {advice}")

    # Variables: x[i, k] for slots k in lo_i..hi_i, then F_e per edge.
    width = hi - lo + 1
    x_at = np.concatenate([[0], np.cumsum(width)])
    f_at = int(x_at[-1])
    n_vars = f_at + len(g.edges)
    upper = np.ones(n_vars)
    for i in range(n) if shared else ():  # a shared node in an even slot, another in a stage or the last slot
        barred = np.arange(1, slots, 2) if i in shared else np.arange(0, slots - 1, 2)
        upper[x_at[i] + barred - lo[i]] = 0.0
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    row_lo: list[float] = []
    row_hi: list[float] = []

    def stage_terms(i: int, sign: float):
        """B_i's terms: Σ_k k·x[i, k]."""
        ks = np.arange(lo[i], hi[i] + 1)
        return x_at[i] + (ks - lo[i]), sign * ks.astype(float)

    def add_row(terms: list[tuple[np.ndarray, np.ndarray]], low: float, high: float):
        r = len(row_lo)
        for cs, vs in terms:
            rows.append(np.full(len(cs), r))
            cols.append(np.asarray(cs))
            vals.append(np.asarray(vs, dtype=float))
        row_lo.append(low)
        row_hi.append(high)

    for i in range(n):  # one stage per node
        add_row([(x_at[i] + np.arange(width[i]), np.ones(width[i]))], 1.0, 1.0)
    for e, (s, t, _) in enumerate(g.edges):
        diff = [stage_terms(t, 1.0), stage_terms(s, -1.0)]
        add_row(diff + [(np.array([f_at + e]), np.array([-1.0]))], 0.0, np.inf)  # F ≤ B_t − B_s (so B_t ≥ B_s)
        add_row(diff + [(np.array([f_at + e]), np.array([-(slots - 1.0)]))], -np.inf, 0.0)  # B_t − B_s ≤ (D−1)F
    last = slots - 1
    for i, beside in (_after_shared(g, shared) if shared else {}).items():  # x[i, last] ≤ Σ x[j, last]
        add_row([(np.array([x_at[i] + last - lo[i]]), np.ones(1)),
                 (np.array([x_at[j] + last - lo[j] for j in beside], dtype=int), -np.ones(len(beside)))],
                -np.inf, 0.0)
    for k in map(slot_of, range(d)):  # balance, in shares; and no stage empty (a tolerance of a share allows one)
        members = [i for i in range(n) if lo[i] <= k <= hi[i] and i not in shared]
        at = np.array([x_at[i] + k - lo[i] for i in members], dtype=int)
        add_row([(at, np.array([c[i] / share for i in members]))], 1.0 - epsilon, 1.0 + epsilon)
        add_row([(at, np.ones(len(members)))], 1.0, np.inf)
    weight = np.array([b for _, _, b in g.edges], dtype=float)
    objective = np.zeros(n_vars)
    objective[f_at:] = weight / max(weight.max(initial=0.0), 1.0)
    matrix = scipy.sparse.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                                     shape=(len(row_lo), n_vars))
    program = solver_process.Program(objective, matrix, np.array(row_lo), np.array(row_hi), np.zeros(n_vars),
                                     upper, integer=np.arange(n_vars))
    ilp.check_backend(backend)
    # Ctrl-C propagates: no plan exists before the stages are chosen.
    result = ilp.run(program, backend, time_limit_s - (time.perf_counter() - start))
    if result.status == "INFEASIBLE":
        raise StagingError(f"no division of {n} nodes into {d} stages within epsilon={epsilon:g} of a balanced "
                           f"share; {advice}")
    if result.status not in ("OPTIMAL", "FEASIBLE"):
        raise SolverError(f"the stage ILP found no division within its {time_limit_s:g} s time limit "
                          f"({result.status}); raise the time limit or epsilon")
    values = result.values
    assignment = tuple(int(lo[i] + np.argmax(values[x_at[i]:x_at[i + 1]])) for i in range(n))
    per_stage = np.zeros(d)
    for i, k in enumerate(assignment):
        if not shared or k % 2:
            per_stage[k // 2 if shared else k] += c[i]
    cut = float(sum(b for s, t, b in g.edges if assignment[s] != assignment[t]))
    return Staging(assignment, cut, tuple(per_stage.tolist()),
                   "optimal" if result.status == "OPTIMAL" else "feasible",
                   time.perf_counter() - start, n_vars, len(row_lo))


def _after_shared(g: StageGraph, shared: frozenset[int]) -> dict[int, list[int]]:
    """Node (not shared) → the shared nodes it depends on: it may run on every device after the
    last stage only beside one of them there. The user named the shared nodes and left the others
    to the stages, so another node runs on every device only where no stage can run it: after a
    shared node that runs after every stage (the loss after a shared output projection). An op
    that merely reads a shared op's result (the first block's norm, after the lookup) stays on a
    stage, and where the balance then leaves no division the caller relaxes the balance rather
    than move it. (An op between two shared ops of one segment is shared itself,
    `forward_stage_graph`.)"""
    above = ancestors(g)
    return {i: [j for j in sorted(shared) if above[i, j]] for i in range(len(g.compute)) if i not in shared}


def forward_ops(graph: Graph, loss: int) -> set[int]:
    """The ops the loss (value id) depends on: the forward pass."""
    producer = {r: n.id for n in graph.nodes for r in n.results}
    forward: set[int] = set()
    stack = [producer[loss]] if loss in producer else []
    while stack:
        i = stack.pop()
        if i in forward:
            continue
        forward.add(i)
        stack.extend(producer[o] for o in graph.nodes[i].operands if o in producer)
    if not forward:
        raise StagingError("the loss depends on no op: there is no forward pass to divide into stages")
    return forward


def forward_stage_graph(graph: Graph, loss: int, apart: dict[int, int] | None = None,
                        leave_out: frozenset[int] = frozenset(), repeats: dict[int, int] | None = None
                        ) -> tuple[StageGraph, dict[int, int]]:
    """The forward pass of a train step as a stage graph, and each forward op's node: the ops the
    loss (value id) depends on, coarsened by the backbone's segments (each opened by a critical
    node: a compute-heavy op on the critical path, `critical`). Compute is FLOPs; an edge carries
    the bytes of the values one segment reads from another (a value read twice, once). `apart`:
    op → a label (the stage the user assigns it, `constraints.SHARED` for every device); ops of
    one segment with other labels are other nodes, so an assignment moves its ops and what they
    feed in their segment (a stage's rather than every device's), nothing before them.
    `leave_out`: forward ops the stager does not see (a multi-forward step's earlier passes,
    `passes`); `repeats`: op → how many times it runs per micro-batch (its compute counts so)."""
    forward = forward_ops(graph, loss) - leave_out
    producer = {r: n.id for n in graph.nodes for r in n.results}
    segment = backbone(graph).segment
    label = dict(apart or {})
    if label:  # an op reading a labelled op of its segment goes with it (its unnamed reshapes, its adds)
        for i in sorted(forward):  # program order: producers first
            if i not in label:
                found = [label[producer[o]] for o in graph.nodes[i].operands
                         if o in producer and producer[o] in label and segment[producer[o]] == segment[i]]
                if found:  # after ops of every device only: a node of its own, which the stager places
                    label[i] = max(found) if max(found) >= 0 else _AFTER_SHARED
        readers = graph.consumers()
        for i in sorted(forward, reverse=True):  # an op between two of every device's runs there too
            if label.get(i) == _AFTER_SHARED and any(label.get(c) == SHARED and segment[c] == segment[i]
                                                     for r in graph.nodes[i].results for c in readers[r]):
                label[i] = SHARED
    node_of_segment: dict[tuple, int] = {}
    key = {i: (segment[i], label.get(i)) for i in forward}
    for i in sorted(forward):
        node_of_segment.setdefault(key[i], len(node_of_segment))
    node = {i: node_of_segment[key[i]] for i in forward}
    compute = [0.0] * len(node_of_segment)
    names = [""] * len(node_of_segment)
    for i in sorted(forward):
        compute[node[i]] += graph.nodes[i].flops * (repeats or {}).get(i, 1)
        names[node[i]] = names[node[i]] or graph.nodes[i].name
    for i in forward:  # a loop is never cut: say so where it is what cannot be balanced
        if graph.nodes[i].op == "stablehlo.while":
            names[node[i]] = (f"the loop {graph.nodes[i].name or 'while'} (a loop runs whole in one stage; to "
                              "pipeline a scan over layers, unroll it: a Python loop, or nn.scan/lax.scan unroll)")
    crossing: dict[tuple[int, int], dict[int, None]] = defaultdict(dict)
    for i in forward:
        for o in graph.nodes[i].operands:
            if o in producer and producer[o] in forward and node[producer[o]] != node[i]:
                crossing[node[producer[o]], node[i]][o] = None
    edges = tuple((s, t, float(sum(graph.values[v].nbytes for v in vs))) for (s, t), vs in sorted(crossing.items()))
    return StageGraph(tuple(compute), edges, tuple(names)), node
