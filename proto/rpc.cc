#include "proto/rpc.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "proto/in_process.h"

namespace tessera {
namespace {

// HTTP/2 flow-control window per stream. gRPC's 64 KiB default makes a 1 MiB chunk wait for
// many window updates, each a wake-up of a busy peer process.
constexpr int kStreamWindowBytes = 16 << 20;
constexpr int kKeepaliveMs = 5000;

// Calls that are safe to send twice are retried on UNAVAILABLE (a connection found dead only
// when the call was written on it, as after a coordinator restart: gRPC notices an idle
// connection's end late), at most 4 times within the call's deadline. Never Execute,
// CreateArray or RunCollective: a second one would run again.
constexpr char kRetryServiceConfig[] = R"json({
  "methodConfig": [{
    "name": [
      {"service": "tessera.pb.Coordinator", "method": "Handshake"},
      {"service": "tessera.pb.Coordinator", "method": "GetTopology"},
      {"service": "tessera.pb.Coordinator", "method": "GetArray"},
      {"service": "tessera.pb.Coordinator", "method": "DeleteArray"},
      {"service": "tessera.pb.Coordinator", "method": "AdoptArrays"},
      {"service": "tessera.pb.Coordinator", "method": "OpenSession"},
      {"service": "tessera.pb.Coordinator", "method": "RenewLease"},
      {"service": "tessera.pb.Coordinator", "method": "Compile"},
      {"service": "tessera.pb.Coordinator", "method": "GetClusterStatus"},
      {"service": "tessera.pb.Worker", "method": "Handshake"},
      {"service": "tessera.pb.Worker", "method": "GetStats"}
    ],
    "retryPolicy": {
      "maxAttempts": 4,
      "initialBackoff": "0.05s",
      "maxBackoff": "0.5s",
      "backoffMultiplier": 2,
      "retryableStatusCodes": ["UNAVAILABLE"]
    }
  }]
})json";

}  // namespace

absl::Duration transfer_deadline(int64_t bytes) {
  constexpr double kFloorBytesPerSecond = 16.0 * (1 << 20);
  return kControlDeadline + absl::Seconds(static_cast<double>(bytes) / kFloorBytesPerSecond);
}

grpc::Status to_grpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // The message travels in a header, and gRPC bounds a response's metadata (8 KiB by default):
  // a longer one fails the call with "metadata size exceeds limit", losing the code and the
  // reason. Cut at kMaxStatusMessage bytes, saying how much was cut.
  const absl::string_view message = status.message();
  if (message.size() <= kMaxStatusMessage) {
    return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(message));
  }
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      absl::StrCat(message.substr(0, kMaxStatusMessage), "... (", message.size() - kMaxStatusMessage,
                                   " more bytes cut)"));
}

absl::Status from_grpc(const grpc::Status& status, absl::string_view who) {
  if (status.ok()) return absl::OkStatus();
  // gRPC's own words for a peer that never answered say nothing about the peer.
  const bool silent =
      status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && status.error_message() == "Deadline Exceeded";
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(who, ": ",
                                   silent ? "no answer before the deadline (the process may be stopped, hung or "
                                            "unreachable)"
                                          : status.error_message()));
}

void set_deadline(grpc::ClientContext* ctx, absl::Duration timeout) {
  // Beyond a year is no deadline: now + an enormous duration would overflow the clock into
  // the past (and fail the call at once).
  if (timeout > absl::Hours(24 * 365)) {
    ctx->set_deadline(std::chrono::system_clock::time_point::max());
    return;
  }
  ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMicroseconds(timeout));
}

absl::Status check_protocol_version(uint32_t theirs, absl::string_view who) {
  if (theirs == kProtocolVersion) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(who, " speaks Tessera protocol version ", theirs,
                                                    " but this build speaks version ", kProtocolVersion,
                                                    "; run matching builds of the client, coordinator and workers"));
}

absl::Status check_max_sync_threads(int max_sync_threads, absl::string_view flag) {
  if (max_sync_threads >= 2 && max_sync_threads <= 65536) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(flag, "=", max_sync_threads,
                   ": must be 2 to 65536 (one thread polls for calls; the others serve synchronous calls)"));
}

void configure_server(grpc::ServerBuilder* builder, int max_sync_threads) {
  // gRPC's sync server otherwise makes a thread per waiting call, without bound. The builder
  // keeps its own reference to the quota.
  grpc::ResourceQuota quota;
  quota.SetMaxThreads(max_sync_threads);
  builder->SetResourceQuota(quota);
  builder->AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder->SetMaxReceiveMessageSize(static_cast<int>(kMaxMessageBytes));
  // Accept the clients' keepalive pings (see make_channel).
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, kKeepaliveMs / 2);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  // And ping them too: a client that vanished without closing its connection (link cut)
  // ends its streams here (a peer's Exchange stream, say) instead of leaving them open.
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveMs);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveMs);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kStreamWindowBytes);
  // Collective chunks (up to 1 MiB) travel as one HTTP/2 frame and are read in few syscalls;
  // the window is fixed (no BDP pings to wake peers). Two idle pollers are plenty: every
  // extra thread is one more to schedule on a machine running several daemons per core.
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 4 << 20);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  builder->SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MIN_POLLERS, 1);
  builder->SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS, 2);
  builder->AddChannelArgument(GRPC_ARG_TCP_READ_CHUNK_SIZE, 1 << 20);
  builder->AddChannelArgument(GRPC_ARG_TCP_MIN_READ_CHUNK_SIZE, 64 << 10);
  builder->AddChannelArgument(GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, 4 << 20);
}

grpc::ChannelArguments channel_arguments() {
  grpc::ChannelArguments args;
  // Shards travel in chunks of at most kMaxChunkBytes; leave headroom for framing.
  args.SetMaxReceiveMessageSize(static_cast<int>(kMaxMessageBytes));
  // The servers' limit too: a request over it fails here with RESOURCE_EXHAUSTED naming the
  // sizes, rather than being cut off by the server mid-stream.
  args.SetMaxSendMessageSize(static_cast<int>(kMaxMessageBytes));
  // Fail fast on a dead peer instead of backing off for minutes.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kStreamWindowBytes);
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 4 << 20);
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  // A peer that vanishes without closing its connections (host down, link cut) is noticed
  // within kKeepaliveMs plus the ping timeout, and the long-lived streams to it fail.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 1);
  args.SetServiceConfigJSON(kRetryServiceConfig);
  return args;
}

std::shared_ptr<grpc::Channel> make_channel(const std::string& address) {
  if (is_in_process_address(address)) return in_process_channel(address, channel_arguments(), {});
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), channel_arguments());
}

}  // namespace tessera
