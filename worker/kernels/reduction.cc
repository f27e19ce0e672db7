// Reductions, argmax and argsort.
//
// A reduction reads its operand once, in memory order, folding each element into the result
// element it belongs to: along a reduced last dimension that is a running fold of a contiguous
// row, along a kept one an elementwise fold of a row into a row of the result. Float32 sums and
// products accumulate in double (one rounding at the end instead of one per element); integer
// ones in the unsigned type, wrapping.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "worker/kernels/internal.h"

namespace tessera::internal {
namespace {

// A sum along a reduced last dimension folds its row into four accumulators (elements
// i = k mod 4 into the k-th) added at the end: four independent additions in flight instead of
// one chain waiting on each add's latency. In double for float32 (integers wrap, exactly
// associative), so the order changes the result by far less than its final rounding to float.
template <typename Acc, typename T>
Acc sum_row(Acc folded, const Stored<T>* row, int64_t n) {
  Acc part[4] = {Acc{0}, Acc{0}, Acc{0}, Acc{0}};
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    for (int k = 0; k < 4; ++k) part[k] = static_cast<Acc>(part[k] + static_cast<Acc>(load<T>(row[j + k])));
  }
  for (; j < n; ++j) part[0] = static_cast<Acc>(part[0] + static_cast<Acc>(load<T>(row[j])));
  return static_cast<Acc>(folded +
                          static_cast<Acc>(static_cast<Acc>(part[0] + part[1]) + static_cast<Acc>(part[2] + part[3])));
}

template <typename T, bool kSum = false, typename Acc, typename F>
HostArray reduce_with(const Node& node, const HostArray& x, Acc init, F combine) {
  HostArray out(node.dtype, node.shape);
  std::vector<Acc> acc(static_cast<size_t>(out.size()), init);

  // The result's stride for each operand dimension: 0 for a reduced one.
  const Shape& shape = x.shape();
  const size_t rank = shape.size();
  const std::vector<int64_t> result_strides = row_major_strides(node.shape);
  std::vector<int64_t> out_strides(rank, 0);
  for (size_t d = 0, kept = 0; d < rank; ++d) {
    const std::vector<int64_t>& axes = node.attrs<ReduceAttrs>().axes;
    const bool reduced = std::find(axes.begin(), axes.end(), static_cast<int64_t>(d)) != axes.end();
    if (!reduced) out_strides[d] = result_strides[kept++];
  }

  const Stored<T>* in = stored<T>(x);
  if (x.size() > 0 && rank == 0) {
    acc[0] = combine(acc[0], load<T>(in[0]));
  } else if (x.size() > 0) {
    const int64_t inner = shape[rank - 1];
    const bool inner_reduced = out_strides[rank - 1] == 0;
    const int64_t rows = x.size() / inner;
    std::vector<int64_t> index(rank - 1, 0);
    int64_t out_offset = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const Stored<T>* row = in + r * inner;
      Acc* a = acc.data() + out_offset;
      if (kSum && inner_reduced) {
        *a = sum_row<Acc, T>(*a, row, inner);
      } else if (inner_reduced) {
        Acc folded = *a;
        for (int64_t j = 0; j < inner; ++j) folded = combine(folded, load<T>(row[j]));
        *a = folded;
      } else {
        for (int64_t j = 0; j < inner; ++j) a[j] = combine(a[j], load<T>(row[j]));
      }
      for (size_t d = rank - 1; d-- > 0;) {
        if (++index[d] < shape[d]) {
          out_offset += out_strides[d];
          break;
        }
        index[d] = 0;
        out_offset -= out_strides[d] * (shape[d] - 1);
      }
    }
  }

  Stored<T>* o = mutable_stored<T>(&out);
  for (size_t i = 0; i < acc.size(); ++i) o[i] = static_cast<Stored<T>>(static_cast<T>(acc[i]));
  return out;
}

template <typename T>
HostArray reduce_typed(const Node& node, const HostArray& x) {
  if constexpr (kIsBool<T>) {
    // sum and max are "any", prod and min "all".
    if (node.op == Op::kReduceSum || node.op == Op::kReduceMax) {
      return reduce_with<T>(node, x, uint8_t{0}, [](uint8_t a, bool v) -> uint8_t { return a | v; });
    }
    return reduce_with<T>(node, x, uint8_t{1}, [](uint8_t a, bool v) -> uint8_t { return a & v; });
  } else if constexpr (kIsInt<T>) {
    using U = Wrapping<T>;
    switch (node.op) {
      case Op::kReduceSum:
        return reduce_with<T, true>(node, x, U{0}, [](U a, T v) -> U { return a + static_cast<U>(v); });
      case Op::kReduceProd:
        return reduce_with<T>(node, x, U{1}, [](U a, T v) -> U { return a * static_cast<U>(v); });
      case Op::kReduceMax:
        return reduce_with<T>(node, x, std::numeric_limits<T>::lowest(), [](T a, T v) { return v > a ? v : a; });
      default:
        return reduce_with<T>(node, x, std::numeric_limits<T>::max(), [](T a, T v) { return v < a ? v : a; });
    }
  } else {
    constexpr T kInf = std::numeric_limits<T>::infinity();
    switch (node.op) {
      case Op::kReduceSum:
        return reduce_with<T, true>(node, x, 0.0, [](double a, T v) { return a + v; });
      case Op::kReduceProd:
        return reduce_with<T>(node, x, 1.0, [](double a, T v) { return a * v; });
      // NaN, once in the accumulator, stays: lax.reduce_max/min propagate it.
      case Op::kReduceMax:
        return reduce_with<T>(node, x, -kInf, [](T a, T v) { return (std::isnan(a) || a >= v) ? a : v; });
      default:
        return reduce_with<T>(node, x, kInf, [](T a, T v) { return (std::isnan(a) || a <= v) ? a : v; });
    }
  }
}

// Whether `v` replaces `best` as the maximum: a strictly greater value, or the first NaN.
template <typename T>
bool beats(T v, T best) {
  if constexpr (kIsFloat<T>) {
    return !std::isnan(best) && (std::isnan(v) || v > best);
  } else {
    return v > best;
  }
}

template <typename T, typename I>
void argmax_typed(const HostArray& x, size_t axis, HostArray* out) {
  const Shape& shape = x.shape();
  int64_t outer = 1, inner = 1;
  for (size_t d = 0; d < axis; ++d) outer *= shape[d];
  for (size_t d = axis + 1; d < shape.size(); ++d) inner *= shape[d];
  const int64_t n = shape[axis];
  const Stored<T>* in = stored<T>(x);
  I* index = out->mutable_values<I>().data();
  std::vector<Stored<T>> best(static_cast<size_t>(inner));
  for (int64_t i = 0; i < outer; ++i, index += inner) {
    const Stored<T>* block = in + i * n * inner;
    for (int64_t j = 0; j < inner; ++j) {
      best[j] = static_cast<Stored<T>>(load<T>(block[j]));
      index[j] = 0;
    }
    for (int64_t k = 1; k < n; ++k) {
      const Stored<T>* row = block + k * inner;
      for (int64_t j = 0; j < inner; ++j) {
        const Stored<T> v = static_cast<Stored<T>>(load<T>(row[j]));
        if (beats<Stored<T>>(v, best[j])) {
          best[j] = v;
          index[j] = static_cast<I>(k);
        }
      }
    }
  }
}

// REQUIRES (here and below): x is not a half (reduction_entry widened it).
HostArray reduce_kernel(const Node& node, const HostArray& x) {
  return visit_dtype(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    if constexpr (kIsHalf<T>) {
      return HostArray();
    } else {
      return reduce_typed<T>(node, x);
    }
  });
}

HostArray argmax_kernel(const Node& node, const HostArray& x) {
  HostArray out(node.dtype, node.shape);
  const size_t axis = static_cast<size_t>(node.attrs<ArgmaxAttrs>().axis);
  visit_dtype(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    if constexpr (kIsHalf<T>) {
      return;
    } else if (node.dtype == DType::kI32) {
      argmax_typed<T, int32_t>(x, axis, &out);
    } else {
      argmax_typed<T, int64_t>(x, axis, &out);
    }
  });
  return out;
}

// jnp.argsort: each lane along `axis` sorted stably by JAX's comparator, which canonicalizes
// floats first (jax/_src/lax/lax.py, _canonicalize_float_for_sort: -0 equals 0, every NaN is
// one NaN, sorted last). Descending (jnp.argsort(descending=True), the reverse of the
// ascending sort of the reversed lane): NaNs first, then larger first, ties in index order.
HostArray argsort_kernel(const Node& node, const HostArray& x) {
  HostArray out(DType::kI32, x.shape());
  const size_t axis = static_cast<size_t>(node.attrs<ArgmaxAttrs>().axis);
  const Shape& shape = x.shape();
  int64_t outer = 1, inner = 1;
  for (size_t d = 0; d < axis; ++d) outer *= shape[d];
  for (size_t d = axis + 1; d < shape.size(); ++d) inner *= shape[d];
  const int64_t n = shape[axis];
  const bool descending = node.op == Op::kArgsortDescending;
  int32_t* index = out.mutable_values<int32_t>().data();
  visit_dtype(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    if constexpr (!kIsHalf<T>) {
      const Stored<T>* in = stored<T>(x);
      std::vector<int32_t> order(static_cast<size_t>(n));
      std::vector<Stored<T>> lane(static_cast<size_t>(n));
      for (int64_t i = 0; i < outer; ++i) {
        for (int64_t j = 0; j < inner; ++j) {
          const int64_t base = i * n * inner + j;
          for (int64_t k = 0; k < n; ++k) {
            order[k] = static_cast<int32_t>(k);
            lane[k] = static_cast<Stored<T>>(load<T>(in[base + k * inner]));
          }
          std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
            if (descending) std::swap(a, b);  // "b before a" for the strict order, ties kept in place
            if constexpr (kIsFloat<T>) {
              return !std::isnan(lane[a]) && (std::isnan(lane[b]) || lane[a] < lane[b]);
            } else {
              return lane[a] < lane[b];
            }
          });
          for (int64_t k = 0; k < n; ++k) index[base + k * inner] = order[k];
        }
      }
    }
  });
  return out;
}

using Operands = const std::vector<const HostArray*>&;

// The family's entry: bfloat16/float16 operands reduce (or are ranked) in float32, a half sum
// or product rounded once at the end (in_float32).
template <HostArray (*kernel)(const Node&, const HostArray&)>
absl::StatusOr<HostArray> reduction_entry(const Node& n, Operands xs, std::byte* into) {
  if (has_half(n, xs)) return in_float32(reduction_entry<kernel>, n, xs, into);
  return kernel(n, *xs[0]);
}

}  // namespace

absl::Span<const KernelEntry> reduction_kernels() {
  static constexpr KernelFn kReduce = reduction_entry<reduce_kernel>;
  static constexpr KernelFn kArgsort = reduction_entry<argsort_kernel>;
  static constexpr KernelEntry kKernels[] = {
      {Op::kReduceSum, Backend::kCpu, kReduce},
      {Op::kReduceMax, Backend::kCpu, kReduce},
      {Op::kReduceMin, Backend::kCpu, kReduce},
      {Op::kReduceProd, Backend::kCpu, kReduce},
      {Op::kArgmax, Backend::kCpu, reduction_entry<argmax_kernel>},
      {Op::kArgsort, Backend::kCpu, kArgsort},
      {Op::kArgsortDescending, Backend::kCpu, kArgsort},
  };
  return kKernels;
}

}  // namespace tessera::internal
