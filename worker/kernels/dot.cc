// dot_general as a batch of matrix products.
//
// With B, M, K, N the products of the batch, lhs free, contracting and rhs free dimensions,
// the result (batch, lhs free, rhs free) is row-major [B, M, N], and the operands are wanted as
// B matrices [M, K] and [K, N]. BLAS takes a matrix whose rows are any fixed number of elements
// apart (its leading dimension) and whose columns are adjacent, or the transpose of one. So an
// operand is used in place wherever its row dimensions collapse into one strided dimension and
// its column dimensions into one contiguous one (or the reverse, read transposed), whatever the
// strides of its batch dimensions: attention's (B, T, N, H) queries, batched over B and N, are
// B*N matrices of T rows N*H apart. Any other operand is first copied into [B, M, K]
// (resp. [B, K, N]). Float32/float64 then go through cblas_sgemm/dgemm once per batch element;
// integers through a plain loop over copies that wraps like the other integer kernels.
#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "worker/kernels/internal.h"

namespace tessera::internal {
namespace {

std::vector<int64_t> joined(const std::vector<int64_t>& a, const std::vector<int64_t>& b,
                            const std::vector<int64_t>& c) {
  std::vector<int64_t> out = a;
  out.insert(out.end(), b.begin(), b.end());
  out.insert(out.end(), c.begin(), c.end());
  return out;
}

int64_t product(const Shape& shape, const std::vector<int64_t>& dims) {
  int64_t p = 1;
  for (int64_t d : dims) p *= shape[static_cast<size_t>(d)];
  return p;
}

bool is_identity(const std::vector<int64_t>& perm) {
  for (size_t i = 0; i < perm.size(); ++i) {
    if (perm[i] != static_cast<int64_t>(i)) return false;
  }
  return true;
}

// Dimensions `dims` of an array of `shape` and element `strides`, in this order, as one
// dimension: the stride of that dimension if they collapse into one (each one's stride is the
// next one's times its size; dimensions of size 1 do not count), 0 if they hold one element
// (any stride will do), -1 if they do not collapse.
int64_t collapsed_stride(const Shape& shape, const std::vector<int64_t>& strides, const std::vector<int64_t>& dims) {
  int64_t stride = 0, span = 0;
  for (auto it = dims.rbegin(); it != dims.rend(); ++it) {
    const auto d = static_cast<size_t>(*it);
    if (shape[d] == 1) continue;
    if (stride == 0) {
      stride = strides[d];
    } else if (strides[d] != span) {
      return -1;
    }
    span = strides[d] * shape[d];
  }
  return stride;
}

// One operand as a batch of row-major matrices: batch element b's matrix starts at
// data + offsets[b], its rows `ld` elements apart, or (`transposed`) it is stored as the
// transpose, BLAS reading it with Trans.
template <typename T>
struct Matrices {
  const T* data = nullptr;
  bool transposed = false;
  int64_t ld = 0;
  std::vector<int64_t> offsets;
  std::vector<T> copy;
};

// The offsets of the batch elements of x: its `batch` dimensions (in this order) row-major.
std::vector<int64_t> batch_offsets(const Shape& shape, const std::vector<int64_t>& strides,
                                   const std::vector<int64_t>& batch) {
  std::vector<int64_t> offsets = {0};
  for (int64_t d : batch) {
    std::vector<int64_t> next;
    next.reserve(offsets.size() * static_cast<size_t>(shape[static_cast<size_t>(d)]));
    for (int64_t o : offsets) {
      for (int64_t i = 0; i < shape[static_cast<size_t>(d)]; ++i)
        next.push_back(o + i * strides[static_cast<size_t>(d)]);
    }
    offsets = std::move(next);
  }
  return offsets;
}

// `x` as a batch of [rows, cols] matrices, its dimensions grouped as `batch`, `rows` and `cols`:
// in place when BLAS can read it (`strided`: rows collapse to one strided dimension and cols to a
// contiguous one, or the reverse), else in a copy ordered [batch, rows, cols].
template <typename T>
void as_matrices(const HostArray& x, const std::vector<int64_t>& batch, const std::vector<int64_t>& rows,
                 const std::vector<int64_t>& cols, bool strided, Matrices<T>* out) {
  const T* own = x.values<T>().data();
  const std::vector<int64_t> x_strides = row_major_strides(x.shape());
  const int64_t m = product(x.shape(), rows), n = product(x.shape(), cols);
  const int64_t row_stride = collapsed_stride(x.shape(), x_strides, rows);
  const int64_t col_stride = collapsed_stride(x.shape(), x_strides, cols);
  constexpr int64_t kMaxLd = std::numeric_limits<blasint>::max();
  if (!strided && is_identity(joined(batch, rows, cols))) {  // the loop: contiguous [B, rows, cols] as it is
    out->data = own;
    out->ld = std::max<int64_t>(1, n);
    out->offsets = batch_offsets(x.shape(), x_strides, batch);
    return;
  }
  if (strided && row_stride >= 0 && col_stride >= 0 && row_stride <= kMaxLd && col_stride <= kMaxLd) {
    if (col_stride <= 1 && (row_stride == 0 ? n : row_stride) >= n) {
      out->data = own;
      out->ld = std::max<int64_t>(1, row_stride == 0 ? n : row_stride);
      out->offsets = batch_offsets(x.shape(), x_strides, batch);
      return;
    }
    if (row_stride <= 1 && col_stride >= m) {
      out->data = own;
      out->transposed = true;
      out->ld = std::max<int64_t>(1, col_stride);
      out->offsets = batch_offsets(x.shape(), x_strides, batch);
      return;
    }
  }
  const std::vector<int64_t> perm = joined(batch, rows, cols);
  Shape shape(perm.size());
  std::vector<int64_t> strides(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) {
    shape[i] = x.shape()[static_cast<size_t>(perm[i])];
    strides[i] = x_strides[static_cast<size_t>(perm[i])];
  }
  out->copy.resize(static_cast<size_t>(x.size()));
  gather(x.data(), sizeof(T), 0, shape, strides, reinterpret_cast<std::byte*>(out->copy.data()));
  out->data = out->copy.data();
  out->ld = std::max<int64_t>(1, n);
  out->offsets.resize(static_cast<size_t>(product(x.shape(), batch)));
  for (size_t b = 0; b < out->offsets.size(); ++b) out->offsets[b] = static_cast<int64_t>(b) * m * n;
}

void gemm(bool trans_a, bool trans_b, blasint m, blasint n, blasint k, const float* a, blasint lda, const float* b,
          blasint ldb, float* c) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, m, n, k, 1.0f, a,
              lda, b, ldb, 0.0f, c, n);
}

void gemm(bool trans_a, bool trans_b, blasint m, blasint n, blasint k, const double* a, blasint lda, const double* b,
          blasint ldb, double* c) {
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, m, n, k, 1.0, a,
              lda, b, ldb, 0.0, c, n);
}

// [B, M, K] x [B, K, N] -> [B, M, N] by plain loops (the inner one over N vectorizes).
// Integers accumulate in their unsigned type, wrapping.
template <typename T, bool = kIsInt<T>>
struct Accumulator {
  using type = T;
};
template <typename T>
struct Accumulator<T, true> {
  using type = Wrapping<T>;
};

template <typename T>
void dot_loop(int64_t batch, int64_t m, int64_t k, int64_t n, const T* a, const T* b, T* c) {
  using Acc = typename Accumulator<T>::type;
  std::vector<Acc> row(static_cast<size_t>(n));
  for (int64_t bi = 0; bi < batch; ++bi) {
    for (int64_t i = 0; i < m; ++i) {
      std::fill(row.begin(), row.end(), Acc{0});
      const T* a_row = a + (bi * m + i) * k;
      for (int64_t p = 0; p < k; ++p) {
        const Acc av = static_cast<Acc>(a_row[p]);
        const T* b_row = b + (bi * k + p) * n;
        for (int64_t j = 0; j < n; ++j) row[j] += av * static_cast<Acc>(b_row[j]);
      }
      T* c_row = c + (bi * m + i) * n;
      for (int64_t j = 0; j < n; ++j) c_row[j] = static_cast<T>(row[j]);
    }
  }
}

template <typename T>
void dot_typed(const Node& node, const HostArray& lhs, const HostArray& rhs, HostArray* out) {
  const DotDims& dd = node.attrs<DotAttrs>().dims;
  const std::vector<int64_t> lhs_free =
      dot_free_dims(static_cast<int64_t>(lhs.shape().size()), dd.lhs_batch, dd.lhs_contracting);
  const std::vector<int64_t> rhs_free =
      dot_free_dims(static_cast<int64_t>(rhs.shape().size()), dd.rhs_batch, dd.rhs_contracting);
  const int64_t batch = product(lhs.shape(), dd.lhs_batch);
  const int64_t m = product(lhs.shape(), lhs_free);
  const int64_t k = product(lhs.shape(), dd.lhs_contracting);
  const int64_t n = product(rhs.shape(), rhs_free);

  // BLAS takes int sizes; anything larger (or an integer dtype) goes through the loop.
  constexpr int64_t kMaxBlas = std::numeric_limits<blasint>::max();
  const bool use_blas = kIsFloat<T> && m <= kMaxBlas && n <= kMaxBlas && k <= kMaxBlas;

  Matrices<T> a, b;
  as_matrices(lhs, dd.lhs_batch, lhs_free, dd.lhs_contracting, use_blas, &a);
  as_matrices(rhs, dd.rhs_batch, dd.rhs_contracting, rhs_free, use_blas, &b);
  T* c = out->mutable_values<T>().data();

  if constexpr (kIsFloat<T>) {
    if (use_blas) {
      const auto bm = static_cast<blasint>(m), bn = static_cast<blasint>(n), bk = static_cast<blasint>(k);
      for (int64_t bi = 0; bi < batch; ++bi) {
        gemm(a.transposed, b.transposed, bm, bn, bk, a.data + a.offsets[static_cast<size_t>(bi)],
             static_cast<blasint>(a.ld), b.data + b.offsets[static_cast<size_t>(bi)], static_cast<blasint>(b.ld),
             c + bi * m * n);
      }
      return;
    }
  }
  dot_loop(batch, m, k, n, a.data, b.data, c);
}

absl::StatusOr<HostArray> dot_general_kernel(const Node& node, const HostArray& lhs, const HostArray& rhs) {
  if (node.dtype == DType::kBool) {
    return absl::InvalidArgumentError(absl::StrCat("dot_general: not defined for bool operands (",
                                                   type_to_string(lhs.dtype(), lhs.shape()), " and ",
                                                   type_to_string(rhs.dtype(), rhs.shape()), ")"));
  }
  HostArray out(node.dtype, node.shape);
  if (out.size() == 0) return out;
  // An empty contraction sums nothing; BLAS would reject the zero leading dimensions.
  if (lhs.size() == 0 || rhs.size() == 0) {
    std::memset(out.data(), 0, static_cast<size_t>(out.nbytes()));
    return out;
  }
  visit_dtype(node.dtype, [&](auto zero) {
    using T = decltype(zero);
    if constexpr (!kIsBool<T> && !kIsHalf<T>) dot_typed<T>(node, lhs, rhs, &out);  // halves: dot_entry widens
  });
  return out;
}

// bfloat16/float16 operands multiply in float32 (BLAS), accumulating in float32, and a half
// result is rounded once (in_float32), as XLA:CPU's dot on bf16.
absl::StatusOr<HostArray> dot_entry(const Node& n, const std::vector<const HostArray*>& xs, std::byte* into) {
  if (has_half(n, xs)) return in_float32(dot_entry, n, xs, into);
  return dot_general_kernel(n, *xs[0], *xs[1]);
}

}  // namespace

absl::Span<const KernelEntry> dot_kernels() {
  static constexpr KernelEntry kKernels[] = {
      {Op::kDotGeneral, Backend::kCpu, dot_entry},
  };
  return kKernels;
}

}  // namespace tessera::internal
