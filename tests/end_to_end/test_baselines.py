"""The expert baselines of benchmarks/fixtures/baselines.py on the zoo's tiny presets (4 devices): same numbers
as one device, the compiled program shows the baseline's signature, and rhino_jax's own plan is
predicted no slower than any of them under the same cost model."""
import dataclasses
import functools
import math
import re

import jax
import pytest

import rhino_jax as rj
from rhino_jax.runtime.compiled.hlo_text import _computations
from benchmarks.fixtures import baselines as B
from benchmarks.fixtures.models import MODELS

from helpers import assert_same_numbers

GPT, MOE, VGG = MODELS["gpt"], MODELS["moe"], MODELS["vgg19"]


def _mesh(shape=(4,), names=("x",)):
    return rj.device_mesh(shape, names, jax.devices()[:math.prod(shape)])


BUILDERS = {  # ZeRO keeps small tensors replicated by default; the tiny models have only small ones
    "data parallel": B.data_parallel,
    "Megatron": B.megatron,
    "ZeRO-2": functools.partial(B.zero2, persistence_threshold=0),
    "ZeRO-3": functools.partial(B.zero3, persistence_threshold=0),
    "expert parallel": B.expert_parallel,
    "DP x TP": B.dp_x_tp,
}


@functools.lru_cache(maxsize=None)
def _lowered(model_name: str, method: str):
    model = MODELS[model_name]
    cfg = model.PRESETS["tiny"]
    mesh = _mesh((2, 2), ("data", "model")) if method == "DP x TP" else _mesh()
    step = model.make_train_step(cfg) if method == "rhino_jax" else BUILDERS[method](model, cfg, mesh)
    # The signatures are read off the program compiled here: plan for the CPU compiler's combiner
    # (a GPU's would merge the weights' all-gathers, and the search would then gather them).
    cluster = dataclasses.replace(rj.M8_V100, backend="cpu")
    return rj.parallelize(step, mesh=mesh, donate_argnums=(0, 1), cluster=cluster).lower(
        *model.example(cfg, abstract=True))


@functools.lru_cache(maxsize=None)
def _reference(model_name: str):
    model = MODELS[model_name]
    cfg = model.PRESETS["tiny"]
    # One device; LLVM optimizations off, they double the CPU compile time (as test_model_zoo).
    step = jax.jit(model.make_train_step(cfg), compiler_options={"xla_backend_optimization_level": 0})
    return step(*model.example(cfg))


def _param_shapes(model) -> set[str]:
    params = model.example(model.PRESETS["tiny"], abstract=True)[0]
    return {"f32[" + ",".join(map(str, x.shape)) + "]" for x in jax.tree.leaves(params)}


def _transposed(shape: str) -> str:
    """'f32[a,b]' -> 'f32[b,a]' (other ranks unchanged)."""
    dtype, dims = shape[:-1].split("[")
    parts = dims.split(",")
    return f"{dtype}[{','.join(reversed(parts))}]" if len(parts) == 2 else shape


CASES = [("gpt", "data parallel"), ("gpt", "Megatron"), ("gpt", "ZeRO-2"), ("gpt", "ZeRO-3"),
         ("moe", "expert parallel"), ("gpt", "DP x TP")]


@pytest.mark.parametrize("model_name,method", CASES)
def test_baseline_matches_one_device(model_name, method):
    model = MODELS[model_name]
    compiled = _lowered(model_name, method).compile()
    assert_same_numbers(_reference(model_name), compiled(*model.example(model.PRESETS["tiny"])))


def test_data_parallel_signature():
    """Gradients are all-reduced; no parameter is gathered, and every all-reduce carries gradients
    (or scalars). Activations may still be gathered where the pins leave the search free: see
    test_data_parallel_moves_only_gradients."""
    lowered = _lowered("gpt", "data parallel")
    assert all(s.is_replicated() for s, role in zip(lowered.plan.arg_specs, lowered.plan.arg_roles)
               if role in ("parameter", "optimizer_state"))
    stats = lowered.compile().collectives
    params = _param_shapes(GPT)
    # A weight gradient dW = dy^T x may be reduced before XLA transposes it to the weight's layout.
    grads = params | {_transposed(s) for s in params}
    reduced = [s for c in stats.collectives if c.kind == "all-reduce" for s in c.shapes]
    assert any(s in params for s in reduced), str(stats)
    assert all(s in grads or s in ("f32[]", "s32[]") for s in reduced), reduced
    moved = [s for c in stats.collectives if c.kind != "all-reduce" for s in c.shapes]
    assert not [s for s in moved if s in params], moved


def _forward_instructions(hlo_text: str) -> tuple[set[str], set[str]]:
    """(what the loss depends on, every instruction) in the ENTRY computation of a compiled step
    that returns the loss last: its forward pass told by structure. (The op names jax records,
    `jvp(...)` against `transpose(jvp(...))`, differ between jax versions for the same program.)"""
    comps, texts, entry = _computations(hlo_text)
    instrs = {i.name: i for i in comps[entry]}
    root = instrs[re.search(r"\bROOT\s+%?([\w.\-]+)", texts[entry]).group(1)]

    def operands(instr) -> list[str]:
        return [r for r in re.findall(r"%([\w.\-]+)", instr.operands) if r in instrs]

    assert root.opcode == "tuple" and operands(root), root
    loss = operands(root)[-1]
    assert instrs[loss].shape == "f32[]", instrs[loss]
    seen, todo = set(), [loss]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(operands(instrs[name]))
    return seen, set(instrs)


def test_megatron_signature():
    """Megatron: the weights are stored split, and the forward pass all-reduces the [B, S, D]
    activations after each row-split layer (attention output, MLP); no weight matrix moves in the
    forward pass (see the xfail test below for the backward pass and the biases)."""
    lowered = _lowered("gpt", "Megatron")
    plan = lowered.plan
    split = {p for p, s in zip(plan.arg_paths, plan.arg_specs) if p.startswith("arg[0]") and not s.is_replicated()}
    assert any(p.endswith("['fc1_w']") for p in split) and any(p.endswith("['proj_w']") for p in split), split
    compiled = lowered.compile()
    stats = compiled.collectives
    cfg = GPT.PRESETS["tiny"]
    hidden = f"f32[{cfg.batch},{cfg.seq_len},{cfg.d_model}]"
    forward_names, entry_names = _forward_instructions(compiled.as_text())
    assert all(c.name in entry_names for c in stats.collectives), str(stats)
    forward = [c for c in stats.collectives if c.name in forward_names]
    assert len([c for c in forward if c.kind == "all-reduce" and hidden in c.shapes]) == 2 * cfg.n_layers, str(stats)
    weights = {s for s in _param_shapes(GPT) if "," in s} - {f"f32[{cfg.vocab},{cfg.d_model}]"}  # wte: below
    assert not [s for c in forward if c.kind != "all-reduce" for s in c.shapes if s in weights], str(stats)


# Where the pins leave choices open, the tiny preset's plans deviate from the textbook signatures:
# the search gathers small activations in the backward pass (and, for Megatron, the 8 KiB
# vocabulary-split table before the lookup, cheaper under the cost model than the lookup's 16 KiB
# all-reduce): the cost model at 4-64 KiB, where latency dominates. (Not the ILP charging a value
# that several cones read once per cone: since hubs, `assembly.add_hubs`, the ILP's objective for
# Megatron equals the plan's own cost, and the plan is the same.) Not settled.
XFAIL_SMALL_GATHERS = pytest.mark.xfail(strict=False, reason=(
    "tiny preset: the backward pass gathers 16-64 KiB activations instead of keeping the pinned "
    "layouts (latency-dominated costs)"))


@XFAIL_SMALL_GATHERS
def test_megatron_gathers_no_parameter():
    stats = _lowered("gpt", "Megatron").compile().collectives
    gathered = [s for c in stats.collectives if c.kind in ("all-gather", "all-to-all") for s in c.shapes]
    assert not [s for s in gathered if s in _param_shapes(GPT)], gathered


def test_a_value_read_by_several_cones_is_moved_once():
    """Megatron's pins leave values (a gradient, an activation) read by several cones in one layout:
    the ILP moves each once, through its hub, as the plan does (it charged once per cone: the ILP's
    objective was 268.8 us for a plan of 255.7)."""
    plan = _lowered("gpt", "Megatron").plan
    assert plan.search_stats.hubs > 0
    assert plan.search_stats.objective_s == pytest.approx(plan.cost.total_s, rel=1e-6)


def test_data_parallel_moves_only_gradients():
    stats = _lowered("gpt", "data parallel").compile().collectives
    assert {c.kind for c in stats.collectives} == {"all-reduce"}, str(stats)


def test_zero_signatures():
    """ZeRO-2 shards the Adam moments only; ZeRO-3 also the parameters, which it all-gathers."""
    for method, params_sharded in (("ZeRO-2", False), ("ZeRO-3", True)):
        plan = _lowered("gpt", method).plan
        moments = [s for p, s in zip(plan.arg_paths, plan.arg_specs) if "['mu']" in p or "['nu']" in p]
        params = [s for p, s in zip(plan.arg_paths, plan.arg_specs) if p.startswith("arg[0]")]
        assert all(not s.is_replicated() for s in moments), method
        assert all(not s.is_replicated() for s in params) == params_sharded, method
        assert any(not s.is_replicated() for s in params) == params_sharded, method
    stats = _lowered("gpt", "ZeRO-3").compile().collectives
    gathered = {s for c in stats.collectives if c.kind == "all-gather" for s in c.shapes}
    big = {s for s in _param_shapes(GPT) if "," in s}  # the 2-D weights
    assert big & gathered, (sorted(big), sorted(gathered))


def test_expert_parallel_signature():
    """GShard: expert e's weights live on device e and the tokens travel there by all-to-all."""
    lowered = _lowered("moe", "expert parallel")
    plan = lowered.plan
    experts = [s for p, s in zip(plan.arg_paths, plan.arg_specs) if p.startswith("arg[0]") and "['experts']" in p]
    assert experts and all(s.dims[0] == ("x",) for s in experts)
    assert lowered.compile().collectives.count("all-to-all") > 0


def test_not_applicable_is_skipped():
    mesh = _mesh()
    assert B.BASELINES["expert parallel"].applies(GPT, mesh)
    assert B.BASELINES["DP x TP"].applies(GPT, mesh)
    assert B.BASELINES["DP + TP classifier"].applies(MODELS["unet"], mesh)
    with pytest.raises(B.NotApplicable):
        B.expert_parallel(GPT, GPT.PRESETS["tiny"], mesh)


def test_rhino_never_predicted_slower_than_a_baseline():
    """On one tiny model: the search's plan costs no more than any pinned
    expert plan under the same cost model (the pins only remove choices)."""
    ours = _lowered("gpt", "rhino_jax").plan.cost.total_s
    for method in ("data parallel", "Megatron", "ZeRO-2", "ZeRO-3"):
        theirs = _lowered("gpt", method).plan.cost.total_s
        assert ours <= theirs * (1 + 1e-9), (method, ours, theirs)
