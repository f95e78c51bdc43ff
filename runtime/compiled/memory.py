"""What a compiled program holds per device, from XLA's buffer assignment."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CompiledMemory:
    """Per-device memory of a compiled executable, from XLA's buffer assignment."""

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int

    @property
    def total(self) -> int:
        """Arguments + outputs + temporaries, not counting donated (aliased) buffers twice."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes


def compiled_memory(compiled: Any) -> CompiledMemory:
    """Read `compiled.memory_analysis()` (a jax `Compiled`; a stats object also works).

    The peak figure is deliberately not used: on CPU it is unreliable.
    """
    stats = compiled.memory_analysis() if hasattr(compiled, "memory_analysis") else compiled
    if isinstance(stats, (list, tuple)):  # some jax versions return one entry per executable
        if not stats:
            raise RuntimeError("memory_analysis() returned no entries")
        stats = stats[0]
    if stats is None:
        raise RuntimeError("memory_analysis() is not available for this executable")
    return CompiledMemory(
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
    )
