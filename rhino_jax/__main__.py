"""python -m rhino_jax: the command line (`rhino_jax/cli.py`)."""
import sys

from .cli import main

sys.exit(main())
