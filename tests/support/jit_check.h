// Checking jit against the host: runs a traced function through jit on a cluster and the same
// function on the host (host_eval.h), and compares the results element by element with a
// tolerance per dtype.
//
//   absl::StatusOr<JitCheck> r = run_against_host(client, mesh, f, inputs, {P("data", None)});
//   EXPECT_TRUE(results_match(r->got[0], r->want[0], kF32Tolerance));
#ifndef TESSERA_TESTS_SUPPORT_JIT_CHECK_H_
#define TESSERA_TESTS_SUPPORT_JIT_CHECK_H_

#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"

namespace tessera {

// float32 results may differ from the host's in rounding only: a sharded reduction or
// contraction adds its terms in another order than the host does (per-shard partial sums,
// then a collective; BLAS blocks by the shard's shape), and a sum of n float32 terms of size
// O(1) rounds by about n * 2^-24 relative to the largest term. The programs here keep
// n <= 256 and inputs O(1), so 1e-5 (relative to max(1, |want|)) leaves a margin of ~10x.
inline constexpr double kF32Tolerance = 1e-5;

// Which values random_array draws (float dtypes; integers are drawn from [-4, 4], bools fair).
enum class Domain {
  kSigned,    // uniform in [-2, 2]
  kPositive,  // uniform in [0.5, 2.5]: log, sqrt, rsqrt, divisors, pow bases
  kNearOne,   // uniform in [0.8, 1.25]: products of many terms
};

HostArray random_array(DType dtype, const Shape& shape, Domain domain, std::mt19937& rng);

// Integer and bool results must be equal; float ones within `rtol` * max(1, |want|) (NaN
// matches NaN). The failure message names the first differing element and how many differ.
::testing::AssertionResult results_match(const HostArray& got, const HostArray& want, double rtol);

// Client::local(8), for a test suite's SetUpTestSuite to share among its tests: null, with a
// failure recorded, when the cluster cannot start.
std::unique_ptr<Client> start_local_client();

// The meshes the op and shard_map suites run on: (8), (4, 2) and (2, 4) over Client::local(8).
struct MeshDef {
  const char* name;
  std::vector<int64_t> shape;
  std::vector<std::string> axes;
};
const std::vector<MeshDef>& test_meshes();

// A suite fixture: one Client::local(8) for the whole suite, and test_meshes() on it (tests
// ASSERT_NE(client_, nullptr) first: null when the cluster could not start): meshes_ with
// make_mesh's Explicit axes (JAX >= 0.9's default), auto_meshes_ the same with Auto axes, for
// tests of GSPMD-style propagation (as make_mesh(..., axis_types=(Auto, ...)) in JAX).
class MeshesSuite : public ::testing::Test {
 protected:
  static void SetUpTestSuite();
  static void TearDownTestSuite();
  inline static Client* client_ = nullptr;
  inline static std::vector<Mesh> meshes_;
  inline static std::vector<Mesh> auto_meshes_;
};

// `mesh` with every axis Auto.
Mesh with_auto_axes(const Mesh& mesh);

struct JitCheck {
  std::vector<HostArray> got;   // fetched from the cluster
  std::vector<HostArray> want;  // the host reference
  std::vector<PartitionSpec> out_specs;
  std::string plan_text;  // Jitted::as_text()
};

// Runs `f` through jit on `inputs` placed on `mesh` with `specs`, and the same function on the
// host. Errors from device_put, the call, fetch or the reference are returned as they are.
absl::StatusOr<JitCheck> run_against_host(const Client& client, const Mesh& mesh, const TracedFunction& f,
                                          const std::vector<const HostArray*>& inputs,
                                          const std::vector<PartitionSpec>& specs, const JitOptions& options = {});

}  // namespace tessera

#endif  // TESSERA_TESTS_SUPPORT_JIT_CHECK_H_
