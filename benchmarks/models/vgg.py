"""VGG19 with a million-class classifier, Rhino §7.4 and Table 3.

Rhino: "VGG19 [...] We replace the model's last layer with a million-scale classifier";
Table 3: 4.2B parameters, batch 128 per device, 1 to 8 GPUs (batch scaled with the GPUs).

VGG19 (Simonyan & Zisserman, configuration E): 16 3x3 convolutions with bias and ReLU in five
stages of 2, 2, 4, 4, 4 (64, 128, 256, 512, 512 channels), 2x2 max pooling after each stage,
then fc6 [7*7*512, 4096], fc7 [4096, 4096] (ReLU) and fc8 [4096, num_classes]. With
num_classes = 1,000,000 that is 20.0M (convolutions) + 119.5M (fc6, fc7) + 4.097B (fc8)
= 4.237B parameters, Table 3's 4.2B.

============  ========  =====  =========  =============================================
preset        classes   image  batch      parameters
============  ========  =====  =========  =============================================
VGG19         1000000   224    128        4.237B (Table 3: 4.2B; 1 GPU, 128 per device)
VGG19-8gpu    1000000   224    1024       4.237B (8 GPUs x 128)
tiny          128       32     8          1, 1, 2, 2, 2 convs of 8..32 channels, fc 64
============  ========  =====  =========  =============================================

Deviations: no dropout in the classifier (deterministic step); images are NHWC, 224x224x3,
random; He-normal initialisation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from ._common import (Constrain, build_example, conv2d, conv_params, dense_params, image_classification_batch,
                      max_pool, no_constrain, softmax_cross_entropy, train_step_for)

__all__ = ["Config", "PRESETS", "ROLES", "example", "make_train_step", "loss", "init_params"]


@dataclass(frozen=True)
class Config:
    batch: int
    num_classes: int = 1_000_000
    image_size: int = 224
    in_channels: int = 3
    widths: tuple[int, ...] = (64, 128, 256, 512, 512)  # channels per stage
    convs: tuple[int, ...] = (2, 2, 4, 4, 4)  # 3x3 convolutions per stage (VGG19)
    fc_dim: int = 4096
    lr: float = 1e-4

    def __post_init__(self) -> None:
        if self.image_size % 2 ** len(self.widths):
            raise ValueError(f"image_size={self.image_size} not divisible by 2**{len(self.widths)}")

    @property
    def final_size(self) -> int:
        return self.image_size // 2 ** len(self.widths)


PRESETS: dict[str, Config] = {
    "tiny": Config(batch=8, num_classes=128, image_size=32, widths=(8, 16, 16, 32, 32), convs=(1, 1, 2, 2, 2),
                   fc_dim=64, lr=1e-3),
    "VGG19": Config(batch=128),
    "VGG19-8gpu": Config(batch=8 * 128),
}

ROLES: dict[str, str] = {
    "feature_map": "[N, H, W, C] output of every 3x3 convolution (before ReLU)",
    "classifier_hidden": "[N, fc_dim] output of fc6 and fc7 (before ReLU)",
    "logits": "[N, num_classes] output of fc8, the million-class classifier",
}


def init_params(key: jax.Array, config: Config) -> dict:
    """``{"conv{stage}_{i}": {"w" [3, 3, in, out], "b"}, "fc6"/"fc7"/"fc8": {"w" [in, out], "b"}}``."""
    params = {}
    keys = iter(jax.random.split(key, sum(config.convs) + 3))
    c_in = config.in_channels
    for stage, (width, n) in enumerate(zip(config.widths, config.convs), start=1):
        for i in range(1, n + 1):
            params[f"conv{stage}_{i}"] = conv_params(next(keys), 3, c_in, width)
            c_in = width
    flat = config.final_size ** 2 * c_in
    params["fc6"] = dense_params(next(keys), flat, config.fc_dim)
    params["fc7"] = dense_params(next(keys), config.fc_dim, config.fc_dim)
    params["fc8"] = dense_params(next(keys), config.fc_dim, config.num_classes, scale=0.1)
    return params


def logits_fn(params: dict, images: jax.Array, config: Config, constrain: Constrain = no_constrain) -> jax.Array:
    x = images
    for stage, n in enumerate(config.convs, start=1):
        with jax.named_scope(f"stage{stage}"):
            for i in range(1, n + 1):
                x = jax.nn.relu(constrain(conv2d(x, params[f"conv{stage}_{i}"]), "feature_map"))
            x = max_pool(x, 2, 2)
    x = x.reshape(x.shape[0], -1)
    with jax.named_scope("classifier"):
        for name in ("fc6", "fc7"):
            x = jax.nn.relu(constrain(x @ params[name]["w"] + params[name]["b"], "classifier_hidden"))
        return constrain(x @ params["fc8"]["w"] + params["fc8"]["b"], "logits")


def loss(params: dict, batch: dict, config: Config, constrain: Constrain = no_constrain) -> jax.Array:
    """Mean softmax cross-entropy over the million classes."""
    logits = logits_fn(params, batch["images"], config, constrain)
    return jnp.mean(softmax_cross_entropy(logits, batch["labels"]))


def example(config: Config, abstract: bool = False, key: Optional[jax.Array] = None) -> tuple:
    """``(params, opt_state, batch)``; ShapeDtypeStructs when ``abstract`` (nothing allocated)."""
    return build_example(init_params, image_classification_batch, config, abstract, key)


def make_train_step(config: Config, constrain: Optional[Constrain] = None) -> Callable:
    """``step(params, opt_state, batch) -> (params, opt_state, loss)`` with Adam (lr = config.lr)."""
    return train_step_for(loss, config, constrain)
