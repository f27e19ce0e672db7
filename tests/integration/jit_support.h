// What the jit integration tests share: random host arrays, a comparison of a fetched float32
// array against a reference computed in double, and a suite fixture holding one
// Client::local(8) cluster with a (4, 2) ('data', 'model') mesh.
//
//   class MyTest : public LocalJitSuite {};
//   const HostArray x = random_f32({16, 8}, /*seed=*/1);
//   Array xs = put(x, P("data", None));
//   expect_near(*xs.fetch(), want, /*tol=*/1e-5);   // |got - want| <= tol * (1 + |want|)
#ifndef TESSERA_TESTS_INTEGRATION_JIT_SUPPORT_H_
#define TESSERA_TESTS_INTEGRATION_JIT_SUPPORT_H_

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tessera/tessera.h"

namespace tessera::jit_support {

// float32 values drawn uniformly from [-1, 1), reproducible from `seed`.
inline HostArray random_f32(Shape shape, uint32_t seed) {
  HostArray a(DType::kF32, std::move(shape));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (float& v : a.mutable_values<float>()) v = dist(rng);
  return a;
}

// Every element of the float32 array `got` within tol * (1 + |want|) of `want`.
inline void expect_near(const HostArray& got, const std::vector<double>& want, double tol = 1e-5) {
  ASSERT_EQ(got.size(), static_cast<int64_t>(want.size()));
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(got.values<float>()[i], want[i], tol * (1 + std::abs(want[i]))) << "element " << i;
  }
}

// Host reference: (m, k) @ (k, n) of float32 arrays, in double.
inline std::vector<double> matmul_ref(const HostArray& x, const HostArray& w) {
  const int64_t m = x.shape()[0], k = x.shape()[1], n = w.shape()[1];
  std::vector<double> out(m * n, 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t l = 0; l < k; ++l)
        out[i * n + j] += double(x.values<float>()[i * k + l]) * w.values<float>()[l * n + j];
    }
  }
  return out;
}

// How many `op` instructions (e.g. "collective_permute") a program's text (Jitted::as_text)
// has, loop bodies included.
inline size_t count_of(const std::string& program, const std::string& op) {
  const std::string needle = "= " + op + "(";
  size_t n = 0;
  for (size_t at = program.find(needle); at != std::string::npos; at = program.find(needle, at + 1)) ++n;
  return n;
}

// How many all_reduce instructions a program's text has, loop bodies included.
inline size_t all_reduce_count(const std::string& program) { return count_of(program, "all_reduce"); }

// jit of a while loop that never ends (its condition, sum(carry) > -1, holds as the carry grows
// from zeros): a run that only its deadline, a stopped worker or a cancellation ends.
inline Jitted never_ending_loop(const JitOptions& options) {
  return jit(
      [](const std::vector<Value>& in) {
        return while_loop([](const std::vector<Value>& c) { return sum(c[0]) > -1.0; },
                          [](const std::vector<Value>& c) { return std::vector<Value>{c[0] + 1.0}; }, {in[0]});
      },
      options);
}

// One embedded cluster of 8 devices for a whole suite, and a (4, 2) mesh over it: make_mesh's,
// Explicit axes (JAX >= 0.9's default), and the same devices with Auto axes for tests of
// GSPMD-style propagation (what a JAX user writes as make_mesh(..., axis_types=(Auto, Auto))).
// `Base` is ::testing::Test, or ::testing::TestWithParam<T> for a parameterized suite.
template <typename Base>
class LocalSuite : public Base {
 protected:
  static void SetUpTestSuite() { start_cluster(LocalOptions{}); }
  // The suite's Client::local(8, options) and its mesh.
  static void start_cluster(const LocalOptions& options) {
    absl::StatusOr<Client> client = Client::local(8, options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = new Client(*std::move(client));
    absl::StatusOr<Mesh> mesh = client_->make_mesh({4, 2}, {"data", "model"});
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    mesh_ = new Mesh(*std::move(mesh));
    absl::StatusOr<Mesh> auto_mesh = client_->make_mesh({4, 2}, {"data", "model"}, {AxisType::kAuto, AxisType::kAuto});
    ASSERT_TRUE(auto_mesh.ok()) << auto_mesh.status();
    auto_mesh_ = new Mesh(*std::move(auto_mesh));
  }
  static void TearDownTestSuite() {
    delete auto_mesh_;
    delete mesh_;
    delete client_;
  }
  // `a` placed on the suite's mesh (or `mesh`) under `spec` (a test failure if that fails).
  static Array put(const HostArray& a, const PartitionSpec& spec) { return put_on(*mesh_, a, spec); }
  static Array put_on(const Mesh& mesh, const HostArray& a, const PartitionSpec& spec) {
    absl::StatusOr<Array> r = client_->device_put(a, NamedSharding(mesh, spec));
    EXPECT_TRUE(r.ok()) << r.status();
    return *std::move(r);
  }
  // `a`'s value on the host (a test failure, and an empty array, if that fails).
  static HostArray fetch(const Array& a) {
    absl::StatusOr<HostArray> r = a.fetch();
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *std::move(r) : HostArray();
  }
  inline static Client* client_ = nullptr;
  inline static Mesh* mesh_ = nullptr;
  inline static Mesh* auto_mesh_ = nullptr;
};
using LocalJitSuite = LocalSuite<::testing::Test>;

}  // namespace tessera::jit_support

#endif  // TESSERA_TESTS_INTEGRATION_JIT_SUPPORT_H_
