// ChildProcess: a daemon started by a test — stdout piped back, killed by pid at teardown.
//
//   absl::StatusOr<std::unique_ptr<ChildProcess>> c =
//       ChildProcess::spawn({"bin/tessera-coordinator", "--port=0"});
//   absl::StatusOr<std::string> line = (*c)->read_line_with("listening on", absl::Seconds(10));
#ifndef TESSERA_TESTS_INTEGRATION_PROCESS_H_
#define TESSERA_TESTS_INTEGRATION_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tessera::testing {

class ChildProcess {
 public:
  // Starts argv[0] with the arguments; the child dies with the test process (PDEATHSIG).
  static absl::StatusOr<std::unique_ptr<ChildProcess>> spawn(const std::vector<std::string>& argv);
  ~ChildProcess();  // SIGKILL and reap, if still running

  pid_t pid() const { return pid_; }

  // The first line of stdout containing `needle`, waiting at most `timeout`.
  // DEADLINE_EXCEEDED on timeout; UNAVAILABLE if the child closes stdout first.
  absl::StatusOr<std::string> read_line_with(const std::string& needle, absl::Duration timeout);

  // SIGKILL and reap.
  void kill();

  // Runs `argv` to completion (at most `timeout`); returns exit code and merged output.
  static absl::StatusOr<std::pair<int, std::string>> run(const std::vector<std::string>& argv, absl::Duration timeout);

 private:
  ChildProcess(pid_t pid, int stdout_fd) : pid_(pid), stdout_fd_(stdout_fd) {}
  pid_t pid_;
  int stdout_fd_;
  std::string buffered_;
};

// "host:port" taken from the last word of a line like "...listening on 127.0.0.1:4711".
std::string last_word(const std::string& line);

}  // namespace tessera::testing

#endif  // TESSERA_TESTS_INTEGRATION_PROCESS_H_
