"""Per-device memory of a plan: arguments, outputs and the peak of live intermediates."""
from __future__ import annotations

from ..hlo_passes.graph import Graph
from .specs import ShardingSpec


def local_bytes(graph: Graph, vid: int, spec: ShardingSpec | None, sizes: dict[str, int]) -> int:
    full = graph.values[vid].nbytes
    return full if spec is None else full // spec.shard_factor(sizes)


def plan_memory(graph: Graph, specs: dict[int, ShardingSpec], sizes: dict[str, int]) -> int:
    """Arguments stay live for the whole step (donated ones are reused by their outputs);
    intermediates live from their producer to their last reader, in program order. A counted
    loop's entry and exit hand on the buffers they read (a carried value is one buffer in, through
    and out of the loop), so their results are the same bytes, live until the last read of any."""
    buffer: dict[int, int] = {}  # loop-carried value → the value whose buffer it is
    for n in graph.nodes:
        if "loop_trips" in n.attrs:
            for o, r in zip(n.operands, n.results):
                buffer[r] = buffer.get(o, o)
    last_use: dict[int, int] = {}
    for n in graph.nodes:
        for o in n.operands:
            last_use[buffer.get(o, o)] = n.id
    end = len(graph.nodes)
    for o in graph.outputs:
        last_use[buffer.get(o, o)] = end
    args = sum(local_bytes(graph, a.value, specs.get(a.value), sizes) for a in graph.args)
    donated = {a.donated_to for a in graph.args if a.donated_to is not None}
    live = peak = 0
    frees: dict[int, int] = {}
    for n in graph.nodes:
        for r in n.results:
            v = graph.values[r]
            if v.constant or r not in last_use or r in buffer:
                continue
            b = local_bytes(graph, r, specs.get(r), sizes)
            live += b
            frees[last_use[r]] = frees.get(last_use[r], 0) + b
        peak = max(peak, live)
        live -= frees.pop(n.id, 0)
    # Outputs that do not reuse a donated buffer need their own space at the end.
    extra_out = sum(local_bytes(graph, o, specs.get(o), sizes)
                    for k, o in enumerate(graph.outputs) if k not in donated
                    and graph.values[o].producer == -1)
    return args + peak + extra_out
