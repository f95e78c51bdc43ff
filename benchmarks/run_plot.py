"""`python -m benchmarks.run`'s plots: predicted throughput per model and mesh, and search time
against layers."""
from __future__ import annotations

import math
import pathlib

import numpy as np

from benchmarks import pyplot
from benchmarks.run_report import _compiler, _h100_ms, _is_rhino


def plot(rows, layer_rows, out: pathlib.Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    paper = [r for r in rows if r.get("kind") == "paper" and r.get("step_ms") and r["status"] in ("ok", "time limit")]
    # One bar pair per (model, method, mesh): M8 from the CPU row, H100 from the GPU row where there is one.
    entries: dict[tuple, dict] = {}
    for r in paper:
        e = entries.setdefault((r["model"], r["method"], r["mesh"]), dict(
            model=r["model"], method=r["method"], mesh=r["mesh"], preset=r["preset"], batch=r["batch"], m8=None,
            h1=None, fits=True))
        if _compiler(r) == "cpu":
            e["m8"], e["fits"] = r["step_ms"], r.get("fits", r.get("fits_m8", True))
        if _h100_ms(r) is not None and (e["h1"] is None or _compiler(r) == "gpu"):
            e["h1"] = _h100_ms(r)
    models = list(dict.fromkeys(e["model"] for e in entries.values()))
    if models:
        cols = 3
        nrows = math.ceil(len(models) / cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 4.2 * nrows), squeeze=False)
        for ax, m in zip(axes.flat, models):
            rs = [e for e in entries.values() if e["model"] == m]
            labels = [f"{e['method']}\n({e['mesh']})" for e in rs]
            x = np.arange(len(rs))
            base = [e for e in rs if not _is_rhino(e["method"])]
            best_m8 = max((e["batch"] / e["m8"] for e in base if e["m8"]), default=None)
            best_h1 = max((e["batch"] / e["h1"] for e in base if e["h1"]), default=None)
            m8 = [e["batch"] / e["m8"] / best_m8 if best_m8 and e["m8"] else 0 for e in rs]
            h1 = [e["batch"] / e["h1"] / best_h1 if best_h1 and e["h1"] else 0 for e in rs]
            colors = ["tab:red" if _is_rhino(e["method"]) else "tab:blue" for e in rs]
            ax.bar(x - 0.2, m8, 0.4, color=colors, label="m8-v100")
            ax.bar(x + 0.2, h1, 0.4, color=colors, alpha=0.45, label="8x-h100")
            ax.axhline(1.0, color="k", lw=0.8, ls="--")
            for xi, e in zip(x, rs):
                if not e["fits"]:
                    ax.text(xi - 0.2, 0.02, "> 32 GiB", rotation=90, va="bottom", ha="center", fontsize=7)
            ax.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
            ax.set(title=f"{m} ({rs[0]['preset']}): best baseline {(best_m8 or 0) * 1e3:.3g} / "
                         f"{(best_h1 or 0) * 1e3:.3g} samples/s (M8 / H100)",
                   ylabel="predicted throughput / best baseline's")
            ax.title.set_fontsize(9)
            ax.grid(alpha=0.3, axis="y")
        for ax in list(axes.flat)[len(models):]:
            ax.axis("off")
        from matplotlib.patches import Patch
        fig.legend(handles=[Patch(color="tab:red", label="rhino_jax, m8-v100"),
                            Patch(color="tab:red", alpha=0.45, label="rhino_jax, 8x-h100"),
                            Patch(color="tab:blue", label="baseline, m8-v100"),
                            Patch(color="tab:blue", alpha=0.45, label="baseline, 8x-h100")],
                   loc="upper center", ncol=4, fontsize=9, frameon=False)
        fig.tight_layout(rect=(0, 0, 1, 0.96))
        fig.savefig(out / "throughput.png", dpi=90)
        plt.close(fig)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    srch = [r for r in paper if _is_rhino(r["method"]) and r["mesh"] == "8" and _compiler(r) == "cpu"]
    ms = list(dict.fromkeys(r["model"] for r in srch))
    for k, level in enumerate(("O2", "O3")):
        vals = [next((r["search_s"] for r in srch if r["model"] == m and r["method"].endswith(level)), 0) for m in ms]
        ax1.bar(np.arange(len(ms)) + (k - 0.5) * 0.4, vals, 0.4, label=level)
    ax1.set_xticks(np.arange(len(ms)), ms)
    ax1.set(ylabel="search s (lowering included)", title="search time, paper sizes, mesh (8,), M8")
    ax1.legend()
    ax1.grid(alpha=0.3, axis="y")
    for level, marker in (("O2", "o"), ("O3", "s")):
        rs = [r for r in layer_rows if r["opt"] == level]
        ax2.plot([r["layers"] for r in rs], [r["search_s"] for r in rs], marker=marker, label=level)
    ax2.set(xlabel="layers", ylabel="search s (lowering included)", title="search time vs layers (GPT-Medium width)")
    ax2.grid(alpha=0.3)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(out / "search_time.png", dpi=90)
    plt.close(fig)
