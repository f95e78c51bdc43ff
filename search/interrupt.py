"""Ctrl-C during a search: the best plan so far, and the searches after it in one lowering stop too.

Before a plan exists (import, cone building) a Ctrl-C is the user stopping: KeyboardInterrupt
propagates. After it, each solver answers it with the best choice it holds (`press` records that it
did), and a lowering that runs several searches (mesh shapes, micro-batched and pipelined programs,
pipeline candidates) opens one `session` around them: once pressed, the searches left in it solve
nothing (their solves raise KeyboardInterrupt at once, which their solvers answer the same way), so
the lowering ends with a plan at once, every search's plan marked `interrupted`.
"""
from __future__ import annotations

import contextlib
import threading
import warnings

from rhino_jax.errors import SolverInterruptedWarning

_state = threading.local()  # depth: sessions open in this thread; pressed: a Ctrl-C answered in them


@contextlib.contextmanager
def session():
    """The searches of one lowering (nested sessions belong to the outermost). Also a decorator."""
    depth = getattr(_state, "depth", 0)
    if depth == 0:
        _state.pressed = False
    _state.depth = depth + 1
    try:
        yield
    finally:
        _state.depth = depth


def press() -> None:
    """A Ctrl-C was answered with the best plan so far: the searches left in the session stop.
    Outside a session (a solver called alone) it stops nothing else."""
    if getattr(_state, "depth", 0):
        _state.pressed = True


def pressed() -> bool:
    return getattr(_state, "depth", 0) > 0 and _state.pressed


def check() -> None:
    """Raise KeyboardInterrupt if the session was interrupted (before a solve starts)."""
    if pressed():
        raise KeyboardInterrupt("the search was interrupted (Ctrl-C)")


def warn(what: str, stacklevel: int = 3) -> None:
    """Tell the user that Ctrl-C stopped `what`, that its plan is not optimal, and how to search
    again: the parallelized step keeps the plan for these argument shapes, as it keeps any."""
    warnings.warn(f"{what} interrupted (Ctrl-C): the solver stopped, and the plan is the best found so far, not "
                  "optimal; the step keeps it for these argument shapes: call step.clear_cache() for a full search "
                  "at the next call or step.lower(...)", SolverInterruptedWarning, stacklevel=stacklevel + 1)
