# tessera.profiler.trace (jax.profiler.trace's name; jax/_src/profiler.py): the trace of a
# jitted matmul with a psum, written with its HTML viewer.
import json
import os

import numpy as np
import pytest

import tessera
import tessera.numpy as jnp
from tessera.sharding import NamedSharding, PartitionSpec as P


def test_trace_records_every_devices_kernels_and_collectives(mesh, tmp_path):
    path = tmp_path / "step.json"
    x = np.arange(128, dtype=np.float32).reshape(16, 8)
    w = np.arange(32, dtype=np.float32).reshape(8, 4)
    with tessera.profiler.trace(path):
        xd = tessera.device_put(x, NamedSharding(mesh, P(None, "model")))
        wd = tessera.device_put(w, NamedSharding(mesh, P("model", None)))
        y = tessera.jit(lambda a, b: jnp.tanh(a @ b))(xd, wd)  # a partial sum over 'model': an all_reduce
        np.testing.assert_allclose(np.asarray(y), np.tanh(x @ w), rtol=1e-6)
    trace = json.loads(path.read_text())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    for d in range(8):
        pid = next(p for p, n in names.items() if n.startswith(f"device {d} ("))
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid]
        assert any(e["cat"] == "kernel" and e["name"] == "dot_general" for e in spans), d
        reduces = [e for e in spans if e["cat"] == "collective" and e["name"] == "all_reduce"]
        assert len(reduces) == 1, d
        assert reduces[0]["args"]["bytes"] == str(16 * 4 * 4)  # each device's (16, 4) f32 partial product
        # the path its bytes took: the embedded workers of tessera.local file them into each
        # other's mailboxes (in_process); a cluster of processes uses rings (shm) or gRPC
        assert reduces[0]["args"]["path"] in ("in_process", "shm", "grpc")
    assert trace["metadata"]["dropped_events"] == 0
    assert os.path.getsize(str(path) + ".html") > len(path.read_text())


def test_stop_without_start_names_the_state():
    with pytest.raises(tessera.errors.FailedPreconditionError, match="no profile is running"):
        tessera.profiler.stop_trace()
