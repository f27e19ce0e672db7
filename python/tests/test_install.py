# `cmake --install` puts the package in <prefix>/lib/python3.X/site-packages, and the seed
# program runs from there (not from the build tree) with that directory on PYTHONPATH.
import os
import subprocess
import sys

import pytest

from conftest import SOURCE_DIR


def test_installed_package_runs_the_seed_program(tmp_path):
    build = os.environ.get("TESSERA_BINARY_DIR")
    if not build:
        pytest.skip("TESSERA_BINARY_DIR is not set (ctest sets it)")
    prefix = tmp_path / "prefix"
    subprocess.run(["cmake", "--install", build, "--prefix", str(prefix)], check=True, capture_output=True,
                   timeout=120)
    site = prefix / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    assert (site / "tessera" / "__init__.py").is_file()
    env = dict(os.environ, PYTHONPATH=str(site))
    where = subprocess.run([sys.executable, "-c", "import tessera; print(tessera.__file__)"], capture_output=True,
                           text=True, env=env, cwd=tmp_path, timeout=60)
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr
    out = subprocess.run([sys.executable, os.path.join(SOURCE_DIR, "examples", "python", "seed.py")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "(16, 4)\nP('data', 'model')\n8 (4, 2)\n"
