"""Model zoo of the Rhino paper's evaluation (§7, Tables 1-4), in plain JAX.

Every module (``MODELS[name]``) exposes the same interface::

    Config                                   # frozen (hashable) dataclass: all sizes, batch included
    PRESETS: dict[str, Config]               # "tiny" (tests) plus the paper's configurations
    example(config, abstract=False)          # (params, opt_state, batch); ShapeDtypeStructs if abstract
    make_train_step(config, constrain=None)  # step(params, opt_state, batch) -> (params, opt_state, loss)
    ROLES: dict[str, str]                    # activation role -> what it is and its shape

``constrain(x, role)`` is called on the activations named in ``ROLES`` (identity by default), so a
baseline can pin them, e.g. ``lambda x, role: rj.annotate(x, P("data")) if role == "hidden" else x``.
Parameters are nested dicts (lists for repeated layers) with descriptive key names; the optimizer
is Adam (``rhino_jax.models.adam``). Each module's docstring says which table row each preset follows,
its parameter count, and where it deviates from the paper.
"""
import math

import jax

from . import bert, gpt, moe, unet, vgg, wresnet

MODELS = {"gpt": gpt, "moe": moe, "vgg19": vgg, "wresnet": wresnet, "unet": unet, "bert": bert}


def sharding_memory_limit(unlimited_bytes: int, example: tuple, devices: int) -> int:
    """A `memory_limit_bytes` that an unlimited plan of `unlimited_bytes` per device (all parameters
    and optimizer states replicated) exceeds by half of what sharding all of them over `devices`
    would save, so the search must shard about half of them.

    The tiny presets need it to check anything: at their sizes the cost model rightly replicates
    everything, and a replicated plan agrees with one device trivially."""
    params, opt_state = example[0], example[1]
    state = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves((params, opt_state)))
    return int(unlimited_bytes - state * (1 - 1 / devices) / 2)


__all__ = ["MODELS", "sharding_memory_limit", "gpt", "moe", "vgg", "wresnet", "unet", "bert"]
