"""Expert parallelization plans, written with rhino_jax's public API only.

A baseline is a function ``(model module, config, mesh axes) -> step``: it builds the model's train
step with a ``constrain`` hook and wraps it so that the parameters, the optimizer state and the batch
(on the way in and on the way out) and the activations (through ``constrain(x, role)``) are pinned
with ``rj.annotate``. ``rj.parallelize(step, mesh=...)`` then plans only what the pins leave open,
under the same cost model as its own plans, so a baseline's ``plan.cost`` is the cost model's price
of the expert plan (or of the cheapest completion of it where the pins leave a choice).

Baselines (``BASELINES``; ``mesh`` is the number of mesh axes a baseline takes):

=====================  ====  ===================================================================
name                   mesh  plan
=====================  ====  ===================================================================
data parallel          1-D   parameters and optimizer state replicated, batch and every
                             activation split on the batch dimension: gradient all-reduces only
Megatron               1-D   tensor parallelism (Megatron-LM): column/row weight splits and the
                             activations pinned in between (``TENSOR_PARALLEL`` says per model)
ZeRO-2                 1-D   data parallel, optimizer moments sharded (DeepSpeed ZeRO stage 2:
                             the search reduce-scatters the gradients into them and all-gathers
                             the updated parameters)
ZeRO-3                 1-D   data parallel, parameters and moments sharded (ZeRO stage 3:
                             parameters all-gathered where used, gradients reduce-scattered)
expert parallel        1-D   MoE only (GShard): experts' weights and their activations split
                             on the expert dimension, everything else data parallel
DP + TP classifier     1-D   conv classifiers only (Krizhevsky's "one weird trick"): convolutions
                             data parallel, the classifier tensor parallel on gathered features
DP x TP                2-D   Megatron on the second ("model") axis, data parallel on the first
DP x EP                2-D   MoE only: experts split on the model axis, tokens on both axes
=====================  ====  ===================================================================

Pipelining is not built in rhino_jax yet, so the "3-D" manual plan (DP x TP x PP) is the 2-D DP x TP.

A baseline raises ``NotApplicable`` for a model it does not fit (expert parallel on a dense model,
a classifier plan on a U-Net, a 2-D plan on a 1-D mesh): it is skipped, not faked. A pin the mesh
does not divide (say 4 heads on 8 devices) fails in ``rj.annotate`` with ``rj.ShardingPinError``
when the step is lowered; a weight that no mesh axis divides in ZeRO stays replicated, as does an
activation pin of the data-parallel plans whose batch-like dimension the mesh does not divide.

Two choices that are ours, not the papers':
- ZeRO shards a tensor on its first dimension the mesh divides (DeepSpeed flattens and pads; the
  bytes moved are the same) and keeps tensors of fewer than ``persistence_threshold`` elements
  replicated (DeepSpeed's ``stage3_param_persistence_threshold``, default 1e5; DeepSpeed buckets
  small tensors into one collective, which has no per-tensor analogue here). We cannot pin the
  gradients (they live inside the model's step), so ZeRO-1 and ZeRO-2 are the same plan here.
- Megatron on the GPT-family models (gpt, moe, bert) leaves the fused QKV weight ``qkv_w`` [D, 3D]
  and its bias unpinned: their columns are [q | k | v], so Megatron's contiguous column split would
  cut heads (Megatron-LM stores QKV interleaved per head for this reason), which no PartitionSpec of
  [D, 3D] can undo. The per-head activations (q, k, v, attention output and scores) are pinned split
  on heads, so the search picks the cheapest layout of the QKV weight that feeds them.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import rhino_jax as rj

__all__ = ["NotApplicable", "Baseline", "BASELINES", "data_parallel", "megatron", "zero2", "zero3",
           "expert_parallel", "dp_tp_classifier", "dp_x_tp", "dp_x_ep", "model_name", "TENSOR_PARALLEL"]

DATA, MODEL = "data", "model"  # symbolic axes in the rule tables, bound to mesh axes per baseline
PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold (elements)


class NotApplicable(Exception):
    """This baseline does not fit this model or mesh (it is skipped, not faked)."""


def model_name(model) -> str:
    """'gpt', 'moe', 'vgg', 'wresnet', 'unet', 'bert': the zoo module's file name."""
    return model.__name__.rsplit(".", 1)[-1]


def _sizes(mesh_axes) -> dict[str, int]:
    if isinstance(mesh_axes, Mesh):
        return dict(zip(mesh_axes.axis_names, mesh_axes.devices.shape))
    if isinstance(mesh_axes, Mapping):
        return dict(mesh_axes)
    raise TypeError(f"mesh axes must be a Mesh or a {{name: size}} mapping, got {mesh_axes!r}")


# ------------------------------------------------------------------------------------ pinning

Rule = Callable[[tuple[str, ...], jax.ShapeDtypeStruct], "P | None"]  # leaf path keys, leaf -> spec


def _keys(path) -> tuple[str, ...]:
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
    return tuple(out)


def _pin(tree, rule: Rule, label: str):
    def pin(path, x):
        spec = rule(_keys(path), x)
        return x if spec is None else rj.annotate(x, spec, name=f"{label}{jax.tree_util.keystr(path)}")
    return jax.tree_util.tree_map_with_path(pin, tree)


def _mirror(param_rule: Rule, param_paths: set[tuple[str, ...]]) -> Rule:
    """The optimizer-state rule: a moment leaf (path ('mu', *param path)) takes its parameter's spec."""
    def rule(keys, x):
        for i in range(len(keys)):
            if keys[i:] in param_paths:
                return param_rule(keys[i:], x)
        return P() if x.ndim == 0 else None  # the step count
    return rule


@dataclass(frozen=True)
class Axes:
    """Mesh axes bound to the symbolic ones: `data` may be several axes, `model` is one."""

    sizes: dict[str, int]
    data: tuple[str, ...] = ()
    model: str | None = None

    def n(self, axes) -> int:
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        return math.prod(self.sizes[a] for a in axes)

    def bind(self, template: tuple) -> P:
        """('data', None, 'model') -> P(<data axes>, None, <model axis>)."""
        out = []
        for t in template:
            if t == DATA:
                out.append(None if not self.data else self.data[0] if len(self.data) == 1 else self.data)
            elif t == MODEL:
                out.append(self.model)
            else:
                out.append(t)
        return P(*out)


def _role_dims(model, role: str) -> list[str]:
    """Dimension names of an activation role from the zoo's ROLES text: '[B, S, D] ...' -> B, S, D."""
    m = re.match(r"\s*\[([^\]]*)\]", model.ROLES.get(role, ""))
    return [d.strip() for d in m.group(1).split(",")] if m else []


def _batch_dim(model, role: str) -> int | None:
    """The dimension of a role that holds examples (B, N, gating groups G, or G*C token slots)."""
    for i, d in enumerate(_role_dims(model, role)):
        if d in ("B", "N", "G") or d.startswith("G*"):
            return i
    return None


def _data_split(x, dim: int | None, ax: Axes) -> P | None:
    """Split `dim` on the data axes when they divide it (else leave the tensor to the search)."""
    if dim is None or not ax.data or x.shape[dim] % ax.n(ax.data):
        return None
    return ax.bind(tuple(DATA if d == dim else None for d in range(x.ndim)))


def _batch_rule(ax: Axes) -> Rule:
    return lambda keys, x: (_data_split(x, 0, ax) or P()) if x.ndim else P()


def _wrap(model, config, param_rule: Rule, batch_rule: Rule, act_rule, label: str, opt_rule: Rule | None = None):
    """The model's step with pins. `act_rule(role, x, i)` -> spec or None, `i` counting the calls
    of that role in trace order (the models call `constrain` in forward order, once per trace)."""
    calls: dict[str, int] = {}

    def constrain(x, role):
        i = calls.get(role, 0)
        calls[role] = i + 1
        spec = act_rule(role, x, i)
        return x if spec is None else rj.annotate(x, spec, name=f"{label}/{role}{i}")

    step = model.make_train_step(config, constrain)

    def pinned(params, opt_state, batch):
        calls.clear()
        paths = {_keys(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
        o_rule = opt_rule or _mirror(param_rule, paths)
        params = _pin(params, param_rule, "params")
        opt_state = _pin(opt_state, o_rule, "opt_state")
        batch = _pin(batch, batch_rule, "batch")
        params, opt_state, loss = step(params, opt_state, batch)
        return _pin(params, param_rule, "new_params"), _pin(opt_state, o_rule, "new_opt_state"), loss

    pinned.__name__ = pinned.__qualname__ = f"{model_name(model)}_{label}"
    return pinned


def _one_axis(mesh_axes, what: str) -> tuple[str, dict[str, int]]:
    sizes = _sizes(mesh_axes)
    if len(sizes) != 1:
        raise NotApplicable(f"{what} is a 1-D plan; the mesh has axes {sizes}")
    return next(iter(sizes)), sizes


def _two_axes(mesh_axes, what: str) -> tuple[str, str, dict[str, int]]:
    sizes = _sizes(mesh_axes)
    if len(sizes) != 2:
        raise NotApplicable(f"{what} is a 2-D plan (data, model); the mesh has axes {sizes}")
    data, model = sizes
    return data, model, sizes


# ------------------------------------------------------------------------------ data parallel

def _dp_acts(model, ax: Axes):
    return lambda role, x, i: _data_split(x, _batch_dim(model, role), ax)


def _zero_rule(ax: Axes, threshold: int) -> Rule:
    """Shard on the first dimension the data axes divide; small tensors stay replicated."""
    n = ax.n(ax.data)

    def rule(keys, x):
        if x.ndim == 0 or math.prod(x.shape) < threshold:
            return P()
        for d, size in enumerate(x.shape):
            if size % n == 0:
                return ax.bind(tuple(DATA if e == d else None for e in range(x.ndim)))
        return P()
    return rule


def data_parallel(model, config, mesh_axes):
    """Data parallelism: every parameter and moment replicated, the batch and every activation split
    on their batch dimension over all mesh axes. The compiled step all-reduces the gradients and
    gathers no parameter."""
    ax = Axes(_sizes(mesh_axes), data=tuple(_sizes(mesh_axes)))
    return _wrap(model, config, lambda k, x: P(), _batch_rule(ax), _dp_acts(model, ax), "dp")


def zero2(model, config, mesh_axes, persistence_threshold: int = PERSISTENCE_THRESHOLD):
    """ZeRO-2 (DeepSpeed P_os+g): data parallel with the Adam moments sharded across the devices and
    the parameters replicated; each device updates its shard and the parameters are all-gathered."""
    ax = Axes(_sizes(mesh_axes), data=tuple(_sizes(mesh_axes)))
    zero = _zero_rule(ax, persistence_threshold)
    opt_rule = lambda keys, x: zero(keys, x)  # noqa: E731 (every moment, by its own shape)
    return _wrap(model, config, lambda k, x: P(), _batch_rule(ax), _dp_acts(model, ax), "zero2", opt_rule)


def zero3(model, config, mesh_axes, persistence_threshold: int = PERSISTENCE_THRESHOLD):
    """ZeRO-3 (DeepSpeed P_os+g+p): data parallel with parameters and moments sharded; parameters are
    all-gathered where the step uses them, gradients reduce-scattered."""
    ax = Axes(_sizes(mesh_axes), data=tuple(_sizes(mesh_axes)))
    zero = _zero_rule(ax, persistence_threshold)
    return _wrap(model, config, zero, _batch_rule(ax), _dp_acts(model, ax), "zero3", zero)


# -------------------------------------------------------------------------- tensor parallel

@dataclass
class TPPlan:
    """A tensor-parallel plan of one model: a spec template per parameter, per activation call."""

    params: Callable[[tuple[str, ...], object], tuple | None]  # keys, leaf -> template (None: unpinned)
    acts: Callable[[str, object, int], tuple | None]  # role, x, call index -> template (None: unpinned)


def _col(x) -> tuple:
    """Megatron's column split: the output (last) dimension."""
    return (None,) * (x.ndim - 1) + (MODEL,)


def _row(x) -> tuple:
    """Megatron's row split: the input dimension (second to last: [in, out], HWIO, [E, in, out])."""
    return (None,) * (x.ndim - 2) + (MODEL, None)


def _rep(x) -> tuple:
    return (None,) * x.ndim


def _transformer_tp(config, model_divides_vocab: bool) -> TPPlan:
    """Megatron-LM on the GPT-family trees (gpt, moe, bert): attention heads and MLP columns split,
    proj/fc2 rows split (one all-reduce after each block, forward and backward), vocabulary-parallel
    embedding, LM head and cross-entropy when the mesh divides the vocabulary; MoE experts' FFNs
    split on F like a dense MLP (expert tensor parallelism)."""

    def params(keys, x):
        leaf = keys[-1]
        if leaf in ("qkv_w", "qkv_b"):
            return None  # see the module docstring: [q | k | v] columns, left to the search
        if leaf in ("fc1_w", "fc1_b"):
            return _col(x)
        if leaf in ("proj_w", "fc2_w"):
            return _row(x)
        if keys[-2:] == ("experts", "wi"):
            return _col(x)
        if keys[-2:] == ("experts", "wo"):
            return _row(x)
        if keys == ("wte",) and model_divides_vocab:
            return (MODEL, None)
        if keys == ("head", "w") and model_divides_vocab:
            return _col(x)
        if keys == ("mlm", "bias") and model_divides_vocab:
            return (MODEL,)
        return _rep(x)

    def acts(role, x, i):
        return {
            "hidden": (DATA, None, None),
            "attn_heads": (DATA, None, MODEL, None),
            "attn_scores": (DATA, MODEL, None, None),
            "mlp_hidden": (DATA, None, MODEL),
            "logits": (DATA, None, MODEL if model_divides_vocab else None),
            "moe_tokens": (DATA, None, None),
            "gate_logits": (DATA, None, None),
            "expert_in": (None, DATA, None),
            "expert_hidden": (None, DATA, MODEL),
            "expert_out": (None, DATA, None),
        }.get(role)

    return TPPlan(params, acts)


class _ConvTP:
    """Megatron's column/row pairing applied to convolutions (and the dense classifier): a layer whose
    input is replicated splits its output channels (column: kernel HWIO split on O, no
    communication), a layer whose input is channel-split splits its input channels (row: kernel
    split on I, the partial sums all-reduced into a replicated output). Per layer, forward and
    backward, that is one activation all-reduce every two layers instead of an all-gather and a
    reduce-scatter per layer with output channels split everywhere; batch norm is per channel, so
    it runs on either layout without communication. `order` lists the layers in the order the model
    calls `constrain` on their outputs; `kind[path]` is 'col', 'row' or 'rep' (replicated: when the
    mesh does not divide the channels)."""

    def __init__(self, n_model: int):
        self.n = n_model
        self.kind: dict[tuple[str, ...], str] = {}
        self.order: dict[str, list[tuple[str, ...]]] = {}  # role -> layer paths in call order

    def layer(self, path: tuple[str, ...], c_in: int, c_out: int, split_in: bool, role: str,
              want: str | None = None) -> bool:
        """Choose the layer's split from its input layout; return whether its output is split."""
        if want is None:
            want = "row" if split_in else "col"
        if want == "col" and c_out % self.n:
            want = "rep"
        if want == "row" and c_in % self.n:
            want = "rep"
        self.kind[path] = want
        self.order.setdefault(role, []).append(path)
        return want == "col"

    def plan(self, data_convs: bool = False) -> TPPlan:
        """`data_convs`: the convolutions stay data parallel (only classifier layers are split)."""

        def params(keys, x):
            for path, kind in self.kind.items():
                if keys[:len(path)] == path and x.ndim >= 1:
                    if kind == "col":
                        return _col(x)
                    if kind == "row" and x.ndim >= 2:
                        return _row(x)
                    return _rep(x)
            return _rep(x)

        def acts(role, x, i):
            layers = self.order.get(role)
            if not layers or i >= len(layers):
                return None
            batch = None if data_convs and role != "feature_map" else DATA
            out = (MODEL if self.kind[layers[i]] == "col" else None,)
            return (batch,) + (None,) * (x.ndim - 2) + out

        return TPPlan(params, acts)


def _vgg_tp(config, n: int, classifier_only: bool = False) -> _ConvTP:
    tp = _ConvTP(n)
    split, c_in = False, config.in_channels
    for stage, (width, count) in enumerate(zip(config.widths, config.convs), start=1):
        for i in range(1, count + 1):
            want = "rep" if classifier_only else None
            split = tp.layer((f"conv{stage}_{i}",), c_in, width, split, "feature_map", want)
            c_in = width
    if split:  # flattening a channel-split map interleaves the channels: gather it first
        split = False
    flat = config.final_size ** 2 * c_in
    split = tp.layer(("fc6",), flat, config.fc_dim, split, "classifier_hidden")
    split = tp.layer(("fc7",), config.fc_dim, config.fc_dim, split, "classifier_hidden")
    tp.layer(("fc8",), config.fc_dim, config.num_classes, split, "logits", "col")
    return tp


def _wresnet_tp(config, n: int, classifier_only: bool = False) -> _ConvTP:
    tp = _ConvTP(n)
    rep = "rep" if classifier_only else None
    c = config.channels
    split = tp.layer(("stem", "conv"), config.in_channels, c, False, "feature_map", rep)
    c_in = c
    for stage, blocks in enumerate(config.stage_sizes):
        f = c * 2 ** stage
        for j in range(blocks):
            base = (f"stage{stage + 1}", str(j))
            s1 = tp.layer(base + ("conv1", "conv"), c_in, f, split, "feature_map", rep)
            s2 = tp.layer(base + ("conv2", "conv"), f, f * config.width_factor, s1, "feature_map", rep)
            s3 = tp.layer(base + ("conv3", "conv"), f * config.width_factor, 4 * f, s2, "feature_map", rep)
            shortcut = split
            if c_in != 4 * f or (stage > 0 and j == 0):  # the block has a projection (see wresnet.py)
                # Match the residual branch's layout: a column split if it is split, else a row split.
                shortcut = tp.layer(base + ("proj", "conv"), c_in, 4 * f, split, "feature_map",
                                    rep or ("col" if s3 else "row" if split else "rep"))
            split = s3 or shortcut  # the add slices the replicated side locally
            c_in = 4 * f
    tp.layer(("head",), c_in, config.num_classes, split, "logits", "row" if split else "col")
    tp.order["classifier_hidden"] = [("head", "__in__")]  # pooled features: the head's input
    tp.kind[("head", "__in__")] = "col" if split else "rep"
    return tp


def _unet_tp(config, n: int) -> _ConvTP:
    tp = _ConvTP(n)
    widths = config.widths
    levels = len(widths) - 1
    split, c_in = False, config.in_channels
    for i, w in enumerate(widths[:-1], start=1):
        split = tp.layer((f"enc{i}", "conv1"), c_in, w, split, "feature_map")
        split = tp.layer((f"enc{i}", "conv2"), w, w, split, "feature_map")
        c_in = w
    split = tp.layer(("bottom", "conv1"), c_in, widths[-1], split, "feature_map")
    split = tp.layer(("bottom", "conv2"), widths[-1], widths[-1], split, "feature_map")
    for i in range(levels, 0, -1):
        w = widths[i - 1]
        # The up-sampled map is concatenated with the (replicated) skip map on channels: a row split
        # (of a replicated input: each device reads its slice) keeps it replicated, so the
        # concatenation needs no communication.
        split = tp.layer((f"dec{i}", "up"), widths[i], w, split, "feature_map", "row")
        split = tp.layer((f"dec{i}", "conv1"), 2 * w, w, False, "feature_map")
        split = tp.layer((f"dec{i}", "conv2"), w, w, split, "feature_map")
    tp.layer(("out",), widths[0], config.out_channels, split, "feature_map", "row" if split else "rep")
    return tp


def _tp_plan(model, config, n_model: int, classifier_only: bool = False) -> TPPlan:
    name = model_name(model)
    if classifier_only:
        if name == "vgg":
            return _vgg_tp(config, n_model, True).plan(data_convs=True)
        if name == "wresnet":
            return _wresnet_tp(config, n_model, True).plan(data_convs=True)
        raise NotApplicable(f"{name} has no classifier to split")
    if name in ("gpt", "moe", "bert"):
        return _transformer_tp(config, config.vocab % n_model == 0)
    if name == "vgg":
        return _vgg_tp(config, n_model).plan()
    if name == "wresnet":
        return _wresnet_tp(config, n_model).plan()
    if name == "unet":
        return _unet_tp(config, n_model).plan()
    raise NotApplicable(f"no tensor-parallel plan written for model {name!r}")


TENSOR_PARALLEL = {
    "gpt": "qkv_w/qkv_b left to the search (per-head activations pinned), proj_w and fc2_w rows, fc1_w "
           "columns, wte vocabulary-split (the tied LM head: logits split on the vocabulary)",
    "moe": "as gpt; experts' wi columns and wo rows (split on F), gate replicated",
    "bert": "as gpt; vocabulary (4101) split only where the mesh divides it",
    "vgg": "convolutions alternate column (output channels) and row (input channels), fc6 column, fc7 "
           "row, fc8 column (logits split on the million classes)",
    "wresnet": "each convolution column or row by its input's layout, projections matching their block, "
               "the head column or row",
    "unet": "encoder/bottom convolutions alternate column, row; decoder up-convolutions row (so the "
            "concatenation with the replicated skip map is local), then column, row",
}


def _tp_wrap(model, config, ax: Axes, plan: TPPlan, label: str, batch_split: bool):
    def param_rule(keys, x):
        t = plan.params(keys, x)
        return None if t is None else ax.bind(t)

    def act_rule(role, x, i):
        t = plan.acts(role, x, i)
        if t is None:
            return None
        if len(t) != x.ndim:
            raise ValueError(f"{label}: role {role!r} template {t} for a rank-{x.ndim} tensor {x.shape}")
        return ax.bind(t)

    batch_rule = _batch_rule(ax) if batch_split else (lambda keys, x: P())
    return _wrap(model, config, param_rule, batch_rule, act_rule, label)


def megatron(model, config, mesh_axes):
    """Megatron tensor parallelism on a 1-D mesh (batch replicated); see `TENSOR_PARALLEL`."""
    axis, sizes = _one_axis(mesh_axes, "Megatron")
    ax = Axes(sizes, data=(), model=axis)
    return _tp_wrap(model, config, ax, _tp_plan(model, config, sizes[axis]), "megatron", batch_split=False)


def dp_x_tp(model, config, mesh_axes):
    """The manual 2-D plan: Megatron on the second axis, data parallel on the first (the 3-D plan of
    Megatron-LM less pipelining, which rhino_jax does not build yet)."""
    data, axis, sizes = _two_axes(mesh_axes, "DP x TP")
    ax = Axes(sizes, data=(data,), model=axis)
    return _tp_wrap(model, config, ax, _tp_plan(model, config, sizes[axis]), "dp_tp", batch_split=True)


def dp_tp_classifier(model, config, mesh_axes):
    """Krizhevsky's "one weird trick" (2014): convolutions data parallel (their weights are small,
    their activations large), the dense classifier tensor parallel (its weights are large): the
    pooled features are all-gathered, the classifier's layers alternate column and row splits and
    the logits are split on the classes. Conv classifiers only (vgg19, wresnet)."""
    axis, sizes = _one_axis(mesh_axes, "DP + TP classifier")
    ax = Axes(sizes, data=(axis,), model=axis)
    plan = _tp_plan(model, config, sizes[axis], classifier_only=True)
    return _tp_wrap(model, config, ax, plan, "dp_tp_classifier", batch_split=True)


# --------------------------------------------------------------------------- expert parallel

def _ep(model, config, ax: Axes, expert_axis: str, label: str):
    if model_name(model) != "moe":
        raise NotApplicable(f"expert parallelism needs experts; {model_name(model)} has none")
    if config.n_experts % ax.sizes[expert_axis]:
        raise NotApplicable(f"{config.n_experts} experts on {ax.sizes[expert_axis]} devices")
    rest = tuple(a for a in ax.data if a != expert_axis)
    rest_ax = Axes(ax.sizes, data=rest)

    def param_rule(keys, x):
        if len(keys) >= 2 and keys[-2] == "experts":
            return P(expert_axis, *([None] * (x.ndim - 1)))
        return P()

    def act_rule(role, x, i):
        if role in ("expert_in", "expert_hidden", "expert_out"):
            tokens = _data_split(x, 1, rest_ax) if rest else None
            return P(expert_axis, tokens[1] if tokens else None, *([None] * (x.ndim - 2)))
        return _data_split(x, _batch_dim(model, role), ax)

    return _wrap(model, config, param_rule, _batch_rule(ax), act_rule, label)


def expert_parallel(model, config, mesh_axes):
    """GShard's expert parallelism on a 1-D mesh: expert e's weights and the tokens dispatched to it
    on device e (all-to-all in and out of the expert FFN), the rest data parallel."""
    axis, sizes = _one_axis(mesh_axes, "expert parallel")
    return _ep(model, config, Axes(sizes, data=(axis,)), axis, "ep")


def dp_x_ep(model, config, mesh_axes):
    """Expert parallelism on the model axis, data parallelism over both axes elsewhere (the expert
    FFN's token slots split on the data axis)."""
    data, axis, sizes = _two_axes(mesh_axes, "DP x EP")
    return _ep(model, config, Axes(sizes, data=(data, axis)), axis, "dp_ep")


# ------------------------------------------------------------------------------- registry

@dataclass(frozen=True)
class Baseline:
    name: str
    build: Callable  # (model, config, mesh axes) -> step
    mesh_rank: int  # number of mesh axes it is written for
    models: tuple[str, ...] | None = None  # model_name()s it applies to (None: all)

    def applies(self, model, mesh_axes) -> str | None:
        """None when it applies, else why not."""
        if self.models is not None and model_name(model) not in self.models:
            return f"{self.name} applies to {', '.join(self.models)} only"
        if len(_sizes(mesh_axes)) != self.mesh_rank:
            return f"{self.name} is a {self.mesh_rank}-D plan"
        return None


BASELINES: dict[str, Baseline] = {b.name: b for b in (
    Baseline("data parallel", data_parallel, 1),
    Baseline("Megatron", megatron, 1),
    Baseline("ZeRO-2", zero2, 1),
    Baseline("ZeRO-3", zero3, 1),
    Baseline("expert parallel", expert_parallel, 1, ("moe",)),
    Baseline("DP + TP classifier", dp_tp_classifier, 1, ("vgg", "wresnet")),
    Baseline("DP x TP", dp_x_tp, 2),
    Baseline("DP x EP", dp_x_ep, 2, ("moe",)),
)}
