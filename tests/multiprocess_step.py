"""A step of a distributed job, run by tests/end_to_end/test_multiprocess.py under `rhino_jax.launch`:
`python -m rhino_jax.launch -n 2 --local-devices 4 tests/multiprocess_step.py run|die|pipeline [PLAN_FILE]`.
With `pipeline`, process 0 saves the plan the job found to PLAN_FILE and every process runs the
step from that file, searching nothing: how a job plans once and reuses the plan."""
import os
import sys

import jax
import numpy as np

jax.distributed.initialize()  # as on a cluster; the launcher has joined the job already

import rhino_jax as rj  # noqa: E402
from rhino_jax.models import gpt  # noqa: E402
from rhino_jax.multiprocess import digest  # noqa: E402
from rhino_jax.search.staging import stager  # noqa: E402


def process_rows(x: np.ndarray, sharding) -> np.ndarray:
    """What this process's data loader reads: the rows its devices hold under `sharding`."""
    rows = sorted({r for idx in sharding.addressable_devices_indices_map(x.shape).values()
                   for r in range(*idx[0].indices(x.shape[0]))})
    return x[rows[0]:rows[-1] + 1]


step = gpt.make_gpt_train_step(gpt.GPT_TINY)
with jax.default_device(jax.local_devices()[0]):
    args = gpt.gpt_example(gpt.GPT_TINY)
    want = jax.jit(step)(*args)
stages = {"pipeline": dict(pipeline=2, num_micro_batches=2)}.get(sys.argv[1], {})  # a stage per process
lowered = rj.parallelize(step, mesh=rj.device_mesh((2, 4), ("data", "model")), **stages).lower(*args)
print(f"plan digest {digest(lowered.plan)}", flush=True)  # one write: C++ logs may come between writes
if sys.argv[1] == "pipeline":
    from jax.experimental import multihost_utils

    if jax.process_index() == 0:
        lowered.plan.save(sys.argv[2])
    multihost_utils.sync_global_devices("plan saved")

    def no_search(*_args, **_kwargs):
        raise AssertionError("searched although a plan was given")

    rj.pipelined.lowered.plan_on = stager.stage = no_search
    lowered = rj.parallelize(step, mesh=rj.device_mesh((2, 4), ("data", "model")), plan=sys.argv[2],
                             **stages).lower(*args)
    print(f"plan digest {digest(lowered.plan)} (loaded)", flush=True)
params, opt_state, batch = args
shardings = lowered.plan.input_shardings
state = jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: np.asarray(x)[i], dtype=x.dtype),
                     (params, opt_state), shardings[:2])  # a pipeline's stage may be on the other process alone
batch = jax.tree.map(lambda x, s: jax.make_array_from_process_local_data(s, process_rows(np.asarray(x), s), x.shape),
                     batch, shardings[2])
if sys.argv[1] == "die" and jax.process_index() == 1:
    os._exit(3)  # the other process is left waiting in the step's collectives
got = lowered.compile()(*state, batch)
for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    for shard in g.addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data), np.asarray(w)[shard.index], rtol=1e-4, atol=1e-5)
print("same numbers as one device", flush=True)
loss = float(got[-1].addressable_data(0))  # every process reads the loss, as after jax.jit
np.testing.assert_allclose(loss, float(want[-1]), rtol=1e-4)
print("the loss read on this process", flush=True)
