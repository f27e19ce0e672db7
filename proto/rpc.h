// The gRPC edge: protocol version, status conversion, and client-side deadlines.
//
// gRPC 1.51 has no absl::Status bridge; every service and stub converts here, once.
//
//   grpc::Status s = stub->Foo(&ctx, req, &reply);
//   absl::Status st = tessera::from_grpc(s, "device 3 (127.0.0.1:4711)");
#ifndef TESSERA_PROTO_RPC_H_
#define TESSERA_PROTO_RPC_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/status.h"

namespace tessera {

// Bump on any incompatible change to proto/tessera.proto, and on any change to the op table
// (core/op.h: an op's name, wire number, arity, what it is given or its attributes' kind),
// which kOpTableDigest records: op_table_test fails until both are updated together. (8: one
// SPMD program per executable; 9: the op table and its OpCodes; 10: ids carry the
// coordinator's epoch; 11: sessions and leases; 12: typed op attributes, a KernelNode oneof;
// 13: credentials, session credentials and array grants; 14: mesh axis types; 15: the
// indexing ops and rem, GatherAttrs and DynamicSliceAttrs; 16: scan, ScanAttrs and loop instructions; stop_gradient,
// argsort; calls name in-flight calls' outputs (ExecuteRequest.pending_inputs), and ExecuteReply carries only ids and
// grants; uint32, random_bits with RandomBitsAttrs, shift_right_logical, erf_inv. 17: the Profile RPC of both
// services; while and switch (BranchesAttrs, the SWITCH instruction); the dtypes bfloat16, float16, uint8, int8,
// int16. 18: a worker's heartbeat says it drains (HeartbeatRequest.draining, DeviceInfo.draining). 19: a Graph's
// sub-graphs in one table (Graph.subgraphs), which ScanAttrs.body and BranchesAttrs.graphs index. 20: a worker's
// HandshakeReply says which registration it holds (epoch, incarnation). 21: ReshardArray and the workers' Reshard
// (device_put of an array already on devices). 22: a replicated put's fan-out (ShardHeader.fan_out,
// CreateArrayReply.peers, PeerAddress.grant). 23: ShardingAttrs.manual_axes (a shard_map body manual over some
// axes only, its work split over the others). 24: a drained worker deregisters (HeartbeatRequest.leaving, the
// DeviceState LEFT); the pvary op (OP_PVARY, lax.pvary / pcast to 'varying'). 25: the ragged_all_to_all op
// (OP_RAGGED_ALL_TO_ALL, six operands) and its collective kind RAGGED_ALL_TO_ALL, an instruction of six inputs. 26: a
// PartitionSpec's unreduced and reduced axes (PartitionSpec.unreduced, .reduced). 27: a worker's Exchange
// streams declare its registration (tessera-epoch, tessera-incarnation) and the coordinator's RegisterWorker and
// Heartbeat replies name the alive devices (the tessera-peers trailer); a worker refuses streams of other senders. 28:
// each run's collectives carry a random run tag (RunPlanRequest, WorkerCollectiveRequest and
// WorkerReshardRequest.run_tag, ExchangeMessage.run_tag), and a worker drops Exchange messages whose tag is not their
// run's: a worker of 27 sends none. 29: a put's fan-out carries the client's random run tag (ShardFanOut.run_tag),
// and a notice of lost ops the tag of each (ExchangeMessage.lost_op_tags); a worker refuses a run, collective, reshard
// or fan-out of tag 0 and ignores a notice whose tag is not its op's run's: a worker of 28 sends tag 0 and untagged
// notices. 30: SliceAttrs.strides (lax.slice's strides), which a worker of 29 would ignore. 31: the alive devices
// travel in the RegisterWorker and Heartbeat replies (ClusterPeers), no longer in the tessera-peers trailer, whose
// 8 KiB metadata bound held about a thousand devices; a worker of 30 cannot register with a coordinator of 31,
// which checks the version exactly. 32: the rev op (OP_REV, lax.rev, ReduceAttrs). 33: GatherAttrs.batch_dims (a
// batched one-axis gather / scatter), which a worker of 32 would ignore. 34: the cluster view is versioned
// (ClusterPeers.version, HeartbeatRequest.view_version) and a Heartbeat reply carries it only when the worker's
// version is not the current one (a worker of 33 is refused at registration: the coordinator checks the version
// exactly).)
inline constexpr uint32_t kProtocolVersion = 34;
inline constexpr uint64_t kOpTableDigest = 0x4a21795196e7679d;

// Largest data payload of one ShardChunk (gRPC's default message limit is 4 MiB).
inline constexpr int64_t kMaxChunkBytes = 1 << 20;

// Largest message a Tessera server receives, and a Tessera channel sends or receives: a
// chunk with headroom for framing. Larger requests fail RESOURCE_EXHAUSTED.
inline constexpr int64_t kMaxMessageBytes = 4 * kMaxChunkBytes;

// Deadline of a small control RPC.
inline constexpr absl::Duration kControlDeadline = absl::Seconds(10);

// Deadline of the first contact with a peer (its handshake). That call waits for the
// connection (wait_for_ready): a listener that has only just started can refuse a first
// connect for a moment, and this machine's sandbox has been seen doing so under load.
inline constexpr absl::Duration kConnectDeadline = absl::Seconds(5);

// Deadline of a transfer of `bytes`: a base plus a floor rate of 16 MiB/s, so a stuck peer
// fails a transfer within bounded time while a slow but live one completes.
absl::Duration transfer_deadline(int64_t bytes);

// An OK grpc::Status carries no message; everything else keeps its code and message, the
// message cut after kMaxStatusMessage bytes (gRPC's metadata bound would fail the call).
inline constexpr size_t kMaxStatusMessage = 4096;
grpc::Status to_grpc(const absl::Status& status);

// Converts a gRPC status to absl, prefixing the message with `who` (the peer), so the
// caller sees which device or service failed.
absl::Status from_grpc(const grpc::Status& status, absl::string_view who);

// Sets the deadline of `ctx` to now + `timeout` (none for more than a year, so that a huge
// timeout never overflows the clock).
void set_deadline(grpc::ClientContext* ctx, absl::Duration timeout);

// Checks a peer's protocol version against ours.
absl::Status check_protocol_version(uint32_t theirs, absl::string_view who);

// Threads a daemon's gRPC server may use for its synchronous calls by default (its pollers
// among them); see configure_server.
inline constexpr int kDefaultMaxSyncThreads = 256;

// Applies the server settings Tessera uses everywhere: no SO_REUSEPORT (with it, two servers
// binding port 0 can be handed the same port and split each other's connections), a receive
// limit that fits a kMaxChunkBytes chunk, and a thread quota: at most `max_sync_threads`
// threads serve the synchronous methods (callback methods do not count, nor use them). gRPC
// 1.51 answers a synchronous call that finds no thread RESOURCE_EXHAUSTED "Server Threadpool
// Exhausted" at once (docs/design.md, "Bounds"), so at most max_sync_threads - 1 such calls
// run at once (one thread keeps polling).
// REQUIRES: check_max_sync_threads(max_sync_threads, ...) is OK.
void configure_server(grpc::ServerBuilder* builder, int max_sync_threads = kDefaultMaxSyncThreads);

// INVALID_ARGUMENT naming `flag` unless 2 <= max_sync_threads <= 65536 (gRPC aborts the
// process when it cannot start its one poller; one handler thread at least).
absl::Status check_max_sync_threads(int max_sync_threads, absl::string_view flag);

// The channel settings Tessera uses everywhere (limits, keepalive, retries).
grpc::ChannelArguments channel_arguments();

// A channel to `address` with channel_arguments() that sends no credentials (a cluster in
// the development mode, health probes). proto/auth.h has the one that sends them. An
// in-process address (proto/in_process.h) gets an in-process channel to that server.
std::shared_ptr<grpc::Channel> make_channel(const std::string& address);

}  // namespace tessera

#endif  // TESSERA_PROTO_RPC_H_
