// Asynchronous dispatch: an Execution is one jit call in flight — it waits for its inputs,
// sends Execute to the coordinator without blocking anyone, and its outcome is the readiness
// that all of its output arrays share. ArrayBuffers own an array's buffers on the devices and
// free them when the last owner (an Array handle, or an execution reading them) goes.
//
//   absl::Time deadline = Execution::finish_by(inputs, timeout);
//   TESSERA_RETURN_IF_ERROR(client->in_flight()->begin_execution(deadline, who));
//   auto e = std::make_shared<Execution>(client, inputs, /*num_outputs=*/1, timeout, deadline, who);
//   e->start({executable_id, epoch});         // returns at once
//   ArrayBuffers out(client, e, 0);
//   absl::StatusOr<uint64_t> id = out.wait(); // the output's array id, or the call's error
//
// Every wait ends by the execution's deadline(): the latest deadline of its inputs' producers
// plus its own Execute RPC's deadline. Callbacks never block; they run on gRPC's threads.
#ifndef TESSERA_CLIENT_EXECUTION_H_
#define TESSERA_CLIENT_EXECUTION_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/tessera.pb.h"

namespace tessera::internal {

class ClientImpl;
class Execution;

// How many calls of one client may be in flight (dispatched or waiting for their inputs)
// before a new call waits for one to finish.
inline constexpr int kMaxExecutionsInFlight = 16;
// How many deletions of dropped arrays may wait in the client, for the next Execute to carry
// them or for the background DeleteArray (at most one in flight, carrying all that wait): a
// drop beyond it deletes with a DeleteArray of its own (synchronous on a user thread: the
// back-pressure; asynchronous on a gRPC callback thread, which must not block).
inline constexpr size_t kMaxQueuedDeletes = 1024;
// A background DeleteArray refused for a passing reason (UNAVAILABLE: the coordinator cannot
// be reached for now; RESOURCE_EXHAUSTED: every thread of its synchronous server is busy) is
// sent again after kFirstDeleteRetry, the wait doubling each time: at most kMaxDeleteRetries
// times in a row (6.3 s in all), then its deletions count as failed.
inline constexpr int kMaxDeleteRetries = 6;
inline constexpr absl::Duration kFirstDeleteRetry = absl::Milliseconds(100);
// How long deletions queued with no execution in flight wait for an Execute to carry them
// before a DeleteArray of their own carries them: a loop's `y = f(x)` drops the last y when
// nothing runs, just before its next call, whose Execute then takes the deletion instead of a
// DeleteArray fanned out to every device during that call (InFlight::linger).
inline constexpr absl::Duration kDeleteLinger = absl::Milliseconds(2);

// Deletions: array ids and their grants.
using Deletes = std::vector<std::pair<uint64_t, std::string>>;

// True on a thread running one of this SDK's gRPC callbacks: work there must not block.
bool on_callback_thread();

// What a client has in flight: executions not yet finished and calls started from gRPC's
// threads (deletions), and the deletions of dropped arrays waiting to be sent. ~ClientImpl
// waits until none remain; callbacks hold this by shared_ptr, so the last end() never touches
// freed memory.
//
// The deletion queue: a drop queues its array (queue_delete) and returns. The next Execute
// carries what waits (take_deletes). When nothing is in flight (no execution, no DeleteArray),
// a drop, or the end of the last execution, starts a linger of kDeleteLinger instead (one at a
// time, a grpc::Alarm): what still waits when it ends, with no execution in flight, goes in a
// DeleteArray. One DeleteArray at a time carries everything queued, its sender (the linger's
// end, or a flush, which does not linger) sending the next batch from the reply's callback
// until the queue is empty. The client deletes an array only once no call of its reads it
// (ArrayBuffers), so no order against calls is needed.
class InFlight {
 public:
  // Counts a new execution that will finish by `finish_by`. While kMaxExecutionsInFlight are
  // in flight, waits for one to finish — at most until the latest of their deadlines:
  // DEADLINE_EXCEEDED naming `who` then.
  absl::Status begin_execution(absl::Time finish_by, const std::string& who);
  // Counts an asynchronous RPC that ends by `finish_by`.
  void begin_call(absl::Time finish_by);
  // One execution, or one call, ended. If it was the last execution in flight and deletions
  // wait with no DeleteArray in flight and no linger, end_execution returns true: a linger
  // starts, counted as a call in flight, and the caller is to set its alarm
  // (ClientImpl::linger_deletes), whose end calls end_linger.
  bool end_execution();
  void end_call();
  // Queues the deletion of array `id`; false (the caller deletes it itself) when
  // kMaxQueuedDeletes wait. When no execution, no DeleteArray and no linger is in flight,
  // `*linger` is set: a linger starts, as above.
  bool queue_delete(uint64_t id, std::string grant, bool* linger);
  // The linger ended: with no execution in flight, everything queued as a batch whose sender
  // the caller becomes (ClientImpl::send_deletes), unless a DeleteArray is in flight (its
  // sender sends it next) or nothing waits; with executions in flight, nothing (the next
  // Execute carries what waits, or the last of them lingers again).
  Deletes end_linger();
  // The deletions queued so far, for an Execute to carry.
  Deletes take_deletes();
  // An Execute that carried `deletes` failed, perhaps before the coordinator took them: they
  // wait again (a second deletion of an array is skipped). The queue may then hold up to
  // twice kMaxQueuedDeletes.
  void requeue(Deletes deletes);
  // The sender of a batch had its reply: the next batch, everything queued meanwhile, for the
  // same sender; empty when nothing waits, and the sender no longer counts.
  Deletes next_delete_batch();
  // The batch sender's DeleteArray of `arrays` was refused for a passing reason. Unless it
  // was refused kMaxDeleteRetries times in a row already, they wait again (as many as fit
  // under kMaxQueuedDeletes; the others go to *given_up) and the sender, still counted, is to
  // send the next batch (next_delete_batch) after the returned wait. Else nothing waits again:
  // everything goes to *given_up, the run of refusals ends, and the wait is nullopt.
  // *attempts gets how many times in a row the sender was refused, this one included.
  std::optional<absl::Duration> retry_deletes(Deletes arrays, Deletes* given_up, int* attempts);
  // The batch sender's DeleteArray was answered (done, or refused for good): a run of
  // refusals for passing reasons ends.
  void end_delete_retries();
  // `n` deletions failed with `error` (nothing when n is 0): counted, and kept for
  // take_delete_error.
  void count_failed_deletes(int64_t n, const absl::Status& error);
  // A flush: everything queued as a batch for the caller to send, unless a DeleteArray is in
  // flight already (its sender sends what waits next) or nothing waits.
  Deletes start_flush();
  // Waits until no deletion waits and no DeleteArray is in flight, at most until `deadline`:
  // DEADLINE_EXCEEDED saying how many still wait.
  absl::Status await_deletes(absl::Time deadline);
  // Deletions whose DeleteArray failed, since the client started; and the last such error
  // since the previous call (then OK until another fails).
  int64_t deletes_failed() const;
  // Deletions retry_deletes queued again, since the client started.
  int64_t deletes_retried() const;
  absl::Status take_delete_error();
  // Waits until nothing is in flight. Everything counted ends by its deadline (gRPC calls
  // their callbacks by then), so this returns by the latest one.
  void wait_idle();

 private:
  // Everything queued as a batch whose sender the caller becomes, if none is in flight.
  Deletes start_batch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts a linger (counted) if deletions wait and neither a DeleteArray nor a linger is in
  // flight; returns whether it did.
  bool start_linger() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  int executions_ ABSL_GUARDED_BY(mu_) = 0;
  int count_ ABSL_GUARDED_BY(mu_) = 0;  // executions and calls (a batch's sender counts once)
  absl::Time latest_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  Deletes deletes_ ABSL_GUARDED_BY(mu_);                // queued, not sent
  bool delete_in_flight_ ABSL_GUARDED_BY(mu_) = false;  // a batch's DeleteArray
  bool lingering_ ABSL_GUARDED_BY(mu_) = false;         // a linger's alarm is set (counted in count_)
  int delete_retries_ ABSL_GUARDED_BY(mu_) = 0;         // the sender's refusals in a row (retry_deletes)
  int64_t deletes_failed_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t deletes_retried_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status delete_error_ ABSL_GUARDED_BY(mu_);
};

// The buffers of one array on its devices: placed by id, or output `output` of `producer`.
class ArrayBuffers {
 public:
  ArrayBuffers(ClientImpl* client, uint64_t id) : client_(client), id_(id) {}
  ArrayBuffers(ClientImpl* client, std::shared_ptr<Execution> producer, int output)
      : client_(client), producer_(std::move(producer)), output_(output) {}
  // Frees the buffers: at once, or when the producer finishes (nothing if it failed).
  ~ArrayBuffers();

  ArrayBuffers(const ArrayBuffers&) = delete;
  ArrayBuffers& operator=(const ArrayBuffers&) = delete;

  // Whether the data exists or the producer failed (never blocks).
  bool ready() const;
  // Waits at most `max_wait` until wait() would return at once (Execution::await_done).
  bool await_ready(absl::Duration max_wait) const;
  // The array's id once its producer finished; the producer's error if it failed, and
  // DEADLINE_EXCEEDED if it has not finished by its deadline.
  absl::StatusOr<uint64_t> wait() const;

  const std::shared_ptr<Execution>& producer() const { return producer_; }
  int output() const { return output_; }

  // Donation (jit's donate_argnums): marks the array as taken by a call, which frees its
  // buffers when it finishes (this then frees nothing). Returns the calls still reading it:
  // the donating call runs after them.
  std::vector<std::shared_ptr<Execution>> donate();
  bool donated() const { return donated_.load(); }
  // What the destructor does unless donated: frees the buffers at once, or when the producer
  // finishes (nothing if it failed). The donating call runs it when it finishes.
  void free_buffers();
  // `reader` reads these buffers while it runs.
  void add_reader(const std::shared_ptr<Execution>& reader);

 private:
  // Outlives this: owners are Array handles (which hold the client) and executions (which
  // ~ClientImpl waits for).
  ClientImpl* const client_;
  const uint64_t id_ = 0;
  const std::shared_ptr<Execution> producer_;
  const int output_ = -1;
  std::atomic<bool> donated_{false};
  absl::Mutex readers_mu_;
  std::vector<std::weak_ptr<Execution>> readers_ ABSL_GUARDED_BY(readers_mu_);
};

// A compiled program as the coordinator knows it: its id, and the coordinator incarnation
// (CompileReply.epoch) it belongs to.
struct ExecutableRef {
  uint64_t id = 0;
  uint64_t epoch = 0;
};

// How a call gets its program again after the coordinator restarted: adopt the inputs
// (`input_ids`, in order) again and compile again, asynchronously, then call `done` with the
// new executable or the error (on a gRPC callback thread). Must not block, and must call
// `done` by `deadline`.
using Recompile = std::function<void(const std::vector<uint64_t>& input_ids, absl::Time deadline,
                                     std::function<void(absl::StatusOr<ExecutableRef>)> done)>;

class Execution : public std::enable_shared_from_this<Execution> {
 public:
  // `inputs` are the arguments' buffers, held until this finishes; `deadline` is
  // finish_by(inputs, timeout); `who` prefixes errors ("jit: coordinator host:port").
  // REQUIRES: client->in_flight()->begin_execution(deadline) succeeded for this execution
  // (finish() ends it).
  Execution(ClientImpl* client, std::vector<std::shared_ptr<ArrayBuffers>> inputs, int num_outputs,
            absl::Duration timeout, absl::Time deadline, std::string who);

  // The deadline finish_by() of an execution on `inputs` started now with `timeout`.
  static absl::Time finish_by(const std::vector<std::shared_ptr<ArrayBuffers>>& inputs, absl::Duration timeout);

  // Sends Execute(executable), or fails without sending when an input's producer is known to
  // have failed. Returns at once. An input whose producer's Execute is in flight is named as
  // that call's output (the coordinator runs this call after it: no round trip here per link
  // of a chain); otherwise, or with calls in `after`, Execute is sent once every input is
  // ready and every call in `after` has finished (whatever its outcome). When the coordinator answers that the
  // executable belongs to an earlier incarnation of it (ABORTED: it restarted), `recompile` (if given) gets a new one
  // and Execute is sent once more.
  void start(ExecutableRef executable, const std::vector<std::shared_ptr<Execution>>& after = {},
             Recompile recompile = nullptr);

  bool ready() const;
  // Waits at most `max_wait` until wait() would return at once: true when the call finished
  // or its deadline passed.
  bool await_done(absl::Duration max_wait) const;
  // Whether this call's Execute has been sent (it may be in flight): a consumer may then name
  // its outputs by call_id().
  bool sent() const { return sent_.load(); }
  uint64_t call_id() const { return call_id_; }
  absl::Time deadline() const { return deadline_; }
  // The call's outcome: OK, its error (naming the device that failed), or DEADLINE_EXCEEDED
  // when it has not finished by deadline().
  absl::Status wait() const;
  // REQUIRES: wait() returned OK.
  uint64_t output_id(int i) const;
  // The error that made this call fail: its own, or for a call that failed because an input's
  // producer had, that producer's root cause. REQUIRES: ready().
  absl::Status root_cause() const;

  // The error of a call whose argument `index` is an output of `failed`: the root cause's
  // code, its message prefixed with `who` and the argument. REQUIRES: failed.ready().
  static absl::Status failed_input(const std::string& who, size_t index, const Execution& failed);

  // Runs `f` once this has finished: at once, on this thread, if it has. `f` must not block.
  void on_finish(std::function<void()> f);

  // The last handle of output `i` is gone: free its buffers now, or when this finishes.
  void release_output(int i);

  // The outputs' dtypes, shapes and shardings, for the client to track them once they exist
  // (see ClientImpl::track). Before start().
  void describe_outputs(std::shared_ptr<const std::vector<pb::ArrayInfo>> outputs) { outputs_ = std::move(outputs); }

 private:
  void input_ready();
  void dispatch();
  // Sends Execute at once, naming the inputs still in flight as their producers' outputs.
  void forward();
  // Runs `f` once every producer named by forward() has finished.
  void after_producers(std::function<void()> f);
  // Sends Execute on `inputs` (array ids; 0 for the `pending` ones), by `rpc_deadline`; on
  // ABORTED, recompiles once (or, with pending inputs, waits for them and sends again).
  void send(std::vector<uint64_t> inputs, absl::Time rpc_deadline, bool may_recompile,
            std::vector<pb::CallOutput> pending = {});
  // Records the outcome (and its root cause: `status` itself when not given), frees the
  // outputs already released, runs the continuations and ends this execution in InFlight.
  // Called once.
  void finish(absl::Status status, std::vector<uint64_t> ids, absl::Status root_cause = absl::OkStatus());

  // Constant after construction.
  ClientImpl* const client_;  // alive until finish() ends this execution's count
  const std::shared_ptr<InFlight> in_flight_;
  const int num_outputs_;
  const absl::Duration timeout_;
  const std::string who_;
  const absl::Time deadline_;
  const uint64_t call_id_;
  std::atomic<bool> sent_{false};

  // Set by start() (and by a recompilation); read by dispatch() and send(), which run after
  // the last input_ready(), one after another.
  ExecutableRef executable_;
  Recompile recompile_;
  std::shared_ptr<const std::vector<pb::ArrayInfo>> outputs_;
  std::atomic<int> pending_inputs_{0};
  // The producers forward() named by their calls (null entries: inputs that existed). Set
  // before Execute is sent; read by its callback.
  std::vector<std::shared_ptr<Execution>> named_producers_;
  // Released by finish(). Touched only by start(), dispatch() and finish(), one after another.
  std::vector<std::shared_ptr<ArrayBuffers>> inputs_;

  mutable absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  absl::Status root_cause_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> output_ids_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> released_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> continuations_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera::internal

#endif  // TESSERA_CLIENT_EXECUTION_H_
