#include "cli/state.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/daemon.h"

namespace tessera {
namespace {

constexpr char kHeader[] = "# tessera up: the processes it started; tessera down stops them by pid";

// mkdir -p with mode 0700 for the directories it creates.
absl::Status make_dirs(const std::string& dir) {
  if (dir.empty()) return absl::OkStatus();
  std::string partial;
  for (absl::string_view part : absl::StrSplit(dir, '/')) {
    absl::StrAppend(&partial, part, "/");
    if (part.empty()) continue;
    if (mkdir(partial.c_str(), 0700) != 0 && errno != EEXIST) {
      return absl::InternalError(absl::StrCat("cannot create directory ", partial, ": ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::string default_state_path() {
  const std::string runtime = env_or("XDG_RUNTIME_DIR", "");
  if (!runtime.empty()) return runtime + "/tessera/state";
  return absl::StrCat("/tmp/tessera-", getuid(), "/state");
}

absl::Status write_state(const std::string& path, const ClusterState& state) {
  const size_t slash = path.rfind('/');
  if (slash != std::string::npos) {
    absl::Status dirs = make_dirs(path.substr(0, slash));
    if (!dirs.ok()) return dirs;
  }
  std::ostringstream out;
  out << kHeader << "\n";
  out << "coordinator_address " << state.coordinator_address << "\n";
  for (const StartedProcess& p : state.processes) {
    out << "process " << p.role << " " << p.process.pid << " " << p.process.start_ticks << " " << p.log << "\n";
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream file(tmp, std::ios::trunc);
    file << out.str();
    file.close();
    if (!file) return absl::InternalError(absl::StrCat("cannot write state file ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot rename ", tmp, " to ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<ClusterState> read_state(const std::string& path) {
  std::ifstream file(path);
  if (!file) return absl::NotFoundError(absl::StrCat("no state file at ", path));
  ClusterState state;
  std::string line;
  int number = 0;
  while (std::getline(file, line)) {
    ++number;
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> words = absl::StrSplit(line, absl::MaxSplits(' ', 4));
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(
          absl::StrCat("state file ", path, " line ", number, ": ", why, ": '", line, "'"));
    };
    if (words[0] == "coordinator_address" && words.size() == 2) {
      state.coordinator_address = words[1];
    } else if (words[0] == "process" && words.size() == 5) {
      StartedProcess p;
      p.role = words[1];
      int pid = 0;
      if (!absl::SimpleAtoi(words[2], &pid) || pid <= 0) return bad("the pid is not a positive number");
      p.process.pid = pid;
      if (!absl::SimpleAtoi(words[3], &p.process.start_ticks)) return bad("the start time is not a number");
      p.log = words[4];
      state.processes.push_back(std::move(p));
    } else {
      return bad("expected 'coordinator_address ADDR' or 'process ROLE PID START_TICKS LOG'");
    }
  }
  return state;
}

}  // namespace tessera
