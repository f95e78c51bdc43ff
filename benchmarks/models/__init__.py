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
from . import bert, gpt, moe, unet, vgg, wresnet

MODELS = {"gpt": gpt, "moe": moe, "vgg19": vgg, "wresnet": wresnet, "unet": unet, "bert": bert}

__all__ = ["MODELS", "gpt", "moe", "vgg", "wresnet", "unet", "bert"]
