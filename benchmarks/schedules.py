"""Predicted step time of GPipe, 1F1B and eager-1F1B ("On Optimizing the Communication of Model
Parallelism" §4) as the transfer between stages grows: each stage runs its schedule's order as soon
as its inputs have arrived (`Schedule.makespan`), forward 1 unit and backward 2 units per
micro-batch on every stage, a transfer of t units after each cross-stage task. Also the
micro-batches each schedule holds on its first stage (activation memory).

python -m benchmarks.schedules → prints a table, writes benchmarks/results/schedules.md
"""
import datetime

from benchmarks import RESULTS
from rhino_jax.runtime import schedules


def main():
    rows = []
    for stages, micro_batches in ((4, 8), (4, 32), (8, 32)):
        for transfer in (0.0, 0.25, 0.5, 1.0):
            row = dict(stages=stages, micro_batches=micro_batches, transfer=transfer)
            for name in schedules.NAMES:
                s = schedules.make(name, stages, micro_batches)
                row[name] = s.makespan([1.0] * stages, [2.0] * stages, transfer)
                row[f"{name} held"] = s.in_flight()[0]
            rows.append(row)
    cols = list(rows[0])
    lines = ["# Pipeline schedules: predicted step time (units of one forward) and micro-batches held on stage 0",
             "", f"{datetime.date.today()}. Forward 1, backward 2 per micro-batch and stage; `transfer`: the time "
             "a tensor takes from one stage to the next. Without transfers the three take (m + p - 1) * 3; with "
             "them 1F1B waits on each one, eager-1F1B runs forwards ahead and hides them like GPipe while "
             "holding fewer micro-batches.", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(f"{r[c]:g}" for c in cols) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    (RESULTS / "schedules.md").write_text(text)


if __name__ == "__main__":
    main()
