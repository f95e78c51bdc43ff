"""Pipeline stage programs: the compute-gradients program of one micro-batch cut into a forward
and a backward program per stage (Rhino §5-6; the stager decides the forward ops' stages).

The forward ops are the ancestors of the loss's sum (`micro_batch`); the stager places them. A
backward op never runs after a backward op it reads (gradients flow from the last stage to the
first), and among the stages left it goes where most of the bytes it reads were made (ties: to
its forward values' stage). So the backward of a layer follows its forward op (it reads that
layer's activations), and the weight gradient of an LM head stays by the [B, S, V] logits'
gradient instead of pulling it to the stage of the head's (much smaller) input. Each program
takes the step's arguments it reads and the values it reads from other programs, and returns the values
other programs (and the step's sums) read from it.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from jax.extend.mlir import ir

from rhino_jax.errors import StagingError

from .graph import Graph
from .split import drop_unused_arguments, extract


@dataclass(frozen=True)
class Program:
    kind: str  # "F" | "B"
    stage: int
    module: ir.Module
    args: tuple[int, ...]  # the step's arguments it reads (indices), its first arguments
    inputs: tuple[int, ...]  # values made by other programs that it reads (after `args`)
    outputs: tuple[int, ...]  # values it makes that other programs read, or that the step returns


def ancestors(graph: Graph, value: int) -> set[int]:
    """The nodes `value` depends on."""
    producer = {r: n.id for n in graph.nodes for r in n.results}
    found: set[int] = set()
    stack = [producer[value]] if value in producer else []
    while stack:
        i = stack.pop()
        if i not in found:
            found.add(i)
            stack.extend(producer[o] for o in graph.nodes[i].operands if o in producer)
    return found


def assign(graph: Graph, loss: int, forward_stage: Mapping[int, int]) -> dict[int, tuple[str, int]]:
    """Each node's (pass, stage): forward nodes (ancestors of `loss`) as `forward_stage` puts
    them, the others by the rule in the module's docstring."""
    forward = ancestors(graph, loss)
    missing = forward - set(forward_stage)
    if missing:
        raise StagingError(f"{len(missing)} forward ops have no stage")
    producer = {r: n.id for n in graph.nodes for r in n.results}
    last = max(forward_stage.values(), default=0)
    out: dict[int, tuple[str, int]] = {}
    for n in graph.nodes:
        if n.trips > 1 or "loop_trips" in n.attrs:
            raise StagingError("pipeline stages cannot cut through a loop yet: unroll the layers "
                               f"({n.name or n.op} is in a loop's body)")
        if n.id in forward:
            out[n.id] = ("F", forward_stage[n.id])
            continue
        made = [(o, forward_stage[producer[o]] if producer[o] in forward else out[producer[o]][1])
                for o in n.operands if o in producer]
        latest = min((out[producer[o]][1] for o in n.operands if o in producer and producer[o] not in forward),
                     default=last)
        here: dict[int, list[int]] = {}  # stage → [bytes read from it, of which forward values]
        for o, stage in made:
            if stage <= latest:
                counts = here.setdefault(stage, [0, 0])
                counts[0] += graph.values[o].nbytes
                counts[1] += graph.values[o].nbytes if producer[o] in forward else 0
        # ties go to the forward op's stage (a layer's backward reads its activations and the
        # gradient of its output alike), then to the later stage
        out[n.id] = ("B", max(here, key=lambda s: (*here[s], s)) if here else latest)
    return out


def programs(module: ir.Module, graph: Graph, place: Mapping[int, tuple[str, int]]) -> list[Program]:
    """The forward and backward program of each stage, in the order one micro-batch runs them
    (F0 .. Fp-1, then Bp-1 .. B0); a stage without ops of a pass has no program for it."""
    producer = {r: n.id for n in graph.nodes for r in n.results}
    returned = set(graph.outputs)
    keys = sorted(set(place.values()), key=lambda k: (k[0] == "B", k[1] if k[0] == "F" else -k[1]))
    made: dict[tuple[str, int], list[int]] = {k: [] for k in keys}
    for n in graph.nodes:
        made[place[n.id]].extend(n.results)
    result = []
    for key in keys:
        mine = set(made[key])
        reads = {o for n in graph.nodes if place[n.id] == key for o in n.operands
                 if o in producer and o not in mine and not graph.values[o].constant}
        read_elsewhere = {o for n in graph.nodes if place[n.id] != key for o in n.operands if o in mine}
        outputs = sorted((read_elsewhere | (returned & mine)) - {v for v in mine if graph.values[v].constant})
        inputs = sorted(reads)
        program = extract(module, graph, inputs, outputs)
        args = drop_unused_arguments(program, len(graph.args))
        result.append(Program(key[0], key[1], program, args, tuple(inputs), tuple(outputs)))
    return result


_WRAPPER = re.compile(r"^(?:\w+\()+(.*?)\)+$")  # jvp(layer3), transpose(jvp(layer3)) → layer3


def layers(graph: Graph, ops: list[int]) -> tuple[str, ...]:
    """The named scopes `ops` come from, in program order, runs of numbered names folded
    ("layer0-layer15"). The scope level is the first one at which the graph's ops differ (a
    Flax model's top module, common to every op, is skipped)."""
    paths = {n.id: [_WRAPPER.sub(r"\1", part) for part in n.name.split("/")[:-1]] for n in graph.nodes}
    depth = 0
    while len({p[depth] for p in paths.values() if len(p) > depth}) == 1:
        depth += 1
    names: list[str] = []
    for i in sorted(ops):
        if len(paths[i]) > depth and paths[i][depth] not in names:
            names.append(paths[i][depth])
    return _fold(names)


def _fold(names: list[str]) -> tuple[str, ...]:
    """["embed", "layer0", "layer1", "layer2"] → ("embed", "layer0-layer2")."""
    out: list[list[str]] = []
    for name in names:
        m, last = re.fullmatch(r"(.*?)(\d+)", name), re.fullmatch(r"(.*?)(\d+)", out[-1][-1]) if out else None
        if m and last and m[1] == last[1] and int(m[2]) == int(last[2]) + 1:
            out[-1].append(name)
        else:
            out.append([name])
    return tuple(run[0] if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in out)
