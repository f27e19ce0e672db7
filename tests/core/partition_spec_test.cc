// PartitionSpec: construction, printing exactly as JAX prints specs, and equality as JAX's
// (entries as written).
#include "core/partition_spec.h"

#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

TEST(PartitionSpec, ToStringAsJax) {
  const std::vector<std::pair<PartitionSpec, std::string>> cases = {
      {P("data", None), "P('data', None)"},
      {P(None, "model"), "P(None, 'model')"},
      {P("data", "model"), "P('data', 'model')"},
      {P(Axes{"data", "model"}), "P(('data', 'model'),)"},
      {P(Axes{"model", "data"}), "P(('model', 'data'),)"},
      {P(Axes{"data", "model"}, None), "P(('data', 'model'), None)"},
      {P(None, Axes{"model", "data"}), "P(None, ('model', 'data'))"},
      {P(), "P()"},
      // One entry: Python's one-element tuple repr keeps the trailing comma.
      {P("data"), "P('data',)"},
      {P(None), "P(None,)"},
      {P(std::string("model")), "P('model',)"},
  };
  for (const auto& [spec, text] : cases) EXPECT_EQ(spec.to_string(), text);
}

TEST(PartitionSpec, EntriesAsWritten) {
  PartitionSpec spec = P(Axes{"data", "model"}, None, "expert");
  EXPECT_EQ(spec.size(), 3);
  EXPECT_THAT(spec.axes(0), ElementsAre("data", "model"));
  EXPECT_THAT(spec.axes(1), IsEmpty());
  EXPECT_THAT(spec.axes(2), ElementsAre("expert"));
  EXPECT_THAT(spec.axes(3), IsEmpty());  // past the end: None
  EXPECT_THAT(spec.axes(-1), IsEmpty());
  EXPECT_EQ(spec.dims(), (std::vector<Axes>{{"data", "model"}, {}, {"expert"}}));

  EXPECT_EQ(P().size(), 0);
  EXPECT_EQ(P("data", None).size(), 2);  // trailing Nones are kept as written
  EXPECT_EQ(PartitionSpec(std::vector<Axes>{{"data"}, {}}).to_string(), "P('data', None)");
}

TEST(PartitionSpec, UsedAxesInOrderOfAppearance) {
  EXPECT_THAT(P(None, "model", Axes{"expert", "data"}).used_axes(), ElementsAre("model", "expert", "data"));
  EXPECT_THAT(P(Axes{"model", "data"}).used_axes(), ElementsAre("model", "data"));
  EXPECT_THAT(P().used_axes(), IsEmpty());
  EXPECT_THAT(P(None, None).used_axes(), IsEmpty());
}

// JAX compares specs by their entries: `P('x') == P('x', None)` is False (jax/_src/
// partition_spec.py interns P by its canonicalized partitions, trailing Nones kept; JAX's
// tests/pjit_test.py relies on NamedSharding.is_equivalent_to, not ==, to call them alike).
TEST(PartitionSpec, TrailingNonesCountAsInJax) {
  EXPECT_NE(P("data"), P("data", None));
  EXPECT_NE(P("data", None), P("data"));
  EXPECT_NE(P("data"), P("data", None, None));
  EXPECT_NE(P(), P(None));
  EXPECT_NE(P(None, None), P());
  EXPECT_NE(P(None, "model"), P(None, "model", None));
  EXPECT_NE(P(Axes{"data", "model"}), P(Axes{"data", "model"}, None));
  EXPECT_EQ(P("data", None), P("data", None));
  EXPECT_EQ(P(), P());
}

// JAX canonicalizes a one-axis tuple to the bare axis: P(('data',)) == P('data').
TEST(PartitionSpec, OneAxisTupleIsTheAxis) {
  EXPECT_EQ(P(Axes{"data"}), P("data"));
  EXPECT_EQ(P(Axes{"data"}).to_string(), "P('data',)");
  EXPECT_EQ(P(None, Axes{"model"}).to_string(), "P(None, 'model')");
}

TEST(PartitionSpec, LeadingNonesAndOrderMatter) {
  EXPECT_NE(P("data"), P(None, "data"));
  EXPECT_NE(P("data", "model"), P("model", "data"));
  EXPECT_NE(P(Axes{"data", "model"}), P(Axes{"model", "data"}));
  EXPECT_NE(P(Axes{"data", "model"}), P("data", "model"));
  EXPECT_NE(P("data"), P());
  EXPECT_NE(P(None, "model"), P(None, "model", "data"));
}

// jax tests/array_test.py, test_pspec_unreduced: the reprs and equality of specs with unreduced
// and reduced axes (unreduced_kind defaults to sum, and prints).
TEST(PartitionSpec, UnreducedAndReducedAsJax) {
  const std::vector<std::pair<PartitionSpec, std::string>> cases = {
      {P("a", "b", None).with_unreduced({"c"}).with_reduced({"d"}),
       "P('a', 'b', None, unreduced={'c'}, reduced={'d'}, unreduced_kind=sum)"},
      {P("a", "b", None).with_unreduced({"c"}), "P('a', 'b', None, unreduced={'c'}, unreduced_kind=sum)"},
      {P("x").with_unreduced({"y"}), "P('x', unreduced={'y'}, unreduced_kind=sum)"},
      {P(None, None).with_unreduced({"x"}), "P(None, None, unreduced={'x'}, unreduced_kind=sum)"},
      {P(None).with_unreduced({"x"}), "P(None, unreduced={'x'}, unreduced_kind=sum)"},
      {P().with_unreduced({"x"}), "P(unreduced={'x'}, unreduced_kind=sum)"},
      // Reduced alone has no unreduced_kind (partition_spec.py's __repr__).
      {P().with_reduced({"x"}), "P(reduced={'x'})"},
      // Python prints a set in its hash order; Tessera sorts.
      {P().with_unreduced({"y", "x"}), "P(unreduced={'x', 'y'}, unreduced_kind=sum)"},
  };
  for (const auto& [spec, text] : cases) EXPECT_EQ(spec.to_string(), text);
  EXPECT_EQ(P("a", "b", None).with_unreduced({"c"}), P("a", "b", None).with_unreduced({"c"}));
  EXPECT_NE(P("a", "b", None).with_unreduced({"c"}), P("a", "b", None).with_unreduced({"d"}));
  EXPECT_NE(P("a", "b", None).with_unreduced({"c"}), P("a", "b", None));
  EXPECT_NE(P().with_unreduced({"c"}), P().with_reduced({"c"}));
  EXPECT_EQ(P().with_unreduced({"y", "x", "x"}).unreduced(), (std::vector<std::string>{"x", "y"}));
  // Unreduced axes split no dimension.
  EXPECT_THAT(P("a").with_unreduced({"b"}).used_axes(), ElementsAre("a"));
  EXPECT_EQ(P("a").with_unreduced({"b"}).partitions_only(), P("a"));
}

// jax/_src/partition_spec.py, _check: the messages of an overlap (its sets are frozensets,
// PartitionSpec.__new__'s _canonicalize_ur).
TEST(PartitionSpec, CheckRefusesOverlapsAsJax) {
  EXPECT_TRUE(P("a").with_unreduced({"b"}).with_reduced({"c"}).check().ok());
  const absl::Status both = P().with_unreduced({"a"}).with_reduced({"a"}).check();
  EXPECT_EQ(both.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(both.message(),
            "`unreduced` and `reduced` argument to PartitionSpec cannot overlap. Got unreduced: frozenset({'a'}) and "
            "reduced: frozenset({'a'})");
  EXPECT_EQ(P("a", None).with_unreduced({"a"}).check().message(),
            "partitions cannot overlap with unreduced axes passed to PartitionSpec. Got partitions: ('a', None) and "
            "unreduced axes: frozenset({'a'})");
  EXPECT_EQ(P(Axes{"a", "b"}).with_reduced({"b"}).check().message(),
            "partitions cannot overlap with reduced axes passed to PartitionSpec. Got partitions: (('a', 'b'),) and "
            "reduced axes: frozenset({'b'})");
}

}  // namespace
}  // namespace tessera
