"""rhino_jax: automatic SPMD parallelization of JAX training steps (Rhino)."""
from setuptools import setup

setup(
    name="rhino_jax",
    version="0.1.0",
    description="Auto-parallelize a single-device JAX training step onto a device mesh",
    python_requires=">=3.11",  # jax 0.10 needs 3.11; jax 0.11 and 0.12 need 3.12
    packages=[
        "rhino_jax",
        "rhino_jax.models",
        "rhino_jax.hlo_passes",
        "rhino_jax.search",
        "rhino_jax.runtime",
    ],
    package_dir={
        "rhino_jax": "rhino_jax",
        "rhino_jax.hlo_passes": "hlo_passes",
        "rhino_jax.search": "search",
        "rhino_jax.runtime": "runtime",
    },
    # The jax range whose internals hlo_passes/jax_internals.py (SUPPORTED_JAX) was checked against.
    install_requires=["jax>=0.10.2,<0.13", "jaxlib>=0.10.2,<0.13", "numpy", "scipy", "ortools>=9.15", "networkx"],
    # Test-only: pytest-xdist, which runs the suite in a process per core (`-n auto`: one process
    # of 8 emulated devices is mostly single-threaded Python and XLA compiles); the user code the
    # tests parallelize (Flax linen/NNX, Optax, Equinox; Orbax for the checkpoints users save the
    # plan's state with), versions that run on jax 0.10 through 0.12; jax's CUDA plugin, which
    # compiles for described GPUs without one (rj.gpu_topology; no CUDA toolkit: about 340 MB),
    # where jax 0.11 and newer run. Its version must be jaxlib's: the newest of both in range is
    # the same release.
    extras_require={"test": ["pytest", "pytest-xdist>=3", "flax>=0.12,<0.13", "optax>=0.2.8,<0.3",
                             "equinox>=0.13,<0.14", "orbax-checkpoint>=0.12,<0.13",
                             "jax-cuda12-plugin>=0.11,<0.13; python_version >= '3.12' and sys_platform == 'linux'"],
                    "bench": ["matplotlib"]},
)
