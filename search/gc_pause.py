"""Python's full garbage collections held back while a step is planned.

CPython collects its oldest generation once ten younger collections have run and the objects
that survived them have grown by a quarter: each such collection walks every object alive. A
search of a large model holds millions (the graph, each unit's strategies, each cone's
choices) and makes and drops as many again per overlap round, so the full collections came
every few seconds and took a quarter of a 70B model's search (28 of them, 22 to 26 s of 85 to
95 s on two loaded cores),
finding little: the search's garbage is freed by reference counting, and the young collections,
which still run, take the few cycles it makes. Inside `few_full_collections` a full collection
waits for `YOUNGER_PER_FULL` younger ones instead; the threshold is put back when the last
caller leaves, and the collections after that find what was left meanwhile.
"""
from __future__ import annotations

import contextlib
import gc
import threading

YOUNGER_PER_FULL = 1000  # CPython's default is 10
_lock = threading.Lock()
_depth = 0
_saved: int | None = None


@contextlib.contextmanager
def few_full_collections():
    """Full collections rare inside (nested and threaded uses share one raised threshold)."""
    global _depth, _saved
    with _lock:
        if _depth == 0:
            young, middle, _saved = gc.get_threshold()
            gc.set_threshold(young, middle, max(_saved, YOUNGER_PER_FULL))
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                young, middle, _ = gc.get_threshold()
                gc.set_threshold(young, middle, _saved)
