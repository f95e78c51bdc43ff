"""Stage programs alike enough to share one plan, so a pipeline searches each kind once.

A pipeline of a model whose layers repeat cuts stages that run the same program on the same
sub-mesh shape: 70B on 4 stages has two middle stages of 20 identical layers, on 8 stages six.
Searching each again costs the same and finds the same plan, so `pipeline=p` (and each of
`pipeline="auto"`'s candidates) searches one of them and gives the others its plan, renamed.

Two programs are alike when the search cannot tell them apart: the same StableHLO (its
fingerprint leaves out source locations, so layer names do not count), the same sub-mesh axes,
the same `rj.annotate` pins, arguments of the same roles holding the same state beside them, and
the same ops and arguments named by each `rj.op_trans` (a constraint that names one stage's
layer makes that stage differ). A plan names values by their position in the program, which
alike programs share; only the names it reports (argument paths, the ops its collectives serve)
are the other program's, and are mapped by position.
"""
from __future__ import annotations

import dataclasses

from rhino_jax.core.plan import Plan
from rhino_jax.hlo_passes.graph import Graph
from rhino_jax.search.space.constraints import OpTrans, arg_names


__all__ = ["alike_key", "renamed"]


def alike_key(kind: str, program: str, graph: Graph, axes: dict[str, int], constraints) -> tuple:
    """Equal for two programs exactly when one plan serves both (see the module docstring):
    `kind` "F", "B" or "A", `program` its StableHLO's fingerprint (`PlanTarget.program`)."""
    named = tuple((tuple(i for i, n in enumerate(graph.nodes) if n.name and c.matches((n.name,))),
                   tuple(i for i, a in enumerate(graph.args) if c.matches(arg_names(a.path))))
                  for c in constraints if isinstance(c, OpTrans))
    return (kind, program, tuple(axes.items()),
            tuple((p.value, p.dims) for p in graph.pins),
            tuple((a.role, a.held_beside, a.donated_to) for a in graph.args), graph.outputs_held_beside, named)


def renamed(plan: Plan, searched: Graph, graph: Graph, name: str) -> Plan:
    """The plan searched on `searched` (program `name`), for the alike program `graph`: its names
    are `graph`'s, and its search line says whose plan it is and took no time."""
    names = {a.path: b.path for a, b in zip(searched.args, graph.args)}
    names.update((a.name, b.name) for a, b in zip(searched.nodes, graph.nodes) if a.name)
    stats = dataclasses.replace(plan.search_stats, solve_s=0.0, build_s=0.0, plan_of=name, ilp_stages=(),
                                not_replicated=tuple(names.get(n, n) for n in plan.search_stats.not_replicated))
    return dataclasses.replace(
        plan, arg_paths=tuple(a.path for a in graph.args), output_paths=graph.output_paths,
        collectives=tuple(dataclasses.replace(c, where=names.get(c.where, c.where)) for c in plan.collectives),
        fallback_ops=tuple(names.get(op, op) for op in plan.fallback_ops), search_stats=stats)
