// tessera-coordinator: the cluster's controller. Registers workers, tracks their heartbeats,
// serves topology and array metadata, and fans out deletions, until SIGINT or SIGTERM.
#include <cstdio>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "coordinator/coordinator_server.h"
#include "core/daemon.h"

ABSL_FLAG(std::string, host, "", "address to listen on (default: $TESSERA_COORDINATOR_HOST or 127.0.0.1)");
ABSL_FLAG(int, port, -1,
          "port to listen on; 0 picks a free one, printed at startup "
          "(default: $TESSERA_COORDINATOR_PORT or 0)");
ABSL_FLAG(int, heartbeat_interval_ms, 500, "how often workers heartbeat");
ABSL_FLAG(int, heartbeat_timeout_ms, 3000, "a worker silent this long is marked lost");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Tessera coordinator daemon: device registry, topology and array metadata.\n"
      "Usage: tessera-coordinator [--host=127.0.0.1] [--port=0]\n"
      "Prints 'tessera-coordinator: listening on HOST:PORT' once serving.");
  absl::ParseCommandLine(argc, argv);
  tessera::block_termination_signals();

  tessera::CoordinatorOptions options;
  options.host = absl::GetFlag(FLAGS_host);
  if (options.host.empty()) options.host = tessera::env_or("TESSERA_COORDINATOR_HOST", "127.0.0.1");
  options.port = absl::GetFlag(FLAGS_port);
  if (options.port < 0) options.port = std::atoi(tessera::env_or("TESSERA_COORDINATOR_PORT", "0").c_str());
  options.heartbeat_interval = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_interval_ms));
  options.heartbeat_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_timeout_ms));

  auto server = tessera::CoordinatorServer::start(options);
  if (!server.ok()) {
    std::cerr << "tessera-coordinator: " << server.status().message() << "\n";
    return 1;
  }
  std::printf("tessera-coordinator: listening on %s\n", (*server)->address().c_str());
  std::fflush(stdout);
  int sig = tessera::wait_for_termination_signal();
  std::fprintf(stderr, "tessera-coordinator: signal %d, shutting down\n", sig);
  (*server)->shutdown();
  return 0;
}
