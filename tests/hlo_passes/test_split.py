"""Programs cut from a step's module, compiled on their own: run one after the other they give
the step's numbers."""
import jax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import rhino_jax as rj
from rhino_jax.hlo_passes import split
from rhino_jax.hlo_passes.importer import import_module
from rhino_jax.hlo_passes.lowering import lower_on_mesh
from rhino_jax.models import gpt, make_mlp_train_step, mlp_example
from rhino_jax.runtime.executable import compile_program

from helpers import assert_same_numbers


@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_a_step_cut_at_its_matmuls_runs_as_two_programs(model):
    step, args = ((make_mlp_train_step(), mlp_example((8, 16, 8), 4)) if model == "mlp"
                  else (gpt.make_gpt_train_step(gpt.GPT_TINY), gpt.gpt_example(gpt.GPT_TINY)))
    mesh = rj.device_mesh((8,), ("data",))
    lowered = lower_on_mesh(step, args, mesh, ())
    graph = import_module(lowered.module, lowered.arg_paths, lowered.arg_roles, lowered.output_paths)
    cut = [r for n in graph.nodes if n.op == "stablehlo.dot_general" for r in n.results]
    first = split.extract(lowered.module, graph, [], cut)  # the step up to its matmuls
    second = split.extract(lowered.module, graph, cut, graph.outputs)  # the rest, from them
    assert "dot_general" not in str(second) and str(first).count("dot_general") == len(cut)
    aval = lambda v: jax.ShapeDtypeStruct(graph.values[v].shape, graph.values[v].dtype)  # noqa: E731
    replicated = NamedSharding(mesh, P())
    ins = [aval(a.value) for a in graph.args]
    a = compile_program(first, ins, [aval(v) for v in cut], [replicated] * len(ins), [replicated] * len(cut))
    b = compile_program(second, ins + [aval(v) for v in cut], [aval(v) for v in graph.outputs],
                        [replicated] * (len(ins) + len(cut)), [replicated] * len(graph.outputs))
    flat = jax.tree.leaves(args)
    out = b(*flat, *a(*flat))
    assert_same_numbers(jax.tree.leaves(jax.jit(step)(*args)), list(out))


def test_values_inside_a_loop_cannot_be_cut():
    def step(w, x):
        return jax.lax.fori_loop(0, 3, lambda i, h: jax.numpy.tanh(h @ w), x).sum()

    args = (jax.numpy.ones((4, 4)), jax.numpy.ones((2, 4)))
    lowered = lower_on_mesh(step, args, rj.device_mesh((8,), ("data",)), ())
    graph = import_module(lowered.module, lowered.arg_paths, lowered.arg_roles, lowered.output_paths)
    inside = next(v.id for v in graph.values if v.trips > 1)
    with pytest.raises(ValueError, match="inside a loop"):
        split.extract(lowered.module, graph, [inside], graph.outputs)
