"""The programs of a pipelined step on their stages: each cut from the step and put on its
sub-mesh, the state a stage holds beside them, where each argument and sum lives (its home), the
layouts apply-gradients' programs are pinned to, and their tasks in the task graph."""
from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from rhino_jax.core.diagnostics import SearchDiagnostics
from rhino_jax.core.plan import ApplyTask, Plan
from rhino_jax.core.specs import ShardingSpec
from rhino_jax.hlo_passes import stages as stage_programs
from rhino_jax.hlo_passes.graph import Graph, Pin
from rhino_jax.hlo_passes.importer import import_module
from rhino_jax.hlo_passes.split import on_mesh

# A program of the step, its graph and its plan.
Planned = tuple[stage_programs.Program, Graph, Plan]


def _state_copies(cg: Graph, roles) -> dict[tuple, int]:
    """(shape, dtype) of a parameter → the copies of it the step's state holds beside it: its
    optimizer's moments (the optimizer-state arguments of its shape, per parameter of that
    shape: Adam's two) and its gradient sum."""
    count: Counter = Counter()
    for a, role in zip(cg.args, roles):
        value = cg.values[a.value]
        count[role, value.shape, value.dtype] += 1
    return {(shape, dtype): round(count["optimizer_state", shape, dtype] / n) + 1
            for (role, shape, dtype), n in count.items() if role == "parameter"}


def _with_state_beside(graph: Graph, prog: stage_programs.Program, cg: Graph, copies: dict[tuple, int]) -> Graph:
    """A forward or backward program's graph with each parameter it reads marked with the copies
    of it its stage holds beside it (`Arg.held_beside`: the gradient sum, which the backward
    adds its micro-batch's gradient to, and the moments): a memory limit on the program then
    keeps the stage's state within it, which the apply-gradients programs are pinned to."""
    def marked(a):
        if a.index >= len(prog.args) or a.role != "parameter":
            return a
        value = cg.values[cg.args[prog.args[a.index]].value]
        return dataclasses.replace(a, held_beside=copies.get((value.shape, value.dtype), 1))
    return dataclasses.replace(graph, args=tuple(marked(a) for a in graph.args))


def _on_stage(prog: stage_programs.Program, axes: dict[str, int], paths, roles, output_paths
              ) -> tuple[stage_programs.Program, Graph]:
    """The program on its stage's sub-mesh, and its graph: the arguments it reads (named and
    cast as in the graph it was cut from), then the values it takes from other programs."""
    prog = dataclasses.replace(prog, module=on_mesh(prog.module, axes))
    graph = import_module(prog.module, [paths[i] for i in prog.args] + [f"in[{v}]" for v in prog.inputs],
                          [roles[i] for i in prog.args] + ["other"] * len(prog.inputs), output_paths)
    return prog, graph


def _compute_homes(plans: dict[tuple[str, int], Planned], cg: Graph) -> dict[int, int]:
    """apply-gradients' arguments that live on a stage, and where: a step argument other than the
    batch on the stage of the first program that reads it (in a micro-batch's order), a sum on
    the stage that makes it (apply-gradients' argument len(args) + j is compute-gradients' sum j)."""
    n, sums = len(cg.args), {v: j for j, v in enumerate(cg.outputs)}
    home: dict[int, int] = {}
    for key in sorted(plans, key=stage_programs.run_order):
        prog = plans[key][0]
        home.update((i, prog.stage) for i in prog.args if cg.args[i].role != "batch" and i not in home)
        home.update((n + sums[v], prog.stage) for v in prog.outputs if v in sums)
    return home


def _apply_homes(home: dict[int, int], programs, ag: Graph, roles) -> dict[int, int]:
    """Where each step argument other than the batch lives: on the stage that makes the result
    fed back into it (a parameter where its update runs, its optimizer state with it), so that a
    training loop hands it back where it came from; else as `home` has it (compute-gradients'
    first reader); else on its first reader's among apply-gradients' programs. Sums as in `home`."""
    made = {v: prog.stage for prog in programs for v in prog.outputs}
    out = dict(home)
    for k, i in ag.fed_back().items():
        if i < len(roles) and roles[i] != "batch" and ag.outputs[k] in made:
            out[i] = made[ag.outputs[k]]
    for prog in programs:
        out.update((i, prog.stage) for i in prog.args if i < len(roles) and roles[i] != "batch" and i not in out)
    return out


def _fed_back_names(prog: stage_programs.Program, ag: Graph) -> list[str]:
    """Names of an apply-gradients program's results: a step result the training loop feeds back
    into an argument (`Graph.fed_back` of the whole step) is named as that argument ("out" for
    "arg"), so that the program's own search, which pairs names leaf by leaf, ties its layout to
    the argument's; the others by value."""
    fed = ag.fed_back()
    first = {v: k for k, v in reversed(list(enumerate(ag.outputs)))}
    return ["out" + ag.args[fed[first[v]]].path[len("arg"):] if first.get(v) in fed else f"out[{v}]"
            for v in prog.outputs]


def _with_donation(graph: Graph, prog: stage_programs.Program, ag: Graph, donated: set[int]) -> Graph:
    """The program's graph with each donated step argument (of `donated`) aliasing the result the
    step pairs it with (`several_programs._with_donation`) where the program makes that result."""
    args = list(graph.args)
    for pos, i in enumerate(prog.args):
        k = ag.args[i].donated_to
        if i in donated and k is not None and ag.outputs[k] in prog.outputs:
            args[pos] = dataclasses.replace(args[pos], donated_to=prog.outputs.index(ag.outputs[k]))
    return dataclasses.replace(graph, args=tuple(args))


def _taken_layout(planned: list[Planned], places: tuple[int, ...], i: int, fed: int | None) -> ShardingSpec | None:
    """The layout a stage (its `places`: one, or every device's) takes step argument i in, as
    far as `planned` (in run order) fixes it: as the first of them that reads it, else as an
    apply-gradients program makes `fed`, the result fed back into it; None when none does."""
    read = [plan.arg_specs[prog.args.index(i)] for prog, _, plan in planned if prog.stage in places and i in prog.args]
    made = [plan.output_specs[prog.outputs.index(fed)] for prog, _, plan in planned
            if prog.kind == "A" and prog.stage in places and fed is not None and fed in prog.outputs]
    return (read + made + [None])[0]


def _fed_back_pins(prog: stage_programs.Program, graph: Graph, earlier: list[Planned], ag: Graph,
                   places: tuple[int, ...]) -> tuple[Pin, ...]:
    """Pins for an apply-gradients program's results that the training loop feeds back into an
    argument whose layout `earlier` programs of the stage fixed (an optimizer state read in one
    wave and made in a later one): the result leaves in it, else every step would reshard it
    outside every program and every count."""
    into = {ag.outputs[k]: i for k, i in ag.fed_back().items()}
    pins = []
    for pos, v in enumerate(prog.outputs):
        spec = _taken_layout(earlier, places, into[v], v) if v in into else None
        if spec is not None:
            pins.append(Pin(graph.outputs[pos], spec.dims, graph.output_paths[pos]))
    return tuple(pins)


def _held_layouts(plans: dict[tuple[str, int], Planned], places: tuple[int, ...], cg: Graph
                  ) -> dict[int, ShardingSpec]:
    """apply-gradients' argument → the layout a stage's (its `places`') forward (else backward)
    program holds it in: a parameter as it reads it, a sum as it makes it. apply-gradients'
    programs on the stage are pinned to these, so nothing moves between a stage's programs."""
    n, sums = len(cg.args), {v: j for j, v in enumerate(cg.outputs)}
    held: dict[int, ShardingSpec] = {}
    for kind, s in [(kind, s) for kind in ("F", "B") for s in places if (kind, s) in plans]:
        prog, _, plan = plans[kind, s]
        for pos, i in enumerate(prog.args):
            held.setdefault(i, plan.arg_specs[pos])
        for v, spec in zip(prog.outputs, plan.output_specs):
            if v in sums:
                held.setdefault(n + sums[v], spec)
    return held


def _apply_tasks(applies: list[Planned], home: dict[int, int], n: int) -> tuple[ApplyTask, ...]:
    """The task graph's apply tasks: each apply-gradients program after the stages whose sums it
    reads and the programs whose values it reads."""
    made = {v: prog for prog, _, _ in applies for v in prog.outputs}
    return tuple(ApplyTask(prog.stage, prog.wave, tuple(sorted({home[i] for i in prog.args if i >= n})),
                           tuple(sorted({(made[v].stage, made[v].wave) for v in prog.inputs})))
                 for prog, _, _ in applies)


def _searches(named: dict[str, SearchDiagnostics]) -> SearchDiagnostics:
    """apply-gradients' programs' searches (by program name) as one search line: sizes and times
    added up (each program's ILPs one after another, named by their program), the worst status
    (interrupted, then any other than optimal) with its figures, the largest gap."""
    stats = list(named.values())
    worst = max(stats, key=lambda st: (st.status == "interrupted", st.status != "optimal"))
    gaps = [st.gap for st in stats]
    added = {key: sum(getattr(st, key) for st in stats)
             for key in ("ops", "critical_nodes", "segments", "groups", "tied_segments", "ilp_groups", "ilp_vars",
                         "ilp_constraints", "solve_s", "build_s")}
    return dataclasses.replace(
        worst, **added, gap=float("nan") if any(np.isnan(g) for g in gaps) else max(gaps),
        not_replicated=tuple(x for st in stats for x in st.not_replicated),
        ilp_stages=tuple(dataclasses.replace(stage, name=name if len(st.ilp_stages) == 1 else f"{name} {stage.name}")
                         for name, st in named.items() for stage in st.ilp_stages))
