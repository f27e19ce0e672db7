// VJPs of the indexing ops: a gather's cotangent is scattered back (added, where indices
// repeat), a scatter's is gathered, each with the forward op's batch_dims; the dynamic window
// ops move the cotangent back through the same clamped window. Index operands are integers and
// get no cotangent.
#include <optional>

#include "absl/status/status.h"
#include "client/vjp/vjp.h"

namespace tessera::internal {
namespace {

// The cotangent rows at a scatter's indices: what each update contributed (0 for a dropped one).
Value gathered(const VjpArgs& a, const Value& g) {
  GatherAttrs attrs = a.node.attrs<GatherAttrs>();
  if (attrs.mode == IndexMode::kFillOrDrop) attrs.fill_value = Scalar(0);
  return gather(g, a.x[1], attrs);
}

// The node's attributes for its transpose: the same axis, mode and batch dimensions, no fill.
GatherAttrs transposed(const VjpArgs& a) {
  GatherAttrs attrs = a.node.attrs<GatherAttrs>();
  attrs.fill_value.reset();
  return attrs;
}

}  // namespace

absl::Span<const VjpEntry> indexing_vjps() {
  static const VjpEntry kRules[] = {
      // An index out of range in fill mode read nothing: its cotangent is dropped. In explicit
      // mode the scatter runs with the Explicit axes as Auto and is laid out as the table (JAX's
      // _gather_transpose_fancy: zeros with operand's sharding; under auto_axes when the gather
      // was, as take's out_sharding makes it), since indices split as the cotangent is would
      // make the explicit scatter ambiguous.
      // An unreduced cotangent (that of a gather from a reduced table) is added into zeros
      // typed as the table's cotangent, unreduced alike (JAX's _gather_transpose_fancy: zeros
      // of the cotangent accumulator's sharding; _scatter_unreduced_rule), each device adding
      // its term, and the result is laid out unreduced: no sum runs (tests/pjit_test.py,
      // test_gather_reduced_fwd_unreduced_bwd). The zeros are typed outside auto_axes, whose
      // Auto axes could not carry their unreduced type.
      {Op::kGather,
       [](const VjpArgs& a) {
         const std::optional<TypedOperand> g = typed_operand(a.g);
         const Value zeros = g.has_value() && !g->unreduced.empty()
                                 ? typed_as(a.x[0], [&] { return zeros_like(a.x[0]); })
                                 : zeros_like(a.x[0]);
         a.add(0, auto_typed_as(a.x[0], [&] { return scatter_add(zeros, a.x[1], a.g, transposed(a)); }));
         return absl::OkStatus();
       }},
      // A scatter's cotangents are gathered / scattered as its forward ran: in explicit mode with
      // the Explicit axes as Auto, laid out as the primal's cotangent (auto_typed_as), so those
      // of an .at[].set / add(out_sharding=) that ran under auto_axes with split indices are no
      // error, and the (reduced, typed replicated) cotangent of unreduced updates is not summed
      // again. The updates' cotangent is built only when wanted (a constant update's gather is not).
      {Op::kScatterAdd,
       [](const VjpArgs& a) {
         a.add(0, a.g);
         if (a.wants(2)) a.add(2, auto_typed_as(a.x[2], [&] { return gathered(a, a.g); }));
         return absl::OkStatus();
       }},
      // Overwritten elements of x get no cotangent; each update gets its element's (unique
      // indices: with repeats only one update lands, which this does not single out). The zeros
      // written are laid out as the updates (JAX's _scatter_transpose_rule: lax.full(updates_shape,
      // 0, sharding=updates_sharding)), which the explicit scatter rule needs split as the cotangent.
      {Op::kScatter,
       [](const VjpArgs& a) {
         const Value zeros = typed_as(a.x[2], [&] { return zeros_like(a.x[2]); });
         a.add(0, auto_typed_as(a.x[0], [&] { return scatter(a.g, a.x[1], zeros, transposed(a)); }));
         if (a.wants(2)) a.add(2, auto_typed_as(a.x[2], [&] { return gathered(a, a.g); }));
         return absl::OkStatus();
       }},
      // An unreduced cotangent (that of a window of a reduced operand) is written into zeros
      // typed as the operand's cotangent, unreduced alike (slicing.py's
      // _dynamic_slice_transpose_fancy: zeros of the accumulator's sharding; _dus_unreduced_rule).
      {Op::kDynamicSlice,
       [](const VjpArgs& a) {
         TraceState* t = a.trace;
         const std::optional<TypedOperand> g = typed_operand(a.g);
         const Value zeros = g.has_value() && !g->unreduced.empty()
                                 ? typed_as(a.x[0], [&] { return zeros_like(a.x[0]); })
                                 : zeros_like(a.x[0]);
         a.add(0, t->make(t->graph.add_dynamic_update_slice(zeros.node(), a.g.node(), a.x[1].node())));
         return absl::OkStatus();
       }},
      // The update's window of an unreduced cotangent is written with zeros typed as the
      // update's cotangent (_dynamic_update_slice_transpose_rule). The update's own cotangent is
      // built only when wanted: JAX's is a dynamic_slice of the cotangent, which refuses an
      // unreduced one, as Tessera's does.
      {Op::kDynamicUpdateSlice,
       [](const VjpArgs& a) {
         TraceState* t = a.trace;
         const std::optional<TypedOperand> g = typed_operand(a.g);
         const Value zeros = g.has_value() && !g->unreduced.empty()
                                 ? typed_as(a.x[1], [&] { return zeros_like(a.x[1]); })
                                 : zeros_like(a.x[1]);
         a.add(0, t->make(t->graph.add_dynamic_update_slice(a.g.node(), zeros.node(), a.x[2].node())));
         if (a.wants(1)) a.add(1, t->make(t->graph.add_dynamic_slice(a.g.node(), a.x[2].node(), a.x[1].shape())));
         return absl::OkStatus();
       }},
  };
  return kRules;
}

}  // namespace tessera::internal
