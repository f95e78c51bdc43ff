"""Wide-ResNet of Rhino §7.4 and Table 4 (the model of Alpa's Wide-ResNet benchmark).

Table 4 gives depth, base channels and width factor only. Its first three rows repeat the
(depth, channels, width) triples of Alpa's Wide-ResNet benchmark, so we build Alpa's model
(``alpa/model/wide_resnet.py``: Flax's ImageNet ResNet-v1 with a width factor):
- a 7x7/2 stem convolution with C channels, batch norm, ReLU, 3x3/2 max pooling;
- four stages of bottleneck blocks (depth 50: 3, 4, 6, 3 blocks; depth 101: 3, 4, 23, 3; the
  test-only depths 8 and 14 have one block in each of 2 or 4 stages), f = C * 2**stage;
- a block: 1x1 conv (f) -> 3x3 conv (f * width; stride 2 in the first block of every stage but
  the first) -> 1x1 conv (4f), each followed by batch norm, ReLU after the first two and after the
  residual add; a 1x1 projection conv + norm on the shortcut when the shape changes;
- global average pooling and a dense classifier over 1024 classes (Alpa's benchmark).
224x224x3 images, batch 4 (Table 4: "We keep global batch size at 4").

=======  =====  ========  =====  ===========================================
preset   depth  channels  width  parameters (ours / Table 4)
=======  =====  ========  =====  ===========================================
WR-1.3B  50     320       2      1.006B / 1.3B
WR-2.6B  50     448       2      1.965B / 2.6B
WR-6B    50     640       2      4.001B / 6B
WR-12B   101    320       12     9.550B / 12B
tiny     8      8         2      2 stages of 1 block; 32x32 images, 16 classes
=======  =====  ========  =====  ===========================================

Deviation (parameter counts): Alpa's model with Table 4's (depth, channels, width) has 0.67-0.80x
the parameters Table 4 lists (Alpa itself names these sizes 1B, 2B, 4B; its 13B is depth 101 with
width 16, not 12). The paper does not say how it counts; we keep Table 4's (depth, channels, width)
and Alpa's architecture, so the FLOPs per step are those of the configuration as specified.

Batch norm is kept, in training mode: batch statistics over (N, H, W), learned scale and bias, so
the gradients flow through the statistics exactly as in real training and a data-parallel plan
needs the statistics reduced across devices (sync BN). Running averages are not tracked (they do
not enter the training loss or gradients; only inference uses them). Flax's zero init of the last
norm's scale in a block is not copied: every norm scale starts at 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from ._common import (Constrain, batch_norm, build_example, conv2d, conv_params, dense_params,
                      image_classification_batch, max_pool, no_constrain, norm_params, softmax_cross_entropy,
                      train_step_for)

__all__ = ["Config", "PRESETS", "ROLES", "STAGE_SIZES", "example", "make_train_step", "loss", "init_params"]

STAGE_SIZES = {8: (1, 1), 14: (1, 1, 1, 1), 26: (2, 2, 2, 2),  # 8, 14, 26: small, for tests
               50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}


@dataclass(frozen=True)
class Config:
    depth: int  # a key of STAGE_SIZES (bottleneck ResNets)
    channels: int  # C: stem channels and the first stage's bottleneck width f
    width_factor: int
    batch: int = 4
    num_classes: int = 1024
    image_size: int = 224
    in_channels: int = 3
    lr: float = 1e-3

    def __post_init__(self) -> None:
        if self.depth not in STAGE_SIZES:
            raise ValueError(f"depth={self.depth} not one of {sorted(STAGE_SIZES)}")

    @property
    def stage_sizes(self) -> tuple[int, ...]:
        return STAGE_SIZES[self.depth]


PRESETS: dict[str, Config] = {
    "tiny": Config(depth=8, channels=8, width_factor=2, batch=8, num_classes=16, image_size=32),
    "WR-1.3B": Config(depth=50, channels=320, width_factor=2),
    "WR-2.6B": Config(depth=50, channels=448, width_factor=2),
    "WR-6B": Config(depth=50, channels=640, width_factor=2),
    "WR-12B": Config(depth=101, channels=320, width_factor=12),
}

ROLES: dict[str, str] = {
    "feature_map": "[N, H, W, C] output of every convolution (stem, block convs, shortcut projections), "
                   "before its batch norm",
    "classifier_hidden": "[N, 4 * C * 2**(stages - 1)] globally average-pooled features, the classifier's input",
    "logits": "[N, num_classes] classifier output",
}


def _conv_bn(key: jax.Array, k: int, c_in: int, c_out: int) -> dict:
    return {"conv": conv_params(key, k, c_in, c_out, bias=False), "bn": norm_params(c_out)}


def init_params(key: jax.Array, config: Config) -> dict:
    """``{"stem": {"conv": {"w"}, "bn": {"scale", "bias"}}, "stage1".."stage4": [block, ...],
    "head": {"w", "b"}}``; a block is ``{"conv1", "conv2", "conv3"[, "proj"]}``, each ``{"conv", "bn"}``."""
    c = config.channels
    k_stem, k_head, k_blocks = jax.random.split(key, 3)
    params = {"stem": _conv_bn(k_stem, 7, config.in_channels, c)}
    c_in = c
    keys = iter(jax.random.split(k_blocks, sum(config.stage_sizes)))
    for stage, n in enumerate(config.stage_sizes):
        f = c * 2 ** stage
        blocks = []
        for _ in range(n):
            k1, k2, k3, kp = jax.random.split(next(keys), 4)
            block = {"conv1": _conv_bn(k1, 1, c_in, f),
                     "conv2": _conv_bn(k2, 3, f, f * config.width_factor),
                     "conv3": _conv_bn(k3, 1, f * config.width_factor, 4 * f)}
            if c_in != 4 * f or (stage > 0 and not blocks):
                block["proj"] = _conv_bn(kp, 1, c_in, 4 * f)
            blocks.append(block)
            c_in = 4 * f
        params[f"stage{stage + 1}"] = blocks
    params["head"] = dense_params(k_head, c_in, config.num_classes, scale=0.1)
    return params


def _conv_bn_apply(x: jax.Array, p: dict, constrain: Constrain, stride: int = 1, padding="SAME") -> jax.Array:
    return batch_norm(constrain(conv2d(x, p["conv"], stride, padding), "feature_map"), p["bn"])


def logits_fn(params: dict, images: jax.Array, config: Config, constrain: Constrain = no_constrain) -> jax.Array:
    with jax.named_scope("stem"):
        x = jax.nn.relu(_conv_bn_apply(images, params["stem"], constrain, 2, [(3, 3), (3, 3)]))
        x = max_pool(x, 3, 2, "SAME")
    for stage in range(len(config.stage_sizes)):
        for j, block in enumerate(params[f"stage{stage + 1}"]):
            stride = 2 if stage > 0 and j == 0 else 1
            with jax.named_scope(f"stage{stage + 1}_block{j}"):
                y = jax.nn.relu(_conv_bn_apply(x, block["conv1"], constrain))
                y = jax.nn.relu(_conv_bn_apply(y, block["conv2"], constrain, stride))
                y = _conv_bn_apply(y, block["conv3"], constrain)
                shortcut = _conv_bn_apply(x, block["proj"], constrain, stride) if "proj" in block else x
                x = jax.nn.relu(shortcut + y)
    with jax.named_scope("head"):
        x = constrain(jnp.mean(x, axis=(1, 2)), "classifier_hidden")
        return constrain(x @ params["head"]["w"] + params["head"]["b"], "logits")


def loss(params: dict, batch: dict, config: Config, constrain: Constrain = no_constrain) -> jax.Array:
    logits = logits_fn(params, batch["images"], config, constrain)
    return jnp.mean(softmax_cross_entropy(logits, batch["labels"]))


def example(config: Config, abstract: bool = False, key: Optional[jax.Array] = None) -> tuple:
    """``(params, opt_state, batch)``; ShapeDtypeStructs when ``abstract`` (nothing allocated)."""
    return build_example(init_params, image_classification_batch, config, abstract, key)


def make_train_step(config: Config, constrain: Optional[Constrain] = None) -> Callable:
    """``step(params, opt_state, batch) -> (params, opt_state, loss)`` with Adam (lr = config.lr)."""
    return train_step_for(loss, config, constrain)
