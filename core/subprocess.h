// Subprocess: a daemon started by a test, benchmark or tool — stdout piped back, killed by
// pid when the handle goes.
//
//   absl::StatusOr<std::unique_ptr<Subprocess>> c =
//       Subprocess::spawn({"bin/tessera-coordinator", "--port=0"});
//   absl::StatusOr<std::string> line = (*c)->read_line_with("listening on", absl::Seconds(10));
#ifndef TESSERA_CORE_SUBPROCESS_H_
#define TESSERA_CORE_SUBPROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tessera {

class Subprocess {
 public:
  // Starts argv[0] with the arguments; the child dies with the test process (PDEATHSIG).
  static absl::StatusOr<std::unique_ptr<Subprocess>> spawn(const std::vector<std::string>& argv);
  ~Subprocess();  // SIGKILL and reap, if still running

  pid_t pid() const { return pid_; }

  // The first line of stdout containing `needle`, waiting at most `timeout`.
  // DEADLINE_EXCEEDED on timeout; UNAVAILABLE if the child closes stdout first.
  absl::StatusOr<std::string> read_line_with(const std::string& needle, absl::Duration timeout);

  // SIGKILL and reap.
  void kill();

  // Runs `argv` to completion (at most `timeout`); returns exit code and merged output.
  static absl::StatusOr<std::pair<int, std::string>> run(const std::vector<std::string>& argv, absl::Duration timeout);

 private:
  Subprocess(pid_t pid, int stdout_fd) : pid_(pid), stdout_fd_(stdout_fd) {}
  pid_t pid_;
  int stdout_fd_;
  std::string buffered_;
};

// A coordinator and `workers` worker daemons started as processes on 127.0.0.1 ephemeral
// ports, each having reported its address; all killed when this goes.
struct ProcessCluster {
  // `bin_dir` holds tessera-coordinator and tessera-worker. Worker i asks for device id i.
  static absl::StatusOr<ProcessCluster> start(const std::string& bin_dir, int workers,
                                              const std::vector<std::string>& coordinator_flags = {},
                                              const std::vector<std::string>& worker_flags = {},
                                              absl::Duration timeout = absl::Seconds(20));
  std::string address;  // the coordinator's
  std::unique_ptr<Subprocess> coordinator;
  std::vector<std::unique_ptr<Subprocess>> workers;
};

// The directory of this process's executable (where the sibling binaries live).
std::string executable_dir();

// "host:port" taken from the last word of a line like "...listening on 127.0.0.1:4711".
std::string last_word(const std::string& line);

}  // namespace tessera

#endif  // TESSERA_CORE_SUBPROCESS_H_
