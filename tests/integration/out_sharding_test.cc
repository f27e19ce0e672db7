// out_sharding on the ops that make or broadcast values (full, iota, broadcast_in_dim /
// broadcast_to, take / at().get()) and reshard(Array, P) against the ambient mesh, end to end
// on a local cluster: each case after a test of JAX's tests/pjit_test.py (ShardingInTypesTest,
// named per case) for the result's type and sharding; values against a host computation.
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/jit_support.h"

namespace tessera {
namespace {

using jit_support::expect_near;
using jit_support::random_f32;
using ::testing::HasSubstr;

class OutShardingTest : public jit_support::LocalJitSuite {
 protected:
  // make_mesh's axes are Explicit by default, as jax.make_mesh's (JAX >= 0.9).
  static Mesh explicit_mesh(std::vector<int64_t> shape, std::vector<std::string> names) {
    absl::StatusOr<Mesh> mesh = client_->make_mesh(std::move(shape), std::move(names));
    EXPECT_TRUE(mesh.ok()) << mesh.status();
    for (AxisType t : mesh->axis_types()) EXPECT_EQ(t, AxisType::kExplicit);
    return *mesh;
  }
  // f's results on `args`; `types`: their types as the trace saw them.
  static absl::StatusOr<std::vector<Array>> run(const TracedFunction& f, const std::vector<Array>& args,
                                                std::vector<std::string>* types = nullptr) {
    return jit([&](const std::vector<Value>& in) {
      std::vector<Value> r = f(in);
      if (types != nullptr) {
        types->clear();
        for (const Value& v : r) types->push_back(type_of(v).to_string());
      }
      return r;
    })(args);
  }
  static std::vector<double> as_doubles(const HostArray& a) {
    std::vector<double> out;
    for (int64_t i = 0; i < a.size(); ++i) out.push_back(a.values<float>()[i]);
    return out;
  }
};

// test_jnp_zeros_out_sharding (jnp.zeros(x.shape, x.dtype, out_sharding=P('x')) under jit is
// NamedSharding(mesh, P('x')) and zeros), test_jnp_arange_out_sharding (arange(8,
// out_sharding=P('x')): laid out so, 0..7) and test_broadcasted_iota_with_sharding
// (broadcasted_iota((8, 2), 0, out_sharding=P('x', 'y')) has spec P('x', 'y')).
TEST_F(OutShardingTest, FullAndIotaAreMadeLaidOutByOutSharding) {
  const Mesh mesh = explicit_mesh({4, 2}, {"x", "y"});
  const Array arg = put_on(mesh, random_f32({8}, 1), P("x"));
  std::vector<std::string> types;
  absl::StatusOr<std::vector<Array>> out = run(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{full(in[0].shape(), 0.0, DType::kF32, P("x")), full({8, 2}, 2.5, DType::kF32, P()),
                                  iota(DType::kF32, {8}, 0, P("x")), iota(DType::kI32, {8, 2}, 0, P("x", "y")),
                                  iota(DType::kI32, {8, 2}, 1, P(None, "y"))};
      },
      {arg}, &types);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(types, ::testing::ElementsAre("f32[8@x]", "f32[8,2]", "f32[8@x]", "i32[8@x,2@y]", "i32[8,2@y]"));
  EXPECT_EQ((*out)[0].sharding(), NamedSharding(mesh, P("x")));
  EXPECT_TRUE(fetch((*out)[0]) == HostArray::zeros(DType::kF32, {8}));
  EXPECT_TRUE((*out)[1].sharding().is_fully_replicated());
  expect_near(fetch((*out)[1]), std::vector<double>(16, 2.5));
  EXPECT_EQ((*out)[2].sharding(), NamedSharding(mesh, P("x")));
  EXPECT_TRUE(fetch((*out)[2]) == HostArray::arange(DType::kF32, {8}));
  EXPECT_EQ((*out)[3].sharding(), NamedSharding(mesh, P("x", "y")));
  EXPECT_EQ((*out)[4].sharding(), NamedSharding(mesh, P(None, "y")));
  std::vector<int32_t> rows, cols;
  for (int32_t i = 0; i < 8; ++i) {
    for (int32_t j = 0; j < 2; ++j) rows.push_back(i), cols.push_back(j);
  }
  EXPECT_TRUE(fetch((*out)[3]) == HostArray::from_vector<int32_t>({8, 2}, rows));
  EXPECT_TRUE(fetch((*out)[4]) == HostArray::from_vector<int32_t>({8, 2}, cols));
}

// test_broadcast_to: x (1, 24) P(None, ('y', 'z')) on a (2, 2, 2) mesh, broadcast_to((8, 24),
// out_sharding=P('x', ('y', 'z'))) has that spec and sharding; its values are x's rows repeated.
// test_no_op_broadcast_except_for_sharding_change: broadcast_in_dim(x, (4, 2), [0, 1],
// out_sharding=P('x')) of an unsplit x is x laid out by P('x', None), and grad of its sum
// comes back laid out as x (P(None, None)): ones.
TEST_F(OutShardingTest, BroadcastsAreLaidOutByOutShardingAndTheirGradientsAsTheOperand) {
  const Mesh mesh = explicit_mesh({2, 2, 2}, {"x", "y", "z"});
  const HostArray x = random_f32({1, 24}, 2);
  std::vector<std::string> types;
  absl::StatusOr<std::vector<Array>> out = run(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{broadcast_to(in[0], {8, 24}, P("x", Axes{"y", "z"}))};
      },
      {put_on(mesh, x, P(None, Axes{"y", "z"}))}, &types);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(types, ::testing::ElementsAre("f32[8@x,24@(y,z)]"));
  EXPECT_EQ((*out)[0].sharding(), NamedSharding(mesh, P("x", Axes{"y", "z"})));
  std::vector<double> rows;
  for (int i = 0; i < 8; ++i) {
    for (double v : as_doubles(x)) rows.push_back(v);
  }
  expect_near(fetch((*out)[0]), rows);

  const HostArray a = HostArray::arange(DType::kF32, {4, 2});
  const Array as = put_on(mesh, a, P());
  TracedFunction f = [](const std::vector<Value>& in) {
    return std::vector<Value>{broadcast_in_dim(in[0], {4, 2}, {0, 1}, P("x"))};
  };
  out = run(f, {as}, &types);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(types, ::testing::ElementsAre("f32[4@x,2]"));
  EXPECT_EQ((*out)[0].sharding(), NamedSharding(mesh, P("x", None)));
  EXPECT_TRUE(fetch((*out)[0]) == a);
  // And a broadcast along new and stretched dimensions: d/dx sum(w * broadcast(x)) sums w over
  // them, laid out as x although the broadcast's result was split.
  const HostArray v = random_f32({1, 2}, 3), w = random_f32({3, 4, 2}, 4);
  out = run(grad(
                [](const std::vector<Value>& in) {
                  return std::vector<Value>{sum(broadcast_in_dim(in[0], {4, 2}, {0, 1}, P("x"))) +
                                            sum(in[2] * broadcast_in_dim(in[1], {3, 4, 2}, {1, 2}, P(None, "x", "y")))};
                },
                {0, 1}),
            {as, put_on(mesh, v, P()), put_on(mesh, w, P())}, &types);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(types, ::testing::ElementsAre("f32[4,2]", "f32[1,2]"));
  EXPECT_TRUE((*out)[0].sharding().is_fully_replicated());
  expect_near(fetch((*out)[0]), std::vector<double>(8, 1.0));
  std::vector<double> want(2, 0.0);
  for (int64_t i = 0; i < w.size(); ++i) want[i % 2] += w.values<float>()[i];
  expect_near(fetch((*out)[1]), want, 1e-4);
}

// test_auto_gather_out_sharding: embed (64, 16) P(None, 'x'), tokens (8, 4) P('x', None) on a
// (2, 2) mesh; embed.at[tok].get(out_sharding=P('x', None, None)) is (8, 4, 16) with that spec
// (the gather runs as under auto_axes), and jit(grad(sum of it)) is laid out as embed. Values:
// the rows of embed; the gradient counts each row's uses. Without out_sharding a split indexed
// dimension is refused, naming the fix.
TEST_F(OutShardingTest, TakeWithOutShardingGathersUnderAutoAxesAndScattersBackLaidOutAsTheTable) {
  const Mesh mesh = explicit_mesh({2, 2}, {"x", "y"});
  HostArray embed = HostArray::arange(DType::kF32, {64, 16});
  std::vector<int32_t> ids(32);
  for (int i = 0; i < 32; ++i) ids[i] = (i * 7) % 64 - (i % 3 == 0 ? 64 : 0);  // some negative: wrapped
  const HostArray tok = HostArray::from_vector<int32_t>({8, 4}, ids);
  const Array es = put_on(mesh, embed, P(None, "x")), ts = put_on(mesh, tok, P("x", None));
  std::vector<std::string> types;
  absl::StatusOr<std::vector<Array>> out = run(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{take(in[0], in[1], 0, P("x", None, None)), at(in[0], in[1]).get(P("x", None, None))};
      },
      {es, ts}, &types);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(types, ::testing::ElementsAre("f32[8@x,4,16]", "f32[8@x,4,16]"));
  std::vector<double> rows;
  std::vector<double> uses(64 * 16, 0.0);
  for (int32_t id : ids) {
    const int32_t r = id < 0 ? id + 64 : id;
    for (int c = 0; c < 16; ++c) rows.push_back(r * 16 + c), uses[r * 16 + c] += 1.0;
  }
  for (const Array& o : *out) {
    EXPECT_EQ(o.sharding(), NamedSharding(mesh, P("x", None, None)));
    expect_near(fetch(o), rows);
  }

  out = run(grad([](const std::vector<Value>& in) {
              return std::vector<Value>{sum(take(in[0], in[1], 0, P("x", None, None)))};
            }),
            {es, ts}, &types);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(types, ::testing::ElementsAre("f32[64,16@x]"));
  EXPECT_EQ((*out)[0].sharding(), es.sharding());
  expect_near(fetch((*out)[0]), uses);

  // The table split along the indexed dimension: refused without out_sharding, in the text of JAX's
  // _gather_sharding_rule (jax/_src/lax/slicing.py; the types in Tessera's notation, where JAX prints
  // ShapedArray(float32[64@x,16])), gathered with it.
  const Array split = put_on(mesh, embed, P("x", None));
  TracedFunction plain = [](const std::vector<Value>& in) { return std::vector<Value>{take(in[0], in[1], 0)}; };
  absl::StatusOr<std::vector<Array>> refused = run(plain, {split, ts});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("gather: Use `.at[...].get(out_sharding=)` to provide output PartitionSpec for the gather "
                        "indexing as out sharding could not be resolved unambiguously (or would require collectives on "
                        "inputs). Got operand=f32[64@x,16], indices=i32[8@x,4] (operands f32[64@x,16], i32[8@x,4]); "
                        "the indexed dimension 0 is split over ('x',), and the indexed dimension and the indices must "
                        "be unsplit"));
  out = run([](const std::vector<Value>& in) { return std::vector<Value>{take(in[0], in[1], 0, P(None, "y", None))}; },
            {split, ts}, &types);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(types, ::testing::ElementsAre("f32[8,4@y,16]"));
  expect_near(fetch((*out)[0]), rows);
}

// test_at_add_lower_to_scatter_add (tests/pjit_test.py): with the indices split,
// x.at[:, ids].add(5.0) is refused: the updates' slice_sharding puts 'x' on x's rows and on the
// indices' dimension (jax/_src/numpy/indexing.py _index_to_gather's aia_spec), which JAX's
// NamedSharding refuses (named_sharding.py _check_unique_resources; here broadcast_to's words);
// given `.at[...].add(out_sharding=)`, the scatter runs under auto_axes
// (jax/_src/ops/scatter.py _scatter_update) and the result is laid out as out_sharding
// (P('x', None) there). The same for set with the indexed dimension split (test_index_update's
// updates keep P('x', None)). Values: numpy's (index 10 out of range, dropped; -1 wraps).
TEST_F(OutShardingTest, AtSetAndAddWithOutShardingScatterUnderAutoAxes) {
  const Mesh mesh = explicit_mesh({2, 2}, {"x", "y"});
  const HostArray x = HostArray::arange(DType::kF32, {4, 10});
  const HostArray ids = HostArray::from_vector<int32_t>({4}, {1, 3, 7, 10});
  const Array xs = put_on(mesh, x, P("x", None)), is = put_on(mesh, ids, P("x"));
  TracedFunction plain = [](const std::vector<Value>& in) {
    return std::vector<Value>{at(in[0], in[1], 1).add(full({}, 5.0))};
  };
  absl::StatusOr<std::vector<Array>> refused = run(plain, {xs, is});
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("P('x', 'x'): mesh axis 'x' is used more than once"));
  std::vector<std::string> types;
  absl::StatusOr<std::vector<Array>> out = run(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{at(in[0], in[1], 1).add(full({}, 5.0), P("x", None)),
                                  at(in[0], in[2], 0).set(full({2, 10}, -1.0), P("x", "y"))};
      },
      {xs, is, put_on(mesh, HostArray::from_vector<int32_t>({2}, {-1, 2}), P("x"))}, &types);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(types, ::testing::ElementsAre("f32[4@x,10]", "f32[4@x,10@y]"));
  EXPECT_EQ((*out)[0].sharding(), NamedSharding(mesh, P("x", None)));
  EXPECT_EQ((*out)[1].sharding(), NamedSharding(mesh, P("x", "y")));
  std::vector<double> added(40), set(40);
  for (int i = 0; i < 40; ++i) {
    const int r = i / 10, c = i % 10;
    added[i] = i + ((c == 1 || c == 3 || c == 7) ? 5.0 : 0.0);
    set[i] = (r == 3 || r == 2) ? -1.0 : i;
  }
  expect_near(fetch((*out)[0]), added);
  expect_near(fetch((*out)[1]), set);
}

// jax.sharding.reshard(x, P(...)) outside jit resolves the spec against the ambient mesh
// (jax/_src/pjit.py reshard -> canonicalize_sharding, jax/_src/sharding_impls.py), also onto a
// mesh other than x's; without one a bare spec is refused (JAX: "Using PartitionSpec when you
// are not under a mesh context is not allowed ... via `jax.set_mesh`").
TEST_F(OutShardingTest, ReshardOfAnArrayTakesTheAmbientMesh) {
  const Mesh mesh = explicit_mesh({4, 2}, {"X", "Y"});
  const HostArray x = random_f32({16, 8}, 5);
  const Array xs = put_on(mesh, x, P("X", None));
  absl::StatusOr<Array> none = reshard(xs, P(None, "Y"));
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(none.status().message()),
              HasSubstr("reshard: the bare PartitionSpec P(None, 'Y') needs a mesh: use NamedSharding(mesh, spec), "
                        "or set one with `MeshScope scope = set_mesh(mesh);`"));
  {
    MeshScope scope = set_mesh(mesh);
    absl::StatusOr<Array> moved = reshard(xs, P(None, "Y"));
    ASSERT_TRUE(moved.ok()) << moved.status();
    EXPECT_EQ(moved->sharding(), NamedSharding(mesh, P(None, "Y")));
    EXPECT_EQ(type_of(*moved).to_string(), "f32[16,8@Y]");
    EXPECT_TRUE(fetch(*moved) == x);
  }
  // Another mesh (of the other devices' order): the array moves onto it.
  std::vector<int> reversed(mesh.device_ids().rbegin(), mesh.device_ids().rend());
  absl::StatusOr<Mesh> other =
      Mesh::create({2, 4}, {"a", "b"}, std::move(reversed), {AxisType::kExplicit, AxisType::kExplicit});
  ASSERT_TRUE(other.ok()) << other.status();
  MeshScope scope = set_mesh(*other);
  absl::StatusOr<Array> moved = reshard(xs, P("b", "a"));
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->sharding(), NamedSharding(*other, P("b", "a")));
  EXPECT_TRUE(fetch(*moved) == x);
  absl::StatusOr<Array> bad = reshard(xs, P("X"));
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("reshard: f32[16,8] to P('X',): sharding P('X',): axis 'X' of dimension 0 is not in the mesh"));
}

// tests/pjit_test.py's test_reshard_no_mesh_ctx: reshard onto a NamedSharding over Auto axes is
// refused ("cannot contain axis names that are of type Auto"), onto Explicit ones it moves the
// data; device_put takes Auto axes as before.
TEST_F(OutShardingTest, ReshardOfAnArrayTakesExplicitAxesOnly) {
  const Mesh ex = explicit_mesh({2}, {"x"});
  absl::StatusOr<Mesh> autos = Mesh::create({2}, {"x"}, ex.device_ids());
  ASSERT_TRUE(autos.ok()) << autos.status();
  const HostArray x = random_f32({8}, 6);
  const Array on_auto = put_on(*autos, x, P());
  absl::StatusOr<Array> refused = reshard(on_auto, NamedSharding(*autos, P("x")));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("PartitionSpec passed to reshard cannot contain axis names that are of type Auto or Manual. "
                        "Got PartitionSpec: P('x',) with axis name: x of type: Auto"));
  absl::StatusOr<Array> put = client_->device_put(on_auto, NamedSharding(*autos, P("x")));
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->sharding(), NamedSharding(*autos, P("x")));
  EXPECT_TRUE(fetch(*put) == x);
  absl::StatusOr<Array> moved = reshard(on_auto, NamedSharding(ex, P("x")));
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->sharding(), NamedSharding(ex, P("x")));
  EXPECT_TRUE(fetch(*moved) == x);
}

}  // namespace
}  // namespace tessera
