"""Search time vs depth, Rhino §7.5 style: a GPT backbone with hidden 512 and L layers on 8
devices, planned at O2 and O3. Records Table 5's statistics (instructions, critical nodes,
their proportion, subgraphs), search time and predicted step time at each level.

python -m benchmarks.search_scaling [--layers 6 12 24 36 48 72] [--o3-max-layers 36]
    → prints a table, writes benchmarks/results/search_scaling.md and benchmarks/results/search_scaling.png
python -m benchmarks.search_scaling --distinct [--layers 6 12 24 48] [--o3-max-layers 12]
    → the same for layers that never repeat (FFN width 1024 + 64 i in layer i) on a (2, 4) mesh,
      where O2 cannot tie layers and solves by windows; writes benchmarks/results/search_scaling_distinct.md
Planning needs shapes only (jax.ShapeDtypeStruct), so nothing is compiled or run. Time is wall
time on this machine, lowering included (plan_s); O3 is skipped above --o3-max-layers.
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
from benchmarks import RESULTS, pyplot  # noqa: E402
from rhino_jax.models import gpt  # noqa: E402


def backbone_config(layers: int, distinct: bool) -> gpt.GPTConfig:
    return gpt.GPTConfig(vocab=50304, seq_len=512, d_model=512, n_heads=8, n_layers=layers,
                         d_ff=1024 if distinct else 2048, batch=8, d_ff_step=64 if distinct else 0)


def plan_once(layers: int, opt_level: str, mesh, distinct: bool) -> dict:
    cfg = backbone_config(layers, distinct)
    step = gpt.make_gpt_train_step(cfg)
    args = gpt.gpt_example(cfg, abstract=True)
    start = time.perf_counter()
    plan = rj.parallelize(step, mesh=mesh, opt_level=opt_level, donate_argnums=(0, 1),
                          solver_time_limit_s=600).lower(*args).plan
    s = plan.search_stats
    return dict(layers=layers, opt=opt_level, plan_s=time.perf_counter() - start, build_s=s.build_s,
                solve_s=s.solve_s, instructions=s.ops, critical=s.critical_nodes,
                proportion=s.critical_proportion, subgraphs=s.segments, ilp_groups=s.ilp_groups,
                ilp_vars=s.ilp_vars, windows=s.windows, status=s.status,
                step_ms=plan.cost.total_s * 1e3)


def plot(rows: list[dict], path: pathlib.Path) -> None:
    plt = pyplot()
    if plt is None:
        return
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
    parser.add_argument("--distinct", action="store_true", help="layers of distinct widths, mesh (2, 4)")
    parser.add_argument("--layers", type=int, nargs="+")
    parser.add_argument("--o3-max-layers", type=int)
    opts = parser.parse_args()
    layers = opts.layers or ([6, 12, 24, 48] if opts.distinct else [6, 12, 24, 36, 48, 72])
    o3_max = opts.o3_max_layers if opts.o3_max_layers is not None else (12 if opts.distinct else 36)
    mesh = rj.device_mesh((2, 4), ("data", "model")) if opts.distinct else rj.device_mesh((8,), ("devices",))
    name = "search_scaling_distinct" if opts.distinct else "search_scaling"
    rows = []
    for n in layers:
        for level in ("O2", "O3"):
            if level == "O3" and n > o3_max:
                continue
            rows.append(plan_once(n, level, mesh, opts.distinct))
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
    cols = ["layers", "opt", "instructions", "critical", "proportion", "subgraphs", "ilp_groups", "ilp_vars",
            "windows", "build_s", "solve_s", "plan_s", "status", "step_ms"]
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    o3 = {r["layers"]: r["step_ms"] for r in rows if r["opt"] == "O3"}
    gaps = [f"L={r['layers']}: O2 {100 * (r['step_ms'] / o3[r['layers']] - 1):+.2f}% vs O3"
            for r in rows if r["opt"] == "O2" and r["layers"] in o3]
    model = ("layers of distinct FFN widths (1024 + 64 i), mesh (2, 4)" if opts.distinct
             else "mesh (8,)")
    lines = [f"# Search time vs depth (GPT backbone, hidden 512, seq 512, batch 8, vocab 50304), {model}, m8-v100",
             "", f"{datetime.date.today()}, jax {jax.__version__}, {os.cpu_count()} CPU cores. plan_s = lowering + "
             "import + search (wall time); build_s = strategies, cones and ILP construction; windows: how many "
             "windows O2 solved the ILP in (0: one ILP; ilp_vars is then the largest window's).", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    lines += ["", "Predicted cost, O2 against O3: " + "; ".join(gaps) + ".", "",
              f"![search time and predicted step]({name}.png)"]
    text = "\n".join(lines) + "\n"
    print(text)
    (RESULTS / f"{name}.md").write_text(text)
    plot(rows, RESULTS / f"{name}.png")


if __name__ == "__main__":
    main()
