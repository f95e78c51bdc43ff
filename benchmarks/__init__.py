"""Benchmark scripts, each run as `python -m benchmarks.<name>`; what they measure goes to `RESULTS`."""
import pathlib

# The folder every benchmark writes its tables, data and plots to (and reads the rows it keeps from).
RESULTS = pathlib.Path(__file__).parent / "results"


def pyplot():
    """matplotlib's pyplot drawing to files, or None (said) where matplotlib is not installed:
    a plot is the last thing a benchmark writes, after its tables."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
