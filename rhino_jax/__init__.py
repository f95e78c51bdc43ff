"""rhino_jax: automatic SPMD parallelization of JAX training steps (Rhino, in JAX)."""
from rhino_jax.core import plan as _plan
from rhino_jax.core.plan import MeshCandidate, Plan, PlanCost
from rhino_jax.runtime import schedules as _schedules, task_graph as _task_graph
from rhino_jax.runtime.schedules import Task
from rhino_jax.search.cost import combining as _combining
from rhino_jax.search.cost.cluster import A100_8X, H100_8X, H200_8X, M8_V100, Cluster

from .annotate import annotate
from .constraints import coshard, op_assign, op_order, op_trans
from .api import Parallelized, parallelize
from .one_program import Compiled, Lowered
from .errors import (CompiledMemoryWarning, ConstraintError, HostCallbackError, MemoryLimitError, MeshError,
                     NoFeasibleMeshError, RhinoError, ShardingPinError, SolverError, SolverTimeLimitWarning,
                     TracedCallWarning, UnscheduledProgramWarning)
from . import explain as _explain, render as _render, report as _report
from .plan_diff import diff
from .gpu_topology import DescribedDeviceError, gpu_topology
from .mesh import device_mesh

__all__ = [
    "parallelize", "annotate", "device_mesh", "gpu_topology", "Plan", "PlanCost", "Lowered", "Compiled",
    "Parallelized", "Cluster", "M8_V100", "H100_8X", "H200_8X", "A100_8X", "RhinoError", "ShardingPinError",
    "SolverError", "MeshError", "SolverTimeLimitWarning", "NoFeasibleMeshError", "MemoryLimitError",
    "DescribedDeviceError", "MeshCandidate", "TracedCallWarning", "diff", "op_trans", "op_assign", "op_order", "coshard", "Task",
    "ConstraintError", "HostCallbackError", "CompiledMemoryWarning", "UnscheduledProgramWarning",
]
__version__ = "0.1.0"

# the plan's readers, which stand above the floor the plan is on (`rhino_jax.core.plan.READERS`)
_plan.READERS.update(explain=_explain.explain, render=_render.render, report=_report.report,
                     mesh_candidates_report=_report.mesh_candidates_report,
                     schedule=_schedules.of_plan, task_graph=_task_graph.of_plan,
                     combined_kinds=_combining.combined_kinds)
