"""hlo_passes.program_order: barriers that hold XLA's GPU schedule to the program's order. The
ties must keep the numbers, make each group's split weights wait for the activation of the
group before, and make each late matmul (a weight gradient) finish before a later matmul of
the step's chain runs."""
import jax
import jax.numpy as jnp
from jax.extend.mlir import ir

import rhino_jax as rj
from benchmarks.fixtures.llama import Shape, llama_step
from rhino_jax.hlo_passes import module as mod
from rhino_jax.hlo_passes.jax_internals import compile_replacing_module
from rhino_jax.hlo_passes.program_order import LATE_SLACK, tie_to_program_order
from rhino_jax.runtime.executable import Weights
from helpers import assert_same_adam_step

LAYERS = 4


def _arrays(shapes, seed=0):
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 256))
    return jax.tree.map(lambda s: (jax.random.normal(next(keys), s.shape, s.dtype) * 0.05 if s.dtype == jnp.float32
                                   else jnp.zeros(s.shape, s.dtype)), shapes)


def _body(module):
    body = [op.operation for op in mod.entry_function(module).regions[0].blocks[0].operations]
    return body, {op: i for i, op in enumerate(body)}


def _matmuls_reached(values, at, end) -> list[int]:
    """Where the matmuls that read `values`, or what is made of them, sit in @main's body."""
    seen, todo, found = set(), list(values), []
    while todo:
        v = todo.pop()
        for use in v.uses:
            user = use.owner.operation
            while user.parent.name != "func.func":
                user = user.parent.operation
            if user.name == "stablehlo.dot_general":
                found.append(at.get(user, end))
            elif user.name == "stablehlo.optimization_barrier":  # passes each value on apart
                todo.append(user.results[use.operand_number])
            elif user not in seen and user.name != "func.return":
                seen.add(user)
                todo.extend(user.results)
    return found


def _weight_ties(module) -> int:
    """@main's barriers that pass weights (arguments) beside an activation that a matmul reads,
    through the barrier, before the weights reach one."""
    body, at = _body(module)
    count = 0
    for op in body:
        if op.name != "stablehlo.optimization_barrier":
            continue
        weights = [r for v, r in zip(op.operands, op.results) if isinstance(v.owner, ir.Block)]
        acts = [at[use.owner.operation] for v, r in zip(op.operands, op.results) if not isinstance(v.owner, ir.Block)
                for read in _pins(r) for use in read.uses if use.owner.operation.name == "stablehlo.dot_general"]
        passed = _matmuls_reached(weights, at, len(body))
        count += bool(passed and acts) and min(acts) < min(passed)
    return count


def _pins(v) -> list:
    """`v` and the sharding constraints that read it."""
    return [v] + [use.owner.operation.result for use in v.uses if use.owner.operation.name == "sdy.sharding_constraint"]


def _late_ties(module) -> list[tuple[int, int, int]]:
    """(where the late matmul is, where the barrier is, where the matmul that waits is) of each
    barrier that passes what a matmul made with no matmul after it, beside an activation."""
    body, at = _body(module)
    found = []
    for op in body:
        if op.name != "stablehlo.optimization_barrier" or len(op.operands) != 2:
            continue
        v = op.operands[0]
        while not isinstance(v.owner, ir.Block) and v.owner.operation.name != "stablehlo.dot_general" \
                and len(v.owner.operation.operands) == 1:
            v = v.owner.operation.operands[0]
        if isinstance(v.owner, ir.Block):
            continue
        made = v.owner.operation
        if made.name != "stablehlo.dot_general" or _matmuls_reached(list(made.results), at, len(body)):
            continue
        waiting = _matmuls_reached([op.results[1]], at, len(body))
        found.append((at[made], at[op], min(waiting)))
    return found


def test_tied_program_waits_as_planned_and_keeps_the_numbers():
    """A 4-layer Llama step (f32 compute, so that float noise is all a changed fusion can
    bring) planned with its parameters split (ZeRO-3 under a small limit):
    each matmul group's weights pass a barrier with the activation the group before reads (q, k
    and v share one); each weight gradient passes one with the activation of a matmul after
    it, which so waits for it. The tied program gives the planned program's numbers."""
    step, shapes = llama_step(Shape(128, LAYERS, 1, 1, 320, vocab=1024), seq=32, compute="float32")
    params, opt_state, tokens = shapes(16)
    lowered = rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), memory_limit_bytes=5 << 20,
                             progress=False).lower(params, opt_state, tokens)
    plan = lowered.plan
    weights = Weights.of(plan.arg_roles, plan.arg_specs)
    assert len(weights.split) > 20, "the layers' weights are split"
    module = lowered._rewritten()
    tied = mod.copy_module(module)
    count = tie_to_program_order(tied, weights.parameters, weights.split)
    tied.operation.verify()
    # 4 layers of (q|k|v, o, gate|up, down) and the head, the first group (layer 0's q|k|v) untied
    assert _weight_ties(tied) - _weight_ties(module) == LAYERS * 4
    late = _late_ties(tied)
    # 7 weight gradients a layer (q, k, v, o, gate, up, down); the last ones made have too few
    # matmuls after them to wait
    assert LAYERS * 7 - LATE_SLACK - 1 <= len(late) <= LAYERS * 7 + 1
    assert count == LAYERS * 4 + len(late)
    for made, barrier, waiting in late:
        assert made < barrier < waiting, "the gradient is made before the barrier, and a later matmul waits"

    args = (_arrays(params), _arrays(opt_state, 1),
            jax.random.randint(jax.random.PRNGKey(2), tokens.shape, 0, 1024, jnp.int32))
    ins, outs = jax.tree.leaves(plan.input_shardings), jax.tree.leaves(plan.output_shardings)
    planned, tied_run = (compile_replacing_module(lowered._step.lowered, m, ins, outs)(
        *jax.device_put(args, plan.input_shardings)) for m in (module, tied))
    assert_same_adam_step(planned, tied_run, lr=3e-4)  # llama_step's optax.adamw(3e-4)


def test_a_program_with_no_split_weights_ties_only_its_late_matmuls():
    """Replicated weights (data parallel) are read where the program reads them; the weight
    gradients still wait."""
    step, shapes = llama_step(Shape(128, 2, 1, 1, 320, vocab=1024), seq=32)
    lowered = rj.parallelize(step, mesh=rj.device_mesh((8,), ("data",)), progress=False).lower(*shapes(16))
    plan = lowered.plan
    weights = Weights.of(plan.arg_roles, plan.arg_specs)
    module = lowered._rewritten()
    count = tie_to_program_order(module, weights.parameters, ())
    module.operation.verify()
    assert count == len(_late_ties(module)) > 0
    assert _weight_ties(module) == 0
