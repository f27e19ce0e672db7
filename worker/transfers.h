// Transfers: the shard data paths of a worker: PutShard (check the grant, reserve, read the
// chunks, commit; a stream that stalls is cancelled and its reservation released) and
// GetShard (check the grant, send the chunks), with the bytes each moved. A replicated block's
// put fans out (ShardHeader.fan_out): its uploader broadcasts it to the other members over the
// collectives' Transport, whose members' streams carry only the header.
//
// Lock: puts_mu_ guards puts_, the PutShard streams open (from their start, whether or not
// they hold a reservation yet). It is held only to
// insert, erase or scan them; cancel_stalled_puts calls ServerContext::TryCancel under it
// (which does not block), so a stream's context is never touched after it left the set.
// PutShard and GetShard are synchronous handlers: they block their gRPC thread on the
// stream's reads and writes (bounded: a stall is cancelled, a reader that goes cancels).
//
//   Transfers transfers(&store, &auth, &device, &profile, absl::Seconds(10));
//   return transfers.put(ctx, caller, reader, reply);   // from the PutShard handler
//   (its own thread cancels stalled puts every put_stall_timeout / 4)
#ifndef TESSERA_WORKER_TRANSFERS_H_
#define TESSERA_WORKER_TRANSFERS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "core/op.h"
#include "core/profile.h"
#include "grpcpp/grpcpp.h"
#include "proto/auth.h"
#include "proto/tessera.grpc.pb.h"
#include "worker/buffer_store.h"
#include "worker/collectives/engine.h"
#include "worker/device.h"

namespace tessera {

namespace internal {

// A TCP endpoint; an IPv4 address as ::ffff:a.b.c.d, as an IPv6 socket connected to one shows it.
struct TcpEndpoint {
  std::array<unsigned char, 16> address{};
  int port = -1;
  // The endpoint of IPv4 address `address4` (4 bytes, network order) and `port`.
  static TcpEndpoint v4(const void* address4, int port) {
    TcpEndpoint end;
    end.address[10] = end.address[11] = 0xff;
    std::memcpy(end.address.data() + 12, address4, 4);
    end.port = port;
    return end;
  }
  bool operator==(const TcpEndpoint& other) const { return address == other.address && port == other.port; }
};

// The inodes of this network namespace's established TCP sockets (IPv4 and IPv6) whose local
// end is `local` and whose remote end has port `remote_port`, sorted, each once. Asked of the
// kernel (NETLINK_SOCK_DIAG, inet_diag: it filters by state and ports, so the answer holds the
// matches only, however many other sockets there are); where netlink is unavailable, read
// from /proc/net/tcp{,6} (proc_established_tcp_inodes), which this process says once on
// stderr. FAILED_PRECONDITION naming the table if neither can be read.
absl::StatusOr<std::vector<uint64_t>> established_tcp_inodes(const TcpEndpoint& local, int remote_port);
// Which dumps sock_diag_established_tcp_inodes makes: both families in one (TCPDIAG_GETSOCK),
// one per family (SOCK_DIAG_BY_FAMILY), or the first and, where the kernel refuses it, the second.
enum class SockDiag { kOneDump, kByFamily, kEither };
// The same from the kernel alone: UNAVAILABLE with the reason if netlink refuses. Each dump walks
// the kernel's table of established sockets (skipping other ports).
absl::StatusOr<std::vector<uint64_t>> sock_diag_established_tcp_inodes(const TcpEndpoint& local, int remote_port,
                                                                       SockDiag dumps = SockDiag::kEither);
// The same read from /proc/net/tcp and /proc/net/tcp6: every socket of the namespace is
// printed and parsed (tens of milliseconds with thousands of TIME_WAIT sockets).
absl::StatusOr<std::vector<uint64_t>> proc_established_tcp_inodes(const TcpEndpoint& local, int remote_port);

}  // namespace internal

class Transfers {
 public:
  // A fan-out's broadcast runs under the op id buffer id | kFanOutOpBit: no other op id has
  // bit 63 (coordinator ids stay below 2^62, barriers set bit 62), and a device holds one block
  // of an array, so it is in one fan-out of it.
  static constexpr uint64_t kFanOutOpBit = uint64_t{1} << 63;
  static constexpr int kMaxFanOut = 65536;

  // Starts the stall watch: a thread of its own that runs cancel_stalled_puts every
  // put_stall_timeout / 4 (10 ms to 1 s), so that no other wait (a heartbeat to a slow
  // coordinator, say) delays it. The destructor stops and joins it.
  // `in_process`: the worker has no port, so every caller is in this process and may hand
  // buffers over (core/handoff.h) instead of streaming them.
  // `transport` carries fan-outs (ShardHeader.fan_out) to the other members.
  // `shm_transfers`: clients of this host may name a memfd of theirs to read a put's block
  // from or write a fetched one into (ShardHeader.shm, GetShardRequest.shm; core/shm_transfer.h).
  // `client_memory`: such a segment may name the block in its client's memory
  // (ShmSegment::create_direct), read or written there (check_client_memory).
  Transfers(BufferStore* store, const Authenticator* auth, const WorkerDevice* device, Transport* transport,
            ProfileRecorder* profile, absl::Duration put_stall_timeout, bool in_process = false,
            bool shm_transfers = false, bool client_memory = true);
  ~Transfers();

  // The PutShard and GetShard handlers after `caller` was authenticated: a caller below a
  // daemon must present the buffer's grant. PutShard's errors do not name this device: its
  // caller, the client, names the device it called ("device_put: device 3 (address): ..."), so
  // a fan-out's error names the member that failed it once, and the peer it blames after it.
  grpc::Status put(grpc::ServerContext* ctx, const Caller& caller, grpc::ServerReader<pb::ShardChunk>* reader,
                   pb::PutShardReply* reply);
  grpc::Status get(grpc::ServerContext* ctx, const Caller& caller, const pb::GetShardRequest* req,
                   grpc::ServerWriter<pb::ShardChunk>* writer);

  // Cancels the PutShard streams that received nothing for put_stall_timeout while waiting
  // for the client (their reservations are released as they end). Called by the stall watch.
  void cancel_stalled_puts(absl::Time now);

  // Bytes received from clients (streamed or handed over); a fan-out member's bytes, which
  // came from its peers, count in bytes_fanned_out() instead.
  int64_t bytes_put() const { return bytes_put_.load(std::memory_order_relaxed); }
  int64_t bytes_fanned_out() const { return bytes_fanned_out_.load(std::memory_order_relaxed); }
  int64_t bytes_fetched() const { return bytes_fetched_.load(std::memory_order_relaxed); }
  // Of bytes_put() and bytes_fetched(), those moved through a client's memfd.
  int64_t shm_bytes_put() const { return shm_bytes_put_.load(std::memory_order_relaxed); }
  int64_t shm_bytes_fetched() const { return shm_bytes_fetched_.load(std::memory_order_relaxed); }
  // Of shm_bytes_put() and shm_bytes_fetched(), those read from or written into the client's
  // own memory (a direct segment), not its memfd.
  int64_t client_memory_bytes_read() const { return client_memory_bytes_read_.load(std::memory_order_relaxed); }
  int64_t client_memory_bytes_written() const { return client_memory_bytes_written_.load(std::memory_order_relaxed); }
  bool shm_transfers() const { return shm_transfers_; }
  // The port this worker listens on, once known: a put reading a client's memory is taken
  // only from a connection to it (read_client_segment); none before.
  void set_listening_port(int port) { listening_port_.store(port, std::memory_order_relaxed); }

 private:
  // A PutShard stream holding a reservation, and when it last received a message.
  struct PutWatch {
    grpc::ServerContext* ctx = nullptr;
    std::atomic<int64_t> progress{0};  // Unix ns
    std::atomic<bool> cancelled{false};
    // Not reading the client's stream: a fan-out's uploader while its broadcast waits on the
    // members (their own stall deadline applies, see CollectiveRun::stall_timeout).
    std::atomic<bool> paused{false};
  };
  std::shared_ptr<PutWatch> watch_put(grpc::ServerContext* ctx);
  void unwatch_put(const std::shared_ptr<PutWatch>& w);

  // DEADLINE_EXCEEDED for a put cancelled for stalling: before its header (no id) or while
  // receiving buffer `id`.
  absl::Status stalled(std::optional<uint64_t> id) const;

  // Validates the header and reserves the memory of the shard it announces.
  absl::StatusOr<ArrayType> reserve_put(const pb::ShardHeader& header);
  // reserve_put, and allocates the destination.
  absl::StatusOr<std::shared_ptr<HostArray>> begin_put(const pb::ShardHeader& header);
  // A put whose bytes a client of this process handed over under `token`: takes the buffer,
  // checks it is the shard the header announces and reserves it.
  absl::StatusOr<std::shared_ptr<const HostArray>> take_handed_over(const pb::ShardChunk& first, uint64_t token);
  // A put whose bytes wait in a co-located client's memfd (header.shm): reserves the shard
  // the header announces and adopts the segment's pages as the buffer (a sealed segment,
  // mapped privately) or copies the block out of it (an unsealed one); on an error
  // (core/shm_transfer.h's), releases the reservation. A segment naming the block in its
  // process's memory (ShmSegment::direct) is read only if that process holds the call's
  // connection, from `peer` (ServerContext::peer) to listening_port_: PERMISSION_DENIED if it
  // does not, FAILED_PRECONDITION if that cannot be told. `direct`: set to whether it was read
  // from the process's memory.
  absl::StatusOr<std::shared_ptr<const HostArray>> read_client_segment(const pb::ShardChunk& first,
                                                                       const std::string& peer, bool* direct);
  // Before a put reads, or a fetch writes, process `pid`'s memory (a direct segment): OK only
  // if client_memory_ and `pid` holds the call's connection from `peer` (check_peer_process):
  // PERMISSION_DENIED if it does not; FAILED_PRECONDITION (the client then copies through a
  // memfd) if that cannot be told or client_memory_ is off.
  absl::Status check_client_memory(int32_t pid, const std::string& peer) const;

  // The broadcast of a fan-out (header.fan_out), checked: two to kMaxFanOut distinct members,
  // this device among them, each address vouched for by the coordinator (PERMISSION_DENIED
  // otherwise); INVALID_ARGUMENT naming what is wrong.
  absl::StatusOr<CollectiveRun> fan_out_run(grpc::ServerContext* ctx, const pb::ShardHeader& header) const;
  // Runs this member's part of `run`: the uploader sends `data` (whose bytes `input_ready`,
  // if set, brings in as the broadcast needs them: CollectiveRun::input_ready); another member
  // receives into a buffer of the header's type, reserved here. Either way the result is
  // committed as the header's buffer, or the reservation released.
  absl::Status fan_out(const CollectiveRun& run, const pb::ShardHeader& header, std::shared_ptr<const HostArray> data,
                       pb::PutShardReply* reply, std::function<absl::Status(int64_t)> input_ready = nullptr);
  // Stores a put's buffer `id`, counted as bytes put.
  void commit_put(uint64_t id, std::shared_ptr<const HostArray> data, pb::PutShardReply* reply);

  BufferStore* const store_;
  const Authenticator* const auth_;
  const WorkerDevice* const device_;
  ProfileRecorder* const profile_;
  const absl::Duration put_stall_timeout_;
  const bool in_process_;
  const bool shm_transfers_;
  const bool client_memory_;
  Transport* const transport_;
  std::atomic<int> listening_port_{0};
  std::atomic<int64_t> bytes_put_{0}, bytes_fetched_{0};          // PutShard / GetShard, whole shards
  std::atomic<int64_t> shm_bytes_put_{0}, shm_bytes_fetched_{0};  // of which through clients' memfds
  // Of which straight from or into the clients' memory (direct segments).
  std::atomic<int64_t> client_memory_bytes_read_{0}, client_memory_bytes_written_{0};
  std::atomic<int64_t> bytes_fanned_out_{0};  // received from fan-out peers

  absl::Mutex puts_mu_;
  std::set<std::shared_ptr<PutWatch>> puts_ ABSL_GUARDED_BY(puts_mu_);

  // Last: the stall watch uses everything above.
  absl::Notification stopping_;
  std::thread stall_watch_;
};

}  // namespace tessera

#endif  // TESSERA_WORKER_TRANSFERS_H_
