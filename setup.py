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
        "rhino_jax.core",
        "rhino_jax.pipelined",
        "rhino_jax.hlo_passes",
        "rhino_jax.search",
        "rhino_jax.search.coarsening",
        "rhino_jax.search.cost",
        "rhino_jax.search.solvers",
        "rhino_jax.search.space",
        "rhino_jax.search.staging",
        "rhino_jax.runtime",
        "rhino_jax.runtime.compiled",
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
                    "bench": ["matplotlib"],
                    # benchmarks/maxtext.py: MaxText's own Llama2 train step and shardings. maxtext
                    # itself goes in after this extra, with `pip install --no-deps maxtext==0.2.5`:
                    # its declared requirements pin its whole TPU/GPU image. These are the jax
                    # versions it was run with and what importing its trainer (train_compile) then
                    # needs, one import error at a time; versions as they were run.
                    "maxtext": ["jax==0.12.0.1", "jaxlib==0.12.0.1", "jax-cuda12-plugin==0.12.0.1",
                                "flax==0.12.12", "optax==0.2.8", "orbax-checkpoint==0.12.8",
                                "omegaconf==2.4.0", "packaging==26.4", "pathwaysutils==0.1.13",
                                "fastapi==0.165.0", "uvicorn==0.54.0", "requests==2.34.2",
                                "jinja2==3.1.6", "qwix==0.1.8", "aqtp==0.9.0", "tokamax==0.0.17",
                                "xprof==2.24.2", "jaxtyping==0.3.11", "einshape==1.0", "tqdm==4.70.1",
                                "huggingface-hub==2.4.0", "transformers==5.24.0", "grain==0.2.18",
                                "cloudpickle==3.1.3", "portpicker==1.6.0", "array-record==0.8.6",
                                "drjax==0.2.1", "wadler-lindig==0.1.8", "pillow==13.0.0",
                                "tiktoken==0.14.0", "sentencepiece==0.2.3", "sympy==1.14.0"]},
)
