// Subprocess: a daemon started by a test, benchmark or tool — stdout piped back, killed by
// pid when the handle goes.
//
//   absl::StatusOr<std::unique_ptr<Subprocess>> c =
//       Subprocess::spawn({"bin/tessera-coordinator", "--port=0"});
//   absl::StatusOr<std::string> line = (*c)->read_line_with("listening on", absl::Seconds(10));
#ifndef TESSERA_CORE_SUBPROCESS_H_
#define TESSERA_CORE_SUBPROCESS_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tessera {

struct SubprocessOptions {
  bool pipe_stdin = false;  // give the child a pipe for stdin (write_line), else it inherits ours
};

class Subprocess {
 public:
  // Starts argv[0] with the arguments; the child dies with the test process (PDEATHSIG).
  static absl::StatusOr<std::unique_ptr<Subprocess>> spawn(const std::vector<std::string>& argv,
                                                           const SubprocessOptions& options = {});
  ~Subprocess();  // SIGKILL and reap, if still running

  pid_t pid() const { return pid_; }

  // Writes `line` and a newline to the child's stdin (SubprocessOptions::pipe_stdin). UNAVAILABLE if the
  // child closed it.
  absl::Status write_line(const std::string& line);

  // The first line of stdout containing `needle`, waiting at most `timeout`.
  // DEADLINE_EXCEEDED on timeout; UNAVAILABLE if the child closes stdout first.
  absl::StatusOr<std::string> read_line_with(const std::string& needle, absl::Duration timeout);

  // SIGKILL and reap.
  void kill();

  // Waits (at most `timeout`) for the child to exit and reaps it: its exit code, or 128 + the
  // signal that ended it (as a shell reports). DEADLINE_EXCEEDED naming the pid if it is still
  // running then; FAILED_PRECONDITION if it was reaped already.
  absl::StatusOr<int> wait_for_exit(absl::Duration timeout);

  // Runs `argv` to completion (at most `timeout`); returns exit code and merged output.
  static absl::StatusOr<std::pair<int, std::string>> run(const std::vector<std::string>& argv, absl::Duration timeout);

 private:
  Subprocess(pid_t pid, int stdout_fd, int stdin_fd) : pid_(pid), stdout_fd_(stdout_fd), stdin_fd_(stdin_fd) {}
  pid_t pid_;
  int stdout_fd_;
  int stdin_fd_;  // -1 without SubprocessOptions::pipe_stdin
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

// A daemon that outlives its starter (`tessera up`): its own session, no controlling
// terminal, stdin from /dev/null, stdout and stderr appended to `log_path`. The pid is not
// reaped here: the starter is expected to exit, and init adopts the daemon.
struct DaemonProcess {
  // Starts argv[0]; INTERNAL naming the program if it cannot be executed (errno reported
  // back from the child) or the log cannot be opened.
  static absl::StatusOr<DaemonProcess> start(const std::vector<std::string>& argv, const std::string& log_path);

  pid_t pid = -1;
  // The kernel's start time of the process (/proc/PID/stat, clock ticks since boot): with the
  // pid, it names this process and never a later one that reuses the pid.
  uint64_t start_ticks = 0;
};

// The start time of process `pid` (see DaemonProcess::start_ticks); 0 if there is no such
// process or it has exited (a zombie counts as exited).
uint64_t process_start_ticks(pid_t pid);

// Whether `process` (pid and start time) is still running.
bool process_running(const DaemonProcess& process);

// Whether every thread of process `pid` is stopped (state T in /proc/PID/task/*/stat, as
// SIGSTOP leaves it): kill(SIGSTOP) returns before a thread busy in the kernel has stopped.
// False if there is no such process.
bool all_threads_stopped(pid_t pid);

// SIGSTOP to `pid`, then waits (at most `timeout`) until all_threads_stopped: what a test
// needs before relying on the process being stopped. INTERNAL if kill fails,
// DEADLINE_EXCEEDED naming the pid if it has not stopped by then.
absl::Status sigstop_and_wait(pid_t pid, absl::Duration timeout = absl::Seconds(5));

// Stops `process`: SIGTERM, then SIGKILL if it is still running after `grace`, then waits
// (bounded) for it to go. Does nothing to a pid that now belongs to another process.
// Returns "stopped", "killed" or "not running"; DEADLINE_EXCEEDED if it survived SIGKILL.
absl::StatusOr<std::string> stop_process(const DaemonProcess& process, absl::Duration grace);

// The directory of this process's executable (where the sibling binaries live).
std::string executable_dir();

// "host:port" taken from the last word of a line like "...listening on 127.0.0.1:4711".
std::string last_word(const std::string& line);

}  // namespace tessera

#endif  // TESSERA_CORE_SUBPROCESS_H_
