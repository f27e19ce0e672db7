// The kernel families behind run_kernel, and the element-type plumbing they share.
//
// run_kernel (kernels.cc) checks that the operands and the node's attributes agree; the family
// functions below trust that and do the arithmetic, one family per file:
//   elementwise.cc   constant, iota, unary, binary, comparisons, select, convert
//   layout.cc        broadcast_in_dim, reshape, transpose, slice, concatenate (and gather)
//   reduction.cc     reduce_{sum,max,min,prod}, argmax
//   dot.cc           dot_general (BLAS for float32/float64)
#ifndef TESSERA_WORKER_KERNELS_INTERNAL_H_
#define TESSERA_WORKER_KERNELS_INTERNAL_H_

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/graph.h"
#include "core/host_array.h"

namespace tessera::internal {

// Calls f(T{}) with T the C++ element type of `dtype`.
template <typename F>
decltype(auto) visit_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF32:
      return f(float{});
    case DType::kF64:
      return f(double{});
    case DType::kI32:
      return f(int32_t{});
    case DType::kI64:
      return f(int64_t{});
    case DType::kBool:
      break;
  }
  return f(bool{});
}

template <typename T>
inline constexpr bool kIsFloat = std::is_floating_point_v<T>;
template <typename T>
inline constexpr bool kIsBool = std::is_same_v<T, bool>;
template <typename T>
inline constexpr bool kIsInt = std::is_integral_v<T> && !kIsBool<T>;

// Kernels access bool elements as bytes: an array that came over the wire may hold a byte
// other than 0 or 1, and reading that through a bool is undefined behaviour. Every such byte
// reads as true (load) and results are written as 0 or 1.
template <typename T>
using Stored = std::conditional_t<kIsBool<T>, uint8_t, T>;

template <typename T>
const Stored<T>* stored(const HostArray& a) {
  return reinterpret_cast<const Stored<T>*>(a.data());
}
template <typename T>
Stored<T>* mutable_stored(HostArray* a) {
  return reinterpret_cast<Stored<T>*>(a->data());
}
template <typename T>
T load(Stored<T> v) {
  if constexpr (kIsBool<T>) {
    return v != 0;
  } else {
    return v;
  }
}

// Row-major strides, in elements.
std::vector<int64_t> row_major_strides(const Shape& shape);

// Writes the num_elements(shape) elements (`elem_size` bytes each) whose multi-index i lies at
// element offset `offset + sum(i[d] * strides[d])` of `src`, row-major, to `dst`. A stride may
// be 0 (broadcasting) or any permutation of the source's strides (transposing).
// REQUIRES: elem_size is 1, 4 or 8, and every such offset lies inside `src`.
void gather(const std::byte* src, int64_t elem_size, int64_t offset, const Shape& shape,
            const std::vector<int64_t>& strides, std::byte* dst);

// The families. REQUIRES: run_kernel's checks of `node` against the operands passed.
// Those returning StatusOr reject dtypes their op is not defined for. Those taking `into`
// write their result there when it is not null (run_kernel_in_place: an operand's storage,
// element i read before element i is written) and then return an empty array.
absl::StatusOr<HostArray> constant_kernel(const Node& node);
absl::StatusOr<HostArray> iota_kernel(const Node& node);
absl::StatusOr<HostArray> unary_kernel(const Node& node, const HostArray& x, std::byte* into);
absl::StatusOr<HostArray> binary_kernel(const Node& node, const HostArray& x, const HostArray& y, std::byte* into);
HostArray select_kernel(const Node& node, const HostArray& pred, const HostArray& on_true, const HostArray& on_false,
                        std::byte* into);
HostArray convert_kernel(const Node& node, const HostArray& x);

HostArray broadcast_in_dim_kernel(const Node& node, const HostArray& x);
HostArray reshape_kernel(const Node& node, const HostArray& x);
HostArray transpose_kernel(const Node& node, const HostArray& x);
HostArray slice_kernel(const Node& node, const HostArray& x);
HostArray concatenate_kernel(const Node& node, const std::vector<const HostArray*>& xs);

HostArray reduce_kernel(const Node& node, const HostArray& x);
HostArray argmax_kernel(const Node& node, const HostArray& x);

absl::StatusOr<HostArray> dot_general_kernel(const Node& node, const HostArray& lhs, const HostArray& rhs);

}  // namespace tessera::internal

#endif  // TESSERA_WORKER_KERNELS_INTERNAL_H_
