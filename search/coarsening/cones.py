"""Level 1 of Rhino's subgraph merging (§4.3.2): cone structures.

A cone root is a unit that reads several live tensors (or a compute-heavy op, an argument, a
returned value: every unit that may not join another). Walking back from each root, units that
read a single live tensor join the root's cone until another root is reached; a unit read by
several others joins the cone of its last reader. Inside a cone every member feeds exactly one
in-cone reader, so the cone is an in-tree, and for each strategy of its root a dynamic program
over the tree picks the members' strategies that minimise their compute plus the resharding
inside the cone. The cone becomes one unit of the ILP, with one strategy per root strategy; the
reads that enter or leave the cone stay exact edges of the ILP.

The DP cannot see the read that enters a cone, so an op whose input is larger than its output
(a reduction, a slice) would pick its layout for its small result and pay to move its large
input. Such ops join their producer's cone instead and read its layout at least cost (an
addition to Rhino, whose cones only grow backwards).
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from rhino_jax.core.specs import ShardingSpec

from ..space.strategies import Strategy


class ConeUnit(Protocol):
    operands: tuple[int, ...]
    results: tuple[int, ...]
    strategies: list[Strategy]
    live: tuple[int, ...]  # distinct operand values that come from other units
    join: str  # "reader" or "producer": the cone it may join (it reads one live tensor); or ""


@dataclass
class Cone:
    root: int
    members: list[int]  # unit indices, the root first
    choice: list[dict[int, Strategy]]  # per root strategy: unit index → its strategy
    signature: tuple | None = None  # groups of one signature are alike (`signature`), None: unknown


def find_cones(units: Sequence[ConeUnit], producer_unit: dict[int, int]
               ) -> tuple[dict[int, int], dict[int, int]]:
    """(unit → root of its cone, member → the reader that claimed it). Readers come after their
    producers, so one pass from the end claims each reader-joining producer for its last
    reader; a pass from the start then puts producer-joining units in their producer's cone."""
    root_of: dict[int, int] = {}
    claimed_by: dict[int, int] = {}
    for i in reversed(range(len(units))):
        if units[i].join == "producer":
            continue
        root = root_of.setdefault(i, i)
        for v in units[i].live:
            p = producer_unit[v]
            if p < i and units[p].join == "reader" and p not in root_of:
                root_of[p], claimed_by[p] = root, i
    for i, u in enumerate(units):
        if u.join == "producer":
            root_of[i] = root_of[producer_unit[u.live[0]]]
    return root_of, claimed_by


def build_cones(units: Sequence[ConeUnit], producer_unit: dict[int, int],
                own_cost: Callable[[int, Strategy], float],
                reshard_cost: Callable[[ShardingSpec, ShardingSpec, int], float],
                reads_cost: Callable[[int, list[ShardingSpec], list[list[ShardingSpec]]], np.ndarray],
                read_bytes: Callable[[ShardingSpec, int], int], check: Callable[[], None] = lambda: None,
                unit_key: Callable[[int], Hashable] | None = None, value_key: Callable[[int], Hashable] | None = None
                ) -> list[Cone]:
    """The cones of the graph, each with its strategies (one per root strategy, DP inside).
    `reshard_cost(src, dst, value)`: seconds of one move; `reads_cost(value, starts, reads)`:
    [start, reader] seconds of many (`Prices.reads`); `read_bytes(spec, value)`: bytes per
    device of a value in a layout (breaks the DP's ties); `check()`, called per cone, may stop
    the build (the search's deadline). With `unit_key` (what a unit's own costs depend on) and
    `value_key` (what a read of a value costs depends on), a cone alike in all of them to an
    earlier one (`signature`: the same op of the next layer) takes its choices, not a new DP:
    the build does not grow with the layers' count as fast."""
    root_of, claimed_by = find_cones(units, producer_unit)
    children: dict[int, list[int]] = {i: [] for i in range(len(units))}
    for m, reader in claimed_by.items():
        children[reader].append(m)

    def follow(m: int, out: dict[int, Strategy]) -> Strategy:
        """A producer-joining unit reads its producer's layout as it is when it can (slicing
        it further would look free here and cost a gather later), else at least cost."""
        u = units[m]
        v = u.live[0]
        p = producer_unit[v]
        spec = out[p].results[units[p].results.index(v)]
        reads = [k for k, o in enumerate(u.operands) if o == v]
        as_is = [s for s in u.strategies if all(s.operands[k] == spec for k in reads)]
        if as_is:
            return min(as_is, key=lambda s: own_cost(m, s))
        return min(u.strategies, key=lambda s: own_cost(m, s) + sum(
            reshard_cost(spec, to, v) for to in dict.fromkeys(s.operands[k] for k in reads)))

    def choices(root: int, ms: list[int]) -> list[dict[int, Strategy]]:
        """Per root strategy, every member's: a DP over the cone's in-tree (members in program
        order, producers before readers), then the producer-joining members in program order."""
        # best[m][t]: least cost of m's subtree when m takes strategy t; back[m, c][t]: c's choice;
        # entering[m][t]: bytes per device that the subtree reads from outside the cone.
        best: dict[int, np.ndarray] = {}
        entering: dict[int, np.ndarray] = {}
        back: dict[tuple[int, int], np.ndarray] = {}
        for m in ms:
            u = units[m]
            cost = np.array([own_cost(m, s) for s in u.strategies])
            inside = {units[c].results[0] for c in children[m]}
            outside = [(k, v) for k, v in enumerate(u.operands) if v in u.live and v not in inside]
            enter = np.array([sum(read_bytes(spec, v) for v, spec in {(v, s.operands[k]) for k, v in outside})
                              for s in u.strategies], dtype=float)
            for c in children[m]:
                v = units[c].results[0]
                positions = [k for k, o in enumerate(u.operands) if o == v]
                step = best[c][:, None] + reads_cost(v, [cs.results[0] for cs in units[c].strategies],
                                                     [[rs.operands[k] for k in positions] for rs in u.strategies])
                back[m, c] = _least(step, entering[c])
                picked = (back[m, c], np.arange(step.shape[1]))
                cost = cost + step[picked]
                enter = enter + entering[c][back[m, c]]
            best[m], entering[m] = cost, enter
        forward = [m for m in ms if units[m].join == "producer"]
        out = []
        for t in range(len(units[root].strategies)):
            picked: dict[int, Strategy] = {}
            stack = [(root, t)]
            while stack:
                m, j = stack.pop()
                picked[m] = units[m].strategies[j]
                stack.extend((c, int(back[m, c][j])) for c in children[m])
            for m in forward:  # in program order: each one's producer is already picked
                picked[m] = follow(m, picked)
            out.append(picked)
        return out

    members: dict[int, list[int]] = {}
    for i in range(len(units)):
        members.setdefault(root_of[i], []).append(i)
    cones = []
    seen: dict[Hashable, Cone] = {}
    for root, ms in members.items():
        check()
        order = [root] + [m for m in ms if m != root]
        key = signature(order, units, producer_unit, claimed_by, unit_key, value_key) if unit_key else None
        like = seen.get(key) if key is not None else None
        if like is None:
            cone = Cone(root, order, choices(root, ms), key)
            if key is not None:
                seen[key] = cone
        else:
            cone = Cone(root, order, _renamed(like, order), key)
        cones.append(cone)
    cones.sort(key=lambda c: c.root)
    return cones


def _renamed(like: Cone, order: list[int]) -> list[dict[int, Strategy]]:
    """The choices of cone `like` for an alike cone whose members are `order` (in its members'
    order): each member takes what its counterpart takes."""
    if len(order) == 1:
        return [{order[0]: ch[like.members[0]]} for ch in like.choice]
    counterparts = operator.itemgetter(*like.members)
    return [dict(zip(order, counterparts(ch))) for ch in like.choice]


def signature(members: Sequence[int], units: Sequence[ConeUnit], producer_unit: dict[int, int],
              parent: dict[int, int], unit_key: Callable[[int], Hashable],
              value_key: Callable[[int], Hashable]) -> tuple:
    """What a group's strategies and their costs depend on, with units named by their place in
    `members`: each member's own key, join and reader in the group (`parent`), and per live
    operand its producer's place (None outside) and the value's key. Two groups of one signature
    have the same choices, costs and, read alike, the same edges (`assembly.ilp_problem`)."""
    place = {m: i for i, m in enumerate(members)}
    out = []
    for m in members:
        u = units[m]
        reads = []
        for v in u.operands:
            if v not in u.live:
                reads.append(None)
                continue
            p = producer_unit[v]
            reads.append((place.get(p), units[p].results.index(v) if p in place else None, value_key(v)))
        out.append((unit_key(m), u.join, place.get(parent.get(m)), tuple(reads)))
    return tuple(out)


def _least(step: np.ndarray, entering: np.ndarray) -> np.ndarray:
    """Per column of `step` ([child strategy, reader strategy] costs), the child strategy of least
    cost; among equal costs, the one whose subtree reads the fewest bytes from outside the cone.
    The DP cannot price those reads (their source layout is the ILP's choice), but a split read
    costs nothing more than a replicated one when the source is split alike or replicated, while
    the reverse gathers: without this, ties (a broadcast of a layer norm's mean, of a bias) went
    to whichever came first, often the replicated read, and the ILP then paid an all-gather."""
    low = step.min(axis=0)
    near = step <= low + 1e-12 + 1e-9 * np.abs(low)
    return np.where(near, entering[:, None], np.inf).argmin(axis=0)


def replicated_choice(groups: list[Cone]) -> list[int | None]:
    """Each cone's strategy in which every member works on whole tensors (None where it has
    none, a pinned cone): the one-device step run on every device, a plan the search must beat."""
    def whole(s: Strategy) -> bool:
        return not any(spec.used_axes() for spec in s.operands + s.results)
    return [next((j for j, ch in enumerate(g.choice) if all(whole(s) for s in ch.values())), None) for g in groups]
