// Fuzz target: one peer's Exchange stream as a worker reads it (Transport::deliver, which
// the stream's reader calls for each message, and the mailbox it files messages into).
//
// The input is a run of messages, each 3 bytes then its bytes: the offset where gRPC's slices
// split it (the first byte, modulo its length + 1) and its length (two bytes, little endian).
// Messages are delivered in order until one is rejected (the reader then ends the stream).
// Each accepted data message must be what protobuf itself parses from the same bytes, and be
// received under its tag with exactly those data bytes. Each input runs twice: on a stream of
// the development mode (no authenticated device) and on one authenticated as device 3 (the
// seeds' sender), where an accepted message claiming another device must be dropped and
// counted, leaving the mailbox and the stream's source as they were.
// An op stays open (claimed by its first receive, with that message's run tag) until a message
// of another op comes: a later message of it under another tag is dropped and counted as
// forged, never filed (the run-tag check), and so is each op a notice names under another tag
// than its claim's; it is then finished, and its later messages dropped as late.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <set>

#include "fuzz/fuzz_check.h"
#include "grpcpp/support/byte_buffer.h"
#include "proto/tessera.pb.h"
#include "worker/collectives/transport.h"

using namespace tessera;

namespace {

constexpr int kAuthenticated = 3;

void run_stream(const uint8_t* data, size_t size, int authenticated_source) {
  Transport transport;
  transport.set_self(0);
  int source = -1;
  std::optional<uint64_t> open_op;       // received, not finished yet
  std::map<uint64_t, uint64_t> claimed;  // op: the run tag of its first receive, until it finishes
  std::set<uint64_t> finished;
  size_t pos = 0;
  while (pos + 3 <= size) {
    const size_t cut = data[pos];
    const size_t length = std::min<size_t>(data[pos + 1] | data[pos + 2] << 8, size - pos - 3);
    const char* bytes = reinterpret_cast<const char*>(data + pos + 3);
    pos += 3 + length;
    const size_t split = cut % (length + 1);
    grpc::Slice slices[2] = {grpc::Slice(bytes, split), grpc::Slice(bytes + split, length - split)};
    grpc::ByteBuffer buffer(slices, 2);
    const int64_t pending = transport.pending_messages();
    const int64_t forged = transport.forged_messages();
    const int source_before = source;
    // A message of another op than the open one: the open op ends first (a run's ops end in
    // turn), so that the messages of one op meet its claim.
    if (pb::ExchangeMessage next;
        open_op.has_value() && next.ParseFromArray(bytes, static_cast<int>(length)) && next.op_id() != *open_op) {
      transport.finish_op(*open_op);
      claimed.erase(*open_op);
      finished.insert(*open_op);
      open_op.reset();
    }
    absl::Status delivered = transport.deliver(&buffer, &source, authenticated_source);
    fuzz::check_rejection(delivered, "deliver");
    if (!delivered.ok()) break;
    // What protobuf makes of the same bytes (deliver reads them by hand).
    pb::ExchangeMessage parsed;
    if (!parsed.ParseFromArray(bytes, static_cast<int>(length))) fuzz::fail("deliver accepted", "unparseable bytes");
    if (authenticated_source >= 0 && parsed.source_device() != authenticated_source) {
      fuzz::check(transport.forged_messages() == forged + 1, "a message claiming another device was not counted");
      fuzz::check(transport.pending_messages() == pending, "a message claiming another device was filed");
      fuzz::check(source == source_before, "a message claiming another device set the stream's source");
      continue;
    }
    fuzz::check(parsed.source_device() == source, "deliver's source is not the message's");
    // Under another tag than its claim's (the open op's): wrong for this run.
    auto mismatched = [&](uint64_t op, uint64_t run_tag) {
      auto claim = claimed.find(op);
      return finished.count(op) == 0 && claim != claimed.end() && claim->second != run_tag;
    };
    if (parsed.lost_ops_size() > 0) {  // a notice: counts once for each op it names under another tag
      int64_t wrong = 0;
      for (int i = 0; i < parsed.lost_ops_size(); ++i) wrong += mismatched(parsed.lost_ops(i), parsed.lost_op_tags(i));
      fuzz::check(transport.forged_messages() == forged + wrong,
                  "a notice's ops claimed under another tag were not each counted once as forged");
      fuzz::check(transport.pending_messages() == pending, "a notice was filed");
      continue;
    }
    if (parsed.shm_segment().empty() && mismatched(parsed.op_id(), parsed.run_tag())) {
      fuzz::check(transport.forged_messages() == forged + 1,
                  "a message of a claimed op under another tag was not counted");
      fuzz::check(transport.pending_messages() == pending, "a message of a claimed op under another tag was filed");
      continue;
    }
    fuzz::check(transport.forged_messages() == forged, "a message of the stream's own device was counted as forged");
    if (transport.pending_messages() == pending) continue;  // a repeat, or an offer
    const MessageTag tag{parsed.op_id(), parsed.step(), parsed.chunk(), parsed.run_tag()};
    absl::StatusOr<Received> got = transport.receive(source, "", tag, absl::InfinitePast(), absl::InfinitePast());
    if (!got.ok()) fuzz::fail("an accepted message is not in the mailbox under its tag", got.status().ToString());
    fuzz::check(got->size() == static_cast<int64_t>(parsed.data().size()), "received size differs from protobuf's");
    std::string copy(static_cast<size_t>(got->size()), '\0');
    got->copy_to(reinterpret_cast<std::byte*>(copy.data()));
    fuzz::check(copy == parsed.data(), "received bytes differ from protobuf's");
    if (got->size() % 4 == 0) {
      std::string acc(copy.size(), '\0');
      got->reduce_into(DType::kI32, ReduceOp::kSum, reinterpret_cast<std::byte*>(acc.data()));
      fuzz::check(acc == copy, "0 + data is not data");
    }
    claimed.emplace(tag.op, tag.run_tag);  // its first receive claimed it
    open_op = tag.op;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  run_stream(data, size, -1);
  run_stream(data, size, kAuthenticated);
  return 0;
}
