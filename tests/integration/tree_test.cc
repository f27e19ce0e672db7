// Parameter trees (tessera/tree.h): the flattening order (JAX's sorted dict keys,
// jax/_src/tree_util.py), round trips, structure errors naming the path, sharding rules, and
// device_put / jit / grad over trees on Client::local(8), against host computations.
#include "tessera/tree.h"

#include <cmath>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"

namespace tessera {

// The cluster this binary's tests share (also optim_test.cc's).
Client& shared_client() {
  static Client* const client = new Client(*Client::local(8));
  return *client;
}

namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<std::string> names_of(const Tree<int>& t) {
  absl::StatusOr<TreeDef> def = t.structure();
  EXPECT_TRUE(def.ok()) << def.status();
  return def.ok() ? def->names() : std::vector<std::string>{};
}

TEST(Tree, FlattensAsJaxFlattensTheNestedDict) {
  // {"layers": {"2": {"w"}, "10": {"w"}}, "b": .., "a-c": .., "a": {"z": .., "b": {"c": ..}}}:
  // jax.tree_util sorts each dict's keys, so "a" < "a-c" < "b" < "layers" and "10" < "2".
  Tree<int> t;
  t.set("layers.2.w", 1).set("b", 2).set("a-c", 3).set("a.z", 4).set("layers.10.w", 5).set("a.b.c", 6);
  EXPECT_THAT(names_of(t), ElementsAre("a.b.c", "a.z", "a-c", "b", "layers.10.w", "layers.2.w"));
  EXPECT_THAT(t.flatten(), ElementsAre(6, 4, 3, 2, 5, 1));
  EXPECT_THAT(names_of(Tree<int>(7)), ElementsAre(""));  // a leaf is a tree of one leaf
}

TEST(Tree, UnflattenUndoesFlattenAndChecksTheCount) {
  Tree<int> t = {{"w", 1}, {"b", 2}, {"layers.0.w", 3}};
  absl::StatusOr<TreeDef> def = t.structure();
  ASSERT_TRUE(def.ok());
  absl::StatusOr<Tree<int>> back = Tree<int>::unflatten(*def, t.flatten());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->leaves_by_name(), t.leaves_by_name());
  absl::StatusOr<Tree<int>> short_one = Tree<int>::unflatten(*def, {1, 2});
  EXPECT_EQ(short_one.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(short_one.status().message(), HasSubstr("{b, layers.0.w, w} (3 leaves) from 2 leaves"));
}

TEST(Tree, RefusesNamesThatSpellNoTree) {
  absl::StatusOr<TreeDef> both = Tree<int>({{"a", 1}, {"a.b", 2}}).structure();
  EXPECT_EQ(both.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(both.status().message(), HasSubstr("'a' is a leaf and also has leaves under it ('a.b')"));
  absl::StatusOr<TreeDef> empty_part = Tree<int>({{"a..b", 1}}).structure();
  EXPECT_THAT(empty_part.status().message(), HasSubstr("'a..b' has an empty part"));
  absl::StatusOr<TreeDef> root = Tree<int>({{"", 1}, {"x", 2}}).structure();
  EXPECT_THAT(root.status().message(), HasSubstr("a leaf named '' (the root) and also 'x'"));
  // "ab" is not under "a": only whole parts nest.
  EXPECT_TRUE(Tree<int>({{"a", 1}, {"ab.c", 2}}).structure().ok());
}

TEST(Tree, SetAndSubtreeMoveWholeNodes) {
  Tree<int> layer = {{"w", 1}, {"b", 2}};
  Tree<int> t;
  t.set("layers.0", layer).set("layers.1", layer).set("head", 9);
  EXPECT_THAT(names_of(t), ElementsAre("head", "layers.0.b", "layers.0.w", "layers.1.b", "layers.1.w"));
  EXPECT_THAT(names_of(t.subtree("layers")), ElementsAre("0.b", "0.w", "1.b", "1.w"));
  EXPECT_EQ(t.subtree("layers.1").leaves_by_name(), layer.leaves_by_name());
  EXPECT_THAT(names_of(t.subtree("head")), ElementsAre(""));
  EXPECT_TRUE(t.subtree("lay").empty());
  ASSERT_NE(t.find("layers.1.w"), nullptr);
  EXPECT_EQ(*t.find("layers.1.w"), 1);
}

TEST(Tree, CheckSameNamesTheFirstDifference) {
  TreeDef a = *Tree<int>({{"w", 1}, {"b", 2}}).structure();
  TreeDef b = *Tree<int>({{"w", 1}, {"c", 2}}).structure();
  absl::Status s = a.check_same(b, "gradients", "parameters");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("'b' is in the gradients but not in the parameters"));
  EXPECT_THAT(b.check_same(a, "gradients", "parameters").message(),
              HasSubstr("'b' is in the parameters but not in the gradients"));
  EXPECT_TRUE(a.check_same(a, "x", "y").ok());
}

TEST(ShardingRule, GlobsFirstMatchWinsAndTreesAreExact) {
  ShardingRule rule = ShardingRule::globs({{"*.w", P("data", None)}, {"embed", P(None, "data")}});
  EXPECT_EQ(*rule.spec_for("layers.0.w"), P("data", None));
  EXPECT_EQ(*rule.spec_for("embed"), P(None, "data"));
  absl::StatusOr<PartitionSpec> none = rule.spec_for("layers.0.b");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(none.status().message(), HasSubstr("no spec for leaf 'layers.0.b'"));
  ShardingRule exact(Tree<PartitionSpec>({{"w", P("data")}}));
  EXPECT_EQ(*exact.spec_for("w"), P("data"));
  EXPECT_THAT(exact.spec_for("b").status().message(), HasSubstr("leaf 'b'"));
  EXPECT_EQ(*ShardingRule(P()).spec_for("anything"), P());
}

HostArray random_array(std::mt19937& rng, Shape shape) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  HostArray a(DType::kF32, std::move(shape));
  for (float& v : a.mutable_values<float>()) v = u(rng);
  return a;
}

Mesh data_mesh(int n) {
  std::vector<int> ids(n);
  for (int i = 0; i < n; ++i) ids[i] = i;
  return *shared_client().make_mesh({n}, {"data"}, ids);
}

TEST(TreeDevicePut, PlacesEachLeafByTheRuleAndDeviceGetRoundTrips) {
  std::mt19937 rng(1);
  Tree<HostArray> host;
  host.set("layers.0.w", random_array(rng, {8, 4}));
  host.set("layers.0.b", random_array(rng, {4}));
  host.set("embed", random_array(rng, {3, 16}));
  const Mesh mesh = data_mesh(8);
  absl::StatusOr<Tree<Array>> put =
      device_put(shared_client(), host, mesh,
                 ShardingRule::globs({{"*.w", P("data", None)}, {"embed", P(None, "data")}, {"*", P()}}));
  ASSERT_TRUE(put.ok()) << put.status();
  Tree<PartitionSpec> specs = shardings_of(*put);
  EXPECT_EQ(*specs.find("layers.0.w"), P("data", None));
  EXPECT_EQ(*specs.find("layers.0.b"), P());
  EXPECT_EQ(*specs.find("embed"), P(None, "data"));
  absl::StatusOr<Tree<HostArray>> back = device_get(*put);
  ASSERT_TRUE(back.ok()) << back.status();
  for (const auto& [name, h] : host) EXPECT_EQ(*back->find(name), h) << name;

  // A rule that does not fit a leaf names it.
  absl::StatusOr<Tree<Array>> bad = device_put(shared_client(), host, mesh, P("data"));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("device_put: 'embed': "));
}

std::vector<double> from_host_doubles(const Array& a) {
  absl::StatusOr<HostArray> h = a.fetch();
  EXPECT_TRUE(h.ok()) << h.status();
  return h.ok() ? std::vector<double>(h->values<double>().begin(), h->values<double>().end()) : std::vector<double>{};
}

std::vector<float> floats(const HostArray& a) {
  return std::vector<float>(a.values<float>().begin(), a.values<float>().end());
}

TEST(TreeJit, TreesInTreesOutDonatedWholeAndRetracedForOtherNames) {
  std::mt19937 rng(2);
  const Mesh mesh = data_mesh(8);
  Tree<HostArray> host;
  host.set("a", random_array(rng, {8, 2}));
  host.set("b", random_array(rng, {8, 2}));
  HostArray xh = random_array(rng, {});
  Tree<Array> tree = *device_put(shared_client(), host, mesh, P("data", None));
  Tree<Array> x = *shared_client().device_put(xh, NamedSharding(mesh, P()));
  TreeJitOptions options;
  options.donate_argnums = {0};
  TreeJitted f = jit(
      [](const std::vector<Tree<Value>>& in) {
        Tree<Value> doubled = tree_map(in[0], [](const std::string&, const Value& v) { return v * 2.0; });
        Value total = in[1].begin()->second;
        for (const auto& [name, v] : in[0]) total = total + sum(v);
        return std::vector<Tree<Value>>{Tree<Value>().set("doubled", doubled), total};
      },
      options);
  absl::StatusOr<std::vector<Tree<Array>>> out = f({tree, x});
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), 2u);
  EXPECT_THAT(out->at(0).structure()->names(), ElementsAre("doubled.a", "doubled.b"));
  double total = xh.element_as_double(0);
  for (const char* name : {"a", "b"}) {
    std::vector<float> want = floats(*host.find(name));
    for (float& v : want) total += v, v *= 2;
    EXPECT_EQ(floats(*out->at(0).find(absl::StrCat("doubled.", name))->fetch()), want);
  }
  EXPECT_NEAR(out->at(1).find("")->fetch()->element_as_double(0), total, 1e-4);
  // Every leaf of the donated tree is gone; the other argument is not.
  EXPECT_EQ(tree.find("a")->block_until_ready().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(tree.find("b")->block_until_ready().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(x.find("")->block_until_ready().ok());

  // Other names: traced again, with the results named after them.
  Tree<HostArray> host3;
  host3.set("p.q", random_array(rng, {8, 2}));
  Tree<Array> tree3 = *device_put(shared_client(), host3, mesh, P("data", None));
  out = f({tree3, x});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(out->at(0).structure()->names(), ElementsAre("doubled.p.q"));
}

TEST(TreeJit, ShardingRulesForArgumentsAndResults) {
  std::mt19937 rng(3);
  const Mesh mesh = data_mesh(8);
  Tree<HostArray> host;
  host.set("w", random_array(rng, {8, 2}));
  host.set("b", random_array(rng, {2}));
  Tree<Array> params =
      *device_put(shared_client(), host, mesh, ShardingRule::globs({{"w", P("data", None)}, {"*", P()}}));
  TreeFunction identity_times_3 = [](const std::vector<Tree<Value>>& in) {
    return std::vector<Tree<Value>>{tree_map(in[0], [](const std::string&, const Value& v) { return v * 3.0; })};
  };
  TreeJitOptions strict;
  strict.in_shardings = {ShardingRule(P("data", None))};
  absl::StatusOr<std::vector<Tree<Array>>> refused = jit(identity_times_3, strict)({params});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("argument tree 0 leaf 'b'"));

  TreeJitOptions pinned;
  pinned.in_shardings = {ShardingRule::globs({{"w", P("data", None)}, {"b", P()}})};
  pinned.out_shardings = {ShardingRule(P())};  // every result replicated
  absl::StatusOr<std::vector<Tree<Array>>> out = jit(identity_times_3, pinned)({params});
  ASSERT_TRUE(out.ok()) << out.status();
  for (const auto& [name, a] : out->at(0)) {
    EXPECT_TRUE(a.sharding().is_fully_replicated()) << name << " " << a.sharding().to_string();
    std::vector<float> want = floats(*host.find(name));
    for (float& v : want) v *= 3;
    EXPECT_EQ(floats(*a.fetch()), want) << name;
  }
}

TEST(TreeJit, StructureErrorsNameThePath) {
  const Mesh mesh = data_mesh(1);
  Tree<Array> bad;
  bad.set("a", *shared_client().device_put(HostArray::ones(DType::kF32, {2}), NamedSharding(mesh, P())));
  bad.set("a.b", *bad.find("a"));
  TreeJitted f = jit([](const std::vector<Tree<Value>>& in) { return in; });
  absl::StatusOr<std::vector<Tree<Array>>> out = f({bad});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(out.status().message(), HasSubstr("argument tree 0: tree: 'a' is a leaf and also has leaves under it"));

  TreeJitted bad_result = jit([](const std::vector<Tree<Value>>& in) {
    Tree<Value> r;
    r.set("x", in[0]).set("x.y", in[0]);
    return std::vector<Tree<Value>>{r};
  });
  out = bad_result({*bad.find("a")});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(out.status().message(), HasSubstr("result tree 0: tree: 'x' is a leaf"));
}

TEST(TreeGrad, GradientsByNameInTheirParametersLayout) {
  // loss = sum((x @ w + b)^2): d/dw = 2 x^T r, d/db = 2 sum_rows(r), r = x @ w + b.
  std::mt19937 rng(4);
  const Mesh mesh = data_mesh(8);
  Tree<HostArray> host;
  host.set("w", random_array(rng, {8, 3}));
  host.set("b", random_array(rng, {3}));
  HostArray xh = random_array(rng, {4, 8});
  Tree<Array> params =
      *device_put(shared_client(), host, mesh, ShardingRule::globs({{"w", P("data", None)}, {"b", P()}}));
  Array x = *shared_client().device_put(xh, NamedSharding(mesh, P()));
  TreeFunction loss = [](const std::vector<Tree<Value>>& in) {
    const Value r = matmul(in[1].begin()->second, *in[0].find("w")) + *in[0].find("b");
    return std::vector<Tree<Value>>{sum(r * r)};
  };
  absl::StatusOr<std::vector<Tree<Array>>> out = jit(value_and_grad(loss, {0}))({params, x});
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), 2u);
  const std::vector<float> w = floats(*host.find("w")), b = floats(*host.find("b")), xs = floats(xh);
  std::vector<double> r(4 * 3), dw(8 * 3, 0), db(3, 0);
  double value = 0;
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 3; ++j) {
      double s = b[j];
      for (int k = 0; k < 8; ++k) s += double(xs[i * 8 + k]) * w[k * 3 + j];
      r[i * 3 + j] = s;
      value += s * s;
      db[j] += 2 * s;
      for (int k = 0; k < 8; ++k) dw[k * 3 + j] += 2 * xs[i * 8 + k] * s;
    }
  }
  EXPECT_NEAR(out->at(0).find("")->fetch()->element_as_double(0), value, 1e-4 * std::max(1.0, value));
  const Tree<Array>& g = out->at(1);
  EXPECT_THAT(g.structure()->names(), ElementsAre("b", "w"));
  EXPECT_EQ(g.find("w")->sharding().spec(), P("data", None));
  HostArray gw = *g.find("w")->fetch(), gb = *g.find("b")->fetch();
  for (int i = 0; i < 24; ++i) EXPECT_NEAR(gw.element_as_double(i), dw[i], 1e-4) << i;
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(gb.element_as_double(i), db[i], 1e-4) << i;

  // An integer leaf among the differentiated ones is named.
  Tree<Array> with_step = params;
  with_step.set("step", *shared_client().device_put(HostArray::zeros(DType::kI32, {}), NamedSharding(mesh, P())));
  out = jit(grad(loss, {0}))({with_step, x});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(out.status().message(), HasSubstr("argument 0 leaf 'step' is i32[]"));
}

// jax.jit's static_argnums (C++: a second list of static values): a value change compiles
// again, an equal value reuses the program, and values differing in the 16th digit are told
// apart (the coordinator's compile key once confused constants past 6 digits).
TEST(JitStatic, StaticValuesArePartOfTheCompileKeyExactly) {
  const Mesh mesh = data_mesh(2);
  HostArray xh = HostArray::from_vector<double>({2, 2}, {1.0, 2.0, -3.0, 0.5});
  Array x = *shared_client().device_put(xh, NamedSharding(mesh, P("data", None)));
  int traces = 0;
  Jitted f = jit([&](const std::vector<Value>& in, const std::vector<StaticValue>& s) {
    ++traces;
    Value y = in[0] * std::get<double>(s[0]);
    if (std::get<int64_t>(s[1]) > 0) y = y + std::get<int64_t>(s[1]);
    if (std::get<std::string>(s[2]) == "neg") y = -y;
    return std::vector<Value>{y};
  });
  auto run = [&](double scale, int64_t shift, std::string mode) {
    absl::StatusOr<std::vector<Array>> out = f({x}, {scale, shift, mode});
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? from_host_doubles((*out)[0]) : std::vector<double>{};
  };
  auto want = [&](double scale, int64_t shift, bool neg) {
    std::vector<double> w;
    for (double v : xh.values<double>()) {
      double y = v * scale + (shift > 0 ? static_cast<double>(shift) : 0.0);
      w.push_back(neg ? -y : y);
    }
    return w;
  };
  const double a = 1.0000000000000002, b = 1.0000000000000004;  // adjacent doubles
  EXPECT_EQ(run(a, 0, "pos"), want(a, 0, false));
  EXPECT_EQ(traces, 1);
  EXPECT_EQ(run(a, 0, "pos"), want(a, 0, false));
  EXPECT_EQ(traces, 1);  // equal values: the cached program
  EXPECT_EQ(run(b, 0, "pos"), want(b, 0, false));
  EXPECT_EQ(traces, 2);
  EXPECT_NE(want(a, 0, false), want(b, 0, false));  // the programs' results differ too
  EXPECT_EQ(run(b, 3, "neg"), want(b, 3, true));
  EXPECT_EQ(traces, 3);
  EXPECT_EQ(run(a, 0, "pos"), want(a, 0, false));
  EXPECT_EQ(traces, 3);

  // A function without static arguments refuses them.
  absl::StatusOr<std::vector<Array>> refused =
      jit([](const std::vector<Value>& in) { return in; })({x}, {StaticValue(1.0)});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("1 static arguments for a function that takes none"));
}

}  // namespace
}  // namespace tessera
