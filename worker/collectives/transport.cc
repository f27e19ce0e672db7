#include "worker/collectives/transport.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>

#include "absl/base/const_init.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/run_tag.h"  // random_run_tag
#include "grpc/slice.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/client_callback.h"
#include "grpcpp/support/slice.h"
#include "proto/auth.h"
#include "proto/in_process.h"
#include "proto/rpc.h"
#include "proto/tessera.grpc.pb.h"
#include "worker/collectives/reduce.h"
#include "worker/collectives/shm_ring.h"

namespace tessera {
namespace {

// How many finished op ids to remember, to discard their late messages.
constexpr size_t kRememberedOps = 4096;

// Exchange messages are written as raw bytes: the four small fields serialized by protobuf,
// then field 5 (data) framed by hand and carried as its own slice. The bytes are a valid
// ExchangeMessage for the receiver, and the data is copied once (into the slice) instead of
// three times (into a string, a message, and gRPC's serialization buffer).
const grpc::internal::RpcMethod& exchange_method() {
  static const auto* const kMethod =
      new grpc::internal::RpcMethod("/tessera.pb.Worker/Exchange", grpc::internal::RpcMethod::CLIENT_STREAMING);
  return *kMethod;
}

// Releases the owner a zero-copy slice holds (gRPC calls it once it is done with the bytes).
void release_owner(void* owner) { delete static_cast<std::shared_ptr<const void>*>(owner); }

// A message's data as one slice: the caller's memory itself when it is large and `owner`
// keeps it alive (zero-copy, see Transport::send), else a copy.
grpc::Slice payload_slice(const std::byte* data, int64_t bytes, std::shared_ptr<const void> owner) {
  if (owner != nullptr && bytes >= Transport::kZeroCopyMinBytes) {
    return grpc::Slice(const_cast<std::byte*>(data), static_cast<size_t>(bytes), &release_owner,
                       new std::shared_ptr<const void>(std::move(owner)));
  }
  return grpc::Slice(data, static_cast<size_t>(bytes));
}

grpc::ByteBuffer encode_exchange(int self, MessageTag tag, const std::byte* data, int64_t bytes,
                                 std::shared_ptr<const void> owner) {
  pb::ExchangeMessage header;
  header.set_source_device(self);
  header.set_op_id(tag.op);
  header.set_step(tag.step);
  header.set_chunk(tag.chunk);
  header.set_run_tag(tag.run_tag);
  std::string prefix = header.SerializeAsString();
  prefix.push_back(static_cast<char>((5 << 3) | 2));  // field 5, length-delimited
  for (uint64_t n = static_cast<uint64_t>(bytes);; n >>= 7) {
    if (n < 0x80) {
      prefix.push_back(static_cast<char>(n));
      break;
    }
    prefix.push_back(static_cast<char>((n & 0x7F) | 0x80));
  }
  grpc::Slice slices[2] = {grpc::Slice(prefix), payload_slice(data, bytes, std::move(owner))};
  return grpc::ByteBuffer(slices, 2);
}

// A notice (ExchangeMessage.lost_ops and lost_op_tags, no data): the sender's earlier streams
// to the receiver failed with messages of `ops` in flight.
grpc::ByteBuffer encode_notice(int self, const std::vector<TaggedOp>& ops) {
  pb::ExchangeMessage notice;
  notice.set_source_device(self);
  for (const TaggedOp& op : ops) {
    notice.add_lost_ops(op.op);
    notice.add_lost_op_tags(op.run_tag);
  }
  grpc::Slice slice(notice.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

// An offer (ExchangeMessage.shm_*, no data): the sender's shared-memory ring to the receiver,
// to fetch from the sender's ShmRingServer at `socket` with `token`.
grpc::ByteBuffer encode_offer(int self, const std::string& socket, uint64_t token, const std::string& host) {
  pb::ExchangeMessage offer;
  offer.set_source_device(self);
  offer.set_shm_segment(socket);
  offer.set_shm_token(token);
  offer.set_shm_host(host);
  grpc::Slice slice(offer.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

// Longest socket path and host identity an offer may carry.
constexpr size_t kMaxOfferString = 256;
// Most rings a worker reads at once (one per source).
constexpr size_t kMaxInboundRings = 1024;
// How long a ring writer sleeps before it checks its link and deadline again (it is also woken
// when the link breaks), and a ring reader before it checks that it is to stop.
constexpr absl::Duration kRingRecheck = absl::Milliseconds(500);
// How long an InboundRing waits at most before it asks a busy ring server again.
constexpr absl::Duration kRingFetchBackoff = absl::Milliseconds(500);

// How many ops a notice may name, and how many recent ops a link remembers for one.
constexpr size_t kMaxNoticeOps = 256;

std::string peer_name(int device, const std::string& address) {
  return address.empty() ? absl::StrCat("device ", device) : absl::StrCat("device ", device, " (", address, ")");
}

// What the status an outbound Exchange stream ended with says to the op that lost it: a
// refusal or verdict of the peer's Exchange handler keeps its code (PERMISSION_DENIED for a
// replaced registration, INVALID_ARGUMENT from its decoder, RESOURCE_EXHAUSTED for its
// waiting list, UNAUTHENTICATED, FAILED_PRECONDITION); every other end is UNAVAILABLE: the
// stream just went (OK: a peer never ends a stream cleanly unless this end closed it;
// CANCELLED: the call was cancelled, by gRPC or a server going away), or gRPC's own
// transport ended it (INTERNAL "RST_STREAM ...", UNKNOWN "Stream removed", ...), which a
// dead or faulty peer causes and callers (FanOut::first_failure, the peer-killed drills)
// take as UNAVAILABLE. gRPC's code then stays in the message.
absl::Status stream_end(const grpc::Status& ended) {
  switch (ended.error_code()) {
    case grpc::StatusCode::PERMISSION_DENIED:
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::UNAUTHENTICATED:
    case grpc::StatusCode::FAILED_PRECONDITION:
      return absl::Status(static_cast<absl::StatusCode>(ended.error_code()), ended.error_message());
    default:
      break;
  }
  if (ended.error_message().empty()) return absl::UnavailableError("");
  return absl::UnavailableError(
      absl::StrCat("gRPC ", absl::StatusCodeToString(static_cast<absl::StatusCode>(ended.error_code())), " ",
                   ended.error_message()));
}

// ": <code>: <message>" of a stream_end status with a message; "" without one.
std::string stream_end_detail(const absl::Status& end) {
  if (end.message().empty()) return "";
  return absl::StrCat(": ", absl::StatusCodeToString(end.code()), ": ", end.message());
}

}  // namespace

// A transport serving an in-process address (Transport::serve_in_process), in the process's
// table: peers of this process file their messages into it through this entry. `transport`
// is null once it stopped; a sender holds `mu` (shared) while it files, so the transport
// cannot go meanwhile. Lock order: a transport's mu_ is never held while taking an entry's
// `mu` or the table's lock.
struct internal::InProcessMailbox {
  InProcessMailbox(Transport* t, std::string token) : transport(t), cluster_token(std::move(token)) {}
  absl::Mutex mu;
  Transport* transport ABSL_GUARDED_BY(mu);
  const std::string cluster_token;  // a peer of another cluster (another token) keeps gRPC, which checks it
};

namespace {

absl::Mutex in_process_table_mu(absl::kConstInit);
// In-process address -> the transport serving it.
std::map<std::string, std::shared_ptr<internal::InProcessMailbox>>& in_process_table()
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(in_process_table_mu) {
  static auto* table = new std::map<std::string, std::shared_ptr<internal::InProcessMailbox>>();
  return *table;
}

std::shared_ptr<internal::InProcessMailbox> in_process_mailbox(const std::string& address) {
  absl::MutexLock lock(&in_process_table_mu);
  auto it = in_process_table().find(address);
  return it == in_process_table().end() ? nullptr : it->second;
}

// The order an entry of refused_ (a Refusal) or lost_ (the order itself) was remembered in.
template <typename Value>
uint64_t order_of(const Value& value) {
  return value.order;
}
uint64_t order_of(uint64_t order) { return order; }

}  // namespace

// Whether the key may be added: not if it is held already. At most
// Transport::kRefusedTagsPerSource tags per (op, source), so that made-up tags for one op
// cannot fill the source's share and push its other ops' entries out (see refuse_locked). At
// that cap the oldest entry of the (op, source) goes to make room, except its first (a run's
// own refusal or loss, come before made-up tags) and the tag a run claimed the op with
// (`claimed_tag`): so the newest stays, a client's retry of a fan-out under fresh tags as well.
template <typename Value>
bool Transport::Remembered<Value>::room_for_tag(const OpSourceTag& key, std::optional<uint64_t> claimed_tag) {
  // Named copies, not a structured binding: C++17 lambdas cannot capture those (clang refuses).
  const uint64_t op = std::get<0>(key);
  const int from = std::get<1>(key);
  const uint64_t run_tag = std::get<2>(key);
  const auto begin = entries_.lower_bound({op, from, 0});
  auto same = [&](auto it) {
    return it != entries_.end() && std::get<0>(it->first) == op && std::get<1>(it->first) == from;
  };
  int tags = 0;
  auto first = entries_.end();
  for (auto it = begin; same(it); ++it) {
    if (std::get<2>(it->first) == run_tag) return false;
    ++tags;
    if (first == entries_.end() || order_of(it->second) < order_of(first->second)) first = it;
  }
  if (tags < Transport::kRefusedTagsPerSource) return true;
  auto oldest = entries_.end();
  for (auto it = begin; same(it); ++it) {
    if (it == first || std::get<2>(it->first) == claimed_tag) continue;
    if (oldest == entries_.end() || order_of(it->second) < order_of(oldest->second)) oldest = it;
  }
  erase(oldest);  // kRefusedTagsPerSource > 2 (below): there is one
  return true;
}
static_assert(Transport::kRefusedTagsPerSource > 2,
              "room_for_tag keeps an (op, source)'s first and claimed tags and must find a third to forget");

template <typename Value>
template <typename Claimed>
bool Transport::Remembered<Value>::remember(const OpSourceTag& key, Value value, std::optional<uint64_t> claimed_tag,
                                            const Claimed& claimed) {
  if (!room_for_tag(key, claimed_tag)) return false;
  const uint64_t order = order_of(value);
  // Held already (room_for_tag said no, this is for the indexes' sake): nothing is indexed.
  if (!entries_.emplace(key, std::move(value)).second) return false;
  const int source = std::get<1>(key);
  auto& own = by_source_[source];
  if (!own.empty()) by_count_.erase({own.size(), source});
  own.insert({order, key});
  const size_t held = own.size();
  by_count_.insert({held, source});
  // Charged to the source: past its own bound its own oldest goes. Past the bound in all, the
  // source holding the most pays (a flood's), never one holding fewer than the newcomer's.
  if (held > kRememberedPerSource) {
    forget_oldest_of(source, claimed);
  } else if (entries_.size() > kRememberedInAll) {
    const std::pair<size_t, int> most = *by_count_.rbegin();
    forget_oldest_of(most.first > held ? most.second : source, claimed);
  }
  return true;
}

template <typename Value>
bool Transport::remember_locked(Remembered<Value>& remembered, const OpSourceTag& key, Value value,
                                std::optional<uint64_t> claimed_tag) {
  return remembered.remember(key, std::move(value), claimed_tag, [this](uint64_t op) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return run_tag_locked(op).has_value();  // under mu_, as here
  });
}

template <typename Value>
template <typename Claimed>
void Transport::Remembered<Value>::forget_oldest_of(int source, const Claimed& claimed) {
  // A run waits on its claimed ops' entries; a flood of made-up op ids adds unclaimed ones.
  const auto& own = by_source_.at(source);
  auto oldest = own.begin();
  for (auto it = own.begin(); it != own.end(); ++it) {
    if (!claimed(std::get<0>(it->second))) {
      oldest = it;
      break;
    }
  }
  const auto entry = entries_.find(oldest->second);
  if (entry == entries_.end()) {  // our invariant: by_source_ indexes entries_ exactly
    std::fprintf(stderr,
                 "tessera-worker: Transport::Remembered: an entry of op %lu from device %d is indexed but not held\n",
                 static_cast<unsigned long>(std::get<0>(oldest->second)), source);
    std::abort();
  }
  erase(entry);
}

template <typename Value>
typename Transport::Remembered<Value>::Map::const_iterator Transport::Remembered<Value>::erase(
    typename Map::const_iterator it) {
  const int source = std::get<1>(it->first);
  auto own = by_source_.find(source);
  by_count_.erase({own->second.size(), source});
  own->second.erase({order_of(it->second), it->first});
  if (own->second.empty()) {
    by_source_.erase(own);
  } else {
    by_count_.insert({own->second.size(), source});
  }
  return entries_.erase(it);
}

template <typename Value>
void Transport::Remembered<Value>::erase_ops(uint64_t first, uint64_t end) {
  for (typename Map::const_iterator it = entries_.lower_bound({first, INT_MIN, 0});
       it != entries_.end() && std::get<0>(it->first) < end;) {
    it = erase(it);
  }
}

template <typename Value>
size_t Transport::Remembered<Value>::held_by(int source) const {
  auto own = by_source_.find(source);
  return own == by_source_.end() ? 0 : own->second.size();
}

std::pair<size_t, size_t> Transport::remembered_of(int source) const {
  absl::MutexLock lock(&mu_);
  return {refused_.held_by(source), lost_.held_by(source)};
}

// The outbound Exchange streams to one peer: kStreamsPerLink callback-API writers over one
// channel, each with one write in flight, sharing one queue. A sender whose message finds a
// stream idle starts its write itself (gRPC then writes the socket inline, without waking
// another thread); otherwise the message is queued and the next OnWriteDone starts it.
// Several streams matter for latency: a stream is busy until gRPC runs its OnWriteDone on a
// callback thread, and a collective's next message (the next round of recursive doubling,
// say) must not wait for that thread to be scheduled. Messages are tagged, so their order
// across streams does not matter.
//
// A message accepted here is not known to be delivered: gRPC's write completing only means
// the bytes left for the socket, and a connection that breaks (a peer stopped and continued,
// whose keepalive state makes either end drop it) loses what was in flight. So a link that
// fails reports the ops it carried recently to the transport (see Transport::link_failed),
// which fails them here and tells the peer, unless the link is being retired on purpose.
class Transport::Link {
 public:
  static constexpr int kStreamsPerLink = 3;

  // `ring_bytes` > 0 and a `ring_server`: offer the peer a shared-memory ring of that size
  // through `ring_server` with the first message, naming this worker's `host` (without a
  // server, `ring_bytes` is ignored). `declared`: the registration the streams declare (epoch
  // and incarnation; none when 0), which the peer checks (peer_view.h).
  Link(Transport* transport, int self, int peer, std::string address, int64_t ring_bytes = 0, std::string host = "",
       std::pair<uint64_t, uint64_t> declared = {}, std::shared_ptr<ShmRingServer> ring_server = nullptr)
      : transport_(transport),
        self_(self),
        declared_(declared),
        peer_(peer),
        address_(std::move(address)),
        channel_(make_channel(address_, daemon_identity(transport->credentials_, self))),
        ring_bytes_(ring_server != nullptr ? ring_bytes : 0),
        host_(std::move(host)),
        ring_server_(std::move(ring_server)) {
    for (int i = 0; i < kStreamsPerLink; ++i) streams_.push_back(std::make_unique<Stream>(this));
  }

  ~Link() {
    {
      absl::MutexLock lock(&mu_);
      retiring_ = true;  // the streams end because we end them: nothing to report
    }
    for (auto& s : streams_) s->cancel();
    absl::MutexLock lock(&mu_);
    // gRPC calls OnDone once a cancelled call is over: this wait ends.
    auto all_done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_streams_ == kStreamsPerLink; };
    mu_.Await(absl::Condition(&all_done));
    if (ring_ != nullptr) ring_server_->withdraw(ring_->token());  // if the peer never fetched it
  }

  absl::Status enqueue(MessageTag tag, const std::byte* data, int64_t bytes, absl::Time deadline,
                       std::shared_ptr<const void> owner) {
    if (ring_bytes_ > 0) {
      // The ring is made with the first message (a link that only carries a notice has none),
      // and offered on gRPC; messages take gRPC too until the peer has opened the ring (they
      // are tagged: which path each took does not matter to the receiver).
      std::call_once(ring_once_, [this] { offer_ring(); });
      ShmRing* ring = ring_view_.load(std::memory_order_acquire);
      if (ring != nullptr && ring->attached() && ring->fits(bytes)) return write_ring(ring, tag, data, bytes, deadline);
    }
    return push(Outgoing{encode_exchange(self_, tag, data, bytes, std::move(owner)), bytes}, {tag.op, tag.run_tag},
                deadline);
  }

  // Sends a notice that messages of `ops` sent on earlier links may be lost. Never waits.
  void notify_lost(const std::vector<TaggedOp>& ops) {
    push(Outgoing{encode_notice(self_, ops), 0}, {}, absl::InfiniteFuture()).IgnoreError();
  }

  const std::string& address() const { return address_; }
  int peer() const { return peer_; }

  bool broken() const {
    absl::MutexLock lock(&mu_);
    return broken_;
  }

 private:
  struct Outgoing {
    grpc::ByteBuffer buffer;
    int64_t bytes = 0;  // of data, for the in-flight cap
  };

  void offer_ring() {
    // Sparse until written: a ring the peer never opens (another host) costs a header page, and
    // one descriptor, the server's (closed when the link withdraws the ring).
    absl::StatusOr<std::unique_ptr<ShmRing>> created = ShmRing::create(ring_bytes_, random_run_tag());
    if (!created.ok()) {
      std::fprintf(stderr, "tessera-worker: no shared memory to device %d, using gRPC: %s\n", peer_,
                   created.status().ToString().c_str());
      return;
    }
    if (absl::Status offered = ring_server_->offer(**created); !offered.ok()) {
      std::fprintf(stderr, "tessera-worker: no shared memory to device %d, using gRPC: %s\n", peer_,
                   offered.ToString().c_str());
      return;
    }
    ring_ = *std::move(created);
    ring_view_.store(ring_.get(), std::memory_order_release);
    push(Outgoing{encode_offer(self_, ring_server_->path(), ring_->token(), host_), 0}, {}, absl::InfiniteFuture())
        .IgnoreError();
  }

  // Copies one message into the ring, waiting for room until `deadline`. The link's gRPC
  // streams stay open beside it: when they fail (the peer died), so does this link, and the
  // ops it carried, on either path, are reported (see fail_locked).
  absl::Status write_ring(ShmRing* ring, MessageTag tag, const std::byte* data, int64_t bytes, absl::Time deadline) {
    absl::MutexLock writer(&ring_mu_);  // one writer at a time
    {
      absl::MutexLock lock(&mu_);
      if (broken_) return error_;
      note_op_locked({tag.op, tag.run_tag});
    }
    const ShmRing::Record record{tag.op, tag.step, tag.chunk, bytes, tag.run_tag};
    while (!ring->write(record, data, std::min(deadline, absl::Now() + kRingRecheck))) {
      absl::MutexLock lock(&mu_);
      if (broken_) return error_;
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(peer_name(peer_, address_),
                                                        " is not taking collective data (its shared-memory ring of ",
                                                        ring->capacity(), " bytes is full)"));
      }
    }
    return absl::OkStatus();
  }

  void note_op_locked(TaggedOp op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (op.op != 0 &&
        (recent_ops_.empty() || recent_ops_.back().op != op.op || recent_ops_.back().run_tag != op.run_tag)) {
      recent_ops_.push_back(op);
      if (recent_ops_.size() > kMaxNoticeOps) recent_ops_.pop_front();
    }
  }

  // Queues `message` (of op `op`; op 0 for a notice), or starts its write on an idle stream.
  absl::Status push(Outgoing message, TaggedOp op, absl::Time deadline) {
    const int64_t bytes = message.bytes;
    Stream* idle = nullptr;
    {
      absl::MutexLock lock(&mu_);
      auto room = [this, bytes]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return broken_ || queued_bytes_ == 0 || queued_bytes_ + bytes <= kMaxQueuedBytes;
      };
      if (!mu_.AwaitWithDeadline(absl::Condition(&room), deadline)) {
        return absl::DeadlineExceededError(absl::StrCat(peer_name(peer_, address_), " is not taking collective data (",
                                                        queued_bytes_, " bytes queued)"));
      }
      if (broken_) return error_;
      queued_bytes_ += bytes;
      note_op_locked(op);
      for (auto& s : streams_) {
        if (!s->writing && !s->ended) {
          idle = s.get();
          break;
        }
      }
      if (idle == nullptr) {
        queue_.push_back(std::move(message));
        return absl::OkStatus();
      }
      idle->writing = true;
      idle->current = std::move(message);
    }
    idle->start_write();
    return absl::OkStatus();
  }

  class Stream final : public grpc::ClientWriteReactor<grpc::ByteBuffer> {
   public:
    explicit Stream(Link* link) : link_(link) {
      // A long-lived stream: no deadline. It waits for the connection rather than failing
      // on a first refused connect; the collectives' own deadlines bound every wait.
      ctx_.set_wait_for_ready(true);
      // Not corked: every stream of a link opens (and its peer checks its declaration) when the
      // link is made, not at its first write, which for a link's second and third streams may
      // come after this worker registered again and so declare a registration no longer current.
      if (link->declared_.first != 0) {
        ctx_.AddMetadata(kEpochKey, absl::StrCat(link->declared_.first));
        ctx_.AddMetadata(kIncarnationKey, absl::StrCat(link->declared_.second));
      }
      grpc::internal::ClientCallbackWriterFactory<grpc::ByteBuffer>::Create(link->channel_.get(), exchange_method(),
                                                                            &ctx_, &reply_, this);
      AddHold();  // released by cancel(): OnDone cannot run before the Link is being destroyed
      StartCall();
    }

    void cancel() {
      bool release = false;
      {
        absl::MutexLock lock(&link_->mu_);
        release = held;
        held = false;
      }
      ctx_.TryCancel();  // the context keeps its own reference to the call, even after OnDone
      if (release) RemoveHold();
    }

    void start_write() { StartWrite(&current.buffer); }

    void OnWriteDone(bool ok) override {
      bool next = false;
      bool release = false;
      {
        absl::MutexLock lock(&link_->mu_);
        link_->queued_bytes_ -= current.bytes;
        current = {};
        if (!ok) ended = true;  // a write fails only once the call is over: OnDone says why
        if (ended || link_->queue_.empty()) {
          writing = false;
          release = release_locked();
        } else {
          current = std::move(link_->queue_.front());
          link_->queue_.pop_front();
          next = true;
        }
      }
      // The Link lives until this stream's OnDone, which gRPC runs after this returns.
      if (release) RemoveHold();
      if (next) start_write();
    }

    // The server never sends initial metadata before it ends the stream (its only message is
    // the final reply), so this runs when the call ends: the server finished it, or the
    // connection broke. OnWriteDone would come only with the next write: this is how an idle
    // stream's end is known. The hold goes (unless a write of ours is pending: its OnWriteDone
    // lets go of it), so OnDone comes now, with the status the peer ended the stream with.
    void OnReadInitialMetadataDone(bool) override {
      bool release = false;
      {
        absl::MutexLock lock(&link_->mu_);
        ended = true;
        release = release_locked();
      }
      if (release) RemoveHold();
    }

    // Once the call ended and the hold went (above), or the Link is going (cancel).
    void OnDone(const grpc::Status& status) override {
      std::vector<TaggedOp> lost;
      const absl::Status end = stream_end(status);
      {
        absl::MutexLock lock(&link_->mu_);
        lost = link_->fail_locked(end);
      }
      if (!lost.empty()) link_->transport_->link_failed(*link_, lost, end);
      absl::MutexLock lock(&link_->mu_);
      ++link_->done_streams_;  // last: once every stream is done, the Link may go
    }

    // Guarded by link_->mu_ (written under it; `current` is then used only by the one
    // thread that starts or finishes this stream's write).
    bool writing = false;
    Outgoing current;
    // The call ended (no write starts on it any more), and whether our hold is still on: while
    // it is, OnDone cannot run, so a write may start and cancel() may remove it.
    bool ended = false;
    bool held = true;

   private:
    // Whether to let go of the hold now: the call ended and no write of ours is pending (a
    // write started after OnDone would use a call gRPC has destroyed). REQUIRES: link_->mu_.
    bool release_locked() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      if (!held || !ended || writing) return false;
      held = false;
      return true;
    }

    Link* const link_;
    grpc::ClientContext ctx_;
    grpc::ByteBuffer reply_;
  };

  // Marks the link broken and drops what is queued; `end` (stream_end): how its stream ended,
  // which the sends that find it broken report. The first time, unless the link is being
  // retired, returns the ops it carried recently (their messages may be lost), to report.
  std::vector<TaggedOp> fail_locked(const absl::Status& end) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<TaggedOp> lost;
    if (!broken_) {
      broken_ = true;
      error_ = absl::Status(end.code(), absl::StrCat(peer_name(peer_, address_), " stopped taking collective data",
                                                     stream_end_detail(end)));
      if (!retiring_) lost.assign(recent_ops_.begin(), recent_ops_.end());
      if (ShmRing* ring = ring_view_.load(); ring != nullptr) ring->wake_writer();  // a waiting writer sees broken_
    }
    queue_.clear();
    queued_bytes_ = 0;
    return lost;
  }

  // Constant after construction.
  Transport* const transport_;
  const int self_;
  const std::pair<uint64_t, uint64_t> declared_;
  const int peer_;
  const std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::vector<std::unique_ptr<Stream>> streams_;
  const int64_t ring_bytes_;
  const std::string host_;
  const std::shared_ptr<ShmRingServer> ring_server_;  // hands ring_ to the peer (see offer_ring)
  // The ring to the peer, made once by the first enqueue (closed when the link goes: the
  // peer's reader drains it and stops); ring_view_ is how other threads see it.
  std::once_flag ring_once_;
  std::unique_ptr<ShmRing> ring_;
  std::atomic<ShmRing*> ring_view_{nullptr};
  absl::Mutex ring_mu_;  // held by the one writer of the ring

  mutable absl::Mutex mu_;
  std::deque<Outgoing> queue_ ABSL_GUARDED_BY(mu_);
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // queued and in flight
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool retiring_ ABSL_GUARDED_BY(mu_) = false;
  // The ops of the latest messages with their run tags, each once (at most kMaxNoticeOps).
  std::deque<TaggedOp> recent_ops_ ABSL_GUARDED_BY(mu_);
  int done_streams_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

// A ring a peer writes to this worker, read by a thread of its own: it fetches the ring the peer
// offered from the peer's ShmRingServer (not on the gRPC callback thread that read the offer,
// which must not wait for that), says it is attached,
// then files each message in the mailbox as gRPC's reader would, until it is stopped (the
// source offered a new ring, its streams all ended, or the transport goes) or the writer
// closed the ring and it is drained.
class Transport::InboundRing {
 public:
  InboundRing(Transport* transport, int source, std::string socket, std::string dir, uint64_t token,
              std::function<void(const MessageTag&)> before_placed_copy)
      : transport_(transport),
        source_(source),
        socket_(std::move(socket)),
        dir_(std::move(dir)),
        token_(token),
        before_placed_copy_(std::move(before_placed_copy)),
        thread_([this] { run(); }) {}

  ~InboundRing() {
    stop();
    thread_.join();
  }

  // Never waits.
  void stop() {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    if (ring_ != nullptr) ring_->wake_reader();
  }

  bool exited() const { return exited_.load(); }

 private:
  void run() {
    // Bounded (the server's own limit), and stop() ends it within 100 ms (fetch asks), so a
    // transport that goes does not wait for a peer that does not answer. A busy server is asked
    // again, backing off, within the same deadline.
    const absl::Time until = absl::Now() + ShmRingServer::kHandoverTimeout;
    auto stopped = [this] {
      absl::MutexLock lock(&mu_);
      return stop_;
    };
    absl::StatusOr<std::unique_ptr<ShmRing>> opened;
    for (absl::Duration backoff = absl::Milliseconds(10);; backoff = std::min(2 * backoff, kRingFetchBackoff)) {
      opened = ShmRing::fetch(socket_, dir_, token_, until, stopped);
      if (!absl::IsUnavailable(opened.status()) || absl::Now() + backoff >= until) break;
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), backoff)) {
        opened = absl::CancelledError("stopped");
        break;
      }
    }
    if (!opened.ok()) {
      // Another host after all (or /dev/shm is not shared), refused, or stopped: the peer keeps
      // using gRPC.
      if (!absl::IsNotFound(opened.status()) && !absl::IsCancelled(opened.status())) {
        std::fprintf(stderr, "tessera-worker: shared memory from device %d not used: %s\n", source_,
                     opened.status().ToString().c_str());
      }
      exited_ = true;
      return;
    }
    std::unique_ptr<ShmRing> ring = *std::move(opened);
    {
      absl::MutexLock lock(&mu_);
      if (!stop_) {
        ring_ = ring.get();
        ring->mark_attached();
      }
    }
    for (;;) {
      {
        absl::MutexLock lock(&mu_);
        if (stop_) break;
      }
      ShmRing::Record record;
      absl::StatusOr<bool> got = ring->next(&record, absl::Now() + kRingRecheck);
      if (!got.ok() || (*got && record.bytes > kMaxChunkBytes)) {
        std::fprintf(
            stderr, "tessera-worker: dropping the shared-memory ring from device %d: %s\n", source_,
            got.ok()
                ? absl::StrCat("a message of ", record.bytes, " bytes exceeds the limit of ", kMaxChunkBytes).c_str()
                : got.status().ToString().c_str());
        break;
      }
      if (!*got) {
        if (ring->drained_and_closed()) break;
        continue;
      }
      Received data;
      Expected expected;
      const MessageTag tag{record.op, record.step, record.chunk, record.run_tag};
      if (transport_->take_expected(source_, tag, record.bytes, &expected)) {
        if (before_placed_copy_) before_placed_copy_(tag);  // tests only (ShmOptions)
        ring->copy_payload(record, expected.dst);           // straight to where its receive wants it
        transport_->copied({tag.op, source_, tag.step, tag.chunk, tag.run_tag});
        data.placed_ = expected.dst;
        data.placed_owner_ = std::move(expected.owner);
      } else {
        grpc::Slice slice(grpc_slice_malloc(static_cast<size_t>(record.bytes)), grpc::Slice::STEAL_REF);
        ring->copy_payload(record, reinterpret_cast<std::byte*>(const_cast<uint8_t*>(slice.begin())));
        data.slices_.push_back(std::move(slice));
      }
      ring->consume(record);
      data.bytes_ = record.bytes;
      // Over the source's share the message waits, and so does this thread: the ring fills and
      // its writer waits for room with its deadline (flow control, see file_or_wait).
      std::shared_ptr<Waiting> waiting;
      if (transport_->file_or_wait(source_, tag, std::move(data), Via::kShm, nullptr, &waiting)) {
        while (!transport_->await_room(&waiting, absl::Now() + kRingRecheck)) {
          bool stop = false;
          {
            absl::MutexLock lock(&mu_);  // not with the transport's: it takes this one in stop()
            stop = stop_;
          }
          if (stop && transport_->give_up_waiting(&waiting)) break;
        }
      }
    }
    {
      absl::MutexLock lock(&mu_);
      ring_ = nullptr;
    }
    exited_ = true;
  }

  Transport* const transport_;
  const int source_;
  const std::string socket_;
  const std::string dir_;  // the only directory the socket may be in (ShmOptions::socket_dir)
  const uint64_t token_;
  const std::function<void(const MessageTag&)> before_placed_copy_;  // ShmOptions::before_placed_copy
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  ShmRing* ring_ ABSL_GUARDED_BY(mu_) = nullptr;  // while the thread has it open
  std::atomic<bool> exited_{false};
  std::thread thread_;  // last: starts once everything above is set
};

Transport::Transport(Credentials credentials) : credentials_(std::move(credentials)) {}

Transport::~Transport() {
  close_in_process();  // no peer files here any more
  std::map<int, std::shared_ptr<Link>> links;
  std::vector<std::shared_ptr<Link>> retired;
  std::map<int, std::unique_ptr<InboundRing>> inbound;
  std::vector<std::unique_ptr<InboundRing>> stopped;
  std::thread watch;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;  // the watchdog resumes what is parked and ends
    links.swap(links_);
    retired.swap(retired_);
    for (auto& old : superseded_) retired.push_back(std::move(old));
    superseded_.clear();
    inbound.swap(inbound_);
    stopped.swap(stopped_inbound_);
    watch.swap(parked_watch_);
  }
  if (watch.joinable()) watch.join();
  inbound.clear();  // joins the ring readers (they file into this transport) outside the lock
  stopped.clear();
  links.clear();  // ends the streams outside the lock
  retired.clear();
}

absl::Status Transport::set_shm(ShmOptions options) {
  if (options.enabled && (options.ring_bytes < ShmRing::kMinBytes || options.ring_bytes > ShmRing::kMaxBytes)) {
    return absl::InvalidArgumentError(absl::StrCat("shared-memory ring size ", options.ring_bytes,
                                                   " bytes: must be within [", ShmRing::kMinBytes, ", ",
                                                   ShmRing::kMaxBytes, "]"));
  }
  if (options.host.empty()) options.host = shm_host_identity();
  std::shared_ptr<ShmRingServer> server;
  {
    absl::MutexLock lock(&mu_);
    server = shm_server_;
  }
  if (options.enabled && server == nullptr) {
    // Where peers fetch the rings this worker offers. Without it this worker offers none (it
    // sends over gRPC) and still reads the rings its peers offer.
    absl::StatusOr<std::unique_ptr<ShmRingServer>> started = ShmRingServer::start(options.socket_dir);
    if (started.ok()) {
      server = *std::move(started);
    } else {
      std::fprintf(stderr, "tessera-worker: offering no shared-memory rings, sending over gRPC: %s\n",
                   started.status().ToString().c_str());
    }
  }
  absl::MutexLock lock(&mu_);
  shm_ = std::move(options);
  if (shm_server_ == nullptr) shm_server_ = std::move(server);
  return absl::OkStatus();
}

bool Transport::shm_enabled() const {
  absl::MutexLock lock(&mu_);
  return shm_.enabled;
}

int64_t Transport::shm_messages_received() const {
  absl::MutexLock lock(&mu_);
  return shm_received_;
}

void Transport::expect_at(int source, MessageTag tag, std::byte* dst, int64_t bytes,
                          std::shared_ptr<const void> owner) {
  Expected replaced;  // destroyed after the lock is let go: its owner may be the last (a leaf lock)
  absl::MutexLock lock(&expected_mu_);
  const auto [it, added] = expected_.try_emplace(Key{tag.op, source, tag.step, tag.chunk, tag.run_tag});
  replaced = std::exchange(it->second, Expected{dst, bytes, std::move(owner)});
  if (added) expected_count_.fetch_add(1, std::memory_order_relaxed);
}

void Transport::forget_expected(uint64_t op) {
  std::vector<std::shared_ptr<const void>> owners;  // let go outside the lock
  absl::MutexLock lock(&expected_mu_);
  for (auto it = expected_.lower_bound(Key{op, INT_MIN, INT32_MIN, INT32_MIN, 0});
       it != expected_.end() && std::get<0>(it->first) == op;) {
    owners.push_back(std::move(it->second.owner));
    it = expected_.erase(it);
    expected_count_.fetch_sub(1, std::memory_order_relaxed);
  }
  // Nothing writes to the op's places once this returns.
  await_copies_locked(Key{op, INT_MIN, INT32_MIN, INT32_MIN, 0}, Key{op, INT_MAX, INT32_MAX, INT32_MAX, UINT64_MAX});
}

void Transport::unexpect(const Key& key) {
  // No lock on other ops' path: a copy under way was counted (copying_count_) before its take
  // let go of the lock, and so was every expectation.
  if (expected_count_.load(std::memory_order_acquire) == 0 && copying_count_.load(std::memory_order_acquire) == 0) {
    return;
  }
  std::shared_ptr<const void> owner;  // let go outside the lock
  absl::MutexLock lock(&expected_mu_);
  auto it = expected_.find(key);
  if (it != expected_.end()) {
    owner = std::move(it->second.owner);
    expected_.erase(it);
    expected_count_.fetch_sub(1, std::memory_order_relaxed);
  }
  // A repeat of the message taken before this may be being copied there: it must be done
  // before the receive's caller copies the one it got there.
  await_copies_locked(key, key);
}

void Transport::await_copies_locked(const Key& first, const Key& last) {
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(expected_mu_) {
    auto it = copying_.lower_bound(first);
    return it == copying_.end() || last < it->first;
  };
  // A memcpy of at most a chunk from the ring, which waits for nothing: it ends. Waited for
  // without a bound (returning earlier would let the caller hand out memory still written),
  // said every 10 s should a starved reader take that long.
  while (!expected_mu_.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(10))) {
    std::fprintf(stderr,
                 "tessera-worker: a shared-memory ring's reader still copies a message of op %llu to its place "
                 "after 10 s\n",
                 static_cast<unsigned long long>(std::get<0>(first)));
  }
}

bool Transport::take_expected(int source, MessageTag tag, int64_t bytes, Expected* out) {
  if (expected_count_.load(std::memory_order_relaxed) == 0) return false;  // no lock on other ops' path
  absl::MutexLock lock(&expected_mu_);
  auto it = expected_.find(Key{tag.op, source, tag.step, tag.chunk, tag.run_tag});
  if (it == expected_.end() || it->second.bytes != bytes) return false;
  *out = std::move(it->second);
  ++copying_[it->first];  // until copied(key)
  copying_count_.fetch_add(1, std::memory_order_release);
  expected_.erase(it);
  // Release: an unlocked reader that sees this decrement also sees the copy counted above.
  expected_count_.fetch_sub(1, std::memory_order_release);
  placed_count_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void Transport::copied(const Key& key) {
  absl::MutexLock lock(&expected_mu_);
  auto it = copying_.find(key);
  if (it == copying_.end()) return;
  copying_count_.fetch_sub(1, std::memory_order_release);
  if (--it->second == 0) copying_.erase(it);
}

int64_t Transport::placed_messages() const { return placed_count_.load(std::memory_order_relaxed); }

int64_t Transport::expected_messages() const { return expected_count_.load(std::memory_order_relaxed); }

absl::Status Transport::serve_in_process(const std::string& address) {
  if (!is_in_process_address(address)) {
    return absl::InvalidArgumentError(absl::StrCat("serve_in_process: '", address, "' is not an in-process address"));
  }
  auto mailbox = std::make_shared<internal::InProcessMailbox>(this, credentials_.cluster);
  {
    absl::MutexLock lock(&in_process_table_mu);
    auto [it, added] = in_process_table().emplace(address, mailbox);
    if (!added) {
      return absl::FailedPreconditionError(
          absl::StrCat("serve_in_process: another transport of this process serves ", address));
    }
  }
  absl::MutexLock lock(&mu_);
  in_process_ = std::move(mailbox);
  return absl::OkStatus();
}

void Transport::close_in_process() {
  std::shared_ptr<internal::InProcessMailbox> mine;
  std::map<int, std::weak_ptr<internal::InProcessMailbox>> sent_to;
  int self = -1;
  {
    absl::MutexLock lock(&mu_);
    mine.swap(in_process_);
    sent_to.swap(in_process_sent_to_);
    self = self_;
  }
  if (mine == nullptr) return;
  {
    absl::MutexLock lock(&in_process_table_mu);
    for (auto it = in_process_table().begin(); it != in_process_table().end(); ++it) {
      if (it->second == mine) {
        in_process_table().erase(it);
        break;
      }
    }
  }
  {
    absl::MutexLock lock(&mine->mu);  // waits for the senders filing here now
    mine->transport = nullptr;
  }
  // The peers that took messages from this one: what they wait for from it will not come.
  // Their runs parked for it resume after the peer's lock is let go (Parked::resume).
  std::vector<std::shared_ptr<Parked>> parked;
  for (auto& [device, weak] : sent_to) {
    std::shared_ptr<internal::InProcessMailbox> peer = weak.lock();
    if (peer == nullptr) continue;
    absl::ReaderMutexLock lock(&peer->mu);
    if (peer->transport == nullptr) continue;
    for (auto& p : peer->transport->in_process_source_gone(self)) parked.push_back(std::move(p));
  }
  for (auto& p : parked) p->resume(false);
}

bool Transport::in_process() const {
  absl::MutexLock lock(&mu_);
  return in_process_ != nullptr;
}

int64_t Transport::in_process_messages_received() const {
  absl::MutexLock lock(&mu_);
  return in_process_received_;
}

int64_t Transport::grpc_messages_received() const {
  absl::MutexLock lock(&mu_);
  return grpc_received_;
}

std::vector<std::shared_ptr<Transport::Parked>> Transport::in_process_source_gone(int source) {
  std::vector<std::shared_ptr<Parked>> parked;  // those waiting for `source`: their receives say so at once
  absl::MutexLock lock(&mu_);
  down_since_[source] = absl::Now();  // as when a source's last stream ends (see receive's `gone`)
  for (auto it = parked_.begin(); it != parked_.end();) {
    if (std::get<1>(it->first) != source) {  // a run waiting for another peer keeps waiting for it
      ++it;
      continue;
    }
    parked.push_back(std::move(it->second.waiter));
    it = parked_.erase(it);
  }
  return parked;
}

bool Transport::park(int source, MessageTag tag, absl::Time op_start, std::shared_ptr<Parked> waiter) {
  const Key key{tag.op, source, tag.step, tag.chunk, tag.run_tag};
  AfterUnlock after;
  absl::MutexLock lock(&mu_);
  // As receive: its messages are awaited now, and must carry its run tag.
  if (started_.emplace(tag.op, tag.run_tag).second) drop_mismatched_locked(tag.op, tag.op + 1, tag.run_tag);
  awaited_.insert(key);  // and this one goes in even over its source's share, if it waits for room
  admit_locked(absl::Now(), &after);
  awaited_.erase(awaited_.find(key));
  if (stopping_ || ready_locked(key, op_start) || parked_.count(key) > 0) return false;
  parked_[key] = ParkedRun{std::move(waiter), absl::Now()};
  if (!parked_watch_.joinable()) parked_watch_ = std::thread([this] { watch_parked(); });
  return true;
}

std::vector<std::shared_ptr<Transport::Parked>> Transport::take_parked_locked() {
  std::vector<std::shared_ptr<Parked>> out;
  for (auto& [key, run] : parked_) out.push_back(std::move(run.waiter));
  parked_.clear();
  return out;
}

void Transport::unpark_all() {
  std::vector<std::shared_ptr<Parked>> parked;
  {
    absl::MutexLock lock(&mu_);
    parked = take_parked_locked();
  }
  for (auto& p : parked) p->resume(false);
}

int64_t Transport::parked_resumed() const {
  absl::MutexLock lock(&mu_);
  return parked_resumed_;
}

// Wakes when a run parks while nothing was parked, then every kParkLimit while something is:
// not at every park (each would cost the parking thread a wake-up of this one).
void Transport::watch_parked() {
  absl::MutexLock lock(&mu_);
  auto parked_or_stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !parked_.empty(); };
  auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
  for (;;) {
    mu_.Await(absl::Condition(&parked_or_stopping));
    if (!stopping_) mu_.AwaitWithDeadline(absl::Condition(&stopping), absl::Now() + kParkLimit);
    std::vector<std::shared_ptr<Parked>> expired;
    if (stopping_) {
      expired = take_parked_locked();
    } else {
      const absl::Time before = absl::Now() - kParkLimit;
      for (auto it = parked_.begin(); it != parked_.end();) {
        if (it->second.since > before) {
          ++it;
          continue;
        }
        expired.push_back(std::move(it->second.waiter));
        it = parked_.erase(it);
      }
    }
    const bool stop = stopping_;
    mu_.Unlock();
    for (auto& p : expired) p->resume(false);
    expired.clear();  // their last references may go here, outside the lock
    mu_.Lock();
    if (stop) return;
  }
}

absl::Status Transport::send_in_process(internal::InProcessMailbox& to, int self, int peer, const std::string& address,
                                        MessageTag tag, const std::byte* data, int64_t bytes,
                                        std::shared_ptr<const void> owner, AfterUnlock* after) {
  absl::ReaderMutexLock lock(&to.mu);
  if (to.transport == nullptr) {
    return absl::UnavailableError(absl::StrCat(peer_name(peer, address), " stopped taking collective data"));
  }
  // As the gRPC reader files them: a message of an op that has not started there keeps its own
  // bytes (a copy), not the sender's buffer; one of a running op is taken as it comes.
  if (!to.transport->started(tag.op)) owner = nullptr;
  Received message;
  message.slices_.push_back(payload_slice(data, bytes, std::move(owner)));
  message.bytes_ = bytes;
  to.transport->file_message(self, tag, std::move(message), Via::kInProcess, after);
  return absl::OkStatus();
}

void Transport::force_all_reduce(std::optional<Algorithm> algorithm) {
  absl::MutexLock lock(&mu_);
  forced_all_reduce_ = algorithm;
}

std::optional<Algorithm> Transport::forced_all_reduce() const {
  absl::MutexLock lock(&mu_);
  return forced_all_reduce_;
}

void Transport::ring_offered(int source, const std::string& socket, uint64_t token, const std::string& host,
                             uint64_t reader) {
  absl::MutexLock lock(&mu_);
  if (!shm_.enabled || stopping_ || host != shm_.host) return;  // the sender keeps gRPC
  // Bounded: rings read at once, and replaced ones whose threads are not yet joined.
  if (stopped_inbound_.size() >= kMaxInboundRings) return;
  auto& slot = inbound_[source];
  if (slot == nullptr && inbound_.size() > kMaxInboundRings) {
    inbound_.erase(source);
    return;
  }
  if (slot != nullptr) {
    slot->stop();
    stopped_inbound_.push_back(std::move(slot));
  }
  slot = std::make_unique<InboundRing>(this, source, socket, shm_.socket_dir, token, shm_.before_placed_copy);
  inbound_offered_by_[source] = reader;
}

void Transport::stream_replaced(int source, uint64_t reader) {
  absl::MutexLock lock(&mu_);
  auto ring = inbound_.find(source);
  auto by = inbound_offered_by_.find(source);
  if (ring == inbound_.end() || by == inbound_offered_by_.end() || by->second != reader) return;
  ring->second->stop();
  stopped_inbound_.push_back(std::move(ring->second));
  inbound_.erase(ring);
  inbound_offered_by_.erase(by);
}

void Transport::join_stopped_rings() {
  std::vector<std::unique_ptr<InboundRing>> done;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = stopped_inbound_.begin(); it != stopped_inbound_.end();) {
      if ((*it)->exited()) {
        done.push_back(std::move(*it));
        it = stopped_inbound_.erase(it);
      } else {
        ++it;
      }
    }
  }
}

void Transport::set_self(int device_id) {
  absl::MutexLock lock(&mu_);
  self_ = device_id;
}

void Transport::begin_registration() {
  absl::MutexLock lock(&mu_);
  registering_ = true;
}

void Transport::end_registration() {
  absl::MutexLock lock(&mu_);
  registering_ = false;  // the held sends go on under declared_ (mu_'s Await)
}

int Transport::held_sends() const {
  absl::MutexLock lock(&mu_);
  return held_sends_;
}

void Transport::declare(uint64_t epoch, uint64_t incarnation) {
  absl::MutexLock lock(&mu_);
  registering_ = false;  // the sends that waited for it go on (mu_'s Await)
  if (declared_ == std::make_pair(epoch, incarnation)) return;
  declared_ = {epoch, incarnation};
  // The links open now declare the replaced registration: sends from now on take fresh ones.
  // They are not cancelled: each peer ends their streams itself once its view shows the new
  // registration, an end that does not count as this worker going away there (its runs of the
  // new registration may already wait for this worker's messages, which come on the fresh
  // links). Cancelling them here did count (session 29: the first collective after a
  // coordinator restart failed "went away during op"). Those of the registration before are
  // destroyed now (at most two links per peer are kept).
  for (auto& old : superseded_) retired_.push_back(std::move(old));
  superseded_.clear();
  for (auto& [peer, old] : links_) {
    if (old != nullptr) superseded_.push_back(std::move(old));
  }
  links_.clear();
}

absl::StatusOr<std::shared_ptr<Transport::Link>> Transport::link(int peer, const std::string& address, uint64_t op,
                                                                 absl::Time deadline,
                                                                 const std::function<bool()>& cancelled) {
  std::vector<std::shared_ptr<Link>> retired;
  std::shared_ptr<Link> current;
  {
    absl::MutexLock lock(&mu_);
    // What is retired stays in retired_ for the next call when this fails.
    if (absl::Status registered = await_registration_locked(peer, address, op, deadline, cancelled); !registered.ok()) {
      return registered;
    }
    current = current_link_locked(peer, address);
    for (auto it = superseded_.begin(); it != superseded_.end();) {
      if (!(*it)->broken()) {
        ++it;
        continue;
      }
      retired_.push_back(std::move(*it));  // its peer ended it
      it = superseded_.erase(it);
    }
    retired.swap(retired_);
  }
  join_stopped_rings();
  return current;  // the retired links end here, outside the lock, on a thread that may wait
}

std::shared_ptr<Transport::Link> Transport::current_link_locked(int peer, const std::string& address) {
  auto& slot = links_[peer];
  // A broken link, or one to an address the peer no longer has (it restarted elsewhere), is
  // replaced; the old one is retired (destroyed later, outside the lock).
  if (slot != nullptr && (slot->broken() || slot->address() != address)) retired_.push_back(std::move(slot));
  if (slot == nullptr)
    slot = std::make_shared<Link>(this, self_, peer, address, shm_.ring_bytes, shm_.host, declared_,
                                  shm_.enabled ? shm_server_ : nullptr);
  return slot;
}

void Transport::link_failed(const Link& failed, const std::vector<TaggedOp>& ops, const absl::Status& end) {
  std::shared_ptr<Link> notice;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    auto failure = std::make_shared<const LinkFailure>(LinkFailure{peer_name(failed.peer(), failed.address()), end});
    for (const TaggedOp& lost : ops) {
      const uint64_t op = lost.op;  // its sends and receives fail, whatever their tag: they are ours
      if (finished_locked(op)) continue;
      failed_ops_[op] = failure;
      if (failed_ops_.size() > kRememberedOps) failed_ops_.erase(failed_ops_.begin());  // the oldest op
    }
    // A fresh link tells the peer at once (it may be waiting for a lost message of an op that
    // has ended here); creating one never blocks. Unless the peer has moved to another
    // address since (a new process, which never ran these ops).
    auto current = links_.find(failed.peer());
    if (current != links_.end() && current->second != nullptr && current->second->address() != failed.address()) {
      return;
    }
    notice = current_link_locked(failed.peer(), failed.address());
  }
  notice->notify_lost(ops);
}

absl::Status Transport::send(int peer, const std::string& address, MessageTag tag, const std::byte* data, int64_t bytes,
                             absl::Time deadline, std::shared_ptr<const void> owner,
                             const std::function<bool()>& cancelled) {
  int self = -1;
  bool in_process = false;
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status failed = failed_op_locked(tag.op); !failed.ok()) return failed;
    self = self_;
    in_process = in_process_ != nullptr && is_in_process_address(address);
  }
  std::shared_ptr<internal::InProcessMailbox> local;
  if (in_process) {
    local = in_process_mailbox(address);
    if (local == nullptr) {
      return absl::UnavailableError(
          absl::StrCat(peer_name(peer, address), " is not serving collectives in this process (it stopped)"));
    }
    if (local->cluster_token != credentials_.cluster) local = nullptr;  // gRPC checks the token
  }
  // The send's time is taken before the write: the peer may take the message before enqueue returns.
  const int64_t sent_ns = profile_.on() ? profile_clock_ns() : 0;
  absl::Status queued;
  AfterUnlock after;  // the peer's run parked for this message resumes once send_in_process let go of the locks
  if (local != nullptr) {
    {
      absl::MutexLock lock(&mu_);
      in_process_sent_to_[peer] = local;
    }
    queued = send_in_process(*local, self, peer, address, tag, data, bytes, std::move(owner), &after);
  } else {
    absl::StatusOr<std::shared_ptr<Link>> to = link(peer, address, tag.op, deadline, cancelled);
    queued = to.ok() ? (*to)->enqueue(tag, data, bytes, deadline, std::move(owner)) : to.status();
  }
  if (queued.ok() && sent_ns != 0) {
    profile_flow(profile_, ProfileEvent::kFlowStart, message_flow_id(self, peer, tag.op, tag.step, tag.chunk),
                 "message", sent_ns);
  }
  return queued;
}

absl::Status Transport::await_registration_locked(int peer, const std::string& address, uint64_t op,
                                                  absl::Time deadline, const std::function<bool()>& cancelled) {
  auto registered = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !registering_ || stopping_; };
  if (registered()) return absl::OkStatus();
  ++held_sends_;
  struct Unhold {
    int& held;
    ~Unhold() { --held; }
  } unhold{held_sends_};
  // Wake up now and then to notice a cancelled run, as receive does.
  while (!mu_.AwaitWithDeadline(absl::Condition(&registered), std::min(deadline, absl::Now() + kCancelPoll))) {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("a message of op ", op, " to ", peer_name(peer, address), " waited for device ", self_,
                       " to register again with the coordinator (its collective messages go out only under its new "
                       "registration, which peers take) and its deadline passed first"));
    }
    if (cancelled && cancelled()) {
      return absl::CancelledError(absl::StrCat("op ", op, " was cancelled while its message to ",
                                               peer_name(peer, address), " waited for device ", self_,
                                               " to register again with the coordinator"));
    }
  }
  return absl::OkStatus();
}

absl::Status Transport::stream_failed(uint64_t op, const std::string& peer, const absl::Status& end) {
  return absl::Status(end.code(), absl::StrCat("the stream to ", peer, " failed with messages of op ", op,
                                               " in flight, which may be lost", stream_end_detail(end)));
}

absl::Status Transport::failed_op_locked(uint64_t op) const {
  auto it = failed_ops_.find(op);
  if (it == failed_ops_.end()) return absl::OkStatus();
  return stream_failed(op, it->second->peer, it->second->end);
}

absl::StatusOr<Received> Transport::receive(int source, const std::string& address, MessageTag tag, absl::Time op_start,
                                            absl::Time deadline, const std::function<bool()>& cancelled) {
  absl::StatusOr<Received> data = receive_filed(source, address, tag, op_start, deadline, cancelled);
  // Not read to its expected place (it came another way): that place expects nothing more.
  if (data.ok() && data->placed_ == nullptr) unexpect(Key{tag.op, source, tag.step, tag.chunk, tag.run_tag});
  return data;
}

absl::StatusOr<Received> Transport::receive_filed(int source, const std::string& address, MessageTag tag,
                                                  absl::Time op_start, absl::Time deadline,
                                                  const std::function<bool()>& cancelled) {
  const Key key{tag.op, source, tag.step, tag.chunk, tag.run_tag};
  AfterUnlock after;  // before the lock: runs once it is let go
  absl::MutexLock lock(&mu_);
  const OpSourceTag from{tag.op, source, tag.run_tag};
  auto arrived = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ready_locked(key, op_start); };
  // Its messages are awaited now (no longer unclaimed), and only those of its run tag: the ones
  // held with another go (a run's ops were claimed at begin_run_ops already).
  if (started_.emplace(tag.op, tag.run_tag).second) drop_mismatched_locked(tag.op, tag.op + 1, tag.run_tag);
  // The awaited message is filed even over its source's share (it is taken at once): one that
  // waits for room now goes in, and so does one that arrives during this wait.
  awaited_.insert(key);
  admit_locked(absl::Now(), &after);
  struct Unawait {
    Transport* t;
    const Key& key;
    ~Unawait() ABSL_NO_THREAD_SAFETY_ANALYSIS { t->awaited_.erase(t->awaited_.find(key)); }
  } unawait{this, key};
  // Wake up now and then to notice a cancelled call (the coordinator gave up on the op).
  while (!mu_.AwaitWithDeadline(absl::Condition(&arrived), std::min(deadline, absl::Now() + kCancelPoll))) {
    if (absl::Now() >= deadline) {
      std::string paused;  // a wait behind a paused stream of the source (concurrent runs): say so
      for (const auto& w : waiting_) {
        if (w->from != source) continue;
        paused = absl::StrCat("; its stream here is paused at its share of the mailbox (",
                              mailbox_options_.bytes_per_peer, " bytes, --mailbox_bytes_per_peer): its ",
                              held_bytes_[source], " bytes waiting here are of ops not taken yet");
        break;
      }
      return absl::DeadlineExceededError(absl::StrCat(peer_name(source, address), " sent nothing for op ", tag.op,
                                                      " step ", tag.step, " chunk ", tag.chunk, " in time", paused));
    }
    if (cancelled && cancelled()) return absl::CancelledError(absl::StrCat("op ", tag.op, " was cancelled"));
  }
  auto it = mailbox_.find(key);
  if (it == mailbox_.end()) {
    if (auto refused = refused_.map().find(from); refused != refused_.map().end()) {
      return absl::ResourceExhaustedError(absl::StrCat("a message of op ", tag.op, " from ", peer_name(source, address),
                                                       " was dropped: ", refusal_text_locked(refused->second)));
    }
    if (absl::Status failed = failed_op_locked(tag.op); !failed.ok()) return failed;
    if (lost_.map().count(from) > 0) {
      return absl::UnavailableError(absl::StrCat(peer_name(source, address), " lost messages of op ", tag.op,
                                                 " to this device: its streams here failed with them in flight"));
    }
    return absl::UnavailableError(absl::StrCat(peer_name(source, address), " went away during op ", tag.op));
  }
  Received data = std::move(it->second.data);
  take_locked(it);
  admit_locked(absl::Now(), &after);  // room for what waits
  if (profile_.on()) {
    profile_flow(profile_, ProfileEvent::kFlowEnd, message_flow_id(source, self_, tag.op, tag.step, tag.chunk),
                 "message");
  }
  return data;
}

bool Transport::ready_locked(const Key& key, absl::Time op_start) const {
  const auto [op, source, step, chunk, run_tag] = key;
  // A source counts as gone only if its stream ended while this op ran: a stream that ended
  // before may simply not have been reopened yet.
  auto down = down_since_.find(source);
  const bool gone = down != down_since_.end() && down->second >= op_start;
  const OpSourceTag from{op, source, run_tag};
  return mailbox_.count(key) > 0 || gone || lost_.map().count(from) > 0 || failed_ops_.count(op) > 0 ||
         refused_.map().count(from) > 0;
}

void Transport::finish_ops(uint64_t first, uint64_t end) {
  if (end <= first) return;
  AfterUnlock after;
  absl::MutexLock lock(&mu_);
  for (auto it = mailbox_.lower_bound(Key{first, INT_MIN, INT32_MIN, INT32_MIN, 0});
       it != mailbox_.end() && std::get<0>(it->first) < end;) {
    take_locked(it++);
  }
  failed_ops_.erase(failed_ops_.lower_bound(first), failed_ops_.lower_bound(end));
  lost_.erase_ops(first, end);
  refused_.erase_ops(first, end);
  started_.erase(started_.lower_bound(first), started_.lower_bound(end));
  if (first >= kUnorderedOps && end == first + 1) {  // named by a buffer id: remembered apart
    if (finished_unordered_.insert(first).second) finished_unordered_order_.push_back(first);
    while (finished_unordered_order_.size() > kRememberedOps) {  // the first finished go first
      finished_unordered_.erase(finished_unordered_order_.front());
      finished_unordered_order_.pop_front();
    }
    admit_locked(absl::Now(), &after);
    return;
  }
  // Kept as ranges, merged with the one before when they touch (a run's ops finish in order).
  auto next = finished_.upper_bound(first);
  if (next != finished_.begin() && std::prev(next)->second >= first) {
    std::prev(next)->second = std::max(std::prev(next)->second, end);
  } else {
    finished_[first] = end;
  }
  while (finished_.size() > kRememberedOps) finished_.erase(finished_.begin());  // the oldest ids
  admit_locked(absl::Now(), &after);  // what waited goes in, or is dropped if its op just finished
}

void Transport::begin_run_ops(uint64_t first, uint64_t end, uint64_t run_tag) {
  if (end <= first) return;
  AfterUnlock after;  // before the lock: runs once it is let go
  absl::MutexLock lock(&mu_);
  run_ops_.insert({first, end, run_tag});
  // Messages held early for these ops that carry another tag are not the run's: forged (their
  // op ids guessed) or of nobody. Checked now, as the run claims them.
  drop_mismatched_locked(first, end, run_tag);
  for (auto it = mailbox_.lower_bound(Key{first, INT_MIN, INT32_MIN, INT32_MIN, 0});
       it != mailbox_.end() && std::get<0>(it->first) < end; ++it) {
    if (!it->second.early) continue;
    it->second.early = false;
    --held_early_[std::get<1>(it->first)];
  }
  admit_locked(absl::Now(), &after);  // the room the dropped messages made: what waits for it goes in now
}

void Transport::end_run_ops(uint64_t first, uint64_t end, uint64_t run_tag) {
  if (end <= first) return;
  absl::MutexLock lock(&mu_);
  if (auto it = run_ops_.find({first, end, run_tag}); it != run_ops_.end()) run_ops_.erase(it);
}

std::optional<uint64_t> Transport::run_tag_locked(uint64_t op) const {
  // Few entries (the runs going here): every range starting at or before op.
  for (auto it = run_ops_.begin(); it != run_ops_.end() && std::get<0>(*it) <= op; ++it) {
    if (op < std::get<1>(*it)) return std::get<2>(*it);
  }
  if (auto it = started_.find(op); it != started_.end()) return it->second;
  return std::nullopt;
}

void Transport::drop_mismatched_locked(uint64_t first, uint64_t end, uint64_t run_tag) {
  for (auto it = mailbox_.lower_bound(Key{first, INT_MIN, INT32_MIN, INT32_MIN, 0});
       it != mailbox_.end() && std::get<0>(it->first) < end;) {
    if (std::get<4>(it->first) == run_tag) {
      ++it;
      continue;
    }
    count_mismatch_locked(std::get<0>(it->first), std::get<1>(it->first), std::get<4>(it->first));
    take_locked(it++);
  }
  // So do the refusals of messages of another tag (refused early, for a bound): they were not
  // the run's, and its op does not fail for them. Not counted again: their messages were
  // counted once, in dropped_, when refused (forged_ and dropped_ count messages, each in one).
  for (auto it = refused_.map().lower_bound({first, INT_MIN, 0});
       it != refused_.map().end() && std::get<0>(it->first) < end;) {
    if (std::get<2>(it->first) == run_tag) {
      ++it;
      continue;
    }
    it = refused_.erase(it);
  }
  // And notices of lost messages of another tag: the run's messages were not what was lost.
  for (auto it = lost_.map().lower_bound({first, INT_MIN, 0});
       it != lost_.map().end() && std::get<0>(it->first) < end;) {
    const auto [op, from, tag] = it->first;
    if (tag == run_tag) {
      ++it;
      continue;
    }
    count_mismatch_locked(op, from, tag);
    it = lost_.erase(it);
  }
}

void Transport::count_mismatch_locked(uint64_t op, int from, uint64_t run_tag) {
  // The tags themselves are not logged: the expected one is the run's secret.
  if (forged_++ < 10) {
    std::fprintf(stderr,
                 "tessera-worker: dropped an Exchange message of op %llu from device %d: its run tag (%s) is not its "
                 "run's here\n",
                 static_cast<unsigned long long>(op), from, run_tag == 0 ? "none" : "another");
  }
}

bool Transport::finished_locked(uint64_t op) const {
  if (op >= kUnorderedOps) return finished_unordered_.count(op) > 0;
  auto it = finished_.upper_bound(op);  // the first range starting after op
  return it != finished_.begin() && std::prev(it)->second > op;
}

void Transport::take_locked(std::map<Key, Held>::iterator it) {
  const int64_t bytes = it->second.data.size() + kHeldMessageBytes;
  held_bytes_[std::get<1>(it->first)] -= bytes;
  if (it->second.early) --held_early_[std::get<1>(it->first)];
  pending_bytes_ -= it->second.data.size();
  if (mailbox_options_.release) mailbox_options_.release(bytes);
  mailbox_.erase(it);
}

std::string Transport::refusal_text_locked(const Refusal& r) const {
  switch (r.kind) {
    case Refusal::kShare:
      return absl::StrCat("the device's messages waiting here would exceed their share of the mailbox (",
                          mailbox_options_.bytes_per_peer, " bytes, --mailbox_bytes_per_peer)");
    case Refusal::kCount:
      return absl::StrCat("the device's messages waiting here for ops not started here would exceed their number (",
                          mailbox_options_.messages_per_peer, " messages, --mailbox_messages_per_peer)");
    case Refusal::kMemory:
      return absl::StrCat("its ", r.value,
                          " bytes (data and bookkeeping) do not fit in this device's free memory (--memory_bytes)");
    case Refusal::kTtl:
      return absl::StrCat("it waited ",
                          absl::FormatDuration(absl::Trunc(absl::Nanoseconds(r.value), absl::Milliseconds(1))),
                          " for its op to start here, longer than the mailbox keeps unclaimed messages (",
                          absl::FormatDuration(mailbox_options_.unclaimed_ttl), ")");
    case Refusal::kPaused:
      return absl::StrCat("its stream here stayed paused for ",
                          absl::FormatDuration(absl::Trunc(absl::Nanoseconds(r.value), absl::Milliseconds(1))),
                          ", longer than the mailbox keeps unclaimed messages (",
                          absl::FormatDuration(mailbox_options_.unclaimed_ttl),
                          ", --mailbox_ttl_ms): the device's messages waiting here filled their share of the mailbox (",
                          mailbox_options_.bytes_per_peer,
                          " bytes, --mailbox_bytes_per_peer) and too few were taken to make room for it");
    case Refusal::kGaveUp:
      return absl::StrCat("its stream here ended after it waited ",
                          absl::FormatDuration(absl::Trunc(absl::Nanoseconds(r.value), absl::Milliseconds(1))),
                          " for room in the device's share of the mailbox (", mailbox_options_.bytes_per_peer,
                          " bytes, --mailbox_bytes_per_peer)");
  }
  return "";
}

void Transport::refuse_locked(uint64_t op, int from, uint64_t run_tag, Refusal why, std::optional<uint64_t> claimed) {
  if (dropped_++ < 10) {
    std::fprintf(stderr, "tessera-worker: dropped a message of op %lu from device %d: %s\n",
                 static_cast<unsigned long>(op), from, refusal_text_locked(why).c_str());
  }
  const OpSourceTag key{op, from, run_tag};
  // At most kRefusedTagsPerSource run tags' refusals per (op, source): made-up tags must not
  // fill the source's kRememberedPerSource with one op's refusals and push out its older ops',
  // likely the one a run waits on (which would then end at its deadline, not with RESOURCE_EXHAUSTED). Over it
  // the newest replaces the oldest but the first (Remembered::remember): a client retrying a fan-out
  // under fresh tags waits on its newest. A run's claim keeps its own tag's and erases the
  // others (drop_mismatched_locked), and after it only messages of its tag reach a bound here,
  // so a claimed op's refusal always has room.
  // A refusal remembered already keeps its first reason. Past the bounds per source and in all,
  // the source's own oldest goes, or the oldest of the source holding the most (Remembered::remember):
  // a flooding or forging source cannot push out another source's refusals, so a wait for them
  // fails at once whatever else arrives.
  why.order = remembered_++;
  remember_locked(refused_, key, why, claimed);
}

void Transport::sweep() {
  AfterUnlock after;
  absl::MutexLock lock(&mu_);
  sweep_locked(absl::Now(), &after);
}

void Transport::sweep_locked(absl::Time now, AfterUnlock* after) {
  const absl::Duration ttl = mailbox_options_.unclaimed_ttl;
  if (now - last_sweep_ < ttl / 4) return;
  last_sweep_ = now;
  for (auto it = mailbox_.begin(); it != mailbox_.end();) {
    const uint64_t op = std::get<0>(it->first);
    const int from = std::get<1>(it->first);
    // Messages of an op a run or a receive here claimed are awaited, not early (transport.h,
    // begin_run_ops): they wait for the run's receive, whatever their age.
    if (now - it->second.arrived <= ttl || run_tag_locked(op).has_value()) {
      ++it;
      continue;
    }
    refuse_locked(op, from, std::get<4>(it->first), {Refusal::kTtl, absl::ToInt64Nanoseconds(now - it->second.arrived)},
                  /*claimed=*/std::nullopt);  // (a claimed op's messages are kept, above)
    take_locked(it++);
  }
  // A message that waited for room longer than the time-to-live (its stream paused all along:
  // no message of its source was taken, or a deadlock between concurrent runs) is refused, with
  // what the mailbox holds of its op from its source under its run tag: its op fails anyway for
  // that tag, and the room goes to the source's other ops. Its reader reads on.
  for (;;) {
    admit_locked(now, after);  // what fits now goes in first (the room the sweep made)
    auto it = std::find_if(waiting_.begin(), waiting_.end(), [&](const auto& w) { return now - w->since > ttl; });
    if (it == waiting_.end()) return;
    Waiting& w = **it;
    refuse_locked(w.tag.op, w.from, w.tag.run_tag, {Refusal::kPaused, absl::ToInt64Nanoseconds(now - w.since)},
                  run_tag_locked(w.tag.op));
    for (auto held = mailbox_.lower_bound(Key{w.tag.op, w.from, INT32_MIN, INT32_MIN, 0});
         held != mailbox_.end() && std::get<0>(held->first) == w.tag.op && std::get<1>(held->first) == w.from;) {
      if (std::get<4>(held->first) == w.tag.run_tag) {
        take_locked(held++);
      } else {
        ++held;
      }
    }
    decide_locked(w, after);
    waiting_.erase(it);
  }
}

int64_t Transport::mailbox_bytes_per_peer() const {
  absl::MutexLock lock(&mu_);
  return mailbox_options_.bytes_per_peer;
}

absl::Status Transport::set_mailbox(MailboxOptions options) {
  if (options.bytes_per_peer <= 0 || options.messages_per_peer <= 0 || options.unclaimed_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mailbox: bytes_per_peer (", options.bytes_per_peer, "), messages_per_peer (", options.messages_per_peer,
        ") and unclaimed_ttl (", absl::FormatDuration(options.unclaimed_ttl), ") must be positive"));
  }
  absl::MutexLock lock(&mu_);
  mailbox_options_ = std::move(options);
  return absl::OkStatus();
}

namespace {

// Reads the raw bytes of an ExchangeMessage across slices.
class SliceReader {
 public:
  explicit SliceReader(const std::vector<grpc::Slice>& slices) : slices_(slices) {}

  bool byte(uint8_t* out) {
    while (slice_ < slices_.size() && pos_ == slices_[slice_].size()) {
      ++slice_;
      pos_ = 0;
    }
    if (slice_ == slices_.size()) return false;
    *out = slices_[slice_].begin()[pos_++];
    return true;
  }

  // At most `max_bytes` bytes (10 for a 64-bit value; a key is at most 5, as protobuf reads it).
  bool varint(uint64_t* out, int max_bytes = 10) {
    *out = 0;
    for (int shift = 0; shift < 7 * max_bytes; shift += 7) {
      uint8_t b;
      if (!byte(&b)) return false;
      *out |= uint64_t{b & 0x7Fu} << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }

  // Skips `n` bytes; false if fewer are left.
  bool skip(uint64_t n) {
    while (n > 0) {
      where();
      if (slice_ == slices_.size()) return false;
      const size_t k = static_cast<size_t>(std::min<uint64_t>(n, slices_[slice_].size() - pos_));
      pos_ += k;
      n -= k;
    }
    return true;
  }

  // Position of the next byte: (slice index, offset), normalised past empty slices' ends.
  std::pair<size_t, size_t> where() {
    while (slice_ < slices_.size() && pos_ == slices_[slice_].size()) {
      ++slice_;
      pos_ = 0;
    }
    return {slice_, pos_};
  }

  int64_t remaining() const {
    int64_t n = slice_ < slices_.size() ? static_cast<int64_t>(slices_[slice_].size() - pos_) : 0;
    for (size_t i = slice_ + 1; i < slices_.size(); ++i) n += static_cast<int64_t>(slices_[i].size());
    return n;
  }

 private:
  const std::vector<grpc::Slice>& slices_;
  size_t slice_ = 0;
  size_t pos_ = 0;
};

}  // namespace

template <typename F>
void Received::for_each_piece(F&& f) const {
  if (placed_ != nullptr) {
    if (bytes_ > 0) f(placed_, bytes_);
    return;
  }
  int64_t left = bytes_;
  size_t offset = offset_;
  for (size_t i = 0; i < slices_.size() && left > 0; ++i) {
    const int64_t n = std::min<int64_t>(left, static_cast<int64_t>(slices_[i].size() - offset));
    f(reinterpret_cast<const std::byte*>(slices_[i].begin()) + offset, n);
    left -= n;
    offset = 0;
  }
}

void Received::compact() {
  if (placed_ != nullptr) return;  // in the receiver's own buffer, no gRPC one
  grpc::Slice own(grpc_slice_malloc(static_cast<size_t>(bytes_)), grpc::Slice::STEAL_REF);
  copy_to(reinterpret_cast<std::byte*>(const_cast<uint8_t*>(own.begin())));
  slices_.clear();
  slices_.push_back(std::move(own));
  offset_ = 0;
}

void Received::copy_to(std::byte* dst) const {
  if (placed_ == dst) return;  // read there already (Transport::expect_at)
  if (placed_ != nullptr) {    // in the receiver's buffer: dst may overlap it
    if (bytes_ > 0) std::memmove(dst, placed_, static_cast<size_t>(bytes_));
    return;
  }
  for_each_piece([&dst](const std::byte* p, int64_t n) {
    std::memcpy(dst, p, static_cast<size_t>(n));
    dst += n;
  });
}

void Received::reduce(DType dtype, ReduceOp op, const std::byte* local, std::byte* out) const {
  // Slices need not split the data on element boundaries: an element cut in two is put
  // together in `carry` first.
  const int64_t esize = dtype_size(dtype);
  alignas(8) std::byte carry[8];
  int64_t consumed = 0;
  for_each_piece([&](const std::byte* p, int64_t n) {
    int64_t i = 0;
    const int64_t have = consumed % esize;
    if (have != 0) {
      const int64_t take = std::min(esize - have, n);
      std::memcpy(carry + have, p, static_cast<size_t>(take));
      i = take;
      const int64_t at = consumed - have;
      if (have + take == esize) tessera::reduce(dtype, op, out + at, local + at, carry, 1);
    }
    const int64_t whole = (n - i) / esize;
    if (whole > 0) tessera::reduce(dtype, op, out + consumed + i, local + consumed + i, p + i, whole);
    i += whole * esize;
    if (i < n) std::memcpy(carry, p + i, static_cast<size_t>(n - i));
    consumed += n;
  });
}

absl::Status Transport::deliver(grpc::ByteBuffer* buffer, int* source, int authenticated_source) {
  bool waits = false;
  return deliver_or_wait(buffer, source, authenticated_source, nullptr, nullptr, &waits);
}

absl::Status Transport::deliver_or_wait(grpc::ByteBuffer* buffer, int* source, int authenticated_source,
                                        std::function<void()> read_on, std::shared_ptr<Waiting>* slot, bool* waits,
                                        uint64_t reader_id) {
  *waits = false;
  Received data;
  if (!buffer->Dump(&data.slices_).ok()) return absl::InvalidArgumentError("Exchange: unreadable message");
  SliceReader reader(data.slices_);
  uint64_t fields[9] = {0, 0, 0, 0, 0, 0, 0, 0, 0};  // source_device, op_id, step, chunk; shm_token at 8
  uint64_t run_tag = 0;                              // field 10, fixed64
  std::string shm_segment, shm_host;                 // an offer (see ExchangeMessage.shm_segment: a socket path)
  bool has_data = false;
  std::pair<size_t, size_t> data_at;  // where the data starts: (slice, offset)
  std::vector<uint64_t> lost_ops;     // a notice (see ExchangeMessage.lost_ops)
  std::vector<uint64_t> lost_tags;    // and their run tags (ExchangeMessage.lost_op_tags, packed fixed64)
  uint64_t key = 0;
  // Fields may come in any order: our senders write the data last (encode_exchange), but
  // protobuf's own serialization puts run_tag (10) after it.
  while (reader.remaining() > 0) {
    if (!reader.varint(&key, 5) || key > UINT32_MAX) {
      return absl::InvalidArgumentError("Exchange: truncated message or a key longer than 5 bytes");
    }
    const uint64_t field = key >> 3, wire = key & 7;
    if (((field >= 1 && field <= 4) || field == 8) && wire == 0) {
      if (!reader.varint(&fields[field])) return absl::InvalidArgumentError("Exchange: truncated message");
    } else if (field == 10 && wire == 1) {
      run_tag = 0;
      for (int i = 0; i < 8; ++i) {
        uint8_t b = 0;
        if (!reader.byte(&b)) {
          return absl::InvalidArgumentError(
              absl::StrCat("Exchange: truncated run_tag (field 10): ", i, " of its 8 bytes"));
        }
        run_tag |= uint64_t{b} << (8 * i);
      }
    } else if ((field == 7 || field == 9) && wire == 2) {
      uint64_t length = 0;
      if (!reader.varint(&length) || length > static_cast<uint64_t>(reader.remaining())) {
        return absl::InvalidArgumentError("Exchange: truncated message");
      }
      if (length > kMaxOfferString) {
        return absl::InvalidArgumentError(
            absl::StrCat("Exchange: field ", field, " of ", length, " bytes exceeds the limit of ", kMaxOfferString));
      }
      std::string& out = field == 7 ? shm_segment : shm_host;
      out.clear();
      for (uint64_t i = 0; i < length; ++i) {
        uint8_t b = 0;
        reader.byte(&b);
        // Socket paths and host identities are printable ASCII (and a proto3 string must be
        // UTF-8, which protobuf's own parser checks).
        if (b < 0x20 || b > 0x7e) {
          return absl::InvalidArgumentError(
              absl::StrCat("Exchange: field ", field, " has byte ", static_cast<int>(b), ", not printable ASCII"));
        }
        out.push_back(static_cast<char>(b));
      }
    } else if (field == 6 && wire == 2) {
      uint64_t length = 0;
      if (!reader.varint(&length) || length > static_cast<uint64_t>(reader.remaining())) {
        return absl::InvalidArgumentError("Exchange: truncated message");
      }
      const int64_t end = reader.remaining() - static_cast<int64_t>(length);
      while (reader.remaining() > end) {
        uint64_t op = 0;
        if (!reader.varint(&op) || reader.remaining() < end) {
          return absl::InvalidArgumentError("Exchange: malformed lost_ops");
        }
        if (lost_ops.size() == kMaxNoticeOps) {
          return absl::InvalidArgumentError(
              absl::StrCat("Exchange: a notice names more than ", kMaxNoticeOps, " lost ops"));
        }
        lost_ops.push_back(op);
      }
    } else if (field == 11 && wire == 2) {
      uint64_t length = 0;
      if (!reader.varint(&length) || length > static_cast<uint64_t>(reader.remaining()) || length % 8 != 0) {
        return absl::InvalidArgumentError("Exchange: truncated message or malformed lost_op_tags");
      }
      if (lost_tags.size() + length / 8 > kMaxNoticeOps) {
        return absl::InvalidArgumentError(
            absl::StrCat("Exchange: a notice names more than ", kMaxNoticeOps, " lost ops' tags"));
      }
      for (uint64_t k = 0; k < length / 8; ++k) {
        uint64_t tag = 0;
        for (int i = 0; i < 8; ++i) {
          uint8_t b = 0;
          reader.byte(&b);
          tag |= uint64_t{b} << (8 * i);
        }
        lost_tags.push_back(tag);
      }
    } else if (field == 5 && wire == 2) {
      if (has_data) return absl::InvalidArgumentError("Exchange: a message with two data fields");
      uint64_t length = 0;
      if (!reader.varint(&length)) return absl::InvalidArgumentError("Exchange: truncated message");
      if (length > static_cast<uint64_t>(reader.remaining())) {
        return absl::InvalidArgumentError(
            absl::StrCat("Exchange: data of ", length, " bytes in a message with ", reader.remaining(), " left"));
      }
      if (static_cast<int64_t>(length) > kMaxChunkBytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("Exchange: a message of ", length, " bytes exceeds the limit of ", kMaxChunkBytes));
      }
      data_at = reader.where();
      data.bytes_ = static_cast<int64_t>(length);
      reader.skip(length);
      has_data = true;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("Exchange: unexpected field ", field, " of wire type ", wire));
    }
  }
  if (has_data) {  // the data's slices, from where it starts (it is bytes_ long: what follows is not read)
    data.slices_.erase(data.slices_.begin(), data.slices_.begin() + static_cast<std::ptrdiff_t>(data_at.first));
    data.offset_ = data_at.second;
  }
  const int from = static_cast<int>(static_cast<int32_t>(fields[1]));
  if (!has_data && lost_ops.empty() && shm_segment.empty()) {
    return absl::InvalidArgumentError(
        "Exchange: a message with neither data (field 5), lost ops (field 6) nor a shared-memory offer (field 7)");
  }
  if (!shm_segment.empty() && (has_data || !lost_ops.empty())) {
    return absl::InvalidArgumentError("Exchange: an offer of shared memory carries data");
  }
  if (!lost_ops.empty() && has_data) return absl::InvalidArgumentError("Exchange: a notice of lost ops carries data");
  if (lost_tags.size() != lost_ops.size()) {
    return absl::InvalidArgumentError(absl::StrCat("Exchange: a notice names ", lost_ops.size(), " lost ops and ",
                                                   lost_tags.size(),
                                                   " run tags (lost_op_tags); each op needs its tag"));
  }
  if (from < 0) {
    return absl::InvalidArgumentError(absl::StrCat("Exchange: source device ", from, " is not a device id"));
  }
  if (authenticated_source >= 0 && from != authenticated_source) {
    // Forged or misrouted: its stream's credential is another device's. A shared-memory offer
    // too: a ring is read as the messages of the device whose stream offered it.
    absl::MutexLock lock(&mu_);
    if (forged_++ < 10) {
      std::fprintf(stderr, "tessera-worker: dropped an Exchange message claiming device %d on a stream of device %d\n",
                   from, authenticated_source);
    }
    return absl::OkStatus();
  }
  if (*source < 0) {
    *source = from;
    stream_started(from);
  } else if (from != *source) {
    return absl::InvalidArgumentError(
        absl::StrCat("Exchange: a stream from device ", *source, " carried a message from device ", from));
  }
  if (!shm_segment.empty()) {
    // `from` is the stream's authenticated device (when it has one): the ring's messages are
    // filed as that device's.
    ring_offered(from, shm_segment, fields[8], shm_host, reader_id);
    return absl::OkStatus();
  }
  if (!lost_ops.empty()) {
    absl::MutexLock lock(&mu_);
    // The sender's earlier streams here failed: waits for these ops' messages from it fail at
    // once (what arrived before stays in the mailbox and is still delivered). Only waits of the
    // tag it names: an op a run here claimed with another tag is not the one whose messages
    // were lost (a forger knows op ids, not tags), and the notice for it is dropped and counted.
    for (size_t i = 0; i < lost_ops.size(); ++i) {
      const uint64_t op = lost_ops[i], run_tag = lost_tags[i];
      if (finished_locked(op)) continue;
      const std::optional<uint64_t> expected = run_tag_locked(op);
      if (expected.has_value() && *expected != run_tag) {
        count_mismatch_locked(op, from, run_tag);
        continue;
      }
      // As refusals: at most kRefusedTagsPerSource tags per (op, source), so that made-up tags
      // for one op (up to 256 a notice) cannot push out another op's real loss; past it the
      // newest replaces an older one. And as refusals, bounded per source and in all
      // (Remembered::remember): a notice's source pushes out only its own losses, or those of a
      // source holding more.
      remember_locked(lost_, OpSourceTag{op, from, run_tag}, remembered_++, expected);
    }
    return absl::OkStatus();
  }
  // A message of an op not started here may wait for it up to the time-to-live: it keeps its
  // own bytes, not the socket reads it came in (bench_programs' flood held 5,000 messages of
  // 1 KiB, every other one of a flood stream, in 11 MB). The messages of a running op are
  // taken as they come and are not copied; neither are those of a finished op, dropped.
  const MessageTag tag{fields[2], static_cast<int32_t>(fields[3]), static_cast<int32_t>(fields[4]), run_tag};
  if (!started(tag.op)) data.compact();
  // A parked run it resumes is kept off this gRPC thread by its own rules (Parked::resume).
  *waits = file_or_wait(from, tag, std::move(data), Via::kGrpc, std::move(read_on), slot);
  return absl::OkStatus();
}

bool Transport::started(uint64_t op) const {
  absl::MutexLock lock(&mu_);
  return started_.count(op) > 0 || finished_locked(op);
}

Transport::AfterUnlock::~AfterUnlock() {
  for (auto& p : parked) p->resume(true);
  for (auto& f : read_on) f();
}

void Transport::file_message(int from, MessageTag tag, Received data, Via via, AfterUnlock* after) {
  absl::MutexLock lock(&mu_);
  if (via == Via::kShm) ++shm_received_;
  if (via == Via::kInProcess) ++in_process_received_;
  if (via == Via::kGrpc) ++grpc_received_;
  const absl::Time now = absl::Now();
  sweep_locked(now, after);
  file_locked(from, tag, data, now, /*may_wait=*/false, after);
  admit_locked(now, after);  // a repeat it replaced made room
}

bool Transport::file_or_wait(int from, MessageTag tag, Received data, Via via, std::function<void()> read_on,
                             std::shared_ptr<Waiting>* slot) {
  AfterUnlock after;  // before the lock: runs once it is let go
  absl::MutexLock lock(&mu_);
  if (via == Via::kShm) ++shm_received_;
  if (via == Via::kInProcess) ++in_process_received_;
  if (via == Via::kGrpc) ++grpc_received_;
  const absl::Time now = absl::Now();
  sweep_locked(now, &after);
  const bool filed = file_locked(from, tag, data, now, slot != nullptr && !stopping_, &after);
  admit_locked(now, &after);
  if (filed) return false;
  auto w = std::make_shared<Waiting>();
  w->from = from;
  w->tag = tag;
  w->data = std::move(data);
  w->since = now;
  w->read_on = std::move(read_on);
  w->slot = slot;
  *slot = w;
  waiting_.push_back(std::move(w));
  ++paused_;
  return true;
}

bool Transport::file_locked(int from, MessageTag tag, Received& data, absl::Time now, bool may_wait,
                            AfterUnlock* after) {
  if (finished_locked(tag.op)) {  // late: nobody will ask for it
    ++dropped_;
    return true;
  }
  // A message of an op that a run (or a receive) here claimed must carry its run tag; one that
  // does not is dropped and counted, never filed, and resumes no parked run: its op's messages
  // are the run's peers' alone. (One of an op not claimed yet is held with its tag, and judged
  // when the run claims it: begin_run_ops, receive.)
  const std::optional<uint64_t> expected = run_tag_locked(tag.op);
  if (expected.has_value() && *expected != tag.run_tag) {
    count_mismatch_locked(tag.op, from, tag.run_tag);
    return true;
  }
  const Key key{tag.op, from, tag.step, tag.chunk, tag.run_tag};
  // The run parked for this message resumes whether it is kept or refused (its receive then
  // says why): a refusal is what its wait would have woken for too. Not while it waits.
  auto decided = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (auto p = parked_.find(key); p != parked_.end()) {
      after->parked.push_back(std::move(p->second.waiter));
      parked_.erase(p);
      ++parked_resumed_;
    }
    return true;
  };
  // The op fails anyway for this run tag: keep nothing of it (another tag's refusal is not its).
  if (refused_.map().count({tag.op, from, tag.run_tag}) > 0) return decided();
  if (auto old = mailbox_.find(key); old != mailbox_.end()) take_locked(old);  // a repeat replaces it
  const int64_t bytes = data.size() + kHeldMessageBytes;
  int64_t& held = held_bytes_[from];
  if (held + bytes > mailbox_options_.bytes_per_peer && awaited_.count(key) == 0 && parked_.count(key) == 0) {
    // Flow control: it waits for the source's messages here to be taken, and its reader reads
    // no further. One that could never fit is refused.
    if (may_wait && bytes <= mailbox_options_.bytes_per_peer) return false;
    refuse_locked(tag.op, from, tag.run_tag, {Refusal::kShare}, expected);
    return decided();
  }
  // Early: it may wait for its op up to the time-to-live. A legitimate peer has at most a few
  // hundred such messages here (docs/design.md, "The flood's peak"); a flood of small ones is
  // bounded by their number, not only by their bytes.
  const bool early = !expected.has_value();
  int64_t& early_held = held_early_[from];
  if (early && early_held >= mailbox_options_.messages_per_peer) {
    refuse_locked(tag.op, from, tag.run_tag, {Refusal::kCount}, expected);
    return decided();
  }
  if (mailbox_options_.reserve && !mailbox_options_.reserve(bytes)) {
    refuse_locked(tag.op, from, tag.run_tag, {Refusal::kMemory, bytes}, expected);
    return decided();
  }
  held += bytes;
  if (early) ++early_held;
  pending_bytes_ += data.size();
  mailbox_.emplace(key, Held{std::move(data), now, early});
  return decided();
}

void Transport::admit_locked(absl::Time now, AfterUnlock* after) {
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    Waiting& w = **it;
    if (!file_locked(w.from, w.tag, w.data, now, /*may_wait=*/true, after)) {
      ++it;
      continue;
    }
    decide_locked(w, after);
    it = waiting_.erase(it);
  }
}

void Transport::decide_locked(Waiting& w, AfterUnlock* after) {
  if (w.read_on) after->read_on.push_back(std::move(w.read_on));
  if (w.slot != nullptr) *w.slot = nullptr;  // may drop a reference to w: the caller holds another
  w.slot = nullptr;
}

bool Transport::give_up_waiting(std::shared_ptr<Waiting>* slot) {
  absl::MutexLock lock(&mu_);
  if (*slot == nullptr) return false;
  std::shared_ptr<Waiting> w = std::move(*slot);
  *slot = nullptr;
  w->slot = nullptr;
  refuse_locked(w->tag.op, w->from, w->tag.run_tag,
                {Refusal::kGaveUp, absl::ToInt64Nanoseconds(absl::Now() - w->since)}, run_tag_locked(w->tag.op));
  waiting_.erase(std::find(waiting_.begin(), waiting_.end(), w));
  return true;
}

bool Transport::await_room(std::shared_ptr<Waiting>* slot, absl::Time deadline) {
  {
    absl::MutexLock lock(&mu_);
    auto decided = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return *slot == nullptr || stopping_; };
    mu_.AwaitWithDeadline(absl::Condition(&decided), deadline);
    if (*slot == nullptr) return true;
    if (!stopping_) return false;
  }
  give_up_waiting(slot);
  return true;
}

int64_t Transport::paused_messages() const {
  absl::MutexLock lock(&mu_);
  return paused_;
}

int64_t Transport::waiting_messages() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(waiting_.size());
}

// Reads one peer's stream. Never blocks in a reaction: filing a message takes the
// transport's lock briefly.
//
// With a PeerView the stream is read only once admitted, and ends when a view says the
// registration it declares was replaced. Those decisions come on other threads (the
// heartbeat's, or whoever admits), so every start of a read and every Finish is made under
// the stream's Gate, which outlives the reactor: a Gate that is not `finished` means the
// reactor is alive (gRPC deletes it in OnDone, which follows Finish). StartRead and Finish
// may be called under it: gRPC runs neither OnReadDone nor OnDone inline from them. A
// message is filed under the Gate too, so once the view's decision is made (under it), no
// message of the stream is filed after it. Lock order: a Gate's mu, then the transport's mu_
// (and, from a filing's AfterUnlock, the Gate of the stream whose waiting message was filed:
// such a stream is never itself filing, so two Gates never wait on each other).
class Transport::ExchangeReader final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  ExchangeReader(Transport* transport, grpc::ByteBuffer* response, int authenticated_source, PeerView* peers,
                 const StreamClaim& claim)
      : transport_(transport),
        authenticated_source_(authenticated_source),
        peers_(peers),
        reader_(transport->next_reader_.fetch_add(1)) {
    // The reply is an empty ExchangeReply: zero bytes, but a message all the same.
    grpc::Slice empty;
    *response = grpc::ByteBuffer(&empty, 1);
    if (peers_ == nullptr) {
      absl::MutexLock lock(&gate_->mu);
      gate_->decided = true;
      start_read_locked();
      return;
    }
    // Nothing is read until the stream is admitted. The decision may come after OnCancel
    // finished the stream, and `replaced` before decided(OK) (a view applied meanwhile): the
    // Gate orders them.
    id_ = peers_->admit(
        claim, [this, gate = gate_](absl::Status decided) { admitted(*gate, std::move(decided)); },
        [this, gate = gate_](absl::Status why) { replaced(*gate, std::move(why)); });
  }

  void OnReadDone(bool ok) override {
    absl::MutexLock lock(&gate_->mu);
    gate_->read_issued = false;
    if (gate_->finished) {
      // Ended by a view while this read was pending: what it read is dropped unread.
      if (source_ >= 0) transport_->stream_ended(source_, /*replaced=*/true);
      return;
    }
    if (!ok) {
      // We never close a stream cleanly: it ends because the peer went away or is closing.
      finish_locked(grpc::Status::OK);
      return;
    }
    // The message leaves buffer_ first: once it waits, another thread may start the next read.
    grpc::ByteBuffer message;
    message.Swap(&buffer_);
    bool waits = false;
    absl::Status status = transport_->deliver_or_wait(
        &message, &source_, authenticated_source_, [this, gate = gate_] { read_on(*gate); }, &waiting_, &waits,
        reader_);
    if (!status.ok()) {
      finish_locked(to_grpc(status));
      return;
    }
    // Over its source's share the message waits and this stream is read no further (gRPC's
    // flow control holds the sender back); the thread that files or refuses it starts the next
    // read (read_on). Never a wait on this thread.
    if (!waits) {
      start_read_locked();
      return;
    }
    // OnCancel may have run before the message waited, finding nothing waiting: give it up here.
    if (cancelled_.load() && transport_->give_up_waiting(&waiting_)) finish_locked(grpc::Status::CANCELLED);
  }

  // The call ended. A read pending fails (OnReadDone finishes); a message waiting is given up
  // here; a stream not yet admitted is finished here.
  void OnCancel() override {
    cancelled_.store(true);
    absl::MutexLock lock(&gate_->mu);
    if (gate_->finished) return;
    if (!gate_->decided) {
      gate_->decided = true;
      gate_->finished = true;
      Finish(grpc::Status::CANCELLED);  // never read: nothing else finishes it
      return;
    }
    if (transport_->give_up_waiting(&waiting_)) finish_locked(grpc::Status::CANCELLED);
  }

  void OnDone() override {
    if (peers_ != nullptr) peers_->ended(id_);  // no longer waiting, nor checked by views
    delete this;
  }

 private:
  struct Gate {
    absl::Mutex mu;
    bool decided ABSL_GUARDED_BY(mu) = false;      // admitted or refused, or finished by OnCancel first
    bool finished ABSL_GUARDED_BY(mu) = false;     // Finish called: the reactor may be gone
    bool read_issued ABSL_GUARDED_BY(mu) = false;  // a read is pending (its OnReadDone will come)
    absl::Status replaced ABSL_GUARDED_BY(mu);     // the view's verdict: end with it
  };

  void start_read_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(gate_->mu) {
    gate_->read_issued = true;
    StartRead(&buffer_);
  }

  // Ends the stream with `status` (a read may be pending: its OnReadDone then sees `finished`).
  void finish_locked(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(gate_->mu) {
    gate_->finished = true;
    if (source_ >= 0 && !gate_->read_issued) transport_->stream_ended(source_, !gate_->replaced.ok());
    Finish(status);
  }

  // PeerView's decision (on the thread that admits it).
  void admitted(Gate& gate, absl::Status decided) {
    absl::MutexLock lock(&gate.mu);
    if (gate.decided) return;  // cancelled first: this reactor may be gone
    gate.decided = true;
    if (!gate.replaced.ok()) decided = gate.replaced;  // a view replaced it before this came
    if (decided.ok()) {
      start_read_locked();
    } else {
      finish_locked(to_grpc(decided));
    }
  }

  // A view says the stream's registration was replaced (on the heartbeat thread).
  void replaced(Gate& gate, absl::Status why) {
    absl::MutexLock lock(&gate.mu);
    if (gate.finished) return;  // this reactor may be gone
    gate.replaced = std::move(why);
    std::fprintf(stderr, "tessera-worker: %s\n", std::string(gate.replaced.message()).c_str());
    if (!gate.decided) return;  // admitted() ends it
    if (source_ >= 0) transport_->stream_replaced(source_, reader_);
    if (gate.read_issued) {
      finish_locked(to_grpc(gate.replaced));  // the pending read fails, or what it read is dropped
    } else if (transport_->give_up_waiting(&waiting_)) {
      finish_locked(to_grpc(gate.replaced));  // its waiting message is refused unfiled
    }
    // Otherwise its waiting message was just decided, and read_on comes: it ends the stream.
  }

  // The message that waited for room was filed or refused: read on, unless a view ended it.
  void read_on(Gate& gate) {
    absl::MutexLock lock(&gate.mu);
    if (gate.finished) return;
    if (!gate.replaced.ok()) {
      finish_locked(to_grpc(gate.replaced));
    } else {
      start_read_locked();
    }
  }

  Transport* const transport_;
  const int authenticated_source_;
  PeerView* const peers_;
  // This reader's id, for the ring it offers (stream_replaced), assigned by the transport.
  const uint64_t reader_;
  // PeerView's, for ended(). Written in the constructor after admit() returns, which may
  // already have started a read or finished the stream: gRPC keeps such calls in its backlog
  // until it binds this reactor, after the handler returned it (so new_exchange_reader's
  // result must be returned straight from the handler), and no reaction runs before that.
  uint64_t id_ = 0;
  const std::shared_ptr<Gate> gate_ = std::make_shared<Gate>();
  grpc::ByteBuffer buffer_;
  int source_ = -1;                   // under gate_->mu once the stream is read
  std::shared_ptr<Waiting> waiting_;  // the message waiting for room (see file_or_wait); under transport_->mu_
  std::atomic<bool> cancelled_{false};
};

grpc::ServerReadReactor<grpc::ByteBuffer>* Transport::new_exchange_reader(grpc::ByteBuffer* response,
                                                                          int authenticated_source, PeerView* peers,
                                                                          const StreamClaim& claim) {
  return new ExchangeReader(this, response, authenticated_source, peers, claim);
}

int64_t Transport::forged_messages() const {
  absl::MutexLock lock(&mu_);
  return forged_;
}

void Transport::stream_started(int source) {
  absl::MutexLock lock(&mu_);
  ++live_streams_[source];
  down_since_.erase(source);
}

void Transport::stream_ended(int source, bool replaced) {
  absl::MutexLock lock(&mu_);
  // A source is down only once all its streams have ended: a peer's streams end together
  // when it dies, but an old stream's late end must not condemn its fresh ones.
  if (--live_streams_[source] <= 0) {
    live_streams_.erase(source);
    if (replaced) return;  // see stream_replaced: its ring, if any, stopped then
    down_since_[source] = absl::Now();
    // Its ring here goes too (its writer is gone or will offer a new one).
    if (auto ring = inbound_.find(source); ring != inbound_.end()) {
      ring->second->stop();
      stopped_inbound_.push_back(std::move(ring->second));
      inbound_.erase(ring);
      inbound_offered_by_.erase(source);
    }
  }
}

int64_t Transport::pending_messages() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(mailbox_.size());
}

int64_t Transport::pending_bytes() const {
  absl::MutexLock lock(&mu_);
  return pending_bytes_;
}

int64_t Transport::dropped_messages() const {
  absl::MutexLock lock(&mu_);
  return dropped_;
}

}  // namespace tessera
