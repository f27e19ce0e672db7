# examples/python/shard_map_tutorial.py (the "Toy examples" of JAX's shard_map notebook, as a
# user writes them) against numpy on the host: each matmul's product and layout, and each
# network strategy's loss and gradients against a float64 forward and hand-written backward of
# the same model on the same data. [SM] docs/notebooks/shard_map.md in jax-ml/jax.
import os
import sys

import numpy as np
import pytest

from tessera.sharding import PartitionSpec as P

from conftest import SOURCE_DIR

sys.path.insert(0, os.path.join(SOURCE_DIR, "examples", "python"))
import shard_map_tutorial  # noqa: E402

import host_mlp  # noqa: E402


def test_matmuls_give_the_product_laid_out_as_out_specs():
    out = shard_map_tutorial.matmuls()
    assert list(out) == ["allgather", "psumscatter", "psumscatter_overlapped", "psumscatter_overlapped_bidi"]
    for name, (c, lhs, rhs) in out.items():
        want = np.asarray(lhs).astype(np.float64) @ np.asarray(rhs).astype(np.float64)
        np.testing.assert_allclose(np.asarray(c), want, rtol=1e-5, atol=1e-5, err_msg=name)
        # [SM]: every one returns its result laid out as rhs_spec, P('i', None), on 4 devices.
        assert c.sharding.spec in (P("i"), P("i", None)), (name, c.sharding)
        assert len(c.sharding.mesh.devices.flat) == 4
    # Example 2 re-lays lhs out by its contracting dimension.
    assert out["psumscatter"][1].sharding.spec == P(None, "i")


def test_networks_agree_with_numpy():
    out, (params, batch) = shard_map_tutorial.networks()
    want_loss, want_grads = host_mlp.loss_and_grads(params, batch)
    assert list(out) == ["dp", "fsdp", "tp", "fsdp_tp"]
    for name, (ref, got, ref_grads, grads) in out.items():
        assert float(ref) == pytest.approx(want_loss, rel=1e-4), name
        assert float(got) == pytest.approx(want_loss, rel=1e-4), name
        for which, tree in (("reference", ref_grads), (name, grads)):
            assert len(tree) == len(want_grads)
            for k, ((dW, db), (wW, wb)) in enumerate(zip(tree, want_grads)):
                np.testing.assert_allclose(np.asarray(dW), wW, rtol=1e-3, atol=1e-4, err_msg=f"{which} W{k}")
                np.testing.assert_allclose(np.asarray(db), wb, rtol=1e-3, atol=1e-4, err_msg=f"{which} b{k}")
        # The notebook's check of the same.
        assert bool(shard_map_tutorial.allclose(ref_grads, grads)), name
    # FSDP's gradients come back split as its parameters ([SM]: params P('batch')).
    assert out["fsdp"][3][0][0].sharding.spec in (P("batch"), P("batch", None))


def test_the_example_runs_as_a_program():
    import subprocess
    run = subprocess.run([sys.executable, os.path.join(SOURCE_DIR, "examples", "python", "shard_map_tutorial.py")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert [l.split()[0] for l in lines] == ["allgather", "psumscatter", "psumscatter_overlapped",
                                            "psumscatter_overlapped_bidi", "dp", "fsdp", "tp", "fsdp_tp"]
    assert all(l.split()[-1] == "True" for l in lines), run.stdout
