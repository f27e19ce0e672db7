// Client: a connection to a Tessera cluster — a running one (connect) or one embedded in this
// process (local) — and the entry point for placing arrays on its devices.
//
//   absl::StatusOr<Client> client = Client::local(8);
//   absl::StatusOr<Mesh> mesh = client->make_mesh({4, 2}, {"data", "model"});
//   absl::StatusOr<Array> x = client->device_put(host, NamedSharding(*mesh, P("data", None)));
//
// A Client is a cheap, copyable handle; the connection (and an embedded cluster) lives until
// the last Client and the last Array that came from it are gone.
#ifndef TESSERA_CLIENT_H_
#define TESSERA_CLIENT_H_

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/host_array.h"
#include "core/mesh.h"
#include "core/sharding.h"
#include "tessera/array.h"

namespace tessera {

// Implementation details of the SDK, not for applications.
namespace internal {
class ClientImpl;
}  // namespace internal

// One device of the cluster, as the coordinator sees it.
struct Device {
  int id = 0;
  std::string address;  // the worker's host:port
  bool alive = false;   // false once the worker has missed its heartbeats (lost)
  // Alive but its worker is stopping (SIGTERM): it finishes its runs and serves fetches but
  // takes no new work, so make_mesh(shape, names) leaves it out, until it registers again.
  bool draining = false;
};

// What a worker reports about its memory.
struct DeviceStats {
  int device_id = 0;
  int64_t buffer_count = 0;
  int64_t bytes_used = 0;
  int64_t memory_limit_bytes = 0;
  int64_t collective_messages_pending = 0;  // received by the device, not yet consumed
  std::string blas_kernel;                  // OpenBLAS's kernel on that device
  int64_t plans_loaded = 0;                 // compiled programs' plans the device holds
  int64_t shm_messages_received = 0;        // collective messages that came through shared memory
  int64_t plan_runs_in_flight = 0;          // program runs started there and not finished
  int64_t bytes_put = 0;                    // shard bytes clients put there (streamed or handed over), in all
  int64_t bytes_fetched = 0;                // shard bytes read from there by clients (fetch), in all
  int64_t bytes_fanned_out = 0;             // shard bytes a replicated put's fan-out brought from peers
  int64_t shm_bytes_put = 0;                // of bytes_put, read from a co-located client's shared memory
  int64_t shm_bytes_fetched = 0;            // of bytes_fetched, written into a co-located client's shared memory
  // Collective messages that peers in the same process (Client::local's embedded workers) put
  // straight into the device's mailbox.
  int64_t in_process_messages_received = 0;
  // Program runs there that started stepped: on the thread that read them, parking at an
  // in-process collective's receive (docs/design.md, "Stepped runs").
  int64_t plan_runs_stepped = 0;
  int64_t client_memory_bytes_read = 0;     // of shm_bytes_put, read straight from the client's memory
  int64_t client_memory_bytes_written = 0;  // of shm_bytes_fetched, written straight into the client's memory
};

// Options of Client::connect.
struct ConnectOptions {
  // Wait (up to `timeout`) until at least this many devices are alive.
  int min_devices = 1;
  // How long to wait for the coordinator to answer, and again for the devices.
  absl::Duration timeout = absl::Seconds(30);
  // The credential sent on every call, as 'authorization: Bearer <token>': a client token (or
  // an admin one) of the cluster. Empty: the token in the file `token_file`; both empty: the
  // file named by $TESSERA_TOKEN_FILE if set, else, for a Client::local cluster of this
  // process, its client token, else none (a cluster in the development mode).
  std::string token{};
  std::string token_file{};
  // The cluster CA's certificate (PEM file, ca.pem of its credentials): connect over TLS and
  // verify the servers against it. Empty: $TESSERA_CA_FILE if set, else plaintext.
  std::string ca_file{};
  // Put and fetch through shared memory with every worker on this host that offers it
  // (tessera-worker --shm_transfers); false: gRPC streams. A block contiguous in the host
  // array is read from there (put) or written there (fetch) by the worker itself
  // (process_vm_readv / process_vm_writev, once it has seen that this process holds the call's
  // connection): no copy in this process. Any other block, an adopted put's (adopt_puts), and
  // every block once a worker could not do that (another user, ptrace denied, a connection it
  // cannot trace to this process, tessera-worker --shm_client_memory=false), goes through a
  // memfd of this process that the worker reads or writes once.
  bool shared_memory = true;
  // With shared_memory: each put's memfd is sealed and handed to the workers for good, which
  // map its pages as the buffer instead of copying them out (one copy per put, however many
  // replicas). Off by default: where it was measured (a 2-core VM), fresh pages for every put
  // cost more than the copies it saves through memory kept warm (docs/design.md, "Co-located
  // clients").
  bool adopt_puts = false;
};

// Options of Client::local: each worker's memory limit and the coordinator's heartbeat
// settings (a worker silent for heartbeat_timeout is marked lost).
struct LocalOptions {
  int64_t memory_bytes_per_device = int64_t{1} << 30;
  absl::Duration heartbeat_interval = absl::Milliseconds(500);
  absl::Duration heartbeat_timeout = absl::Seconds(3);
  // The embedded cluster checks credentials as a deployed one does, with fresh random tokens
  // (or those of `credentials_dir`, as `tessera credentials DIR` writes them, over TLS if it
  // holds TLS files); the client presents the client token. check_credentials = false: the
  // development mode, nothing is checked.
  bool check_credentials = true;
  std::string credentials_dir{};
  // The client, coordinator and workers talk through gRPC's in-process transport: no port is
  // opened, and only this process (a Client::connect to coordinator_address() among them)
  // reaches the cluster. false, or TLS files in credentials_dir: over TCP on 127.0.0.1
  // ephemeral ports, reachable by other processes of this host.
  bool in_process = true;
  // Over TCP (in_process = false): this client puts and fetches through shared memory, as a
  // co-located Client::connect does (ConnectOptions::shared_memory); false: over its streams.
  bool shared_memory = true;
  // For measuring worker/collectives/algorithms.h, as tessera-worker --all_reduce_algorithm:
  // "tree", "recursive_doubling", "direct" or "ring" for every all_reduce of at most one chunk
  // on every embedded worker; empty: the table's choice.
  std::string all_reduce_algorithm{};
};

// Options of Client::start_profile.
struct ProfileOptions {
  // Each daemon's (and this client's) ring of events, in [1, 2^20]: beyond it the oldest go,
  // counted in the trace's metadata (dropped_events).
  int64_t events_per_daemon = int64_t{1} << 16;
};

class Client;

// A running profile (Client::profile): stops it and writes the trace when finished, or when
// destroyed (an error then goes to stderr). Movable.
class ProfileScope {
 public:
  ProfileScope(ProfileScope&& other) noexcept;
  ProfileScope& operator=(ProfileScope&&) = delete;
  ~ProfileScope();
  // Client::stop_profile(path) and its errors; FAILED_PRECONDITION the second time.
  absl::Status finish();

 private:
  friend class Client;
  ProfileScope(std::shared_ptr<internal::ClientImpl> impl, std::string path)
      : impl_(std::move(impl)), path_(std::move(path)) {}
  std::shared_ptr<internal::ClientImpl> impl_;
  std::string path_;
};

// A connection to a cluster (see above); copies share it.
class Client {
 public:
  // Connects to the coordinator at `address` ("host:port"), checks its protocol version and
  // waits for options.min_devices alive devices. FAILED_PRECONDITION on a version mismatch
  // (naming both versions); UNAVAILABLE or DEADLINE_EXCEEDED when the coordinator does not
  // answer within options.timeout; DEADLINE_EXCEEDED when fewer than min_devices devices are
  // alive after another options.timeout. UNAUTHENTICATED when the cluster does not accept the
  // token (or none was given); NOT_FOUND or INVALID_ARGUMENT naming the token file when it
  // cannot be read or is empty.
  static absl::StatusOr<Client> connect(const std::string& address, const ConnectOptions& options = {});

  // Starts a coordinator and `num_devices` workers inside this process, on 127.0.0.1
  // ephemeral ports, and connects to them. Devices are numbered 0 .. num_devices - 1. They
  // compute with this process's OpenBLAS, each with max(1, cores / num_devices) threads
  // (unless OPENBLAS_NUM_THREADS is set); call ensure_fast_blas(argv) (below) first thing in
  // main() for the fast kernel on AVX-512 CPUs. Waits (up to 30 s) for every
  // device to be alive. INVALID_ARGUMENT when num_devices is outside [1, 1024], the heartbeat
  // timeout does not exceed a positive interval, or memory_bytes_per_device is not positive;
  // UNAVAILABLE when a server cannot listen; DEADLINE_EXCEEDED when the devices do not all
  // come alive in time. Surprising: the OpenBLAS thread count is set for the whole process.
  static absl::StatusOr<Client> local(int num_devices, const LocalOptions& options = {});

  // The cluster's devices, lost ones included, ordered by id, fresh from the coordinator.
  // UNAVAILABLE or DEADLINE_EXCEEDED naming the coordinator when it does not answer.
  absl::StatusOr<std::vector<Device>> devices() const;

  // jax.make_mesh: the first prod(shape) alive devices, by id, laid row-major over `shape`
  // (the others are left out, as JAX leaves them), every axis Explicit (JAX >= 0.9's default;
  // pass {AxisType::kAuto, ...} for GSPMD-style propagation). INVALID_ARGUMENT when prod(shape) exceeds the
  // number of alive devices, or as Mesh::create; devices()'s errors when the coordinator does
  // not answer.
  absl::StatusOr<Mesh> make_mesh(std::vector<int64_t> shape, std::vector<std::string> axis_names) const;
  // The same with the axes of `axis_types`, one per axis: make_mesh({4, 2}, {"data", "model"},
  // {AxisType::kExplicit, AxisType::kExplicit}). (A list, not a vector: {0} stays device ids.)
  absl::StatusOr<Mesh> make_mesh(std::vector<int64_t> shape, std::vector<std::string> axis_names,
                                 std::initializer_list<AxisType> axis_types) const;
  // The mesh of `device_ids`, in that order (jax.make_mesh's `devices`): exactly
  // tessera::make_mesh (core/mesh.h), and its errors. Surprising: it does not ask the cluster,
  // so ids that are lost or not in the cluster are accepted here, and only device_put or a
  // jitted call fails on them (NOT_FOUND for an id not in the cluster).
  absl::StatusOr<Mesh> make_mesh(std::vector<int64_t> shape, std::vector<std::string> axis_names,
                                 std::vector<int> device_ids, std::vector<AxisType> axis_types = {}) const;

  // jax.device_put: validates `sharding` against the array's shape (INVALID_ARGUMENT naming
  // the rule broken), then sends each device exactly its own shard, in parallel and straight
  // to its worker; returns once every shard is stored (the Array is ready at once).
  // NOT_FOUND when the mesh names a device that is not in the cluster. A device out of
  // memory gives RESOURCE_EXHAUSTED; an unreachable one UNAVAILABLE or DEADLINE_EXCEEDED
  // naming it. On error the coordinator is asked (best effort) to free what
  // was placed.
  absl::StatusOr<Array> device_put(const HostArray& host, const NamedSharding& sharding) const;
  // The same from memory the caller owns (a std::vector, an xtensor container — see
  // tessera/xtensor.h): each device's block is sent straight from it when contiguous there
  // (whole rows), else gathered first. INVALID_ARGUMENT also for an invalid view
  // (validate_view). The memory is only read, and not after the call returns.
  absl::StatusOr<Array> device_put(const HostView& host, const NamedSharding& sharding) const;
  // With a bare spec, on the ambient mesh (tessera/mesh_context.h's set_mesh), as
  // jax.device_put(x, P(...)) under jax.set_mesh; INVALID_ARGUMENT when none is set.
  absl::StatusOr<Array> device_put(const HostArray& host, const PartitionSpec& spec) const;
  absl::StatusOr<Array> device_put(const HostView& host, const PartitionSpec& spec) const;
  // jax.device_put(x, sharding) of an array already on devices: the same values laid out by
  // `sharding` on its mesh's devices, which may be x's, some of them, more, or others. The data
  // moves worker to worker, never through this client: within x's own mesh by collectives (a
  // jitted reshard, as tessera::reshard), else each device of `sharding` gets its boxes straight
  // from devices holding them (itself first). x itself when `sharding` is x's. Waits until x is
  // ready (first its block_until_ready errors). INVALID_ARGUMENT naming the rule when
  // `sharding` does not fit x's shape, or when x is another client's; NOT_FOUND for a device
  // not in the cluster; UNAVAILABLE naming a device that is lost, draining or unreachable;
  // FAILED_PRECONDITION when x lost a shard to a worker restart.
  absl::StatusOr<Array> device_put(const Array& x, const NamedSharding& sharding) const;
  // The same on the ambient mesh (set_mesh), as jax.device_put(x, P(...)) under jax.set_mesh.
  absl::StatusOr<Array> device_put(const Array& x, const PartitionSpec& spec) const;

  // jnp.array: `host` on the default device (the first of devices(), a one-device mesh with
  // the Auto axis '_default'), uncommitted (Array::committed() is false): a jitted call moves
  // it to where it runs, as JAX moves an array made without a sharding (jit.h). device_put's
  // errors.
  absl::StatusOr<Array> array(const HostArray& host) const;
  absl::StatusOr<Array> array(const HostView& host) const;

  // Dropping an Array's last handle never waits for its deletion: the client queues it, and
  // the next call carries it or a DeleteArray sent in the background does (docs/design.md,
  // "Asynchronous dispatch", drops never wait). flush_deletes sends what waits and returns
  // once the coordinator answered every deletion made before it: the buffers are then free on
  // the alive devices (device_put and device_stats flush first, and so does the client when it
  // goes; a deletion riding on a call is done when that call is, and an output of a call still
  // running when dropped is deleted once the call finishes). DEADLINE_EXCEEDED if the coordinator has not
  // answered within about 30 s (retries included); else the error of the last deletion that failed since the
  // previous flush (its arrays' ids are logged to stderr), or OK.
  absl::Status flush_deletes() const;
  // Deletions that failed since this client started (each logged with its array's id). A
  // background DeleteArray refused for a passing reason (UNAVAILABLE, RESOURCE_EXHAUSTED) is
  // sent again, waiting 100 ms and doubling, up to 6 times in a row: its deletions count here
  // only if the last try is refused too.
  int64_t failed_deletes() const;
  // Deletions sent again after such a refusal since this client started (each try counts).
  int64_t retried_deletes() const;

  // What the device's worker reports about its memory, asked now. NOT_FOUND when the device
  // is not in the cluster; UNAVAILABLE or DEADLINE_EXCEEDED naming the coordinator or the
  // device when it does not answer (a lost device is asked too). Flushes deletions first.
  absl::StatusOr<DeviceStats> device_stats(int device_id) const;

  // The coordinator's "host:port" (for local(), its 127.0.0.1 ephemeral port).
  std::string coordinator_address() const;

  // A timeline (docs/guide.md, "Seeing where the time goes"; as jax.profiler.start_trace):
  // records this client's calls and waits, the coordinator's compiles and dispatches, and on
  // every alive device its plan runs, kernels, collectives (bytes, algorithm, path), the
  // messages between devices (flow arrows from each send to its receive) and shard transfers,
  // whoever's calls caused them. FAILED_PRECONDITION if this client is profiling already;
  // INVALID_ARGUMENT for events_per_daemon outside [1, 2^20]; UNAVAILABLE or DEADLINE_EXCEEDED
  // naming a daemon that does not answer (those started are stopped again).
  absl::Status start_profile(const ProfileOptions& options = {}) const;
  // Stops the profile and writes `path`, Chrome's trace-event JSON (Perfetto and
  // chrome://tracing open it), every daemon's clock aligned to the coordinator's, and `path`.html,
  // a viewer that needs no network (one row per device). FAILED_PRECONDITION if none runs;
  // INTERNAL naming a file that cannot be written; a daemon that does not answer: its error
  // naming it, after the others' trace was written (its metadata lists the failure); ABORTED
  // naming a daemon whose recording another profile restarted meanwhile (one profile at a time
  // per cluster: its row is left out).
  absl::Status stop_profile(const std::string& path) const;
  // start_profile now; stop_profile(path) when the scope finishes or goes:
  //   { absl::StatusOr<ProfileScope> p = client.profile("/tmp/step.json"); ... step ...; p->finish(); }
  absl::StatusOr<ProfileScope> profile(const std::string& path, const ProfileOptions& options = {}) const;

 private:
  friend class ProfileScope;
  friend class Jitted;  // moves uncommitted arguments (device_put)
  friend absl::StatusOr<Array> reshard(const Array& x, const NamedSharding& sharding);  // onto another mesh
  explicit Client(std::shared_ptr<internal::ClientImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<internal::ClientImpl> impl_;
};

// For programs that run Client::local, first thing in main(): Debian's OpenBLAS 0.3.21 does
// not recognise recent AVX-512 CPUs and computes 4-5x slower with its generic kernel. When the
// CPU has AVX-512 and OPENBLAS_CORETYPE is unset, sets it and re-executes the program with the
// same arguments; returns when there is nothing to do (or the exec failed). (The daemons call
// it too; it is defined with the kernels.)
void ensure_fast_blas(char** argv);

}  // namespace tessera

#endif  // TESSERA_CLIENT_H_
