#include "core/subprocess.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace tessera {

namespace {

// A waitpid status as a shell reports it: the exit code, or 128 + the signal that ended it.
int exit_code(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }

}  // namespace

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::spawn(const std::vector<std::string>& argv,
                                                              const SubprocessOptions& options) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  int in[2] = {-1, -1};
  if (options.pipe_stdin && pipe2(in, O_CLOEXEC) != 0) {
    close(fds[0]);
    close(fds[1]);
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    dup2(fds[1], STDOUT_FILENO);
    if (in[0] >= 0) dup2(in[0], STDIN_FILENO);
    execv(args[0], args.data());
    _exit(127);
  }
  close(fds[1]);
  if (in[0] >= 0) close(in[0]);
  return std::unique_ptr<Subprocess>(new Subprocess(pid, fds[0], in[1]));
}

Subprocess::~Subprocess() {
  kill();
  close(stdout_fd_);
  if (stdin_fd_ >= 0) close(stdin_fd_);
}

absl::Status Subprocess::write_line(const std::string& line) {
  if (stdin_fd_ < 0) return absl::FailedPreconditionError("write_line: the child was not given a stdin pipe");
  const std::string data = line + "\n";
  size_t done = 0;
  while (done < data.size()) {
    // MSG_NOSIGNAL is for sockets only: a closed pipe raises SIGPIPE, which tests ignore.
    const ssize_t n = write(stdin_fd_, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::UnavailableError(absl::StrCat("child ", pid_, " closed stdin: ", std::strerror(errno)));
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

void Subprocess::kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

absl::StatusOr<int> Subprocess::wait_for_exit(absl::Duration timeout) {
  if (pid_ <= 0) return absl::FailedPreconditionError("wait_for_exit: the child was reaped already");
  const absl::Time deadline = absl::Now() + timeout;
  int status = 0;
  pid_t reaped;
  while ((reaped = waitpid(pid_, &status, WNOHANG)) == 0) {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("child ", pid_, " still running after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(10));  // a poll interval: waitpid has no timeout
  }
  if (reaped < 0) return absl::InternalError(absl::StrCat("waitpid ", pid_, ": ", std::strerror(errno)));
  pid_ = -1;
  return exit_code(status);
}

absl::StatusOr<std::string> Subprocess::read_line_with(const std::string& needle, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    size_t newline;
    while ((newline = buffered_.find('\n')) != std::string::npos) {
      std::string line = buffered_.substr(0, newline);
      buffered_.erase(0, newline + 1);
      if (line.find(needle) != std::string::npos) return line;
    }
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left_ms <= 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("no line with '", needle, "' within ", absl::FormatDuration(timeout)));
    }
    pollfd p{stdout_fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left_ms)) <= 0) continue;
    char buf[4096];
    const ssize_t n = read(stdout_fd_, buf, sizeof(buf));
    if (n <= 0) return absl::UnavailableError(absl::StrCat("child ", pid_, " closed stdout before '", needle, "'"));
    buffered_.append(buf, static_cast<size_t>(n));
  }
}

absl::StatusOr<std::pair<int, std::string>> Subprocess::run(const std::vector<std::string>& argv,
                                                            absl::Duration timeout) {
  std::vector<std::string> shell = {"/bin/sh", "-c", "exec \"$0\" \"$@\" 2>&1"};
  shell.insert(shell.end(), argv.begin(), argv.end());
  absl::StatusOr<std::unique_ptr<Subprocess>> child = spawn(shell);
  if (!child.ok()) return child.status();
  const absl::Time deadline = absl::Now() + timeout;
  std::string output;
  while (true) {
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left_ms <= 0) return absl::DeadlineExceededError(absl::StrCat(argv[0], " did not finish in time"));
    pollfd p{(*child)->stdout_fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left_ms)) <= 0) continue;
    char buf[4096];
    const ssize_t n = read((*child)->stdout_fd_, buf, sizeof(buf));
    if (n <= 0) break;
    output.append(buf, static_cast<size_t>(n));
  }
  // stdout closed: the process is exiting; reap it.
  int status = 0;
  waitpid((*child)->pid_, &status, 0);
  (*child)->pid_ = -1;
  return std::make_pair(exit_code(status), output);
}

absl::StatusOr<ProcessCluster> ProcessCluster::start(const std::string& bin_dir, int workers,
                                                     const std::vector<std::string>& coordinator_flags,
                                                     const std::vector<std::string>& worker_flags,
                                                     absl::Duration timeout) {
  ProcessCluster cluster;
  std::vector<std::string> argv = {bin_dir + "/tessera-coordinator", "--port=0"};
  argv.insert(argv.end(), coordinator_flags.begin(), coordinator_flags.end());
  absl::StatusOr<std::unique_ptr<Subprocess>> coordinator = Subprocess::spawn(argv);
  if (!coordinator.ok()) return coordinator.status();
  cluster.coordinator = *std::move(coordinator);
  absl::StatusOr<std::string> line = cluster.coordinator->read_line_with("listening on", timeout);
  if (!line.ok()) return line.status();
  cluster.address = last_word(*line);
  for (int i = 0; i < workers; ++i) {
    argv = {bin_dir + "/tessera-worker", "--coordinator=" + cluster.address, "--port=0",
            absl::StrCat("--device_id=", i)};
    argv.insert(argv.end(), worker_flags.begin(), worker_flags.end());
    absl::StatusOr<std::unique_ptr<Subprocess>> worker = Subprocess::spawn(argv);
    if (!worker.ok()) return worker.status();
    cluster.workers.push_back(*std::move(worker));
  }
  for (int i = 0; i < workers; ++i) {
    absl::StatusOr<std::string> ready = cluster.workers[i]->read_line_with("listening on", timeout);
    if (!ready.ok())
      return absl::Status(ready.status().code(), absl::StrCat("worker ", i, ": ", ready.status().message()));
  }
  return cluster;
}

absl::StatusOr<DaemonProcess> DaemonProcess::start(const std::vector<std::string>& argv, const std::string& log_path) {
  const int log = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log < 0) return absl::InternalError(absl::StrCat("cannot open log ", log_path, ": ", std::strerror(errno)));
  // The child reports a failed exec through this pipe; a successful one closes it empty.
  int report[2];
  if (pipe2(report, O_CLOEXEC) != 0) {
    close(log);
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) {
    close(log);
    close(report[0]);
    close(report[1]);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    setsid();  // no controlling terminal: a hangup of the starter's terminal does not reach it
    const int null = open("/dev/null", O_RDONLY);
    dup2(null, STDIN_FILENO);
    dup2(log, STDOUT_FILENO);
    dup2(log, STDERR_FILENO);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execv(args[0], args.data());
    const int error = errno;
    (void)!write(report[1], &error, sizeof(error));
    _exit(127);
  }
  close(log);
  close(report[1]);
  int error = 0;
  ssize_t n;
  do {
    n = read(report[0], &error, sizeof(error));
  } while (n < 0 && errno == EINTR);
  close(report[0]);
  if (n == sizeof(error)) {
    waitpid(pid, nullptr, 0);
    return absl::InternalError(absl::StrCat("cannot execute ", argv[0], ": ", std::strerror(error)));
  }
  DaemonProcess process;
  process.pid = pid;
  process.start_ticks = process_start_ticks(pid);
  return process;
}

namespace {

// The fields of a /proc stat file after "pid (comm)", from the state on (field 3); empty if
// it cannot be read. read(2), not a stream: when the process exits while its stat is read,
// read fails with ESRCH, which libstdc++'s filebuf reports by throwing (`tessera down` died
// of it once).
std::vector<std::string> stat_fields(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  char buffer[4096];  // a stat line is a few hundred bytes: comm is at most 16 characters
  const ssize_t n = read(fd, buffer, sizeof(buffer));
  close(fd);
  if (n <= 0) return {};
  const std::string stat(buffer, static_cast<size_t>(n));
  // comm may hold spaces and parentheses; the fields resume after the last ')'.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) return {};
  return absl::StrSplit(stat.substr(close + 2), ' ');
}

}  // namespace

uint64_t process_start_ticks(pid_t pid) {
  if (pid <= 0) return 0;
  // State is field 3, starttime field 22.
  const std::vector<std::string> fields = stat_fields(absl::StrCat("/proc/", pid, "/stat"));
  if (fields.size() < 20 || fields[0] == "Z" || fields[0] == "X") return 0;
  uint64_t ticks = 0;
  return absl::SimpleAtoi(fields[19], &ticks) ? ticks : 0;
}

bool all_threads_stopped(pid_t pid) {
  if (pid <= 0) return false;
  const std::string dir = absl::StrCat("/proc/", pid, "/task");
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return false;
  bool all = true;
  for (dirent* e; all && (e = readdir(d)) != nullptr;) {
    if (e->d_name[0] == '.') continue;
    const std::vector<std::string> fields = stat_fields(absl::StrCat(dir, "/", e->d_name, "/stat"));
    all = !fields.empty() && fields[0] == "T";
  }
  closedir(d);
  return all;
}

absl::Status sigstop_and_wait(pid_t pid, absl::Duration timeout) {
  if (::kill(pid, SIGSTOP) != 0)
    return absl::InternalError(absl::StrCat("kill(", pid, ", SIGSTOP): ", std::strerror(errno)));
  const absl::Time deadline = absl::Now() + timeout;
  while (!all_threads_stopped(pid)) {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("process ", pid, " had threads still running ",
                                                      absl::FormatDuration(timeout), " after SIGSTOP"));
    }
    absl::SleepFor(absl::Milliseconds(1));  // between polls of /proc, which has no change feed
  }
  return absl::OkStatus();
}

bool process_running(const DaemonProcess& process) {
  return process.start_ticks != 0 && process_start_ticks(process.pid) == process.start_ticks;
}

namespace {

// Waits until `process` is no longer running, at most `timeout`; reaps it if it is our child.
// Polls: a process that is not our child cannot be waited for.
bool wait_until_gone(const DaemonProcess& process, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    waitpid(process.pid, nullptr, WNOHANG);
    if (!process_running(process)) return true;
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
}

}  // namespace

absl::StatusOr<std::string> stop_process(const DaemonProcess& process, absl::Duration grace) {
  if (!process_running(process)) return std::string("not running");
  ::kill(process.pid, SIGTERM);
  if (wait_until_gone(process, grace)) return std::string("stopped");
  ::kill(process.pid, SIGKILL);
  if (wait_until_gone(process, absl::Seconds(5))) return std::string("killed");
  return absl::DeadlineExceededError(absl::StrCat("process ", process.pid, " survived SIGKILL for 5s"));
}

std::string executable_dir() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  const std::string path(buf, n > 0 ? static_cast<size_t>(n) : 0);
  return path.substr(0, path.rfind('/'));
}

std::string last_word(const std::string& line) {
  const size_t space = line.rfind(' ');
  return space == std::string::npos ? line : line.substr(space + 1);
}

}  // namespace tessera
