// Transport: how collective data moves between workers.
//
// Each worker keeps one long-lived Exchange stream to every peer it has sent to (opened on
// first use, reused by every later collective) and pushes tagged messages down it; a writer
// thread per link drains a queue capped at kMaxQueuedBytes, so a sender never has more than
// that in flight to one peer. Incoming streams deliver into a mailbox keyed by
// (op, source, step, chunk); a collective waits there for exactly the message it needs, so
// concurrent collectives and back-to-back runs never mix. A message is either delivered or
// its loss is known at both ends: when a link breaks, the ops it carried fail here at once and
// the peer is told on a fresh link, so its waits for them fail too (see link_failed).
//
//   transport.send(peer, address, {op, step, chunk}, data, bytes, deadline, owner);
//   absl::StatusOr<Received> data = transport.receive(source, address, {op, step, chunk}, start, deadline);
//   data->copy_to(dst);   // or data->reduce_into(dtype, op, acc)
//   transport.finish_op(op);     // drops what is left of op; late messages are discarded
//
// The mailbox is bounded (MailboxOptions): each source may hold at most bytes_per_peer there,
// charged to the device's memory (each message its data and kHeldMessageBytes), at most
// messages_per_peer messages of ops that have not started here, and a message
// of an op that no run or receive here claimed within unclaimed_ttl of its arrival is dropped.
// Either way the drop is counted and remembered, so the op's wait for that message fails at
// once, saying why, instead of at its deadline.
// A source's share is flow control, not a refusal: a message read from its stream or ring that
// would pass the share waits, and that stream or ring is read no further, until messages of the
// source are taken (the sender's link queue, gRPC's window or the ring fill, and its send waits
// with its deadline); one that waits longer than unclaimed_ttl is refused (docs/design.md,
// "Flow control at the share").
#ifndef TESSERA_WORKER_COLLECTIVES_TRANSPORT_H_
#define TESSERA_WORKER_COLLECTIVES_TRANSPORT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/collective.h"
#include "core/credentials.h"
#include "core/dtype.h"
#include "core/profile.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "grpcpp/support/slice.h"
#include "worker/collectives/algorithms.h"
#include "worker/collectives/collective_metrics.h"
#include "worker/collectives/peer_view.h"

namespace tessera {

struct MessageTag {
  uint64_t op = 0;
  int32_t step = 0;
  int32_t chunk = 0;
  // The run's tag: random, drawn by the coordinator per run (RunPlanRequest.run_tag) and carried
  // by every message of the run's ops (a put's fan-out: drawn by the client, ShardFanOut.run_tag).
  // Op ids are predictable; a message must also carry its run's tag to be filed for it (see
  // begin_run_ops). 0: no tag, which no run has.
  uint64_t run_tag = 0;
};

// An op and the run tag its messages carry: what a notice of lost ops names (ExchangeMessage
// .lost_ops and .lost_op_tags), so that it fails only the run whose messages were lost.
struct TaggedOp {
  uint64_t op = 0;
  uint64_t run_tag = 0;
};

// The data of one message as it arrived: gRPC's slices, not copied.
class Received {
 public:
  int64_t size() const { return bytes_; }
  // Copies the data to `dst` (size() bytes). Data read to a receiver's own buffer
  // (Transport::expect_at) may overlap `dst`; at that very place nothing is copied.
  void copy_to(std::byte* dst) const;
  // out[i] = op(local[i], data[i]) over size() / dtype_size(dtype) elements; `out` may be `local`.
  void reduce(DType dtype, ReduceOp op, const std::byte* local, std::byte* out) const;
  void reduce_into(DType dtype, ReduceOp op, std::byte* acc) const { reduce(dtype, op, acc, acc); }
  // Copies the data into one slice of its own. gRPC's slices of a message point into the
  // buffers its transport read from the socket, shared with the messages around it: one kept
  // message keeps them all alive.
  void compact();

 private:
  friend class Transport;
  // Calls f(pointer, length) for each contiguous piece of the data, in order.
  template <typename F>
  void for_each_piece(F&& f) const;

  std::vector<grpc::Slice> slices_;
  size_t offset_ = 0;  // where the data starts in the first slice
  int64_t bytes_ = 0;
  // Or the data is at placed_ (no slices), kept alive by placed_owner_.
  const std::byte* placed_ = nullptr;
  std::shared_ptr<const void> placed_owner_;
};

// The mailbox's bounds (see above).
struct MailboxOptions {
  int64_t bytes_per_peer = int64_t{64} << 20;
  // Messages of one source held for ops not started here when they arrived (those of a started
  // op are taken as they come and count only against bytes_per_peer). docs/design.md, "The
  // flood's peak": no legitimate peer gets near it; a flood of small messages does.
  int64_t messages_per_peer = 1024;
  absl::Duration unclaimed_ttl = absl::Seconds(60);
  // The device's memory: reserve(bytes) is false when they do not fit; release gives them back.
  // Unset: nothing is charged.
  std::function<bool(int64_t)> reserve;
  std::function<void(int64_t)> release;
};

// The shared-memory data path between workers of one host (see shm_ring.h).
struct ShmOptions {
  bool enabled = false;
  int64_t ring_bytes = int64_t{4} << 20;  // per peer pair and direction
  std::string host;                       // empty: shm_host_identity()
  // Where this worker's ShmRingServer listens, and the only directory whose sockets a peer's
  // offer may name: docker-compose's workers share /dev/shm (one IPC namespace), network
  // namespaces of one machine too (they differ in shm_host_identity instead).
  std::string socket_dir = "/dev/shm";
  // Tests only: called by a ring's reader between its take of a message's expected place
  // (Transport::expect_at) and its copy there, with the message's tag; it may block to hold the
  // reader in that window (the copy is then under way for forget_expected and receive). Each
  // reader takes its copy when it starts; unset, a reader tests one empty function per message
  // read in place. There is a reader per source, so it may run on several threads at once; it
  // must not call forget_expected or receive for the op whose copy it holds (they wait for that
  // copy: a deadlock).
  std::function<void(const MessageTag&)> before_placed_copy = nullptr;
};

class ShmRingServer;  // worker/collectives/shm_ring.h

namespace internal {
struct InProcessMailbox;  // a transport serving in process (transport.cc)
}  // namespace internal

class Transport {
 public:
  // Bytes queued to one peer before send() waits.
  static constexpr int64_t kMaxQueuedBytes = int64_t{16} << 20;

  // `credentials`: what this worker presents to its peers, with its device id (proto/auth.h);
  // none in the development mode.
  explicit Transport(Credentials credentials = {});
  ~Transport();  // cancels every link and joins its writer

  void set_self(int device_id);
  // This worker is about to register (again) with the coordinator: until declare() or
  // end_registration(), sends over gRPC are held (each until its deadline, DEADLINE_EXCEEDED
  // naming this device and the rule; or CANCELLED soon after its run's `cancelled()` turns
  // true), so that no link declares a registration the coordinator is replacing. A run the
  // coordinator sends as soon as it has recorded the new registration may reach this worker
  // before the registration's reply does: its messages then go out under the new one. (A
  // notice of lost ops, sent from a gRPC callback thread, is never held.)
  void begin_registration();
  // The registration begin_registration() announced ended without a new one to declare (its
  // RegisterWorker failed, or the worker stopped registering): the held sends go on under the
  // registration declared before. That is the only one this worker holds; runs of it still
  // going can finish, and a peer whose view says it was replaced (the coordinator recorded the
  // attempt but its reply was lost) ends the streams declaring it with PERMISSION_DENIED, which
  // fails the op with that reason (docs/design.md, "Held sends"). Idempotent.
  void end_registration();
  // Sends held now (begin_registration), for tests.
  int held_sends() const;
  // The registration (coordinator epoch, incarnation) this worker's Exchange streams declare to
  // its peers (worker/collectives/peer_view.h); ends begin_registration's wait. A new one
  // supersedes the open links: sends take fresh links declaring it, while each peer ends the
  // old links' streams once its view shows the new registration (PeerView's `replaced`).
  void declare(uint64_t epoch, uint64_t incarnation);

  // Bounds the mailbox (before the first message arrives). INVALID_ARGUMENT for a bound that
  // is not positive.
  absl::Status set_mailbox(MailboxOptions options);
  // Each source's share of the mailbox here (MailboxOptions::bytes_per_peer): the collectives
  // size their send windows from it (a cluster's workers run with the same flags).
  int64_t mailbox_bytes_per_peer() const;

  // Offers a shared-memory ring to every peer this worker sends to from now on: a peer on the
  // same host (the same ShmOptions::host) that has it enabled too fetches it from this worker's
  // ShmRingServer (a Unix socket in ShmOptions::socket_dir, started here), and the messages to it go through
  // the ring from then on; other peers keep gRPC (as do all when the server cannot start).
  // INVALID_ARGUMENT for a ring size outside [ShmRing::kMinBytes, ShmRing::kMaxBytes]. Call
  // before the first send.
  absl::Status set_shm(ShmOptions options);
  bool shm_enabled() const;
  // Messages received through shared memory so far (tests and GetStats: the path is used).
  int64_t shm_messages_received() const;

  // The message `tag` from `source`, if it comes through a shared-memory ring after this call
  // and is `bytes` long, is copied by the ring's reader straight to `dst` instead of into a
  // buffer of its own: its receive's Received then refers to `dst` (Received::placed), and
  // copy_to(dst) copies nothing. `owner` keeps `dst` alive while the reader may still write
  // it; the caller must neither read nor write those bytes until the receive returns the
  // message. Any other message (another size, one already read, gRPC, in process) is received
  // as usual, and its receive drops the expectation (a repeat of the message is not written to
  // `dst` then). forget_expected(op) drops what is left of an op's (each collective, as it
  // ends) and waits for the copies to its places under way: nothing is written there after.
  void expect_at(int source, MessageTag tag, std::byte* dst, int64_t bytes, std::shared_ptr<const void> owner);
  void forget_expected(uint64_t op);
  // Messages a ring's reader copied straight to their expected place (tests: the path is used).
  int64_t placed_messages() const;
  // Expectations not yet taken or forgotten (tests: a collective leaves none).
  int64_t expected_messages() const;

  // Takes collective messages straight from the transports of this process (Client::local's
  // embedded workers) under this worker's in-process `address` (proto/in_process.h), until
  // close_in_process(). A peer transport of this process that serves in process too, with the
  // same cluster token, and sends to `address` files each message into this mailbox itself:
  // no stream, ring or reader thread, one wake-up of the waiting collective (the same keys,
  // bounds and errors as the other paths; see send). INVALID_ARGUMENT if `address` is not an
  // in-process one, FAILED_PRECONDITION if another transport of this process serves it.
  absl::Status serve_in_process(const std::string& address);
  // Stops taking messages in process: peers' sends here fail UNAVAILABLE naming this device,
  // and the waits of the peers this transport sent to for its messages of ops running now fail
  // UNAVAILABLE at once, as when a peer's streams end. Idempotent; the destructor calls it.
  void close_in_process();
  // Whether collectives go in process (serve_in_process): the path of algorithms.h's table.
  bool in_process() const;
  // Messages peers of this process filed here directly (tests and GetStats: the path is used).
  int64_t in_process_messages_received() const;
  // Messages with data (or acknowledgements) read from peers' gRPC streams so far (tests).
  int64_t grpc_messages_received() const;

  // For measuring the thresholds of algorithms.h (tessera-worker --all_reduce_algorithm):
  // every all_reduce of at most one chunk runs `algorithm` (give every worker the same).
  void force_all_reduce(std::optional<Algorithm> algorithm);
  std::optional<Algorithm> forced_all_reduce() const;

  // What this device's collectives did (run_collective records each), for --metrics_port.
  CollectiveMetrics& collective_metrics() { return collective_metrics_; }
  const CollectiveMetrics& collective_metrics() const { return collective_metrics_; }
  // This device's timeline (core/profile.h): the interpreter's kernels, the engine's
  // collectives, each message sent and taken (flow events), the worker's transfers.
  ProfileRecorder& profile() { return profile_; }

  // Messages of at least this many bytes are sent from the caller's memory when it passes
  // an owner; smaller ones are always copied.
  static constexpr int64_t kZeroCopyMinBytes = 32 << 10;

  // Queues `bytes` bytes at `data` for `peer` (reachable at `address`). Waits while the
  // link's queue is full, until `deadline` (DEADLINE_EXCEEDED naming the peer). UNAVAILABLE
  // naming the peer if its link broke; the next send opens a fresh one.
  // Without `owner` the data is copied before send() returns. With one, large messages are
  // sent from `data` itself: `owner` keeps that memory alive until gRPC (or, in process, the
  // peer) is done with it, and the caller must not change those bytes afterwards (they may
  // still be unsent, or unread).
  // In process (serve_in_process, both ends): the message is in the peer's mailbox (or refused
  // for its bounds, which fails the peer's wait) when send() returns; UNAVAILABLE naming the
  // peer if no transport of this process serves its in-process address any more.
  // While this worker registers (begin_registration) a send over gRPC is held: CANCELLED
  // soon after `cancelled()` turns true.
  absl::Status send(int peer, const std::string& address, MessageTag tag, const std::byte* data, int64_t bytes,
                    absl::Time deadline, std::shared_ptr<const void> owner = nullptr,
                    const std::function<bool()>& cancelled = nullptr);

  // How often a waiting receive checks whether its op was cancelled.
  static constexpr absl::Duration kCancelPoll = absl::Milliseconds(100);

  // Waits for the message `tag` from `source` (at `address`, for errors). DEADLINE_EXCEEDED
  // naming the source at `deadline`; UNAVAILABLE as soon as the source's stream to this worker
  // ends after `op_start`, the source's notice says its messages of the op may be lost, or a
  // link of ours failed with messages of the op in flight (naming that peer); RESOURCE_EXHAUSTED
  // naming the bound when a message of the op from the source was dropped for the mailbox's
  // bounds; CANCELLED soon after `cancelled()` turns true.
  absl::StatusOr<Received> receive(int source, const std::string& address, MessageTag tag, absl::Time op_start,
                                   absl::Time deadline, const std::function<bool()>& cancelled = nullptr);

  // A run waiting for a message without a thread (park): its continuation.
  class Parked {
   public:
    virtual ~Parked() = default;
    // Called once, outside the transport's locks. `arrived`: by the thread that filed the
    // awaited message (or its refusal), which the run may continue on if its own rules allow;
    // false: it waited kParkLimit, a source of this process stopped, or the transport is
    // stopping: continue on a thread that may wait (receive then says what went wrong).
    virtual void resume(bool arrived) = 0;
  };
  // How long a run stays parked before it is handed back to wait on a thread (resume(false)):
  // its deadline, cancellation and a peer's loss are then noticed as receive notices them.
  static constexpr absl::Duration kParkLimit = kCancelPoll;

  // Instead of a receive that would wait: if receive(source, address, tag, op_start, ...) would
  // return at once now (the message, or a failure, is here), returns false and the caller
  // receives. Otherwise records `waiter` and returns true: the thread that files the message
  // calls waiter->resume(true); within 2 * kParkLimit without it, or when a source of this
  // process stops taking messages (close_in_process), resume(false). The caller must not touch
  // the run once this returns true (its continuation may already run).
  bool park(int source, MessageTag tag, absl::Time op_start, std::shared_ptr<Parked> waiter);
  // Resumes every parked run with resume(false) (a runner going away).
  void unpark_all();
  // Runs parked so far that their message's arrival resumed (tests: the path is used).
  int64_t parked_resumed() const;

  // Ops from this id up (bit 63: a put's fan-out, Transfers::kFanOutOpBit) are named by buffer
  // ids, which do not grow as the coordinator's op ids do: their ends are remembered apart,
  // one by one, the first finished forgotten first (at most 4096), so that they never push
  // the ranges of runs out of memory.
  static constexpr uint64_t kUnorderedOps = uint64_t{1} << 63;

  // What a message in the mailbox costs beyond its data, charged with it (to its sender's
  // share and to the device's memory): its map node (112 bytes), its slice list (32) and its
  // slice's header (about 40), each rounded up by malloc. Without it a flood of one-byte
  // messages held some 200 bytes each under a charge of one.
  static constexpr int64_t kHeldMessageBytes = 256;
  // How many run tags' refusals the mailbox remembers for one (op, source) (see refuse_locked):
  // a run's peer sends its op's messages under one tag, so a few cover it with room for
  // forgeries; more tags for the op replace older ones of the same (op, source) (the newest
  // stays, as does the first and the tag a run claimed the op with), and so cannot push other
  // ops' refusals out of those remembered. The same cap holds for the remembered notices of
  // lost ops (lost_).
  static constexpr int kRefusedTagsPerSource = 4;
  // How many refusals the mailbox remembers for the ops' waits (and, apart, how many losses a
  // source's notices named): at most kRememberedPerSource of one source, charged to it (past
  // them that source's own oldest goes, one of an op no run claimed first), and
  // kRememberedInAll in all (past them the oldest of the source holding the most goes, the
  // newcomer's own source on a tie). So a source's entries go only for its own or for a source
  // holding fewer than it: a flooding or forging source, which holds the most, pushes out only
  // its own, and a source holding at most kRememberedInAll / n of them (n the sources holding
  // any; with authenticated streams, devices of the cluster) keeps them all. Entries go with
  // their op (finish_op) or at a run's claim of it with another tag.
  static constexpr size_t kRememberedPerSource = 1024;
  static constexpr size_t kRememberedInAll = 4096;
  // The refusals and the losses remembered now of `source`'s messages (tests: the bounds).
  std::pair<size_t, size_t> remembered_of(int source) const;

  // Drops every stored message of `op` and discards any that arrive later.
  void finish_op(uint64_t op) { finish_ops(op, op + 1); }
  // The same for every op in [first, end): a failed plan run's ops it will never start.
  void finish_ops(uint64_t first, uint64_t end);

  // A plan run here with collectives (one without claims nothing) owns the ops [first, end) from
  // now until end_run_ops(first, end, run_tag):
  // their messages are awaited, so they are not "early" (not counted against
  // --mailbox_messages_per_peer, not dropped for their age), however far ahead a peer runs (a
  // device that only sends, as in a one-way permute pipeline, may be hundreds of ops ahead).
  // Messages already held for those ops stop counting. Runs may nest (a loop's body) and repeat
  // a range.
  // Run tags: from now on a message of these ops is filed only if it carries `run_tag`; one
  // that does not is dropped and counted (forged_messages), and so are those held for them
  // that carry another tag (held early, before the run claimed them). A receive's tag claims
  // its op the same way (ops outside any run: RunCollective's, a reshard's, a fan-out's).
  // No default tag: a caller states the run's (0 only for ops of no tagged run).
  void begin_run_ops(uint64_t first, uint64_t end, uint64_t run_tag);
  void end_run_ops(uint64_t first, uint64_t end, uint64_t run_tag);

  // The reactor that reads one peer's Exchange stream into this transport (the worker's
  // raw Exchange handler returns it; it deletes itself when the stream ends).
  // `authenticated_source`: the device the stream declares (-1: none); a message from another
  // device is dropped and counted. With `peers` (which must outlive every stream), nothing is
  // read before peers->admit(claim) admits the stream, and once a view says the registration
  // it declares was replaced the stream ends with the view's PERMISSION_DENIED: no message of
  // it (nor of the shared-memory ring it offered) is filed after that, and its end does not
  // count as its source going away (the ops of the source's new registration go on).
  grpc::ServerReadReactor<grpc::ByteBuffer>* new_exchange_reader(grpc::ByteBuffer* response,
                                                                 int authenticated_source = -1,
                                                                 PeerView* peers = nullptr,
                                                                 const StreamClaim& claim = {});

  // Messages dropped because their sender was not the device their stream authenticated, or
  // because their run tag was not that of the run their op belongs to here (at once, or when the
  // run claimed their op). Each message, and each op of a notice of lost ops (each op it names
  // under another tag than its run's), counts once, here or in dropped_messages: a message
  // refused for the mailbox's bounds before its op was claimed counts there, and its refusal
  // going at the claim counts nowhere again.
  int64_t forged_messages() const;

  // Drops the mailbox's messages whose op no run or receive here claimed within the time-to-live
  // (MailboxOptions::unclaimed_ttl). Filing a message does this too; the worker also calls it on
  // each heartbeat, so messages of ops that never start go even when no more messages come.
  void sweep();

  // Messages that waited for room in their source's share (their stream or ring paused), so
  // far (tests: the path is used), and those waiting now.
  int64_t paused_messages() const;
  int64_t waiting_messages() const;

  // Messages held in the mailbox (for tests: zero after every collective has finished), and
  // the bytes of their data.
  int64_t pending_messages() const;
  int64_t pending_bytes() const;
  // Messages dropped unconsumed: of finished ops, or for the mailbox's bounds.
  int64_t dropped_messages() const;

  // Parses one raw ExchangeMessage and files it; `source` is the stream's sender (-1 before
  // its first message). INVALID_ARGUMENT for malformed bytes or a change of sender. A message
  // (data, notice or shared-memory offer) claiming another device than `authenticated_source`
  // (>= 0) is dropped and counted (forged_messages), with OK. What the Exchange reader does
  // with each message (public for fuzz/exchange_fuzzer.cc).
  absl::Status deliver(grpc::ByteBuffer* buffer, int* source, int authenticated_source);

 private:
  class Link;
  // op, source, step, chunk, run tag: messages of one op with other tags (forged, held before
  // the op's run claims it) never replace one another.
  using Key = std::tuple<uint64_t, int, int32_t, int32_t, uint64_t>;

  class ExchangeReader;
  class InboundRing;
  // How a message arrived, for the counters.
  enum class Via { kGrpc, kShm, kInProcess };

  // What to do once the transport's lock is let go: resume the runs parked for messages just
  // filed, and let the readers whose waiting message was filed or refused read on. Declare it
  // before the lock it follows: its destructor runs them after the lock's.
  struct AfterUnlock {
    ~AfterUnlock();
    std::vector<std::shared_ptr<Parked>> parked;
    std::vector<std::function<void()>> read_on;
  };
  // A message read from a source's stream or ring that would pass the source's share: it waits
  // here (not charged) and its reader reads no further until it is filed (admit_locked) or
  // refused (its wait passed unclaimed_ttl, or its reader gave up). `slot` is the reader's handle
  // to it, set to null (under mu_) once it is decided; a gRPC reader then reads on (`read_on`),
  // a ring's thread waits for that (await_room).
  struct Waiting {
    int from = -1;
    MessageTag tag;
    Received data;
    absl::Time since;
    std::function<void()> read_on;
    std::shared_ptr<Waiting>* slot = nullptr;
  };
  // Files a message as file_message does, or, when it would pass its source's share and `slot`
  // is given, makes it wait (*slot set) and returns true: its reader must read no further.
  bool file_or_wait(int from, MessageTag tag, Received data, Via via, std::function<void()> read_on,
                    std::shared_ptr<Waiting>* slot);
  // Files `data` (see file_message) and returns true, or returns false (keeping `data`) when it
  // would pass its source's share and `may_wait`.
  bool file_locked(int from, MessageTag tag, Received& data, absl::Time now, bool may_wait, AfterUnlock* after)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Files the waiting messages that fit now.
  void admit_locked(absl::Time now, AfterUnlock* after) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void decide_locked(Waiting& w, AfterUnlock* after) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Withdraws the message waiting in `*slot` (its stream ended, its ring stopped): refused, so
  // its op's wait fails saying so. False if it was decided already.
  bool give_up_waiting(std::shared_ptr<Waiting>* slot);
  // Waits until the message in `*slot` is decided (true) or `deadline` passes (false). When the
  // transport stops, gives it up and returns true.
  bool await_room(std::shared_ptr<Waiting>* slot, absl::Time deadline);
  // Raw bytes of one message, as deliver, from a reader that can wait (`slot`; see file_or_wait).
  // `*waits`: its reader must read no further until `read_on` runs.
  // `reader_id`: the reader's id (next_reader_), which a ring it offers is remembered by
  // (stream_replaced); 0: none.
  absl::Status deliver_or_wait(grpc::ByteBuffer* buffer, int* source, int authenticated_source,
                               std::function<void()> read_on, std::shared_ptr<Waiting>* slot, bool* waits,
                               uint64_t reader_id = 0);

  // The healthy link to `peer` at `address`, opened if needed, for a message of `op`: while
  // this worker registers (begin_registration) it waits first, under the same lock (one lock
  // round when not registering), until `deadline` or `cancelled()` (see await_registration_locked).
  // Destroys retired links (which waits for their streams to end): never call it on a gRPC
  // callback thread.
  absl::StatusOr<std::shared_ptr<Link>> link(int peer, const std::string& address, uint64_t op, absl::Time deadline,
                                             const std::function<bool()>& cancelled);
  // Waits while this worker registers (begin_registration): DEADLINE_EXCEEDED at `deadline`,
  // CANCELLED soon after `cancelled()` turns true, both naming `op`, the peer and the rule.
  absl::Status await_registration_locked(int peer, const std::string& address, uint64_t op, absl::Time deadline,
                                         const std::function<bool()>& cancelled) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::shared_ptr<Link> current_link_locked(int peer, const std::string& address) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A link broke with messages of `ops` (its recent ones) in flight: the ops still running
  // here fail at once (their sends and receives return stream_failed naming the peer), and the
  // peer gets a notice on a fresh link, so that its waits for them fail too. `end`: how the
  // stream ended (the peer's code and reason, or UNAVAILABLE; see stream_end in transport.cc).
  // On gRPC's callback threads; never blocks.
  void link_failed(const Link& failed, const std::vector<TaggedOp>& ops, const absl::Status& end);
  // The error of op `op` whose messages to `peer` may be lost: `end`'s code, naming the peer,
  // with the peer's reason if it gave one.
  static absl::Status stream_failed(uint64_t op, const std::string& peer, const absl::Status& end);
  // Files one message of `from` in the mailbox (dropped if its op has finished, or over the
  // mailbox's bounds). The run parked for it goes to `after` (resumed outside the locks).
  // Never waits: over the share it refuses (the in-process path, whose sender may be a run
  // stepping on a thread that must not wait, and deliver's callers).
  void file_message(int from, MessageTag tag, Received data, Via via, AfterUnlock* after);
  // Whether a receive of `key` begun at `op_start` returns now (see receive).
  bool ready_locked(const Key& key, absl::Time op_start) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The parked runs' watchdog (park): hands those parked too long to resume(false).
  void watch_parked();
  // Takes every parked run out (to resume outside the lock).
  std::vector<std::shared_ptr<Parked>> take_parked_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends one message in process: files it in `peer`'s mailbox (see send); `after`: the run
  // of the peer parked for it.
  absl::Status send_in_process(internal::InProcessMailbox& to, int self, int peer, const std::string& address,
                               MessageTag tag, const std::byte* data, int64_t bytes, std::shared_ptr<const void> owner,
                               AfterUnlock* after);
  // A peer of this process that this transport took messages from stopped taking messages in
  // process: waits for its messages of ops running now fail UNAVAILABLE, as when its streams end.
  // Returns the runs parked for a message from it, for the caller to resume outside every lock.
  [[nodiscard]] std::vector<std::shared_ptr<Parked>> in_process_source_gone(int source);
  struct Held {
    Received data;
    absl::Time arrived;
    bool early = false;  // its op had not started here and no run here owned it (counted in held_early_)
  };
  bool finished_locked(uint64_t op) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a receive for `op` began here (its messages are taken as they come) or `op`
  // finished (its messages are dropped): either way, none of them waits for long.
  bool started(uint64_t op) const;
  // Removes a message from the mailbox, giving back its bytes.
  void take_locked(std::map<Key, Held>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the messages of ops not claimed here within unclaimed_ttl, and refuses those waiting
  // for room longer than that (every ttl/4 at most).
  void sweep_locked(absl::Time now, AfterUnlock* after) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why a message was dropped for the mailbox's bounds: a flood leaves kRememberedInAll of
  // these behind (until their ops end, which for ops that never start is never), so they hold
  // no text; the op's wait puts the reason into words (refusal_text_locked).
  struct Refusal {
    enum Kind : uint8_t { kShare, kCount, kMemory, kTtl, kPaused, kGaveUp } kind;
    // kMemory: the message's charge in bytes; kTtl, kPaused, kGaveUp: how long it waited, in ns
    int64_t value = 0;
    uint64_t order = 0;  // when it was remembered (remembered_): the oldest goes first
  };
  std::string refusal_text_locked(const Refusal& r) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts a dropped message of (op, from) with `run_tag` and remembers why, for the op's wait
  // (a wait of that run tag only: a forged message's refusal does not fail the run's op).
  // `claimed`: run_tag_locked(op), which the caller has at hand (file_locked, on a flood's path).
  void refuse_locked(uint64_t op, int from, uint64_t run_tag, Refusal why, std::optional<uint64_t> claimed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A peer offered its ring to this worker (on a gRPC callback thread: starts the ring's
  // reader thread, which opens it, and returns).
  void ring_offered(int source, const std::string& socket, uint64_t token, const std::string& host, uint64_t reader);
  // Joins the reader threads that have stopped. Never on a gRPC callback thread.
  void join_stopped_rings();
  void stream_started(int source);
  // A stream of `source` that carried data ended. `replaced`: ended because its registration
  // was replaced (PeerView), which is no sign that the source went away: its fresh streams may
  // not have carried anything yet, and the ops of its new registration must not fail for it.
  void stream_ended(int source, bool replaced = false);
  // The registration of the stream read by `reader` (its id) was replaced: the ring it offered,
  // if it is still the source's, stops (a replaced registration's messages are not read from it
  // either).
  void stream_replaced(int source, uint64_t reader);

  // Where expect_at's messages go (`bytes`: the size they must have), and the ring reader's
  // take of one (false: none expected there), which counts a copy of its key under way until the
  // reader calls copied(key). Under a lock of their own, a leaf (docs/design.md, "Lock order"),
  // taken by a ring's reader only while expected_count_ says some are there.
  struct Expected {
    std::byte* dst = nullptr;
    int64_t bytes = 0;
    std::shared_ptr<const void> owner;
  };
  bool take_expected(int source, MessageTag tag, int64_t bytes, Expected* out);
  // receive, but for the expectation of a message that came another way (see expect_at).
  absl::StatusOr<Received> receive_filed(int source, const std::string& address, MessageTag tag, absl::Time op_start,
                                         absl::Time deadline, const std::function<bool()>& cancelled);
  void copied(const Key& key);
  // Drops the expectation of `key`, whose message came another way, once no copy of that key
  // (a repeat's) is under way.
  void unexpect(const Key& key);
  // Waits until no copy of a key in [first, last] is under way: no deadline (a copy is a memcpy
  // of at most a chunk, which waits for nothing; returning before it ends would hand out memory
  // still written), said on stderr every 10 s.
  void await_copies_locked(const Key& first, const Key& last) ABSL_EXCLUSIVE_LOCKS_REQUIRED(expected_mu_);
  mutable absl::Mutex expected_mu_;
  std::map<Key, Expected> expected_ ABSL_GUARDED_BY(expected_mu_);
  std::map<Key, int> copying_ ABSL_GUARDED_BY(expected_mu_);  // copies under way per key
  std::atomic<int64_t> expected_count_{0};
  std::atomic<int64_t> copying_count_{0};  // copies under way, all keys
  std::atomic<int64_t> placed_count_{0};

  const Credentials credentials_;
  mutable absl::Mutex mu_;
  int self_ ABSL_GUARDED_BY(mu_) = -1;
  std::pair<uint64_t, uint64_t> declared_ ABSL_GUARDED_BY(mu_);  // see declare
  bool registering_ ABSL_GUARDED_BY(mu_) = false;                // see begin_registration
  int held_sends_ ABSL_GUARDED_BY(mu_) = 0;                      // sends waiting for registering_ to end
  int64_t forged_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int, std::shared_ptr<Link>> links_ ABSL_GUARDED_BY(mu_);
  std::map<Key, Held> mailbox_ ABSL_GUARDED_BY(mu_);
  MailboxOptions mailbox_options_ ABSL_GUARDED_BY(mu_);
  std::map<int, int64_t> held_bytes_ ABSL_GUARDED_BY(mu_);  // per source, as charged
  std::map<int, int64_t> held_early_ ABSL_GUARDED_BY(mu_);  // per source: messages held with early set
  int64_t pending_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_sweep_ ABSL_GUARDED_BY(mu_);
  // Ops a receive began here, until they finish, with the run tag of the first receive.
  std::map<uint64_t, uint64_t> started_ ABSL_GUARDED_BY(mu_);
  // Op ranges [first, end) of the plan runs here (begin_run_ops) and their run tags, as many as
  // runs hold them.
  std::multiset<std::tuple<uint64_t, uint64_t, uint64_t>> run_ops_ ABSL_GUARDED_BY(mu_);
  // The run tag the messages of `op` must carry: its run's (run_ops_), else its first
  // receive's (started_); none while no run or receive here has claimed it (an early message).
  std::optional<uint64_t> run_tag_locked(uint64_t op) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A run or receive claimed [first, end) with `run_tag`: drops the messages held for those ops
  // that carry another tag (counted in forged_), and the refusals of such messages (not counted
  // again: their messages were counted in dropped_ when refused).
  void drop_mismatched_locked(uint64_t first, uint64_t end, uint64_t run_tag) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts a message dropped for its run tag (in forged_), logging the first ten.
  void count_mismatch_locked(uint64_t op, int from, uint64_t run_tag) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // (op, source, run tag): the key of the refusals and notices of lost ops remembered.
  using OpSourceTag = std::tuple<uint64_t, int, uint64_t>;
  // refused_ and lost_: what is remembered per (op, source, run tag) for the ops' waits, each
  // entry with the order it was remembered in (Refusal::order; lost_'s value itself), bounded
  // per source and in all (kRememberedPerSource, kRememberedInAll): a map, and beside it each
  // source's entries in order and the sources by how many they hold.
  template <typename Value>
  class Remembered {
   public:
    using Map = std::map<OpSourceTag, Value>;
    const Map& map() const { return entries_; }
    // Remembers `value` (its order, order_of, above every held entry's) under `key` and keeps
    // the bounds; false if `key` is held already (it keeps its first value) and nothing changes.
    // At most kRefusedTagsPerSource tags per (op, source): past them the oldest of the (op,
    // source) goes but its first and the tag `claimed_tag` a run claimed the op with. Past
    // kRememberedPerSource entries of the key's source, that source's oldest goes; past
    // kRememberedInAll in all, the oldest of the source holding the most (the highest device id
    // among sources holding as many), or of the key's source if none holds more (the new entry,
    // if it is its only one). Of a source's entries, the oldest of an op no run claimed
    // (`claimed(op)` false) goes first, else its oldest. The trade-off: for an honest peer far
    // ahead of this device that is its lowest op not claimed yet, the one a run here reaches
    // first, whose wait then ends at its deadline instead of failing at once; forgetting the
    // newcomer instead would let old entries lock out what a source is refused on now.
    template <typename Claimed>
    bool remember(const OpSourceTag& key, Value value, std::optional<uint64_t> claimed_tag, const Claimed& claimed);
    typename Map::const_iterator erase(typename Map::const_iterator it);
    void erase_ops(uint64_t first, uint64_t end);  // the entries of the ops [first, end)
    size_t held_by(int source) const;              // how many entries of `source` it holds

   private:
    // Whether `key` may be added (not if held), making room for it among its (op, source)'s tags.
    bool room_for_tag(const OpSourceTag& key, std::optional<uint64_t> claimed_tag);
    template <typename Claimed>
    void forget_oldest_of(int source, const Claimed& claimed);
    Map entries_;
    std::map<int, std::set<std::pair<uint64_t, OpSourceTag>>> by_source_;  // (order, key), oldest first
    std::set<std::pair<size_t, int>> by_count_;                            // (entries held, source)
  };
  // remembered.remember(key, value, claimed_tag, whether a run here claimed the op).
  template <typename Value>
  bool remember_locked(Remembered<Value>& remembered, const OpSourceTag& key, Value value,
                       std::optional<uint64_t> claimed_tag) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Messages dropped for the bounds, and why (until the op finishes; at most
  // kRefusedTagsPerSource tags per (op, source), and kRememberedPerSource per source and
  // kRememberedInAll in all, see Remembered). Only a wait of the same run tag fails for one, and
  // only a message of that tag is dropped for it.
  Remembered<Refusal> refused_ ABSL_GUARDED_BY(mu_);
  // The next entry's order in refused_ and lost_ (Refusal::order, lost_'s values); one not
  // remembered (held already) leaves a gap, which the order does not mind.
  uint64_t remembered_ ABSL_GUARDED_BY(mu_) = 0;
  // Messages waiting for room in their source's share, oldest first (at most one per stream or
  // ring: its reader waits with it), and how many ever waited.
  std::vector<std::shared_ptr<Waiting>> waiting_ ABSL_GUARDED_BY(mu_);
  // Messages a receive waits for now (their parked runs are in parked_): filed even over their
  // source's share, since they are taken at once.
  std::multiset<Key> awaited_ ABSL_GUARDED_BY(mu_);
  int64_t paused_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int, int> live_streams_ ABSL_GUARDED_BY(mu_);       // per source: streams that carried data
  std::map<int, absl::Time> down_since_ ABSL_GUARDED_BY(mu_);  // sources whose streams all ended, and when
  // Finished ops as ranges [first, end) by first, at most kRememberedOps (the oldest go first:
  // ids only grow).
  std::map<uint64_t, uint64_t> finished_ ABSL_GUARDED_BY(mu_);
  // Finished ops from kUnorderedOps up, and the order they finished in.
  std::set<uint64_t> finished_unordered_ ABSL_GUARDED_BY(mu_);
  std::deque<uint64_t> finished_unordered_order_ ABSL_GUARDED_BY(mu_);
  // How a link of ours failed: the peer (peer_name) and how its stream ended. One per failed
  // link, shared by every op it had in flight (up to kMaxNoticeOps): the op's error is put into
  // words when asked (failed_op_locked), not kept per op.
  struct LinkFailure {
    std::string peer;
    absl::Status end;
  };
  // Ops whose messages a link of ours may have lost, with that link's failure (until the op
  // finishes; at most kRememberedOps, the oldest ids dropped first: ids only grow).
  std::map<uint64_t, std::shared_ptr<const LinkFailure>> failed_ops_ ABSL_GUARDED_BY(mu_);
  // The error of a failed op (stream_failed of its link's failure); OK if none failed.
  absl::Status failed_op_locked(uint64_t op) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // (op, source, run tag): the source's notice said messages of op with that tag to here may
  // be lost (as above), and the order it was remembered in (remembered_). Only waits of that
  // tag fail for it; when a run claims the op, the entries of other tags go, counted as forged
  // (drop_mismatched_locked). At most kRefusedTagsPerSource tags per (op, source), and
  // kRememberedPerSource per source and kRememberedInAll in all (Remembered), as refused_.
  Remembered<uint64_t> lost_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<Link>> retired_ ABSL_GUARDED_BY(mu_);  // replaced, to destroy outside mu_
  // Links of the registration declare() replaced: kept open until their peer ends them (then
  // retired by link()) or the next declare (see declare).
  std::vector<std::shared_ptr<Link>> superseded_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  ShmOptions shm_ ABSL_GUARDED_BY(mu_);
  // Hands the rings this worker offers to its peers (started by set_shm; shared with the links).
  std::shared_ptr<ShmRingServer> shm_server_ ABSL_GUARDED_BY(mu_);
  // The rings peers write to this worker: the current one per source, and those replaced or
  // whose source went away (stopped, their threads joined by join_stopped_rings).
  std::map<int, std::unique_ptr<InboundRing>> inbound_ ABSL_GUARDED_BY(mu_);
  // The id of the reader whose offer made inbound_'s ring, by source. An id, never reused: a
  // reader's address, which a later reader may get once it is freed, could stop a current ring.
  std::map<int, uint64_t> inbound_offered_by_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> next_reader_{1};  // the next ExchangeReader's id
  std::vector<std::unique_ptr<InboundRing>> stopped_inbound_ ABSL_GUARDED_BY(mu_);
  int64_t shm_received_ ABSL_GUARDED_BY(mu_) = 0;
  // serve_in_process: this transport's entry in the process's table, and the mailboxes of the
  // peers it sent to in process (told when it stops: in_process_source_gone), by device.
  std::shared_ptr<internal::InProcessMailbox> in_process_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::weak_ptr<internal::InProcessMailbox>> in_process_sent_to_ ABSL_GUARDED_BY(mu_);
  int64_t in_process_received_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t grpc_received_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<Algorithm> forced_all_reduce_ ABSL_GUARDED_BY(mu_);
  // Runs parked for a message (park), and since when; the watchdog's thread (started by the
  // first park, joined by the destructor).
  struct ParkedRun {
    std::shared_ptr<Parked> waiter;
    absl::Time since;
  };
  std::map<Key, ParkedRun> parked_ ABSL_GUARDED_BY(mu_);
  int64_t parked_resumed_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread parked_watch_ ABSL_GUARDED_BY(mu_);
  CollectiveMetrics collective_metrics_;
  ProfileRecorder profile_;
};

}  // namespace tessera

#endif  // TESSERA_WORKER_COLLECTIVES_TRANSPORT_H_
