// A forger's Exchange streams into a worker, for the tests of its checks: it holds the
// cluster token and declares whatever sender it likes (device, coordinator epoch,
// incarnation), as an insider or a stale process could; what the worker answers is what the
// drills check (docs/design.md, "Security"). Also the RegisterWorkerRequest a fake worker
// sends the coordinator (`worker_request`).
//
//   absl::StatusOr<pb::HandshakeReply> r = worker_registration(address, credentials.client);
//   grpc::Status s = exchange_stream(address, credentials.cluster, {2, r->epoch(), 1}, messages);
#ifndef TESSERA_TESTS_SUPPORT_EXCHANGE_STREAM_H_
#define TESSERA_TESTS_SUPPORT_EXCHANGE_STREAM_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "proto/auth.h"
#include "proto/rpc.h"
#include "proto/tessera.grpc.pb.h"

namespace tessera {

// What a stream declares of its sender (0 / -1: not declared).
struct DeclaredSender {
  int device = -1;
  uint64_t epoch = 0;
  uint64_t incarnation = 0;
};

// The registration the worker at `address` holds (its Handshake: epoch and incarnation),
// asked as `identity`.
inline absl::StatusOr<pb::HandshakeReply> worker_registration(const std::string& address,
                                                              std::shared_ptr<const CallIdentity> identity) {
  pb::HandshakeRequest req;
  req.set_protocol_version(kProtocolVersion);
  req.set_peer("exchange_stream.h");
  pb::HandshakeReply reply;
  grpc::ClientContext ctx;
  set_deadline(&ctx, absl::Seconds(10));
  const grpc::Status s = pb::Worker::NewStub(make_channel(address, std::move(identity)))->Handshake(&ctx, req, &reply);
  if (!s.ok()) return from_grpc(s, address);
  return reply;
}
inline absl::StatusOr<pb::HandshakeReply> worker_registration(const std::string& address, const std::string& token) {
  return worker_registration(address, std::make_shared<CallIdentity>(token));
}

// Opens an Exchange stream on `stub` (whose channel's identity says the device), declaring
// `sender`'s epoch and incarnation, writes `messages` (as far as the worker reads them) and
// returns how the worker ended the stream. Bounded by a 20 s deadline.
inline grpc::Status exchange_stream(pb::Worker::Stub* stub, DeclaredSender sender,
                                    const std::vector<pb::ExchangeMessage>& messages) {
  grpc::ClientContext ctx;
  set_deadline(&ctx, absl::Seconds(20));
  if (sender.epoch != 0) ctx.AddMetadata(kEpochKey, absl::StrCat(sender.epoch));
  if (sender.incarnation != 0) ctx.AddMetadata(kIncarnationKey, absl::StrCat(sender.incarnation));
  pb::ExchangeReply reply;
  std::unique_ptr<grpc::ClientWriter<pb::ExchangeMessage>> writer = stub->Exchange(&ctx, &reply);
  for (const pb::ExchangeMessage& m : messages) {
    if (!writer->Write(m)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}
// The same to the worker at `address`, with `token` and `sender`'s device.
inline grpc::Status exchange_stream(const std::string& address, const std::string& token, DeclaredSender sender,
                                    const std::vector<pb::ExchangeMessage>& messages) {
  auto stub = pb::Worker::NewStub(make_channel(address, std::make_shared<CallIdentity>(token, sender.device)));
  return exchange_stream(stub.get(), sender, messages);
}

// A RegisterWorkerRequest as a worker of this protocol sends it: `name` at `address` asking for
// device `device` (-1: any free id) with `memory_bytes` of memory.
inline pb::RegisterWorkerRequest worker_request(const std::string& name, const std::string& address, int device = -1,
                                                int64_t memory_bytes = int64_t{1} << 30) {
  pb::RegisterWorkerRequest req;
  req.set_protocol_version(kProtocolVersion);
  req.set_name(name);
  req.set_address(address);
  req.set_requested_device_id(device);
  req.set_memory_bytes(memory_bytes);
  return req;
}

}  // namespace tessera

#endif  // TESSERA_TESTS_SUPPORT_EXCHANGE_STREAM_H_
