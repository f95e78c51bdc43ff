"""Static pipeline schedules as data (Rhino §6.2; nnScaler: schedules are data, checked before use).

A schedule is, per stage, the order in which it runs the forward (F) and backward (B) pass of
each micro-batch. All three schedules are one pattern: stage s first runs W(s) forwards (the
warm-up), then alternates one backward and one forward until the forwards run out, then runs
the remaining backwards:
- GPipe: W = m, every forward, then every backward;
- 1F1B (PipeDream-Flush, Rhino's default): W = p − s, so stage s holds at most p − s micro-batches'
  activations;
- eager-1F1B (seeds/004 §4): W = 2(p − s) − 1, forwards run ahead so that a stage has work while
  a transfer is in flight, at the price of p − s − 1 more micro-batches held.
(p stages, m micro-batches, stages counted from 0.) `check` proves a schedule runs: every task
once, F before B of a micro-batch on its stage, and no stage waiting forever on another.

A schedule may also be derived from ordering constraints (nnScaler's op-order, seeds/002 Table 4):
pairs "task a runs before task b" on one stage (`ordered`). 1F1B is ① F(k) before F(k+1),
② B(k) before B(k+1), ③ F(k+w−1) before B(k) and ④ B(k) before F(k+w), w = p − s; the three
schedules above, written so, come out as `make` makes them.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from rhino_jax.errors import ScheduleError

NAMES = ("gpipe", "1f1b", "eager-1f1b")


@dataclass(frozen=True, order=True)
class Task:
    kind: str  # "F" | "B"
    stage: int
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}@{self.stage}"


@dataclass(frozen=True)
class Schedule:
    name: str
    stages: int
    micro_batches: int
    order: tuple[tuple[Task, ...], ...]  # per stage, in run order

    def rows(self) -> tuple[str, ...]:
        """Each stage's order as text ("F0 F1 B0 F2 B1 B2"), as a plan saves an op_order schedule
        (`parse`)."""
        return tuple(" ".join(f"{t.kind}{t.micro_batch}" for t in tasks) for tasks in self.order)

    @staticmethod
    def parse(name: str, rows: Sequence[str], micro_batches: int) -> "Schedule":
        """The schedule `rows` writes (`Schedule.rows`), checked."""
        try:
            order = tuple(tuple(Task(w[0], s, int(w[1:])) for w in row.split()) for s, row in enumerate(rows))
        except (ValueError, IndexError):
            raise ScheduleError(f"{name}: a stage's order must be words like F0 or B3, got {list(rows)!r}") from None
        schedule = Schedule(name, len(rows), micro_batches, order)
        schedule.check()
        return schedule

    def needs(self, task: Task) -> list[Task]:
        """The tasks of other stages, and its own forward, a task waits for."""
        k, s = task.micro_batch, task.stage
        if task.kind == "F":
            return [Task("F", s - 1, k)] if s > 0 else []
        return [Task("F", s, k)] + ([Task("B", s + 1, k)] if s < self.stages - 1 else [])

    def in_flight(self) -> tuple[int, ...]:
        """Per stage, the most micro-batches forwarded and not yet backwarded at once (whose
        activations the stage holds)."""
        peaks = []
        for tasks in self.order:
            held = peak = 0
            for t in tasks:
                held += 1 if t.kind == "F" else -1
                peak = max(peak, held)
            peaks.append(peak)
        return tuple(peaks)

    def check(self) -> None:
        """Raise ScheduleError unless every task runs once, a micro-batch's F runs before its B
        on each stage, and the stages can run it without waiting on each other forever."""
        p, m = self.stages, self.micro_batches
        if len(self.order) != p:
            raise ScheduleError(f"{self.name}: {len(self.order)} stage orders for {p} stages")
        for s, tasks in enumerate(self.order):
            want = {Task(kind, s, k) for kind in "FB" for k in range(m)}
            if len(tasks) != len(set(tasks)) or set(tasks) != want:
                missing, extra = sorted(want - set(tasks)), sorted(set(tasks) - want)
                raise ScheduleError(f"{self.name}: stage {s} must run each F and B of micro-batches 0..{m - 1} "
                                    f"once; missing {[str(t) for t in missing]}, unexpected or repeated "
                                    f"{[str(t) for t in extra] or [str(t) for t in tasks if tasks.count(t) > 1]}")
            position = {t: i for i, t in enumerate(tasks)}
            for k in range(m):
                if position[Task("B", s, k)] < position[Task("F", s, k)]:
                    raise ScheduleError(f"{self.name}: stage {s} runs B{k} before F{k}")
        self.timeline(lambda t: 1.0)

    def timeline(self, duration: Callable[[Task], float], transfer_s: float = 0.0) -> dict[Task, tuple[float, float]]:
        """(start, end) of every task when each stage runs its order as soon as what it needs has
        arrived: a result of another stage `transfer_s` after it ends. ScheduleError on a
        deadlock (a stage's next task waits on a task that waits on it)."""
        done: dict[Task, tuple[float, float]] = {}
        free = [0.0] * self.stages
        nxt = [0] * self.stages
        while any(n < len(o) for n, o in zip(nxt, self.order)):
            moved = False
            for s, tasks in enumerate(self.order):
                while nxt[s] < len(tasks):
                    t = tasks[nxt[s]]
                    needs = self.needs(t)
                    if any(n not in done for n in needs):
                        break
                    ready = max([free[s]] + [done[n][1] + (transfer_s if n.stage != s else 0.0) for n in needs])
                    done[t] = (ready, ready + duration(t))
                    free[s] = done[t][1]
                    nxt[s] += 1
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


def make(name: str, stages: int, micro_batches: int) -> Schedule:
    """The named schedule for `stages` stages and `micro_batches` micro-batches, checked."""
    if stages < 1 or micro_batches < 1:
        raise ScheduleError(f"a schedule needs at least one stage and one micro-batch, got {stages} and "
                            f"{micro_batches}")
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


def ordered(stages: int, micro_batches: int, before: Iterable[tuple[Task, Task]], name: str = "op_order") -> Schedule:
    """The schedule the ordering constraints `before` ((a, b): a runs before b, both on one
    stage) call for, checked. Each stage runs its tasks in an order the constraints allow, a
    micro-batch's F before its B; where they leave a choice, the task that can start first runs
    (F taking 1 and B 2, as a backward pass about doubles its forward), ties to the earlier
    micro-batch, then to its B. Constraints that name a task the pipeline lacks or pair two
    stages, form a cycle, or deadlock the stages are a ScheduleError."""
    if stages < 1 or micro_batches < 1:
        raise ScheduleError(f"a schedule needs at least one stage and one micro-batch, got {stages} and "
                            f"{micro_batches}")
    tasks = [Task(kind, s, k) for s in range(stages) for k in range(micro_batches) for kind in "FB"]
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
            if t not in preds:
                raise ScheduleError(f"{name}: {t} is not a task of {stages} stages and {micro_batches} micro-batches "
                                    "(kind F or B, stage and micro-batch counted from 0)")
        if a.stage != b.stage:
            raise ScheduleError(f"{name}: ({a}, {b}) orders tasks of two stages; the stages' own dependencies order "
                                "those (a stage's F after the previous stage's, its B after the next stage's)")
        preds[b].add(a)
    order: list[list[Task]] = [[] for _ in range(stages)]
    end: dict[Task, float] = {}
    free = [0.0] * stages
    waiting = {t: len(ps) for t, ps in preds.items()}
    succs: dict[Task, list[Task]] = {t: [] for t in tasks}
    for t, ps in preds.items():
        for q in ps:
            succs[q].append(t)
    probe = Schedule(name, stages, micro_batches, ())
    allowed = [t for t in tasks if not waiting[t]]  # every in-stage predecessor has run
    while allowed:
        ready = []  # (start, micro-batch, B first, stage, task) of the allowed tasks whose inputs are made
        for t in allowed:
            needs = probe.needs(t)
            if all(n in end for n in needs):
                ready.append((max([free[t.stage]] + [end[n] for n in needs]), t.micro_batch, t.kind != "B", t.stage, t))
        if not ready:
            break
        start, *_, t = min(ready)
        allowed.remove(t)
        end[t] = start + (1.0 if t.kind == "F" else 2.0)
        free[t.stage] = end[t]
        order[t.stage].append(t)
        for u in succs[t]:
            waiting[u] -= 1
            if not waiting[u]:
                allowed.append(u)
    if len(end) < len(tasks):
        stuck = sorted(t for t in tasks if t not in end)
        raise ScheduleError(f"{name}: the ordering constraints leave {len(stuck)} tasks unable to run (a cycle among "
                            f"them, or a task waiting on another stage that waits on it): "
                            f"{', '.join(map(str, stuck[:8]))}{' ...' if len(stuck) > 8 else ''}")
    schedule = Schedule(name, stages, micro_batches, tuple(map(tuple, order)))
    schedule.check()
    return schedule
