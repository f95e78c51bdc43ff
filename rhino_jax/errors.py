"""Errors a user can act on: each message says what to change."""


class RhinoError(Exception):
    """Base class of rhino_jax's errors."""


class ShardingPinError(RhinoError, ValueError):
    """A pinned sharding (rj.annotate / with_sharding_constraint) that the mesh cannot satisfy."""


class ConstraintError(RhinoError, ValueError):
    """A constraint on the search space (rj.op_trans, rj.op_assign, rj.op_order) that is
    malformed, names nothing, or leaves an op no strategy or stage."""


class SolverError(RhinoError, RuntimeError):
    """The strategy solver failed: infeasible, or no plan within the time limit."""


class MeshError(RhinoError, ValueError):
    """The mesh or devices do not fit the request."""


class LayoutError(RhinoError, ValueError):
    """A plan lays out an argument or result of the step as jax cannot: a dim split by mesh axes
    that do not divide it, or more dims split than the array has (a typed PRNG key's)."""


class GpuPluginError(RhinoError, RuntimeError):
    """Described GPUs (`rj.gpu_topology`) need jax's CUDA plugin of jaxlib's version, and it is
    missing or of another version."""


class SolverTimeLimitWarning(UserWarning):
    """The solver stopped at its time limit; the plan is feasible but may not be optimal."""


class SolverInterruptedWarning(UserWarning):
    """The search was interrupted (Ctrl-C); the plan is the best found so far."""


class CompiledMemoryWarning(UserWarning):
    """XLA's GPU compile of a plan needs more memory per device than the plan was searched for:
    it was compiled again with remedies (its latency-hiding scheduler held to the limit, tied to
    the program's order, last without the scheduler) and the fastest that fits kept, or it does
    not fit at all."""


class UnscheduledProgramWarning(UserWarning):
    """An HLO module priced as a timeline carries no schedule (no `is_scheduled=true`): its
    instructions are in no running order, so it is priced serially, no communication overlapped."""


class TracedCallWarning(UserWarning):
    """A parallelized step was called inside a jax transformation (jax.jit, grad, vmap,
    eval_shape): it is traced as written, without its plan."""


class NoFeasibleMeshError(MeshError):
    """`parallelize(mesh=None)`: no enumerated mesh shape has a plan (each candidate's reason is
    in the message)."""


class MemoryLimitError(RhinoError, ValueError):
    """No plan fits `memory_limit_bytes`, even with every parameter and optimizer state sharded."""


class StagingError(RhinoError, ValueError):
    """No division of the graph into pipeline stages fits the request (stages, balance)."""


class ScheduleError(RhinoError, ValueError):
    """A pipeline schedule that cannot run: a task missing or repeated, a backward before its
    forward, or stages waiting on each other forever."""


class UnknownTensorError(RhinoError, KeyError):
    """`plan.explain(name)` of a name that is none of the plan's arguments (the message lists the
    closest names and how many there are)."""

    def __str__(self) -> str:  # a KeyError would print its message quoted, as a key
        return str(self.args[0])


class HostCallbackError(RhinoError, RuntimeError):
    """A step whose host callback the installed jaxlib could deadlock on when run on this mesh."""
