// Helpers shared by the daemons' main() functions.
//
//   int main(int argc, char** argv) {
//     parse_flags(argc, argv, "tessera-worker", {{"port", "TESSERA_WORKER_PORT"}});  // flags win over env
//     block_termination_signals();          // before any thread starts
//     ... start the server ...
//     int sig = wait_for_termination_signal();
//   }
#ifndef TESSERA_CORE_DAEMON_H_
#define TESSERA_CORE_DAEMON_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tessera {

// Makes SIGINT and SIGTERM reach wait_for_termination_signal*: blocks them in this thread and
// every thread it starts afterwards, and catches them in threads started before (OpenBLAS
// starts its own before main; one of them, receiving SIGTERM, used to end the process at
// once). Call it in main before starting threads.
void block_termination_signals();

// Waits for SIGINT or SIGTERM; returns the signal number.
int wait_for_termination_signal();

// Waits at most `timeout` for SIGINT or SIGTERM; returns the signal number, or 0 if none came.
int wait_for_termination_signal_for(absl::Duration timeout);

// A device id from the environment that Kubernetes gives a pod. `source`:
//   "ordinal"    the number after the last '-' of the pod's name: $POD_NAME, else $HOSTNAME,
//                else gethostname() (a StatefulSet names its pods NAME-0, NAME-1, ...)
//   "job_index"  $JOB_COMPLETION_INDEX (an Indexed Job's pods)
// INVALID_ARGUMENT naming the source, the variable and its value when there is no such
// number (or it is negative or too large), or for any other source.
absl::StatusOr<int> device_id_from_environment(const std::string& source);

// The value of environment variable `name`, or `fallback` when unset or empty.
std::string env_or(const char* name, const std::string& fallback);

// Sets flags from environment variables, as containers configure programs; call it before
// absl::ParseCommandLine so that a flag given on the command line wins. Each pair is (flag
// name, variable name); unset or empty variables are skipped. The convention: a daemon's flag
// --NAME reads TESSERA_<DAEMON>_<NAME>, and the cluster's address --coordinator reads
// TESSERA_COORDINATOR in every program. INVALID_ARGUMENT naming the variable, its value and
// the parse error when a value does not parse; INTERNAL for a flag that does not exist.
absl::Status flags_from_env(const std::vector<std::pair<std::string, std::string>>& flag_variables);

// flags_from_env, then absl::ParseCommandLine: what every program's main() does. Also turns
// off abseil's Mutex deadlock detection, which Debian's build leaves on. A bad
// variable is reported as "<program>: <error>" on stderr and exits with status 2, like a bad
// flag. Returns the positional arguments (argv[0] first).
std::vector<char*> parse_flags(int argc, char** argv, const char* program,
                               const std::vector<std::pair<std::string, std::string>>& flag_variables);

}  // namespace tessera

#endif  // TESSERA_CORE_DAEMON_H_
