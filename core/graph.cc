#include "core/graph.h"

#include <algorithm>
#include <functional>
#include <iterator>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "core/pvary_cast.h"
#include "core/status.h"

namespace tessera {
namespace {

std::string dims_to_string(const std::vector<int64_t>& v) { return absl::StrCat("{", absl::StrJoin(v, ","), "}"); }

std::string mesh_text(const Mesh& mesh) {
  return absl::StrCat(" mesh=", mesh.to_string(), " devices={", absl::StrJoin(mesh.device_ids(), ","), "}");
}

// Each kind's text, as Graph::to_text prints it after the type: " start={0} limit={4}".
std::string text(const NoAttrs&, Op) { return ""; }
std::string text(const ParameterAttrs& a, Op) { return absl::StrCat(" index=", a.index); }
std::string text(const ConstantAttrs& a, Op) { return absl::StrCat(" value=", a.value.to_string()); }
std::string text(const IotaAttrs& a, Op) { return absl::StrCat(" dims={", a.dimension, "}"); }
// A list of dimensions, " dims={...}", printed when not empty.
std::string dims_text(const std::vector<int64_t>& v) { return v.empty() ? "" : " dims=" + dims_to_string(v); }
std::string text(const BroadcastAttrs& a, Op) { return dims_text(a.result_dims); }
std::string text(const TransposeAttrs& a, Op) { return dims_text(a.permutation); }
std::string text(const ReduceAttrs& a, Op) { return dims_text(a.axes); }
std::string text(const ArgmaxAttrs& a, Op) { return absl::StrCat(" dims={", a.axis, "}"); }
std::string text(const SliceAttrs& a, Op) {
  return absl::StrCat(" start=", dims_to_string(a.start), " limit=", dims_to_string(a.limit),
                      a.strides.empty() ? "" : " strides=" + dims_to_string(a.strides));
}
std::string text(const ConcatAttrs& a, Op) { return absl::StrCat(" dims={", a.axis, "}"); }
std::string text(const DotAttrs& a, Op) {
  return absl::StrCat(" lhs_batch=", dims_to_string(a.dims.lhs_batch), " rhs_batch=", dims_to_string(a.dims.rhs_batch),
                      " lhs_contracting=", dims_to_string(a.dims.lhs_contracting),
                      " rhs_contracting=", dims_to_string(a.dims.rhs_contracting));
}
std::string text(const ShardingAttrs& a, Op) {
  return absl::StrCat(" sharding=", a.sharding.to_string(), " devices={",
                      absl::StrJoin(a.sharding.mesh().device_ids(), ","), "}",
                      a.manual_axes.empty() ? "" : absl::StrCat(" manual_axes=", axes_to_string(a.manual_axes)));
}
std::string text(const AxisIndexAttrs& a, Op) {
  return absl::StrCat(" axes=", axes_to_string(a.axes), a.mesh.has_value() ? mesh_text(*a.mesh) : "");
}

std::string text(const GatherAttrs& a, Op) {
  return absl::StrCat(" dims={", a.axis, "} mode=", a.mode == IndexMode::kClip ? "clip" : "fill_or_drop",
                      a.fill_value.has_value() ? " fill=" + a.fill_value->to_string() : "",
                      a.batch_dims != 0 ? absl::StrCat(" batch_dims=", a.batch_dims) : "");
}
std::string text(const DynamicSliceAttrs& a, Op) { return " sizes=" + dims_to_string(a.sizes); }
std::string text(const RandomBitsAttrs& a, Op) { return " of=" + dims_to_string(a.shape) + (a.words ? " words" : ""); }

// A scan prints its body indented under it, one node per line.
std::string text(const ScanAttrs& a, Op) {
  std::string body = a.body == nullptr ? "" : a.body->to_text();
  if (!body.empty() && body.back() == '\n') body.pop_back();
  return absl::StrCat(" length=", a.length, a.reverse ? " reverse" : "", " num_carry=", a.num_carry,
                      " output=", a.output, " body={\n    ", absl::StrReplaceAll(body, {{"\n", "\n    "}}), "\n  }");
}

// while / switch print their sub-graphs indented under them.
std::string text(const BranchesAttrs& a, Op) {
  std::string out = absl::StrCat(" output=", a.output);
  for (size_t k = 0; k < a.graphs.size(); ++k) {
    std::string g = a.graphs[k] == nullptr ? "" : a.graphs[k]->to_text();
    if (!g.empty() && g.back() == '\n') g.pop_back();
    absl::StrAppend(&out, " graph", k, "={\n    ", absl::StrReplaceAll(g, {{"\n", "\n    "}}), "\n  }");
  }
  return out;
}

// A collective prints the dimension list it is built from (add_collective).
std::string text(const CollectiveAttrs& c, Op op) {
  std::vector<int64_t> dims;
  if (op == Op::kAllGather || op == Op::kReduceScatter) dims = {c.dimension};
  if (op == Op::kAllToAll) dims = {c.split_dimension, c.concat_dimension};
  if (op == Op::kCollectivePermute) dims = c.positions;
  std::string out = absl::StrCat(" axes=", axes_to_string(c.axes));
  if (op == Op::kAllReduce || op == Op::kReduceScatter) absl::StrAppend(&out, " ", reduce_op_name(c.reduce_op));
  PvaryCast cast;
  if (op == Op::kPvary && c.dimension != 0 && pvary_cast_of(c.dimension, &cast)) {
    absl::StrAppend(&out, " to=", pvary_cast_name(cast));
  }
  return out + dims_text(dims) + mesh_text(c.mesh);
}

}  // namespace

const Mesh* mesh_of(const Node& n) {
  if (const auto* s = std::get_if<ShardingAttrs>(&n.attributes)) return &s->sharding.mesh();
  if (const auto* c = std::get_if<CollectiveAttrs>(&n.attributes)) return &c->mesh;
  if (const auto* a = std::get_if<AxisIndexAttrs>(&n.attributes)) return a->mesh.has_value() ? &*a->mesh : nullptr;
  return nullptr;
}

std::string attrs_to_text(const Node& n) {
  return std::visit([&n](const auto& a) { return text(a, n.op); }, n.attributes);
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

CollectiveSpec collective_of(const Node& n) {
  const CollectiveAttrs& c = n.attrs<CollectiveAttrs>();
  CollectiveSpec spec;
  spec.reduce_op = c.reduce_op;
  switch (n.op) {
    case Op::kAllReduce:
      spec.kind = CollectiveKind::kAllReduce;
      break;
    case Op::kAllGather:
      spec.kind = CollectiveKind::kAllGather;
      spec.dimension = static_cast<int>(c.dimension);
      break;
    case Op::kReduceScatter:
      spec.kind = CollectiveKind::kReduceScatter;
      spec.dimension = static_cast<int>(c.dimension);
      break;
    case Op::kAllToAll:
      spec.kind = CollectiveKind::kAllToAll;
      spec.split_dimension = static_cast<int>(c.split_dimension);
      spec.concat_dimension = static_cast<int>(c.concat_dimension);
      break;
    case Op::kRaggedAllToAll:
      spec.kind = CollectiveKind::kRaggedAllToAll;
      break;
    default:
      spec.kind = CollectiveKind::kCollectivePermute;
      break;
  }
  return spec;
}

bool graph_extends(const Graph& big, const Graph& small) {
  if (&big == &small) return true;
  if (big.size() < small.size() || big.outputs().size() < small.outputs().size()) return false;
  if (!std::equal(small.outputs().begin(), small.outputs().end(), big.outputs().begin())) return false;
  for (int id = 0; id < small.size(); ++id) {
    const Node& a = big.node(id);
    const Node& b = small.node(id);
    if (a.op != b.op || a.dtype != b.dtype || a.shape != b.shape || a.operands != b.operands ||
        attrs_to_text(a) != attrs_to_text(b)) {
      return false;
    }
  }
  return true;
}

std::string type_to_string(DType dtype, const Shape& shape) {
  static const char* const kShort[] = {"f32", "f64", "i32", "i64", "bool", "u32", "bf16", "f16", "u8", "i8", "i16"};
  static_assert(std::size(kShort) == std::size(kAllDTypes), "one short name per dtype");
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
  if (auto* reduce = std::get_if<ReduceAttrs>(&n.attributes)) std::sort(reduce->axes.begin(), reduce->axes.end());
  // One stride of 1 per dimension is stored empty (add_slice's and the wire's alike); strides of
  // another length are left for the type rule to refuse, as _slice_shape_rule does.
  if (auto* slice = std::get_if<SliceAttrs>(&n.attributes);
      slice != nullptr && slice->strides.size() == slice->start.size() &&
      std::all_of(slice->strides.begin(), slice->strides.end(), [](int64_t s) { return s == 1; })) {
    slice->strides.clear();
  }
  TESSERA_ASSIGN_OR_RETURN(ArrayType type, infer_type(n, in));
  // The type rule lets a plan's elementwise kernel read a scalar operand as broadcast; a graph
  // broadcasts explicitly, so that every layer sees one shape per elementwise node.
  if (has_trait(n.op, kElementwise) &&
      std::any_of(in.begin(), in.end(), [&](const ArrayType& t) { return t.shape != type.shape; })) {
    std::vector<std::string> types;
    for (const ArrayType& t : in) types.push_back(type_to_string(t.dtype, t.shape));
    return absl::InvalidArgumentError(
        absl::StrCat(def.name, ": operands ", absl::StrJoin(types, ", "), " differ in shape (broadcast_in_dim first)"));
  }
  n.dtype = type.dtype;
  n.shape = std::move(type.shape);
  if (n.op == Op::kParameter) n.attrs<ParameterAttrs>().index = static_cast<int64_t>(parameters_.size());
  nodes_.push_back(std::move(n));
  if (nodes_.back().op == Op::kParameter) parameters_.push_back(size() - 1);
  return size() - 1;
}

namespace {

Node make_node(Op op, std::vector<int> operands, Attrs attrs = NoAttrs{}) {
  Node n;
  n.op = op;
  n.operands = std::move(operands);
  n.attributes = std::move(attrs);
  return n;
}

}  // namespace

int Graph::add_parameter(DType dtype, Shape shape) {
  Node n = make_node(Op::kParameter, {}, ParameterAttrs{});
  n.dtype = dtype;
  n.shape = std::move(shape);
  absl::StatusOr<int> id = add_node(std::move(n));
  if (!id.ok()) std::abort();  // REQUIRES: a valid shape
  return *id;
}

absl::StatusOr<int> Graph::add_constant(DType dtype, Shape shape, Scalar value) {
  Node n = make_node(Op::kConstant, {}, ConstantAttrs{value});
  n.dtype = dtype;
  n.shape = std::move(shape);
  return add_node(std::move(n));
}

absl::StatusOr<int> Graph::add_iota(DType dtype, Shape shape, int64_t dimension) {
  Node n = make_node(Op::kIota, {}, IotaAttrs{dimension});
  n.dtype = dtype;
  n.shape = std::move(shape);
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
  Node n = make_node(Op::kBroadcastInDim, {x}, BroadcastAttrs{std::move(dims)});
  n.shape = std::move(shape);
  return add_node(std::move(n));
}

absl::StatusOr<int> Graph::add_reshape(int x, Shape shape) {
  Node n = make_node(Op::kReshape, {x});
  n.shape = std::move(shape);
  return add_node(std::move(n));
}

absl::StatusOr<int> Graph::add_transpose(int x, std::vector<int64_t> permutation) {
  return add_node(make_node(Op::kTranspose, {x}, TransposeAttrs{std::move(permutation)}));
}

absl::StatusOr<int> Graph::add_reduce(Op op, int x, std::vector<int64_t> axes) {
  if (!has_trait(op, kReduction)) return absl::InvalidArgumentError(absl::StrCat(op_name(op), " is not a reduction"));
  return add_node(make_node(op, {x}, ReduceAttrs{std::move(axes)}));
}

absl::StatusOr<int> Graph::add_argmax(int x, int64_t axis, DType index_dtype) {
  Node n = make_node(Op::kArgmax, {x}, ArgmaxAttrs{axis});
  n.dtype = index_dtype;
  return add_node(std::move(n));
}

absl::StatusOr<int> Graph::add_dot_general(int lhs, int rhs, DotDims dims) {
  return add_node(make_node(Op::kDotGeneral, {lhs, rhs}, DotAttrs{std::move(dims)}));
}

absl::StatusOr<int> Graph::add_slice(int x, std::vector<int64_t> start, std::vector<int64_t> limit,
                                     std::vector<int64_t> strides) {
  return add_node(make_node(Op::kSlice, {x}, SliceAttrs{std::move(start), std::move(limit), std::move(strides)}));
}

absl::StatusOr<int> Graph::add_rev(int x, std::vector<int64_t> dimensions) {
  return add_node(make_node(Op::kRev, {x}, ReduceAttrs{std::move(dimensions)}));
}

absl::StatusOr<int> Graph::add_concatenate(const std::vector<int>& xs, int64_t axis) {
  if (xs.empty()) return absl::InvalidArgumentError("concatenate: no operands");
  return add_node(make_node(Op::kConcatenate, xs, ConcatAttrs{axis}));
}

absl::StatusOr<int> Graph::add_sharding_constraint(int x, NamedSharding sharding) {
  return add_node(make_node(Op::kShardingConstraint, {x}, ShardingAttrs{std::move(sharding)}));
}

absl::StatusOr<int> Graph::add_shard_map_in(int x, NamedSharding sharding, std::vector<std::string> manual_axes) {
  return add_node(make_node(Op::kShardMapIn, {x}, ShardingAttrs{std::move(sharding), std::move(manual_axes)}));
}

absl::StatusOr<int> Graph::add_shard_map_out(int x, NamedSharding sharding, std::vector<std::string> manual_axes) {
  return add_node(make_node(Op::kShardMapOut, {x}, ShardingAttrs{std::move(sharding), std::move(manual_axes)}));
}

absl::StatusOr<int> Graph::add_collective(Op op, int x, const Mesh& mesh, std::vector<std::string> axes,
                                          std::vector<int64_t> dims, ReduceOp reduce_op) {
  if (!has_trait(op, kCollective)) return absl::InvalidArgumentError(absl::StrCat(op_name(op), " is not a collective"));
  // The dimension attributes, as the op takes them.
  const size_t want = op == Op::kAllReduce                               ? 0
                      : op == Op::kAllGather || op == Op::kReduceScatter ? 1
                      : op == Op::kAllToAll                              ? 2
                                                                         : dims.size();
  if (dims.size() != want) {
    return absl::InvalidArgumentError(absl::StrCat(op_name(op), ": ", dims.size(), " dimension attributes"));
  }
  CollectiveAttrs attrs{mesh, std::move(axes), reduce_op, 0, 0, 0, {}};
  if (want == 1) attrs.dimension = dims[0];
  if (op == Op::kAllToAll) {
    attrs.split_dimension = dims[0];
    attrs.concat_dimension = dims[1];
  }
  if (op == Op::kCollectivePermute) attrs.positions = std::move(dims);
  return add_node(make_node(op, {x}, std::move(attrs)));
}

absl::StatusOr<int> Graph::add_axis_index(const Mesh& mesh, std::vector<std::string> axes) {
  return add_node(make_node(Op::kAxisIndex, {}, AxisIndexAttrs{mesh, std::move(axes)}));
}

absl::StatusOr<int> Graph::add_pvary(int x, const Mesh& mesh, std::vector<std::string> axes) {
  return add_node(make_node(Op::kPvary, {x}, CollectiveAttrs{mesh, std::move(axes), ReduceOp::kSum, 0, 0, 0, {}}));
}

absl::StatusOr<int> Graph::add_ragged_all_to_all(std::vector<int> operands, const Mesh& mesh,
                                                 std::vector<std::string> axes) {
  return add_node(make_node(Op::kRaggedAllToAll, std::move(operands),
                            CollectiveAttrs{mesh, std::move(axes), ReduceOp::kSum, 0, 0, 0, {}}));
}

absl::StatusOr<int> Graph::add_gather(int x, int indices, GatherAttrs attrs) {
  return add_node(make_node(Op::kGather, {x, indices}, std::move(attrs)));
}

absl::StatusOr<int> Graph::add_scatter(Op op, int x, int indices, int updates, GatherAttrs attrs) {
  if (op != Op::kScatter && op != Op::kScatterAdd) {
    return absl::InvalidArgumentError(absl::StrCat(op_name(op), " is not a scatter"));
  }
  return add_node(make_node(op, {x, indices, updates}, std::move(attrs)));
}

absl::StatusOr<int> Graph::add_random_bits(int key, int counter, Shape shape, bool words) {
  Node n = make_node(Op::kRandomBits, {key, counter}, RandomBitsAttrs{shape, words});
  n.dtype = DType::kU32;
  if (key >= 0 && key < static_cast<int>(nodes_.size()) && !nodes_[key].shape.empty()) {
    n.shape.assign(nodes_[key].shape.begin(), nodes_[key].shape.end() - 1);  // a batch of keys
  }
  n.shape.insert(n.shape.end(), shape.begin(), shape.end());
  if (words) n.shape.push_back(2);
  return add_node(std::move(n));
}

absl::StatusOr<int> Graph::add_dynamic_slice(int x, int starts, std::vector<int64_t> sizes) {
  return add_node(make_node(Op::kDynamicSlice, {x, starts}, DynamicSliceAttrs{std::move(sizes)}));
}

absl::StatusOr<int> Graph::add_dynamic_update_slice(int x, int update, int starts) {
  return add_node(make_node(Op::kDynamicUpdateSlice, {x, update, starts}));
}

absl::StatusOr<int> Graph::add_sharding_as(int x, int like) { return add_node(make_node(Op::kShardingAs, {x, like})); }

absl::Status Graph::set_outputs(std::vector<int> outputs) {
  for (int id : outputs) TESSERA_RETURN_IF_ERROR(check_operand(id, "outputs"));
  outputs_ = std::move(outputs);
  return absl::OkStatus();
}

absl::Status Graph::replace_uses(int from, int to) {
  TESSERA_RETURN_IF_ERROR(check_operand(from, "replace_uses"));
  TESSERA_RETURN_IF_ERROR(check_operand(to, "replace_uses"));
  const Node& a = nodes_[from];
  const Node& b = nodes_[to];
  if (to >= from || a.dtype != b.dtype || a.shape != b.shape) {
    return absl::InvalidArgumentError(absl::StrCat("replace_uses: %", to, " (", type_to_string(b.dtype, b.shape),
                                                   ") cannot stand for %", from, " (", type_to_string(a.dtype, a.shape),
                                                   "): it must come first and have the same type"));
  }
  for (int id = from + 1; id < size(); ++id) {
    for (int& o : nodes_[id].operands) o = o == from ? to : o;
  }
  for (int& o : outputs_) o = o == from ? to : o;
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
    absl::StrAppend(&out, attrs_to_text(n));
    out += "\n";
  }
  std::vector<std::string> roots;
  for (int o : outputs_) roots.push_back(absl::StrCat("%", o));
  absl::StrAppend(&out, "ROOT (", absl::StrJoin(roots, ", "), ")\n");
  return out;
}

}  // namespace tessera
