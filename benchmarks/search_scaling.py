"""Search time vs depth, Rhino §7.5 style: a GPT backbone with hidden 512 and L layers on 8
devices, planned at O2 and O3. Records Table 5's statistics (instructions, critical nodes,
their proportion, subgraphs), search time and predicted step time at each level.

python -m benchmarks.search_scaling [--layers 6 12 24 36 48 72] [--o3-max-layers 36]
    → prints a table, writes benchmarks/search_scaling.md and benchmarks/search_scaling.png
Planning needs shapes only (jax.ShapeDtypeStruct), so nothing is compiled or run. Time is wall
time on this machine, lowering included (the first column); O3 is skipped above --o3-max-layers.
"""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import datetime  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

import rhino_jax as rj  # noqa: E402
from rhino_jax.models import gpt  # noqa: E402

HERE = pathlib.Path(__file__).parent


def backbone_config(layers: int) -> gpt.GPTConfig:
    return gpt.GPTConfig(vocab=50304, seq_len=512, d_model=512, n_heads=8, n_layers=layers, d_ff=2048, batch=8)


def plan_once(layers: int, opt_level: str, mesh) -> dict:
    cfg = backbone_config(layers)
    step = gpt.make_gpt_train_step(cfg)
    args = gpt.gpt_example(cfg, abstract=True)
    start = time.perf_counter()
    plan = rj.parallelize(step, mesh=mesh, opt_level=opt_level, donate_argnums=(0, 1),
                          solver_time_limit_s=600).lower(*args).plan
    s = plan.search_stats
    return dict(layers=layers, opt=opt_level, plan_s=time.perf_counter() - start, build_s=s["build_s"],
                solve_s=s["solve_s"], instructions=s["instructions"], critical=s["critical_nodes"],
                proportion=s["critical_proportion"], subgraphs=s["subgraphs"], ilp_groups=s["ilp_groups"],
                ilp_vars=s["ilp_vars"], status=s["status"], step_ms=plan.cost.total_s * 1e3)


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for level, marker in (("O2", "o"), ("O3", "s")):
        rs = [r for r in rows if r["opt"] == level]
        ax1.plot([r["layers"] for r in rs], [r["plan_s"] for r in rs], marker=marker, label=level)
        ax2.plot([r["layers"] for r in rs], [r["step_ms"] for r in rs], marker=marker, label=level)
    ax1.set(xlabel="layers", ylabel="planning time (s, lowering included)", title="search time")
    ax2.set(xlabel="layers", ylabel="predicted step (ms, m8-v100)", title="plan quality")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[6, 12, 24, 36, 48, 72])
    parser.add_argument("--o3-max-layers", type=int, default=36)
    opts = parser.parse_args()
    mesh = rj.device_mesh((8,), ("devices",))
    rows = []
    for layers in opts.layers:
        for level in ("O2", "O3"):
            if level == "O3" and layers > opts.o3_max_layers:
                continue
            rows.append(plan_once(layers, level, mesh))
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
    cols = ["layers", "opt", "instructions", "critical", "proportion", "subgraphs", "ilp_groups", "ilp_vars",
            "build_s", "solve_s", "plan_s", "status", "step_ms"]
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    o3 = {r["layers"]: r["step_ms"] for r in rows if r["opt"] == "O3"}
    gaps = [f"L={r['layers']}: O2 {100 * (r['step_ms'] / o3[r['layers']] - 1):+.2f}% vs O3"
            for r in rows if r["opt"] == "O2" and r["layers"] in o3]
    lines = ["# Search time vs depth (GPT backbone, hidden 512, seq 512, batch 8, vocab 50304), mesh (8,), m8-v100",
             "", f"{datetime.date.today()}, jax {jax.__version__}, {os.cpu_count()} CPU cores. plan_s = lowering + "
             "import + search (wall time); build_s = strategies, cones and ILP construction.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    lines += ["", "Predicted cost, O2 against O3: " + "; ".join(gaps) + ".", "",
              "![search time and predicted step](search_scaling.png)"]
    text = "\n".join(lines) + "\n"
    print(text)
    (HERE / "search_scaling.md").write_text(text)
    plot(rows, HERE / "search_scaling.png")


if __name__ == "__main__":
    main()
