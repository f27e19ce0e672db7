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

std::string dims_to_string(const std::vector<int64_t>& v) { return absl::StrCat("{", absl::StrJoin(v, ","), "}"); }

}  // namespace

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

CollectiveSpec collective_of(const Node& n) {
  CollectiveSpec spec;
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
    default:
      spec.kind = CollectiveKind::kCollectivePermute;
      break;
  }
  return spec;
}

std::string type_to_string(DType dtype, const Shape& shape) {
  static const char* const kShort[] = {"f32", "f64", "i32", "i64", "bool"};
  return absl::StrCat(kShort[static_cast<int>(dtype)], "[", absl::StrJoin(shape, ","), "]");
}

absl::Status Graph::check_operand(int id, const std::string& op) const {
  if (id < 0 || id >= size()) return absl::InvalidArgumentError(absl::StrCat(op, ": operand %", id, " does not exist"));
  return absl::OkStatus();
}

absl::StatusOr<int> Graph::add_node(Node n) {
  if (!is_op(n.op)) return absl::InvalidArgumentError(absl::StrCat("unknown op ", static_cast<int>(n.op)));
  const OpDef& def = op_def(n.op);
  std::vector<ArrayType> in;
  for (int id : n.operands) {
    TESSERA_RETURN_IF_ERROR(check_operand(id, def.name));
    in.push_back({nodes_[id].dtype, nodes_[id].shape});
  }
  if (has_trait(n.op, kReduction)) std::sort(n.dims.begin(), n.dims.end());
  TESSERA_ASSIGN_OR_RETURN(ArrayType type, infer_type(n, in));
  n.dtype = type.dtype;
  n.shape = std::move(type.shape);
  if (n.op == Op::kParameter) n.index = static_cast<int64_t>(parameters_.size());
  nodes_.push_back(std::move(n));
  if (nodes_.back().op == Op::kParameter) parameters_.push_back(size() - 1);
  return size() - 1;
}

namespace {

Node make_node(Op op, std::vector<int> operands) {
  Node n;
  n.op = op;
  n.operands = std::move(operands);
  return n;
}

}  // namespace

int Graph::add_parameter(DType dtype, Shape shape) {
  Node n = make_node(Op::kParameter, {});
  n.dtype = dtype;
  n.shape = std::move(shape);
  absl::StatusOr<int> id = add_node(std::move(n));
  if (!id.ok()) std::abort();  // REQUIRES: a valid shape
  return *id;
}

absl::StatusOr<int> Graph::add_constant(DType dtype, Shape shape, Scalar value) {
  Node n = make_node(Op::kConstant, {});
  n.dtype = dtype;
  n.shape = std::move(shape);
  n.value = value;
  return add_node(std::move(n));
}

absl::StatusOr<int> Graph::add_iota(DType dtype, Shape shape, int64_t dimension) {
  Node n = make_node(Op::kIota, {});
  n.dtype = dtype;
  n.shape = std::move(shape);
  n.dims = {dimension};
  return add_node(std::move(n));
}

absl::StatusOr<int> Graph::add_unary(Op op, int x) {
  if (!has_trait(op, kUnary)) return absl::InvalidArgumentError(absl::StrCat(op_name(op), " is not a unary op"));
  return add_node(make_node(op, {x}));
}

absl::StatusOr<int> Graph::add_binary(Op op, int x, int y) {
  if (!has_trait(op, kBinary)) return absl::InvalidArgumentError(absl::StrCat(op_name(op), " is not a binary op"));
  return add_node(make_node(op, {x, y}));
}

absl::StatusOr<int> Graph::add_select(int pred, int on_true, int on_false) {
  return add_node(make_node(Op::kSelect, {pred, on_true, on_false}));
}

absl::StatusOr<int> Graph::add_convert(int x, DType dtype) {
  Node n = make_node(Op::kConvert, {x});
  n.dtype = dtype;
  return add_node(std::move(n));
}

absl::StatusOr<int> Graph::add_broadcast_in_dim(int x, Shape shape, std::vector<int64_t> dims) {
  Node n = make_node(Op::kBroadcastInDim, {x});
  n.shape = std::move(shape);
  n.dims = std::move(dims);
  return add_node(std::move(n));
}

absl::StatusOr<int> Graph::add_reshape(int x, Shape shape) {
  Node n = make_node(Op::kReshape, {x});
  n.shape = std::move(shape);
  return add_node(std::move(n));
}

absl::StatusOr<int> Graph::add_transpose(int x, std::vector<int64_t> permutation) {
  Node n = make_node(Op::kTranspose, {x});
  n.dims = std::move(permutation);
  return add_node(std::move(n));
}

absl::StatusOr<int> Graph::add_reduce(Op op, int x, std::vector<int64_t> axes) {
  if (!has_trait(op, kReduction)) return absl::InvalidArgumentError(absl::StrCat(op_name(op), " is not a reduction"));
  Node n = make_node(op, {x});
  n.dims = std::move(axes);
  return add_node(std::move(n));
}

absl::StatusOr<int> Graph::add_argmax(int x, int64_t axis, DType index_dtype) {
  Node n = make_node(Op::kArgmax, {x});
  n.dims = {axis};
  n.dtype = index_dtype;
  return add_node(std::move(n));
}

absl::StatusOr<int> Graph::add_dot_general(int lhs, int rhs, DotDims dims) {
  Node n = make_node(Op::kDotGeneral, {lhs, rhs});
  n.dot = std::move(dims);
  return add_node(std::move(n));
}

absl::StatusOr<int> Graph::add_slice(int x, std::vector<int64_t> start, std::vector<int64_t> limit) {
  Node n = make_node(Op::kSlice, {x});
  n.dims = std::move(start);
  n.limits = std::move(limit);
  return add_node(std::move(n));
}

absl::StatusOr<int> Graph::add_concatenate(const std::vector<int>& xs, int64_t axis) {
  if (xs.empty()) return absl::InvalidArgumentError("concatenate: no operands");
  Node n = make_node(Op::kConcatenate, xs);
  n.dims = {axis};
  return add_node(std::move(n));
}

absl::StatusOr<int> Graph::add_sharding_constraint(int x, NamedSharding sharding) {
  Node n = make_node(Op::kShardingConstraint, {x});
  n.sharding = std::move(sharding);
  return add_node(std::move(n));
}

absl::StatusOr<int> Graph::add_shard_map_in(int x, NamedSharding sharding) {
  Node n = make_node(Op::kShardMapIn, {x});
  n.sharding = std::move(sharding);
  return add_node(std::move(n));
}

absl::StatusOr<int> Graph::add_shard_map_out(int x, NamedSharding sharding) {
  Node n = make_node(Op::kShardMapOut, {x});
  n.sharding = std::move(sharding);
  return add_node(std::move(n));
}

absl::StatusOr<int> Graph::add_collective(Op op, int x, const Mesh& mesh, std::vector<std::string> axes,
                                          std::vector<int64_t> dims, ReduceOp reduce_op) {
  if (!has_trait(op, kCollective)) return absl::InvalidArgumentError(absl::StrCat(op_name(op), " is not a collective"));
  Node n = make_node(op, {x});
  n.sharding = NamedSharding(mesh, PartitionSpec());
  n.axes = std::move(axes);
  n.dims = std::move(dims);
  n.index = static_cast<int64_t>(reduce_op);
  return add_node(std::move(n));
}

absl::StatusOr<int> Graph::add_axis_index(const Mesh& mesh, std::vector<std::string> axes) {
  Node n = make_node(Op::kAxisIndex, {});
  n.sharding = NamedSharding(mesh, PartitionSpec());
  n.axes = std::move(axes);
  return add_node(std::move(n));
}

absl::StatusOr<int> Graph::add_sharding_as(int x, int like) { return add_node(make_node(Op::kShardingAs, {x, like})); }

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
    const uint32_t attrs = op_def(n.op).attrs;
    if (attrs & kAttrIndex) {
      absl::StrAppend(&out, " index=", n.index);
    } else if (attrs & kAttrValue) {
      absl::StrAppend(&out, " value=", n.value.to_string());
    } else if (attrs & kAttrLimits) {
      absl::StrAppend(&out, " start=", dims_to_string(n.dims), " limit=", dims_to_string(n.limits));
    } else if (attrs & kAttrDot) {
      absl::StrAppend(&out, " lhs_batch=", dims_to_string(n.dot.lhs_batch), " rhs_batch=", dims_to_string(n.dot.rhs_batch),
                      " lhs_contracting=", dims_to_string(n.dot.lhs_contracting),
                      " rhs_contracting=", dims_to_string(n.dot.rhs_contracting));
    } else if (attrs & kAttrAxes) {
      absl::StrAppend(&out, " axes=", axes_to_string(n.axes));
      if (attrs & kAttrReduceOp) absl::StrAppend(&out, " ", reduce_op_name(static_cast<ReduceOp>(n.index)));
      if (!n.dims.empty()) absl::StrAppend(&out, " dims=", dims_to_string(n.dims));
      absl::StrAppend(&out, " mesh=", n.sharding->mesh().to_string(), " devices={",
                      absl::StrJoin(n.sharding->mesh().device_ids(), ","), "}");
    } else if (attrs & kAttrSharding) {
      absl::StrAppend(&out, " sharding=", n.sharding->to_string(), " devices={",
                      absl::StrJoin(n.sharding->mesh().device_ids(), ","), "}");
    } else if (!n.dims.empty()) {
      absl::StrAppend(&out, " dims=", dims_to_string(n.dims));
    }
    out += "\n";
  }
  std::vector<std::string> roots;
  for (int o : outputs_) roots.push_back(absl::StrCat("%", o));
  absl::StrAppend(&out, "ROOT (", absl::StrJoin(roots, ", "), ")\n");
  return out;
}

}  // namespace tessera
