#include "core/wire.h"

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "proto/tessera.pb.h"

namespace tessera {

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
  out->mutable_device_ids()->Assign(mesh.device_ids().begin(), mesh.device_ids().end());
}

absl::StatusOr<Mesh> mesh_from_proto(const pb::Mesh& mesh) {
  return Mesh::create(std::vector<int64_t>(mesh.shape().begin(), mesh.shape().end()),
                      std::vector<std::string>(mesh.axis_names().begin(), mesh.axis_names().end()),
                      std::vector<int>(mesh.device_ids().begin(), mesh.device_ids().end()));
}

void to_proto(const NamedSharding& sharding, pb::NamedSharding* out) {
  to_proto(sharding.mesh(), out->mutable_mesh());
  for (const Axes& axes : sharding.spec().dims()) {
    auto* dim = out->mutable_spec()->add_dims();
    for (const std::string& axis : axes) dim->add_axes(axis);
  }
}

absl::StatusOr<NamedSharding> sharding_from_proto(const pb::NamedSharding& sharding) {
  TESSERA_ASSIGN_OR_RETURN(Mesh mesh, mesh_from_proto(sharding.mesh()));
  std::vector<Axes> dims;
  for (const auto& dim : sharding.spec().dims()) dims.emplace_back(dim.axes().begin(), dim.axes().end());
  NamedSharding out(std::move(mesh), PartitionSpec(std::move(dims)));
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

absl::StatusOr<CollectiveSpec> collective_from_proto(const pb::CollectiveSpec& spec) {
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
  TESSERA_RETURN_IF_ERROR(validate_collective(out));
  return out;
}

}  // namespace tessera
