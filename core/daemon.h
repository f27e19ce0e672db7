// Helpers shared by the daemons' main() functions.
//
//   int main(int argc, char** argv) {
//     block_termination_signals();          // before any thread starts
//     ... start the server ...
//     int sig = wait_for_termination_signal();
//   }
#ifndef TESSERA_CORE_DAEMON_H_
#define TESSERA_CORE_DAEMON_H_

#include <string>

namespace tessera {

// Blocks SIGINT and SIGTERM in this thread and every thread it starts afterwards, so that
// wait_for_termination_signal() alone receives them.
void block_termination_signals();

// Waits for SIGINT or SIGTERM; returns the signal number.
int wait_for_termination_signal();

// The value of environment variable `name`, or `fallback` when unset or empty.
std::string env_or(const char* name, const std::string& fallback);

}  // namespace tessera

#endif  // TESSERA_CORE_DAEMON_H_
