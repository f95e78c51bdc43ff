"""Price a compiled program: the step time a cluster would take to run exactly what XLA compiled.

The cost model predicts a plan's time from shardings; this module prices the compiled HLO of any
program (rhino_jax's or a hand plan compiled by plain `jax.jit`) the same way, so that plans
compare on what XLA really built:

- compute: every kernel of the per-device program (a fusion, a library call, a copy) at its own
  roofline, max(flops / F(dtype), bytes accessed / memory bandwidth), summed
  (`kernels.program_kernels`: XLA's generic cost analysis of each kernel on its own, cuDNN
  convolutions' FLOPs added, each kernel counted as often as its computation runs per step, so a
  `scan` over layers costs all of its layers). Collectives are not kernels: communication prices
  them. (One roofline over the program's totals would let memory-bound kernels hide under
  compute-bound ones: a ZeRO plan's sharded optimizer update would save nothing.)
- communication: every compiled collective (`collectives.collective_stats`, once per execution:
  loop trips counted) at the α-β ring cost of `search.collectives.Collective.time`, on a one-axis
  topology of its group size and link. For a GPU cluster, an all-reduce whose result is only read
  in 1/group slices is priced as the reduce-scatter GPU XLA makes of it
  (`CompiledCollective.scattered`); the CPU compiler keeps the pair.

- overlap: the scheduled program replayed on a compute stream and a collective stream
  (`timeline`: each async collective runs from its start to its done under the kernels XLA
  placed between them), with the same prices per kernel and per collective. `total_s` stays the
  serial sum; `overlapped_s` is the replayed step, `exposed_comm_s` its communication not hidden.

Pricing a CPU-compiled program for a GPU cluster inherits the CPU compiler's choices (e.g. bf16
dots are computed in f32 and fusions differ), the same for every plan priced.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import jax

from rhino_jax.search.cost.cluster import Cluster, MeshTopology, combiner_for, get_cluster, is_described
from rhino_jax.search.cost.collectives import Collective

from rhino_jax.hlo_passes.jax_internals import hlo_cost_analysis

from .collectives import COLLECTIVE_KINDS, CollectiveStats, CompiledCollective, collective_stats
from .hlo_text import _REF_RE
from .kernels import Kernel, library_flops, parseable, program_kernels
from .memory import CompiledMemory, compiled_memory
from .timeline import CollectiveExposure, Timeline, timeline

__all__ = ["CompiledCost", "price_compiled", "price_collectives", "collective_seconds", "replay", "program_device",
           "dot_dtype", "xla_cost_analysis"]


@dataclass(frozen=True)
class CompiledCost:
    """Per-device time of one step of a compiled program on a cluster: `total_s` with no
    compute/comm overlap, `overlapped_s` as XLA's schedule overlaps them."""

    compute_s: float
    comm_s: float
    total_s: float
    dtype: str  # the FLOP rate's dtype (`price_compiled` says how it is chosen)
    flops: float  # per device, loop bodies counted per trip
    bytes_accessed: float  # by the kernels (collectives' buffers are communication)
    collectives: dict[str, tuple[int, int]]  # kind -> (count, bytes per device), as `collectives` counts
    comm_by_kind: dict[str, float]  # kind -> seconds
    memory: CompiledMemory
    unknown_trip_loops: int = 0  # while loops XLA gave no trip count: their bodies are priced once
    kernels: int = 0  # distinct kernel instructions priced
    kernel_runs: int = 0  # kernels run per step (loop bodies' per trip), each charged the cluster's kernel_launch_s
    overlapped_s: float = 0.0  # the step replayed on a compute and a collective stream (`timeline.Timeline.step_s`)
    exposed_comm_s: float = 0.0  # of overlapped_s, the time compute waited on collectives
    exposure: tuple[CollectiveExposure, ...] = ()  # per collective instruction, the most exposed first

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["memory"] = dict(self.memory.__dict__, total=self.memory.total)
        d["exposure"] = [dict(c.__dict__) for c in self.exposure]
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


def _generic_cost(text: str) -> dict[str, float]:
    """XLA's generic HloCostAnalysis of an HLO module's text, by the CPU's client (it counts the
    dots of Triton GEMM fusions, not library calls: cuDNN convolutions and cuBLAS GEMMs,
    `kernels.library_flops`)."""
    return _cost_dict(hlo_cost_analysis(parseable(text), jax.devices("cpu")[0]))


def xla_cost_analysis(compiled: Any) -> dict[str, float]:
    """XLA's cost analysis of a compiled program ('flops', 'bytes accessed', ...): jax's
    `cost_analysis()`, or for a program compiled for described GPUs, for which jax gives None,
    XLA's generic analysis of its optimized HLO, parsed back from its text, with its library
    calls' FLOPs (each once, as XLA counts a loop's body once; the collectives' buffers
    it charges as bytes accessed, as the CPU's does)."""
    if not is_described(program_device(compiled)):
        return _cost_dict(compiled.cost_analysis())
    text = compiled.as_text()
    cost = dict(_generic_cost(text))
    cost["flops"] = cost.get("flops", 0.0) + sum(library_flops(text).values())
    return cost


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


def collective_seconds(c: CompiledCollective, cluster: Cluster, num_devices: int) -> dict[str, float]:
    """Seconds of one execution of `c`, by the kind it runs as: `Collective.time` on a one-axis
    topology of the group's size, over the intra-host link when the group's devices (or a
    permute's pairs) lie in one host, else the inter-host one, shared by the groups that cross a
    host at once."""
    permute = c.kind == "collective-permute"
    n = 2 if permute else c.group_size
    if n <= 0:
        raise ValueError(f"collective {c.name!r} ({c.kind}) has no readable replica group size; "
                         "cannot price it (see groups._group_size for the forms understood)")
    combiner = combiner_for(cluster.backend)
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
    # predict). An all-reduce read only in 1/group slices runs as a reduce-scatter where the
    # backend forms them (a CPU-compiled program priced for a GPU cluster); the rest of a
    # combined one stays an all-reduce.
    parts = [(c.kind, c.bytes)]
    if c.scattered and not combiner.reduce_scatter_as_all_reduce:
        parts = [(k, b) for k, b in (("all-reduce", c.bytes - c.scattered), ("reduce-scatter", c.scattered)) if b]
    out: dict[str, float] = {}
    for kind, nbytes in parts:
        out[kind] = out.get(kind, 0.0) + Collective(kind, ("group",), nbytes).time(topo, pairwise=permute)
    return out


def price_collectives(stats: CollectiveStats, cluster: Cluster, num_devices: int) -> dict[str, float]:
    """Seconds per step per collective kind: each collective at `collective_seconds`, once per
    execution (loop trips, `CompiledCollective.executions`)."""
    out = {k: 0.0 for k in COLLECTIVE_KINDS}
    for c in stats.collectives:
        for kind, seconds in collective_seconds(c, cluster, num_devices).items():
            out[kind] += c.executions * seconds
    return out


def replay(text: str, kernels: tuple[Kernel, ...], stats: CollectiveStats, cluster: Cluster, dtype: str) -> Timeline:
    """The program `text` replayed on a compute and a collective stream (`timeline.timeline`) at
    the prices `price_compiled` sums: each kernel run at its roofline plus `kernel_launch_s`,
    each collective execution at `collective_seconds`."""
    devices = _num_partitions(text)
    rate, bandwidth = cluster.flops(dtype), cluster.memory_bandwidth
    return timeline(text, {k.name: k.run_seconds(rate, bandwidth) + cluster.kernel_launch_s for k in kernels},
                    {c.name: sum(collective_seconds(c, cluster, devices).values()) for c in stats.collectives})


# ------------------------------------------------------------------------------ entry point


def price_compiled(compiled: Any, cluster: "Cluster | str | None" = None, dtype: str | None = None) -> CompiledCost:
    """Price a `jax.stages.Compiled` (anything with `as_text` and `memory_analysis`) on `cluster` (a `Cluster` or preset name; None: m8-v100).

    Compute is each kernel at its own roofline (`kernels.Kernel.seconds`) plus the cluster's
    `kernel_launch_s` per kernel run; the overlapped step replays those kernels and collectives
    in the program's schedule (`replay`). `dtype` picks the FLOP rate (`cluster.flops(dtype)`); None
    reads it from the program: the operand type of its largest dot (`dot_dtype`)."""
    cluster = get_cluster(cluster)
    text = compiled.as_text()
    dtype = dtype or dot_dtype(text)
    kernels, module = program_kernels(text)
    runs = sum(k.runs for k in kernels)
    compute = sum(k.seconds(cluster.flops(dtype), cluster.memory_bandwidth) for k in kernels) \
        + runs * cluster.kernel_launch_s
    stats = collective_stats(text)
    comm = price_collectives(stats, cluster, _num_partitions(text))
    comm_s = sum(comm.values())
    replayed = replay(text, kernels, stats, cluster, dtype)
    return CompiledCost(compute_s=compute, comm_s=comm_s, total_s=compute + comm_s, dtype=dtype,
                        flops=sum(k.runs * k.flops for k in kernels),
                        bytes_accessed=sum(k.runs * k.bytes_accessed for k in kernels),
                        collectives=stats.by_kind(), comm_by_kind=comm, memory=compiled_memory(compiled),
                        unknown_trip_loops=sum(lp.trip_count is None for lp in module.loops), kernels=len(kernels),
                        kernel_runs=runs, overlapped_s=replayed.step_s, exposed_comm_s=replayed.exposed_comm_s,
                        exposure=replayed.collectives)
