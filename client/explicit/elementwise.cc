// Explicit-mode sharding rules of the elementwise ops (every op with kElementwise: unary,
// binary, comparisons, select, convert, ...). As JAX's broadcasting_sharding_rule
// (jax/_src/lax/lax.py): the operands (of one shape: the tracer broadcasts first) must agree
// dimension by dimension; an unsplit dimension meets any split, two different splits are an
// error.
#include "absl/strings/str_cat.h"
#include "client/explicit/rules.h"

namespace tessera::internal {
namespace {

TypeRuleResult elementwise(const TypeRuleCall& c) { return consensus(c); }

}  // namespace

absl::Span<const std::pair<Op, TypeRule>> elementwise_type_rules() {
  static const std::vector<std::pair<Op, TypeRule>> kRules = [] {
    std::vector<std::pair<Op, TypeRule>> rules;
    for (const OpDef& def : op_table()) {
      if (def.traits & kElementwise) rules.push_back({def.op, elementwise});
    }
    return rules;
  }();
  return kRules;
}

}  // namespace tessera::internal
