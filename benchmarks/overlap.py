"""Plans priced as the GPU runs them: communication overlapped with compute.

python -m benchmarks.overlap [--cases NAME ...] [--out benchmarks/]
    each case: a Llama-style step (`fixtures.llama.llama_step`: RMSNorm, rotary, SwiGLU, per-layer remat,
    AdamW on f32 state, bf16 compute) planned by rhino_jax for described H100s, compiled as
    `compile()` makes it, and the hand plans users write (data parallel, FSDP) compiled by plain
    `jax.jit` with the state donated; each priced from its GPU HLO (`compiled_cost.price_compiled`)
    serially (compute + communication) and overlapped (`timeline`: the program replayed in XLA's
    schedule on a compute and a collective stream). Writes overlap.json and overlap.md.

The verdict is the overlapped column: XLA's latency-hiding scheduler (on by default) runs an
async collective beside the kernels between its start and its done.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from benchmarks import RESULTS

from .fixtures.llama import compile_hand, llama_step, model_shape
from .scale import GIB, compile_as_users_do, kept_note

HAND = ("data parallel", "FSDP")
NOTES = "<!-- notes: kept when the table is written again -->"


@dataclass(frozen=True)
class Case:
    name: str
    shape: object  # llama.Shape
    mesh: tuple[int, ...]
    seq: int
    per_device: int = 1  # sequences per device


CASES = [
    Case("7b-4l-8", model_shape("7b", 4), (8,), seq=2048),
    # the same step at a quarter of the width and sequence: minutes, not tens of minutes, to compile
    Case("1k-4l-8", replace(model_shape("7b", 4), d=1024, heads=8, kv_heads=8, ffn=2752, vocab=8192), (8,), seq=512),
]


def _hand(step, args, mesh, method: str):
    if method == "FSDP":
        return compile_hand(step, args, mesh, "FSDP", donate=True)
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P(tuple(mesh.axis_names)))
    state = jax.tree.map(lambda _: replicated, args[:2])
    return jax.jit(step, in_shardings=(*state, batch), out_shardings=(*state, replicated),
                   donate_argnums=(0, 1)).lower(*args).compile()


def priced(compiled) -> dict:
    from rhino_jax.runtime.compiled.compiled_cost import price_compiled
    cost = price_compiled(compiled, "8x-h100", "bfloat16")
    return {"serial_s": cost.total_s, "overlapped_s": cost.overlapped_s, "exposed_s": cost.exposed_comm_s,
            "compute_s": cost.compute_s, "comm_s": cost.comm_s, "gib": cost.memory.total / GIB}


def searches(cluster) -> dict:
    """The searches compared: as the preset prices (on GPUs, off-chain collectives behind compute)
    and with every collective priced in line (`Cluster.overlap` 0), as the search priced before."""
    return {"rhino_jax": cluster, "rhino_jax, serial search": replace(cluster, overlap=0.0)}


def run_case(case: Case, cluster) -> dict:
    """The case's plans (`searches`) and the hand plans, compiled and priced."""
    import jax
    jax.config.update("jax_platforms", "cpu")
    import numpy as np
    from jax.sharding import Mesh

    import rhino_jax as rj

    devices = rj.gpu_topology("h100", hosts=1, devices_per_host=8)
    mesh = Mesh(np.array(devices).reshape(case.mesh), ("data",) if len(case.mesh) == 1 else ("data", "model"))
    step, shapes = llama_step(case.shape, seq=case.seq)
    args = shapes(case.per_device * int(np.prod(case.mesh)))
    out = {}
    for label, searched_on in searches(cluster).items():
        t0 = time.perf_counter()
        lowered = rj.parallelize(step, mesh=mesh, cluster=searched_on, memory_limit_bytes=80 * GIB,
                                 donate_argnums=(0, 1), progress=False).lower(*args)
        compiled, said = compile_as_users_do(lowered)
        out[label] = {**priced(compiled), "note": kept_note(said), "plan_s": time.perf_counter() - t0,
                      "predicted_s": lowered.plan.cost.total_s}
    for method in HAND:
        try:
            out[method] = priced(_hand(step, args, mesh, method))
        except Exception as e:  # noqa: BLE001 (recorded, the others go on)
            out[method] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return out


def table(rows: dict, hand: tuple[str, ...] = HAND, best: str = "best hand") -> str:
    """Each case's plans, rhino_jax's first, against the best of the `hand` plans of its row in
    each column (the serial and the overlapped best may be different plans)."""
    lines = [f"| case | plan | predicted ms | serial ms | overlapped ms | exposed comm ms | overlapped / {best} | "
             f"serial / {best} | GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        hands = [row[m] for m in hand if "error" not in row.get(m, {"error": 1})]
        best_o = min((h["overlapped_s"] for h in hands), default=float("nan"))
        best_s = min((h["serial_s"] for h in hands), default=float("nan"))
        for plan in (*(p for p in row if p.startswith("rhino_jax")), *hand):
            r = row.get(plan, {})
            if "error" in r or not r:
                lines.append(f"| {name} | {plan} | {r.get('error', 'not run')} | | | | | | |")
                continue
            label = plan + (f" ({r['note']})" if r.get("note") else "")
            predicted = f"{r['predicted_s'] * 1e3:.2f}" if "predicted_s" in r else ""
            lines.append(f"| {name} | {label} | {predicted} | {r['serial_s'] * 1e3:.2f} | {r['overlapped_s'] * 1e3:.2f} | "
                         f"{r['exposed_s'] * 1e3:.2f} | {r['overlapped_s'] / best_o:.3f} | "
                         f"{r['serial_s'] / best_s:.3f} | {r['gib']:.1f} |")
    return "\n".join(lines)


def run_cases(out: pathlib.Path, stem: str, cases: list, run: Callable[[object], dict], stamp: dict, heading: str,
              table_of: Callable[[dict], str] = table) -> dict:
    """Run each case, its row saved in `stem`.json as soon as it ends (the rows of cases not run
    kept), and write `stem`.md: `heading`, the table of every row, and the notes kept below it."""
    path = out / f"{stem}.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    for case in cases:
        t0 = time.perf_counter()
        saved[case.name] = {**run(case), "wall_s": time.perf_counter() - t0, **stamp}
        path.write_text(json.dumps(saved, indent=1))
        print(table_of({case.name: saved[case.name]}), flush=True)
    md = out / f"{stem}.md"
    notes = md.read_text().partition(NOTES)[2] if md.exists() else "\n"
    md.write_text(f"{heading}\n\n{table_of(saved)}\n\n{NOTES}{notes}")
    return saved


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=[c.name for c in CASES])
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    import jax

    from rhino_jax.search.cost.cluster import get_cluster
    run_cases(pathlib.Path(args.out), "overlap", [c for c in CASES if c.name in args.cases],
              lambda case: run_case(case, get_cluster("8x-h100")), {"jax": jax.__version__},
              f"# Plans priced overlapped\n\n`python -m benchmarks.overlap` (jax {jax.__version__}, 8 described "
              "H100s, the 8x-h100 preset)")


if __name__ == "__main__":
    main()
