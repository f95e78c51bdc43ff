"""`pipeline="auto"`: the SPMD-only plan against pipelined ones, by predicted step time (Rhino §5:
pipelining on a dimension of the device mesh, the rest SPMD inside each stage, so every pipelined
candidate is a hybrid whose stages are planned by the search).

Candidates: SPMD over the whole mesh (with the user's micro-batches), and p stages for every p
of 2, 4, 8, ... that splits the mesh's first axis, each with the user's micro-batches or 2p when
they are fewer than 2 (a pipeline needs several in flight; micro-batching keeps the numbers); with
k micro-batches given, p up to k.
The least predicted step among those that fit the devices' memory wins; the report lists every
candidate, an infeasible one with why. The candidates share `solver_time_limit_s`, each taking the
time left over the candidates left (`levels.Budget`): one without time is infeasible, saying so.
"""
from __future__ import annotations

import dataclasses
import warnings

from rhino_jax.core.diagnostics import PipelineCandidate
from rhino_jax.search import interrupt, progress

from .errors import MemoryLimitError, MeshError, RhinoError
from .options import budget_of, device_memory, within
from .several_programs import splits_shared


def candidates(options, first_axis: int) -> list:
    """The options of each candidate. With the user's k >= 2 micro-batches, no more stages than
    k: a 1F1B stage idles (p - 1) / (k + p - 1) of the step, over half once p > k, and each such
    candidate would take its share of the time limit from the ones that can win."""
    out = [dataclasses.replace(options, pipeline="off")]
    given = options.num_micro_batches if options.num_micro_batches >= 2 else None
    p = 2
    while p <= min(first_axis, given or first_axis):
        if first_axis % p == 0:
            out.append(dataclasses.replace(options, pipeline=p, num_micro_batches=given or 2 * p))
        p *= 2
    return out


def _label(options) -> str:
    stages = "SPMD only" if options.pipeline == "off" else f"{options.pipeline} stages"
    return f"{stages}, {options.num_micro_batches} micro-batch{'es' if options.num_micro_batches > 1 else ''}"


def choose(parallelized, call, key):
    """The candidate with the least predicted step among those that fit the devices' memory
    (`memory_limit_bytes`, else the cluster's `memory_per_device`); `plan.search_stats.
    pipeline_candidates` lists each, the chosen one first. When none fits, a
    given `memory_limit_bytes` is an error; the preset's capacity only a warning (the estimate
    is not XLA's), and the least predicted step is taken."""
    if parallelized.mesh is None:
        raise MeshError("pipeline='auto' needs a mesh: pass mesh=rj.device_mesh(...)")
    options = parallelized.options
    limit = device_memory(options, parallelized.mesh.devices.flat)
    with interrupt.session():
        tried, errors = _lower_candidates(parallelized, call, key, limit)
        return _choose(tried, errors, options, limit, interrupt.pressed())


def _lower_candidates(parallelized, call, key, limit: int
                      ) -> tuple[list[tuple[PipelineCandidate, object]], list[RhinoError]]:
    """Each candidate lowered, or why not. Ctrl-C: the candidates lowered so far (none: it propagates)."""
    tried: list[tuple[PipelineCandidate, object]] = []
    errors: list[RhinoError] = []
    cands = candidates(parallelized.options, parallelized.mesh.devices.shape[0])
    budget = budget_of(parallelized.options, len(cands))  # the candidates share the limit
    with splits_shared():  # the candidates split the step for their micro-batches once
        for cand in cands:
            if interrupt.pressed():  # a candidate's search answered Ctrl-C with its plan so far: no more
                break
            try:
                lowered = parallelized.lower_with(within(cand, budget, 1, _label(cand)), call, key)
            except RhinoError as e:
                errors.append(e)
                tried.append((PipelineCandidate(_label(cand), None, None, str(e).splitlines()[0][:160]), None))
                continue
            except KeyboardInterrupt:
                if not any(lowered is not None for _, lowered in tried):
                    raise
                interrupt.press()
                interrupt.warn("pipeline='auto': the comparison of SPMD and pipelined plans", stacklevel=5)
                break
            cost = lowered.plan.cost
            over = cost.memory_bytes > limit
            why = f"needs {cost.memory_bytes / 2**30:.1f} GiB/device > {limit / 2**30:.1f} GiB" if over else ""
            tried.append((PipelineCandidate(_label(cand), cost.total_s, cost.memory_bytes, why), lowered))
            progress.say("rhino_jax: pipeline='auto': %s predicted %.4g ms, %.1f GiB/device", _label(cand),
                         cost.total_s * 1e3, cost.memory_bytes / 2**30, best_s=None if over else cost.total_s)
    return tried, errors


def _reasons(tried: list[tuple[PipelineCandidate, object]], errors: list[RhinoError]) -> str:
    """Why each candidate has no plan, whole (the report's table keeps a line of it), candidates
    with the same reason named together: every candidate failing alike says so once."""
    by_reason: dict[str, list[str]] = {}
    for (c, _), e in zip(tried, errors):  # none planned: each tried one failed with its error
        by_reason.setdefault(str(e), []).append(c.label)
    return "; ".join(f"{' / '.join(labels)}: {why}" for why, labels in by_reason.items())


def _choose(tried: list[tuple[PipelineCandidate, object]], errors: list[RhinoError], options, limit: int,
            interrupted: bool):
    """The fastest candidate that fits (see `choose`), its plan marked `interrupted` when Ctrl-C
    cut the comparison short."""
    planned = [t for t in tried if t[1] is not None]
    if not planned:
        kind = MemoryLimitError if all(isinstance(e, MemoryLimitError) for e in errors) else RhinoError
        raise kind("pipeline='auto': no candidate has a plan: " + _reasons(tried, errors))
    fitting = [t for t in planned if not t[0].why]
    if not fitting:
        listing = "; ".join(f"{c.label}: {c.memory_bytes / 2**30:.1f} GiB" for c, _ in planned)
        if options.memory_limit_bytes:
            raise MemoryLimitError(f"pipeline='auto': no candidate fits memory_limit_bytes="
                                   f"{options.memory_limit_bytes} ({listing}); raise the limit, use a larger mesh "
                                   "or more micro-batches")
        warnings.warn(f"pipeline='auto': no candidate fits the {limit / 2**30:.1f} GiB of the cluster's devices by "
                      f"the estimate ({listing}); taking the fastest. Set memory_limit_bytes to make this an error.",
                      stacklevel=3)
        fitting = planned
    best = min(fitting, key=lambda t: t[0].step_s)
    chosen = best[1]
    table = tuple(c for c, _ in [best] + [t for t in tried if t is not best])
    chosen.plan = dataclasses.replace(
        chosen.plan, search_stats=dataclasses.replace(chosen.plan.search_stats, pipeline_candidates=table),
        interrupted=chosen.plan.interrupted or interrupted)
    return chosen
