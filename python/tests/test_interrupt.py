# Ctrl-C during a long wait on the cluster (issue #20 item 4): block_until_ready and
# np.asarray raise KeyboardInterrupt within a bounded time while the call is still running,
# the interpreter stays usable, and the interrupted call still finishes with the right result.
# A child process does the waiting (a SIGINT reaching pytest itself would end the session);
# this test sends it SIGINT once the child's main thread is asleep in the wait.
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np

import tessera as jax
import tessera.numpy as jnp
from tessera import lax
from tessera.sharding import Mesh, NamedSharding, PartitionSpec as P

CHILD = r"""
import sys, time
import numpy as np
import tessera
tessera.config.update("jax_num_cpu_devices", 1)
import tessera as jax, tessera.numpy as jnp
from tessera import lax

STEPS = 5000  # about 2.5 s here: far longer than the interrupt takes to land
x = np.full((256, 256), 0.01, np.float32)
w = np.eye(256, dtype=np.float32) * 0.9
f = jax.jit(lambda x, w: lax.fori_loop(0, STEPS, lambda i, c: (jnp.tanh(c[0] @ c[1]), c[1]), (x, w))[0])
small = jax.jit(lambda x: x * 2.0)
small(np.ones(4, np.float32)).block_until_ready()  # compiled and warm

for how in ("block_until_ready", "asarray"):
    y = f(x, w)
    print("waiting", flush=True)
    start = time.monotonic()
    try:
        y.block_until_ready() if how == "block_until_ready" else np.asarray(y)
        print("not interrupted", flush=True)
        sys.exit(1)
    except KeyboardInterrupt:
        interrupted_after = time.monotonic() - start
    print("interrupted", how, "ready" if y.is_ready() else "running", round(interrupted_after, 3), flush=True)
    # The interpreter and the client still work, and the interrupted call completes.
    np.testing.assert_array_equal(np.asarray(small(np.ones(4, np.float32))), np.full(4, 2.0, np.float32))
    expected = x.copy()
    for _ in range(STEPS):
        expected = np.tanh(expected @ w)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-4, atol=1e-6)
    print("finished", how, flush=True)
"""


def main_thread_state(pid):
    # The third field of /proc/PID/stat, after the parenthesised command name.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def read_line(child, deadline):
    line = child.stdout.readline()
    assert time.monotonic() < deadline, "the child did not answer in time"
    return line.strip()


def test_ctrl_c_ends_a_long_wait_and_the_call_still_finishes():
    env = dict(os.environ)
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        for how in ("block_until_ready", "asarray"):
            assert read_line(child, deadline) == "waiting"
            # Asleep (S) means it is inside the wait: nothing else after the print blocks.
            while main_thread_state(child.pid) != "S":
                assert time.monotonic() < deadline, "the child never started waiting"
                time.sleep(0.001)  # a poll interval, bounded by the deadline
            child.send_signal(signal.SIGINT)
            words = read_line(child, deadline).split()
            assert words[:3] == ["interrupted", how, "running"], words
            assert read_line(child, deadline) == f"finished {how}"
        assert child.wait(timeout=max(1.0, deadline - time.monotonic())) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_thread_waiting_on_the_cluster_lets_other_threads_run_python():
    # Issue #20 item 4: the GIL is released while waiting. One thread waits on a long
    # computation on device 0 (block_until_ready); the main thread, meanwhile, runs a small
    # program on device 1 and fetches it. Were the GIL held through the wait, the main thread's
    # fetch (which lets go of the GIL) would hand it to the waiter, which would keep it until
    # the long computation ended: the long one would then be ready by the time the main
    # thread checks. Each device's worker runs its own programs (worker/plan_runner.h).
    devs = jax.devices()
    on = [NamedSharding(Mesh(np.array(devs[i:i + 1]), ("d",)), P()) for i in (0, 1)]
    steps = 5000  # seconds on one core, as CHILD's
    x = jax.device_put(np.full((256, 256), 0.01, np.float32), on[0])
    w = jax.device_put(np.eye(256, dtype=np.float32) * 0.9, on[0])
    long = jax.jit(lambda x, w: lax.fori_loop(0, steps, lambda i, c: (jnp.tanh(c[0] @ c[1]), c[1]), (x, w))[0])
    small = jax.jit(lambda v: v * 2.0)
    ones = jax.device_put(np.ones(4, np.float32), on[1])
    small(ones).block_until_ready()  # compiled and warm

    y = long(x, w)  # traced and compiled here; running on device 0 when it returns
    started, errors = threading.Event(), []

    def waiter():
        started.set()
        try:
            y.block_until_ready()
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    try:
        assert started.wait(timeout=60)
        got = np.asarray(small(ones))
        long_still_running = not y.is_ready()
    finally:
        t.join(timeout=120)
    assert not t.is_alive() and not errors, errors
    np.testing.assert_array_equal(got, np.full(4, 2.0, np.float32))
    assert long_still_running, "the main thread ran only after the waiting thread's wait had ended"
    assert y.is_ready() and np.isfinite(np.asarray(y)).all()
