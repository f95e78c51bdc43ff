"""Planning at scale on described GPUs (`benchmarks/scale.py`'s small case): Llama-2-7B shapes
with 4 layers, f32 AdamW state, bf16 compute, per-layer remat, on 256 described H100s as a
three-axis mesh (4, 8, 8), under 80 GiB per device. The whole space's ILP held 3.1M variables;
O2 searches it coarse to fine (`search/coarsening/coarse_axes.py`)."""
import pytest

from benchmarks.scale import CASES, run_case
from test_gpu_topology import _plugin_skip

pytestmark = pytest.mark.skipif(_plugin_skip() is not None, reason=_plugin_skip() or "")


def test_a_three_axis_mesh_of_256_described_gpus_plans_within_memory():
    small = next(c for c in CASES if c.name == "7b-4l-4x8x8")
    got = run_case(small, limit_s=120.0)
    assert got["status"] in ("optimal", "windowed")
    assert got["gib_per_device"] <= 80
    assert got["ilp_vars"] < 200_000  # the fine search's ILP: each op within one axis of the coarse plan
    assert 0.2 < got["mfu"] < 0.7  # a plan that uses the devices, not a replicated one
