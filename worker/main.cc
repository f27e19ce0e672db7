// tessera-worker: one Tessera device. Registers with the coordinator, holds shards in a
// buffer store with a memory limit, and serves transfers until SIGINT or SIGTERM.
#include <malloc.h>
#include <signal.h>
#include <sysexits.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/credentials.h"
#include "core/daemon.h"
#include "core/heap.h"
#include "core/host_array.h"
#include "core/open_mode.h"
#include "proto/rpc.h"
#include "worker/kernels/blas.h"
#include "worker/worker_server.h"

ABSL_FLAG(std::string, coordinator, "", "host:port of tessera-coordinator (env TESSERA_COORDINATOR); required");
ABSL_FLAG(std::string, host, "127.0.0.1",
          "address to advertise to the coordinator, clients and peers, and to listen on unless --bind_host "
          "says otherwise: an address or a name they resolve, such as a compose service name or a pod's DNS "
          "name (env TESSERA_WORKER_HOST)");
ABSL_FLAG(std::string, bind_host, "",
          "address to listen on, such as 0.0.0.0 when --host is a name that may not resolve yet; default: "
          "--host (env TESSERA_WORKER_BIND_HOST)");
ABSL_FLAG(int, port, 0, "port to listen on; 0 picks a free one, printed at startup (env TESSERA_WORKER_PORT)");
ABSL_FLAG(int, metrics_port, -1,
          "serve Prometheus metrics (GET /metrics, plaintext HTTP) on this port; -1: none, 0: a free one, printed at "
          "startup (env TESSERA_WORKER_METRICS_PORT)");
ABSL_FLAG(int, health_port, -1,
          "also answer grpc.health.v1 (only) on this plaintext port, for probes that speak no TLS (Kubernetes'); "
          "-1: none, 0: a free one, printed at startup (env TESSERA_WORKER_HEALTH_PORT)");
ABSL_FLAG(std::string, name, "",
          "stable worker name; a restart with the same name keeps the device id; default: the address "
          "(env TESSERA_WORKER_NAME)");
ABSL_FLAG(int, device_id, -1, "device id to ask for; -1 lets the coordinator choose (env TESSERA_WORKER_DEVICE_ID)");
ABSL_FLAG(std::string, device_id_from, "",
          "take the device id from the environment instead of --device_id: 'ordinal' (the number ending the "
          "pod's name, $POD_NAME or else the host name, as a StatefulSet names its pods) or 'job_index' "
          "($JOB_COMPLETION_INDEX, as an Indexed Job sets it) (env TESSERA_WORKER_DEVICE_ID_FROM)");
ABSL_FLAG(int64_t, memory_bytes, int64_t{2} << 30,
          "device memory limit in bytes; match a container's memory limit, less headroom "
          "(env TESSERA_WORKER_MEMORY_BYTES)");
ABSL_FLAG(int, register_timeout_s, 600,
          "seconds to keep trying to register at startup, through a coordinator that starts late or a name that "
          "does not resolve yet; one log line per failed attempt (env TESSERA_WORKER_REGISTER_TIMEOUT_S)");
ABSL_FLAG(bool, shm, true,
          "move collective data to workers on this host through shared memory (memfd rings handed over a Unix "
          "socket in /dev/shm); false: gRPC only (env TESSERA_WORKER_SHM)");
ABSL_FLAG(int64_t, shm_ring_bytes, int64_t{4} << 20,
          "bytes of each shared-memory ring (one per peer and direction), 2 MiB to 1 GiB "
          "(env TESSERA_WORKER_SHM_RING_BYTES)");
ABSL_FLAG(std::string, shm_host, "",
          "the host identity that decides which peers share memory: the same for containers that share IPC "
          "(a compose file's workers); default: this boot id and IPC and network namespaces "
          "(env TESSERA_WORKER_SHM_HOST)");
ABSL_FLAG(bool, shm_transfers, true,
          "clients on this host (same boot id and IPC, network and PID namespaces) put and fetch shards through "
          "a memfd of theirs instead of gRPC streams; false: streams only (env TESSERA_WORKER_SHM_TRANSFERS)");
ABSL_FLAG(bool, shm_client_memory, true,
          "with --shm_transfers: a co-located client's contiguous blocks are read from and written into its own "
          "memory (process_vm_readv/writev, once the client is shown to hold the call's connection); false: this "
          "worker answers FAILED_PRECONDITION and the client copies through its memfd (env "
          "TESSERA_WORKER_SHM_CLIENT_MEMORY)");
ABSL_FLAG(std::string, all_reduce_algorithm, "",
          "for measuring: every all_reduce up to 512 KiB runs tree, recursive_doubling, direct or ring instead "
          "of the table's choice; give every worker the same");

ABSL_FLAG(int, max_plans, 4096,
          "loaded plans kept; a new one beyond this drops the least recently run (env TESSERA_WORKER_MAX_PLANS)");
ABSL_FLAG(int, max_plan_threads, 256,
          "plans that may run at once on threads of their own; one more fails RESOURCE_EXHAUSTED "
          "(env TESSERA_WORKER_MAX_PLAN_THREADS)");
ABSL_FLAG(int, max_sync_threads, 256,
          "gRPC threads serving synchronous calls (every call but RunPlans and Exchange: transfers, RunCollective, "
          "LoadPlan, GetStats, ...), one of them polling; a call that finds none free fails RESOURCE_EXHAUSTED "
          "'Server Threadpool Exhausted' at once. 2 to 65536 (env TESSERA_WORKER_MAX_SYNC_THREADS)");

ABSL_FLAG(int64_t, mailbox_bytes_per_peer, int64_t{64} << 20,
          "bytes of collective messages from one peer that may wait here for their op, charged to --memory_bytes; "
          "more are dropped and fail their op (env TESSERA_WORKER_MAILBOX_BYTES_PER_PEER)");
ABSL_FLAG(int64_t, mailbox_messages_per_peer, 1024,
          "collective messages from one peer that may wait here for ops not started here; more are dropped and "
          "fail their op (env TESSERA_WORKER_MAILBOX_MESSAGES_PER_PEER)");
ABSL_FLAG(int64_t, mailbox_ttl_ms, 60000,
          "a collective message whose op has not started here this long after it arrived is dropped "
          "(env TESSERA_WORKER_MAILBOX_TTL_MS)");

ABSL_FLAG(int64_t, drain_timeout_ms, 5000,
          "on SIGTERM or SIGINT, how long to keep serving while plan runs are in flight (reporting not ready), so "
          "that they finish rather than fail; keep it below the orchestrator's grace period (Kubernetes' "
          "terminationGracePeriodSeconds) (env TESSERA_WORKER_DRAIN_TIMEOUT_MS)");
ABSL_FLAG(int64_t, buffer_cache_bytes, 268435456,
          "freed host buffers (64 KiB and more) kept for reuse by the next array of their size, in bytes in all; "
          "on top of --memory_bytes, so the container's memory headroom must hold it (env "
          "TESSERA_WORKER_BUFFER_CACHE_BYTES)");
ABSL_FLAG(int64_t, drain_quiet_ms, 200,
          "on SIGTERM, how long no plan run must have been in flight before the drain ends: the time clients "
          "have to fetch what the last runs made before the worker exits (env TESSERA_WORKER_DRAIN_QUIET_MS)");
ABSL_FLAG(int64_t, heap_trim_freed_bytes, int64_t{64} << 20,
          "give the heap's free pages back to the kernel (malloc_trim) once arrays of this many bytes were freed "
          "since the last such trim and no plan has run for --heap_trim_quiet_ms (checked each heartbeat); 0: "
          "never (env TESSERA_WORKER_HEAP_TRIM_FREED_BYTES)");
ABSL_FLAG(int64_t, heap_trim_quiet_ms, 200,
          "how long no plan run must have been in flight before freed memory is trimmed: back-to-back runs (a "
          "training loop) keep their pages (env TESSERA_WORKER_HEAP_TRIM_QUIET_MS)");
ABSL_FLAG(int64_t, put_stall_ms, 10000,
          "a PutShard stream that receives nothing this long is cancelled and its reserved memory released "
          "(env TESSERA_WORKER_PUT_STALL_MS)");

ABSL_FLAG(int, malloc_arenas, 0,
          "glibc malloc arenas at most (M_ARENA_MAX); 0: as many as cores, at least 2. Fewer arenas keep the "
          "freed memory of evicted programs reusable instead of growing the heap (docs/design.md, Memory) "
          "(env TESSERA_WORKER_MALLOC_ARENAS)");

ABSL_FLAG(
    std::string, credentials, "",
    "directory of the cluster's tokens (`tessera credentials DIR` makes one): every call must present one of "
    "them. A worker needs cluster.token, client.token and, with TLS, ca.pem and its device-N.pem/.key (admin.token "
    "and daemon.pem may be missing: `tessera select-credentials` copies only these). Empty: the development mode, "
    "nothing is checked (a warning says so) (env TESSERA_WORKER_CREDENTIALS)");

ABSL_FLAG(bool, insecure_any_host, false,
          "without --credentials, listen on a non-loopback address anyway (a network nobody else reaches, such as "
          "a test's network namespaces): every caller there is trusted as an admin. Without it, a daemon with no "
          "credentials refuses any address but loopback (env TESSERA_WORKER_INSECURE_ANY_HOST)");

// The exit status after a drain on SIGTERM (the usage message says why): sysexits.h's "temporary
// failure", distinct from a failure to start (1), a bad flag (2) and a death by a signal (128 + N).
constexpr int kExitStopped = EX_TEMPFAIL;

int main(int argc, char** argv) {
  tessera::ensure_fast_blas(argv);
  absl::SetProgramUsageMessage(absl::StrCat(
      "Tessera worker daemon: owns one logical device.\n"
      "Usage: tessera-worker --coordinator=HOST:PORT [--host=ADDR] [--port=0] [--memory_bytes=N] [--device_id=N]\n"
      "Every flag can also be set by the environment variable named in its help; the command line wins.\n"
      "Prints 'tessera-worker: device D listening on HOST:PORT' once serving.\n"
      "Exit status: ",
      kExitStopped,
      " (EX_TEMPFAIL) after a drain on SIGTERM: stopped before its work was done, so that an "
      "orchestrator that restarts only failures (a Kubernetes Job's restartPolicy OnFailure or Never) replaces "
      "it instead of counting it complete (deploy/README.md, \"Stopping\"); 0 after a drain on SIGINT (an "
      "interrupt at a terminal); 1 if it could not start or serve; 2 for a bad flag."));
  tessera::parse_flags(argc, argv, "tessera-worker",
                       {{"coordinator", "TESSERA_COORDINATOR"},
                        {"host", "TESSERA_WORKER_HOST"},
                        {"bind_host", "TESSERA_WORKER_BIND_HOST"},
                        {"port", "TESSERA_WORKER_PORT"},
                        {"health_port", "TESSERA_WORKER_HEALTH_PORT"},
                        {"metrics_port", "TESSERA_WORKER_METRICS_PORT"},
                        {"name", "TESSERA_WORKER_NAME"},
                        {"device_id", "TESSERA_WORKER_DEVICE_ID"},
                        {"device_id_from", "TESSERA_WORKER_DEVICE_ID_FROM"},
                        {"memory_bytes", "TESSERA_WORKER_MEMORY_BYTES"},
                        {"register_timeout_s", "TESSERA_WORKER_REGISTER_TIMEOUT_S"},
                        {"shm", "TESSERA_WORKER_SHM"},
                        {"shm_ring_bytes", "TESSERA_WORKER_SHM_RING_BYTES"},
                        {"shm_host", "TESSERA_WORKER_SHM_HOST"},
                        {"shm_transfers", "TESSERA_WORKER_SHM_TRANSFERS"},
                        {"shm_client_memory", "TESSERA_WORKER_SHM_CLIENT_MEMORY"},
                        {"max_plans", "TESSERA_WORKER_MAX_PLANS"},
                        {"max_plan_threads", "TESSERA_WORKER_MAX_PLAN_THREADS"},
                        {"max_sync_threads", "TESSERA_WORKER_MAX_SYNC_THREADS"},
                        {"mailbox_bytes_per_peer", "TESSERA_WORKER_MAILBOX_BYTES_PER_PEER"},
                        {"mailbox_messages_per_peer", "TESSERA_WORKER_MAILBOX_MESSAGES_PER_PEER"},
                        {"mailbox_ttl_ms", "TESSERA_WORKER_MAILBOX_TTL_MS"},
                        {"put_stall_ms", "TESSERA_WORKER_PUT_STALL_MS"},
                        {"drain_quiet_ms", "TESSERA_WORKER_DRAIN_QUIET_MS"},
                        {"heap_trim_freed_bytes", "TESSERA_WORKER_HEAP_TRIM_FREED_BYTES"},
                        {"heap_trim_quiet_ms", "TESSERA_WORKER_HEAP_TRIM_QUIET_MS"},
                        {"buffer_cache_bytes", "TESSERA_WORKER_BUFFER_CACHE_BYTES"},
                        {"drain_timeout_ms", "TESSERA_WORKER_DRAIN_TIMEOUT_MS"},
                        {"malloc_arenas", "TESSERA_WORKER_MALLOC_ARENAS"},
                        {"credentials", "TESSERA_WORKER_CREDENTIALS"},
                        {"insecure_any_host", "TESSERA_WORKER_INSECURE_ANY_HOST"}});
  tessera::limit_malloc_arenas(absl::GetFlag(FLAGS_malloc_arenas));  // before our threads start
  tessera::block_termination_signals();
  // Collective chunks and shard buffers are large and short-lived: keep them in the heap
  // instead of a fresh mmap (and a page fault per 4 KiB) for every one. 32 MiB is the
  // largest threshold glibc accepts.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  // Lock-order checking costs on every lock; tests run the same code with it on.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  tessera::WorkerOptions options;
  options.coordinator_address = absl::GetFlag(FLAGS_coordinator);
  if (options.coordinator_address.empty()) {
    std::cerr << "tessera-worker: --coordinator (or $TESSERA_COORDINATOR) is required; see --help\n";
    return 2;
  }
  options.host = absl::GetFlag(FLAGS_host);
  options.bind_host = absl::GetFlag(FLAGS_bind_host);
  options.port = absl::GetFlag(FLAGS_port);
  options.health_port = absl::GetFlag(FLAGS_health_port);
  options.name = absl::GetFlag(FLAGS_name);
  options.device_id = absl::GetFlag(FLAGS_device_id);
  if (const std::string from = absl::GetFlag(FLAGS_device_id_from); !from.empty()) {
    absl::StatusOr<int> id = tessera::device_id_from_environment(from);
    if (!id.ok() || options.device_id >= 0) {
      std::cerr << "tessera-worker: "
                << (id.ok() ? "give --device_id or --device_id_from, not both" : std::string(id.status().message()))
                << "\n";
      return 2;
    }
    options.device_id = *id;
  }
  options.memory_bytes = absl::GetFlag(FLAGS_memory_bytes);
  options.register_timeout = absl::Seconds(absl::GetFlag(FLAGS_register_timeout_s));
  options.shm = absl::GetFlag(FLAGS_shm);
  options.shm_ring_bytes = absl::GetFlag(FLAGS_shm_ring_bytes);
  options.shm_host = absl::GetFlag(FLAGS_shm_host);
  options.shm_transfers = absl::GetFlag(FLAGS_shm_transfers);
  options.shm_client_memory = absl::GetFlag(FLAGS_shm_client_memory);
  options.all_reduce_algorithm = absl::GetFlag(FLAGS_all_reduce_algorithm);
  options.max_plans = absl::GetFlag(FLAGS_max_plans);
  options.max_plan_threads = absl::GetFlag(FLAGS_max_plan_threads);
  options.max_sync_threads = absl::GetFlag(FLAGS_max_sync_threads);
  if (absl::Status threads = tessera::check_max_sync_threads(options.max_sync_threads, "--max_sync_threads");
      !threads.ok()) {
    std::cerr << "tessera-worker: " << threads.message() << "\n";
    return 2;
  }
  options.mailbox_bytes_per_peer = absl::GetFlag(FLAGS_mailbox_bytes_per_peer);
  options.mailbox_messages_per_peer = absl::GetFlag(FLAGS_mailbox_messages_per_peer);
  options.mailbox_ttl = absl::Milliseconds(absl::GetFlag(FLAGS_mailbox_ttl_ms));
  options.put_stall_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_put_stall_ms));
  for (const auto& [name, value] :
       {std::pair<const char*, int64_t>{"buffer_cache_bytes", absl::GetFlag(FLAGS_buffer_cache_bytes)},
        {"drain_quiet_ms", absl::GetFlag(FLAGS_drain_quiet_ms)},
        {"heap_trim_freed_bytes", absl::GetFlag(FLAGS_heap_trim_freed_bytes)},
        {"heap_trim_quiet_ms", absl::GetFlag(FLAGS_heap_trim_quiet_ms)}}) {
    if (value < 0) {
      std::fprintf(stderr, "tessera-worker: --%s=%lld: must be at least 0\n", name, static_cast<long long>(value));
      return 2;
    }
  }
  tessera::HostArray::set_buffer_cache_limit(static_cast<size_t>(absl::GetFlag(FLAGS_buffer_cache_bytes)));
  options.drain_quiet = absl::Milliseconds(absl::GetFlag(FLAGS_drain_quiet_ms));
  options.heap_trim_freed_bytes = absl::GetFlag(FLAGS_heap_trim_freed_bytes);
  options.heap_trim_quiet = absl::Milliseconds(absl::GetFlag(FLAGS_heap_trim_quiet_ms));
  absl::StatusOr<tessera::Credentials> credentials =
      tessera::credentials_from_flag(absl::GetFlag(FLAGS_credentials), tessera::CredentialsHolder::kWorker);
  if (!credentials.ok()) {
    std::cerr << "tessera-worker: --credentials: " << credentials.status().message() << "\n";
    return 2;
  }
  options.credentials = *std::move(credentials);
  if (absl::Status open =
          tessera::check_open_mode(options.credentials, options.bind_host.empty() ? options.host : options.bind_host,
                                   absl::GetFlag(FLAGS_insecure_any_host), "tessera-worker");
      !open.ok()) {
    std::cerr << open.message() << "\n";
    return 2;
  }
  options.wait_or_stop = [](absl::Duration pause) { return tessera::wait_for_termination_signal_for(pause) != 0; };

  auto worker = tessera::WorkerServer::start(options);
  if (!worker.ok()) {
    std::cerr << "tessera-worker: " << worker.status().message() << "\n";
    return 1;
  }
  std::printf("tessera-worker: device %d listening on %s\n", (*worker)->device_id(), (*worker)->address().c_str());
  if ((*worker)->health_port() >= 0) {
    std::printf("tessera-worker: health checks (plaintext) on port %d\n", (*worker)->health_port());
  }
  absl::StatusOr<std::unique_ptr<tessera::MetricsServer>> metrics = tessera::serve_daemon_metrics(
      "tessera-worker", (*worker).get(), options.bind_host.empty() ? options.host : options.bind_host,
      absl::GetFlag(FLAGS_metrics_port));
  if (!metrics.ok()) {
    std::cerr << "tessera-worker: " << metrics.status().message() << "\n";
    return 1;
  }
  std::fflush(stdout);
  // After the line that says it serves (which tools and tests wait for as the first).
  if (std::string warning = tessera::open_mode_warning(
          options.credentials, options.bind_host.empty() ? options.host : options.bind_host, "tessera-worker");
      !warning.empty()) {
    std::cerr << warning << "\n";
  }
  int sig = tessera::wait_for_termination_signal();
  std::fprintf(stderr, "tessera-worker: signal %d, shutting down\n", sig);
  (*worker)->drain(absl::Milliseconds(std::max<int64_t>(0, absl::GetFlag(FLAGS_drain_timeout_ms))));
  metrics->reset();  // it reads the server
  (*worker)->shutdown();
  // Stopped from outside (a pod deleted or evicted, `docker stop`, `tessera down`): not done.
  if (sig != SIGTERM) return 0;
  std::fprintf(stderr, "tessera-worker: stopped by SIGTERM; exit status %d (stopped, not finished: see --help)\n",
               kExitStopped);
  return kExitStopped;
}
