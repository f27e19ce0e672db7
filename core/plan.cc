#include "core/plan.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "core/status.h"

namespace tessera {
namespace {

std::string slot(int s) { return absl::StrCat("s", s); }

std::string groups_to_string(const std::vector<std::vector<int>>& groups) {
  return absl::StrCat("{",
                      absl::StrJoin(groups, ",",
                                    [](std::string* o, const std::vector<int>& g) {
                                      absl::StrAppend(o, "{", absl::StrJoin(g, ","), "}");
                                    }),
                      "}");
}

std::string relayout_to_string(const Instruction::Relayout& r) {
  return absl::StrCat(r.from.to_string(), " -> ", r.to.to_string());
}

// The block of a `shape` value this device holds under `spec` on `mesh`.
absl::StatusOr<DeviceShard> shard_at(const Mesh& mesh, const PartitionSpec& spec, const Shape& shape,
                                     int64_t position) {
  const NamedSharding sharding(mesh, spec);
  TESSERA_RETURN_IF_ERROR(sharding.validate(shape));
  return sharding.device_shards(shape)[position];
}

// This device's block under relayout.to, relative to the block it holds under relayout.from.
absl::StatusOr<Index> local_block(const Mesh& mesh, const Instruction::Relayout& r, int64_t position) {
  TESSERA_ASSIGN_OR_RETURN(DeviceShard held, shard_at(mesh, r.from, r.shape, position));
  TESSERA_ASSIGN_OR_RETURN(DeviceShard kept, shard_at(mesh, r.to, r.shape, position));
  Index out;
  for (size_t d = 0; d < r.shape.size(); ++d) {
    if (kept.index[d].start < held.index[d].start || kept.index[d].stop > held.index[d].stop) {
      return absl::InvalidArgumentError(absl::StrCat("local slice ", index_to_string(kept.index),
                                                     " is not inside the held block ", index_to_string(held.index)));
    }
    out.push_back({kept.index[d].start - held.index[d].start, kept.index[d].stop - held.index[d].start});
  }
  return out;
}

// A permute between layouts: every device sends its block to the device that holds the same
// block (and replica) under the new layout.
absl::StatusOr<std::vector<std::pair<int, int>>> relayout_pairs(const Mesh& mesh, const Instruction::Relayout& r) {
  const NamedSharding from(mesh, r.from), to(mesh, r.to);
  TESSERA_RETURN_IF_ERROR(from.validate(r.shape));
  TESSERA_RETURN_IF_ERROR(to.validate(r.shape));
  std::map<std::pair<std::string, int64_t>, int> holder;  // (block, replica) -> device under `from`
  for (const DeviceShard& s : from.device_shards(r.shape))
    holder[{index_to_string(s.index), s.replica_id}] = s.device_id;
  std::vector<std::pair<int, int>> pairs;
  for (const DeviceShard& t : to.device_shards(r.shape)) {
    auto it = holder.find({index_to_string(t.index), t.replica_id});
    if (it != holder.end()) pairs.emplace_back(it->second, t.device_id);
  }
  return pairs;
}

// This device's position along `axes`, and the replica groups of those axes.
absl::StatusOr<int64_t> position_along(const std::vector<std::vector<int>>& groups, int device_id) {
  for (const std::vector<int>& g : groups) {
    for (size_t k = 0; k < g.size(); ++k) {
      if (g[k] == device_id) return static_cast<int64_t>(k);
    }
  }
  return absl::InvalidArgumentError(absl::StrCat("device ", device_id, " is in none of its groups"));
}

absl::Status resolve_instruction(Instruction& i, const Mesh& mesh, int device_id, int64_t position) {
  for (size_t b = 0; b < i.branches.size(); ++b) {
    if (i.branches[b] == nullptr) return absl::InvalidArgumentError(absl::StrCat("its sub-plan ", b, " is missing"));
    absl::StatusOr<DevicePlan> p = resolve(*i.branches[b], mesh, device_id);
    if (!p.ok()) return absl::Status(p.status().code(), absl::StrCat("its sub-plan ", b, ": ", p.status().message()));
    i.branches[b] = std::make_shared<const DevicePlan>(*std::move(p));
  }
  if (i.kind == Instruction::Kind::kSwitch) return absl::OkStatus();
  if (i.kind == Instruction::Kind::kLoop) {
    if (i.body == nullptr) return absl::InvalidArgumentError("a loop has no body");
    absl::StatusOr<DevicePlan> body = resolve(*i.body, mesh, device_id);
    if (!body.ok()) return absl::Status(body.status().code(), absl::StrCat("its body: ", body.status().message()));
    i.body = std::make_shared<const DevicePlan>(*std::move(body));
    return absl::OkStatus();
  }
  if (i.kind == Instruction::Kind::kKernel && i.node.op == Op::kAxisIndex) {
    if (i.node.dtype != DType::kI32 || !i.node.shape.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("axis_index is ", type_to_string(i.node.dtype, i.node.shape), ", not i32[]"));
    }
    TESSERA_ASSIGN_OR_RETURN(std::vector<std::vector<int>> groups, replica_groups(mesh, i.axes));
    TESSERA_ASSIGN_OR_RETURN(int64_t k, position_along(groups, device_id));
    i.node.op = Op::kConstant;
    i.node.attributes = ConstantAttrs{Scalar(k)};
    return absl::OkStatus();
  }
  if (i.kind == Instruction::Kind::kLocalSlice && i.relayout.has_value()) {
    TESSERA_ASSIGN_OR_RETURN(i.slice, local_block(mesh, *i.relayout, position));
    return absl::OkStatus();
  }
  if (i.kind != Instruction::Kind::kCollective) return absl::OkStatus();
  CollectiveSpec& c = i.collective;
  if (i.relayout.has_value()) {
    if (c.kind != CollectiveKind::kCollectivePermute) {
      return absl::InvalidArgumentError(absl::StrCat(collective_name(c.kind), " cannot change layouts"));
    }
    TESSERA_ASSIGN_OR_RETURN(c.pairs, relayout_pairs(mesh, *i.relayout));
    c.groups = {mesh.device_ids()};
  } else {
    TESSERA_ASSIGN_OR_RETURN(c.groups, replica_groups(mesh, i.axes));
    if (c.kind == CollectiveKind::kCollectivePermute) {
      if (i.positions.size() % 2 != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("a permute needs (source, target) pairs, not ", i.positions.size(), " positions"));
      }
      c.pairs.clear();
      for (const std::vector<int>& g : c.groups) {
        for (size_t k = 0; k < i.positions.size(); k += 2) {
          for (int64_t p : {i.positions[k], i.positions[k + 1]}) {
            if (p < 0 || p >= static_cast<int64_t>(g.size())) {
              return absl::InvalidArgumentError(
                  absl::StrCat("permute position ", p, " is outside the ", g.size(), " devices of its axes"));
            }
          }
          c.pairs.emplace_back(g[i.positions[k]], g[i.positions[k + 1]]);
        }
      }
      c.groups = {mesh.device_ids()};
    }
  }
  return validate_collective(c);
}

}  // namespace

absl::StatusOr<DevicePlan> resolve(const DevicePlan& program, const Mesh& mesh, int device_id) {
  const std::vector<int>& ids = mesh.device_ids();
  auto it = absl::c_find(ids, device_id);
  if (it == ids.end()) {
    return absl::NotFoundError(absl::StrCat("plan: device ", device_id, " is not in the program's mesh ",
                                            mesh.to_string(), " of devices {", absl::StrJoin(ids, ","), "}"));
  }
  const int64_t position = it - ids.begin();
  DevicePlan out = program;
  out.device = device_id;
  for (size_t k = 0; k < out.code.size(); ++k) {
    absl::Status s = resolve_instruction(out.code[k], mesh, device_id, position);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("plan: instruction ", k, " on device ", device_id, ": ", s.message()));
    }
  }
  return out;
}

uint64_t instruction_op_span(const Instruction& i) {
  if (i.kind == Instruction::Kind::kSwitch) {
    uint64_t widest = 0;
    for (const auto& b : i.branches) widest = std::max(widest, b == nullptr ? 0 : plan_op_span(*b));
    return 1 + widest;
  }
  if (i.kind != Instruction::Kind::kLoop || i.body == nullptr) return 1;
  const uint64_t pred = i.branches.empty() || i.branches[0] == nullptr ? 0 : plan_op_span(*i.branches[0]);
  return 1 + static_cast<uint64_t>(i.trip_count) * (plan_op_span(*i.body) + pred) + pred;
}

uint64_t plan_op_span(const DevicePlan& program) {
  uint64_t span = 0;
  for (const Instruction& i : program.code) span += instruction_op_span(i);
  return span;
}

bool plan_has_collectives(const DevicePlan& program) {
  for (const Instruction& i : program.code) {
    if (i.kind == Instruction::Kind::kCollective) return true;
    if (i.kind == Instruction::Kind::kLoop && i.body != nullptr && plan_has_collectives(*i.body)) return true;
    for (const auto& b : i.branches) {
      if (b != nullptr && plan_has_collectives(*b)) return true;
    }
  }
  return false;
}

bool freed_after(const DevicePlan& plan, size_t k, int s) {
  for (size_t i = k + 1; i < plan.code.size() && plan.code[i].kind == Instruction::Kind::kFree; ++i) {
    if (plan.code[i].in[0] == s) return true;
  }
  return false;
}

int64_t plan_size(const DevicePlan& program) {
  int64_t size = 0;
  for (const Instruction& i : program.code) {
    size += 1 + (i.kind == Instruction::Kind::kLoop && i.body != nullptr ? plan_size(*i.body) : 0);
    for (const auto& b : i.branches) size += b == nullptr ? 0 : plan_size(*b);
  }
  return size;
}

int64_t collective_bytes_per_device(const Instruction& i, const Mesh& mesh) {
  if (i.kind == Instruction::Kind::kSwitch) {  // the costliest branch
    int64_t most = 0;
    for (const auto& b : i.branches) most = std::max(most, b == nullptr ? 0 : collective_bytes_per_device(*b, mesh));
    return most;
  }
  if (i.kind == Instruction::Kind::kLoop && i.body != nullptr && !i.branches.empty()) {  // a while: one iteration
    return collective_bytes_per_device(*i.body, mesh) +
           (i.branches[0] == nullptr ? 0 : collective_bytes_per_device(*i.branches[0], mesh));
  }
  if (i.kind == Instruction::Kind::kLoop && i.body != nullptr) {
    return i.trip_count * collective_bytes_per_device(*i.body, mesh);
  }
  if (i.kind != Instruction::Kind::kCollective) return 0;
  int64_t bytes = dtype_size(i.node.dtype);
  for (int64_t d : i.node.shape) bytes *= d;
  int64_t n = i.relayout.has_value() ? mesh.size() : 1;
  if (!i.relayout.has_value()) {
    if (!i.axes.empty()) {
      absl::StatusOr<std::vector<std::vector<int>>> groups = replica_groups(mesh, i.axes);
      n = groups.ok() && !groups->empty() ? static_cast<int64_t>(groups->front().size()) : 1;
    } else if (!i.collective.groups.empty()) {
      n = static_cast<int64_t>(i.collective.groups.front().size());
    }
  }
  switch (i.collective.kind) {
    case CollectiveKind::kAllReduce:
      return 2 * (n - 1) * bytes / n;
    case CollectiveKind::kAllGather:
    case CollectiveKind::kAllToAll:
      return (n - 1) * bytes / n;
    case CollectiveKind::kReduceScatter:
      return (n - 1) * bytes;
    default:
      return bytes;
  }
}

int64_t collective_bytes_per_device(const DevicePlan& program, const Mesh& mesh) {
  int64_t total = 0;
  for (const Instruction& i : program.code) total += collective_bytes_per_device(i, mesh);
  return total;
}

std::string plan_to_text(const DevicePlan& plan, const Mesh& mesh, const std::string& header) {
  std::vector<std::string> inputs;
  for (size_t i = 0; i < plan.input_slots.size(); ++i) {
    inputs.push_back(slot(plan.input_slots[i]));
    if (absl::c_linear_search(plan.donated_inputs, static_cast<int>(i))) inputs.back() += " (donated)";
  }
  std::string out = absl::StrCat(header, "\n  inputs: ", absl::StrJoin(inputs, ", "), "\n");
  for (const Instruction& i : plan.code) {
    std::vector<std::string> in;
    for (int s : i.in) in.push_back(slot(s));
    const std::string type = type_to_string(i.node.dtype, i.node.shape);
    switch (i.kind) {
      case Instruction::Kind::kKernel: {
        const std::string attrs = i.node.op == Op::kAxisIndex ? absl::StrCat("axes=", axes_to_string(i.axes)) : "";
        absl::StrAppend(&out, "  ", slot(i.out), " = ", op_name(i.node.op), "(", absl::StrJoin(in, ", "), attrs, ") ",
                        type, "  ; ", i.cause, "\n");
        break;
      }
      case Instruction::Kind::kCollective: {
        const CollectiveSpec& c = i.collective;
        std::string attrs = c.kind == CollectiveKind::kAllReduce || c.kind == CollectiveKind::kReduceScatter
                                ? absl::StrCat(reduce_op_name(c.reduce_op), ", ")
                                : "";
        if (c.kind == CollectiveKind::kAllGather || c.kind == CollectiveKind::kReduceScatter) {
          absl::StrAppend(&attrs, "dim=", c.dimension, ", ");
        }
        if (c.kind == CollectiveKind::kAllToAll) {
          absl::StrAppend(&attrs, "split=", c.split_dimension, ", concat=", c.concat_dimension, ", ");
        }
        if (!c.groups.empty()) {  // resolved
          absl::StrAppend(&attrs, "groups=", groups_to_string(c.groups));
        } else if (i.relayout.has_value()) {
          absl::StrAppend(&attrs, relayout_to_string(*i.relayout));
        } else {
          absl::StrAppend(&attrs, "axes=", axes_to_string(i.axes));
          if (!i.positions.empty()) {
            std::vector<std::string> pairs;
            for (size_t k = 0; k + 1 < i.positions.size(); k += 2) {
              pairs.push_back(absl::StrCat(i.positions[k], "->", i.positions[k + 1]));
            }
            absl::StrAppend(&attrs, ", positions={", absl::StrJoin(pairs, ","), "}");
          }
        }
        absl::StrAppend(&out, "  ", slot(i.out), " = ", collective_name(c.kind), "(", attrs, ") ", in[0], " ", type,
                        " ", collective_bytes_per_device(i, mesh), "B/device  ; ", i.cause, "\n");
        break;
      }
      case Instruction::Kind::kLocalSlice:
        absl::StrAppend(&out, "  ", slot(i.out), " = local_slice",
                        i.slice.empty() && i.relayout.has_value()
                            ? absl::StrCat("(", relayout_to_string(*i.relayout), ")")
                            : index_to_string(i.slice),
                        " ", in[0], " ", type, "  ; ", i.cause, "\n");
        break;
      case Instruction::Kind::kFree:
        absl::StrAppend(&out, "  free ", in[0], "\n");
        break;
      case Instruction::Kind::kLoop: {
        std::vector<std::string> outs = {slot(i.out)};
        for (int s : i.extra_out) outs.push_back(slot(s));
        std::string body = i.body == nullptr ? "" : plan_to_text(*i.body, mesh, "  body:");
        if (!i.branches.empty() && i.branches[0] != nullptr) {
          body = absl::StrCat(plan_to_text(*i.branches[0], mesh, "  predicate:"), body);
        }
        if (!body.empty() && body.back() == '\n') body.pop_back();
        absl::StrAppend(&out, "  ", absl::StrJoin(outs, ", "), i.branches.empty() ? " = loop(" : " = while(",
                        absl::StrJoin(in, ", "), ", trip_count=", i.trip_count, i.reverse ? ", reverse" : "",
                        ", carries=", i.num_carry, ") ", collective_bytes_per_device(i, mesh), "B/device",
                        i.branches.empty() ? "" : " per iteration", "  ; ", i.cause, "\n  ",
                        absl::StrReplaceAll(body, {{"\n", "\n  "}}), "\n");
        break;
      }
      case Instruction::Kind::kSwitch: {
        std::vector<std::string> outs = {slot(i.out)};
        for (int s : i.extra_out) outs.push_back(slot(s));
        std::string branches;
        for (size_t b = 0; b < i.branches.size(); ++b) {
          if (i.branches[b] != nullptr)
            absl::StrAppend(&branches, plan_to_text(*i.branches[b], mesh, absl::StrCat("  branch ", b, ":")));
        }
        if (!branches.empty() && branches.back() == '\n') branches.pop_back();
        absl::StrAppend(&out, "  ", absl::StrJoin(outs, ", "), " = switch(", absl::StrJoin(in, ", "),
                        ", branches=", i.branches.size(), ") ", collective_bytes_per_device(i, mesh), "B/device  ; ",
                        i.cause, "\n  ", absl::StrReplaceAll(branches, {{"\n", "\n  "}}), "\n");
        break;
      }
    }
  }
  absl::StrAppend(&out, "  outputs: ",
                  absl::StrJoin(plan.output_slots, ", ", [](std::string* o, int s) { o->append(slot(s)); }), "\n");
  return out;
}

}  // namespace tessera
