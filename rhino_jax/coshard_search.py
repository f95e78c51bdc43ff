"""Co-shard's choices, searched (`rj.coshard`): how many chunks, and on which dim each group of
named ops is cut (`search.space.coshard` cuts, `hlo_passes.chunking` rewrites).

The plan without chunks is searched first: each group is cut on the dim of its largest value
that plan splits least over the mesh (chunks of a dim the devices already split would leave
each device uneven pieces). Each candidate number of chunks (the user's, or with "auto" 1, 2,
4, ... up to `MAX_AUTO`) rewrites the step and searches it again: the cost model prices the
chunks' ops and their slices and sums, and its memory model sees one chunk live at a time. The
fastest plan within `memory_limit_bytes` wins; a number of chunks the user fixed is refused where
its plan is predicted to hold no less than the plan without (chunks cost time to save memory),
and every coshard on a jax whose XLA does not keep the chunks in order (`ORDERED_FROM`).
Its choices are kept in the plan's `execution` (`CoshardCut`), so that a saved plan cuts the step
the same way when loaded (`replay`).
"""
from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh

from rhino_jax.core.diagnostics import CoshardCandidate
from rhino_jax.core.plan import CoshardCut, Plan
from rhino_jax.errors import ConstraintError, MemoryLimitError, SolverError
from rhino_jax.search.space import coshard as cut
from rhino_jax.hlo_passes.chunking import Chunking, chunk
from rhino_jax.hlo_passes.graph import Graph
from rhino_jax.hlo_passes.lowering import LoweredStep, import_step
from rhino_jax.search import progress
from rhino_jax.search.space.constraints import CoShard
from rhino_jax.search.cost.cluster import Cluster, MeshTopology

from .mesh_search import plan_on
from .options import Options, budget_of, within

MAX_AUTO = 16  # the most chunks "auto" tries
# The first jax whose XLA keeps the chunks in order: the optimization barriers between them are
# still there when it schedules the program. Measured on the CPU compiler with 4 chunks of an
# LM's attention: jax 0.10.2 and 0.11.0 drop them first and run the chunks side by side
# (1.12-1.22x the temporaries of no chunks); jax 0.12.0.1 runs them in turn (0.38-0.41x).
ORDERED_FROM = (0, 12)


def plan_with_coshards(step: LoweredStep, graph: Graph, mesh: Mesh, cluster: Cluster, options: Options
                       ) -> tuple[LoweredStep, Graph, Plan]:
    """The step (rewritten), its graph and the fastest plan within the memory limit over the
    candidate numbers of chunks; a plain search when `options` has no `rj.coshard`."""
    coshards = [c for c in options.constraints if isinstance(c, CoShard)]
    topo = MeshTopology.from_mesh(mesh, cluster)
    if not coshards:
        return step, graph, plan_on(graph, topo, cluster, options, mesh)
    options = dataclasses.replace(options, constraints=tuple(c for c in options.constraints if c not in coshards))
    groups = _groups(coshards, graph)
    counts = _candidates(coshards)
    budget = budget_of(options, len(counts) + 1)
    progress.say("rhino_jax: co-shard: the plan without chunks, then %s chunks",
                 " / ".join(str(n) for n in counts if n > 1))
    free = plan_on(graph, topo, cluster, dataclasses.replace(within(options, budget, 1, "the plan without chunks"),
                                                             memory_limit_bytes=None), mesh)
    tried, error = [], None
    for n in counts:
        if n == 1:
            if options.memory_limit_bytes is None or free.cost.memory_bytes <= options.memory_limit_bytes:
                tried.append((step, graph, free, ()))
            continue
        try:
            cuts = _cuts(groups, graph, free, topo, n)
        except ConstraintError:
            if len(counts) == 1:  # the user's number of chunks
                raise
            continue  # "auto": a number no group's dims divide is not a candidate
        _refuse_unordered(coshards)
        cut_step, cut_graph = _rewritten(step, graph, [c for _, c in cuts])
        try:
            plan = plan_on(cut_graph, topo, cluster, within(options, budget, 1, f"{n} chunks"), mesh)
        except (MemoryLimitError, SolverError) as e:  # no plan within the limit (in its share of the time)
            error = e
            continue
        tried.append((cut_step, cut_graph, plan, tuple(choice for choice, _ in cuts)))
    if not tried:
        raise error if error is not None else MemoryLimitError(
            f"no number of chunks of {', '.join(map(str, coshards))} brings the plan within memory_limit_bytes")
    step, graph, plan, choices = min(tried, key=lambda t: t[2].cost.total_s)
    if choices and plan.cost.memory_bytes >= free.cost.memory_bytes:
        raise ConstraintError(_saves_nothing(coshards, counts, plan, free))
    stats = dataclasses.replace(plan.search_stats, coshard_candidates=tuple(
        CoshardCandidate(t[3][0].chunks if t[3] else 1, t[2].cost.total_s, t[2].cost.memory_bytes) for t in tried))
    return step, graph, dataclasses.replace(plan, search_stats=stats,
                                            execution=dataclasses.replace(plan.execution, coshard=choices))


def _refuse_unordered(coshards: list[CoShard]) -> None:
    """Chunks that XLA runs side by side hold more than no chunks: refused where it would."""
    if tuple(int(p) for p in jax.__version__.split(".")[:2]) < ORDERED_FROM:
        raise ConstraintError(
            f"{', '.join(map(str, coshards))}: co-shard needs jax {'.'.join(map(str, ORDERED_FROM))} or newer. The "
            f"XLA of jax {jax.__version__} drops the optimization barriers that run the chunks one after another "
            "before it schedules the program, so the chunks run side by side and hold more memory than no chunks "
            "(measured on its CPU compiler: 1.12-1.22x with jax 0.10.2 and 0.11.0). Upgrade jax and jaxlib, or "
            "leave the coshard out")


def _saves_nothing(coshards: list[CoShard], counts: list[int], plan: Plan, free: Plan) -> str:
    """Why a number of chunks the user fixed is refused: its plan holds no less than the plan without."""
    return (f"{', '.join(map(str, coshards))}: the plan in {counts[0]} chunks is predicted to hold "
            f"{plan.cost.memory_bytes / 2**20:.1f} MiB per device, the plan without chunks "
            f"{free.cost.memory_bytes / 2**20:.1f} MiB: chunking these ops saves no memory here (what they make and "
            "drop is small beside what they read or let out). Leave the coshard out, name the ops whose "
            "temporaries are the step's largest (the attention scores), or pass chunks='auto' to let the search "
            "keep the plan without chunks")


def replay(step: LoweredStep, graph: Graph, plan: Plan, constraints) -> tuple[LoweredStep, Graph]:
    """The step cut as the saved `plan` recorded (`CoshardCut`s), for the plan to run on."""
    saved = plan.execution.coshard
    if not saved:
        return step, graph
    coshards = [c for c in constraints if isinstance(c, CoShard)]
    groups = dict((str(c), mine) for c, mine in _groups(coshards, graph))
    cuts = []
    for choice in saved:
        if choice.constraint not in groups or choice.group >= len(groups[choice.constraint]):
            raise ConstraintError(f"the plan was made with {choice.constraint}: pass it in constraints= again, so "
                                  "that the step is cut as the plan expects")
        mine = groups[choice.constraint]
        found = [c for c in _options(graph, mine, choice.group, choice.chunks, choice.recompute)
                 if c.dims[c.seed] == choice.dim]
        if not found:
            raise ConstraintError(f"the saved plan cuts the ops from {graph.nodes[mine[choice.group][0]].name} on a "
                                  "dim this step cannot be cut on: plan again")
        cuts.append(found[0])
    return _rewritten(step, graph, cuts)


def _groups(coshards: list[CoShard], graph: Graph) -> list[tuple[CoShard, list[tuple[int, ...]]]]:
    """Each constraint's groups (`search.coshard.groups`); an op two constraints name is the first's."""
    claimed: set[int] = set()
    out = []
    for c in coshards:
        mine = [g for g in cut.groups(graph, lambda name, c=c: bool(name) and c.matches((name,)))
                if not claimed & set(g)]
        claimed.update(n for g in mine for n in g)
        out.append((c, mine))
    return out


def _candidates(coshards: list[CoShard]) -> list[int]:
    """The numbers of chunks to try: the users' (one number for all), or with "auto" 1 (none) and
    the powers of two up to `MAX_AUTO`."""
    fixed = {c.chunks for c in coshards if c.chunks != "auto"}
    if len(fixed) > 1 or fixed and any(c.chunks == "auto" for c in coshards):
        raise ConstraintError(f"{', '.join(map(str, coshards))}: give every coshard the same chunks (or all 'auto'); "
                              "cutting groups into different numbers is not searched yet")
    if fixed:
        return list(fixed)
    return [1] + [2 ** k for k in range(1, MAX_AUTO.bit_length())]


def _cuts(groups, graph: Graph, free: Plan, topo: MeshTopology, chunks: int) -> list[tuple[CoshardCut, Chunking]]:
    """Each group's cut into `chunks`: on the dim of its largest value the plan without chunks
    splits least (its largest piece per device), its chunks recomputing what they read from the
    earlier groups where they can. Groups no dim of which can be cut so stay whole; a constraint
    none of whose groups can is an error naming it and its first group."""
    out = []
    for c, mine in groups:
        found = []
        for k in range(len(mine)):
            for recompute in (True, False):
                options = _options(graph, mine, k, chunks, recompute)
                if options:
                    best = max(options, key=lambda o: _local(graph, free, topo, o))
                    found.append((CoshardCut(str(c), k, best.dims[best.seed], chunks, recompute), best))
                    break
        if not found:
            raise ConstraintError(_uncuttable(c, mine, graph, chunks))
        out += found
    return out


def _options(graph: Graph, groups: list[tuple[int, ...]], k: int, chunks: int, recompute: bool) -> list[Chunking]:
    """Group k's cuts into `chunks`, its chunks recomputing what they read from the earlier groups
    (co-shard with recomputation) or reading it whole."""
    copies = cut.recomputed(graph, groups, k) if recompute else ()
    if recompute and not copies or not cut.saves_memory(graph, groups[k], copies):
        return []
    return cut.chunkings(graph, groups[k], chunks, copies)


def _uncuttable(c: CoShard, groups: list[tuple[int, ...]], graph: Graph, chunks: int) -> str:
    if not groups:
        named = [n.name for n in graph.nodes if n.name and c.matches((n.name,))]
        return (f"{c} names no op that can run in chunks (ops with a sharding rule at the step's top level, not in "
                "loops or conditionals)" + (f": it names {len(named)} ops, none of them such" if named else
                                            ": it names arguments only (ops are named by their jax name stack, which "
                                            "Flax NNX modules do not extend: wrap the layer's code in "
                                            "`with jax.named_scope('attn'):`)")
                + "; name the ops of a layer, e.g. '*Block_*/MultiHeadDotProductAttention_0/*'")
    first = groups[0]
    if not any(cut.saves_memory(graph, g, cut.recomputed(graph, groups, k)) or cut.saves_memory(graph, g)
               for k, g in enumerate(groups)):
        return (f"{c}: none of the {len(groups)} groups of ops it names keeps to itself a value larger than what it "
                f"reads (the first: {len(first)} ops from {graph.nodes[first[0]].name!r}), so chunks would save no "
                "memory; name the ops whose temporaries are the step's largest, e.g. the attention's "
                "'*MultiHeadDotProductAttention_0/*'")
    big = max((r for n in first for r in graph.nodes[n].results), key=lambda v: graph.values[v].nbytes)
    return (f"{c}: none of the {len(groups)} groups of ops it names can be cut into {chunks} chunks: the first, "
            f"{len(first)} ops from {graph.nodes[first[0]].name!r}, has no dim of its largest value "
            f"{list(graph.values[big].shape)} that is divisible by {chunks} and that every op in it can be cut on "
            "(an op that needs the whole of a value the others make in chunks, e.g. a softmax over the cut dim). "
            "Choose fewer chunks, or name ops that share a batch-like dim (heads, batch)")


def _local(graph: Graph, free: Plan, topo: MeshTopology, chunking: Chunking) -> int:
    """How large one device's piece of the cut dim of the group's largest value is, in the plan
    without chunks."""
    shape = graph.values[chunking.seed].shape
    spec = free.value_specs.get(chunking.seed)
    return (shape if spec is None else spec.local_shape(shape, topo.sizes))[chunking.dims[chunking.seed]]


def _rewritten(step: LoweredStep, graph: Graph, cuts: list[Chunking]) -> tuple[LoweredStep, Graph]:
    module = chunk(step.module, graph, cuts)
    step = dataclasses.replace(step, module=module)
    return step, import_step(step)
