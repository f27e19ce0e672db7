#include "worker/collectives/transport.h"

#include <climits>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/client_callback.h"
#include "grpcpp/support/slice.h"
#include "proto/auth.h"
#include "proto/rpc.h"
#include "proto/tessera.grpc.pb.h"
#include "worker/collectives/reduce.h"

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

grpc::ByteBuffer encode_exchange(int self, MessageTag tag, const std::byte* data, int64_t bytes,
                                 std::shared_ptr<const void> owner) {
  pb::ExchangeMessage header;
  header.set_source_device(self);
  header.set_op_id(tag.op);
  header.set_step(tag.step);
  header.set_chunk(tag.chunk);
  std::string prefix = header.SerializeAsString();
  prefix.push_back(static_cast<char>((5 << 3) | 2));  // field 5, length-delimited
  for (uint64_t n = static_cast<uint64_t>(bytes);; n >>= 7) {
    if (n < 0x80) {
      prefix.push_back(static_cast<char>(n));
      break;
    }
    prefix.push_back(static_cast<char>((n & 0x7F) | 0x80));
  }
  grpc::Slice payload = owner != nullptr && bytes >= Transport::kZeroCopyMinBytes
                            ? grpc::Slice(const_cast<std::byte*>(data), static_cast<size_t>(bytes), &release_owner,
                                          new std::shared_ptr<const void>(std::move(owner)))
                            : grpc::Slice(data, static_cast<size_t>(bytes));
  grpc::Slice slices[2] = {grpc::Slice(prefix), std::move(payload)};
  return grpc::ByteBuffer(slices, 2);
}

// A notice (ExchangeMessage.lost_ops, no data): the sender's earlier streams to the receiver
// failed with messages of `ops` in flight.
grpc::ByteBuffer encode_notice(int self, const std::vector<uint64_t>& ops) {
  pb::ExchangeMessage notice;
  notice.set_source_device(self);
  for (uint64_t op : ops) notice.add_lost_ops(op);
  grpc::Slice slice(notice.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

// How many ops a notice may name, and how many recent ops a link remembers for one.
constexpr size_t kMaxNoticeOps = 256;

std::string peer_name(int device, const std::string& address) {
  return address.empty() ? absl::StrCat("device ", device) : absl::StrCat("device ", device, " (", address, ")");
}

}  // namespace

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

  Link(Transport* transport, int self, int peer, std::string address)
      : transport_(transport),
        self_(self),
        peer_(peer),
        address_(std::move(address)),
        channel_(make_channel(address_, daemon_identity(transport->credentials_, self))) {
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
  }

  absl::Status enqueue(MessageTag tag, const std::byte* data, int64_t bytes, absl::Time deadline,
                       std::shared_ptr<const void> owner) {
    return push(Outgoing{encode_exchange(self_, tag, data, bytes, std::move(owner)), bytes}, tag.op, deadline);
  }

  // Sends a notice that messages of `ops` sent on earlier links may be lost. Never waits.
  void notify_lost(const std::vector<uint64_t>& ops) {
    push(Outgoing{encode_notice(self_, ops), 0}, 0, absl::InfiniteFuture()).IgnoreError();
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

  // Queues `message` (of op `op`; 0 for a notice), or starts its write on an idle stream.
  absl::Status push(Outgoing message, uint64_t op, absl::Time deadline) {
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
      if (op != 0 && (recent_ops_.empty() || recent_ops_.back() != op)) {
        recent_ops_.push_back(op);
        if (recent_ops_.size() > kMaxNoticeOps) recent_ops_.pop_front();
      }
      for (auto& s : streams_) {
        if (!s->writing) {
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
      ctx_.set_initial_metadata_corked(true);
      grpc::internal::ClientCallbackWriterFactory<grpc::ByteBuffer>::Create(link->channel_.get(), exchange_method(),
                                                                            &ctx_, &reply_, this);
      AddHold();  // released by cancel(): OnDone cannot run before the Link is being destroyed
      StartCall();
    }

    void cancel() {
      ctx_.TryCancel();
      RemoveHold();
    }

    void start_write() { StartWrite(&current.buffer); }

    void OnWriteDone(bool ok) override {
      std::vector<uint64_t> lost;
      {
        absl::MutexLock lock(&link_->mu_);
        link_->queued_bytes_ -= current.bytes;
        current = {};
        if (!ok) lost = link_->fail_locked();
      }
      // The Link lives until this stream's OnDone, which gRPC runs after this returns.
      if (!ok) {
        if (!lost.empty()) link_->transport_->link_failed(*link_, lost);
        return;
      }
      {
        absl::MutexLock lock(&link_->mu_);
        if (link_->queue_.empty()) {
          writing = false;
          return;
        }
        current = std::move(link_->queue_.front());
        link_->queue_.pop_front();
      }
      start_write();
    }

    // The server never sends initial metadata before it ends the stream (its only message is
    // the final reply), so this runs when the call ends: the server finished it, or the
    // connection broke. OnDone would come only once the Link goes (it holds the stream), and
    // OnWriteDone only with the next write: this is how an idle stream's failure is known.
    void OnReadInitialMetadataDone(bool) override {
      std::vector<uint64_t> lost;
      {
        absl::MutexLock lock(&link_->mu_);
        lost = link_->fail_locked();
      }
      if (!lost.empty()) link_->transport_->link_failed(*link_, lost);
    }

    void OnDone(const grpc::Status&) override {
      std::vector<uint64_t> lost;
      {
        absl::MutexLock lock(&link_->mu_);
        lost = link_->fail_locked();
      }
      if (!lost.empty()) link_->transport_->link_failed(*link_, lost);
      absl::MutexLock lock(&link_->mu_);
      ++link_->done_streams_;  // last: once every stream is done, the Link may go
    }

    // Guarded by link_->mu_ (written under it; `current` is then used only by the one
    // thread that starts or finishes this stream's write).
    bool writing = false;
    Outgoing current;

   private:
    Link* const link_;
    grpc::ClientContext ctx_;
    grpc::ByteBuffer reply_;
  };

  // Marks the link broken and drops what is queued. The first time, unless the link is being
  // retired, returns the ops it carried recently (their messages may be lost), to report.
  std::vector<uint64_t> fail_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<uint64_t> lost;
    if (!broken_) {
      broken_ = true;
      error_ = absl::UnavailableError(absl::StrCat(peer_name(peer_, address_), " stopped taking collective data"));
      if (!retiring_) lost.assign(recent_ops_.begin(), recent_ops_.end());
    }
    queue_.clear();
    queued_bytes_ = 0;
    return lost;
  }

  // Constant after construction.
  Transport* const transport_;
  const int self_;
  const int peer_;
  const std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::vector<std::unique_ptr<Stream>> streams_;

  mutable absl::Mutex mu_;
  std::deque<Outgoing> queue_ ABSL_GUARDED_BY(mu_);
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // queued and in flight
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool retiring_ ABSL_GUARDED_BY(mu_) = false;
  // The ops of the latest messages, each once (at most kMaxNoticeOps).
  std::deque<uint64_t> recent_ops_ ABSL_GUARDED_BY(mu_);
  int done_streams_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

Transport::Transport(Credentials credentials) : credentials_(std::move(credentials)) {}

Transport::~Transport() {
  std::map<int, std::shared_ptr<Link>> links;
  std::vector<std::shared_ptr<Link>> retired;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    links.swap(links_);
    retired.swap(retired_);
  }
  links.clear();  // ends the streams outside the lock
  retired.clear();
}

void Transport::set_self(int device_id) {
  absl::MutexLock lock(&mu_);
  self_ = device_id;
}

std::shared_ptr<Transport::Link> Transport::link(int peer, const std::string& address) {
  std::vector<std::shared_ptr<Link>> retired;
  std::shared_ptr<Link> current;
  {
    absl::MutexLock lock(&mu_);
    current = current_link_locked(peer, address);
    retired.swap(retired_);
  }
  return current;  // the retired links end here, outside the lock, on a thread that may wait
}

std::shared_ptr<Transport::Link> Transport::current_link_locked(int peer, const std::string& address) {
  auto& slot = links_[peer];
  // A broken link, or one to an address the peer no longer has (it restarted elsewhere), is
  // replaced; the old one is retired (destroyed later, outside the lock).
  if (slot != nullptr && (slot->broken() || slot->address() != address)) retired_.push_back(std::move(slot));
  if (slot == nullptr) slot = std::make_shared<Link>(this, self_, peer, address);
  return slot;
}

void Transport::link_failed(const Link& failed, const std::vector<uint64_t>& ops) {
  std::shared_ptr<Link> notice;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    for (uint64_t op : ops) {
      if (finished_.count(op) > 0) continue;
      failed_ops_[op] = peer_name(failed.peer(), failed.address());
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
                             absl::Time deadline, std::shared_ptr<const void> owner) {
  {
    absl::MutexLock lock(&mu_);
    if (auto it = failed_ops_.find(tag.op); it != failed_ops_.end()) return stream_failed(tag.op, it->second);
  }
  return link(peer, address)->enqueue(tag, data, bytes, deadline, std::move(owner));
}

absl::Status Transport::stream_failed(uint64_t op, const std::string& peer) {
  return absl::UnavailableError(absl::StrCat("the stream to ", peer, " failed with messages of op ", op,
                                             " in flight, which may be lost"));
}

absl::StatusOr<Received> Transport::receive(int source, const std::string& address, MessageTag tag,
                                            absl::Time op_start, absl::Time deadline,
                                            const std::function<bool()>& cancelled) {
  const Key key{tag.op, source, tag.step, tag.chunk};
  absl::MutexLock lock(&mu_);
  // A source counts as gone only if its stream ended while this op ran: a stream that ended
  // before may simply not have been reopened yet.
  auto gone = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = down_since_.find(source);
    return it != down_since_.end() && it->second >= op_start;
  };
  const std::pair<uint64_t, int> from{tag.op, source};
  auto arrived = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return mailbox_.count(key) > 0 || gone() || lost_.count(from) > 0 || failed_ops_.count(tag.op) > 0;
  };
  // Wake up now and then to notice a cancelled call (the coordinator gave up on the op).
  while (!mu_.AwaitWithDeadline(absl::Condition(&arrived), std::min(deadline, absl::Now() + kCancelPoll))) {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(peer_name(source, address), " sent nothing for op ", tag.op,
                                                      " step ", tag.step, " chunk ", tag.chunk, " in time"));
    }
    if (cancelled && cancelled()) return absl::CancelledError(absl::StrCat("op ", tag.op, " was cancelled"));
  }
  auto it = mailbox_.find(key);
  if (it == mailbox_.end()) {
    if (auto failed = failed_ops_.find(tag.op); failed != failed_ops_.end()) {
      return stream_failed(tag.op, failed->second);
    }
    if (lost_.count(from) > 0) {
      return absl::UnavailableError(absl::StrCat(peer_name(source, address), " lost messages of op ", tag.op,
                                                 " to this device: its streams here failed with them in flight"));
    }
    return absl::UnavailableError(absl::StrCat(peer_name(source, address), " went away during op ", tag.op));
  }
  Received data = std::move(it->second);
  mailbox_.erase(it);
  return data;
}

void Transport::finish_op(uint64_t op) {
  absl::MutexLock lock(&mu_);
  mailbox_.erase(mailbox_.lower_bound(Key{op, INT32_MIN, INT32_MIN, INT32_MIN}),
                 mailbox_.upper_bound(Key{op, INT32_MAX, INT32_MAX, INT32_MAX}));
  failed_ops_.erase(op);
  lost_.erase(lost_.lower_bound({op, INT_MIN}), lost_.upper_bound({op, INT_MAX}));
  if (finished_.insert(op).second) finished_order_.push_back(op);
  while (finished_order_.size() > kRememberedOps) {
    finished_.erase(finished_order_.front());
    finished_order_.pop_front();
  }
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

  bool varint(uint64_t* out) {
    *out = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!byte(&b)) return false;
      *out |= uint64_t{b & 0x7Fu} << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
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
  int64_t left = bytes_;
  size_t offset = offset_;
  for (size_t i = 0; i < slices_.size() && left > 0; ++i) {
    const int64_t n = std::min<int64_t>(left, static_cast<int64_t>(slices_[i].size() - offset));
    f(reinterpret_cast<const std::byte*>(slices_[i].begin()) + offset, n);
    left -= n;
    offset = 0;
  }
}

void Received::copy_to(std::byte* dst) const {
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
  Received data;
  if (!buffer->Dump(&data.slices_).ok()) return absl::InvalidArgumentError("Exchange: unreadable message");
  SliceReader reader(data.slices_);
  uint64_t fields[5] = {0, 0, 0, 0, 0};  // source_device, op_id, step, chunk
  bool has_data = false;
  std::vector<uint64_t> lost_ops;  // a notice (see ExchangeMessage.lost_ops)
  uint64_t key = 0;
  while (!has_data && reader.varint(&key)) {
    const uint64_t field = key >> 3, wire = key & 7;
    if (field >= 1 && field <= 4 && wire == 0) {
      if (!reader.varint(&fields[field])) return absl::InvalidArgumentError("Exchange: truncated message");
    } else if (field == 6 && wire == 2) {
      uint64_t length = 0;
      if (!reader.varint(&length) || static_cast<int64_t>(length) > reader.remaining()) {
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
    } else if (field == 5 && wire == 2) {
      uint64_t length = 0;
      if (!reader.varint(&length)) return absl::InvalidArgumentError("Exchange: truncated message");
      const auto [slice, offset] = reader.where();
      if (static_cast<int64_t>(length) != reader.remaining()) {
        return absl::InvalidArgumentError(
            absl::StrCat("Exchange: data of ", length, " bytes in a message with ", reader.remaining(), " left"));
      }
      if (static_cast<int64_t>(length) > kMaxChunkBytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("Exchange: a message of ", length, " bytes exceeds the limit of ", kMaxChunkBytes));
      }
      data.slices_.erase(data.slices_.begin(), data.slices_.begin() + static_cast<std::ptrdiff_t>(slice));
      data.offset_ = offset;
      data.bytes_ = static_cast<int64_t>(length);
      has_data = true;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("Exchange: unexpected field ", field, " of wire type ", wire));
    }
  }
  const int from = static_cast<int>(static_cast<int32_t>(fields[1]));
  if (authenticated_source >= 0 && from != authenticated_source) {
    // Forged or misrouted: its stream's credential is another device's.
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
  absl::MutexLock lock(&mu_);
  if (!lost_ops.empty()) {
    if (has_data) return absl::InvalidArgumentError("Exchange: a notice of lost ops carries data");
    // The sender's earlier streams here failed: waits for these ops' messages from it fail at
    // once (what arrived before stays in the mailbox and is still delivered).
    for (uint64_t op : lost_ops) {
      if (finished_.count(op) > 0) continue;
      lost_.insert({op, from});
      if (lost_.size() > kRememberedOps) lost_.erase(lost_.begin());  // the oldest op
    }
    return absl::OkStatus();
  }
  if (finished_.count(fields[2]) > 0) return absl::OkStatus();
  mailbox_[Key{fields[2], from, static_cast<int32_t>(fields[3]), static_cast<int32_t>(fields[4])}] = std::move(data);
  return absl::OkStatus();
}

// Reads one peer's stream. Never blocks in a reaction: filing a message takes the
// transport's lock briefly.
class Transport::ExchangeReader final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  ExchangeReader(Transport* transport, grpc::ByteBuffer* response, int authenticated_source)
      : transport_(transport), authenticated_source_(authenticated_source) {
    // The reply is an empty ExchangeReply: zero bytes, but a message all the same.
    grpc::Slice empty;
    *response = grpc::ByteBuffer(&empty, 1);
    StartRead(&buffer_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // We never close a stream cleanly: it ends because the peer went away or is closing.
      if (source_ >= 0) transport_->stream_ended(source_);
      Finish(grpc::Status::OK);
      return;
    }
    absl::Status status = transport_->deliver(&buffer_, &source_, authenticated_source_);
    buffer_.Clear();
    if (!status.ok()) {
      if (source_ >= 0) transport_->stream_ended(source_);
      Finish(to_grpc(status));
      return;
    }
    StartRead(&buffer_);
  }

  void OnDone() override { delete this; }

 private:
  Transport* const transport_;
  const int authenticated_source_;
  grpc::ByteBuffer buffer_;
  int source_ = -1;
};

grpc::ServerReadReactor<grpc::ByteBuffer>* Transport::new_exchange_reader(grpc::ByteBuffer* response,
                                                                          int authenticated_source) {
  return new ExchangeReader(this, response, authenticated_source);
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

void Transport::stream_ended(int source) {
  absl::MutexLock lock(&mu_);
  // A source is down only once all its streams have ended: a peer's streams end together
  // when it dies, but an old stream's late end must not condemn its fresh ones.
  if (--live_streams_[source] <= 0) {
    live_streams_.erase(source);
    down_since_[source] = absl::Now();
  }
}

int64_t Transport::pending_messages() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(mailbox_.size());
}

}  // namespace tessera
