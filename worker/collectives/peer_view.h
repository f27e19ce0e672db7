// PeerView: the devices a worker takes collective data from — the registered devices of the
// cluster as the coordinator last said (its epoch, and each alive device's incarnation), and
// the rule an Exchange stream's sender is checked by when the stream opens (issue #17 item 1).
//
// A peer's Exchange stream declares its sender (metadata tessera-device, tessera-epoch,
// tessera-incarnation; proto/auth.h). The coordinator's view comes with every registration and
// heartbeat reply (the tessera-peers trailer). A stream may come before this worker has heard
// of its sender's registration (a peer registered a moment ago): such a stream waits, unread,
// for a view asked for after it came (the next heartbeat, sent at once), and is decided then.
//
//   PeerView peers([&] { registration.beat_now(); });
//   uint64_t ticket = peers.ask();                          // before each heartbeat
//   peers.update(ticket, epoch, reply_trailer);             // after it
//   peers.admit({2, epoch, 5}, [](absl::Status s) { ... }); // a stream: OK, or why it is refused
#ifndef TESSERA_WORKER_COLLECTIVES_PEER_VIEW_H_
#define TESSERA_WORKER_COLLECTIVES_PEER_VIEW_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace tessera {

// What an Exchange stream says of its sender (0 / -1: not said).
struct StreamClaim {
  int device = -1;
  uint64_t epoch = 0;        // the coordinator incarnation the sender registered with
  uint64_t incarnation = 0;  // the sender's registration with it
};

class PeerView {
 public:
  // How long a stream waits for a view newer than itself before it is refused UNAVAILABLE
  // (the coordinator does not answer this worker's heartbeats).
  static constexpr absl::Duration kMaxWait = absl::Seconds(10);
  // Streams waiting at once; one more is refused RESOURCE_EXHAUSTED.
  static constexpr int kMaxWaiting = 1024;

  // `refresh`: asks for a view now (the registration's next heartbeat, early); must not block.
  explicit PeerView(std::function<void()> refresh = nullptr) : refresh_(std::move(refresh)) {}
  void set_refresh(std::function<void()> refresh);

  // A request for a view (a registration or heartbeat) is about to be sent: its ticket.
  uint64_t ask();
  // The view that request (`ticket`) brought: this worker's registration `epoch` and `peers`
  // (the tessera-peers trailer). Decides the streams it can. INVALID_ARGUMENT for a malformed
  // trailer (the view is unchanged). Until a view comes, every stream is taken (a coordinator
  // that names no peers: nothing to check against).
  absl::Status update(uint64_t ticket, uint64_t epoch, absl::string_view peers);

  // Decides whether a stream of `claim` is read: calls decided(status) once, on this thread
  // when the view decides it now, or later (from update or expire, outside the lock). OK: the
  // claim is a current registration (this epoch, the device alive, its current incarnation).
  // PERMISSION_DENIED naming the device, its incarnation and epoch and the rule: a claim of an
  // earlier coordinator epoch or an earlier incarnation at once; a device not registered, or a
  // newer epoch or incarnation than the view knows, once a view asked for after the stream
  // came still says so. A claim without a device, epoch or incarnation is refused (once a view
  // is known).
  void admit(const StreamClaim& claim, std::function<void(absl::Status)> decided);
  // Refuses UNAVAILABLE the streams that waited kMaxWait (the registration's tick).
  void expire(absl::Time now);
  int waiting() const;

 private:
  enum class Verdict { kAdmit, kRefuse, kWait };
  Verdict judge_locked(const StreamClaim& claim, bool fresh, std::string* why) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  struct Waiting {
    StreamClaim claim;
    uint64_t needed_ticket = 0;  // a view asked for after the stream came
    absl::Time since;
    std::function<void(absl::Status)> decided;
  };

  mutable absl::Mutex mu_;
  std::function<void()> refresh_ ABSL_GUARDED_BY(mu_);
  uint64_t asked_ ABSL_GUARDED_BY(mu_) = 0;
  bool known_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int, uint64_t> peers_ ABSL_GUARDED_BY(mu_);
  std::vector<Waiting> waiting_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera

#endif  // TESSERA_WORKER_COLLECTIVES_PEER_VIEW_H_
