#include "coordinator/compiler/propagate.h"

#include <algorithm>
#include <limits>
#include <set>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/compiler/reshard.h"
#include "core/sharding.h"
#include "core/status.h"

namespace tessera {
namespace {

using Dims = std::vector<Axes>;

// Ops through which a partial sum passes unresolved (they are linear in the operand).
bool passes_partial(const Node& n) {
  switch (n.op) {
    case Op::kNeg:
    case Op::kBroadcastInDim:
    case Op::kReshape:
    case Op::kTranspose:
    case Op::kSlice:
      return true;
    default:
      return false;
  }
}

// How reshape maps dimensions: consecutive groups, input [i, i2) and output [o, o2), grown
// until their element counts match (`exact`; false only for a trailing group where the
// shapes run out first). Input dimensions past the last group are in none.
struct ReshapeGroup {
  size_t i, i2, o, o2;
  bool exact;
};

std::vector<ReshapeGroup> reshape_groups(const Shape& in, const Shape& out) {
  std::vector<ReshapeGroup> groups;
  size_t i = 0, o = 0;
  while (i < in.size() && o < out.size()) {
    size_t i2 = i + 1, o2 = o + 1;
    int64_t pi = in[i], po = out[o];
    while (pi != po) {
      if (pi < po && i2 < in.size()) {
        pi *= in[i2++];
      } else if (o2 < out.size()) {
        po *= out[o2++];
      } else {
        break;
      }
    }
    groups.push_back({i, i2, o, o2, pi == po});
    i = i2;
    o = o2;
  }
  return groups;
}

class Propagator {
 public:
  Propagator(const Graph& g, const Mesh& mesh) : g_(g), mesh_(mesh), assigned_(g.size(), false) {
    out_.result.resize(g.size());
    out_.operands.resize(g.size());
  }

  absl::StatusOr<Propagation> run(const std::vector<PartitionSpec>& inputs,
                                  const std::vector<std::optional<PartitionSpec>>& outputs) {
    if (inputs.size() != g_.parameters().size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("jit: ", g_.parameters().size(), " inputs but ", inputs.size(), " input shardings"));
    }
    for (size_t i = 0; i < inputs.size(); ++i) {
      const Node& p = g_.node(g_.parameters()[i]);
      NamedSharding s(mesh_, inputs[i]);
      absl::Status fits = s.validate(p.shape);
      if (!fits.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("jit: input ", i, " ", type_to_string(p.dtype, p.shape), ": ", fits.message()));
      }
      set(g_.parameters()[i], padded(inputs[i], p.shape.size()));
    }
    // shard_map bodies are explicit per-device code: their values are blocks, every device
    // holding its own — to propagation, replicated values of the block's shape, never moved.
    manual_.assign(g_.size(), false);
    for (int id = 0; id < g_.size(); ++id) {
      const Node& n = g_.node(id);
      if (n.sharding.has_value() && n.sharding->mesh() != mesh_) {
        return absl::InvalidArgumentError(absl::StrCat("jit: %", id, " = ", op_name(n.op), " is on ",
                                                       n.sharding->mesh().to_string(), " but the arguments are on ",
                                                       mesh_.to_string()));
      }
      manual_[id] = n.op == Op::kShardMapIn || n.op == Op::kAxisIndex || is_manual_collective(n.op);
      for (int o : n.operands) manual_[id] = manual_[id] || (manual_[o] && n.op != Op::kShardMapOut);
    }
    for (int id = 0; id < g_.size(); ++id) {
      if (g_.node(id).op != Op::kParameter) TESSERA_RETURN_IF_ERROR(forward(id));
    }
    // Values no operand determined (constants, iota) start replicated; the backward pass
    // gives them what their users want.
    for (int id = 0; id < g_.size(); ++id) {
      if (!assigned_[id]) set(id, Dims(g_.node(id).shape.size()));
    }
    backward(outputs);
    return std::move(out_);
  }

 private:
  Dims padded(const PartitionSpec& spec, size_t rank) const {
    Dims d(rank);
    for (int i = 0; i < spec.size() && i < static_cast<int>(rank); ++i) d[i] = spec.axes(i);
    return d;
  }

  void set(int id, Dims dims, std::vector<std::string> partial = {}, ReduceOp op = ReduceOp::kSum) {
    out_.result[id] = ValueSharding{std::move(dims), std::move(partial), op};
    assigned_[id] = true;
  }

  // The operand's sharding as the op sees it: nullopt for a value not decided yet.
  std::optional<ValueSharding> of(int id) const {
    return assigned_[id] ? std::optional<ValueSharding>(out_.result[id]) : std::nullopt;
  }

  // Keeps only axes that are unused so far (in `taken`) and divide `size`.
  Axes usable(const Axes& axes, int64_t size, std::set<std::string>* taken) const {
    Axes out;
    int64_t n = 1;
    for (const std::string& a : axes) {
      if (taken->count(a) > 0 || size % (n * mesh_.axis_size(a)) != 0) break;
      n *= mesh_.axis_size(a);
      out.push_back(a);
    }
    taken->insert(out.begin(), out.end());
    return out;
  }

  absl::Status forward(int id) {
    const Node& n = g_.node(id);
    std::vector<ValueSharding>& req = out_.operands[id];
    const size_t rank = n.shape.size();
    if (n.op == Op::kShardMapIn) {  // the operand in the in_spec's layout, whole: each block
      req = {ValueSharding{padded(n.sharding->spec(), g_.node(n.operands[0]).shape.size()), {}, ReduceOp::kSum}};
      set(id, Dims(rank));
      return absl::OkStatus();
    }
    if (n.op == Op::kShardMapOut) {  // the blocks are the global value's shards
      req = {ValueSharding::replicated(g_.node(n.operands[0]).shape.size())};
      set(id, padded(n.sharding->spec(), rank));
      return absl::OkStatus();
    }
    if (n.op == Op::kShardingAs) {  // the reference's layout, whole; the reference is not moved
      const ValueSharding& like = out_.result[n.operands[1]];
      req = {ValueSharding{like.dims, {}, ReduceOp::kSum}, like};
      set(id, like.dims);
      return absl::OkStatus();
    }
    if (manual_[id]) {
      req.clear();
      for (int o : n.operands) req.push_back(ValueSharding::replicated(g_.node(o).shape.size()));
      set(id, Dims(rank));
      return absl::OkStatus();
    }
    switch (n.op) {
      case Op::kConstant:
      case Op::kIota:
        return absl::OkStatus();  // decided by its users
      case Op::kShardingConstraint: {
        Dims d = padded(n.sharding->spec(), rank);
        req = {ValueSharding{d, {}, ReduceOp::kSum}};
        set(id, d);
        return absl::OkStatus();
      }
      case Op::kBroadcastInDim: {
        std::optional<ValueSharding> a = of(n.operands[0]);
        const Shape& in = g_.node(n.operands[0]).shape;
        ValueSharding q = a.value_or(ValueSharding::replicated(in.size()));
        Dims d(rank);
        for (size_t i = 0; i < in.size(); ++i) {
          if (in[i] != n.shape[n.dims[i]]) q.dims[i].clear();  // a stretched dimension cannot stay split
          d[n.dims[i]] = q.dims[i];
        }
        req = {q};
        set(id, d, q.partial, q.partial_op);
        return absl::OkStatus();
      }
      case Op::kTranspose: {
        ValueSharding q = of(n.operands[0]).value_or(ValueSharding::replicated(rank));
        Dims d;
        for (int64_t p : n.dims) d.push_back(q.dims[p]);
        req = {q};
        set(id, d, q.partial, q.partial_op);
        return absl::OkStatus();
      }
      case Op::kReshape:
        return reshape(id);
      case Op::kSlice:
      case Op::kConcatenate: {
        // Dimensions that are cut (slice) or joined (concatenate) are gathered first.
        ValueSharding q = of(n.operands[0]).value_or(ValueSharding::replicated(rank));
        for (size_t d = 0; d < rank; ++d) {
          const bool whole = n.op == Op::kSlice ? (n.dims[d] == 0 && n.limits[d] == g_.node(n.operands[0]).shape[d])
                                                : static_cast<int64_t>(d) != n.dims[0];
          if (!whole) q.dims[d].clear();
        }
        if (n.op == Op::kConcatenate) q.partial.clear();
        req.assign(n.operands.size(), q);
        set(id, q.dims, q.partial, q.partial_op);
        return absl::OkStatus();
      }
      case Op::kReduceSum:
      case Op::kReduceMax:
      case Op::kReduceMin:
      case Op::kReduceProd: {
        ValueSharding q = of(n.operands[0]).value_or(ValueSharding::replicated(g_.node(n.operands[0]).shape.size()));
        const ReduceOp op = n.op == Op::kReduceSum   ? ReduceOp::kSum
                            : n.op == Op::kReduceMax ? ReduceOp::kMax
                            : n.op == Op::kReduceMin ? ReduceOp::kMin
                                                     : ReduceOp::kProd;
        if (q.is_partial() && !(op == ReduceOp::kSum && q.partial_op == ReduceOp::kSum)) q.partial.clear();
        Dims d;
        std::vector<std::string> partial = q.partial;
        for (size_t i = 0; i < q.dims.size(); ++i) {
          if (std::binary_search(n.dims.begin(), n.dims.end(), static_cast<int64_t>(i))) {
            partial.insert(partial.end(), q.dims[i].begin(), q.dims[i].end());
          } else {
            d.push_back(q.dims[i]);
          }
        }
        req = {q};
        set(id, d, partial, op);
        return absl::OkStatus();
      }
      case Op::kArgmax: {
        ValueSharding q = of(n.operands[0]).value_or(ValueSharding::replicated(g_.node(n.operands[0]).shape.size()));
        q.partial.clear();
        q.dims[n.dims[0]].clear();
        Dims d = q.dims;
        d.erase(d.begin() + n.dims[0]);
        req = {q};
        set(id, d);
        return absl::OkStatus();
      }
      case Op::kDotGeneral:
        return dot(id);
      default:
        return elementwise(id);
    }
  }

  // Unary, binary, compare, select, convert: operands and result share one layout; the result
  // takes each dimension's axes from the first operand that splits it.
  absl::Status elementwise(int id) {
    const Node& n = g_.node(id);
    const size_t rank = n.shape.size();
    std::vector<std::optional<ValueSharding>> in;
    for (int o : n.operands) in.push_back(of(o));
    // A partial sum passes through neg, through add/sub of two equally partial operands, and
    // through mul (or the numerator of div) by a whole operand.
    auto same_partial = [&](size_t i, size_t j) {
      return in[i] && in[j] && in[i]->is_partial() && in[i]->partial == in[j]->partial &&
             in[i]->partial_op == ReduceOp::kSum && in[j]->partial_op == ReduceOp::kSum;
    };
    std::vector<std::string> partial;
    std::vector<bool> keep_partial(in.size(), false);
    if (passes_partial(n) && in[0] && in[0]->partial_op == ReduceOp::kSum) {
      partial = in[0]->partial;
      keep_partial[0] = true;
    } else if ((n.op == Op::kAdd || n.op == Op::kSub) && same_partial(0, 1)) {
      partial = in[0]->partial;
      keep_partial = {true, true};
    } else if (n.op == Op::kMul || n.op == Op::kDiv) {
      // An operand not decided yet (a constant) is whole.
      const bool p0 = in[0] && in[0]->is_partial(), p1 = in[1] && in[1]->is_partial();
      if (p0 && !p1 && in[0]->partial_op == ReduceOp::kSum) {
        partial = in[0]->partial;
        keep_partial[0] = true;
      } else if (n.op == Op::kMul && p1 && !p0 && in[1]->partial_op == ReduceOp::kSum) {
        partial = in[1]->partial;
        keep_partial[1] = true;
      }
    } else if (n.op == Op::kConvert && in[0] && in[0]->partial_op == ReduceOp::kSum && is_floating(n.dtype) &&
               is_floating(g_.node(n.operands[0]).dtype)) {
      partial = in[0]->partial;
      keep_partial[0] = true;
    }
    std::set<std::string> taken(partial.begin(), partial.end());
    Dims d(rank);
    for (size_t dim = 0; dim < rank; ++dim) {
      for (const auto& s : in) {
        if (s && d[dim].empty() && !s->dims[dim].empty()) d[dim] = usable(s->dims[dim], n.shape[dim], &taken);
      }
    }
    auto& req = out_.operands[id];
    req.clear();
    for (size_t i = 0; i < in.size(); ++i) {
      req.push_back(ValueSharding{d, keep_partial[i] ? partial : std::vector<std::string>{}, ReduceOp::kSum});
    }
    set(id, d, partial);
    return absl::OkStatus();
  }

  // dot_general: batch dimensions keep their axes, free dimensions keep their operand's, and
  // contracting dimensions split the same way on both sides leave a partial sum over those axes.
  absl::Status dot(int id) {
    const Node& n = g_.node(id);
    const DotDims& dd = n.dot;
    const Shape& ls = g_.node(n.operands[0]).shape;
    const Shape& rs = g_.node(n.operands[1]).shape;
    ValueSharding l = of(n.operands[0]).value_or(ValueSharding::replicated(ls.size()));
    ValueSharding r = of(n.operands[1]).value_or(ValueSharding::replicated(rs.size()));
    Dims ql(ls.size()), qr(rs.size());
    std::set<std::string> taken;
    std::vector<std::string> partial;
    // Contracting first: they decide the partial axes.
    for (size_t i = 0; i < dd.lhs_contracting.size(); ++i) {
      const int64_t a = dd.lhs_contracting[i], b = dd.rhs_contracting[i];
      Axes axes = usable(!l.dims[a].empty() ? l.dims[a] : r.dims[b], ls[a], &taken);
      ql[a] = qr[b] = axes;
      partial.insert(partial.end(), axes.begin(), axes.end());
    }
    for (size_t i = 0; i < dd.lhs_batch.size(); ++i) {
      const int64_t a = dd.lhs_batch[i], b = dd.rhs_batch[i];
      ql[a] = qr[b] = usable(!l.dims[a].empty() ? l.dims[a] : r.dims[b], ls[a], &taken);
    }
    Dims result;
    for (int64_t a : dd.lhs_batch) result.push_back(ql[a]);
    for (int64_t d : dot_free_dims(static_cast<int64_t>(ls.size()), dd.lhs_batch, dd.lhs_contracting)) {
      result.push_back(ql[d] = usable(l.dims[d], ls[d], &taken));
    }
    for (int64_t d : dot_free_dims(static_cast<int64_t>(rs.size()), dd.rhs_batch, dd.rhs_contracting)) {
      result.push_back(qr[d] = usable(r.dims[d], rs[d], &taken));
    }
    out_.operands[id] = {ValueSharding{ql, {}, ReduceOp::kSum}, ValueSharding{qr, {}, ReduceOp::kSum}};
    set(id, result, partial);
    return absl::OkStatus();
  }

  // reshape: dimensions are matched in groups of equal element count; a group's split moves
  // to the major dimension of its image when the sizes allow, else it is gathered first.
  absl::Status reshape(int id) {
    const Node& n = g_.node(id);
    const Shape& in = g_.node(n.operands[0]).shape;
    const Shape& out = n.shape;
    ValueSharding q = of(n.operands[0]).value_or(ValueSharding::replicated(in.size()));
    Dims d(out.size());
    size_t covered = 0;
    for (const ReshapeGroup& g : reshape_groups(in, out)) {
      // Only the group's major input dimension may stay split, onto the major output one.
      for (size_t k = g.i + 1; k < g.i2; ++k) q.dims[k].clear();
      if (!q.dims[g.i].empty() && out[g.o] % mesh_.axes_size(q.dims[g.i]) == 0 &&
          (g.i2 == g.i + 1 || in[g.i] == out[g.o] || out[g.o] % in[g.i] == 0)) {
        d[g.o] = q.dims[g.i];
      } else {
        q.dims[g.i].clear();
      }
      covered = g.i2;
    }
    for (size_t i = covered; i < in.size(); ++i) q.dims[i].clear();
    out_.operands[id] = {q};
    set(id, d, q.partial, q.partial_op);
    return absl::OkStatus();
  }

  // ---- Backward pass -------------------------------------------------------------------
  //
  // The forward pass decides every value from its operands alone. The backward pass visits
  // the nodes from the last to the first and lets each one that the user did not pin
  // (parameters, with_sharding_constraint) move to a layout its users want, when that makes
  // the program move fewer bytes: a reshard wanted after an op is pulled in front of it when
  // it is cheaper there (a local slice of a replicated operand instead of a gather of the
  // result, a gather of a small operand instead of a large result) — GSPMD's backward
  // propagation, with conflicts settled by an estimate of the bytes each choice moves.

  // How a node's operands follow its result: operand k's dimension d follows result dimension
  // follow[k][d] (-1: it does not, and keeps what the forward pass asked of it). Only the
  // result dimensions in `free` may change.
  struct DimMap {
    std::vector<std::vector<int>> follow;
    std::vector<bool> free;
  };

  DimMap dim_map(const Node& n) const {
    const size_t rank = n.shape.size();
    DimMap m{std::vector<std::vector<int>>(n.operands.size()), std::vector<bool>(rank, true)};
    auto identity = [&](size_t k) {
      m.follow[k].resize(rank);
      for (size_t d = 0; d < rank; ++d) m.follow[k][d] = static_cast<int>(d);
    };
    switch (n.op) {
      case Op::kConstant:
      case Op::kIota:
        break;
      case Op::kBroadcastInDim: {
        const Shape& in = g_.node(n.operands[0]).shape;
        for (size_t i = 0; i < in.size(); ++i) {
          m.follow[0].push_back(in[i] == n.shape[n.dims[i]] ? static_cast<int>(n.dims[i]) : -1);
        }
        break;
      }
      case Op::kTranspose:
        m.follow[0].assign(rank, -1);
        for (size_t i = 0; i < rank; ++i) m.follow[0][n.dims[i]] = static_cast<int>(i);
        break;
      case Op::kReshape: {
        // Only dimensions that reshape leaves alone (a group of one on both sides) follow.
        const Shape& in = g_.node(n.operands[0]).shape;
        m.follow[0].assign(in.size(), -1);
        m.free.assign(rank, false);
        for (const ReshapeGroup& g : reshape_groups(in, n.shape)) {
          if (g.i2 == g.i + 1 && g.o2 == g.o + 1 && g.exact) {
            m.follow[0][g.i] = static_cast<int>(g.o);
            m.free[g.o] = true;
          }
        }
        break;
      }
      case Op::kSlice:
      case Op::kConcatenate:
        for (size_t k = 0; k < n.operands.size(); ++k) identity(k);
        for (size_t d = 0; d < rank; ++d) {
          const bool cut = n.op == Op::kSlice ? (n.dims[d] != 0 || n.limits[d] != g_.node(n.operands[0]).shape[d])
                                              : static_cast<int64_t>(d) == n.dims[0];
          if (!cut) continue;
          m.free[d] = false;
          for (auto& f : m.follow) f[d] = -1;
        }
        break;
      case Op::kReduceSum:
      case Op::kReduceMax:
      case Op::kReduceMin:
      case Op::kReduceProd:
      case Op::kArgmax: {
        int r = 0;
        for (size_t d = 0; d < g_.node(n.operands[0]).shape.size(); ++d) {
          const bool reduced = std::binary_search(n.dims.begin(), n.dims.end(), static_cast<int64_t>(d));
          m.follow[0].push_back(reduced ? -1 : r++);
        }
        break;
      }
      case Op::kDotGeneral: {
        const DotDims& dd = n.dot;
        m.follow[0].assign(g_.node(n.operands[0]).shape.size(), -1);
        m.follow[1].assign(g_.node(n.operands[1]).shape.size(), -1);
        int r = 0;
        for (size_t i = 0; i < dd.lhs_batch.size(); ++i, ++r) {
          m.follow[0][dd.lhs_batch[i]] = m.follow[1][dd.rhs_batch[i]] = r;
        }
        for (int64_t d : dot_free_dims(static_cast<int64_t>(m.follow[0].size()), dd.lhs_batch, dd.lhs_contracting)) {
          m.follow[0][d] = r++;
        }
        for (int64_t d : dot_free_dims(static_cast<int64_t>(m.follow[1].size()), dd.rhs_batch, dd.rhs_contracting)) {
          m.follow[1][d] = r++;
        }
        break;
      }
      default:  // elementwise
        for (size_t k = 0; k < n.operands.size(); ++k) identity(k);
        break;
    }
    return m;
  }

  struct Choice {
    ValueSharding result;
    std::vector<ValueSharding> operands;
  };

  // Whether `s` is a layout of `shape`: each axis of the mesh used once (dimensions and
  // pending reduction together) and every split dividing its dimension.
  bool fits(const ValueSharding& s, const Shape& shape) const {
    std::set<std::string> used(s.partial.begin(), s.partial.end());
    if (used.size() != s.partial.size()) return false;
    for (size_t d = 0; d < s.dims.size(); ++d) {
      for (const std::string& a : s.dims[d]) {
        if (!used.insert(a).second) return false;
      }
      if (shape[d] % mesh_.axes_size(s.dims[d]) != 0) return false;
    }
    return true;
  }

  // Node `id` with result dimensions `dims` (on its free dimensions; the others stay): what it
  // then needs of its operands, or nullopt when that is no layout. Dimensions that do not
  // follow the result (contracted, reduced) keep what the forward pass asked: a contraction
  // over a split dimension stays a partial sum, as in GSPMD.
  std::optional<Choice> choice(int id, const DimMap& m, const Dims& dims) const {
    const Node& n = g_.node(id);
    Choice c{out_.result[id], out_.operands[id]};
    for (size_t d = 0; d < dims.size(); ++d) {
      if (m.free[d]) c.result.dims[d] = dims[d];
    }
    if (!fits(c.result, n.shape)) return std::nullopt;
    for (size_t k = 0; k < n.operands.size(); ++k) {
      ValueSharding& q = c.operands[k];
      for (size_t d = 0; d < q.dims.size(); ++d) {
        if (m.follow[k][d] >= 0) q.dims[d] = c.result.dims[m.follow[k][d]];
      }
      if (!fits(q, g_.node(n.operands[k]).shape)) return std::nullopt;
    }
    return c;
  }

  // Estimated bytes one device moves to take a value from `from` to `to`; each collective also
  // costs a fixed latency, counted as kLatencyBytes.
  double reshard_cost(const ValueSharding& from, const ValueSharding& to, const Node& value) const {
    static constexpr double kLatencyBytes = 64 * 1024;
    if (from == to) return 0;
    absl::StatusOr<std::vector<ReshardStep>> steps = plan_reshard(from, to, value.shape, mesh_);
    if (!steps.ok()) return std::numeric_limits<double>::infinity();
    auto local_bytes = [&](const ValueSharding& s) {
      return static_cast<double>(num_elements(NamedSharding(mesh_, s.spec()).shard_shape(value.shape))) *
             dtype_size(value.dtype);
    };
    double cost = 0;
    ValueSharding before = from;
    for (const ReshardStep& step : *steps) {
      const double n = static_cast<double>(mesh_.axes_size(step.axes));
      const double share = (n - 1) / n;
      switch (step.kind) {
        case ReshardStep::Kind::kAllReduce:
          cost += 2 * share * local_bytes(before) + kLatencyBytes;
          break;
        case ReshardStep::Kind::kReduceScatter:
        case ReshardStep::Kind::kAllToAll:
          cost += share * local_bytes(before) + kLatencyBytes;
          break;
        case ReshardStep::Kind::kAllGather:
          cost += share * local_bytes(step.after) + kLatencyBytes;
          break;
        case ReshardStep::Kind::kCollectivePermute:
          cost += local_bytes(before) + kLatencyBytes;
          break;
        case ReshardStep::Kind::kLocalSlice:
          break;
      }
      before = step.after;
    }
    return cost;
  }

  // Values whose layout the user fixed: parameters, constraints, shard_map boundaries and
  // bodies.
  bool pinned(int id) const {
    const Op op = g_.node(id).op;
    return op == Op::kParameter || op == Op::kShardingConstraint || op == Op::kShardMapOut || op == Op::kShardingAs ||
           manual_[id];
  }

  // What it costs to have value `id` in layout `want`: resharding it as it is, or — when this
  // is its only use and the user did not pin it — computing it in that layout, looking up to
  // `depth` producers further back. This lets a reshard travel past several ops whose own
  // input and output are equally large (exp after a broadcast) to where it is cheapest.
  double supply_cost(int id, const ValueSharding& want, const std::vector<std::vector<std::pair<int, int>>>& uses,
                     int depth) const {
    const Node& n = g_.node(id);
    const double direct = reshard_cost(out_.result[id], want, n);
    if (direct == 0 || depth == 0 || pinned(id) || uses[id].size() != 1 || is_output_[id] ||
        want.partial != out_.result[id].partial) {
      return direct;
    }
    std::optional<Choice> c = choice(id, dim_map(n), want.dims);
    if (!c || c->result != want) return direct;
    double cost = 0;
    for (size_t k = 0; k < n.operands.size() && cost < direct; ++k) {
      cost += supply_cost(n.operands[k], c->operands[k], uses, depth - 1);
    }
    return std::min(direct, cost);
  }

  void backward(const std::vector<std::optional<PartitionSpec>>& outputs) {
    is_output_.assign(g_.size(), false);
    for (int o : g_.outputs()) is_output_[o] = true;
    // What each value's consumers need of it: (user node, operand index), and output specs.
    std::vector<std::vector<std::pair<int, int>>> uses(g_.size());
    for (int id = 0; id < g_.size(); ++id) {
      const Node& n = g_.node(id);
      for (size_t k = 0; k < n.operands.size(); ++k) uses[n.operands[k]].emplace_back(id, static_cast<int>(k));
    }
    std::vector<std::vector<ValueSharding>> wanted_out(g_.size());
    for (size_t i = 0; i < outputs.size(); ++i) {
      const int o = g_.outputs()[i];
      if (outputs[i].has_value()) {
        wanted_out[o].push_back(ValueSharding{padded(*outputs[i], g_.node(o).shape.size()), {}, ReduceOp::kSum});
      } else {
        // No spec: whatever layout it has, made whole (dims left empty to say so; for a
        // scalar the two are the same).
        wanted_out[o].push_back(ValueSharding{});
      }
    }
    for (int id = g_.size() - 1; id >= 0; --id) {
      const Node& n = g_.node(id);
      if (pinned(id)) continue;
      std::vector<ValueSharding> wants;
      for (const auto& [user, k] : uses[id]) wants.push_back(out_.operands[user][k]);
      for (const ValueSharding& w : wanted_out[id]) wants.push_back(w);
      if (wants.empty()) continue;
      const DimMap m = dim_map(n);
      // Candidate result layouts: as it is; each consumer's wish, taken whole or only on
      // dimensions the value does not split yet; each operand's layout carried through. Each
      // once: a repeat would cost the same and lose the tie to its first occurrence.
      std::vector<Dims> candidates = {out_.result[id].dims};
      auto candidate = [&candidates](Dims dims) {
        if (!absl::c_linear_search(candidates, dims)) candidates.push_back(std::move(dims));
      };
      for (const ValueSharding& w : wants) {
        if (w.dims.empty()) continue;
        candidate(w.dims);
        Dims refined = out_.result[id].dims;
        for (size_t d = 0; d < refined.size(); ++d) {
          if (refined[d].empty()) refined[d] = w.dims[d];
        }
        candidate(std::move(refined));
      }
      for (size_t k = 0; k < n.operands.size(); ++k) {
        Dims carried = out_.result[id].dims;
        const ValueSharding& have = out_.result[n.operands[k]];
        for (size_t d = 0; d < have.dims.size(); ++d) {
          if (m.follow[k][d] >= 0) carried[m.follow[k][d]] = have.dims[d];
        }
        candidate(std::move(carried));
      }
      // The cheapest; among equals the one holding the fewest elements per device, then the
      // earliest (the forward pass's layout first).
      std::optional<Choice> best;
      double best_cost = 0;
      int64_t best_local = 0;
      for (const Dims& dims : candidates) {
        std::optional<Choice> c = choice(id, m, dims);
        if (!c) continue;
        double cost = 0;
        for (size_t k = 0; k < n.operands.size(); ++k) cost += supply_cost(n.operands[k], c->operands[k], uses, 4);
        for (const ValueSharding& w : wants) {
          ValueSharding target = w;
          if (target.dims.empty()) {  // an output with no spec: its layout, made whole
            target = c->result;
            target.partial.clear();
          }
          cost += reshard_cost(c->result, target, n);
        }
        const int64_t local = num_elements(NamedSharding(mesh_, c->result.spec()).shard_shape(n.shape));
        if (!best || cost < best_cost || (cost == best_cost && local < best_local)) {
          best = std::move(c);
          best_cost = cost;
          best_local = local;
        }
      }
      if (best) {
        out_.result[id] = std::move(best->result);
        out_.operands[id] = std::move(best->operands);
      }
    }
  }

  const Graph& g_;
  const Mesh& mesh_;
  std::vector<bool> assigned_;
  std::vector<bool> is_output_;
  std::vector<bool> manual_;  // in a shard_map body
  Propagation out_;
};

}  // namespace

std::string ValueSharding::to_string() const {
  std::string s = spec().to_string();
  if (is_partial()) {
    absl::StrAppend(
        &s, " partial(", reduce_op_name(partial_op), " over ",
        absl::StrJoin(partial, ", ", [](std::string* o, const std::string& a) { absl::StrAppend(o, "'", a, "'"); }),
        ")");
  }
  return s;
}

absl::StatusOr<Propagation> propagate(const Graph& graph, const Mesh& mesh, const std::vector<PartitionSpec>& inputs,
                                      const std::vector<std::optional<PartitionSpec>>& outputs) {
  if (outputs.size() != graph.outputs().size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("jit: ", graph.outputs().size(), " outputs but ", outputs.size(), " output shardings"));
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!outputs[i].has_value()) continue;
    const Node& o = graph.node(graph.outputs()[i]);
    absl::Status fits = NamedSharding(mesh, *outputs[i]).validate(o.shape);
    if (!fits.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("jit: output ", i, " ", type_to_string(o.dtype, o.shape), ": ", fits.message()));
    }
  }
  return Propagator(graph, mesh).run(inputs, outputs);
}

}  // namespace tessera
