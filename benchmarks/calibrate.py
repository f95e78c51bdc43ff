"""Calibrate the cost model's compute term on a real GPU.

Two steps, because the GPU machine and the planning machine differ:

python -m benchmarks.calibrate measure --out DIR      (on the GPU)
    Times, on one device, (a) every distinct dot/convolution of each measured train step in
    isolation, and the larger memory-bound ops, and (b) the whole train step of the zoo's tiny
    presets and of "medium" presets (paper sizes cut to fit one GPU), each at two depths so
    that the difference is the time of the added layers. Writes DIR/measured.json, with each
    op's StableHLO text. Needs only jax, numpy and the repo's benchmarks/ (run from the repo
    root): not an installed rhino_jax, its planner (rhino_jax.search, rhino_jax.hlo_passes) nor
    ortools, and not the jax version rhino_jax pins. The zoo is imported with the body of
    `rhino_jax/__init__.py` (which imports the planner) deferred (`calibrate_measure.load_zoo`).

python -m benchmarks.calibrate fit [--measured FILE] [--preset NAME] [--out-dir DIR]   (with rhino_jax)
    Counts each op's FLOPs as the cost model does, by importing its stored StableHLO into
    rhino_jax's Graph IR (`op_flops`); fits the compute roofline's constants (achievable FLOP/s
    per dtype, memory bandwidth, and the fixed time per op that the roofline leaves out) to the
    isolated ops, then predicts the measured steps from rhino_jax's own graph of each step
    (`import_module`, `memory_traffic`, `compute_time`) with the cluster preset (default
    `8x-h100`) as it was and as fitted. Writes calibration.md and calibration.json to DIR
    (default benchmarks/).

Ops are timed as XLA compiles them alone (jit of the one primitive), whole steps as jit
compiles them (fused). Every time is the median of several repetitions of back-to-back calls.

This module is the command line: the measuring is in `calibrate_measure.py`, the fitting in
`calibrate_fit.py`.
"""
from __future__ import annotations

import argparse
import pathlib

from benchmarks import RESULTS
from benchmarks.calibrate_fit import fit_and_report
from benchmarks.calibrate_measure import MEDIUM, measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", type=pathlib.Path, required=True)
    m.add_argument("--models", nargs="+", default=list(MEDIUM), choices=list(MEDIUM))
    m.add_argument("--quick", action="store_true", help="tiny presets only (a smoke run)")
    f = sub.add_parser("fit")
    f.add_argument("--measured", type=pathlib.Path, default=RESULTS / "calibration_measured.json")
    f.add_argument("--preset", default="8x-h100", help="the cluster preset whose constants are fitted")
    f.add_argument("--out-dir", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args()
    if args.cmd == "measure":
        measure(args.out, args.models, args.quick)
    else:
        print(fit_and_report(args.measured, args.preset, args.out_dir))


if __name__ == "__main__":
    main()
