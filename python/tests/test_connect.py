# tessera.config's connection options against a real cluster: a tessera-coordinator and two
# tessera-worker processes on 127.0.0.1 ephemeral ports (each reports its address), reached from
# a child Python process through TESSERA_COORDINATOR, as a user's program reaches one.
# tessera_adopt_puts is ConnectOptions::adopt_puts: the workers keep each put's memfd as their
# buffer (mapped: /proc/<worker>/maps lists it, as tests/integration/shm_transfer_test.cc's
# AdoptedPutsAreTheWorkersBuffers counts), where without it they copy the block out (none mapped).
import os
import select
import subprocess
import sys
import time

import pytest

import tessera

BIN = os.path.join(os.environ.get("TESSERA_BINARY_DIR", ""), "bin")
DEADLINE_S = 30


def _address_line(proc):
    """The line a daemon prints when it listens ('... listening on 127.0.0.1:PORT'), read
    within DEADLINE_S."""
    deadline = time.monotonic() + DEADLINE_S
    buffered = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            continue
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            break
        buffered += chunk
        for line in buffered.split(b"\n"):
            if b"listening on" in line:
                return line.decode()
    raise AssertionError(f"pid {proc.pid} reported no address within {DEADLINE_S}s: {buffered[-500:]!r}")


@pytest.fixture(scope="module")
def cluster():
    if not os.path.exists(os.path.join(BIN, "tessera-coordinator")):
        pytest.skip("TESSERA_BINARY_DIR is not set to a build with the daemons (ctest sets it)")
    procs = []

    def spawn(argv):
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    try:
        coordinator = spawn([os.path.join(BIN, "tessera-coordinator"), "--port=0"])
        address = _address_line(coordinator).split()[-1]
        workers = [spawn([os.path.join(BIN, "tessera-worker"), f"--coordinator={address}", "--port=0",
                          f"--device_id={i}", "--memory_bytes=268435456"]) for i in range(2)]
        for w in workers:
            _address_line(w)
        yield address, [w.pid for w in workers]
    finally:
        for p in procs:  # our own children only, by pid
            p.kill()
        for p in procs:
            p.wait(timeout=DEADLINE_S)


# Puts one block per worker and prints, per worker, how many of the client's transfer memfds it
# maps while the array lives, then whether the array reads back equal.
CHILD = r"""
import sys
import numpy as np
import tessera as jax
from tessera.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((2,), ("x",))
x = np.arange(2 * 4096, dtype=np.float32).reshape(2, 4096)
a = jax.device_put(x, NamedSharding(mesh, P("x")))
a.block_until_ready()
mapped = [sum("/memfd:tessera-transfer" in line for line in open(f"/proc/{pid}/maps")) for pid in sys.argv[1:]]
print(mapped, np.array_equal(np.asarray(a), x), jax.config.tessera_adopt_puts)
"""


def _run_child(address, pids, prelude="", script=CHILD, **env):
    """`script` (after `prelude`) in a Python process of its own connected to the cluster
    (through TESSERA_COORDINATOR unless `address` is None); its line."""
    drop = ("TESSERA_ADOPT_PUTS", "JAX_NUM_CPU_DEVICES", "TESSERA_COORDINATOR")
    child_env = {k: v for k, v in os.environ.items() if k not in drop}
    if address is not None:
        child_env["TESSERA_COORDINATOR"] = address
    child_env.update(**env)
    out = subprocess.run([sys.executable, "-c", prelude + script, *map(str, pids)], env=child_env,
                         capture_output=True, text=True, timeout=DEADLINE_S)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_adopt_puts_from_the_environment_maps_each_put_on_the_workers(cluster):
    address, pids = cluster
    assert _run_child(address, pids) == "[0, 0] True False"  # off by default: copied out
    assert _run_child(address, pids, TESSERA_ADOPT_PUTS="1") == "[1, 1] True True"


def test_adopt_puts_by_config_update(cluster):
    address, pids = cluster
    prelude = "import tessera\ntessera.config.update('tessera_adopt_puts', True)\n"
    assert _run_child(address, pids, prelude) == "[1, 1] True True"


def test_coordinator_by_config_update(cluster):
    # Issue #20 item 2: tessera.config.update("tessera_coordinator", "host:port") instead of the
    # environment variable. CHILD's (2,) mesh needs both of the cluster's workers (without the
    # update the process would make Client::local(1), and make_mesh((2,)) would fail).
    address, pids = cluster
    prelude = f"import tessera\ntessera.config.update('tessera_coordinator', {address!r})\n"
    assert _run_child(None, pids, prelude) == "[0, 0] True False"
    with pytest.raises(AssertionError, match="make_mesh|devices"):
        _run_child(None, pids)


def test_adopt_puts_is_checked_and_chosen_once():
    with pytest.raises(ValueError, match="tessera_adopt_puts must be True or False, not 'yes'"):
        tessera.config.update("tessera_adopt_puts", "yes")
    tessera.devices()  # this process's embedded cluster (conftest), now chosen
    with pytest.raises(tessera.errors.FailedPreconditionError, match="tessera_adopt_puts.*comes too late"):
        tessera.config.update("tessera_adopt_puts", True)
    # In a process of its own: asked for with the embedded cluster, it is refused, not ignored.
    out = subprocess.run([sys.executable, "-c", "import tessera\ntessera.devices()"],
                         env={**os.environ, "TESSERA_ADOPT_PUTS": "1", "JAX_NUM_CPU_DEVICES": "2"},
                         capture_output=True, text=True, timeout=DEADLINE_S)
    assert out.returncode != 0
    assert "ValueError: tessera_adopt_puts=True (ConnectOptions::adopt_puts) applies to a cluster reached" in out.stderr


# Device.memory_stats()'s shared-memory counters, summed over the workers, around a put and a
# fetch of a P("x") array by a client on the workers' host: each row is a block contiguous in the
# client's array, so the workers read it straight from the client's memory and write it straight
# back there (process_vm_readv/writev: docs/design.md, "Direct reads", "Direct writes"), and
# every counter moves by the array's bytes (numpy's nbytes), as the C++
# ShmTransferTest.EveryDTypeRoundTripsThroughTheClientsMemory counts through DeviceStats. Then a
# psum over the workers, repeated until a collective message comes through their shared-memory
# rings (a ring attaches once its pair of workers has negotiated it), within DEADLINE_S.
STATS_CHILD = r"""
import time
import numpy as np
import tessera as jax
from tessera import shard_map
from tessera.sharding import NamedSharding, PartitionSpec as P
KEYS = ("shm_bytes_put", "client_memory_bytes_read", "shm_bytes_fetched", "client_memory_bytes_written")
def totals(keys=KEYS):
    return [sum(d.memory_stats()[k] for d in jax.devices()) for k in keys]
mesh = jax.make_mesh((2,), ("x",))
x = np.arange(2 * 4096, dtype=np.float32).reshape(2, 4096)
before = totals()
a = jax.device_put(x, NamedSharding(mesh, P("x")))
a.block_until_ready()
put = totals()
back = np.asarray(a)
fetched = totals()
messages = totals(("shm_messages_received",))[0]
deadline = time.monotonic() + DEADLINE_S  # the parent's, given in the prelude
while totals(("shm_messages_received",))[0] == messages and time.monotonic() < deadline:
    total = shard_map(lambda b: jax.lax.psum(b, "x"), mesh=mesh, in_specs=P("x"), out_specs=P())(a)
    assert np.array_equal(np.asarray(total), x.sum(0, keepdims=True))
print([p - b for b, p in zip(before, put)], [f - p for p, f in zip(put, fetched)], np.array_equal(back, x),
      x.nbytes, totals(("shm_messages_received",))[0] > messages)
"""


def test_memory_stats_count_the_bytes_moved_through_the_clients_memory(cluster):
    address, pids = cluster
    n = 2 * 4096 * 4
    line = _run_child(address, pids, prelude=f"DEADLINE_S = {DEADLINE_S}\n", script=STATS_CHILD)
    assert line == f"[{n}, {n}, 0, 0] [0, 0, {n}, {n}] True {n} True"
