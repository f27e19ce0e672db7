// VJP rules: how grad (client/grad.cc) takes a cotangent back through one op, registered per
// op family, each family in its own file of this folder. Internal to the client library.
//
// A rule sees the node, its operands and result as Values of the trace, and the result's
// cotangent; it adds each operand's cotangent with `add` (cotangents of non-float operands
// are dropped by grad). Ops whose OpDef has kNoGradient have no rule, on purpose.
//
//   {Op::kExp, [](const VjpArgs& a) { a.add(0, a.g * a.out); return absl::OkStatus(); }},
#ifndef TESSERA_CLIENT_VJP_VJP_H_
#define TESSERA_CLIENT_VJP_VJP_H_

#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "client/trace_state.h"
#include "core/graph.h"
#include "tessera/trace.h"

namespace tessera::internal {

struct VjpArgs {
  const Node& node;             // a copy's reference: rules add nodes to the graph
  const std::vector<Value>& x;  // the operands
  const Value& out;             // the result
  const Value& g;               // the result's cotangent
  TraceState* trace;
  const std::function<void(size_t operand, const Value& cotangent)>& add;
  // Takes (and removes) the cotangent accumulated so far for another node of the trace,
  // invalid if none: how a rule for an op of several nodes (a scan's results) gathers the
  // cotangents of its other nodes, whose consumers all come after them.
  const std::function<Value(int node)>& take_cotangent;
  // Whether operand k's cotangent is wanted (it depends on a value grad differentiates), as JAX
  // transposes into undefined primals only (ad.is_undefined_primal): a rule may skip building
  // an unwanted one that could not be typed (dynamic_update_slice's update, indexing.cc).
  const std::function<bool(size_t operand)>& wants;
};

// OK, or INVALID_ARGUMENT for a case the rule does not differentiate (grad fails with it).
using VjpRule = absl::Status (*)(const VjpArgs& args);
struct VjpEntry {
  Op op;
  VjpRule rule;
};

absl::Span<const VjpEntry> elementwise_vjps();  // elementwise.cc
absl::Span<const VjpEntry> layout_vjps();       // layout.cc: layout ops and sharding_constraint
absl::Span<const VjpEntry> reduction_vjps();    // reduction.cc
absl::Span<const VjpEntry> dot_vjps();          // dot.cc
absl::Span<const VjpEntry> indexing_vjps();     // indexing.cc
absl::Span<const VjpEntry> shard_map_vjps();    // shard_map.cc: shard_map boundaries, collectives
absl::Span<const VjpEntry> control_vjps();      // control.cc: scan

// The rule registered for `op`, or null.
VjpRule find_vjp(Op op);

// The cotangents of `primals` (distinct Values of one trace) for f's results given theirs
// (`cotangents`, one per result; an invalid Value or a non-float result: none): f is recorded
// on the primals, then its VJP. Zeros for a primal nothing reaches; invalid Values, with the
// error kept by the trace, when f or a rule fails.
std::vector<Value> vjp(const TracedFunction& f, const std::vector<Value>& primals,
                       const std::vector<Value>& cotangents);

// A zero array of x's dtype and shape.
inline Value zeros_like(const Value& x) { return full(x.shape(), 0.0, x.dtype()); }

}  // namespace tessera::internal

#endif  // TESSERA_CLIENT_VJP_VJP_H_
