// example_shard_map: the classic shard_map matmuls of JAX's documentation on
// Client::local(8), each checked against the product computed on the host:
//
//   (a) the contracting dimension split over 'j': each device multiplies its blocks, psum
//       over 'j' adds the partial products (result P('i', None));
//   (b) the same finishing with psum_scatter, which leaves the result split (P('i', 'j'));
//   (c) a collective matmul on a ring of 8 devices: the rows of lhs move around the ring
//       with ppermute, each device multiplying each block by its own columns of rhs as it
//       passes and writing the product at the block's rows (dynamic_update_slice at
//       ((axis_index + i) % n) * rows), so no device ever holds all of lhs (result P(None, 'x'));
//   (d)-(f) the notebook's matmul_allgather_overlapped, matmul_allgather_overlapped_bidi and
//       matmul_psumscatter_overlapped (docs/notebooks/shard_map.md, "Matrix multiplies").
//   (c)-(f) are examples/collective_matmul.h: each a fori_loop over the ring steps, so the
//       program holds one loop whose body has the ppermute(s), not one copy per step.
//
// Prints one line per example ending in "ok"; exits non-zero on a mismatch.
#include <cmath>
#include <cstdio>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "core/daemon.h"
#include "examples/collective_matmul.h"
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
      "Runs JAX's shard_map matmul examples (psum, psum_scatter, a ppermute ring, the notebook's overlapped\n"
      "collective matmuls as fori_loops) and checks them against the host.\n"
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

  // (c)-(f): a (64, 32) @ (32, 16) on a ring of 8 devices, as JAX's notebook writes its
  // collective matmuls (examples/collective_matmul.h): a fori_loop over the ring steps that
  // ppermutes the moving block and indexes its blocks at (axis_index +- i) % n.
  const HostArray lhs = random_matrix({64, 32}, 3), rhs = random_matrix({32, 16}, 4);
  struct Form {
    const char* name;
    std::vector<Value> (*body)(const std::vector<Value>&, const std::string&);
    PartitionSpec lhs, rhs, out;
  };
  const std::vector<Form> forms = {
      {"(c) collective matmul, lhs rows around a ring of ppermutes", collective_matmul::ring_gather_lhs, P("x", None),
       P(None, "x"), P(None, "x")},
      {"(d) all-gather matmul overlapped (fori_loop, ppermute, dynamic_slice)", collective_matmul::allgather_overlapped,
       P("x", None), P("x", None), P("x", None)},
      {"(e) all-gather matmul overlapped, bidirectional", collective_matmul::allgather_overlapped_bidi, P("x", None),
       P("x", None), P("x", None)},
      {"(f) psum_scatter matmul overlapped", collective_matmul::psumscatter_overlapped, P(None, "x"), P("x", None),
       P("x", None)},
  };
  for (const Form& form : forms) {
    absl::StatusOr<Array> lhs_blocks = put(lhs, *ring, form.lhs);
    absl::StatusOr<Array> rhs_blocks = put(rhs, *ring, form.rhs);
    if (!lhs_blocks.ok() || !rhs_blocks.ok()) {
      std::cerr << "example_shard_map: " << (lhs_blocks.ok() ? rhs_blocks.status() : lhs_blocks.status()) << "\n";
      return 1;
    }
    auto body = form.body;
    ShardMapped f = shard_map([body](const std::vector<Value>& in) { return body(in, "x"); }, *ring,
                              {form.lhs, form.rhs}, {form.out});
    ok = check(form.name, f({*lhs_blocks, *rhs_blocks}), lhs, rhs) && ok;
  }
  return ok ? 0 : 1;
}
