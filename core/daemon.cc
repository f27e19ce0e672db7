#include "core/daemon.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace tessera {
namespace {

sigset_t termination_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}

// The handler's end of a pipe that wait_for_termination_signal_for reads.
int termination_pipe[2] = {-1, -1};

void on_termination_signal(int sig) {
  const unsigned char byte = static_cast<unsigned char>(sig);
  const ssize_t ignored = write(termination_pipe[1], &byte, 1);  // async-signal-safe
  (void)ignored;
}

}  // namespace

void block_termination_signals() {
  if (termination_pipe[0] < 0 && pipe2(termination_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    std::perror("tessera: pipe2");
    std::exit(1);
  }
  struct sigaction action = {};
  action.sa_handler = on_termination_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  sigset_t set = termination_signals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int wait_for_termination_signal() { return wait_for_termination_signal_for(absl::InfiniteDuration()); }

int wait_for_termination_signal_for(absl::Duration timeout) {
  // ppoll unblocks the signals while it waits, so the kernel hands them to this thread; one
  // that went to another thread meanwhile is in the pipe already.
  sigset_t waiting;
  pthread_sigmask(SIG_SETMASK, nullptr, &waiting);
  sigdelset(&waiting, SIGINT);
  sigdelset(&waiting, SIGTERM);
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    unsigned char byte = 0;
    if (read(termination_pipe[0], &byte, 1) == 1) return byte;
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return 0;
    struct pollfd readable = {termination_pipe[0], POLLIN, 0};
    const struct timespec wait = absl::ToTimespec(left);
    ppoll(&readable, 1, left == absl::InfiniteDuration() ? nullptr : &wait, &waiting);
  }
}

absl::StatusOr<int> device_id_from_environment(const std::string& source) {
  std::string where, text;
  if (source == "ordinal") {
    const std::string pod = env_or("POD_NAME", env_or("HOSTNAME", ""));
    std::string name = pod;
    if (name.empty()) {
      char host[256] = {};
      if (gethostname(host, sizeof(host) - 1) == 0) name = host;
    }
    where = pod.empty() ? absl::StrCat("the host name '", name, "'") : absl::StrCat("the pod name '", name, "'");
    const size_t dash = name.rfind('-');
    text = dash == std::string::npos ? "" : name.substr(dash + 1);
  } else if (source == "job_index") {
    text = env_or("JOB_COMPLETION_INDEX", "");
    where = absl::StrCat("$JOB_COMPLETION_INDEX='", text, "'");
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("device_id_from: '", source, "' is neither 'ordinal' nor 'job_index'"));
  }
  int id = -1;
  if (text.empty() || !absl::SimpleAtoi(text, &id) || id < 0 || text[0] == '+') {
    return absl::InvalidArgumentError(
        absl::StrCat("device_id_from=", source, ": ", where,
                     source == "ordinal" ? " does not end in '-N' with N a device id" : " is not a device id",
                     " (an integer from 0 to 2^31-1)"));
  }
  return id;
}

std::string env_or(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? std::string(value) : fallback;
}

absl::Status flags_from_env(const std::vector<std::pair<std::string, std::string>>& flag_variables) {
  for (const auto& [flag_name, variable] : flag_variables) {
    const std::string value = env_or(variable.c_str(), "");
    if (value.empty()) continue;
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(flag_name);
    if (flag == nullptr) return absl::InternalError(absl::StrCat("no flag --", flag_name, " for $", variable));
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      return absl::InvalidArgumentError(
          absl::StrCat("$", variable, "='", value, "' is not a valid --", flag_name, ": ", error));
    }
  }
  return absl::OkStatus();
}

std::vector<char*> parse_flags(int argc, char** argv, const char* program,
                               const std::vector<std::pair<std::string, std::string>>& flag_variables) {
  // --help lists the flags of the program's own files (absl's default matches file names
  // against the program name, which "main.cc" never does, and showed no flags at all).
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view path) { return !absl::StrContains(path, "/absl/"); };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  // Debian builds abseil without NDEBUG, so every Mutex lock (gRPC's included) also records
  // the lock in a process-wide deadlock graph: about 6% of the CPU time of a cluster that is
  // busy dispatching small calls. Programs turn that off; the tests keep it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::Status env = flags_from_env(flag_variables);
  if (!env.ok()) {
    std::fprintf(stderr, "%s: %s\n", program, std::string(env.message()).c_str());
    std::exit(2);
  }
  return absl::ParseCommandLine(argc, argv);
}

}  // namespace tessera
