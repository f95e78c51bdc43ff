"""A plan's report: what was chosen and how it was searched, in words (`Plan.report`).

It reads a plan and stands above it: the collectives are counted as XLA's combiners merge them
(the search's cost model), sizes from the graph's dtypes."""
from __future__ import annotations

import numpy as np

from rhino_jax.core.diagnostics import CompiledCandidate, SearchDiagnostics
from rhino_jax.core.plan import Plan, StagePlan, place_name
from rhino_jax.core.plan_file import mesh_label
from rhino_jax.hlo_passes.graph import dtype_size
from rhino_jax.search.cost.cluster import BACKENDS


def report(plan: Plan, max_tensors: int = 12) -> str:
    """`Plan.report`: the plan in words, for a person reading what was chosen and why."""
    mesh = mesh_label(plan.mesh_axes)
    c = plan.cost
    s, e = plan.search_stats, plan.execution
    lines = [
        f"rhino_jax plan  mesh {mesh}  cluster {plan.cluster}  opt {plan.opt_level}",
        f"predicted step  {c.total_s * 1e3:.3f} ms = "
        + (f"pipeline {(c.total_s - c.compute_s - c.comm_s + c.hidden_s) * 1e3:.3f} ms + apply-gradients "
           if plan.stages else "")
        + f"compute {c.compute_s * 1e3:.3f} ms + communication {c.comm_s * 1e3:.3f} ms"
        + (f" - {c.hidden_s * 1e3:.3f} ms of it hidden behind compute" if c.hidden_s else "")
        + f";  memory {c.memory_bytes / 2**20:.1f} MiB/device",
    ]
    if plan.interrupted:
        lines.append("interrupted     Ctrl-C stopped the search: this is the best plan found by then, not optimal")
    if s.status:
        how = (f"each window optimal given the rest, {s.windows} windows" if s.status == "windowed"
               else "no bound" if np.isnan(s.gap) else f"gap {s.gap:.2%}")
        lines += [
            f"coarsening      {s.ops} ops, {s.critical_nodes} critical nodes "
            f"({s.critical_proportion:.1%}), {s.segments} segments, {s.tied_segments} repeats tied; {s.groups} cones",
            f"search          ILP over {s.ilp_groups} groups: {s.ilp_vars} vars, "
            f"{s.ilp_constraints} constraints; {s.solver} {s.status} "
            f"({how}) in {s.solve_s:.2f} s" + _solves(s, several=e.micro_batches > 1 or e.pipeline > 1)]
        if s.pipeline_candidates:
            lines.append("pipeline='auto' (chosen first): " + "; ".join(
                (f"{c.label} {c.step_s * 1e3:.4g} ms, {c.memory_bytes / 2**30:.3g} GiB/device"
                 if c.step_s is not None else c.label) + (f" (infeasible: {c.why})" if c.why else "")
                for c in s.pipeline_candidates))
        if s.compiled_candidates:
            lines.append("compiled        the search's plans of other layouts, compiled for these GPUs and priced as "
                         "XLA schedules them (* kept): " + "; ".join(
                             map(_compiled_candidate, s.compiled_candidates)))
        if e.pipeline > 1:
            staging = s.staging
            lines.append(f"pipeline        {e.pipeline} stages ({e.schedule}"
                         + (f" interlaced with {len(e.shared_places)} places on every device (op_assign "
                            "stage='all')" if e.shared_places else "")
                         + (f" over {e.passes} forward passes of {', '.join(e.repeated_layers)}, the "
                            "last differentiated" if e.passes > 1 else "")
                         + f", {e.micro_batches} micro-batches; {staging.cut_bytes / 2**20:.2f} MiB cut"
                         + (f", the stages' balance relaxed to ±{staging.epsilon:g} of a share for op_assign"
                            if staging.epsilon else "")
                         + f", {e.transfer_s * 1e3:.3f} ms "
                         f"to move a micro-batch's tensors across a boundary; {staging.arguments_in_s * 1e3:.3f} ms "
                         f"to bring the programs the arguments they read elsewhere, {staging.sums_out_s * 1e3:.3f} ms "
                         "to bring apply-gradients the sums and values of other stages, "
                         f"{staging.outputs_out_s * 1e3:.3f} ms to return the loss and metrics on the whole "
                         "mesh), then apply-gradients on the stages (the search line above: its programs together)")
            lines += [f"    {place_name(st.stage, e.shared_places, e.passes, len(plan.stages))}  "
                      f"{mesh_label(st.mesh_axes)} devices {_runs(st.devices)}: forward {st.forward_s * 1e3:.3f}"
                      + (f" + backward {st.backward_s * 1e3:.3f}" if st.backward else " (no backward)")
                      + " ms per micro-batch, "
                      f"apply {st.apply_s * 1e3:.3f} ms, "
                      f"{st.in_flight} in flight, {st.memory_bytes / 2**20:.1f} MiB/device; "
                      f"{', '.join(st.layers) or 'no named layers'}" + _alike(st) for st in plan.stages]
        elif e.micro_batches > 1:
            cg = plan.programs["compute_gradients"].search_stats
            lines.append(f"micro-batching  {e.micro_batches} micro-batches of compute-gradients (ILP over "
                         f"{cg.ilp_groups} groups, {cg.status}), their sums added up, then apply-gradients "
                         "(the search line above); cost and collectives count every micro-batch")
        if plan.constrained():
            lines.append("constraints     " + "; ".join(f"{c} on {n} ops and arguments"
                                                        for c, n in plan.constrained().items()))
        if s.coshard_candidates:
            cut = e.coshard
            groups: dict[str, int] = {}
            for c in cut:
                groups[c.constraint] = groups.get(c.constraint, 0) + 1
            lines.append("co-shard        " + ("; ".join(f"{c}: {n} groups in {cut[0].chunks} chunks"
                                                      for c, n in groups.items()) if cut else "no chunks")
                         + " (tried: " + "; ".join(f"{c.chunks} chunk{'s' * (c.chunks > 1)} {c.step_s * 1e3:.4g} ms, "
                                                  f"{c.memory_bytes / 2**20:.1f} MiB"
                                                  for c in s.coshard_candidates) + ")")
        if s.strided_values:
            lines.append(f"strided specs   {s.strided_values} values held at a non-maximum stride "
                         "(split dims in the compiled program), e.g. " + ", ".join(s.strided_examples))
        if s.not_replicated:
            forced = ", ".join(s.not_replicated[:6]) + (" ..." if len(s.not_replicated) > 6 else "")
            lines.append(f"memory limit    kept from replication ({len(s.not_replicated)}, largest first): "
                         f"{forced}")
    if plan.mesh_candidates:
        lines += ["", mesh_candidates_report(plan)]
    sizes = [int(np.prod(sh, dtype=np.int64)) * dtype_size(dt) for sh, dt in zip(plan.arg_shapes, plan.arg_dtypes)]
    largest = sorted(range(len(sizes)), key=lambda i: -sizes[i])[:max_tensors]
    lines += ["", f"largest arguments (showing {len(largest)} of {len(plan.arg_paths)}):",
              f"  {'argument':<44} {'role':<16} {'shape':<18} {'MiB':>8}  spec"]
    for i in largest:
        lines.append(f"  {plan.arg_paths[i][:44]:<44} {plan.arg_roles[i]:<16} "
                     f"{str(plan.arg_shapes[i]):<18} {sizes[i] / 2**20:>8.2f}  {plan.arg_specs[i]}")
    lines += _collective_lines(plan)
    if plan.fallback_ops:
        lines += ["", f"ops with no sharding rule, kept replicated ({len(plan.fallback_ops)}):"]
        lines += [f"  {op}" for op in plan.fallback_ops[:10]]
        if len(plan.fallback_ops) > 10:
            lines.append(f"  ... and {len(plan.fallback_ops) - 10} more")
    return "\n".join(lines)


def _compiled_candidate(c: CompiledCandidate) -> str:
    """One plan `compiled_choice` weighed: its compiled step, its predicted one, its memory and
    what its compile took."""
    if c.compiled_s is None:
        return f"predicted {c.predicted_s * 1e3:.4g} ms, above a compiled step: not compiled"
    return (f"{'*' * c.kept}{c.compiled_s * 1e3:.4g} ms (predicted {c.predicted_s * 1e3:.4g}), "
            f"{c.memory_bytes / 2**20:.1f} MiB" + ("" if c.fits else ", does not fit")
            + (f", compiled in {c.compile_s:.3g} s" if c.compile_s is not None else ""))


def mesh_candidates_report(plan: Plan) -> str:
    """The mesh shapes searched (mesh=None), best predicted step first."""
    cands = plan.mesh_candidates
    n_ok = sum(c.feasible for c in cands)
    lines = [f"mesh candidates ({len(cands)} searched, {n_ok} feasible; best predicted first):",
             f"    {'mesh':<34} {'step ms':>10} {'compute ms':>11} {'comm ms':>10} {'MiB/dev':>9} "
             f"{'search s':>9}"]
    for c in cands:
        mark = "  *" if c.chosen else "   "
        if c.feasible:
            k = c.cost
            lines.append(f"{mark} {c.label():<34} {k.total_s * 1e3:>10.4g} {k.compute_s * 1e3:>11.4g} "
                         f"{k.comm_s * 1e3:>10.4g} {k.memory_bytes / 2**20:>9.1f} {c.search_s:>9.2f}")
        else:
            lines.append(f"{mark} {c.label():<34} infeasible: {c.error.splitlines()[0][:120]}")
    return "\n".join(lines)


def _collective_lines(plan: Plan, slowest: int = 6) -> list[str]:
    """The report's predicted collectives: as the cluster's backend compiles them (what the
    predicted step prices); where the plan was made on devices of another backend (8 CPU
    devices standing for GPUs), also as that one compiles them, the figures `compile().report()`
    sets beside the compiled program's; then the `slowest` alone."""
    lines = ["", f"predicted collectives, as XLA's {plan.backend} backend combines them (what the predicted "
             "step prices):", *_kinds_lines(plan, plan.backend)]
    here = plan.target.platform if plan.target is not None else plan.backend
    if here in BACKENDS and plan.combined_kinds(here) != plan.combined_kinds():
        lines += [f"as XLA's {here} backend compiles them for this plan's {here} devices (compile().report() "
                  "sets these beside the compiled program's):", *_kinds_lines(plan, here)]
    if plan.collectives:
        heavy = sorted(plan.collectives, key=lambda c: -c.time_s)[:slowest]
        lines.append(f"slowest alone, before XLA combines them (showing {len(heavy)} of {len(plan.collectives)}):")
        lines += [f"  {c.kind:<14} over {'+'.join(c.axes):<12} {c.bytes / 2**10:>10.1f} KiB "
                  f"{c.time_s * 1e6:>9.1f} µs  at {c.where[:60]}" for c in heavy]
    return lines


def _kinds_lines(plan: Plan, backend: str) -> list[str]:
    summary = plan.combined_kinds(backend)
    return [f"  {kind:<16} {n:>5} ops {b / 2**20:>10.3f} MiB" + (f"  ({m} combined by XLA)" if m > n else "")
            for kind, (n, b, m) in sorted(summary.items())] or ["  none"]


def _solves(stats: SearchDiagnostics, several: bool) -> str:
    """The search line's tail: each ILP's time where the search solved several (the progress line
    says each one's as it ends, "ILP optimal in 7.84 s"), and the ILP's own estimate of the step,
    the progress line's "predicted", which the predicted step refines by replaying XLA's combiners
    on the chosen collectives. No estimate for a step run as several programs (the search line is
    one program's: `several`) nor for a memory-limit trial (its objective prices memory too)."""
    parts = [f"{stage.name} {stage.solve_s:.2f} s" for stage in stats.ilp_stages]
    out = f" ({', then '.join(parts)})" if len(parts) > 1 else ""
    if not several and not stats.memory_weight_s:
        out += f"; the ILP's estimate of the step {stats.objective_s * 1e3:.4g} ms"
    return out


def _alike(st: StagePlan) -> str:
    """A stage whose programs took alike ones' plans (`alike_programs`) says whose."""
    of = [p.search_stats.plan_of for p in (st.forward, st.backward) if p and p.search_stats.plan_of]
    return f"; the plans of {' and '.join(of)}, alike programs searched once" if of else ""


def _runs(ids: tuple[int, ...]) -> str:
    """Device ids with consecutive runs folded: (0, 1, 2, 3, 8) → "0-3,8"."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
