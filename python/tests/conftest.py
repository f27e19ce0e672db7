# Every test file runs in its own process (one ctest each) on one Client::local(8), chosen
# here before first use as a JAX program chooses its CPU devices.
import os
import sys

import pytest

import tessera

tessera.config.update("jax_num_cpu_devices", 8)

SOURCE_DIR = os.environ.get("TESSERA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))


# Auto axes: the tests that take these fixtures run numpy-style code under many layouts and let
# the compiler propagate them (GSPMD), as JAX's own guides build such a mesh since make_mesh
# defaults to Explicit axes (docs/parallel.md: `auto_mesh = jax.make_mesh((4, 2), ('X', 'Y'),
# (Auto, Auto))`). Explicit mode has its own meshes (test_explicit.py, test_arrays.py).
@pytest.fixture(scope="session")
def mesh():
    return tessera.make_mesh((4, 2), ("data", "model"), axis_types=tessera.sharding.AxisType.Auto)


@pytest.fixture(scope="session")
def mesh8():
    return tessera.make_mesh((8,), ("x",), axis_types=tessera.sharding.AxisType.Auto)
