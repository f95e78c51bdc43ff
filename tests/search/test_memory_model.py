"""The memory model's count of buffers: what XLA's buffer assignment gives a buffer of its own."""
import jax
import jax.numpy as jnp
import numpy as np

import rhino_jax as rj
from rhino_jax.hlo_passes.importer import import_module
from rhino_jax.hlo_passes.lowering import lower_on_mesh
from rhino_jax.search.cost.memory import plan_memory

from helpers import topology


def _memory(fn, *args) -> int:
    """Predicted bytes per device of `fn` with every value replicated."""
    lowered = lower_on_mesh(fn, args, rj.device_mesh((8,), ("d",)), ())
    graph = import_module(lowered.module, lowered.arg_paths, lowered.arg_roles, lowered.output_paths)
    return plan_memory(graph, {}, topology(d=8))


def test_a_barrier_hands_its_operands_buffers_on():
    """`jax.checkpoint`'s barrier makes no copy: its results are its operands' buffers, each held
    as long as the result in its slot is read. Counted as buffers of their own, a 6-layer Llama
    step's weights read whole at the barrier were held twice (42.8 MiB predicted, 35.6 compiled
    on described H100s)."""
    w, x = np.ones((512, 512), np.float32), np.ones((64, 512), np.float32)

    def step(w, x, barrier):
        a, h = jnp.sin(w) @ w, jnp.tanh(x)  # a: a buffer of its own (a GEMM's result)
        if barrier:
            a, h = jax.lax.optimization_barrier((a, h))
        return (h @ a).sum()

    plain = _memory(lambda w, x: step(w, x, False), w, x)
    assert _memory(lambda w, x: step(w, x, True), w, x) == plain
