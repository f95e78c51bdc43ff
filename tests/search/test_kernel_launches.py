"""The kernels the search counts once XLA has fused a step, and what it charges for them."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import rhino_jax as rj
from rhino_jax.hlo_passes.importer import import_module
from rhino_jax.hlo_passes.lowering import lower_on_mesh
from rhino_jax.search.cost.cluster import get_cluster
from rhino_jax.search.cost.fusion import fused_kernels, kernel_launches, memory_traffic


def _graph(fn, *args):
    lowered = lower_on_mesh(fn, args, rj.device_mesh((8,), ("d",)), ())
    return import_module(lowered.module, lowered.arg_paths, lowered.arg_roles, lowered.output_paths)


def _launches(fn, *args) -> dict[str, int]:
    """op kind → kernels its nodes launch."""
    graph = _graph(fn, *args)
    launches, out = kernel_launches(graph, fused_kernels(graph)), {}
    for node in graph.nodes:
        kind = node.op.split(".")[-1]
        out[kind] = out.get(kind, 0) + launches[node.id]
    return out


def _adam(p, g, mu, nu, lr):
    mu = 0.9 * mu + 0.1 * g
    nu = 0.999 * nu + 0.001 * g * g
    return p - lr * mu / (jnp.sqrt(nu) + 1e-8), mu, nu


def _corrected(lr, count):
    """A learning rate with Adam's bias correction: arithmetic on scalars."""
    return lr * jnp.sqrt(1 - 0.999 ** count) / (1 - 0.9 ** count)


def test_an_update_of_one_leaf_is_one_kernel_and_two_leaves_sharing_a_scalar_are_two():
    """An Adam update's elementwise chain writes its three results in one kernel (XLA's
    multi-output fusion); two leaves' chains that share only the bias-corrected learning rate
    (scalars, computed again in each kernel) are two kernels, neither one nor three."""
    x = [np.ones((64, 32), np.float32)] * 4
    lr, count = np.float32(1e-3), np.float32(3)
    one = _launches(lambda p, g, mu, nu, lr, c: _adam(p, g, mu, nu, _corrected(lr, c)), *x, lr, count)
    assert sum(one.values()) == 1
    def both(p, g, mu, nu, q, lr, c):
        rate = _corrected(lr, c)
        return (*_adam(p, g, mu, nu, rate), *_adam(q, g, mu, nu, rate))

    assert sum(_launches(both, *x, x[0], lr, count).values()) == 2


def test_matmuls_launch_one_kernel_each_and_broadcasts_none():
    """Two matmuls with a bias and a ReLU between: the dots are a kernel each, the bias add and
    the ReLU one more; the bias's broadcast and the zero's are folded into the add's kernel."""
    w1, w2, b = np.ones((32, 64), np.float32), np.ones((64, 16), np.float32), np.ones((64,), np.float32)
    launches = _launches(lambda x: jnp.maximum(x @ w1 + b, 0.0) @ w2, np.ones((8, 32), np.float32))
    assert launches["dot_general"] == 2
    assert launches.get("broadcast_in_dim", 0) == 0 and launches.get("constant", 0) == 0
    assert sum(launches.values()) == 3


def test_a_kernel_never_both_feeds_a_matmul_and_reads_its_product():
    """Two residual layers, y = x + x @ w1, z = y + y @ w2: the first add feeds the second
    matmul, whose product the second add reads, so the adds are two kernels (as XLA compiles a
    residual stream: a fusion per layer), not one kernel with a matmul inside it."""
    w1, w2 = np.ones((64, 64), np.float32), np.ones((64, 64), np.float32)

    def step(x):
        y = x + x @ w1
        return y + y @ w2

    launches = _launches(step, np.ones((8, 64), np.float32))
    assert {k: n for k, n in launches.items() if n} == {"dot_general": 2, "add": 2}


def test_a_reduction_read_back_whole_is_read_by_the_next_kernel():
    """x minus its row means: the means are one kernel, and the subtraction, which needs every
    mean, the next one. It reads x again, and the means, from memory: 3 times x's bytes and
    twice the means', where one kernel would move x's twice."""
    x = np.ones((64, 256), np.float32)
    graph = _graph(lambda x: (x - x.mean(axis=-1, keepdims=True)) * 2.0, x)
    kernels = fused_kernels(graph)
    launches, traffic = kernel_launches(graph, kernels), memory_traffic(graph, kernels)
    assert sum(launches.values()) == 2
    assert sum(traffic.values()) == 3 * x.nbytes + 2 * 64 * 4


def test_on_ampere_and_later_a_row_reduction_and_its_readers_are_one_kernel():
    """XLA's Triton fusions on the GPUs the presets describe: x minus its row means is one
    kernel, reading x once and writing the result; a reduction along another dimension (column
    means) is still read by the next kernel."""
    x = np.ones((64, 256), np.float32)
    rows = _graph(lambda x: (x - x.mean(axis=-1, keepdims=True)) * 2.0, x)
    fused = fused_kernels(rows, rows_fused=True)
    assert sum(kernel_launches(rows, fused).values()) == 1
    assert sum(memory_traffic(rows, fused).values()) == 2 * x.nbytes
    columns = _graph(lambda x: (x - x.mean(axis=0, keepdims=True)) * 2.0, x)
    assert sum(kernel_launches(columns, fused_kernels(columns, rows_fused=True)).values()) == 2


def test_a_layer_norm_whose_two_means_are_combined_stays_two_kernels_on_ampere():
    """Flax's layer norm of a residual stream's sum takes the mean and the mean of squares in
    one pass, with the sum, and combines them into the variance before reading it back: XLA
    keeps that kernel and the normalization's apart (two, as in a compiled Flax GPT), where a
    lone row mean would fuse with its readers."""
    def layer_norm(x, y):
        x = x + y
        mean, mean2 = x.mean(axis=-1, keepdims=True), (x * x).mean(axis=-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(mean2 - mean * mean + 1e-6)

    x = np.ones((64, 256), np.float32)
    graph = _graph(layer_norm, x, x)
    assert sum(kernel_launches(graph, fused_kernels(graph, rows_fused=True)).values()) == 2


def test_the_search_charges_each_kernel_a_launch():
    """The same step planned for a cluster that charges 5 µs a kernel predicts 5 µs more compute
    for each kernel it counts than for one that charges nothing, the split op or not."""
    def step(w, x):
        return jnp.tanh(x @ w).sum()

    args = (np.ones((256, 256), np.float32), np.ones((64, 256), np.float32))
    mesh = rj.device_mesh((8,), ("d",))
    free = dataclasses.replace(get_cluster("8x-h100"), kernel_launch_s=0.0, overlap=0.0)
    charged = dataclasses.replace(free, kernel_launch_s=5e-6)
    plans = [rj.parallelize(step, mesh=mesh, cluster=c).lower(*args).plan for c in (free, charged)]
    assert plans[0].arg_specs == plans[1].arg_specs
    graph = plans[0].search_inputs.graph
    launches = kernel_launches(graph, fused_kernels(graph))
    kernels = sum(launches[node.id] * node.trips for node in graph.nodes)
    assert kernels >= 2
    assert abs(plans[1].cost.compute_s - plans[0].cost.compute_s - kernels * 5e-6) < 1e-9
