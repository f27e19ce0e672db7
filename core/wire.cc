#include "core/wire.h"

#include <memory>
#include <type_traits>

#include "absl/algorithm/container.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "proto/tessera.pb.h"

namespace tessera {
namespace {

// The same fields in the same order give the same bytes in every process (our messages have
// no maps, and doubles are written as their 8 bytes).
std::string deterministic_bytes(const google::protobuf::MessageLite& message) {
  std::string bytes;
  google::protobuf::io::StringOutputStream stream(&bytes);
  google::protobuf::io::CodedOutputStream coded(&stream);
  coded.SetSerializationDeterministic(true);
  message.SerializeToCodedStream(&coded);
  coded.Trim();
  return bytes;
}

}  // namespace

pb::DType to_proto(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return pb::F32;
    case DType::kF64:
      return pb::F64;
    case DType::kI32:
      return pb::I32;
    case DType::kI64:
      return pb::I64;
    case DType::kBool:
      return pb::BOOL;
    case DType::kU32:
      return pb::U32;
    case DType::kBF16:
      return pb::BF16;
    case DType::kF16:
      return pb::F16;
    case DType::kU8:
      return pb::U8;
    case DType::kI8:
      return pb::I8;
    case DType::kI16:
      return pb::I16;
  }
  return pb::DTYPE_INVALID;
}

absl::StatusOr<DType> dtype_from_proto(int dtype) {
  switch (dtype) {
    case pb::F32:
      return DType::kF32;
    case pb::F64:
      return DType::kF64;
    case pb::I32:
      return DType::kI32;
    case pb::I64:
      return DType::kI64;
    case pb::BOOL:
      return DType::kBool;
    case pb::U32:
      return DType::kU32;
    case pb::BF16:
      return DType::kBF16;
    case pb::F16:
      return DType::kF16;
    case pb::U8:
      return DType::kU8;
    case pb::I8:
      return DType::kI8;
    case pb::I16:
      return DType::kI16;
    default:
      return absl::InvalidArgumentError(absl::StrCat("dtype ", dtype, " is not a known dtype"));
  }
}

void to_proto(const Shape& shape, pb::Shape* out) { out->mutable_dims()->Assign(shape.begin(), shape.end()); }

absl::StatusOr<Shape> shape_from_proto(const pb::Shape& shape, DType dtype) {
  constexpr int kMaxRank = 64;
  if (shape.dims_size() > kMaxRank) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape has rank ", shape.dims_size(), "; the largest supported rank is ", kMaxRank));
  }
  Shape out(shape.dims().begin(), shape.dims().end());
  TESSERA_RETURN_IF_ERROR(validate_shape(out, dtype_size(dtype), "shape"));
  return out;
}

void to_proto(const Mesh& mesh, pb::Mesh* out) {
  out->mutable_shape()->Assign(mesh.shape().begin(), mesh.shape().end());
  for (const std::string& name : mesh.axis_names()) out->add_axis_names(name);
  const std::vector<int>& ids = mesh.device_ids();
  bool in_order = true;
  for (size_t i = 0; i < ids.size() && in_order; ++i) in_order = ids[i] == static_cast<int>(i);
  if (in_order) {
    out->set_device_ids_in_order(true);
  } else {
    out->mutable_device_ids()->Assign(ids.begin(), ids.end());
  }
  if (mesh.has_axis_type(AxisType::kExplicit) || mesh.has_axis_type(AxisType::kManual)) {
    for (AxisType t : mesh.axis_types()) {
      out->add_axis_types(t == AxisType::kExplicit ? pb::AXIS_EXPLICIT
                          : t == AxisType::kManual ? pb::AXIS_MANUAL
                                                   : pb::AXIS_AUTO);
    }
  }
}

absl::StatusOr<Mesh> mesh_from_proto(const pb::Mesh& mesh) {
  std::vector<int> ids(mesh.device_ids().begin(), mesh.device_ids().end());
  if (mesh.device_ids_in_order()) {
    constexpr int64_t kMaxDevices = 1 << 20;
    if (!ids.empty()) {
      return absl::InvalidArgumentError("mesh: device_ids_in_order is set but device_ids are listed too");
    }
    int64_t n = 1;
    for (int64_t d : mesh.shape()) {
      if (d < 1 || d > kMaxDevices || n * d > kMaxDevices) {
        return absl::InvalidArgumentError(absl::StrCat("mesh: a shape with dimension ", d, " is out of range (at most ",
                                                       kMaxDevices, " devices, each dimension at least 1)"));
      }
      n *= d;
    }
    for (int64_t i = 0; i < n; ++i) ids.push_back(static_cast<int>(i));
  }
  std::vector<AxisType> types;
  for (int t : mesh.axis_types()) {
    if (t != pb::AXIS_AUTO && t != pb::AXIS_EXPLICIT && t != pb::AXIS_MANUAL) {
      return absl::InvalidArgumentError(
          absl::StrCat("mesh: axis type ", t, " is not one of Auto (0), Explicit (1), Manual (2)"));
    }
    types.push_back(t == pb::AXIS_EXPLICIT ? AxisType::kExplicit
                    : t == pb::AXIS_MANUAL ? AxisType::kManual
                                           : AxisType::kAuto);
  }
  return Mesh::create(std::vector<int64_t>(mesh.shape().begin(), mesh.shape().end()),
                      std::vector<std::string>(mesh.axis_names().begin(), mesh.axis_names().end()), std::move(ids),
                      std::move(types));
}

void to_proto(const PartitionSpec& spec, pb::PartitionSpec* out) {
  for (const Axes& axes : spec.dims()) {
    auto* dim = out->add_dims();
    for (const std::string& axis : axes) dim->add_axes(axis);
  }
  for (const std::string& axis : spec.unreduced()) out->add_unreduced(axis);
  for (const std::string& axis : spec.reduced()) out->add_reduced(axis);
}

PartitionSpec spec_from_proto(const pb::PartitionSpec& spec) {
  std::vector<Axes> dims;
  for (const auto& dim : spec.dims()) dims.emplace_back(dim.axes().begin(), dim.axes().end());
  return PartitionSpec(std::move(dims), std::vector<std::string>(spec.unreduced().begin(), spec.unreduced().end()),
                       std::vector<std::string>(spec.reduced().begin(), spec.reduced().end()));
}

void to_proto(const NamedSharding& sharding, pb::NamedSharding* out) {
  to_proto(sharding.mesh(), out->mutable_mesh());
  to_proto(sharding.spec(), out->mutable_spec());
}

absl::StatusOr<NamedSharding> sharding_from_proto(const pb::NamedSharding& sharding) {
  TESSERA_ASSIGN_OR_RETURN(Mesh mesh, mesh_from_proto(sharding.mesh()));
  NamedSharding out(std::move(mesh), spec_from_proto(sharding.spec()));
  TESSERA_RETURN_IF_ERROR(out.validate_spec());
  return out;
}

namespace {

constexpr std::pair<CollectiveKind, pb::CollectiveKind> kKinds[] = {
    {CollectiveKind::kAllReduce, pb::ALL_REDUCE},
    {CollectiveKind::kAllGather, pb::ALL_GATHER},
    {CollectiveKind::kReduceScatter, pb::REDUCE_SCATTER},
    {CollectiveKind::kAllToAll, pb::ALL_TO_ALL},
    {CollectiveKind::kCollectivePermute, pb::COLLECTIVE_PERMUTE},
    {CollectiveKind::kBroadcast, pb::BROADCAST},
    {CollectiveKind::kRaggedAllToAll, pb::RAGGED_ALL_TO_ALL},
};
constexpr std::pair<ReduceOp, pb::ReduceOp> kReduceOps[] = {
    {ReduceOp::kSum, pb::SUM}, {ReduceOp::kMax, pb::MAX}, {ReduceOp::kMin, pb::MIN}, {ReduceOp::kProd, pb::PROD}};

}  // namespace

void to_proto(const CollectiveSpec& spec, pb::CollectiveSpec* out) {
  for (const auto& [kind, wire] : kKinds) {
    if (kind == spec.kind) out->set_kind(wire);
  }
  for (const auto& [op, wire] : kReduceOps) {
    if (op == spec.reduce_op) out->set_reduce_op(wire);
  }
  for (const std::vector<int>& group : spec.groups) {
    out->add_groups()->mutable_device_ids()->Assign(group.begin(), group.end());
  }
  out->set_dimension(spec.dimension);
  out->set_split_dimension(spec.split_dimension);
  out->set_concat_dimension(spec.concat_dimension);
  for (const auto& [source, target] : spec.pairs) {
    pb::SourceTarget* pair = out->add_pairs();
    pair->set_source(source);
    pair->set_target(target);
  }
  out->set_root(spec.root);
}

namespace {

// The spec's fields, checked only for known enum values (a program's collectives have no
// groups until a device resolves them).
absl::StatusOr<CollectiveSpec> decode_collective(const pb::CollectiveSpec& spec) {
  CollectiveSpec out;
  bool kind_known = false;
  for (const auto& [kind, wire] : kKinds) {
    if (wire == spec.kind()) {
      out.kind = kind;
      kind_known = true;
    }
  }
  if (!kind_known) return absl::InvalidArgumentError(absl::StrCat("collective kind ", spec.kind(), " is not known"));
  const bool reduces = out.kind == CollectiveKind::kAllReduce || out.kind == CollectiveKind::kReduceScatter;
  bool op_known = false;
  for (const auto& [op, wire] : kReduceOps) {
    if (wire == spec.reduce_op()) {
      out.reduce_op = op;
      op_known = true;
    }
  }
  if (reduces && !op_known) {
    return absl::InvalidArgumentError(
        absl::StrCat(collective_name(out.kind), ": reduce op ", spec.reduce_op(), " is not known"));
  }
  for (const pb::ReplicaGroup& group : spec.groups())
    out.groups.emplace_back(group.device_ids().begin(), group.device_ids().end());
  out.dimension = spec.dimension();
  out.split_dimension = spec.split_dimension();
  out.concat_dimension = spec.concat_dimension();
  for (const pb::SourceTarget& pair : spec.pairs()) out.pairs.emplace_back(pair.source(), pair.target());
  out.root = spec.root();
  return out;
}

}  // namespace

absl::StatusOr<CollectiveSpec> collective_from_proto(const pb::CollectiveSpec& spec) {
  TESSERA_ASSIGN_OR_RETURN(CollectiveSpec out, decode_collective(spec));
  TESSERA_RETURN_IF_ERROR(validate_collective(out));
  return out;
}

namespace {

// Each kind's wire form (the KernelNode oneof).
void attrs_to_proto(const NoAttrs&, pb::KernelNode*) {}
void attrs_to_proto(const ParameterAttrs& a, pb::KernelNode* n) { n->mutable_parameter()->set_index(a.index); }
void attrs_to_proto(const ConstantAttrs& a, pb::KernelNode* n) {
  pb::ConstantAttrs* w = n->mutable_constant();
  if (a.value.is_integer()) {
    w->set_int_value(a.value.int_value());
  } else {
    w->set_float_value(a.value.float_value());
  }
}
void attrs_to_proto(const IotaAttrs& a, pb::KernelNode* n) { n->mutable_iota()->set_dimension(a.dimension); }
void attrs_to_proto(const BroadcastAttrs& a, pb::KernelNode* n) {
  n->mutable_broadcast()->mutable_result_dims()->Assign(a.result_dims.begin(), a.result_dims.end());
}
void attrs_to_proto(const TransposeAttrs& a, pb::KernelNode* n) {
  n->mutable_transpose()->mutable_permutation()->Assign(a.permutation.begin(), a.permutation.end());
}
void attrs_to_proto(const ReduceAttrs& a, pb::KernelNode* n) {
  n->mutable_reduce()->mutable_axes()->Assign(a.axes.begin(), a.axes.end());
}
void attrs_to_proto(const ArgmaxAttrs& a, pb::KernelNode* n) { n->mutable_argmax()->set_axis(a.axis); }
void attrs_to_proto(const SliceAttrs& a, pb::KernelNode* n) {
  pb::SliceAttrs* w = n->mutable_slice();
  w->mutable_start()->Assign(a.start.begin(), a.start.end());
  w->mutable_limit()->Assign(a.limit.begin(), a.limit.end());
  w->mutable_strides()->Assign(a.strides.begin(), a.strides.end());
}
void attrs_to_proto(const ConcatAttrs& a, pb::KernelNode* n) { n->mutable_concat()->set_axis(a.axis); }
void attrs_to_proto(const DotAttrs& a, pb::KernelNode* n) {
  pb::DotAttrs* w = n->mutable_dot();
  w->mutable_lhs_batch()->Assign(a.dims.lhs_batch.begin(), a.dims.lhs_batch.end());
  w->mutable_rhs_batch()->Assign(a.dims.rhs_batch.begin(), a.dims.rhs_batch.end());
  w->mutable_lhs_contracting()->Assign(a.dims.lhs_contracting.begin(), a.dims.lhs_contracting.end());
  w->mutable_rhs_contracting()->Assign(a.dims.rhs_contracting.begin(), a.dims.rhs_contracting.end());
}
void attrs_to_proto(const ShardingAttrs& a, pb::KernelNode* n) {
  to_proto(a.sharding, n->mutable_sharding()->mutable_sharding());
  n->mutable_sharding()->mutable_manual_axes()->Assign(a.manual_axes.begin(), a.manual_axes.end());
}
void attrs_to_proto(const CollectiveAttrs& a, pb::KernelNode* n) {
  pb::CollectiveAttrs* w = n->mutable_collective();
  to_proto(a.mesh, w->mutable_mesh());
  w->mutable_axes()->Assign(a.axes.begin(), a.axes.end());
  for (const auto& [op, wire] : kReduceOps) {
    if (op == a.reduce_op) w->set_reduce_op(wire);
  }
  w->set_dimension(a.dimension);
  w->set_split_dimension(a.split_dimension);
  w->set_concat_dimension(a.concat_dimension);
  w->mutable_positions()->Assign(a.positions.begin(), a.positions.end());
}
void attrs_to_proto(const AxisIndexAttrs& a, pb::KernelNode* n) {
  pb::AxisIndexAttrs* w = n->mutable_axis_index();
  if (a.mesh.has_value()) to_proto(*a.mesh, w->mutable_mesh());
  w->mutable_axes()->Assign(a.axes.begin(), a.axes.end());
}

void attrs_to_proto(const GatherAttrs& a, pb::KernelNode* n) {
  pb::GatherAttrs* w = n->mutable_gather();
  w->set_axis(a.axis);
  w->set_mode(a.mode == IndexMode::kClip ? pb::INDEX_MODE_CLIP : pb::INDEX_MODE_FILL_OR_DROP);
  if (a.fill_value.has_value() && a.fill_value->is_integer()) w->set_fill_int(a.fill_value->int_value());
  if (a.fill_value.has_value() && !a.fill_value->is_integer()) w->set_fill_float(a.fill_value->float_value());
  w->set_batch_dims(a.batch_dims);
}
void attrs_to_proto(const DynamicSliceAttrs& a, pb::KernelNode* n) {
  n->mutable_dynamic_slice()->mutable_sizes()->Assign(a.sizes.begin(), a.sizes.end());
}
void attrs_to_proto(const RandomBitsAttrs& a, pb::KernelNode* n) {
  n->mutable_random_bits()->mutable_shape()->Assign(a.shape.begin(), a.shape.end());
  n->mutable_random_bits()->set_words(a.words);
}

// The sub-graphs of one graph's nodes, each written once into its `subgraphs` (a scan, while or
// switch has one node per result, all sharing their sub-graphs): by pointer, then by content,
// so equal sub-graphs get one entry whoever built them and compile_key stays canonical.
class SubgraphTable {
 public:
  explicit SubgraphTable(pb::Graph* out) : out_(out) {}

  int32_t index_of(const std::shared_ptr<const Graph>& g) {
    if (auto it = by_pointer_.find(g.get()); it != by_pointer_.end()) return it->second;
    pb::Graph written;
    if (g != nullptr) to_proto(*g, &written);
    auto [it, added] = by_bytes_.try_emplace(deterministic_bytes(written), out_->subgraphs_size());
    if (added) *out_->add_subgraphs() = std::move(written);
    by_pointer_.emplace(g.get(), it->second);
    return it->second;
  }

 private:
  pb::Graph* out_;
  absl::flat_hash_map<const Graph*, int32_t> by_pointer_;
  absl::flat_hash_map<std::string, int32_t> by_bytes_;
};

void attrs_to_proto(const BranchesAttrs& a, pb::KernelNode* n, SubgraphTable& table) {
  pb::BranchesAttrs* w = n->mutable_branches();
  for (const std::shared_ptr<const Graph>& g : a.graphs) w->add_graphs(table.index_of(g));
  w->set_output(a.output);
}

void attrs_to_proto(const ScanAttrs& a, pb::KernelNode* n, SubgraphTable& table) {
  pb::ScanAttrs* w = n->mutable_scan();
  w->set_body(table.index_of(a.body));
  w->set_length(a.length);
  w->set_reverse(a.reverse);
  w->set_num_carry(a.num_carry);
  w->set_output(a.output);
}

// Writes its wire number, its type and its attributes; sub-graphs go to `table` (none for plan
// instructions). Plan instructions other than kernels carry only a result type (their node's
// op is kParameter's default, with no attributes).
void node_to_proto(const Node& node, pb::KernelNode* n, SubgraphTable* table = nullptr) {
  n->set_op(op_def(node.op).wire);
  n->set_dtype(to_proto(node.dtype));
  to_proto(node.shape, n->mutable_shape());
  std::visit(
      [n, table](const auto& a) {
        using A = std::decay_t<decltype(a)>;
        if constexpr (std::is_same_v<A, ScanAttrs> || std::is_same_v<A, BranchesAttrs>) {
          if (table != nullptr) attrs_to_proto(a, n, *table);
        } else {
          attrs_to_proto(a, n);
        }
      },
      node.attributes);
}

std::vector<int64_t> v(const google::protobuf::RepeatedField<int64_t>& r) { return {r.begin(), r.end()}; }
std::vector<std::string> v(const google::protobuf::RepeatedPtrField<std::string>& r) { return {r.begin(), r.end()}; }

// A mesh that arrived, if one did; errors prefixed by `where`.
absl::StatusOr<std::optional<Mesh>> optional_mesh(bool has, const pb::Mesh& mesh, const std::string& where) {
  if (!has) return std::nullopt;
  absl::StatusOr<Mesh> m = mesh_from_proto(mesh);
  if (!m.ok()) return absl::Status(m.status().code(), absl::StrCat(where, ": ", m.status().message()));
  return std::optional<Mesh>(*std::move(m));
}

// The attributes that arrived (NoAttrs for none); only the enum values and the meshes and
// shardings are checked here, the rest by the op's type rule.
// `subgraphs`: the enclosing graph's decoded sub-graphs, which scan and branches attributes
// index (none for a plan's kernels).
absl::StatusOr<Attrs> attrs_from_proto(const pb::KernelNode& n, const std::string& where,
                                       const std::vector<std::shared_ptr<const Graph>>& subgraphs) {
  const auto subgraph = [&](int32_t index, const std::string& what) -> absl::StatusOr<std::shared_ptr<const Graph>> {
    if (index < 0 || index >= static_cast<int32_t>(subgraphs.size())) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", what, " is sub-graph ", index, ", but the graph has ",
                                                     subgraphs.size(), " (indices from 0)"));
    }
    return subgraphs[static_cast<size_t>(index)];
  };
  switch (n.attrs_case()) {
    case pb::KernelNode::ATTRS_NOT_SET:
      return NoAttrs{};
    case pb::KernelNode::kParameter:
      return ParameterAttrs{n.parameter().index()};
    case pb::KernelNode::kConstant:
      if (n.constant().value_case() == pb::ConstantAttrs::kIntValue)
        return ConstantAttrs{Scalar(n.constant().int_value())};
      return ConstantAttrs{Scalar(n.constant().float_value())};
    case pb::KernelNode::kIota:
      return IotaAttrs{n.iota().dimension()};
    case pb::KernelNode::kBroadcast:
      return BroadcastAttrs{v(n.broadcast().result_dims())};
    case pb::KernelNode::kTranspose:
      return TransposeAttrs{v(n.transpose().permutation())};
    case pb::KernelNode::kReduce:
      return ReduceAttrs{v(n.reduce().axes())};
    case pb::KernelNode::kArgmax:
      return ArgmaxAttrs{n.argmax().axis()};
    case pb::KernelNode::kSlice:
      return SliceAttrs{v(n.slice().start()), v(n.slice().limit()), v(n.slice().strides())};
    case pb::KernelNode::kConcat:
      return ConcatAttrs{n.concat().axis()};
    case pb::KernelNode::kDot: {
      const pb::DotAttrs& d = n.dot();
      return DotAttrs{DotDims{v(d.lhs_batch()), v(d.rhs_batch()), v(d.lhs_contracting()), v(d.rhs_contracting())}};
    }
    case pb::KernelNode::kSharding: {
      if (!n.sharding().has_sharding()) return absl::InvalidArgumentError(absl::StrCat(where, " has no sharding"));
      absl::StatusOr<NamedSharding> sharding = sharding_from_proto(n.sharding().sharding());
      if (!sharding.ok()) {
        return absl::Status(sharding.status().code(), absl::StrCat(where, ": ", sharding.status().message()));
      }
      return ShardingAttrs{*std::move(sharding), v(n.sharding().manual_axes())};
    }
    case pb::KernelNode::kCollective: {
      const pb::CollectiveAttrs& c = n.collective();
      TESSERA_ASSIGN_OR_RETURN(std::optional<Mesh> mesh, optional_mesh(c.has_mesh(), c.mesh(), where));
      if (!mesh.has_value()) return absl::InvalidArgumentError(absl::StrCat(where, " has no mesh"));
      CollectiveAttrs out{*std::move(mesh),    v(c.axes()),          ReduceOp::kSum,  c.dimension(),
                          c.split_dimension(), c.concat_dimension(), v(c.positions())};
      bool known = false;
      for (const auto& [op, wire] : kReduceOps) {
        if (wire == c.reduce_op()) {
          out.reduce_op = op;
          known = true;
        }
      }
      if (!known) return absl::InvalidArgumentError(absl::StrCat(where, " has unknown reduce op ", c.reduce_op()));
      return out;
    }
    case pb::KernelNode::kGather: {
      const pb::GatherAttrs& w = n.gather();
      GatherAttrs out;
      out.axis = w.axis();
      if (w.mode() == pb::INDEX_MODE_CLIP) {
        out.mode = IndexMode::kClip;
      } else if (w.mode() != pb::INDEX_MODE_FILL_OR_DROP) {
        return absl::InvalidArgumentError(absl::StrCat(where, " has unknown index mode ", w.mode()));
      }
      if (w.fill_value_case() == pb::GatherAttrs::kFillInt) out.fill_value = Scalar(w.fill_int());
      if (w.fill_value_case() == pb::GatherAttrs::kFillFloat) out.fill_value = Scalar(w.fill_float());
      out.batch_dims = w.batch_dims();  // checked by the type rule
      return out;
    }
    case pb::KernelNode::kDynamicSlice:
      return DynamicSliceAttrs{v(n.dynamic_slice().sizes())};
    case pb::KernelNode::kScan: {
      const pb::ScanAttrs& w = n.scan();
      TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<const Graph> body, subgraph(w.body(), "its body"));
      return ScanAttrs{std::move(body), w.length(), w.reverse(), w.num_carry(), w.output()};
    }
    case pb::KernelNode::kBranches: {
      BranchesAttrs out;
      out.output = n.branches().output();
      for (int32_t index : n.branches().graphs()) {
        TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<const Graph> g,
                                 subgraph(index, absl::StrCat("its sub-graph ", out.graphs.size())));
        out.graphs.push_back(std::move(g));
      }
      return out;
    }
    case pb::KernelNode::kRandomBits:
      return RandomBitsAttrs{v(n.random_bits().shape()), n.random_bits().words()};
    case pb::KernelNode::kAxisIndex: {
      AxisIndexAttrs out;
      TESSERA_ASSIGN_OR_RETURN(out.mesh, optional_mesh(n.axis_index().has_mesh(), n.axis_index().mesh(), where));
      out.axes = v(n.axis_index().axes());
      return out;
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(where, " has unknown attributes ", n.attrs_case()));
}

// The op, its type and its attributes, from the wire: the attributes must be the op's kind
// (the type rule checks their values). `where` prefixes errors.
absl::StatusOr<Node> node_from_proto(const pb::KernelNode& n, const std::string& where,
                                     const std::vector<std::shared_ptr<const Graph>>& subgraphs = {}) {
  absl::StatusOr<Op> op = op_from_wire(n.op());
  if (!op.ok()) return absl::InvalidArgumentError(absl::StrCat(where, " has ", op.status().message()));
  Node out;
  out.op = *op;
  TESSERA_ASSIGN_OR_RETURN(out.dtype, dtype_from_proto(n.dtype()));
  TESSERA_ASSIGN_OR_RETURN(out.shape, shape_from_proto(n.shape(), out.dtype));
  TESSERA_ASSIGN_OR_RETURN(out.attributes, attrs_from_proto(n, where, subgraphs));
  absl::Status kind = check_attrs(out);
  if (!kind.ok()) return absl::InvalidArgumentError(absl::StrCat(where, ": ", kind.message()));
  return out;
}

}  // namespace

void to_proto(const Graph& graph, pb::Graph* out) {
  SubgraphTable table(out);
  for (const Node& node : graph.nodes()) {
    pb::GraphNode* n = out->add_nodes();
    node_to_proto(node, n->mutable_node(), &table);
    n->mutable_operands()->Assign(node.operands.begin(), node.operands.end());
  }
  out->mutable_outputs()->Assign(graph.outputs().begin(), graph.outputs().end());
}

absl::StatusOr<Graph> graph_from_proto(const pb::Graph& graph) {
  constexpr int kMaxNodes = 1 << 20;
  if (graph.nodes_size() > kMaxNodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("graph: ", graph.nodes_size(), " nodes is over the limit of ", kMaxNodes));
  }
  std::vector<std::shared_ptr<const Graph>> subgraphs;
  for (const pb::Graph& w : graph.subgraphs()) {
    absl::StatusOr<Graph> sub = graph_from_proto(w);
    if (!sub.ok()) {
      return absl::Status(sub.status().code(),
                          absl::StrCat("graph: sub-graph ", subgraphs.size(), ": ", sub.status().message()));
    }
    subgraphs.push_back(std::make_shared<const Graph>(*std::move(sub)));
  }
  Graph g;
  for (int id = 0; id < graph.nodes_size(); ++id) {
    const pb::GraphNode& w = graph.nodes(id);
    TESSERA_ASSIGN_OR_RETURN(Node node, node_from_proto(w.node(), absl::StrCat("graph: node ", id), subgraphs));
    const ArrayType claimed{node.dtype, node.shape};
    node.operands.assign(w.operands().begin(), w.operands().end());
    absl::StatusOr<int> added = g.add_node(std::move(node));
    if (!added.ok()) {
      return absl::Status(added.status().code(), absl::StrCat("graph: node ", id, ": ", added.status().message()));
    }
    const Node& built = g.node(*added);
    if (built.dtype != claimed.dtype || built.shape != claimed.shape) {
      return absl::InvalidArgumentError(absl::StrCat("graph: node ", id, " claims ",
                                                     type_to_string(claimed.dtype, claimed.shape), " but computes ",
                                                     type_to_string(built.dtype, built.shape)));
    }
  }
  TESSERA_RETURN_IF_ERROR(g.set_outputs(std::vector<int>(graph.outputs().begin(), graph.outputs().end())));
  return g;
}

void to_proto(const Instruction& i, pb::Instruction* w) {
  switch (i.kind) {
    case Instruction::Kind::kKernel:
      w->set_kind(pb::Instruction::KERNEL);
      break;
    case Instruction::Kind::kCollective:
      w->set_kind(pb::Instruction::COLLECTIVE);
      break;
    case Instruction::Kind::kLocalSlice:
      w->set_kind(pb::Instruction::LOCAL_SLICE);
      break;
    case Instruction::Kind::kFree:
      w->set_kind(pb::Instruction::FREE);
      break;
    case Instruction::Kind::kSwitch:
    case Instruction::Kind::kLoop:
      w->set_kind(i.kind == Instruction::Kind::kLoop ? pb::Instruction::LOOP : pb::Instruction::SWITCH);
      if (i.body != nullptr) to_proto(*i.body, w->mutable_body());
      for (const auto& b : i.branches) {
        pb::DevicePlan* p = w->add_branches();
        if (b != nullptr) to_proto(*b, p);
      }
      w->set_trip_count(i.trip_count);
      w->set_reverse(i.reverse);
      w->set_num_carry(i.num_carry);
      w->mutable_extra_out()->Assign(i.extra_out.begin(), i.extra_out.end());
      for (const ArrayType& t : i.out_types) {
        Node typed;
        typed.dtype = t.dtype;
        typed.shape = t.shape;
        node_to_proto(typed, w->add_out_types());
      }
      break;
  }
  w->set_out(i.out);
  w->mutable_in()->Assign(i.in.begin(), i.in.end());
  if (i.kind != Instruction::Kind::kLoop && i.kind != Instruction::Kind::kSwitch) {
    node_to_proto(i.node, w->mutable_node());  // a loop's and a switch's types: out_types
  }
  if (i.kind == Instruction::Kind::kCollective) to_proto(i.collective, w->mutable_collective());
  for (const Slice& sl : i.slice) {
    pb::SliceRange* r = w->add_slice();
    r->set_start(sl.start);
    r->set_stop(sl.stop);
  }
  w->mutable_axes()->Assign(i.axes.begin(), i.axes.end());
  w->mutable_positions()->Assign(i.positions.begin(), i.positions.end());
  if (i.relayout.has_value()) {
    to_proto(i.relayout->shape, w->mutable_relayout()->mutable_shape());
    to_proto(i.relayout->from, w->mutable_relayout()->mutable_from());
    to_proto(i.relayout->to, w->mutable_relayout()->mutable_to());
  }
}

std::string canonical_bytes(const Instruction& instruction) {
  pb::Instruction w;
  to_proto(instruction, &w);
  return deterministic_bytes(w);
}

void to_proto(const DevicePlan& plan, pb::DevicePlan* out) {
  out->set_device(plan.device);
  out->set_num_slots(plan.num_slots);
  out->mutable_input_slots()->Assign(plan.input_slots.begin(), plan.input_slots.end());
  out->mutable_output_slots()->Assign(plan.output_slots.begin(), plan.output_slots.end());
  out->mutable_donated_inputs()->Assign(plan.donated_inputs.begin(), plan.donated_inputs.end());
  for (const Instruction& i : plan.code) to_proto(i, out->add_code());
}

namespace {

// A loop instruction's body, trip count, carries and result types (not its slots), checked
// against each other: as many body inputs as `in`, as many body outputs as results, carries
// among both, stacked results of trip_count rows.
absl::StatusOr<Instruction> loop_from_proto(const pb::Instruction& w, const std::string& where) {
  auto fail = [&where](const std::string& m) { return absl::InvalidArgumentError(absl::StrCat("plan: ", where, m)); };
  const bool is_switch = w.kind() == pb::Instruction::SWITCH;
  if (w.has_node()) return fail(" is a loop or switch with a node (its results' types are its out_types)");
  Instruction i;
  i.trip_count = w.trip_count();
  i.reverse = w.reverse();
  i.num_carry = w.num_carry();
  i.extra_out.assign(w.extra_out().begin(), w.extra_out().end());
  for (const pb::KernelNode& t : w.out_types()) {
    absl::StatusOr<DType> dtype = dtype_from_proto(t.dtype());
    absl::StatusOr<Shape> shape = dtype.ok() ? shape_from_proto(t.shape(), *dtype) : dtype.status();
    if (!shape.ok()) return fail(absl::StrCat(" result ", i.out_types.size(), ": ", shape.status().message()));
    i.out_types.push_back({*dtype, *std::move(shape)});
  }
  for (int b = 0; b < w.branches_size(); ++b) {
    absl::StatusOr<DevicePlan> p = plan_from_proto(w.branches(b));
    if (!p.ok())
      return absl::Status(p.status().code(), absl::StrCat(where, "'s sub-plan ", b, ": ", p.status().message()));
    i.branches.push_back(std::make_shared<const DevicePlan>(*std::move(p)));
  }
  if (is_switch) {
    if (i.out_types.empty() || static_cast<int>(i.out_types.size()) != 1 + w.extra_out_size()) {
      return fail(absl::StrCat(" writes ", 1 + w.extra_out_size(), " slots of ", i.out_types.size(), " types"));
    }
    i.node.dtype = i.out_types[0].dtype;
    i.node.shape = i.out_types[0].shape;
    if (w.has_body() || i.trip_count != 0 || i.reverse || i.num_carry != 0) {
      return fail(" is a switch with a loop's body, trip count, direction or carries");
    }
    if (i.branches.empty()) return fail(" is a switch without branches");
    for (size_t b = 0; b < i.branches.size(); ++b) {
      if (static_cast<int>(i.branches[b]->input_slots.size()) + 1 != w.in_size() ||
          i.branches[b]->output_slots.size() != i.out_types.size()) {
        return fail(absl::StrCat(" reads ", w.in_size(), " slots (the index first) and writes ", i.out_types.size(),
                                 "; its branch ", b, " takes ", i.branches[b]->input_slots.size(), " and returns ",
                                 i.branches[b]->output_slots.size()));
      }
    }
    return i;
  }
  if (!w.has_body()) return fail(" is a loop without a body");
  absl::StatusOr<DevicePlan> body = plan_from_proto(w.body());
  if (!body.ok()) return absl::Status(body.status().code(), absl::StrCat(where, "'s body: ", body.status().message()));
  if (i.branches.size() > 1) return fail(absl::StrCat(" is a loop with ", i.branches.size(), " predicates"));
  if (i.branches.size() == 1) {  // a while loop
    const DevicePlan& pred = *i.branches[0];
    if (i.num_carry != w.in_size() || i.num_carry != static_cast<int>(i.out_types.size()) || i.reverse) {
      return fail(absl::StrCat(" is a while loop of ", w.in_size(), " inputs, ", i.out_types.size(), " results and ",
                               i.num_carry, " carries (all must be carries, and it has no direction)"));
    }
    if (static_cast<int>(pred.input_slots.size()) != i.num_carry || pred.output_slots.size() != 1) {
      return fail(absl::StrCat(" has a predicate taking ", pred.input_slots.size(), " values and returning ",
                               pred.output_slots.size(), ", not its ", i.num_carry, " carries and one bool"));
    }
    if (i.trip_count == 0 && (plan_has_collectives(pred) || plan_has_collectives(*body))) {
      return fail(" is a while loop with collectives and no bound on its iterations (their op ids need one)");
    }
  }
  const int inputs = static_cast<int>(body->input_slots.size());
  const int results = static_cast<int>(body->output_slots.size());
  if (i.trip_count < 0) return fail(absl::StrCat(" has trip count ", i.trip_count));
  if (inputs != w.in_size()) return fail(absl::StrCat(" reads ", w.in_size(), " slots; its body takes ", inputs));
  if (results != 1 + w.extra_out_size() || results != static_cast<int>(i.out_types.size())) {
    return fail(absl::StrCat(" writes ", 1 + w.extra_out_size(), " slots of ", i.out_types.size(),
                             " types; its body returns ", results));
  }
  if (i.num_carry < 0 || i.num_carry > inputs || i.num_carry > results) {
    return fail(absl::StrCat(" has ", i.num_carry, " carries of ", inputs, " inputs and ", results, " results"));
  }
  for (size_t k = static_cast<size_t>(i.num_carry); i.branches.empty() && k < i.out_types.size(); ++k) {
    if (i.out_types[k].shape.empty() || i.out_types[k].shape[0] != i.trip_count) {
      return fail(absl::StrCat(" stacks result ", k, " as ", type_to_string(i.out_types[k].dtype, i.out_types[k].shape),
                               ", not ", i.trip_count, " rows"));
    }
  }
  i.body = std::make_shared<const DevicePlan>(*std::move(body));
  i.node.dtype = i.out_types[0].dtype;
  i.node.shape = i.out_types[0].shape;
  return i;
}

}  // namespace

absl::StatusOr<DevicePlan> plan_from_proto(const pb::DevicePlan& plan) {
  constexpr int kMaxSlots = 1 << 20;
  DevicePlan out;
  out.device = plan.device();
  out.num_slots = plan.num_slots();
  if (out.num_slots < 0 || out.num_slots > kMaxSlots) {
    return absl::InvalidArgumentError(absl::StrCat("plan: ", out.num_slots, " slots is out of range"));
  }
  std::vector<int> state(out.num_slots, 0);                   // 0 unwritten, 1 live, 2 freed
  std::vector<std::optional<ArrayType>> type(out.num_slots);  // of slots an instruction wrote
  auto slot_ok = [&](int s, const std::string& where) -> absl::Status {
    if (s < 0 || s >= out.num_slots) {
      return absl::InvalidArgumentError(absl::StrCat("plan: ", where, " names slot ", s, " of ", out.num_slots));
    }
    return absl::OkStatus();
  };
  for (int s : plan.input_slots()) {
    TESSERA_RETURN_IF_ERROR(slot_ok(s, "an input"));
    state[s] = 1;
    out.input_slots.push_back(s);
  }
  for (int d : plan.donated_inputs()) {
    if (d < 0 || d >= plan.input_slots_size() || absl::c_linear_search(out.donated_inputs, d)) {
      return absl::InvalidArgumentError(absl::StrCat("plan: donated input ", d, " is not one of the ",
                                                     plan.input_slots_size(), " inputs or is named twice"));
    }
    out.donated_inputs.push_back(d);
  }
  for (int k = 0; k < plan.code_size(); ++k) {
    const pb::Instruction& w = plan.code(k);
    const std::string where = absl::StrCat("instruction ", k);
    Instruction i;
    switch (w.kind()) {
      case pb::Instruction::KERNEL:
        i.kind = Instruction::Kind::kKernel;
        break;
      case pb::Instruction::COLLECTIVE:
        i.kind = Instruction::Kind::kCollective;
        break;
      case pb::Instruction::LOCAL_SLICE:
        i.kind = Instruction::Kind::kLocalSlice;
        break;
      case pb::Instruction::FREE:
        i.kind = Instruction::Kind::kFree;
        break;
      case pb::Instruction::LOOP:
        i.kind = Instruction::Kind::kLoop;
        break;
      case pb::Instruction::SWITCH:
        i.kind = Instruction::Kind::kSwitch;
        break;
      default:
        return absl::InvalidArgumentError(absl::StrCat("plan: ", where, " has unknown kind ", w.kind()));
    }
    for (int s : w.in()) {
      TESSERA_RETURN_IF_ERROR(slot_ok(s, where));
      if (state[s] != 1) {
        return absl::InvalidArgumentError(absl::StrCat("plan: ", where, " reads slot ", s,
                                                       state[s] == 0 ? " before it is written" : " after it is freed"));
      }
      i.in.push_back(s);
    }
    if (i.kind == Instruction::Kind::kFree) {
      if (i.in.size() != 1)
        return absl::InvalidArgumentError(absl::StrCat("plan: ", where, " frees ", i.in.size(), " slots"));
      state[i.in[0]] = 2;
      out.code.push_back(std::move(i));
      continue;
    }
    TESSERA_RETURN_IF_ERROR(slot_ok(w.out(), where));
    i.out = w.out();
    const pb::KernelNode& n = w.node();
    if (i.kind == Instruction::Kind::kLoop || i.kind == Instruction::Kind::kSwitch) {
      TESSERA_ASSIGN_OR_RETURN(Instruction loop, loop_from_proto(w, where));
      loop.kind = i.kind;
      loop.in = std::move(i.in);
      loop.out = i.out;
      loop.node.operands = loop.in;
      std::vector<int> outs = {loop.out};
      outs.insert(outs.end(), loop.extra_out.begin(), loop.extra_out.end());
      for (size_t k = 0; k < outs.size(); ++k) {
        TESSERA_RETURN_IF_ERROR(slot_ok(outs[k], where));
        if (absl::c_count(outs, outs[k]) != 1) {
          return absl::InvalidArgumentError(absl::StrCat("plan: ", where, " writes slot ", outs[k], " twice"));
        }
        state[outs[k]] = 1;
        type[outs[k]] = loop.out_types[k];
      }
      for (int c = 0; c < loop.num_carry; ++c) {
        if (type[loop.in[c]].has_value() && *type[loop.in[c]] != loop.out_types[c]) {
          return absl::InvalidArgumentError(
              absl::StrCat("plan: ", where, ": carry ", c, " enters as ",
                           type_to_string(type[loop.in[c]]->dtype, type[loop.in[c]]->shape), " but leaves as ",
                           type_to_string(loop.out_types[c].dtype, loop.out_types[c].shape)));
        }
      }
      out.code.push_back(std::move(loop));
      continue;
    }
    if (i.kind == Instruction::Kind::kKernel) {
      // Kernels of a plan: every op with one but placement (the partitioner's business), and
      // those each device resolves to a constant (axis_index).
      absl::StatusOr<Op> op = op_from_wire(n.op());
      const bool kernel = op.ok() && has_trait(*op, kHasKernel) && !has_trait(*op, kPlacement);
      if (!kernel && !(op.ok() && has_trait(*op, kResolvedByDevice))) {
        return absl::InvalidArgumentError(absl::StrCat("plan: ", where, " has op ", n.op(), ", not a kernel"));
      }
      TESSERA_ASSIGN_OR_RETURN(i.node, node_from_proto(n, absl::StrCat("plan: ", where)));
      // Its type rule, where the operands' types are known here (inputs' are not: the
      // worker checks those against the arrays when it runs).
      std::vector<ArrayType> in;
      for (int s : i.in) {
        if (type[s].has_value()) in.push_back(*type[s]);
      }
      if (kernel && in.size() == i.in.size()) {
        i.node.operands = i.in;
        absl::StatusOr<ArrayType> t = infer_type(i.node, in);
        if (!t.ok()) return absl::InvalidArgumentError(absl::StrCat("plan: ", where, ": ", t.status().message()));
        if (*t != ArrayType{i.node.dtype, i.node.shape}) {
          return absl::InvalidArgumentError(absl::StrCat("plan: ", where, " claims ",
                                                         type_to_string(i.node.dtype, i.node.shape), " but computes ",
                                                         type_to_string(t->dtype, t->shape)));
        }
      }
    } else {
      TESSERA_ASSIGN_OR_RETURN(i.node.dtype, dtype_from_proto(n.dtype()));
      TESSERA_ASSIGN_OR_RETURN(i.node.shape, shape_from_proto(n.shape(), i.node.dtype));
    }
    i.node.operands = i.in;
    if (i.kind == Instruction::Kind::kCollective) {
      TESSERA_ASSIGN_OR_RETURN(i.collective, decode_collective(w.collective()));  // resolve() validates it
      const size_t inputs = i.collective.kind == CollectiveKind::kRaggedAllToAll ? 6 : 1;
      if (i.in.size() != inputs) {
        return absl::InvalidArgumentError(absl::StrCat("plan: ", where, " (", collective_name(i.collective.kind),
                                                       ") needs ", inputs, inputs == 1 ? " input" : " inputs", ", not ",
                                                       i.in.size()));
      }
    }
    if (i.kind == Instruction::Kind::kLocalSlice) {
      if (i.in.size() != 1) return absl::InvalidArgumentError(absl::StrCat("plan: ", where, " needs one input"));
      for (const pb::SliceRange& r : w.slice()) i.slice.push_back({r.start(), r.stop()});
    }
    i.axes.assign(w.axes().begin(), w.axes().end());
    i.positions.assign(w.positions().begin(), w.positions().end());
    if (w.has_relayout()) {
      const pb::Relayout& r = w.relayout();
      TESSERA_ASSIGN_OR_RETURN(Shape shape, shape_from_proto(r.shape(), i.node.dtype));
      i.relayout = Instruction::Relayout{std::move(shape), spec_from_proto(r.from()), spec_from_proto(r.to())};
    }
    state[i.out] = 1;
    type[i.out] = ArrayType{i.node.dtype, i.node.shape};
    out.code.push_back(std::move(i));
  }
  for (int s : plan.output_slots()) {
    TESSERA_RETURN_IF_ERROR(slot_ok(s, "an output"));
    if (state[s] != 1)
      return absl::InvalidArgumentError(absl::StrCat("plan: output slot ", s, " is not live at the end"));
    out.output_slots.push_back(s);
  }
  return out;
}

std::string compile_key(const Graph& graph, const Mesh& mesh, const std::vector<PartitionSpec>& inputs,
                        const std::vector<std::optional<PartitionSpec>>& outputs, const std::vector<int>& donated) {
  pb::CompileRequest req;
  to_proto(graph, req.mutable_graph());
  to_proto(mesh, req.mutable_mesh());
  for (const PartitionSpec& s : inputs) to_proto(s, req.add_input_specs());
  for (const std::optional<PartitionSpec>& s : outputs) {
    pb::OptionalSpec* o = req.add_output_specs();
    o->set_set(s.has_value());
    if (s.has_value()) to_proto(*s, o->mutable_spec());
  }
  req.mutable_donated_inputs()->Assign(donated.begin(), donated.end());
  return deterministic_bytes(req);
}

}  // namespace tessera
