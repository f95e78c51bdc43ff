"""8 emulated CPU devices for every test; set before jax is imported anywhere. Fixtures several
test files share."""
import os

import pytest

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(scope="session")
def tiny_gpt():
    """GPT_TINY's step, its arguments and its one-device result, made once: each new step is a new
    function, which jax.jit compiles again (seconds)."""
    import jax
    from rhino_jax.models import gpt
    step, args = gpt.make_gpt_train_step(gpt.GPT_TINY), gpt.gpt_example(gpt.GPT_TINY)
    return step, args, jax.jit(step)(*args)
