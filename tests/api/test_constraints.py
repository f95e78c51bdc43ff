"""rj.op_trans: the user constrains the search space (nnScaler's op-trans), the search obeys it,
the plan runs with one device's numbers, and a constraint that names nothing or leaves an op no
strategy is an error that says what to change."""
import re

import flax.linen as nn
import jax
import optax
import pytest
from jax.sharding import PartitionSpec as P

import rhino_jax as rj
from rhino_jax.errors import ScheduleError, StagingError

from benchmarks.fixtures.third_party_models import linen_gpt
from helpers import _readme_example, assert_same_adam_step, assert_same_numbers

BATCH, SEQ, VOCAB, WIDTH, HEADS = 8, 16, 64, 32, 4
LR = 1e-3
ATTENTION = "*MultiHeadDotProductAttention_*"


class Block(nn.Module):
    """A pre-LN transformer block (4 heads of 8). The attention has no biases: its key bias gets
    no gradient, and Adam would scale the rounding noise of that zero into an update."""

    @nn.compact
    def __call__(self, x):
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, use_bias=False, deterministic=True)(nn.LayerNorm()(x))
        return x + nn.Dense(WIDTH)(nn.gelu(nn.Dense(4 * WIDTH)(nn.LayerNorm()(x))))


class AttentionLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, WIDTH)(tokens)
        for _ in range(2):
            x = Block()(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def _step_and_args():
    model = AttentionLM()
    tokens = jax.random.randint(jax.random.PRNGKey(1), (BATCH, SEQ + 1), 0, VOCAB)
    params = model.init(jax.random.PRNGKey(0), tokens[:, :-1])["params"]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(LR))

    def step(params, opt_state, tokens):
        def loss_fn(p):
            logits = model.apply({"params": p}, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), tokens)


@pytest.fixture(scope="module")
def lm():
    step, args = _step_and_args()
    return step, args, jax.jit(step)(*args)


def _mesh():
    return rj.device_mesh((2, 4), ("data", "model"))


def _kernels(plan):
    """(path, spec) of every attention kernel and its optimizer moments in `plan.input_shardings`."""
    return [(jax.tree_util.keystr(p), s.spec) for p, s in jax.tree_util.tree_flatten_with_path(plan.input_shardings)[0]
            if "MultiHeadDotProductAttention" in jax.tree_util.keystr(p) and "kernel" in jax.tree_util.keystr(p)]


def test_the_readme_constraints_split_attention_by_heads(lm, tmp_path):
    """The README's constraints: every attention kernel (and its Adam moments, which the same
    globs name) split four ways along its heads dim and nowhere else (q/k/v kernels are (width,
    heads, head dim), the output projection's (heads, head dim, width)); the forward query
    projections split their heads dim; the blocks' MLPs whole."""
    step, args, reference = lm
    lowered = _readme_example(0, step, _mesh())["step"].lower(*args)
    plan, graph = lowered.plan, lowered.graph
    kernels = _kernels(plan)
    assert len(kernels) == 2 * 4 * 3  # 2 blocks x q, k, v, out x the parameter and Adam's two moments
    for path, spec in kernels:
        heads_dim = 0 if "['out']" in path else 1
        split = [d for d, axes in enumerate(spec) if axes]
        assert split == [heads_dim], (path, spec)
        assert spec[heads_dim] in ("model", ("model",)), (path, spec)  # four ways on (2, 4): 'model'
    forward = [(n.name, plan.value_specs[r]) for n in graph.nodes if (n.name or "").startswith("jvp(")
               for r in n.results if r in plan.value_specs and graph.values[r].shape]
    queries = [(n, spec) for n, spec in forward if "/query/" in n]
    assert queries and all([d for d, a in enumerate(spec.dims) if a] in ([], [len(spec.dims) - 2])
                           for _, spec in queries), queries
    mlps = [(n, spec) for n, spec in forward if "/Block_" in n and "/Dense_" in n]
    assert mlps and not any(spec.used_axes() for _, spec in mlps), mlps
    assert "op_trans" in plan.report()
    # why: its one allowed layout is the one it has, so no alternative is searched
    kernel = "[0]['Block_0']['MultiHeadDotProductAttention_0']['query']['kernel']"
    why = plan.explain(kernel)
    assert why.alternatives == () and "none: the constraints allow it none of its" in str(why)
    plan.save(tmp_path / "plan.json")
    assert rj.Plan.load(tmp_path / "plan.json").constrained() == plan.constrained() != {}
    assert_same_adam_step(reference, lowered.compile()(*args), lr=LR)  # an AdamW step: parameters to lr/4


def test_forward_ops_take_only_the_allowed_result_dims(lm):
    """The forward query projections ((batch, seq, heads, head dim)) split their heads dim four
    ways; the MLP's forward ops split eight ways (`parts`), or are kept whole (`replicate`)."""
    step, args, reference = lm
    free = rj.parallelize(step, mesh=_mesh(), progress=False).lower(*args).plan
    query = rj.op_trans(f"jvp(*){ATTENTION}/query/*", dims=-2, parts=4)
    mlp = "jvp(*)/Block_*/Dense_*/*"

    def lower(*constraints):
        return rj.parallelize(step, mesh=_mesh(), constraints=list(constraints), progress=False).lower(*args)

    def results(lowered, *parts: str):
        graph, plan = lowered.graph, lowered.plan
        found = [(n.name, plan.value_specs[r]) for n in graph.nodes
                 if (n.name or "").startswith("jvp(") and all(p in n.name for p in parts)
                 for r in n.results if r in plan.value_specs and graph.values[r].shape]
        assert found, parts
        return found

    split = lower(query, rj.op_trans(mlp, parts=8))
    for name, spec in results(split, "/query/"):
        rank = len(spec.dims)
        assert [d for d, axes in enumerate(spec.dims) if axes] == [rank - 2] and not spec.partial, (name, spec)
        assert spec.shard_factor(split.plan.mesh_axes) == 4, (name, spec)
    for name, spec in results(split, "/Block_", "/Dense_"):
        assert len(spec.used_axes()) == 2, (name, spec)  # both axes: eight parts
    whole = lower(query, rj.op_trans(mlp, replicate=True))
    for name, spec in results(whole, "/Block_", "/Dense_"):
        assert not spec.used_axes(), (name, spec)
    for lowered in (split, whole):
        assert lowered.plan.cost.total_s >= free.cost.total_s * (1 - 1e-9)  # a smaller space is never better
        assert_same_adam_step(reference, lowered.compile()(*args), lr=LR)


def test_constraints_combine_with_pins():
    """A pin (rj.annotate, named "w") and a constraint on the op it pins: the pin's layout must be
    one the constraint allows, else the error names both."""
    def step(w, x):
        w = rj.annotate(w, P("model", None), name="w")
        return (x @ w).sum()

    args = (jax.numpy.ones((64, 32)), jax.numpy.ones((16, 64)))
    allowed = rj.parallelize(step, mesh=_mesh(), constraints=[rj.op_trans("w/*", dims=0)], progress=False)
    lowered = allowed.lower(*args)
    (pin,) = lowered.graph.pins
    assert lowered.plan.value_specs[pin.value].dims == (("model",), ())
    assert_same_numbers(jax.jit(step)(*args), lowered.compile()(*args))
    refused = rj.parallelize(step, mesh=_mesh(), constraints=[rj.op_trans("w/*", replicate=True)], progress=False)
    with pytest.raises(rj.ConstraintError, match=r"op_trans\('w/\*', replicate=True\) leaves node "
                                                 r"'w/sharding_constraint'.*beside its rj.annotate pin"):
        refused.lower(*args)


def test_a_constraint_that_leaves_no_strategy_names_the_op_and_itself(lm):
    step, args, _ = lm
    three = rj.op_trans(f"jvp(*){ATTENTION}/query/*", parts=3)  # no split of 8 devices is 3 parts
    with pytest.raises(rj.ConstraintError, match=r"op_trans\(.*parts=\(3,\)\) leaves node 'jvp\(AttentionLM\)/"
                                                 r"Block_0/MultiHeadDotProductAttention_0/query/.*no strategy"):
        rj.parallelize(step, mesh=_mesh(), constraints=[three], progress=False).lower(*args)


def test_a_dim_past_the_result_of_all_a_constraint_names_is_refused(lm):
    """dims=5 on rank-2 kernels (and their Adam moments) would keep them whole, unseen."""
    step, args, _ = lm
    past = rj.op_trans("*Dense_0*kernel*", dims=5)
    with pytest.raises(rj.ConstraintError, match=r"op_trans\('\*Dense_0\*kernel\*', dims=\(5,\)\): dim 5 is past .*"
                                                 r"argument arg\[0\]\['Block_0'\]\['Dense_0'\]\['kernel'\], of shape "
                                                 r"\(128, 32\).*give dims d with -2 <= d < 2"):
        rj.parallelize(step, mesh=_mesh(), constraints=[past], progress=False).lower(*args)


def test_a_dim_that_only_some_of_what_a_glob_names_has_is_kept():
    """A glob naming a weight matrix, its bias and the input: dims=1, the matrices' last dim, plans
    (the bias, which has no dim 1, stays whole); dims=2, no one's, is refused."""
    def step(w, b, x):
        return jax.numpy.tanh(x @ w + b).sum()

    args = (jax.numpy.ones((32, 64)), jax.numpy.ones((64,)), jax.numpy.ones((16, 32)))

    def lower(dims):
        return rj.parallelize(step, mesh=_mesh(), constraints=[rj.op_trans("arg[?]", dims=dims)],
                              progress=False).lower(*args)

    assert not any(lower(1).plan.input_shardings[1].spec)
    with pytest.raises(rj.ConstraintError, match=r"dim 2 is past .*argument arg\[0\], of shape \(32, 64\)"):
        lower(2)


def test_a_number_of_parts_no_split_of_the_devices_makes_is_refused(lm):
    """16 parts of 8 devices would be dropped beside 4, unseen."""
    step, args, _ = lm
    with pytest.raises(rj.ConstraintError, match=r"parts=\(4, 16\)\): no split of the step's 8 devices is 16 parts; "
                                                 r"give numbers of parts that divide 8 \(1, 2, 4, 8\)"):
        rj.parallelize(step, mesh=_mesh(), constraints=[rj.op_trans(ATTENTION, parts=(4, 16))],
                       progress=False).lower(*args)


def test_a_constraint_that_names_nothing_is_refused(lm):
    step, args, _ = lm
    typo = rj.op_trans("*MultiHeadAttention*", replicate=True)
    with pytest.raises(rj.ConstraintError, match=r"names no op or argument of the step.*jvp\(AttentionLM\)/"):
        rj.parallelize(step, mesh=_mesh(), constraints=[typo], progress=False).lower(*args)


@pytest.mark.parametrize("how", [dict(mesh=_mesh(), num_micro_batches=2), dict(devices=jax.devices()[:4])],
                         ids=["micro-batches", "mesh=None"])
def test_a_constraint_that_names_nothing_is_refused_before_searching(lm, how):
    step, args, _ = lm
    typo = rj.op_trans("*Attention_9/*", replicate=True)
    with pytest.raises(rj.ConstraintError, match="names no op or argument"):
        rj.parallelize(step, constraints=[typo], progress=False, **how).lower(*args)


def test_op_assign_moves_a_block_to_the_stage_it_names(lm):
    """The stager alone puts the second block (partly) on stage 1; the README's op_assign puts it
    on stage 0, its parameters on stage 0's devices, with the balance relaxed as far as that needs
    (the report says so), and the step keeps one device's numbers."""
    step, args, reference = lm
    free = rj.parallelize(step, mesh=_mesh(), pipeline=2, num_micro_batches=4, progress=False).lower(*args)

    def stage_of_block_1(plan):
        devices = [set(st.devices) for st in plan.stages]
        return {devices.index({d.id for d in s.device_set}) for p, s in
                jax.tree_util.tree_flatten_with_path(plan.input_shardings[0])[0] if "Block_1" in jax.tree_util.keystr(p)}

    assert 1 in stage_of_block_1(free.plan), "the stager puts it on stage 0 by itself: no check"
    moved = _readme_example(1, step, _mesh())["step"].lower(*args)
    assert stage_of_block_1(moved.plan) == {0}
    assert "balance relaxed" in moved.plan.report()
    assert_same_adam_step(reference, moved.compile()(*args), lr=LR)


def test_with_pipeline_auto_op_assign_rules_out_the_spmd_candidate(lm):
    step, args, _ = lm
    lowered = rj.parallelize(step, mesh=_mesh(), constraints=[rj.op_assign("*Block_1/*", stage=1)], pipeline="auto",
                             num_micro_batches=2, progress=False).lower(*args)
    assert len(lowered.plan.stages) == 2
    assert re.search(r"SPMD only, 2 micro-batches \(infeasible: op_assign\('\*Block_1/\*', stage=1\) is about "
                     r"pipeline stages", lowered.plan.report())


def test_op_assign_takes_the_ops_its_layer_feeds_in_its_segment():
    """A GPT whose blocks make their causal mask and residual adds: block1 put on stage 0 takes
    the unnamed ops it feeds inside its segments along, so the stage graph stays a DAG (it made a
    cycle when only the named ops moved)."""
    case = linen_gpt()
    lowered = rj.parallelize(case.step, mesh=_mesh(), constraints=[rj.op_assign("*block1/*", stage=0)],
                             pipeline=2, num_micro_batches=4, progress=False).lower(*case.args)
    plan = lowered.plan
    stage0 = set(plan.stages[0].devices)
    for path, sharding in jax.tree_util.tree_flatten_with_path(plan.input_shardings[0])[0]:
        if "'block1'" in jax.tree_util.keystr(path):
            assert {d.id for d in sharding.device_set} == stage0, jax.tree_util.keystr(path)


def test_op_assign_errors_say_what_to_change(lm):
    step, args, _ = lm

    def lower(*constraints, pipeline=2):
        return rj.parallelize(step, mesh=_mesh(), constraints=list(constraints), pipeline=pipeline,
                              num_micro_batches=2, progress=False).lower(*args)

    with pytest.raises(StagingError, match=r"no ops in the backward of stage 0: op_assign\('\*Block_0/\*', "
                                              r"stage=1\) leaves that stage too little"):
        lower(rj.op_assign("*Block_0/*", stage=1))  # stage 0 keeps the embedding, whose gradient is stage 1's
    with pytest.raises(rj.ConstraintError, match=r"stages 0\.\.1; assign to one of them"):
        lower(rj.op_assign("*Block_1/*", stage=2))
    with pytest.raises(rj.ConstraintError, match="and op_assign.*put .* on two stages"):
        lower(rj.op_assign("*Block_1/*", stage=0), rj.op_assign("*Block_*/*", stage=1))
    with pytest.raises(rj.ConstraintError, match="names no op of the forward pass"):
        lower(rj.op_assign("transpose(*", stage=0))
    with pytest.raises(rj.ConstraintError, match=r"is about pipeline stages.*pass pipeline=2"):
        lower(rj.op_assign("*Block_1/*", stage=0), pipeline="off")


def test_op_order_derives_the_schedule_the_stages_run(lm, tmp_path):
    """1F1B written as ordering constraints (the README's) plans and runs as schedule='1f1b' does; "every
    forward before any backward" holds every micro-batch at once, as GPipe; a saved plan keeps
    its derived schedule."""
    step, args, reference = lm

    def lower(constraints, **options):
        return rj.parallelize(step, mesh=_mesh(), constraints=constraints, pipeline=2, num_micro_batches=4,
                              progress=False, **options).lower(*args)

    made = lower([])
    example = _readme_example(2, step, _mesh())
    derived = example["step"].lower(*args)
    assert derived.plan.schedule().order == made.plan.schedule().order
    assert derived.plan.cost == made.plan.cost
    assert "op_order" in derived.plan.report()
    assert_same_adam_step(reference, derived.compile()(*args), lr=LR)

    def forwards_first(p, m):  # GPipe: each pass in micro-batch order, the last forward before the first backward
        return [(rj.Task(kind, s, k), rj.Task(kind, s, k + 1)) for s in range(p) for k in range(m - 1) for kind in "FB"
                ] + [(rj.Task("F", s, m - 1), rj.Task("B", s, 0)) for s in range(p)]

    flush = lower([rj.op_order(forwards_first)])
    assert [st.in_flight for st in flush.plan.stages] == [4, 4]
    assert [st.in_flight for st in made.plan.stages] == [2, 1]
    flush.plan.save(tmp_path / "plan.json")
    again = rj.parallelize(step, mesh=_mesh(), pipeline=2, num_micro_batches=4, constraints=[rj.op_order(forwards_first)],
                           plan=str(tmp_path / "plan.json")).lower(*args)
    assert again.plan.schedule() == flush.plan.schedule()
    assert_same_adam_step(reference, again.compile()(*args), lr=LR)
    with pytest.raises(ValueError, match=r"pass .*constraints=\[rj.op_order\(\.\.\.\)\] \(got schedule='1f1b'\)"):
        rj.parallelize(step, mesh=_mesh(), pipeline=2, num_micro_batches=4, plan=str(tmp_path / "plan.json")).lower(*args)


def test_op_order_errors_say_what_to_change(lm):
    step, args, _ = lm

    def lower(*constraints, **options):
        return rj.parallelize(step, mesh=_mesh(), constraints=list(constraints), num_micro_batches=2,
                              progress=False, **dict(dict(pipeline=2), **options)).lower(*args)

    with pytest.raises(ScheduleError, match="unable to run"):
        lower(rj.op_order(lambda p, m: [(rj.Task("B", 0, 0), rj.Task("F", 0, 0))]))
    with pytest.raises(rj.ConstraintError, match="must return or yield pairs"):
        lower(rj.op_order(lambda p, m: None))
    with pytest.raises(rj.ConstraintError, match="is about pipeline stages"):
        lower(rj.op_order(lambda p, m: []), pipeline="off")
    with pytest.raises(rj.ConstraintError, match="schedule='gpipe' and rj.op_order"):
        lower(rj.op_order(lambda p, m: []), schedule="gpipe")


@pytest.mark.parametrize("make, message", [
    (lambda: rj.op_trans("", replicate=True), "non-empty glob"),
    (lambda: rj.op_trans("*Dense*"), "constrains nothing"),
    (lambda: rj.op_trans("*Dense*", dims=0, replicate=True), "drop dims and parts"),
    (lambda: rj.op_trans("*Dense*", dims="heads"), "dims must be an int"),
    (lambda: rj.op_trans("*Dense*", parts=(0, 2)), r"parts must be .* >= 1"),
    (lambda: rj.op_trans("*Dense*", replicate="yes"), "replicate must be True or False"),
    (lambda: rj.op_assign("*Dense*", stage="every"), r"stage must be an int >= 0 .* or 'all'"),
    (lambda: rj.op_assign("*Dense*", stage=-1), "stage must be an int >= 0"),
    (lambda: rj.op_order([(rj.Task("F", 0, 0), rj.Task("F", 0, 1))]), "takes a rule"),
    (lambda: rj.parallelize(lambda x: x, mesh=_mesh(), constraints="*Dense*"), "list of rj.op_trans"),
    (lambda: rj.parallelize(lambda x: x, mesh=_mesh(), constraints=[("*Dense*", 0)]), "list of rj.op_trans"),
])
def test_bad_constraints_say_what_to_change(make, message):
    with pytest.raises(rj.ConstraintError, match=message):
        make()


def test_a_module_glob_names_the_ops_of_the_jax_functions_it_calls():
    """jax lowers `jnp.take` (nn.Embed's lookup) to a function of its own, whose ops it names
    from that function's scope ("gather"); inlined, they are named under the call, so that
    "*Embed_0/*" names the lookup's gather as it names the module's other ops."""
    from rhino_jax.hlo_passes.importer import import_module
    from rhino_jax.hlo_passes.lowering import lower_on_mesh

    model = nn.Embed(VOCAB, WIDTH)
    tokens = jax.numpy.zeros((BATCH, SEQ), jax.numpy.int32)
    params = model.init(jax.random.PRNGKey(0), tokens)

    def loss(p, t):
        return model.apply(p, t).sum()

    lowered = lower_on_mesh(jax.grad(loss), (params, tokens), _mesh(), ())
    graph = import_module(lowered.module, lowered.arg_paths, lowered.arg_roles, lowered.output_paths)
    gathers = [n.name for n in graph.nodes if n.op == "stablehlo.gather"]
    scatters = [n.name for n in graph.nodes if n.op == "stablehlo.scatter"]
    assert gathers and scatters
    assert all(rj.op_assign("*Embed*", stage="all").matches((name,)) for name in gathers + scatters), gathers + scatters
