// Host-side inputs and checks shared by the jit integration tests: random arrays, and a
// comparison of a fetched float32 array against a reference computed in double.
//
//   const HostArray x = random_f32({16, 8}, /*seed=*/1);
//   expect_near(*y.fetch(), want, /*tol=*/1e-5);   // |got - want| <= tol * (1 + |want|)
#ifndef TESSERA_TESTS_INTEGRATION_HOST_REFERENCE_H_
#define TESSERA_TESTS_INTEGRATION_HOST_REFERENCE_H_

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tessera/tessera.h"

namespace tessera::host_reference {

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

}  // namespace tessera::host_reference

#endif  // TESSERA_TESTS_INTEGRATION_HOST_REFERENCE_H_
