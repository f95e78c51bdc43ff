"""`pipeline="auto"`: the SPMD-only plan against pipelined ones, by predicted step time (Rhino §5:
pipelining on a dimension of the device mesh, the rest SPMD inside each stage, so every pipelined
candidate is a hybrid whose stages are planned by the search).

Candidates: SPMD over the whole mesh (with the user's micro-batches), and p stages for every p
of 2, 4, 8, ... that splits the mesh's first axis, each with the user's micro-batches or 2p when
they are fewer than 2 (a pipeline needs several in flight; micro-batching keeps the numbers).
The least predicted step wins; the report lists every candidate, an infeasible one with why.
"""
from __future__ import annotations

import dataclasses
import logging

from .errors import MeshError, RhinoError

log = logging.getLogger("rhino_jax")


def candidates(options, first_axis: int) -> list:
    """The options of each candidate."""
    out = [dataclasses.replace(options, pipeline="off")]
    p = 2
    while p <= first_axis:
        if first_axis % p == 0:
            k = options.num_micro_batches if options.num_micro_batches >= 2 else 2 * p
            out.append(dataclasses.replace(options, pipeline=p, num_micro_batches=k))
        p *= 2
    return out


def _label(options) -> str:
    stages = "SPMD only" if options.pipeline == "off" else f"{options.pipeline} stages"
    return f"{stages}, {options.num_micro_batches} micro-batch{'es' if options.num_micro_batches > 1 else ''}"


def choose(parallelized, args, key):
    """The candidate with the least predicted step; `plan.search_stats["pipeline_candidates"]`
    holds (label, predicted seconds or None, reason) for each, the chosen one first."""
    if parallelized.mesh is None:
        raise MeshError("pipeline='auto' needs a mesh: pass mesh=rj.device_mesh(...)")
    tried = []
    for options in candidates(parallelized.options, parallelized.mesh.devices.shape[0]):
        try:
            lowered = parallelized.lower_with(options, args, key)
        except RhinoError as e:
            tried.append((_label(options), None, str(e).splitlines()[0][:160], None))
            continue
        tried.append((_label(options), lowered.plan.cost.total_s, "", lowered))
        log.info("rhino_jax: pipeline='auto': %s predicted %.4g ms", _label(options), lowered.plan.cost.total_s * 1e3)
    feasible = [t for t in tried if t[3] is not None]
    if not feasible:
        raise RhinoError("pipeline='auto': no candidate has a plan: " + "; ".join(f"{t[0]}: {t[2]}" for t in tried))
    best = min(feasible, key=lambda t: t[1])
    table = tuple((label, seconds, why) for label, seconds, why, _ in [best] + [t for t in tried if t is not best])
    chosen = best[3]
    chosen.plan = dataclasses.replace(chosen.plan, search_stats=dict(chosen.plan.search_stats,
                                                                     pipeline_candidates=table))
    return chosen
