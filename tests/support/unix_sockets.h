// Test helpers for Unix sockets (the shared-memory rings' servers, worker/collectives/shm_ring.h):
// a directory of the test's own for its sockets, and a socket listening at a path.
//
//   SocketDir dir;                          // mkdtemp under /tmp; path() is "" if that failed
//   const int s = listen_at(absl::StrCat(dir.path(), "/tessera-1-mute.sock"));  // -1 if not
#ifndef TESSERA_TESTS_SUPPORT_UNIX_SOCKETS_H_
#define TESSERA_TESTS_SUPPORT_UNIX_SOCKETS_H_

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>

namespace tessera {

// A directory of the test's own for its ring servers (ShmOptions::socket_dir): no other
// process's server starting (ctest -j2 runs other tests' at once) probes them or removes what
// the test puts there. Removed with what is left in it.
class SocketDir {
 public:
  SocketDir() {
    char name[] = "/tmp/tessera-sockets-XXXXXX";
    if (mkdtemp(name) != nullptr) path_ = name;
  }
  ~SocketDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  SocketDir(const SocketDir&) = delete;
  SocketDir& operator=(const SocketDir&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A socket bound at `path` and listening (never accepting: connections wait in its backlog),
// or -1.
inline int listen_at(const std::string& path) {
  sockaddr_un address{};
  if (path.size() >= sizeof address.sun_path) return -1;
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.data(), path.size());
  const int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return -1;
  if (bind(s, reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0 || listen(s, 4) != 0) {
    close(s);
    return -1;
  }
  return s;
}

}  // namespace tessera

#endif  // TESSERA_TESTS_SUPPORT_UNIX_SOCKETS_H_
