// PeerView: the devices a worker takes collective data from — the registered devices of the
// cluster as the coordinator last said (its epoch, and each alive device's incarnation), and
// the rule an Exchange stream's sender is checked by when the stream opens (issue #17 item 1).
//
// A peer's Exchange stream declares its sender (metadata tessera-device, tessera-epoch,
// tessera-incarnation; proto/auth.h). The coordinator's view comes with every registration
// reply, and with a heartbeat reply when the version the heartbeat named (view_version) is not
// the coordinator's current one: a heartbeat reply without a view says the one held is current
// (ClusterPeers, proto/tessera.proto). A stream may come before this worker has heard
// of its sender's registration (a peer registered a moment ago): such a stream waits, unread,
// for a view asked for after it came (the next heartbeat, sent at once), and is decided then.
// A stream admitted is checked again by every later view: once the view says its sender's
// registration was replaced (a newer incarnation or epoch, or the device is gone), the stream
// is told to end (`replaced`), so nothing of a replaced registration is read afterwards.
//
//   PeerView peers([&] { registration.beat_now(); });
//   uint64_t held = peers.view_version(epoch);              // HeartbeatRequest.view_version
//   uint64_t ticket = peers.ask();                          // before each heartbeat
//   peers.update(ticket, epoch, held, reply.has_peers() ? &reply.peers() : nullptr, "Heartbeat reply");
//   uint64_t id = peers.admit({2, epoch, 5}, [](absl::Status s) { ... },  // OK, or why refused
//                             [](absl::Status s) { ... });  // later: its registration was replaced
//   peers.ended(id);                                        // the stream is over
#ifndef TESSERA_WORKER_COLLECTIVES_PEER_VIEW_H_
#define TESSERA_WORKER_COLLECTIVES_PEER_VIEW_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace tessera {

namespace pb {
class ClusterPeers;
}  // namespace pb

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
  // Streams waiting at once (not counting those that ended: see ended); one more is refused
  // RESOURCE_EXHAUSTED.
  static constexpr int kMaxWaiting = 1024;

  // `refresh`: asks for a view now (the registration's next heartbeat, early); must not block.
  explicit PeerView(std::function<void()> refresh = nullptr) : refresh_(std::move(refresh)) {}
  void set_refresh(std::function<void()> refresh);

  // A request for a view (a registration or heartbeat) is about to be sent: its ticket.
  uint64_t ask();
  // The version (ClusterPeers.version) of the view held when it is of coordinator `epoch`; 0
  // when none is (no view yet, or one of another epoch): what a heartbeat names, so that the
  // coordinator sends the view whenever it is not the one held.
  uint64_t view_version(uint64_t epoch) const;
  // The view that request (`ticket`) brought: this worker's registration `epoch` and the
  // reply's `peers`; the view and its version are replaced together, under one lock. Decides
  // the streams it can. INVALID_ARGUMENT naming the entry that is not a distinct device (id
  // from 0) with an incarnation from 1 (the view and version are unchanged). Until a view
  // comes, every stream is taken (nothing to check against).
  absl::Status update(uint64_t ticket, uint64_t epoch, const pb::ClusterPeers& peers);
  // The same for a reply that may carry no view (`peers` null). `held`: the view_version(epoch)
  // the request named (0 for a registration, whose reply always carries the view). A reply
  // without a view to a request that named `held` says that view is still current: the streams
  // waiting for a view asked for by `ticket` or before are decided by the view held, when it is
  // still that one (else nothing happens: a newer request decides them). To a request naming
  // none (0; or from a coordinator of another protocol version): INVALID_ARGUMENT naming
  // `reply`, and the view unchanged (never taken as "no device alive").
  absl::Status update(uint64_t ticket, uint64_t epoch, uint64_t held, const pb::ClusterPeers* peers,
                      absl::string_view reply);

  // Decides whether a stream of `claim` is read: calls decided(status) once, on this thread
  // when the view decides it now, or later (from update or expire, outside the lock). OK: the
  // claim is a current registration (this epoch, the device alive, its current incarnation).
  // PERMISSION_DENIED naming the device, its incarnation and epoch and the rule: a claim of an
  // earlier coordinator epoch or an earlier incarnation at once; a device not registered, or a
  // newer epoch or incarnation than the view knows, once a view asked for after the stream
  // came still says so. A claim without a device, epoch or incarnation is refused (once a view
  // is known).
  // Once admitted (OK), the stream is checked by every later view: when one says its sender's
  // registration was replaced (the device gone, a newer incarnation of it, or this worker's
  // registration of a newer coordinator epoch), replaced(status) is called once (from update,
  // outside the lock), PERMISSION_DENIED naming the device, the incarnation it declared, the
  // current one and the rule; the stream must end with it and read nothing more. `replaced`
  // may run before decided(OK) has returned (a view applied meanwhile): the caller orders the
  // two. Returns the stream's id, for ended() (0 when it was refused at once: nothing is kept).
  uint64_t admit(const StreamClaim& claim, std::function<void(absl::Status)> decided,
                 std::function<void(absl::Status)> replaced = nullptr);
  // The stream `id` is over (it ended or was cancelled, whatever was decided): it no longer
  // waits (nor counts toward kMaxWaiting) and is no longer checked. Its callbacks are not
  // called by any view or expiry that starts after this returns. Unknown ids are ignored.
  void ended(uint64_t id);
  // Refuses UNAVAILABLE the streams that waited kMaxWait (the registration's tick).
  void expire(absl::Time now);
  int waiting() const;
  // Streams admitted and not ended (each checked again by every view).
  int admitted() const;

 private:
  enum class Verdict { kAdmit, kRefuse, kWait };
  using Decided = std::vector<std::pair<std::function<void(absl::Status)>, absl::Status>>;
  // Judges the admitted and waiting streams by the view held, as of `ticket` (after a view of
  // it came, or a reply saying the view held is current); the callbacks to call, outside mu_,
  // go to *decided.
  void judge_streams_locked(uint64_t ticket, Decided* decided) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Verdict judge_locked(const StreamClaim& claim, bool fresh, std::string* why) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether an admitted stream's registration was replaced in the view (*why: the status text).
  bool replaced_locked(const StreamClaim& claim, std::string* why) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  struct Waiting {
    StreamClaim claim;
    uint64_t needed_ticket = 0;  // a view asked for after the stream came
    absl::Time since;
    std::function<void(absl::Status)> decided;
    std::function<void(absl::Status)> replaced;  // moved to admitted_ once it is admitted
  };
  struct Admitted {
    StreamClaim claim;
    std::function<void(absl::Status)> replaced;
    // Admitted before any view (nothing to check against): the first views judge it as a new
    // stream (one that does not name it yet may predate its sender's registration) until one
    // names it; from then on, a view without it means the device is gone.
    bool named = true;
    uint64_t needed_ticket = 0;
  };

  mutable absl::Mutex mu_;
  std::function<void()> refresh_ ABSL_GUARDED_BY(mu_);
  uint64_t asked_ ABSL_GUARDED_BY(mu_) = 0;
  bool known_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t version_ ABSL_GUARDED_BY(mu_) = 0;  // ClusterPeers.version of peers_ (0: none)
  std::map<int, uint64_t> peers_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  // By stream id (the order they came in). Each entry goes when its stream ends (ended), is
  // decided (waiting_) or told it was replaced (admitted_): both hold only live streams.
  std::map<uint64_t, Waiting> waiting_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Admitted> admitted_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera

#endif  // TESSERA_WORKER_COLLECTIVES_PEER_VIEW_H_
