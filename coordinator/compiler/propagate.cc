#include "coordinator/compiler/propagate.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/sharding.h"
#include "core/status.h"

namespace tessera {
namespace {

using Dims = std::vector<Axes>;

int64_t axes_size(const Axes& axes, const Mesh& mesh) {
  int64_t n = 1;
  for (const std::string& a : axes) n *= mesh.axis_size(a);
  return n;
}

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

class Propagator {
 public:
  Propagator(const Graph& g, const Mesh& mesh) : g_(g), mesh_(mesh), assigned_(g.size(), false) {
    out_.result.resize(g.size());
    out_.operands.resize(g.size());
  }

  absl::StatusOr<Propagation> run(const std::vector<PartitionSpec>& inputs) {
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
    for (int id = 0; id < g_.size(); ++id) {
      if (g_.node(id).op != Op::kParameter) TESSERA_RETURN_IF_ERROR(forward(id));
    }
    // Values no operand determined (constants, iota) take what their first user asked of
    // them, else stay replicated; requirements on them already match.
    for (int id = 0; id < g_.size(); ++id) {
      if (assigned_[id]) continue;
      out_.result[id] = ValueSharding::replicated(g_.node(id).shape.size());
      for (int user = id + 1; user < g_.size() && !assigned_[id]; ++user) {
        const Node& u = g_.node(user);
        for (size_t k = 0; k < u.operands.size(); ++k) {
          if (u.operands[k] == id) {
            out_.result[id] = out_.operands[user][k];
            assigned_[id] = true;
            break;
          }
        }
      }
    }
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
    } else if (n.op == Op::kConvert && in[0] && in[0]->partial_op == ReduceOp::kSum &&
               (n.dtype == DType::kF32 || n.dtype == DType::kF64) &&
               (g_.node(n.operands[0]).dtype == DType::kF32 || g_.node(n.operands[0]).dtype == DType::kF64)) {
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
    auto is_free = [](const std::vector<int64_t>& batch, const std::vector<int64_t>& contracting, size_t d) {
      return std::find(batch.begin(), batch.end(), static_cast<int64_t>(d)) == batch.end() &&
             std::find(contracting.begin(), contracting.end(), static_cast<int64_t>(d)) == contracting.end();
    };
    Dims result;
    for (int64_t a : dd.lhs_batch) result.push_back(ql[a]);
    for (size_t d = 0; d < ls.size(); ++d) {
      if (is_free(dd.lhs_batch, dd.lhs_contracting, d)) result.push_back(ql[d] = usable(l.dims[d], ls[d], &taken));
    }
    for (size_t d = 0; d < rs.size(); ++d) {
      if (is_free(dd.rhs_batch, dd.rhs_contracting, d)) result.push_back(qr[d] = usable(r.dims[d], rs[d], &taken));
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
    size_t i = 0, o = 0;
    while (i < in.size() && o < out.size()) {
      // Grow [i, i2) and [o, o2) until their products match.
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
      // Only the group's major input dimension may stay split, onto the major output one.
      for (size_t k = i + 1; k < i2; ++k) q.dims[k].clear();
      if (!q.dims[i].empty() && out[o] % axes_size(q.dims[i], mesh_) == 0 &&
          (i2 == i + 1 || in[i] == out[o] || out[o] % in[i] == 0)) {
        d[o] = q.dims[i];
      } else {
        q.dims[i].clear();
      }
      i = i2;
      o = o2;
    }
    for (; i < in.size(); ++i) q.dims[i].clear();
    out_.operands[id] = {q};
    set(id, d, q.partial, q.partial_op);
    return absl::OkStatus();
  }

  const Graph& g_;
  const Mesh& mesh_;
  std::vector<bool> assigned_;
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
  return Propagator(graph, mesh).run(inputs);
}

}  // namespace tessera
