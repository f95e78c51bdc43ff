"""Rhino §4.4: under a memory limit only the largest parameters lose replication."""
import jax
import pytest

import rhino_jax as rj
from rhino_jax.models import make_mlp_train_step, mlp_example

from helpers import assert_same_numbers

WIDTHS, BATCH = (256, 256, 1024, 256), 16384  # two 1 MiB weights, one 0.25 MiB


def _lower(args, **kw):
    mesh = rj.device_mesh((8,), ("data",))
    return rj.parallelize(make_mlp_train_step(), mesh=mesh, donate_argnums=(0, 1), **kw).lower(*args)


def _state(plan):
    return [(p, shape, s) for p, shape, s, role in zip(plan.arg_paths, plan.arg_shapes, plan.arg_specs, plan.arg_roles)
            if role in ("parameter", "optimizer_state")]


def test_limit_shards_only_the_largest_weights():
    args = mlp_example(WIDTHS, BATCH, abstract=True)
    free = _lower(args).plan
    assert all(s.is_replicated() for _, _, s in _state(free))  # data parallel without a limit
    limit = free.cost.memory_bytes - (2 << 20)
    lowered = _lower(args, memory_limit_bytes=limit)
    plan = lowered.plan
    assert plan.cost.memory_bytes <= limit
    forced = plan.search_stats["not_replicated"]
    assert forced and "memory limit" in plan.report()
    sharded = [(p, shape) for p, shape, s in _state(plan) if not s.is_replicated()]
    big = [(p, shape) for p, shape, _ in _state(plan) if 1024 in shape and len(shape) == 2]
    # Only 1 MiB weights (and their Adam moments) are sharded; some of them stay replicated.
    assert sharded and all(x in big for x in sharded), sharded
    assert len(sharded) < len(big)
    assert lowered.compile().memory.argument_bytes <= limit


def test_limit_keeps_the_numbers():
    args = mlp_example((32, 64, 32), 64)
    step = make_mlp_train_step()
    reference = jax.jit(step)(*args)
    mesh = rj.device_mesh((8,), ("data",))
    free = rj.parallelize(step, mesh=mesh).lower(*args).plan
    limited = rj.parallelize(step, mesh=mesh, memory_limit_bytes=free.cost.memory_bytes * 9 // 10)
    assert limited.lower(*args).plan.search_stats["not_replicated"]
    assert_same_numbers(reference, limited(*args))


def test_impossible_limit_names_the_largest_tensors():
    args = mlp_example(WIDTHS, BATCH, abstract=True)
    with pytest.raises(rj.MemoryLimitError, match=r"more than the limit.*arg\[2\]\['x'\]"):
        _lower(args, memory_limit_bytes=1 << 20)


def test_bad_limit_value():
    with pytest.raises(ValueError, match="memory_limit_bytes must be a positive int"):
        rj.parallelize(lambda x: x, mesh=rj.device_mesh((8,), ("data",)), memory_limit_bytes=-5)
