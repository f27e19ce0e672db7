// xtensor containers to and from the cluster. Opt-in: this header brings in xtensor's, which
// tessera/tessera.h does not.
//
//   #include "tessera/tessera.h"
//   #include "tessera/xtensor.h"
//   xt::xarray<float> x = xt::ones<float>({16, 8});
//   absl::StatusOr<Array> a = device_put(*client, x, NamedSharding(*mesh, P("data", None)));  // read in place
//   absl::StatusOr<xt::xarray<float>> back = fetch_xarray<float>(*a);                        // written in place
#ifndef TESSERA_XTENSOR_H_
#define TESSERA_XTENSOR_H_

#include <cstddef>
#include <type_traits>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/xtensor_interop.h"
#include "tessera/array.h"
#include "tessera/client.h"
#include "xtensor/xarray.hpp"

namespace tessera {

// Whether `e`'s elements lie dense and row-major in its own storage, so that device_put can
// read them in place (true for xt::xarray and xt::xtensor; false for a transposed or strided
// view, which device_put evaluates into a temporary first).
template <class E>
bool is_dense_row_major(const E& e) {
  if constexpr (!xt::has_data_interface<E>::value) {
    return false;
  } else {
    const auto& shape = e.shape();
    const auto& strides = e.strides();
    std::ptrdiff_t want = 1;
    for (std::size_t d = shape.size(); d-- > 0;) {
      if (shape[d] != 1 && static_cast<std::ptrdiff_t>(strides[d]) != want) return false;
      want *= static_cast<std::ptrdiff_t>(shape[d]);
    }
    return true;
  }
}

// Client::device_put of an xtensor expression whose value_type is float, double, int32_t,
// int64_t or bool: straight from its storage when is_dense_row_major, else evaluated into a
// HostArray first. The errors of Client::device_put.
template <class E>
absl::StatusOr<Array> device_put(const Client& client, const xt::xexpression<E>& expr, const NamedSharding& sharding) {
  using T = typename E::value_type;
  const E& e = expr.derived_cast();
  if constexpr (xt::has_data_interface<E>::value) {
    if (is_dense_row_major(e)) {
      const Shape shape(e.shape().begin(), e.shape().end());
      return client.device_put(HostView{dtype_of<T>(), shape, e.data() + e.data_offset()}, sharding);
    }
  }
  return client.device_put(from_xtensor(e), sharding);
}

// The whole array as an xt::xarray<T>, fetched into its storage (Array::fetch_into: no copy
// in between). INVALID_ARGUMENT when T is not the array's dtype; the errors of Array::fetch.
template <class T>
absl::StatusOr<xt::xarray<T>> fetch_xarray(const Array& array) {
  if (dtype_of<T>() != array.dtype()) {
    return absl::InvalidArgumentError(
        absl::StrCat("fetch_xarray: the array is ", dtype_name(array.dtype()), ", not ", dtype_name(dtype_of<T>())));
  }
  xt::xarray<T> out(typename xt::xarray<T>::shape_type(array.shape().begin(), array.shape().end()));
  absl::Status status = array.fetch_into(MutableHostView{array.dtype(), array.shape(), out.data()});
  if (!status.ok()) return status;
  return out;
}

}  // namespace tessera

#endif  // TESSERA_XTENSOR_H_
