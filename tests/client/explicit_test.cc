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

TEST(ExplicitJaxDocs, ExplicitAxesNeedAMesh) {
  EXPECT_THAT(one_type(mesh_of({2, 4}, {"X", "Y"}, {}), {{DType::kF32, {4, 4}, P()}},
                       explicit_axes([](const std::vector<Value>& in) { return in; }, {}, {P()})),
              HasSubstr("Context mesh cannot be empty"));
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
       "error: batch dimensions must be split alike"},
      {"matmul_result_axis_twice",
       {{f32, {16, 8}, P("a", None)}, {f32, {8, 8}, P(None, "a")}},
       [](V v) { return matmul(v[0], v[1]); },
       "error: produces an illegally sharded result: f32[16@a,8@a]"},
      // Made in the function: unsplit (the notebook's nullary ops).
      {"iota",
       {{f32, {16, 8}, P("a", None)}},
       [](V) {
         return iota(DType::kI32, {16, 8}, 0);
       },
       "i32[16,8]"},
      {"full_plus_split",
       {{f32, {16, 8}, P("a", None)}},
       [](V v) {
         return v[0] + full({16, 8}, 1.0);
       },
       "f32[16@a,8]"},
      // Indexing: the table's other dimensions and the indices keep their splits.
      {"take_rows",
       {{f32, {32, 8}, P(None, "b")}, {DType::kI32, {16}, P("a")}},
       [](V v) { return take(v[0], v[1], 0); },
       "f32[16@a,8@b]"},
      {"take_split_table_dim",
       {{f32, {32, 8}, P("a", None)}, {DType::kI32, {16}, P()}},
       [](V v) { return take(v[0], v[1], 0); },
       "error: the indexed dimension 0 is split over ('a',)"},
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
       [](V v) {
         return pad(v[0], full({}, 0.0), {{0, 0, 0}, {1, 2, 0}});
       },
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
      {"scatter_add_updates_split",
       {{f32, {32, 8}, P()}, {DType::kI32, {16}, P()}, {f32, {16, 8}, P(None, "b")}},
       [](V v) { return scatter_add(v[0], v[1], v[2], 0); },
       "f32[32,8@b]"},
      {"scatter_indexed_dim_split",
       {{f32, {32, 8}, P("a", None)}, {DType::kI32, {16}, P()}, {f32, {16, 8}, P()}},
       [](V v) { return scatter(v[0], v[1], v[2], 0); },
       "error: scatter: out sharding could not be resolved unambiguously"},
      {"scatter_indices_split",
       {{f32, {32, 8}, P()}, {DType::kI32, {16}, P("a")}, {f32, {16, 8}, P("a", None)}},
       [](V v) { return scatter_add(v[0], v[1], v[2], 0); },
       "error: scatter_add: out sharding could not be resolved unambiguously"},
      {"scatter_window_disagree",
       {{f32, {32, 8}, P(None, "b")}, {DType::kI32, {16}, P()}, {f32, {16, 8}, P(None, "a")}},
       [](V v) { return scatter(v[0], v[1], v[2], 0); },
       "error: out sharding could not be resolved unambiguously"},
      // reshard moves the spec on purpose.
      {"reshard", {{f32, {16, 8}, P("a", None)}}, [](V v) { return reshard(v[0], P(None, "a")); }, "f32[16,8@a]"},
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

// An op with no explicit rule yet (while_loop here) takes replicated operands and refuses
// split ones, naming the op, the operand's type and the fix, rather than guessing.
TEST(ExplicitGrid, AnOpWithoutARuleRefusesSplitOperands) {
  auto loop = [](const std::vector<Value>& in) {
    return while_loop([](const std::vector<Value>& c) { return sum(c[0]) < 100.0; },
                      [](const std::vector<Value>& c) { return std::vector<Value>{c[0] * 2.0}; }, {in[0]});
  };
  EXPECT_EQ(one_type(xy(), {{DType::kF32, {8, 4}, P()}}, loop), "f32[8,4]");
  EXPECT_THAT(one_type(xy(), {{DType::kF32, {8, 4}, P("X", None)}}, loop),
              HasSubstr("has no explicit-sharding rule yet, and an operand is split over an Explicit mesh axis "
                        "(operand f32[8@X,4]); reshard it to P() first, or make that mesh axis Auto"));
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

}  // namespace
}  // namespace tessera
