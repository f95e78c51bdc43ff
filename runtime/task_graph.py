"""The task graph of a pipelined step (Rhino §6.1): what runs, where, after what.

Nodes: a source and a sink; per stage (a place of the chain: with an interlaced pipeline, also a
place that runs on every device) and micro-batch, its forward and backward pass; a send and
a receive for every tensor crossing stages (activations forward, their gradients back); with
several micro-batches, a local accumulation of each backward's gradients; the apply of the
accumulated gradients (the optimizer): one on the whole mesh, or one per stage and wave of a
pipeline's apply-gradients programs (`ApplyTask`), each after the stages whose sums it reads and the
apply programs whose values it reads. Edges: data dependencies, and each stage's run order as the
schedule fixes it (nnScaler's schedules as ordering constraints), so one topological order of
the graph is the static schedule the executor follows.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import networkx as nx

from rhino_jax.core.plan import ApplyTask, Plan, apply_task_name
from rhino_jax.errors import ScheduleError

from . import schedules
from .schedules import Schedule, Task

KINDS = ("source", "forward", "backward", "send", "recv", "accumulate", "apply", "sink")


@dataclass(frozen=True)
class TaskNode:
    name: str
    kind: str  # one of KINDS
    stage: int = -1  # -1: the source and the sink
    micro_batch: int = -1  # -1: tasks of the whole step (source, apply, sink)


@dataclass(frozen=True)
class TaskGraph:
    nodes: tuple[TaskNode, ...]
    edges: tuple[tuple[int, int], ...]  # (before, after) indices into nodes
    schedule: str

    def index(self, name: str) -> int:
        return next(i for i, n in enumerate(self.nodes) if n.name == name)

    def order(self) -> list[TaskNode]:
        """The tasks in an order that respects every edge (the executor's order)."""
        g = nx.DiGraph()
        g.add_nodes_from(range(len(self.nodes)))
        g.add_edges_from(self.edges)
        try:
            return [self.nodes[i] for i in nx.lexicographical_topological_sort(g)]
        except nx.NetworkXUnfeasible as e:
            raise ScheduleError(f"the {self.schedule} task graph has a cycle") from e

    def to_dot(self) -> str:
        """Graphviz DOT: one color per stage, transfers dashed."""
        colors = ("lightblue", "khaki", "palegreen", "lightpink", "plum", "lightsalmon", "lightcyan", "wheat")
        lines = [f'digraph "{self.schedule}" {{', "  rankdir=LR;", "  node [shape=box, style=filled];"]
        for i, n in enumerate(self.nodes):
            color = "white" if n.stage < 0 else colors[n.stage % len(colors)]
            lines.append(f'  n{i} [label="{n.name}", fillcolor={color}];')
        for a, b in self.edges:
            cross = self.nodes[a].kind == "send"
            lines.append(f"  n{a} -> n{b}{' [style=dashed]' if cross else ''};")
        return "\n".join(lines + ["}"])


def build(schedule: Schedule, applies: Sequence[ApplyTask] = ()) -> TaskGraph:
    """The task graph of a checked schedule; `applies`: the apply-gradients programs on the
    stages (none: one apply on the whole mesh)."""
    nodes: list[TaskNode] = []
    at: dict[str, int] = {}
    edges: list[tuple[int, int]] = []

    def node(name: str, kind: str, stage: int = -1, micro_batch: int = -1) -> int:
        at[name] = len(nodes)
        nodes.append(TaskNode(name, kind, stage, micro_batch))
        return at[name]

    def compute(t: Task) -> int:
        return at[str(t)]

    p, m = schedule.stages, schedule.micro_batches
    source = node("source", "source")
    backward = [schedule.has_backward(s) for s in range(p)]  # a multi-forward step's earlier passes have none
    for s in range(p):
        for k in range(m):
            node(str(Task("F", s, k)), "forward", s, k)
            if backward[s]:
                node(str(Task("B", s, k)), "backward", s, k)
    for tasks in schedule.order:  # the run order on each stage's devices (a shared task's on every stage's)
        edges += [(compute(a), compute(b)) for a, b in zip(tasks, tasks[1:])]
    for k in range(m):
        edges.append((source, compute(Task("F", 0, k))))  # the micro-batch is fed to stage 0
        for s in range(p):
            if backward[s]:
                edges.append((compute(Task("F", s, k)), compute(Task("B", s, k))))  # saved activations
            if s + 1 < p:
                for kind, src, dst in (("F", s, s + 1), ("B", s + 1, s))[:1 + backward[s]]:
                    what = "activations" if kind == "F" else "gradients"
                    send = node(f"send {what} {k}: {src}→{dst}", "send", src, k)
                    recv = node(f"recv {what} {k}: {src}→{dst}", "recv", dst, k)
                    edges += [(compute(Task(kind, src, k)), send), (send, recv), (recv, compute(Task(kind, dst, k)))]
    done = []  # per place with a backward: its last task, after which its sums are whole
    for s in filter(backward.__getitem__, range(p)):
        last = compute(Task("B", s, m - 1)) if m == 1 else None
        for k in range(m if m > 1 else 0):  # several micro-batches: sum each one's gradients in order
            acc = node(f"accumulate {k}@{s}", "accumulate", s, k)
            edges.append((compute(Task("B", s, k)), acc))
            if last is not None:
                edges.append((last, acc))
            last = acc
        done.append(last)
    places = {s: j for j, s in enumerate(filter(backward.__getitem__, range(p)))}  # → its `done`
    applies = list(applies) or [ApplyTask(-1, 0, tuple(places), ())]  # once per step, on the whole mesh
    for a in applies:
        node(a.name, "apply", a.stage)
    sink = node("sink", "sink")
    edges += [(d, sink) for d in done]
    for a in applies:
        i = at[a.name]
        edges += [(done[places[s]], i) for s in a.sums_from] + [(at[apply_task_name(s, w)], i) for s, w in a.reads]
        edges += [(i, sink)] + ([(source, i)] if not a.sums_from and not a.reads else [])
    graph = TaskGraph(tuple(nodes), tuple(edges), schedule.name)
    graph.order()  # acyclic, or ScheduleError
    return graph


def of_plan(plan: Plan) -> TaskGraph:
    """What runs in a plan's step, where and after what: its schedule's tasks and its stages'
    apply-gradients programs."""
    return build(schedules.of_plan(plan), plan.execution.applies)
