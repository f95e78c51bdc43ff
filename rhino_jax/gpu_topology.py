"""Described GPU clusters: devices that XLA's GPU compiler compiles for on a machine with no GPU.

A plan is made for GPUs (every cluster preset is one), but the CPU compiler makes other programs
of it: no reduce-scatter, no all-gather combining, bf16 collectives sent as f32. jax's CUDA plugin
compiles for GPUs it is only told about (`jax.experimental.topologies.get_topology_desc` with an
XLA `GpuTargetConfigProto`), so a plan can be searched, lowered, compiled and priced for the
program a GPU cluster would run, here. Such devices cannot run anything: a step compiled for them
is saved as a plan and run on the cluster (`refuse_described`).

Each target description is a list of the device's published figures (NVIDIA's datasheets and
CUDA's per-architecture limits), written in the proto's text format; where a figure is what the
CUDA runtime reports of a real device (memory size, the H200's L2), the reading is named.
Autotuning needs a device, so a described compile keeps XLA's default kernel choices.
"""
from __future__ import annotations

import importlib.metadata
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh

from rhino_jax.search.cost.cluster import Cluster, get_cluster, is_described

from .errors import GpuPluginError, MeshError, RhinoError


class DescribedDeviceError(RhinoError, RuntimeError):
    """A step compiled for described GPUs (`rj.gpu_topology`) was called: they run nothing."""


@dataclass(frozen=True)
class GpuSpec:
    """One GPU's figures as XLA's GpuDeviceInfoProto names them (bytes, Hz, counts)."""

    name: str  # the CUDA device name, which jax gives as `device_kind`
    compute_capability: tuple[int, int]
    sm_count: int
    fp32_cores_per_sm: int
    boost_clock_ghz: float
    memory_bytes: int
    memory_bandwidth: int  # bytes/s: 2 (DDR) x memory clock x bus width in bytes
    l2_bytes: int
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int
    # CUDA's limits common to compute capability 8.0 and 9.0
    shared_memory_per_block: int = 48 << 10
    threads_per_block: int = 1024
    threads_per_sm: int = 2048
    registers_per_sm: int = 64 << 10
    registers_per_block: int = 64 << 10

    def target_config(self) -> str:
        """The `GpuTargetConfigProto` text XLA's GPU compiler takes (`target_config=`). CUDA 12.8
        and cuDNN 9.10: what jax's CUDA 12 plugin is built for (it needs cuDNN 9.10 or newer)."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: {self.threads_per_block}
  threads_per_warp: 32
  shared_memory_per_block: {self.shared_memory_per_block}
  shared_memory_per_core: {self.shared_memory_per_sm}
  threads_per_core_limit: {self.threads_per_sm}
  core_count: {self.sm_count}
  fpus_per_core: {self.fp32_cores_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {self.memory_bandwidth}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.boost_clock_ghz}
  device_memory_size: {self.memory_bytes}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: {self.registers_per_sm}
  registers_per_block_limit: {self.registers_per_block}
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
runtime_version {{ major: 12 minor: 8 patch: 0 }}
device_description_str: "{self.name}"
"""


# H100 SXM5 80 GB: 132 SMs of 128 FP32 cores, 1.98 GHz boost, HBM3 at 2619 MHz on 5120 bits
# (3.35 TB/s), 50 MB L2, 228 KB shared memory per SM (227 KB for one block); 85,017,493,504
# bytes as the CUDA runtime reports the card to XLA (benchmarks/results/gpu.md: the device's own
# description, dumped by XLA on an H100, agrees with this one on every other field written here).
H100_SXM = GpuSpec("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 1.98, 85_017_493_504, 2 * 2_619_000_000 * 640,
                   50 << 20, 228 << 10, 227 << 10)
# H200 SXM 141 GB: the H100's SMs and clocks, HBM3e at 3201 MHz (4.8 TB/s on the datasheet), a
# 60 MB L2; memory size and bandwidth as XLA read them on an H200 (benchmarks/results/h200/gpu.md: the
# device's own description, which agrees with this one on every other field written here).
H200_SXM = GpuSpec("NVIDIA H200", (9, 0), 132, 128, 1.98, 150_109_880_320, 4_814_304_000_000, 60 << 20,
                   228 << 10, 227 << 10)
# A100 SXM4 80 GB: 108 SMs of 64 FP32 cores, 1.41 GHz boost, HBM2e at 1593 MHz on 5120 bits
# (2.04 TB/s), 40 MB L2, 164 KB shared memory per SM (163 KB for one block); 81,251 MiB reported.
A100_SXM = GpuSpec("NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 1.41, 81_251 << 20, 2 * 1_593_000_000 * 640,
                   40 << 20, 164 << 10, 163 << 10)

GPUS = {"h100": H100_SXM, "h200": H200_SXM, "a100": A100_SXM}


def _plugin_hint() -> str:
    version = importlib.metadata.version("jaxlib")
    return (f"pip install jax-cuda12-plugin=={version} jax-cuda12-pjrt=={version} (the version of the installed "
            "jaxlib; no GPU or CUDA toolkit needed), and set JAX_PLATFORMS=cpu on a machine without a GPU")


def gpu_topology(kind: str = "h100", hosts: int = 1, devices_per_host: int = 8) -> list[jax.Device]:
    """The devices of `hosts` described hosts of `devices_per_host` GPUs of `kind` ("h100",
    "h200", "a100"), host by host: device i lies on host (process index) i // devices_per_host.

    Plan, lower and compile for them on any machine (jax's CUDA plugin compiles without a GPU):
    `rj.device_mesh((2, 8), ("data", "model"), devices=rj.gpu_topology("h100", hosts=2))`. The
    plan is priced for the matching cluster preset unless `cluster=` says otherwise. They run
    nothing: save the plan and run it on the cluster (`rj.parallelize(..., plan="plan.json")`)."""
    spec = GPUS.get(str(kind).lower())
    if spec is None:
        raise ValueError(f"unknown GPU kind {kind!r}; described GPUs are {sorted(GPUS)}")
    for name, value in (("hosts", hosts), ("devices_per_host", devices_per_host)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"gpu_topology's {name} must be a positive int, got {value!r}")
    from jax.experimental import topologies  # noqa: PLC0415 (only for described devices)

    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=spec.target_config(),
                                                topology=f"1x{hosts}x{devices_per_host}")
    except Exception as e:  # no CUDA plugin, or one of another version than jaxlib
        said = str(e).strip().splitlines()[:1]  # the cause in one line, before what to do
        raise GpuPluginError(f"jax cannot describe {kind} GPUs here ({': '.join([type(e).__name__, *said])}); "
                             f"{_plugin_hint()}") from e
    return sorted(topology.devices, key=lambda d: (d.process_index, d.id))


def described_mesh(mesh: AbstractMesh, cluster: "Cluster | str | None") -> Mesh:
    """The Mesh of described GPUs an AbstractMesh is planned on: the cluster's GPU kind
    (`Cluster.gpu`), in hosts of its `devices_per_host`, with the AbstractMesh's shape, axis names
    and axis types. An AbstractMesh names no devices, so the cluster says what they are; the
    plan then loads on a real cluster of that shape (`Plan.check_matches`)."""
    if cluster is None:
        raise MeshError(f"an AbstractMesh ({dict(mesh.shape_tuple)}) names no devices: pass the cluster it stands for, "
                        "e.g. cluster='8x-h100', and the plan is made for described GPUs of that kind")
    c = get_cluster(cluster)
    if c.gpu not in GPUS:
        raise MeshError(f"an AbstractMesh is planned on described GPUs, and cluster {c.name!r} names none "
                        f"(Cluster.gpu={c.gpu!r}; described kinds: {sorted(GPUS)}): pass a preset such as "
                        "cluster='8x-h100', or devices=rj.gpu_topology(kind, hosts=...) in a Mesh")
    per_host = min(c.devices_per_host, mesh.size)
    if mesh.size % per_host:
        raise MeshError(f"an AbstractMesh of {mesh.size} devices does not fill hosts of {per_host} "
                        f"(cluster {c.name!r}): make its size a multiple of {per_host}")
    devices = gpu_topology(c.gpu, hosts=mesh.size // per_host, devices_per_host=per_host)
    return Mesh(np.array(devices).reshape(mesh.axis_sizes), mesh.axis_names, axis_types=mesh.axis_types)


def refuse_described(devices: Sequence[jax.Device] | Mesh | None) -> None:
    """Raise DescribedDeviceError, saying how to run the step, when `devices` are described."""
    if isinstance(devices, Mesh):
        devices = list(devices.devices.flat)
    first = next(iter(devices or ()), None)
    if first is not None and is_described(first):
        raise DescribedDeviceError(
            f"this step was compiled for described devices ({len(devices)} x {first.device_kind}, rj.gpu_topology), "
            "which run nothing on this machine: save the plan (lowered.plan.save('plan.json')), then on the cluster "
            "run rj.parallelize(step, mesh=rj.device_mesh(<same shape and axis names>), plan='plan.json')")
