"""Plans within `memory_limit_bytes`: Rhino §4.4's search over which large arguments may not stay
replicated (few solves, galloping then bisection), then memory priced in the ILP's objective; the
errors that say why no plan fits, with a true lower bound."""
from __future__ import annotations

import warnings

import numpy as np

from rhino_jax.errors import MemoryLimitError, SolverError, SolverTimeLimitWarning
from rhino_jax.core.plan import Plan

from ..hlo_passes.graph import Graph
from . import progress
from .coarsening.cones import Cone
from .cost.memory import held_fractions, local_bytes
from .solvers import levels


def by_size(graph: Graph, units, groups: list[Cone], sizes: dict[str, int]) -> list[int]:
    """Groups of the parameters and optimizer states that can be sharded, largest first."""
    found = []
    for g, cone in enumerate(groups):
        u = units[cone.root]
        if u.kind != "arg" or graph.args[u.ref].role not in ("parameter", "optimizer_state"):
            continue
        if any(ch[cone.root].results[0].shard_factor(sizes) > 1 for ch in cone.choice):
            found.append(g)
    return sorted(found, key=lambda g: -graph.values[units[groups[g].root].results[0]].nbytes)


PROBE_ALL = 128  # more candidates than this: k = all is tried first (`fit_memory`)


def fit_memory(plan_with, candidates: list[int], args: list[int], unlimited: Plan, limit: int,
               graph: Graph, least: int, deadline: levels.Deadline | None = None, near: Plan | None = None) -> Plan:
    """The fastest plan within the limit among every plan solved on the way.

    First Rhino §4.4: forbid replicating the k largest parameters (and optimizer states), k found
    by galloping up from the small end (k = 1, 2, 4, ...), then by bisection down to the smallest
    k that fits: about 2 log2(k) solves, as a few tensors usually hold most of the memory. A plan
    that keeps more of the leading candidates off replication than it was made to is also the
    best plan for those larger k, so a plan that does not fit rules them out too (`_leading`).
    Memory need not fall as k grows (a plan forced to shard its weights may replicate its
    activations instead), so when no k fits, the ILP prices memory itself (`_weigh_memory`).
    With more than `PROBE_ALL` candidates (a large model: the gallop would take 2 log2 of them),
    k = all is solved first: when even that does not fit, the gallop is skipped; when it fits,
    it bounds the gallop.
    `near`: the plan this search kept under the same limit at another price of communication
    (an earlier overlap round); its answer (its k, or its price of memory) is tried first and
    kept where it fits, without the whole gallop: the answer rarely moves between rounds, and
    the trials are most of a large model's search (a 70B Llama's pipeline stages: 8 to 14 each).
    `least`: a lower bound on every plan's memory, for the error. No trial starts after the
    `deadline`: the best plan that fits so far, else a SolverError that says so."""
    tried = [unlimited]
    out_of_time = False

    def fits(plan: Plan) -> bool:
        return plan.cost.memory_bytes <= limit

    def stop() -> bool:
        """Whether to end the search here: interrupted, or out of time (Ctrl-C with no plan that
        fits: KeyboardInterrupt)."""
        nonlocal out_of_time
        _stop_if_interrupted(tried, fits)
        out_of_time = deadline is not None and deadline.left() <= 0
        return out_of_time or tried[-1].search_stats.status == "interrupted"

    lo, hi, step = _leading(unlimited, args), None, 1  # the plan with k = lo does not fit
    k = len(near.search_stats.not_replicated) if near is not None else 0
    if near is not None and near.search_stats.memory_weight_s:
        lo = len(candidates)  # no k fitted before: straight to pricing memory, from that price
    elif lo < k <= len(candidates) and not stop():  # the earlier answer: kept where it still fits
        tried.append(_try(plan_with, candidates, k, limit))
        if fits(tried[-1]):
            lo, hi = k - 1, k
        else:
            lo = max(k, _leading(tried[-1], args))
    elif len(candidates) > PROBE_ALL and lo < len(candidates) and not stop():
        tried.append(_try(plan_with, candidates, len(candidates), limit))
        if not fits(tried[-1]):
            lo = len(candidates)  # no k fits: straight to pricing memory
        else:
            hi = len(candidates)
    while lo < len(candidates) and not stop():  # gallop up to a k = hi that fits
        k = min(lo + step, len(candidates))
        if hi is not None and k >= hi:  # the probe's k = all fits: bisect below it
            break
        tried.append(_try(plan_with, candidates, k, limit))
        if fits(tried[-1]):
            hi = k
            break
        lo, step = max(k, _leading(tried[-1], args)), 2 * step
    while hi is not None and hi - lo > 1 and not stop():
        k = (lo + hi) // 2  # bisect down to the smallest k that fits
        tried.append(_try(plan_with, candidates, k, limit))
        if fits(tried[-1]):
            hi = k
        else:
            lo = max(k, min(_leading(tried[-1], args), hi - 1))
    if hi is None and not stop():
        _weigh_memory(plan_with, tried, limit, fits, stop, near.search_stats.memory_weight_s if near else 0.0)
    fitting = [p for p in tried if fits(p)]
    if not fitting and out_of_time:
        smallest = min(p.cost.memory_bytes for p in tried)
        raise SolverError(
            f"the search reached its solver_time_limit_s={deadline.seconds:g} before it found a plan within "
            f"memory_limit_bytes={limit:,}: the smallest of the {len(tried)} plans solved needs {smallest:,} bytes "
            f"per device. Raise solver_time_limit_s (or memory_limit_bytes).")
    if not fitting:
        raise_memory_error(tried, limit, graph, least)
    if out_of_time:
        warnings.warn(f"the memory limit's search stopped at its {deadline.seconds:g} s time limit after "
                      f"{len(tried)} plans: the plan fits memory_limit_bytes, but a faster one may (raise "
                      "solver_time_limit_s)", SolverTimeLimitWarning, stacklevel=4)
    return min(fitting, key=lambda p: p.cost.total_s)


def _weigh_memory(plan_with, tried: list[Plan], limit: int, fits, stop, near_s: float = 0.0,
                  steps: int = 8) -> None:
    """Plans of the ILP with each byte a device holds on average (`memory.held_fractions`) priced
    at w seconds, added to `tried` (whose first is the unlimited plan): a monotone search over
    the price, the Lagrange multiplier of the limit. w gallops up (x4) from the unlimited plan's
    seconds per byte until a plan fits (down, when the first fits, until one does not: a price
    too high leaves memory unused and the step slower), then two bisections (geometric) towards
    the lowest price that fits, while `stop()` says go on. The average stands in for the peak,
    which is not linear in the choices; each plan's own peak decides whether it fits.
    `near_s`: the price an earlier search kept (`fit_memory`'s `near`): tried first, and kept
    where it fits."""
    if near_s:
        tried.append(_try_weight(plan_with, near_s, limit))
        if fits(tried[-1]):
            return
    unlimited = tried[0]
    base = near_s * 4 if near_s else unlimited.cost.total_s / max(unlimited.cost.memory_bytes, 1)
    low, high = near_s, None
    for i in range(steps):
        w = base * 4.0 ** i
        tried.append(_try_weight(plan_with, w, limit))
        if fits(tried[-1]):
            high = w
            break
        low = w
        if stop():
            return
    for _ in range(3 if high is not None and not low else 0):
        if stop():
            return
        w = high / 4.0
        tried.append(_try_weight(plan_with, w, limit))
        if not fits(tried[-1]):
            low = w
            break
        high = w
    for _ in range(2 if high is not None and low else 0):
        if stop():
            return
        w = (low * high) ** 0.5
        tried.append(_try_weight(plan_with, w, limit))
        low, high = (low, w) if fits(tried[-1]) else (w, high)


def held_bytes(graph: Graph, units, groups: list[Cone], sizes: dict[str, int]) -> list[np.ndarray]:
    """Per group and strategy: the bytes a device holds on average over the step (each value's
    local bytes times the fraction of the step it is held, `memory.held_fractions`)."""
    held = held_fractions(graph)
    return [np.array([sum(held.get(v, 0.0) * local_bytes(graph, v, spec, sizes)
                          for m, s in ch.items() if units[m].kind != "hub"
                          for v, spec in zip(units[m].results, s.results))
                      for ch in cone.choice]) for cone in groups]


def least_arguments(graph: Graph, units, producer_unit: dict[int, int], sizes: dict[str, int]) -> int:
    """A lower bound on every plan's memory: the arguments, which stay for the whole step, each
    split as finely as the mesh and the pins allow."""
    return sum((1 + a.held_beside) * min(local_bytes(graph, a.value, s.results[0], sizes)
                                         for s in units[producer_unit[a.value]].strategies) for a in graph.args)


def _leading(plan: Plan, args: list[int]) -> int:
    """How many of the leading candidate arguments `plan` keeps off replication."""
    k = 0
    while k < len(args) and plan.arg_specs[args[k]].shard_factor(plan.mesh_axes) > 1:
        k += 1
    return k


def _try(plan_with, candidates: list[int], k: int, limit: int) -> Plan:
    plan = plan_with(candidates[:k])
    progress.say("rhino_jax: memory limit: %d largest not replicated → %.1f MiB per device (limit %.1f)",
                 k, plan.cost.memory_bytes / 2**20, limit / 2**20, best_s=_fitting(plan, limit))
    return plan


def _try_weight(plan_with, weight_s: float, limit: int) -> Plan:
    plan = plan_with([], weight_s)
    progress.say("rhino_jax: memory limit: memory priced at %.3g s/GiB → %.1f MiB per device (limit %.1f)",
                 weight_s * 2**30, plan.cost.memory_bytes / 2**20, limit / 2**20, best_s=_fitting(plan, limit))
    return plan


def _fitting(plan: Plan, limit: int) -> float | None:
    """The plan's predicted step where it fits the memory limit (the best so far to show)."""
    return plan.cost.total_s if plan.cost.memory_bytes <= limit else None


def _stop_if_interrupted(tried: list[Plan], fits) -> None:
    """Ctrl-C during the search: stop, with no plan to return unless one fits already."""
    if tried[-1].search_stats.status == "interrupted" and not any(fits(p) for p in tried):
        raise KeyboardInterrupt("the search was interrupted before it found a plan within memory_limit_bytes")


def raise_memory_error(tried: list[Plan], limit: int, graph: Graph, least: int):
    best = min(tried, key=lambda p: p.cost.memory_bytes)
    local = [local_bytes(graph, a.value, spec, best.mesh_axes) for a, spec in zip(graph.args, best.arg_specs)]
    largest = sorted(range(len(local)), key=lambda i: -local[i])[:5]
    listing = ", ".join(f"{best.arg_paths[i]} {tuple(best.arg_shapes[i])} {best.arg_specs[i]} "
                        f"({local[i] / 2**20:.1f} MiB)" for i in largest)
    donate = ("" if any(a.donated_to is not None for a in graph.args) else
              ", donate the parameters and optimizer state (donate_argnums) so the outputs reuse their buffers")
    raise MemoryLimitError(
        f"no plan fits memory_limit_bytes={limit:,}. Every plan needs at least {least:,} bytes per device "
        f"(a lower bound: the arguments alone, each split as finely as the mesh and pins allow). Of the "
        f"{len(tried)} plans solved, the smallest needs {best.cost.memory_bytes:,} bytes per device "
        f"({sum(local):,} in arguments, the rest in outputs and intermediates at the peak), "
        f"{best.cost.memory_bytes - limit:,} more than the limit; its largest arguments per device: "
        f"{listing}. Raise the limit, use more devices, or shrink the batch or model{donate}.")
