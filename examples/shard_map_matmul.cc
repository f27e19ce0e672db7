// example_shard_map: the classic shard_map matmuls of JAX's documentation on
// Client::local(8), each checked against the product computed on the host:
//
//   (a) the contracting dimension split over 'j': each device multiplies its blocks, psum
//       over 'j' adds the partial products (result P('i', None));
//   (b) the same finishing with psum_scatter, which leaves the result split (P('i', 'j'));
//   (c) a collective matmul on a ring of 8 devices: each device keeps its rows of lhs moving
//       around the ring with ppermute, multiplying each by its own columns of rhs as it
//       passes, so no device ever holds all of lhs (result P(None, 'x')).
//
// Prints one line per example ending in "ok"; exits non-zero on a mismatch.
#include <cmath>
#include <cstdio>
#include <iostream>
#include <random>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "core/daemon.h"
#include "tessera/tessera.h"

ABSL_FLAG(std::string, coordinator, "",
          "host:port of a running cluster's coordinator; empty runs Client::local(8) (env TESSERA_COORDINATOR)");

namespace {

using namespace tessera;

HostArray random_matrix(Shape shape, uint32_t seed) {
  HostArray a(DType::kF32, std::move(shape));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (float& v : a.mutable_values<float>()) v = dist(rng);
  return a;
}

// Checks `y` against a @ b computed on the host in double; prints the example's line.
bool check(const char* name, const absl::StatusOr<std::vector<Array>>& out, const HostArray& a, const HostArray& b) {
  absl::StatusOr<HostArray> got = out.ok() ? (*out)[0].fetch() : out.status();
  if (!got.ok()) {
    std::cerr << "example_shard_map: " << name << ": " << got.status() << "\n";
    return false;
  }
  const int64_t m = a.shape()[0], k = a.shape()[1], n = b.shape()[1];
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double want = 0;
      for (int64_t p = 0; p < k; ++p) want += double(a.values<float>()[i * k + p]) * b.values<float>()[p * n + j];
      const double have = got->values<float>()[i * n + j];
      if (std::abs(have - want) > 1e-4 * (1 + std::abs(want))) {
        std::fprintf(stderr, "example_shard_map: %s: y[%ld, %ld] = %.7f, expected %.7f\n", name, static_cast<long>(i),
                     static_cast<long>(j), have, want);
        return false;
      }
    }
  }
  const Array& y = (*out)[0];
  std::cout << name << ": " << shape_to_string(y.shape()) << " " << y.sharding().spec().to_string() << " ok\n";
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Runs JAX's shard_map matmul examples (psum, psum_scatter, a ppermute ring) and checks them.\n"
      "Usage: example_shard_map [--coordinator=HOST:PORT]");
  tessera::parse_flags(argc, argv, "example_shard_map", {{"coordinator", "TESSERA_COORDINATOR"}});
  const std::string address = absl::GetFlag(FLAGS_coordinator);
  absl::StatusOr<Client> client = address.empty() ? Client::local(8) : Client::connect(address, {.min_devices = 8});
  absl::StatusOr<Mesh> mesh = client.ok() ? client->make_mesh({4, 2}, {"i", "j"}) : client.status();
  absl::StatusOr<Mesh> ring = client.ok() ? client->make_mesh({8}, {"x"}) : client.status();
  if (!mesh.ok() || !ring.ok()) {
    std::cerr << "example_shard_map: " << (mesh.ok() ? ring.status() : mesh.status()) << "\n";
    return 1;
  }
  auto put = [&](const HostArray& a, const Mesh& on, const PartitionSpec& spec) {
    return client->device_put(a, NamedSharding(on, spec));
  };
  bool ok = true;

  // (a) and (b): a (16, 8) @ (8, 4) with the contracting dimension split over 'j'.
  const HostArray a = random_matrix({16, 8}, 1), b = random_matrix({8, 4}, 2);
  absl::StatusOr<Array> a_blocks = put(a, *mesh, P("i", "j"));
  absl::StatusOr<Array> b_blocks = put(b, *mesh, P("j", None));
  if (!a_blocks.ok() || !b_blocks.ok()) {
    std::cerr << "example_shard_map: " << (a_blocks.ok() ? b_blocks.status() : a_blocks.status()) << "\n";
    return 1;
  }
  ShardMapped matmul_psum = shard_map(
      [](const std::vector<Value>& in) {
        Value partial = matmul(in[0], in[1]);  // (4, 4): this device's share of its rows
        return std::vector<Value>{psum(partial, "j")};
      },
      *mesh, {P("i", "j"), P("j", None)}, {P("i", None)});
  ok = check("(a) matmul, contracting dimension split, psum", matmul_psum({*a_blocks, *b_blocks}), a, b) && ok;

  ShardMapped matmul_scatter = shard_map(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{psum_scatter(matmul(in[0], in[1]), "j", /*scatter_dimension=*/1, /*tiled=*/true)};
      },
      *mesh, {P("i", "j"), P("j", None)}, {P("i", "j")});
  ok = check("(b) matmul, psum_scatter leaves it split", matmul_scatter({*a_blocks, *b_blocks}), a, b) && ok;

  // (c) a (64, 32) @ (32, 16) on a ring: device d holds rows block d of lhs and columns
  // block d of rhs, and computes columns block d of the result, one row block per step.
  const int64_t n = 8, rows = 64 / n;
  const HostArray lhs = random_matrix({64, 32}, 3), rhs = random_matrix({32, 16}, 4);
  absl::StatusOr<Array> lhs_blocks = put(lhs, *ring, P("x", None));
  absl::StatusOr<Array> rhs_blocks = put(rhs, *ring, P(None, "x"));
  if (!lhs_blocks.ok() || !rhs_blocks.ok()) {
    std::cerr << "example_shard_map: " << (lhs_blocks.ok() ? rhs_blocks.status() : lhs_blocks.status()) << "\n";
    return 1;
  }
  ShardMapped collective_matmul = shard_map(
      [&](const std::vector<Value>& in) {
        std::vector<std::pair<int64_t, int64_t>> from_next;  // device k+1 sends to device k
        for (int64_t k = 0; k < n; ++k) from_next.emplace_back((k + 1) % n, k);
        const Value me = axis_index("x");
        Value held = in[0];  // at step s: the rows block of device (me + s) % n
        Value out = full({n * rows, 2}, 0.0);
        for (int64_t s = 0; s < n; ++s) {
          const Value part = matmul(held, in[1]);  // (rows, 2): rows block (me + s) % n of the result
          // Put it at its block: a one-hot over the n blocks, from this device's index.
          Value block = me + double(s);
          block = where(block >= full({}, double(n), DType::kI32), block - double(n), block);
          const Value one_hot = convert(iota(DType::kI32, {n}, 0) == block, DType::kF32);
          out =
              out + reshape(broadcast_in_dim(one_hot, {n, rows, 2}, {0}) * broadcast_in_dim(part, {n, rows, 2}, {1, 2}),
                            {n * rows, 2});
          if (s + 1 < n) held = ppermute(held, "x", from_next);
        }
        return std::vector<Value>{out};
      },
      *ring, {P("x", None), P(None, "x")}, {P(None, "x")});
  ok = check("(c) collective matmul, a ring of ppermute steps", collective_matmul({*lhs_blocks, *rhs_blocks}), lhs,
             rhs) &&
       ok;
  return ok ? 0 : 1;
}
