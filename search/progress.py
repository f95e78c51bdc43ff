"""What a search is doing, said twice: to the `rhino_jax` logger at INFO (for logs) and, while
`rj.parallelize` plans a step, on one line of stderr that a person sees (`shown`): the elapsed
time, the latest step of the search and the best predicted step so far. A script that did not
configure logging would otherwise wait through a minute's search in silence.

The line appears once a search has run DELAY_S; on a terminal it is redrawn in place and erased
at the end, elsewhere (a log file, CI) a plain line is written every LOG_PERIOD_S and at the end. Off with
`parallelize(progress=False)` or the environment variable RHINO_JAX_PROGRESS=0. A search in a
worker process (`mesh=None`'s pool) says its steps to its own process only; the searching
process says each mesh's result as it comes back."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger("rhino_jax")

DELAY_S = 3.0  # a search quicker than this shows nothing
TTY_PERIOD_S = 0.5
LOG_PERIOD_S = 15.0
ENV = "RHINO_JAX_PROGRESS"


@dataclass
class _Line:
    start: float = field(default_factory=time.monotonic)
    phase: str = "lowering the step"
    best_s: float | None = None
    parts: int = 0  # searches under way of a part of the step (`part`)


_line: _Line | None = None  # the display in progress, if any (one per process)


def say(message: str, *args, best_s: float | None = None) -> None:
    """Log `message % args` at INFO and show it on the progress line; `best_s`: the predicted
    step of a plan of the whole step it reports (as its report will say it), the line's best so
    far unless a `part` is being searched."""
    log.info(message, *args)
    line = _line
    if line is not None:
        line.phase = (message % args).removeprefix("rhino_jax: ")
        if best_s is not None and not line.parts and (line.best_s is None or best_s < line.best_s):
            line.best_s = best_s


@contextlib.contextmanager
def part():
    """A search of a part of the step, or of another question about it (one program of a step
    run as several, the plan on a coarser mesh, an alternative `explain` prices): its plans'
    predictions are not the step's, and the line's best so far leaves them out."""
    line = _line
    if line is not None:
        line.parts += 1
    try:
        yield
    finally:
        if line is not None:
            line.parts -= 1


def enabled(option: bool) -> bool:
    """Whether to show the line: the option, unless RHINO_JAX_PROGRESS is 0, false, no or off."""
    return option and os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@contextlib.contextmanager
def shown(show: bool, stream=None):
    """Show the progress line on `stream` (default stderr) while the block runs, if `show`
    (nested blocks: the outer one's line)."""
    global _line
    if not show or _line is not None:
        yield
        return
    stream = stream or sys.stderr
    line, stop = _Line(), threading.Event()
    drawer = threading.Thread(target=_draw, args=(line, stop, stream), name="rhino_jax progress", daemon=True)
    _line = line
    drawer.start()
    try:
        yield
    finally:
        _line = None
        stop.set()
        drawer.join()


def _text(line: _Line, now: float) -> str:
    best = "" if line.best_s is None else f" | best so far {line.best_s * 1e3:.4g} ms"
    return f"rhino_jax {now - line.start:6.1f} s | {line.phase}{best}"


def _draw(line: _Line, stop: threading.Event, stream) -> None:
    tty = getattr(stream, "isatty", lambda: False)()
    if stop.wait(DELAY_S):
        return
    width = shutil.get_terminal_size((100, 20)).columns - 1
    drawn = False
    while True:
        shown_text = _text(line, time.monotonic())
        try:
            if tty:
                stream.write("\r" + shown_text[:width].ljust(width))
            else:
                stream.write(shown_text + "\n")
            stream.flush()
            drawn = True
        except (OSError, ValueError):  # a closed stream: nothing more to show
            return
        if stop.wait(TTY_PERIOD_S if tty else LOG_PERIOD_S):
            break
    if drawn:  # a terminal's line erased; a log's last line says where the search ended
        with contextlib.suppress(OSError, ValueError):
            stream.write("\r" + " " * width + "\r" if tty else _text(line, time.monotonic()) + "\n")
            stream.flush()
