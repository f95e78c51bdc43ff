"""The temporaries XLA's GPU compiler adds to run a GEMM (`dot_general`), measured for the memory
model (`memory.plan_memory`).

When a GEMM's result has too few tiles to fill the GPU, XLA splits its contraction (split-K): the
partial products go to a temporary of split x the result, in the accumulation type, which a
reduction then sums. On deviceless H100 compiles a [1024, 512] x [512, 256] f32 GEMM is split 4
ways (4 MiB beside its 1 MiB result) and a [4096, 512] x [512, 512] one not at all; in a
Mixtral-style MoE's plan these temporaries are 6 of the step's 88 MB. Which GEMMs are split, and
how many ways, is the compiler's heuristic (autotuning on a device may choose again), so each
distinct local GEMM is compiled alone for one of the plan's devices, once per process. The search
runs without them (it may run in worker processes, away from the devices); they are added to the
chosen plan's memory (`with_gemm_workspaces`), so a memory limit is checked without them."""
from __future__ import annotations

import dataclasses
import functools
import logging

import jax

from rhino_jax.core.specs import ShardingSpec

from ...hlo_passes.graph import Graph
from .cluster import MeshTopology
from .memory import plan_memory

log = logging.getLogger("rhino_jax")

GPU_PLATFORMS = ("gpu", "cuda", "rocm")
Dims = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]


def with_gemm_workspaces(plan, graph: Graph, topo: MeshTopology, device):
    """`plan` (a `rhino_jax.Plan`) with its memory counting the GEMM temporaries XLA makes for
    `device`'s backend: the same plan where that is not a GPU or no GEMM needs one."""
    workspaces = gemm_workspaces(graph, plan.value_specs, plan.read_specs, topo.sizes, device)
    if not workspaces:
        return plan
    memory = plan_memory(graph, plan.value_specs, topo, plan.read_specs, plan.output_specs, workspaces)
    return dataclasses.replace(plan, cost=dataclasses.replace(plan.cost, memory_bytes=memory))


def gemm_workspaces(graph: Graph, specs: dict[int, ShardingSpec], reads: dict[tuple[int, int], ShardingSpec],
                    sizes: dict[str, int], device) -> dict[int, int]:
    """Node id → bytes of the temporaries XLA compiles beside that `dot_general` on `device`, run
    on one device's pieces of its operands (in the layouts the plan reads them in)."""
    if device.platform not in GPU_PLATFORMS:
        return {}
    out = {}
    for n in graph.nodes:
        if n.op != "stablehlo.dot_general":
            continue
        shapes = []
        for pos, v in enumerate(n.operands):
            spec = reads.get((n.id, pos), specs.get(v))
            shape = graph.values[v].shape
            shapes.append(tuple(shape) if spec is None else spec.local_shape(shape, sizes))
        a = n.attrs
        dims = ((tuple(a["lhs_contract"]), tuple(a["rhs_contract"])), (tuple(a["lhs_batch"]), tuple(a["rhs_batch"])))
        dtypes = tuple(graph.values[v].dtype for v in n.operands)
        nbytes = _measured(device, tuple(shapes), dtypes, graph.values[n.results[0]].dtype, dims)
        if nbytes:
            out[n.id] = nbytes
    return out


@functools.cache
def _measured(device, shapes: tuple[tuple[int, ...], ...], dtypes: tuple[str, ...], result_dtype: str,
              dims: Dims) -> int:
    """The temporary bytes of one GEMM compiled alone for `device` (0 where it does not compile:
    the plan is then priced without it, and the log says so)."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in zip(shapes, dtypes)]
    dot = functools.partial(jax.lax.dot_general, dimension_numbers=dims, preferred_element_type=result_dtype)
    try:
        return int(jax.jit(dot).lower(*args).compile().memory_analysis().temp_size_in_bytes)
    except Exception as e:  # noqa: BLE001 - a refinement of the estimate, not worth failing the plan for
        log.info("rhino_jax: the temporaries of a %s x %s GEMM were not measured (%s: %s)",
                 shapes[0], shapes[1], type(e).__name__, e)
        return 0
