"""tessera.config: JAX's config.update for the options Tessera reads, and the process's one
cluster client, made on first use from them:

    tessera.config.update("jax_num_cpu_devices", 8)              # Client::local(8)
    tessera.config.update("tessera_coordinator", "host:5000")    # Client::connect
    tessera.config.update("tessera_adopt_puts", True)            # ConnectOptions::adopt_puts

Without either: TESSERA_COORDINATOR, then JAX_NUM_CPU_DEVICES, then XLA_FLAGS'
--xla_force_host_platform_device_count from the environment, else Client::local(1) (JAX's
one CPU device). Changing the cluster after first use raises FailedPreconditionError (JAX
only warns and keeps the old backend). tessera_adopt_puts (default: TESSERA_ADOPT_PUTS from the
environment, else False) is the connection's ConnectOptions::adopt_puts: the workers on this
host keep each put's shared memory as their buffer instead of copying it out (docs/design.md,
"Co-located clients"); it applies to tessera_coordinator's cluster only (an embedded cluster has
no shared-memory transfers: asking for it there raises ValueError).
"""
import atexit
import gc
import os
import re
import threading

from . import _tessera
from . import errors


def _env_devices():
    n = os.environ.get("JAX_NUM_CPU_DEVICES")
    if n:
        return int(n)
    m = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(m.group(1)) if m else None


def _env_bool(name):
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


class Config:
    _CLUSTER_OPTIONS = ("jax_num_cpu_devices", "tessera_coordinator", "tessera_adopt_puts")

    def __init__(self):
        self._lock = threading.Lock()
        self._client = None
        self._client_from = None
        self._values = {
            "jax_num_cpu_devices": _env_devices(),
            "tessera_coordinator": os.environ.get("TESSERA_COORDINATOR") or None,
            "tessera_adopt_puts": _env_bool("TESSERA_ADOPT_PUTS"),
            "jax_enable_x64": _env_bool("JAX_ENABLE_X64"),
        }

    def update(self, name, value):
        if name not in self._values:
            raise AttributeError(f"Unrecognized config option: {name}")
        with self._lock:
            if name in self._CLUSTER_OPTIONS and self._client is not None and self._values[name] != value:
                raise errors.FailedPreconditionError(
                    f"config.update({name!r}, {value!r}) comes too late: the cluster was already chosen "
                    f"({self._client_from}) by an earlier call that used devices; update it right after "
                    "`import tessera` (JAX ignores such a late update with a warning)")
            if name == "jax_num_cpu_devices" and value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"jax_num_cpu_devices must be a positive int, not {value!r}")
            if name == "tessera_adopt_puts" and not isinstance(value, bool):
                raise ValueError(f"tessera_adopt_puts must be True or False, not {value!r}")
            self._values[name] = value

    def __getattr__(self, name):
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        raise AttributeError(f"Unrecognized config option: {name}")

    def client(self):
        """The cluster client, made on first use (Client::connect or Client::local)."""
        with self._lock:
            if self._client is None:
                address = self._values["tessera_coordinator"]
                adopt = self._values["tessera_adopt_puts"]
                if address:
                    self._client = _tessera.Client.connect(address, 1, 30.0, adopt_puts=adopt)
                    self._client_from = f"tessera_coordinator={address!r}" + (", tessera_adopt_puts=True" if adopt else "")
                elif adopt:
                    raise ValueError("tessera_adopt_puts=True (ConnectOptions::adopt_puts) applies to a cluster "
                                     "reached through tessera_coordinator; the embedded cluster of "
                                     "jax_num_cpu_devices has no shared-memory transfers to adopt")
                else:
                    n = self._values["jax_num_cpu_devices"] or 1
                    self._client = _tessera.Client.local(n)
                    self._client_from = f"Client::local({n})"
            return self._client


    def _shutdown(self):
        """At exit, while the interpreter is whole: drop the client (and with it an embedded
        cluster, once no Array holds it) and the jit caches, rather than during finalization."""
        from . import _api
        _api._eager_cache.clear()
        _api._reshard.clear()
        with self._lock:
            self._client = None
        gc.collect()


config = Config()
atexit.register(config._shutdown)
