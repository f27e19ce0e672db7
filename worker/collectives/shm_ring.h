// ShmRing: a one-way ring of tagged messages in a memfd, from one worker process to another on
// the same host. The sender creates the ring (an unnamed memfd whose size is sealed: no file
// under /dev/shm, so no other process can open it by name) and offers it through its
// ShmRingServer, a Unix socket under /dev/shm; it names the socket and a random token to the
// receiver over their gRPC Exchange stream. The receiver connects, presents the token, gets the
// memfd (SCM_RIGHTS), maps it, checks it and says so in the segment (attached()), after which
// the sender writes its messages here instead of on gRPC. One writer and one reader; each side
// sleeps on a futex in the segment while the ring is empty (reader) or full (writer): no polling.
// The trust boundary on a host is the uid: the socket is 0600 and the fetch checks that the
// server runs as this uid, but another process of the same uid can still read the ring (e.g.
// through /proc/<pid>/fd of a dumpable worker); the token keeps out only other uids' processes
// and a peer that has not seen the offer.
//
//   auto server = ShmRingServer::start("/dev/shm");                   // sender, once
//   auto ring = ShmRing::create(4 << 20, token);
//   (*server)->offer(**ring);                  // then Exchange: {(*server)->path(), token}
//   auto peer = ShmRing::fetch(path, "/dev/shm", token, until);       // receiver (another process)
//   (*peer)->mark_attached();
//   (*ring)->write({op, step, chunk}, data, bytes, until);      // false: no room by `until`
//   ShmRing::Record r; (*peer)->next(&r, until); (*peer)->copy_payload(r, dst); (*peer)->consume(r);
#ifndef TESSERA_WORKER_COLLECTIVES_SHM_RING_H_
#define TESSERA_WORKER_COLLECTIVES_SHM_RING_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/shm_transfer.h"  // shm_host_identity

namespace tessera {

class ShmRing {
 public:
  // Smallest ring: room for two of the largest messages a link sends through it.
  static constexpr int64_t kMinBytes = int64_t{2} << 20;
  // Largest ring (a segment per peer pair and direction).
  static constexpr int64_t kMaxBytes = int64_t{1} << 30;
  // The segment's first page holds the ring's header; the ring's bytes follow it.
  static constexpr int64_t kHeaderBytes = 4096;

  struct Record {
    uint64_t op = 0;
    int32_t step = 0;
    int32_t chunk = 0;
    int64_t bytes = 0;     // of payload
    uint64_t run_tag = 0;  // the message's (MessageTag::run_tag)
  };

  // A new ring of `capacity` bytes (plus a header page) in an unnamed memfd, its size sealed.
  // INVALID_ARGUMENT for a capacity outside [kMinBytes, kMaxBytes]; INTERNAL with errno's text
  // when the kernel refuses.
  static absl::StatusOr<std::unique_ptr<ShmRing>> create(int64_t capacity, uint64_t token);
  // The ring in memfd `fd` (which this takes, and closes): FAILED_PRECONDITION when it is not a
  // size-sealed ring of this version or its token differs.
  static absl::StatusOr<std::unique_ptr<ShmRing>> attach(int fd, uint64_t token);
  // The ring a peer offers through its ShmRingServer at `socket` (a path from the wire, which
  // must name a socket directly in `dir`, the directory this side's servers use), fetched with
  // `token` (the Exchange offer's), waiting until `until` and stopping early (CANCELLED) once
  // `cancelled` returns true (asked every 100 ms at most): NOT_FOUND when this host has no such
  // socket (the peer is elsewhere); FAILED_PRECONDITION when the socket is in another directory
  // or its server runs as another uid, when the server refused the token or the ring is not one
  // (attach); UNAVAILABLE when the server is busy (try again), DEADLINE_EXCEEDED when it did not
  // answer by `until`; INVALID_ARGUMENT for a path that is not a ring server's.
  static absl::StatusOr<std::unique_ptr<ShmRing>> fetch(const std::string& socket, const std::string& dir,
                                                        uint64_t token, absl::Time until,
                                                        const std::function<bool()>& cancelled = nullptr);

  // The creator marks the ring closed (the reader drains it and stops).
  ~ShmRing();

  // The memfd: the creator's until it offers the ring (ShmRingServer::offer takes it); -1 at
  // the reader, which keeps only the mapping.
  int fd() const { return fd_; }
  // Gives up the memfd (the caller closes it): the ring stays mapped and usable, and fd() is -1.
  int release_fd();
  uint64_t token() const;
  int64_t capacity() const { return capacity_; }
  // Whether a message of `bytes` bytes may go through this ring (at most half of it).
  bool fits(int64_t bytes) const;

  // Receiver: opened and checked.
  void mark_attached();
  bool attached() const;

  // Writer. Copies one message in, waiting for room until `until`; false if there was none by
  // then (the caller checks its link and deadline and tries again). REQUIRES: fits(bytes), and
  // one writer at a time.
  bool write(const Record& header, const std::byte* data, absl::Time until);

  // Reader. Waits until `until` for the next message: true with its header in `*record`,
  // false if none came (or wake_reader() was called). DATA_LOSS for a header that cannot be
  // (the segment is corrupt). Then copy_payload (any number of times) and consume.
  absl::StatusOr<bool> next(Record* record, absl::Time until);
  void copy_payload(const Record& record, std::byte* dst) const;
  void consume(const Record& record);
  // The writer closed the ring and everything in it has been read.
  bool drained_and_closed() const;

  // Wakes a reader or writer that waits (to stop it, or to check its link).
  void wake_reader();
  void wake_writer();

 private:
  struct Header;
  ShmRing(int fd, bool creator, Header* header, int64_t capacity);
  void copy_in(uint64_t at, const void* src, int64_t n);
  void copy_out(uint64_t at, void* dst, int64_t n) const;

  int fd_;  // the creator's memfd until released, else -1
  const bool creator_;
  Header* const header_;
  std::byte* const data_;
  const int64_t capacity_;
};

// ShmRingServer: hands this process's rings to its peers. A thread listens on a Unix socket
// (mode 0600, removed when the server goes, or when its thread fails) and answers each
// connection that presents the token of an offered ring with that ring's memfd (SCM_RIGHTS),
// once; any other connection is closed without one (refused). Bounded: at most kMaxPending
// connections wait for their token, each for at most kHandoverTimeout; a connection past them
// whose token is not there yet gets kBusy with no fd (the client's fetch says UNAVAILABLE).
// Same-uid processes are not kept out (see ShmRing): the uid is the trust boundary.
class ShmRingServer {
 public:
  static constexpr int kMaxPending = 16;
  static constexpr absl::Duration kHandoverTimeout = absl::Seconds(5);
  // The byte a busy server answers with (a ring comes with kRing and its fd).
  static constexpr char kRing = 1;
  static constexpr char kBusy = 'B';

  // Listens on a fresh socket `dir`/tessera-<pid>-<random>.sock, after removing the sockets in
  // `dir` of this uid's servers that were killed (and their `.bind` names older than a minute).
  // INTERNAL with errno's text when the socket, its thread's wake-up or the bind fails (e.g.
  // `dir` is not writable).
  static absl::StatusOr<std::unique_ptr<ShmRingServer>> start(const std::string& dir);
  // Stops the thread, closes every connection and offered fd, and removes the socket.
  ~ShmRingServer();

  const std::string& path() const { return path_; }
  // Hands `ring` to the first connection presenting ring.token(): takes its memfd
  // (ring.release_fd()), which the server holds, the ring's only descriptor, until it is handed
  // over or withdrawn (then closed). FAILED_PRECONDITION when `ring` has no memfd (a reader's, or
  // offered already).
  absl::Status offer(ShmRing& ring);
  // No connection gets the ring of `token` any more (the link that offered it went).
  void withdraw(uint64_t token);

  int64_t handed_over() const;
  // Connections closed without a ring: a wrong or spent token, or silent until the deadline
  // (one that closes having sent nothing, as another server's stale-socket probe does, is not).
  int64_t refused() const;
  int64_t busy() const;  // connections answered kBusy (past kMaxPending)

 private:
  ShmRingServer(std::string path, int listener, int wake);
  void run();
  // Reads what `connection` has sent of its token; answers it (and closes it: true) once it is
  // all there, or when the connection ended (not counted if it sent nothing) or failed.
  bool read_token(int connection, uint64_t* token, size_t* got);
  // Answers a connection that presented `token`, and closes it.
  void answer(int connection, uint64_t token);

  // Constant after construction.
  const std::string path_;
  int listener_;    // run()'s alone until it is joined; -1 once run() closed it (it failed)
  const int wake_;  // an eventfd: the destructor stops run()'s poll

  mutable absl::Mutex mu_;
  std::map<uint64_t, int> offers_ ABSL_GUARDED_BY(mu_);  // token -> the ring's memfd (taken from it)
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int64_t handed_over_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t refused_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t busy_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;  // last: starts once everything above is set
};

}  // namespace tessera

#endif  // TESSERA_WORKER_COLLECTIVES_SHM_RING_H_
