# Every test file runs in its own process (one ctest each) on one Client::local(8), chosen
# here before first use as a JAX program chooses its CPU devices.
import os
import sys

import pytest

import tessera

tessera.config.update("jax_num_cpu_devices", 8)

SOURCE_DIR = os.environ.get("TESSERA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.fixture(scope="session")
def mesh():
    return tessera.make_mesh((4, 2), ("data", "model"))


@pytest.fixture(scope="session")
def mesh8():
    return tessera.make_mesh((8,), ("x",))
