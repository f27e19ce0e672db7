#include "tests/support/host_eval.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "core/collective.h"
#include "core/slicing.h"
#include "worker/kernels/kernels.h"

namespace tessera {
namespace {

// Runs the kernel of `op` on the given arrays: how the reference computes collectives.
absl::StatusOr<HostArray> kernel(Op op, DType dtype, Shape shape, const std::vector<const HostArray*>& in,
                                 Attrs attrs = NoAttrs{}) {
  Node n;
  n.op = op;
  n.dtype = dtype;
  n.shape = std::move(shape);
  n.attributes = std::move(attrs);
  return run_kernel(n, in);
}

// Block `i` of `n` equal blocks of `x` along `dim`.
absl::StatusOr<HostArray> block(const HostArray& x, int64_t dim, int64_t i, int64_t n) {
  const int64_t size = x.shape()[dim] / n;
  std::vector<int64_t> start(x.shape().size(), 0);
  std::vector<int64_t> limit = x.shape();
  start[dim] = i * size;
  limit[dim] = (i + 1) * size;
  Shape shape = x.shape();
  shape[dim] = size;
  return kernel(Op::kSlice, x.dtype(), shape, {&x}, SliceAttrs{start, limit, {}});
}

// One shard_map collective over every group, by its definition: one block per mesh position
// in, one out.
absl::StatusOr<std::vector<HostArray>> reference_collective(const Node& n, const std::vector<HostArray>& in) {
  const CollectiveAttrs& c = n.attrs<CollectiveAttrs>();
  const Mesh& mesh = c.mesh;
  std::map<int, int> position;
  for (int p = 0; p < mesh.size(); ++p) position[mesh.device_ids()[p]] = p;
  std::vector<HostArray> out(in.size());
  absl::StatusOr<std::vector<std::vector<int>>> groups = replica_groups(mesh, c.axes);
  if (!groups.ok()) return groups.status();
  const ReduceOp reduce_op = c.reduce_op;
  const bool is_bool = n.dtype == DType::kBool;
  const Op combine = reduce_op == ReduceOp::kSum   ? (is_bool ? Op::kOr : Op::kAdd)
                     : reduce_op == ReduceOp::kMax ? (is_bool ? Op::kOr : Op::kMax)
                     : reduce_op == ReduceOp::kMin ? (is_bool ? Op::kAnd : Op::kMin)
                                                   : (is_bool ? Op::kAnd : Op::kMul);
  for (const std::vector<int>& devices : *groups) {
    std::vector<const HostArray*> members;
    for (int d : devices) members.push_back(&in[position[d]]);
    const int64_t size = static_cast<int64_t>(members.size());
    auto reduced = [&]() -> absl::StatusOr<HostArray> {
      HostArray acc = members[0]->clone();
      for (size_t m = 1; m < members.size(); ++m) {
        absl::StatusOr<HostArray> next = kernel(combine, acc.dtype(), acc.shape(), {&acc, members[m]});
        if (!next.ok()) return next.status();
        acc = *std::move(next);
      }
      return acc;
    };
    for (int64_t r = 0; r < size; ++r) {
      HostArray& dst = out[position[devices[r]]];
      absl::StatusOr<HostArray> v = absl::InternalError("unreachable");
      switch (n.op) {
        case Op::kAllReduce:
          v = reduced();
          break;
        case Op::kAllGather:
          v = kernel(Op::kConcatenate, n.dtype, n.shape, members, ConcatAttrs{c.dimension});
          break;
        case Op::kReduceScatter: {
          absl::StatusOr<HostArray> sum = reduced();
          v = sum.ok() ? block(*sum, c.dimension, r, size) : sum.status();
          break;
        }
        case Op::kAllToAll: {  // block r of every member, in member order, joined
          std::vector<HostArray> pieces;
          std::vector<const HostArray*> ptrs;
          for (const HostArray* m : members) {
            absl::StatusOr<HostArray> b = block(*m, c.split_dimension, r, size);
            if (!b.ok()) return b.status();
            pieces.push_back(*std::move(b));
          }
          for (const HostArray& p : pieces) ptrs.push_back(&p);
          v = kernel(Op::kConcatenate, n.dtype, n.shape, ptrs, ConcatAttrs{c.concat_dimension});
          break;
        }
        case Op::kCollectivePermute: {
          v = HostArray::zeros(n.dtype, n.shape);
          for (size_t i = 0; i + 1 < c.positions.size(); i += 2) {
            if (c.positions[i + 1] == r) v = members[c.positions[i]]->clone();
          }
          break;
        }
        default:
          return absl::InvalidArgumentError(absl::StrCat(op_name(n.op), " is not a collective"));
      }
      if (!v.ok()) return v.status();
      dst = *std::move(v);
    }
  }
  return out;
}

// lax.while_loop by its definition: `while cond(carry): carry = body(carry)`, on the host. A
// loop that does not end within 10^6 iterations is an error (a test's bound, not the op's).
absl::StatusOr<HostArray> reference_while(const Node& n, const std::vector<const HostArray*>& operands) {
  const BranchesAttrs& a = n.attrs<BranchesAttrs>();
  std::vector<HostArray> carry;
  for (const HostArray* o : operands) carry.push_back(o->clone());
  for (int64_t t = 0;; ++t) {
    if (t > 1000000) return absl::DeadlineExceededError("reference_while: over 10^6 iterations");
    std::vector<const HostArray*> in;
    for (const HostArray& c : carry) in.push_back(&c);
    absl::StatusOr<std::vector<HostArray>> p = evaluate_on_host(*a.graphs[0], in);
    if (!p.ok()) return p.status();
    if ((*p)[0].data()[0] == std::byte{0}) break;
    absl::StatusOr<std::vector<HostArray>> next = evaluate_on_host(*a.graphs[1], in);
    if (!next.ok()) return next.status();
    carry = *std::move(next);
  }
  return std::move(carry[a.output]);
}

// lax.switch by its definition: branches[clamp(index, 0, n - 1)](*operands), on the host.
absl::StatusOr<HostArray> reference_switch(const Node& n, const std::vector<const HostArray*>& operands) {
  const BranchesAttrs& a = n.attrs<BranchesAttrs>();
  int32_t k = 0;
  std::memcpy(&k, operands[0]->data(), sizeof(k));
  const int64_t b = std::clamp<int64_t>(k, 0, static_cast<int64_t>(a.graphs.size()) - 1);
  absl::StatusOr<std::vector<HostArray>> out =
      evaluate_on_host(*a.graphs[b], std::vector<const HostArray*>(operands.begin() + 1, operands.end()));
  if (!out.ok()) return out.status();
  return std::move((*out)[a.output]);
}

// A scan by its definition: the body graph evaluated on the host once per row, in order, the
// carries passed along and the ys stacked (nothing of the plan's loop involved).
absl::StatusOr<HostArray> reference_scan(const Node& n, const std::vector<const HostArray*>& operands) {
  const ScanAttrs& a = n.attrs<ScanAttrs>();
  std::vector<HostArray> carry;
  for (int64_t c = 0; c < a.num_carry; ++c) carry.push_back(operands[c]->clone());
  std::vector<std::vector<HostArray>> ys(a.body->outputs().size());
  for (int64_t step = 0; step < a.length; ++step) {
    const int64_t row = a.reverse ? a.length - 1 - step : step;
    std::vector<HostArray> rows;
    for (size_t k = a.num_carry; k < operands.size(); ++k) {
      Index index;
      for (int64_t d : operands[k]->shape()) index.push_back({0, d});
      index[0] = {row, row + 1};
      Shape shape(operands[k]->shape().begin() + 1, operands[k]->shape().end());
      rows.push_back(extract_block(*operands[k], index).reshaped(shape));
    }
    std::vector<const HostArray*> in;
    for (const HostArray& c : carry) in.push_back(&c);
    for (const HostArray& r : rows) in.push_back(&r);
    absl::StatusOr<std::vector<HostArray>> out = evaluate_on_host(*a.body, in);
    if (!out.ok()) return out.status();
    for (size_t j = 0; j < out->size(); ++j) {
      if (static_cast<int64_t>(j) < a.num_carry) {
        carry[j] = std::move((*out)[j]);
      } else {
        ys[j].push_back(std::move((*out)[j]));
      }
    }
  }
  if (a.output < a.num_carry) return std::move(carry[a.output]);
  HostArray stacked = HostArray::zeros(n.dtype, n.shape);
  for (int64_t step = 0; step < a.length; ++step) {
    const int64_t row = a.reverse ? a.length - 1 - step : step;
    Index index;
    for (int64_t d : n.shape) index.push_back({0, d});
    index[0] = {row, row + 1};
    Shape one = n.shape;
    one[0] = 1;
    HostArray y = ys[a.output][step].clone();
    insert_block(std::move(y).reshaped(one), index, &stacked);
  }
  return stacked;
}

}  // namespace

absl::StatusOr<std::vector<HostArray>> evaluate_on_host(const Graph& graph,
                                                        const std::vector<const HostArray*>& inputs) {
  if (inputs.size() != graph.parameters().size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("evaluate_on_host: ", graph.parameters().size(), " parameters but ", inputs.size(), " inputs"));
  }
  // Every node's value is kept to the end: reference graphs are small.
  std::vector<HostArray> values(graph.size());
  std::vector<std::vector<HostArray>> blocks(graph.size());  // shard_map bodies: per mesh position
  for (int id = 0; id < graph.size(); ++id) {
    const Node& n = graph.node(id);
    if (n.op == Op::kParameter) {
      const int64_t index = n.attrs<ParameterAttrs>().index;
      const HostArray* in = inputs[index];
      if (in == nullptr || in->dtype() != n.dtype || in->shape() != n.shape) {
        return absl::InvalidArgumentError(absl::StrCat(
            "evaluate_on_host: parameter ", index, " is ", type_to_string(n.dtype, n.shape), " but the input is ",
            in == nullptr ? std::string("null") : type_to_string(in->dtype(), in->shape())));
      }
      values[id] = in->clone();
      continue;
    }
    if (has_trait(n.op, kPlacement)) {  // placement or typing only: the operand's value (or blocks)
      values[id] = values[n.operands[0]].clone();
      for (const HostArray& b : blocks[n.operands[0]]) blocks[id].push_back(b.clone());
      continue;
    }
    // shard_map: a body's values are one block per mesh position, computed one position at a
    // time; collectives combine them across positions by their definitions.
    if (n.op == Op::kShardMapIn) {
      for (const DeviceShard& s : n.attrs<ShardingAttrs>().sharding.device_shards(graph.node(n.operands[0]).shape)) {
        blocks[id].push_back(extract_block(values[n.operands[0]], s.index));
      }
      continue;
    }
    if (n.op == Op::kShardMapOut) {
      values[id] = HostArray::zeros(n.dtype, n.shape);
      const std::vector<DeviceShard> shards = n.attrs<ShardingAttrs>().sharding.device_shards(n.shape);
      for (size_t p = 0; p < shards.size(); ++p) insert_block(blocks[n.operands[0]][p], shards[p].index, &values[id]);
      continue;
    }
    if (n.op == Op::kAxisIndex) {
      const Mesh& mesh = *n.attrs<AxisIndexAttrs>().mesh;
      absl::StatusOr<std::vector<std::vector<int>>> groups = replica_groups(mesh, n.attrs<AxisIndexAttrs>().axes);
      if (!groups.ok()) return groups.status();
      blocks[id].resize(mesh.size());
      for (const std::vector<int>& g : *groups) {
        for (size_t k = 0; k < g.size(); ++k) {
          for (int p = 0; p < mesh.size(); ++p) {
            if (mesh.device_ids()[p] == g[k])
              blocks[id][p] = HostArray::from_vector<int32_t>({}, {static_cast<int32_t>(k)});
          }
        }
      }
      continue;
    }
    if (has_trait(n.op, kCollective)) {
      absl::StatusOr<std::vector<HostArray>> v = reference_collective(n, blocks[n.operands[0]]);
      if (!v.ok()) return v.status();
      blocks[id] = *std::move(v);
      continue;
    }
    size_t positions = 0;  // > 0: an op of a shard_map body
    for (int o : n.operands) positions = std::max(positions, blocks[o].size());
    if (positions > 0) {
      for (size_t p = 0; p < positions; ++p) {
        std::vector<const HostArray*> operands;
        for (int o : n.operands) operands.push_back(blocks[o].empty() ? &values[o] : &blocks[o][p]);
        absl::StatusOr<HostArray> v = run_kernel(n, operands);
        if (!v.ok()) {
          return absl::Status(v.status().code(), absl::StrCat("evaluate_on_host: %", id, " at mesh position ", p, ": ",
                                                              v.status().message()));
        }
        blocks[id].push_back(*std::move(v));
      }
      continue;
    }
    std::vector<const HostArray*> operands;
    for (int o : n.operands) operands.push_back(&values[o]);
    absl::StatusOr<HostArray> v = n.op == Op::kScan     ? reference_scan(n, operands)
                                  : n.op == Op::kWhile  ? reference_while(n, operands)
                                  : n.op == Op::kSwitch ? reference_switch(n, operands)
                                                        : run_kernel(n, operands);
    if (!v.ok()) {
      return absl::Status(v.status().code(), absl::StrCat("evaluate_on_host: %", id, ": ", v.status().message()));
    }
    values[id] = *std::move(v);
  }
  std::vector<HostArray> out;
  for (int o : graph.outputs()) out.push_back(values[o].clone());
  return out;
}

}  // namespace tessera
