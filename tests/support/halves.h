// Test helpers for bfloat16/float16 arrays: build them from floats (each rounded once) and read
// them back as floats (exact).
//
//   HostArray x = halves<BFloat16>({2}, {1.0f, 0.1f});   // 0x3F80, 0x3DCD
//   floats<BFloat16>(x) == {1.0f, 0.10009765625f}
#ifndef TESSERA_TESTS_SUPPORT_HALVES_H_
#define TESSERA_TESTS_SUPPORT_HALVES_H_

#include <random>
#include <vector>

#include "core/float16.h"
#include "core/host_array.h"

namespace tessera {

template <typename H>
HostArray halves(const Shape& shape, const std::vector<float>& values) {
  std::vector<H> v;
  for (float f : values) v.push_back(H(f));
  return HostArray::from_vector<H>(shape, v);
}

template <typename H>
std::vector<float> floats(const HostArray& a) {
  std::vector<float> out;
  for (H h : a.values<H>()) out.push_back(static_cast<float>(h));
  return out;
}

// n floats uniform in [lo, hi).
inline std::vector<float> uniform_floats(int n, float lo, float hi, std::mt19937& rng) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> out;
  for (int i = 0; i < n; ++i) out.push_back(d(rng));
  return out;
}

}  // namespace tessera

#endif  // TESSERA_TESTS_SUPPORT_HALVES_H_
