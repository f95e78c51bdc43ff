"""Plan: the search's answer, as plain data that can be saved, diffed and explained."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from collections.abc import Callable

import numpy as np

from rhino_jax.hlo_passes.graph import dtype_size
from rhino_jax.runtime.schedules import Schedule, make as make_schedule
from rhino_jax.runtime.task_graph import TaskGraph, build as build_task_graph
from rhino_jax.search.cluster import BACKENDS, combiner_for
from rhino_jax.search.combining import combine, combined_collectives
from rhino_jax.core.specs import ShardingSpec

from .plain_data import PlainDataError, from_plain, to_plain
from .plan_file import PLAN_FORMAT, check_specs, mesh_label, not_readable, replace_file, spec_owner
from .plan_target import PlanTarget, PlanTargetError

# The readers of a plan that search again or draw (`explain`, `render`), by name: they stand a
# stage above the plan, which the search makes and imports, so the package fills this table as
# it imports them, and the plan's methods call through it.
READERS: dict[str, Callable] = {}


@dataclass(frozen=True)
class PlanCost:
    """Predicted per-device time of one step and memory: total = compute + communication, less
    the communication hidden behind compute (`Cluster.overlap`; never more than the compute)."""

    compute_s: float
    comm_s: float
    total_s: float
    memory_bytes: int
    hidden_s: float = 0.0


@dataclass(frozen=True)
class PlannedCollective:
    kind: str
    axes: tuple[str, ...]
    bytes: int
    time_s: float  # alone; XLA may combine it with others (`Plan.collective_summary`)
    where: str  # the op (source name) that needs it
    combinable: bool = False  # XLA may combine it with others (`search.combining.combining_sides`)
    depends_on: int = 0  # bit i set: it needs the i-th planned collective's result first
    trip: int = 0  # in a loop's body: which trip it runs in (one copy per trip)
    trips: int = 1  # how many trips its loop runs (1 outside loops)
    branch: tuple[int, ...] = ()  # the conditional branches it runs in (`Node.attrs["branch"]`), outermost first
    group: int = 1  # devices in each of its groups (the product of its axes' sizes)
    dtype: str = ""  # the element type it moves (XLA combines all-reduces of one type only)
    # its share of its program's communication: the time of the op XLA combines it into, split
    # among that op's members by bytes (`combining.shares`); None in a plan saved before it was kept
    combined_s: float | None = None


@dataclass(frozen=True)
class MeshCandidate:
    """One mesh shape tried by `parallelize(mesh=None)`: its best plan's predicted cost, or why it
    has no plan (`error`, e.g. a pin naming an axis this mesh lacks)."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    cost: PlanCost | None  # None when infeasible
    search_s: float = 0.0  # lowering + import + search of this candidate
    error: str = ""
    chosen: bool = False

    @property
    def mesh_axes(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.shape))

    @property
    def feasible(self) -> bool:
        return self.cost is not None

    def label(self) -> str:
        return " × ".join(f"{a}={n}" for a, n in self.mesh_axes.items())


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage (Rhino §5): its sub-mesh, the layers its forward ops come from, and the
    plans of its forward and backward programs (one micro-batch each); its apply-gradients
    programs' plans are in `Plan.programs`."""

    stage: int
    mesh_axes: dict[str, int]
    devices: tuple[int, ...]
    layers: tuple[str, ...]  # named scopes of its forward ops, in program order ("layer0-layer15")
    forward: "Plan"
    backward: "Plan | None"  # None: a multi-forward step's earlier pass, which runs no backward
    in_flight: int  # most micro-batches whose activations it holds at once (the schedule's)
    held_bytes: int  # per device, one micro-batch's values its forward keeps for its backward
    summed_bytes: int  # per device, the running sums its micro-batches' gradients are added into
    # per device, the step's arguments it holds that its forward and backward programs do not read
    # (the optimizer state of its layers)
    kept_bytes: int = 0
    apply_s: float = 0.0  # its apply-gradients programs' predicted time, once per step
    apply_bytes: int = 0  # per device, the peak of its apply-gradients programs
    # an interlaced pipeline's place that runs on every device (op_assign(stage="all")), between
    # the stages' programs; its devices are the whole mesh's
    shared: bool = False

    @property
    def forward_s(self) -> float:
        return self.forward.cost.total_s

    @property
    def backward_s(self) -> float:
        return self.backward.cost.total_s if self.backward else 0.0

    @property
    def beside_bytes(self) -> int:
        """Per device, what the stage holds beside the program it runs while micro-batches are in
        flight: the other micro-batches' values, the running sums, the optimizer state."""
        return max(self.in_flight - 1, 0) * self.held_bytes + self.summed_bytes + self.kept_bytes

    @property
    def memory_bytes(self) -> int:
        """Peak per device: the larger of the forward and backward programs' peaks plus what the
        stage holds beside them, or its apply-gradients programs' peak."""
        peak = max(plan.cost.memory_bytes for plan in (self.forward, self.backward) if plan)
        return max(peak + self.beside_bytes, self.apply_bytes)


def _alike(st: StagePlan) -> str:
    """A stage whose programs took alike ones' plans (`alike_programs`) says whose."""
    of = [p.search_stats["plan_of"] for p in (st.forward, st.backward) if p and "plan_of" in p.search_stats]
    return f"; the plans of {' and '.join(of)}, alike programs searched once" if of else ""


@dataclass(frozen=True)
class Plan:
    mesh_axes: dict[str, int]
    cluster: str
    opt_level: str
    arg_paths: tuple[str, ...]
    arg_roles: tuple[str, ...]
    arg_shapes: tuple[tuple[int, ...], ...]
    arg_dtypes: tuple[str, ...]
    arg_specs: tuple[ShardingSpec, ...]
    output_paths: tuple[str, ...]
    output_specs: tuple[ShardingSpec, ...]
    value_specs: dict[int, ShardingSpec] = field(repr=False)
    # (node id, operand index) → the layout that op reads, where it differs from the producer's
    read_specs: dict[tuple[int, int], ShardingSpec] = field(default_factory=dict, repr=False)
    # (value id, layout read) → the layouts the value passes through on the way, where the reshard
    # takes several steps (`collectives.reshard_path`); the rewrite pins each one
    read_paths: dict[tuple[int, ShardingSpec], tuple[ShardingSpec, ...]] = field(default_factory=dict, repr=False)
    cost: PlanCost = None  # type: ignore[assignment]
    collectives: tuple[PlannedCollective, ...] = ()
    fallback_ops: tuple[str, ...] = ()  # ops without a sharding rule, kept replicated
    search_stats: dict = field(default_factory=dict)
    backend: str = "gpu"  # the XLA backend the cluster stands for (`cluster.Combiner`)
    # With `parallelize(mesh=None)`: every mesh shape searched, best predicted first (the chosen
    # one is marked), infeasible ones last with their reason. Empty for a given mesh.
    mesh_candidates: tuple[MeshCandidate, ...] = ()
    # With `pipeline`: each stage (the programs' plans); the plan itself sums up the step, its
    # search line apply-gradients' programs.
    stages: tuple[StagePlan, ...] = ()
    # With micro-batches or `pipeline`: the plans of the step's programs that `stages` does not
    # hold, by their names in `compiled.programs` ("compute_gradients", "apply_gradients", a
    # stage's "apply_gradients[stage.wave]"), and where each op of compute-gradients runs (node →
    # ("F" | "B", stage)): what a saved plan needs to run without a search (apply-gradients' ops
    # follow from it, `hlo_passes.stages.assign_apply`).
    programs: dict[str, "Plan"] = field(default_factory=dict, repr=False)
    placement: dict[int, tuple[str, int]] = field(default_factory=dict, repr=False)
    # What the plan was made for (program, arguments, mesh): a saved plan is checked against it.
    target: PlanTarget | None = None
    # Ctrl-C stopped the search (`search.interrupt`): the best plan found by then, not optimal.
    interrupted: bool = False
    # Set by `parallelize` when the plan belongs to a call: the user's pytrees and mesh.
    input_shardings: object = field(default=None, compare=False, repr=False)
    output_shardings: object = field(default=None, compare=False, repr=False)
    # Set by `parallelize` on an SPMD plan: the step's graph, mesh and options it was searched with
    # (`explain.SearchInputs`), so that `explain` can search again with one argument pinned. Not
    # saved (a loaded plan explains its layouts, not their alternatives) and not compared.
    search_inputs: object = field(default=None, compare=False, repr=False)
    # Set by the search where its ILP is not too large to keep (`search.repin.Repin`): that ILP, to
    # be solved again with one argument pinned (how `explain` prices an alternative layout in
    # seconds). Not saved, not compared, not carried to another process.
    repin: object = field(default=None, compare=False, repr=False)

    @property
    def task_graph(self) -> TaskGraph:
        """What runs in a step, where and after what (Rhino §6.1); `.to_dot()` for Graphviz."""
        s = self.search_stats
        return build_task_graph(self.schedule(), s.get("applies", ()))

    def schedule(self) -> Schedule:
        """The pipeline's schedule as it runs (one stage, one micro-batch without a pipeline): an
        op_order or interlaced schedule from its saved rows, the others made again from their name."""
        s = self.search_stats
        if "schedule_order" in s:
            return Schedule.parse(s["schedule"], s["schedule_order"], s["micro_batches"], s.get("shared_places", ()),
                                  s.get("passes", 1))
        return make_schedule(s.get("schedule", "1f1b"), s.get("pipeline", 1), s.get("micro_batches", 1),
                             s.get("passes", 1))

    def collective_summary(self, backend: str | None = None) -> dict[str, tuple[int, int]]:
        """kind → (count, bytes) of the collectives a backend's XLA compiles for this plan, once
        its combiners have merged independent ones (default: the cluster's backend; "cpu" to
        compare with a program compiled here)."""
        return {kind: (n, b) for kind, (n, b, _) in self.combined_kinds(backend).items()}

    def combined_kinds(self, backend: str | None = None) -> dict[str, tuple[int, int, int]]:
        """kind → (count, bytes, planned collectives merged into them) of `collective_summary`."""
        combiner = combiner_for(backend or self.backend)
        out: dict[str, tuple[int, int, int]] = {}
        for group, c in zip(combine(self.collectives, combiner), combined_collectives(self.collectives, combiner)):
            n, b, m = out.get(c.kind, (0, 0, 0))
            out[c.kind] = (n + 1, b + c.bytes, m + len(group))
        return out

    def mesh_candidates_report(self) -> str:
        """The mesh shapes searched (mesh=None), best predicted step first."""
        cands = self.mesh_candidates
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

    def to_json(self) -> str:
        """The whole plan as JSON (`plain_data`: plain values, no code), less the jax shardings."""
        return json.dumps({"rhino_jax_plan": PLAN_FORMAT, **to_plain(self, Plan)}, indent=1, allow_nan=False)

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan to `path` as JSON; `Plan.load` reads it back equal. A save that fails
        (a full disk) leaves the file that was there as it was (`plan_file.replace_file`)."""
        replace_file(path, self.to_json())

    @staticmethod
    def load(path: str | os.PathLike) -> "Plan":
        """A plan written by `save`. Check it with `check_matches` before applying it. ValueError,
        naming the file, the place in it and what to change, for a file `save` would not write
        (another format, a hand-edited spec the plan's mesh cannot lay out)."""
        with open(path) as f:
            text = f.read()
        try:
            data = json.loads(text)
            why = not_readable(data)
            if why:
                raise ValueError(why)
            plan = from_plain(Plan, {k: v for k, v in data.items() if k != "rhino_jax_plan"})
            check_specs(plan)
            return plan
        except PlainDataError as e:
            raise ValueError(f"{path}: {spec_owner(data, e.where)}{e}") from None
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: {e}") from None

    def check_matches(self, target: PlanTarget) -> None:
        """Raise PlanTargetError unless this plan was made for `target` (the program and mesh
        about to run: `PlanTarget.of(lowered_step, mesh)`)."""
        if self.target is None:
            raise PlanTargetError("the plan does not record the program and mesh it was made for, so it cannot be "
                                  "checked against this step; plan again")
        why = self.target.mismatch(target)
        if why:
            raise PlanTargetError(why)

    def program_plans(self) -> dict[str, "Plan"]:
        """Every program's plan by its name in `compiled.programs` (a step run as several programs;
        empty for one SPMD program)."""
        out = {program_name(kind, st.stage): getattr(st, attr) for st in self.stages
               for kind, attr in (("F", "forward"), ("B", "backward")) if getattr(st, attr)}
        return dict(out, **self.programs)

    def constrained(self) -> dict[str, int]:
        """Each of the user's constraints (`rj.op_trans`) → the ops and arguments it restricted, in
        every program of the step."""
        out: dict[str, int] = {}
        for plan in [self, *self.program_plans().values()]:
            for c, n in plan.search_stats.get("constraints", {}).items():
                out[c] = out.get(c, 0) + n
        return out

    def program(self, name: str, target: PlanTarget) -> "Plan":
        """The saved plan of program `name`, once it is shown to be made for `target`, the program
        cut from the step now (`PlanTarget.of_program`): PlanTargetError otherwise, as when another
        version of rhino_jax cut the step into programs differently."""
        found = self.program_plans().get(name)
        if found is None:
            held = ", ".join(self.program_plans())
            raise PlanTargetError(f"the plan holds no plan of the program {name} ("
                                  + (f"it holds {held}" if held else "it was saved by a rhino_jax that did not keep "
                                     "the plans of a step's programs") + "); plan again")
        why = "it records no target" if found.target is None else found.target.mismatch(target)
        if why:
            raise PlanTargetError(f"the plan of the program {name} was not made for the program cut from this step "
                                  f"now ({why}); another version of rhino_jax cut the step differently: plan again")
        return found

    def explain(self, name: str, alternatives: int = 3):
        """Why argument `name` (as the report prints it, or a path of `input_shardings`) is laid out
        as it is: its layout, the collectives at it and in its layer, and the predicted step of
        the best plan with it in each of up to `alternatives` other layouts, found by searching
        the step again with it pinned (`rhino_jax.explain`). Returns an `Explanation`; print it."""
        return READERS["explain"](self, name, alternatives)

    def render(self, path: str | os.PathLike) -> None:
        """Write one self-contained HTML page of SVG pictures to `path`: each layer's large
        tensors over the mesh, the collectives per layer and, for a pipeline, its schedule
        (`rhino_jax.render`)."""
        READERS["render"](self, path)

    def report(self, max_tensors: int = 12) -> str:
        mesh = mesh_label(self.mesh_axes)
        c = self.cost
        s = self.search_stats
        lines = [
            f"rhino_jax plan  mesh {mesh}  cluster {self.cluster}  opt {self.opt_level}",
            f"predicted step  {c.total_s * 1e3:.3f} ms = "
            + (f"pipeline {(c.total_s - c.compute_s - c.comm_s + c.hidden_s) * 1e3:.3f} ms + apply-gradients "
               if self.stages else "")
            + f"compute {c.compute_s * 1e3:.3f} ms + communication {c.comm_s * 1e3:.3f} ms"
            + (f" - {c.hidden_s * 1e3:.3f} ms of it hidden behind compute" if c.hidden_s else "")
            + f";  memory {c.memory_bytes / 2**20:.1f} MiB/device",
        ]
        if self.interrupted:
            lines.append("interrupted     Ctrl-C stopped the search: this is the best plan found by then, not optimal")
        if s:
            tied = f", {s['tied_segments']} repeats tied" if "tied_segments" in s else ""
            how = (f"each window optimal given the rest, {s['windows']} windows" if s["status"] == "windowed"
                   else "no bound" if np.isnan(s["gap"]) else f"gap {s['gap']:.2%}")
            lines += [
                f"coarsening      {s['ops']} ops, {s['critical_nodes']} critical nodes "
                f"({s['critical_proportion']:.1%}), {s['subgraphs']} segments{tied}; {s['groups']} cones",
                f"search          ILP over {s['ilp_groups']} groups: {s['ilp_vars']} vars, "
                f"{s['ilp_constraints']} constraints; {s['backend']} {s['status']} "
                f"({how}) in {s['solve_s']:.2f} s" + _solves(s)]
            if s.get("pipeline_candidates"):
                lines.append("pipeline='auto' (chosen first): " + "; ".join(
                    (f"{c.label} {c.step_s * 1e3:.4g} ms, {c.memory_bytes / 2**30:.3g} GiB/device"
                     if c.step_s is not None else c.label) + (f" (infeasible: {c.why})" if c.why else "")
                    for c in s["pipeline_candidates"]))
            if s.get("pipeline"):
                lines.append(f"pipeline        {s['pipeline']} stages ({s['schedule']}"
                             + (f" interlaced with {len(s['shared_places'])} places on every device (op_assign "
                                "stage='all')" if s.get("shared_places") else "")
                             + (f" over {s['passes']} forward passes of {', '.join(s['repeated_layers'])}, the "
                                "last differentiated" if s.get("passes") else "")
                             + f", {s['micro_batches']} micro-batches; {s['stage_cut_bytes'] / 2**20:.2f} MiB cut"
                             + (f", the stages' balance relaxed to ±{s['stage_epsilon']:g} of a share for op_assign"
                                if s.get("stage_epsilon") else "")
                             + f", {s['transfer_s'] * 1e3:.3f} ms "
                             f"to move a micro-batch's tensors across a boundary; {s['arguments_in_s'] * 1e3:.3f} ms to "
                             f"bring the programs the arguments they read elsewhere, {s['sums_out_s'] * 1e3:.3f} ms to "
                             "bring apply-gradients the sums and values of other stages, "
                             f"{s.get('outputs_out_s', 0.0) * 1e3:.3f} ms to return the loss and metrics on the whole "
                             "mesh), then apply-gradients on the stages (the search line above: its programs together)")
                shared = tuple(s.get("shared_places", ()))
                lines += [f"    {place_name(st.stage, shared, s.get('passes', 1), len(self.stages))}  "
                          f"{mesh_label(st.mesh_axes)} devices {_runs(st.devices)}: forward {st.forward_s * 1e3:.3f}"
                          + (f" + backward {st.backward_s * 1e3:.3f}" if st.backward else " (no backward)")
                          + " ms per micro-batch, "
                          f"apply {st.apply_s * 1e3:.3f} ms, "
                          f"{st.in_flight} in flight, {st.memory_bytes / 2**20:.1f} MiB/device; "
                          f"{', '.join(st.layers) or 'no named layers'}" + _alike(st) for st in self.stages]
            elif s.get("micro_batches"):
                cg = s["compute_gradients"]
                lines.append(f"micro-batching  {s['micro_batches']} micro-batches of compute-gradients (ILP over "
                             f"{cg['ilp_groups']} groups, {cg['status']}), their sums added up, then apply-gradients "
                             "(the search line above); cost and collectives count every micro-batch")
            if self.constrained():
                lines.append("constraints     " + "; ".join(f"{c} on {n} ops and arguments"
                                                            for c, n in self.constrained().items()))
            if s.get("coshard_candidates"):
                cut = s.get("coshard", [])
                groups = {}
                for c in cut:
                    groups[c["constraint"]] = groups.get(c["constraint"], 0) + 1
                lines.append("co-shard        " + ("; ".join(f"{c}: {n} groups in {cut[0]['chunks']} chunks"
                                                          for c, n in groups.items()) if cut else "no chunks")
                             + " (tried: " + "; ".join(f"{n} chunk{'s' * (n > 1)} {t * 1e3:.4g} ms, {m / 2**20:.1f} MiB"
                                                      for n, t, m in s["coshard_candidates"]) + ")")
            if s.get("strided_values"):
                lines.append(f"strided specs   {s['strided_values']} values held at a non-maximum stride "
                             "(split dims in the compiled program), e.g. " + ", ".join(s["strided_examples"]))
            if s.get("not_replicated"):
                forced = ", ".join(s["not_replicated"][:6]) + (" ..." if len(s["not_replicated"]) > 6 else "")
                lines.append(f"memory limit    kept from replication ({len(s['not_replicated'])}, largest first): "
                             f"{forced}")
        if self.mesh_candidates:
            lines += ["", self.mesh_candidates_report()]
        sizes = [int(np.prod(sh, dtype=np.int64)) * dtype_size(dt) for sh, dt in zip(self.arg_shapes, self.arg_dtypes)]
        largest = sorted(range(len(sizes)), key=lambda i: -sizes[i])[:max_tensors]
        lines += ["", f"largest arguments (showing {len(largest)} of {len(self.arg_paths)}):",
                  f"  {'argument':<44} {'role':<16} {'shape':<18} {'MiB':>8}  spec"]
        for i in largest:
            lines.append(f"  {self.arg_paths[i][:44]:<44} {self.arg_roles[i]:<16} "
                         f"{str(self.arg_shapes[i]):<18} {sizes[i] / 2**20:>8.2f}  {self.arg_specs[i]}")
        lines += self._collective_lines()
        if self.fallback_ops:
            lines += ["", f"ops with no sharding rule, kept replicated ({len(self.fallback_ops)}):"]
            lines += [f"  {op}" for op in self.fallback_ops[:10]]
            if len(self.fallback_ops) > 10:
                lines.append(f"  ... and {len(self.fallback_ops) - 10} more")
        return "\n".join(lines)

    def _collective_lines(self, slowest: int = 6) -> list[str]:
        """The report's predicted collectives: as the cluster's backend compiles them (what the
        predicted step prices); where the plan was made on devices of another backend (8 CPU
        devices standing for GPUs), also as that one compiles them, the figures `compile().report()`
        sets beside the compiled program's; then the `slowest` alone."""
        lines = ["", f"predicted collectives, as XLA's {self.backend} backend combines them (what the predicted "
                 "step prices):", *self._kinds_lines(self.backend)]
        here = self.target.platform if self.target is not None else self.backend
        if here in BACKENDS and self.combined_kinds(here) != self.combined_kinds():
            lines += [f"as XLA's {here} backend compiles them for this plan's {here} devices (compile().report() "
                      "sets these beside the compiled program's):", *self._kinds_lines(here)]
        if self.collectives:
            heavy = sorted(self.collectives, key=lambda c: -c.time_s)[:slowest]
            lines.append(f"slowest alone, before XLA combines them (showing {len(heavy)} of {len(self.collectives)}):")
            lines += [f"  {c.kind:<14} over {'+'.join(c.axes):<12} {c.bytes / 2**10:>10.1f} KiB "
                      f"{c.time_s * 1e6:>9.1f} µs  at {c.where[:60]}" for c in heavy]
        return lines

    def _kinds_lines(self, backend: str) -> list[str]:
        summary = self.combined_kinds(backend)
        return [f"  {kind:<16} {n:>5} ops {b / 2**20:>10.3f} MiB" + (f"  ({m} combined by XLA)" if m > n else "")
                for kind, (n, b, m) in sorted(summary.items())] or ["  none"]


def _solves(stats: dict) -> str:
    """The search line's tail: each ILP's time where the search solved several (the progress line
    says each one's as it ends, "ILP optimal in 7.84 s"), and the ILP's own estimate of the step,
    the progress line's "predicted", which the predicted step refines by replaying XLA's combiners
    on the chosen collectives. No estimate for a step run as several programs (the search line is
    one program's) nor for a memory-limit trial (its objective prices memory too)."""
    names = stats.get("stage_names", ())
    parts = [f"{name} {stage[3]:.2f} s" for name, stage in zip(names, stats.get("stages", ()))]
    out = f" ({', then '.join(parts)})" if len(parts) > 1 else ""
    if "objective_s" in stats and not stats.get("micro_batches") and not stats.get("memory_weight_s"):
        out += f"; the ILP's estimate of the step {stats['objective_s'] * 1e3:.4g} ms"
    return out


def as_plan(plan: Plan | str | os.PathLike, name: str) -> Plan:
    """`plan`, or the plan saved at that path (`Plan.load`): what an argument `name` that takes
    either holds; TypeError for anything else."""
    if isinstance(plan, (str, os.PathLike)):
        return Plan.load(plan)
    if not isinstance(plan, Plan):
        raise TypeError(f"{name} must be a rhino_jax.Plan or the path of a saved one, got {type(plan).__name__}")
    return plan


def place_name(s: int, shared: tuple[int, ...], passes: int = 1, places: int = 0) -> str:
    """A place of a pipeline's chain as the report names it: a stage by its number among the
    stages, a place of every device (an interlaced pipeline's) by the stages around it, a
    multi-forward step's (of `places` in all) by its stage and forward pass."""
    if passes > 1:
        p = places // passes
        return f"stage {s % p} pass {s // p}"
    before = s - sum(1 for x in shared if x < s)  # the stages before it
    if s not in shared:
        return f"stage {before}"
    return "every device " + (f"after stage {before - 1}" if before else "before stage 0")


def program_name(kind: str, stage: int, wave: int = 0) -> str:
    """The name of a stage's forward ("F"), backward ("B") or apply-gradients ("A", of one wave)
    program in `compiled.programs`."""
    if kind == "A":
        return f"apply_gradients[{stage}.{wave}]"
    return f"{'forward' if kind == 'F' else 'backward'}[{stage}]"


def _runs(ids: tuple[int, ...]) -> str:
    """Device ids with consecutive runs folded: (0, 1, 2, 3, 8) → "0-3,8"."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
