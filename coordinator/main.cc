// tessera-coordinator: the cluster's controller. Registers workers, tracks their heartbeats,
// serves topology and array metadata, and fans out deletions, until SIGINT or SIGTERM.
#include <cstdio>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "coordinator/coordinator_server.h"
#include "core/credentials.h"
#include "core/daemon.h"
#include "core/heap.h"
#include "core/open_mode.h"
#include "proto/rpc.h"

ABSL_FLAG(std::string, host, "127.0.0.1",
          "address to listen on; 0.0.0.0 for every interface (env TESSERA_COORDINATOR_HOST)");
ABSL_FLAG(int, port, 0, "port to listen on; 0 picks a free one, printed at startup (env TESSERA_COORDINATOR_PORT)");
ABSL_FLAG(int, metrics_port, -1,
          "serve Prometheus metrics (GET /metrics, plaintext HTTP) on this port; -1: none, 0: a free one, printed at "
          "startup (env TESSERA_COORDINATOR_METRICS_PORT)");
ABSL_FLAG(int, health_port, -1,
          "also answer grpc.health.v1 (only) on this plaintext port, for probes that speak no TLS (Kubernetes'); "
          "-1: none, 0: a free one, printed at startup (env TESSERA_COORDINATOR_HEALTH_PORT)");
ABSL_FLAG(int, heartbeat_interval_ms, 500,
          "how often workers heartbeat (env TESSERA_COORDINATOR_HEARTBEAT_INTERVAL_MS)");
ABSL_FLAG(int, heartbeat_timeout_ms, 3000,
          "a worker silent this long is marked lost, and the executions that need it fail "
          "(env TESSERA_COORDINATOR_HEARTBEAT_TIMEOUT_MS)");
ABSL_FLAG(int64_t, lease_timeout_ms, 30000,
          "a client session not renewed this long (the client died) lapses, and its arrays and programs are "
          "freed on every worker (env TESSERA_COORDINATOR_LEASE_TIMEOUT_MS)");

ABSL_FLAG(int, expected_devices, 0,
          "grpc.health.v1 reports SERVING (ready) while at least this many devices are alive; 0: once serving "
          "(env TESSERA_COORDINATOR_EXPECTED_DEVICES)");

ABSL_FLAG(int, max_programs, 1024,
          "compiled programs kept in the compile cache; the least recently used beyond it are dropped and "
          "unloaded from the workers (their clients compile them again) (env TESSERA_COORDINATOR_MAX_PROGRAMS)");

ABSL_FLAG(int, max_sync_threads, 256,
          "gRPC threads serving synchronous calls (every call but Execute, Heartbeat and RegisterWorker), one of "
          "them polling; a call that finds none free fails RESOURCE_EXHAUSTED 'Server Threadpool Exhausted' at "
          "once. 2 to 65536 (env TESSERA_COORDINATOR_MAX_SYNC_THREADS)");

ABSL_FLAG(int, malloc_arenas, 0,
          "glibc malloc arenas at most (M_ARENA_MAX); 0: as many as cores, at least 2. Fewer arenas keep the "
          "freed memory of evicted programs reusable instead of growing the heap (docs/design.md, Memory) "
          "(env TESSERA_COORDINATOR_MALLOC_ARENAS)");

ABSL_FLAG(std::string, credentials, "",
          "directory of the cluster's tokens (cluster.token, client.token, admin.token; `tessera credentials DIR` "
          "makes one): every call must present one of them. Empty: the development mode, nothing is checked (a "
          "warning says so) (env TESSERA_COORDINATOR_CREDENTIALS)");

ABSL_FLAG(bool, insecure_any_host, false,
          "without --credentials, listen on a non-loopback address anyway (a network nobody else reaches, such as "
          "a test's network namespaces): every caller there is trusted as an admin. Without it, a daemon with no "
          "credentials refuses any address but loopback (env TESSERA_COORDINATOR_INSECURE_ANY_HOST)");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Tessera coordinator daemon: device registry, topology and array metadata, compilation and execution.\n"
      "Usage: tessera-coordinator [--host=127.0.0.1] [--port=0]\n"
      "Every flag can also be set by the environment variable named in its help; the command line wins.\n"
      "Prints 'tessera-coordinator: listening on HOST:PORT' once serving.");
  tessera::parse_flags(argc, argv, "tessera-coordinator",
                       {{"host", "TESSERA_COORDINATOR_HOST"},
                        {"port", "TESSERA_COORDINATOR_PORT"},
                        {"health_port", "TESSERA_COORDINATOR_HEALTH_PORT"},
                        {"metrics_port", "TESSERA_COORDINATOR_METRICS_PORT"},
                        {"heartbeat_interval_ms", "TESSERA_COORDINATOR_HEARTBEAT_INTERVAL_MS"},
                        {"heartbeat_timeout_ms", "TESSERA_COORDINATOR_HEARTBEAT_TIMEOUT_MS"},
                        {"lease_timeout_ms", "TESSERA_COORDINATOR_LEASE_TIMEOUT_MS"},
                        {"expected_devices", "TESSERA_COORDINATOR_EXPECTED_DEVICES"},
                        {"max_programs", "TESSERA_COORDINATOR_MAX_PROGRAMS"},
                        {"max_sync_threads", "TESSERA_COORDINATOR_MAX_SYNC_THREADS"},
                        {"malloc_arenas", "TESSERA_COORDINATOR_MALLOC_ARENAS"},
                        {"credentials", "TESSERA_COORDINATOR_CREDENTIALS"},
                        {"insecure_any_host", "TESSERA_COORDINATOR_INSECURE_ANY_HOST"}});
  tessera::limit_malloc_arenas(absl::GetFlag(FLAGS_malloc_arenas));  // before our threads start
  tessera::block_termination_signals();

  tessera::CoordinatorOptions options;
  options.host = absl::GetFlag(FLAGS_host);
  options.port = absl::GetFlag(FLAGS_port);
  options.health_port = absl::GetFlag(FLAGS_health_port);
  options.heartbeat_interval = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_interval_ms));
  options.heartbeat_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_timeout_ms));
  options.lease_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_lease_timeout_ms));
  options.log_registrations = true;
  options.expected_devices = absl::GetFlag(FLAGS_expected_devices);
  options.max_programs = absl::GetFlag(FLAGS_max_programs);
  options.max_sync_threads = absl::GetFlag(FLAGS_max_sync_threads);
  if (absl::Status threads = tessera::check_max_sync_threads(options.max_sync_threads, "--max_sync_threads");
      !threads.ok()) {
    std::cerr << "tessera-coordinator: " << threads.message() << "\n";
    return 2;
  }
  absl::StatusOr<tessera::Credentials> credentials =
      tessera::credentials_from_flag(absl::GetFlag(FLAGS_credentials), tessera::CredentialsHolder::kCoordinator);
  if (!credentials.ok()) {
    std::cerr << "tessera-coordinator: --credentials: " << credentials.status().message() << "\n";
    return 2;
  }
  options.credentials = *std::move(credentials);
  if (absl::Status open = tessera::check_open_mode(options.credentials, options.host,
                                                   absl::GetFlag(FLAGS_insecure_any_host), "tessera-coordinator");
      !open.ok()) {
    std::cerr << open.message() << "\n";
    return 2;
  }

  auto server = tessera::CoordinatorServer::start(options);
  if (!server.ok()) {
    std::cerr << "tessera-coordinator: " << server.status().message() << "\n";
    return 1;
  }
  std::printf("tessera-coordinator: listening on %s\n", (*server)->address().c_str());
  if ((*server)->health_port() >= 0) {
    std::printf("tessera-coordinator: health checks (plaintext) on port %d\n", (*server)->health_port());
  }
  absl::StatusOr<std::unique_ptr<tessera::MetricsServer>> metrics = tessera::serve_daemon_metrics(
      "tessera-coordinator", (*server).get(), options.host, absl::GetFlag(FLAGS_metrics_port));
  if (!metrics.ok()) {
    std::cerr << "tessera-coordinator: " << metrics.status().message() << "\n";
    return 1;
  }
  std::fflush(stdout);
  // After the line that says it serves (which tools and tests wait for as the first).
  if (std::string warning = tessera::open_mode_warning(options.credentials, options.host, "tessera-coordinator");
      !warning.empty()) {
    std::cerr << warning << "\n";
  }
  int sig = tessera::wait_for_termination_signal();
  std::fprintf(stderr, "tessera-coordinator: signal %d, shutting down\n", sig);
  metrics->reset();  // it reads the server
  (*server)->shutdown();
  return 0;
}
