"""Cross-mesh resharding ("On Optimizing the Communication of Model Parallelism" §3): a tensor
sent from one stage's mesh, in its layout, to the next stage's mesh, in that one's layout.

The transfer is cut into unit tasks: each region where a distinct piece of the source layout
meets a distinct piece of the destination layout, held by some source devices (any may send it)
and needed by some destination devices (all receive it, in one broadcast-style transfer: the
piece crosses to each receiving host once, then spreads inside it). Hosts are the bottleneck
(the paper's host-level model): a task takes its bytes over the inter-host bandwidth (intra-host
when sender and receivers share a host), and two tasks sharing a host, sender or receiver, do not
overlap. Which source host sends each task, and in what order, is a load-balancing and
scheduling problem; two searches are run and the better kept:
- randomized greedy: round after round, the largest set of tasks that share no host, found among
  random orders (the tasks of a resharding are mostly alike, so this is near optimal);
- depth-first search over senders with pruning by a lower bound on the busiest host, under a time
  budget, each leaf scheduled as early as its hosts allow.
`naive` (the lowest host sends, tasks in order) is the baseline. Execution moves each piece with
jax (device_put to each receiver) and assembles each destination shard from its pieces on its
device: bitwise what `jax.device_put(x, destination)` gives.
"""
from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

Region = tuple[tuple[int, int], ...]  # (start, stop) per dim


@dataclass(frozen=True)
class UnitTask:
    region: Region
    senders: tuple  # source devices holding the region (any may send)
    receivers: tuple  # destination devices that need it
    nbytes: int


@dataclass(frozen=True)
class Hosts:
    """Where devices live and how fast hosts talk (the paper's host-level model)."""

    host_of: Callable[[object], int]
    inter_bandwidth: float  # bytes/s between two hosts
    intra_bandwidth: float  # bytes/s inside a host

    def duration(self, task: UnitTask, sender_host: int) -> float:
        crosses = any(self.host_of(r) != sender_host for r in task.receivers)
        return task.nbytes / (self.inter_bandwidth if crosses else self.intra_bandwidth)


@dataclass(frozen=True)
class ReshardPlan:
    tasks: tuple[UnitTask, ...]
    sender: tuple  # per task: the source device that sends it
    start: tuple[float, ...]  # per task
    makespan_s: float
    lower_bound_s: float
    method: str


def block_map(shape: Sequence[int], devices: np.ndarray, dims: Sequence[Sequence[int]]) -> dict:
    """device → its region when `shape` is split over the mesh `devices` (an array of devices)
    by `dims` (per tensor dim, the mesh dims that split it, major first); a size that does not
    divide is padded, as XLA pads (the paper's case 6)."""
    out = {}
    for index in itertools.product(*(range(n) for n in devices.shape)):
        region = []
        for size, mesh_dims in zip(shape, dims):
            parts, k = 1, 0
            for m in mesh_dims:
                parts, k = parts * devices.shape[m], k * devices.shape[m] + index[m]
            block = -(-size // parts)
            region.append((min(k * block, size), min((k + 1) * block, size)))
        out[devices[index]] = tuple(region)
    return out


def sharding_map(sharding: jax.sharding.Sharding, shape: Sequence[int]) -> dict:
    """device → its region under a jax sharding (jax's own index map)."""
    return {d: tuple((s.start or 0, size if s.stop is None else s.stop) for s, size in zip(idx, shape))
            for d, idx in sharding.devices_indices_map(tuple(shape)).items()}


def unit_tasks(src: Mapping, dst: Mapping, itemsize: int) -> tuple[UnitTask, ...]:
    """The unit tasks of moving a tensor laid out as `src` (device → region) to `dst`."""
    by_region = lambda m: {r: tuple(d for d in m if m[d] == r) for r in dict.fromkeys(m.values())}  # noqa: E731
    tasks = []
    for s_region, senders in by_region(src).items():
        for d_region, receivers in by_region(dst).items():
            meet = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(s_region, d_region))
            if all(lo < hi for lo, hi in meet):
                tasks.append(UnitTask(meet, senders, receivers, itemsize * int(np.prod([hi - lo for lo, hi in meet]))))
    return tuple(tasks)


def host_level(tasks: Sequence[UnitTask], hosts: Hosts) -> tuple[UnitTask, ...]:
    """The tasks as the host-level model sees them, for pricing many tensors' moves at once: a
    receiver that holds the piece already drops out, and tasks between the same sending and
    receiving hosts merge into one (a device per host stands for it)."""
    merged: dict[tuple[frozenset, frozenset], list] = {}
    for t in tasks:
        receivers = [r for r in t.receivers if r not in t.senders]
        if not receivers:
            continue
        by_host = lambda devices: {hosts.host_of(d): d for d in reversed(devices)}  # noqa: E731
        senders, takers = by_host(t.senders), by_host(receivers)
        key = (frozenset(senders), frozenset(takers))
        if key not in merged:
            merged[key] = [tuple(senders.values()), tuple(takers.values()), 0]
        merged[key][2] += t.nbytes
    return tuple(UnitTask((), senders, takers, nbytes) for senders, takers, nbytes in merged.values())


def _schedule(tasks: Sequence[UnitTask], sender_hosts: Sequence[int], order: Sequence[int], hosts: Hosts):
    """Each task, in `order`, as early as its sender host and its receiver hosts are free."""
    free: dict[int, float] = {}
    start = [0.0] * len(tasks)
    for i in order:
        involved = {sender_hosts[i]} | {hosts.host_of(r) for r in tasks[i].receivers}
        start[i] = max((free.get(h, 0.0) for h in involved), default=0.0)
        for h in involved:
            free[h] = start[i] + hosts.duration(tasks[i], sender_hosts[i])
    end = max((start[i] + hosts.duration(tasks[i], sender_hosts[i]) for i in range(len(tasks))), default=0.0)
    return start, end


def lower_bound(tasks: Sequence[UnitTask], hosts: Hosts) -> float:
    """No schedule is shorter: each receiving host takes each of its tasks in turn, a task whose
    pieces one host alone holds keeps that host busy, and every task needs some sending host."""
    recv: dict[int, float] = {}
    only: dict[int, float] = {}
    source_hosts = {hosts.host_of(d) for t in tasks for d in t.senders}
    shortest = []
    for t in tasks:
        options = {hosts.host_of(d) for d in t.senders}
        best = min(hosts.duration(t, h) for h in options)
        shortest.append(best)
        for h in {hosts.host_of(r) for r in t.receivers}:
            recv[h] = recv.get(h, 0.0) + best
        if len(options) == 1:
            h = options.pop()
            only[h] = only.get(h, 0.0) + best
    return max([0.0, *recv.values(), *only.values(), sum(shortest) / max(len(source_hosts), 1)])


def _plan(tasks, senders: Sequence, order: Sequence[int], hosts: Hosts, method: str) -> ReshardPlan:
    start, end = _schedule(tasks, [hosts.host_of(d) for d in senders], order, hosts)
    return ReshardPlan(tuple(tasks), tuple(senders), tuple(start), end, lower_bound(tasks, hosts), method)


def naive(tasks: Sequence[UnitTask], hosts: Hosts) -> ReshardPlan:
    """The baseline: the first device holding a piece sends it, tasks in their order."""
    return _plan(tasks, [t.senders[0] for t in tasks], range(len(tasks)), hosts, "naive")


def _sender_on(task: UnitTask, host: int, hosts: Hosts):
    return next(d for d in task.senders if hosts.host_of(d) == host)


def randomized_greedy(tasks: Sequence[UnitTask], hosts: Hosts, tries: int = 64, seed: int = 0) -> ReshardPlan:
    """Rounds of tasks that share no host, each round the largest set found among `tries`
    random orders (the paper's §3.2), then every task as early as its hosts allow."""
    rng = random.Random(seed)
    left = list(range(len(tasks)))
    order, sender = [], [None] * len(tasks)
    while left:
        best: list[tuple[int, int]] = []
        for _ in range(tries):
            rng.shuffle(left)
            busy: set[int] = set()
            picked = []
            for i in left:
                receiving = {hosts.host_of(r) for r in tasks[i].receivers}
                # a free holder, one on a receiving host first (the piece then stays inside it)
                options = sorted({hosts.host_of(d) for d in tasks[i].senders} - busy,
                                 key=lambda h: (h not in receiving, h))  # noqa: B023
                if options and not receiving & busy:
                    picked.append((i, options[0]))
                    busy |= receiving | {options[0]}
            if len(picked) > len(best):
                best = picked
        for i, h in best:
            order.append(i)
            sender[i] = _sender_on(tasks[i], h, hosts)
        done = {i for i, _ in best}
        left = [i for i in left if i not in done]
    return _plan(tasks, sender, order, hosts, "randomized greedy")


def dfs(tasks: Sequence[UnitTask], hosts: Hosts, budget_s: float = 0.5) -> ReshardPlan:
    """Branch and bound over which task goes next and which host sends it, each placed as early
    as its hosts allow; a branch is cut when a task would end no earlier than the best schedule
    found, or the hosts' remaining receiving work cannot end before it. Stops at the time budget
    with the best found (the paper's §3.2: exponential, for small resharding tasks)."""
    deadline = time.perf_counter() + budget_s
    options = [sorted({hosts.host_of(d) for d in t.senders}) for t in tasks]
    receiving = [{hosts.host_of(r) for r in t.receivers} for t in tasks]
    best = randomized_greedy(tasks, hosts, tries=1)
    chosen = [0] * len(tasks)
    order: list[int] = []

    def visit(free: dict[int, float], left: frozenset[int]) -> None:
        nonlocal best
        if not left:
            end = max(free.values(), default=0.0)
            if end < best.makespan_s - 1e-12:
                best = _plan(tasks, [_sender_on(t, h, hosts) for t, h in zip(tasks, chosen)], list(order), hosts, "dfs")
            return
        if time.perf_counter() > deadline:
            return
        owed: dict[int, float] = {}  # receiving work still to come, per host
        for i in left:
            for h in receiving[i]:
                owed[h] = owed.get(h, 0.0) + min(hosts.duration(tasks[i], s) for s in options[i])
        if any(free.get(h, 0.0) + w >= best.makespan_s - 1e-12 for h, w in owed.items()):
            return
        moves = []
        for i in left:
            for h in options[i]:
                at = max(free.get(x, 0.0) for x in receiving[i] | {h})
                moves.append((at, at + hosts.duration(tasks[i], h), i, h))
        for at, end, i, h in sorted(moves):
            if end >= best.makespan_s - 1e-12:
                continue
            chosen[i] = h
            order.append(i)
            visit({**free, **{x: end for x in receiving[i] | {h}}}, left - {i})
            order.pop()

    visit({}, frozenset(range(len(tasks))))
    return best


def plan(tasks: Sequence[UnitTask], hosts: Hosts, budget_s: float = 0.5) -> ReshardPlan:
    """The better of randomized greedy and DFS (the paper: keep the better)."""
    return min((randomized_greedy(tasks, hosts), dfs(tasks, hosts, budget_s)), key=lambda p: p.makespan_s)


def reshard(x: jax.Array, destination: jax.sharding.Sharding, schedule: ReshardPlan | None = None) -> jax.Array:
    """`x` in `destination`'s layout, moved piece by piece in the schedule's order (default: one
    task per region, the first holder sending): each piece is cut from its sender's shard and put
    on each receiver; each destination shard is then assembled on its device."""
    shape = x.shape
    if schedule is None:
        tasks = unit_tasks(sharding_map(x.sharding, shape), sharding_map(destination, shape), x.dtype.itemsize)
        schedule = ReshardPlan(tasks, tuple(t.senders[0] for t in tasks), tuple(range(len(tasks))), 0.0, 0.0, "naive")
    shards = {s.device: s.data for s in x.addressable_shards}
    source = sharding_map(x.sharding, shape)
    target = sharding_map(destination, shape)
    pieces: dict = {d: [] for d in target}
    for i in sorted(range(len(schedule.tasks)), key=lambda i: schedule.start[i]):
        task, sender = schedule.tasks[i], schedule.sender[i]
        local = tuple(slice(lo - s0, hi - s0) for (lo, hi), (s0, _) in zip(task.region, source[sender]))
        piece = shards[sender][local]
        for r in task.receivers:
            pieces[r].append((task.region, jax.device_put(piece, r)))
    out = []
    for device, region in target.items():
        block = jnp.zeros([hi - lo for lo, hi in region], x.dtype, device=device)
        for where, piece in pieces[device]:
            block = block.at[tuple(slice(lo - r0, hi - r0) for (lo, hi), (r0, _) in zip(where, region))].set(piece)
        out.append(block)
    return jax.make_array_from_single_device_arrays(shape, destination, out)
