"""The devices each XLA compiler compiles for in the benchmarks (`third_party.py`, `run.py`).

cpu: the emulated CPU devices (`--xla_force_host_platform_device_count=8`, set by each script).
gpu: described H100 SXM devices (`rj.gpu_topology`), hosts of 8, which XLA's GPU compiler compiles
for through jax's CUDA plugin on a machine without a GPU (JAX_PLATFORMS=cpu); they run nothing.
"""
from __future__ import annotations

import argparse
import functools

import jax

import rhino_jax as rj

COMPILERS = ("cpu", "gpu")
KIND_ABBR = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A",
             "collective-permute": "CP"}


@functools.cache
def _described(hosts: int) -> list:
    """`hosts` described hosts of 8 H100s: one topology per host count, shared by every mesh."""
    return rj.gpu_topology("h100", hosts=hosts)


def devices(compiler: str, count: int, hosts: int = 1) -> list:
    """The first `count` devices `compiler` compiles for (for the GPU, of `hosts` hosts of 8)."""
    if compiler == "cpu":
        return jax.devices("cpu")[:count]
    if compiler == "gpu":
        return _described(hosts)[:count]
    raise ValueError(f"unknown compiler {compiler!r}; choose one of {COMPILERS}")


def check_gpu(parser: argparse.ArgumentParser, compilers) -> None:
    """Stop with the plugin's install hint, before anything runs, when the GPU compiler is asked
    for and jax cannot describe GPUs here (no CUDA plugin: Python < 3.12, or not installed)."""
    if "gpu" not in compilers:
        return
    try:
        _described(1)
    except RuntimeError as e:
        parser.error(f"{e}; or run the CPU compiler's rows only: --compiler cpu")


def rerun_over(saved: list, rows: list, key) -> list:
    """A partial rerun's results (`--keep`): the saved rows of every configuration (`key(row)`)
    not run again, then the new ones."""
    ran = set(map(key, rows))
    return [r for r in saved if key(r) not in ran] + rows
