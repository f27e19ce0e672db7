// Indexing kernels: gather, scatter, scatter_add (one integer index array along one operand
// dimension, core/op_attrs.h's GatherAttrs, with leading batch dimensions matched elementwise),
// dynamic_slice and dynamic_update_slice.
//
// Out-of-range indices follow lax.GatherScatterMode (jax/_src/lax/slicing.py): CLIP clamps an
// index to [0, n - 1]; FILL_OR_DROP makes a gather return the fill value for it and a scatter
// drop its update. dynamic_slice and dynamic_update_slice clamp each start to [0, dim - size],
// as lax.dynamic_slice documents, so the window always fits.
#include <algorithm>
#include <cstring>

#include "worker/kernels/internal.h"

namespace tessera::internal {
namespace {

// The operand viewed as (batch, outer, n, inner) around the indexed dimension: `batch` the
// product of the batch dimensions (1 with none), `outer` of the others before the axis. The
// indices are (batch, m), the gathered value (and the updates) (batch, outer, m, inner).
struct IndexedView {
  int64_t batch = 1, outer = 1, n = 0, inner = 1;
};
IndexedView view(const Shape& x, const GatherAttrs& a) {
  IndexedView v;
  for (int64_t d = 0; d < a.batch_dims; ++d) v.batch *= x[d];
  for (int64_t d = a.batch_dims; d < a.axis; ++d) v.outer *= x[d];
  v.n = x[a.axis];
  for (size_t d = static_cast<size_t>(a.axis) + 1; d < x.size(); ++d) v.inner *= x[d];
  return v;
}

// The indices as int64, whatever their dtype (int32 or int64, checked by the type rule).
std::vector<int64_t> indices_of(const HostArray& indices) {
  std::vector<int64_t> out(static_cast<size_t>(indices.size()));
  for (int64_t j = 0; j < indices.size(); ++j) {
    out[j] = indices.dtype() == DType::kI32 ? reinterpret_cast<const int32_t*>(indices.data())[j]
                                            : reinterpret_cast<const int64_t*>(indices.data())[j];
  }
  return out;
}

// Where index `i` of a dimension of size n lands: clamped, or -1 (out of range) in fill/drop.
int64_t resolve_index(int64_t i, int64_t n, IndexMode mode) {
  if (mode == IndexMode::kClip) return std::clamp<int64_t>(i, 0, n - 1);
  return i >= 0 && i < n ? i : -1;
}

// One element of T holding `value`: the fill (an integer for integer and bool dtypes, by the
// type rule; an int64 fill wraps into int32 as a C++ conversion does).
template <typename T>
Stored<T> element_of(const Scalar& value) {
  if constexpr (kIsBool<T>) {
    return value.int_value() != 0 ? 1 : 0;
  } else if constexpr (kIsInt<T>) {
    return static_cast<T>(value.int_value());  // integral, by the type rule
  } else {
    return static_cast<T>(value.to_double());
  }
}

absl::StatusOr<HostArray> gather_kernel(const Node& node, const std::vector<const HostArray*>& xs, std::byte*) {
  const HostArray& x = *xs[0];
  const GatherAttrs& a = node.attrs<GatherAttrs>();
  const IndexedView v = view(x.shape(), a);
  const std::vector<int64_t> indices = indices_of(*xs[1]);
  const int64_t m = v.batch == 0 ? 0 : static_cast<int64_t>(indices.size()) / v.batch;
  const int64_t esize = dtype_size(x.dtype()), row = v.inner * esize;
  HostArray out(node.dtype, node.shape);
  // A row of the fill value, for out-of-range indices in fill mode.
  std::vector<std::byte> fill(static_cast<size_t>(row));
  visit_dtype(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const Stored<T> f = element_of<T>(a.fill_value.value_or(default_fill_value(x.dtype())));
    for (int64_t k = 0; k < v.inner; ++k) std::memcpy(fill.data() + k * esize, &f, static_cast<size_t>(esize));
  });
  // Example b reads only its own block of x, (b * outer + o) rows of n, at its own indices.
  for (int64_t b = 0; b < v.batch; ++b) {
    for (int64_t o = b * v.outer; o < (b + 1) * v.outer; ++o) {
      for (int64_t j = 0; j < m; ++j) {
        const int64_t i = resolve_index(indices[b * m + j], v.n, a.mode);
        std::byte* dst = out.data() + (o * m + j) * row;
        const std::byte* src = i < 0 ? fill.data() : x.data() + (o * v.n + i) * row;
        if (row > 0) std::memcpy(dst, src, static_cast<size_t>(row));
      }
    }
  }
  return out;
}

// x with each update row set (kScatter) or added (kScatterAdd) at its index; integers add
// wrapping around, as lax.
absl::StatusOr<HostArray> scatter_kernel(const Node& node, const std::vector<const HostArray*>& xs, std::byte* into) {
  // scatter_add adds in float32 (rounded once per element); scatter only moves elements.
  if (node.op == Op::kScatterAdd && has_half(node, xs)) return in_float32(scatter_kernel, node, xs, into);
  const HostArray &x = *xs[0], &updates = *xs[2];
  const GatherAttrs& a = node.attrs<GatherAttrs>();
  const IndexedView v = view(x.shape(), a);
  const std::vector<int64_t> indices = indices_of(*xs[1]);
  const int64_t m = v.batch == 0 ? 0 : static_cast<int64_t>(indices.size()) / v.batch;
  HostArray out = x.clone();
  visit_dtype(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    Stored<T>* o = mutable_stored<T>(&out);
    const Stored<T>* u = stored<T>(updates);
    for (int64_t p = 0; p < v.batch * v.outer; ++p) {
      for (int64_t j = 0; j < m; ++j) {
        const int64_t i = resolve_index(indices[p / v.outer * m + j], v.n, a.mode);
        if (i < 0) continue;  // dropped
        Stored<T>* dst = o + (p * v.n + i) * v.inner;
        const Stored<T>* src = u + (p * m + j) * v.inner;
        for (int64_t k = 0; k < v.inner; ++k) {
          if (node.op == Op::kScatter) {
            dst[k] = src[k];
          } else if constexpr (kIsInt<T>) {
            using U = Wrapping<T>;
            dst[k] = static_cast<T>(static_cast<U>(dst[k]) + static_cast<U>(src[k]));
          } else if constexpr (!kIsBool<T> && !kIsHalf<T>) {
            dst[k] += src[k];
          }
        }
      }
    }
  });
  return out;
}

// Each start clamped so that a window of `sizes` fits in `shape`.
std::vector<int64_t> clamped_starts(const HostArray& starts, const Shape& shape, const Shape& sizes) {
  std::vector<int64_t> s = indices_of(starts);
  for (size_t d = 0; d < s.size(); ++d) s[d] = std::clamp<int64_t>(s[d], 0, shape[d] - sizes[d]);
  return s;
}

int64_t offset_of(const std::vector<int64_t>& starts, const std::vector<int64_t>& strides) {
  int64_t offset = 0;
  for (size_t d = 0; d < starts.size(); ++d) offset += starts[d] * strides[d];
  return offset;
}

absl::StatusOr<HostArray> dynamic_slice_kernel(const Node& node, const std::vector<const HostArray*>& xs, std::byte*) {
  const HostArray& x = *xs[0];
  HostArray out(node.dtype, node.shape);
  const std::vector<int64_t> strides = row_major_strides(x.shape());
  const int64_t offset = offset_of(clamped_starts(*xs[1], x.shape(), node.shape), strides);
  gather(x.data(), dtype_size(x.dtype()), offset, node.shape, strides, out.data());
  return out;
}

absl::StatusOr<HostArray> dynamic_update_slice_kernel(const Node&, const std::vector<const HostArray*>& xs,
                                                      std::byte*) {
  const HostArray &x = *xs[0], &update = *xs[1];
  HostArray out = x.clone();
  const Shape& u = update.shape();
  if (update.size() == 0) return out;
  const std::vector<int64_t> strides = row_major_strides(x.shape());
  const int64_t offset = offset_of(clamped_starts(*xs[2], x.shape(), u), strides);
  const int64_t esize = dtype_size(x.dtype());
  // Row by row along the last dimension (a scalar is one row of one element).
  const size_t rank = u.size();
  const int64_t inner = rank == 0 ? 1 : u[rank - 1];
  const int64_t rows = update.size() / inner;
  std::vector<int64_t> index(rank == 0 ? 0 : rank - 1, 0);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t at = offset;
    for (size_t d = 0; d + 1 < rank; ++d) at += index[d] * strides[d];
    std::memcpy(out.data() + at * esize, update.data() + r * inner * esize, static_cast<size_t>(inner * esize));
    for (size_t d = index.size(); d-- > 0;) {
      if (++index[d] < u[d]) break;
      index[d] = 0;
    }
  }
  return out;
}

}  // namespace

absl::Span<const KernelEntry> indexing_kernels() {
  static constexpr KernelEntry kKernels[] = {
      {Op::kGather, Backend::kCpu, gather_kernel},
      {Op::kScatter, Backend::kCpu, scatter_kernel},
      {Op::kScatterAdd, Backend::kCpu, scatter_kernel},
      {Op::kDynamicSlice, Backend::kCpu, dynamic_slice_kernel},
      {Op::kDynamicUpdateSlice, Backend::kCpu, dynamic_update_slice_kernel},
  };
  return kKernels;
}

}  // namespace tessera::internal
