// ClientImpl: the state behind Client and Array handles — the coordinator stub, one stub per
// worker (handshaken on first use), the calls in flight, and an embedded cluster when there
// is one.
#ifndef TESSERA_CLIENT_CLIENT_IMPL_H_
#define TESSERA_CLIENT_CLIENT_IMPL_H_

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/execution.h"
#include "client/local_cluster.h"
#include "core/graph.h"
#include "proto/tessera.grpc.pb.h"
#include "tessera/client.h"

namespace tessera::internal {

class ClientImpl {
 public:
  ClientImpl(std::string coordinator_address, std::unique_ptr<LocalCluster> cluster);
  // Waits for the calls in flight to finish (each by its deadline) and frees the buffers of
  // their outputs that nobody holds, before the connection (and an embedded cluster) goes.
  ~ClientImpl();

  // Handshake with the coordinator, then wait for `options.min_devices` alive devices.
  absl::Status init(const ConnectOptions& options);

  const std::string& coordinator_address() const { return coordinator_address_; }
  pb::Coordinator::Stub* coordinator() { return coordinator_.get(); }

  // The stub of a worker at `address`, handshaken once. The error names `who`.
  absl::StatusOr<pb::Worker::Stub*> worker(const std::string& address, const std::string& who);

  absl::StatusOr<pb::Topology> topology();

  // Best effort: asks the coordinator to forget the array and free its buffers. Returns when
  // that is done, except on a gRPC callback thread, where it only starts the RPC.
  void delete_array(uint64_t id);

  const std::shared_ptr<InFlight>& in_flight() const { return in_flight_; }

 private:
  // Declared first so that it is destroyed last, after every stub that talks to it.
  std::unique_ptr<LocalCluster> cluster_;
  const std::string coordinator_address_;
  std::unique_ptr<pb::Coordinator::Stub> coordinator_;
  const std::shared_ptr<InFlight> in_flight_ = std::make_shared<InFlight>();

  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<pb::Worker::Stub>> workers_ ABSL_GUARDED_BY(mu_);
};

// What an Array handle shares: its metadata, the client and the buffers (freed when their
// last owner goes: the last handle, or an execution still reading them).
struct ArrayState {
  ArrayState(std::shared_ptr<ClientImpl> client, std::shared_ptr<ArrayBuffers> buffers, DType dtype, Shape shape,
             NamedSharding sharding)
      : client(std::move(client)),
        buffers(std::move(buffers)),
        dtype(dtype),
        shape(std::move(shape)),
        sharding(std::move(sharding)) {}

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
};

// Runs `call` (a request naming array `id` of `a`); if the coordinator answers ABORTED (it
// restarted since the array was made), asks it to adopt the array again (AdoptArrays: the
// workers kept its buffers) and runs `call` once more. The adoption's error otherwise
// (FAILED_PRECONDITION naming the array and a device that lost its shard).
absl::Status with_adoption(const ArrayState& a, uint64_t id, const std::function<absl::Status()>& call);

// Access to an Array's state and construction from one, for the SDK's own files.
const ArrayState& array_state(const Array& array);
Array make_array(std::shared_ptr<ArrayState> state);

}  // namespace tessera::internal

#endif  // TESSERA_CLIENT_CLIENT_IMPL_H_
