"""hlo_passes.prefetch: the reads of split parameters tied to the layer before theirs. XLA's GPU
memory scheduler otherwise gathers every split weight at the program's start; the ties must
keep the numbers and order each group's reads after the activation of the group before."""
import jax
import jax.numpy as jnp
import numpy as np

import rhino_jax as rj
from benchmarks.scale import Shape, llama_step
from rhino_jax.hlo_passes import module as mod
from rhino_jax.hlo_passes import rewrite as rewrite_pass
from rhino_jax.hlo_passes.jax_internals import compile_replacing_module
from rhino_jax.hlo_passes.prefetch import tie_weight_reads
from rhino_jax.runtime.executable import Weights


def _arrays(shapes, seed=0):
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 256))
    return jax.tree.map(lambda s: (jax.random.normal(next(keys), s.shape, s.dtype) * 0.05 if s.dtype == jnp.float32
                                   else jnp.zeros(s.shape, s.dtype)), shapes)


def test_tied_reads_wait_for_the_group_before_and_keep_the_numbers():
    """A 4-layer Llama step planned with its parameters split (ZeRO-3 under a small limit): each
    matmul group's weights pass a barrier with the activation the group before reads (q, k and v
    share one), and the tied program gives the planned program's numbers."""
    step, shapes = llama_step(Shape(128, 4, 1, 1, 320, vocab=1024), seq=32)
    params, opt_state, tokens = shapes(16)
    lowered = rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), memory_limit_bytes=4 << 20,
                             progress=False).lower(params, opt_state, tokens)
    plan = lowered.plan
    weights = Weights.of(plan.arg_roles, plan.arg_specs)
    assert len(weights.split) > 20, "the layers' weights are split"
    module = rewrite_pass.rewrite(mod.copy_module(lowered._step.module), lowered.graph, plan.value_specs,
                                  plan.read_specs, plan.read_paths, plan.arg_specs, plan.output_specs, plan.mesh_axes)
    tied = mod.copy_module(module)
    # 4 layers of (q|k|v, o, gate|up, down) and the head, the first group (layer 0's q|k|v) untied
    assert tie_weight_reads(tied, weights.parameters, weights.split) == 4 * 4
    tied.operation.verify()
    def ties(m):  # @main's barriers whose activation a matmul reads before the weights they pass
        body = [op.operation for op in mod.entry_function(m).regions[0].blocks[0].operations]
        at = {op: i for i, op in enumerate(body)}
        readers = {}
        for op in body:
            if op.name == "stablehlo.dot_general":
                for v in op.operands:
                    readers.setdefault(v, []).append(at[op])

        def first_matmul(values) -> int:  # the first matmul reading `values` or what is made of them
            seen, todo, found = set(), list(values), []
            while todo:
                v = todo.pop()
                for use in v.uses:
                    user = use.owner.operation
                    if user.name == "stablehlo.dot_general":
                        found.append(at.get(user, len(body)))
                    elif user not in seen and user.name != "func.return":
                        seen.add(user)
                        todo.extend(user.results)
            return min(found, default=len(body))

        return [op for op in body if op.name == "stablehlo.optimization_barrier" and op.operands[-1] in readers
                and min(readers[op.operands[-1]]) < first_matmul(list(op.results)[:-1])]

    assert len(ties(tied)) - len(ties(module)) == 16, "each of 16 groups' weights wait for the group before's input"
    args = (_arrays(params), _arrays(opt_state, 1),
            jax.random.randint(jax.random.PRNGKey(2), tokens.shape, 0, 1024, jnp.int32))
    ins, outs = jax.tree.leaves(plan.input_shardings), jax.tree.leaves(plan.output_shardings)
    planned, tied_run = (compile_replacing_module(lowered._step.lowered, m, ins, outs)(
        *jax.device_put(args, plan.input_shardings)) for m in (module, tied))
    for a, b in zip(jax.tree.leaves(planned), jax.tree.leaves(tied_run)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
