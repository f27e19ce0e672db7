"""jax.profiler's trace, over Client::start_profile / stop_profile (docs/guide.md, "Seeing where
the time goes"): a timeline of this client's calls, the coordinator's compiles and dispatches
and every device's kernels, collectives, messages and transfers.

    with tessera.profiler.trace("/tmp/step.json"):
        y = step(x).block_until_ready()
    # /tmp/step.json (Chrome trace-event JSON: Perfetto, chrome://tracing) and /tmp/step.json.html

Unlike JAX's, `path` names the trace file itself (JAX's log_dir is a directory of TensorBoard
runs), and the HTML viewer beside it opens without TensorBoard or a network.
"""
import contextlib

from ._config import config


def start_trace(path, events_per_daemon=1 << 16):
    """Starts recording; stop_trace() writes `path` and `path`.html."""
    global _path
    config.client().start_profile(int(events_per_daemon))
    _path = str(path)


def stop_trace():
    """Stops the recording start_trace() began and writes its files."""
    global _path
    path, _path = _path, None
    # Without a start_trace, the SDK raises FailedPreconditionError ("no profile is running").
    config.client().stop_profile(path if path is not None else "")


_path = None


@contextlib.contextmanager
def trace(path, events_per_daemon=1 << 16):
    """jax.profiler.trace: records while the block runs, then writes `path` and `path`.html
    (also when the block raises)."""
    start_trace(path, events_per_daemon)
    try:
        yield
    finally:
        stop_trace()
