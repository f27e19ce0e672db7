// Views between HostArray and xtensor, without copying.
//
// Kept apart from host_array.h so that only the files that use xtensor pay for its headers.
//
//   HostArray a = HostArray::arange(DType::kF32, {4, 2});
//   auto view = as_xtensor<float>(a);          // xt adaptor over a's storage
//   HostArray b = from_xtensor(xt::xarray<float>{{1, 2}, {3, 4}});
#ifndef TESSERA_CORE_XTENSOR_INTEROP_H_
#define TESSERA_CORE_XTENSOR_INTEROP_H_

#include <vector>

#include "core/host_array.h"
#include "xtensor/xadapt.hpp"
#include "xtensor/xarray.hpp"

namespace tessera {

// A row-major xtensor adaptor over `array`'s storage (writable unless `array` is const); it
// does not own the storage and dangles once `array` is gone. REQUIRES: dtype_of<T>() ==
// array.dtype().
template <typename T>
auto as_xtensor(HostArray& array) {
  std::vector<size_t> shape(array.shape().begin(), array.shape().end());
  return xt::adapt(array.mutable_values<T>().data(), static_cast<size_t>(array.size()), xt::no_ownership(), shape);
}

template <typename T>
auto as_xtensor(const HostArray& array) {
  std::vector<size_t> shape(array.shape().begin(), array.shape().end());
  return xt::adapt(array.values<T>().data(), static_cast<size_t>(array.size()), xt::no_ownership(), shape);
}

// Copies any xtensor expression into a new HostArray of the expression's value type, which
// must be float, double, int32_t, int64_t or bool (dtype_of).
template <typename E>
HostArray from_xtensor(const xt::xexpression<E>& expr) {
  using T = typename E::value_type;
  const auto& e = expr.derived_cast();
  Shape shape(e.shape().begin(), e.shape().end());
  HostArray out(dtype_of<T>(), shape);
  auto view = as_xtensor<T>(out);
  view = e;
  return out;
}

}  // namespace tessera

#endif  // TESSERA_CORE_XTENSOR_INTEROP_H_
