// The op table: one row per op, and the ops' type rules, by family.
//
// A type rule sees the node's attributes and its operands' types, and gives the result's
// type or the precise rule broken. It is the only place an op's shapes are checked: Graph's
// add_* build a node and call it, the wire decoders call it on what arrived, and the worker
// calls it on the arrays it is handed before any arithmetic runs.
#include "core/op.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <set>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/collective.h"
#include "core/graph.h"
#include "core/pvary_cast.h"
#include "core/status.h"

namespace tessera {
namespace {

std::string dims_to_string(const std::vector<int64_t>& v) { return absl::StrCat("{", absl::StrJoin(v, ","), "}"); }
std::string type_of(const ArrayType& t) { return type_to_string(t.dtype, t.shape); }

// Checks that `axes` are distinct dimensions of a rank-`rank` array.
absl::Status check_axes(const std::vector<int64_t>& axes, size_t rank, const std::string& what) {
  std::set<int64_t> seen;
  for (int64_t a : axes) {
    if (a < 0 || a >= static_cast<int64_t>(rank)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": axis ", a, " is out of range for rank ", rank));
    }
    if (!seen.insert(a).second) return absl::InvalidArgumentError(absl::StrCat(what, ": axis ", a, " appears twice"));
  }
  return absl::OkStatus();
}

// Checks that `axes` are distinct axes of `mesh`.
absl::Status check_mesh_axes(const Mesh& mesh, const std::vector<std::string>& axes, const std::string& what) {
  if (axes.empty()) return absl::InvalidArgumentError(absl::StrCat(what, ": no mesh axis named"));
  std::set<std::string> seen;
  for (const std::string& a : axes) {
    if (mesh.axis_index(a) < 0) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": axis '", a, "' is not in the mesh ", mesh.to_string()));
    }
    if (!seen.insert(a).second)
      return absl::InvalidArgumentError(absl::StrCat(what, ": axis '", a, "' is named twice"));
  }
  return absl::OkStatus();
}

absl::StatusOr<const Mesh*> needs_mesh(const Node& n, const std::optional<Mesh>& mesh) {
  if (mesh.has_value()) return &*mesh;
  return absl::InvalidArgumentError(absl::StrCat(op_name(n.op), ": the node has no mesh"));
}

// ---- Sources: parameter, constant, iota ------------------------------------------------------

absl::StatusOr<ArrayType> infer_given(const Node& n, absl::Span<const ArrayType>) {
  TESSERA_RETURN_IF_ERROR(validate_shape(n.shape, dtype_size(n.dtype), op_name(n.op)));
  return ArrayType{n.dtype, n.shape};
}

absl::StatusOr<ArrayType> infer_iota(const Node& n, absl::Span<const ArrayType>) {
  TESSERA_RETURN_IF_ERROR(validate_shape(n.shape, dtype_size(n.dtype), "iota"));
  const int64_t dimension = n.attrs<IotaAttrs>().dimension;
  if (dimension < 0 || dimension >= static_cast<int64_t>(n.shape.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("iota: dimension ", dimension, " is out of range for shape ", shape_to_string(n.shape)));
  }
  if (n.dtype == DType::kBool) return absl::InvalidArgumentError("iota: bool is not a numeric dtype");
  return ArrayType{n.dtype, n.shape};
}

// ---- Elementwise -----------------------------------------------------------------------------

// Unary ops keep dtype and shape; these say which dtypes each takes.
absl::StatusOr<ArrayType> infer_float_unary(const Node& n, absl::Span<const ArrayType> in) {
  const std::string name = op_name(n.op);
  if (in[0].dtype == DType::kBool) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": operand is ", type_of(in[0]), "; bool is not a numeric dtype"));
  }
  if (!is_floating(in[0].dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": operand is ", type_of(in[0]),
                                                   "; it needs float32, float64, bfloat16 or float16 (convert first)"));
  }
  return in[0];
}

absl::StatusOr<ArrayType> infer_numeric_unary(const Node& n, absl::Span<const ArrayType> in) {
  if (in[0].dtype == DType::kBool) {
    return absl::InvalidArgumentError(
        absl::StrCat(op_name(n.op), ": operand is ", type_of(in[0]), "; bool is not a numeric dtype"));
  }
  return in[0];
}

absl::StatusOr<ArrayType> infer_bitwise_unary(const Node& n, absl::Span<const ArrayType> in) {
  if (is_floating(in[0].dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op_name(n.op), ": operand is ", type_of(in[0]), "; it needs bool or an integer dtype"));
  }
  return in[0];
}

// Binary ops take operands of one shape and dtype (tracing broadcasts and converts first).
absl::Status same_types(const Node& n, absl::Span<const ArrayType> in) {
  if (in[0] == in[1]) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(op_name(n.op), ": operands ", type_of(in[0]), " and ", type_of(in[1]), " differ"));
}

absl::StatusOr<ArrayType> infer_arithmetic(const Node& n, absl::Span<const ArrayType> in) {
  TESSERA_RETURN_IF_ERROR(same_types(n, in));
  if (in[0].dtype == DType::kBool) {
    return absl::InvalidArgumentError(
        absl::StrCat(op_name(n.op), ": operands are ", type_of(in[0]), "; bool is not a numeric dtype"));
  }
  return in[0];
}

absl::StatusOr<ArrayType> infer_any_binary(const Node& n, absl::Span<const ArrayType> in) {
  TESSERA_RETURN_IF_ERROR(same_types(n, in));
  return in[0];
}

absl::StatusOr<ArrayType> infer_bitwise_binary(const Node& n, absl::Span<const ArrayType> in) {
  TESSERA_RETURN_IF_ERROR(same_types(n, in));
  if (is_floating(in[0].dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op_name(n.op), ": operands are ", type_of(in[0]), "; it needs bool or an integer dtype"));
  }
  return in[0];
}

absl::StatusOr<ArrayType> infer_comparison(const Node& n, absl::Span<const ArrayType> in) {
  TESSERA_RETURN_IF_ERROR(same_types(n, in));
  return ArrayType{DType::kBool, in[0].shape};
}

absl::StatusOr<ArrayType> infer_select(const Node&, absl::Span<const ArrayType> in) {
  const ArrayType &p = in[0], &t = in[1], &f = in[2];
  if (p.dtype != DType::kBool || p.shape != t.shape || t != f) {
    return absl::InvalidArgumentError(
        absl::StrCat("select: needs a bool predicate and two branches of its shape and one dtype; got ", type_of(p),
                     ", ", type_of(t), ", ", type_of(f)));
  }
  return t;
}

absl::StatusOr<ArrayType> infer_convert(const Node& n, absl::Span<const ArrayType> in) {
  return ArrayType{n.dtype, in[0].shape};
}

// ---- Layout ----------------------------------------------------------------------------------

absl::StatusOr<ArrayType> infer_broadcast_in_dim(const Node& n, absl::Span<const ArrayType> in) {
  const ArrayType& a = in[0];
  const std::vector<int64_t>& dims = n.attrs<BroadcastAttrs>().result_dims;
  const std::string what = absl::StrCat("broadcast_in_dim of ", type_of(a), " to ", shape_to_string(n.shape),
                                        " with dims ", dims_to_string(dims));
  TESSERA_RETURN_IF_ERROR(validate_shape(n.shape, dtype_size(a.dtype), what));
  if (dims.size() != a.shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": needs one dim per operand dimension"));
  }
  TESSERA_RETURN_IF_ERROR(check_axes(dims, n.shape.size(), what));
  for (size_t i = 1; i < dims.size(); ++i) {
    if (dims[i] <= dims[i - 1]) return absl::InvalidArgumentError(absl::StrCat(what, ": dims must increase"));
  }
  for (size_t i = 0; i < dims.size(); ++i) {
    if (a.shape[i] != 1 && a.shape[i] != n.shape[dims[i]]) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": operand dimension ", i, " of size ", a.shape[i],
                                                     " cannot become size ", n.shape[dims[i]]));
    }
  }
  return ArrayType{a.dtype, n.shape};
}

absl::StatusOr<ArrayType> infer_reshape(const Node& n, absl::Span<const ArrayType> in) {
  const ArrayType& a = in[0];
  TESSERA_RETURN_IF_ERROR(validate_shape(n.shape, dtype_size(a.dtype), "reshape"));
  if (num_elements(n.shape) != num_elements(a.shape)) {
    return absl::InvalidArgumentError(absl::StrCat("reshape: cannot reshape ", type_of(a), " (", num_elements(a.shape),
                                                   " elements) to ", shape_to_string(n.shape), " (",
                                                   num_elements(n.shape), ")"));
  }
  return ArrayType{a.dtype, n.shape};
}

absl::StatusOr<ArrayType> infer_transpose(const Node& n, absl::Span<const ArrayType> in) {
  const ArrayType& a = in[0];
  const std::vector<int64_t>& permutation = n.attrs<TransposeAttrs>().permutation;
  const std::string what = absl::StrCat("transpose of ", type_of(a), " by ", dims_to_string(permutation));
  if (permutation.size() != a.shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": needs a permutation of every dimension"));
  }
  TESSERA_RETURN_IF_ERROR(check_axes(permutation, a.shape.size(), what));
  ArrayType out{a.dtype, {}};
  for (int64_t p : permutation) out.shape.push_back(a.shape[p]);
  return out;
}

absl::StatusOr<ArrayType> infer_slice(const Node& n, absl::Span<const ArrayType> in) {
  const ArrayType& a = in[0];
  const SliceAttrs& s = n.attrs<SliceAttrs>();
  const std::string what =
      absl::StrCat("slice of ", type_of(a), " from ", dims_to_string(s.start), " to ", dims_to_string(s.limit),
                   s.strides.empty() ? "" : " by " + dims_to_string(s.strides));
  if (s.start.size() != a.shape.size() || s.limit.size() != a.shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": needs a start and a limit per dimension"));
  }
  // slicing.py's _slice_shape_rule: one stride per dimension, each positive.
  if (!s.strides.empty() && s.strides.size() != a.shape.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": slice strides must have length equal to the number of dimensions of the operand"));
  }
  ArrayType out{a.dtype, {}};
  for (size_t d = 0; d < s.start.size(); ++d) {
    if (s.start[d] < 0 || s.start[d] > s.limit[d] || s.limit[d] > a.shape[d]) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": dimension ", d, " is out of bounds"));
    }
    if (s.stride(d) < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": slice strides must be positive, got (", absl::StrJoin(s.strides, ", "), ")"));
    }
    // core.stride_dim: the kept indices start, start + stride, ... below limit; ceil(n / stride)
    // without n + stride - 1, which overflows for a stride near INT64_MAX (from the wire).
    const int64_t n = s.limit[d] - s.start[d];
    out.shape.push_back(n == 0 ? 0 : 1 + (n - 1) / s.stride(d));
  }
  return out;
}

absl::StatusOr<ArrayType> infer_concatenate(const Node& n, absl::Span<const ArrayType> in) {
  std::vector<std::string> types;
  for (const ArrayType& t : in) types.push_back(type_of(t));
  const int64_t axis = n.attrs<ConcatAttrs>().axis;
  const std::string what = absl::StrCat("concatenate of ", absl::StrJoin(types, ", "), " along axis ", axis);
  TESSERA_RETURN_IF_ERROR(check_axes({axis}, in[0].shape.size(), what));
  ArrayType out = in[0];
  out.shape[axis] = 0;
  for (const ArrayType& o : in) {
    bool fits = o.dtype == in[0].dtype && o.shape.size() == in[0].shape.size();
    for (size_t d = 0; fits && d < o.shape.size(); ++d) {
      fits = static_cast<int64_t>(d) == axis || o.shape[d] == in[0].shape[d];
    }
    if (!fits) return absl::InvalidArgumentError(absl::StrCat(what, ": operands must agree off the axis"));
    out.shape[axis] += o.shape[axis];
  }
  return out;
}

// lax.rev: _rev_shape_rule (jax/_src/lax/lax.py), distinct dimensions of the operand; the
// operand's type.
absl::StatusOr<ArrayType> infer_rev(const Node& n, absl::Span<const ArrayType> in) {
  TESSERA_RETURN_IF_ERROR(
      check_axes(n.attrs<ReduceAttrs>().axes, in[0].shape.size(),
                 absl::StrCat("rev of ", type_of(in[0]), " along ", dims_to_string(n.attrs<ReduceAttrs>().axes))));
  return in[0];
}

// ---- Reductions ------------------------------------------------------------------------------

absl::StatusOr<ArrayType> infer_reduce(const Node& n, absl::Span<const ArrayType> in) {
  const ArrayType& a = in[0];
  const std::vector<int64_t>& axes = n.attrs<ReduceAttrs>().axes;
  TESSERA_RETURN_IF_ERROR(check_axes(axes, a.shape.size(), absl::StrCat(op_name(n.op), " of ", type_of(a))));
  ArrayType out{a.dtype, {}};
  for (size_t d = 0; d < a.shape.size(); ++d) {
    if (std::find(axes.begin(), axes.end(), static_cast<int64_t>(d)) == axes.end()) out.shape.push_back(a.shape[d]);
  }
  return out;
}

absl::StatusOr<ArrayType> infer_argmax(const Node& n, absl::Span<const ArrayType> in) {
  const ArrayType& a = in[0];
  const int64_t axis = n.attrs<ArgmaxAttrs>().axis;
  TESSERA_RETURN_IF_ERROR(check_axes({axis}, a.shape.size(), absl::StrCat("argmax of ", type_of(a))));
  if (n.dtype != DType::kI32 && n.dtype != DType::kI64) {
    return absl::InvalidArgumentError("argmax: the index dtype must be int32 or int64");
  }
  if (a.shape[axis] == 0) return absl::InvalidArgumentError("argmax: the axis has size 0");
  ArrayType out{n.dtype, a.shape};
  out.shape.erase(out.shape.begin() + axis);
  return out;
}

// ---- Contraction -----------------------------------------------------------------------------

absl::StatusOr<ArrayType> infer_dot_general(const Node& n, absl::Span<const ArrayType> in) {
  const ArrayType &a = in[0], &b = in[1];
  const DotDims& dims = n.attrs<DotAttrs>().dims;
  const std::string what = absl::StrCat("dot_general of ", type_of(a), " and ", type_of(b));
  if (a.dtype != b.dtype) return absl::InvalidArgumentError(absl::StrCat(what, ": dtypes differ"));
  if (a.dtype == DType::kBool) return absl::InvalidArgumentError(absl::StrCat(what, ": bool is not a numeric dtype"));
  if (dims.lhs_batch.size() != dims.rhs_batch.size() || dims.lhs_contracting.size() != dims.rhs_contracting.size()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": batch and contracting dimensions must pair up"));
  }
  std::vector<int64_t> lhs_used = dims.lhs_batch, rhs_used = dims.rhs_batch;
  lhs_used.insert(lhs_used.end(), dims.lhs_contracting.begin(), dims.lhs_contracting.end());
  rhs_used.insert(rhs_used.end(), dims.rhs_contracting.begin(), dims.rhs_contracting.end());
  TESSERA_RETURN_IF_ERROR(check_axes(lhs_used, a.shape.size(), what + " (lhs)"));
  TESSERA_RETURN_IF_ERROR(check_axes(rhs_used, b.shape.size(), what + " (rhs)"));
  for (size_t i = 0; i < dims.lhs_batch.size(); ++i) {
    if (a.shape[dims.lhs_batch[i]] != b.shape[dims.rhs_batch[i]]) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": batch dimensions ", dims.lhs_batch[i], " and ", dims.rhs_batch[i], " differ in size"));
    }
  }
  for (size_t i = 0; i < dims.lhs_contracting.size(); ++i) {
    if (a.shape[dims.lhs_contracting[i]] != b.shape[dims.rhs_contracting[i]]) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": contracting dimensions ", dims.lhs_contracting[i], " (size ", a.shape[dims.lhs_contracting[i]],
          ") and ", dims.rhs_contracting[i], " (size ", b.shape[dims.rhs_contracting[i]], ") differ"));
    }
  }
  ArrayType out{a.dtype, {}};
  for (int64_t d : dims.lhs_batch) out.shape.push_back(a.shape[d]);
  for (int64_t d : dot_free_dims(static_cast<int64_t>(a.shape.size()), dims.lhs_batch, dims.lhs_contracting)) {
    out.shape.push_back(a.shape[d]);
  }
  for (int64_t d : dot_free_dims(static_cast<int64_t>(b.shape.size()), dims.rhs_batch, dims.rhs_contracting)) {
    out.shape.push_back(b.shape[d]);
  }
  return out;
}

// ---- Indexing --------------------------------------------------------------------------------

absl::Status check_index_dtype(const std::string& what, const ArrayType& indices) {
  if (indices.dtype == DType::kI32 || indices.dtype == DType::kI64) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": indices are ", type_of(indices), "; they need int32 or int64"));
}

// X[:axis] + I[batch_dims:] + X[axis+1:]: a gather's result, a scatter's updates.
absl::StatusOr<Shape> indexed_shape(const std::string& what, const GatherAttrs& a, const ArrayType& x,
                                    const ArrayType& indices) {
  TESSERA_RETURN_IF_ERROR(check_index_dtype(what, indices));
  TESSERA_RETURN_IF_ERROR(check_axes({a.axis}, x.shape.size(), what));
  if (a.mode != IndexMode::kClip && a.mode != IndexMode::kFillOrDrop) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": unknown index mode ", static_cast<int>(a.mode)));
  }
  const int64_t n = a.batch_dims;
  if (n < 0 || n > a.axis || n > static_cast<int64_t>(indices.shape.size())) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": batch_dims ", n, " must be in [0, min(axis ", a.axis,
                                                   ", the indices' rank ", indices.shape.size(),
                                                   ")]: the batch dimensions come before the indexed one"));
  }
  for (int64_t d = 0; d < n; ++d) {
    if (x.shape[d] != indices.shape[d]) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": batch dimension ", d, " has size ", x.shape[d],
                                                     " in the operand and ", indices.shape[d],
                                                     " in the indices; batch dimensions must be equal"));
    }
  }
  if (x.shape[a.axis] == 0 && num_elements(indices.shape) > 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": dimension ", a.axis, " has size 0: nothing to index"));
  }
  Shape out(x.shape.begin(), x.shape.begin() + a.axis);
  out.insert(out.end(), indices.shape.begin() + n, indices.shape.end());
  out.insert(out.end(), x.shape.begin() + a.axis + 1, x.shape.end());
  TESSERA_RETURN_IF_ERROR(validate_shape(out, dtype_size(x.dtype), what));
  return out;
}

absl::StatusOr<ArrayType> infer_gather(const Node& n, absl::Span<const ArrayType> in) {
  const GatherAttrs& a = n.attrs<GatherAttrs>();
  const std::string what = absl::StrCat("gather of ", type_of(in[0]), " at ", type_of(in[1]), " along axis ", a.axis,
                                        a.batch_dims > 0 ? absl::StrCat(" with batch_dims ", a.batch_dims) : "");
  TESSERA_ASSIGN_OR_RETURN(Shape shape, indexed_shape(what, a, in[0], in[1]));
  if (a.fill_value.has_value() && a.mode != IndexMode::kFillOrDrop) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": a fill value needs the fill mode"));
  }
  if (a.fill_value.has_value() && !is_floating(in[0].dtype) && !a.fill_value->is_integer()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": fill value ", a.fill_value->to_string(), " is not an integer"));
  }
  return ArrayType{in[0].dtype, std::move(shape)};
}

absl::StatusOr<ArrayType> infer_scatter(const Node& n, absl::Span<const ArrayType> in) {
  const GatherAttrs& a = n.attrs<GatherAttrs>();
  const std::string what =
      absl::StrCat(op_name(n.op), " into ", type_of(in[0]), " at ", type_of(in[1]), " of ", type_of(in[2]),
                   " along axis ", a.axis, a.batch_dims > 0 ? absl::StrCat(" with batch_dims ", a.batch_dims) : "");
  TESSERA_ASSIGN_OR_RETURN(Shape shape, indexed_shape(what, a, in[0], in[1]));
  if (a.fill_value.has_value())
    return absl::InvalidArgumentError(absl::StrCat(what, ": a scatter takes no fill value"));
  if (in[2].dtype != in[0].dtype || in[2].shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": the updates must be ", type_to_string(in[0].dtype, shape)));
  }
  if (n.op == Op::kScatterAdd && in[0].dtype == DType::kBool) {
    // As lax.scatter_add's (client/lax_gather.cc): JAX's traces lax.add, and add_p takes only
    // _num dtypes (jax/_src/lax/lax.py: "add does not accept dtype bool ...").
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": add does not accept dtype bool; the operand needs a numeric dtype"));
  }
  return in[0];
}

// The starts of a dynamic window into a rank-`rank` operand: one integer per dimension.
absl::Status check_starts(const std::string& what, const ArrayType& starts, size_t rank) {
  TESSERA_RETURN_IF_ERROR(check_index_dtype(what, starts));
  if (starts.shape != Shape{static_cast<int64_t>(rank)}) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": the start indices are ", type_of(starts),
                                                   "; they need one per dimension, shape (", rank, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ArrayType> infer_dynamic_slice(const Node& n, absl::Span<const ArrayType> in) {
  const std::vector<int64_t>& sizes = n.attrs<DynamicSliceAttrs>().sizes;
  const std::string what = absl::StrCat("dynamic_slice of ", type_of(in[0]), " of sizes ", dims_to_string(sizes));
  TESSERA_RETURN_IF_ERROR(check_starts(what, in[1], in[0].shape.size()));
  if (sizes.size() != in[0].shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": needs one size per dimension"));
  }
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] < 0 || sizes[d] > in[0].shape[d]) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": size ", sizes[d], " of dimension ", d, " is outside [0, ", in[0].shape[d], "]"));
    }
  }
  return ArrayType{in[0].dtype, sizes};
}

absl::StatusOr<ArrayType> infer_dynamic_update_slice(const Node&, absl::Span<const ArrayType> in) {
  const std::string what = absl::StrCat("dynamic_update_slice of ", type_of(in[0]), " with ", type_of(in[1]));
  TESSERA_RETURN_IF_ERROR(check_starts(what, in[2], in[0].shape.size()));
  bool fits = in[1].dtype == in[0].dtype && in[1].shape.size() == in[0].shape.size();
  for (size_t d = 0; fits && d < in[0].shape.size(); ++d) fits = in[1].shape[d] <= in[0].shape[d];
  if (!fits) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the update needs the operand's dtype and rank and no larger dimensions"));
  }
  return in[0];
}

// ---- Placement and shard_map -----------------------------------------------------------------

// A shard_map boundary's manual axes (ShardingAttrs): the mesh's, each once, in mesh order,
// and every axis its spec names among them. Empty: every axis.
absl::Status check_manual_axes(const ShardingAttrs& a, const std::string& what) {
  if (a.manual_axes.empty()) return absl::OkStatus();
  const Mesh& mesh = a.sharding.mesh();
  int last = -1;
  for (const std::string& axis : a.manual_axes) {
    const int i = mesh.axis_index(axis);
    if (i <= last) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": manual axes ", axes_to_string(a.manual_axes),
                                                     " must be distinct axes of ", mesh.to_string(), " in its order"));
    }
    last = i;
  }
  for (const std::string& axis : a.sharding.spec().used_axes()) {
    if (std::find(a.manual_axes.begin(), a.manual_axes.end(), axis) == a.manual_axes.end()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": spec ", a.sharding.spec().to_string(), " names '", axis,
                                                     "', which is not one of the manual axes ",
                                                     axes_to_string(a.manual_axes)));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ArrayType> infer_sharding_constraint(const Node& n, absl::Span<const ArrayType> in) {
  if (!n.attrs<ShardingAttrs>().manual_axes.empty()) {
    return absl::InvalidArgumentError("with_sharding_constraint: manual axes belong to shard_map boundaries only");
  }
  absl::Status fits = n.attrs<ShardingAttrs>().sharding.validate(in[0].shape);
  if (!fits.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("with_sharding_constraint on ", type_of(in[0]), ": ", fits.message()));
  }
  return in[0];
}

absl::StatusOr<ArrayType> infer_sharding_as(const Node&, absl::Span<const ArrayType> in) {
  if (in[0].shape != in[1].shape) {
    return absl::InvalidArgumentError(absl::StrCat("sharding_as: ", type_of(in[0]), " cannot take the layout of ",
                                                   type_of(in[1]), ": the shapes differ"));
  }
  return in[0];
}

// Any dtype and shape, kept (stop_gradient).
absl::StatusOr<ArrayType> infer_identity(const Node&, absl::Span<const ArrayType> in) { return in[0]; }

absl::StatusOr<ArrayType> infer_argsort(const Node& n, absl::Span<const ArrayType> in) {
  TESSERA_RETURN_IF_ERROR(
      check_axes({n.attrs<ArgmaxAttrs>().axis}, in[0].shape.size(), absl::StrCat("argsort of ", type_of(in[0]))));
  return ArrayType{DType::kI32, in[0].shape};
}

absl::StatusOr<ArrayType> infer_shard_map_in(const Node& n, absl::Span<const ArrayType> in) {
  const NamedSharding* sharding = &n.attrs<ShardingAttrs>().sharding;
  TESSERA_RETURN_IF_ERROR(check_manual_axes(n.attrs<ShardingAttrs>(), "shard_map_in"));
  absl::Status fits = sharding->validate(in[0].shape);
  if (!fits.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("shard_map: in_spec for ", type_of(in[0]), ": ", fits.message()));
  }
  return ArrayType{in[0].dtype, sharding->shard_shape(in[0].shape)};
}

absl::StatusOr<ArrayType> infer_shard_map_out(const Node& n, absl::Span<const ArrayType> in) {
  const NamedSharding* sharding = &n.attrs<ShardingAttrs>().sharding;
  TESSERA_RETURN_IF_ERROR(sharding->validate_spec());
  TESSERA_RETURN_IF_ERROR(check_manual_axes(n.attrs<ShardingAttrs>(), "shard_map_out"));
  const PartitionSpec& spec = sharding->spec();
  if (spec.size() > static_cast<int>(in[0].shape.size())) {
    return absl::InvalidArgumentError(absl::StrCat("shard_map: out_spec ", spec.to_string(), " has ", spec.size(),
                                                   " entries for a value of rank ", in[0].shape.size()));
  }
  ArrayType out = in[0];
  for (int d = 0; d < spec.size(); ++d) out.shape[d] *= sharding->mesh().axes_size(spec.axes(d));
  TESSERA_RETURN_IF_ERROR(validate_shape(out.shape, dtype_size(out.dtype), "shard_map_out"));
  return out;
}

// A collective's result is collective_output_shape's (core/collective.h), the rule the
// workers apply to what they run; the graph adds what only it knows: mesh axes, and permute
// positions along them.
absl::StatusOr<ArrayType> infer_collective(const Node& n, absl::Span<const ArrayType> in) {
  const std::string what = op_name(n.op);
  const CollectiveAttrs& c = n.attrs<CollectiveAttrs>();
  const Mesh* mesh = &c.mesh;
  TESSERA_RETURN_IF_ERROR(check_mesh_axes(*mesh, c.axes, what));
  if (static_cast<int>(c.reduce_op) < 0 || c.reduce_op > ReduceOp::kProd) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": unknown reduce op ", static_cast<int>(c.reduce_op)));
  }
  if (n.op != Op::kCollectivePermute && !c.positions.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": only collective_permute takes positions"));
  }
  if (n.op == Op::kCollectivePermute) {
    if (c.positions.size() % 2 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", c.positions.size(), " positions do not pair up"));
    }
    const int64_t size = mesh->axes_size(c.axes);
    std::set<int64_t> sources, targets;
    for (size_t i = 0; i < c.positions.size(); i += 2) {
      for (int64_t p : {c.positions[i], c.positions[i + 1]}) {
        if (p < 0 || p >= size) {
          return absl::InvalidArgumentError(absl::StrCat(what, ": position ", p, " is outside [0, ", size,
                                                         ") (the size of mesh axes ", axes_to_string(c.axes), ")"));
        }
      }
      if (!sources.insert(c.positions[i]).second) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": source ", c.positions[i], " appears twice"));
      }
      if (!targets.insert(c.positions[i + 1]).second) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": target ", c.positions[i + 1], " appears twice"));
      }
    }
  }
  CollectiveSpec spec = collective_of(n);
  spec.groups = {std::vector<int>(static_cast<size_t>(mesh->axes_size(c.axes)))};  // only the size matters
  absl::StatusOr<Shape> shape = collective_output_shape(spec, in[0].shape);
  if (!shape.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(shape.status().message(), " (", what, " of ", type_of(in[0]),
                                                   " over mesh axes ", axes_to_string(c.axes), ")"));
  }
  TESSERA_RETURN_IF_ERROR(validate_shape(*shape, dtype_size(in[0].dtype), what));
  return ArrayType{in[0].dtype, *shape};
}

// pvary: the operand's type, over distinct axes of its mesh; its dimension is the cast it types
// (core/pvary_cast.h); none of the other collectives' attributes.
absl::StatusOr<ArrayType> infer_pvary(const Node& n, absl::Span<const ArrayType> in) {
  const CollectiveAttrs& c = n.attrs<CollectiveAttrs>();
  TESSERA_RETURN_IF_ERROR(check_mesh_axes(c.mesh, c.axes, "pvary"));
  PvaryCast cast;
  if (!pvary_cast_of(c.dimension, &cast)) {
    return absl::InvalidArgumentError(absl::StrCat("pvary: dimension ", c.dimension,
                                                   " names no cast (0 varying, 1 unreduced, 2 reduced, 3 invariant)"));
  }
  if (c.reduce_op != ReduceOp::kSum || c.split_dimension != 0 || c.concat_dimension != 0 || !c.positions.empty()) {
    return absl::InvalidArgumentError(
        "pvary: takes only a mesh, axes and a cast, not a reduce op, dimensions or positions");
  }
  return in[0];
}

// ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
// output's type. JAX's checks of the four index arrays, with its words
// (jax/_src/lax/parallel.py, _ragged_all_to_all_effectful_abstract_eval): each integer, of
// rank 1 and positive length; then what its docstring requires and XLA checks: one length for
// all four, divisible by the size of the axes; operand and output of one dtype and rank >= 1,
// equal beyond the leading dimension.
absl::StatusOr<ArrayType> infer_ragged_all_to_all(const Node& n, absl::Span<const ArrayType> in) {
  const CollectiveAttrs& c = n.attrs<CollectiveAttrs>();
  TESSERA_RETURN_IF_ERROR(check_mesh_axes(c.mesh, c.axes, "ragged_all_to_all"));
  if (c.reduce_op != ReduceOp::kSum || c.dimension != 0 || c.split_dimension != 0 || c.concat_dimension != 0 ||
      !c.positions.empty()) {
    return absl::InvalidArgumentError(
        "ragged_all_to_all: takes only a mesh and axes, not a reduce op, dimensions or positions");
  }
  static constexpr const char* kIndexNames[] = {"input_offsets", "send_sizes", "output_offsets", "recv_sizes"};
  for (int k = 0; k < 4; ++k) {
    const ArrayType& t = in[2 + k];
    if (is_floating(t.dtype) || t.dtype == DType::kBool) {
      return absl::InvalidArgumentError(absl::StrCat("ragged_all_to_all ", kIndexNames[k], " must be integer type."));
    }
    if (t.shape.size() != 1 || t.shape[0] < 1) {
      return absl::InvalidArgumentError(absl::StrCat("ragged_all_to_all ", kIndexNames[k],
                                                     " must be rank 1 with positive dimension size, but got shape ",
                                                     shape_to_string(t.shape)));
    }
  }
  for (int k = 1; k < 4; ++k) {
    if (in[2 + k].shape != in[2].shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ragged_all_to_all: input_offsets, send_sizes, output_offsets and recv_sizes must have one length, but ",
          kIndexNames[k], " has shape ", shape_to_string(in[2 + k].shape), " and input_offsets ",
          shape_to_string(in[2].shape)));
    }
  }
  const int64_t devices = c.mesh.axes_size(c.axes);
  if (in[2].shape[0] % devices != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ragged_all_to_all: the length of input_offsets, send_sizes, output_offsets and recv_sizes (",
                     in[2].shape[0], ") must be divisible by the size of mesh axes ", axes_to_string(c.axes), " (",
                     devices, "): each device sends them a whole number of slices"));
  }
  const ArrayType &operand = in[0], &output = in[1];
  if (operand.dtype != output.dtype) {
    return absl::InvalidArgumentError(absl::StrCat("ragged_all_to_all: operand ", type_of(operand), " and output ",
                                                   type_of(output), " must have one dtype"));
  }
  if (operand.shape.empty() || operand.shape.size() != output.shape.size() ||
      !std::equal(operand.shape.begin() + 1, operand.shape.end(), output.shape.begin() + 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ragged_all_to_all: operand ", type_of(operand), " and output ", type_of(output),
        " must have one rank, at least 1, and the same dimensions after the leading one (the rows they exchange)"));
  }
  return output;
}

absl::StatusOr<ArrayType> infer_axis_index(const Node& n, absl::Span<const ArrayType>) {
  const AxisIndexAttrs& a = n.attrs<AxisIndexAttrs>();
  TESSERA_ASSIGN_OR_RETURN(const Mesh* mesh, needs_mesh(n, a.mesh));
  TESSERA_RETURN_IF_ERROR(check_mesh_axes(*mesh, a.axes, "axis_index"));
  return ArrayType{DType::kI32, {}};
}

// ---- Control flow ----------------------------------------------------------------------------

absl::StatusOr<ArrayType> infer_scan(const Node& n, absl::Span<const ArrayType> in) {
  const ScanAttrs& a = n.attrs<ScanAttrs>();
  auto fail = [](const std::string& m) { return absl::InvalidArgumentError(absl::StrCat("scan: ", m)); };
  if (a.body == nullptr) return fail("the node has no body");
  const Graph& body = *a.body;
  const int64_t operands = static_cast<int64_t>(in.size());
  if (a.length < 0) return fail(absl::StrCat("length ", a.length, " is negative"));
  if (a.num_carry < 0 || a.num_carry > operands) {
    return fail(absl::StrCat("num_carry ", a.num_carry, " is not within the ", operands, " operands"));
  }
  if (static_cast<int64_t>(body.parameters().size()) != operands) {
    return fail(absl::StrCat("the body takes ", body.parameters().size(), " parameters, but the scan has ", operands,
                             " operands (carries and xs)"));
  }
  const int64_t outputs = static_cast<int64_t>(body.outputs().size());
  if (outputs < a.num_carry) {
    return fail(absl::StrCat("the body returns ", outputs, " values, fewer than its ", a.num_carry, " carries"));
  }
  if (a.output < 0 || a.output >= outputs) {
    return fail(absl::StrCat("output ", a.output, " is not one of the body's ", outputs, " results"));
  }
  auto param = [&](int64_t k) {
    const Node& p = body.node(body.parameters()[k]);
    return ArrayType{p.dtype, p.shape};
  };
  auto result = [&](int64_t k) {
    const Node& r = body.node(body.outputs()[k]);
    return ArrayType{r.dtype, r.shape};
  };
  for (int64_t c = 0; c < a.num_carry; ++c) {
    if (param(c) != in[c] || result(c) != in[c]) {
      return fail(absl::StrCat("carry ", c, " enters as ", type_of(in[c]), "; the body takes ", type_of(param(c)),
                               " and returns ", type_of(result(c)), " (a carry keeps its type)"));
    }
  }
  for (int64_t k = a.num_carry; k < operands; ++k) {
    ArrayType row = in[k];
    if (row.shape.empty() || row.shape[0] != a.length) {
      return fail(absl::StrCat("xs ", k - a.num_carry, " is ", type_of(in[k]),
                               "; its leading dimension must be the length ", a.length));
    }
    row.shape.erase(row.shape.begin());
    if (param(k) != row) {
      return fail(absl::StrCat("xs ", k - a.num_carry, " gives rows of ", type_of(row), " but the body takes ",
                               type_of(param(k))));
    }
  }
  if (a.output < a.num_carry) return in[a.output];
  ArrayType stacked = result(a.output);
  stacked.shape.insert(stacked.shape.begin(), a.length);
  TESSERA_RETURN_IF_ERROR(validate_shape(stacked.shape, dtype_size(stacked.dtype), "scan: the stacked ys"));
  return stacked;
}

// The checks of a sub-graph against the types it is given and returns.
absl::Status check_graph(const char* op, const std::string& what, const Graph* g, absl::Span<const ArrayType> params,
                         const std::vector<ArrayType>* results) {
  auto fail = [&](const std::string& m) { return absl::InvalidArgumentError(absl::StrCat(op, ": ", what, m)); };
  if (g == nullptr) return fail(" is missing");
  if (g->parameters().size() != params.size()) {
    return fail(absl::StrCat(" takes ", g->parameters().size(), " parameters, but the op gives it ", params.size()));
  }
  for (size_t k = 0; k < params.size(); ++k) {
    const Node& p = g->node(g->parameters()[k]);
    if (ArrayType{p.dtype, p.shape} != params[k]) {
      return fail(absl::StrCat(" takes ", type_of({p.dtype, p.shape}), " as parameter ", k, ", but is given ",
                               type_of(params[k])));
    }
  }
  if (results == nullptr) return absl::OkStatus();
  if (g->outputs().size() != results->size()) {
    return fail(absl::StrCat(" returns ", g->outputs().size(), " values, not ", results->size()));
  }
  for (size_t k = 0; k < results->size(); ++k) {
    const Node& r = g->node(g->outputs()[k]);
    if (ArrayType{r.dtype, r.shape} != (*results)[k]) {
      return fail(
          absl::StrCat(" returns ", type_of({r.dtype, r.shape}), " as result ", k, ", not ", type_of((*results)[k])));
    }
  }
  return absl::OkStatus();
}

std::vector<ArrayType> graph_results(const Graph& g) {
  std::vector<ArrayType> out;
  for (int o : g.outputs()) out.push_back({g.node(o).dtype, g.node(o).shape});
  return out;
}

absl::StatusOr<ArrayType> infer_while(const Node& n, absl::Span<const ArrayType> in) {
  const BranchesAttrs& a = n.attrs<BranchesAttrs>();
  if (a.graphs.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("while: the node has ", a.graphs.size(), " sub-graphs, not 2 (the predicate and the body)"));
  }
  const std::vector<ArrayType> carries(in.begin(), in.end());
  const std::vector<ArrayType> pred = {{DType::kBool, {}}};
  TESSERA_RETURN_IF_ERROR(check_graph("while", "the predicate", a.graphs[0].get(), in, &pred));
  TESSERA_RETURN_IF_ERROR(check_graph("while", "the body (a carry keeps its type)", a.graphs[1].get(), in, &carries));
  if (a.output < 0 || a.output >= static_cast<int64_t>(in.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("while: output ", a.output, " is not one of its ", in.size(), " carries"));
  }
  return in[a.output];
}

absl::StatusOr<ArrayType> infer_switch(const Node& n, absl::Span<const ArrayType> in) {
  const BranchesAttrs& a = n.attrs<BranchesAttrs>();
  if (in[0] != ArrayType{DType::kI32, {}}) {
    return absl::InvalidArgumentError(absl::StrCat("switch: the index is ", type_of(in[0]), ", not an int32 scalar"));
  }
  if (a.graphs.empty() || a.graphs[0] == nullptr) return absl::InvalidArgumentError("switch: the node has no branches");
  const std::vector<ArrayType> results = graph_results(*a.graphs[0]);
  for (size_t b = 0; b < a.graphs.size(); ++b) {
    TESSERA_RETURN_IF_ERROR(
        check_graph("switch", absl::StrCat("branch ", b), a.graphs[b].get(), in.subspan(1), &results));
  }
  if (a.output < 0 || a.output >= static_cast<int64_t>(results.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("switch: output ", a.output, " is not one of the branches' ", results.size(), " results"));
  }
  return results[a.output];
}

// ---- Randomness ------------------------------------------------------------------------------

absl::StatusOr<ArrayType> infer_random_bits(const Node& n, absl::Span<const ArrayType> in) {
  const RandomBitsAttrs& a = n.attrs<RandomBitsAttrs>();
  const std::string what = absl::StrCat("random_bits of ", shape_to_string(a.shape), a.words ? " (both words)" : "");
  TESSERA_RETURN_IF_ERROR(validate_shape(a.shape, 4, what));
  TESSERA_RETURN_IF_ERROR(validate_shape(n.shape, 4, what));
  // A batch of keys (uint32[batch..., 2]) with one counter each (int64[batch...]): the
  // result is each key's bits, batch dimensions first (JAX's random_bits_p over keys of any
  // shape, jax/_src/random/prng.py; vmap's form of the op).
  if (in[0].dtype != DType::kU32 || in[0].shape.empty() || in[0].shape.back() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the key is ", type_of(in[0]), "; it must be uint32[2] (or uint32[batch..., 2])"));
  }
  const Shape batch(in[0].shape.begin(), in[0].shape.end() - 1);
  if (in[1] != ArrayType{DType::kI64, batch}) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the counter is ", type_of(in[1]), "; it must be ",
                     batch.empty() ? "an int64 scalar" : type_to_string(DType::kI64, batch) + ", one per key"));
  }
  const size_t rank = a.shape.size(), b = batch.size();
  bool fits = n.shape.size() == b + rank + (a.words ? 1 : 0) && (!a.words || n.shape.back() == 2) &&
              std::equal(batch.begin(), batch.end(), n.shape.begin());
  for (size_t d = 0; fits && d < rank; ++d) fits = n.shape[b + d] <= a.shape[d];
  if (!fits) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the result shape ", shape_to_string(n.shape), " is not a block of it",
                     a.words ? " with a last dimension of 2" : "",
                     b > 0 ? absl::StrCat(" after the keys' batch ", shape_to_string(batch)) : ""));
  }
  if (n.dtype != DType::kU32) return absl::InvalidArgumentError(absl::StrCat(what, ": the result dtype is uint32"));
  return ArrayType{DType::kU32, n.shape};
}

absl::StatusOr<ArrayType> infer_shift(const Node& n, absl::Span<const ArrayType> in) {
  TESSERA_RETURN_IF_ERROR(same_types(n, in));
  if (is_floating(in[0].dtype) || in[0].dtype == DType::kBool) {
    return absl::InvalidArgumentError(
        absl::StrCat(op_name(n.op), ": operands are ", type_of(in[0]), "; it needs an integer dtype"));
  }
  return in[0];
}

// ---- The table -------------------------------------------------------------------------------

constexpr uint32_t kUnaryOp = kUnary | kElementwise | kInPlace | kHasKernel;
constexpr uint32_t kBinaryOp = kBinary | kElementwise | kInPlace | kHasKernel;
constexpr uint32_t kComparisonOp = kBinary | kComparison | kElementwise | kHasKernel | kNoGradient;
constexpr uint32_t kLayoutOp = kLayout | kHasKernel;
constexpr uint32_t kGiven = kGivenShape | kGivenDType;

// Wire numbers are pb::OpCode's (proto/tessera.proto): a new op takes the next free one.
constexpr OpDef kOps[] = {
    {Op::kParameter, "parameter", 1, 0, kNoGradient | kPinned, kGiven, kAttrsIndex<ParameterAttrs>, infer_given},
    {Op::kConstant, "constant", 2, 0, kHasKernel | kNoGradient, kGiven, kAttrsIndex<ConstantAttrs>, infer_given},
    {Op::kIota, "iota", 3, 0, kHasKernel | kNoGradient, kGiven, kAttrsIndex<IotaAttrs>, infer_iota},
    {Op::kNeg, "neg", 4, 1, kUnaryOp | kLinear, 0, kAttrsIndex<NoAttrs>, infer_numeric_unary},
    {Op::kAbs, "abs", 5, 1, kUnaryOp, 0, kAttrsIndex<NoAttrs>, infer_numeric_unary},
    {Op::kExp, "exp", 6, 1, kUnaryOp, 0, kAttrsIndex<NoAttrs>, infer_float_unary},
    {Op::kLog, "log", 7, 1, kUnaryOp, 0, kAttrsIndex<NoAttrs>, infer_float_unary},
    {Op::kTanh, "tanh", 8, 1, kUnaryOp, 0, kAttrsIndex<NoAttrs>, infer_float_unary},
    {Op::kLogistic, "logistic", 9, 1, kUnaryOp, 0, kAttrsIndex<NoAttrs>, infer_float_unary},
    {Op::kSqrt, "sqrt", 10, 1, kUnaryOp, 0, kAttrsIndex<NoAttrs>, infer_float_unary},
    {Op::kRsqrt, "rsqrt", 11, 1, kUnaryOp, 0, kAttrsIndex<NoAttrs>, infer_float_unary},
    {Op::kSin, "sin", 12, 1, kUnaryOp, 0, kAttrsIndex<NoAttrs>, infer_float_unary},
    {Op::kCos, "cos", 13, 1, kUnaryOp, 0, kAttrsIndex<NoAttrs>, infer_float_unary},
    {Op::kFloor, "floor", 14, 1, kUnaryOp | kNoGradient, 0, kAttrsIndex<NoAttrs>, infer_float_unary},
    {Op::kCeil, "ceil", 15, 1, kUnaryOp | kNoGradient, 0, kAttrsIndex<NoAttrs>, infer_float_unary},
    {Op::kSign, "sign", 16, 1, kUnaryOp | kNoGradient, 0, kAttrsIndex<NoAttrs>, infer_numeric_unary},
    {Op::kNot, "not", 17, 1, kUnaryOp | kNoGradient, 0, kAttrsIndex<NoAttrs>, infer_bitwise_unary},
    {Op::kAdd, "add", 18, 2, kBinaryOp, 0, kAttrsIndex<NoAttrs>, infer_arithmetic},
    {Op::kSub, "sub", 19, 2, kBinaryOp, 0, kAttrsIndex<NoAttrs>, infer_arithmetic},
    {Op::kMul, "mul", 20, 2, kBinaryOp, 0, kAttrsIndex<NoAttrs>, infer_arithmetic},
    {Op::kDiv, "div", 21, 2, kBinaryOp, 0, kAttrsIndex<NoAttrs>, infer_arithmetic},
    {Op::kPow, "pow", 22, 2, kBinaryOp, 0, kAttrsIndex<NoAttrs>, infer_arithmetic},
    {Op::kMax, "max", 23, 2, kBinaryOp, 0, kAttrsIndex<NoAttrs>, infer_any_binary},
    {Op::kMin, "min", 24, 2, kBinaryOp, 0, kAttrsIndex<NoAttrs>, infer_any_binary},
    {Op::kAnd, "and", 25, 2, kBinaryOp | kNoGradient, 0, kAttrsIndex<NoAttrs>, infer_bitwise_binary},
    {Op::kOr, "or", 26, 2, kBinaryOp | kNoGradient, 0, kAttrsIndex<NoAttrs>, infer_bitwise_binary},
    {Op::kEq, "eq", 27, 2, kComparisonOp, 0, kAttrsIndex<NoAttrs>, infer_comparison},
    {Op::kNe, "ne", 28, 2, kComparisonOp, 0, kAttrsIndex<NoAttrs>, infer_comparison},
    {Op::kLt, "lt", 29, 2, kComparisonOp, 0, kAttrsIndex<NoAttrs>, infer_comparison},
    {Op::kLe, "le", 30, 2, kComparisonOp, 0, kAttrsIndex<NoAttrs>, infer_comparison},
    {Op::kGt, "gt", 31, 2, kComparisonOp, 0, kAttrsIndex<NoAttrs>, infer_comparison},
    {Op::kGe, "ge", 32, 2, kComparisonOp, 0, kAttrsIndex<NoAttrs>, infer_comparison},
    {Op::kSelect, "select", 33, 3, kElementwise | kInPlace | kHasKernel, 0, kAttrsIndex<NoAttrs>, infer_select},
    {Op::kConvert, "convert", 34, 1, kElementwise | kHasKernel, kGivenDType, kAttrsIndex<NoAttrs>, infer_convert},
    {Op::kBroadcastInDim, "broadcast_in_dim", 35, 1, kLayoutOp | kLinear, kGivenShape, kAttrsIndex<BroadcastAttrs>,
     infer_broadcast_in_dim},
    {Op::kReshape, "reshape", 36, 1, kLayoutOp | kLinear, kGivenShape, kAttrsIndex<NoAttrs>, infer_reshape},
    {Op::kTranspose, "transpose", 37, 1, kLayoutOp | kLinear, 0, kAttrsIndex<TransposeAttrs>, infer_transpose},
    {Op::kReduceSum, "reduce_sum", 38, 1, kReduction | kHasKernel, 0, kAttrsIndex<ReduceAttrs>, infer_reduce},
    {Op::kReduceMax, "reduce_max", 39, 1, kReduction | kHasKernel, 0, kAttrsIndex<ReduceAttrs>, infer_reduce},
    {Op::kReduceMin, "reduce_min", 40, 1, kReduction | kHasKernel, 0, kAttrsIndex<ReduceAttrs>, infer_reduce},
    {Op::kReduceProd, "reduce_prod", 41, 1, kReduction | kHasKernel, 0, kAttrsIndex<ReduceAttrs>, infer_reduce},
    {Op::kArgmax, "argmax", 42, 1, kHasKernel | kNoGradient, kGivenDType, kAttrsIndex<ArgmaxAttrs>, infer_argmax},
    {Op::kDotGeneral, "dot_general", 43, 2, kContraction | kHasKernel, 0, kAttrsIndex<DotAttrs>, infer_dot_general},
    {Op::kSlice, "slice", 44, 1, kLayoutOp | kLinear, 0, kAttrsIndex<SliceAttrs>, infer_slice},
    {Op::kConcatenate, "concatenate", 45, kVariadic, kLayoutOp, 0, kAttrsIndex<ConcatAttrs>, infer_concatenate},
    {Op::kShardingConstraint, "sharding_constraint", 46, 1, kPlacement | kPinned | kHasKernel, 0,
     kAttrsIndex<ShardingAttrs>, infer_sharding_constraint},
    {Op::kShardMapIn, "shard_map_in", 47, 1, kBlockResult, 0, kAttrsIndex<ShardingAttrs>, infer_shard_map_in},
    {Op::kShardMapOut, "shard_map_out", 48, 1, kLeavesBody | kPinned, 0, kAttrsIndex<ShardingAttrs>,
     infer_shard_map_out},
    {Op::kAllReduce, "all_reduce", 49, 1, kCollective | kBlockResult, 0, kAttrsIndex<CollectiveAttrs>,
     infer_collective},
    {Op::kAllGather, "all_gather", 50, 1, kCollective | kBlockResult, 0, kAttrsIndex<CollectiveAttrs>,
     infer_collective},
    {Op::kReduceScatter, "reduce_scatter", 51, 1, kCollective | kBlockResult, 0, kAttrsIndex<CollectiveAttrs>,
     infer_collective},
    {Op::kAllToAll, "all_to_all", 52, 1, kCollective | kBlockResult, 0, kAttrsIndex<CollectiveAttrs>, infer_collective},
    {Op::kCollectivePermute, "collective_permute", 53, 1, kCollective | kBlockResult, 0, kAttrsIndex<CollectiveAttrs>,
     infer_collective},
    {Op::kAxisIndex, "axis_index", 54, 0, kBlockResult | kResolvedByDevice | kNoGradient, 0,
     kAttrsIndex<AxisIndexAttrs>, infer_axis_index},
    {Op::kShardingAs, "sharding_as", 55, 2, kPlacement | kPinned, 0, kAttrsIndex<NoAttrs>, infer_sharding_as},
    {Op::kErf, "erf", 56, 1, kUnaryOp, 0, kAttrsIndex<NoAttrs>, infer_float_unary},
    {Op::kGather, "gather", 57, 2, kHasKernel, 0, kAttrsIndex<GatherAttrs>, infer_gather},
    {Op::kScatter, "scatter", 58, 3, kHasKernel, 0, kAttrsIndex<GatherAttrs>, infer_scatter},
    {Op::kScatterAdd, "scatter_add", 59, 3, kHasKernel, 0, kAttrsIndex<GatherAttrs>, infer_scatter},
    {Op::kDynamicSlice, "dynamic_slice", 60, 2, kHasKernel, 0, kAttrsIndex<DynamicSliceAttrs>, infer_dynamic_slice},
    {Op::kDynamicUpdateSlice, "dynamic_update_slice", 61, 3, kHasKernel, 0, kAttrsIndex<NoAttrs>,
     infer_dynamic_update_slice},
    {Op::kRem, "rem", 62, 2, kBinaryOp, 0, kAttrsIndex<NoAttrs>, infer_arithmetic},
    {Op::kStopGradient, "stop_gradient", 63, 1, kUnary | kElementwise | kLinear | kHasKernel | kNoGradient, 0,
     kAttrsIndex<NoAttrs>, infer_identity},
    {Op::kArgsort, "argsort", 64, 1, kHasKernel | kNoGradient, 0, kAttrsIndex<ArgmaxAttrs>, infer_argsort},
    {Op::kArgsortDescending, "argsort_descending", 65, 1, kHasKernel | kNoGradient, 0, kAttrsIndex<ArgmaxAttrs>,
     infer_argsort},
    {Op::kScan, "scan", 90, kVariadic, 0, 0, kAttrsIndex<ScanAttrs>, infer_scan},
    {Op::kRandomBits, "random_bits", 80, 2, kHasKernel | kNoGradient, kGiven, kAttrsIndex<RandomBitsAttrs>,
     infer_random_bits},
    {Op::kShiftRightLogical, "shift_right_logical", 81, 2, kBinaryOp | kNoGradient, 0, kAttrsIndex<NoAttrs>,
     infer_shift},
    {Op::kErfInv, "erf_inv", 82, 1, kUnaryOp, 0, kAttrsIndex<NoAttrs>, infer_float_unary},
    {Op::kWhile, "while", 91, kVariadic, 0, 0, kAttrsIndex<BranchesAttrs>, infer_while},
    {Op::kSwitch, "switch", 92, kVariadic, 0, 0, kAttrsIndex<BranchesAttrs>, infer_switch},
    {Op::kPvary, "pvary", 66, 1, kUnary | kElementwise | kLinear | kPlacement, 0, kAttrsIndex<CollectiveAttrs>,
     infer_pvary},
    {Op::kRaggedAllToAll, "ragged_all_to_all", 67, 6, kCollective | kBlockResult, 0, kAttrsIndex<CollectiveAttrs>,
     infer_ragged_all_to_all},
    {Op::kRev, "rev", 68, 1, kLayoutOp | kLinear, 0, kAttrsIndex<ReduceAttrs>, infer_rev},
};
static_assert(std::size(kOps) == static_cast<size_t>(kNumOps), "every Op has one row in the table");

// The row of each op, by enum value; built once, checked to name each op exactly once.
struct Index {
  const OpDef* by_op[kNumOps] = {};
  Index() {
    for (const OpDef& d : kOps) {
      const int k = static_cast<int>(d.op);
      if (k < 0 || k >= kNumOps || by_op[k] != nullptr) std::abort();  // a table defect: op_table_test names it
      by_op[k] = &d;
    }
  }
};

const Index& index() {
  static const Index* const kIndex = new Index();
  return *kIndex;
}

}  // namespace

absl::Span<const OpDef> op_table() { return kOps; }

bool is_op(Op op) { return static_cast<int>(op) < kNumOps; }

const OpDef& op_def(Op op) { return *index().by_op[static_cast<int>(op)]; }

absl::StatusOr<Op> op_from_wire(int wire) {
  for (const OpDef& d : kOps) {
    if (d.wire == wire) return d.op;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown op ", wire));
}

std::string op_name(Op op) { return is_op(op) ? op_def(op).name : "unknown"; }

absl::Status check_attrs(const Node& node) {
  const int want = op_def(node.op).attrs;
  if (static_cast<int>(node.attributes.index()) == want) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(op_name(node.op), ": the node carries ",
                                                 attrs_name(static_cast<int>(node.attributes.index())),
                                                 " attributes, not ", attrs_name(want)));
}

namespace {

// The shape elementwise operands of different shapes broadcast to, when they do as a plan's
// kernels allow (rank 0, or the common rank with size 1 where another has n); nullopt when
// they all have one shape or do not broadcast so.
std::optional<Shape> broadcast_operand_shape(absl::Span<const ArrayType> operands) {
  bool differ = false;
  for (const ArrayType& t : operands) differ = differ || t.shape != operands[0].shape;
  if (!differ) return std::nullopt;  // checked first: a kernel's usual case, with no allocation
  size_t rank = 0;
  for (const ArrayType& t : operands) rank = std::max(rank, t.shape.size());
  Shape common(rank, 1);
  for (const ArrayType& t : operands) {
    if (t.shape.empty()) continue;
    if (t.shape.size() != rank) return std::nullopt;
    for (size_t i = 0; i < rank; ++i) {
      if (t.shape[i] == 1) continue;
      if (common[i] != 1 && common[i] != t.shape[i]) return std::nullopt;
      common[i] = t.shape[i];
    }
  }
  return common;
}

}  // namespace

absl::StatusOr<ArrayType> infer_type(const Node& node, absl::Span<const ArrayType> operands) {
  if (!is_op(node.op)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown op ", static_cast<int>(node.op)));
  }
  const OpDef& d = op_def(node.op);
  if (d.arity >= 0 && operands.size() != static_cast<size_t>(d.arity)) {
    return absl::InvalidArgumentError(
        absl::StrCat(d.name, ": takes ", d.arity, d.arity == 1 ? " operand" : " operands", ", got ", operands.size()));
  }
  if (d.arity < 0 && operands.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(d.name, ": takes at least one operand, got none"));
  }
  TESSERA_RETURN_IF_ERROR(check_attrs(node));
  // A plan's elementwise kernel may read an operand broadcast on the fly
  // (passes/broadcast_operands.cc): a rank-0 one, or one of the others' rank with size 1
  // along the dimensions it repeats. The rule sees every operand at the common shape; an
  // error is the rule's on the operands as given. Graphs hold no such node: Graph::add_node
  // refuses it.
  if ((d.traits & kElementwise) != 0 && operands.size() > 1) {
    std::optional<Shape> common = broadcast_operand_shape(operands);
    if (common.has_value()) {
      absl::InlinedVector<ArrayType, 4> broadcast;  // no outer vector allocated (each shape still is)
      for (const ArrayType& t : operands) broadcast.push_back({t.dtype, *common});
      absl::StatusOr<ArrayType> type = d.infer(node, broadcast);
      if (type.ok()) return type;
      TESSERA_RETURN_IF_ERROR(d.infer(node, operands).status());
      return type.status();
    }
  }
  return d.infer(node, operands);
}

Scalar default_fill_value(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kF64:
    case DType::kBF16:
    case DType::kF16:
      return std::numeric_limits<double>::quiet_NaN();
    case DType::kI32:
      return std::numeric_limits<int32_t>::min();
    case DType::kI64:
      return std::numeric_limits<int64_t>::min();
    case DType::kU32:
      return static_cast<int64_t>(std::numeric_limits<uint32_t>::max());
    case DType::kU8:
      return static_cast<int64_t>(std::numeric_limits<uint8_t>::max());
    case DType::kI8:
      return static_cast<int64_t>(std::numeric_limits<int8_t>::min());
    case DType::kI16:
      return static_cast<int64_t>(std::numeric_limits<int16_t>::min());
    case DType::kBool:
      break;
  }
  return 1;
}

uint64_t op_table_digest() {
  // FNV-1a over "name wire arity given attrs;" per op, in wire order: stable across compilers.
  std::vector<const OpDef*> rows;
  for (const OpDef& d : kOps) rows.push_back(&d);
  std::sort(rows.begin(), rows.end(), [](const OpDef* a, const OpDef* b) { return a->wire < b->wire; });
  uint64_t h = 1469598103934665603ull;
  for (const OpDef* d : rows) {
    for (char c : absl::StrCat(d->name, " ", d->wire, " ", d->arity, " ", d->given, " ", attrs_name(d->attrs), ";")) {
      h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
    }
  }
  return h;
}

}  // namespace tessera
