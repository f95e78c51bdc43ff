"""Cluster description: what a device computes and how fast its links are.

The α-β model needs, per mesh axis, the bandwidth and latency of the slowest link its groups
cross: an axis whose groups stay inside one host uses the intra-host link (NVLink), otherwise the
inter-host network, whose bandwidth a host's concurrent groups share. `MeshTopology` works that
out from the devices' host placement.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.sharding import Mesh


# XLA's combiners merge independent collectives of one kind over the same device groups into one
# op, up to a byte and a count threshold (xla/service/collective_utils.h and the GPU compiler's
# pipeline: 30 MiB + 7 bytes and 256 ops for all-reduce, all-gather and reduce-scatter; flags
# --xla_gpu_{all_reduce,all_gather,reduce_scatter}_combine_threshold_bytes override the bytes).
# The CPU compiler combines all-reduces only, whatever their size (256 at most: measured with
# jax 0.10.2), and its SPMD partitioner writes a reduce-scatter as an all-reduce plus a slice.
_GPU_COMBINE_BYTES = 30 * 1024 * 1024 + 7
_GPU_FLAGS = {"all-reduce": "xla_gpu_all_reduce_combine_threshold_bytes",
              "all-gather": "xla_gpu_all_gather_combine_threshold_bytes",
              "reduce-scatter": "xla_gpu_reduce_scatter_combine_threshold_bytes"}
BACKENDS = ("gpu", "cpu")


@dataclass(frozen=True)
class Combiner:
    """What one backend's XLA pipeline does to the collectives the SPMD partitioner emits: which
    kinds it combines (bytes and count thresholds; 0 bytes: never combined) and whether a
    reduce-scatter runs as an all-reduce of the whole buffer (CPU)."""

    backend: str = "gpu"
    threshold_bytes: tuple[tuple[str, int], ...] = ()
    threshold_count: int = 256
    reduce_scatter_as_all_reduce: bool = False
    # XLA GPU's all-reduce reassociation: a sum of all-reduces runs as one all-reduce of the sum
    # (a global norm's per-gradient partial sums are one op); the CPU pipeline keeps them apart.
    reassociates: bool = True
    # XLA GPU runs a combined all-reduce on one contiguous buffer: a kernel concatenates its
    # members into it and a kernel per member slices each out of the result (measured on
    # described H100s: a data-parallel step's 40 gradients, one all-reduce per element type, ran
    # 2 concatenations and 40 slices, 76 µs of launches in a 0.87 ms step). The other kinds, and
    # the CPU's all-reduces, combine into tuples of their members' buffers.
    contiguous_all_reduce: bool = False

    def compiled_kind(self, kind: str) -> str:
        return "all-reduce" if kind == "reduce-scatter" and self.reduce_scatter_as_all_reduce else kind

    def limit(self, kind: str) -> int:
        """Byte threshold of the combiner of this (compiled) kind; 0 when it is not combined."""
        return dict(self.threshold_bytes).get(kind, 0)

    def counted(self, kind: str, nbytes: int, group: int) -> int:
        """The bytes of a collective (`nbytes` in the compiled collectives' convention, over `group`
        devices) that its combiner adds up against the threshold: XLA counts each op's result,
        which for a reduce-scatter is its operand / group (measured on GPU: 53 gradients of an FSDP step,
        56.4 MiB of operands, 7.0 MiB of results, are one op at the 30 MiB default and two at a
        4 MiB threshold)."""
        return nbytes // max(group, 1) if self.compiled_kind(kind) == "reduce-scatter" else nbytes

    def keyed_by_dtype(self, kind: str) -> bool:
        """XLA's all-reduce and reduce-scatter combiners combine only ops of one element type
        (their key holds it: a bf16 step's f32 LayerNorm gradients are an op of their own); the
        all-gather combiner mixes types."""
        return self.compiled_kind(kind) in ("all-reduce", "reduce-scatter")

    def latency_share(self, kind: str, nbytes: int, group: int) -> float:
        """The share of one launch and its latency a collective pays when XLA combines it with
        others: each op of the byte threshold pays one. (The first op of a family is paid once by
        the ILP's family variable, `ilp.Problem.fixed`; the plan counts the ops exactly.)"""
        limit = self.limit(self.compiled_kind(kind))
        return min(1.0, self.counted(kind, nbytes, group) / limit) if limit else 1.0


def _flag_value(name: str) -> int | None:
    found = re.findall(rf"--{name}=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(found[-1]) if found else None


def combiner_for(backend: str) -> Combiner:
    """The combiner of an XLA backend, with XLA's default thresholds and the user's XLA_FLAGS."""
    if backend == "gpu":
        limits = {k: _flag_value(flag) for k, flag in _GPU_FLAGS.items()}
        return Combiner("gpu", tuple((k, _GPU_COMBINE_BYTES if v is None else v) for k, v in limits.items()),
                        contiguous_all_reduce=True)
    if backend == "cpu":
        return Combiner("cpu", (("all-reduce", 1 << 62),), reduce_scatter_as_all_reduce=True, reassociates=False)
    raise ValueError(f"unknown XLA backend {backend!r}; choose one of {BACKENDS}")


@dataclass(frozen=True)
class Cluster:
    name: str
    devices_per_host: int
    intra_host_bandwidth: float  # bytes/s one device can push to peers in its host (one direction)
    intra_host_latency: float  # s per collective step
    # bytes/s one host's network (all its NICs) moves to other hosts. The groups of a collective
    # that cross hosts share it: on a (2 hosts, 8) mesh, the 8 groups of the outer axis each get
    # 1/8 (`MeshTopology.link`), a ring over all 16 devices gets all of it.
    inter_host_bandwidth: float
    inter_host_latency: float
    # Fixed cost of one collective whatever its size (kernel launch, group synchronisation):
    # it is what makes one all-reduce cheaper than a reduce-scatter plus an all-gather.
    collective_launch_s: float = 10e-6
    # Fixed cost of one compute kernel beyond its roofline (launch, or a command buffer's node):
    # what the referee (`compiled_cost.price_compiled`) charges per kernel a compiled step runs,
    # and the search per kernel it counts once XLA has fused the step (`kernel_launches`).
    # 0 where not measured.
    kernel_launch_s: float = 0.0
    flops_per_s: dict[str, float] = field(default_factory=dict)  # achievable, by dtype
    memory_bandwidth: float = 1e12  # bytes/s, bounds memory-bound ops
    memory_per_device: int = 32 << 30
    host_to_device_bandwidth: float = 12e9  # bytes/s per device (PCIe), to feed each batch
    backend: str = "gpu"  # the XLA backend that compiles for it: how collectives are combined
    # Compute/communication overlap: the share of the collectives off the compute chain (a
    # parameter's all-gather, issued ahead of the layer that reads it; a gradient's reduction,
    # trailing behind the layers still to differentiate: `combining.combining_sides`) that run
    # behind compute, as XLA GPU's latency-hiding scheduler (on by default) runs them. 1 on the
    # GPU presets; 0: none, every collective waited for where it is made. A collective on the
    # chain (an activation's, between its producer and its reader) is always waited for. Never
    # more than the step's compute is hidden (`search.planner`).
    overlap: float = 0.0
    # How many hosts the preset describes (None: as many as the devices used need). A mesh with
    # more devices than hosts * devices_per_host does not fit it (`MeshTopology.from_mesh`).
    hosts: int | None = None
    # The GPU kind `rj.gpu_topology` describes for this cluster ("h100", "h200", "a100"): what an
    # AbstractMesh is planned on (`gpu_topology.described_mesh`); "" where none is (V100s, a
    # cluster of the user's).
    gpu: str = ""

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"Cluster.backend must be one of {BACKENDS}, got {self.backend!r}")
        positive = ("intra_host_bandwidth", "inter_host_bandwidth", "memory_bandwidth", "host_to_device_bandwidth",
                    "memory_per_device")
        for name in positive + ("intra_host_latency", "inter_host_latency", "collective_launch_s", "kernel_launch_s"):
            value = getattr(self, name)
            number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            if not number or value < 0 or (value == 0 and name in positive):
                must = "a positive" if name in positive else "a non-negative"
                raise ValueError(f"Cluster.{name} must be {must} finite number, got {value!r}")
        if isinstance(self.devices_per_host, bool) or not isinstance(self.devices_per_host, int) \
                or self.devices_per_host < 1:
            raise ValueError(f"Cluster.devices_per_host must be an int >= 1, got {self.devices_per_host!r}")
        if self.hosts is not None and (isinstance(self.hosts, bool) or not isinstance(self.hosts, int) or self.hosts < 1):
            raise ValueError(f"Cluster.hosts must be None or an int >= 1, got {self.hosts!r}")
        bad = {k: v for k, v in self.flops_per_s.items() if isinstance(v, bool) or not isinstance(v, (int, float))
               or not 0 < v < float("inf")}
        if bad:
            raise ValueError(f"Cluster.flops_per_s must map dtypes to positive FLOP/s, got {bad}")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"Cluster.overlap is a share of communication time, in [0, 1]; got {self.overlap!r}")
        if self.overlap and self.backend != "gpu":
            raise ValueError(f"Cluster.overlap={self.overlap} needs backend='gpu': the {self.backend} backend "
                             "runs collectives in line with compute")

    def flops(self, dtype: str) -> float:
        return self.flops_per_s.get(dtype, self.flops_per_s.get("float32", 1e13))


# Rhino §7.1 platform M8: 8×V100-SXM2-32GB with NVLink2 per host, one 100 Gb/s RoCE NIC per host,
# FP32 training. NVLink2 ring bandwidth ~130 GB/s per GPU; 15.7 TFLOP/s FP32 peak, ~80% reachable.
M8_V100 = Cluster(
    name="m8-v100", devices_per_host=8,
    intra_host_bandwidth=130e9, intra_host_latency=1e-6,
    inter_host_bandwidth=12.5e9, inter_host_latency=20e-6, collective_launch_s=10e-6,
    flops_per_s={"float32": 12.5e12, "float16": 100e12, "bfloat16": 12.5e12},
    memory_bandwidth=900e9, memory_per_device=32 << 30, host_to_device_bandwidth=12e9,  # PCIe 3 x16
)

# One DGX/HGX H100 host: NVLink4 (450 GB/s per direction per GPU, ~370 GB/s achieved in rings),
# 8×400 Gb/s InfiniBand, one NIC per GPU (50 GB/s each, ~45 GB/s achieved: 360 GB/s per host) to
# other hosts. TF32 for float32 matmuls. A kernel costs 1.85 µs beyond its roofline, as chains of
# tiny kernels took on an H200 (the same chip; benchmarks/results/h200/gpu.md, part 3).
H100_8X = Cluster(
    name="8x-h100", devices_per_host=8,
    intra_host_bandwidth=370e9, intra_host_latency=0.7e-6,
    inter_host_bandwidth=8 * 45e9, inter_host_latency=10e-6, collective_launch_s=6e-6, kernel_launch_s=1.85e-6,
    flops_per_s={"float32": 400e12, "bfloat16": 750e12, "float16": 750e12},
    memory_bandwidth=3.0e12, memory_per_device=80 << 30, host_to_device_bandwidth=50e9,  # PCIe 5 x16
    overlap=1.0, gpu="h100",
)

# One HGX H200 host: the H100's chip, links and network, HBM3e (4.8 TB/s, 4.3 TB/s measured in a
# device-to-device copy) and 141 GB.
H200_8X = dataclasses.replace(H100_8X, name="8x-h200", memory_bandwidth=4.3e12, memory_per_device=140 << 30,
                              gpu="h200")

# One DGX/HGX A100 80 GB host: NVLink3 (300 GB/s per direction per GPU, ~240 achieved in rings),
# 8x200 Gb/s HDR InfiniBand (25 GB/s per GPU, ~22.5 achieved), TF32 156 and bf16 312 TFLOP/s
# dense at ~80 %, HBM2e 2.04 TB/s at ~90 %, PCIe 4 x16.
A100_8X = Cluster(
    name="8x-a100", devices_per_host=8,
    intra_host_bandwidth=240e9, intra_host_latency=0.8e-6,
    inter_host_bandwidth=8 * 22.5e9, inter_host_latency=10e-6, collective_launch_s=8e-6,
    flops_per_s={"float32": 125e12, "bfloat16": 250e12, "float16": 250e12},
    memory_bandwidth=1.83e12, memory_per_device=80 << 30, host_to_device_bandwidth=25e9, overlap=1.0,
    gpu="a100",
)


def _hosts(cluster: Cluster, n: int) -> Cluster:
    return dataclasses.replace(cluster, name=f"{cluster.name}-{n}hosts", hosts=n)


# Rhino §7.2 runs GPT and MoE on 2 M8 hosts (16 GPUs); 4 hosts and the H100 twins are the same
# machines, more of them.
PRESETS = {c.name: c for c in (M8_V100, H100_8X, H200_8X, A100_8X,
                                *(_hosts(c, n) for c in (M8_V100, H100_8X) for n in (2, 4)))}
# The preset of a GPU by the name jax gives it (`device_kind`, e.g. "NVIDIA H100 80GB HBM3").
_PRESET_OF_KIND = (("H100", H100_8X), ("H200", H200_8X), ("A100", A100_8X))


def get_cluster(cluster: "Cluster | str | None", devices: Sequence = ()) -> Cluster:
    """The cluster to price for: `cluster` as given, or with None the preset of the GPUs
    `devices` are (H100, H200, A100, real or described), else M8 (V100s)."""
    if cluster is None:
        kind = getattr(next(iter(devices), None), "device_kind", "")
        return next((preset for key, preset in _PRESET_OF_KIND if key in kind), M8_V100)
    if isinstance(cluster, Cluster):
        return cluster
    if cluster in PRESETS:
        return PRESETS[cluster]
    raise ValueError(f"unknown cluster preset {cluster!r}; choose one of {sorted(PRESETS)} "
                     "or pass a rhino_jax.Cluster(...)")


def is_described(device) -> bool:
    """A device that XLA compiles for but that runs nothing (`rj.gpu_topology`): its hosts are
    the processes its topology names."""
    return getattr(device.client, "runtime_type", "") == "compile_only_runtime"


def host_ids(devices: Sequence, devices_per_host: int) -> list[int]:
    """The host of each device: its process where processes stand for hosts (a multi-process run,
    jax.distributed running a process per host; a described topology), else its position among
    its backend's devices divided by the cluster's devices per host (one process standing for
    several hosts, as 8 emulated CPU devices do for a preset's)."""
    if jax.process_count() > 1 or (devices and is_described(devices[0])):
        return [d.process_index for d in devices]
    order = {d.id: i for i, d in enumerate(jax.devices(devices[0].platform))} if devices else {}
    return [order[d.id] // devices_per_host for d in devices]


@dataclass(frozen=True)
class MeshTopology:
    """The mesh as the cost model sees it: axis sizes and each axis's link."""

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    bandwidth: tuple[float, ...]  # per axis: its link's bytes/s (across hosts: a host's, shared)
    latency: tuple[float, ...]
    launch: float = 0.0  # the cluster's collective_launch_s
    combiner: Combiner = field(default_factory=lambda: combiner_for("gpu"))
    overlap: float = 0.0  # the cluster's overlap
    # Per axis, how many hosts one group along it touches (1: inside a host; empty: all 1), and
    # how many of the mesh's devices one host holds: together they say how many groups share a
    # host's network when a collective crosses hosts.
    hosts_spanned: tuple[int, ...] = ()
    host_devices: int = 0
    memory_bandwidth: float = 1e12  # the cluster's: what a copy XLA adds around a collective costs
    kernel_launch_s: float = 0.0  # the cluster's: what each kernel XLA adds around a collective costs

    def exposed(self, off_chain: bool) -> float:
        """The share of a collective's time the step waits for: off the chain, what overlap leaves."""
        return 1.0 - self.overlap if off_chain else 1.0

    def without_overlap(self) -> "MeshTopology":
        """This mesh with nothing hidden: the key of what does not depend on what overlap hides."""
        return dataclasses.replace(self, overlap=0.0)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.axis_sizes))

    @property
    def num_devices(self) -> int:
        return int(np.prod(self.axis_sizes))

    def link(self, axes: tuple[str, ...], pairwise: bool = False) -> tuple[int, float, float]:
        """(group size, bandwidth, latency) of a collective over these axes: the slowest link
        wins, and a host's network is shared by the groups that cross it at once (a host holding
        8 of the mesh's devices and 1 member of each group runs 8 groups through its NICs).
        `pairwise`: each device sends to one peer across hosts (a collective-permute whose pairs
        cross, as compiled pricing reads them), so every device of a host crosses at once."""
        idx = [self.axis_names.index(a) for a in axes]
        n = int(math.prod(self.axis_sizes[i] for i in idx))  # math, not numpy: called per priced move
        bw = min(self.bandwidth[i] for i in idx)
        spanned = int(math.prod(self.hosts_spanned[i] for i in idx)) if self.hosts_spanned else 1
        if spanned > 1 and self.host_devices:
            groups_per_host = self.host_devices if pairwise else max(1.0, self.host_devices * spanned / n)
            bw = min(min(self.bandwidth[i] for i in idx if self.hosts_spanned[i] > 1) / groups_per_host,
                     min((self.bandwidth[i] for i in idx if self.hosts_spanned[i] == 1), default=np.inf))
        return n, bw, max(self.latency[i] for i in idx)

    @staticmethod
    def from_mesh(mesh: Mesh, cluster: Cluster) -> "MeshTopology":
        devices = mesh.devices
        host = np.array(host_ids(list(devices.flat), cluster.devices_per_host)).reshape(devices.shape)
        hosts = len(np.unique(host))
        if cluster.hosts is not None and hosts > cluster.hosts:
            raise ValueError(f"the mesh's {devices.size} devices lie on {hosts} hosts of "
                             f"{cluster.devices_per_host}, but cluster {cluster.name!r} has {cluster.hosts}: "
                             "use a preset with more hosts or a smaller mesh")
        bws, lats, spanned = [], [], []
        for ax in range(devices.ndim):
            lines = np.moveaxis(host, ax, -1).reshape(-1, devices.shape[ax])  # the groups along `ax`
            spanned.append(max(len(set(line.tolist())) for line in lines))
            same_host = spanned[-1] == 1
            bws.append(cluster.intra_host_bandwidth if same_host else cluster.inter_host_bandwidth)
            lats.append(cluster.intra_host_latency if same_host else cluster.inter_host_latency)
        return MeshTopology(tuple(mesh.axis_names), tuple(devices.shape), tuple(bws), tuple(lats),
                            cluster.collective_launch_s, combiner_for(cluster.backend), cluster.overlap,
                            tuple(spanned), int(devices.size // hosts), cluster.memory_bandwidth,
                            cluster.kernel_launch_s)
