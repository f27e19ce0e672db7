// The kernel families behind run_kernel, and the element-type plumbing they share.
//
// run_kernel (kernels.cc) checks that the operands and the node's attributes agree (the op's
// type rule) and finds the kernel in the registry; the kernels trust that and do the
// arithmetic, one family per file:
//   elementwise.cc   constant, iota, unary, binary, comparisons, select, convert
//   layout.cc        broadcast_in_dim, reshape, transpose, slice, rev, concatenate (and gather)
//   reduction.cc     reduce_{sum,max,min,prod}, argmax
//   dot.cc           dot_general (BLAS for float32/float64)
//   vector_math.cc   vectorized float32 exp and tanh (used by elementwise.cc)
//   indexing.cc      gather, scatter, scatter_add, dynamic_slice, dynamic_update_slice
#ifndef TESSERA_WORKER_KERNELS_INTERNAL_H_
#define TESSERA_WORKER_KERNELS_INTERNAL_H_

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
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
    case DType::kU32:
      return f(uint32_t{});
    case DType::kBF16:
      return f(BFloat16{});
    case DType::kF16:
      return f(Float16{});
    case DType::kU8:
      return f(uint8_t{});
    case DType::kI8:
      return f(int8_t{});
    case DType::kI16:
      return f(int16_t{});
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

// The unsigned type integer T's arithmetic wraps in: T's own, or unsigned int for the types C++
// promotes to int (int16 * int16 in int could overflow, which is undefined behaviour).
template <typename T>
using Wrapping = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;

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
// be 0 (broadcasting), any permutation of the source's strides (transposing), a multiple of
// one (a strided slice), or negative (rev: `offset` then points at the last element of each
// reversed dimension, and the walk steps back from it).
// REQUIRES: elem_size is 1, 2, 4 or 8, and every such offset lies inside `src`.
void gather(const std::byte* src, int64_t elem_size, int64_t offset, const Shape& shape,
            const std::vector<int64_t>& strides, std::byte* dst);

// The kernels, registered per family: each family file lists its ops' kernels, keyed by
// (op, backend). A kernel may trust that run_kernel checked the node against its operands (the
// op's type rule, core/op.h); it rejects dtypes its op is not defined for. `into`, when not
// null, is where the result goes (run_kernel_in_place: an operand's storage, element i read
// before element i is written, only for kInPlace ops); the kernel then returns a placeholder
// nobody reads (a rank-0 view of `into` that allocates and frees nothing).
enum class Backend : uint8_t { kCpu };
using KernelFn = absl::StatusOr<HostArray> (*)(const Node& node, const std::vector<const HostArray*>& xs,
                                               std::byte* into);
struct KernelEntry {
  Op op;
  Backend backend;
  KernelFn fn;
};
absl::Span<const KernelEntry> elementwise_kernels();  // elementwise.cc
absl::Span<const KernelEntry> layout_kernels();       // layout.cc
absl::Span<const KernelEntry> reduction_kernels();    // reduction.cc
absl::Span<const KernelEntry> dot_kernels();          // dot.cc
absl::Span<const KernelEntry> indexing_kernels();     // indexing.cc

// bfloat16 and float16 are storage types: a family's arithmetic kernels compute on them in
// float32 and round the result back once, as XLA:CPU does (its float normalization upcasts
// every bf16/f16 op it has no native kernel for). in_float32 runs `kernel` so: every half
// operand widened to float32 (exact), the node's dtype float32 where it is a half, and a half
// result rounded to nearest even (into `into` when not null). Reductions and dot_general thereby
// accumulate in float32 and round once. Families call it first thing in the kernels whose
// operands or result has_half; layout and indexing ops that only move elements copy their two
// bytes as they are.
bool has_half(const Node& node, const std::vector<const HostArray*>& xs);
absl::StatusOr<HostArray> in_float32(KernelFn kernel, const Node& node, const std::vector<const HostArray*>& xs,
                                     std::byte* into);

// float32 exp and tanh of n elements (vector_math.cc: vectorized polynomials within 1 and 2 ulps
// of the correctly rounded result, as XLA:CPU's own). `out` may equal `in`.
void exp_f32(const float* in, float* out, int64_t n);
void tanh_f32(const float* in, float* out, int64_t n);

// The kernel registered for (op, backend), or null.
KernelFn find_kernel(Op op, Backend backend = Backend::kCpu);

}  // namespace tessera::internal

#endif  // TESSERA_WORKER_KERNELS_INTERNAL_H_
