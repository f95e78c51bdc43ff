"""Pipeline stager (Rhino §5) solve time with and without bound tightening (§5.2): the forward
pass of a GPT backbone (hidden 512, seq 512, batch 8, vocab 50304) at 24 and 48 layers, coarsened
by critical-node segments, divided into 2, 4 and 8 stages balanced within epsilon.

python -m benchmarks.stager [--layers 24 48] [--stages 2 4 8] [--epsilon 0.1] [--time-limit 300]
    → prints a table, writes benchmarks/results/stager.md
Planning needs shapes only, so nothing is compiled or run. Time is wall time on this machine.
"""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import datetime  # noqa: E402

import jax  # noqa: E402

import rhino_jax as rj  # noqa: E402
from benchmarks import RESULTS  # noqa: E402
from rhino_jax.errors import SolverError, StagingError  # noqa: E402
from rhino_jax.hlo_passes.importer import import_module  # noqa: E402
from rhino_jax.hlo_passes.lowering import lower_on_mesh  # noqa: E402
from rhino_jax.models import gpt  # noqa: E402
from rhino_jax.search.staging import stager  # noqa: E402

from .search_scaling import backbone_config  # noqa: E402



def stage_graph(layers: int) -> stager.StageGraph:
    cfg = backbone_config(layers, distinct=False)
    lowered = lower_on_mesh(gpt.make_gpt_train_step(cfg), gpt.gpt_example(cfg, abstract=True),
                            rj.device_mesh((8,), ("devices",)), (0, 1))
    graph = import_module(lowered.module, lowered.arg_paths, lowered.arg_roles, lowered.output_paths)
    return stager.forward_stage_graph(graph, graph.outputs[-1])[0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[24, 48])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--epsilon", type=float, default=0.1)
    parser.add_argument("--time-limit", type=float, default=300.0)
    opts = parser.parse_args()
    rows = []
    for layers in opts.layers:
        g = stage_graph(layers)
        for stages in opts.stages:
            for tighten in (True, False):
                row = dict(layers=layers, nodes=len(g.compute), edges=len(g.edges), stages=stages,
                           bounds="yes" if tighten else "no")
                try:
                    r = stager.stage(g, stages, opts.epsilon, tighten=tighten, time_limit_s=opts.time_limit)
                    row.update(vars=r.num_vars, constraints=r.num_constraints, solve_s=r.solve_s, status=r.status,
                               cut_mib=r.cut_bytes / 2**20,
                               imbalance=max(r.stage_compute) / (sum(r.stage_compute) / stages) - 1)
                except SolverError as e:
                    row.update(status="time limit", note=str(e)[:80])
                except StagingError as e:  # e.g. the LM head alone outweighs a balanced share
                    row.update(status="infeasible: " + str(e).split(": ", 1)[-1].split(";")[0])
                rows.append(row)
                print(row, flush=True)
    cols = ["layers", "nodes", "edges", "stages", "bounds", "vars", "constraints", "solve_s", "status", "cut_mib",
            "imbalance"]
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = [f"# Stager (Rhino §5) solve time with and without bound tightening, epsilon {opts.epsilon:g}", "",
             f"{datetime.date.today()}, jax {jax.__version__}, {os.cpu_count()} CPU cores, OR-Tools HiGHS. GPT "
             "backbone (hidden 512, seq 512, batch 8, vocab 50304), forward pass coarsened by critical-node "
             "segments; cut_mib: bytes crossing stages; imbalance: the heaviest stage over a balanced share, "
             "less 1.", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    (RESULTS / "stager.md").write_text(text)


if __name__ == "__main__":
    main()
