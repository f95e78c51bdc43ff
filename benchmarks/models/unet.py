"""U-Net of Rhino §7.4 and Table 3 ("Unet, the key component in popular diffusion network").

Table 3: 33M parameters, batch 16 per device, 1 to 8 GPUs (batch scaled with the GPUs). The paper
gives no architecture; 33M is the size of the original U-Net (Ronneberger et al. 2015), which we
build: an encoder of four levels of two 3x3 convolutions + ReLU (64, 128, 256, 512 channels) each
followed by 2x2 max pooling, a 1024-channel bottom level, and a decoder of four levels, each a 2x2
stride-2 transposed convolution (``lax.conv_transpose``) halving the channels, concatenation with
the encoder's skip feature map of the same level, and two 3x3 convolutions + ReLU; a 1x1
convolution gives the output. The training task is diffusion-style denoising: the network
predicts the noise added to an image, mean squared error.

==========  ======  =====  =====  =============================================
preset      widths  image  batch  parameters
==========  ======  =====  =====  =============================================
UNet        64-1024 256    16     31.03M (Table 3: 33M; 1 GPU, 16 per device)
UNet-8gpu   64-1024 256    128    31.03M (8 GPUs x 16)
tiny        8-32    16     8      for tests
==========  ======  =====  =====  =============================================

Deviations: 'SAME' padding instead of the original's unpadded convolutions and crops (so the
output has the input's size, as in diffusion U-Nets); 256x256x3 images (the paper does not say);
no timestep embedding, normalization or attention blocks of diffusion U-Nets (the paper says
U-Net, and 33M is the plain U-Net's size: ours has 31.0M, 6% below the table).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax

from ._common import Constrain, build_example, conv2d, conv_params, max_pool, no_constrain, train_step_for

__all__ = ["Config", "PRESETS", "ROLES", "example", "make_train_step", "loss", "init_params"]


@dataclass(frozen=True)
class Config:
    batch: int
    image_size: int = 256
    in_channels: int = 3
    out_channels: int = 3
    widths: tuple[int, ...] = (64, 128, 256, 512, 1024)  # encoder levels ..., bottom level
    noise_scale: float = 0.5
    lr: float = 1e-3

    def __post_init__(self) -> None:
        if self.image_size % 2 ** (len(self.widths) - 1):
            raise ValueError(f"image_size={self.image_size} not divisible by 2**{len(self.widths) - 1}")


PRESETS: dict[str, Config] = {
    "tiny": Config(batch=8, image_size=16, widths=(8, 16, 32)),
    "UNet": Config(batch=16),
    "UNet-8gpu": Config(batch=8 * 16),
}

ROLES: dict[str, str] = {
    "feature_map": "[N, H, W, C] output of every convolution and transposed convolution (before ReLU), "
                   "and the 1x1 output convolution's [N, H, W, out_channels]",
}


def _double_conv(key: jax.Array, c_in: int, c_out: int) -> dict:
    k1, k2 = jax.random.split(key)
    return {"conv1": conv_params(k1, 3, c_in, c_out), "conv2": conv_params(k2, 3, c_out, c_out)}


def init_params(key: jax.Array, config: Config) -> dict:
    """``{"enc1".."encL": {"conv1", "conv2"}, "bottom": {...}, "decL".."dec1": {"up", "conv1", "conv2"},
    "out"}``; every conv is ``{"w" [k, k, in, out], "b"}`` (``up`` is the 2x2 transposed conv)."""
    widths = config.widths
    levels = len(widths) - 1
    keys = iter(jax.random.split(key, 2 * levels + 2))
    params, c_in = {}, config.in_channels
    for i, w in enumerate(widths[:-1], start=1):
        params[f"enc{i}"] = _double_conv(next(keys), c_in, w)
        c_in = w
    params["bottom"] = _double_conv(next(keys), c_in, widths[-1])
    for i in range(levels, 0, -1):
        w = widths[i - 1]
        ku, kc = jax.random.split(next(keys))
        params[f"dec{i}"] = {"up": conv_params(ku, 2, widths[i], w), **_double_conv(kc, 2 * w, w)}
    params["out"] = conv_params(next(keys), 1, widths[0], config.out_channels)
    return params


def _apply_double_conv(x: jax.Array, p: dict, constrain: Constrain) -> jax.Array:
    x = jax.nn.relu(constrain(conv2d(x, p["conv1"]), "feature_map"))
    return jax.nn.relu(constrain(conv2d(x, p["conv2"]), "feature_map"))


def forward(params: dict, images: jax.Array, config: Config, constrain: Constrain = no_constrain) -> jax.Array:
    levels = len(config.widths) - 1
    skips, x = [], images
    for i in range(1, levels + 1):
        with jax.named_scope(f"enc{i}"):
            x = _apply_double_conv(x, params[f"enc{i}"], constrain)
            skips.append(x)
            x = max_pool(x, 2, 2)
    with jax.named_scope("bottom"):
        x = _apply_double_conv(x, params["bottom"], constrain)
    for i in range(levels, 0, -1):
        p = params[f"dec{i}"]
        with jax.named_scope(f"dec{i}"):
            up = lax.conv_transpose(x, p["up"]["w"], (2, 2), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
            x = jnp.concatenate([skips[i - 1], constrain(up + p["up"]["b"], "feature_map")], axis=-1)
            x = _apply_double_conv(x, p, constrain)
    with jax.named_scope("out"):
        return constrain(conv2d(x, params["out"]), "feature_map")


def loss(params: dict, batch: dict, config: Config, constrain: Constrain = no_constrain) -> jax.Array:
    """Mean squared error of the predicted noise."""
    pred = forward(params, batch["images"], config, constrain)
    return jnp.mean(jnp.square(pred - batch["targets"]))


def make_batch(key: jax.Array, config: Config) -> dict:
    """Noisy images x0 + noise_scale * eps (x0, eps ~ N(0, 1)); the target is eps."""
    k0, ke = jax.random.split(key)
    s = config.image_size
    clean = jax.random.normal(k0, (config.batch, s, s, config.in_channels), jnp.float32)
    noise = jax.random.normal(ke, (config.batch, s, s, config.out_channels), jnp.float32)
    return {"images": clean + config.noise_scale * noise, "targets": noise}


def example(config: Config, abstract: bool = False, key: Optional[jax.Array] = None) -> tuple:
    """``(params, opt_state, batch)``; ShapeDtypeStructs when ``abstract`` (nothing allocated)."""
    return build_example(init_params, make_batch, config, abstract, key)


def make_train_step(config: Config, constrain: Optional[Constrain] = None) -> Callable:
    """``step(params, opt_state, batch) -> (params, opt_state, loss)`` with Adam (lr = config.lr)."""
    return train_step_for(loss, config, constrain)
