#include "coordinator/compiler/reshard.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/sharding.h"
#include "core/status.h"

namespace tessera {
namespace {

// The dimension holding `axis`, or -1.
int dim_of(const ValueSharding& s, const std::string& axis) {
  for (size_t d = 0; d < s.dims.size(); ++d) {
    if (std::find(s.dims[d].begin(), s.dims[d].end(), axis) != s.dims[d].end()) return static_cast<int>(d);
  }
  return -1;
}

absl::Status check_fits(const ValueSharding& s, const Shape& shape, const Mesh& mesh, const char* which) {
  if (s.dims.size() != shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat("reshard: the ", which, " sharding has ", s.dims.size(),
                                                   " dimensions for a value of shape ", shape_to_string(shape)));
  }
  return NamedSharding(mesh, s.spec()).validate(shape);
}

}  // namespace

// Splitting a dimension over one device, or reducing over one, is the identity, so `s` and
// the result lay out the same blocks.
ValueSharding without_unit_axes(ValueSharding s, const Mesh& mesh) {
  auto unit = [&](const std::string& a) {
    const int i = mesh.axis_index(a);
    return i >= 0 && mesh.shape()[i] == 1;
  };
  for (Axes& axes : s.dims) axes.erase(std::remove_if(axes.begin(), axes.end(), unit), axes.end());
  s.partial.erase(std::remove_if(s.partial.begin(), s.partial.end(), unit), s.partial.end());
  return s;
}

std::string ReshardStep::to_string() const {
  switch (kind) {
    case Kind::kAllReduce:
      return absl::StrCat("all_reduce(", reduce_op_name(reduce_op), ", axes=", axes_to_string(axes), ")");
    case Kind::kReduceScatter:
      return absl::StrCat("reduce_scatter(", reduce_op_name(reduce_op), ", dim=", dim, ", axes=", axes_to_string(axes),
                          ")");
    case Kind::kAllGather:
      return absl::StrCat("all_gather(dim=", dim, ", axes=", axes_to_string(axes), ")");
    case Kind::kAllToAll:
      return absl::StrCat("all_to_all(split=", split_dim, ", concat=", concat_dim, ", axes=", axes_to_string(axes),
                          ")");
    case Kind::kLocalSlice:
      return absl::StrCat("local_slice(dim=", dim, ", axes=", axes_to_string(axes), ")");
    case Kind::kCollectivePermute:
      return absl::StrCat("collective_permute(axes=", axes_to_string(axes), ")");
    case Kind::kUnreduce:
      return absl::StrCat("unreduce(axes=", axes_to_string(axes), ")");
  }
  return "unknown";
}

namespace {

absl::StatusOr<std::vector<ReshardStep>> plan_without_unit_axes(const ValueSharding& from, const ValueSharding& to,
                                                                const Shape& shape, const Mesh& mesh) {
  // A whole value made a sum pending over new axes (explicit mode's reshard onto unreduced axes,
  // a reduced value's cotangent): a sum pending over other axes runs first; then the layout,
  // keeping a dimension's trailing split over new pending axes (its blocks are zero-padded in
  // place), then the local kUnreduce.
  if (to.is_partial() && !same_axes(to.partial, from.partial) && to.partial_op == ReduceOp::kSum) {
    for (const std::string& a : to.partial) {
      if (dim_of(to, a) >= 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("reshard: the target ", to.to_string(), " splits a dimension over pending axis '", a, "'"));
      }
    }
    const ValueSharding whole{from.dims, {}, ReduceOp::kSum};
    std::vector<ReshardStep> steps;
    if (from.is_partial()) {
      absl::StatusOr<std::vector<ReshardStep>> sum = plan_without_unit_axes(from, whole, shape, mesh);
      if (!sum.ok()) return sum;
      steps = *std::move(sum);
    }
    ValueSharding mid = ValueSharding::replicated(to.dims.size());
    for (size_t d = 0; d < to.dims.size(); ++d) {
      const Axes &have = whole.dims[d], &want = to.dims[d];
      const bool padded = have.size() > want.size() && std::equal(want.begin(), want.end(), have.begin()) &&
                          std::all_of(have.begin() + want.size(), have.end(), [&](const std::string& a) {
                            return std::find(to.partial.begin(), to.partial.end(), a) != to.partial.end();
                          });
      mid.dims[d] = padded ? have : want;
    }
    absl::StatusOr<std::vector<ReshardStep>> layout = plan_without_unit_axes(whole, mid, shape, mesh);
    if (!layout.ok()) return layout;
    steps.insert(steps.end(), layout->begin(), layout->end());
    steps.push_back(ReshardStep{ReshardStep::Kind::kUnreduce, to.partial, ReduceOp::kSum, 0, 0, 0, to});
    return steps;
  }
  // A partial target is an operand of an op linear in it (slice, add of two partial values...)
  // that needs another layout but not the sum yet: the pending reduction is kept as it is, and
  // the moves below only move blocks (gather, all_to_all, slice, permute), which commute with
  // it. It must be the source's own pending reduction, over axes no dimension is split by.
  if (to.is_partial()) {
    if (!same_axes(to.partial, from.partial) || to.partial_op != from.partial_op) {
      return absl::InvalidArgumentError(absl::StrCat("reshard: the target ", to.to_string(),
                                                     " is partial but not pending what the source ", from.to_string(),
                                                     " is"));
    }
    for (const std::string& a : to.partial) {
      if (dim_of(to, a) >= 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("reshard: the target ", to.to_string(), " splits a dimension over pending axis '", a, "'"));
      }
    }
  }
  std::vector<ReshardStep> steps;
  ValueSharding cur = from;
  auto push = [&](ReshardStep step) {
    step.after = cur;
    steps.push_back(std::move(step));
  };
  // A gather (or local slice) of a dimension right after another of the same dimension is one
  // over both steps' axes: a dimension split over ('data', 'model') is gathered by one
  // all_gather over both (its replica groups order devices major-to-minor, as the dimension's
  // blocks are), not one per axis. The gathered axis is major to those gathered before it (they
  // leave minor-most first); a sliced one is minor to those sliced before it.
  auto push_merged = [&](ReshardStep step) {
    if (steps.empty() || steps.back().kind != step.kind || steps.back().dim != step.dim) {
      push(std::move(step));
      return;
    }
    ReshardStep& last = steps.back();
    last.axes.insert(step.kind == ReshardStep::Kind::kAllGather ? last.axes.begin() : last.axes.end(),
                     step.axes.begin(), step.axes.end());
    last.after = cur;
  };

  // 1. Resolve a pending reduction: scatter it straight onto a dimension the target splits
  //    over exactly those axes (minor-most, currently unsplit), else all_reduce it.
  if (cur.is_partial() && !to.is_partial()) {
    std::vector<std::string> pending = cur.partial;
    for (size_t d = 0; d < to.dims.size() && !pending.empty(); ++d) {
      if (!cur.dims[d].empty() || to.dims[d].empty()) continue;
      const Axes& want = to.dims[d];
      if (std::all_of(want.begin(), want.end(), [&](const std::string& a) {
            return std::find(pending.begin(), pending.end(), a) != pending.end();
          })) {
        cur.dims[d] = want;
        for (const std::string& a : want) pending.erase(std::find(pending.begin(), pending.end(), a));
        cur.partial = pending;
        push({ReshardStep::Kind::kReduceScatter, want, from.partial_op, static_cast<int>(d), 0, 0, {}});
      }
    }
    if (!pending.empty()) {
      cur.partial.clear();
      push({ReshardStep::Kind::kAllReduce, pending, from.partial_op, 0, 0, 0, {}});
    }
    cur.partial.clear();
  }

  // 2. The same axes on every dimension in another order: only the devices' blocks are
  //    swapped around, one collective_permute.
  bool reordered = false, same_sets = true;
  std::vector<std::string> moved;
  for (size_t d = 0; d < cur.dims.size(); ++d) {
    Axes a = cur.dims[d], b = to.dims[d];
    if (a != b) {
      reordered = true;
      moved.insert(moved.end(), a.begin(), a.end());
    }
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    same_sets = same_sets && a == b;
  }
  if (reordered && same_sets) {
    cur.dims = to.dims;
    push({ReshardStep::Kind::kCollectivePermute, moved, ReduceOp::kSum, 0, 0, 0, {}});
    return steps;
  }

  // 3. Axes that are in the wrong place leave it: minor-most first, each step removing the
  //    last axis of a dimension. An axis the target wants on another (so far unsplit-by-it)
  //    dimension moves there with all_to_all (a run of axes it wants in that order, in one);
  //    otherwise it is gathered, with the axes of the same dimension gathered next (one
  //    all_gather).
  bool changed = true;
  while (changed) {
    changed = false;
    for (size_t d = 0; d < cur.dims.size(); ++d) {
      bool gathered = true;
      while (gathered && !cur.dims[d].empty()) {
        // The current axes of d are right if they are a prefix of the target's.
        const Axes& have = cur.dims[d];
        const Axes& want = to.dims[d];
        if (have.size() <= want.size() && std::equal(have.begin(), have.end(), want.begin())) break;
        // A minor run of two or more of d's axes that another dimension wants next, in the same
        // order, moves there in one all_to_all over them (its groups order devices as both
        // dimensions' blocks are): ('data', 'model') from rows to columns is one collective,
        // not a gather, an all_to_all and a slice.
        bool moved_run = false;
        for (size_t len = have.size(); len >= 2 && !moved_run; --len) {
          const Axes run(have.end() - static_cast<std::ptrdiff_t>(len), have.end());
          const int t = dim_of(to, run[0]);
          if (t < 0 || t == static_cast<int>(d)) continue;
          const Axes& now = cur.dims[t];
          const Axes& next = to.dims[t];
          if (now.size() + len > next.size() || !std::equal(now.begin(), now.end(), next.begin()) ||
              !std::equal(run.begin(), run.end(), next.begin() + static_cast<std::ptrdiff_t>(now.size())) ||
              shape[t] % (mesh.axes_size(now) * mesh.axes_size(run)) != 0) {
            continue;
          }
          cur.dims[d].resize(cur.dims[d].size() - len);
          cur.dims[t].insert(cur.dims[t].end(), run.begin(), run.end());
          push({ReshardStep::Kind::kAllToAll, run, ReduceOp::kSum, 0, t, static_cast<int>(d), {}});
          moved_run = true;
        }
        if (moved_run) {
          changed = true;
          break;
        }
        const std::string axis = have.back();
        const int target = dim_of(to, axis);
        const bool movable =
            target >= 0 && target != static_cast<int>(d) &&
            std::equal(cur.dims[target].begin(), cur.dims[target].end(), to.dims[target].begin(),
                       to.dims[target].begin() + std::min(cur.dims[target].size(), to.dims[target].size())) &&
            cur.dims[target].size() < to.dims[target].size() && to.dims[target][cur.dims[target].size()] == axis &&
            shape[target] % (mesh.axes_size(cur.dims[target]) * mesh.axis_size(axis)) == 0;
        cur.dims[d].pop_back();
        gathered = !movable;
        if (movable) {
          cur.dims[target].push_back(axis);
          push({ReshardStep::Kind::kAllToAll, {axis}, ReduceOp::kSum, 0, target, static_cast<int>(d), {}});
        } else {
          push_merged({ReshardStep::Kind::kAllGather, {axis}, ReduceOp::kSum, static_cast<int>(d), 0, 0, {}});
        }
        changed = true;
      }
    }
  }

  // 4. What is still missing is added by slicing locally: free.
  for (size_t d = 0; d < to.dims.size(); ++d) {
    while (cur.dims[d].size() < to.dims[d].size()) {
      const std::string axis = to.dims[d][cur.dims[d].size()];
      cur.dims[d].push_back(axis);
      push_merged({ReshardStep::Kind::kLocalSlice, {axis}, ReduceOp::kSum, static_cast<int>(d), 0, 0, {}});
    }
  }
  return steps;
}

}  // namespace

absl::StatusOr<std::vector<ReshardStep>> plan_reshard(const ValueSharding& from, const ValueSharding& to,
                                                      const Shape& shape, const Mesh& mesh) {
  TESSERA_RETURN_IF_ERROR(check_fits(from, shape, mesh, "source"));
  TESSERA_RETURN_IF_ERROR(check_fits(to, shape, mesh, "target"));
  // Axes of size 1 move nothing: plan between the shardings without them (none when that is
  // all they differ in), and end on `to` itself.
  absl::StatusOr<std::vector<ReshardStep>> steps =
      plan_without_unit_axes(without_unit_axes(from, mesh), without_unit_axes(to, mesh), shape, mesh);
  if (steps.ok() && !steps->empty()) steps->back().after = to;
  return steps;
}

}  // namespace tessera
