"""Ties broken the way a person would write the plan.

The ILP is indifferent among plans of equal predicted step; its solver returns whichever it met
first, so two alike layers, two optimizer moments of one parameter or two pipeline stages could
come out in different layouts, and a reader could not tell a choice from a tie. So each group
that holds an argument or an output (what a reader of the plan sees) ranks its strategies, and
pays `TIE_S` per rank: far below any difference the cost model means (a hundredth of a
nanosecond a rank), far above the solver's tolerances on the scaled objective. Of tied plans the
solver then returns the one whose arguments and outputs are, in order:

1. the least memory a device holds of them (Rajbhandari et al., "ZeRO: Memory Optimizations
   Toward Training Trillion Parameter Models" §5.1: optimizer states split across the devices
   cost no more time than replicated ones where no collective of their own is added);
2. split along their leading dims first, without strides (the layout FSDP writes).

Every group ranks alike, so tensors of one shape tied alike (a parameter and its optimizer
moments, the same weight in two layers or two stages' programs) take one layout. Ranks work as
costs, so a tie settled by moving several groups together (a moment and the update that reads it)
is settled too. A solve stopped at its gap or its time limit may leave a tie unbroken.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from rhino_jax.core.specs import ShardingSpec

from ..hlo_passes.graph import Graph
from .solvers.ilp import Problem
from .space.strategies import Strategy
from .space.units import Unit

TIE_S = 1e-11  # seconds per rank of a tied strategy
SAME_STEP = 1e-6  # two plans whose predicted steps differ by less than this share of the step tie


def seen(units: list[Unit], members: Sequence[int], choices: list[dict[int, Strategy]], graph: Graph,
         sizes: dict[str, int]) -> list[list[tuple[int, ShardingSpec]]]:
    """Per strategy of a cone (`choices`, each over its `members`), the (local bytes, layout) of
    each argument and output it makes: what a reader of the plan sees, and what is ranked. Most
    cones hold neither: theirs are empty without a look at their strategies."""
    shown = {m for m in members if units[m].kind in ("arg", "output")}
    if not shown:
        return [[] for _ in choices]
    out = []
    for choice in choices:
        held = []
        for m, s in choice.items():
            if m in shown:
                u = units[m]
                v, spec = (u.results[0], s.results[0]) if u.kind == "arg" else (u.operands[0], s.operands[0])
                held.append((graph.values[v].nbytes // spec.shard_factor(sizes), spec))
        out.append(held)
    return out


def spec_order(spec: ShardingSpec) -> tuple:
    """Lower first: splits on the leading dims, then no strides."""
    return tuple((not axes, axes) for axes in spec.dims), spec.strides


def rank_by_preference(keys: list[tuple]) -> np.ndarray:
    """Each strategy's rank among its group's (equal keys, equal ranks)."""
    order = {k: r for r, k in enumerate(sorted(set(keys)))}
    return np.array([order[k] for k in keys], dtype=float)


def with_preferences(problem: Problem, seen: list[list[list[tuple[int, ShardingSpec]]]]) -> Problem:
    """`problem` with each group's strategies ranked (the module's docstring). `seen[g][j]`: the
    (local bytes, layout) of each argument and output group g holds under strategy j, in one
    order for every j; empty for a group that holds none."""
    costs = []
    for c, held in zip(problem.costs, seen):
        if not held or not held[0]:
            costs.append(c)
            continue
        keys = [(sum(b for b, _ in h), tuple(spec_order(s) for _, s in h)) for h in held]
        costs.append(c + TIE_S * rank_by_preference(keys))
    return dataclasses.replace(problem, costs=tuple(costs))
