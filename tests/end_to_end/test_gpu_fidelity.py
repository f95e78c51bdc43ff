"""Plans judged on what XLA's GPU compiler makes of them (described H100s, `rj.gpu_topology`):
the predicted collectives (count and bytes per kind, as GPU XLA combines them) within 10 % of the
compiled program's, the predicted memory within 15 % of XLA's buffer assignment, and the plan
priced from its GPU HLO as XLA's schedule runs it (communication overlapped with compute) no
slower than data parallel and FSDP compiled by plain `jax.jit` for the same devices. Users'
steps: the demo GPT, a Flax LM, a ViT, a Llama-style NNX decoder, a Mixtral-style MoE, in f32
and bf16, on (8,), (2, 4) and 2 hosts x 8.
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

import pytest

import rhino_jax as rj
from benchmarks.fixtures.hand_plans import compile_hand
from benchmarks.fixtures.third_party_models import CASES, Case
from rhino_jax.runtime.compiled.collectives import collective_stats
from rhino_jax.runtime.compiled.compiled_cost import price_compiled
from rhino_jax.search.cost.gemm_workspace import gemm_workspaces
from rhino_jax.models.gpt import GPTConfig, gpt_example, make_gpt_train_step
from helpers import _plugin_skip

pytestmark = pytest.mark.skipif(_plugin_skip() is not None, reason=_plugin_skip() or "")

MESHES = {"8": ((8,), ("data",), 1), "2x4": ((2, 4), ("data", "model"), 1), "2x8": ((2, 8), ("data", "model"), 2)}


def _demo_gpt() -> Case:
    cfg = GPTConfig(vocab=2048, seq_len=128, d_model=512, n_heads=8, n_layers=4, d_ff=2048, batch=16)
    return Case("gpt", "rhino_jax.models", make_gpt_train_step(cfg), gpt_example(cfg), ())


def _case(name: str) -> Case:
    return _demo_gpt() if name == "gpt" else CASES[name]()


def _mesh(key: str):
    shape, names, hosts = MESHES[key]
    return rj.device_mesh(shape, names, devices=rj.gpu_topology("h100", hosts=hosts))


def _within(predicted: float, compiled: float, tolerance: float, slack: float = 0.0) -> bool:
    return abs(compiled - predicted) <= max(tolerance * predicted, slack)


@functools.cache
def _planned(model: str, mesh: str):
    """(case, mesh, lowered, compiled): one search and compile per configuration, for every test
    of it. Tests that share one run in one pytest-xdist worker (`_shared`, `--dist loadgroup`)."""
    case, devices = _case(model), _mesh(mesh)
    lowered = rj.parallelize(case.step, mesh=devices).lower(*case.args)
    return case, devices, lowered, lowered.compile()


def _group(model: str, mesh: str):
    """The tests of a configuration that more than one test plans (`_planned`), in one worker."""
    return pytest.mark.xdist_group(f"{model}-{mesh}")


def _shared(model: str, mesh: str):
    return pytest.param(model, mesh, marks=_group(model, mesh))


@pytest.mark.parametrize("model, mesh", [
    ("gpt", "2x8"), _shared("linen_gpt", "2x4"), ("linen_bf16", "2x8"), ("vit", "8"),
    _shared("nnx_llama", "2x4"), ("nnx_llama_bf16", "2x8"), _shared("linen_moe", "8"),
])
def test_predicted_collectives_and_memory_match_the_gpu_compile(model, mesh):
    _, _, lowered, compiled = _planned(model, mesh)
    predicted, made = lowered.plan.collective_summary("gpu"), compiled.collectives.by_kind()
    assert any(n for n, _ in made.values()), "a plan that moves nothing checks nothing"
    for kind, (count, nbytes) in made.items():
        want_count, want_bytes = predicted.get(kind, (0, 0))
        # bytes: 10 %, or a few scalars (XLA sums the MoE's three scalar all-reduces into one of 2)
        assert _within(want_count, count, 0.10) and _within(want_bytes, nbytes, 0.10, slack=16), (
            f"{kind}: predicted {want_count} ops / {want_bytes} B, compiled {count} / {nbytes}")
    ratio = compiled.memory.total / lowered.plan.cost.memory_bytes
    assert 0.85 <= ratio <= 1.15, f"compiled / predicted memory {ratio:.2f}"


# Priced serially the bf16 Llama's plan on (8,) beat FSDP (0.834 against 0.838 ms); overlapped it
# is 0.6 % slower (0.790 against 0.785): beside FSDP's parameter gather and gradient scatters it
# all-gathers two f32 per-token tensors ([2, 128] pieces into [16, 128]) where FSDP all-reduces
# one scalar, and the compute waits for that gather (XLA's schedule has nothing to run beside it).
_PER_TOKEN_GATHER = pytest.mark.xfail(strict=True, reason="a per-token all-gather waited for, 0.6 % over FSDP")


@pytest.mark.parametrize("model, mesh", [_shared("linen_gpt", "2x4"), _shared("nnx_llama", "2x4"),
                                         pytest.param("nnx_llama_bf16", "8", marks=_PER_TOKEN_GATHER),
                                         ("linen_clip_adamw", "8"), ("linen_clip_adamw", "2x4")])
def test_the_plan_is_no_slower_than_data_parallel_or_fsdp_on_the_gpu_compile(model, mesh):
    """With clip_by_global_norm, GPU XLA sums the per-gradient partial norms before one all-reduce:
    the search priced each apart and chose data parallel, 1.14x FSDP's step. On (2, 4) it priced
    the bias gradients (reduces) as reduce-scattered over `model`, which XLA all-reduces over
    both axes, and chose a plan 1.16x FSDP's; and its windows, from the replicated plan, found
    nothing better than it before the time limit until they started from the coarse plan too.
    The bf16 Llama's plan is FSDP's collectives, but it priced 1.024x FSDP's: a pin between each
    weight gradient's dot and its transpose kept GPU XLA from folding the two, and the layouts
    it gave the dots instead added 12 transposes to the attention's backward pass."""
    case, mesh, _, compiled = _planned(model, mesh)
    ours = price_compiled(compiled, "8x-h100", dtype=case.dtype).overlapped_s
    for method in ("data parallel", "FSDP"):
        theirs = price_compiled(compile_hand(case, method, mesh), "8x-h100", dtype=case.dtype).overlapped_s
        assert ours <= theirs, f"{method}: {theirs * 1e3:.4f} ms, the plan {ours * 1e3:.4f} ms (overlapped)"


def test_a_reduces_partial_sums_are_all_reduced_over_both_axes_for_a_reader_split_on_one():
    """A bias gradient as the GPU compiles it: the sum over a batch split on `data` and a
    sequence split on `model`, read split on `model`. XLA all-reduces the whole sum over all 8
    devices and slices it (no reduce-scatter over `model`, unlike a dot's sums); the plan says
    so, in count, kind and bytes."""
    from jax.sharding import PartitionSpec as P

    def grad_bias(g):
        g = rj.annotate(g, P("data", "model", None))
        return rj.annotate(g.sum((0, 1)), P("model"))

    mesh = rj.device_mesh((2, 4), ("data", "model"), devices=rj.gpu_topology("h100"))
    lowered = rj.parallelize(grad_bias, mesh=mesh).lower(jnp.zeros((16, 128, 1024), jnp.float32))
    predicted, made = lowered.plan.collective_summary("gpu"), lowered.compile().collectives.by_kind()
    assert predicted == {"all-reduce": (1, 1024 * 4)}, predicted
    assert {k: v for k, v in made.items() if v[0]} == predicted, made


def test_the_predicted_memory_counts_the_split_k_temporaries_of_gemms():
    """A GEMM whose result has few tiles for the GPU is split along its contraction (split-K): its
    partial products take a temporary of split x the result beside it. Here each device's
    [1024, 512] x [512, 256] f32 GEMM is split 4 ways: 4 MiB beside a 1 MiB result, the larger
    part of the step's memory, counted by compiling the GEMM alone for the plan's device."""
    mesh = rj.device_mesh((8,), ("data",), devices=rj.gpu_topology("h100"))

    def step(w, x):
        return jnp.mean(jnp.tanh(x @ w))

    w = jnp.zeros((512, 256), jnp.float32)
    x = jnp.zeros((8 * 1024, 512), jnp.float32)
    lowered = rj.parallelize(step, mesh=mesh).lower(w, x)
    plan = lowered.plan
    assert plan.arg_specs[1].dims[0] == ("data",), "the batch is split: each device multiplies [1024, 512]"
    graph = lowered.graph
    measured = gemm_workspaces(graph, plan.value_specs, plan.read_specs, dict(plan.mesh_axes),
                               mesh.devices.flat[0])
    assert list(measured.values()) == [4 * 1024 * 256 * 4]
    ratio = lowered.compile().memory.total / plan.cost.memory_bytes
    assert 0.85 <= ratio <= 1.15, f"compiled / predicted memory {ratio:.2f}"


@_group("linen_moe", "8")
def test_a_cumsum_for_gpus_keeps_its_rows_split_and_is_not_a_loop():
    """For a GPU jax lowers jnp.cumsum to a chlo.scan (the CPU gets a reduce_window): it has a
    rule too, so an MoE router's slot count keeps its split rows, and XLA's GPU partitioner moves
    nothing for it (a Mixtral-style step on described H100s has no fallback op either). Its init
    is left unpinned: XLA's GPU compiler makes a scan whose init is a plain constant a tree of
    reduce-windows, and a pinned one a loop of one kernel chain per element (the Mixtral-style
    step's plan ran 2399 kernels where FSDP's program ran 358)."""
    from jax.sharding import PartitionSpec as P

    def count_slots(logits):
        logits = rj.annotate(logits, P("data", None))
        return jnp.sum(jnp.cumsum(logits, axis=-1) * logits)

    mesh = rj.device_mesh((8,), ("data",), devices=rj.gpu_topology("h100"))
    lowered = rj.parallelize(count_slots, mesh=mesh).lower(jnp.zeros((64, 512), jnp.float32))
    assert any(n.op == "chlo.scan" for n in lowered.graph.nodes) and lowered.plan.fallback_ops == ()
    compiled = lowered.compile()
    moved = [c for c in compiled.collectives.collectives if c.bytes > 64]
    assert not moved, moved  # the sum's scalar only
    assert " while(" not in compiled.as_text()
    _, _, moe, moe_compiled = _planned("linen_moe", "8")
    assert moe.plan.fallback_ops == ()
    assert " while(" not in moe_compiled.as_text()


@pytest.mark.parametrize("mesh", ["8", "2x4"])
def test_a_scanned_attentions_hoisted_mask_is_not_carried_at_the_global_batch(mesh):
    """jax's scan passes the causal mask and the -1e9 of a masked softmax, broadcast to the
    scores' [batch, heads, seq, seq], into the loop as values its body hands back unchanged. The
    loop carried them as buffers the search gave no cost, laid out replicated: the GPU compile
    held the global-batch tensors on every device and sliced them each trip (2.5 TiB per device
    for a scanned Llama-70B step planned at 20 GiB). Built in the body instead, each is made in
    its reader's layout, inside its fusion, and the predicted memory is the compiled one's."""
    from helpers import scanned_attention_step

    batch, heads, seq, head_dim = 32, 8, 128, 32
    args = (jax.ShapeDtypeStruct((2, heads * head_dim, heads * head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, seq, heads * head_dim), jnp.float32))
    lowered = rj.parallelize(scanned_attention_step(batch, heads, seq, head_dim), mesh=_mesh(mesh)).lower(*args)
    assert lowered.plan.arg_specs[1].dims[0], "the batch is split"
    compiled = lowered.compile()
    assert f"[{batch},{heads},{seq},{seq}]" not in compiled.as_text()
    ratio = compiled.memory.total / lowered.plan.cost.memory_bytes
    assert 0.85 <= ratio <= 1.15, f"compiled / predicted memory {ratio:.2f}"


@pytest.mark.parametrize("micro_batches, batch, limit_mib", [(1, 16, 22), (2, 32, 20)])
def test_a_plan_xlas_gpu_schedule_takes_past_the_limit_is_tied_to_its_order(micro_batches, batch, limit_mib):
    """XLA's GPU schedulers reorder a step past its planned memory: they gather split weights
    early and run weight-gradient GEMMs late, beside the optimizer update, keeping their inputs
    live across layers. This 4-layer Llama-style step (its gradients reduce-scattered, its
    updates gathered) compiles to 23.5 MiB per device, past the 22 MiB limit it was planned
    under. There compile() ties the program to its order (`hlo_passes.program_order`), which
    brings it to 10.6 MiB with the latency-hiding scheduler kept, and says so; asked for the
    scheduler, it keeps it too. Under a limit no program meets (a third of it), it also drops
    the scheduler (10.2 MiB) and says the step will not fit. On CPUs nothing is compiled twice
    (`test_memory_limit::test_a_cpu_compile_is_not_held_to_the_limit`)."""
    from benchmarks.fixtures.llama import Shape, llama_step
    from rhino_jax.runtime.compiled.memory import compiled_memory
    from rhino_jax.runtime.executable import LATENCY_HIDING

    def biggest(compiled) -> int:
        programs = getattr(compiled, "programs", {"step": compiled})
        return max(compiled_memory(getattr(p, "_executable", p)).total for p in programs.values())

    step, shapes = llama_step(Shape(128, 4, 1, 1, 320, vocab=1024), seq=128)
    limit = limit_mib << 20
    lowered = rj.parallelize(step, mesh=_mesh("8"), memory_limit_bytes=limit, donate_argnums=(0, 1),
                             num_micro_batches=micro_batches, progress=False).lower(*shapes(batch))
    assert lowered.plan.cost.memory_bytes <= limit
    kept_tied = (r"\(as planned: [\d.]+ MiB, [\d.]+ ms; tied to the program's order: [\d.]+ MiB, [\d.]+ ms\); "
                 r"kept: tied to the program's order, its step priced [\d.]+ ms against [\d.]+ ms as planned "
                 r"\(\+[\d.]+%\)\.$")
    with pytest.warns(rj.CompiledMemoryWarning, match=kept_tied):
        compiled = lowered.compile()
    assert biggest(compiled) <= limit
    with pytest.warns(rj.CompiledMemoryWarning, match=kept_tied):
        scheduled = lowered.compile(compiler_options={LATENCY_HIDING: True})
    assert biggest(scheduled) <= limit
    if micro_batches > 1:
        return  # the path below is the same for every program
    lowered.memory_limit_bytes = limit // 3
    with pytest.warns(rj.CompiledMemoryWarning,
                      match=f"tied to the program's order: .*; tied to the program's order and {LATENCY_HIDING}=False: "
                            ".*will not fit"):
        smallest = lowered.compile(compiler_options={})  # options: compiled anew, not the cached program
    assert biggest(smallest) > limit // 3


def test_a_plan_past_the_limit_keeps_the_latency_hiding_scheduler_held_to_it_where_that_is_fastest():
    """Each remedy costs step time, priced from its compiled program as its schedule runs, and
    compile() keeps the fastest that fits. The step above on H100s described with 40 MiB each (so
    that MiBs are a share of the device XLA's slop factor can name), under 15 MiB: as planned
    23.5 MiB; tied to the program's order 10.6 MiB at +15 % step time; XLA's latency-hiding
    scheduler held to the limit by its memory budget (`xla_gpu_memory_limit_slop_factor`, aimed
    again once it overshot) 13.8 MiB at +2 %. The held program is kept: under the limit, slower
    than the program as planned and faster than the tied one."""
    import dataclasses
    import re
    import warnings

    from jax.experimental import topologies

    from benchmarks.fixtures.llama import Shape, llama_step
    from rhino_jax.gpu_topology import H100_SXM
    from rhino_jax.runtime.executable import SLOP, Weights, compile_module, tied_to_order

    small = dataclasses.replace(H100_SXM, memory_bytes=40 << 20)
    topology = topologies.get_topology_desc(platform="cuda", target_config=small.target_config(), topology="1x1x8")
    mesh = rj.device_mesh((8,), ("data",), devices=sorted(topology.devices, key=lambda d: d.id))
    cluster = dataclasses.replace(rj.H100_8X, memory_per_device=40 << 20)
    step, shapes = llama_step(Shape(128, 4, 1, 1, 320, vocab=1024), seq=128)
    limit = 15 << 20
    lowered = rj.parallelize(step, mesh=mesh, cluster=cluster, memory_limit_bytes=limit, donate_argnums=(0, 1),
                             progress=False).lower(*shapes(16))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", rj.CompiledMemoryWarning)
        compiled = lowered.compile()
    message = str(said[-1].message)
    assert re.search(rf"kept: its latency-hiding scheduler held to the limit \({SLOP}=\d+\), its step priced", message)
    assert compiled.memory.total <= limit

    def priced(program) -> float:
        return price_compiled(program, cluster).overlapped_s

    ins, outs = jax.tree.leaves(lowered.plan.input_shardings), jax.tree.leaves(lowered.plan.output_shardings)
    planned = compile_module(lowered._step.lowered, lowered._rewritten(), ins, outs)
    tied = compile_module(lowered._step.lowered, tied_to_order(lowered._rewritten(), Weights.of(
        lowered.plan.arg_roles, lowered.plan.arg_specs)), ins, outs)
    assert priced(planned) < priced(compiled._executable) < priced(tied)

@pytest.fixture(scope="module")
def deep_step():
    """A 6-layer Llama-like step planned on (8,) under 100 MiB per device (its XLA schedule
    takes 98.8 MiB; tied to the program's order 35.6), compiled under 95 MiB: (the plan, the
    compiled step, what compile() said). Its tests run in one worker (`_DEEP`)."""
    import warnings

    from benchmarks.fixtures.llama import Shape, llama_step

    step, shapes = llama_step(Shape(512, 6, 4, 2, 1024, vocab=1024), seq=32)
    lowered = rj.parallelize(step, mesh=_mesh("8"), memory_limit_bytes=100 << 20, donate_argnums=(0, 1),
                             progress=False).lower(*shapes(8))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", rj.CompiledMemoryWarning)
        compiled = dataclasses.replace(lowered, memory_limit_bytes=95 << 20, _compiled=None).compile()
    return lowered.plan, compiled, [str(w.message) for w in said if w.category is rj.CompiledMemoryWarning]


_DEEP = pytest.mark.xdist_group("deep_step")


@_DEEP
def test_a_deep_step_over_the_limit_in_xlas_schedule_is_tied_to_the_programs_order(deep_step):
    _, compiled, said = deep_step
    assert len(said) == 1 and "kept: tied to the program's order" in said[0], said
    assert compiled.memory.total <= 95 << 20


@_DEEP
def test_a_deep_steps_tied_program_gathers_its_layers_apart(deep_step):
    """Tied to the program's order, XLA gathers each layer's weights apart, while the layer
    before computes: the forward's, and those the plan reads whole at `jax.checkpoint`'s barrier
    before a layer's backward (f32 here). Before, the ties' barriers lost the activation they
    waited for (XLA drops a barrier result no one reads, its operand with it), the reads at
    jax's barrier were not tied, and XLA's combiner merged the six layers' gathers into three ops
    at the program's start: tied, the step held 101.3 MiB."""
    plan, compiled, _ = deep_step
    layer = sum(4 * math.prod(shape) for path, shape in zip(plan.arg_paths, plan.arg_shapes)
                if "['layers'][0]" in path)  # one layer's f32 weights
    gathers = [c.bytes for c in collective_stats(compiled.as_text()).collectives if c.kind == "all-gather"]
    assert len(gathers) >= 2 * 6, gathers
    assert max(gathers) < 1.5 * layer, (max(gathers), layer)


@_DEEP
def test_a_deep_steps_memory_is_counted_as_xla_holds_it(deep_step):
    """Tied to the program's order, the 6-layer step of `deep_step` within 15 % of XLA's count.
    XLA's partitioner sums a weight gradient's partial products in the GEMM that makes them (a
    reduce-scatter right after it), so each layer's gradient waits for the optimizer split, not
    whole: counted whole until the optimizer read it, the step was predicted at 95 MiB per device
    where XLA makes 80, a 32-layer 70B-wide step at 79.5 GiB where XLA makes 37
    (benchmarks/results/memory_depth.md). And `jax.checkpoint`'s barrier hands on its operands'
    buffers: counted as buffers of their own, the weights this plan reads whole there were held
    twice (42.8 MiB predicted, 35.6 compiled)."""
    plan, compiled, _ = deep_step
    assert any(s.dims[0] == ("data",) for s, role in zip(plan.arg_specs, plan.arg_roles)
               if role == "parameter" and s.dims), "some weights are split: their gradients are reduce-scattered"
    ratio = compiled.memory.total / plan.cost.memory_bytes
    assert 0.9 <= ratio <= 1.15, f"compiled / predicted memory {ratio:.2f}"
