"""Constraints on the search space, the primitives of "nnScaler: Constraint-Guided Parallelization
Plan Generation for Deep Learning Training" (§3-§4): checked here, applied by the search
(`search/space/constraints.py`)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from rhino_jax.runtime.schedules import Task
from rhino_jax.search.space.constraints import CoShard, OpAssign, OpTrans

from .errors import ConstraintError


def op_trans(where: str, dims: int | Sequence[int] | None = None, parts: int | Sequence[int] | None = None,
             replicate: bool = False) -> OpTrans:
    """The ops and arguments `where` names may be partitioned only along `dims` of their result
    (indices, negative from the end; a split of a contracted dim, whose result is a partial sum,
    is along none), only into a number of parts in `parts` (the devices one op's work is split
    over; include 1 to let it stay whole), or not at all (`replicate=True`). Pass a list of them
    as `rj.parallelize(..., constraints=[...])`; they combine with `rj.annotate` pins.

    `where` is a glob (`*` and `?`) on the whole name: an op's jax name stack as `plan.report()`
    prints it (`jvp(LM)/Block_0/MultiHeadDotProductAttention_0/query/dot_general`; the backward
    pass's ops start `transpose(jvp(...))`), or an argument's path (`arg[0]['Block_0']['Dense_0']
    ['kernel']`, or with slashes, `0/Block_0/Dense_0/kernel`). A Flax module path such as
    `"*Block_*/MultiHeadDotProductAttention_0/*"` names the module's forward and backward ops and
    its parameters and optimizer state alike. The backward pass's results are laid out otherwise
    than the forward's (a weight gradient's dims follow XLA's dot_general), so a `dims` constraint
    usually names the forward ops (`"jvp(*)/..."`) or the parameters."""
    _check_where("op_trans", where)
    if replicate not in (True, False):
        raise ConstraintError(f"op_trans({where!r}): replicate must be True or False, got {replicate!r}")
    if replicate and (dims is not None or parts is not None):
        raise ConstraintError(f"op_trans({where!r}): replicate=True keeps the ops whole; drop dims and parts, "
                              "or replicate")
    if not replicate and dims is None and parts is None:
        raise ConstraintError(f"op_trans({where!r}) constrains nothing: give dims (the result dims it may split), "
                              "parts (the numbers of parts it may be split into) or replicate=True")
    return OpTrans(where, _ints("dims", where, dims, lowest=None), _ints("parts", where, parts, lowest=1), replicate)


def op_assign(where: str, stage: int | str) -> OpAssign:
    """The forward ops `where` names (a glob, as for `op_trans`) run on pipeline stage `stage`
    (0 the first); their backward ops follow them. The stager still balances the rest and cuts
    the fewest bytes; where the assignment leaves no division within its balance (a share of
    1 ± 0.25), the balance is relaxed as far as the assignment needs, and the report says by how
    much. Needs `pipeline=k` (or "auto", where a candidate with too few stages is infeasible).

    `stage="all"`: the interlaced pipeline (nnScaler §4.2): the ops it names, forward
    and backward (a module's glob such as `"*Embed*"` names both), run on every device of the
    mesh, split over all of them by the search, between the stages' programs: a large embedding
    before the first stage and its tied output projection after the last, while the blocks are
    pipelined. The stager places them before, between or after the stages as their inputs
    allow, with the unnamed ops no stage can take (the loss after the projection); the schedule
    interlaces their tasks, which occupy every device, with the stages' (`schedule` still
    orders each stage's own)."""
    _check_where("op_assign", where)
    if stage != "all" and (isinstance(stage, bool) or not isinstance(stage, int) or stage < 0):
        raise ConstraintError(f"op_assign({where!r}): stage must be an int >= 0 (0 the first stage) or 'all' (every "
                              f"device, between the stages), got {stage!r}")
    return OpAssign(where, stage)


def coshard(where: str, chunks: int | str = "auto") -> CoShard:
    """Co-shard (nnScaler §4.2): the ops `where` names (a glob, as for `op_trans`) run
    as `chunks` chunks one after another on the same devices, each on a 1/chunks slice of a dim
    they all share (an attention's heads or batch), so that the values they make and drop take
    about 1/chunks of the memory while they run; the results and the plan's communication stay
    as they were. It goes with recomputation (`nn.remat`, `jax.checkpoint`): what the chunks
    keep for the backward pass is not cut. The ops between two named ones join them; the named
    ops form groups (a block's forward, its recomputed forward, its backward), each cut on the
    dim that the plan without chunks splits least over the mesh. `chunks="auto"`: the search
    tries 1 (no chunks), 2, 4, ... and keeps the fastest plan within `memory_limit_bytes`.
    Not with pipelines or micro-batches yet."""
    _check_where("coshard", where)
    if chunks != "auto" and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 2):
        raise ConstraintError(f"coshard({where!r}): chunks must be an int >= 2 or 'auto', got {chunks!r}")
    return CoShard(where, chunks)


@dataclass(frozen=True)
class OpOrder:
    """`rj.op_order`: the pipeline's schedule derived from ordering constraints."""

    rule: Callable[[int, int], Iterable[tuple[Task, Task]]]

    def __str__(self) -> str:
        return f"op_order({getattr(self.rule, '__name__', 'rule')})"


def op_order(rule: Callable[[int, int], Iterable[tuple[Task, Task]]]) -> OpOrder:
    """The pipeline's schedule as ordering constraints (nnScaler's op-order, its Table 4):
    `rule(stages, micro_batches)` returns or yields pairs `(a, b)` of `rj.Task(kind, stage,
    micro_batch)` (kind "F" or "B", counted from 0), each "a runs before b" on one stage. Each
    stage then runs its forward and backward tasks in an order the pairs allow (a micro-batch's
    F before its B, the stages' own dependencies kept); where they leave a choice, the task that
    can start first. The schedule is checked (every task once, no deadlock) and simulated before
    anything runs; with `pipeline=p` and `num_micro_batches`, in place of `schedule`. In a step
    that runs its layers several times per micro-batch (recycling: a multi-forward step, the
    passes before the last under stop_gradient), an F task names its pass:
    `rj.Task("F", stage, micro_batch, forward_pass=r)`, r from 0; the backward is the last pass's."""
    if not callable(rule):
        raise ConstraintError(f"op_order takes a rule(stages, micro_batches) returning pairs (a, b) of rj.Task, "
                              f"a to run before b on one stage; got {rule!r}")
    return OpOrder(rule)


def _check_where(kind: str, where) -> None:
    if not isinstance(where, str) or not where:
        raise ConstraintError(f"{kind}: where must be a non-empty glob string, e.g. '*Block_*/Dense_0/*'; "
                              f"got {where!r}")


def _ints(name: str, where: str, value, lowest: int | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    values = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    try:
        out = tuple(values)
    except TypeError:
        out = None
    if not out or any(isinstance(v, bool) or not isinstance(v, int) or (lowest is not None and v < lowest)
                      for v in out):
        example = "(0,) or (-2,)" if name == "dims" else "(2, 4, 8)"
        raise ConstraintError(f"op_trans({where!r}): {name} must be an int or a non-empty sequence of ints"
                              f"{f' >= {lowest}' if lowest is not None else ''}, e.g. {example}; got {value!r}")
    return tuple(dict.fromkeys(out))
