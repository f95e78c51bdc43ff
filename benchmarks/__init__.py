"""Benchmark scripts, each run as `python -m benchmarks.<name>`; what they measure goes to `RESULTS`."""
import pathlib

# The folder every benchmark writes its tables, data and plots to (and reads the rows it keeps from).
RESULTS = pathlib.Path(__file__).parent / "results"
