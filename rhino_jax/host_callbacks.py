"""Host callbacks the installed jaxlib may deadlock on, refused before the step runs.

jaxlib 0.10's CPU client: a `jax.pure_callback` or `io_callback` copies its operands onto CPU
device 0 (`device_put` in jax's callback implementation) while device 0 runs the step that
called it. On a mesh of several CPU devices that copy sometimes never finishes: device 0 waits
in the callback, the other devices wait for it in the next collective, and XLA aborts the
process after 40 s. It happens under plain `jax.jit` too (the same step on 8 CPU devices,
arguments replicated). Seen with operands of 128 KiB and more; 96 KiB and less ran every time
tried; jaxlib 0.12 ran every size. So on jaxlib older than 0.12 a callback whose operands
pass a quarter of the smallest size seen to hang is refused with an error saying what to do,
rather than left to hang now and then."""
from __future__ import annotations

import importlib.metadata

from jax.sharding import Mesh

from rhino_jax.hlo_passes.graph import Graph

from .errors import HostCallbackError

FIXED_IN = (0, 12)  # the first jaxlib seen to run every size
SAFE_OPERAND_BYTES = 32 * 2**10  # a quarter of the smallest operand seen to hang (128 KiB)


def _jaxlib() -> tuple[int, ...]:
    return tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2])


def refuse_deadlocking(graph: Graph, mesh: Mesh) -> None:
    """Raise HostCallbackError for a step whose CPU host callbacks could deadlock when run on
    `mesh`."""
    if mesh.devices.size < 2 or mesh.devices.flat[0].platform != "cpu" or _jaxlib() >= FIXED_IN:
        return
    for node in graph.nodes:
        if "python_cpu_callback" not in node.attrs.get("target", ""):
            continue
        size = sum(graph.values[v].nbytes for v in node.operands)
        if size > SAFE_OPERAND_BYTES:
            raise HostCallbackError(
                f"{node.name.rstrip(':') or 'a host callback'} sends the host {size / 2**10:.0f} KiB: jaxlib "
                f"{'.'.join(map(str, _jaxlib()))}'s CPU client can deadlock on a callback's operands of this size "
                f"on a mesh of several CPU devices (under jax.jit as well; jaxlib {FIXED_IN[0]}.{FIXED_IN[1]} does "
                f"not): upgrade jax and jaxlib to {FIXED_IN[0]}.{FIXED_IN[1]} or later, or send the callback less "
                f"than {SAFE_OPERAND_BYTES // 2**10} KiB (a reduction of the value), or run the step on one device")
