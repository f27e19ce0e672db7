#include "core/collective.h"

#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tessera {

std::string collective_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllReduce:
      return "all_reduce";
    case CollectiveKind::kAllGather:
      return "all_gather";
    case CollectiveKind::kReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::kAllToAll:
      return "all_to_all";
    case CollectiveKind::kCollectivePermute:
      return "collective_permute";
    case CollectiveKind::kBroadcast:
      return "broadcast";
    case CollectiveKind::kRaggedAllToAll:
      return "ragged_all_to_all";
  }
  return "invalid";
}

std::string reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kProd:
      return "prod";
  }
  return "invalid";
}

absl::StatusOr<std::vector<std::vector<int>>> replica_groups(const Mesh& mesh, const std::vector<std::string>& axes) {
  std::vector<int> axis_index;
  std::vector<bool> in_group(mesh.rank(), false);
  for (const std::string& axis : axes) {
    const int a = mesh.axis_index(axis);
    if (a < 0) {
      return absl::InvalidArgumentError(absl::StrCat("replica groups: axis '", axis, "' is not in the mesh ('",
                                                     absl::StrJoin(mesh.axis_names(), "', '"), "')"));
    }
    if (in_group[a])
      return absl::InvalidArgumentError(absl::StrCat("replica groups: axis '", axis, "' is named twice"));
    in_group[a] = true;
    axis_index.push_back(a);
  }
  // Key: coordinates along the other axes. Members ordered by their coordinates along `axes`.
  std::map<std::vector<int64_t>, std::map<std::vector<int64_t>, int>> groups;
  for (int64_t pos = 0; pos < mesh.size(); ++pos) {
    const std::vector<int64_t> c = mesh.coords(pos);
    std::vector<int64_t> outer, inner;
    for (int a = 0; a < mesh.rank(); ++a) {
      if (!in_group[a]) outer.push_back(c[a]);
    }
    for (int a : axis_index) inner.push_back(c[a]);
    groups[outer][inner] = mesh.device_ids()[pos];
  }
  std::vector<std::vector<int>> out;
  for (const auto& [outer, members] : groups) {
    out.emplace_back();
    for (const auto& [inner, device] : members) out.back().push_back(device);
  }
  return out;
}

absl::Status validate_collective(const CollectiveSpec& spec) {
  const std::string name = collective_name(spec.kind);
  if (spec.groups.empty()) return absl::InvalidArgumentError(absl::StrCat(name, ": no replica groups"));
  std::map<int, int> group_of;
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    if (spec.groups[g].empty())
      return absl::InvalidArgumentError(absl::StrCat(name, ": replica group ", g, " is empty"));
    if (spec.groups[g].size() != spec.groups[0].size()) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": replica group ", g, " has ", spec.groups[g].size(),
                                                     " devices but group 0 has ", spec.groups[0].size()));
    }
    for (int d : spec.groups[g]) {
      if (d < 0) return absl::InvalidArgumentError(absl::StrCat(name, ": device id ", d, " is negative"));
      if (!group_of.emplace(d, static_cast<int>(g)).second) {
        return absl::InvalidArgumentError(absl::StrCat(name, ": device ", d, " is in more than one replica group"));
      }
    }
  }
  if (spec.kind == CollectiveKind::kCollectivePermute) {
    std::set<int> sources, targets;
    for (const auto& [s, t] : spec.pairs) {
      if (!group_of.count(s) || !group_of.count(t) || group_of[s] != group_of[t]) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": pair (", s, ", ", t, ") must name two devices of one replica group"));
      }
      if (!sources.insert(s).second)
        return absl::InvalidArgumentError(absl::StrCat(name, ": device ", s, " is a source twice"));
      if (!targets.insert(t).second)
        return absl::InvalidArgumentError(absl::StrCat(name, ": device ", t, " is a target twice"));
    }
  }
  if (spec.kind == CollectiveKind::kBroadcast &&
      (spec.root < 0 || spec.root >= static_cast<int>(spec.groups[0].size()))) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": root ", spec.root, " is not a position in groups of ", spec.groups[0].size()));
  }
  return absl::OkStatus();
}

absl::StatusOr<Shape> collective_output_shape(const CollectiveSpec& spec, const Shape& input) {
  const std::string name = collective_name(spec.kind);
  const int64_t n = static_cast<int64_t>(spec.groups[0].size());
  const int rank = static_cast<int>(input.size());
  auto check_dim = [&](int d, const char* what) -> absl::Status {
    if (d < 0 || d >= rank) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": ", what, " ", d, " is out of range for shape ", shape_to_string(input)));
    }
    return absl::OkStatus();
  };
  auto check_divisible = [&](int d, const char* what) -> absl::Status {
    if (input[d] % n != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": ", what, " ", d, " of size ", input[d], " is not divisible by the group size ", n));
    }
    return absl::OkStatus();
  };
  Shape out = input;
  switch (spec.kind) {
    case CollectiveKind::kAllReduce:
    case CollectiveKind::kCollectivePermute:
    case CollectiveKind::kBroadcast:
      return out;
    case CollectiveKind::kRaggedAllToAll:
      return absl::InvalidArgumentError(
          "ragged_all_to_all: its result has the shape of its output operand, which only a plan's instruction has");
    case CollectiveKind::kAllGather: {
      absl::Status s = check_dim(spec.dimension, "dimension");
      if (!s.ok()) return s;
      out[spec.dimension] *= n;
      return out;
    }
    case CollectiveKind::kReduceScatter: {
      absl::Status s = check_dim(spec.dimension, "dimension");
      if (s.ok()) s = check_divisible(spec.dimension, "dimension");
      if (!s.ok()) return s;
      out[spec.dimension] /= n;
      return out;
    }
    case CollectiveKind::kAllToAll: {
      absl::Status s = check_dim(spec.split_dimension, "split dimension");
      if (s.ok()) s = check_dim(spec.concat_dimension, "concat dimension");
      if (s.ok()) s = check_divisible(spec.split_dimension, "split dimension");
      if (!s.ok()) return s;
      out[spec.split_dimension] /= n;
      out[spec.concat_dimension] *= n;
      return out;
    }
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown collective kind ", static_cast<int>(spec.kind)));
}

std::pair<int, int> find_in_groups(const CollectiveSpec& spec, int device) {
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    for (size_t i = 0; i < spec.groups[g].size(); ++i) {
      if (spec.groups[g][i] == device) return {static_cast<int>(g), static_cast<int>(i)};
    }
  }
  return {-1, -1};
}

}  // namespace tessera
