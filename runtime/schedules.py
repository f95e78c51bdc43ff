"""Static pipeline schedules as data (Rhino §6.2; nnScaler: schedules are data, checked before use).

A schedule is, per stage, the order in which it runs the forward (F) and backward (B) pass of
each micro-batch. All three schedules are one pattern: stage s first runs W(s) forwards (the
warm-up), then alternates one backward and one forward until the forwards run out, then runs
the remaining backwards:
- GPipe: W = m, every forward, then every backward;
- 1F1B (PipeDream-Flush, Rhino's default): W = p − s, so stage s holds at most p − s micro-batches'
  activations;
- eager-1F1B ("On Optimizing the Communication of Model Parallelism" §4): W = 2(p − s) − 1,
  forwards run ahead so that a stage has work while a transfer is in flight, at the price of
  p − s − 1 more micro-batches held.
(p stages, m micro-batches, stages counted from 0.) `check` proves a schedule runs: every task
once, F before B of a micro-batch on its stage, and no stage waiting forever on another.

A schedule may also be derived from ordering constraints (nnScaler's op-order, its Table 4):
pairs "task a runs before task b" on one stage (`ordered`). 1F1B is ① F(k) before F(k+1),
② B(k) before B(k+1), ③ F(k+w−1) before B(k) and ④ B(k) before F(k+w), w = p − s; the three
schedules above, written so, come out as `make` makes them.

Interlaced pipelines (nnScaler's interlaced pipeline, its §4.2): the chain of places a
micro-batch passes through may hold, besides the stages, places whose programs run on every
device (`shared`: a large embedding before the first stage and its tied output projection after
the last). A shared task occupies every device, so it appears in every stage's order; it starts
once it is next on every stage. `interlace` inserts them into a schedule of the stages.

Multi-forward steps (nnScaler's 3F1B, its §4.2, AlphaFold2's recycling): each micro-batch
passes through the stages R times, the first R − 1 passes without a backward (they run under
`stop_gradient`). Its chain of places is pass-major, place r·p + s being pass r on stage s; the
places of one stage share its devices, so a stage's order holds the tasks of all of them, and
only the last pass's places have a backward. `make` gives GPipe (every forward first) and the
multi-forward 1F1B of Table 7: ① F of pass r, micro-batch m + 1 before F of pass r + 1,
micro-batch m (the passes of consecutive micro-batches interleave), ③ F of the last pass,
micro-batch m before B of micro-batch m − (p − 1 − s); the rest is list-scheduled (`ordered`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from rhino_jax.core.plan import Plan
from rhino_jax.errors import ScheduleError

NAMES = ("gpipe", "1f1b", "eager-1f1b")


@dataclass(frozen=True, order=True)
class Task:
    kind: str  # "F" | "B"
    stage: int  # a stage (as users write tasks), or a place of the chain (inside a Schedule)
    micro_batch: int
    forward_pass: int = 0  # a multi-forward step's pass of an F task (users' tasks; places number them inside)

    def __str__(self) -> str:
        of_pass = f" pass {self.forward_pass}" if self.forward_pass else ""
        return f"{self.kind}{self.micro_batch}@{self.stage}{of_pass}"


def placed(task: Task, stages: int, passes: int) -> Task:
    """A user's task (stage, pass) as the task of its place in a chain of `passes` passes over
    `stages` stages (place r·stages + s; a backward runs in the last pass)."""
    if not (0 <= task.stage < stages and 0 <= task.forward_pass < passes) or (task.kind == "B" and task.forward_pass):
        raise ScheduleError(f"{task!r} is not a task of {stages} stages and {passes} forward passes (stage counted "
                            f"from 0; forward_pass from 0 to {passes - 1}, only for an F task)")
    r = task.forward_pass if task.kind == "F" else passes - 1
    return Task(task.kind, r * stages + task.stage, task.micro_batch)


@dataclass(frozen=True)
class Schedule:
    name: str
    stages: int  # places in a micro-batch's chain: the stages, and any shared places between them
    micro_batches: int
    order: tuple[tuple[Task, ...], ...]  # per stage (`groups`), in run order, with every shared task
    shared: tuple[int, ...] = ()  # the places whose programs run on every device
    passes: int = 1  # a multi-forward step's forward passes: place r·(stages / passes) + s is pass r on stage s

    def groups(self) -> tuple[int, ...]:
        """The first place that runs on each stage's own devices, one per row of `order`."""
        if self.passes > 1:
            return tuple(range(self.stages // self.passes))
        return tuple(s for s in range(self.stages) if s not in self.shared)

    def row(self, place: int) -> int:
        """The row of `order` a place of its own devices runs in (a stage's)."""
        return place % (self.stages // self.passes) if self.passes > 1 else self.groups().index(place)

    def has_backward(self, place: int) -> bool:
        """Whether the place runs a backward pass: all but a multi-forward step's earlier passes."""
        return place >= self.stages - self.stages // self.passes

    def rows(self) -> tuple[str, ...]:
        """Each stage's order as text ("F0 F1 B0 F2 B1 B2"; a shared place's task "F0@3"), as a
        plan saves an op_order or interlaced schedule (`parse`)."""
        return tuple(" ".join(f"{t.kind}{t.micro_batch}" + (f"@{t.stage}" if t.stage != g else "") for t in tasks)
                     for g, tasks in zip(self.groups(), self.order))

    @staticmethod
    def parse(name: str, rows: Sequence[str], micro_batches: int, shared: Sequence[int] = (),
              passes: int = 1) -> "Schedule":
        """The schedule `rows` writes (`Schedule.rows`), checked."""
        places = len(rows) * passes + len(shared)
        groups = Schedule(name, places, micro_batches, (), tuple(shared), passes).groups()
        try:
            order = tuple(tuple(Task(w[0], int(w.split("@")[1]) if "@" in w else g, int(w[1:].split("@")[0]))
                                for w in row.split()) for g, row in zip(groups, rows))
        except (ValueError, IndexError):
            raise ScheduleError(f"{name}: a stage's order must be words like F0 or B3, got {list(rows)!r}") from None
        schedule = Schedule(name, places, micro_batches, order, tuple(shared), passes)
        schedule.check()
        return schedule

    def needs(self, task: Task) -> list[Task]:
        """The tasks of other stages, and its own forward, a task waits for."""
        k, s = task.micro_batch, task.stage
        if task.kind == "F":
            return [Task("F", s - 1, k)] if s > 0 else []
        return [Task("F", s, k)] + ([Task("B", s + 1, k)] if s < self.stages - 1 else [])

    def tasks_of(self, place: int) -> tuple[Task, ...]:
        """The tasks of one place in the order they run (a shared place's: as every stage has them)."""
        row = self.order[self.row(place) if place not in self.shared else 0]
        return tuple(t for t in row if t.stage == place)

    def in_flight(self) -> tuple[int, ...]:
        """Per place, the most micro-batches forwarded and not yet backwarded at once (whose
        activations the place holds; a place without a backward holds none)."""
        peaks = []
        for s in range(self.stages):
            if not self.has_backward(s):
                peaks.append(0)
                continue
            held = peak = 0
            for t in self.tasks_of(s):
                held += 1 if t.kind == "F" else -1
                peak = max(peak, held)
            peaks.append(peak)
        return tuple(peaks)

    def check(self) -> None:
        """Raise ScheduleError unless every task runs once, a micro-batch's F runs before its B
        on each place, and the stages can run it without waiting on each other forever."""
        p, m = self.stages, self.micro_batches
        if self.passes < 1 or p % self.passes or (self.passes > 1 and self.shared):
            raise ScheduleError(f"{self.name}: {self.passes} forward passes over {p} places (a whole number of places "
                                "per pass, and no places on every device)")
        groups = self.groups()
        if len(self.order) != len(groups) or not all(0 <= s < p for s in self.shared):
            raise ScheduleError(f"{self.name}: {len(self.order)} stage orders for {p} places of which "
                                f"{list(self.shared)} are shared")
        shared = {Task(kind, s, k) for s in self.shared for kind in "FB" for k in range(m)}
        own = [s for s in range(p) if s not in self.shared]
        for g, tasks in enumerate(self.order):
            want = {Task(kind, s, k) for s in own if self.row(s) == g for kind in "FB"[:1 + self.has_backward(s)]
                    for k in range(m)} | shared
            if len(tasks) != len(set(tasks)) or set(tasks) != want:
                missing, extra = sorted(want - set(tasks)), sorted(set(tasks) - want)
                raise ScheduleError(f"{self.name}: stage {groups[g]} must run each F and B of micro-batches 0..{m - 1} "
                                    f"once; missing {[str(t) for t in missing]}, unexpected or repeated "
                                    f"{[str(t) for t in extra] or [str(t) for t in tasks if tasks.count(t) > 1]}")
        for s in filter(self.has_backward, range(p)):
            position = {t: i for i, t in enumerate(self.tasks_of(s))}
            for k in range(m):
                if position[Task("B", s, k)] < position[Task("F", s, k)]:
                    raise ScheduleError(f"{self.name}: stage {s} runs B{k} before F{k}")
        self.timeline(lambda t: 1.0)

    def timeline(self, duration: Callable[[Task], float], transfer_s: float = 0.0) -> dict[Task, tuple[float, float]]:
        """(start, end) of every task when each stage runs its order as soon as what it needs has
        arrived: a result of another place `transfer_s` after it ends; a shared task once it is
        next on every stage, which it then occupies. ScheduleError on a deadlock (a stage's next
        task waits on a task that waits on it)."""
        done: dict[Task, tuple[float, float]] = {}
        rows = len(self.order)
        free = [0.0] * rows
        nxt = [0] * rows
        while any(n < len(o) for n, o in zip(nxt, self.order)):
            moved = False
            for g, tasks in enumerate(self.order):
                while nxt[g] < len(tasks):
                    t = tasks[nxt[g]]
                    needs = self.needs(t)
                    on = range(rows) if t.stage in self.shared else (g,)
                    if any(n not in done for n in needs) or any(self.order[h][nxt[h]] != t for h in on):
                        break
                    ready = max([free[h] for h in on] + [done[n][1] + (transfer_s if n.stage != t.stage else 0.0)
                                                        for n in needs])
                    done[t] = (ready, ready + duration(t))
                    for h in on:
                        free[h] = done[t][1]
                        nxt[h] += 1
                    moved = True
            if not moved:
                waiting = [str(o[n]) for n, o in zip(nxt, self.order) if n < len(o)]
                raise ScheduleError(f"{self.name}: deadlock, every stage waits: next tasks {waiting}")
        return done

    def makespan(self, forward_s: Sequence[float], backward_s: Sequence[float], transfer_s: float = 0.0) -> float:
        """The schedule's time for one step: per-stage F and B times, a transfer between stages."""
        times = self.timeline(lambda t: (forward_s if t.kind == "F" else backward_s)[t.stage], transfer_s)
        return max(end for _, end in times.values())


def _warm_up(name: str, stages: int, micro_batches: int) -> Callable[[int], int]:
    if name == "gpipe":
        return lambda s: micro_batches
    if name == "1f1b":
        return lambda s: stages - s
    if name == "eager-1f1b":
        return lambda s: 2 * (stages - s) - 1
    raise ScheduleError(f"unknown schedule {name!r}; choose one of {NAMES}")


def make(name: str, stages: int, micro_batches: int, passes: int = 1) -> Schedule:
    """The named schedule for `stages` stages and `micro_batches` micro-batches, checked; for a
    multi-forward step of `passes` forward passes, by ordering constraints (module docstring)."""
    if stages < 1 or micro_batches < 1:
        raise ScheduleError(f"a schedule needs at least one stage and one micro-batch, got {stages} and "
                            f"{micro_batches}")
    if passes > 1:
        return ordered(stages, micro_batches, _multi_forward(name, stages, micro_batches, passes), name, passes)
    warm_up = _warm_up(name, stages, micro_batches)
    order = []
    for s in range(stages):
        w = min(warm_up(s), micro_batches)
        tasks = [Task("F", s, k) for k in range(w)]
        for k in range(micro_batches):
            tasks.append(Task("B", s, k))
            if w + k < micro_batches:
                tasks.append(Task("F", s, w + k))
        order.append(tuple(tasks))
    schedule = Schedule(name, stages, micro_batches, tuple(order))
    schedule.check()
    return schedule


def of_plan(plan: Plan) -> Schedule:
    """A plan's pipeline schedule as it runs (one stage, one micro-batch without a pipeline): an
    op_order or interlaced schedule from its saved rows, the others made again from their name."""
    e = plan.execution
    if e.schedule_rows:
        return Schedule.parse(e.schedule, e.schedule_rows, e.micro_batches, e.shared_places, e.passes)
    return make(e.schedule or "1f1b", e.pipeline, e.micro_batches, e.passes)


def _multi_forward(name: str, stages: int, micro_batches: int, passes: int) -> list[tuple[Task, Task]]:
    """The ordering constraints of a named schedule for a multi-forward step (module docstring):
    GPipe, every forward before any backward on a stage; 1F1B, nnScaler's Table 7 (3F1B)."""
    p, m, last = stages, micro_batches, passes - 1
    if name == "gpipe":
        return [(Task("F", s, k, r), Task("B", s, j)) for s in range(p) for k in range(m) for r in range(passes)
                for j in range(m)]
    if name != "1f1b":
        raise ScheduleError(f"a step of {passes} forward passes runs schedule 'gpipe' or '1f1b' (nnScaler's "
                            f"{passes}F1B), or an rj.op_order; got {name!r}")
    pairs = [(Task("F", s, k + 1, r), Task("F", s, k, r + 1))  # ① the passes of consecutive micro-batches interleave
             for s in range(p) for r in range(last) for k in range(m - 1)]
    pairs += [(Task("F", s, k, last), Task("B", s, k - (p - 1 - s)))  # ③ the last pass, then a backward 1F1B's offset
              for s in range(p) for k in range(p - 1 - s, m)]
    return pairs


def ordered(stages: int, micro_batches: int, before: Iterable[tuple[Task, Task]], name: str = "op_order",
            passes: int = 1) -> Schedule:
    """The schedule the ordering constraints `before` ((a, b): a runs before b, both on one
    stage) call for, checked. Each stage runs its tasks in an order the constraints allow, a
    micro-batch's F before its B; where they leave a choice, the task that can start first runs
    (F taking 1 and B 2, as a backward pass about doubles its forward), ties to the earlier
    micro-batch, then to its B. Constraints that name a task the pipeline lacks or pair two
    stages, form a cycle, or deadlock the stages are a ScheduleError. `passes`: a multi-forward
    step's forward passes (its tasks name theirs, `Task.forward_pass`); the schedule is of places."""
    if stages < 1 or micro_batches < 1 or passes < 1:
        raise ScheduleError(f"a schedule needs at least one stage, micro-batch and pass, got {stages}, "
                            f"{micro_batches} and {passes}")
    places = stages * passes
    probe = Schedule(name, places, micro_batches, (), passes=passes)
    tasks = [Task(kind, s, k) for s in range(places) for k in range(micro_batches)
             for kind in "FB"[:1 + probe.has_backward(s)]]
    preds: dict[Task, set[Task]] = {t: set() for t in tasks}
    for t in tasks:
        if t.kind == "B":
            preds[t].add(Task("F", t.stage, t.micro_batch))
    for pair in before:
        if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(t, Task) for t in pair)):
            raise ScheduleError(f"{name}: each ordering constraint is a pair (a, b) of Tasks, e.g. "
                                f"(Task('F', 0, 1), Task('B', 0, 0)); got {pair!r}")
        a, b = pair
        for t in pair:
            if placed(t, stages, passes) not in preds:
                raise ScheduleError(f"{name}: {t} is not a task of {stages} stages and {micro_batches} micro-batches "
                                    "(kind F or B, stage and micro-batch counted from 0)")
        if a.stage != b.stage:
            raise ScheduleError(f"{name}: ({a}, {b}) orders tasks of two stages; the stages' own dependencies order "
                                "those (a stage's F after the previous stage's, its B after the next stage's)")
        preds[placed(b, stages, passes)].add(placed(a, stages, passes))
    order: list[list[Task]] = [[] for _ in range(stages)]
    end: dict[Task, float] = {}
    free = [0.0] * stages
    waiting = {t: len(ps) for t, ps in preds.items()}
    succs: dict[Task, list[Task]] = {t: [] for t in tasks}
    for t, ps in preds.items():
        for q in ps:
            succs[q].append(t)
    allowed = [t for t in tasks if not waiting[t]]  # every in-stage predecessor has run
    while allowed:
        ready = []  # (start, micro-batch, B first, place, task) of the allowed tasks whose inputs are made
        for t in allowed:
            needs = probe.needs(t)
            if all(n in end for n in needs):
                ready.append((max([free[probe.row(t.stage)]] + [end[n] for n in needs]), t.micro_batch,
                              t.kind != "B", t.stage, t))
        if not ready:
            break
        start, *_, t = min(ready)
        allowed.remove(t)
        end[t] = start + (1.0 if t.kind == "F" else 2.0)
        free[probe.row(t.stage)] = end[t]
        order[probe.row(t.stage)].append(t)
        for u in succs[t]:
            waiting[u] -= 1
            if not waiting[u]:
                allowed.append(u)
    if len(end) < len(tasks):
        stuck = sorted(t for t in tasks if t not in end)
        raise ScheduleError(f"{name}: the ordering constraints leave {len(stuck)} tasks unable to run (a cycle among "
                            f"them, or a task waiting on another stage that waits on it): "
                            f"{', '.join(map(str, stuck[:8]))}{' ...' if len(stuck) > 8 else ''}")
    schedule = Schedule(name, places, micro_batches, tuple(map(tuple, order)), passes=passes)
    schedule.check()
    return schedule


# Tie-breaks among the tasks that can start first (`interlace`): each orders (start, task,
# duration); the one whose schedule ends first is kept.
_TIES: tuple[Callable[[float, Task, float, bool], tuple], ...] = (
    lambda start, t, d, shared: (start, t.micro_batch, t.kind != "B", t.stage),  # the earlier micro-batch
    lambda start, t, d, shared: (start, d, t.micro_batch, t.stage),  # the shorter task
    lambda start, t, d, shared: (start, not shared, t.micro_batch, t.stage),  # the shared task
    lambda start, t, d, shared: (start, shared, t.micro_batch, t.kind != "B", t.stage),  # the stage's task
)


def interlace(base: Schedule, shared: Sequence[int], duration: Callable[[Task], float],
              transfer_s: float = 0.0) -> Schedule:
    """`base` (a schedule of the stages) with the places `shared` (indices in the chain of
    `base.stages + len(shared)` places; the stages keep their order in the others) run on every
    device between them: the interlaced pipeline of nnScaler (its §4.2). Each stage keeps
    `base`'s order; a shared place runs its forwards, and its backwards, in micro-batch order.
    Tasks are placed by list scheduling with `duration` (a task's predicted time) and
    `transfer_s` between places: of the tasks whose inputs are made and which are next on their
    devices, one that can start first runs, a shared task once every stage is free; of the ways
    to break ties (`_TIES`), the one whose step ends first is kept. The result is checked like
    any schedule."""
    places = base.stages + len(shared)
    if base.shared or base.passes > 1 or not all(0 <= s < places for s in shared) or len(set(shared)) != len(shared):
        raise ScheduleError(f"{base.name}: shared places {list(shared)} do not fit a chain of {places} places")
    shared = tuple(sorted(shared))
    best = min((_list_scheduled(base, shared, duration, transfer_s, tie) for tie in _TIES), key=lambda found: found[0])
    schedule = Schedule(base.name, places, base.micro_batches, best[1], shared)
    schedule.check()
    return schedule


def _list_scheduled(base: Schedule, shared: tuple[int, ...], duration: Callable[[Task], float], transfer_s: float,
                    tie: Callable) -> tuple[float, tuple[tuple[Task, ...], ...]]:
    """`interlace`'s list scheduling with one tie-break: (the step's end, each stage's order)."""
    probe = Schedule(base.name, base.stages + len(shared), base.micro_batches, (), shared)
    groups = probe.groups()
    queues = [[Task(t.kind, g, t.micro_batch) for t in row] for g, row in zip(groups, base.order)]
    own = {(s, kind): [Task(kind, s, k) for k in range(base.micro_batches)] for s in shared for kind in "FB"}
    taken = [0] * len(groups)
    order: list[list[Task]] = [[] for _ in groups]
    free = [0.0] * len(groups)
    end: dict[Task, float] = {}
    total = sum(map(len, queues)) + sum(map(len, own.values()))
    while len(end) < total:
        ready = []  # (tie key, task, the stages it occupies, start)
        nexts = [(queue[taken[g]], (g,)) for g, queue in enumerate(queues) if taken[g] < len(queue)]
        nexts += [(tasks[0], tuple(range(len(groups)))) for tasks in own.values() if tasks]
        for t, on in nexts:
            needs = probe.needs(t)
            if all(n in end for n in needs):
                start = max([free[h] for h in on] + [end[n] + (transfer_s if n.stage != t.stage else 0.0)
                                                     for n in needs])
                ready.append((tie(start, t, duration(t), t.stage in shared), t, on, start))
        if not ready:
            raise ScheduleError(f"{base.name}: the shared places {list(shared)} cannot be interlaced: every stage "
                                "waits")
        _, t, on, start = min(ready)
        end[t] = start + duration(t)
        for h in on:
            free[h] = end[t]
            order[h].append(t)
        if t.stage in shared:
            own[t.stage, t.kind].pop(0)
        else:
            taken[on[0]] += 1
    return max(end.values(), default=0.0), tuple(map(tuple, order))
