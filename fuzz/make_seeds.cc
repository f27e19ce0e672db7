// fuzz_seeds: writes the seed corpus of fuzz/ (fuzz/corpus/<target>/seed-*) from real
// programs: the digits MLP's training step (examples/mlp_model.h), a shard_map ring matmul with
// psum, psum_scatter, ppermute and axis_index, the gradient of a scan, and the gradient of rev,
// a strided slice and take, traced and compiled for a (4, 2) mesh as the coordinator does; their Compile requests,
// their LoadPlan requests, and the Exchange, PutShard and RunCollective messages of their runs. Deterministic: a rerun
// rewrites the same bytes unless the wire format or the compiler changed.
//
//   build/bin/fuzz_seeds fuzz/corpus      # ./dev fuzz-seeds
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "coordinator/block_moves.h"
#include "coordinator/compiler/partition.h"
#include "coordinator/compiler/propagate.h"
#include "core/slicing.h"
#include "core/wire.h"
#include "examples/mlp_model.h"
#include "proto/rpc.h"
#include "proto/tessera.pb.h"
#include "tessera/grad.h"
#include "tessera/shard_map.h"
#include "worker/collectives/shm_ring.h"

namespace tessera {
namespace {

std::string root;

void write(const std::string& target, const std::string& name, const std::string& bytes) {
  std::filesystem::create_directories(root + "/" + target);
  const std::string path = root + "/" + target + "/seed-" + name;
  std::ofstream out(path, std::ios::binary);
  out << bytes;
  out.close();
  if (!out) {
    std::fprintf(stderr, "fuzz_seeds: could not write %s\n", path.c_str());
    std::exit(1);
  }
  std::printf("%s: %zu bytes\n", path.c_str(), bytes.size());
}

std::string le16(size_t n) { return std::string{static_cast<char>(n & 0xff), static_cast<char>(n >> 8)}; }

// A traced program's Compile request, and the LoadPlan request of what it compiles to.
bool program_seeds(const std::string& name, const TracedFunction& f, const std::vector<ArrayType>& types,
                   const Mesh& mesh, const std::vector<PartitionSpec>& specs) {
  absl::StatusOr<Graph> graph = trace(f, types);
  const std::vector<std::optional<PartitionSpec>> outputs(graph.ok() ? graph->outputs().size() : 0);
  absl::StatusOr<Propagation> p = graph.ok() ? propagate(*graph, mesh, specs, outputs) : graph.status();
  absl::StatusOr<Executable> e = p.ok() ? partition(*graph, mesh, *p, outputs, {}) : p.status();
  if (!e.ok()) {
    std::fprintf(stderr, "fuzz_seeds: %s: %s\n", name.c_str(), e.status().ToString().c_str());
    return false;
  }
  pb::CompileRequest compile;
  to_proto(*graph, compile.mutable_graph());
  to_proto(mesh, compile.mutable_mesh());
  for (const PartitionSpec& s : specs) to_proto(s, compile.add_input_specs());
  write("graph", name, compile.SerializeAsString());
  pb::LoadPlanRequest load;
  load.set_plan_id(1);
  to_proto(e->program, load.mutable_plan());
  to_proto(e->mesh, load.mutable_mesh());
  for (int d : e->mesh.device_ids()) {
    pb::PeerAddress* peer = load.add_peers();
    peer->set_device_id(d);
    peer->set_address("127.0.0.1:" + std::to_string(7000 + d));
  }
  write("plan", name, load.SerializeAsString());
  return true;
}

// An Exchange message as Transport writes it (the header, then field 5 by hand), with the
// fuzzer's 3-byte prefix (split offset, length).
std::string exchange_record(int source, uint64_t op, int step, int chunk, const std::string& data, int split,
                            uint64_t run_tag = 0) {
  pb::ExchangeMessage m;
  m.set_source_device(source);
  m.set_op_id(op);
  m.set_step(step);
  m.set_chunk(chunk);
  m.set_data(data);
  m.set_run_tag(run_tag);  // protobuf writes field 10 after the data; Transport before it
  const std::string bytes = m.SerializeAsString();
  return std::string(1, static_cast<char>(split)) + le16(bytes.size()) + bytes;
}

std::string floats(int n) {
  std::string s;
  for (int i = 0; i < n; ++i) {
    const float x = 0.5f * static_cast<float>(i) - 3.0f;
    s.append(reinterpret_cast<const char*>(&x), sizeof x);
  }
  return s;
}

// Device 0's part of a ReshardArray of `shape` f32 from `from` to `to`, as the coordinator's
// reshard_array() writes it (plan_reshard_parts), after the fuzzer's prefix: the ShardHeader of
// device 0's input block. REQUIRES: device 0 holds a block of both.
std::string reshard_record(const Shape& shape, const NamedSharding& from, const NamedSharding& to) {
  ReshardPart part = plan_reshard_parts(shape, from, to)[0];
  pb::WorkerReshardRequest& r = part.request;
  r.set_op_id(1000);
  if (r.sends_size() > 0) r.set_input_buffer(7);
  r.set_output_buffer(1000);
  to_proto(block_shape(*part.out_block), r.mutable_output_shape());
  r.set_dtype(pb::F32);
  r.set_timeout_ms(10000);
  for (int d : to.mesh().device_ids()) {
    pb::PeerAddress* peer = r.add_peers();
    peer->set_device_id(d);
    peer->set_address("127.0.0.1:" + std::to_string(7000 + d));
  }
  pb::ShardHeader held;
  held.set_buffer_id(7);
  held.set_dtype(pb::F32);
  to_proto(block_shape(*part.in_block), held.mutable_shape());
  const std::string h = held.SerializeAsString();
  return le16(h.size()) + h + r.SerializeAsString();
}

// A real ring's segment after `records` writes: its header page and the bytes written.
std::string ring_segment(const std::vector<std::pair<ShmRing::Record, std::string>>& records) {
  constexpr uint64_t kToken = 0x5eed'7e55'e7a1'0001;  // fuzz/shm_ring_fuzzer.cc's
  absl::StatusOr<std::unique_ptr<ShmRing>> ring = ShmRing::create(ShmRing::kMinBytes, kToken);
  if (!ring.ok()) return "";
  int64_t written = 0;
  for (const auto& [record, data] : records) {
    (*ring)->write(record, reinterpret_cast<const std::byte*>(data.data()), absl::InfiniteFuture());
    written += (static_cast<int64_t>(sizeof(ShmRing::Record)) + record.bytes + 7) / 8 * 8;
  }
  std::string bytes(static_cast<size_t>(ShmRing::kHeaderBytes + written), '\0');
  if (pread((*ring)->fd(), bytes.data(), bytes.size(), 0) != static_cast<ssize_t>(bytes.size())) bytes.clear();
  return bytes;
}

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) {
  using namespace tessera;
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_seeds CORPUS_DIR (fuzz/corpus)\n");
    return 2;
  }
  root = argv[1];
  const Mesh mesh = *make_mesh({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7});
  bool ok = true;

  // The digits MLP step as example_mlp_train jits it: 64 pixels, 32 hidden units over 'model'.
  const std::vector<ArrayType> mlp_types = {{DType::kF32, {64, 32}}, {DType::kF32, {32}},     {DType::kF32, {32, 10}},
                                            {DType::kF32, {10}},     {DType::kF32, {16, 64}}, {DType::kF32, {16, 10}}};
  ok = program_seeds("digits_mlp_step", mlp::train_step(0.1), mlp_types, mesh,
                     {P(None, "model"), P("model"), P("model", None), P(), P("data", None), P("data", None)}) &&
       ok;

  // shard_map: a matmul with its contracting dimension over 'model' (psum, psum_scatter) and
  // a ring over 'data' (ppermute, axis_index), inside one jitted function.
  ShardMapped body = shard_map(
      [](const std::vector<Value>& in) {
        const Value partial = matmul(in[0], in[1]);
        const Value summed = psum(partial, "model");
        const Value scattered = psum_scatter(partial, "model", /*scatter_dimension=*/1, /*tiled=*/true);
        const Value me = convert(axis_index("data"), DType::kF32);
        const Value ring = ppermute(summed, "data", {{0, 1}, {1, 2}, {2, 3}, {3, 0}});
        return std::vector<Value>{ring + me, scattered};
      },
      mesh, {P("data", "model"), P("model", None)}, {P("data", None), P("data", "model")});
  ok = program_seeds("shard_map_ring",
                     [&body](const std::vector<Value>& in) {
                       std::vector<Value> out = body({tanh(in[0]), in[1]});
                       return std::vector<Value>{out[0], sum(out[1], {0})};
                     },
                     {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}}, mesh, {P("data", "model"), P("model", None)}) &&
       ok;

  // The gradient of a scan over stacked weights (a layer loop, as the transformer's): the scan
  // VJP's forward loop has a result node per residual, all sharing one body, so the Compile
  // request has sub-graph tables (protocol 19) and the plan has loop instructions.
  const TracedFunction layers = [](const std::vector<Value>& in) {
    const ScanResult r = scan(
        [](const std::vector<Value>& c, const std::vector<Value>& w) {
          const Value next = tanh(matmul(c[0], w[0]));
          return ScanStep{{next}, {}};
        },
        {in[0]}, {in[1]});
    return std::vector<Value>{sum(r.carry[0] * r.carry[0], {0, 1})};
  };
  ok = program_seeds("scan_grad", value_and_grad(layers, {1}), {{DType::kF32, {16, 8}}, {DType::kF32, {3, 8, 8}}}, mesh,
                     {P("data", None), P()}) &&
       ok;

  // Indexing: rev of a dimension split over 'data' (a permute of the blocks), a strided slice
  // (x[::2]) of it, and an embedding lookup from a table split over 'model' (hidden), all
  // through value_and_grad, so the plan also holds their transposes (pad/scatter_add).
  const TracedFunction indexing = [](const std::vector<Value>& in) {
    const Value flipped = rev(in[0], {0});
    const Value every_other = slice(flipped, {0, 0}, {16, 8}, {2, 1});
    const Value looked_up = take(in[1], in[2], 0);
    return std::vector<Value>{sum(every_other * every_other, {0, 1}) + sum(tanh(looked_up), {0, 1})};
  };
  ok = program_seeds("indexing_grad", value_and_grad(indexing, {0, 1}),
                     {{DType::kF32, {16, 8}}, {DType::kF32, {10, 8}}, {DType::kI32, {6}}}, mesh,
                     {P("data", "model"), P(None, "model"), P()}) &&
       ok;

  // Exchange: a collective's data messages on one stream (one split inside the header, one in
  // the data), then a notice of lost ops, each with its run tag (lost_op_tags, protocol 29).
  pb::ExchangeMessage notice;
  notice.set_source_device(3);
  notice.add_lost_ops(41);
  notice.add_lost_ops(42);
  notice.add_lost_op_tags(0x5eed5eed5eed5eedULL);
  notice.add_lost_op_tags(0x5eed5eed5eed5eedULL);
  const std::string notice_bytes = notice.SerializeAsString();
  write("exchange", "all_reduce_steps",
        exchange_record(3, 42, 0, 0, floats(16), 4) + exchange_record(3, 42, 1, 0, floats(16), 30) +
            exchange_record(3, 42, 1, 1, floats(3), 0) + std::string(1, '\2') + le16(notice_bytes.size()) +
            notice_bytes);
  // A message claiming device 1, then device 3's own: on a stream authenticated as device 3
  // the first is dropped as forged and the second filed; in the development mode the first
  // names the stream's sender and the second is a change of sender.
  write("exchange", "forged_then_own",
        exchange_record(1, 43, 0, 0, floats(4), 2) + exchange_record(3, 43, 0, 0, floats(4), 5));
  // Messages of one run (its random tag in field 10), then one of another run at the same op.
  write("exchange", "run_tags",
        exchange_record(3, 44, 0, 0, floats(8), 3, 0x7a91'3c05'e2d4'b816) +
            exchange_record(3, 44, 1, 0, floats(8), 9, 0x7a91'3c05'e2d4'b816) +
            exchange_record(3, 44, 0, 0, floats(8), 1, 0x0bad'0bad'0bad'0bad));

  // PutShard: a (4, 8) f32 shard in a header message with the first 64 bytes, then the rest.
  pb::ShardChunk first;
  first.mutable_header()->set_buffer_id(7);
  first.mutable_header()->set_dtype(pb::F32);
  first.mutable_header()->mutable_shape()->add_dims(4);
  first.mutable_header()->mutable_shape()->add_dims(8);
  const std::string data = floats(32);
  first.set_data(data.substr(0, 64));
  pb::ShardChunk rest;
  rest.set_data(data.substr(64));
  const std::string a = first.SerializeAsString(), b = rest.SerializeAsString();
  write("put_shard", "f32_4x8_two_chunks", le16(a.size()) + a + le16(b.size()) + b);

  // CreateArray (16, 8) f32 over P('data', 'model'), then each collective kind on it.
  pb::CreateArrayRequest create;
  create.set_dtype(pb::F32);
  create.mutable_shape()->add_dims(16);
  create.mutable_shape()->add_dims(8);
  to_proto(NamedSharding(mesh, P("data", "model")), create.mutable_sharding());
  const std::string create_bytes = create.SerializeAsString();
  struct Case {
    const char* name;
    CollectiveKind kind;
    std::vector<std::string> axes;
  };
  for (const Case& c : {Case{"all_reduce_model", CollectiveKind::kAllReduce, {"model"}},
                        Case{"all_gather_data", CollectiveKind::kAllGather, {"data"}},
                        Case{"reduce_scatter_model", CollectiveKind::kReduceScatter, {"model"}},
                        Case{"all_to_all_all", CollectiveKind::kAllToAll, {"data", "model"}},
                        Case{"permute_data", CollectiveKind::kCollectivePermute, {"data"}},
                        Case{"broadcast_data", CollectiveKind::kBroadcast, {"data"}}}) {
    CollectiveSpec spec;
    spec.kind = c.kind;
    spec.groups = *replica_groups(mesh, c.axes);
    spec.dimension = c.kind == CollectiveKind::kReduceScatter ? 1 : 0;
    spec.split_dimension = 0;
    spec.concat_dimension = 1;
    if (c.kind == CollectiveKind::kCollectivePermute) {
      for (const std::vector<int>& g : spec.groups) {
        for (size_t i = 0; i < g.size(); ++i) spec.pairs.emplace_back(g[i], g[(i + 1) % g.size()]);
      }
    }
    spec.root = c.kind == CollectiveKind::kBroadcast ? 1 : 0;
    pb::RunCollectiveRequest run;
    run.set_array_id(1);
    to_proto(spec, run.mutable_spec());
    run.set_timeout_ms(10000);
    write("requests", c.name, le16(create_bytes.size()) + create_bytes + run.SerializeAsString());
  }

  // Reshard: device 0's part of (16, 8) f32 from P('data', 'model') to P('data', None) (a
  // local copy and a piece each way with device 1); and the same with every piece local (its
  // remote receive taken from its remote send's box instead: the same shape).
  const NamedSharding split(mesh, P("data", "model")), rows(mesh, P("data", None));
  const std::string reshard = reshard_record({16, 8}, split, rows);
  write("reshard", "split_to_rows_device0", reshard);
  {
    pb::ShardHeader held;
    pb::WorkerReshardRequest r;
    const size_t n = static_cast<uint8_t>(reshard[0]) | static_cast<uint8_t>(reshard[1]) << 8;
    held.ParseFromString(reshard.substr(2, n));
    r.ParseFromString(reshard.substr(2 + n));
    int remote_send = -1;
    for (pb::BlockPiece& p : *r.mutable_sends()) {
      if (p.peer() != 0) remote_send = p.tag();
      p.set_peer(0);
    }
    for (pb::BlockPiece& p : *r.mutable_receives()) {
      if (p.peer() != 0) p.set_tag(remote_send);
      p.set_peer(0);
    }
    write("reshard", "all_local", reshard.substr(0, 2 + n) + r.SerializeAsString());
  }

  // ReshardArray of that (16, 8) array: to rows, to every device whole, to the transposed
  // split on a (2, 4) mesh of the devices in another order.
  const Mesh other = *make_mesh({2, 4}, {"a", "b"}, {7, 6, 5, 4, 3, 2, 1, 0});
  for (const auto& [name, target] : {std::pair{"to_rows", rows}, std::pair{"to_replicated", NamedSharding(mesh, P())},
                                     std::pair{"to_other_mesh", NamedSharding(other, P("b", "a"))}}) {
    pb::ReshardArrayRequest r;
    r.set_array_id(1);
    to_proto(target, r.mutable_sharding());
    r.set_timeout_ms(10000);
    write("reshard_array", name, le16(create_bytes.size()) + create_bytes + r.SerializeAsString());
  }

  // RegisterWorker after a coordinator restart: the 8 workers of the (4, 2) mesh, each
  // holding its (4, 4) f32 block of an array of the earlier coordinator (and device 0 one
  // more buffer), then AdoptArrays of that array.
  const uint64_t earlier_epoch = uint64_t{1'600'000'000'000'000} << 8;  // fuzz_register starts at 1.7e9 s
  const uint64_t array_id = earlier_epoch + 5;
  std::string registrations(1, static_cast<char>(8));
  for (int d = 0; d < 8; ++d) {
    pb::RegisterWorkerRequest r;
    r.set_protocol_version(kProtocolVersion);
    r.set_name("w" + std::to_string(d));
    r.set_address("127.0.0.1:" + std::to_string(7000 + d));
    r.set_requested_device_id(d);
    r.set_memory_bytes(int64_t{1} << 30);
    r.set_previous_incarnation(1);
    r.set_previous_epoch(earlier_epoch);
    for (uint64_t id : d == 0 ? std::vector<uint64_t>{array_id, array_id + 1} : std::vector<uint64_t>{array_id}) {
      pb::ShardHeader* h = r.add_held_buffers();
      h->set_buffer_id(id);
      h->set_dtype(pb::F32);
      to_proto(Shape{4, 4}, h->mutable_shape());
    }
    const std::string bytes = r.SerializeAsString();
    registrations += le16(bytes.size()) + bytes;
  }
  pb::AdoptArraysRequest adopt;
  pb::ArrayInfo* info = adopt.add_arrays();
  info->set_array_id(array_id);
  info->set_dtype(pb::F32);
  to_proto(Shape{16, 8}, info->mutable_shape());
  to_proto(split, info->mutable_sharding());
  adopt.set_session_id(1);
  write("register", "restart_adopt_16x8", registrations + adopt.SerializeAsString());

  // A peer's shared-memory ring with three messages (one empty), as Link writes them.
  const std::string ring = ring_segment({{ShmRing::Record{42, 0, 0, 64, 0x7a91'3c05'e2d4'b816}, floats(16)},
                                         {ShmRing::Record{42, 1, 0, 0, 0x7a91'3c05'e2d4'b816}, ""},
                                         {ShmRing::Record{43, 0, 1, 12, 0x7a91'3c05'e2d4'b816}, floats(3)}});
  if (ring.empty()) {
    std::fprintf(stderr, "fuzz_seeds: no shared-memory ring\n");
    ok = false;
  } else {
    write("shm_ring", "three_messages", ring);
  }
  return ok ? 0 : 1;
}
