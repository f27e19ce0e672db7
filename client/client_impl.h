// ClientImpl: the state behind Client and Array handles — the coordinator stub, one stub per
// worker (handshaken on first use), the calls in flight, the session (whose lease a thread of
// its own renews) with the arrays it holds, and an embedded cluster when there is one.
#ifndef TESSERA_CLIENT_CLIENT_IMPL_H_
#define TESSERA_CLIENT_CLIENT_IMPL_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "client/execution.h"
#include "client/local_cluster.h"
#include "client/transfer.h"
#include "core/graph.h"
#include "core/profile.h"
#include "proto/auth.h"
#include "proto/tessera.grpc.pb.h"
#include "tessera/client.h"

namespace tessera::internal {

// The error of a DeleteArray refused with `status`, naming the method once (the coordinator's
// own refusals name it already).
absl::Status delete_array_error(const grpc::Status& status);
// Of `arrays`, those a DeleteArray refused with `status`: the ids its `trailers` list (a
// PERMISSION_DENIED refusing some of a batch names them; the others were deleted), else all.
Deletes refused_deletes(Deletes arrays, const grpc::Status& status,
                        const std::multimap<grpc::string_ref, grpc::string_ref>& trailers);

class ClientImpl {
 public:
  // `token`: the credential every call presents (empty: none); `ca_pem`: the cluster CA's
  // certificate, for TLS (empty: plaintext).
  ClientImpl(std::string coordinator_address, std::shared_ptr<LocalCluster> cluster, std::string token,
             std::string ca_pem = "");
  // Waits for the calls in flight to finish (each by its deadline) and frees the buffers of
  // their outputs that nobody holds, before the connection (and an embedded cluster) goes;
  // then stops renewing the session's lease.
  ~ClientImpl();

  // Handshake with the coordinator, a session, then wait for `options.min_devices` alive
  // devices.
  absl::Status init(const ConnectOptions& options);

  // The session every array and program of this client belongs to (OpenSession).
  uint64_t session() const { return session_.load(); }
  // A number for a new call, unique within this client (ExecuteRequest.call_id).
  uint64_t next_call_id() { return call_ids_.fetch_add(1) + 1; }
  // Unique among the clients this process ever made.
  uint64_t serial() const { return serial_; }

  // The arrays this client holds, by id, with their types: after a coordinator restart they
  // are adopted again (see renew_leases). delete_array forgets them.
  void track(uint64_t id, pb::ArrayInfo info);
  // The grant of array `id` (ArrayInfo.grant) as the coordinator handed it out, for AdoptArrays;
  // empty if none is known.
  void remember_grant(uint64_t id, const std::string& grant);
  std::string grant(uint64_t id);

  const std::string& coordinator_address() const { return coordinator_address_; }
  pb::Coordinator::Stub* coordinator() { return coordinator_.get(); }

  // The stub of a worker at `address`, handshaken once. The error names `who`.
  absl::StatusOr<pb::Worker::Stub*> worker(const std::string& address, const std::string& who);
  // How shards travel to and from the worker at `address`: handed over in process, through
  // shared memory when its handshake (worker()) showed it on this host and PID namespace and
  // ConnectOptions::shared_memory allows, else streamed (also before worker(address) reached it).
  TransferPath transfer_path(const std::string& address);
  // Whether the worker at `address` takes fetches written straight into this process's memory
  // (HandshakeReply.writes_client_memory; with TransferPath::kSharedMemory).
  bool writes_our_memory(const std::string& address);
  // ConnectOptions::adopt_puts (set by init()).
  bool adopt_puts() const { return adopt_puts_; }

  absl::StatusOr<pb::Topology> topology();

  // Best effort: the coordinator is to forget the array and free its buffers. Never waits for
  // it (InFlight's deletion queue) unless kMaxQueuedDeletes wait already: then a user thread
  // deletes it synchronously. A failure is logged with the array's id and counted.
  void delete_array(uint64_t id);
  // Sends `arrays` with one asynchronous DeleteArray. `batch`: the caller is the sender of a
  // batch of InFlight's queue (counted there), and the reply's callback sends the next one;
  // else a lone deletion, counted as a call in flight until its reply.
  void send_deletes(Deletes arrays, bool batch = true);
  // The linger InFlight started (queue_delete, end_execution): an alarm kDeleteLinger from now
  // ends it, and sends what then waits with no execution in flight (InFlight::end_linger).
  void linger_deletes();
  // After `wait` (a grpc::Alarm: no thread waits), sends the batch `take` hands over, if any:
  // a linger's end (end_linger) or a refused batch's backoff (next_delete_batch).
  void send_deletes_after(absl::Duration wait, Deletes (InFlight::*take)());
  // Sends the deletions that wait and waits until every DeleteArray is answered (the buffers
  // are then free on the alive devices): Client::flush_deletes.
  absl::Status flush_deletes();

  const std::shared_ptr<InFlight>& in_flight() const { return in_flight_; }
  // The deletions `arrays` failed with `error` (a DeleteArray's, or refused on an Execute that
  // carried them): logged with their ids and counted (Client::failed_deletes); the next
  // flush_deletes returns the error.
  void deletes_failed(const Deletes& arrays, const absl::Status& error);

  // This client's timeline (core/profile.h): its calls and waits; and the profile running
  // across the cluster (client/profile.cc), if any.
  ProfileRecorder& profile() { return profile_; }
  struct Profiling;
  absl::Mutex profiling_mu;
  std::shared_ptr<Profiling> profiling ABSL_GUARDED_BY(profiling_mu);  // shared: Profiling is client/profile.cc's

 private:
  // Renews the session's lease every quarter lease until stopping_. After a coordinator
  // restart (the epoch changed) adopts every tracked array again; after a lapse (the client
  // was stopped for longer than the lease) opens a new session: the old arrays are gone.
  void renew_leases(absl::Duration lease);
  void adopt_tracked();
  // Logs the ids of `arrays`, whose deletion failed with `status`.
  static void report_failed_deletes(const Deletes& arrays, const absl::Status& status);
  // Runs `call` on a context the destructor cancels (the renewer's calls).
  grpc::Status cancellable(absl::Duration timeout, const std::function<grpc::Status(grpc::ClientContext*)>& call);

  // Declared first so that it is destroyed last, after every stub that talks to it. Shared by
  // every client of the cluster in this process (Client::connect to its address): an in-process
  // cluster must outlive every channel to it (proto/in_process.h).
  std::shared_ptr<LocalCluster> cluster_;
  const std::string coordinator_address_;
  const std::shared_ptr<CallIdentity> identity_;  // the token, and the session's credential once open
  std::unique_ptr<pb::Coordinator::Stub> coordinator_;
  const std::shared_ptr<InFlight> in_flight_ = std::make_shared<InFlight>();
  ProfileRecorder profile_;
  const uint64_t serial_ = next_serial();
  static uint64_t next_serial() {
    static std::atomic<uint64_t> next{1};
    return next.fetch_add(1);
  }

  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<pb::Worker::Stub>> workers_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> shm_workers_ ABSL_GUARDED_BY(mu_);  // addresses whose transfers take shared memory
  // Of shm_workers_, those that write fetches into our memory (HandshakeReply.writes_client_memory).
  std::set<std::string> direct_fetch_workers_ ABSL_GUARDED_BY(mu_);
  bool shared_memory_ = true;  // ConnectOptions::shared_memory; set by init()
  bool adopt_puts_ = false;    // ConnectOptions::adopt_puts; set by init()
  std::map<uint64_t, pb::ArrayInfo> tracked_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::string> grants_ ABSL_GUARDED_BY(mu_);
  grpc::ClientContext* renewing_ ABSL_GUARDED_BY(mu_) = nullptr;  // the renewer's call, to cancel

  std::atomic<uint64_t> session_{0};
  std::atomic<uint64_t> call_ids_{0};
  uint64_t epoch_ = 0;  // of the coordinator that renewed the lease last; the renewer's
  absl::Notification stopping_;
  std::thread renewer_;
};

// What an Array handle shares: its metadata, the client and the buffers (freed when their
// last owner goes: the last handle, or an execution still reading them).
struct ArrayState {
  ArrayState(std::shared_ptr<ClientImpl> client, std::shared_ptr<ArrayBuffers> buffers, DType dtype, Shape shape,
             NamedSharding sharding, bool committed = true)
      : client(std::move(client)),
        buffers(std::move(buffers)),
        dtype(dtype),
        shape(std::move(shape)),
        sharding(std::move(sharding)),
        committed(committed) {}

  // An array that exists on the devices under `id` (device_put, run_collective).
  static std::shared_ptr<ArrayState> placed(std::shared_ptr<ClientImpl> client, uint64_t id, DType dtype, Shape shape,
                                            NamedSharding sharding) {
    auto buffers = std::make_shared<ArrayBuffers>(client.get(), id);
    return std::make_shared<ArrayState>(std::move(client), std::move(buffers), dtype, std::move(shape),
                                        std::move(sharding));
  }

  // The array's id once its data exists; the producing call's error otherwise (see
  // ArrayBuffers::wait).
  // A donated array has none: FAILED_PRECONDITION naming the donation.
  absl::StatusOr<uint64_t> ready_id() const {
    if (buffers->donated()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the array ", type_to_string(dtype, shape),
                       " was donated to a jitted call (donate_argnums) and no longer exists; use that call's outputs"));
    }
    return buffers->wait();
  }

  const std::shared_ptr<ClientImpl> client;
  const std::shared_ptr<ArrayBuffers> buffers;  // declared after `client`: released before it
  const DType dtype;
  const Shape shape;
  const NamedSharding sharding;
  // False for an array made without a sharding (Client::array, as jnp.array) and for the
  // outputs of a call on such arrays only: a jitted call moves it (Array::committed).
  const bool committed;
};

// Runs `call` (a request naming array `id` of `a`); if the coordinator answers ABORTED (it
// restarted since the array was made), asks it to adopt the array again (AdoptArrays: the
// workers kept its buffers) and runs `call` once more. The adoption's error otherwise
// (FAILED_PRECONDITION naming the array and a device that lost its shard).
absl::Status with_adoption(const ArrayState& a, uint64_t id, const std::function<absl::Status()>& call);

// Access to an Array's state and construction from one, for the SDK's own files.
const ArrayState& array_state(const Array& array);
Array make_array(std::shared_ptr<ArrayState> state);
// x laid out by `target`, a sharding over x's own mesh that fits x: a jitted sharding
// constraint (collectives on the workers). What reshard and device_put do on one mesh
// (jit.cc; device_put takes Auto axes, reshard Explicit ones only).
absl::StatusOr<Array> relayout_on_mesh(const Array& x, const NamedSharding& target);

}  // namespace tessera::internal

#endif  // TESSERA_CLIENT_CLIENT_IMPL_H_
