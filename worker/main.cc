// tessera-worker: one Tessera device. Registers with the coordinator, holds shards in a
// buffer store with a memory limit, and serves transfers until SIGINT or SIGTERM.
#include <malloc.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/synchronization/mutex.h"
#include "core/daemon.h"
#include "worker/kernels/blas.h"
#include "worker/worker_server.h"

ABSL_FLAG(std::string, coordinator, "", "host:port of tessera-coordinator (default: $TESSERA_COORDINATOR)");
ABSL_FLAG(std::string, host, "", "address to listen on and advertise (default: $TESSERA_WORKER_HOST or 127.0.0.1)");
ABSL_FLAG(int, port, 0, "port to listen on; 0 picks a free one, printed at startup");
ABSL_FLAG(std::string, name, "",
          "stable worker name; a restart with the same name keeps the device id "
          "(default: $TESSERA_WORKER_NAME or the address)");
ABSL_FLAG(int, device_id, -1, "device id to ask for; -1 lets the coordinator choose");
ABSL_FLAG(int64_t, memory_bytes, int64_t{2} << 30, "device memory limit in bytes");
ABSL_FLAG(int, register_timeout_s, 30, "seconds to wait for the coordinator at startup");

int main(int argc, char** argv) {
  tessera::ensure_fast_blas(argv);
  absl::SetProgramUsageMessage(
      "Tessera worker daemon: owns one logical device.\n"
      "Usage: tessera-worker --coordinator=HOST:PORT [--port=0] [--memory_bytes=N] [--device_id=N]\n"
      "Prints 'tessera-worker: device D listening on HOST:PORT' once serving.");
  absl::ParseCommandLine(argc, argv);
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
  if (options.coordinator_address.empty()) options.coordinator_address = tessera::env_or("TESSERA_COORDINATOR", "");
  if (options.coordinator_address.empty()) {
    std::cerr << "tessera-worker: --coordinator (or $TESSERA_COORDINATOR) is required; see --help\n";
    return 2;
  }
  options.host = absl::GetFlag(FLAGS_host);
  if (options.host.empty()) options.host = tessera::env_or("TESSERA_WORKER_HOST", "127.0.0.1");
  options.port = absl::GetFlag(FLAGS_port);
  options.name = absl::GetFlag(FLAGS_name);
  if (options.name.empty()) options.name = tessera::env_or("TESSERA_WORKER_NAME", "");
  options.device_id = absl::GetFlag(FLAGS_device_id);
  options.memory_bytes = absl::GetFlag(FLAGS_memory_bytes);
  options.register_timeout = absl::Seconds(absl::GetFlag(FLAGS_register_timeout_s));

  auto worker = tessera::WorkerServer::start(options);
  if (!worker.ok()) {
    std::cerr << "tessera-worker: " << worker.status().message() << "\n";
    return 1;
  }
  std::printf("tessera-worker: device %d listening on %s\n", (*worker)->device_id(), (*worker)->address().c_str());
  std::fflush(stdout);
  int sig = tessera::wait_for_termination_signal();
  std::fprintf(stderr, "tessera-worker: signal %d, shutting down\n", sig);
  (*worker)->shutdown();
  return 0;
}
