"""The forward passes of a multi-forward step (nnScaler §4.2's 3F1B).

AlphaFold2-style recycling runs the same layers several times per micro-batch, each pass fed the
previous pass's output, all but the last under `stop_gradient`. In the forward ops this shows
as layers (`stages.layer_of`) whose ops come in R separate runs, in program order, each run the
same sequence of ops. Pipelined, pass r of a layer runs on the stage of its last pass, which
holds the layer's parameters once: a micro-batch passes through the stages R times, and the
chain of places is pass-major (place r·p + s is pass r on stage s, `runtime.schedules`). So the
stager divides the last pass (and the layers that run once), each op of a repeated layer
weighing R times its compute; an earlier pass's op of a repeated layer takes the stage of the op
at its position in the last pass, and the other ops of the earlier passes go with their inputs.

A layer that runs twice for another reason (a tied embedding: the lookup, then the output
projection) has runs of different ops; a shared block whose every pass is differentiated (ALBERT)
has earlier passes whose activations the backward reads. Neither is a multi-forward step: they
are staged as one pass.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rhino_jax.errors import StagingError

from ...hlo_passes.graph import Graph
from ...hlo_passes.stages import fold, layer_of


@dataclass(frozen=True)
class Passes:
    count: int  # forward passes per micro-batch (1: an ordinary step)
    tied: dict[int, int] = field(default_factory=dict)  # an earlier pass's op of a repeated layer → its twin
    earlier: frozenset[int] = frozenset()  # the earlier passes' ops (tied, or going with their inputs): not staged
    repeats: dict[int, int] = field(default_factory=dict)  # a last-pass op of a repeated layer → its passes
    pass_of: dict[int, int] = field(default_factory=dict)  # an op of a repeated layer → its pass
    layers: tuple[str, ...] = ()  # the repeated layers, runs of numbered names folded (`stages.fold`)

    def places(self, graph: Graph, forward: set[int], stage: Mapping[int, int], stages: int) -> dict[int, int]:
        """Each forward op's place in the pass-major chain, from the stages the stager gave the
        ops it saw (`stage`): an op with a stage (a staged op, or a tied one: its twin's) in the
        first place of that stage at or after its inputs' places and its pass's start; another
        op in its inputs' latest place; an op that reads only arguments and constants (outside
        the repeated layers) beside its first reader."""
        producer = {r: n.id for n in graph.nodes for r in n.results}
        staged = dict(stage)
        staged.update((i, stage[twin]) for i, twin in self.tied.items())
        place: dict[int, int] = {}
        for i in sorted(forward):  # program order: inputs first
            inputs = [place[producer[o]] for o in graph.nodes[i].operands if o in producer and producer[o] in place]
            if not inputs and i not in self.pass_of:
                continue  # beside its first reader (below)
            after = max(inputs + [self.pass_of.get(i, 0) * stages])
            place[i] = after + (staged[i] - after) % stages if i in staged else after
        readers = graph.consumers()
        for i in sorted(forward - set(place), reverse=True):  # readers first
            place[i] = min(place[c] for r in graph.nodes[i].results for c in readers[r] if c in place)
        for i, r in self.pass_of.items():
            if place[i] // stages != r:
                raise StagingError(
                    f"pass {r} of layer {layer_of(graph)[i]!r} would run in pass {place[i] // stages} of the stages' "
                    f"chain: a multi-forward step is pipelined with each pass of its layers on the stage of the last "
                    f"({', '.join(self.layers)} repeat {self.count} times); place the layers by op_assign, or use "
                    "fewer stages")
        if max(place.values()) >= self.count * stages:
            raise StagingError(f"the {self.count} forward passes do not fit {self.count} passes over the {stages} "
                               "stages (an op after the last pass runs on an earlier stage than the last pass's end); "
                               "use fewer stages")
        return place


def find(graph: Graph, forward: set[int]) -> Passes:
    """The forward passes of the step (`Passes.count` 1 when its layers run once, or repeat for
    another reason: module docstring)."""
    layer = layer_of(graph)
    runs: dict[str, list[list[int]]] = {}
    last = None
    for i in sorted(forward):
        if not layer[i]:
            continue  # unnamed ops (a residual add between layers) do not end a run
        if layer[i] != last:
            runs.setdefault(layer[i], []).append([])
            last = layer[i]
        runs[layer[i]][-1].append(i)
    repeated = {name: r for name, r in runs.items() if len(r) > 1}
    counts = {len(r) for r in repeated.values()}
    if len(counts) != 1:
        return Passes(1)
    count = counts.pop()
    kinds = lambda run: [graph.nodes[i].op for i in run]  # noqa: E731
    if any(kinds(run) != kinds(r[-1]) for r in repeated.values() for run in r):
        return Passes(1)
    pass_of = {i: k for r in repeated.values() for k, run in enumerate(r) for i in run}
    start = min(r[-1][0] for r in repeated.values())  # the last pass's first op
    once = {i for name, r in runs.items() if name not in repeated for run in r for i in run}
    earlier = frozenset(i for i in forward if i < start and i not in once)
    if _differentiated(graph, forward, earlier, pass_of):
        return Passes(1)
    tied = {i: r[-1][j] for r in repeated.values() for run in r[:-1] for j, i in enumerate(run)}
    repeats = {i: count for r in repeated.values() for i in r[-1]}
    return Passes(count, tied, earlier, repeats, pass_of, fold(list(repeated)))


def _differentiated(graph: Graph, forward: set[int], earlier: frozenset[int], pass_of: dict[int, int]) -> bool:
    """Whether the backward reads an earlier pass's activation that no later pass reads (its
    gradient is taken: every pass is differentiated, not only the last)."""
    readers = graph.consumers()
    for i in earlier:
        for r in graph.nodes[i].results:
            backward = any(c not in forward for c in readers[r])
            onward = any(c in forward and pass_of.get(c, -1) > pass_of.get(i, -1) for c in readers[r])
            if backward and not onward:
                return True
    return False
