"""What the search charges: a unit's strategy (its compute and its own collectives) and a read in
another layout (the reshard's collectives), each with the combined families it uses.

A collective on a value off the compute chain (`combining.combining_sides`) is combined by XLA
with the others of its family: it pays its bandwidth and only its share of a launch, and the
family's one launch is charged once by the ILP (`ilp.Problem.fixed`). Everything else pays its
own launch and latency (`combining.combined_alone`). A layout copy XLA adds to a collective
(`Collective.copy_time`), and the kernels it adds around a combined op (`combining.member_kernels_s`),
are compute, never hidden behind it.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rhino_jax.core.specs import ShardingSpec

from ..hlo_passes.graph import Graph
from .cost.cluster import MeshTopology
from .cost.collectives import Collective, reshard
from .cost.combining import Families, combined_alone, combining_sides, families, member_kernels_s
from .solvers.ilp import classes
from .space.strategies import Strategy


class Prices:
    """The prices of one search: per unit and per read, cached by what they depend on."""

    def __init__(self, graph: Graph, topo: MeshTopology, unit_results: Sequence[tuple[int, ...]],
                 shared: dict | None = None):
        """`shared`: what searches of this graph on this mesh at other overlap shares found that
        does not depend on the share (the overlap rounds, `planner.search`): which side of the
        compute chain each value stands on, and the collectives of each move (a move's path is
        the cheapest under α-β alone; what the share changes is the price of its collectives)."""
        self.graph, self.topo = graph, topo
        shared = {} if shared is None else shared
        if "sides" not in shared:
            shared["sides"] = combining_sides(graph)
        self.sides = shared["sides"]
        self._moves: dict[tuple, list[Collective]] = shared.setdefault("moves", {})
        self._path_topo = topo.without_overlap()  # one path cache for every share
        self.families: Families = families(topo, sorted({v.trips for v in graph.values}))
        self._unit_side = [self.side_of(rs) for rs in unit_results]
        self._unit_trips = [graph.values[rs[0]].trips if rs else 1 for rs in unit_results]
        self._reshards: dict[tuple, tuple[float, frozenset[int]]] = {}
        self._tables: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._value_keys: dict[int, tuple] = {}

    def add_unit(self, results: tuple[int, ...]) -> None:
        """A unit added after the prices were made (a hub, `assembly.add_hubs`)."""
        self._unit_side.append(self.side_of(results))
        self._unit_trips.append(self.graph.values[results[0]].trips if results else 1)

    def side_of(self, values: Sequence[int]) -> str | None:
        """The side of a unit's results when they share one (an op's own collectives act on them)."""
        found = {self.sides.get(v) for v in values}
        return found.pop() if len(found) == 1 else None

    def value_key(self, v: int) -> tuple:
        """What moving value v costs depends on (besides the layouts); made once per value, as
        every cone's signature and every read between cones asks for it."""
        key = self._value_keys.get(v)
        if key is None:
            value = self.graph.values[v]
            key = self._value_keys[v] = (value.nbytes, value.shape, self.sides.get(v), value.trips)
        return key

    def unit_key(self, m: int) -> tuple:
        """What unit m's own costs depend on besides its strategies."""
        return self._unit_side[m], self._unit_trips[m]

    def combined(self, c: Collective, side: str | None) -> bool:
        return not combined_alone(self.topo.combiner.compiled_kind(c.kind), side, self.topo.combiner)

    def _priced(self, collectives: Sequence[Collective], side: str | None, trips: int
                ) -> tuple[float, frozenset[int]]:
        time = 0.0
        for c in collectives:
            combined = self.combined(c, side)
            time += c.time(self.topo, combined) * self.topo.exposed(combined) + c.copy_time(self.topo)
            if combined:
                time += member_kernels_s(c.kind, c.bytes, side, self.topo)
        return time, self.families.of(collectives, self.topo.combiner, side, trips)

    def own(self, m: int, s: Strategy) -> float:
        """Seconds of unit m's strategy s: compute and the collectives inside the op (an op in a
        loop's body lists them once per trip, `carried.per_trip`)."""
        if not s.collectives:  # most strategies: called for every strategy of every unit
            return s.compute_s
        return s.compute_s + self._priced(s.collectives, self._unit_side[m], self._unit_trips[m])[0]

    def own_uses(self, m: int, s: Strategy) -> frozenset[int]:
        if not s.collectives:
            return frozenset()
        return self._priced(s.collectives, self._unit_side[m], self._unit_trips[m])[1]

    def _reshard(self, src: ShardingSpec, dst: ShardingSpec, v: int) -> tuple[float, frozenset[int]]:
        value = self.graph.values[v]
        key = (src, dst, *self.value_key(v))
        if key not in self._reshards:
            moved = (src, dst, value.nbytes, value.shape)
            if moved not in self._moves:
                self._moves[moved] = reshard(src, dst, value.nbytes, self._path_topo, value.shape)
            self._reshards[key] = self._priced(self._moves[moved], *key[4:])
        return self._reshards[key]

    def reshard(self, src: ShardingSpec, dst: ShardingSpec, v: int) -> float:
        """Seconds to move value v from layout src to dst: where it is made, in a loop's body once
        per trip."""
        return self._reshard(src, dst, v)[0] * self.graph.values[v].trips

    def reshard_uses(self, src: ShardingSpec, dst: ShardingSpec, v: int) -> frozenset[int]:
        return self._reshard(src, dst, v)[1]

    def reads(self, v: int, starts: Sequence[ShardingSpec], reads: Sequence[Sequence[ShardingSpec]],
              uses: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
        """Value v made in each layout of `starts` and read by each reader of `reads` in each of
        its layouts (a layout read twice is moved once, as XLA shares the collective): ([start,
        reader] seconds, [family, start, reader] bools, the families used, when `uses`). Summed
        from a table of the distinct moves, cached whole: the cones of one layer after another
        read values of one shape in the same layouts."""
        s_index, firsts = classes(starts)
        ends_of = [tuple(dict.fromkeys(r)) for r in reads]
        e_index, ends = classes([e for r in ends_of for e in r])
        read = np.zeros((len(ends), len(reads)))  # [end layout, reader]: the reader reads v in it
        read[list(e_index), np.repeat(np.arange(len(reads)), [len(r) for r in ends_of])] = 1.0
        cost, used = self._table(tuple(firsts), tuple(ends), v)
        seconds = (cost @ read)[list(s_index)]
        if not uses:
            return seconds, None
        return seconds, np.einsum("sdf,dr->fsr", used.astype(float), read)[:, list(s_index)] > 0

    def _table(self, starts: tuple[ShardingSpec, ...], ends: tuple[ShardingSpec, ...], v: int
               ) -> tuple[np.ndarray, np.ndarray]:
        value = self.graph.values[v]
        key = (starts, ends, value.nbytes, value.shape, self.sides.get(v), value.trips)
        if key not in self._tables:
            moves = [self._reshard(a, b, v) for a in starts for b in ends]
            cost = np.array([seconds for seconds, _ in moves]).reshape(len(starts), len(ends)) * value.trips
            uses = np.array([self.families.vector(used) for _, used in moves],
                            dtype=bool).reshape(len(starts), len(ends), len(self.families.fixed))
            self._tables[key] = (cost, uses)
        return self._tables[key]
