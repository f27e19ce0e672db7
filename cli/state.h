// ClusterState: what `tessera up` started — the coordinator's address and every daemon's pid,
// start time and log — kept in a small text file so that `tessera down` (another process,
// later) stops exactly those processes and nothing else.
//
//   ClusterState state;
//   state.coordinator_address = "127.0.0.1:5000";
//   state.processes.push_back({"worker-0", {pid, start_ticks}, "/tmp/tessera-0/state-worker-0.log"});
//   absl::Status saved = write_state(path, state);
//   absl::StatusOr<ClusterState> back = read_state(path);
#ifndef TESSERA_CLI_STATE_H_
#define TESSERA_CLI_STATE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/subprocess.h"

namespace tessera {

struct StartedProcess {
  std::string role;  // "coordinator", "worker-3"
  DaemonProcess process;
  std::string log;
};

struct ClusterState {
  std::string coordinator_address;
  std::vector<StartedProcess> processes;  // in start order: the coordinator first
};

// The state file used when --state is not given: $XDG_RUNTIME_DIR/tessera/state when that
// variable is set, else /tmp/tessera-$UID/state.
std::string default_state_path();

// Writes `state` to `path` atomically (a temporary file renamed over it), creating the
// directory (mode 0700) if needed. INTERNAL naming the path on an I/O error.
absl::Status write_state(const std::string& path, const ClusterState& state);

// NOT_FOUND if there is no file at `path`; INVALID_ARGUMENT naming the path and the line
// when it is not a state file.
absl::StatusOr<ClusterState> read_state(const std::string& path);

}  // namespace tessera

#endif  // TESSERA_CLI_STATE_H_
