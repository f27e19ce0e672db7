#include "core/graph.h"

#include <algorithm>
#include <functional>
#include <iterator>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status.h"

namespace tessera {
namespace {

struct OpInfo {
  Op op;
  const char* name;
};

constexpr OpInfo kOps[] = {
    {Op::kParameter, "parameter"},
    {Op::kConstant, "constant"},
    {Op::kIota, "iota"},
    {Op::kNeg, "neg"},
    {Op::kAbs, "abs"},
    {Op::kExp, "exp"},
    {Op::kLog, "log"},
    {Op::kTanh, "tanh"},
    {Op::kLogistic, "logistic"},
    {Op::kSqrt, "sqrt"},
    {Op::kRsqrt, "rsqrt"},
    {Op::kSin, "sin"},
    {Op::kCos, "cos"},
    {Op::kFloor, "floor"},
    {Op::kCeil, "ceil"},
    {Op::kSign, "sign"},
    {Op::kNot, "not"},
    {Op::kAdd, "add"},
    {Op::kSub, "sub"},
    {Op::kMul, "mul"},
    {Op::kDiv, "div"},
    {Op::kPow, "pow"},
    {Op::kMax, "max"},
    {Op::kMin, "min"},
    {Op::kAnd, "and"},
    {Op::kOr, "or"},
    {Op::kEq, "eq"},
    {Op::kNe, "ne"},
    {Op::kLt, "lt"},
    {Op::kLe, "le"},
    {Op::kGt, "gt"},
    {Op::kGe, "ge"},
    {Op::kSelect, "select"},
    {Op::kConvert, "convert"},
    {Op::kBroadcastInDim, "broadcast_in_dim"},
    {Op::kReshape, "reshape"},
    {Op::kTranspose, "transpose"},
    {Op::kReduceSum, "reduce_sum"},
    {Op::kReduceMax, "reduce_max"},
    {Op::kReduceMin, "reduce_min"},
    {Op::kReduceProd, "reduce_prod"},
    {Op::kArgmax, "argmax"},
    {Op::kDotGeneral, "dot_general"},
    {Op::kSlice, "slice"},
    {Op::kConcatenate, "concatenate"},
    {Op::kShardingConstraint, "sharding_constraint"},
    {Op::kShardMapIn, "shard_map_in"},
    {Op::kShardMapOut, "shard_map_out"},
    {Op::kAllReduce, "all_reduce"},
    {Op::kAllGather, "all_gather"},
    {Op::kReduceScatter, "reduce_scatter"},
    {Op::kAllToAll, "all_to_all"},
    {Op::kCollectivePermute, "collective_permute"},
    {Op::kAxisIndex, "axis_index"},
    {Op::kShardingAs, "sharding_as"},
};
static_assert(std::size(kOps) == static_cast<size_t>(kLastOp) + 1, "every Op has a name, and kLastOp is the last");

std::string dims_to_string(const std::vector<int64_t>& v) { return absl::StrCat("{", absl::StrJoin(v, ","), "}"); }

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

}  // namespace

std::string op_name(Op op) {
  for (const OpInfo& info : kOps) {
    if (info.op == op) return info.name;
  }
  return "unknown";
}

std::vector<int64_t> dot_free_dims(int64_t rank, const std::vector<int64_t>& batch,
                                   const std::vector<int64_t>& contracting) {
  std::vector<int64_t> out;
  for (int64_t d = 0; d < rank; ++d) {
    if (std::find(batch.begin(), batch.end(), d) == batch.end() &&
        std::find(contracting.begin(), contracting.end(), d) == contracting.end()) {
      out.push_back(d);
    }
  }
  return out;
}

bool is_unary(Op op) { return op >= Op::kNeg && op <= Op::kNot; }
bool is_binary(Op op) { return op >= Op::kAdd && op <= Op::kGe; }
bool is_comparison(Op op) { return op >= Op::kEq && op <= Op::kGe; }
bool is_reduction(Op op) { return op >= Op::kReduceSum && op <= Op::kReduceProd; }
bool is_manual_collective(Op op) { return op >= Op::kAllReduce && op <= Op::kCollectivePermute; }

absl::StatusOr<CollectiveSpec> collective_of(const Node& n) {
  if (!is_manual_collective(n.op) || !n.sharding.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(op_name(n.op), " is not a shard_map collective"));
  }
  const Mesh& mesh = n.sharding->mesh();
  CollectiveSpec spec;
  TESSERA_ASSIGN_OR_RETURN(spec.groups, replica_groups(mesh, n.axes));
  spec.reduce_op = static_cast<ReduceOp>(n.index);
  auto dim = [&](size_t i) { return i < n.dims.size() ? static_cast<int>(n.dims[i]) : -1; };
  switch (n.op) {
    case Op::kAllReduce:
      spec.kind = CollectiveKind::kAllReduce;
      break;
    case Op::kAllGather:
      spec.kind = CollectiveKind::kAllGather;
      spec.dimension = dim(0);
      break;
    case Op::kReduceScatter:
      spec.kind = CollectiveKind::kReduceScatter;
      spec.dimension = dim(0);
      break;
    case Op::kAllToAll:
      spec.kind = CollectiveKind::kAllToAll;
      spec.split_dimension = dim(0);
      spec.concat_dimension = dim(1);
      break;
    default: {  // a permute: the position pairs in every group, as device ids; one group of all
      spec.kind = CollectiveKind::kCollectivePermute;
      std::vector<std::vector<int>> groups = std::move(spec.groups);
      for (const std::vector<int>& g : groups) {
        for (size_t i = 0; i + 1 < n.dims.size(); i += 2) spec.pairs.emplace_back(g[n.dims[i]], g[n.dims[i + 1]]);
      }
      spec.groups = {mesh.device_ids()};
      break;
    }
  }
  return spec;
}

std::string type_to_string(DType dtype, const Shape& shape) {
  static const char* const kShort[] = {"f32", "f64", "i32", "i64", "bool"};
  return absl::StrCat(kShort[static_cast<int>(dtype)], "[", absl::StrJoin(shape, ","), "]");
}

int Graph::add(Node node) {
  nodes_.push_back(std::move(node));
  return size() - 1;
}

absl::Status Graph::check_operand(int id, const char* op) const {
  if (id < 0 || id >= size()) return absl::InvalidArgumentError(absl::StrCat(op, ": operand %", id, " does not exist"));
  return absl::OkStatus();
}

int Graph::add_parameter(DType dtype, Shape shape) {
  Node n;
  n.op = Op::kParameter;
  n.dtype = dtype;
  n.shape = std::move(shape);
  n.index = static_cast<int64_t>(parameters_.size());
  const int id = add(std::move(n));
  parameters_.push_back(id);
  return id;
}

absl::StatusOr<int> Graph::add_constant(DType dtype, Shape shape, Scalar value) {
  TESSERA_RETURN_IF_ERROR(validate_shape(shape, dtype_size(dtype), "constant"));
  Node n;
  n.op = Op::kConstant;
  n.dtype = dtype;
  n.shape = std::move(shape);
  n.value = value;
  return add(std::move(n));
}

absl::StatusOr<int> Graph::add_iota(DType dtype, Shape shape, int64_t dimension) {
  TESSERA_RETURN_IF_ERROR(validate_shape(shape, dtype_size(dtype), "iota"));
  if (dimension < 0 || dimension >= static_cast<int64_t>(shape.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("iota: dimension ", dimension, " is out of range for shape ", shape_to_string(shape)));
  }
  if (dtype == DType::kBool) return absl::InvalidArgumentError("iota: bool is not a numeric dtype");
  Node n;
  n.op = Op::kIota;
  n.dtype = dtype;
  n.shape = std::move(shape);
  n.dims = {dimension};
  return add(std::move(n));
}

absl::StatusOr<int> Graph::add_unary(Op op, int x) {
  const std::string name = op_name(op);
  if (!is_unary(op)) return absl::InvalidArgumentError(absl::StrCat(name, " is not a unary op"));
  TESSERA_RETURN_IF_ERROR(check_operand(x, name.c_str()));
  const Node& a = nodes_[x];
  const bool needs_float = op != Op::kNeg && op != Op::kAbs && op != Op::kSign && op != Op::kNot;
  if (op == Op::kNot && is_floating(a.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("not: operand is ", type_to_string(a.dtype, a.shape), "; it needs bool or an integer dtype"));
  }
  if (op != Op::kNot && a.dtype == DType::kBool) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": operand is ", type_to_string(a.dtype, a.shape), "; bool is not a numeric dtype"));
  }
  if (needs_float && !is_floating(a.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": operand is ", type_to_string(a.dtype, a.shape),
                                                   "; it needs float32 or float64 (convert first)"));
  }
  Node n;
  n.op = op;
  n.dtype = a.dtype;
  n.shape = a.shape;
  n.operands = {x};
  return add(std::move(n));
}

absl::StatusOr<int> Graph::add_binary(Op op, int x, int y) {
  const std::string name = op_name(op);
  if (!is_binary(op)) return absl::InvalidArgumentError(absl::StrCat(name, " is not a binary op"));
  TESSERA_RETURN_IF_ERROR(check_operand(x, name.c_str()));
  TESSERA_RETURN_IF_ERROR(check_operand(y, name.c_str()));
  const Node& a = nodes_[x];
  const Node& b = nodes_[y];
  if (a.shape != b.shape || a.dtype != b.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": operands ", type_to_string(a.dtype, a.shape), " and ",
                                                   type_to_string(b.dtype, b.shape), " differ"));
  }
  if ((op == Op::kAnd || op == Op::kOr) && is_floating(a.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": operands are ", type_to_string(a.dtype, a.shape), "; it needs bool or an integer dtype"));
  }
  if (!is_comparison(op) && op != Op::kAnd && op != Op::kOr && op != Op::kMax && op != Op::kMin &&
      a.dtype == DType::kBool) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": operands are ", type_to_string(a.dtype, a.shape), "; bool is not a numeric dtype"));
  }
  Node n;
  n.op = op;
  n.dtype = is_comparison(op) ? DType::kBool : a.dtype;
  n.shape = a.shape;
  n.operands = {x, y};
  return add(std::move(n));
}

absl::StatusOr<int> Graph::add_select(int pred, int on_true, int on_false) {
  for (int id : {pred, on_true, on_false}) TESSERA_RETURN_IF_ERROR(check_operand(id, "select"));
  const Node& p = nodes_[pred];
  const Node& t = nodes_[on_true];
  const Node& f = nodes_[on_false];
  if (p.dtype != DType::kBool || p.shape != t.shape || t.shape != f.shape || t.dtype != f.dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("select: needs a bool predicate and two branches of its shape "
                     "and one dtype; got ",
                     type_to_string(p.dtype, p.shape), ", ", type_to_string(t.dtype, t.shape), ", ",
                     type_to_string(f.dtype, f.shape)));
  }
  Node n;
  n.op = Op::kSelect;
  n.dtype = t.dtype;
  n.shape = t.shape;
  n.operands = {pred, on_true, on_false};
  return add(std::move(n));
}

absl::StatusOr<int> Graph::add_convert(int x, DType dtype) {
  TESSERA_RETURN_IF_ERROR(check_operand(x, "convert"));
  Node n;
  n.op = Op::kConvert;
  n.dtype = dtype;
  n.shape = nodes_[x].shape;
  n.operands = {x};
  return add(std::move(n));
}

absl::StatusOr<int> Graph::add_broadcast_in_dim(int x, Shape shape, std::vector<int64_t> dims) {
  TESSERA_RETURN_IF_ERROR(check_operand(x, "broadcast_in_dim"));
  const Node& a = nodes_[x];
  const std::string what = absl::StrCat("broadcast_in_dim of ", type_to_string(a.dtype, a.shape), " to ",
                                        shape_to_string(shape), " with dims ", dims_to_string(dims));
  TESSERA_RETURN_IF_ERROR(validate_shape(shape, dtype_size(a.dtype), what));
  if (dims.size() != a.shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": needs one dim per operand dimension"));
  }
  TESSERA_RETURN_IF_ERROR(check_axes(dims, shape.size(), what));
  for (size_t i = 1; i < dims.size(); ++i) {
    if (dims[i] <= dims[i - 1]) return absl::InvalidArgumentError(absl::StrCat(what, ": dims must increase"));
  }
  for (size_t i = 0; i < dims.size(); ++i) {
    if (a.shape[i] != 1 && a.shape[i] != shape[dims[i]]) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": operand dimension ", i, " of size ", a.shape[i],
                                                     " cannot become size ", shape[dims[i]]));
    }
  }
  Node n;
  n.op = Op::kBroadcastInDim;
  n.dtype = a.dtype;
  n.shape = std::move(shape);
  n.dims = std::move(dims);
  n.operands = {x};
  return add(std::move(n));
}

absl::StatusOr<int> Graph::add_reshape(int x, Shape shape) {
  TESSERA_RETURN_IF_ERROR(check_operand(x, "reshape"));
  const Node& a = nodes_[x];
  TESSERA_RETURN_IF_ERROR(validate_shape(shape, dtype_size(a.dtype), "reshape"));
  if (num_elements(shape) != num_elements(a.shape)) {
    return absl::InvalidArgumentError(absl::StrCat("reshape: cannot reshape ", type_to_string(a.dtype, a.shape), " (",
                                                   num_elements(a.shape), " elements) to ", shape_to_string(shape),
                                                   " (", num_elements(shape), ")"));
  }
  Node n;
  n.op = Op::kReshape;
  n.dtype = a.dtype;
  n.shape = std::move(shape);
  n.operands = {x};
  return add(std::move(n));
}

absl::StatusOr<int> Graph::add_transpose(int x, std::vector<int64_t> permutation) {
  TESSERA_RETURN_IF_ERROR(check_operand(x, "transpose"));
  const Node& a = nodes_[x];
  const std::string what =
      absl::StrCat("transpose of ", type_to_string(a.dtype, a.shape), " by ", dims_to_string(permutation));
  if (permutation.size() != a.shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": needs a permutation of every dimension"));
  }
  TESSERA_RETURN_IF_ERROR(check_axes(permutation, a.shape.size(), what));
  Node n;
  n.op = Op::kTranspose;
  n.dtype = a.dtype;
  for (int64_t p : permutation) n.shape.push_back(a.shape[p]);
  n.dims = std::move(permutation);
  n.operands = {x};
  return add(std::move(n));
}

absl::StatusOr<int> Graph::add_reduce(Op op, int x, std::vector<int64_t> axes) {
  const std::string name = op_name(op);
  if (!is_reduction(op)) return absl::InvalidArgumentError(absl::StrCat(name, " is not a reduction"));
  TESSERA_RETURN_IF_ERROR(check_operand(x, name.c_str()));
  const Node& a = nodes_[x];
  TESSERA_RETURN_IF_ERROR(
      check_axes(axes, a.shape.size(), absl::StrCat(name, " of ", type_to_string(a.dtype, a.shape))));
  std::sort(axes.begin(), axes.end());
  Node n;
  n.op = op;
  n.dtype = a.dtype;
  for (size_t d = 0; d < a.shape.size(); ++d) {
    if (!std::binary_search(axes.begin(), axes.end(), static_cast<int64_t>(d))) n.shape.push_back(a.shape[d]);
  }
  n.dims = std::move(axes);
  n.operands = {x};
  return add(std::move(n));
}

absl::StatusOr<int> Graph::add_argmax(int x, int64_t axis, DType index_dtype) {
  TESSERA_RETURN_IF_ERROR(check_operand(x, "argmax"));
  const Node& a = nodes_[x];
  TESSERA_RETURN_IF_ERROR(
      check_axes({axis}, a.shape.size(), absl::StrCat("argmax of ", type_to_string(a.dtype, a.shape))));
  if (index_dtype != DType::kI32 && index_dtype != DType::kI64) {
    return absl::InvalidArgumentError("argmax: the index dtype must be int32 or int64");
  }
  if (a.shape[axis] == 0) return absl::InvalidArgumentError("argmax: the axis has size 0");
  Node n;
  n.op = Op::kArgmax;
  n.dtype = index_dtype;
  n.shape = a.shape;
  n.shape.erase(n.shape.begin() + axis);
  n.dims = {axis};
  n.operands = {x};
  return add(std::move(n));
}

absl::StatusOr<int> Graph::add_dot_general(int lhs, int rhs, DotDims dims) {
  TESSERA_RETURN_IF_ERROR(check_operand(lhs, "dot_general"));
  TESSERA_RETURN_IF_ERROR(check_operand(rhs, "dot_general"));
  const Node& a = nodes_[lhs];
  const Node& b = nodes_[rhs];
  const std::string what =
      absl::StrCat("dot_general of ", type_to_string(a.dtype, a.shape), " and ", type_to_string(b.dtype, b.shape));
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
  Node n;
  n.op = Op::kDotGeneral;
  n.dtype = a.dtype;
  for (int64_t d : dims.lhs_batch) n.shape.push_back(a.shape[d]);
  auto free_dims = [](const Shape& s, const std::vector<int64_t>& used, Shape* out) {
    for (size_t d = 0; d < s.size(); ++d) {
      if (std::find(used.begin(), used.end(), static_cast<int64_t>(d)) == used.end()) out->push_back(s[d]);
    }
  };
  free_dims(a.shape, lhs_used, &n.shape);
  free_dims(b.shape, rhs_used, &n.shape);
  n.dot = std::move(dims);
  n.operands = {lhs, rhs};
  return add(std::move(n));
}

absl::StatusOr<int> Graph::add_slice(int x, std::vector<int64_t> start, std::vector<int64_t> limit) {
  TESSERA_RETURN_IF_ERROR(check_operand(x, "slice"));
  const Node& a = nodes_[x];
  const std::string what = absl::StrCat("slice of ", type_to_string(a.dtype, a.shape), " from ", dims_to_string(start),
                                        " to ", dims_to_string(limit));
  if (start.size() != a.shape.size() || limit.size() != a.shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": needs a start and a limit per dimension"));
  }
  Node n;
  n.op = Op::kSlice;
  n.dtype = a.dtype;
  for (size_t d = 0; d < start.size(); ++d) {
    if (start[d] < 0 || start[d] > limit[d] || limit[d] > a.shape[d]) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": dimension ", d, " is out of bounds"));
    }
    n.shape.push_back(limit[d] - start[d]);
  }
  n.dims = std::move(start);
  n.limits = std::move(limit);
  n.operands = {x};
  return add(std::move(n));
}

absl::StatusOr<int> Graph::add_concatenate(const std::vector<int>& xs, int64_t axis) {
  if (xs.empty()) return absl::InvalidArgumentError("concatenate: no operands");
  for (int id : xs) TESSERA_RETURN_IF_ERROR(check_operand(id, "concatenate"));
  const Node& first = nodes_[xs[0]];
  std::vector<std::string> types;
  for (int id : xs) types.push_back(type_to_string(nodes_[id].dtype, nodes_[id].shape));
  const std::string what = absl::StrCat("concatenate of ", absl::StrJoin(types, ", "), " along axis ", axis);
  TESSERA_RETURN_IF_ERROR(check_axes({axis}, first.shape.size(), what));
  Node n;
  n.op = Op::kConcatenate;
  n.dtype = first.dtype;
  n.shape = first.shape;
  n.shape[axis] = 0;
  for (int id : xs) {
    const Node& o = nodes_[id];
    bool fits = o.dtype == first.dtype && o.shape.size() == first.shape.size();
    for (size_t d = 0; fits && d < o.shape.size(); ++d) {
      fits = static_cast<int64_t>(d) == axis || o.shape[d] == first.shape[d];
    }
    if (!fits) return absl::InvalidArgumentError(absl::StrCat(what, ": operands must agree off the axis"));
    n.shape[axis] += o.shape[axis];
  }
  n.dims = {axis};
  n.operands = xs;
  return add(std::move(n));
}

absl::StatusOr<int> Graph::add_sharding_constraint(int x, NamedSharding sharding) {
  TESSERA_RETURN_IF_ERROR(check_operand(x, "sharding_constraint"));
  const Node& a = nodes_[x];
  absl::Status fits = sharding.validate(a.shape);
  if (!fits.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("with_sharding_constraint on ", type_to_string(a.dtype, a.shape), ": ", fits.message()));
  }
  Node n;
  n.op = Op::kShardingConstraint;
  n.dtype = a.dtype;
  n.shape = a.shape;
  n.sharding = std::move(sharding);
  n.operands = {x};
  return add(std::move(n));
}

namespace {

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

}  // namespace

absl::StatusOr<int> Graph::add_shard_map_in(int x, NamedSharding sharding) {
  TESSERA_RETURN_IF_ERROR(check_operand(x, "shard_map_in"));
  const Node& a = nodes_[x];
  absl::Status fits = sharding.validate(a.shape);
  if (!fits.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard_map: in_spec for ", type_to_string(a.dtype, a.shape), ": ", fits.message()));
  }
  Node n;
  n.op = Op::kShardMapIn;
  n.dtype = a.dtype;
  n.shape = sharding.shard_shape(a.shape);
  n.sharding = std::move(sharding);
  n.operands = {x};
  return add(std::move(n));
}

absl::StatusOr<int> Graph::add_shard_map_out(int x, NamedSharding sharding) {
  TESSERA_RETURN_IF_ERROR(check_operand(x, "shard_map_out"));
  const Node& a = nodes_[x];
  TESSERA_RETURN_IF_ERROR(sharding.validate_spec());
  const PartitionSpec& spec = sharding.spec();
  if (spec.size() > static_cast<int>(a.shape.size())) {
    return absl::InvalidArgumentError(absl::StrCat("shard_map: out_spec ", spec.to_string(), " has ", spec.size(),
                                                   " entries for a value of rank ", a.shape.size()));
  }
  Node n;
  n.op = Op::kShardMapOut;
  n.dtype = a.dtype;
  n.shape = a.shape;
  for (int d = 0; d < spec.size(); ++d) n.shape[d] *= sharding.mesh().axes_size(spec.axes(d));
  TESSERA_RETURN_IF_ERROR(validate_shape(n.shape, dtype_size(n.dtype), "shard_map_out"));
  n.sharding = std::move(sharding);
  n.operands = {x};
  return add(std::move(n));
}

absl::StatusOr<int> Graph::add_collective(Op op, int x, const Mesh& mesh, std::vector<std::string> axes,
                                          std::vector<int64_t> dims, ReduceOp reduce_op) {
  const std::string what = op_name(op);
  if (!is_manual_collective(op)) return absl::InvalidArgumentError(absl::StrCat(what, " is not a collective"));
  TESSERA_RETURN_IF_ERROR(check_operand(x, what.c_str()));
  TESSERA_RETURN_IF_ERROR(check_mesh_axes(mesh, axes, what));
  const Node& a = nodes_[x];
  const int64_t n = mesh.axes_size(axes);
  const std::string over = absl::StrCat(" (the size of mesh axes ", axes_to_string(axes), ")");
  const size_t want_dims = op == Op::kAllReduce                               ? 0
                           : op == Op::kAllGather || op == Op::kReduceScatter ? 1
                           : op == Op::kAllToAll                              ? 2
                                                                              : dims.size();
  if (dims.size() != want_dims || (op == Op::kCollectivePermute && dims.size() % 2 != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", dims.size(), " dimension attributes"));
  }
  Shape shape = a.shape;
  if (op == Op::kCollectivePermute) {
    std::set<int64_t> sources, targets;
    for (size_t i = 0; i < dims.size(); i += 2) {
      for (int64_t p : {dims[i], dims[i + 1]}) {
        if (p < 0 || p >= n) {
          return absl::InvalidArgumentError(absl::StrCat(what, ": position ", p, " is outside [0, ", n, ")", over));
        }
      }
      if (!sources.insert(dims[i]).second) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": source ", dims[i], " appears twice"));
      }
      if (!targets.insert(dims[i + 1]).second) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": target ", dims[i + 1], " appears twice"));
      }
    }
  } else {
    for (int64_t d : dims) {
      if (d < 0 || d >= static_cast<int64_t>(shape.size())) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": dimension ", d, " is out of range for ", type_to_string(a.dtype, a.shape)));
      }
    }
    auto divisible = [&](int64_t d) -> absl::Status {
      if (shape[d] % n == 0) return absl::OkStatus();
      return absl::InvalidArgumentError(absl::StrCat(what, ": dimension ", d, " of ", type_to_string(a.dtype, a.shape),
                                                     " has size ", shape[d], ", not divisible by ", n, over));
    };
    if (op == Op::kAllGather) shape[dims[0]] *= n;
    if (op == Op::kReduceScatter) {
      TESSERA_RETURN_IF_ERROR(divisible(dims[0]));
      shape[dims[0]] /= n;
    }
    if (op == Op::kAllToAll) {
      TESSERA_RETURN_IF_ERROR(divisible(dims[0]));
      shape[dims[0]] /= n;
      shape[dims[1]] *= n;
    }
  }
  TESSERA_RETURN_IF_ERROR(validate_shape(shape, dtype_size(a.dtype), what.c_str()));
  Node node;
  node.op = op;
  node.dtype = a.dtype;
  node.shape = std::move(shape);
  node.operands = {x};
  node.sharding = NamedSharding(mesh, PartitionSpec());
  node.axes = std::move(axes);
  node.dims = std::move(dims);
  node.index = static_cast<int64_t>(reduce_op);
  return add(std::move(node));
}

absl::StatusOr<int> Graph::add_axis_index(const Mesh& mesh, std::vector<std::string> axes) {
  TESSERA_RETURN_IF_ERROR(check_mesh_axes(mesh, axes, "axis_index"));
  Node n;
  n.op = Op::kAxisIndex;
  n.dtype = DType::kI32;
  n.sharding = NamedSharding(mesh, PartitionSpec());
  n.axes = std::move(axes);
  return add(std::move(n));
}

absl::StatusOr<int> Graph::add_sharding_as(int x, int like) {
  TESSERA_RETURN_IF_ERROR(check_operand(x, "sharding_as"));
  TESSERA_RETURN_IF_ERROR(check_operand(like, "sharding_as"));
  const Node& a = nodes_[x];
  const Node& b = nodes_[like];
  if (a.shape != b.shape) {
    return absl::InvalidArgumentError(absl::StrCat("sharding_as: ", type_to_string(a.dtype, a.shape),
                                                   " cannot take the layout of ", type_to_string(b.dtype, b.shape),
                                                   ": the shapes differ"));
  }
  Node n;
  n.op = Op::kShardingAs;
  n.dtype = a.dtype;
  n.shape = a.shape;
  n.operands = {x, like};
  return add(std::move(n));
}

absl::Status Graph::set_outputs(std::vector<int> outputs) {
  for (int id : outputs) TESSERA_RETURN_IF_ERROR(check_operand(id, "outputs"));
  outputs_ = std::move(outputs);
  return absl::OkStatus();
}

std::string Graph::to_text() const {
  std::string out;
  for (int id = 0; id < size(); ++id) {
    const Node& n = nodes_[id];
    std::vector<std::string> operands;
    for (int o : n.operands) operands.push_back(absl::StrCat("%", o));
    absl::StrAppend(&out, "%", id, " = ", op_name(n.op), "(", absl::StrJoin(operands, ", "), ") ",
                    type_to_string(n.dtype, n.shape));
    switch (n.op) {
      case Op::kParameter:
        absl::StrAppend(&out, " index=", n.index);
        break;
      case Op::kConstant:
        absl::StrAppend(&out, " value=", n.value.to_string());
        break;
      case Op::kSlice:
        absl::StrAppend(&out, " start=", dims_to_string(n.dims), " limit=", dims_to_string(n.limits));
        break;
      case Op::kDotGeneral:
        absl::StrAppend(&out, " lhs_batch=", dims_to_string(n.dot.lhs_batch),
                        " rhs_batch=", dims_to_string(n.dot.rhs_batch),
                        " lhs_contracting=", dims_to_string(n.dot.lhs_contracting),
                        " rhs_contracting=", dims_to_string(n.dot.rhs_contracting));
        break;
      case Op::kShardingConstraint:
      case Op::kShardMapIn:
      case Op::kShardMapOut:
        absl::StrAppend(&out, " sharding=", n.sharding->to_string(), " devices={",
                        absl::StrJoin(n.sharding->mesh().device_ids(), ","), "}");
        break;
      case Op::kAllReduce:
      case Op::kAllGather:
      case Op::kReduceScatter:
      case Op::kAllToAll:
      case Op::kCollectivePermute:
      case Op::kAxisIndex:
        absl::StrAppend(&out, " axes=", axes_to_string(n.axes));
        if (n.op == Op::kAllReduce || n.op == Op::kReduceScatter) {
          absl::StrAppend(&out, " ", reduce_op_name(static_cast<ReduceOp>(n.index)));
        }
        if (!n.dims.empty()) absl::StrAppend(&out, " dims=", dims_to_string(n.dims));
        absl::StrAppend(&out, " mesh=", n.sharding->mesh().to_string(), " devices={",
                        absl::StrJoin(n.sharding->mesh().device_ids(), ","), "}");
        break;
      default:
        if (!n.dims.empty()) absl::StrAppend(&out, " dims=", dims_to_string(n.dims));
    }
    out += "\n";
  }
  std::vector<std::string> roots;
  for (int o : outputs_) roots.push_back(absl::StrCat("%", o));
  absl::StrAppend(&out, "ROOT (", absl::StrJoin(roots, ", "), ")\n");
  return out;
}

}  // namespace tessera
