"""Pipeline stage programs: compute-gradients of one micro-batch cut into a forward and a backward
program per stage; run in a micro-batch's order they give compute-gradients' sums."""
import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import rhino_jax as rj
from rhino_jax.hlo_passes import micro_batch, stages
from rhino_jax.hlo_passes.importer import import_module
from rhino_jax.hlo_passes.lowering import lower_on_mesh
from rhino_jax.models import gpt, make_mlp_train_step, mlp_example
from rhino_jax.runtime.executable import compile_program
from rhino_jax.search.staging import stager

MODELS = {"mlp": lambda: (make_mlp_train_step(), mlp_example((16, 32, 32, 32, 16), 8)),
          "gpt": lambda: (gpt.make_gpt_train_step(dataclasses.replace(gpt.GPT_TINY, n_layers=4)),
                          gpt.gpt_example(dataclasses.replace(gpt.GPT_TINY, n_layers=4)))}


def _stage_programs(step, args, n_stages, mesh, k=2):
    """compute-gradients of one of k micro-batches cut into n_stages: (its graph, its module,
    the programs, the micro-batch's arguments)."""
    whole = lower_on_mesh(step, args, mesh, ())
    leaves, tree = jax.tree.flatten(args)
    micro = [x[: x.shape[0] // k] if r == "batch" else x for x, r in zip(leaves, whole.arg_roles)]
    one = lower_on_mesh(step, jax.tree.unflatten(tree, micro), mesh, ())
    graphs = [import_module(s.module, s.arg_paths, s.arg_roles, s.output_paths) for s in (whole, one)]
    parts = micro_batch.split(whole.module, graphs[0], one.module, graphs[1])
    cg = import_module(parts.compute, whole.arg_paths, whole.arg_roles, [f"sum[{i}]" for i in range(len(parts.boundary))])
    loss = next(v for v in cg.outputs if cg.values[v].shape == ())
    g, node_of = stager.forward_stage_graph(cg, loss)
    staging = stager.stage(g, n_stages, epsilon=0.5)
    place = stages.assign(cg, loss, {i: staging.stage[node_of[i]] for i in node_of})
    return cg, parts.compute, stages.programs(parts.compute, cg, place), micro


@pytest.mark.parametrize("model,n_stages", [("mlp", 2), ("gpt", 2), ("gpt", 3)])
def test_stage_programs_run_in_order_give_the_micro_batchs_sums(model, n_stages):
    step, args = MODELS[model]()
    mesh = rj.device_mesh((8,), ("data",))
    cg, compute, progs, micro = _stage_programs(step, args, n_stages, mesh)
    assert [(p.kind, p.stage) for p in progs] == [("F", s) for s in range(n_stages)] + [
        ("B", s) for s in reversed(range(n_stages))]
    made_by = {v: p for p in progs for v in p.outputs}
    for p in progs:  # forward flows up the stages, backward down, and no forward reads a backward
        for v in p.inputs:
            q = made_by[v]
            assert (q.kind, p.kind) != ("B", "F")
            assert q.stage < p.stage if (q.kind, p.kind) == ("F", "F") else True
            assert q.stage > p.stage if (q.kind, p.kind) == ("B", "B") else True
    replicated = NamedSharding(mesh, P())
    aval = lambda v: jax.ShapeDtypeStruct(cg.values[v].shape, cg.values[v].dtype)  # noqa: E731
    ins = [aval(a.value) for a in cg.args]
    store = {}
    for p in progs:  # each takes only the arguments it reads: a stage's parameters, not the others'
        assert 0 < len(p.args) < len(cg.args)
        run = compile_program(p.module, [ins[i] for i in p.args] + [aval(v) for v in p.inputs],
                              [aval(v) for v in p.outputs], [replicated] * (len(p.args) + len(p.inputs)),
                              [replicated] * len(p.outputs))
        store.update(zip(p.outputs, run(*[micro[i] for i in p.args], *[store[v] for v in p.inputs])))
    whole_cg = compile_program(compute, ins, [aval(v) for v in cg.outputs], [replicated] * len(ins),
                               [replicated] * len(cg.outputs))
    for v, want in zip(cg.outputs, whole_cg(*micro)):
        np.testing.assert_allclose(np.asarray(store[v]), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_a_heads_weight_gradient_stays_by_the_logits_gradient():
    """A wide output head is a stage of its own; the gradient of its weight reads the head's
    input (small, made on the stage before) and the logits' gradient (large, made on the head's
    stage): it is computed where the large one is, so no [B, V] tensor crosses a stage."""
    batch, d, vocab, layers = 8, 256, 2048, 4

    def step(params, batch):
        def loss(p):
            x, labels = batch["x"], batch["labels"]
            h = x
            for w in p["layers"]:
                h = jax.nn.relu(h @ w)
            logits = h @ p["head"]
            return -jax.numpy.mean(jax.numpy.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))
        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), value

    key = jax.random.key(0)
    params = {"layers": [jax.random.normal(key, (d, d)) / 16 for _ in range(layers)],
              "head": jax.random.normal(key, (d, vocab))}
    args = (params, {"x": jax.random.normal(key, (batch, d)), "labels": jax.numpy.arange(batch) * 7 % vocab})
    cg, _, progs, _ = _stage_programs(step, args, 2, rj.device_mesh((8,), ("data",)))
    stage_of = {v: p.stage for p in progs for v in p.outputs}
    crossing = {v for p in progs for v in p.inputs if stage_of[v] != p.stage}
    logits_bytes = batch // 2 * vocab * 4
    assert crossing and max(cg.values[v].nbytes for v in crossing) < logits_bytes, \
        [(cg.values[v].shape, stage_of[v], p.kind, p.stage) for p in progs for v in p.inputs]


def test_a_stages_layers_skip_the_scope_of_an_unnamed_function():
    """jax.value_and_grad of a local loss function names some ops "jvp()/slice": that empty scope
    is no layer, and it must not hide the model's layers behind its top module ("LM")."""
    from types import SimpleNamespace
    from rhino_jax.hlo_passes.graph import Node
    names = ["jvp()/slice", "jvp(LM)/Embed_0/gather", "jvp(LM)/Block_0/Dense_0/dot_general",
             "jvp(LM)/Block_1/Dense_0/dot_general", "jvp(LM)/Dense_0/dot_general", "lt"]
    graph = SimpleNamespace(nodes=[Node(i, "op", (), (), name=name) for i, name in enumerate(names)])
    assert stages.layers(graph, list(range(len(names)))) == ("Embed_0", "Block_0-Block_1", "Dense_0")
