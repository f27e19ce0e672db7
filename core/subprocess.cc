#include "core/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace tessera {

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::spawn(const std::vector<std::string>& argv) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
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
    execv(args[0], args.data());
    _exit(127);
  }
  close(fds[1]);
  return std::unique_ptr<Subprocess>(new Subprocess(pid, fds[0]));
}

Subprocess::~Subprocess() {
  kill();
  close(stdout_fd_);
}

void Subprocess::kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
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
  return std::make_pair(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), output);
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
