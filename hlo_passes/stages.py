"""Pipeline stage programs: the compute-gradients program of one micro-batch cut into a forward
and a backward program per stage (Rhino §5-6; the stager decides the forward ops' stages), and
apply-gradients cut into a program per stage and wave (`assign_apply`).

The forward ops are the ancestors of the loss's sum (`micro_batch`); the stager places them. A
backward op never runs after a backward op it reads (gradients flow from the last stage to the
first), and among the stages left it goes where most of the bytes it reads were made (ties: to
a stage that runs forward ops of its layer, then to its forward values' stage). So the backward
of a layer follows its forward op (it reads that layer's activations), the layer that opens a
stage too: its weight gradient reads its input, made on the stage before, and its output's
gradient, as many bytes, and runs on the layer's stage, where its gradient sum, its update and so
its parameter then live. The weight gradient of an LM head stays by the [B, S, V] logits'
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
    kind: str  # "F" | "B" | "A" (apply-gradients' ops of one stage and wave)
    stage: int
    module: ir.Module
    args: tuple[int, ...]  # its graph's arguments it reads (indices), its first arguments
    inputs: tuple[int, ...]  # values made by other programs that it reads (after `args`)
    outputs: tuple[int, ...]  # values it makes that other programs read, or that the step returns
    wave: int = 0  # "A": the most moves between stages on a path from the sums to its ops


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


def assign(graph: Graph, loss: int, forward_stage: Mapping[int, int], shared: frozenset[int] = frozenset(),
           on_shared: frozenset[int] = frozenset(), first_backward: int = 0) -> dict[int, tuple[str, int]]:
    """Each node's (pass, stage): forward nodes (ancestors of `loss`) as `forward_stage` puts
    them, the others by the rule in the module's docstring. An interlaced pipeline's stages are
    the places of its chain, `shared` those that run on every device; a backward node of
    `on_shared` (named by `op_assign(stage="all")`) goes to the latest of those it may run in.
    `first_backward`: the first place that runs a backward (a multi-forward step's last pass;
    the earlier passes run none, `search.passes`)."""
    forward = ancestors(graph, loss)
    missing = forward - set(forward_stage)
    if missing:
        raise StagingError(f"{len(missing)} forward ops have no stage")
    producer = {r: n.id for n in graph.nodes for r in n.results}
    last = max(forward_stage.values(), default=0)
    out: dict[int, tuple[str, int]] = {}
    loop = loop_of(graph)
    layer_stages = stages_of_layers(graph, forward, forward_stage)
    for n in graph.nodes:
        _check_not_in_conditional(n)
        if n.id in loop:  # a loop runs whole in one program: its body and exit go with its entry
            out[n.id] = out[loop[n.id]]
            if n.id in forward and forward_stage[n.id] != out[n.id][1]:
                raise StagingError(f"pipeline stages cannot cut through a loop yet ({n.name or n.op} is in a loop's "
                                   "body): unroll the layers (a Python loop, or nn.scan/lax.scan unroll)")
            continue
        if n.id in forward:
            out[n.id] = ("F", forward_stage[n.id])
            continue
        made = [(o, forward_stage[producer[o]] if producer[o] in forward else out[producer[o]][1])
                for o in n.operands if o in producer]
        latest = min((out[producer[o]][1] for o in n.operands if o in producer and producer[o] not in forward),
                     default=last)
        here: dict[int, list[int]] = {}  # stage → [bytes read from it, of which forward values]
        for o, stage in made:
            if first_backward <= stage <= latest:
                counts = here.setdefault(stage, [0, 0])
                counts[0] += graph.values[o].nbytes
                counts[1] += graph.values[o].nbytes if producer[o] in forward else 0
        # ties go to its layer's stage, then to the forward values' (a layer's backward reads its
        # activations and the gradient of its output alike), then to the later stage
        mine = layer_stages[n.id]
        out[n.id] = ("B", max(here, key=lambda s: (here[s][0], s in mine, here[s][1], s)) if here
                     else max(latest, first_backward))
        if n.id in on_shared and any(s <= latest for s in shared):
            out[n.id] = ("B", max(s for s in shared if s <= latest))
    return out


def stages_of_layers(graph: Graph, forward: set[int], forward_stage: Mapping[int, int]) -> dict[int, frozenset[int]]:
    """Each op → the stages that run forward ops of its layer (`layer_of`; none for an op of no
    layer)."""
    layer = layer_of(graph)
    found: dict[str, set[int]] = {}
    for i in forward:
        found.setdefault(layer[i], set()).add(forward_stage[i])
    return {i: frozenset(found.get(name, ())) if name else frozenset() for i, name in layer.items()}


def assign_apply(graph: Graph, home: Mapping[int, int]) -> dict[int, tuple[str, int, int]]:
    """Each op of apply-gradients' `graph` → ("A", stage, wave). `home`: the stage of each of its
    arguments that lives on one (a parameter on the stage whose programs read it, a sum on the
    stage that made it). An op goes where most of the bytes it reads are (ties: the stage that
    keeps its wave lowest, then the first stage), so a layer's optimizer update runs beside its
    parameters and gradients. An op that reads nothing placed (an optimizer moment times a
    constant, Adam's step count and bias corrections) or makes more bytes than it reads (a
    clipping factor broadcast to a weight's shape) goes where its readers are; one that reads
    only arguments and constants, read on several stages, is left out of the result: each program
    that reads it computes it again (`programs`), rather than one stage waiting for another's. Its wave is the most stage changes
    on a path from the arguments to it: a global norm's per-stage squares are wave 0, their total
    on one stage wave 1, the updates it scales on other stages wave 2; an op all of whose readers
    run on its stage runs in their earliest wave (Adam's decayed moments, b1 * mu, beside the
    update that reads them, not a wave before it)."""
    producer = {r: n.id for n in graph.nodes for r in n.results}
    readers = graph.consumers()
    at = {graph.args[i].value: s for i, s in home.items()}
    stage: dict[int, int] = {}
    wave: dict[int, int] = {}

    def wave_at(n, s: int) -> int:
        return max((wave[producer[o]] + (stage[producer[o]] != s) for o in n.operands
                    if o in producer and producer[o] in wave), default=0)

    later, pure = [], set()  # ops placed after the others; of those, ops reading only arguments and constants
    for n in graph.nodes:
        _check_not_in_conditional(n)
        if n.trips > 1 or "loop_trips" in n.attrs:
            raise StagingError(f"the optimizer update runs a loop ({n.name or n.op}), which pipeline stages cannot "
                               "place yet; take the loop out of the update, or use pipeline='off'")
        votes: dict[int, int] = {}
        for o in n.operands:
            if o in at:
                votes[at[o]] = votes.get(at[o], 0) + graph.values[o].nbytes
        if not votes or sum(graph.values[r].nbytes for r in n.results) > sum(votes.values()):
            later.append((n, max(votes, key=votes.get, default=0)))  # a broadcast: beside its reader
            if not votes and all(producer.get(o, -1) in pure or o not in producer for o in n.operands):
                pure.add(n.id)
            continue
        stage[n.id] = max(votes, key=lambda s: (votes[s], -wave_at(n, s), -s))
        wave[n.id] = wave_at(n, stage[n.id])
        at.update((r, stage[n.id]) for r in n.results)
    shared: dict[int, set[int]] = {}  # op → the stages of its readers, each computing it again
    for n, fallback in reversed(later):  # readers first: a chain of such ops follows its end
        wanted: set[int] = set()
        for c in (c for r in n.results for c in readers[r]):
            wanted |= {stage[c]} if c in stage else shared.get(c, set())
        if len(wanted) > 1 and n.id in pure:
            shared[n.id] = wanted
        else:
            stage[n.id] = min(wanted, default=fallback)
    wave.clear()
    for n in graph.nodes:  # waves again, now that every op has its stage
        if n.id in stage:
            wave[n.id] = wave_at(n, stage[n.id])
    for n in reversed(graph.nodes):  # as late as its readers on its stage: what a wave makes for a later
        if n.id in stage:           # wave would leave one program for another (moved, in its own layout)
            waits = [c for r in n.results for c in readers[r]]
            if waits and all(c in stage and stage[c] == stage[n.id] for c in waits):
                wave[n.id] = min(wave[c] for c in waits)
    return {i: ("A", stage[i], wave[i]) for i in stage}


def loop_of(graph: Graph) -> dict[int, int]:
    """Each op inside a loop (its body's ops and its exit, which makes the loop's results) → the
    op that enters the loop (an inner loop's entry is itself inside the outer loop). A loop's ops
    follow its entry in program order up to its exit, which names the entry (`loop_entry`)."""
    out: dict[int, int] = {}
    for n in graph.nodes:
        if "loop_entry" in n.attrs:
            entry = n.attrs["loop_entry"]
            for i in range(entry + 1, n.id + 1):
                out.setdefault(i, out.get(entry, entry))
    return out


def _check_not_in_conditional(n) -> None:
    if "branch" in n.attrs or "branches" in n.attrs:
        raise StagingError("pipeline stages cannot cut through a conditional (lax.cond, lax.switch; optax.MultiSteps "
                           f"uses one) yet: {n.name or n.op} is in one. Take it out of the step, or use pipeline='off'")


def run_order(key: tuple) -> tuple:
    """One micro-batch's programs F0 .. Fp-1, Bp-1 .. B0; apply-gradients' by wave, then stage."""
    kind, stage = key[0], key[1]
    return ("FBA".index(kind), key[2] if kind == "A" else 0, stage if kind != "B" else -stage)


def programs(module: ir.Module, graph: Graph, place: Mapping[int, tuple]) -> list[Program]:
    """A program per key of `place` (("F" | "B", stage) or ("A", stage, wave)), in the order they
    run (`run_order`); a stage without ops of a pass has no program for it. An op `place` leaves
    out (it reads only arguments and constants, `assign_apply`) is in every program that reads
    it. A value the graph returns that no placed op makes (an argument, a constant, such an op's)
    is returned by the first program."""
    producer = {r: n.id for n in graph.nodes for r in n.results}
    returned = set(graph.outputs)
    keys = sorted(set(place.values()), key=run_order)
    made: dict[tuple, list[int]] = {k: [] for k in keys}
    for n in graph.nodes:
        if n.id in place:
            made[place[n.id]].extend(n.results)
    unmade = {v for v in returned if v not in producer or producer[v] not in place or graph.values[v].constant}
    result = []
    for key in keys:
        mine = set(made[key])
        reads = {o for n in graph.nodes if place.get(n.id) == key for o in n.operands
                 if o in producer and producer[o] in place and o not in mine and not graph.values[o].constant}
        read_elsewhere = {o for n in graph.nodes if place.get(n.id) != key for o in n.operands if o in mine}
        outputs = sorted((read_elsewhere | (returned & mine)) - {v for v in mine if graph.values[v].constant})
        if key == keys[0]:
            outputs += sorted(unmade)
        inputs = sorted(reads)
        program = extract(module, graph, inputs, outputs)
        args = drop_unused_arguments(program, len(graph.args))
        result.append(Program(key[0], key[1], program, args, tuple(inputs), tuple(outputs),
                              key[2] if len(key) > 2 else 0))
    return result


_WRAPPER = re.compile(r"^(?:\w+\()+(.*?)\)+$")  # jvp(layer3), transpose(jvp(layer3)) → layer3


def layer_of(graph: Graph) -> dict[int, str]:
    """Each op's layer: its named scope at the first level at which the graph's ops differ (a
    Flax model's top module, common to every op, is skipped); "" for an op of no such scope."""
    # jvp() of an unnamed function: no scope, else it hides the model's; nor a jax function the
    # model calls (jit(_take), named so by `module.inline_calls`)
    paths = {n.id: [name for name in (_WRAPPER.sub(r"\1", part) for part in n.name.split("/")[:-1]
                                      if "jit(" not in part) if name]
             for n in graph.nodes}
    depth = 0
    while len({p[depth] for p in paths.values() if len(p) > depth}) == 1:
        depth += 1
    return {i: p[depth] if len(p) > depth else "" for i, p in paths.items()}


def layers(graph: Graph, ops: list[int]) -> tuple[str, ...]:
    """The named scopes `ops` come from (`layer_of`), in program order, runs of numbered names
    folded ("layer0-layer15")."""
    layer = layer_of(graph)
    return fold(list(dict.fromkeys(layer[i] for i in sorted(ops) if layer[i])))


def fold(names: list[str]) -> tuple[str, ...]:
    """["embed", "layer0", "layer1", "layer2"] → ("embed", "layer0-layer2")."""
    out: list[list[str]] = []
    for name in names:
        m, last = re.fullmatch(r"(.*?)(\d+)", name), re.fullmatch(r"(.*?)(\d+)", out[-1][-1]) if out else None
        if m and last and m[1] == last[1] and int(m[2]) == int(last[2]) + 1:
            out[-1].append(name)
        else:
            out.append([name])
    return tuple(run[0] if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in out)
