"""The search finds the plans an expert would write, checked on the compiled HLO."""
import jax
import numpy as np

import rhino_jax as rj
from rhino_jax.models import make_mlp_train_step, mlp_example


def _weights(plan):
    return [(p, s) for p, s in zip(plan.arg_paths, plan.arg_specs)
            if p.startswith("arg[0]") and p.endswith("['w']")]


def test_small_batch_wide_layers_get_megatron():
    """Megatron: column- and row-split weights alternate, so weights never move and each pair
    of layers needs one activation all-reduce forward and one backward."""
    width, batch, layers = 2048, 8, 4
    mesh = rj.device_mesh((8,), ("model",))
    args = mlp_example((width,) * (layers + 1), batch, abstract=True)
    lowered = rj.parallelize(make_mlp_train_step(), mesh=mesh, donate_argnums=(0, 1)).lower(*args)
    specs = [str(s) for _, s in _weights(lowered.plan)]
    assert specs in (["[-, model]", "[model, -]"] * 2, ["[model, -]", "[-, model]"] * 2), specs
    stats = lowered.compile().collectives
    activation = batch * width * 4
    assert stats.count() > 0
    assert all(c.kind == "all-reduce" and c.bytes <= activation for c in stats.collectives), str(stats)
    assert stats.bytes() < width * width * 4  # less than one weight's gradient


def test_large_batch_narrow_layers_get_data_parallelism():
    width, batch, layers = 256, 16384, 4
    mesh = rj.device_mesh((8,), ("data",))
    args = mlp_example((width,) * (layers + 1), batch, abstract=True)
    lowered = rj.parallelize(make_mlp_train_step(), mesh=mesh, donate_argnums=(0, 1)).lower(*args)
    plan = lowered.plan
    assert all(s.is_replicated() for p, s in zip(plan.arg_paths, plan.arg_specs) if not p.startswith("arg[2]"))
    assert all(s.dims[0] == ("data",) for p, s in zip(plan.arg_paths, plan.arg_specs) if p.startswith("arg[2]"))
    stats = lowered.compile().collectives
    assert {c.kind for c in stats.collectives} == {"all-reduce"}, str(stats)
    grads = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(args[0]))
    # Every gradient is all-reduced once (plus the scalar loss), nothing else moves.
    assert grads <= stats.bytes("all-reduce") <= grads + 64
