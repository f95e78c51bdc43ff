"""Cross-mesh resharding makespan, naive against load-balanced ("On Optimizing the Communication of
Model Parallelism" §3.2), on the paper's Table 2 cases under its host-level model: a (1024, 1024,
512) fp16 tensor, each mesh row one host, the two meshes on different hosts, 100 Gb/s between hosts
(12.5 GB/s) and NVLink inside.

python -m benchmarks.resharding → prints a table, writes benchmarks/results/resharding.md
"""
import datetime
import time

import numpy as np

from benchmarks import RESULTS
from rhino_jax.runtime import resharding as R

# The paper's Table 2: (send spec, receive spec, send mesh, receive mesh), a (1024, 1024, 512) fp16
# tensor; each mesh row is a host, the two meshes on different hosts.
TABLE_2 = {1: ("S0RR", "S0RR", (2, 4), (2, 4)), 2: ("RRR", "S0RR", (2, 4), (2, 4)), 3: ("RS0R", "S0RR", (2, 4), (2, 4)),
           4: ("RS01R", "S01RR", (2, 4), (2, 4)), 5: ("S1RR", "S0RR", (2, 4), (2, 4)),
           6: ("S0RR", "S0RR", (2, 4), (3, 4)), 7: ("S1RR", "RRR", (1, 4), (2, 4)), 8: ("RRR", "RRR", (2, 3), (3, 2)),
           9: ("RS0R", "RRS0", (2, 4), (2, 4))}


def _dims(spec: str) -> list[tuple[int, ...]]:
    """The paper's notation: per tensor dim R, or S with the mesh dims that split it (S01)."""
    out, i = [], 0
    while i < len(spec):
        j = i + 1
        while j < len(spec) and spec[j].isdigit():
            j += 1
        out.append(tuple(int(c) for c in spec[i + 1:j]) if spec[i] == "S" else ())
        i = j
    return out


def table_2_case(k: int):
    send, recv, src_shape, dst_shape = TABLE_2[k]
    src = np.arange(np.prod(src_shape)).reshape(src_shape)
    dst = 100 + np.arange(np.prod(dst_shape)).reshape(dst_shape)
    host = {int(d): int(d) // src_shape[1] for d in src.flat} | {int(d): 10 + (int(d) - 100) // dst_shape[1]
                                                                   for d in dst.flat}
    hosts = R.Hosts(lambda d: host[int(d)], inter_bandwidth=12.5e9, intra_bandwidth=130e9)
    shape = (1024, 1024, 512)
    return R.unit_tasks(R.block_map(shape, src, _dims(send)), R.block_map(shape, dst, _dims(recv)), 2), hosts


def main():
    rows = []
    for case, (send, recv, src, dst) in TABLE_2.items():
        tasks, hosts = table_2_case(case)
        start = time.perf_counter()
        best = R.plan(tasks, hosts)
        search_s = time.perf_counter() - start
        base = R.naive(tasks, hosts)
        rows.append(dict(case=case, send=f"{send} {src}", recv=f"{recv} {dst}", tasks=len(tasks),
                         lower_bound_ms=best.lower_bound_s * 1e3, naive_ms=base.makespan_s * 1e3,
                         balanced_ms=best.makespan_s * 1e3, method=best.method, speedup=base.makespan_s / best.makespan_s,
                         search_s=search_s))
    cols = list(rows[0])
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["# Cross-mesh resharding: naive vs load-balanced (the cases of Table 2 of On Optimizing the "
             "Communication of Model Parallelism, host-level model)", "",
             f"{datetime.date.today()}. naive: the first holder sends, tasks in order; balanced: the better of "
             "randomized greedy and DFS (`runtime/resharding.py`); lower bound: each receiving host takes its "
             "pieces in turn, a host holding pieces alone sends them in turn, and all pieces share the sending hosts.",
             "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    (RESULTS / "resharding.md").write_text(text)


if __name__ == "__main__":
    main()
