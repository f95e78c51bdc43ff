"""Shared checks: a parallel result must equal the single-device one."""
import jax
import numpy as np


def assert_same_numbers(reference, result, rtol=1e-4, atol=1e-5):
    assert jax.tree.structure(reference) == jax.tree.structure(result)
    for ref, out in zip(jax.tree.leaves(reference), jax.tree.leaves(result)):
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=rtol, atol=atol)


def topology(**sizes):
    """A mesh as the cost model sees it, every axis on the same link (M8's NVLink figures)."""
    from rhino_jax.search.cluster import M8_V100, MeshTopology
    n = len(sizes)
    return MeshTopology(tuple(sizes), tuple(sizes.values()), (M8_V100.intra_host_bandwidth,) * n,
                        (M8_V100.intra_host_latency,) * n, M8_V100.collective_launch_s)
