#include "worker/collectives/transport.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/client_callback.h"
#include "grpcpp/support/slice.h"
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
class Transport::Link {
 public:
  static constexpr int kStreamsPerLink = 3;

  Link(int self, int peer, std::string address)
      : self_(self), peer_(peer), address_(std::move(address)), channel_(make_channel(address_)) {
    for (int i = 0; i < kStreamsPerLink; ++i) streams_.push_back(std::make_unique<Stream>(this));
  }

  ~Link() {
    for (auto& s : streams_) s->cancel();
    absl::MutexLock lock(&mu_);
    // gRPC calls OnDone once a cancelled call is over: this wait ends.
    auto all_done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_streams_ == kStreamsPerLink; };
    mu_.Await(absl::Condition(&all_done));
  }

  absl::Status enqueue(MessageTag tag, const std::byte* data, int64_t bytes, absl::Time deadline,
                       std::shared_ptr<const void> owner) {
    Outgoing message{encode_exchange(self_, tag, data, bytes, std::move(owner)), bytes};
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

  const std::string& address() const { return address_; }

  bool broken() const {
    absl::MutexLock lock(&mu_);
    return broken_;
  }

 private:
  struct Outgoing {
    grpc::ByteBuffer buffer;
    int64_t bytes = 0;  // of data, for the in-flight cap
  };

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
      {
        absl::MutexLock lock(&link_->mu_);
        link_->queued_bytes_ -= current.bytes;
        current = {};
        if (!ok) {
          link_->fail_locked();
          return;
        }
        if (link_->queue_.empty()) {
          writing = false;
          return;
        }
        current = std::move(link_->queue_.front());
        link_->queue_.pop_front();
      }
      start_write();
    }

    // The call failed (its connection closed: the peer's process died, say) or the server ended
    // it. The hold keeps OnDone back until the Link goes, and an idle stream has no write to
    // fail: without this, the link's next message would be written into the dead call and
    // lost, and its receiver would wait out the deadline (a worker restarted at the same
    // address). A broken link is replaced on the next send.
    void OnReadInitialMetadataDone(bool ok) override {
      if (ok) return;
      absl::MutexLock lock(&link_->mu_);
      link_->fail_locked();
    }

    void OnDone(const grpc::Status&) override {
      absl::MutexLock lock(&link_->mu_);
      link_->fail_locked();
      ++link_->done_streams_;
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

  void fail_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!broken_) {
      broken_ = true;
      error_ = absl::UnavailableError(absl::StrCat(peer_name(peer_, address_), " stopped taking collective data"));
    }
    queue_.clear();
    queued_bytes_ = 0;
  }

  // Constant after construction.
  const int self_;
  const int peer_;
  const std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::vector<std::unique_ptr<Stream>> streams_;

  mutable absl::Mutex mu_;
  std::deque<Outgoing> queue_ ABSL_GUARDED_BY(mu_);
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // queued and in flight
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  int done_streams_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

Transport::Transport() = default;

Transport::~Transport() {
  std::map<int, std::shared_ptr<Link>> links;
  {
    absl::MutexLock lock(&mu_);
    links.swap(links_);
  }
  links.clear();  // joins the writers outside the lock
}

void Transport::set_self(int device_id) {
  absl::MutexLock lock(&mu_);
  self_ = device_id;
}

absl::StatusOr<std::shared_ptr<Transport::Link>> Transport::link(int peer, const std::string& address) {
  std::shared_ptr<Link> stale;
  absl::MutexLock lock(&mu_);
  auto& slot = links_[peer];
  // A broken link, or one to an address the peer no longer has (it restarted elsewhere), is
  // replaced; the old one is destroyed after the lock is released.
  if (slot != nullptr && (slot->broken() || slot->address() != address)) stale = std::move(slot);
  if (slot == nullptr) slot = std::make_shared<Link>(self_, peer, address);
  return slot;
}

absl::Status Transport::send(int peer, const std::string& address, MessageTag tag, const std::byte* data, int64_t bytes,
                             absl::Time deadline, std::shared_ptr<const void> owner) {
  absl::StatusOr<std::shared_ptr<Link>> l = link(peer, address);
  if (!l.ok()) return l.status();
  return (*l)->enqueue(tag, data, bytes, deadline, std::move(owner));
}

absl::StatusOr<Received> Transport::receive(int source, MessageTag tag, absl::Time op_start, absl::Time deadline,
                                            const std::function<bool()>& cancelled) {
  const Key key{tag.op, source, tag.step, tag.chunk};
  absl::MutexLock lock(&mu_);
  // A source counts as gone only if its stream ended while this op ran: a stream that ended
  // before may simply not have been reopened yet.
  auto gone = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = down_since_.find(source);
    return it != down_since_.end() && it->second >= op_start;
  };
  auto arrived = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return mailbox_.count(key) > 0 || gone(); };
  // Wake up now and then to notice a cancelled call (the coordinator gave up on the op).
  while (!mu_.AwaitWithDeadline(absl::Condition(&arrived), std::min(deadline, absl::Now() + kCancelPoll))) {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("device ", source, " sent nothing for op ", tag.op, " step ",
                                                      tag.step, " chunk ", tag.chunk, " in time"));
    }
    if (cancelled && cancelled()) return absl::CancelledError(absl::StrCat("op ", tag.op, " was cancelled"));
  }
  auto it = mailbox_.find(key);
  if (it == mailbox_.end()) {
    return absl::UnavailableError(absl::StrCat("device ", source, " went away during op ", tag.op));
  }
  Received data = std::move(it->second);
  mailbox_.erase(it);
  return data;
}

void Transport::finish_op(uint64_t op) {
  absl::MutexLock lock(&mu_);
  mailbox_.erase(mailbox_.lower_bound(Key{op, INT32_MIN, INT32_MIN, INT32_MIN}),
                 mailbox_.upper_bound(Key{op, INT32_MAX, INT32_MAX, INT32_MAX}));
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

absl::Status Transport::deliver(grpc::ByteBuffer* buffer, int* source) {
  Received data;
  if (!buffer->Dump(&data.slices_).ok()) return absl::InvalidArgumentError("Exchange: unreadable message");
  SliceReader reader(data.slices_);
  uint64_t fields[5] = {0, 0, 0, 0, 0};  // source_device, op_id, step, chunk
  bool has_data = false;
  uint64_t key = 0;
  while (!has_data && reader.varint(&key)) {
    const uint64_t field = key >> 3, wire = key & 7;
    if (field >= 1 && field <= 4 && wire == 0) {
      if (!reader.varint(&fields[field])) return absl::InvalidArgumentError("Exchange: truncated message");
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
  if (*source < 0) {
    *source = from;
    stream_started(from);
  } else if (from != *source) {
    return absl::InvalidArgumentError(
        absl::StrCat("Exchange: a stream from device ", *source, " carried a message from device ", from));
  }
  absl::MutexLock lock(&mu_);
  if (finished_.count(fields[2]) > 0) return absl::OkStatus();
  mailbox_[Key{fields[2], from, static_cast<int32_t>(fields[3]), static_cast<int32_t>(fields[4])}] = std::move(data);
  return absl::OkStatus();
}

// Reads one peer's stream. Never blocks in a reaction: filing a message takes the
// transport's lock briefly.
class Transport::ExchangeReader final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  ExchangeReader(Transport* transport, grpc::ByteBuffer* response) : transport_(transport) {
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
    absl::Status status = transport_->deliver(&buffer_, &source_);
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
  grpc::ByteBuffer buffer_;
  int source_ = -1;
};

grpc::ServerReadReactor<grpc::ByteBuffer>* Transport::new_exchange_reader(grpc::ByteBuffer* response) {
  return new ExchangeReader(this, response);
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
