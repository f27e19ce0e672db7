// run_kernel: checks that the operands are what the node says they are, then hands the node to
// its family (worker/kernels/internal.h).
//
// The node may have come over the wire, so nothing about it is trusted: every attribute the
// kernels index with is checked against the operands before any arithmetic runs, and the
// result shape must be the one the attributes imply.
#include "worker/kernels/kernels.h"

#include <cstdint>
#include <new>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status.h"
#include "worker/kernels/internal.h"

namespace tessera {
namespace {

std::string type_of(const HostArray& a) { return type_to_string(a.dtype(), a.shape()); }
std::string type_of(const Node& n) { return type_to_string(n.dtype, n.shape); }
std::string dims_string(const std::vector<int64_t>& v) { return absl::StrCat("{", absl::StrJoin(v, ","), "}"); }

bool is_known(DType d) { return static_cast<uint8_t>(d) <= static_cast<uint8_t>(DType::kBool); }

// INVALID_ARGUMENT "<op>: <message>".
template <typename... Args>
absl::Status error(const Node& node, const Args&... args) {
  return absl::InvalidArgumentError(absl::StrCat(op_name(node.op), ": ", args...));
}

absl::Status expect_type(const Node& node, size_t i, const HostArray& a, DType dtype, const Shape& shape) {
  if (a.dtype() == dtype && a.shape() == shape) return absl::OkStatus();
  return error(node, "operand ", i, " is ", type_of(a), " but the node expects ", type_to_string(dtype, shape));
}

absl::Status expect_dtype(const Node& node, size_t i, const HostArray& a, DType dtype) {
  if (a.dtype() == dtype) return absl::OkStatus();
  return error(node, "operand ", i, " is ", type_of(a), " but the node expects a ", dtype_name(dtype), " operand");
}

// `axes` (the attribute called `what`) must be distinct dimensions of a rank-`rank` array.
absl::Status check_axes(const Node& node, const char* what, const std::vector<int64_t>& axes, size_t rank) {
  std::vector<bool> seen(rank, false);
  for (int64_t a : axes) {
    if (a < 0 || a >= static_cast<int64_t>(rank)) {
      return error(node, what, " ", dims_string(axes), " name dimension ", a, " of a rank-", rank, " array");
    }
    if (seen[static_cast<size_t>(a)]) return error(node, what, " ", dims_string(axes), " repeat dimension ", a);
    seen[static_cast<size_t>(a)] = true;
  }
  return absl::OkStatus();
}

bool contains(const std::vector<int64_t>& v, size_t d) {
  for (int64_t x : v) {
    if (x == static_cast<int64_t>(d)) return true;
  }
  return false;
}

// `shape` without the dimensions in `axes`.
Shape without(const Shape& shape, const std::vector<int64_t>& axes) {
  Shape out;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (!contains(axes, d)) out.push_back(shape[d]);
  }
  return out;
}

// Operands each op takes; -1 for concatenate's one or more.
int arity(Op op) {
  if (op == Op::kConstant || op == Op::kIota || op == Op::kParameter) return 0;
  if (op == Op::kSelect) return 3;
  if (is_binary(op) || op == Op::kDotGeneral) return 2;
  if (op == Op::kConcatenate) return -1;
  return 1;
}

absl::Status check_broadcast_in_dim(const Node& node, const HostArray& x) {
  TESSERA_RETURN_IF_ERROR(expect_dtype(node, 0, x, node.dtype));
  if (x.shape().size() != node.dims.size()) {
    return error(node, "operand 0 is ", type_of(x), " but dims ", dims_string(node.dims), " map ", node.dims.size(),
                 " dimensions");
  }
  TESSERA_RETURN_IF_ERROR(check_axes(node, "dims", node.dims, node.shape.size()));
  for (size_t i = 0; i < node.dims.size(); ++i) {
    const int64_t to = node.shape[static_cast<size_t>(node.dims[i])];
    if (x.shape()[i] != 1 && x.shape()[i] != to) {
      return error(node, "operand 0 is ", type_of(x), ": its dimension ", i, " of size ", x.shape()[i],
                   " cannot become dimension ", node.dims[i], " of ", type_of(node));
    }
  }
  return absl::OkStatus();
}

absl::Status check_reduce(const Node& node, const HostArray& x) {
  TESSERA_RETURN_IF_ERROR(expect_dtype(node, 0, x, node.dtype));
  TESSERA_RETURN_IF_ERROR(check_axes(node, "axes", node.dims, x.shape().size()));
  if (without(x.shape(), node.dims) != node.shape) {
    return error(node, "operand 0 is ", type_of(x), "; reducing axes ", dims_string(node.dims), " gives ",
                 type_to_string(x.dtype(), without(x.shape(), node.dims)), " but the node is ", type_of(node));
  }
  return absl::OkStatus();
}

absl::Status check_argmax(const Node& node, const HostArray& x) {
  if (node.dtype != DType::kI32 && node.dtype != DType::kI64) {
    return error(node, "the index dtype must be int32 or int64; the node is ", type_of(node));
  }
  if (node.dims.size() != 1) return error(node, "needs one axis, the node has ", dims_string(node.dims));
  TESSERA_RETURN_IF_ERROR(check_axes(node, "axis", node.dims, x.shape().size()));
  if (x.shape()[static_cast<size_t>(node.dims[0])] == 0) {
    return error(node, "operand 0 is ", type_of(x), ": axis ", node.dims[0], " has size 0");
  }
  if (without(x.shape(), node.dims) != node.shape) {
    return error(node, "operand 0 is ", type_of(x), "; argmax over axis ", node.dims[0], " gives shape ",
                 shape_to_string(without(x.shape(), node.dims)), " but the node is ", type_of(node));
  }
  return absl::OkStatus();
}

absl::Status check_dot_general(const Node& node, const HostArray& lhs, const HostArray& rhs) {
  const DotDims& dd = node.dot;
  TESSERA_RETURN_IF_ERROR(expect_dtype(node, 0, lhs, node.dtype));
  TESSERA_RETURN_IF_ERROR(expect_dtype(node, 1, rhs, node.dtype));
  if (dd.lhs_batch.size() != dd.rhs_batch.size() || dd.lhs_contracting.size() != dd.rhs_contracting.size()) {
    return error(node, "batch and contracting dimensions must pair up");
  }
  std::vector<int64_t> lhs_used = dd.lhs_batch, rhs_used = dd.rhs_batch;
  lhs_used.insert(lhs_used.end(), dd.lhs_contracting.begin(), dd.lhs_contracting.end());
  rhs_used.insert(rhs_used.end(), dd.rhs_contracting.begin(), dd.rhs_contracting.end());
  TESSERA_RETURN_IF_ERROR(check_axes(node, "lhs batch and contracting dimensions", lhs_used, lhs.shape().size()));
  TESSERA_RETURN_IF_ERROR(check_axes(node, "rhs batch and contracting dimensions", rhs_used, rhs.shape().size()));
  for (size_t i = 0; i < lhs_used.size(); ++i) {
    const int64_t l = lhs.shape()[static_cast<size_t>(lhs_used[i])];
    const int64_t r = rhs.shape()[static_cast<size_t>(rhs_used[i])];
    if (l != r) {
      return error(node, "operands ", type_of(lhs), " and ", type_of(rhs), ": lhs dimension ", lhs_used[i], " (size ",
                   l, ") and rhs dimension ", rhs_used[i], " (size ", r, ") differ");
    }
  }
  Shape result;
  for (int64_t d : dd.lhs_batch) result.push_back(lhs.shape()[static_cast<size_t>(d)]);
  for (int64_t d : without(lhs.shape(), lhs_used)) result.push_back(d);
  for (int64_t d : without(rhs.shape(), rhs_used)) result.push_back(d);
  if (result != node.shape) {
    return error(node, "operands ", type_of(lhs), " and ", type_of(rhs), " give shape ", shape_to_string(result),
                 " but the node is ", type_of(node));
  }
  return absl::OkStatus();
}

absl::Status check_slice(const Node& node, const HostArray& x) {
  TESSERA_RETURN_IF_ERROR(expect_dtype(node, 0, x, node.dtype));
  const size_t rank = x.shape().size();
  if (node.dims.size() != rank || node.limits.size() != rank || node.shape.size() != rank) {
    return error(node, "operand 0 is ", type_of(x), " but the node slices from ", dims_string(node.dims), " to ",
                 dims_string(node.limits), " into ", type_of(node));
  }
  for (size_t d = 0; d < rank; ++d) {
    const int64_t start = node.dims[d], limit = node.limits[d];
    if (start < 0 || start > limit || limit > x.shape()[d] || limit - start != node.shape[d]) {
      return error(node, "operand 0 is ", type_of(x), ": dimension ", d, " cannot be sliced from ", start, " to ",
                   limit, " into ", type_of(node));
    }
  }
  return absl::OkStatus();
}

absl::Status check_concatenate(const Node& node, const std::vector<const HostArray*>& xs) {
  if (node.dims.size() != 1) return error(node, "needs one axis, the node has ", dims_string(node.dims));
  TESSERA_RETURN_IF_ERROR(check_axes(node, "axis", node.dims, node.shape.size()));
  const size_t axis = static_cast<size_t>(node.dims[0]);
  int64_t total = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const HostArray& x = *xs[i];
    TESSERA_RETURN_IF_ERROR(expect_dtype(node, i, x, node.dtype));
    bool fits = x.shape().size() == node.shape.size();
    for (size_t d = 0; fits && d < node.shape.size(); ++d) fits = d == axis || x.shape()[d] == node.shape[d];
    total += fits ? x.shape()[axis] : 0;
    if (!fits || total > node.shape[axis]) {
      return error(node, "operand ", i, " is ", type_of(x), ", which does not fit along axis ", axis, " into ",
                   type_of(node));
    }
  }
  if (total != node.shape[axis]) {
    return error(node, "the operands add up to ", total, " along axis ", axis, " but the node is ", type_of(node));
  }
  return absl::OkStatus();
}

absl::Status check_operands(const Node& node, const std::vector<const HostArray*>& xs) {
  const int want = arity(node.op);
  if (want >= 0 && xs.size() != static_cast<size_t>(want)) {
    return error(node, "takes ", want, want == 1 ? " operand" : " operands", ", got ", xs.size());
  }
  if (want < 0 && xs.empty()) return error(node, "takes at least one operand, got none");
  for (size_t i = 0; i < xs.size(); ++i) {
    if (xs[i] == nullptr) return error(node, "operand ", i, " is null");
    if (!is_known(xs[i]->dtype())) return error(node, "operand ", i, " has an unknown dtype");
  }
  if (!is_known(node.dtype)) return error(node, "the node has an unknown dtype");
  TESSERA_RETURN_IF_ERROR(validate_shape(node.shape, dtype_size(node.dtype), op_name(node.op)));

  const Op op = node.op;
  if (is_unary(op) || op == Op::kShardingConstraint) return expect_type(node, 0, *xs[0], node.dtype, node.shape);
  if (is_comparison(op)) {
    if (node.dtype != DType::kBool) return error(node, "a comparison gives bool, but the node is ", type_of(node));
    TESSERA_RETURN_IF_ERROR(expect_type(node, 0, *xs[0], xs[0]->dtype(), node.shape));
    return expect_type(node, 1, *xs[1], xs[0]->dtype(), node.shape);
  }
  if (is_binary(op)) {
    TESSERA_RETURN_IF_ERROR(expect_type(node, 0, *xs[0], node.dtype, node.shape));
    return expect_type(node, 1, *xs[1], node.dtype, node.shape);
  }
  if (is_reduction(op)) return check_reduce(node, *xs[0]);
  switch (op) {
    case Op::kConstant:
      return absl::OkStatus();
    case Op::kIota:
      if (node.dims.size() != 1) return error(node, "needs one dimension, the node has ", dims_string(node.dims));
      return check_axes(node, "dimension", node.dims, node.shape.size());
    case Op::kSelect:
      TESSERA_RETURN_IF_ERROR(expect_type(node, 0, *xs[0], DType::kBool, node.shape));
      TESSERA_RETURN_IF_ERROR(expect_type(node, 1, *xs[1], node.dtype, node.shape));
      return expect_type(node, 2, *xs[2], node.dtype, node.shape);
    case Op::kConvert:
      return expect_type(node, 0, *xs[0], xs[0]->dtype(), node.shape);
    case Op::kBroadcastInDim:
      return check_broadcast_in_dim(node, *xs[0]);
    case Op::kReshape:
      TESSERA_RETURN_IF_ERROR(expect_dtype(node, 0, *xs[0], node.dtype));
      if (xs[0]->size() != num_elements(node.shape)) {
        return error(node, "operand 0 is ", type_of(*xs[0]), " (", xs[0]->size(), " elements) but the node is ",
                     type_of(node), " (", num_elements(node.shape), ")");
      }
      return absl::OkStatus();
    case Op::kTranspose: {
      if (node.dims.size() != node.shape.size()) {
        return error(node, "permutation ", dims_string(node.dims), " does not fit the node ", type_of(node));
      }
      TESSERA_RETURN_IF_ERROR(check_axes(node, "permutation", node.dims, node.shape.size()));
      Shape from(node.shape.size());
      for (size_t i = 0; i < node.dims.size(); ++i) from[static_cast<size_t>(node.dims[i])] = node.shape[i];
      return expect_type(node, 0, *xs[0], node.dtype, from);
    }
    case Op::kArgmax:
      return check_argmax(node, *xs[0]);
    case Op::kDotGeneral:
      return check_dot_general(node, *xs[0], *xs[1]);
    case Op::kSlice:
      return check_slice(node, *xs[0]);
    case Op::kConcatenate:
      return check_concatenate(node, xs);
    default:
      return error(node, "has no kernel");
  }
}

// REQUIRES: check_operands(node, xs) is OK; `into` is null unless can_run_in_place (then the
// result is written there and an empty array returned).
absl::StatusOr<HostArray> compute(const Node& node, const std::vector<const HostArray*>& xs, std::byte* into) {
  const Op op = node.op;
  if (is_unary(op)) return internal::unary_kernel(node, *xs[0], into);
  if (is_binary(op)) return internal::binary_kernel(node, *xs[0], *xs[1], into);
  if (is_reduction(op)) return internal::reduce_kernel(node, *xs[0]);
  switch (op) {
    case Op::kConstant:
      return internal::constant_kernel(node);
    case Op::kIota:
      return internal::iota_kernel(node);
    case Op::kSelect:
      return internal::select_kernel(node, *xs[0], *xs[1], *xs[2], into);
    case Op::kConvert:
      return internal::convert_kernel(node, *xs[0]);
    case Op::kBroadcastInDim:
      return internal::broadcast_in_dim_kernel(node, *xs[0]);
    case Op::kReshape:
      return internal::reshape_kernel(node, *xs[0]);
    case Op::kTranspose:
      return internal::transpose_kernel(node, *xs[0]);
    case Op::kArgmax:
      return internal::argmax_kernel(node, *xs[0]);
    case Op::kDotGeneral:
      return internal::dot_general_kernel(node, *xs[0], *xs[1]);
    case Op::kSlice:
      return internal::slice_kernel(node, *xs[0]);
    case Op::kConcatenate:
      return internal::concatenate_kernel(node, xs);
    case Op::kShardingConstraint:
      return xs[0]->clone();
    default:
      return error(node, "has no kernel");
  }
}

absl::Status check_node(const Node& node, const std::vector<const HostArray*>& operands) {
  if (static_cast<uint8_t>(node.op) > static_cast<uint8_t>(Op::kShardingConstraint)) {
    return absl::InvalidArgumentError(absl::StrCat("run_kernel: unknown op ", static_cast<int>(node.op)));
  }
  if (node.op == Op::kParameter) {
    return error(node, "has no kernel: a parameter's value is an input of the program, not computed");
  }
  return check_operands(node, operands);
}

}  // namespace

bool can_run_in_place(const Node& node, const HostArray& operand) {
  const bool elementwise =
      is_unary(node.op) || (is_binary(node.op) && !is_comparison(node.op)) || node.op == Op::kSelect;
  return elementwise && operand.dtype() == node.dtype && operand.shape() == node.shape;
}

absl::Status run_kernel_in_place(const Node& node, const std::vector<const HostArray*>& operands, int reuse) {
  TESSERA_RETURN_IF_ERROR(check_node(node, operands));
  if (reuse < 0 || reuse >= static_cast<int>(operands.size()) || !can_run_in_place(node, *operands[reuse])) {
    return error(node, "cannot write its result over operand ", reuse);
  }
  // The storage is a heap block separate from the (possibly const) HostArray object: writing
  // it is defined; the caller guarantees nobody else reads it.
  return compute(node, operands, const_cast<std::byte*>(operands[reuse]->data())).status();
}

absl::StatusOr<HostArray> run_kernel(const Node& node, const std::vector<const HostArray*>& operands) {
  TESSERA_RETURN_IF_ERROR(check_node(node, operands));
  try {
    return compute(node, operands, nullptr);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat(op_name(node.op), ": out of memory for the result ", type_of(node), " or its temporaries"));
  }
}

}  // namespace tessera
