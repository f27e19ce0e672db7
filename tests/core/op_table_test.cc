// The op table (core/op.h) is complete and agrees with every layer that registers per op
// family: each op has a name, a wire number that proto/tessera.proto's OpCode spells out, a
// type rule, a kernel (unless it has none by the table: no kHasKernel), a VJP (unless
// kNoGradient) and a sharding rule; and the protocol version moves with the table.
#include <algorithm>
#include <cctype>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/vjp/vjp.h"
#include "coordinator/compiler/rules.h"
#include "core/graph.h"
#include "core/op.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/rpc.h"
#include "proto/tessera.pb.h"
#include "worker/kernels/internal.h"

namespace tessera {
namespace {

std::string upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

TEST(OpTable, EveryOpHasOneRowANameAndATypeRule) {
  ASSERT_EQ(op_table().size(), static_cast<size_t>(kNumOps));
  std::set<int> ops;
  std::set<std::string> names;
  for (const OpDef& d : op_table()) {
    SCOPED_TRACE(d.name);
    EXPECT_TRUE(ops.insert(static_cast<int>(d.op)).second) << "two rows for one op";
    ASSERT_NE(d.name, nullptr);
    EXPECT_FALSE(std::string(d.name).empty());
    EXPECT_TRUE(names.insert(d.name).second) << "two ops share a name";
    EXPECT_EQ(op_name(d.op), d.name);
    EXPECT_NE(d.infer, nullptr) << "no type rule";
    EXPECT_TRUE(d.arity >= 0 || d.arity == kVariadic);
  }
  EXPECT_EQ(op_name(static_cast<Op>(kNumOps)), "unknown");
}

// Every op names the attributes struct its nodes carry, and its type rule is never reached
// with another: infer_type refuses the node naming the op and both kinds.
TEST(OpTable, EveryOpChecksItsAttributesKind) {
  for (const OpDef& d : op_table()) {
    SCOPED_TRACE(d.name);
    ASSERT_GE(d.attrs, 0);
    ASSERT_LT(d.attrs, static_cast<int>(std::variant_size_v<Attrs>));
    EXPECT_STRNE(attrs_name(d.attrs), "unknown");
    Node n;
    n.op = d.op;
    // Another kind than the op's: NoAttrs, or ParameterAttrs for an op that takes none.
    const int other = d.attrs == kAttrsIndex<NoAttrs> ? kAttrsIndex<ParameterAttrs> : kAttrsIndex<NoAttrs>;
    if (other == kAttrsIndex<ParameterAttrs>) {
      n.attributes = ParameterAttrs{};
    } else {
      n.attributes = NoAttrs{};
    }
    const std::vector<ArrayType> operands(d.arity == kVariadic ? 1 : static_cast<size_t>(d.arity),
                                          ArrayType{DType::kF32, {4}});
    absl::StatusOr<ArrayType> t = infer_type(n, operands);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(t.status().message()),
                ::testing::HasSubstr(absl::StrCat(d.name, ": the node carries ", attrs_name(other), " attributes, not ",
                                                  attrs_name(d.attrs))));
  }
}

TEST(OpTable, WireNumbersAreTheProtosOpCodes) {
  const google::protobuf::EnumDescriptor* codes = pb::OpCode_descriptor();
  std::set<int> wires;
  for (const OpDef& d : op_table()) {
    SCOPED_TRACE(d.name);
    EXPECT_GT(d.wire, 0) << "0 is OP_UNSPECIFIED";
    EXPECT_TRUE(wires.insert(d.wire).second) << "two ops share wire number " << d.wire;
    const google::protobuf::EnumValueDescriptor* value = codes->FindValueByName(absl::StrCat("OP_", upper(d.name)));
    ASSERT_NE(value, nullptr) << "proto/tessera.proto's OpCode has no OP_" << upper(d.name);
    EXPECT_EQ(value->number(), d.wire) << "OpCode OP_" << upper(d.name) << " and the table disagree";
    absl::StatusOr<Op> back = op_from_wire(d.wire);
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, d.op);
  }
  for (int i = 0; i < codes->value_count(); ++i) {
    const int number = codes->value(i)->number();
    if (number == pb::OP_UNSPECIFIED) continue;
    EXPECT_TRUE(wires.count(number) > 0) << codes->value(i)->name() << " names no op of the table";
  }
  EXPECT_EQ(op_from_wire(0).status(), absl::InvalidArgumentError("unknown op 0"));
}

TEST(OpTable, KernelsAreRegisteredExactlyForOpsThatHaveOne) {
  for (const OpDef& d : op_table()) {
    SCOPED_TRACE(d.name);
    const bool registered = internal::find_kernel(d.op, internal::Backend::kCpu) != nullptr;
    if (d.traits & kHasKernel) {
      EXPECT_TRUE(registered) << d.name << " has kHasKernel but no family registers its kernel";
    } else {
      EXPECT_FALSE(registered) << d.name << " has a kernel: give it kHasKernel";
    }
    if (d.traits & kCollective) {
      EXPECT_FALSE(d.traits & kHasKernel) << "a collective runs as a collective";
    }
  }
}

TEST(OpTable, VjpsAreRegisteredExactlyForDifferentiableOps) {
  for (const OpDef& d : op_table()) {
    SCOPED_TRACE(d.name);
    const bool registered = internal::find_vjp(d.op) != nullptr;
    if (d.traits & kNoGradient) {
      EXPECT_FALSE(registered) << d.name << " has a VJP rule but kNoGradient";
    } else {
      EXPECT_TRUE(registered) << d.name << " has no VJP rule: register one in client/vjp/, or mark it kNoGradient";
    }
  }
}

TEST(OpTable, EveryOpHasAShardingRuleAndAPartitionHandler) {
  for (const OpDef& d : op_table()) {
    const internal::ShardingRule* rule = find_sharding_rule(d.op);
    ASSERT_NE(rule, nullptr) << d.name << " has no sharding rule: register one in coordinator/compiler/rules_*.cc";
    EXPECT_NE(rule->forward, nullptr) << d.name;
    EXPECT_NE(rule->backward, nullptr) << d.name;
    EXPECT_NE(rule->partition, nullptr) << d.name;
  }
}

// Each op is registered by one family only: a second entry would silently replace the first.
template <typename Entry>
void expect_each_op_once(const std::vector<absl::Span<const Entry>>& families, const char* what) {
  std::vector<int> count(kNumOps, 0);
  for (absl::Span<const Entry> family : families) {
    for (const Entry& e : family) ++count[static_cast<int>(e.op)];
  }
  for (int k = 0; k < kNumOps; ++k) {
    EXPECT_LE(count[k], 1) << op_name(static_cast<Op>(k)) << " has " << count[k] << " " << what << " entries";
  }
}

TEST(OpTable, FamiliesRegisterEachOpOnce) {
  expect_each_op_once<internal::KernelEntry>(
      {internal::elementwise_kernels(), internal::layout_kernels(), internal::reduction_kernels(),
       internal::dot_kernels(), internal::indexing_kernels()},
      "kernel");
  expect_each_op_once<internal::VjpEntry>(
      {internal::elementwise_vjps(), internal::layout_vjps(), internal::reduction_vjps(), internal::dot_vjps(),
       internal::indexing_vjps(), internal::shard_map_vjps()},
      "VJP");
  expect_each_op_once<internal::ShardingRuleEntry>(
      {internal::elementwise_rules(), internal::layout_rules(), internal::reduction_rules(), internal::dot_rules(),
       internal::placement_rules(), internal::indexing_rules()},
      "sharding rule");
}

TEST(OpTable, TraitsAgreeWithEachOther) {
  for (const OpDef& d : op_table()) {
    SCOPED_TRACE(d.name);
    const bool elementwise = d.traits & kElementwise, in_place = d.traits & kInPlace;
    const bool unary = d.traits & kUnary, binary = d.traits & kBinary, comparison = d.traits & kComparison;
    EXPECT_TRUE(elementwise || !(unary || binary));
    EXPECT_TRUE(!unary || d.arity == 1);
    EXPECT_TRUE(!binary || d.arity == 2);
    EXPECT_TRUE(!comparison || !in_place) << "a bool result cannot overwrite its operand";
    EXPECT_TRUE(!(d.traits & kLinear) || d.arity == 1);
  }
}

// The protocol version is tied to the table: the digest of every op's name, wire number, arity
// and attributes is recorded next to kProtocolVersion. A change to any of them changes what
// peers send and read, so it must come with a new protocol version.
TEST(OpTable, ProtocolVersionMovesWithTheTable) {
  EXPECT_EQ(op_table_digest(), kOpTableDigest)
      << "The op table changed (a name, wire number, arity or attribute): bump kProtocolVersion in proto/rpc.h "
         "(now "
      << kProtocolVersion << ") and set kOpTableDigest there to 0x" << std::hex << op_table_digest() << ".";
}

}  // namespace
}  // namespace tessera
