// Reduced types in explicit mode beyond the elementwise ops (issue 16): how a type prints its
// reduced and unreduced axes, and the reduced rules of the reductions, pad, the dynamic window
// ops, gather and scatter, each as JAX's (jax/_src/lax/lax.py, jax/_src/lax/slicing.py,
// tests/pjit_test.py), on the (4, 2) and (2, 4) meshes of Client::local(8), values against the
// host and errors by their message.
#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/jit_support.h"

namespace tessera {
namespace {

using jit_support::expect_near;
using jit_support::random_f32;
using ::testing::HasSubstr;

class ExplicitReducedTest : public jit_support::LocalJitSuite {
 protected:
  // The (4, 2) and (2, 4) meshes over all eight devices, axes ('x', 'y'), both Explicit.
  static std::vector<Mesh> meshes() {
    std::vector<Mesh> out;
    for (const Shape& shape : {Shape{4, 2}, Shape{2, 4}}) {
      absl::StatusOr<Mesh> mesh = client_->make_mesh(shape, {"x", "y"}, {AxisType::kExplicit, AxisType::kExplicit});
      EXPECT_TRUE(mesh.ok()) << mesh.status();
      out.push_back(*mesh);
    }
    return out;
  }

  // f's one result on `args`.
  static absl::StatusOr<Array> run1(const std::function<Value(const std::vector<Value>&)>& f,
                                    const std::vector<Array>& args) {
    absl::StatusOr<std::vector<Array>> y =
        jit([&](const std::vector<Value>& in) { return std::vector<Value>{f(in)}; })(args);
    if (!y.ok()) return y.status();
    return (*y)[0];
  }

  // The message of f's refusal to trace on `args` (INVALID_ARGUMENT).
  static std::string refusal(const std::function<Value(const std::vector<Value>&)>& f, const std::vector<Array>& args) {
    absl::StatusOr<std::vector<Array>> y =
        jit([&](const std::vector<Value>& in) { return std::vector<Value>{f(in)}; })(args);
    EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument) << y.status();
    return std::string(y.status().message());
  }

  // An unreduced array's sum over its pending axes, on the host.
  static HostArray summed(const Array& a) {
    absl::StatusOr<Array> whole = reshard(a, NamedSharding(a.sharding().mesh(), P()));
    EXPECT_TRUE(whole.ok()) << whole.status();
    return whole.ok() ? fetch(*whole) : HostArray();
  }
};

// The first of a control-flow op's results, or an invalid Value when it failed (and gave none).
Value first(const std::vector<Value>& results) { return results.empty() ? Value() : results[0]; }

std::vector<double> values_of(const HostArray& a) {
  const auto v = a.values<float>();
  return std::vector<double>(v.begin(), v.end());
}

// The host's reference for a gather of whole rows: table[i] for each index in turn, and how
// many times each element of the f32 table (rows of `width`) is picked (its gradient of sum).
struct GatheredRows {
  std::vector<double> rows, counts;
};
GatheredRows gathered_rows_and_counts(const HostArray& table, const std::vector<int32_t>& indices, int64_t width) {
  GatheredRows g{{}, std::vector<double>(static_cast<size_t>(table.size()), 0.0)};
  for (int32_t i : indices) {
    for (int64_t j = 0; j < width; ++j) {
      g.rows.push_back(table.values<float>()[i * width + j]);
      g.counts[i * width + j] += 1.0;
    }
  }
  return g;
}

// jax/_src/core.py, _vma_ur_str: a type prints its unreduced and reduced axes each in the mesh's
// order (`_create_str(order_wrt_mesh(mesh, reduced), 'R')`), not sorted; the spec keeps them as
// a set (partition_spec.py's repr prints `set(reduced)`, whose order is Python's hash's, which
// Tessera prints sorted). On a mesh ('y', 'x') the reduced type is {R:(y,x)}, and the gradient,
// unreduced over both (sharding-ad.md: reduced {R:X} -> unreduced {U:X}), {U:(y,x)}; on
// ('x', 'y') {R:(x,y)}. The gradient of sum(x) summed over its pending axes is ones.
TEST_F(ExplicitReducedTest, ReducedAndUnreducedAxesPrintInMeshOrder) {
  const HostArray v = random_f32({8}, 7);
  for (const auto& [names, reduced_text, unreduced_text] :
       {std::tuple{std::vector<std::string>{"y", "x"}, "f32[8]{R:(y,x)}", "f32[8]{U:(y,x)}"},
        std::tuple{std::vector<std::string>{"x", "y"}, "f32[8]{R:(x,y)}", "f32[8]{U:(x,y)}"}}) {
    for (const Shape& shape : {Shape{4, 2}, Shape{2, 4}}) {
      absl::StatusOr<Mesh> mesh = client_->make_mesh(shape, names, {AxisType::kExplicit, AxisType::kExplicit});
      ASSERT_TRUE(mesh.ok()) << mesh.status();
      SCOPED_TRACE(mesh->to_string());
      const Array x = put_on(*mesh, v, P(None).with_reduced({"y", "x"}));
      EXPECT_EQ(type_of(x).to_string(), reduced_text);
      // The spec is a set: sorted, whatever the order given or the mesh's.
      EXPECT_EQ(x.sharding().spec().reduced(), (std::vector<std::string>{"x", "y"}));
      EXPECT_EQ(x.sharding().spec().to_string(), "P(None, reduced={'x', 'y'})");
      std::string traced;
      Jitted g = jit(grad([&](const std::vector<Value>& in) {
        traced = type_of(in[0]).to_string();
        return std::vector<Value>{sum(in[0] * 3.0)};
      }));
      absl::StatusOr<std::vector<Array>> gx = g({x});
      ASSERT_TRUE(gx.ok()) << gx.status();
      EXPECT_EQ(traced, reduced_text);
      EXPECT_EQ(type_of((*gx)[0]).to_string(), unreduced_text);
      expect_near(summed((*gx)[0]), std::vector<double>(8, 3.0));
    }
  }
}

// reduce_max / reduce_min keep their operand's reduced axes (lax.py's _reduce_max_ur_rule /
// _reduce_min_ur_rule: _reduce_op_reduced_rule returns getr(operand)); reduce_prod, argmax and
// cumsum have no ur_rule (reduce_prod_p and argmax_p are standard_primitive without one, and
// loops.py's _cumulative_reduction_primitive passes none), so call_ur_rule (lax/utils.py)
// refuses a reduced operand: "unreduced/reduced rule for <op> is not implemented".
TEST_F(ExplicitReducedTest, ReductionsKeepReducedAxesAsJax) {
  const HostArray h = random_f32({8, 6}, 11);
  std::vector<double> row_max(8, -1e30), row_min(8, 1e30);
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 6; ++j) {
      row_max[i] = std::max<double>(row_max[i], h.values<float>()[i * 6 + j]);
      row_min[i] = std::min<double>(row_min[i], h.values<float>()[i * 6 + j]);
    }
  }
  for (const Mesh& mesh : meshes()) {
    SCOPED_TRACE(mesh.to_string());
    const Array x = put_on(mesh, h, P("x", None).with_reduced({"y"}));
    using Reduce = Value (*)(const Value&, std::vector<int64_t>, bool);
    for (const auto& [reduce, want] : {std::pair<Reduce, const std::vector<double>*>{max, &row_max},
                                       std::pair<Reduce, const std::vector<double>*>{min, &row_min}}) {
      std::string type;
      const absl::StatusOr<Array> m = run1(
          [&, reduce = reduce](const std::vector<Value>& in) {
            Value r = reduce(in[0], {1}, false);
            type = type_of(r).to_string();
            return r;
          },
          {x});
      ASSERT_TRUE(m.ok()) << m.status();
      EXPECT_EQ(type, "f32[8@x]{R:y}");
      EXPECT_EQ(m->sharding().spec(), P("x").with_reduced({"y"}));
      expect_near(fetch(*m), *want);
    }

    EXPECT_THAT(refusal([](const std::vector<Value>& in) { return prod(in[0], {1}); }, {x}),
                ::testing::AllOf(HasSubstr("reduce_prod: unreduced/reduced rule for reduce_prod is not implemented"),
                                 HasSubstr("(operand f32[8@x,6]{R:y})")));
    EXPECT_THAT(refusal([](const std::vector<Value>& in) { return argmax(in[0], 1); }, {x}),
                HasSubstr("argmax: unreduced/reduced rule for argmax is not implemented"));
    // argmin_p has no ur_rule either: the refusal names argmin, reduced or unreduced (Tessera
    // traces argmin as argmax of -x, whose names the message must not give).
    EXPECT_THAT(refusal([](const std::vector<Value>& in) { return argmin(in[0], 1); }, {x}),
                ::testing::AllOf(HasSubstr("argmin: unreduced/reduced rule for argmin is not implemented"),
                                 HasSubstr("(operand f32[8@x,6]{R:y})")));
    EXPECT_THAT(
        refusal([](const std::vector<Value>& in) { return argmin(reshard(in[0], P("x").with_unreduced({"y"})), 1); },
                {put_on(mesh, h, P("x", None))}),
        ::testing::AllOf(HasSubstr("argmin: unreduced/reduced rule for argmin is not implemented"),
                         HasSubstr("(operand f32[8@x,6]{U:y})")));
    // An unreduced operand to argmax: call_ur_rule's words too, not nary_ur_rule's.
    EXPECT_THAT(
        refusal([](const std::vector<Value>& in) { return argmax(reshard(in[0], P("x").with_unreduced({"y"})), 1); },
                {put_on(mesh, h, P("x", None))}),
        ::testing::AllOf(HasSubstr("argmax: unreduced/reduced rule for argmax is not implemented"),
                         HasSubstr("(operand f32[8@x,6]{U:y})")));
    EXPECT_THAT(refusal([](const std::vector<Value>& in) { return cumsum(in[0], 1); }, {x}),
                HasSubstr("cumsum: unreduced/reduced rule for cumsum is not implemented"));
  }
}

// A value made unreduced over 'y' and then resolved (reshard to P('x'): an all_reduce) is an
// ordinary array: argmin of it (argmax of its negation) and argmax of it pick the host's
// indices on every device. (Session 28 suspected a use-after-free here; it was a test reading
// values() of a fetched temporary. This keeps the case.)
TEST_F(ExplicitReducedTest, ArgminOfAResolvedUnreducedValueIsTheHostsOnEveryDevice) {
  const HostArray h = random_f32({8, 6}, 19);
  std::vector<double> first_min(8), first_max(8);
  for (int i = 0; i < 8; ++i) {
    const float* row = h.values<float>().data() + i * 6;
    first_min[i] = static_cast<double>(std::min_element(row, row + 6) - row);
    first_max[i] = static_cast<double>(std::max_element(row, row + 6) - row);
  }
  for (const Mesh& mesh : meshes()) {
    SCOPED_TRACE(mesh.to_string());
    const Array x = put_on(mesh, h, P("x", None));
    auto resolved = [](const Value& v) {
      return reshard(reshard(v, P("x", None).with_unreduced({"y"})), P("x", None));
    };
    for (bool minimum : {true, false}) {
      SCOPED_TRACE(minimum ? "argmin" : "argmax");
      const absl::StatusOr<Array> out = run1(
          [&](const std::vector<Value>& in) {
            return minimum ? argmin(resolved(in[0]), 1) : argmax(resolved(in[0]), 1);
          },
          {x});
      ASSERT_TRUE(out.ok()) << out.status();
      const HostArray host = fetch(*out);  // values() views it: keep it alive
      const auto got = host.values<int32_t>();
      EXPECT_EQ(std::vector<double>(got.begin(), got.end()), minimum ? first_min : first_max);
    }
  }
}

// jax/_src/lax/lax.py: sort_p and top_k_p call no ur_rule; _sort_abstract_eval returns its
// operands' types and _top_k_abstract_eval `operand.update(shape=...)` for the values and the
// int32 indices, so sort, argsort (jax/_src/numpy/sorting.py sorts a broadcasted_iota made with
// the operand's sharding beside it) and top_k of a reduced operand are reduced alike. argsort
// with descending=True reverses with lax.rev, which has no ur_rule: call_ur_rule refuses it.
// JAX passes an unreduced operand through, sorting each device's term; Tessera refuses it
// (client/explicit/sort.cc), as the order of a sum is not that of its terms. Values against the
// host's row sorts (stable; top_k's ties to the lower index).
TEST_F(ExplicitReducedTest, SortArgsortAndTopKKeepReducedAxesAsJax) {
  const HostArray h = random_f32({8, 6}, 17);
  std::vector<double> sorted, order, top_values, top_indices;
  for (int i = 0; i < 8; ++i) {
    std::vector<int> idx = {0, 1, 2, 3, 4, 5};
    const float* row = h.values<float>().data() + i * 6;
    std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return row[a] < row[b]; });
    for (int j : idx) {
      sorted.push_back(row[j]);
      order.push_back(j);
    }
    std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return row[a] > row[b]; });
    for (int j = 0; j < 3; ++j) {
      top_values.push_back(row[idx[j]]);
      top_indices.push_back(idx[j]);
    }
  }
  auto ints = [](const HostArray& a) {
    const auto v = a.values<int32_t>();
    return std::vector<double>(v.begin(), v.end());
  };
  for (const Mesh& mesh : meshes()) {
    SCOPED_TRACE(mesh.to_string());
    const Array x = put_on(mesh, h, P("x", None).with_reduced({"y"}));
    std::vector<std::string> types;
    absl::StatusOr<std::vector<Array>> out = jit([&](const std::vector<Value>& in) {
      const auto [values, indices] = top_k(in[0], 3);
      std::vector<Value> r = {sort(in[0]), argsort(in[0]), values, indices};
      for (const Value& v : r) types.push_back(type_of(v).to_string());
      return r;
    })({x});
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_THAT(types,
                ::testing::ElementsAre("f32[8@x,6]{R:y}", "i32[8@x,6]{R:y}", "f32[8@x,3]{R:y}", "i32[8@x,3]{R:y}"));
    for (const Array& a : *out) EXPECT_EQ(a.sharding().spec(), P("x", None).with_reduced({"y"}));
    expect_near(fetch((*out)[0]), sorted);
    EXPECT_EQ(ints(fetch((*out)[1])), order);
    expect_near(fetch((*out)[2]), top_values);
    EXPECT_EQ(ints(fetch((*out)[3])), top_indices);

    EXPECT_THAT(refusal([](const std::vector<Value>& in) { return argsort(in[0], -1, true); }, {x}),
                ::testing::AllOf(HasSubstr("argsort_descending: unreduced/reduced rule for rev is not implemented"),
                                 HasSubstr("(operand f32[8@x,6]{R:y})")));
    const Array plain = put_on(mesh, h, P("x", None));
    auto unreduced = [](const Value& v) { return reshard(v, P("x", None).with_unreduced({"y"})); };
    EXPECT_THAT(refusal([&](const std::vector<Value>& in) { return sort(unreduced(in[0])); }, {plain}),
                ::testing::AllOf(HasSubstr("sort: unreduced rule for sort is not implemented"),
                                 HasSubstr("(operand f32[8@x,6]{U:y})")));
    EXPECT_THAT(refusal([&](const std::vector<Value>& in) { return top_k(unreduced(in[0]), 3).first; }, {plain}),
                HasSubstr("top_k: unreduced rule for top_k is not implemented"));
    EXPECT_THAT(refusal([&](const std::vector<Value>& in) { return argsort(unreduced(in[0])); }, {plain}),
                HasSubstr("argsort: unreduced rule for argsort is not implemented"));
  }
}

// tests/pjit_test.py, test_reduce_max_reduced_reshard: max over a value resharded from P('x') to
// P(reduced={'x'}) is P(reduced={'x'}); its gradient comes back P('x') (the unreduced cotangent
// reduce-scattered by the reshard's transpose) and equals the gradient through P(): one at the
// maximum, zero elsewhere.
TEST_F(ExplicitReducedTest, GradOfAMaxOfAReducedValueAsJax) {
  const HostArray h = HostArray::from_vector<float>({8}, {3, 7, 1, 9, 4, 2, 8, 5});
  std::vector<double> want(8, 0.0);
  want[3] = 1.0;
  for (const Mesh& mesh : meshes()) {
    SCOPED_TRACE(mesh.to_string());
    const Array x = put_on(mesh, h, P("x"));
    auto f = [](const std::vector<Value>& in) {
      return std::vector<Value>{max(reshard(in[0], P().with_reduced({"x"})), {0})};
    };
    absl::StatusOr<std::vector<Array>> out = jit(f)({x});
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ((*out)[0].sharding().spec(), P().with_reduced({"x"}));
    expect_near(fetch((*out)[0]), {9.0});
    absl::StatusOr<std::vector<Array>> g = jit(grad(f))({x});
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ((*g)[0].sharding().spec(), P("x"));
    expect_near(fetch((*g)[0]), want);
  }
}

// pad keeps its operand's reduced axes (lax.py's _pad_ur_rule: getr(operand)); dynamic_slice
// too (slicing.py's _dynamic_slice_ur_rule); dynamic_update_slice needs the operand and the
// update reduced alike (_dus_reduced_rule, its message), and is then reduced as they are.
TEST_F(ExplicitReducedTest, PadAndDynamicWindowsKeepReducedAxesAsJax) {
  const HostArray h = random_f32({8, 6}, 12), u = random_f32({8, 2}, 13);
  std::vector<double> padded(8 * 9), window(8 * 3), updated = values_of(h);
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 9; ++j) padded[i * 9 + j] = (j >= 1 && j < 7) ? h.values<float>()[i * 6 + j - 1] : 5.0;
    for (int j = 0; j < 3; ++j) window[i * 3 + j] = h.values<float>()[i * 6 + 2 + j];
    for (int j = 0; j < 2; ++j) updated[i * 6 + 3 + j] = u.values<float>()[i * 2 + j];
  }
  for (const Mesh& mesh : meshes()) {
    SCOPED_TRACE(mesh.to_string());
    const Array x = put_on(mesh, h, P("x", None).with_reduced({"y"}));
    std::vector<std::string> types;
    auto typed = [&](const Value& v) {
      types.push_back(type_of(v).to_string());
      return v;
    };
    const absl::StatusOr<Array> p = run1(
        [&](const std::vector<Value>& in) {
          return typed(pad(in[0], {{0, 0}, {1, 2}}, 5.0));
        },
        {x});
    ASSERT_TRUE(p.ok()) << p.status();
    const absl::StatusOr<Array> w = run1(
        [&](const std::vector<Value>& in) {
          return typed(dynamic_slice(in[0], {full({}, 0, DType::kI32), full({}, 2, DType::kI32)}, {8, 3}));
        },
        {x});
    ASSERT_TRUE(w.ok()) << w.status();
    const Array up = put_on(mesh, u, P("x", None).with_reduced({"y"}));
    const absl::StatusOr<Array> d = run1(
        [&](const std::vector<Value>& in) {
          return typed(dynamic_update_slice(in[0], in[1], {full({}, 0, DType::kI32), full({}, 3, DType::kI32)}));
        },
        {x, up});
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_THAT(types, ::testing::ElementsAre("f32[8@x,9]{R:y}", "f32[8@x,3]{R:y}", "f32[8@x,6]{R:y}"));
    EXPECT_EQ(p->sharding().spec(), P("x", None).with_reduced({"y"}));
    expect_near(fetch(*p), padded);
    expect_near(fetch(*w), window);
    expect_near(fetch(*d), updated);

    const Array plain = put_on(mesh, u, P("x", None));
    EXPECT_THAT(refusal(
                    [](const std::vector<Value>& in) {
                      return dynamic_update_slice(in[0], in[1], {full({}, 0, DType::kI32), full({}, 3, DType::kI32)});
                    },
                    {x, plain}),
                HasSubstr("dynamic_update_slice: dynamic_update_slice operand and update must be reduced along the "
                          "same axes. Got operand sharding f32[8@x,6]{R:y} and update sharding f32[8@x,2]."));
  }
}

// The gradients of pad, dynamic_slice and dynamic_update_slice of an operand reduced over 'y'
// are unreduced over 'y' (sharding-ad.md: reduced {R:X} -> unreduced {U:X}), each device's term
// written with no sum run, and sum to the host's gradient: 2x where x is read, 0 where the
// update overwrote it. The transposes as JAX's (jax/_src/lax/slicing.py): dynamic_slice's writes
// the cotangent into zeros of the accumulator's sharding (_dynamic_slice_transpose_fancy),
// dynamic_update_slice's the cotangent with zeros typed as the update's cotangent
// (_dynamic_update_slice_transpose_rule), both unreduced alike (_dus_unreduced_rule); the
// update's own cotangent is a dynamic_slice of the unreduced cotangent, which
// _dynamic_slice_ur_rule refuses.
TEST_F(ExplicitReducedTest, GradsOfPadAndDynamicWindowsOfReducedValuesAreUnreducedAsJax) {
  const HostArray h = random_f32({8, 6}, 18), u = random_f32({8, 2}, 19);
  std::vector<double> everywhere(8 * 6), window(8 * 6, 0.0), outside(8 * 6);
  for (int i = 0; i < 8 * 6; ++i) {
    const int j = i % 6;
    const double twice = 2.0 * h.values<float>()[i];
    everywhere[i] = twice;
    if (j >= 2 && j < 5) window[i] = twice;
    outside[i] = (j >= 3 && j < 5) ? 0.0 : twice;
  }
  const auto at_ = [](int64_t row, int64_t col) {
    return std::vector<Value>{full({}, static_cast<double>(row), DType::kI32),
                              full({}, static_cast<double>(col), DType::kI32)};
  };
  auto squared_sum = [](const Value& v) { return sum(v * v); };
  using Body = std::function<Value(const std::vector<Value>&)>;
  for (const Mesh& mesh : meshes()) {
    SCOPED_TRACE(mesh.to_string());
    const Array x = put_on(mesh, h, P("x", None).with_reduced({"y"}));
    const Array up = put_on(mesh, u, P("x", None).with_reduced({"y"}));
    for (const auto& [name, body, want] :
         {std::tuple<std::string, Body, const std::vector<double>*>{
              "pad",
              [&](const std::vector<Value>& in) {
                return squared_sum(pad(in[0], {{0, 0}, {1, 2}}, 5.0));
              },
              &everywhere},
          std::tuple<std::string, Body, const std::vector<double>*>{
              "dynamic_slice",
              [&](const std::vector<Value>& in) {
                return squared_sum(dynamic_slice(in[0], at_(0, 2), {8, 3}));
              },
              &window},
          std::tuple<std::string, Body, const std::vector<double>*>{
              "dynamic_update_slice",
              [&](const std::vector<Value>& in) { return squared_sum(dynamic_update_slice(in[0], in[1], at_(0, 3))); },
              &outside}}) {
      SCOPED_TRACE(name);
      Jitted step =
          jit(grad([&, body = body](const std::vector<Value>& in) { return std::vector<Value>{body(in)}; }, {0}));
      absl::StatusOr<std::vector<Array>> g = step({x, up});
      ASSERT_TRUE(g.ok()) << g.status();
      EXPECT_EQ((*g)[0].sharding().spec(), P("x", None).with_unreduced({"y"}));
      EXPECT_THAT(step.as_text(), ::testing::Not(HasSubstr("all_reduce")));
      expect_near(summed((*g)[0]), *want);
    }
    absl::StatusOr<std::vector<Array>> g_update = jit(grad(
        [&](const std::vector<Value>& in) {
          return std::vector<Value>{squared_sum(dynamic_update_slice(in[0], in[1], at_(0, 3)))};
        },
        {1}))({x, up});
    EXPECT_EQ(g_update.status().code(), absl::StatusCode::kInvalidArgument) << g_update.status();
    EXPECT_THAT(std::string(g_update.status().message()),
                HasSubstr("dynamic_slice: unreduced rule for dynamic_slice is not implemented"));
  }
}

// tests/pjit_test.py, test_gather_reduced_fwd_unreduced_bwd: x.at[idx].get() of a table reduced
// over 'x' is reduced over 'x' (slicing.py's _gather_reduced_rule), and its gradient is
// unreduced over 'x', summing to the gradient through P() (each row counted once per index).
// _gather_reduced_rule refuses reduced indices ("gather indices cannot be reduced") and split
// indices with a reduced table (NotImplementedError); scatter_add refuses any reduced operand
// (_scatter_ur_rule: "reduced rule for scatter is not implemented"), and scatter (.at[].set),
// with no ur_rule, does as call_ur_rule does.
TEST_F(ExplicitReducedTest, GathersKeepReducedAxesAndScattersRefuseThemAsJax) {
  const HostArray table = random_f32({8, 2}, 14);
  const std::vector<int32_t> picks = {0, 2, 2, 5};
  const HostArray idx = HostArray::from_vector<int32_t>({4}, picks);
  const auto [rows, counts] = gathered_rows_and_counts(table, picks, 2);
  for (const Mesh& mesh : meshes()) {
    SCOPED_TRACE(mesh.to_string());
    const Array op = put_on(mesh, table, P(None, None).with_reduced({"x"}));
    const Array ids = put_on(mesh, idx, P());
    std::string type;
    auto f = [&](const std::vector<Value>& in) {
      Value y = at(in[0], in[1]).get();
      type = type_of(y).to_string();
      return y;
    };
    const absl::StatusOr<Array> out = run1(f, {op, ids});
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(type, "f32[4,2]{R:x}");
    EXPECT_EQ(out->sharding().spec(), P(None, None).with_reduced({"x"}));
    expect_near(fetch(*out), rows);
    Jitted step = jit(grad([&](const std::vector<Value>& in) { return std::vector<Value>{sum(f(in))}; }, {0}));
    absl::StatusOr<std::vector<Array>> g = step({op, ids});
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ((*g)[0].sharding().spec(), P(None, None).with_unreduced({"x"}));
    // The scatter_add adds each device's term: no sum runs in the program.
    EXPECT_THAT(step.as_text(), ::testing::Not(HasSubstr("all_reduce")));
    expect_near(summed((*g)[0]), counts);

    const Array reduced_ids = put_on(mesh, idx, P().with_reduced({"x"}));
    // lax.gather (take would first wrap negative indices, an add the nary rule refuses).
    EXPECT_THAT(refusal([](const std::vector<Value>& in) { return gather(in[0], in[1], 0); },
                        {put_on(mesh, table, P()), reduced_ids}),
                HasSubstr("gather: gather indices cannot be reduced. Got indices sharding i32[4]{R:x}."));
    const Array split_ids = put_on(mesh, idx, P("y"));
    EXPECT_THAT(refusal([](const std::vector<Value>& in) { return take(in[0], in[1], 0); }, {op, split_ids}),
                HasSubstr("a gather from a table reduced over {'x'} with split indices is not implemented"));
    const Array updates = put_on(mesh, random_f32({4, 2}, 15), P(None, None).with_reduced({"x"}));
    EXPECT_THAT(refusal([](const std::vector<Value>& in) { return at(in[0], in[1]).set(in[2]); }, {op, ids, updates}),
                HasSubstr("scatter: unreduced/reduced rule for scatter is not implemented"));
    EXPECT_THAT(refusal([](const std::vector<Value>& in) { return at(in[0], in[1]).add(in[2]); }, {op, ids, updates}),
                HasSubstr("scatter_add: reduced rule for scatter is not implemented"));
  }
}

// tests/pjit_test.py, test_scatter_unreduced_fwd_reduced_bwd (its forward): op.at[idx].add(upd)
// of an operand and updates unreduced over 'x' is unreduced over 'x' (slicing.py's
// _scatter_unreduced_rule): each device adds its term of the updates into its term of the
// operand, and the sum is the host's scatter-add. JAX's operand is zeros; here it is not, so the
// operand's terms are summed once (the compiler keeps the pending sum, and runs no all_reduce
// before the scatter). The rule's errors: unreduced indices, operand and updates unreduced over
// different axes, and unreduced values with split indices (NotImplementedError in JAX).
TEST_F(ExplicitReducedTest, ScatterAddOfUnreducedValuesIsUnreducedAndSumsToTheHostAsJax) {
  const HostArray table = random_f32({8, 2}, 21);
  const HostArray upd = random_f32({4, 2}, 22);
  const std::vector<int32_t> rows = {1, 3, 5, 5};
  const HostArray idx = HostArray::from_vector<int32_t>({4}, rows);
  std::vector<double> want(table.values<float>().begin(), table.values<float>().end());
  for (size_t k = 0; k < rows.size(); ++k) {
    for (int j = 0; j < 2; ++j) want[rows[k] * 2 + j] += upd.values<float>()[k * 2 + j];
  }
  const PartitionSpec ux = P(None, None).with_unreduced({"x"});
  for (const Mesh& mesh : meshes()) {
    SCOPED_TRACE(mesh.to_string());
    const Array op = put_on(mesh, table, P());
    const Array ids = put_on(mesh, idx, P());
    const Array updates = put_on(mesh, upd, P());
    std::string type;
    auto f = [&](const std::vector<Value>& in) {
      Value y = at(reshard(in[0], ux), in[1]).add(reshard(in[2], ux));
      type = type_of(y).to_string();
      return y;
    };
    Jitted step = jit([&](const std::vector<Value>& in) { return std::vector<Value>{f(in)}; });
    const absl::StatusOr<std::vector<Array>> out = step({op, ids, updates});
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(type, "f32[8,2]{U:x}");
    EXPECT_EQ((*out)[0].sharding().spec(), ux);
    EXPECT_THAT(step.as_text(), ::testing::Not(HasSubstr("all_reduce")));
    expect_near(summed((*out)[0]), want);

    EXPECT_THAT(refusal([&](const std::vector<Value>& in) { return at(reshard(in[0], ux), in[1]).add(in[2]); },
                        {op, ids, updates}),
                HasSubstr("scatter operand and updates must be unreduced along the same axes. Got operand sharding "
                          "f32[8,2]{U:x} and updates sharding f32[4,2]."));
    EXPECT_THAT(refusal(f, {op, put_on(mesh, idx, P("y")), updates}),
                HasSubstr("a scatter_add of unreduced values with split indices is not implemented"));
    // _scatter_unreduced_rule's first check: "scatter indices cannot be unreduced" (lax's
    // scatter_add: at().add would first wrap negative indices, a compare the nary rule refuses).
    EXPECT_THAT(refusal(
                    [&](const std::vector<Value>& in) {
                      return scatter_add(reshard(in[0], ux), reshard(in[1], P().with_unreduced({"x"})),
                                         reshard(in[2], ux), 0);
                    },
                    {op, ids, updates}),
                HasSubstr("scatter_add: scatter indices cannot be unreduced. Got indices sharding i32[4]{U:x}."));
  }
}

// tests/pjit_test.py, test_scatter_unreduced_fwd_reduced_bwd (its backward): the gradients of a
// weighted sum of op.at[idx].add(upd), operand and updates unreduced over 'x', summed by a reshard
// to P(). The updates' cotangent, the cotangent's rows gathered (slicing.py's
// _scatter_add_transpose_rule), is the cotangent of unreduced values: reduced, laid out as
// replicated (JAX's grad_upd is P(None, None, reduced={'x'})), so no sum runs in the program (laid
// out as the unreduced updates, it would be summed again by an all_reduce). Host reference:
// d/d table = w, d/d updates[k] = w[idx[k]] (every index in range).
TEST_F(ExplicitReducedTest, GradOfScatterAddOfUnreducedValuesRunsNoSumAndIsTheHostsAsJax) {
  const HostArray table = random_f32({8, 2}, 23);
  const HostArray upd = random_f32({4, 2}, 24);
  const HostArray weights = random_f32({8, 2}, 25);
  const std::vector<int32_t> rows = {1, 3, 5, 5};
  const HostArray idx = HostArray::from_vector<int32_t>({4}, rows);
  const std::vector<double> want_table = values_of(weights);
  std::vector<double> want_upd;
  for (int32_t r : rows) {
    for (int j = 0; j < 2; ++j) want_upd.push_back(want_table[r * 2 + j]);
  }
  const PartitionSpec ux = P(None, None).with_unreduced({"x"});
  for (const Mesh& mesh : meshes()) {
    SCOPED_TRACE(mesh.to_string());
    Jitted step = jit(grad(
        [&](const std::vector<Value>& in) {
          const Value y = at(reshard(in[0], ux), in[1]).add(reshard(in[2], ux));
          return std::vector<Value>{sum(reshard(y, P()) * in[3])};
        },
        {0, 2}));
    const absl::StatusOr<std::vector<Array>> g =
        step({put_on(mesh, table, P()), put_on(mesh, idx, P()), put_on(mesh, upd, P()), put_on(mesh, weights, P())});
    ASSERT_TRUE(g.ok()) << g.status();
    ASSERT_EQ(g->size(), 2u);
    EXPECT_THAT(step.as_text(), ::testing::Not(HasSubstr("all_reduce")));
    expect_near(fetch((*g)[0]), want_table);
    expect_near(fetch((*g)[1]), want_upd);
  }
}

// tests/pjit_test.py, test_reduced_at_get_out_sharding: params reduced over 'x' indexed by
// inputs split over 'x' with out_sharding P('x', None, None) (rewriting_take gathers under
// auto_axes): the result is laid out by out_sharding and equals params[inputs]; the gradient of
// params is P(None, None, unreduced={'x'}), summing to the host's counts of each row, with no
// all_reduce in the program (the transpose's scatter is laid out as the cotangent, JAX's
// _gather_transpose_fancy).
TEST_F(ExplicitReducedTest, AtGetWithOutShardingOfAReducedTableAsJax) {
  const HostArray params = random_f32({16, 4}, 16);
  std::vector<int32_t> picks(4 * 2);
  for (size_t k = 0; k < picks.size(); ++k) picks[k] = static_cast<int32_t>((k * 5 + 3) % 16);
  const HostArray inputs = HostArray::from_vector<int32_t>({4, 2}, picks);
  const auto [want, counts] = gathered_rows_and_counts(params, picks, 4);
  for (const Mesh& mesh : meshes()) {
    SCOPED_TRACE(mesh.to_string());
    const Array p = put_on(mesh, params, P(None, None).with_reduced({"x"}));
    const Array i = put_on(mesh, inputs, P("x", None));
    auto f = [](const std::vector<Value>& in) { return at(in[0], in[1]).get(P("x", None, None)); };
    const absl::StatusOr<Array> out = run1(f, {p, i});
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->sharding().spec(), P("x", None, None));
    expect_near(fetch(*out), want);
    Jitted step = jit(grad([&](const std::vector<Value>& in) { return std::vector<Value>{sum(f(in))}; }, {0}));
    absl::StatusOr<std::vector<Array>> g = step({p, i});
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ((*g)[0].sharding().spec(), P(None, None).with_unreduced({"x"}));
    // Each device adds its rows' terms and the result is laid out unreduced as they are: no
    // sum runs (before, the scatter was laid out reduced, an all_reduce, and then unreduced).
    EXPECT_THAT(step.as_text(), ::testing::Not(HasSubstr("all_reduce")));
    expect_near(summed((*g)[0]), counts);
  }
}

// tests/pjit_test.py, test_cond_fori_reduced_fwd: a fori_loop whose carries are typed reduced over
// 'x' and whose body is a cond giving either k and v resharded reduced or its carries. A carry
// keeps its type through the loop and the branches agree on theirs (loops.py's _check_carry_type
// and conditionals.py's _check_branch_outputs compare them with core.typematch, which in explicit
// mode compares the whole sharding, reduced axes included), so the results are typed
// f32[8]{R:x} and leave jit reduced. Values against the host: k and v when the predicate holds,
// else the initial carries doubled three times. JAX's test also takes the gradient (it only
// checks that it does not crash): here it is checked against the host.
TEST_F(ExplicitReducedTest, ForiLoopAndCondKeepReducedCarriesAsJax) {
  const HostArray hk = random_f32({8}, 21), hv = random_f32({8}, 22), h0 = random_f32({8}, 23),
                  h1 = random_f32({8}, 24);
  const PartitionSpec reduced = P(None).with_reduced({"x"});
  auto f = [&](const std::vector<Value>& in, std::vector<std::string>* types) {
    // in: the predicate, the two initial carries, k, v.
    std::vector<Value> out =
        fori_loop(0, 3,
                  [&](const Value&, const std::vector<Value>& kv) {
                    std::vector<Value> r = cond(
                        in[0],
                        [&](const std::vector<Value>&) {
                          return std::vector<Value>{reshard(in[3], reduced), reshard(in[4], reduced)};
                        },
                        [](const std::vector<Value>& c) {
                          return std::vector<Value>{c[0] * 2.0, c[1] * 2.0};
                        },
                        kv);
                    if (types != nullptr && types->empty()) types->push_back(type_of(r[0]).to_string());
                    return r;
                  },
                  {in[1], in[2]});
    if (types != nullptr) types->push_back(type_of(out[0]).to_string());
    return out;
  };
  for (const Mesh& mesh : meshes()) {
    SCOPED_TRACE(mesh.to_string());
    const std::vector<Array> kv = {put_on(mesh, h0, reduced), put_on(mesh, h1, reduced), put_on(mesh, hk, P("x")),
                                   put_on(mesh, hv, P("x"))};
    for (const int32_t p : {1, 0}) {
      SCOPED_TRACE(absl::StrCat("predicate ", p));
      std::vector<Array> args = {put_on(mesh, HostArray::from_vector<int32_t>({}, {p}), P())};
      args.insert(args.end(), kv.begin(), kv.end());
      std::vector<std::string> types;
      absl::StatusOr<std::vector<Array>> y = jit([&](const std::vector<Value>& in) { return f(in, &types); })(args);
      ASSERT_TRUE(y.ok()) << y.status();
      EXPECT_EQ(types, (std::vector<std::string>{"f32[8]{R:x}", "f32[8]{R:x}"}));
      for (int j = 0; j < 2; ++j) {
        EXPECT_EQ((*y)[j].sharding().spec(), reduced);
        std::vector<double> want = values_of(p != 0 ? (j == 0 ? hk : hv) : (j == 0 ? h0 : h1));
        if (p == 0) {
          for (double& w : want) w *= 8.0;
        }
        expect_near(fetch((*y)[j]), want);
      }
      // d sum(k result) / d (initial k carry, k): 8 and 0, or 0 and 1. The initial carry's is the
      // cotangent of a reduced value, unreduced over 'x' (sharding-ad.md), summed here.
      absl::StatusOr<std::vector<Array>> g = jit(
          grad([&](const std::vector<Value>& in) { return std::vector<Value>{sum(f(in, nullptr)[0])}; }, {1, 3}))(args);
      ASSERT_TRUE(g.ok()) << g.status();
      EXPECT_EQ((*g)[0].sharding().spec(), P(None).with_unreduced({"x"}));
      expect_near(summed((*g)[0]), std::vector<double>(8, p != 0 ? 0.0 : 8.0));
      EXPECT_EQ((*g)[1].sharding().spec(), P("x"));
      expect_near(fetch((*g)[1]), std::vector<double>(8, p != 0 ? 1.0 : 0.0));
    }
  }
}

// scan's rows keep their xs's reduced axes (core.py's _map_shaped_array updates only the
// partitions of the scanned dimension's type) and the stacked ys the body's
// (_unmap_shaped_array), its carries their own; while_loop's carries keep theirs. Values against
// the host: the carry is the initial one plus every row, the ys each row doubled, and the while
// loop doubles its carry three times.
TEST_F(ExplicitReducedTest, ScanRowsYsAndWhileCarriesKeepReducedAxesAsJax) {
  const HostArray hx = random_f32({4, 6}, 25), hc = random_f32({6}, 26);
  std::vector<double> carry = values_of(hc), ys = values_of(hx), doubled = values_of(hc);
  for (int r = 0; r < 4; ++r) {
    for (int j = 0; j < 6; ++j) carry[j] += hx.values<float>()[r * 6 + j];
  }
  for (double& v : ys) v *= 2.0;
  for (double& v : doubled) v *= 8.0;
  for (const Mesh& mesh : meshes()) {
    SCOPED_TRACE(mesh.to_string());
    std::vector<std::string> types;
    absl::StatusOr<std::vector<Array>> y = jit([&](const std::vector<Value>& in) {
      ScanResult s = scan(
          [&](const std::vector<Value>& c, const std::vector<Value>& row) {
            types.push_back(type_of(row[0]).to_string());
            return ScanStep{{c[0] + row[0]}, {row[0] * 2.0}};
          },
          {in[1]}, {in[0]});
      std::vector<Value> w = while_loop([](const std::vector<Value>& c) { return c[0] < full({}, 3, DType::kI32); },
                                        [](const std::vector<Value>& c) {
                                          return std::vector<Value>{c[0] + 1, c[1] * 2.0};
                                        },
                                        {full({}, 0, DType::kI32), in[1]});
      for (const Value& v : {s.carry[0], s.ys[0], w[1]}) types.push_back(type_of(v).to_string());
      return std::vector<Value>{s.carry[0], s.ys[0], w[1]};
    })({put_on(mesh, hx, P(None, None).with_reduced({"y"})), put_on(mesh, hc, P(None).with_reduced({"y"}))});
    ASSERT_TRUE(y.ok()) << y.status();
    EXPECT_EQ(types, (std::vector<std::string>{"f32[6]{R:y}", "f32[6]{R:y}", "f32[4,6]{R:y}", "f32[6]{R:y}"}));
    EXPECT_EQ((*y)[1].sharding().spec(), P(None, None).with_reduced({"y"}));
    expect_near(fetch((*y)[0]), carry);
    expect_near(fetch((*y)[1]), ys);
    expect_near(fetch((*y)[2]), doubled);
  }
}

// JAX's refusals: a carry given back with other reduced or unreduced axes than it got is
// loops.py's _check_carry_type error, and branches whose outputs differ in them
// conditionals.py's _check_branch_outputs error (core.typematch compares the whole sharding;
// aval_mismatch_extra says nothing more of a sharding difference). A switch on an unreduced
// index is refused too (JAX's lax.switch clamps its index first, which has no ur_rule).
TEST_F(ExplicitReducedTest, CarriesAndBranchesOfOtherReducedAxesAreRefusedAsJax) {
  const HostArray h = random_f32({8}, 27);
  const Mesh mesh = meshes()[0];
  const Array r = put_on(mesh, h, P(None).with_reduced({"x"}));
  EXPECT_EQ(
      refusal(
          [](const std::vector<Value>& in) {
            return first(fori_loop(
                0, 2, [](const Value&, const std::vector<Value>& c) { return std::vector<Value>{reshard(c[0], P())}; },
                {in[0]}));
          },
          {r}),
      "scan body function carry input and carry output must have equal types, but they differ:\n\n"
      "The input carry at path [1] has type f32[8]{R:x} but the corresponding output carry component has type "
      "f32[8].\n\nRevise the function so that all output types match the corresponding input types.");
  EXPECT_EQ(refusal(
                [](const std::vector<Value>& in) {
                  return first(while_loop([](const std::vector<Value>& c) { return sum(c[0]) > 0.0; },
                                          [](const std::vector<Value>& c) {
                                            return std::vector<Value>{reshard(c[0], P(None).with_unreduced({"x"}))};
                                          },
                                          {reshard(in[0], P())}));
                },
                {r}),
            "while_loop body function carry input and carry output must have equal types, but they differ:\n\n"
            "The input carry at path [0] has type f32[8] but the corresponding output carry component has type "
            "f32[8]{U:x}.\n\nRevise the function so that all output types match the corresponding input types.");
  EXPECT_EQ(refusal(
                [](const std::vector<Value>& in) {
                  return first(cond(
                      sum(in[0]) > 0.0, [](const std::vector<Value>& c) { return std::vector<Value>{c[0] * 2.0}; },
                      [](const std::vector<Value>& c) { return std::vector<Value>{reshard(c[0], P())}; }, {in[0]}));
                },
                {r}),
            "cond branches must have equal output types but they differ.\n\n"
            "The output of true_fun at path [0] has type f32[8]{R:x} but the corresponding output of false_fun has "
            "type f32[8].\n\nRevise true_fun and/or false_fun so that all output types match.");
  EXPECT_THAT(
      refusal(
          [](const std::vector<Value>& in) {
            const Value i = reshard(full({}, 1, DType::kI32), P().with_unreduced({"x"}));
            return first(switch_(i,
                                 {[](const std::vector<Value>& c) { return c; },
                                  [](const std::vector<Value>& c) { return std::vector<Value>{c[0] * 2.0}; }},
                                 {in[0]}));
          },
          {put_on(mesh, h, P())}),
      ::testing::AllOf(HasSubstr("switch: the index is unreduced"), HasSubstr("(operands i32[]{U:x}, f32[8])")));
}

// tests/pjit_test.py, test_minibatch_scan_unreduced: gradients accumulated over microbatches in a
// scan carry typed unreduced over 'x' (each microbatch's contraction over its rows split over
// 'x' is unreduced, out_sharding P(unreduced={'x'})), the carry stays unreduced through the loop
// and the sum over 'x' runs once, at the reshard after it: one all_reduce for it in the program,
// as JAX's compiled text has. Each microbatch's contraction is also stacked as an unreduced ys
// (core.py's _unmap_shaped_array keeps the axes), summed by its own reshard: still one all_reduce
// instruction in the program (the two sums combine). Values against the host: the sum over
// microbatches of xsᵀ·xs, and each one's.
TEST_F(ExplicitReducedTest, AScanCarryTypedUnreducedAccumulatesWithOneAllReduceAsJax) {
  const HostArray hx = random_f32({3, 8, 4}, 28);
  std::vector<double> want(16, 0.0), per_batch(3 * 16, 0.0);
  for (int b = 0; b < 3; ++b) {
    for (int i = 0; i < 4; ++i) {
      for (int j = 0; j < 4; ++j) {
        for (int r = 0; r < 8; ++r) {
          const double t = hx.values<float>()[(b * 8 + r) * 4 + i] * hx.values<float>()[(b * 8 + r) * 4 + j];
          want[i * 4 + j] += t;
          per_batch[b * 16 + i * 4 + j] += t;
        }
      }
    }
  }
  const PartitionSpec unreduced = P(None, None).with_unreduced({"x"});
  for (const Mesh& mesh : meshes()) {
    SCOPED_TRACE(mesh.to_string());
    std::vector<std::string> types;
    Jitted f = jit([&](const std::vector<Value>& in) {
      const Value acc = reshard(full({4, 4}, 0.0), unreduced);
      ScanResult s = scan(
          [&](const std::vector<Value>& c, const std::vector<Value>& row) {
            const Value g = matmul(transpose(row[0], {1, 0}), row[0], unreduced);
            const Value next = c[0] + g;
            for (const Value& v : {c[0], g, next}) types.push_back(type_of(v).to_string());
            return ScanStep{{next}, {g}};
          },
          {acc}, {in[0]});
      types.push_back(type_of(s.carry[0]).to_string());
      types.push_back(type_of(s.ys[0]).to_string());
      return std::vector<Value>{reshard(s.carry[0], P()), reshard(s.ys[0], P())};
    });
    absl::StatusOr<std::vector<Array>> y = f({put_on(mesh, hx, P(None, "x", None))});
    ASSERT_TRUE(y.ok()) << y.status();
    std::vector<std::string> want_types(4, "f32[4,4]{U:x}");
    want_types.push_back("f32[3,4,4]{U:x}");
    EXPECT_EQ(types, want_types);
    expect_near(fetch((*y)[0]), want, 1e-4);
    expect_near(fetch((*y)[1]), per_batch, 1e-4);
    EXPECT_EQ(jit_support::all_reduce_count(f.as_text()), 1u) << f.as_text();
  }
}

// A cond's results are its branches' output types, unreduced axes included
// (conditionals.py's _cond_abstract_eval returns branches[0].out_avals), and a while_loop's carry
// keeps its type: a contraction both branches leave unreduced over 'x' stays pending out of the
// cond and through the loop (which doubles it twice), and the sum runs once, at the reshard
// after. Values against the host: 4·xᵀx, or 8·xᵀx when the predicate is false.
TEST_F(ExplicitReducedTest, UnreducedBranchOutputsAndWhileCarriesStayPendingAsJax) {
  const HostArray hx = random_f32({8, 4}, 29);
  std::vector<double> gram(16, 0.0);
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 4; ++j) {
      for (int r = 0; r < 8; ++r) gram[i * 4 + j] += hx.values<float>()[r * 4 + i] * hx.values<float>()[r * 4 + j];
    }
  }
  const PartitionSpec unreduced = P(None, None).with_unreduced({"x"});
  for (const Mesh& mesh : meshes()) {
    SCOPED_TRACE(mesh.to_string());
    for (const int32_t p : {1, 0}) {
      std::vector<std::string> types;
      Jitted f = jit([&](const std::vector<Value>& in) {
        const Value g = first(cond(
            in[0],
            [&](const std::vector<Value>& c) {
              return std::vector<Value>{matmul(transpose(c[0], {1, 0}), c[0], unreduced)};
            },
            [&](const std::vector<Value>& c) {
              return std::vector<Value>{matmul(transpose(c[0], {1, 0}), c[0] * 2.0, unreduced)};
            },
            {in[1]}));
        const std::vector<Value> w =
            while_loop([](const std::vector<Value>& c) { return c[0] < full({}, 2, DType::kI32); },
                       [](const std::vector<Value>& c) {
                         return std::vector<Value>{c[0] + 1, c[1] + c[1]};
                       },
                       {full({}, 0, DType::kI32), g});
        types = {type_of(g).to_string(), type_of(w[1]).to_string()};
        return std::vector<Value>{reshard(w[1], P())};
      });
      absl::StatusOr<std::vector<Array>> y =
          f({put_on(mesh, HostArray::from_vector<int32_t>({}, {p}), P()), put_on(mesh, hx, P("x", None))});
      ASSERT_TRUE(y.ok()) << y.status();
      EXPECT_EQ(types, (std::vector<std::string>{"f32[4,4]{U:x}", "f32[4,4]{U:x}"}));
      std::vector<double> want = gram;
      for (double& v : want) v *= p != 0 ? 4.0 : 8.0;
      expect_near(fetch((*y)[0]), want, 1e-4);
      EXPECT_EQ(jit_support::all_reduce_count(f.as_text()), 1u) << f.as_text();
    }
  }
}

// Reduced and unreduced types in shard_map bodies (issue 16 items 2 and 5): the manual axes a
// body value is unreduced or reduced over (JAX's ManualAxisType, jax/_src/core.py), set by the
// in_specs and checked against the out_specs (jax/_src/shard_map.py's _shard_shaped_array and
// _unshard_shaped_array), and the collectives' rules (jax/_src/lax/parallel.py).

// (rows x inner) @ (inner x cols) on the host.
std::vector<double> host_matmul(const HostArray& a, const HostArray& b, int64_t rows, int64_t inner, int64_t cols) {
  std::vector<double> out(static_cast<size_t>(rows * cols), 0.0);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t k = 0; k < inner; ++k) {
      for (int64_t j = 0; j < cols; ++j) {
        out[i * cols + j] += a.values<float>()[i * inner + k] * b.values<float>()[k * cols + j];
      }
    }
  }
  return out;
}

// tests/shard_map_test.py's test_unreduced_psum_fwd_preduced_bwd: a contraction left unreduced
// over 'x' (einsum's out_sharding P(unreduced={'x'})) enters a shard_map with in_specs
// P(unreduced={'x'}): each device's block is its term, typed f32[2,6]{U:x}, and psum over 'x'
// sums the terms into the product (typed f32[2,6], out_specs P()). Its gradients are laid out as
// the arguments and are the host's. psum_scatter sums them too, scattered
// (test_unreduced_psum_scatter_fwd_all_gather_reduced_bwd: out_specs P('x', None)). Values
// against the host's product on both meshes (a psum of terms already summed would give n times
// it).
TEST_F(ExplicitReducedTest, ShardMapTakesUnreducedArgumentsAndPsumSumsThemAsJax) {
  const HostArray a = random_f32({2, 4}, 31), b = random_f32({4, 6}, 32);
  const std::vector<double> product = host_matmul(a, b, 2, 4, 6);
  // d sum(a @ b) / da = ones @ b^T (row sums of b); / db = a^T @ ones (column sums of a).
  std::vector<double> da(8), db(24);
  for (int i = 0; i < 2; ++i) {
    for (int k = 0; k < 4; ++k) {
      double row = 0;
      for (int j = 0; j < 6; ++j) row += b.values<float>()[k * 6 + j];
      da[i * 4 + k] = row;
    }
  }
  for (int k = 0; k < 4; ++k) {
    for (int j = 0; j < 6; ++j) db[k * 6 + j] = a.values<float>()[k] + a.values<float>()[4 + k];
  }
  for (const Mesh& mesh : meshes()) {
    SCOPED_TRACE(mesh.to_string());
    const Array x = put_on(mesh, a, P(None, "x")), y = put_on(mesh, b, P("x", None));
    std::string inside, summed_type;
    const ShardMapped ar = shard_map(
        [&](const std::vector<Value>& in) {
          inside = type_of(in[0]).to_string();
          Value out = psum(in[0], "x");
          summed_type = type_of(out).to_string();
          return std::vector<Value>{out};
        },
        mesh, {P().with_unreduced({"x"})}, {P()});
    auto f = [&](const std::vector<Value>& in) {
      return ar({einsum("ab,bc->ac", in[0], in[1], P().with_unreduced({"x"}))});
    };
    absl::StatusOr<std::vector<Array>> out = jit(f)({x, y});
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(inside, "f32[2,6]{U:x}");
    EXPECT_EQ(summed_type, "f32[2,6]");
    expect_near(fetch((*out)[0]), product, 1e-4);
    absl::StatusOr<std::vector<Array>> g =
        jit(grad([&](const std::vector<Value>& in) { return std::vector<Value>{sum(f(in)[0])}; }, {0, 1}))({x, y});
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ((*g)[0].sharding().spec(), P(None, "x"));
    EXPECT_EQ((*g)[1].sharding().spec(), P("x", None));
    expect_near(fetch((*g)[0]), da, 1e-4);
    expect_near(fetch((*g)[1]), db, 1e-4);

    const HostArray b8 = random_f32({4, 8}, 33);
    const ShardMapped rs =
        shard_map([&](const std::vector<Value>& in) { return std::vector<Value>{psum_scatter(in[0], "x", 1, true)}; },
                  mesh, {P().with_unreduced({"x"})}, {P(None, "x")});
    absl::StatusOr<std::vector<Array>> scattered = jit([&](const std::vector<Value>& in) {
      return rs({einsum("ab,bc->ac", in[0], in[1], P().with_unreduced({"x"}))});
    })({x, put_on(mesh, b8, P("x", None))});
    ASSERT_TRUE(scattered.ok()) << scattered.status();
    EXPECT_EQ((*scattered)[0].sharding().spec(), P(None, "x"));
    expect_near(fetch((*scattered)[0]), host_matmul(a, b8, 2, 4, 8), 1e-4);
  }
}

// The refusals, each with JAX's words: an in_spec whose unreduced axes are not its argument's
// (_shard_shaped_array), an out_spec whose unreduced axes are not its result's
// (_unshard_shaped_array; test_matmul_unreduced_error), sin of an unreduced value
// (test_sin_unreduced_error), all_gather, ppermute and all_to_all over an unreduced axis (the
// pvary JAX inserts first: check_unreduced_args) and pmax of one (check_unreduced_kind), psum over an unreduced and an
// invarying axis at once (_get_from), and unreduced in_specs on a mesh whose axes are Auto or in a body not manual over
// every axis (_check_unreduced; test_shmap_auto_unreduced_error).
TEST_F(ExplicitReducedTest, UnreducedShardMapSpecsAndCollectivesAreRefusedAsJax) {
  const HostArray a = random_f32({2, 4}, 41), b = random_f32({4, 6}, 42);
  const Mesh mesh = meshes()[0];
  const Array x = put_on(mesh, a, P(None, "x")), y = put_on(mesh, b, P("x", None));
  const auto refused = [&](const std::function<Value(const Value&)>& body, const PartitionSpec& in,
                           const PartitionSpec& out) {
    const ShardMapped m =
        shard_map([&](const std::vector<Value>& v) { return std::vector<Value>{body(v[0])}; }, mesh, {in}, {out});
    return refusal(
        [&](const std::vector<Value>& v) { return m({einsum("ab,bc->ac", v[0], v[1], P().with_unreduced({"x"}))})[0]; },
        {x, y});
  };
  const PartitionSpec unreduced = P().with_unreduced({"x"});
  const auto same = [](const Value& v) { return v; };
  EXPECT_THAT(refused(same, P(), P()),
              HasSubstr("in_specs containing unreduced P() passed to shard_map should be equal to the unreduced "
                        "present on the in_aval f32[2,6]{U:x}"));
  EXPECT_THAT(refused(same, unreduced, P()),
              HasSubstr("output 0: out_specs passed to shard_map should be equal to the unreduced present on the "
                        "out_aval. Got out_specs=P() and out_aval=f32[2,6]{U:x}"));
  EXPECT_THAT(refused([](const Value& v) { return sin(v); }, unreduced, P()),
              HasSubstr("sin: unreduced rule for sin is not implemented"));
  // all_gather, ppermute and all_to_all (and psum and its kin of a reduced value) first cast x to
  // varying along the axes it does not vary along (jax/_src/lax/parallel.py's
  // insert_collective_pvary; psum's bind_psum_invariant), so pvary's check_unreduced_args
  // refuses, in its words.
  EXPECT_THAT(refused([](const Value& v) { return all_gather(v, "x", 0, true); }, unreduced, P()),
              HasSubstr("all_gather(f32[2,6], 'x'): pvary cannot accept args which are unreduced. Got f32[2,6]{U:x} "
                        "and axes={'x'}"));
  EXPECT_THAT(refused(
                  [](const Value& v) {
                    return ppermute(v, "x", {{0, 1}, {1, 0}});
                  },
                  unreduced, P()),
              HasSubstr("ppermute(f32[2,6], 'x'): pvary cannot accept args which are unreduced. Got f32[2,6]{U:x} "
                        "and axes={'x'}"));
  EXPECT_THAT(refused([](const Value& v) { return all_to_all(reshape(v, {12}), "x", 0, 0, true); }, unreduced, P()),
              HasSubstr("all_to_all(f32[12], 'x'): pvary cannot accept args which are unreduced. Got f32[12]{U:x} "
                        "and axes={'x'}"));
  const auto reduced = [](const Value& v) { return pcast(psum(v, "x"), "x", "reduced"); };
  EXPECT_THAT(refused([&](const Value& v) { return psum(reduced(v), "x"); }, unreduced, P()),
              HasSubstr("psum(f32[2,6], 'x'): pvary cannot accept args which are reduced. Got f32[2,6]{R:x} and "
                        "axes={'x'}"));
  EXPECT_THAT(refused([&](const Value& v) { return pmax(reduced(v), "x"); }, unreduced, P()),
              HasSubstr("pmax(f32[2,6], 'x'): pvary cannot accept args which are reduced"));
  EXPECT_THAT(refused([&](const Value& v) { return all_gather(reduced(v), "x", 0, true); }, unreduced, P()),
              HasSubstr("all_gather(f32[2,6], 'x'): pvary cannot accept args which are reduced"));
  EXPECT_THAT(refused([](const Value& v) { return pmax(v, "x"); }, unreduced, P()),
              HasSubstr("unreduced_pmax cannot accept args with unreduced_kind=sum. Expected unreduced_kind=max"));
  EXPECT_THAT(refused(
                  [](const Value& v) {
                    return psum(v, {"x", "y"});
                  },
                  unreduced, P()),
              HasSubstr("jax.lax.psum can only accept axis_name which corresponds to one of varying, unreduced, "
                        "reduced or invarying state of the input. Got input type: f32[2,6]{U:x}, axes: ('x', 'y') "
                        "and input state: {'invarying', 'unreduced'}"));
  // test_matmul_unreduced_error: out_specs unreduced over 'y' on a result that is not.
  const ShardMapped not_unreduced =
      shard_map([](const std::vector<Value>& v) { return std::vector<Value>{v[0] * 2.0}; }, mesh, {P("x", None)},
                {P("x", None).with_unreduced({"y"})});
  EXPECT_THAT(refusal([&](const std::vector<Value>& v) { return not_unreduced({v[0]})[0]; },
                      {put_on(mesh, random_f32({8, 2}, 43), P("x", None))}),
              HasSubstr("out_specs passed to shard_map should be equal to the unreduced present on the out_aval. Got "
                        "out_specs=P('x', None, unreduced={'y'}, unreduced_kind=sum) and out_aval=f32[2,2]"));

  // test_shmap_auto_unreduced_error, on Auto axes and with axis_names.
  absl::StatusOr<Mesh> auto_mesh = client_->make_mesh({4, 2}, {"x", "y"}, {AxisType::kAuto, AxisType::kAuto});
  ASSERT_TRUE(auto_mesh.ok()) << auto_mesh.status();
  const Array v = put_on(*auto_mesh, random_f32({8}, 44), P());
  const auto identity = [](const std::vector<Value>& in) { return in; };
  absl::StatusOr<std::vector<Array>> on_auto = shard_map(identity, *auto_mesh, {unreduced}, {P()})({v});
  EXPECT_EQ(on_auto.status().code(), absl::StatusCode::kInvalidArgument) << on_auto.status();
  EXPECT_THAT(on_auto.status().message(),
              HasSubstr("unreduced in in_specs P(unreduced={'x'}, unreduced_kind=sum) can only be used when the mesh "
                        "passed to shard_map contains axis names all of type `Explicit`"));
  ShardMapOptions partial;
  partial.axis_names = {"x"};
  absl::StatusOr<std::vector<Array>> partial_manual = shard_map(identity, *auto_mesh, {unreduced}, {P()}, partial)({v});
  EXPECT_EQ(partial_manual.status().code(), absl::StatusCode::kUnimplemented) << partial_manual.status();
  EXPECT_THAT(partial_manual.status().message(),
              HasSubstr("unreduced/reduced can only be passed to in_specs when shard_map is in full manual mode"));
  // _check_unreduced prints the manual axes, a frozenset, as Python does.
  EXPECT_THAT(partial_manual.status().message(), HasSubstr("manual_axes: frozenset({'x'}), specs: "));
}

// An out_spec may keep a body result unreduced (_unshard_shaped_array: the result is typed by
// the out_spec; test_matmul_full_unreduced_out's sharding P(None, None, unreduced={'x'})): the
// blocks leave as the terms of a sum pending over 'x', with no collective; `v + v` of an
// unreduced value is unreduced alike (_add_ur_rule). Resharded to P() it is twice the host's
// product.
TEST_F(ExplicitReducedTest, ShardMapOutSpecsKeepUnreducedResultsPendingAsJax) {
  const HostArray a = random_f32({2, 4}, 51), b = random_f32({4, 6}, 52);
  std::vector<double> twice = host_matmul(a, b, 2, 4, 6);
  for (double& e : twice) e *= 2;
  for (const Mesh& mesh : meshes()) {
    SCOPED_TRACE(mesh.to_string());
    const PartitionSpec unreduced = P().with_unreduced({"x"});
    const ShardMapped doubled = shard_map(
        [](const std::vector<Value>& in) { return std::vector<Value>{in[0] + in[0]}; }, mesh, {unreduced}, {unreduced});
    Jitted f = jit([&](const std::vector<Value>& in) {
      return doubled({einsum("ab,bc->ac", in[0], in[1], P().with_unreduced({"x"}))});
    });
    absl::StatusOr<std::vector<Array>> out = f({put_on(mesh, a, P(None, "x")), put_on(mesh, b, P("x", None))});
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ((*out)[0].sharding().spec(), P(None, None).with_unreduced({"x"}));
    EXPECT_EQ(type_of((*out)[0]).to_string(), "f32[2,6]{U:x}");
    EXPECT_EQ(jit_support::all_reduce_count(f.as_text()), 0u);
    expect_near(summed((*out)[0]), twice, 1e-4);
    // grad of sum(reshard(doubled(a @ b), P())) by a: 2 (ones @ b^T), each row b's row sums.
    absl::StatusOr<std::vector<Array>> g = jit(grad(
        [&](const std::vector<Value>& in) {
          return std::vector<Value>{
              sum(reshard(doubled({einsum("ab,bc->ac", in[0], in[1], P().with_unreduced({"x"}))})[0], P(None, None)))};
        },
        {0}))({put_on(mesh, a, P(None, "x")), put_on(mesh, b, P("x", None))});
    ASSERT_TRUE(g.ok()) << g.status();
    std::vector<double> da(8);
    for (int i = 0; i < 2; ++i) {
      for (int k = 0; k < 4; ++k) {
        double row = 0;
        for (int j = 0; j < 6; ++j) row += b.values<float>()[k * 6 + j];
        da[i * 4 + k] = 2 * row;
      }
    }
    expect_near(fetch((*g)[0]), da, 1e-4);
  }
}

// Reduced in_specs (tests/shard_map_test.py): the body's parameter is typed reduced
// (f32[2,6]{R:x}); where it meets a value varying along 'x' it is cast to varying first
// (core.py's auto_insert_reshard inserts reduced_vary_cast: test_reduced_vary_automatically_inserted,
// jnp.dot(x, y)), so mul and add of a split and a reduced operand, then a psum, are the host's
// (test_one_input_sharded_another_reduced_shmap); the gradient of the reduced argument is
// unreduced over 'x' (P(None, None, unreduced={'x'})) and sums to the host's. An out_spec
// P(reduced={'x'}) takes `x * x` of a reduced x (test_shmap_bwd_rep_to_unreduced_check_vma_true:
// in_specs inferred from the argument's type; the gradient P(None, unreduced={'x'})).
TEST_F(ExplicitReducedTest, ShardMapTakesReducedArgumentsAsJax) {
  const HostArray a = random_f32({8, 2}, 61), b = random_f32({2, 6}, 62);
  const std::vector<double> product = host_matmul(a, b, 8, 2, 6);
  // d sum(a @ b) / db = a^T @ ones: column sums of a, on each of b's rows.
  std::vector<double> db(12);
  for (int k = 0; k < 2; ++k) {
    double col = 0;
    for (int i = 0; i < 8; ++i) col += a.values<float>()[i * 2 + k];
    for (int j = 0; j < 6; ++j) db[k * 6 + j] = col;
  }
  for (const Mesh& mesh : meshes()) {
    SCOPED_TRACE(mesh.to_string());
    const Array x = put_on(mesh, a, P("x", None)), y = put_on(mesh, b, P(None, None).with_reduced({"x"}));
    std::string inside;
    const ShardMapped dot_map = shard_map(
        [&](const std::vector<Value>& in) {
          inside = type_of(in[1]).to_string();
          return std::vector<Value>{dot(in[0], in[1])};
        },
        mesh, {P("x", None), P(None, None).with_reduced({"x"})}, {P("x", None)});
    auto f = [&](const std::vector<Value>& in) { return dot_map({in[0], in[1]}); };
    absl::StatusOr<std::vector<Array>> out = jit(f)({x, y});
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(inside, "f32[2,6]{R:x}");
    EXPECT_EQ((*out)[0].sharding().spec(), P("x", None));
    expect_near(fetch((*out)[0]), product, 1e-4);
    absl::StatusOr<std::vector<Array>> g =
        jit(grad([&](const std::vector<Value>& in) { return std::vector<Value>{sum(f(in)[0])}; }, {0, 1}))({x, y});
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ((*g)[0].sharding().spec(), P("x", None));
    EXPECT_EQ((*g)[1].sharding().spec(), P(None, None).with_unreduced({"x"}));
    expect_near(summed((*g)[1]), db, 1e-4);

    // mul and add of a split operand and a reduced one, then psum over 'x': the sum over the
    // devices along 'x' of f(block, y).
    const int64_t n = mesh.axis_size("x");
    const HostArray h16 = random_f32({16}, 63), hy = random_f32({16 / n}, 64);
    for (const bool add : {false, true}) {
      SCOPED_TRACE(add ? "add" : "mul");
      std::vector<double> want(static_cast<size_t>(16 / n), 0.0);
      for (int64_t d = 0; d < n; ++d) {
        for (int64_t i = 0; i < 16 / n; ++i) {
          const double u = h16.values<float>()[d * (16 / n) + i], w = hy.values<float>()[i];
          want[i] += add ? u + w : u * w;
        }
      }
      const ShardMapped m = shard_map(
          [&](const std::vector<Value>& in) {
            return std::vector<Value>{psum(add ? in[0] + in[1] : in[0] * in[1], "x")};
          },
          mesh, {P("x"), P(None).with_reduced({"x"})}, {P()});
      absl::StatusOr<std::vector<Array>> z = jit([&](const std::vector<Value>& in) { return m(in); })(
          {put_on(mesh, h16, P("x")), put_on(mesh, hy, P(None).with_reduced({"x"}))});
      ASSERT_TRUE(z.ok()) << z.status();
      expect_near(fetch((*z)[0]), want, 1e-4);
    }
  }
  // Reduced out: x * x of a reduced x, in_specs inferred, on the mesh ('x': 8) of JAX's test
  // and on the two meshes whose 'y' the out_spec leaves out.
  absl::StatusOr<Mesh> line = client_->make_mesh({8}, {"x"}, {AxisType::kExplicit});
  ASSERT_TRUE(line.ok()) << line.status();
  std::vector<Mesh> all = meshes();
  all.push_back(*line);
  const HostArray h8 = random_f32({8}, 65);
  std::vector<double> want_sq, want_g;
  for (float e : h8.values<float>()) {
    want_sq.push_back(double{e} * e);
    want_g.push_back(2.0 * e);
  }
  for (const Mesh& mesh : all) {
    SCOPED_TRACE(mesh.to_string());
    const Array r = put_on(mesh, h8, P().with_reduced({"x"}));
    absl::StatusOr<ShardMapped> squared = [&] {
      MeshScope scope = set_mesh(mesh);
      return shard_map([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * in[0]}; }, {},
                       {P().with_reduced({"x"})});
    }();
    ASSERT_TRUE(squared.ok()) << squared.status();
    absl::StatusOr<std::vector<Array>> sq = (*squared)({r});
    ASSERT_TRUE(sq.ok()) << sq.status();
    EXPECT_EQ((*sq)[0].sharding().spec(), P(None).with_reduced({"x"}));
    expect_near(fetch((*sq)[0]), want_sq, 1e-5);
    absl::StatusOr<std::vector<Array>> gsq =
        jit(grad([&](const std::vector<Value>& in) { return std::vector<Value>{sum((*squared)(in)[0])}; }))({r});
    ASSERT_TRUE(gsq.ok()) << gsq.status();
    EXPECT_EQ((*gsq)[0].sharding().spec(), P(None).with_unreduced({"x"}));
    expect_near(summed((*gsq)[0]), want_g, 1e-5);
  }
}

// The casts to unreduced and reduced axes (jax/_src/lax/parallel.py: pcast's _pcast_funcs,
// vary_unreduced_cast, preduced, all_gather_reduced), each an identity at runtime.

// A mesh of the first devices, every axis Explicit (jtu.with_explicit_mesh; make_mesh's default).
Mesh explicit_mesh(Client& client, const Shape& shape, const std::vector<std::string>& names) {
  absl::StatusOr<Mesh> mesh = client.make_mesh(shape, names);
  EXPECT_TRUE(mesh.ok()) << mesh.status();
  return *mesh;
}

// The gradients of sum(a @ b) on the host, a (rows x inner), b (inner x cols): d/da[i, k] is
// b's row sum k, d/db[k, j] is a's column sum k, each times `scale`.
std::pair<std::vector<double>, std::vector<double>> sum_matmul_grads(const HostArray& a, const HostArray& b,
                                                                     int64_t rows, int64_t inner, int64_t cols,
                                                                     double scale = 1.0) {
  std::vector<double> da(static_cast<size_t>(rows * inner)), db(static_cast<size_t>(inner * cols));
  for (int64_t k = 0; k < inner; ++k) {
    double row = 0, col = 0;
    for (int64_t j = 0; j < cols; ++j) row += b.values<float>()[k * cols + j];
    for (int64_t i = 0; i < rows; ++i) col += a.values<float>()[i * inner + k];
    for (int64_t i = 0; i < rows; ++i) da[i * inner + k] = scale * row;
    for (int64_t j = 0; j < cols; ++j) db[k * cols + j] = scale * col;
  }
  return {da, db};
}

double total(const std::vector<double>& v) {
  double s = 0;
  for (double e : v) s += e;
  return s;
}

// tests/shard_map_test.py's test_matmul_unreduced: on a (2, 2) mesh a block product varies
// along ('x', 'y'); pcast(c, 'y', to='unreduced') types it {V:x, U:y} and out_specs
// P('x', None, unreduced={'y'}) keeps each device's block as its term (JAX's expected shards
// [[2, 3]], [[26, 31]], [[10, 19]], [[66, 79]]); resharded to P('x', None) it is the host's
// product, and the gradients of its sum are laid out as the arguments and are the host's.
// test_pcast_to_unreduced: in_specs inferred; pcast over ('x', 'y') of a value varying along 'x'
// and unreduced over 'y' is refused with _get_from's words.
TEST_F(ExplicitReducedTest, PcastToUnreducedKeepsEachDevicesTermAsJax) {
  const Mesh mesh = explicit_mesh(*client_, {2, 2}, {"x", "y"});
  const HostArray a = HostArray::arange(DType::kF32, {2, 4}), b = HostArray::arange(DType::kF32, {4, 2});
  const Array x = put_on(mesh, a, P("x", "y")), y = put_on(mesh, b, P("y", None));
  std::string product_type, cast_type;
  const ShardMapped f = shard_map(
      [&](const std::vector<Value>& in) {
        const Value c = einsum("ab,bc->ac", in[0], in[1]);
        product_type = type_of(c).to_string();
        const Value u = pcast(c, "y", "unreduced");
        cast_type = type_of(u).to_string();
        return std::vector<Value>{u};
      },
      mesh, {P("x", "y"), P("y", None)}, {P("x", None).with_unreduced({"y"})});
  Jitted jf = jit([&](const std::vector<Value>& in) { return f(in); });
  absl::StatusOr<std::vector<Array>> out = jf({x, y});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(product_type, "f32[1,2]{V:(x,y)}");
  EXPECT_EQ(cast_type, "f32[1,2]{V:x, U:y}");
  EXPECT_EQ((*out)[0].shape(), (Shape{2, 2}));
  EXPECT_EQ((*out)[0].sharding().spec(), P("x", None).with_unreduced({"y"}));
  EXPECT_EQ(jit_support::all_reduce_count(jf.as_text()), 0u);
  const std::vector<std::vector<double>> shards = {{2, 3}, {26, 31}, {10, 19}, {66, 79}};
  const std::vector<Shard> got = (*out)[0].addressable_shards();
  ASSERT_EQ(got.size(), shards.size());
  for (size_t i = 0; i < got.size(); ++i) {
    absl::StatusOr<HostArray> block = got[i].data();
    ASSERT_TRUE(block.ok()) << block.status();
    EXPECT_EQ(block->shape(), (Shape{1, 2}));
    expect_near(*block, shards[i], 0);
  }
  absl::StatusOr<Array> whole = reshard((*out)[0], NamedSharding(mesh, P("x", None)));
  ASSERT_TRUE(whole.ok()) << whole.status();
  expect_near(fetch(*whole), host_matmul(a, b, 2, 4, 2), 0);

  absl::StatusOr<std::vector<Array>> g =
      jit(grad([&](const std::vector<Value>& in) { return std::vector<Value>{sum(reshard(f(in)[0], P("x", None)))}; },
               {0, 1}))({x, y});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*g)[0].sharding().spec(), P("x", "y"));
  EXPECT_EQ((*g)[1].sharding().spec(), P("y", None));
  const auto [da, db] = sum_matmul_grads(a, b, 2, 4, 2);
  expect_near(fetch((*g)[0]), da, 2e-4);
  expect_near(fetch((*g)[1]), db, 2e-4);

  // test_pcast_to_unreduced: (4, 2) @ (2, 4), in_specs inferred.
  const HostArray a2 = HostArray::arange(DType::kF32, {4, 2}), b2 = HostArray::arange(DType::kF32, {2, 4});
  const Array x2 = put_on(mesh, a2, P("x", "y")), y2 = put_on(mesh, b2, P("y", None));
  for (const bool then_reduced : {false, true}) {
    const ShardMapped m = shard_map(
        [then_reduced](const std::vector<Value>& in) {
          const Value u = pcast(dot(in[0], in[1]), "y", "unreduced");
          return std::vector<Value>{then_reduced ? pcast(u, AxisNames{"x", "y"}, "reduced") : u};
        },
        mesh, {}, {P("x").with_unreduced({"y"})});
    absl::StatusOr<std::vector<Array>> r = jit([&](const std::vector<Value>& in) { return m(in); })({x2, y2});
    if (then_reduced) {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
      EXPECT_THAT(r.status().message(),
                  HasSubstr("jax.lax.pcast can only accept axis_name which corresponds to one of varying, unreduced, "
                            "reduced or invarying state of the input. Got input type: f32[2,4]{V:x, U:y}, axes: "
                            "('x', 'y') and input state: {'unreduced', 'varying'}"));
      continue;
    }
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ((*r)[0].sharding().spec(), P("x", None).with_unreduced({"y"}));
    expect_near(summed((*r)[0]), host_matmul(a2, b2, 4, 2, 4), 0);
  }
}

// tests/shard_map_test.py's test_preduced_fwd_unreduced_psum_bwd on ('x': 2): pcast(x, 'x',
// to='reduced') of an invariant block is preduced, typed {R:x}, out_specs P(reduced={'x'}); its
// product with a P(None, 'x') operand sums to the host's, laid out P(); the gradient of the
// reduced operand is unreduced inside (JAX's transpose unreduced_psum) and leaves whole
// (P(None, None)), the host's. The casts' refusals, with JAX's words: preduced of a varying
// value (_get_from: from=varying), to='unreduced' of an invariant one, vary_unreduced_cast on
// an Auto mesh (explicit-mode types only).
TEST_F(ExplicitReducedTest, PcastToReducedIsPreducedAndItsGradientIsSummedAsJax) {
  const Mesh mesh = explicit_mesh(*client_, {2}, {"x"});
  const HostArray a = HostArray::arange(DType::kF32, {2, 4}), b = HostArray::arange(DType::kF32, {4, 6});
  const Array x = put_on(mesh, a, P(None, None)), y = put_on(mesh, b, P(None, "x"));
  std::string before, after;
  const ShardMapped pr = shard_map(
      [&](const std::vector<Value>& in) {
        before = type_of(in[0]).to_string();
        const Value r = pcast(in[0], "x", "reduced");
        after = type_of(r).to_string();
        return std::vector<Value>{r};
      },
      mesh, {P()}, {P().with_reduced({"x"})});
  auto f = [&](const std::vector<Value>& in) { return sum(einsum("ab,bc->ac", pr({in[0]})[0], in[1])); };
  absl::StatusOr<Array> out = run1(f, {x, y});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(before, "f32[2,4]");
  EXPECT_EQ(after, "f32[2,4]{R:x}");
  EXPECT_EQ(out->sharding().spec(), P());
  expect_near(fetch(*out), {total(host_matmul(a, b, 2, 4, 6))}, 0);
  absl::StatusOr<std::vector<Array>> g =
      jit(grad([&](const std::vector<Value>& in) { return std::vector<Value>{f(in)}; }, {0}))({x, y});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*g)[0].sharding().spec(), P(None, None));
  expect_near(fetch((*g)[0]), sum_matmul_grads(a, b, 2, 4, 6).first, 2e-4);

  const auto refusal_of = [&](const Mesh& m, const std::function<Value(const Value&)>& body, const PartitionSpec& in) {
    const ShardMapped s =
        shard_map([&](const std::vector<Value>& v) { return std::vector<Value>{body(v[0])}; }, m, {in}, {P("x")});
    absl::StatusOr<std::vector<Array>> r =
        jit([&](const std::vector<Value>& v) { return s(v); })({put_on(m, random_f32({8}, 71), P("x"))});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    return std::string(r.status().message());
  };
  EXPECT_THAT(refusal_of(
                  mesh, [](const Value& v) { return pcast(v, "x", "reduced"); }, P("x")),
              HasSubstr("pcast(f32[4], 'x', to='reduced'): Unsupported pcast from=varying, to='reduced'"));
  EXPECT_THAT(refusal_of(
                  mesh, [](const Value& v) { return pcast(psum(v, "x"), "x", "unreduced"); }, P("x")),
              HasSubstr("Unsupported pcast from=invarying, to='unreduced'"));
  absl::StatusOr<Mesh> auto_mesh = client_->make_mesh({2}, {"x"}, {AxisType::kAuto});
  ASSERT_TRUE(auto_mesh.ok()) << auto_mesh.status();
  EXPECT_THAT(refusal_of(
                  *auto_mesh, [](const Value& v) { return pcast(v, "x", "unreduced"); }, P("x")),
              HasSubstr("reduced and unreduced axes are types of explicit mode"));
}

// vary_unreduced_cast over ('x', 'y') then psum over 'y' only (unreduced_psum: {U:(x,y)} ->
// {U:x}), out_specs P(unreduced={'x'}) on a (2, 2) mesh: the cotangent reaching the cast is
// reduced over 'x' and a summed copy along 'y'; the cast's transpose (jax/_src/lax/parallel.py,
// _vary_unreduced_cast_transpose_rule: reduced_vary_cast) types it varying along both again.
// loss = sum(sin(S)), S the sum of the four (2, 1) blocks of the P('x', 'y') argument: each
// block's gradient on the host is cos(S).
TEST_F(ExplicitReducedTest, PcastToUnreducedThenAPartialPsumHasTheHostsGradientAsJax) {
  const Mesh mesh = explicit_mesh(*client_, {2, 2}, {"x", "y"});
  const HostArray a = HostArray::arange(DType::kF32, {4, 2});
  const std::vector<double> av = values_of(a);
  const Array x = put_on(mesh, a, P("x", "y"));
  std::string summed_type;
  const ShardMapped m = shard_map(
      [&](const std::vector<Value>& in) {
        const Value s = psum(pcast(in[0], AxisNames{"x", "y"}, "unreduced"), "y");
        summed_type = type_of(s).to_string();
        return std::vector<Value>{s};
      },
      mesh, {P("x", "y")}, {P().with_unreduced({"x"})});
  // Block (i, j) of the argument is rows 2i..2i+1 of column j.
  std::vector<double> total(2, 0.0), want(8);
  for (int r = 0; r < 4; ++r) {
    for (int c = 0; c < 2; ++c) total[r % 2] += av[r * 2 + c];
  }
  for (int r = 0; r < 4; ++r) {
    for (int c = 0; c < 2; ++c) want[r * 2 + c] = std::cos(total[r % 2]);
  }
  absl::StatusOr<std::vector<Array>> out = jit([&](const std::vector<Value>& in) { return m(in); })({x});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(summed_type, "f32[2,1]{U:x}");
  expect_near(summed((*out)[0]), total, 0);
  absl::StatusOr<std::vector<Array>> g = jit(
      grad([&](const std::vector<Value>& in) { return std::vector<Value>{sum(sin(reshard(m(in)[0], P())))}; }))({x});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*g)[0].sharding().spec(), P("x", "y"));
  expect_near(fetch((*g)[0]), want, 1e-5);
}

// preduced's transpose is unreduced_psum (jax/_src/lax/parallel.py, _preduced_transpose_rule):
// the cotangent, unreduced over the axes, is summed there into an invariant one, so it flows
// back through the ops before the cast (here sin, whose rule takes no unreduced cotangent) and
// adds to the cotangent of another use of the same invariant value (a second output, P()).
// On ('x': 2) and ('x': 4): loss = sum(sin(w) @ b) + sum(2 w), whose gradient on the host is
// cos(w) times b's row sums, plus 2.
TEST_F(ExplicitReducedTest, PreducedGradientFlowsThroughTheBodyAsJax) {
  for (const int64_t n : {2, 4}) {
    const Mesh mesh = explicit_mesh(*client_, {n}, {"x"});
    const HostArray a = HostArray::arange(DType::kF32, {2, 4}), b = HostArray::arange(DType::kF32, {4, 8});
    const std::vector<double> av = values_of(a), bv = values_of(b);
    const Array x = put_on(mesh, a, P(None, None)), y = put_on(mesh, b, P(None, "x"));
    const ShardMapped pr = shard_map(
        [](const std::vector<Value>& in) {
          return std::vector<Value>{pcast(sin(in[0]), "x", "reduced"), in[0] * 2.0};
        },
        mesh, {P()}, {P().with_reduced({"x"}), P()});
    auto f = [&](const std::vector<Value>& in) {
      const std::vector<Value> r = pr({in[0]});
      return sum(einsum("ab,bc->ac", r[0], in[1])) + sum(r[1]);
    };
    double loss = 0;
    std::vector<double> dw(8);
    for (int i = 0; i < 2; ++i) {
      for (int k = 0; k < 4; ++k) {
        double row = 0;
        for (int c = 0; c < 8; ++c) row += bv[k * 8 + c];
        loss += std::sin(av[i * 4 + k]) * row + 2 * av[i * 4 + k];
        dw[i * 4 + k] = std::cos(av[i * 4 + k]) * row + 2;
      }
    }
    absl::StatusOr<Array> out = run1(f, {x, y});
    ASSERT_TRUE(out.ok()) << out.status();
    expect_near(fetch(*out), {loss}, 1e-3);
    absl::StatusOr<std::vector<Array>> g =
        jit(grad([&](const std::vector<Value>& in) { return std::vector<Value>{f(in)}; }, {0}))({x, y});
    ASSERT_TRUE(g.ok()) << "n=" << n << ": " << g.status();
    EXPECT_EQ((*g)[0].sharding().spec(), P(None, None));
    expect_near(fetch((*g)[0]), dw, 1e-4);
  }
}

// tests/shard_map_test.py's test_all_gather_reduced_fwd_unreduced_psum_scatter_bwd on a (2, 2)
// ('data', 'seq') mesh: all_gather(a, 'seq', tiled=True, to='reduced') types the gathered
// block {R:seq} (no longer varying), out_specs P(None, None, reduced={'seq'}); the product's sum
// is the host's, laid out P(), and both gradients are P('seq', None) and the host's (the
// cotangent of the gathered value, unreduced, is psum-scattered back: unreduced_psum_scatter).
// test_shmap_unreduced_fsdp_grad: preduced over 'data' of a block varying along 'seq', then
// all_gather(to='reduced') over 'seq' gives a weight reduced over both, used by a
// P('data', 'seq', None) batch; sin of the sum's gradients are the host's, laid out as the
// arguments. all_gather(to='reduced')'s refusals, with JAX's words.
TEST_F(ExplicitReducedTest, AllGatherToReducedAsJax) {
  const Mesh mesh = explicit_mesh(*client_, {2, 2}, {"data", "seq"});
  const HostArray a = HostArray::arange(DType::kF32, {4, 2}), b = HostArray::arange(DType::kF32, {2, 6});
  const Array x = put_on(mesh, a, P("seq", None)), y = put_on(mesh, b, P("seq", None));
  std::string gathered;
  const ShardMapped ag = shard_map(
      [&](const std::vector<Value>& in) {
        const Value out = all_gather(in[0], "seq", 0, true, "reduced");
        gathered = type_of(out).to_string();
        return std::vector<Value>{out};
      },
      mesh, {P("seq", None)}, {P(None, None).with_reduced({"seq"})});
  auto f = [&](const std::vector<Value>& in) { return sum(einsum("td,df->tf", in[0], ag({in[1]})[0])); };
  absl::StatusOr<Array> out = run1(f, {x, y});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(gathered, "f32[2,6]{R:seq}");
  EXPECT_EQ(out->sharding().spec(), P());
  expect_near(fetch(*out), {total(host_matmul(a, b, 4, 2, 6))}, 0);
  absl::StatusOr<std::vector<Array>> g =
      jit(grad([&](const std::vector<Value>& in) { return std::vector<Value>{f(in)}; }, {0, 1}))({x, y});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*g)[0].sharding().spec(), P("seq", None));
  EXPECT_EQ((*g)[1].sharding().spec(), P("seq", None));
  const auto [da, db] = sum_matmul_grads(a, b, 4, 2, 6);
  expect_near(fetch((*g)[0]), da, 2e-4);
  expect_near(fetch((*g)[1]), db, 2e-4);

  // test_shmap_unreduced_fsdp_grad.
  const HostArray a3 = HostArray::arange(DType::kF32, {8, 4, 2}), b3 = HostArray::arange(DType::kF32, {2, 6});
  const Array x3 = put_on(mesh, a3, P("data", "seq", None)), y3 = put_on(mesh, b3, P("seq", None));
  std::vector<std::string> types;
  const ShardMapped to_reduced = shard_map(
      [&](const std::vector<Value>& in) {
        const Value out = pcast(in[0], "data", "reduced");
        types.push_back(type_of(out).to_string());
        return std::vector<Value>{out};
      },
      mesh, {P("seq", None)}, {P("seq", None).with_reduced({"data"})});
  const ShardMapped gather = shard_map(
      [&](const std::vector<Value>& in) {
        types.push_back(type_of(in[0]).to_string());
        const Value out = all_gather(in[0], "seq", 0, true, "reduced");
        types.push_back(type_of(out).to_string());
        return std::vector<Value>{out};
      },
      mesh, {P("seq", None).with_reduced({"data"})}, {P(None, None).with_reduced({"seq", "data"})});
  std::string weight_type;
  auto fsdp = [&](const std::vector<Value>& in) {
    const Value w = gather(to_reduced({in[1]}))[0];
    weight_type = type_of(w).to_string();
    return einsum("btd,df->btf", in[0], w);
  };
  absl::StatusOr<Array> y4 = run1(fsdp, {x3, y3});
  ASSERT_TRUE(y4.ok()) << y4.status();
  EXPECT_THAT(types,
              ::testing::ElementsAre("f32[1,6]{V:seq, R:data}", "f32[1,6]{V:seq, R:data}", "f32[2,6]{R:(data,seq)}"));
  EXPECT_EQ(weight_type, "f32[2,6]{R:(data,seq)}");
  EXPECT_EQ(y4->sharding().spec(), P("data", "seq", None));
  // loss = sin(S), S = sum(x @ w): d/dx[b, t, d] = cos(S) w's row sum d, d/dw[d, f] = cos(S)
  // x's sum over (b, t) at d.
  const double s = total(host_matmul(a3, b3, 32, 2, 6));
  const auto [dx, dw] = sum_matmul_grads(a3, b3, 32, 2, 6, std::cos(s));
  absl::StatusOr<std::vector<Array>> g3 =
      jit(grad([&](const std::vector<Value>& in) { return std::vector<Value>{sin(sum(fsdp(in)))}; }, {0, 1}))({x3, y3});
  ASSERT_TRUE(g3.ok()) << g3.status();
  EXPECT_EQ((*g3)[0].sharding().spec(), P("data", "seq", None));
  EXPECT_EQ((*g3)[1].sharding().spec(), P("seq", None));
  expect_near(fetch((*g3)[0]), dx, 2e-4);
  expect_near(fetch((*g3)[1]), dw, 2e-4);

  // The refusals (all_gather_reduced's abstract eval, _all_gather_is_async).
  const auto refusal_of = [&](const std::function<Value(const Value&)>& body, const PartitionSpec& in) {
    const ShardMapped m =
        shard_map([&](const std::vector<Value>& v) { return std::vector<Value>{body(v[0])}; }, mesh, {in}, {P()});
    absl::StatusOr<std::vector<Array>> r =
        jit([&](const std::vector<Value>& v) { return m(v); })({put_on(mesh, random_f32({4, 2}, 72), in)});
    EXPECT_FALSE(r.ok());
    return std::string(r.status().message());
  };
  EXPECT_THAT(refusal_of([](const Value& v) { return all_gather(v, "seq", 0, true, "reduced"); }, P()),
              HasSubstr("all_gather_reduced only accepts inputs that are varying. Got f32[4,2]"));
  EXPECT_THAT(refusal_of([](const Value& v) { return all_gather(v, "seq", 0, true, "reduced"); }, P("data", None)),
              HasSubstr("all_gather_reduced is a Varying -> Reduced collective. This means that the "
                        "axis_name=('seq',) passed to `all_gather_reduced` must be present in "
                        "jax.typeof(x).mat.varying=frozenset({'data'})"));
  EXPECT_THAT(refusal_of([](const Value& v) { return all_gather(v, "seq", 0, true, "sideways"); }, P("seq", None)),
              HasSubstr("Got unexpected `to` value for `jax.lax.all_gather`. Allowed `to` values are: {'varying', "
                        "'reduced', 'invarying'}"));
}

// all_gather(to='reduced') of a value unreduced over one of the gathered axes: JAX's
// _all_gather_reduced_effectful_abstract_eval takes it (x varying along some of the axes,
// reduced over none; of x's unreduced axes it checks only their kind) and keeps x's unreduced
// axes: f32[2,2]{V:data, U:seq} gathered over ('data', 'seq') is f32[8,2]{U:seq, R:(data,seq)};
// psum over 'seq' is then unreduced_psum (_get_from: 'unreduced' before 'reduced'), whose
// abstract eval checks no reduced axes: f32[8,2]{R:(data,seq)}. Values against the host: the
// gather lowers as a plain all_gather, so every device holds the four (2, 2) blocks of A in
// device order, and the psum over 'seq' doubles them.
TEST_F(ExplicitReducedTest, AllGatherToReducedOfAnUnreducedValueKeepsItsUnreducedAxesAsJax) {
  const Mesh mesh = explicit_mesh(*client_, {2, 2}, {"data", "seq"});
  const HostArray a = HostArray::arange(DType::kF32, {4, 4});
  std::vector<std::string> types;
  const ShardMapped f = shard_map(
      [&](const std::vector<Value>& in) {
        const Value u = pcast(in[0], "seq", "unreduced");
        const Value g = all_gather(u, {"data", "seq"}, 0, true, "reduced");
        const Value s = psum(g, "seq");
        types = {type_of(u).to_string(), type_of(g).to_string(), type_of(s).to_string()};
        return std::vector<Value>{s};
      },
      mesh, {P("data", "seq")}, {P(None, None).with_reduced({"data", "seq"})});
  absl::StatusOr<std::vector<Array>> out =
      jit([&](const std::vector<Value>& in) { return f(in); })({put_on(mesh, a, P("data", "seq"))});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(types, ::testing::ElementsAre("f32[2,2]{V:data, U:seq}", "f32[8,2]{U:seq, R:(data,seq)}",
                                            "f32[8,2]{R:(data,seq)}"));
  std::vector<double> want;  // blocks (d, s) in device order, each A[2d:2d+2, 2s:2s+2], doubled
  for (int d = 0; d < 2; ++d) {
    for (int s = 0; s < 2; ++s) {
      for (int r = 0; r < 2; ++r) {
        for (int c = 0; c < 2; ++c) want.push_back(2.0 * a.values<float>()[(2 * d + r) * 4 + 2 * s + c]);
      }
    }
  }
  expect_near(fetch((*out)[0]), want, 0);
}

// check_vma=false (jax/_src/shard_map.py's _shard_shaped_array and _unshard_shaped_array
// without check_vma): the body's values carry no unreduced or reduced axes, and out_specs'
// are not checked; the blocks are what they are. tests/shard_map_test.py's
// test_replicated_unreduced_bitcast_check_vma_false (a P() argument out as P(unreduced={'x'}):
// each device's block is the argument, so the sum is twice it; back in with
// P(unreduced={'x'}), typed f32[8] inside, out P(): each block the argument),
// test_sharded_unreduced_roundtrip_check_vma_false (P('x') out as P(unreduced={'x'}), global
// shape (4,) -> (2,), and back) and test_unreduced_replicated_bitcast (pcast to='unreduced' with
// check_vma, psum gives [2, 4]); sin of an unreduced argument, refused with check_vma, runs on
// each term without; pcast to='unreduced' sees an invarying value (nothing varies), as JAX's
// _pcast_funcs. The gradients are JAX's transpose's without check_vma (the spec's unreduced
// axes counted as unmentioned), and test_check_vma_false_unreduced_fwd_psum_on_bwd's psum.
TEST_F(ExplicitReducedTest, CheckVmaOffDropsUnreducedAndReducedAxesFromTheBodyAsJax) {
  const Mesh mesh = explicit_mesh(*client_, {2}, {"x"});
  ShardMapOptions unchecked;
  unchecked.check_vma = false;
  const auto identity = [](const std::vector<Value>& in) { return in; };
  const auto blocks_of = [](const Array& a) {
    std::vector<std::vector<double>> out;
    for (const Shard& s : a.addressable_shards()) {
      absl::StatusOr<HostArray> b = s.data();
      EXPECT_TRUE(b.ok()) << b.status();
      if (b.ok()) out.push_back(values_of(*b));
    }
    return out;
  };
  const PartitionSpec unreduced = P().with_unreduced({"x"});
  const HostArray h8 = HostArray::arange(DType::kF32, {8});
  const std::vector<double> v8 = values_of(h8);
  const Array arr = put_on(mesh, h8, P());
  absl::StatusOr<std::vector<Array>> out = shard_map(identity, mesh, {P()}, {unreduced}, unchecked)({arr});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ((*out)[0].sharding().spec(), P(None).with_unreduced({"x"}));
  EXPECT_THAT(blocks_of((*out)[0]), ::testing::Each(v8));
  std::vector<double> twice = v8;
  for (double& e : twice) e *= 2;
  expect_near(summed((*out)[0]), twice, 0);
  absl::StatusOr<std::vector<Array>> g = jit(grad([&](const std::vector<Value>& in) {
    return std::vector<Value>{sum(reshard(shard_map(identity, mesh, {P()}, {unreduced}, unchecked)(in)[0], P(None)))};
  }))({arr});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*g)[0].sharding().spec(), P(None));
  // Not 2 (the sum of the terms is 2 x): without check_vma JAX's transpose
  // (jax/_src/shard_map.py, _shard_map_transpose) divides an output's cotangent by the size of
  // the axes _unmentioned2(mesh, out_spec.to_ct_spec()) gives, which counts the out_spec's
  // unreduced axes (the ct spec's reduced ones) as unmentioned: 1/2 per device, then psums the
  // P() argument's over 'x': 1.
  expect_near(fetch((*g)[0]), std::vector<double>(8, 1.0), 0);

  std::string inside;
  const ShardMapped back = shard_map(
      [&](const std::vector<Value>& in) {
        inside = type_of(in[0]).to_string();
        return in;
      },
      mesh, {unreduced}, {P()}, unchecked);
  absl::StatusOr<std::vector<Array>> out2 = back({(*out)[0]});
  ASSERT_TRUE(out2.ok()) << out2.status();
  EXPECT_EQ(inside, "f32[8]");
  EXPECT_EQ((*out2)[0].sharding().spec(), P(None));
  EXPECT_THAT(blocks_of((*out2)[0]), ::testing::Each(v8));
  absl::StatusOr<std::vector<Array>> g2 =
      jit(grad([&](const std::vector<Value>& in) { return std::vector<Value>{sum(back(in)[0])}; }))(*out);
  ASSERT_TRUE(g2.ok()) << g2.status();
  EXPECT_EQ((*g2)[0].sharding().spec(), P(None).with_reduced({"x"}));
  // JAX's values (_shard_map_transpose without check_vma): the P() output's cotangent divided
  // by 2 ('x' unmentioned), the argument's psummed over _unmentioned2 of its ct spec
  // P(reduced={'x'}), which counts its unreduced 'x' as unmentioned: 1/2 + 1/2.
  expect_near(fetch((*g2)[0]), std::vector<double>(8, 1.0), 0);
  // tests/shard_map_test.py's test_check_vma_false_unreduced_fwd_psum_on_bwd: psum_scatter of
  // an unreduced argument, out P('x'); the gradient of the sum gets the same psum (JAX's test
  // asserts one in the jaxpr): the all_gathered ones summed over 'x', 2 on every element, laid
  // out P(None, reduced={'x'}).
  const ShardMapped scattered =
      shard_map([](const std::vector<Value>& in) { return std::vector<Value>{psum_scatter(in[0], "x", 0, true)}; },
                mesh, {unreduced}, {P("x")}, unchecked);
  Jitted jg = jit(grad([&](const std::vector<Value>& in) { return std::vector<Value>{sum(scattered(in)[0])}; }));
  absl::StatusOr<std::vector<Array>> g3 = jg(*out);
  ASSERT_TRUE(g3.ok()) << g3.status();
  EXPECT_GE(jit_support::all_reduce_count(jg.as_text()), 1u);
  EXPECT_EQ((*g3)[0].sharding().spec(), P(None).with_reduced({"x"}));
  expect_near(fetch((*g3)[0]), std::vector<double>(8, 2.0), 0);
  // sin of each term: refused with check_vma, as JAX's nary_ur_rule.
  const auto sine = [](const std::vector<Value>& in) { return std::vector<Value>{sin(in[0])}; };
  absl::StatusOr<std::vector<Array>> sines = shard_map(sine, mesh, {unreduced}, {unreduced}, unchecked)({(*out)[0]});
  ASSERT_TRUE(sines.ok()) << sines.status();
  std::vector<double> two_sines;
  for (double e : v8) two_sines.push_back(2 * std::sin(e));
  expect_near(summed((*sines)[0]), two_sines, 1e-6);
  absl::StatusOr<std::vector<Array>> checked = shard_map(sine, mesh, {unreduced}, {unreduced})({(*out)[0]});
  EXPECT_THAT(checked.status().message(), HasSubstr("unreduced rule for sin is not implemented"));
  absl::StatusOr<std::vector<Array>> cast =
      shard_map([](const std::vector<Value>& in) { return std::vector<Value>{pcast(in[0], "x", "unreduced")}; }, mesh,
                {P("x")}, {unreduced}, unchecked)({put_on(mesh, h8, P("x"))});
  EXPECT_THAT(cast.status().message(), HasSubstr("Unsupported pcast from=invarying, to='unreduced'"));

  // The roundtrip: (4,) P('x') -> (2,) P(None, unreduced={'x'}) -> (4,) P('x').
  const HostArray h4 = HostArray::arange(DType::kF32, {4});
  const Array arr4 = put_on(mesh, h4, P("x"));
  absl::StatusOr<std::vector<Array>> halves = shard_map(identity, mesh, {P("x")}, {unreduced}, unchecked)({arr4});
  ASSERT_TRUE(halves.ok()) << halves.status();
  EXPECT_EQ((*halves)[0].shape(), Shape{2});
  EXPECT_EQ((*halves)[0].sharding().spec(), P(None).with_unreduced({"x"}));
  EXPECT_EQ(blocks_of((*halves)[0]), blocks_of(arr4));
  expect_near(summed((*halves)[0]), {2, 4}, 0);
  absl::StatusOr<std::vector<Array>> whole = shard_map(identity, mesh, {unreduced}, {P("x")}, unchecked)(*halves);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ((*whole)[0].shape(), Shape{4});
  EXPECT_EQ((*whole)[0].sharding().spec(), P("x"));
  expect_near(fetch((*whole)[0]), values_of(h4), 0);

  // test_unreduced_replicated_bitcast: the same, with check_vma and pcast, then psum.
  absl::StatusOr<std::vector<Array>> cast4 =
      shard_map([](const std::vector<Value>& in) { return std::vector<Value>{pcast(in[0], "x", "unreduced")}; }, mesh,
                {P("x")}, {unreduced})({arr4});
  ASSERT_TRUE(cast4.ok()) << cast4.status();
  EXPECT_EQ((*cast4)[0].sharding().spec(), P(None).with_unreduced({"x"}));
  EXPECT_EQ(blocks_of((*cast4)[0]), blocks_of(arr4));
  absl::StatusOr<std::vector<Array>> psummed =
      shard_map([](const std::vector<Value>& in) { return std::vector<Value>{psum(in[0], "x")}; }, mesh, {unreduced},
                {P()})(*cast4);
  ASSERT_TRUE(psummed.ok()) << psummed.status();
  EXPECT_EQ((*psummed)[0].sharding().spec(), P(None));
  EXPECT_THAT(blocks_of((*psummed)[0]), ::testing::Each(std::vector<double>{2, 4}));
}

// Eager shard_map (called on arrays, not under jit) with reduced and unreduced specs gives the
// values and result shardings it gives under jit (tests/shard_map_test.py's
// test_eager_reduced_out, test_eager_reduced_in, test_eager_unreduced_out,
// test_eager_unreduced_in on ('x': 2), their expected values and shardings; the gradients, as
// JAX's, taken of the eager function and compared with the jitted one's).
TEST_F(ExplicitReducedTest, EagerShardMapWithReducedAndUnreducedSpecsIsAsUnderJitAsJax) {
  const Mesh mesh = explicit_mesh(*client_, {2}, {"x"});
  const HostArray h8 = HostArray::arange(DType::kF32, {8});
  const std::vector<double> v8 = values_of(h8);
  struct Case {
    const char* name;
    PartitionSpec in, out;
    std::function<Value(const Value&)> body;
    Shape shape;
    PartitionSpec spec;         // the result's sharding: the out_spec's, one entry per dimension
    std::vector<double> value;  // the result's, resharded to P() (summed when unreduced)
    PartitionSpec grad_spec;
    double grad_each;  // each element of the gradient of the result's sum (summed when unreduced)
  };
  std::vector<double> v16 = v8, halves = {0 + 4, 1 + 5, 2 + 6, 3 + 7};
  v16.insert(v16.end(), v8.begin(), v8.end());
  const std::vector<Case> cases = {
      {"reduced_out",
       P("x"),
       P().with_reduced({"x"}),
       [](const Value& v) { return all_gather(v, "x", 0, true, "reduced"); },
       {8},
       P(None).with_reduced({"x"}),
       v8,
       P("x"),
       1},
      {"reduced_in",
       P().with_reduced({"x"}),
       P("x"),
       [](const Value& v) { return pcast(v, "x", "varying"); },
       {16},
       P("x"),
       v16,
       P(None).with_unreduced({"x"}),
       2},
      {"unreduced_out",
       P("x"),
       P().with_unreduced({"x"}),
       [](const Value& v) { return pcast(v, "x", "unreduced"); },
       {4},
       P(None).with_unreduced({"x"}),
       halves,
       P("x"),
       1},
      {"unreduced_in",
       P().with_unreduced({"x"}),
       P("x"),
       [](const Value& v) { return psum_scatter(v, "x", 0, true); },
       {8},
       P("x"),
       v8,
       P(None).with_reduced({"x"}),
       1},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    absl::StatusOr<Array> arg = reshard(put_on(mesh, h8, P()), NamedSharding(mesh, c.in));
    ASSERT_TRUE(arg.ok()) << arg.status();
    // in_specs inferred from the argument, as JAX's tests leave them out.
    const ShardMapped f =
        shard_map([&c](const std::vector<Value>& in) { return std::vector<Value>{c.body(in[0])}; }, mesh, {}, {c.out});
    absl::StatusOr<std::vector<Array>> eager = f({*arg});
    absl::StatusOr<std::vector<Array>> jitted = jit([&](const std::vector<Value>& in) { return f(in); })({*arg});
    ASSERT_TRUE(eager.ok()) << eager.status();
    ASSERT_TRUE(jitted.ok()) << jitted.status();
    for (const Array& r : {(*eager)[0], (*jitted)[0]}) {
      EXPECT_EQ(r.shape(), c.shape);
      EXPECT_EQ(r.sharding().spec(), c.spec);
      expect_near(summed(r), c.value, 0);
    }
    EXPECT_EQ((*eager)[0].sharding(), (*jitted)[0].sharding());
    const auto loss = [&](const std::vector<Value>& in) { return std::vector<Value>{sum(reshard(f(in)[0], P(None)))}; };
    absl::StatusOr<std::vector<Array>> g = jit(grad(loss))({*arg});
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ((*g)[0].sharding().spec(), c.grad_spec) << (*g)[0].sharding().spec().to_string();
    expect_near(summed((*g)[0]), std::vector<double>(8, c.grad_each), 0);
  }
  // test_eager_unreduced_out: sin of the unreduced cast is refused eagerly too.
  absl::StatusOr<std::vector<Array>> bad =
      shard_map([](const std::vector<Value>& in) { return std::vector<Value>{sin(pcast(in[0], "x", "unreduced"))}; },
                mesh, {}, {P().with_unreduced({"x"})})({put_on(mesh, h8, P("x"))});
  EXPECT_THAT(bad.status().message(), HasSubstr("unreduced rule for sin is not implemented"));
}

}  // namespace
}  // namespace tessera
