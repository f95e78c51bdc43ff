"""Price a compiled program: the step time a cluster would take to run exactly what XLA compiled.

The cost model predicts a plan's time from shardings; this module prices the compiled HLO of any
program (rhino_jax's or a hand plan compiled by plain `jax.jit`) the same way, so that plans
compare on what XLA really built:

- compute: one roofline over the whole per-device program, max(flops / F(dtype),
  bytes accessed / memory bandwidth), from XLA's cost analysis: a CPU program's own
  (`cost_analysis()`), a GPU program's (real or described, `rj.gpu_topology`) XLA's generic
  analysis of its HLO text plus its cuDNN convolutions' FLOPs, which that analysis leaves out.
  XLA prices a while loop's body once; bodies with a known trip count are priced again on their
  own and scaled up here (`program_cost`, run counts from `hlo_stats.computation_runs`), so a
  `scan` over layers costs all of its layers. Both analyses count every collective's operands
  and results as bytes accessed; they are taken out (`collective_traffic`), as communication
  prices them already.
- communication: every compiled collective (`hlo_stats.collective_stats`, once per execution:
  loop trips counted) at the α-β ring cost of `search.collectives.Collective.time`, on a one-axis
  topology of its group size and link. For a GPU cluster, an all-reduce whose result is only read
  in 1/group slices is priced as the reduce-scatter GPU XLA makes of it
  (`CompiledCollective.scattered`); the CPU compiler keeps the pair.

Pricing a CPU-compiled program for a GPU cluster inherits the CPU compiler's choices (e.g. bf16
dots are computed in f32 and fusions differ), the same for every plan priced.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import jax

from rhino_jax.search.cluster import Cluster, MeshTopology, combiner_for, get_cluster, is_described
from rhino_jax.search.collectives import Collective

from .hlo_stats import (
    _REF_RE,
    COLLECTIVE_KINDS,
    CollectiveStats,
    CompiledMemory,
    ComputationRuns,
    collective_stats,
    compiled_memory,
    computation_runs,
    library_conv_flops,
)
from .jax_internals import UnsupportedJaxError, hlo_cost_analysis

__all__ = ["CompiledCost", "price_compiled", "price_collectives", "program_cost", "program_device",
           "collective_traffic", "dot_dtype", "xla_cost_analysis"]


@dataclass(frozen=True)
class CompiledCost:
    """Per-device time of one step of a compiled program on a cluster (no compute/comm overlap)."""

    compute_s: float
    comm_s: float
    total_s: float
    dtype: str  # the FLOP rate's dtype (`price_compiled` says how it is chosen)
    flops: float  # per device, loop bodies counted per trip
    bytes_accessed: float
    collectives: dict[str, tuple[int, int]]  # kind -> (count, bytes per device), as hlo_stats counts
    comm_by_kind: dict[str, float]  # kind -> seconds
    memory: CompiledMemory
    unknown_trip_loops: int = 0  # while loops XLA gave no trip count: their bodies are priced once
    # the collectives' own buffers, which XLA's analysis counted and bytes_accessed leaves out
    collective_bytes: float = 0.0

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["memory"] = dict(self.memory.__dict__, total=self.memory.total)
        return d


# ------------------------------------------------------------------------------ compute


def _cost_dict(analysis: Any) -> dict[str, float]:
    """`cost_analysis()` is a dict in new jax and a list of one dict per executable in old."""
    if analysis is None:
        raise RuntimeError("cost_analysis() returned None: this backend cannot be priced")
    if isinstance(analysis, (list, tuple)):
        if not analysis:
            raise RuntimeError("cost_analysis() returned no entries")
        analysis = analysis[0]
    if not isinstance(analysis, dict) or not {"flops", "bytes accessed"} & set(analysis):
        raise RuntimeError(f"cost_analysis() gave neither 'flops' nor 'bytes accessed' ({analysis!r}); "
                           "this backend cannot be priced")
    return analysis  # a program that only moves data (a reshard) has bytes but no 'flops'


def _module_header(text: str) -> str:
    """An `HloModule` line keeping the device counts, without the entry's layout (it changes)."""
    counts = " ".join(f", {k}={v}" for k, v in re.findall(r"\b(num_partitions|replica_count)=(\d+)",
                                                             text.split("\n", 1)[0]))
    return f"HloModule loop_body{counts}"


def program_device(compiled: Any) -> jax.Device:
    """A device the program was compiled for: one of its arguments' (their shardings name them),
    not the default backend's, so that a program compiled for CPU devices is read as a CPU program
    on a machine whose default backend is a GPU. A program without array arguments runs where
    `jax.jit` puts it: on the default device."""
    for sharding in jax.tree.leaves(getattr(compiled, "input_shardings", None)):
        devices = getattr(sharding, "device_set", None)
        if devices:
            return min(devices, key=lambda d: d.id)
    return jax.devices()[0]


# An async collective's start as GPU XLA prints it (jax 0.12: `all-reduce-start(...), ...,
# output_to_operand_aliasing={{1}: (0, {})}`): its parser admits that attribute on custom calls
# and fusions only.
_ASYNC_START_RE = re.compile(r"^.*\b(?:%s)-start\(.*$" % "|".join(COLLECTIVE_KINDS), re.MULTILINE)
_ALIASING_RE = re.compile(r",\s*output_to_operand_aliasing=\{(?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*\}")


def _without_frames(text: str) -> str:
    """HLO text XLA's parser takes back: the stack frames it prints refer to a table it does not,
    and the aliasing it prints on async collectives' starts it refuses there (an in-place
    buffer: nothing the cost analysis counts)."""
    text = re.sub(r",?\s*stack_frame_id=\d+", "", text)
    return _ASYNC_START_RE.sub(lambda m: _ALIASING_RE.sub("", m.group(0)), text)


def _generic_cost(text: str) -> dict[str, float]:
    """XLA's generic HloCostAnalysis of an HLO module's text, by the CPU's client (GEMMs are Triton
    fusions in a described GPU's program, whose dots it counts; cuDNN convolutions are library
    calls it does not count: `hlo_stats.library_conv_flops`)."""
    return _cost_dict(hlo_cost_analysis(_without_frames(text), jax.devices("cpu")[0]))


def xla_cost_analysis(compiled: Any) -> dict[str, float]:
    """XLA's cost analysis of a compiled program ('flops', 'bytes accessed', ...): jax's
    `cost_analysis()`, or for a program compiled for described GPUs, for which jax gives None,
    XLA's generic analysis of its optimized HLO, parsed back from its text, with its cuDNN
    convolutions' FLOPs (each once, as XLA counts a loop's body once; the collectives' buffers
    it charges as bytes accessed, as the CPU's does)."""
    if not is_described(program_device(compiled)):
        return _cost_dict(compiled.cost_analysis())
    text = compiled.as_text()
    cost = dict(_generic_cost(text))
    cost["flops"] = cost.get("flops", 0.0) + sum(library_conv_flops(text).values())
    return cost


def _body_cost(module: ComputationRuns, body: str, header: str, device: jax.Device) -> dict[str, float]:
    """XLA's cost analysis of one loop body run once: the module re-parsed with it as ENTRY (by a
    CPU program's own client; a GPU program's by the CPU's, `_generic_cost`)."""
    parts = [header]
    for name, block in module.texts.items():
        if name != module.entry:
            parts.append("ENTRY " + block if name == body else block)
    text = "\n\n".join(parts)
    try:
        if device.platform == "cpu":
            return _cost_dict(hlo_cost_analysis(_without_frames(text), device))
        return _generic_cost(text)
    except UnsupportedJaxError:
        raise
    except Exception as e:  # XLA may reject the re-parsed body: say which and why
        raise RuntimeError(f"cannot price while-loop body {body!r} on its own with this jaxlib "
                           f"({type(e).__name__}: {e})") from e


def program_cost(compiled: Any) -> tuple[float, float, int]:
    """(flops, bytes accessed, loops without a trip count) of one step, per device.

    XLA prices each while body once; with M(c) the runs of computation c per step,
    true = cost(entry) + Σ_loops (M(body) - M(caller)) · cost(body), where cost(x) counts the
    loops nested in x once each (checked on nested loops in the tests). Every branch of a
    conditional counts as taken: an upper bound for loops in branches (XLA's cost analysis takes
    the costliest branch, once).

    A GPU program, real or described, is priced by XLA's generic analysis throughout (a real
    GPU's client runs no analysis of HLO text: "PJRT C API does not support GetHloCostAnalysis",
    seen on an H100 with jax 0.11.2), so both price alike; its cuDNN convolutions, which that
    analysis leaves out, are added at M(c) runs each."""
    text = compiled.as_text()
    device = program_device(compiled)
    generic = device.platform != "cpu"
    whole = _generic_cost(text) if generic else xla_cost_analysis(compiled)
    flops, nbytes = float(whole.get("flops", 0.0)), float(whole.get("bytes accessed", 0.0))
    module = computation_runs(text, every_branch=True)
    if not module.entry:
        raise ValueError("no ENTRY computation in the HLO text; pass compiled.as_text()")
    header = _module_header(text)
    for lp in module.loops:
        extra = module.runs.get(lp.body, 0) - module.runs[lp.parent]
        if extra > 0:
            body = _body_cost(module, lp.body, header, device)
            flops += extra * float(body.get("flops", 0.0))
            nbytes += extra * float(body.get("bytes accessed", 0.0))
    if generic:
        flops += sum(module.runs.get(comp, 0) * f for comp, f in library_conv_flops(text).items())
    return flops, nbytes, sum(lp.trip_count is None for lp in module.loops)




def collective_traffic(stats: CollectiveStats) -> int:
    """Bytes per step the collectives read and write, as XLA's analysis charges them: each
    execution's operands and results. In hlo_stats' terms an all-gather's result and a
    reduce-scatter's operand are its group's size times the other end; the other kinds read
    and write one buffer each. A collective's time is its communication (`price_collectives`):
    charged as memory traffic too, it would be paid twice."""
    total = 0
    for c in stats.collectives:
        scaled = c.kind in ("all-gather", "reduce-scatter") and c.group_size > 0
        total += c.executions * (c.bytes + (c.bytes // c.group_size if scaled else c.bytes))
    return total


_DOT_RE = re.compile(r"%([\w.\-]+)\s*=\s*([a-z][a-z0-9]*)\[([^\]]*)\][^=]*?\s(dot|convolution)\((.*?)\)")
_SHAPE_RE = re.compile(r"%([\w.\-]+)\s*=\s*([a-z][a-z0-9]*)\[([^\]]*)\]")
_HLO_TO_NUMPY = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64",
                 "s8": "int8", "s32": "int32", "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2"}


def dot_dtype(text: str) -> str:
    """The element type of the operands of the largest dot/convolution (by result size × lhs
    size), as a numpy name; float32 when the program has none. On CPU, XLA computes bf16 dots in
    f32, so a bf16 program compiled for CPU reads as float32 here: pass the dtype instead."""
    shapes = {m.group(1): (m.group(2), m.group(3)) for m in _SHAPE_RE.finditer(text)}

    def elems(dims: str) -> int:
        n = 1
        for d in filter(None, (x.strip() for x in dims.split(","))):
            n *= int(d.removeprefix("<="))
        return n

    best, best_size = "f32", -1
    for m in _DOT_RE.finditer(text):
        lhs = _REF_RE.search(m.group(5))
        if lhs is None or lhs.group(1) not in shapes:
            continue
        ltype, ldims = shapes[lhs.group(1)]
        size = elems(m.group(3)) * elems(ldims)
        if size > best_size:
            best, best_size = ltype, size
    return _HLO_TO_NUMPY.get(best, best)


# ------------------------------------------------------------------------------ communication


def _num_partitions(text: str) -> int:
    m = re.search(r"\bnum_partitions=(\d+)", text.split("\n", 1)[0])
    return int(m.group(1)) if m else 1


def price_collectives(stats: CollectiveStats, cluster: Cluster, num_devices: int) -> dict[str, float]:
    """Seconds per step per collective kind: `Collective.time` on a one-axis topology of the
    group's size, over the intra-host link when the group's devices (or a permute's pairs) lie
    in one host, else the inter-host one, shared by the groups that cross a host at once."""
    out = {k: 0.0 for k in COLLECTIVE_KINDS}
    combiner = combiner_for(cluster.backend)
    for c in stats.collectives:
        permute = c.kind == "collective-permute"
        n = 2 if permute else c.group_size
        if n <= 0:
            raise ValueError(f"collective {c.name!r} ({c.kind}) has no readable replica group size; "
                             "cannot price it (see hlo_stats._group_size for the forms understood)")
        per_host = cluster.devices_per_host
        # Device i lies on host i // devices_per_host. A group (its first replica group, or a
        # permute's pairs) crosses the hosts it touches; when the text lists neither, a group is
        # taken as consecutive devices and a permute's pairs as anywhere in the program.
        if permute:
            crosses = any(a // per_host != b // per_host for a, b in c.pairs) if c.pairs else num_devices > per_host
            hosts = 2 if crosses else 1  # pairs across hosts: one per device, all sharing the host's network
        else:
            hosts = len({d // per_host for d in c.group}) if c.group else -(-n // per_host)
        intra = hosts == 1
        topo = MeshTopology(("group",), (n,),
                            (cluster.intra_host_bandwidth if intra else cluster.inter_host_bandwidth,),
                            (cluster.intra_host_latency if intra else cluster.inter_host_latency,),
                            cluster.collective_launch_s, combiner=combiner, hosts_spanned=(hosts,),
                            host_devices=min(num_devices, cluster.devices_per_host))
        # The program is compiled: each op is priced as it stands (family 1, no combining left to
        # predict), once per execution (loop trips, `CompiledCollective.executions`). An
        # all-reduce read only in 1/group slices runs as a reduce-scatter where the backend
        # forms them (a CPU-compiled program priced for a GPU cluster); the rest of a combined
        # one stays an all-reduce.
        parts = [(c.kind, c.bytes)]
        if c.scattered and not combiner.reduce_scatter_as_all_reduce:
            parts = [(k, b) for k, b in (("all-reduce", c.bytes - c.scattered), ("reduce-scatter", c.scattered)) if b]
        for kind, nbytes in parts:
            out[kind] += c.executions * Collective(kind, ("group",), nbytes).time(topo, pairwise=permute)
    return out


# ------------------------------------------------------------------------------ entry point


def price_compiled(compiled: Any, cluster: "Cluster | str | None" = None, dtype: str | None = None) -> CompiledCost:
    """Price a `jax.stages.Compiled` (anything with `as_text`, `cost_analysis`,
    `memory_analysis`) on `cluster` (a `Cluster` or preset name; None: m8-v100).

    `dtype` picks the FLOP rate (`cluster.flops(dtype)`); None reads it from the program: the
    operand type of its largest dot (`dot_dtype`)."""
    cluster = get_cluster(cluster)
    text = compiled.as_text()
    flops, nbytes, unknown = program_cost(compiled)
    dtype = dtype or dot_dtype(text)
    stats = collective_stats(text)
    charged = collective_traffic(stats)  # XLA's analysis (the CPU's, the generic one) charges them
    nbytes = max(0.0, nbytes - charged)
    compute = max(flops / cluster.flops(dtype), nbytes / cluster.memory_bandwidth)
    comm = price_collectives(stats, cluster, _num_partitions(text))
    comm_s = sum(comm.values())
    return CompiledCost(compute_s=compute, comm_s=comm_s, total_s=compute + comm_s, dtype=dtype,
                        flops=flops, bytes_accessed=nbytes, collectives=stats.by_kind(),
                        comm_by_kind=comm, memory=compiled_memory(compiled), unknown_trip_loops=unknown,
                        collective_bytes=charged)

