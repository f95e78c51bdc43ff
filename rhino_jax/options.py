"""Options of rj.parallelize, checked once so a bad value fails before any tracing."""
from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rhino_jax.search.cost.cluster import Cluster, get_cluster
from rhino_jax.search.space.constraints import Named
from rhino_jax.search.solvers.levels import Budget

from .constraints import OpOrder
from .errors import ConstraintError, MeshError


SOLVERS = ("HIGHS", "SCIP", "CP-SAT")  # OR-Tools' MIP backends the search is run with


@dataclass(frozen=True)
class Options:
    opt_level: str = "O2"
    memory_limit_bytes: int | None = None
    cluster: Cluster | str | None = None
    num_micro_batches: int = 1
    pipeline: str | int = "off"
    # The dtype micro-batches' low-precision sums (bf16, f16 gradients) are added up in; None: their own.
    accumulation_dtype: str | None = "float32"
    schedule: str = "1f1b"
    solver: str = "HIGHS"
    solver_time_limit_s: float = 60.0
    # mesh=None only: names of the enumerated meshes' axes (a k-axis candidate takes the first k;
    # there are at most len(axis_names) axes), and how many processes search candidates
    # (None: decide from the first candidate's search time; 0 or 1: in this process).
    axis_names: tuple[str, ...] | None = None
    search_workers: int | None = None
    # Rhino's strided specs (§4.1) where reshapes call for them; False: maximum strides only.
    strided_specs: bool = True
    # A one-line progress display on stderr for searches longer than a few seconds (`search.progress`).
    progress: bool = True
    # The user's constraints on the search space (`rj.op_trans`, `rj.op_assign`, `rj.op_order`, `rj.coshard`),
    # in order.
    constraints: tuple[Named | OpOrder, ...] = ()
    # Set by `within`, not by users: the `time.perf_counter()` time this share of a step's time
    # limit ends, so a budget made from it (`budget_of`) counts from the share's start.
    search_until: float | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.opt_level not in ("O2", "O3"):
            raise ValueError(f"opt_level must be 'O2' or 'O3', got {self.opt_level!r}")
        get_cluster(self.cluster)  # raises on an unknown preset
        if self.schedule not in ("1f1b", "gpipe", "eager-1f1b"):
            raise ValueError(f"schedule must be '1f1b', 'gpipe' or 'eager-1f1b', got {self.schedule!r}")
        if self.pipeline not in ("off", "auto") and (isinstance(self.pipeline, bool) or not isinstance(
                self.pipeline, int) or self.pipeline < 1):
            raise ValueError(f"pipeline must be 'off', 'auto' or a number of stages >= 1, got {self.pipeline!r}")
        if self.pipeline not in ("off", "auto", 1) and self.num_micro_batches < 2:
            raise ValueError(f"pipeline={self.pipeline} needs num_micro_batches >= 2: with one micro-batch the "
                             "stages run one after another; pass e.g. num_micro_batches=4")
        if isinstance(self.num_micro_batches, bool) or not isinstance(self.num_micro_batches, int) \
                or self.num_micro_batches < 1:
            raise ValueError(f"num_micro_batches must be an int >= 1, got {self.num_micro_batches!r}")
        if self.accumulation_dtype not in (None, "float32", "float64"):
            raise ValueError("accumulation_dtype must be 'float32' (the default), 'float64' or None (the gradients' "
                             f"own dtype), got {self.accumulation_dtype!r}")
        if self.memory_limit_bytes is not None and (isinstance(self.memory_limit_bytes, bool) or not isinstance(
                self.memory_limit_bytes, int) or self.memory_limit_bytes <= 0):
            raise ValueError(f"memory_limit_bytes must be a positive int (bytes per device) or None, "
                             f"got {self.memory_limit_bytes!r}")
        if not isinstance(self.solver, str) or self.solver.upper() not in SOLVERS:
            raise ValueError(f"solver must be one of {', '.join(repr(s) for s in SOLVERS)} (OR-Tools' MIP "
                             f"backends), got {self.solver!r}")
        object.__setattr__(self, "solver", self.solver.upper())
        if not isinstance(self.strided_specs, bool):
            raise ValueError(f"strided_specs must be True or False, got {self.strided_specs!r}")
        constraints = (self.constraints,) if isinstance(self.constraints, (Named, OpOrder)) else self.constraints
        if not isinstance(constraints, (list, tuple)) or not all(isinstance(c, (Named, OpOrder)) for c in constraints):
            raise ConstraintError(f"constraints must be a list of rj.op_trans(...), rj.op_assign(...), "
                                  f"rj.op_order(...) and rj.coshard(...), e.g. [rj.op_trans('*Attention*', replicate=True)]; "
                                  f"got {self.constraints!r}")
        if self.schedule != "1f1b" and any(isinstance(c, OpOrder) for c in constraints):
            raise ConstraintError(f"schedule={self.schedule!r} and rj.op_order both give the pipeline's schedule; "
                                  "pass one of them")
        object.__setattr__(self, "constraints", tuple(constraints))
        if not isinstance(self.progress, bool):
            raise ValueError(f"progress must be True or False, got {self.progress!r}")
        limit = self.solver_time_limit_s
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit < float("inf"):
            raise ValueError(f"solver_time_limit_s must be a positive number of seconds, got {limit!r}")
        if self.axis_names is not None:
            names = (self.axis_names,) if isinstance(self.axis_names, str) else tuple(self.axis_names)
            if not names or not all(isinstance(a, str) and a for a in names) or len(set(names)) != len(names):
                raise MeshError(f"axis_names must be distinct non-empty strings, e.g. ('data', 'model'); "
                                f"got {self.axis_names!r}")
            object.__setattr__(self, "axis_names", names)
        if self.search_workers is not None and (isinstance(self.search_workers, bool)
                                                or not isinstance(self.search_workers, int)
                                                or self.search_workers < 0):
            raise ValueError("search_workers must be None (automatic) or an int >= 0, "
                             f"got {self.search_workers!r}")


def naming_the_closest(fn: Callable) -> Callable:
    """`fn` refusing a keyword it does not take with a TypeError that names its closest keyword
    (a typo such as `num_microbatches=4` is otherwise Python's bare "unexpected keyword"); its
    signature, as help() and inspect show it, stays `fn`'s."""
    names = list(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        unknown = [name for name in kwargs if name not in names]
        if unknown:
            close = difflib.get_close_matches(unknown[0], names, n=1)
            raise TypeError(f"{fn.__name__}() got an unexpected keyword argument {unknown[0]!r}: "
                            + (f"did you mean {close[0]!r}?" if close else f"its keywords are {', '.join(names)}"))
        return fn(*args, **kwargs)
    return checked


def within(options: Options, budget: Budget, weight: float, what: str) -> Options:
    """`options` with the share of the step's time limit (`budget`) that the search of `what`
    takes (`weight`: its ops, or 1 per candidate)."""
    share = budget.take(weight, f"it searched {what}")
    return dataclasses.replace(options, solver_time_limit_s=share,
                               search_until=min(time.perf_counter() + share, budget.at))


def seconds_left(options: Options) -> float:
    """The time limit of the search about to start: `solver_time_limit_s`, less, for a share of
    a step's limit (`within`), the set-up since the share was taken (at least a millisecond:
    the search then says it ran out of time)."""
    if options.search_until is None:
        return options.solver_time_limit_s
    return max(1e-3, options.search_until - time.perf_counter())


def budget_of(options: Options, weight: float) -> Budget:
    """The time limit of `options` shared by searches of total `weight`; ending where the share
    `options` is ends (`within`), not `solver_time_limit_s` after the set-up before them."""
    return Budget(options.solver_time_limit_s, weight, until=options.search_until)


def device_memory(options: Options, devices) -> int:
    """The bytes a device may hold: `memory_limit_bytes`, else the cluster's `memory_per_device`
    (the preset `options.cluster` names, else the one `devices` are of)."""
    return options.memory_limit_bytes or get_cluster(options.cluster, list(devices)).memory_per_device
