"""What the search measured on its way to a plan (`Plan.search_stats`): the sizes, status and
times of its ILPs, the candidates it weighed. Diagnostics for the report and the benchmarks:
nothing that running the plan reads (that is `plan.Execution`)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class IlpStage:
    """One ILP the search solved on its way to the plan (`search.solvers.levels`): what it solved
    ("repeats tied", "by windows", "untied", ...), over how many classes of groups, how it ended,
    the step it estimated and how long it took."""

    name: str
    classes: int
    status: str
    objective_s: float
    solve_s: float


@dataclass(frozen=True)
class PipelineCandidate:
    """One plan `pipeline="auto"` weighed (`rhino_jax.controller`): its predicted step and memory,
    or why it has none."""

    label: str
    step_s: float | None  # None: no plan
    memory_bytes: int | None
    why: str = ""  # why it has no plan, or does not fit


@dataclass(frozen=True)
class CompiledCandidate:
    """One plan `compiled_choice.fastest_compiled` weighed, compiled for the GPUs or not."""

    predicted_s: float  # the search's replay
    compiled_s: float | None = None  # as its schedule runs; None: not compiled (predicted above a compiled step)
    memory_bytes: int | None = None  # XLA's memory analysis of the program kept for it
    fits: bool | None = None  # within the devices' memory
    kept: bool = False
    compile_s: float | None = None  # seconds its compile and pricing took at `lower()` (None: not compiled)


@dataclass(frozen=True)
class CoshardCandidate:
    """One number of chunks `coshard_search` planned: the plan's predicted step and memory."""

    chunks: int  # 1: the plan without chunks
    step_s: float
    memory_bytes: int


@dataclass(frozen=True)
class Staging:
    """How a pipeline's stager cut the step, and what the step's moves around the stages' programs
    cost once per step (`rhino_jax.pipelined`)."""

    cut_bytes: float  # what crosses the stage boundaries, per micro-batch
    epsilon: float | None = None  # the stages' balance relaxed to ±epsilon of a share for op_assign; None: not relaxed
    arguments_in_s: float = 0.0  # to bring the programs the arguments they read elsewhere
    sums_out_s: float = 0.0  # to bring apply-gradients the sums and values of other stages
    outputs_out_s: float = 0.0  # to return the loss and metrics on the whole mesh


@dataclass(frozen=True)
class SearchDiagnostics:
    """What the search measured on its way to the plan. A plan the search did not make (one
    built by hand) holds the defaults, `status` "". A pipelined step's plan sums its
    apply-gradients programs' searches up (`rhino_jax.pipelined`), a micro-batched step's holds
    apply-gradients'; each program's plan keeps its own."""

    # The step's graph and its coarsening (Rhino §4.3, Table 5): ops imported, critical nodes and
    # the segments between them, repeated segments tied as exactly alike and (counted only where
    # the exact tying made an ILP too large to solve whole, else None) as alike in kind, the
    # cones (`groups`) and the hubs through which several cones read one value.
    ops: int = 0
    critical_nodes: int = 0
    segments: int = 0
    tied_segments: int = 0
    similar_segments: int | None = None
    groups: int = 0
    hubs: int = 0
    # The user's constraints (`rj.op_trans`) → the ops and arguments each restricted.
    constraints: dict[str, int] = field(default_factory=dict)

    # The ILP as last solved: its groups (classes of tied cones), variables and constraints, the
    # solver, how it ended ("optimal", "near-optimal" within one combined launch, "feasible" at
    # the time limit, "windowed", "interrupted"; "" where no search ran), its gap (nan: no bound,
    # solved by windows) and estimate of the step, the windows of its last stage; the time to
    # build it and to solve every stage; each stage solved, in order.
    ilp_groups: int = 0
    ilp_vars: int = 0
    ilp_constraints: int = 0
    solver: str = ""
    status: str = ""
    gap: float = 0.0
    objective_s: float = 0.0
    windows: int = 0
    build_s: float = 0.0
    solve_s: float = 0.0
    ilp_stages: tuple[IlpStage, ...] = ()

    # Under a memory limit (`search.memory_limit`): the arguments kept from replication, largest
    # first, and the seconds the ILP's objective added per byte a device holds (0: none; then the
    # objective is no estimate of the step).
    not_replicated: tuple[str, ...] = ()
    memory_weight_s: float = 0.0

    # Values held at a non-maximum stride (split dims in the compiled program), how many and a
    # few of them as "shape spec".
    strided_values: int = 0
    strided_examples: tuple[str, ...] = ()

    # A program of a pipeline alike to another (`alike_programs`): the program whose plan it took.
    plan_of: str = ""

    # The candidates weighed around the search: `pipeline="auto"`'s (the chosen one first), the
    # co-shard's numbers of chunks, the plans compiled for GPUs (in the search's order).
    pipeline_candidates: tuple[PipelineCandidate, ...] = ()
    coshard_candidates: tuple[CoshardCandidate, ...] = ()
    compiled_candidates: tuple[CompiledCandidate, ...] = ()

    # A pipeline's stager and moves; None for a step not pipelined.
    staging: Staging | None = None

    @property
    def critical_proportion(self) -> float:
        """The share of the ops that are critical nodes."""
        return self.critical_nodes / max(1, self.ops)
