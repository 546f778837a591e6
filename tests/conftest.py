"""Shared test setup: 8 fake CPU devices for sharding tests, quiet transformers."""

import os

# Must be set before jax initialises its backends.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# The TPU AOT test loads libtpu; let concurrent test processes each load it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.tolerance import checked_allclose  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)
# Every assert_allclose of the suite goes through the tolerance check (tests/README.md).
np.testing.assert_allclose = checked_allclose


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    if jax.default_backend() != "cpu" and len(devs) < 8:
        pytest.skip("needs 8 devices (runs on CPU with fake devices)")
    assert len(devs) == 8, "tests expect 8 fake CPU devices (XLA_FLAGS set too late?)"
    return devs
