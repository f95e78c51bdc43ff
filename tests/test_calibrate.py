"""benchmarks/calibrate.py: the fit recovers known constants, and measure → fit runs end to end
(on the CPU here; the real calibration runs on a GPU, see the script's docstring)."""
import json
import math

import pytest

from benchmarks import calibrate
from rhino_jax import H100_8X


def _op(primitive, flops, nbytes, seconds, dtype="float32"):
    return dict(primitive=primitive, dtype=dtype, shapes=[[1]], out=[[1]], flops=flops, bytes=nbytes, seconds=seconds)


def test_fit_recovers_the_roofline_constants():
    f_rate, bandwidth, per_op = 400e12, 2.5e12, 6e-6
    ops = [_op("dot_general", fl, 1e6, fl / f_rate + per_op) for fl in (2e9, 8e9, 3e10, 1e11, 4e11)]
    ops += [_op("add", 0.0, b, b / bandwidth + per_op) for b in (1e7, 5e7, 2e8, 1e9)]
    ops.append(_op("dot_general", 1e6, 1e4, 1.0))  # below MIN_FIT_FLOPS: timed, not fitted
    fit = calibrate.fit(ops, H100_8X)
    assert fit.flops_per_s["float32"] == pytest.approx(f_rate, rel=1e-6)
    assert fit.memory_bandwidth == pytest.approx(bandwidth, rel=1e-6)
    assert fit.per_op_s == pytest.approx(per_op, rel=1e-6)
    assert (fit.compute_ops, fit.memory_ops) == (5, 4)


def test_fit_keeps_the_preset_without_enough_ops():
    fit = calibrate.fit([_op("dot_general", 1e10, 1e6, 1e-4), _op("add", 0.0, 1e8, 1e-4)], H100_8X)
    assert fit.flops_per_s == {} and fit.memory_bandwidth == H100_8X.memory_bandwidth


def test_measure_then_fit_end_to_end(tmp_path):
    calibrate.measure(tmp_path, ["gpt"], quick=True)
    measured = json.loads((tmp_path / "measured.json").read_text())
    assert [s["label"] for s in measured["steps"]] == ["tiny"]
    assert measured["ops"] and all(o["seconds"] > 0 for o in measured["ops"])
    assert {"dot_general"} <= {o["primitive"] for o in measured["ops"]}
    text = calibrate.fit_and_report(tmp_path / "measured.json", "m8-v100", tmp_path)
    report = json.loads((tmp_path / "calibration.json").read_text())
    (step,) = report["steps"]
    assert step["measured_ms"] > 0 and math.isfinite(step["preset_ms"]) and step["kernels"] > 0
    assert measured["device"] in text and "`m8-v100` preset before" in text
