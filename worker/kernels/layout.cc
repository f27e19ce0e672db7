// Layout kernels: ops that move elements without computing on them. broadcast_in_dim,
// transpose, slice and rev are each one strided gather (rev's steps negative); reshape is a
// copy; concatenate copies rows.
#include <cstring>

#include "worker/kernels/internal.h"

namespace tessera::internal {
namespace {

// gather for one element size. Elements move with memcpy of a constant size (a single load and
// store once compiled), which keeps the bytes' dtype out of the picture.
template <size_t kSize>
void gather_fixed(const std::byte* src, int64_t offset, const Shape& shape, const std::vector<int64_t>& strides,
                  std::byte* dst) {
  const size_t rank = shape.size();
  const int64_t total = num_elements(shape);
  if (total == 0) return;
  if (rank == 0) {
    std::memcpy(dst, src + offset * kSize, kSize);
    return;
  }
  // Row by row along the last dimension, keeping a multi-index over the others.
  const int64_t inner = shape[rank - 1];
  const int64_t inner_stride = strides[rank - 1];
  const int64_t rows = total / inner;
  std::vector<int64_t> index(rank - 1, 0);
  int64_t row_offset = offset;
  for (int64_t r = 0; r < rows; ++r) {
    const std::byte* in = src + row_offset * static_cast<int64_t>(kSize);
    if (inner_stride == 1) {
      std::memcpy(dst, in, static_cast<size_t>(inner) * kSize);
    } else {
      // Signed: rev's steps are negative.
      const int64_t step = inner_stride * static_cast<int64_t>(kSize);
      for (int64_t j = 0; j < inner; ++j) std::memcpy(dst + j * kSize, in + j * step, kSize);
    }
    dst += inner * static_cast<int64_t>(kSize);
    for (size_t d = rank - 1; d-- > 0;) {
      if (++index[d] < shape[d]) {
        row_offset += strides[d];
        break;
      }
      index[d] = 0;
      row_offset -= strides[d] * (shape[d] - 1);
    }
  }
}

}  // namespace

std::vector<int64_t> row_major_strides(const Shape& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t stride = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    strides[d] = stride;
    stride *= shape[d];
  }
  return strides;
}

void gather(const std::byte* src, int64_t elem_size, int64_t offset, const Shape& shape,
            const std::vector<int64_t>& strides, std::byte* dst) {
  switch (elem_size) {
    case 1:
      gather_fixed<1>(src, offset, shape, strides, dst);
      break;
    case 2:
      gather_fixed<2>(src, offset, shape, strides, dst);
      break;
    case 4:
      gather_fixed<4>(src, offset, shape, strides, dst);
      break;
    default:
      gather_fixed<8>(src, offset, shape, strides, dst);
      break;
  }
}

namespace {

HostArray broadcast_in_dim_kernel(const Node& node, const HostArray& x) {
  HostArray out(node.dtype, node.shape);
  const std::vector<int64_t> x_strides = row_major_strides(x.shape());
  // Result dimensions the operand does not map to, and operand dimensions of size 1, repeat
  // the same elements: stride 0.
  std::vector<int64_t> strides(node.shape.size(), 0);
  const std::vector<int64_t>& dims = node.attrs<BroadcastAttrs>().result_dims;
  for (size_t i = 0; i < dims.size(); ++i) {
    if (x.shape()[i] != 1) strides[static_cast<size_t>(dims[i])] = x_strides[i];
  }
  gather(x.data(), dtype_size(x.dtype()), 0, node.shape, strides, out.data());
  return out;
}

HostArray reshape_kernel(const Node& node, const HostArray& x) { return x.clone().reshaped(node.shape); }

HostArray transpose_kernel(const Node& node, const HostArray& x) {
  HostArray out(node.dtype, node.shape);
  const std::vector<int64_t> x_strides = row_major_strides(x.shape());
  const std::vector<int64_t>& permutation = node.attrs<TransposeAttrs>().permutation;
  std::vector<int64_t> strides(permutation.size());
  for (size_t i = 0; i < permutation.size(); ++i) strides[i] = x_strides[static_cast<size_t>(permutation[i])];
  gather(x.data(), dtype_size(x.dtype()), 0, node.shape, strides, out.data());
  return out;
}

HostArray slice_kernel(const Node& node, const HostArray& x) {
  HostArray out(node.dtype, node.shape);
  const SliceAttrs& s = node.attrs<SliceAttrs>();
  std::vector<int64_t> x_strides = row_major_strides(x.shape());
  int64_t offset = 0;
  for (size_t d = 0; d < x_strides.size(); ++d) {
    offset += s.start[d] * x_strides[d];
    // The step between kept elements; only where more than one is kept, so a stride past the
    // dimension (x[::2**62], one element) does not overflow a step that is never taken.
    if (node.shape[d] > 1) x_strides[d] *= s.stride(d);
  }
  gather(x.data(), dtype_size(x.dtype()), offset, node.shape, x_strides, out.data());
  return out;
}

// lax.rev: the gather from each reversed dimension's last element, stepping back.
HostArray rev_kernel(const Node& node, const HostArray& x) {
  HostArray out(node.dtype, node.shape);
  std::vector<int64_t> x_strides = row_major_strides(x.shape());
  int64_t offset = 0;
  for (int64_t d : node.attrs<ReduceAttrs>().axes) {
    const size_t k = static_cast<size_t>(d);
    if (x.shape()[k] == 0) return out;  // nothing to read (and no last element to start from)
    offset += (x.shape()[k] - 1) * x_strides[k];
    x_strides[k] = -x_strides[k];
  }
  gather(x.data(), dtype_size(x.dtype()), offset, node.shape, x_strides, out.data());
  return out;
}

HostArray concatenate_kernel(const Node& node, const std::vector<const HostArray*>& xs) {
  HostArray out(node.dtype, node.shape);
  if (out.size() == 0) return out;
  // Viewed as (outer, axis * inner), each operand contributes a block of columns to every row.
  const size_t axis = static_cast<size_t>(node.attrs<ConcatAttrs>().axis);
  int64_t outer = 1, inner = dtype_size(node.dtype);
  for (size_t d = 0; d < axis; ++d) outer *= node.shape[d];
  for (size_t d = axis + 1; d < node.shape.size(); ++d) inner *= node.shape[d];
  const int64_t out_row = node.shape[axis] * inner;
  int64_t column = 0;
  for (const HostArray* x : xs) {
    const int64_t row = x->shape()[axis] * inner;
    for (int64_t i = 0; i < outer && row > 0; ++i) {
      std::memcpy(out.data() + i * out_row + column, x->data() + i * row, static_cast<size_t>(row));
    }
    column += row;
  }
  return out;
}

}  // namespace

absl::Span<const KernelEntry> layout_kernels() {
  using Operands = const std::vector<const HostArray*>&;
  static constexpr KernelEntry kKernels[] = {
      {Op::kBroadcastInDim, Backend::kCpu,
       [](const Node& n, Operands xs, std::byte*) -> absl::StatusOr<HostArray> {
         return broadcast_in_dim_kernel(n, *xs[0]);
       }},
      {Op::kReshape, Backend::kCpu,
       [](const Node& n, Operands xs, std::byte*) -> absl::StatusOr<HostArray> { return reshape_kernel(n, *xs[0]); }},
      {Op::kTranspose, Backend::kCpu,
       [](const Node& n, Operands xs, std::byte*) -> absl::StatusOr<HostArray> { return transpose_kernel(n, *xs[0]); }},
      {Op::kSlice, Backend::kCpu,
       [](const Node& n, Operands xs, std::byte*) -> absl::StatusOr<HostArray> { return slice_kernel(n, *xs[0]); }},
      {Op::kConcatenate, Backend::kCpu,
       [](const Node& n, Operands xs, std::byte*) -> absl::StatusOr<HostArray> { return concatenate_kernel(n, xs); }},
      {Op::kRev, Backend::kCpu,
       [](const Node& n, Operands xs, std::byte*) -> absl::StatusOr<HostArray> { return rev_kernel(n, *xs[0]); }},
      // Placement only: the operand's value (where it lives is the caller's business).
      {Op::kShardingConstraint, Backend::kCpu,
       [](const Node&, Operands xs, std::byte*) -> absl::StatusOr<HostArray> { return xs[0]->clone(); }},
      // lax.stop_gradient: the operand's value (what it stops is grad's business).
      {Op::kStopGradient, Backend::kCpu,
       [](const Node&, Operands xs, std::byte*) -> absl::StatusOr<HostArray> { return xs[0]->clone(); }},
  };
  return kKernels;
}

}  // namespace tessera::internal
