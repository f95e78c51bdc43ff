"""Plan: the search's answer, as plain data that can be saved, diffed and explained."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from collections.abc import Callable

from .diagnostics import SearchDiagnostics
from .plain_data import PlainDataError, from_plain, to_plain
from .plan_file import PLAN_FORMAT, check_specs, not_readable, replace_file, spec_owner, upgraded
from .plan_target import PlanTarget, PlanTargetError
from .specs import ShardingSpec

# The readers of a plan, by name: what the stages above it make of it (the pipeline's schedule
# and task graph, the collectives as XLA's combiners merge them, the report; explain and render,
# which search again or draw). The plan imports nothing above the floor it stands on, so the
# package fills this table as it imports them, and the plan's methods call through it.
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
    # the communication off the compute chain, which the search priced at the cluster's overlap,
    # and what of it the replayed step hid: their ratio is the share the next overlap round
    # prices at (`search.planner.search`)
    off_chain_comm_s: float = 0.0
    off_chain_hidden_s: float = 0.0


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


@dataclass(frozen=True)
class ApplyTask:
    """One apply-gradients program of a pipeline, as the task graph runs it: where, and after what."""

    stage: int  # -1: the one apply of a step not pipelined, on the whole mesh
    wave: int
    sums_from: tuple[int, ...]  # the stages whose accumulated sums it reads
    reads: tuple[tuple[int, int], ...]  # the (stage, wave) of the apply programs whose values it reads

    @property
    def name(self) -> str:
        return apply_task_name(self.stage, self.wave)


def apply_task_name(stage: int, wave: int) -> str:
    return f"apply {wave}@{stage}" if stage >= 0 else "apply"


@dataclass(frozen=True)
class CoshardCut:
    """One group of ops a co-shard constraint cut into chunks (nnScaler §3.2, co-shard): the
    constraint (its text), the group's index among the constraint's groups, the dim of its largest
    value that is cut, and how many chunks."""

    constraint: str
    group: int
    dim: int
    chunks: int
    recompute: bool  # the chunks make again what they read from the constraint's earlier groups


@dataclass(frozen=True)
class Execution:
    """How the step's programs run, beyond their layouts: what a saved plan needs to run without
    a search (the defaults: one SPMD program, as the step was written). What the search measured
    on the way is `Plan.search_stats`."""

    micro_batches: int = 1
    pipeline: int = 1  # stages (1: no pipeline)
    schedule: str = ""  # the pipeline's schedule ("1f1b", "gpipe", "eager-1f1b", "op_order", ...)
    # an op_order or interlaced schedule's own order, a row of tasks per place ("F0 F1 B0 ...",
    # `runtime.schedules.Schedule.rows`); the named schedules are made again from their name
    schedule_rows: tuple[str, ...] = ()
    shared_places: tuple[int, ...] = ()  # an interlaced pipeline's places that run on every device
    passes: int = 1  # a multi-forward step's forward passes over the stages
    repeated_layers: tuple[str, ...] = ()  # the layers those passes repeat
    applies: tuple[ApplyTask, ...] = ()  # a pipeline's apply-gradients programs (none: one apply)
    transfer_s: float = 0.0  # to move one micro-batch's tensors across a stage boundary
    coshard: tuple[CoshardCut, ...] = ()  # the groups of ops cut into chunks


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
    # what the search measured on the way (its ILPs' sizes, status and times; the candidates it
    # weighed): diagnostics for the report, nothing that running the plan reads
    search_stats: SearchDiagnostics = field(default_factory=SearchDiagnostics)
    execution: Execution = field(default_factory=Execution)
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
    # Set by the search: the other plans it weighed (its overlap rounds' plans of other layouts),
    # best predicted first. `parallelize` compiles them beside this one for GPUs and keeps the one
    # whose program runs fastest as XLA schedules it (`rhino_jax.compiled_choice`). Not saved,
    # not compared.
    alternatives: object = field(default=(), compare=False, repr=False)

    @property
    def task_graph(self):
        """What runs in a step, where and after what (Rhino §6.1); `.to_dot()` for Graphviz
        (`runtime.task_graph.of_plan`)."""
        return READERS["task_graph"](self)

    def schedule(self):
        """The pipeline's schedule as it runs (one stage, one micro-batch without a pipeline;
        `runtime.schedules.of_plan`)."""
        return READERS["schedule"](self)

    def collective_summary(self, backend: str | None = None) -> dict[str, tuple[int, int]]:
        """kind → (count, bytes) of the collectives a backend's XLA compiles for this plan, once
        its combiners have merged independent ones (default: the cluster's backend; "cpu" to
        compare with a program compiled here)."""
        return {kind: (n, b) for kind, (n, b, _) in self.combined_kinds(backend).items()}

    def combined_kinds(self, backend: str | None = None) -> dict[str, tuple[int, int, int]]:
        """kind → (count, bytes, planned collectives merged into them) of `collective_summary`
        (`search.combining.combined_kinds`)."""
        return READERS["combined_kinds"](self.collectives, backend or self.backend)

    def mesh_candidates_report(self) -> str:
        """The mesh shapes searched (mesh=None), best predicted step first (`rhino_jax.report`)."""
        return READERS["mesh_candidates_report"](self)

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
            plan = from_plain(Plan, {k: v for k, v in upgraded(data).items() if k != "rhino_jax_plan"})
            check_specs(plan)
            return plan
        except PlainDataError as e:
            raise ValueError(f"{path}: {spec_owner(data, e.where)}{e}") from None
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: {e}") from None

    def check_matches(self, target: PlanTarget) -> None:
        """Raise PlanTargetError unless this plan was made for `target` (the program and mesh
        about to run: `lowering.step_target(lowered_step, mesh)`)."""
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
            for c, n in plan.search_stats.constraints.items():
                out[c] = out.get(c, 0) + n
        return out

    def program(self, name: str, target: PlanTarget) -> "Plan":
        """The saved plan of program `name`, once it is shown to be made for `target`, the program
        cut from the step now (`lowering.program_target`): PlanTargetError otherwise, as when another
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
        """The plan in words: mesh, predicted step, how it was searched, the largest arguments'
        layouts, the predicted collectives (`rhino_jax.report`)."""
        return READERS["report"](self, max_tensors)


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
