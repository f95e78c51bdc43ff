"""The ILP over cones (`ilp.Problem`): a cost per cone strategy and an exact edge per pair of cones
with reads between them; a value read by several cones is read through its hub, moved once per
layout."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np


from rhino_jax.core.specs import ShardingSpec

from ..hlo_passes.graph import Graph
from .coarsening.cones import Cone
from .pricing import Prices
from .solvers import ilp
from .space.strategies import Strategy
from .space.units import Unit, read_branch


def add_hubs(graph: Graph, units: list[Unit], groups: list[Cone], group_of: dict[int, int],
             producer_unit: dict[int, int], prices: Prices,
             sign: Callable[[list[int]], tuple] | None = None) -> dict[int, int]:
    """Value → its hub: a value that cones other than its producer's read (two or more) is read
    through a unit of no cost whose strategies are the value's layouts, a cone of its own. The
    move to the hub's layout is paid once and each reader cone pays from there, as `make_plan`
    (`_shared_path`) and XLA move a value once per layout read; without it each reader cone paid
    the move (an all-reduce of a gradient read by three cones, three times). Not for a value read
    in several conditional branches (a move in one branch is not seen in another). Hubs are
    appended to `units` and `groups` (after every other unit: cones and the DP inside them do
    not see them); the plan leaves them out (`make_plan`), so reads stay reads of the value.
    `sign`: a group's signature (`cones.signature`), given to the hubs' groups."""
    reads: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for m, u in enumerate(units):
        for pos, v in enumerate(u.operands):
            if v in producer_unit and graph.values[v].shape and group_of[m] != group_of[producer_unit[v]]:
                reads[v].append((m, pos))
    hub_of: dict[int, int] = {}
    shared: dict[tuple, list[Strategy]] = {}  # hubs of one set of layouts share it (`cones.signature`)
    for v, rs in sorted(reads.items(), key=lambda item: (producer_unit[item[0]], item[0])):
        branches = {read_branch(units[m], pos, graph) for m, pos in rs}
        if len({group_of[m] for m, _ in rs}) < 2 or len(branches) > 1:
            continue
        p = producer_unit[v]
        made = [ch[p].results[units[p].results.index(v)] for ch in groups[group_of[p]].choice]
        read = [ch[m].operands[pos] for m, pos in rs for ch in groups[group_of[m]].choice]
        # Not partial (every read settles it first); strided only as made (not gone on from, `_shared_path`).
        layouts = dict.fromkeys([spec for spec in made if not spec.partial]
                                + [spec for spec in read if not spec.strides])
        hub_of[v] = h = len(units)
        if tuple(layouts) not in shared:
            shared[tuple(layouts)] = [Strategy((spec,), (spec,), 0.0) for spec in layouts]
        strategies = shared[tuple(layouts)]
        units.append(Unit("hub", v, (v,), (v,), strategies, units[p].name, (v,)))
        prices.add_unit((v,))
        group_of[h] = len(groups)
        groups.append(Cone(h, [h], [{h: s} for s in strategies], sign([h]) if sign else None))
    return hub_of


def _result_spec(units, group: Cone, j: int, producer: int, v: int) -> ShardingSpec:
    s = group.choice[j][producer]
    return s.results[units[producer].results.index(v)]


def ilp_problem(units, groups: list[Cone], group_of: dict[int, int], producer_unit: dict[int, int],
                prices: Prices, hub_of: dict[int, int], check: Callable[[], None] = lambda: None) -> ilp.Problem:
    """The ILP over cones: a cost per cone strategy, and an edge per pair of cones with reads
    between them (reads inside a cone, or from a cone with one layout, fold into the costs); each
    with the combined families it uses (`pricing`). Groups of one signature (`cones.signature`:
    a layer's cone and the next layer's) are priced once, and so are their reads read alike."""
    # each signature numbered: the keys below hash a number, not a cone's whole signature
    alike_as: dict[tuple, int] = {}
    number = [None if g.signature is None else alike_as.setdefault(g.signature, len(alike_as)) for g in groups]
    priced: dict[int, tuple[np.ndarray, list[frozenset[int]]]] = {}
    costs, uses = [], []
    for g, n in zip(groups, number):
        if n is None or n not in priced:
            own = (np.array([sum(prices.own(m, s) for m, s in ch.items()) for ch in g.choice]),
                   [frozenset().union(*(prices.own_uses(m, s) for m, s in ch.items())) for ch in g.choice])
            if n is None:
                costs.append(own[0])
                uses.append(own[1])
                continue
            priced[n] = own
        costs.append(priced[n][0].copy())  # the reads below add to it
        uses.append(list(priced[n][1]))

    def moves(values, src_specs, dst_specs) -> dict:
        """A value read in one layout by several readers is resharded once (as in `make_plan`
        and in XLA, which shares the collective). In read order, not a set's hash order: a float
        sum's last bits, and so the ILP's ties, must not change with PYTHONHASHSEED."""
        return dict.fromkeys(zip(values, src_specs, dst_specs))

    def moves_cost(values, src_specs, dst_specs) -> float:
        return sum(prices.reshard(a, b, v) for v, a, b in moves(values, src_specs, dst_specs))

    def moves_uses(values, src_specs, dst_specs) -> frozenset[int]:
        return frozenset().union(*(prices.reshard_uses(a, b, v) for v, a, b in moves(values, src_specs, dst_specs)))

    reads: dict[tuple[int, int], list[tuple[int, int, int, int]]] = defaultdict(list)  # (v, reader, pos, source)
    for gi, g in enumerate(groups):
        for m in g.members:
            for pos, v in enumerate(units[m].operands):
                if v in producer_unit:
                    p = producer_unit[v]
                    if v in hub_of and m != hub_of[v] and gi != group_of[p]:
                        p = hub_of[v]  # read through the value's hub (`add_hubs`)
                    reads[(group_of[p], gi)].append((v, m, pos, p))
    place = {m: i for g in groups for i, m in enumerate(g.members)}
    inside: dict[tuple, tuple[np.ndarray, list[frozenset[int]]]] = {}  # reads within a group, by `alike`
    between: dict[tuple, ilp.Edge] = {}  # reads between two groups, by `alike`
    edges = []
    for (src, dst), rs in reads.items():
        check()
        gs, gd = groups[src], groups[dst]
        values = [v for v, _, _, _ in rs]
        alike = None if number[src] is None or number[dst] is None else (
            number[src], number[dst], src == dst, tuple((place[m], pos, place[p], units[p].results.index(v),
                                                         prices.value_key(v)) for v, m, pos, p in rs))
        if src == dst:
            if alike not in inside:
                read = [(values, [_result_spec(units, gs, j, p, v) for v, _, _, p in rs],
                         [gd.choice[j][m].operands[pos] for _, m, pos, _ in rs]) for j in range(len(gs.choice))]
                inside[alike] = (np.array([moves_cost(*r) for r in read]), [moves_uses(*r) for r in read])
            cost, used = inside[alike] if alike is not None else inside.pop(None)
            costs[src] += cost
            if any(used):
                uses[src] = [a | b for a, b in zip(uses[src], used)]
            continue
        if alike in between:
            like = between[alike]
            edge = ilp.Edge(src, dst, like.src_class, like.dst_class, like.matrix, like.uses)
        else:
            src_keys = [tuple(_result_spec(units, gs, j, p, v) for v, _, _, p in rs) for j in range(len(gs.choice))]
            dst_keys = [tuple(gd.choice[j][m].operands[pos] for _, m, pos, _ in rs) for j in range(len(gd.choice))]
            edge = _read_edge(src, dst, values, src_keys, dst_keys, prices)
            if alike is not None:
                between[alike] = edge
        if not edge.matrix.any():
            continue
        if edge.matrix.shape[0] == 1:
            costs[dst] += edge.matrix[0, list(edge.dst_class)]
            for j, b in enumerate(edge.dst_class):
                uses[dst][j] |= _indices(edge.uses[:, 0, b])
        elif edge.matrix.shape[1] == 1:
            costs[src] += edge.matrix[list(edge.src_class), 0]
            for j, a in enumerate(edge.src_class):
                uses[src][j] |= _indices(edge.uses[:, a, 0])
        else:
            edges.append(edge)
    return ilp.Problem(tuple(costs), tuple(edges), prices.families.fixed,
                       tuple(_family_matrix(g, len(prices.families.fixed)) for g in uses))


def _family_matrix(used: list[frozenset[int]], families: int) -> np.ndarray:
    """[family, strategy]: whether each strategy uses each family (most use none)."""
    out = np.zeros((families, len(used)), dtype=bool)
    for j, fs in enumerate(used):
        if fs:
            out[list(fs), j] = True
    return out


def _read_edge(src: int, dst: int, values: list[int], src_keys: list[tuple], dst_keys: list[tuple],
               prices: Prices) -> ilp.Edge:
    """The edge of the reads of `values` (one entry per read) from cone src by cone dst; a key
    holds each read's layout at its end. A value read in one layout by several readers is moved
    once (as in `make_plan` and in XLA, which shares the collective); a value that several cones
    read, they read through its hub (`add_hubs`), moved to once. Built per value from its few
    distinct moves, summed over each pair of classes by a matrix product: an edge has up to a
    thousand pairs."""
    src_class, src_layouts = ilp.classes(src_keys)
    dst_class, dst_layouts = ilp.classes(dst_keys)
    matrix = np.zeros((len(src_layouts), len(dst_layouts)))
    uses = np.zeros((len(prices.families.fixed),) + matrix.shape, dtype=bool)
    positions: dict[int, list[int]] = defaultdict(list)
    for p, v in enumerate(values):
        positions[v].append(p)
    for v, ps in positions.items():
        cost, used = prices.reads(v, [a[ps[0]] for a in src_layouts], [[b[p] for p in ps] for b in dst_layouts],
                                  uses=bool(uses.shape[0]))
        matrix += cost
        if used is not None:
            uses |= used
    return ilp.Edge(src, dst, src_class, dst_class, matrix, uses)


def _indices(mask: np.ndarray) -> frozenset[int]:
    return frozenset(np.nonzero(mask)[0].tolist())
