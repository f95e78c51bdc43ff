"""The timeline referee (`runtime/compiled/timeline.py`) beside XLA's own estimate of the same schedule.

Each step is compiled for 8 described H100s (`rj.gpu_topology`, no GPU) with XLA's analytical
speed-of-light latency estimator, which also dumps the latency-hiding scheduler's estimate of each
computation it scheduled (`<module>.schedule.txt`: `total_cycles`, the cycles wasted waiting on
collectives, at `cycles_per_microsecond` 1). The same compiled program is replayed by
`compiled_cost.replay` at the 8x-h100 preset's prices; both figures are per run of a computation.

python -m benchmarks.timeline_crosscheck → prints a table, writes benchmarks/results/timeline_crosscheck.md
"""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import datetime  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import rhino_jax as rj  # noqa: E402
from benchmarks import RESULTS  # noqa: E402
from rhino_jax.runtime.compiled.compiled_cost import dot_dtype, replay  # noqa: E402
from rhino_jax.runtime.compiled.collectives import collective_stats  # noqa: E402
from rhino_jax.runtime.compiled.kernels import program_kernels  # noqa: E402
from rhino_jax.models.mlp import make_mlp_train_step, mlp_example  # noqa: E402
from rhino_jax.search.cost.cluster import H100_8X  # noqa: E402

SOL = {"xla_gpu_enable_analytical_sol_latency_estimator": True, "xla_dump_latency_hiding_schedule": True}


def _mesh() -> Mesh:
    return Mesh(np.array(rj.gpu_topology("h100")), ("d",), axis_types=(AxisType.Auto,))


def fsdp_two_matmuls():
    """SGD on two [1024, 1024] weights, weights and batch split 8 ways: gathers and reduce-scatters."""
    mesh = _mesh()
    split = NamedSharding(mesh, P("d"))

    def fsdp_step(w1, w2, x):
        g1, g2 = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w[0]) @ w[1]))((w1, w2))
        return w1 - 0.1 * g1, w2 - 0.1 * g2

    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=split) for s in ((1024, 1024), (1024, 1024), (2048, 1024))]
    return jax.jit(fsdp_step, out_shardings=(split, split)).lower(*args)


def data_parallel_mlp():
    """The MLP train step (widths 1024-4096-1024), parameters replicated, batch split: gradient all-reduces."""
    mesh = _mesh()
    step, args = make_mlp_train_step(), mlp_example((1024, 4096, 1024), 512, abstract=True)
    replicated = lambda tree: jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)  # noqa: E731
    ins = (*[replicated(a) for a in args[:2]], NamedSharding(mesh, P("d")))
    outs = (*[replicated(a) for a in args[:2]], NamedSharding(mesh, P()))
    return jax.jit(step, in_shardings=ins, out_shardings=outs).lower(*args)


def scanned_fsdp():
    """Six [1024, 1024] layers under `lax.scan`, each split 8 ways: a gather per layer in the loops."""
    mesh = _mesh()
    split = NamedSharding(mesh, P(None, "d"))

    def scan_step(ws, x):
        def loss(ws):
            h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
            return jnp.mean(h)
        return ws - 0.1 * jax.grad(loss)(ws)

    args = [jax.ShapeDtypeStruct((6, 1024, 1024), jnp.float32, sharding=split),
            jax.ShapeDtypeStruct((2048, 1024), jnp.float32, sharding=NamedSharding(mesh, P("d")))]
    return jax.jit(scan_step, out_shardings=split).lower(*args)


STEPS = {"fsdp two matmuls": fsdp_two_matmuls, "data-parallel MLP": data_parallel_mlp, "scanned FSDP": scanned_fsdp}


def xla_schedule(dump: pathlib.Path) -> dict[str, tuple[float, float]]:
    """computation name -> (total µs, µs waited on collectives) from the scheduler's dump."""
    (path,) = dump.glob("*.schedule.txt")
    text = path.read_text()
    names = dict(zip(re.findall(r"\n    id: (\d+)\n    root_id", text),
                     re.findall(r'\n  computations \{\n    name: "([^"]*)"', text)))
    out = {}
    for block in text.split("computation_schedules {")[1:]:
        stats = block[block.index("scheduler_statistics"):]
        rate = float(re.search(r"\bcycles_per_microsecond: ([\d.]+)", stats).group(1))
        total = float(re.search(r"\btotal_cycles: ([\d.e+-]+)", stats).group(1))
        wasted = re.search(r"\btotal_wasted_cycles: ([\d.e+-]+)", stats)
        comp = names[re.search(r"computation_id: (\d+)", block).group(1)]
        out[comp] = (total / rate, (float(wasted.group(1)) if wasted else 0.0) / rate)
    return out


def main():
    rows = []
    for case, make in STEPS.items():
        with tempfile.TemporaryDirectory() as dump:
            compiled = make().compile(compiler_options={**SOL, "xla_dump_to": dump})
            xla = xla_schedule(pathlib.Path(dump))
        text = compiled.as_text()
        kernels, _ = program_kernels(text)
        line = replay(text, kernels, collective_stats(text), H100_8X, dot_dtype(text))
        entry = re.search(r"^ENTRY %?([\w.\-]+)", text, re.MULTILINE).group(1)
        for comp, (total_us, wasted_us) in xla.items():
            ours = line.computations[comp] * 1e6
            rows.append(dict(step=case, computation=comp, xla_us=total_us, xla_waited_us=wasted_us, ours_us=ours,
                             ours_exposed_us=line.exposed_comm_s * 1e6 if comp == entry else None,
                             ours_serial_us=line.serial_s * 1e6 if comp == entry else None, ratio=total_us / ours))
    cols = list(rows[0])
    fmt = lambda v: "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))  # noqa: E731
    table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    table += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    print("\n".join(table))
    notes = (RESULTS / "timeline_crosscheck.md").read_text().split("<!-- table -->")
    stamp = f"jax {jax.__version__}, {datetime.date.today()}"
    (RESULTS / "timeline_crosscheck.md").write_text(
        notes[0] + "<!-- table -->\n\n" + stamp + "\n\n" + "\n".join(table) + "\n\n<!-- table -->" + notes[-1])


if __name__ == "__main__":
    main()
