"""`python -m benchmarks.run`'s matrix: its targets (a mesh of one compiler's devices, and the
cluster its plans are searched for), the memory-limited method of the tiny presets, the paper-size
presets with why each is sized as it is, and the strong-scaling batch. `benchmarks/run.py`'s
docstring says what the matrix measures and what a run of it costs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import rhino_jax as rj
from benchmarks import compilers
from rhino_jax.search.cost.cluster import get_cluster

M8, H100 = rj.M8_V100, rj.H100_8X


# Tiny presets only: O2 under `sharding_memory_limit`, so that agreement with one device checks a
# sharded plan (unlimited, the search replicates a tiny model: the right plan, and a vacuous check).
LIMITED = "rhino_jax O2, memory-limited"


@dataclass(frozen=True)
class Target:
    """A mesh of one compiler's devices and the cluster its plans are searched for. cpu: XLA's CPU
    compiler on the emulated devices, m8-v100 (the plan's collectives predicted as the CPU combines
    them, to compare with what is compiled); gpu: XLA's GPU compiler for described H100s
    (`rj.gpu_topology`, `hosts` of 8), the H100 presets as they are, every program also priced
    from its compiled HLO (`compiled_cost.price_compiled`)."""

    compiler: str  # "cpu" | "gpu"
    shape: tuple[int, ...]
    names: tuple[str, ...]
    cluster: rj.Cluster
    hosts: int = 1
    o3: bool = True  # search (and compile) O3 here too

    @property
    def label(self) -> str:
        return "x".join(map(str, self.shape))

    def mesh(self):
        return rj.device_mesh(self.shape, self.names, compilers.devices(self.compiler, math.prod(self.shape),
                                                                        self.hosts))


_1D, _2D = ("devices",), ("data", "model")


TARGETS = (Target("cpu", (8,), _1D, M8), Target("cpu", (2, 4), _2D, M8),
           Target("gpu", (8,), _1D, H100), Target("gpu", (2, 4), _2D, H100),
           Target("gpu", (2, 8), _2D, get_cluster("8x-h100-2hosts"), hosts=2, o3=False))


# model -> (paper preset, overrides, why). Batches: the zoo's presets carry the full-parallelism
# (pipelined) global batches; without pipelining we use the paper's SPMD-only batches where it
# gives them (Tables 1, 2), raised to 8 so that 8 devices can split them.
# Depth is halved where the CPU compile of ~9 plans per model would take minutes (so the whole run
# stays under half an hour on 2 cores): layers repeat, so per-layer costs and the choice of plan
# carry over, absolute step times are about half. Full depth: GPT-Medium's 24 layers are searched
# in the strong-scaling and search-time sections.
PAPER = {
    "gpt": ("GPT-Medium", {"batch": 8, "n_layers": 12},
            "Table 1 (the §7.3 strong-scaling model) at 12 of its 24 layers; SPMD-only batch 4 raised to 8"),
    "moe": ("MoE-16E-2.4B", {"batch": 8, "n_layers": 8},
            "Table 2's 8-GPU row at 8 of its 16 layers (4 MoE layers of 16 experts); SPMD-only batch 8"),
    "vgg19": ("VGG19-8gpu", {}, "Table 3, 8 GPUs x 128 images, million-class classifier (full size)"),
    "wresnet": ("WR-12B", {"batch": 8, "depth": 50},
                "Table 4's 8-GPU row (channels 320, width 12) at depth 50 instead of 101: 5.1B parameters, "
                "too many to replicate in 32 GiB; global batch 4 raised to 8"),
    "unet": ("UNet-8gpu", {}, "Table 3, 8 GPUs x 16 images (full size)"),
    "bert": ("DNABert-8gpu", {"n_layers": 6}, "Table 3, 8 GPUs x 32 sequences, at 6 of its 12 layers"),
}


STRONG_SCALING_BATCH = 8
