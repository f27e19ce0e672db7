// Explicit sharding at trace time (client/explicit/): a Value's type carries its sharding
// over the mesh's Explicit axes, each op family's rule decides the result's or fails the trace.
// First JAX's documented examples, case by case (each citing where its expected value comes
// from), then a grid of op x mesh x spec, then the errors' wording.
#include <functional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

constexpr AxisType kE = AxisType::kExplicit;

Mesh mesh_of(std::vector<int64_t> shape, std::vector<std::string> names, std::vector<AxisType> types) {
  std::vector<int> ids;
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  for (int i = 0; i < n; ++i) ids.push_back(i);
  return *Mesh::create(std::move(shape), std::move(names), std::move(ids), std::move(types));
}

struct Input {
  DType dtype;
  Shape shape;
  PartitionSpec spec;
};

// Traces `f` on `inputs` laid out on `mesh`; `f` returns its results, whose types (type_of,
// as JAX prints them) the call returns, or the trace's error.
absl::StatusOr<std::vector<std::string>> result_types(const Mesh& mesh, const std::vector<Input>& inputs,
                                                      const TracedFunction& f) {
  std::vector<ArrayType> types;
  std::vector<NamedSharding> shardings;
  for (const Input& in : inputs) {
    types.push_back({in.dtype, in.shape});
    shardings.push_back(NamedSharding(mesh, in.spec));
  }
  std::vector<std::string> seen;
  absl::StatusOr<Graph> g = trace(
      [&](const std::vector<Value>& in) {
        std::vector<Value> out = f(in);
        for (const Value& v : out) seen.push_back(type_of(v).to_string());
        return out;
      },
      types, shardings);
  if (!g.ok()) return g.status();
  return seen;
}

std::string one_type(const Mesh& mesh, const std::vector<Input>& inputs, const TracedFunction& f) {
  absl::StatusOr<std::vector<std::string>> t = result_types(mesh, inputs, f);
  if (!t.ok()) return absl::StrCat("error: ", t.status().message());
  return t->empty() ? "none" : (*t)[0];
}

const Mesh& xy() {
  static const Mesh m = mesh_of({2, 4}, {"X", "Y"}, {kE, kE});
  return m;
}

// docs/notebooks/explicit-sharding.ipynb (jax-ml/jax), "Setting up an explicit mesh": on
// make_mesh((2, 4), ("X", "Y"), axis_types=(Explicit, Explicit)),
// reshard(np.arange(8).reshape(4, 2), P("X", None)) has type int32[4@X,2], and the unsharded
// array int32[4,2] (the notebook's printed outputs).
TEST(ExplicitJaxDocs, ReshardPutsTheSplitInTheType) {
  EXPECT_EQ(one_type(xy(), {{DType::kI32, {4, 2}, P()}},
                     [](const std::vector<Value>& in) { return std::vector<Value>{in[0]}; }),
            "i32[4,2]");
  EXPECT_EQ(one_type(xy(), {{DType::kI32, {4, 2}, P()}},
                     [](const std::vector<Value>& in) { return std::vector<Value>{reshard(in[0], P("X", None))}; }),
            "i32[4@X,2]");
}

// The same notebook: arg0 = reshard(arange(4).reshape(4, 1), P("X", None)), arg1 =
// reshard(arange(8).reshape(1, 8), P(None, "Y")); arg0 + arg1 has type int32[4@X,8@Y], under
// jit too ("x sharding: int32[4@X,1]", "y sharding: int32[1,8@Y]", "ans sharding:
// int32[4@X,8@Y]").
TEST(ExplicitJaxDocs, BroadcastingAddCombinesTheSplits) {
  absl::StatusOr<std::vector<std::string>> t =
      result_types(xy(), {{DType::kI32, {4, 1}, P("X", None)}, {DType::kI32, {1, 8}, P(None, "Y")}},
                   [](const std::vector<Value>& in) {
                     return std::vector<Value>{in[0], in[1], in[0] + in[1]};
                   });
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(*t, ::testing::ElementsAre("i32[4@X,1]", "i32[1,8@Y]", "i32[4@X,8@Y]"));
}

// The same notebook, "Working around unimplemented sharding rules": some_x P("X", None) +
// some_y P(None, "X") fails with "add operation with inputs: i32[4@X,4], i32[4,4@X] produces an
// illegally sharded result: i32[4@X,4@X]".
TEST(ExplicitJaxDocs, AResultUsingAnAxisTwiceIsAnError) {
  EXPECT_THAT(one_type(xy(), {{DType::kI32, {4, 4}, P("X", None)}, {DType::kI32, {4, 4}, P(None, "X")}},
                       [](const std::vector<Value>& in) { return std::vector<Value>{in[0] + in[1]}; }),
              HasSubstr("add operation with inputs: i32[4@X,4], i32[4,4@X] produces an illegally sharded result: "
                        "i32[4@X,4@X]"));
}

// The JAX scaling book's "Programming TPUs in JAX" (jax-ml/scaling-book): In bf16[8@X,2048@Y],
// W bf16[2048@Y,8192]; einsum('bd,df->bf', square(In), W) fails with "Contracting dimensions
// are sharded and it is ambiguous how the output should be sharded ... Got
// lhs_contracting_spec=('Y',) and rhs_contracting_spec=('Y',)"; with out_sharding=P('X', 'Y')
// the result is bf16[8@X,8192@Y]. (float32 here: the types are the same but for the dtype.)
TEST(ExplicitJaxDocs, AContractionSplitOnBothSidesNeedsOutSharding) {
  const std::vector<Input> in = {{DType::kF32, {8, 2048}, P("X", "Y")}, {DType::kF32, {2048, 8192}, P("Y", None)}};
  EXPECT_THAT(
      one_type(xy(), in,
               [](const std::vector<Value>& v) { return std::vector<Value>{einsum("bd,df->bf", v[0] * v[0], v[1])}; }),
      ::testing::AllOf(HasSubstr("ambiguous how it should be sharded"),
                       HasSubstr("lhs_contracting_spec=('Y',), rhs_contracting_spec=('Y',)"),
                       HasSubstr("give out_sharding")));
  EXPECT_EQ(one_type(xy(), in,
                     [](const std::vector<Value>& v) {
                       return std::vector<Value>{einsum("bd,df->bf", v[0] * v[0], v[1], P("X", "Y"))};
                     }),
            "f32[8@X,8192@Y]");
  EXPECT_EQ(one_type(xy(), in,
                     [](const std::vector<Value>& v) { return std::vector<Value>{matmul(v[0], v[1], P("X", None))}; }),
            "f32[8@X,8192]");
}

// jax/_src/core.py's _get_shape_sharding_str: a dimension over several axes prints as
// "8@(X,Y)"; Auto axes are not part of a type (the notebook: "Shardings (on JAX-level types)
// can only mention explicit mesh axes"), so on a mesh Explicit over Y only a P('X', 'Y') value
// is f32[8,4@Y].
TEST(ExplicitJaxDocs, TypesPrintAsJaxAndShowOnlyExplicitAxes) {
  EXPECT_EQ(one_type(xy(), {{DType::kF32, {8, 4}, P(Axes{"X", "Y"}, None)}},
                     [](const std::vector<Value>& in) { return std::vector<Value>{in[0]}; }),
            "f32[8@(X,Y),4]");
  const Mesh mixed = mesh_of({2, 4}, {"X", "Y"}, {AxisType::kAuto, kE});
  EXPECT_EQ(one_type(mixed, {{DType::kF32, {8, 4}, P("X", "Y")}},
                     [](const std::vector<Value>& in) { return std::vector<Value>{in[0]}; }),
            "f32[8,4@Y]");
  // An all-Auto mesh types nothing: the trace is not in explicit mode.
  const Mesh autos = mesh_of({2, 4}, {"X", "Y"}, {});
  EXPECT_EQ(one_type(autos, {{DType::kF32, {8, 4}, P("X", "Y")}},
                     [](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0}; }),
            "f32[8,4]");
}

// The notebook's "Working around unimplemented sharding rules": under auto_axes the same add
// is allowed, and with out_shardings=P("X", None) its result is int32[4@X,4]; and its
// "Using a mixture of sharding modes": inside auto_axes over 'X' a f32[4@X,4@Y] value is
// float32[4,4@Y] ("the type of arr1 is ShapedArray(float32[4,4@Y])"), and the result
// resharded to P("X", "Y") is f32[4@X,4@Y] again outside.
TEST(ExplicitJaxDocs, AutoAxesSwitchTheTypesOff) {
  EXPECT_EQ(one_type(xy(), {{DType::kI32, {4, 4}, P("X", None)}, {DType::kI32, {4, 4}, P(None, "X")}},
                     auto_axes([](const std::vector<Value>& in) { return std::vector<Value>{in[0] + in[1]}; }, {},
                               {P("X", None)})),
            "i32[4@X,4]");
  std::vector<std::string> inside;
  absl::StatusOr<std::vector<std::string>> t =
      result_types(xy(), {{DType::kF32, {4, 4}, P("X", "Y")}}, [&](const std::vector<Value>& in) {
        const Value x = sin(in[0]);
        TracedFunction g = auto_axes(
            [&](const std::vector<Value>& y) {
              inside.push_back(type_of(y[0]).to_string());
              return std::vector<Value>{y[0] * 2.0};
            },
            {"X"}, {P("X", "Y")});
        const Value z = g({x})[0];
        return std::vector<Value>{x, z, z + 1.0};
      });
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(inside, ::testing::ElementsAre("f32[4,4@Y]"));
  EXPECT_THAT(*t, ::testing::ElementsAre("f32[4@X,4@Y]", "f32[4@X,4@Y]", "f32[4@X,4@Y]"));
  // An axis must be one of the mesh's; with no Explicit axis to switch (here: outside
  // explicit mode) f runs as it is (jax/_src/pjit.py, _auto_axes: `return fun(*args)`).
  EXPECT_THAT(one_type(xy(), {{DType::kF32, {4, 4}, P()}},
                       auto_axes([](const std::vector<Value>& in) { return in; }, {"Z"}, {P()})),
              HasSubstr("auto_axes: 'Z' is not an axis of Mesh('X': 2, 'Y': 4"));
  EXPECT_EQ(one_type(mesh_of({2, 4}, {"X", "Y"}, {}), {{DType::kF32, {4, 4}, P("X", None)}},
                     auto_axes([](const std::vector<Value>& in) { return in; }, {}, {P()})),
            "f32[4,4]");
}

// The notebook's explicit_axes example (docs/notebooks/explicit-sharding.md, "Using a mixture
// of sharding modes"): on an all-Auto (2, 4) mesh set as the context mesh, explicit_g(x,
// in_shardings=P("X", "Y")) sees y and z = y * 2 typed with both axes ("sharding is visible on
// the type of arrays inside g"), while outside, in Auto mode, the types show none again.
TEST(ExplicitJaxDocs, ExplicitAxesSwitchTheTypesOn) {
  const Mesh autos = mesh_of({2, 4}, {"X", "Y"}, {});
  MeshScope scope = set_mesh(autos);
  std::vector<std::string> inside;
  absl::StatusOr<std::vector<std::string>> t =
      result_types(autos, {{DType::kF32, {4, 4}, P("X", "Y")}}, [&](const std::vector<Value>& in) {
        TracedFunction g = explicit_axes(
            [&](const std::vector<Value>& y) {
              const Value z = y[0] * 2.0;
              inside = {type_of(y[0]).to_string(), type_of(z).to_string()};
              return std::vector<Value>{z};
            },
            {"X", "Y"}, {P("X", "Y")});
        const Value z = g({sin(in[0])})[0];
        return std::vector<Value>{z, z + 1.0};
      });
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(inside, ::testing::ElementsAre("f32[4@X,4@Y]", "f32[4@X,4@Y]"));
  EXPECT_THAT(*t, ::testing::ElementsAre("f32[4,4]", "f32[4,4]"));
  // Inside, the explicit rules hold: an axis used twice is refused as in explicit mode.
  EXPECT_THAT(one_type(autos, {{DType::kI32, {4, 4}, P()}, {DType::kI32, {4, 4}, P()}},
                       explicit_axes([](const std::vector<Value>& in) { return std::vector<Value>{in[0] + in[1]}; }, {},
                                     {P("X", None), P(None, "X")})),
              HasSubstr("add operation with inputs: i32[4@X,4], i32[4,4@X] produces an illegally sharded result"));
  // Only over some axes: on a mesh Explicit over Y, explicit_axes over X types both inside,
  // and Y only after.
  const Mesh mixed = mesh_of({2, 4}, {"X", "Y"}, {AxisType::kAuto, kE});
  inside.clear();
  EXPECT_EQ(one_type(mixed, {{DType::kF32, {4, 4}, P(None, "Y")}},
                     explicit_axes(
                         [&](const std::vector<Value>& y) {
                           inside.push_back(type_of(y[0]).to_string());
                           return std::vector<Value>{exp(y[0])};
                         },
                         {"X"}, {P("X", "Y")})),
            "f32[4,4@Y]");
  EXPECT_THAT(inside, ::testing::ElementsAre("f32[4@X,4@Y]"));
  EXPECT_THAT(one_type(autos, {{DType::kF32, {4, 4}, P()}},
                       explicit_axes([](const std::vector<Value>& in) { return in; }, {}, {P(), P()})),
              HasSubstr("explicit_axes: 2 in_shardings for 1 arguments"));
}

// explicit_axes inside auto_axes: JAX's _explicit_axes (jax/_src/pjit.py) enters
// use_abstract_mesh(cur_mesh.update_axis_types({a: Explicit for a in axes})) where cur_mesh is
// the mesh auto_axes put in force (all Auto here), so inside, 'X' is Explicit again: the
// in_sharding P('X', None) is accepted (canonicalize_sharding takes Explicit axes) and types
// the argument f32[4@X,4] while 'Y' stays Auto; leaving, the result's spec loses 'X'
// (modify_spec_for_auto_manual on the auto_axes mesh), and auto_axes' out_sharding types it
// outside.
TEST(ExplicitJaxDocs, ExplicitAxesInsideAutoAxesMakeTheirAxesExplicitAgain) {
  std::vector<std::string> seen;
  absl::StatusOr<std::vector<std::string>> t =
      result_types(xy(), {{DType::kF32, {4, 4}, P("X", "Y")}}, [&](const std::vector<Value>& in) {
        return auto_axes(
            [&](const std::vector<Value>& a) {
              seen.push_back(type_of(a[0]).to_string());
              seen.push_back(get_abstract_mesh().to_string());
              std::vector<Value> r = explicit_axes(
                  [&](const std::vector<Value>& e) {
                    const Value z = e[0] * 2.0;
                    seen.push_back(type_of(e[0]).to_string());
                    seen.push_back(type_of(z).to_string());
                    seen.push_back(get_abstract_mesh().to_string());
                    return std::vector<Value>{z};
                  },
                  {"X"}, {P("X", None)})(a);
              seen.push_back(type_of(r[0]).to_string());
              seen.push_back(get_abstract_mesh().to_string());
              return r;
            },
            {}, {P(None, "Y")})(in);
      });
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(seen,
              ::testing::ElementsAre("f32[4,4]", "AbstractMesh('X': 2, 'Y': 4, axis_types=(Auto, Auto))", "f32[4@X,4]",
                                     "f32[4@X,4]", "AbstractMesh('X': 2, 'Y': 4, axis_types=(Explicit, Auto))",
                                     "f32[4,4]", "AbstractMesh('X': 2, 'Y': 4, axis_types=(Auto, Auto))"));
  EXPECT_THAT(*t, ::testing::ElementsAre("f32[4,4@Y]"));
}

TEST(ExplicitJaxDocs, ExplicitAxesNeedAMesh) {
  EXPECT_THAT(one_type(mesh_of({2, 4}, {"X", "Y"}, {}), {{DType::kF32, {4, 4}, P()}},
                       explicit_axes([](const std::vector<Value>& in) { return in; }, {}, {P()})),
              HasSubstr("Context mesh cannot be empty"));
}

// explicit_axes' in_shardings are checked as JAX checks them: jax/_src/pjit.py's
// _explicit_axes reshards each argument to its in_sharding under the switched mesh, so the
// spec goes through canonicalize_sharding (jax/_src/sharding_impls.py: the mesh's axes, each
// once (named_sharding.py _check_unique_resources, _check_mesh_resource_axis), of type
// Explicit there: "PartitionSpec passed to ... cannot contain axis names that are of type Auto
// or Manual") and get_sharding (jax/_src/core.py: "Length of sharding.spec (3) must be equal
// to aval's ndim (2)", and _check_divisibility). Each error names the argument, its spec and
// the rule; a valid spec still types the argument inside.
TEST(ExplicitJaxDocs, ExplicitAxesCheckTheirInShardingsAsJax) {
  const Mesh autos = mesh_of({2, 4}, {"X", "Y"}, {});
  MeshScope scope = set_mesh(autos);
  const auto identity = [](const std::vector<Value>& in) { return in; };
  const auto refused = [&](std::vector<std::string> axes, std::vector<PartitionSpec> in_shardings) {
    return one_type(autos, {{DType::kF32, {4, 8}, P()}, {DType::kF32, {4, 6}, P()}},
                    explicit_axes(identity, std::move(axes), std::move(in_shardings)));
  };
  // 'Y' stays Auto when only 'X' is switched: JAX refuses it (canonicalize_sharding).
  EXPECT_THAT(refused({"X"}, {P("X", None), P("X", "Y")}),
              HasSubstr("explicit_axes: argument 1 f32[4,6] with in_shardings[1] = P('X', 'Y'): PartitionSpec passed "
                        "to explicit_axes cannot contain axis names that are of type Auto or Manual. Got "
                        "PartitionSpec: P('X', 'Y') with axis name: Y of type: Auto"));
  EXPECT_THAT(refused({}, {P("Z", None), P()}),
              HasSubstr("explicit_axes: argument 0 f32[4,8] with in_shardings[0] = P('Z', None): sharding P('Z', "
                        "None): axis 'Z' of dimension 0 is not in the mesh; its axes are ('X', 'Y')"));
  EXPECT_THAT(refused({}, {P("X", "X"), P()}),
              HasSubstr("explicit_axes: argument 0 f32[4,8] with in_shardings[0] = P('X', 'X'): sharding P('X', "
                        "'X'): mesh axis 'X' is used more than once"));
  // Longer than the rank, even with None entries (get_sharding's length check).
  EXPECT_THAT(refused({}, {P(), P(None, None, None)}),
              HasSubstr("explicit_axes: argument 1 f32[4,6] with in_shardings[1] = P(None, None, None): sharding "
                        "P(None, None, None) has 3 entries but the array of shape (4, 6) has rank 2"));
  EXPECT_THAT(refused({}, {P(), P(None, "Y")}),
              HasSubstr("explicit_axes: argument 1 f32[4,6] with in_shardings[1] = P(None, 'Y'): sharding P(None, "
                        "'Y'): dimension 1 of size 6 is not divisible by mesh axis 'Y' of size 4"));
  // The same specs where they are valid type the arguments inside (shorter specs padded).
  std::vector<std::string> inside;
  EXPECT_EQ(one_type(autos, {{DType::kF32, {4, 8}, P()}, {DType::kF32, {4, 6}, P()}},
                     explicit_axes(
                         [&](const std::vector<Value>& in) {
                           for (const Value& v : in) inside.push_back(type_of(v).to_string());
                           return in;
                         },
                         {}, {P("X", "Y"), P("X")})),
            "f32[4,8]");
  EXPECT_THAT(inside, ::testing::ElementsAre("f32[4@X,8@Y]", "f32[4@X,6]"));
  // Inside a shard_map body the manual axis is Manual: JAX's canonicalize_sharding refuses it.
  ShardMapOptions over_x;
  over_x.axis_names = {"X"};
  EXPECT_THAT(one_type(autos, {{DType::kF32, {4, 8}, P()}},
                       [&](const std::vector<Value>& in) {
                         return shard_map(
                             [&](const std::vector<Value>& block) {
                               return explicit_axes(identity, {"Y"}, {P("X", "Y")})(block);
                             },
                             autos, {P("X")}, {P("X")}, over_x)(in);
                       }),
              HasSubstr("in_shardings[0] = P('X', 'Y'): PartitionSpec passed to explicit_axes cannot contain axis "
                        "names that are of type Auto or Manual. Got PartitionSpec: P('X', 'Y') with axis name: X of "
                        "type: Manual"));
}

// The grid: each op on two explicit meshes ((2, 4) and (4, 2), axes "a", "b") under several
// specs, the result's type or the error, by the rules of docs/notebooks/explicit-sharding.md's
// "Sharding rules" and lax.py's rules (cited per family in client/explicit/).
struct GridCase {
  const char* name;
  std::vector<Input> inputs;
  std::function<Value(const std::vector<Value>&)> f;
  const char* want;  // the type, or "error: " and a substring of the message
};

TEST(ExplicitGrid, OpsMeshesAndSpecs) {
  using V = const std::vector<Value>&;
  const DType f32 = DType::kF32;
  const std::vector<GridCase> cases = {
      // Elementwise: the split follows; None meets a split; two different splits fail.
      {"tanh", {{f32, {16, 8}, P("a", None)}}, [](V v) { return tanh(v[0]); }, "f32[16@a,8]"},
      {"convert", {{f32, {16, 8}, P(None, "b")}}, [](V v) { return convert(v[0], DType::kI32); }, "i32[16,8@b]"},
      {"add_same",
       {{f32, {16, 8}, P("a", "b")}, {f32, {16, 8}, P("a", "b")}},
       [](V v) { return v[0] + v[1]; },
       "f32[16@a,8@b]"},
      {"add_none_meets_split",
       {{f32, {16, 8}, P("a", None)}, {f32, {16, 8}, P()}},
       [](V v) { return v[0] * v[1]; },
       "f32[16@a,8]"},
      {"add_conflict",
       {{f32, {16, 8}, P("a", None)}, {f32, {16, 8}, P("b", None)}},
       [](V v) { return v[0] - v[1]; },
       "error: sub: dimension 0 is split over ('a',) in one operand and over ('b',) in another (operands "
       "f32[16@a,8], f32[16@b,8]); reshard one operand"},
      {"add_axis_twice",
       {{f32, {16, 8}, P("a", None)}, {f32, {16, 8}, P(None, "a")}},
       [](V v) { return v[0] + v[1]; },
       "error: produces an illegally sharded result: f32[16@a,8@a]"},
      {"scalar", {{f32, {16, 8}, P("a", "b")}}, [](V v) { return v[0] * 2.0 + 1.0; }, "f32[16@a,8@b]"},
      {"where", {{f32, {16, 8}, P("a", None)}}, [](V v) { return where(v[0] > 0.0, v[0], -v[0]); }, "f32[16@a,8]"},
      {"broadcast_row",
       {{f32, {8}, P("b")}},
       [](V v) {
         return broadcast_in_dim(v[0], {16, 8}, {1});
       },
       "f32[16,8@b]"},
      // Layout: the spec moves with the data.
      {"transpose",
       {{f32, {16, 8}, P("a", "b")}},
       [](V v) {
         return transpose(v[0], {1, 0});
       },
       "f32[8@b,16@a]"},
      {"reshape_keep",
       {{f32, {16, 8}, P("a", None)}},
       [](V v) {
         return reshape(v[0], {16, 1, 8});
       },
       "f32[16@a,1,8]"},
      {"reshape_merge_unsplit",
       {{f32, {16, 4, 2}, P("a", None, None)}},
       [](V v) {
         return reshape(v[0], {16, 8});
       },
       "f32[16@a,8]"},
      {"reshape_merge_split",
       {{f32, {16, 8}, P("a", None)}},
       [](V v) { return reshape(v[0], {128}); },
       "error: reshape: merging operand dimensions 0, 1 into result dimension 0 moves a split dimension"},
      {"reshape_out_sharding",
       {{f32, {16, 8}, P("a", None)}},
       [](V v) { return reshape(v[0], {128}, P("a")); },
       "f32[128@a]"},
      {"slice_whole",
       {{f32, {16, 8}, P("a", "b")}},
       [](V v) {
         return slice(v[0], {0, 0}, {16, 8});
       },
       "f32[16@a,8@b]"},
      {"slice_cut_divisible",
       {{f32, {16, 8}, P("a", None)}},
       [](V v) {
         return slice(v[0], {0, 0}, {8, 8});
       },
       "f32[8@a,8]"},
      {"slice_cut_indivisible",
       {{f32, {16, 8}, P(None, "b")}},
       [](V v) {
         return slice(v[0], {0, 0}, {16, 3});
       },
       "error: slice: slicing on sharded dims where out dim (3) is not divisible by mesh axes"},
      {"concatenate",
       {{f32, {16, 8}, P(None, "b")}, {f32, {16, 8}, P()}},
       [](V v) {
         return concatenate({v[0], v[1]}, 0);
       },
       "f32[32,8@b]"},
      // Reductions: reduced dimensions leave the type, split or not.
      {"sum_split_dim", {{f32, {16, 8}, P("a", "b")}}, [](V v) { return sum(v[0], {0}); }, "f32[8@b]"},
      {"max_keepdims", {{f32, {16, 8}, P("a", "b")}}, [](V v) { return max(v[0], {1}, true); }, "f32[16@a,1]"},
      {"mean_all", {{f32, {16, 8}, P("a", "b")}}, [](V v) { return mean(v[0]); }, "f32[]"},
      {"argmax", {{f32, {16, 8}, P("a", "b")}}, [](V v) { return argmax(v[0], 1); }, "i32[16@a]"},
      // dot_general: free dimensions keep their splits; contracting ones must agree, and split
      // on both sides need out_sharding; batch ones must agree.
      {"matmul_free_splits",
       {{f32, {16, 8}, P("a", None)}, {f32, {8, 8}, P(None, "b")}},
       [](V v) { return matmul(v[0], v[1]); },
       "f32[16@a,8@b]"},
      {"matmul_one_contracting_split",
       {{f32, {16, 8}, P("a", "b")}, {f32, {8, 8}, P()}},
       [](V v) { return matmul(v[0], v[1]); },
       "f32[16@a,8]"},
      {"matmul_contracting_both",
       {{f32, {16, 8}, P("a", "b")}, {f32, {8, 8}, P("b", None)}},
       [](V v) { return matmul(v[0], v[1]); },
       "error: dot_general: contracting dimensions are split on both operands"},
      {"matmul_contracting_disagree",
       {{f32, {16, 8}, P(None, "a")}, {f32, {8, 8}, P("b", None)}},
       [](V v) { return matmul(v[0], v[1]); },
       "error: contracting dimensions must be split alike, got lhs ('a',) and rhs ('b',)"},
      {"matmul_reduce_scatter",
       {{f32, {16, 8}, P(None, "b")}, {f32, {8, 8}, P("b", None)}},
       [](V v) { return matmul(v[0], v[1], P(None, "b")); },
       "f32[16,8@b]"},
      // With out_sharding JAX checks no split (_dot_general_sharding_rule in jax/_src/lax/lax.py
      // returns out_sharding before comparing the batch and contracting specs).
      {"matmul_contracting_disagree_with_out_sharding",
       {{f32, {16, 8}, P(None, "a")}, {f32, {8, 8}, P("b", None)}},
       [](V v) { return matmul(v[0], v[1], P("a", "b")); },
       "f32[16@a,8@b]"},
      {"batched_dot_disagree_with_out_sharding",
       {{f32, {8, 16, 8}, P("a", None, None)}, {f32, {8, 8, 8}, P("b", None, None)}},
       [](V v) {
         return dot_general(v[0], v[1], DotDims{{0}, {0}, {2}, {1}}, P("b", None, None));
       },
       "f32[8@b,16,8]"},
      {"batched_dot",
       {{f32, {8, 16, 8}, P("a", None, None)}, {f32, {8, 8, 8}, P("a", None, "b")}},
       [](V v) {
         return dot_general(v[0], v[1], DotDims{{0}, {0}, {2}, {1}});
       },
       "f32[8@a,16,8@b]"},
      {"batched_dot_disagree",
       {{f32, {8, 16, 8}, P("a", None, None)}, {f32, {8, 8, 8}, P("b", None, None)}},
       [](V v) {
         return dot_general(v[0], v[1], DotDims{{0}, {0}, {2}, {1}});
       },
       "error: dot_general requires lhs batch dimensions and rhs batch dimensions to have the same sharding, got "
       "('a',) and ('b',)"},
      // Split on one side only is refused as well: _dot_general_sharding_rule (jax/_src/lax/
      // lax.py) compares the batch specs with `l != r`, None included, in these words
      // (tests/pjit_test.py test_dot_general_batch_error, test_dot_batch_dims_error).
      {"batched_dot_split_one_side",
       {{f32, {8, 16, 8}, P("a", None, None)}, {f32, {8, 8, 8}, P()}},
       [](V v) {
         return dot_general(v[0], v[1], DotDims{{0}, {0}, {2}, {1}});
       },
       "error: dot_general requires lhs batch dimensions and rhs batch dimensions to have the same sharding, got "
       "('a',) and (None,) (operands f32[8@a,16,8], f32[8,8,8])"},
      {"batched_dot_split_one_side_rhs",
       {{f32, {8, 16, 8}, P()}, {f32, {8, 8, 8}, P(None, None, "b")}},
       [](V v) {
         return dot_general(v[0], v[1], DotDims{{0, 2}, {2, 1}, {}, {}});
       },
       "error: got (None, None) and ('b', None)"},
      // jnp.matmul (jax/_src/numpy/tensor_contractions.py): a batch dimension both operands have
      // with one size must have one split, else "Incompatible types for matmul arguments"
      // (raised before dot_general, so with out_sharding too); one an operand lacks, or has as an
      // unsplit 1, is a free dimension of the product keeping the other's split.
      {"matmul_batch_split_one_side",
       {{f32, {8, 4, 8}, P("a", None, None)}, {f32, {8, 8, 4}, P()}},
       [](V v) { return matmul(v[0], v[1]); },
       "error: matmul: Incompatible types for matmul arguments: f32[8@a,4,8] and f32[8,8,4]"},
      {"matmul_batch_split_one_side_out_sharding",
       {{f32, {8, 4, 8}, P("a", None, None)}, {f32, {8, 8, 4}, P()}},
       [](V v) { return matmul(v[0], v[1], P("a", None, None)); },
       "error: matmul: Incompatible types for matmul arguments: f32[8@a,4,8] and f32[8,8,4]"},
      {"matmul_batch_split_alike",
       {{f32, {8, 4, 8}, P("a", None, None)}, {f32, {8, 8, 4}, P("a", None, "b")}},
       [](V v) { return matmul(v[0], v[1]); },
       "f32[8@a,4,4@b]"},
      {"matmul_rhs_lacks_batch",
       {{f32, {8, 4, 8}, P("a", None, None)}, {f32, {8, 4}, P()}},
       [](V v) { return matmul(v[0], v[1]); },
       "f32[8@a,4,4]"},
      {"matmul_lhs_lacks_batch",
       {{f32, {4, 8}, P()}, {f32, {8, 8, 4}, P("a", None, None)}},
       [](V v) { return matmul(v[0], v[1]); },
       "f32[8@a,4,4]"},
      // The lhs's contracting dimension and the rhs's batch dimension on one mesh axis: the batch
      // dimension is a free one of the product, so 'a' appears once in the result (JAX accepts
      // this; broadcasting the lhs onto the rhs's batch split would use 'a' twice).
      {"matmul_lhs_lacks_batch_contracting_split_on_its_axis",
       {{f32, {4, 8}, P(None, "a")}, {f32, {8, 8, 4}, P("a", None, None)}},
       [](V v) { return matmul(v[0], v[1]); },
       "f32[8@a,4,4]"},
      {"matmul_size_one_batch",
       {{f32, {8, 4, 8}, P("a", None, None)}, {f32, {1, 8, 4}, P()}},
       [](V v) { return matmul(v[0], v[1]); },
       "f32[8@a,4,4]"},
      {"matmul_size_one_lhs_batch",
       {{f32, {1, 4, 8}, P()}, {f32, {8, 8, 4}, P("a", None, None)}},
       [](V v) { return matmul(v[0], v[1]); },
       "f32[8@a,4,4]"},
      {"matmul_size_one_and_missing_batch",
       {{f32, {8, 1, 4, 8}, P("a", None, None, None)}, {f32, {8, 8, 4}, P("b", None, None)}},
       [](V v) { return matmul(v[0], v[1]); },
       "f32[8@a,8@b,4,4]"},
      {"matmul_batch_sizes_differ",
       {{f32, {8, 4, 8}, P()}, {f32, {4, 8, 4}, P()}},
       [](V v) { return matmul(v[0], v[1]); },
       "error: matmul: Incompatible types for matmul arguments: f32[8,4,8] and f32[4,8,4]"},
      {"matmul_result_axis_twice",
       {{f32, {16, 8}, P("a", None)}, {f32, {8, 8}, P(None, "a")}},
       [](V v) { return matmul(v[0], v[1]); },
       "error: produces an illegally sharded result: f32[16@a,8@a]"},
      // Made in the function: unsplit (the notebook's nullary ops).
      {"iota", {{f32, {16, 8}, P("a", None)}}, [](V) { return iota(DType::kI32, {16, 8}, 0); }, "i32[16,8]"},
      {"full_plus_split", {{f32, {16, 8}, P("a", None)}}, [](V v) { return v[0] + full({16, 8}, 1.0); }, "f32[16@a,8]"},
      // Indexing (slicing.py's _gather_spec_computation): the table's other dimensions keep their
      // splits; the indexed dimension and the indices must be unsplit (tests/pjit_test.py
      // test_indices_sharded_gather_error: x[ids, :] with ids P('x') raises ShardingTypeError),
      // and the refusal is _gather_sharding_rule's text (x[ids] and jnp.take are gather_p, as
      // lax.gather is; the types after "Got" in Tessera's notation, where JAX prints
      // ShapedArray(float32[32,8@b])), which dimension is split in the fix.
      {"take_rows",
       {{f32, {32, 8}, P(None, "b")}, {DType::kI32, {16}, P()}},
       [](V v) { return take(v[0], v[1], 0); },
       "f32[16,8@b]"},
      {"take_split_indices",
       {{f32, {32, 8}, P(None, "b")}, {DType::kI32, {16}, P("a")}},
       [](V v) { return take(v[0], v[1], 0); },
       "error: gather: Use `.at[...].get(out_sharding=)` to provide output PartitionSpec for the gather indexing as "
       "out sharding could not be resolved unambiguously (or would require collectives on inputs). Got "
       "operand=f32[32,8@b], indices=i32[16@a] (operands f32[32,8@b], i32[16@a]); dimension 0 of the indices is "
       "split over ('a',), and the indexed dimension and the indices must be unsplit"},
      {"take_split_table_dim",
       {{f32, {32, 8}, P("a", None)}, {DType::kI32, {16}, P()}},
       [](V v) { return take(v[0], v[1], 0); },
       "error: gather: Use `.at[...].get(out_sharding=)` to provide output PartitionSpec for the gather indexing as "
       "out sharding could not be resolved unambiguously (or would require collectives on inputs). Got "
       "operand=f32[32@a,8], indices=i32[16] (operands f32[32@a,8], i32[16]); the indexed dimension 0 is split "
       "over ('a',)"},
      // Sorting (lax.py's _sort_abstract_eval, _top_k_abstract_eval): the sorted dimension
      // must be unsplit; the result keeps the operand's sharding.
      {"argsort_rows", {{f32, {16, 8}, P("a", None)}}, [](V v) { return argsort(v[0], 1); }, "i32[16@a,8]"},
      {"argsort_split_dim",
       {{f32, {16, 8}, P("a", None)}},
       [](V v) { return argsort(v[0], 0); },
       "error: argsort: Arguments to sort must be unsharded over the sorting dimension. Got sorting dimension=0 "
       "split over ('a',)"},
      {"sort_rows", {{f32, {16, 8}, P("a", None)}}, [](V v) { return sort(v[0]); }, "f32[16@a,8]"},
      {"sort_split_dim",
       {{f32, {16, 8}, P(None, "b")}},
       [](V v) { return sort(v[0]); },
       "error: Arguments to sort must be unsharded over the sorting dimension"},
      {"top_k_values", {{f32, {16, 8}, P("a", None)}}, [](V v) { return top_k(v[0], 3).first; }, "f32[16@a,3]"},
      {"top_k_indices", {{f32, {16, 8}, P("a", None)}}, [](V v) { return top_k(v[0], 3).second; }, "i32[16@a,3]"},
      {"top_k_split_axis",
       {{f32, {16, 8}, P(None, "b")}},
       [](V v) { return top_k(v[0], 3).first; },
       "error: top_k: The input should be unsharded over the axis along which to compute the top_k values. Got "
       "input type=f32[16,8@b] and axis=1"},
      // Cumulative reductions (loops.py's _cumred_sharding_rule).
      {"cumsum_rows", {{f32, {16, 8}, P("a", None)}}, [](V v) { return cumsum(v[0], 1); }, "f32[16@a,8]"},
      {"cummax_reverse", {{f32, {16, 8}, P(None, "b")}}, [](V v) { return cummax(v[0], 0, true); }, "f32[16,8@b]"},
      {"cumsum_split_axis",
       {{f32, {16, 8}, P("a", None)}},
       [](V v) { return cumsum(v[0], 0); },
       "error: cumsum: Input should be unsharded over the axis being reduced. Got input type=f32[16@a,8] and "
       "axis=0"},
      // pad, dynamic_slice (slicing.py's _get_sharding_for_varying_out_shape): the operand's
      // sharding, if each resized split dimension still divides.
      {"pad_unsplit_dim",
       {{f32, {16, 8}, P("a", None)}},
       [](V v) { return pad(v[0], full({}, 0.0), {{0, 0, 0}, {1, 2, 0}}); },
       "f32[16@a,11]"},
      {"pad_split_dim_divides",
       {{f32, {16, 8}, P("a", "b")}},
       [](V v) { return pad(v[0], full({}, 0.0), {{0, 1, 1}, {0, 0, 0}}); },
       "f32[32@a,8@b]"},
      {"pad_split_dim_indivisible",
       {{f32, {16, 8}, P("a", None)}},
       [](V v) { return pad(v[0], full({}, 0.0), {{1, 2, 0}, {0, 0, 0}}); },
       "error: pad: padding on sharded dims where out dim (19) is not divisible by mesh axes"},
      {"dynamic_slice_divides",
       {{f32, {16, 8}, P("a", None)}},
       [](V v) { return dynamic_slice(v[0], {full({}, 4.0, DType::kI32), full({}, 2.0, DType::kI32)}, {8, 4}); },
       "f32[8@a,4]"},
      {"dynamic_slice_indivisible",
       {{f32, {16, 8}, P("a", None)}},
       [](V v) { return dynamic_slice(v[0], {full({}, 4.0, DType::kI32), full({}, 2.0, DType::kI32)}, {5, 4}); },
       "error: dynamic_slice on sharded dims where out dim (5) is not divisible by mesh axes"},
      // dynamic_update_slice (_dynamic_update_slice_sharding_rule): the update as the operand.
      {"dynamic_update_slice",
       {{f32, {16, 8}, P("a", None)}, {f32, {16, 4}, P("a", None)}},
       [](V v) { return dynamic_update_slice(v[0], v[1], {full({}, 0.0, DType::kI32), full({}, 2.0, DType::kI32)}); },
       "f32[16@a,8]"},
      {"dynamic_update_slice_differs",
       {{f32, {16, 8}, P("a", None)}, {f32, {16, 4}, P()}},
       [](V v) { return dynamic_update_slice(v[0], v[1], {full({}, 0.0, DType::kI32), full({}, 2.0, DType::kI32)}); },
       "error: dynamic_update_slice operand sharding must be equal to update sharding (operands f32[16@a,8], "
       "f32[16,4], i32[2])"},
      // scatter (slicing.py's _scatter_spec_computation): the indexed dimension and the queries
      // unsplit; the window dimensions agree between the operand and the updates.
      {"scatter_window_split",
       {{f32, {32, 8}, P(None, "b")}, {DType::kI32, {16}, P()}, {f32, {16, 8}, P(None, "b")}},
       [](V v) { return scatter(v[0], v[1], v[2], 0); },
       "f32[32,8@b]"},
      // A window dimension split on one side only (rule 2, "Full slice dims must resolve
      // unambiguously between operand and updates": the same split or none) is refused, with
      // _scatter_sharding_rule's text (its .at[...](out_sharding=) runs under auto_axes; the types
      // in Tessera's notation), which dimension disagrees in the fix.
      {"scatter_add_updates_split",
       {{f32, {32, 8}, P()}, {DType::kI32, {16}, P()}, {f32, {16, 8}, P(None, "b")}},
       [](V v) { return scatter_add(v[0], v[1], v[2], 0); },
       "error: scatter_add: Use `.at[...].set/add/mul/...(out_sharding=)` to provide output PartitionSpec for the "
       "scatter "
       "update as out sharding could not be resolved unambiguously (or would require collectives on inputs). Got "
       "operand=f32[32,8], indices=i32[16], updates=f32[16,8@b] (operands f32[32,8], i32[16], f32[16,8@b]); window "
       "dimension 1 of the operand is unsplit and dimension 1 of the updates split over ('b',)"},
      {"scatter_operand_split_updates_replicated",
       {{f32, {32, 8}, P(None, "b")}, {DType::kI32, {16}, P()}, {f32, {16, 8}, P()}},
       [](V v) { return scatter(v[0], v[1], v[2], 0); },
       "error: scatter: Use `.at[...].set/add/mul/...(out_sharding=)` to provide output PartitionSpec for the scatter "
       "update as out sharding could not be resolved unambiguously (or would require collectives on inputs). Got "
       "operand=f32[32,8@b], indices=i32[16], updates=f32[16,8] (operands f32[32,8@b], i32[16], f32[16,8]); window "
       "dimension 1 of the operand is split over ('b',) and dimension 1 of the updates unsplit, and the indexed "
       "dimension and the indices must be unsplit, the other dimensions split alike in the operand and the updates: "
       "give the scatter an out_sharding (at(x, indices).set(updates, P(...)), at(x, indices).add(updates, "
       "P(...)), which run it under auto_axes as JAX's `.at[...].set/add/mul/...(out_sharding=)`)"},
      // x.at[i].set / add lay the updates out as the indexed slice of x, as JAX's _scatter_impl
      // (broadcast_to(y, slice_shape, out_sharding=indexer.slice_sharding)).
      {"at_set_lays_the_updates_out_as_the_slice",
       {{f32, {32, 8}, P(None, "b")}, {DType::kI32, {16}, P()}, {f32, {16, 8}, P()}},
       [](V v) { return at(v[0], v[1], 0).set(v[2]); },
       "f32[32,8@b]"},
      // ... and with the index array's own split on its dimensions (_index_to_gather's aia_spec),
      // which the scatter then refuses, naming those updates, as JAX's.
      {"at_set_lays_the_updates_out_with_the_indices_split",
       {{f32, {32, 8}, P()}, {DType::kI32, {16}, P("a")}, {f32, {16, 8}, P()}},
       [](V v) { return at(v[0], v[1], 0).set(v[2]); },
       "error: scatter: Use `.at[...].set/add/mul/...(out_sharding=)` to provide output PartitionSpec for the "
       "scatter update as out sharding could not be resolved unambiguously (or would require collectives on inputs). "
       "Got operand=f32[32,8], indices=i32[16@a], updates=f32[16@a,8]"},
      {"at_add_of_a_scalar",
       {{f32, {8, 32}, P("a", None)}, {DType::kI32, {4}, P()}},
       [](V v) { return at(v[0], v[1], 1).add(full({}, 1.0)); },
       "f32[8@a,32]"},
      {"scatter_indexed_dim_split",
       {{f32, {32, 8}, P("a", None)}, {DType::kI32, {16}, P()}, {f32, {16, 8}, P()}},
       [](V v) { return scatter(v[0], v[1], v[2], 0); },
       "error: scatter: Use `.at[...].set/add/mul/...(out_sharding=)` to provide output PartitionSpec for the "
       "scatter update as out sharding could not be resolved unambiguously (or would require collectives on inputs). "
       "Got operand=f32[32@a,8], indices=i32[16], updates=f32[16,8] (operands f32[32@a,8], i32[16], f32[16,8]); the "
       "indexed dimension 0 is split over ('a',)"},
      {"scatter_indices_split",
       {{f32, {32, 8}, P()}, {DType::kI32, {16}, P("a")}, {f32, {16, 8}, P("a", None)}},
       [](V v) { return scatter_add(v[0], v[1], v[2], 0); },
       "error: scatter_add: Use `.at[...].set/add/mul/...(out_sharding=)` to provide output PartitionSpec for the "
       "scatter update as out sharding could not be resolved unambiguously (or would require collectives on inputs). "
       "Got operand=f32[32,8], indices=i32[16@a], updates=f32[16@a,8] (operands f32[32,8], i32[16@a], "
       "f32[16@a,8]); dimension 0 of the indices is split over ('a',)"},
      {"scatter_window_disagree",
       {{f32, {32, 8}, P(None, "b")}, {DType::kI32, {16}, P()}, {f32, {16, 8}, P(None, "a")}},
       [](V v) { return scatter(v[0], v[1], v[2], 0); },
       "error: scatter: Use `.at[...].set/add/mul/...(out_sharding=)` to provide output PartitionSpec for the "
       "scatter update as out sharding could not be resolved unambiguously (or would require collectives on inputs). "
       "Got operand=f32[32,8@b], indices=i32[16], updates=f32[16,8@a] (operands f32[32,8@b], i32[16], "
       "f32[16,8@a]); window dimension 1 of the operand is split over ('b',) and dimension 1 of the updates split "
       "over ('a',)"},
      // reshard moves the spec on purpose.
      {"reshard", {{f32, {16, 8}, P("a", None)}}, [](V v) { return reshard(v[0], P(None, "a")); }, "f32[16,8@a]"},
      // out_sharding on the ops that make or broadcast values is the result's type (lax.py:
      // _broadcast_in_dim_sharding_rule and iota's return it; pjit_test.py test_broadcast_to,
      // test_broadcasted_iota_with_sharding, test_jnp_zeros_out_sharding).
      {"broadcast_to_out_sharding",
       {{f32, {1, 8}, P(None, "b")}},
       [](V v) { return broadcast_to(v[0], {16, 8}, P("a", "b")); },
       "f32[16@a,8@b]"},
      {"broadcast_in_dim_out_sharding_moves_split",
       {{f32, {16}, P("a")}},
       [](V v) { return broadcast_in_dim(v[0], {16, 8}, {0}, P(None, "a")); },
       "f32[16,8@a]"},
      {"iota_out_sharding",
       {{f32, {2}, P()}},
       [](V) { return iota(DType::kI32, {8, 16}, 1, P("a", "b")); },
       "i32[8@a,16@b]"},
      {"full_out_sharding",
       {{f32, {2}, P()}},
       [](V) { return full({16, 8}, 1.0, f32, P(Axes{"a", "b"})); },
       "f32[16@(a,b),8]"},
      // take's out_sharding (.at[].get(out_sharding=), indexing.py: under auto_axes): the
      // indexed dimension may be split (test_auto_gather_out_sharding).
      {"take_out_sharding_indexed_dim_split",
       {{f32, {32, 8}, P("a", "b")}, {DType::kI32, {4, 8}, P()}},
       [](V v) { return take(v[0], v[1], 0, P(None, "a", "b")); },
       "f32[4,8@a,8@b]"},
      {"at_get_out_sharding",
       {{f32, {8, 32}, P(None, "b")}, {DType::kI32, {16}, P("a")}},
       [](V v) { return at(v[0], v[1], 1).get(P(None, "a")); },
       "f32[8,16@a]"},
      // The updates' out_sharding (jax/_src/ops/scatter.py _scatter_update: under auto_axes, the
      // result laid out so; pjit_test.py test_at_add_lower_to_scatter_add, test_index_update):
      // split indices and a split indexed dimension, which scatter_indices_split and
      // scatter_indexed_dim_split refuse, are no error.
      {"at_add_out_sharding_indices_split",
       {{f32, {32, 8}, P(None, "b")}, {DType::kI32, {16}, P("a")}, {f32, {16, 8}, P("a", None)}},
       [](V v) { return at(v[0], v[1], 0).add(v[2], P(None, "b")); },
       "f32[32,8@b]"},
      {"at_set_out_sharding_indexed_dim_split",
       {{f32, {32, 8}, P("a", None)}, {DType::kI32, {16}, P()}, {f32, {16, 8}, P()}},
       [](V v) { return at(v[0], v[1], 0).set(v[2], P("a", "b")); },
       "f32[32@a,8@b]"},
  };
  for (const Mesh& mesh : {mesh_of({2, 4}, {"a", "b"}, {kE, kE}), mesh_of({4, 2}, {"a", "b"}, {kE, kE})}) {
    for (const GridCase& c : cases) {
      SCOPED_TRACE(absl::StrCat(mesh.to_string(), " ", c.name));
      const std::string got = one_type(mesh, c.inputs, [&](V v) { return std::vector<Value>{c.f(v)}; });
      const std::string want = c.want;
      if (want.rfind("error: ", 0) == 0) {
        EXPECT_THAT(got, HasSubstr(want.substr(7)));
        EXPECT_EQ(got.rfind("error: ", 0), 0u);
      } else {
        EXPECT_EQ(got, want);
      }
    }
  }
}

// Control flow in explicit mode (client/explicit/control.cc): a carry's sharding is part of
// its type. The expected types and messages are JAX's: jax-ml/jax tests/pjit_test.py
// (ShardingInTypesTest: test_scan, test_scan_carry_shardings_diff_error,
// test_cond_lowering_constraint) and the messages of jax/_src/lax/control_flow/loops.py
// (_check_carry_type, _infer_scan_length) and conditionals.py (_check_branch_outputs), without
// the functions' names and source lines, which C++ callables do not have (so a carry is "the\n// input carry at path
// [k]", as JAX says when it cannot read the body's signature).
using V = const std::vector<Value>&;

const Mesh& x2y2() {
  static const Mesh m = mesh_of({2, 2}, {"x", "y"}, {kE, kE});
  return m;
}
const Mesh& x2() {
  static const Mesh m = mesh_of({2}, {"x"}, {kE});
  return m;
}

// test_scan: carry f32[2,8] P(None, 'x'), xs f32[8,8,2] P(None, 'x', 'y'); inside the body the
// carry is P(None, 'x'), a row P('x', 'y'), the einsums' results their out_shardings; the final
// carry P(None, 'x') and the stacked ys P(None, None, 'y'). Gradients take their primals'
// shardings (the test's jit(grad(g, argnums=(0, 1)))). A split leading dimension of xs is
// "0th dimension of all xs should be replicated".
TEST(ExplicitControlFlow, ScanTypesCarriesRowsAndStackedYsAsJaxTestScan) {
  const std::vector<Input> in = {{DType::kF32, {2, 8}, P(None, "x")}, {DType::kF32, {8, 8, 2}, P(None, "x", "y")}};
  std::vector<std::string> inside;
  auto f = [&inside](V v) {
    ScanResult r = scan(
        [&inside](V c, V x) {
          const Value y = einsum("xy,yz->xz", c[0], x[0], P(None, "y"));
          const Value z = nn::relu(y);
          const Value a = einsum("xy,yz->xz", z, transpose(x[0], {1, 0}), P(None, "x"));
          inside = {type_of(c[0]).to_string(), type_of(x[0]).to_string(), type_of(y).to_string(),
                    type_of(z).to_string(), type_of(a).to_string()};
          return ScanStep{{a}, {y}};
        },
        {v[0]}, {v[1]});
    return std::vector<Value>{r.carry[0], r.ys[0]};  // a failed scan's ys are invalid Values too
  };
  absl::StatusOr<std::vector<std::string>> t = result_types(x2y2(), in, f);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(inside, ::testing::ElementsAre("f32[2,8@x]", "f32[8@x,2@y]", "f32[2,2@y]", "f32[2,2@y]", "f32[2,8@x]"));
  EXPECT_THAT(*t, ::testing::ElementsAre("f32[2,8@x]", "f32[8,2,2@y]"));

  absl::StatusOr<std::vector<std::string>> g = result_types(x2y2(), in, [&f](V v) {
    return grad([&f](V p) { return std::vector<Value>{sum(f(p)[0])}; }, {0, 1})(v);
  });
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_THAT(*g, ::testing::ElementsAre("f32[2,8@x]", "f32[8,8@x,2@y]"));

  EXPECT_EQ(one_type(x2y2(), {in[0], {DType::kF32, {8, 8, 2}, P("x", None, None)}}, f),
            "error: scan: 0th dimension of all xs should be replicated. Got P('x', None, None) (operand "
            "f32[8@x,8,2]); reshard the xs so that the scanned dimension is not split (reshard(xs, P(None, ...)))");
}

// An unreduced out_sharding is the out_sharding of the one op it is given to, as JAX binds it
// as that primitive's param: jnp.einsum hands it to its dot_general in the dot's dimension
// order (jax/_src/numpy/einsum.py, _get_inverse_sharding keeps the unreduced axes) and
// transposes after, which keeps them (lax.py's _transpose_ur_rule): "xy,yz->zx" of operands
// split over Y on the contracted y is f32[4,8]{U:Y}, directly and in a scan body that reads an
// outer value (the body is traced again with that value as a loop constant, each node typed
// anew with only its own out_sharding).
TEST(ExplicitControlFlow, AnUnreducedOutShardingIsItsOpsOnlyAlsoWhenABodyIsTracedAgain) {
  const PartitionSpec unreduced = P(None, None).with_unreduced({"Y"});
  const std::vector<Input> in = {{DType::kF32, {8, 16}, P(None, "Y")},
                                 {DType::kF32, {16, 4}, P("Y", None)},
                                 {DType::kF32, {2, 8, 16}, P(None, None, "Y")}};
  EXPECT_EQ(one_type(xy(), in, [&](V v) { return std::vector<Value>{einsum("xy,yz->zx", v[0], v[1], unreduced)}; }),
            "f32[4,8]{U:Y}");
  std::vector<std::string> inside;
  const auto f = [&](V v) {
    const Value w = v[1];
    ScanResult r = scan(
        [&](V c, V x) {
          const Value p = einsum("xy,yz->zx", x[0], w, unreduced);
          inside.push_back(type_of(p).to_string());
          return ScanStep{{c[0] + reshard(p, P())}, {}};
        },
        {full({4, 8}, 0.0)}, {v[2]});
    return r.carry;
  };
  absl::StatusOr<std::vector<std::string>> t = result_types(xy(), in, f);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(inside, ::testing::Each("f32[4,8]{U:Y}"));
  EXPECT_THAT(*t, ::testing::ElementsAre("f32[4,8]"));
  // grad replays the body (its VJP inlines the body's graph): gradients take their primals' types.
  absl::StatusOr<std::vector<std::string>> g = result_types(xy(), in, [&](V v) {
    return grad([&](V p) { return std::vector<Value>{sum(f(p)[0])}; }, {1, 2})(v);
  });
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_THAT(*g, ::testing::ElementsAre("f32[16@Y,4]", "f32[2,8,16@Y]"));
}

// test_scan_carry_shardings_diff_error: on a (2,) mesh, a body that reshards its carry i32[4]
// P('x') to P() fails with "scan body function carry input and carry output must have equal\n// types"; the whole text
// is _check_carry_type's (aval_mismatch_extra says nothing of shardings). while_loop's body is checked the same way
// ('while_loop body').
TEST(ExplicitControlFlow, ABodyThatChangesACarrysShardingIsRefusedInJaxsWords) {
  const std::vector<Input> in = {{DType::kI32, {4}, P("x")}};
  EXPECT_EQ(one_type(x2(), in,
                     [](V v) {
                       return scan([](V c, V) { return ScanStep{{reshard(c[0], P())}, {}}; }, {v[0]}, {}, 1).carry;
                     }),
            "error: scan body function carry input and carry output must have equal types, but they differ:\n\n"
            "The input carry at path [0] has type i32[4@x] but the corresponding output carry component has type "
            "i32[4].\n\nRevise the function so that all output types match the corresponding input types.");
  EXPECT_EQ(one_type(x2(), in,
                     [](V v) {
                       return while_loop([](V c) { return sum(c[0]) < 100; },
                                         [](V c) { return std::vector<Value>{reshard(c[0] * 2, P())}; }, {v[0]});
                     }),
            "error: while_loop body function carry input and carry output must have equal types, but they differ:\n\n"
            "The input carry at path [0] has type i32[4@x] but the corresponding output carry component has type "
            "i32[4].\n\nRevise the function so that all output types match the corresponding input types.");
  // Two carries differing: JAX's bullet list.
  const std::vector<Input> two = {{DType::kI32, {4}, P("x")}, {DType::kI32, {4}, P()}};
  EXPECT_EQ(one_type(x2(), two,
                     [](V v) {
                       return scan(
                                  [](V c, V) {
                                    return ScanStep{{reshard(c[0], P()), reshard(c[1], P("x"))}, {}};
                                  },
                                  {v[0], v[1]}, {}, 1)
                           .carry;
                     }),
            "error: scan body function carry input and carry output must have equal types, but they differ:\n\n"
            "  * the input carry at path [0] has type i32[4@x] but the corresponding output carry component has "
            "type i32[4];\n\n  * the input carry at path [1] has type i32[4] but the corresponding output carry "
            "component has type i32[4@x].\n\nRevise the function so that all output types match the corresponding "
            "input types.");
}

// Split carries go through while_loop, fori_loop and scan keeping their types; a value the body
// reads from outside keeps its type there (the stacked ys of a split outer value are split).
TEST(ExplicitControlFlow, LoopsKeepSplitCarriesAndCapturedValuesTypes) {
  const std::vector<Input> in = {{DType::kF32, {8, 4}, P("X", None)}, {DType::kF32, {8, 4}, P(None, "Y")}};
  EXPECT_EQ(one_type(xy(), in,
                     [](V v) {
                       return while_loop([](V c) { return sum(c[0]) < 100.0; },
                                         [](V c) { return std::vector<Value>{c[0] * 2.0}; }, {v[0]});
                     }),
            "f32[8@X,4]");
  EXPECT_EQ(one_type(xy(), in,
                     [](V v) {
                       return fori_loop(0, 3, [](const Value&, V c) { return std::vector<Value>{c[0] + 1.0}; }, {v[1]});
                     }),
            "f32[8,4@Y]");
  EXPECT_EQ(one_type(xy(), in,
                     [](V v) {
                       const Value w = v[1];
                       return scan([&w](V c, V) { return ScanStep{{c[0]}, {w * 2.0}}; }, {v[0]}, {}, 3).ys;
                     }),
            "f32[3,8,4@Y]");
}

// test_cond_lowering_constraint: cond(True, lambda x, y: x, lambda x, y: y, x, y) of two i32[8]
// P('x') arrays is P('x'), and so is out * 2. Branches whose output types differ are refused
// with _check_branch_outputs' text (cond: true_fun first; switch: branch 0 against branch k).
// checkpoint is a one-branch switch: its results have f's types.
TEST(ExplicitControlFlow, BranchesAgreeOnTheirOutputTypesAsJaxConditionals) {
  const std::vector<Input> in = {{DType::kI32, {8}, P("x")}, {DType::kI32, {8}, P("x")}};
  EXPECT_EQ(one_type(x2(), in,
                     [](V v) {
                       const Value out = cond(
                           full({}, 1.0, DType::kBool), [](V a) { return std::vector<Value>{a[0]}; },
                           [](V a) { return std::vector<Value>{a[1]}; }, v)[0];
                       return std::vector<Value>{out * 2};
                     }),
            "i32[8@x]");
  EXPECT_EQ(one_type(x2(), in,
                     [](V v) {
                       return cond(
                           full({}, 1.0, DType::kBool), [](V a) { return std::vector<Value>{a[0]}; },
                           [](V a) { return std::vector<Value>{reshard(a[1], P())}; }, v);
                     }),
            "error: cond branches must have equal output types but they differ.\n\nThe output of true_fun at path "
            "[0] has type i32[8@x] but the corresponding output of false_fun has type i32[8].\n\nRevise true_fun "
            "and/or false_fun so that all output types match.");
  auto id = [](V a) { return std::vector<Value>{a[0] + 1}; };
  EXPECT_EQ(one_type(x2(), in, [&](V v) { return switch_(full({}, 2.0, DType::kI32), {id, id, id}, v); }), "i32[8@x]");
  EXPECT_EQ(one_type(x2(), in,
                     [&](V v) {
                       return switch_(full({}, 2.0, DType::kI32),
                                      {id, id, [](V a) { return std::vector<Value>{reshard(a[0], P())}; }}, v);
                     }),
            "error: switch branches must have equal output types but they differ.\n\nThe output of branch 0 at path "
            "[0] has type i32[8@x] but the corresponding output of branch 2 has type i32[8].\n\nRevise branch 0 "
            "and/or branch 2 so that all output types match.");
  EXPECT_EQ(one_type(xy(), {{DType::kF32, {8, 4}, P("X", "Y")}},
                     [](V v) { return checkpoint([](V a) { return std::vector<Value>{tanh(a[0])}; })(v); }),
            "f32[8@X,4@Y]");
  // With a policy, the kept values are more results of the switch, not of the checkpoint.
  absl::StatusOr<std::vector<std::string>> kept = result_types(xy(), {{DType::kF32, {8, 4}, P("X", "Y")}}, [](V v) {
    return checkpoint([](V a) { return std::vector<Value>{tanh(a[0] * 2)}; },
                      checkpoint_policies::everything_saveable)(v);
  });
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(*kept, std::vector<std::string>{"f32[8@X,4@Y]"});
}

// shard_map on a mesh of Explicit axes (jax/_src/shard_map.py, JAX >= 0.9): an in_spec other
// than the argument's type is an error, not an implicit reshard; omitted in_specs are the
// arguments' types (test_shmap_full_manual_context_explicit in tests/shard_map_test.py omits
// them); inside the body values are blocks split over no mesh axis; a result's type is its
// out_spec.
TEST(ExplicitShardMap, InSpecsMustBeTheArgumentsTypesAndResultsAreTypedByOutSpecs) {
  const std::vector<Input> in = {{DType::kF32, {16, 8}, P("X", None)}};
  std::string body_type;
  auto twice = [&body_type](V b) {
    body_type = type_of(b[0]).to_string();
    return std::vector<Value>{b[0] * 2.0};
  };
  EXPECT_EQ(one_type(xy(), in, [&](V v) { return shard_map(twice, xy(), {P("X", None)}, {P("X", None)})(v); }),
            "f32[16@X,8]");
  // A block: no Explicit axis in its type, varying along the manual axis its in_spec names
  // (JAX prints f32[8,8]{V:X}: jax/_src/core.py's _vma_ur_str).
  EXPECT_EQ(body_type, "f32[8,8]{V:X}");
  EXPECT_EQ(one_type(xy(), in, [&](V v) { return shard_map(twice, xy(), {}, {P("X", None)})(v); }), "f32[16@X,8]");
  EXPECT_EQ(one_type(xy(), in,
                     [&](V v) {
                       return shard_map([](V b) { return std::vector<Value>{psum(b[0], "X")}; }, xy(), {},
                                        {P(None, "Y")})(v);
                     }),
            "f32[8,32@Y]");
  EXPECT_EQ(one_type(xy(), in, [&](V v) { return shard_map(twice, xy(), {P()}, {P()})(v); }),
            "error: shard_map: in_specs passed to shard_map: P(None, None) does not match the specs of the input: "
            "P('X', None) for arg: f32[16@X,8]. `in_specs` is an optional argument so you can omit specifying it and "
            "shard_map will infer the in_specs from the arguments. If you want to reshard your inputs, you can use "
            "`reshard` on the arguments and then pass those args to shard_map.");
}

// reshard and every op's out_sharding take Explicit axes only (jax/_src/sharding_impls.py,
// canonicalize_sharding: "PartitionSpec passed to {api_name} cannot contain axis names that are
// of type Auto or Manual. Got PartitionSpec: ... with axis name: ... of type: ..."), with the
// types in force where they are called. tests/pjit_test.py: test_dot_general_out_sharding (an
// einsum's out_sharding on an axis auto_axes made Auto), test_error_on_canonicalize_under_auto_mode
// (an einsum's out_sharding on an all-Auto mesh), test_reshard_no_mesh_ctx (reshard onto Auto
// axes; the Array case is in out_sharding_test).
TEST(ExplicitShardMap, ReshardAndOutShardingTakeExplicitAxesOnly) {
  const std::vector<Input> in = {{DType::kF32, {8, 4}, P("X", None)}, {DType::kF32, {4, 8}, P()}};
  const std::string kJax = "cannot contain axis names that are of type Auto or Manual. Got PartitionSpec: ";
  // test_dot_general_out_sharding: inside auto_axes, 'X' is Auto.
  EXPECT_THAT(one_type(xy(), in,
                       auto_axes([](V v) { return std::vector<Value>{einsum("xy,yz->xz", v[0], v[1], P("X", None))}; },
                                 {}, {P()})),
              ::testing::AllOf(HasSubstr(absl::StrCat("PartitionSpec passed to einsum ", kJax,
                                                      "P('X', None) with axis name: X of type: Auto")),
                               HasSubstr("einsum takes Explicit axes only")));
  // Outside auto_axes the same call is fine, and P() names no axis inside.
  EXPECT_EQ(one_type(xy(), in, [](V v) { return std::vector<Value>{einsum("xy,yz->xz", v[0], v[1], P("X", None))}; }),
            "f32[8@X,8]");
  EXPECT_EQ(one_type(xy(), in,
                     auto_axes([](V v) { return std::vector<Value>{einsum("xy,yz->xz", v[0], v[1], P())}; }, {},
                               {P("X", None)})),
            "f32[8@X,8]");
  // auto_axes' own out_shardings are resharded outside, where 'X' is Explicit again.
  EXPECT_EQ(one_type(xy(), in, auto_axes([](V v) { return std::vector<Value>{v[0] * 2.0}; }, {"X"}, {P(None, "Y")})),
            "f32[8,4@Y]");
  // A mesh mixing types: only its Explicit axes may be named, by reshard and by the ops.
  const Mesh mixed = mesh_of({2, 4}, {"X", "Y"}, {kE, AxisType::kAuto});
  EXPECT_EQ(one_type(mixed, in, [](V v) { return std::vector<Value>{reshard(v[1], P(None, "X"))}; }), "f32[4,8@X]");
  EXPECT_THAT(one_type(mixed, in, [](V v) { return std::vector<Value>{reshard(v[1], P("X", "Y"))}; }),
              HasSubstr(absl::StrCat("PartitionSpec passed to reshard ", kJax,
                                     "P('X', 'Y') with axis name: Y of type: Auto (in AbstractMesh('X': 2, 'Y': 4, "
                                     "axis_types=(Explicit, Auto)))")));
  // The unreduced and reduced axes too (canonicalize_sharding chains spec.unreduced and
  // spec.reduced after the partitions' axes).
  EXPECT_THAT(
      one_type(mixed, in, [](V v) { return std::vector<Value>{reshard(v[1], P(None, "X").with_reduced({"Y"}))}; }),
      HasSubstr(absl::StrCat("PartitionSpec passed to reshard ", kJax,
                             "P(None, 'X', reduced={'Y'}) with axis name: Y of type: Auto")));
  EXPECT_THAT(
      one_type(mixed, in,
               [](V v) { return std::vector<Value>{einsum("xy,yz->xz", v[0], v[1], P().with_unreduced({"Y"}))}; }),
      HasSubstr(absl::StrCat("PartitionSpec passed to einsum ", kJax,
                             "P(None, None, unreduced={'Y'}, unreduced_kind=sum) with axis name: Y of type: Auto")));
  for (const auto& [api, f] : std::vector<std::pair<std::string, std::function<Value(V)>>>{
           // jnp.matmul hands out_sharding to lax.dot_general, which canonicalizes it under its
           // own name (jax/_src/lax/lax.py, dot_general: canonicalize_sharding(out_sharding,
           // 'dot_general')).
           {"dot_general",
            [](V v) {
              return matmul(v[0], v[1], P(Axes{"X", "Y"}, None));
            }},
           {"reshape", [](V v) { return reshape(v[0], {32}, P("Y")); }},
           {"broadcast_to",
            [](V v) {
              return broadcast_to(v[0], {2, 8, 4}, P("Y", "X", None));
            }},
           {"iota", [](V) { return iota(DType::kI32, {8}, 0, P("Y")); }},
           {"full", [](V) { return full({8}, 1.0, DType::kF32, P("Y")); }},
           {"take", [](V v) { return take(v[0], iota(DType::kI32, {4}, 0), 0, P(None, "Y")); }},
       }) {
    EXPECT_THAT(one_type(mixed, in, [&f = f](V v) { return std::vector<Value>{f(v)}; }),
                HasSubstr(absl::StrCat("PartitionSpec passed to ", api, " ", kJax)))
        << api;
  }
  // test_error_on_canonicalize_under_auto_mode: on an all-Auto mesh (the ambient one here).
  const Mesh autos = mesh_of({2, 4}, {"X", "Y"}, {});
  MeshScope scope = set_mesh(autos);
  EXPECT_THAT(
      one_type(autos, in, [](V v) { return std::vector<Value>{einsum("xy,yz->xz", v[0], v[1], P("X", "Y"))}; }),
      HasSubstr(absl::StrCat("PartitionSpec passed to einsum ", kJax, "P('X', 'Y') with axis name: X of type: Auto")));
  EXPECT_THAT(one_type(autos, in, [](V v) { return std::vector<Value>{reshard(v[0], P("X", None))}; }),
              HasSubstr("lay Auto axes out with with_sharding_constraint"));
  EXPECT_EQ(one_type(autos, in, [](V v) { return std::vector<Value>{with_sharding_constraint(v[0], P("X", "Y"))}; }),
            "f32[8,4]");
  // In a shard_map body the manual axes are Manual.
  EXPECT_THAT(one_type(xy(), in,
                       [](V v) {
                         return shard_map([](V b) { return std::vector<Value>{reshard(b[0], P(None, "X"))}; }, xy(),
                                          {P("X", None)}, {P("X", None)})({v[0]});
                       }),
              HasSubstr(absl::StrCat("PartitionSpec passed to reshard ", kJax,
                                     "P(None, 'X') with axis name: X of type: Manual")));
  EXPECT_THAT(one_type(xy(), in,
                       [](V v) {
                         return shard_map(
                             [](V b) { return std::vector<Value>{reshard(b[0], P().with_reduced({"X"}))}; }, xy(),
                             {P("X", None)}, {P("X", None)})({v[0]});
                       }),
              HasSubstr(absl::StrCat("PartitionSpec passed to reshard ", kJax,
                                     "P(reduced={'X'}) with axis name: X of type: Manual")));
}

// grad in explicit mode: a cotangent takes its primal's type (the notebook's "tangent values
// are sharded in the same way as their primal values"), so the VJP of a layer whose backward
// contractions are split on both sides needs no out_sharding from the user.
TEST(ExplicitGrid, GradientsTakeTheirPrimalsTypes) {
  const std::vector<Input> in = {{DType::kF32, {16, 8}, P("X", None)}, {DType::kF32, {8, 8}, P(None, "Y")}};
  absl::StatusOr<std::vector<std::string>> t = result_types(xy(), in, [](const std::vector<Value>& v) {
    std::vector<Value> g =
        grad([](const std::vector<Value>& p) { return std::vector<Value>{sum(tanh(matmul(p[0], p[1])))}; }, {0, 1})(v);
    return g;
  });
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(*t, ::testing::ElementsAre("f32[16@X,8]", "f32[8,8@Y]"));
}

// jnp.matmul on a 2x2 mesh with the contracting dimension split on one operand only (allowed
// by _dot_general_sharding_rule, jax/_src/lax/lax.py: only a dimension split on both needs
// out_sharding) and the batch dimensions built as tensor_contractions.py's matmul builds them:
// the result keeps each free dimension's split, and grad types each gradient as its primal.
TEST(ExplicitGrid, MatmulBatchDimensionsOnATwoByTwoMesh) {
  const Mesh m = mesh_of({2, 2}, {"x", "y"}, {kE, kE});
  const DType f32 = DType::kF32;
  auto mm = [](const std::vector<Value>& v) { return std::vector<Value>{matmul(v[0], v[1])}; };
  EXPECT_EQ(one_type(m, {{f32, {4, 8}, P(None, "y")}, {f32, {2, 8, 4}, P("x", None, None)}}, mm), "f32[2@x,4,4]");
  EXPECT_EQ(one_type(m, {{f32, {2, 4, 8}, P("x", None, "y")}, {f32, {2, 8, 4}, P("x", None, None)}}, mm),
            "f32[2@x,4,4]");
  EXPECT_EQ(one_type(m, {{f32, {2, 4, 8}, P("x", None, None)}, {f32, {8, 4}, P("y", None)}}, mm), "f32[2@x,4,4]");
  EXPECT_EQ(one_type(m, {{f32, {2, 1, 4, 8}, P("x", None, None, "y")}, {f32, {2, 8, 4}, P()}}, mm), "f32[2@x,2,4,4]");
  EXPECT_THAT(one_type(m, {{f32, {2, 4, 8}, P(None, None, "y")}, {f32, {2, 8, 4}, P("x", None, None)}}, mm),
              HasSubstr("matmul: Incompatible types for matmul arguments: f32[2,4,8@y] and f32[2@x,8,4]"));
  absl::StatusOr<std::vector<std::string>> g = result_types(
      m, {{f32, {4, 8}, P(None, "y")}, {f32, {2, 8, 4}, P("x", None, None)}}, [](const std::vector<Value>& v) {
        return grad([](const std::vector<Value>& p) { return std::vector<Value>{sum(tanh(matmul(p[0], p[1])))}; },
                    {0, 1})(v);
      });
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_THAT(*g, ::testing::ElementsAre("f32[4,8@y]", "f32[2@x,8,4]"));
  // tests/pjit_test.py test_jnp_matmul_out_sharding_3d: a size-1 batch dimension split alike on
  // both (over an axis of size 1) is a batch dimension; out_sharding=P('x') resolves the
  // contraction split over 'y' on both: P('x', None, None).
  const Mesh m12 = mesh_of({1, 2}, {"x", "y"}, {kE, kE});
  EXPECT_EQ(one_type(m12, {{f32, {1, 1, 4}, P("x", None, "y")}, {f32, {1, 4, 2}, P("x", "y", None)}},
                     [](const std::vector<Value>& v) { return std::vector<Value>{matmul(v[0], v[1], P("x"))}; }),
            "f32[1@x,1,2]");
}

// jnp.matmul (jax/_src/numpy/tensor_contractions.py) gives out_sharding to its dot_general, of
// the product's rank and in its order (batch, lhs free, rhs free, without the dimensions it
// squeezes from both operands), then transposes into numpy's order and expand_dims those back.
// f32[4,8,16] @ f32[2,4,16,8]: the product is [4 (batch), 8 (lhs), 2, 8 (rhs)], so P('x') splits
// the batch dimension of 4, as JAX's float32[2,4@x,8,8]. An unreduced out_sharding is the
// dot_general's (tests/pjit_test.py test_jnp_matmul_out_sharding_unreduced checks the
// dot_general's output type has it) and the transpose keeps it (_transpose_ur_rule); an
// unreduced operand is refused by dot_general (squeeze keeps unreduced axes, _squeeze_ur_rule;
// _dot_general_ur_rule: "lhs or rhs passed to dot_general cannot be unreduced").
TEST(ExplicitGrid, MatmulOutShardingIsItsDotGeneralsAsJnp) {
  const DType f32 = DType::kF32;
  auto mm = [](const PartitionSpec& out) {
    return [out](const std::vector<Value>& v) { return std::vector<Value>{matmul(v[0], v[1], out)}; };
  };
  const std::vector<Input> permuted = {{f32, {4, 8, 16}, P()}, {f32, {2, 4, 16, 8}, P()}};
  EXPECT_EQ(one_type(x2y2(), permuted, mm(P("x"))), "f32[2,4@x,8,8]");
  EXPECT_EQ(one_type(x2y2(), permuted, mm(P(None, None, "x", "y"))), "f32[2@x,4,8,8@y]");
  // A dimension that is an unsplit 1 on both is squeezed from both: out_sharding is of rank 3.
  const std::vector<Input> ones = {{f32, {1, 4, 8, 16}, P()}, {f32, {1, 4, 16, 8}, P()}};
  EXPECT_EQ(one_type(x2y2(), ones, mm(P("x"))), "f32[1,4@x,8,8]");
  EXPECT_EQ(one_type(x2y2(), ones, mm(P(None, "x", "y"))), "f32[1,4,8@x,8@y]");
  // The contraction split over 'y' on both, left as each device's partial sum.
  const std::vector<Input> contracted = {{f32, {4, 8, 16}, P(None, None, "y")},
                                         {f32, {2, 4, 16, 8}, P(None, None, "y", None)}};
  EXPECT_EQ(one_type(x2y2(), contracted, mm(P().with_unreduced({"y"}))), "f32[2,4,8,8]{U:y}");
  EXPECT_EQ(one_type(x2y2(), contracted, mm(P("x").with_unreduced({"y"}))), "f32[2,4@x,8,8]{U:y}");
  // f32[1,4,8]{U:y}, whose size-1 dimension matmul squeezes, as an operand.
  const std::vector<Input> partial = {
      {f32, {1, 4, 16}, P(None, None, "y")}, {f32, {16, 8}, P("y", None)}, {f32, {2, 8, 4}, P()}};
  const std::string refused = one_type(x2y2(), partial, [](const std::vector<Value>& v) {
    return std::vector<Value>{matmul(matmul(v[0], v[1], P().with_unreduced({"y"})), v[2], P())};
  });
  EXPECT_THAT(refused, HasSubstr("lhs or rhs passed to dot_general cannot be unreduced"));
  EXPECT_THAT(refused, ::testing::Not(HasSubstr("reshape")));
}

// A scatter's gradients are laid out as its operand and its updates (tests/pjit_test.py
// test_scatter_sharding_rule asserts so for x.at[ind].set / add / ...): the operand's cotangent
// is a scatter of zeros laid out as the updates (_scatter_transpose_rule), which the explicit
// rule needs split alike on the window dimension.
TEST(ExplicitGrid, ScatterGradientsTakeTheOperandsAndUpdatesTypes) {
  const std::vector<Input> in = {
      {DType::kF32, {16, 8}, P(None, "Y")}, {DType::kI32, {4}, P()}, {DType::kF32, {4, 8}, P(None, "Y")}};
  for (bool add : {false, true}) {
    absl::StatusOr<std::vector<std::string>> t = result_types(xy(), in, [add](const std::vector<Value>& v) {
      return grad(
          [add](const std::vector<Value>& p) {
            const Value y = add ? scatter_add(p[0], p[1], p[2], 0) : scatter(p[0], p[1], p[2], 0);
            return std::vector<Value>{sum(tanh(y))};
          },
          {0, 2})(v);
    });
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_THAT(*t, ::testing::ElementsAre("f32[16,8@Y]", "f32[4,8@Y]")) << add;
  }
}

}  // namespace
}  // namespace tessera
