"""The search spaces users constrain: each of nnScaler's primitives on a Flax GPT, the
plan with and without the constraint, predicted and priced from what XLA's GPU compiler makes.

    python -m benchmarks.constraints            # writes benchmarks/results/constraints.md and .json
    python -m benchmarks.constraints --only interlaced   # those rows, the others kept from the .json
    python -m benchmarks.constraints --only multi_forward

The step: `third_party_models.linen_gpt` (Flax linen GPT-2-like LM, d 256, 4 blocks of 8 heads,
seq 128, batch 16, vocab 1024, adamw), f32. Devices: 8 described H100s on one host
(`rj.gpu_topology`), mesh (2, 4) ("data", "model"), preset 8x-h100, O2. Every plan is compiled for
those GPUs and priced from its GPU HLO (`runtime.compiled.compiled_cost.price_compiled`; a pipeline's
programs in its schedule, `compiled_step_s`), as its schedule overlaps communication with compute
(the verdict) and serially beside it; the Megatron row beside op_trans is the hand plan
(`jax.jit` with `in_shardings` from `third_party_models`' Megatron rules) priced the same way.

- op_trans: Megatron's layouts as constraints (q/k/v kernels on heads, the output projection on
  heads, fc1 on columns, fc2 on rows, the LM head on the vocabulary; each 4 ways), the search
  laying out the rest (activations, optimizer state, the batch).
- op_assign: pipeline=2 with 4 micro-batches; the stager alone cuts block2 in two, op_assign
  puts it whole on stage 1.
- op_order: pipeline=2 with 4 micro-batches, GPipe written as ordering constraints (forwards
  then backwards, each in micro-batch order), against the default 1F1B.
- interlaced (op_assign stage="all"): another step, `third_party_models.tied_lm` (a T5-like LM:
  a 32k x 256 embedding tied to its output projection, 4 blocks of width 256, seq 128, batch 16,
  clip + AdamW) on the same mesh: the SPMD plan users would otherwise run, pipeline=2 with 4
  micro-batches as the stager alone makes it (refused: the projection is more than a stage's
  share), and interlaced (the embedding's ops, lookup and projection, on every device), also
  under a memory limit of 160 MiB per device (the SPMD plan's is 0.157 GiB).
- multi_forward (op_order with forward passes, 3F1B): another step, `third_party_models.recycling_lm`
  (AlphaFold2-style recycling: every block runs 3 times per micro-batch, the first two passes
  under stop_gradient; vocab 256, width 256, 4 blocks of 4 heads, seq 128, batch 16, clip +
  AdamW) on the same mesh: the SPMD plan, pipeline=2 with 4 micro-batches in GPipe (every forward
  of every pass first), and in nnScaler's 3F1B (Table 7 as op_order rules, the README's).
- coshard: another step, `third_party_models.remat_lm` (seq 512, batch 16, width 64, 4 heads,
  2 blocks under `nn.remat`, clip + AdamW), on mesh (8,) ("data"): the attention without chunks,
  in 2 and 4 chunks, and chunks="auto" under a memory limit of 20 MiB per device; its column of
  compiled temporaries is what co-shard cuts. Then `masked_remat_lm` (2 and 4 blocks), as users
  often write it: the causal mask made once and handed to each block, attention with biases
  (d 128, 8 heads, seq 512, batch 8), without chunks and in 4.
Needs jax's CUDA plugin (Python 3.12: `pip install -e '.[test]'`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import rhino_jax as rj  # noqa: E402
from rhino_jax.runtime.compiled.compiled_cost import price_compiled  # noqa: E402

from benchmarks import RESULTS  # noqa: E402
from .compilers import devices  # noqa: E402
from rhino_jax.errors import StagingError  # noqa: E402

from .fixtures.third_party_models import linen_gpt, masked_remat_lm, recycling_lm, remat_lm, tied_lm  # noqa: E402

CLUSTER, MESH, NAMES = "8x-h100", (2, 4), ("data", "model")
MEGATRON = [rj.op_trans(f"*block?/attn/{w}/kernel", dims=-2, parts=4) for w in ("query", "key", "value")] + [
    rj.op_trans("*block?/attn/out/kernel", dims=-3, parts=4), rj.op_trans("*block?/fc1/kernel", dims=-1, parts=4),
    rj.op_trans("*block?/fc2/kernel", dims=-2, parts=4), rj.op_trans("*/head/kernel", dims=-1, parts=4)]
PIPELINE = dict(pipeline=2, num_micro_batches=4)
ATTENTION = "*MultiHeadDotProductAttention_0/*"


def gpipe(p: int, m: int):
    """GPipe as ordering constraints: each pass in micro-batch order, the last forward first."""
    for s in range(p):
        for k in range(m - 1):
            yield rj.Task("F", s, k), rj.Task("F", s, k + 1)
            yield rj.Task("B", s, k), rj.Task("B", s, k + 1)
        yield rj.Task("F", s, m - 1), rj.Task("B", s, 0)


def three_f_one_b(p: int, m: int):
    """nnScaler's Table 7 (3F1B) as ordering constraints, as the README writes it."""
    for s in range(p):
        for k in range(m - 1):
            yield rj.Task("F", s, k + 1, forward_pass=0), rj.Task("F", s, k, forward_pass=1)
            yield rj.Task("F", s, k + 1, forward_pass=1), rj.Task("F", s, k, forward_pass=2)
        ofst = p - 1 - s
        for k in range(ofst, m):
            yield rj.Task("F", s, k, forward_pass=2), rj.Task("B", s, k - ofst)


def _mesh(shape=MESH, names=NAMES):
    return rj.device_mesh(shape, names, devices=devices("gpu", 8))


def _row(primitive: str, label: str, lowered, compiled_s: float, serial_s: float, compiled_gib: float | None,
         search_s: float, temp_mib: float | None = None) -> dict:
    """`compiled_s`: the compiled step as its schedule overlaps communication with compute;
    `serial_s`: compute and communication added up."""
    plan = lowered.plan if lowered is not None else None
    return dict(primitive=primitive, plan=label, search_s=search_s,
                predicted_ms=plan.cost.total_s * 1e3 if plan else None,
                predicted_gib=plan.cost.memory_bytes / 2**30 if plan else None,
                compiled_ms=compiled_s * 1e3, serial_ms=serial_s * 1e3, compiled_gib=compiled_gib,
                compiled_temp_mib=temp_mib,
                stages=[list(st.layers) for st in plan.stages] if plan else [],
                in_flight=[st.in_flight for st in plan.stages] if plan else [])


def _plan(case, primitive: str, label: str, mesh=None, **options) -> dict:
    t0 = time.perf_counter()
    lowered = rj.parallelize(case.step, mesh=mesh or _mesh(), cluster=CLUSTER, progress=False,
                             **options).lower(*case.args)
    search_s = time.perf_counter() - t0
    compiled = lowered.compile()
    if options.get("pipeline"):
        return _row(primitive, label, lowered, compiled.compiled_step_s(), compiled.compiled_step_s(overlapped=False),
                    None, search_s)
    cost = price_compiled(compiled._executable, CLUSTER, case.dtype)
    return _row(primitive, label, lowered, cost.overlapped_s, cost.total_s, cost.memory.total / 2**30, search_s,
                cost.memory.temp_bytes / 2**20)


def _megatron_by_hand(case) -> dict:
    """Megatron as users write it: the rules' dims over 'model', the batch over 'data'."""
    mesh = _mesh()

    def spec(path, x):
        key = jax.tree_util.keystr(path)
        dim = next((d for rule, d in case.tp_rules if re.search(rule, key)), None)
        return NamedSharding(mesh, P(*[("model" if d == dim % x.ndim else None) for d in range(x.ndim)])
                             if dim is not None else P())

    state = jax.tree_util.tree_map_with_path(spec, case.args[:2])
    batch = jax.tree.map(lambda _: NamedSharding(mesh, P("data")), case.args[2])
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), case.args)  # no data on described GPUs
    compiled = jax.jit(case.step, in_shardings=(*state, batch),
                       out_shardings=(*state, NamedSharding(mesh, P()))).lower(*shapes).compile()
    cost = price_compiled(compiled, CLUSTER, case.dtype)
    return _row("op_trans", "Megatron by hand (jax.jit in_shardings)", None, cost.overlapped_s, cost.total_s,
                cost.memory.total / 2**30, 0.0)


def measure() -> list[dict]:
    case = linen_gpt()
    return [_plan(case, "op_trans", "free search"),
            _plan(case, "op_trans", "Megatron's layouts as op_trans", constraints=MEGATRON),
            _megatron_by_hand(case),
            _plan(case, "op_assign", "free staging", **PIPELINE),
            _plan(case, "op_assign", "op_assign('*block2/*', stage=1)",
                  constraints=[rj.op_assign("*block2/*", stage=1)], **PIPELINE),
            _plan(case, "op_order", "1F1B (schedule=)", **PIPELINE),
            _plan(case, "op_order", "GPipe as op_order", constraints=[rj.op_order(gpipe)], **PIPELINE),
            *_interlaced_rows(), *_multi_forward_rows(), *_coshard_rows()]


def _interlaced_rows() -> list[dict]:
    case = tied_lm(batch=16, seq=128)
    rows = [_plan(case, "interlaced", "tied_lm, SPMD (no pipeline)")]
    try:
        rows.append(_plan(case, "interlaced", "pipeline=2, free staging", **PIPELINE))
    except StagingError as e:  # what the stager alone makes of it
        rows.append(dict(_row("interlaced", "pipeline=2, free staging", None, 0.0, 0.0, None, 0.0), compiled_ms=None,
                         serial_ms=None, refused=str(e)))
    interlaced = [rj.op_assign("*Embed*", stage="all")]
    rows.append(_plan(case, "interlaced", "pipeline=2, op_assign('*Embed*', stage='all')", constraints=interlaced,
                      **PIPELINE))
    rows.append(_plan(case, "interlaced", "the same, memory limit 160 MiB", constraints=interlaced,
                      memory_limit_bytes=160 << 20, **PIPELINE))
    return rows


def _multi_forward_rows() -> list[dict]:
    case = recycling_lm(batch=16, seq=128, width=256)
    return [_plan(case, "multi_forward", "recycling_lm, SPMD (no pipeline)"),
            _plan(case, "multi_forward", "pipeline=2, GPipe (schedule='gpipe')", schedule="gpipe", **PIPELINE),
            _plan(case, "multi_forward", "pipeline=2, 3F1B (Table 7 as op_order)",
                  constraints=[rj.op_order(three_f_one_b)], **PIPELINE)]


def _coshard_rows() -> list[dict]:
    case, mesh = remat_lm(), _mesh((8,), ("data",))
    rows = [_plan(case, "coshard", "remat_lm, no chunks", mesh)]
    for chunks in (2, 4):
        rows.append(_plan(case, "coshard", f"coshard(attention, chunks={chunks})", mesh,
                          constraints=[rj.coshard(ATTENTION, chunks=chunks)]))
    auto = _plan(case, "coshard", "coshard(attention, chunks='auto'), memory limit 20 MiB", mesh,
                 constraints=[rj.coshard(ATTENTION)], memory_limit_bytes=20 << 20)
    rows.append(auto)
    for layers in (2, 4):  # the mask handed in, attention biases: ops among the attention's that run whole
        masked = masked_remat_lm(layers=layers)
        rows += [_plan(masked, "coshard", f"masked_remat_lm, {layers} blocks, no chunks", mesh),
                 _plan(masked, "coshard", f"masked_remat_lm, {layers} blocks, coshard(attention, chunks=4)", mesh,
                       constraints=[rj.coshard(ATTENTION, chunks=4)])]
    return rows


def table(rows: list[dict]) -> str:
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)
    lines = ["| primitive | plan | search s | predicted ms | predicted GiB/dev | GPU-compiled ms, overlapped | serially "
             "| compiled GiB/dev | compiled temporaries MiB/dev | stages (layers; micro-batches in flight) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        stages = "; ".join(f"{', '.join(layers)} ({n})" for layers, n in zip(r["stages"], r["in_flight"])) or "-"
        stages = f"refused: {r['refused']}" if r.get("refused") else stages
        lines.append(f"| {r['primitive']} | {r['plan']} | {num(r['search_s'] or None, '.1f')} | "
                     f"{num(r['predicted_ms'], '.3f')} | {num(r['predicted_gib'], '.3f')} | "
                     f"{num(r['compiled_ms'], '.3f')} | {num(r.get('serial_ms'), '.3f')} | {num(r['compiled_gib'], '.3f')} | "
                     f"{num(r.get('compiled_temp_mib'), '.1f')} | {stages} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("op_trans", "op_assign", "op_order", "interlaced", "multi_forward",
                                           "coshard"),
                        help="measure these rows only; the others come from constraints.json")
    only = parser.parse_args().only
    rows = measure() if only is None else [
        *(r for r in json.loads((RESULTS / "constraints.json").read_text()) if r["primitive"] != only),
        *{"interlaced": _interlaced_rows, "multi_forward": _multi_forward_rows, "coshard": _coshard_rows}.get(
            only, lambda: [r for r in measure() if r["primitive"] == only])()]
    order = ("op_trans", "op_assign", "op_order", "interlaced", "multi_forward", "coshard")
    rows.sort(key=lambda r: order.index(r["primitive"]))
    text = table(rows)
    print(text)
    (RESULTS / "constraints.json").write_text(json.dumps(rows, indent=1) + "\n")
    (RESULTS / "constraints.md").write_text(
        "# Constraints on the search space: with and without\n\n"
        "`python -m benchmarks.constraints` (its docstring says what each row is). Flax linen GPT (d 256, 4 "
        "blocks, seq 128, batch 16), 8 described H100s, mesh (2, 4), preset 8x-h100, O2. Predicted: the "
        "plan's cost model; GPU-compiled: the programs XLA's GPU compiler makes for the plan, priced from "
        "their HLO (a pipeline: its programs in its schedule), overlapped as XLA's schedule runs communication "
        "beside compute (the verdict), and serially (compute + communication) beside it. A pipeline's compiled memory is not summed "
        "here (its programs run beside each other). The interlaced rows are another step: `tied_lm` (a 32k "
        "x 256 embedding tied to the output projection, 4 blocks, seq 128, batch 16); the multi_forward rows "
        "`recycling_lm` (every block 3 times per micro-batch, the last pass differentiated; width 256, 4 blocks, "
        "seq 128, batch 16); the coshard rows another "
        "step and mesh: `remat_lm` (seq 512, 2 blocks under nn.remat) on (8,), and `masked_remat_lm` (the causal "
        "mask made once and handed to each remat block, attention with biases: d 128, 8 heads, seq 512, batch "
        "8).\n\n" + text + "\n")


if __name__ == "__main__":
    main()
