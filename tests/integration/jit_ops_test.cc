// Every traced op of trace.h under representative shardings on the (8), (4, 2) and (2, 4)
// meshes of Client::local(8), against the single-device host reference (tests/support/).
//
// A case is one jitted function on one mesh with one input layout. Ops that share a
// propagation rule (the unary ops, the binary ops, ...) are the outputs of one function, so
// every op meets every layout at the cost of one compilation per layout; each output is
// checked on its own and a failure names the op. Shardings: replicated, each dimension over
// each axis, two dimensions over two axes (both ways), one dimension over a tuple of axes;
// plus the contraction layouts of dot_general and every transition with_sharding_constraint
// can force. Integer and bool results must be exact, float32 ones within kF32Tolerance.
#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"
#include "tests/support/host_eval.h"
#include "tests/support/jit_check.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

const std::vector<MeshDef>& meshes() { return test_meshes(); }

using CaseFunction = std::function<std::vector<Value>(const std::vector<Value>&, const Mesh&)>;

struct Input {
  DType dtype;
  Shape shape;
  Domain domain;
  PartitionSpec spec;
};

struct OpCase {
  std::string name;
  int mesh = 0;  // index into meshes()
  std::vector<Input> inputs;
  CaseFunction f;
  std::vector<std::string> outputs;                      // what each output is, for messages
  std::vector<std::optional<PartitionSpec>> want_specs;  // checked where set (JAX's behaviour)
  std::vector<std::string> want_in_plan;                 // collectives the plan must contain
  bool no_collectives = false;                           // the plan must contain none
  std::vector<std::string> want_text;                    // more text the plan must contain
  JitOptions options;
};

void PrintTo(const OpCase& c, std::ostream* os) { *os << c.name; }

std::string spec_name(const PartitionSpec& spec) {
  if (spec.used_axes().empty()) return "R";
  std::string out;
  for (int d = 0; d < spec.size(); ++d) {
    if (d > 0) out += "_";
    const Axes& axes = spec.axes(d);
    if (axes.empty()) out += "N";
    for (size_t i = 0; i < axes.size(); ++i) out += (i > 0 ? "X" : "") + axes[i];
  }
  return out;
}

// The representative layouts of a rank-2 value on `mesh`.
std::vector<PartitionSpec> rank2_specs(const MeshDef& mesh) {
  const std::string& a = mesh.axes[0];
  std::vector<PartitionSpec> out = {P(), P(a, None), P(None, a)};
  if (mesh.axes.size() == 2) {
    const std::string& b = mesh.axes[1];
    out.push_back(P(b, None));
    out.push_back(P(None, b));
    out.push_back(P(a, b));
    out.push_back(P(b, a));
    out.push_back(P(Axes{a, b}, None));
    out.push_back(P(None, Axes{a, b}));
  }
  return out;
}

PartitionSpec spec_of(std::vector<Axes> dims) { return PartitionSpec(std::move(dims)); }
Axes dim_axes(const PartitionSpec& s, int d) { return s.axes(d); }

const Shape kMatrix = {8, 16};

// The families whose every op runs under every rank-2 layout `s`.
void add_layout_families(int m, const PartitionSpec& s, std::vector<OpCase>* cases) {
  const std::string suffix = std::string("_") + meshes()[m].name + "_" + spec_name(s);
  const Axes s0 = dim_axes(s, 0), s1 = dim_axes(s, 1);
  auto add_case = [&](std::string family, std::vector<Input> inputs, std::vector<std::string> outputs, CaseFunction f,
                      std::vector<std::optional<PartitionSpec>> want_specs = {}) {
    OpCase c;
    c.name = family + suffix;
    c.mesh = m;
    c.inputs = std::move(inputs);
    c.outputs = std::move(outputs);
    c.f = std::move(f);
    c.want_specs = std::move(want_specs);
    cases->push_back(std::move(c));
  };
  const Input x{DType::kF32, kMatrix, Domain::kSigned, s};
  const Input pos{DType::kF32, kMatrix, Domain::kPositive, s};
  const Input i32{DType::kI32, kMatrix, Domain::kSigned, s};
  const Input b{DType::kBool, kMatrix, Domain::kSigned, s};

  // Elementwise: JAX keeps the operands' layout.
  add_case(
      "unary_f32", {x, pos},
      {"neg", "abs", "exp", "tanh", "logistic", "sin", "cos", "floor", "ceil", "sign", "log", "sqrt", "rsqrt", "-x",
       "erf"},
      [](const std::vector<Value>& in, const Mesh&) {
        const Value& v = in[0];
        const Value& p = in[1];
        return std::vector<Value>{neg(v),  abs(v),  exp(v), tanh(v), logistic(v), sin(v), cos(v), floor(v),
                                  ceil(v), sign(v), log(p), sqrt(p), rsqrt(p),    -v,     erf(v)};
      },
      std::vector<std::optional<PartitionSpec>>(15, s));
  add_case(
      "unary_int_bool", {i32, b}, {"neg i32", "abs i32", "sign i32", "logical_not"},
      [](const std::vector<Value>& in, const Mesh&) {
        return std::vector<Value>{neg(in[0]), abs(in[0]), sign(in[0]), logical_not(in[1])};
      },
      std::vector<std::optional<PartitionSpec>>(4, s));
  add_case(
      "binary_f32", {x, x, pos},
      {"add", "sub", "mul", "div", "pow", "maximum", "minimum", "x+2", "3-x", "x*y/2", "1/q", "<",
       ">=", "==", "!=", "x-2", "2*x", "2+x"},
      [](const std::vector<Value>& in, const Mesh&) {
        const Value &u = in[0], &v = in[1], &q = in[2];
        return std::vector<Value>{add(u, v),     sub(u, v), mul(u, v), div(u, q),   pow(q, u), maximum(u, v),
                                  minimum(u, v), u + 2.0,   3.0 - u,   u * v / 2.0, 1.0 / q,   u < v,
                                  u >= v,        u == u,    u != v,    u - 2.0,     2.0 * u,   2.0 + u};
      },
      std::vector<std::optional<PartitionSpec>>(18, s));
  add_case(
      "binary_int_bool", {i32, i32, b, b},
      {"add", "sub", "mul", "div", "max", "min", "and i32", "or i32", "==", "!=", "<", "<=", ">", ">=", "and", "or"},
      [](const std::vector<Value>& in, const Mesh&) {
        const Value &i = in[0], &j = in[1], &p = in[2], &q = in[3];
        return std::vector<Value>{i + j,
                                  i - j,
                                  i * j,
                                  div(i, j),
                                  maximum(i, j),
                                  minimum(i, j),
                                  logical_and(i, j),
                                  logical_or(i, j),
                                  i == j,
                                  i != j,
                                  i<j, i <= j, i>
                                      j,
                                  i >= j,
                                  logical_and(p, q),
                                  logical_or(p, q)};
      });
  add_case(
      "select_convert", {x, x, i32, b},
      {"where f32", "where i32", "f32->i32", "i32->f32", "bool->f32", "f32->f64", "f32->bool"},
      [](const std::vector<Value>& in, const Mesh&) {
        const Value &u = in[0], &v = in[1], &i = in[2], &p = in[3];
        return std::vector<Value>{
            where(u > v, u, v),      where(p, i, -i),         convert(u * 3.0, DType::kI32),  convert(i, DType::kF32),
            convert(p, DType::kF32), convert(u, DType::kF64), convert(floor(u), DType::kBool)};
      });
  // Issue #15 item 1: rem and Python's %, clamp, comparisons with weakly typed scalars, and
  // the transcendental ops on integers (computed in float32, as jnp).
  add_case(
      "rem_clamp_scalars", {x, pos, i32, i32},
      {"rem", "x % q", "x % 1.5", "-2.5 % q", "i % 3", "i % j", "rem i j", "clamp", "clip i32", "x > 0.0", "0.5 < x",
       "i >= 1", "2 == i", "i > 0.5", "sin(i)", "exp(i)"},
      [](const std::vector<Value>& in, const Mesh&) {
        const Value &u = in[0], &q = in[1], &i = in[2], &j = in[3];
        return std::vector<Value>{rem(u, q),
                                  u % q,
                                  u % 1.5,
                                  -2.5 % q,
                                  i % 3,
                                  i % j,
                                  rem(i, j),
                                  clamp(full({}, -0.5), u, q),
                                  clip(i, full({}, -1.0, DType::kI32), j),
                                  u > 0.0,
                                  0.5 < u,
                                  i >= 1,
                                  2 == i,
                                  i > 0.5,
                                  sin(i),
                                  exp(i)};
      },
      std::vector<std::optional<PartitionSpec>>(16, s));
  // Issue #15: stop_gradient keeps the layout; the composites of client/lax.cc (pad with
  // negative and interior padding, the cumulative scans along a split or whole axis, argmin,
  // tril/triu, einsum) under every layout. Their semantics are checked against plain loops
  // and JAX's documented examples in JnpSemantics.PadScansArgminTrianglesEinsum.
  add_case("lax_composites", {x, x, Input{DType::kF32, kMatrix, Domain::kNearOne, s}, i32},
           {"stop_gradient",
            "pad (2,-3,1) (-1,2,0)",
            "jnp.pad 1",
            "pad interior crop",
            "jnp.pad i32",
            "cumsum 0",
            "cumsum 1 reverse",
            "cumprod 1",
            "cummax 0 reverse",
            "cummin 1",
            "cumsum i32 1",
            "argmin 0",
            "argmin 1",
            "argmin i32 0",
            "tril",
            "triu 2",
            "tril -3",
            "einsum ij,kj->ik",
            "einsum ij,ik->kj",
            "einsum ij,ij->i"},
           [](const std::vector<Value>& in, const Mesh&) {
             const Value &u = in[0], &v = in[1], &n = in[2], &i = in[3];
             const Value fill = full({}, -1.0);
             return std::vector<Value>{stop_gradient(u),
                                       pad(u, fill, {{2, -3, 1}, {-1, 2, 0}}),
                                       pad(u, {{1, 1}}),
                                       pad(u, fill, {{0, 0, 0}, {-4, -5, 2}}),
                                       pad(i, {{3, 0}, {0, 5}}, 7.0),
                                       cumsum(u, 0),
                                       cumsum(u, 1, true),
                                       cumprod(n, 1),
                                       cummax(u, 0, true),
                                       cummin(u, -1),
                                       cumsum(i, 1),
                                       argmin(u, 0),
                                       argmin(u, 1),
                                       argmin(i, 0),
                                       tril(u),
                                       triu(u, 2),
                                       tril(u, -3),
                                       einsum("ij,kj->ik", u, v),
                                       einsum("ij,ik->kj", u, v),
                                       einsum("ij,ij->i", u, v)};
           },
           {s});
  // argsort along either axis (a split one is gathered), sort and top_k along the last; the
  // int32 inputs in [-4, 4] tie often, so the tie order is checked across every layout too.
  add_case("sort_top_k", {x, i32},
           {"argsort 0", "argsort 1", "argsort 0 descending", "sort", "top_k values", "top_k indices", "sort i32",
            "argsort i32 1", "top_k i32 values", "top_k i32 indices"},
           [](const std::vector<Value>& in, const Mesh&) {
             const Value &u = in[0], &i = in[1];
             const auto [values, indices] = top_k(u, 5);
             const auto [ivalues, iindices] = top_k(i, 16);
             return std::vector<Value>{argsort(u, 0), argsort(u, 1), argsort(u, 0, true), sort(u), values,
                                       indices,       sort(i),       argsort(i),          ivalues, iindices};
           },
           {spec_of({{}, s1}), spec_of({s0, {}})});
  // numpy broadcasting inserts broadcast_in_dim: a row vector laid out like the matrix's rows.
  add_case("broadcast_binary", {x, Input{DType::kF32, {16}, Domain::kSigned, spec_of({s1})}}, {"x + row", "row * x"},
           [](const std::vector<Value>& in, const Mesh&) {
             return std::vector<Value>{in[0] + in[1], in[1] * in[0]};
           });
  add_case("broadcast_in_dim", {x, Input{DType::kF32, {1, 16}, Domain::kSigned, spec_of({{}, s1})}},
           {"(8,16)->(4,8,16)", "(8,16)->(8,16,2)", "(1,16)->(8,16) stretched", "broadcast_to"},
           [](const std::vector<Value>& in, const Mesh&) {
             return std::vector<Value>{broadcast_in_dim(in[0], {4, 8, 16}, {1, 2}),
                                       broadcast_in_dim(in[0], {8, 16, 2}, {0, 1}),
                                       broadcast_in_dim(in[1], {8, 16}, {0, 1}), broadcast_to(in[1], {4, 8, 16})};
           });
  add_case("reshape", {x}, {"(128)", "(8,4,4)", "(2,4,16)", "(16,8)", "(4,32)"},
           [](const std::vector<Value>& in, const Mesh&) {
             return std::vector<Value>{reshape(in[0], {128}), reshape(in[0], {8, 4, 4}), reshape(in[0], {2, 4, 16}),
                                       reshape(in[0], {16, 8}), reshape(in[0], {4, 32})};
           });
  // transpose moves the spec with the dimensions.
  add_case("transpose", {x}, {"transpose"},
           [](const std::vector<Value>& in, const Mesh&) {
             return std::vector<Value>{transpose(in[0], {1, 0})};
           },
           {spec_of({s1, s0})});
  add_case("expand_squeeze", {x, Input{DType::kF32, {8, 1, 16}, Domain::kSigned, spec_of({s0, {}, s1})}},
           {"expand_dims 0", "expand_dims 2", "squeeze 1", "squeeze all"},
           [](const std::vector<Value>& in, const Mesh&) {
             return std::vector<Value>{expand_dims(in[0], 0), expand_dims(in[0], -1), squeeze(in[1], {1}),
                                       squeeze(in[1], {})};
           });
  add_case("slice", {x}, {"[2:6, 4:12]", "[:, 8:16]", "[0:4, :]", "[:, :]"},
           [](const std::vector<Value>& in, const Mesh&) {
             return std::vector<Value>{slice(in[0], {2, 4}, {6, 12}), slice(in[0], {0, 8}, {8, 16}),
                                       slice(in[0], {0, 0}, {4, 16}), slice(in[0], {0, 0}, {8, 16})};
           });
  // lax.slice's strides: aligned with the blocks (the split kept) or not (gathered first).
  add_case("strided_slice", {x}, {"[1::2, ::4]", "[1:7:3, :]", "[::2, 1::3]", "[:, 3:16:8]"},
           [](const std::vector<Value>& in, const Mesh&) {
             return std::vector<Value>{slice(in[0], {1, 0}, {8, 16}, {2, 4}), slice(in[0], {1, 0}, {7, 16}, {3, 1}),
                                       slice(in[0], {0, 1}, {8, 16}, {2, 3}), slice(in[0], {0, 3}, {8, 16}, {1, 8})};
           });
  add_case("concatenate", {x, x}, {"axis 0", "axis 1", "three on axis 1"},
           [](const std::vector<Value>& in, const Mesh&) {
             return std::vector<Value>{concatenate({in[0], in[1]}, 0), concatenate({in[0], in[1]}, 1),
                                       concatenate({in[1], in[0], in[1]}, -1)};
           });
  // Reductions over a sharded dimension leave a partial value the partitioner must resolve.
  add_case("reduce", {x, Input{DType::kF32, kMatrix, Domain::kNearOne, s}, i32},
           {"sum 1", "sum 0", "sum all", "sum 1 keepdims", "max 0", "max 1", "min 0", "min all", "prod 0", "prod 1",
            "mean 1", "mean all", "argmax 0", "argmax 1", "sum i32 0", "max i32 1", "prod i32 0"},
           [](const std::vector<Value>& in, const Mesh&) {
             const Value &u = in[0], &n = in[1], &i = in[2];
             return std::vector<Value>{sum(u, {1}),  sum(u, {0}), sum(u),       sum(u, {1}, true), max(u, {0}),
                                       max(u, {1}),  min(u, {0}), min(u),       prod(n, {0}),      prod(n, {1}),
                                       mean(u, {1}), mean(u),     argmax(u, 0), argmax(u, 1),      sum(i, {0}),
                                       max(i, {1}),  prod(i, {0})};
           },
           {spec_of({s0})});
  add_case("wide_dtypes",
           {Input{DType::kF64, kMatrix, Domain::kSigned, s}, Input{DType::kI64, kMatrix, Domain::kSigned, s}},
           {"tanh f64", "sum f64 1", "max f64 0", "f64 @ f64^T", "i64 + i64", "sum i64 0", "prod i64 1",
            "argmax f64 -> i64", "i64 -> f64"},
           [](const std::vector<Value>& in, const Mesh&) {
             const Value &d = in[0], &l = in[1];
             return std::vector<Value>{tanh(d),
                                       sum(d, {1}),
                                       max(d, {0}),
                                       matmul(d, transpose(d, {1, 0})),
                                       l + l,
                                       sum(l, {0}),
                                       prod(l, {1}),
                                       argmax(d, 1, DType::kI64),
                                       convert(l, DType::kF64)};
           });
  add_case("iota_full", {x, i32}, {"x + iota 0", "x * iota 1", "i + iota i32", "x * full", "full + i"},
           [](const std::vector<Value>& in, const Mesh&) {
             return std::vector<Value>{in[0] + iota(DType::kF32, kMatrix, 0), in[0] * iota(DType::kF32, kMatrix, 1),
                                       in[1] + iota(DType::kI32, kMatrix, 1), in[0] * full(kMatrix, 3.0),
                                       full(kMatrix, -2.0, DType::kI32) + in[1]};
           });
}

// An elementwise op on two differently laid out operands: one is resharded to the other.
void add_mixed_layouts(int m, std::vector<OpCase>* cases) {
  const std::vector<PartitionSpec> specs = rank2_specs(meshes()[m]);
  for (size_t k = 0; k < specs.size(); ++k) {
    std::vector<PartitionSpec> others;
    for (const PartitionSpec& t : {P(), specs[(k + 1) % specs.size()], specs[(k + 3) % specs.size()]}) {
      if (t != specs[k] && std::find(others.begin(), others.end(), t) == others.end()) others.push_back(t);
    }
    for (const PartitionSpec& t : others) {
      OpCase c;
      c.name = std::string("add_mixed_") + meshes()[m].name + "_" + spec_name(specs[k]) + "_and_" + spec_name(t);
      c.mesh = m;
      c.inputs = {{DType::kF32, kMatrix, Domain::kSigned, specs[k]}, {DType::kF32, kMatrix, Domain::kSigned, t}};
      c.outputs = {"x + y", "tanh(y) * x"};
      c.f = [](const std::vector<Value>& in, const Mesh&) {
        return std::vector<Value>{in[0] + in[1], tanh(in[1]) * in[0]};
      };
      cases->push_back(std::move(c));
    }
  }
}

std::vector<Value> matmul_f(const std::vector<Value>& in, const Mesh&) { return {matmul(in[0], in[1])}; }

// Contractions: free, contracting and batch dimensions sharded, operands on different axes.
void add_dots(int m, std::vector<OpCase>* cases) {
  const MeshDef& mesh = meshes()[m];
  const std::string a = mesh.axes[0];
  const std::string b = mesh.axes.size() == 2 ? mesh.axes[1] : mesh.axes[0];
  const bool two = mesh.axes.size() == 2;
  auto add_case = [&](std::string name, Input lhs, Input rhs, CaseFunction f, std::optional<PartitionSpec> want_spec,
                      std::vector<std::string> want_in_plan, bool none = false) {
    OpCase c;
    c.name = name + "_" + mesh.name;
    c.mesh = m;
    c.inputs = {std::move(lhs), std::move(rhs)};
    c.outputs = {name};
    c.f = std::move(f);
    c.want_specs = {want_spec};
    c.want_in_plan = std::move(want_in_plan);
    c.no_collectives = none;
    cases->push_back(std::move(c));
  };
  auto mat = [](Shape shape, PartitionSpec spec) {
    return Input{DType::kF32, std::move(shape), Domain::kSigned, spec};
  };
  const Shape l = {8, 16}, r = {16, 8};
  // Every lhs layout against a replicated rhs, and every rhs layout against a replicated lhs.
  for (const PartitionSpec& s : rank2_specs(mesh)) {
    add_case("matmul_lhs_" + spec_name(s), mat(l, s), mat(r, P()), matmul_f, std::nullopt, {});
    add_case("matmul_rhs_" + spec_name(s), mat(l, P()), mat(r, s), matmul_f, std::nullopt, {});
  }
  // JAX: P(a, None) @ P(None, b) is P(a, b), computed without communication.
  if (two) add_case("matmul_rows_by_cols", mat(l, P(a, None)), mat(r, P(None, b)), matmul_f, P(a, b), {}, true);
  add_case("matmul_rows_by_cols_same_axis", mat(l, P(a, None)), mat(r, P(None, a)), matmul_f, std::nullopt, {});
  // FSDP as JAX users write it (issue 14 item 6): batch and weight rows over the same axis; the
  // weight is gathered (partition_test.cc asserts the bytes), and the values stay right.
  add_case("matmul_fsdp", mat({16, 64}, P(a, None)), mat({64, 256}, P(a, None)),
           [a](const std::vector<Value>& in, const Mesh& mesh) {
             return std::vector<Value>{with_sharding_constraint(matmul(in[0], in[1]), NamedSharding(mesh, P(a, None)))};
           },
           P(a, None), {"all_gather"});
  // Contracting dimension sharded on both sides: partial sums, all_reduce.
  add_case("matmul_contracting_" + a, mat(l, P(None, a)), mat(r, P(a, None)), matmul_f, P(), {"all_reduce"});
  if (two) {
    add_case("matmul_contracting_" + b, mat(l, P(None, b)), mat(r, P(b, None)), matmul_f, P(), {"all_reduce"});
    add_case("matmul_rows_and_contracting", mat(l, P(a, b)), mat(r, P(b, None)), matmul_f, P(a, None), {"all_reduce"});
    add_case("matmul_contracting_tuple", mat(l, P(None, Axes{a, b})), mat(r, P(Axes{a, b}, None)), matmul_f, P(),
             {"all_reduce"});
    // Contracting split on one side only: the other operand is sliced or gathered to match.
    add_case("matmul_contracting_lhs_only", mat(l, P(None, b)), mat(r, P(None, a)), matmul_f, std::nullopt, {});
  }
  // Partial product wanted sharded: reduce_scatter (via out_shardings and via a constraint).
  {
    OpCase c;
    c.name = std::string("matmul_partial_to_reduce_scatter_") + mesh.name;
    c.mesh = m;
    c.inputs = {mat(l, P(None, a)), mat(r, P(a, None))};
    c.outputs = {"matmul"};
    c.f = matmul_f;
    c.options.out_shardings = {P(a, None)};
    c.want_specs = {P(a, None)};
    c.want_in_plan = {"reduce_scatter"};
    cases->push_back(std::move(c));
  }
  // Ops linear in a partial product that need it in another layout keep it partial.
  if (two) {
    add_case("slice_of_partial_product", mat(l, P(b, a)), mat(r, P(a, None)),
             [](const std::vector<Value>& in, const Mesh&) {
               return std::vector<Value>{slice(matmul(in[0], in[1]), {2, 0}, {6, 8})};
             },
             std::nullopt, {"all_reduce"});
    OpCase c;
    c.name = std::string("add_of_partials_in_two_layouts_") + mesh.name;
    c.mesh = m;
    c.inputs = {mat(l, P(b, a)), mat(l, P(None, a)), mat(r, P(a, None))};
    c.outputs = {"x @ w + y @ w"};
    c.f = [](const std::vector<Value>& in, const Mesh&) {
      return std::vector<Value>{matmul(in[0], in[2]) + matmul(in[1], in[2])};
    };
    c.want_in_plan = {"all_reduce"};
    cases->push_back(std::move(c));
  }
  // Batch dimensions sharded: (8, 8, 16) x (8, 16, 8) over batch 0.
  auto batched = [](const std::vector<Value>& in, const Mesh&) {
    return std::vector<Value>{dot_general(in[0], in[1], DotDims{{0}, {0}, {2}, {1}})};
  };
  add_case("dot_general_batch_" + a, mat({8, 8, 16}, P(a)), mat({8, 16, 8}, P(a)), batched, P(a), {}, true);
  if (two) {
    add_case("dot_general_batch_and_free", mat({8, 8, 16}, P(a, b)), mat({8, 16, 8}, P(a)), batched, P(a, b), {}, true);
    add_case("dot_general_batch_and_contracting", mat({8, 8, 16}, P(a, None, b)), mat({8, 16, 8}, P(a, b)), batched,
             P(a), {"all_reduce"});
    add_case("dot_general_batch_tuple", mat({8, 8, 16}, P(Axes{a, b})), mat({8, 16, 8}, P(Axes{a, b})), batched,
             P(Axes{a, b}), {}, true);
    add_case("dot_general_batch_mismatched", mat({8, 8, 16}, P(a)), mat({8, 16, 8}, P(b)), batched, std::nullopt, {});
  }
  // Contracting over two dimensions, lhs-major free dims: (4, 8, 16) x (16, 8, 8) -> (4, 8).
  add_case("dot_general_two_contracting", mat({4, 8, 16}, P(None, a)), mat({16, 8, 8}, P(None, a)),
           [](const std::vector<Value>& in, const Mesh&) {
             return std::vector<Value>{dot_general(in[0], in[1], DotDims{{}, {}, {1, 2}, {1, 0}})};
           },
           std::nullopt, {});
  // jnp.matmul's batch broadcasting: (B, S, D) @ (D, F) is one contraction that keeps the batch
  // split; batch dimensions of size 1 and missing ones broadcast.
  add_case("matmul_rank3_by_matrix", mat({8, 4, 16}, P(a)), mat({16, 8}, P()), matmul_f, P(a), {}, true);
  add_case("matmul_matrix_by_rank3", mat({8, 16}, P()), mat({4, 16, 8}, two ? P(b) : P()), matmul_f, std::nullopt, {});
  add_case("matmul_batch_broadcast", mat({2, 1, 8, 16}, P()), mat({8, 16, 8}, P(a)), matmul_f, std::nullopt, {});
  add_case("matvec_rank3", mat({8, 4, 16}, P(a)), mat({16}, P()), matmul_f, P(a), {}, true);
  // Vectors: dot of two sharded vectors is a partial scalar; matrix-vector.
  add_case("dot_vectors", mat({16}, P(a)), mat({16}, P(a)),
           [](const std::vector<Value>& in, const Mesh&) { return std::vector<Value>{dot(in[0], in[1])}; }, P(),
           {"all_reduce"});
  add_case("matvec", mat(l, two ? P(a, b) : P(None, a)), mat({16}, P(b)), matmul_f, std::nullopt, {});
}

// with_sharding_constraint forcing each resharding transition, with the collective it needs.
void add_constraints(int m, std::vector<OpCase>* cases) {
  const MeshDef& mesh = meshes()[m];
  const std::string a = mesh.axes[0];
  const bool two = mesh.axes.size() == 2;
  const std::string b = two ? mesh.axes[1] : a;
  auto add_case = [&](std::string name, PartitionSpec from, PartitionSpec to, std::vector<std::string> want,
                      bool none = false, bool contract = false) {
    OpCase c;
    c.name = "constraint_" + name + "_" + mesh.name;
    c.mesh = m;
    c.outputs = {"constrained", "after"};
    c.want_specs = {to, std::nullopt};
    c.want_in_plan = std::move(want);
    c.no_collectives = none;
    if (contract) {  // a partial value: the contraction over the sharded dimension
      c.inputs = {{DType::kF32, {8, 16}, Domain::kSigned, from}, {DType::kF32, {16, 8}, Domain::kSigned, P(a, None)}};
      c.f = [to](const std::vector<Value>& in, const Mesh& mesh) {
        Value y = with_sharding_constraint(matmul(in[0], in[1]), NamedSharding(mesh, to));
        return std::vector<Value>{y, exp(y)};
      };
    } else {
      c.inputs = {{DType::kF32, {8, 16}, Domain::kSigned, from}};
      c.f = [to](const std::vector<Value>& in, const Mesh& mesh) {
        Value y = with_sharding_constraint(in[0] * 2.0, NamedSharding(mesh, to));
        return std::vector<Value>{y, tanh(y)};
      };
    }
    cases->push_back(std::move(c));
  };
  add_case("replicated_to_sharded", P(), P(a, None), {}, /*none=*/true);
  add_case("sharded_to_replicated", P(a, None), P(), {"all_gather"});
  add_case("axis_to_other_dim", P(a, None), P(None, a), {"all_to_all"});
  add_case("partial_to_sharded", P(None, a), P(a, None), {"reduce_scatter"}, false, /*contract=*/true);
  add_case("partial_to_replicated", P(None, a), P(), {"all_reduce"}, false, /*contract=*/true);
  add_case("identity", P(a, None), P(a, None), {}, /*none=*/true);
  if (two) {
    add_case("swap_axes", P(a, b), P(b, a), {});
    add_case("tuple_reordered", P(Axes{a, b}, None), P(Axes{b, a}, None), {"collective_permute"});
    add_case("tuple_to_major_axis", P(Axes{a, b}, None), P(a, None), {"all_gather"});
    add_case("major_axis_to_tuple", P(a, None), P(Axes{a, b}, None), {}, /*none=*/true);
    add_case("tuple_to_other_dim", P(Axes{a, b}, None), P(None, Axes{a, b}), {"all_to_all"});
    add_case("partial_to_other_axis", P(None, a), P(b, None), {}, false, /*contract=*/true);
  }
}

// Programs at the edges: outputs that are inputs, one value twice, scalars, size-1 dimensions.
void add_edges(int m, std::vector<OpCase>* cases) {
  const MeshDef& mesh = meshes()[m];
  const std::string a = mesh.axes[0];
  auto add_case = [&](std::string name, std::vector<Input> inputs, std::vector<std::string> outputs, CaseFunction f,
                      std::vector<std::optional<PartitionSpec>> want_specs, JitOptions options = {}) {
    OpCase c;
    c.name = name + "_" + mesh.name;
    c.mesh = m;
    c.inputs = std::move(inputs);
    c.outputs = std::move(outputs);
    c.f = std::move(f);
    c.want_specs = std::move(want_specs);
    c.options = std::move(options);
    cases->push_back(std::move(c));
  };
  const Input x{DType::kF32, kMatrix, Domain::kSigned, P(a, None)};
  // A stable softmax over a split last dimension: the pending max and sum are each reduced at
  // their (8, 1) shape before being broadcast back (issue 14 item 6).
  add_case("softmax_split_rows", {Input{DType::kF32, kMatrix, Domain::kSigned, P(None, a)}}, {"softmax"},
           [](const std::vector<Value>& in, const Mesh&) {
             const Value e = exp(in[0] - max(in[0], {1}, true));
             return std::vector<Value>{e / sum(e, {1}, true)};
           },
           {P(None, a)});
  cases->back().want_text = {"all_reduce(max, axes=('" + a + "',))", "all_reduce(sum, axes=('" + a + "',))"};
  add_case("output_is_input", {x}, {"x", "tanh(x)"},
           [](const std::vector<Value>& in, const Mesh&) {
             return std::vector<Value>{in[0], tanh(in[0])};
           },
           {P(a, None)});
  add_case(
      "output_is_input_resharded", {x}, {"x"},
      [](const std::vector<Value>& in, const Mesh&) { return std::vector<Value>{in[0]}; }, {P(None, a)},
      JitOptions{{P(None, a)}});
  add_case("same_output_twice", {x}, {"exp(x)", "exp(x) again"},
           [](const std::vector<Value>& in, const Mesh&) {
             Value e = exp(in[0]);
             return std::vector<Value>{e, e};
           },
           {P(a, None), P(a, None)});
  add_case(
      "mixed_dtypes",
      {x, Input{DType::kI32, kMatrix, Domain::kSigned, P(None, a)}, Input{DType::kBool, kMatrix, Domain::kSigned, P()}},
      {"f32 * i32", "i32 + bool", "where(bool, i32, f32)"},
      [](const std::vector<Value>& in, const Mesh&) {
        return std::vector<Value>{in[0] * in[1], in[1] + in[2], where(in[2], in[1], in[0])};
      },
      {});
  add_case("scalar_input", {x, Input{DType::kF32, {}, Domain::kSigned, P()}}, {"x * s", "s * s"},
           [](const std::vector<Value>& in, const Mesh&) {
             return std::vector<Value>{in[0] * in[1], in[1] * in[1]};
           },
           {P(a, None), P()});
  add_case(
      "made_inside_only", {x}, {"full", "iota sharded by out_shardings", "iota * 2"},
      [](const std::vector<Value>&, const Mesh&) {
        return std::vector<Value>{full({8, 16}, 2.5), iota(DType::kI32, {8, 16}, 1),
                                  iota(DType::kF32, {16, 8}, 0) * 2.0};
      },
      {P(), P(None, a)}, JitOptions{{std::nullopt, P(None, a), P(a, None)}});
  if (mesh.axes.size() == 2) {
    // An iota built at its local shape, its counting dimension over a tuple of axes: each
    // device's offset is its position along both, major first.
    const Axes both = {mesh.axes[0], mesh.axes[1]};
    add_case(
        "iota_over_two_axes", {x}, {"iota f32 dim 0", "iota i32 dim 1"},
        [](const std::vector<Value>&, const Mesh&) {
          return std::vector<Value>{iota(DType::kF32, {16, 8}, 0), iota(DType::kI32, {8, 16}, 1)};
        },
        {P(both, None), P(None, both)}, JitOptions{{P(both, None), P(None, both)}});
  }
  add_case("unused_input", {x, x}, {"tanh(x)"},
           [](const std::vector<Value>& in, const Mesh&) { return std::vector<Value>{tanh(in[0])}; }, {P(a, None)});
  add_case("size_one_dims", {Input{DType::kF32, {1, 8, 1}, Domain::kSigned, P(None, a)}}, {"sum", "reshape", "bcast"},
           [](const std::vector<Value>& in, const Mesh&) {
             return std::vector<Value>{sum(in[0], {0, 2}), reshape(in[0], {8}),
                                       broadcast_in_dim(in[0], {4, 8, 2}, {0, 1, 2}) * 2.0};
           },
           {});
}

// Backward propagation: consumers' layouts pull producers, and the values stay right.
void add_backward(int m, std::vector<OpCase>* cases) {
  const MeshDef& mesh = meshes()[m];
  const std::string a = mesh.axes[0];
  const bool two = mesh.axes.size() == 2;
  const std::string b = two ? mesh.axes[1] : a;
  auto add_case = [&](std::string name, std::vector<Input> inputs, CaseFunction f, PartitionSpec want_spec,
                      std::vector<std::string> want_in_plan, JitOptions options = {},
                      std::vector<std::string> want_text = {}) {
    OpCase c;
    c.name = "backward_" + name + "_" + mesh.name;
    c.want_text = std::move(want_text);
    c.mesh = m;
    c.inputs = std::move(inputs);
    c.outputs = {name};
    c.f = std::move(f);
    c.want_specs = {want_spec};
    c.want_in_plan = std::move(want_in_plan);
    c.no_collectives = c.want_in_plan.empty();
    c.options = std::move(options);
    cases->push_back(std::move(c));
  };
  auto mat = [](Shape shape, PartitionSpec spec) {
    return Input{DType::kF32, std::move(shape), Domain::kSigned, spec};
  };
  add_case("constraint_pulls_exp", {mat({8, 16}, P())},
           [a](const std::vector<Value>& in, const Mesh& mesh) {
             return std::vector<Value>{with_sharding_constraint(exp(in[0]) * 2.0, NamedSharding(mesh, P(a, None)))};
           },
           P(a, None), {}, {},
           // exp runs on this device's rows only (forward propagation alone would run it whole).
           {absl::StrCat("f32[", 8 / mesh.shape[0], ",16]  ; %1 = exp")});
  const PartitionSpec blocks = two ? P(a, b) : P(a, None);
  add_case("out_shardings_pull_matmul", {mat({8, 16}, P()), mat({16, 8}, P())}, matmul_f, blocks, {},
           JitOptions{{blocks}},
           {absl::StrCat("f32[", 8 / mesh.shape[0], ",", two ? 8 / mesh.shape[1] : 8, "]  ; %2 = dot_general")});
  add_case(
      "gather_before_broadcast", {Input{DType::kF32, {8}, Domain::kSigned, P(a)}},
      [](const std::vector<Value>& in, const Mesh&) {
        return std::vector<Value>{exp(broadcast_in_dim(in[0], {8, 16}, {0}))};
      },
      P(), {"all_gather"}, JitOptions{{P()}});
  add_case(
      "conflict_moves_one_operand", {mat({8, 16}, P(a, None)), mat({8, 16}, P(None, a))},
      [](const std::vector<Value>& in, const Mesh&) { return std::vector<Value>{in[0] + in[1]}; }, P(None, a),
      {"all_to_all"}, JitOptions{{P(None, a)}});
  if (two) {
    add_case("partial_split_before_all_reduce", {mat({8, 16}, P(None, a)), mat({16, 8}, P(a, None))},
             [b](const std::vector<Value>& in, const Mesh& mesh) {
               return std::vector<Value>{
                   with_sharding_constraint(tanh(matmul(in[0], in[1])), NamedSharding(mesh, P(b, None)))};
             },
             P(b, None), {"all_reduce"});
  }
}

// Arrays of 1 MiB, above the collectives' 64 KiB switch to pipelined rings (512 KiB chunks).
void add_large(int m, std::vector<OpCase>* cases) {
  const MeshDef& mesh = meshes()[m];
  const std::string a = mesh.axes[0];
  const Shape big = {512, 512};
  auto add_case = [&](std::string name, std::vector<Input> inputs, CaseFunction f, PartitionSpec want_spec,
                      std::string collective, JitOptions options = {}) {
    OpCase c;
    c.name = "large_" + name + "_" + mesh.name;
    c.mesh = m;
    c.inputs = std::move(inputs);
    c.outputs = {name};
    c.f = std::move(f);
    c.want_specs = {want_spec};
    c.want_in_plan = {collective};
    c.options = std::move(options);
    cases->push_back(std::move(c));
  };
  auto constrained = [](PartitionSpec to) {
    return [to](const std::vector<Value>& in, const Mesh& mesh) {
      return std::vector<Value>{with_sharding_constraint(in[0] + 1.0, NamedSharding(mesh, to))};
    };
  };
  const Input rows{DType::kF32, big, Domain::kSigned, P(a, None)};
  add_case("all_gather", {rows}, constrained(P()), P(), "all_gather");
  add_case("all_to_all", {rows}, constrained(P(None, a)), P(None, a), "all_to_all");
  const std::vector<Input> contracting = {Input{DType::kF32, {512, 64}, Domain::kSigned, P(None, a)},
                                          Input{DType::kF32, {64, 512}, Domain::kSigned, P(a, None)}};
  add_case("all_reduce", contracting, matmul_f, P(), "all_reduce");
  add_case("reduce_scatter", contracting, matmul_f, P(a, None), "reduce_scatter", JitOptions{{P(a, None)}});
  if (mesh.axes.size() == 2) {
    const std::string b = mesh.axes[1];
    add_case("collective_permute", {Input{DType::kF32, big, Domain::kSigned, P(Axes{a, b}, None)}},
             constrained(P(Axes{b, a}, None)), P(Axes{b, a}, None), "collective_permute");
  }
}

// Indexing (issue #15): an embedding table (16, 8) under every layout, indices (8, 4) whole or
// split (also one_hot of them), each op in its out-of-range modes (indices in [-20, 20]: negative, wrapped and beyond
// the table's 16 rows). The compiled plans are asserted in partition_test.cc.
void add_indexing(int m, std::vector<OpCase>* cases) {
  const MeshDef& mesh = meshes()[m];
  const std::string a = mesh.axes[0];
  const bool two = mesh.axes.size() == 2;
  const std::string b = two ? mesh.axes[1] : a;
  std::vector<PartitionSpec> tables = {P(), P(a, None), P(None, a)};
  if (two) {
    for (const PartitionSpec& s : {P(b, None), P(None, b), P(a, b), P(Axes{a, b}, None)}) tables.push_back(s);
  }
  auto add_case = [&](const PartitionSpec& table, const PartitionSpec& indices) {
    OpCase c;
    c.name = std::string("indexing_") + mesh.name + "_" + spec_name(table) + "_at_" + spec_name(indices);
    c.mesh = m;
    c.inputs = {{DType::kF32, {16, 8}, Domain::kSigned, table}, {DType::kI32, {8, 4}, Domain::kSigned, indices}};
    c.outputs = {"take fill", "take clip",         "at get",       "take axis 1",   "take i32 fill",        "at add",
                 "at set",    "scatter_add zeros", "scatter clip", "dynamic_slice", "dynamic_update_slice", "one_hot"};
    c.f = [](const std::vector<Value>& in, const Mesh&) {
      const Value &t = in[0], &i = in[1];
      const Value far = i * 5;  // [-20, 20]
      const Value rows = take(t, i, 0) * 0.5;
      const Value start = sum(i) + 2;  // traced, and a pending sum when i is split
      return std::vector<Value>{take(t, far, 0),
                                take(t, far, 0, IndexMode::kClip),
                                at(t, far).get(),
                                take(t, i, 1),
                                take(convert(t * 4.0, DType::kI32), far, 0),
                                at(t, far).add(rows),
                                at(t, i * 3).set(rows),
                                at(full({16, 8}, 0.0), i).add(rows),
                                scatter(t, far, rows, 0, IndexMode::kClip),
                                dynamic_slice(t, {start, full({}, 0.0, DType::kI32)}, {4, 8}),
                                dynamic_update_slice(t, slice(t, {0, 0}, {4, 8}) * 2.0, {start, start}),
                                nn::one_hot(far, 16)};  // jax.nn.one_hot: out-of-range labels give zero rows
    };
    cases->push_back(std::move(c));
  };
  for (const PartitionSpec& t : tables) {
    add_case(t, P());
    add_case(t, P(a, None));
  }
  if (two) {
    add_case(P(a, None), P(b, None));
    add_case(P(None, a), P(None, b));
  }
  // Batch dimensions (GatherAttrs.batch_dims = 1): a cache x (8, 8, 6, 2) read and written at
  // three positions per example (in [-4, 4]: negatives out of range) along axis 2, in every
  // layout of its batch and heads with the positions whole or split; the batch split alike on
  // both moves nothing.
  auto add_batched = [&](const PartitionSpec& cache, const PartitionSpec& positions) {
    OpCase c;
    c.name = std::string("batched_indexing_") + mesh.name + "_" + spec_name(cache) + "_at_" + spec_name(positions);
    c.mesh = m;
    c.inputs = {{DType::kF32, {8, 8, 6, 2}, Domain::kSigned, cache}, {DType::kI32, {8, 3}, Domain::kSigned, positions}};
    c.outputs = {"gather fill", "gather clip", "scatter_add fill", "scatter clip", "gather fill 7"};
    c.f = [](const std::vector<Value>& in, const Mesh&) {
      const Value &x = in[0], &p = in[1];
      const Value rows = gather(x, p, GatherAttrs{2, IndexMode::kFillOrDrop, std::nullopt, 1});
      const Value first = reshape(slice(p, {0, 0}, {8, 1}), {8});
      return std::vector<Value>{rows, gather(x, p, GatherAttrs{2, IndexMode::kClip, std::nullopt, 1}),
                                scatter_add(x, p, rows * 0.5, GatherAttrs{2, IndexMode::kFillOrDrop, std::nullopt, 1}),
                                scatter(x, first, reshape(slice(rows, {0, 0, 0, 0}, {8, 8, 1, 2}), {8, 8, 2}),
                                        GatherAttrs{2, IndexMode::kClip, std::nullopt, 1}),
                                gather(x, p, GatherAttrs{2, IndexMode::kFillOrDrop, Scalar(7.0), 1})};
    };
    c.no_collectives = positions.size() > 0 && !positions.axes(0).empty() && cache.axes(0) == positions.axes(0);
    cases->push_back(std::move(c));
  };
  std::vector<PartitionSpec> caches = {P(), P(a, None, None, None), P(None, a, None, None)};
  if (two) {
    for (const PartitionSpec& s : {P(b, None, None, None), P(a, b, None, None), P(Axes{a, b}, None, None, None)}) {
      caches.push_back(s);
    }
  }
  for (const PartitionSpec& x : caches) {
    add_batched(x, P());
    add_batched(x, P(a, None));
  }
  if (two) {
    add_batched(P(b, None, None, None), P(b, None));
    add_batched(P(a, b, None, None), P(b, None));
    add_batched(P(Axes{a, b}, None, None, None), P(Axes{a, b}, None));
  }
  // Many updates into a small x: a pending sum over the batch's axis, x counted once.
  OpCase c;
  c.name = std::string("scatter_add_histogram_") + mesh.name;
  c.mesh = m;
  c.inputs = {{DType::kF32, {8, 16}, Domain::kSigned, P()},
              {DType::kI32, {64}, Domain::kSigned, P(a)},
              {DType::kF32, {64, 16}, Domain::kSigned, P(a, None)}};
  c.outputs = {"at add"};
  c.f = [](const std::vector<Value>& in, const Mesh&) { return std::vector<Value>{at(in[0], in[1]).add(in[2])}; };
  c.want_in_plan = {"all_reduce"};
  cases->push_back(std::move(c));
}

std::vector<OpCase> all_cases() {
  std::vector<OpCase> cases;
  for (int m = 0; m < static_cast<int>(meshes().size()); ++m) {
    for (const PartitionSpec& s : rank2_specs(meshes()[m])) add_layout_families(m, s, &cases);
    add_mixed_layouts(m, &cases);
    add_dots(m, &cases);
    add_constraints(m, &cases);
    add_edges(m, &cases);
    add_backward(m, &cases);
    add_large(m, &cases);
    add_indexing(m, &cases);
  }
  return cases;
}

uint32_t seed_of(const std::string& name) {
  uint32_t h = 2166136261u;
  for (char c : name) h = (h ^ static_cast<uint8_t>(c)) * 16777619u;
  return h;
}

// The values these ops give by JAX's documentation, evaluated on the host: Python's % takes the
// divisor's sign (jnp.remainder(-3, 2) == 1, jnp.remainder(3, -2) == -1), lax.rem the
// dividend's (lax.rem(-3, 2) == -1); jnp.clip; a weakly typed 0.5 compares an int32 array in
// float32 (1 > 0.5); jnp.sin of int32 is float32.
TEST(JnpSemantics, RemainderClampComparisonsAndPromotion) {
  absl::StatusOr<Graph> g = trace(
      [](const std::vector<Value>& in) {
        const Value& i = in[0];
        const Value two = full({4}, 2.0, DType::kI32);
        return std::vector<Value>{
            i % 2,   i % -2, rem(i, two), convert(in[1], DType::kF32) % 1.5, clip(i, two - 3, two),
            i > 0.5, 0 < i,  sin(i)};
      },
      {{DType::kI32, {4}}, {DType::kF32, {4}}});
  ASSERT_TRUE(g.ok()) << g.status();
  const HostArray i = HostArray::from_vector<int32_t>({4}, {-3, 3, 0, 1});
  const HostArray f = HostArray::from_vector<float>({4}, {-2.0f, 4.0f, -0.5f, 1.5f});
  absl::StatusOr<std::vector<HostArray>> out = evaluate_on_host(*g, {&i, &f});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ((*out)[0], HostArray::from_vector<int32_t>({4}, {1, 1, 0, 1}));
  EXPECT_EQ((*out)[1], HostArray::from_vector<int32_t>({4}, {-1, -1, 0, -1}));
  EXPECT_EQ((*out)[2], HostArray::from_vector<int32_t>({4}, {-1, 1, 0, 1}));
  EXPECT_EQ((*out)[3], HostArray::from_vector<float>({4}, {1.0f, 1.0f, 1.0f, 0.0f}));
  EXPECT_EQ((*out)[4], HostArray::from_vector<int32_t>({4}, {-1, 2, 0, 1}));
  EXPECT_EQ((*out)[5], HostArray::from_vector<bool>({4}, {false, true, false, true}));
  EXPECT_EQ((*out)[6], HostArray::from_vector<bool>({4}, {false, true, false, true}));
  ASSERT_EQ((*out)[7].dtype(), DType::kF32);
  EXPECT_FLOAT_EQ((*out)[7].values<float>()[1], std::sin(3.0f));
  // matmul broadcasts batch dimensions as jnp: (2, 1, 3, 4) @ (5, 4, 6) is (2, 5, 3, 6).
  absl::StatusOr<Graph> m = trace([](const std::vector<Value>& in) { return std::vector<Value>{matmul(in[0], in[1])}; },
                                  {{DType::kF32, {2, 1, 3, 4}}, {DType::kF32, {5, 4, 6}}});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->node(m->outputs()[0]).shape, (Shape{2, 5, 3, 6}));
  EXPECT_THAT(trace([](const std::vector<Value>& in) { return std::vector<Value>{matmul(in[0], in[1])}; },
                    {{DType::kF32, {2, 3, 4}}, {DType::kF32, {3, 4, 6}}})
                  .status()
                  .message(),
              HasSubstr("matmul: Incompatible types for matmul arguments: f32[2,3,4] and f32[3,4,6]"));
}

// numpy's matmul by its definition: batch dimensions broadcast (right-aligned, a 1 stretched),
// each batch element a matrix product of the two operands' last two dimensions.
std::vector<float> host_matmul(const Shape& ls, const std::vector<float>& l, const Shape& rs,
                               const std::vector<float>& r, Shape* out_shape) {
  const size_t n = std::max(ls.size(), rs.size()) - 2;
  const int64_t m = ls[ls.size() - 2], k = ls.back(), cols = rs.back();
  Shape batch(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t dl = static_cast<int64_t>(i + ls.size()) - static_cast<int64_t>(n + 2);
    const int64_t dr = static_cast<int64_t>(i + rs.size()) - static_cast<int64_t>(n + 2);
    batch[i] = std::max(dl >= 0 ? ls[dl] : 1, dr >= 0 ? rs[dr] : 1);
  }
  *out_shape = batch;
  out_shape->push_back(m);
  out_shape->push_back(cols);
  // The offset of batch element `flat` in an operand of shape s (its matrices m_rows x m_cols).
  auto offset = [&](const Shape& s, int64_t flat) {
    int64_t off = 0, stride = s[s.size() - 2] * s.back();
    for (size_t i = n; i-- > 0;) {
      const int64_t idx = flat % batch[i];
      flat /= batch[i];
      const int64_t d = static_cast<int64_t>(i + s.size()) - static_cast<int64_t>(n + 2);
      if (d < 0) continue;
      off += (s[d] == 1 ? 0 : idx) * stride;
      stride *= s[d];
    }
    return off;
  };
  int64_t count = 1;
  for (int64_t b : batch) count *= b;
  std::vector<float> out;
  for (int64_t e = 0; e < count; ++e) {
    const int64_t lo = offset(ls, e), ro = offset(rs, e);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        float acc = 0;
        for (int64_t q = 0; q < k; ++q) acc += l[lo + i * k + q] * r[ro + q * cols + j];
        out.push_back(acc);
      }
    }
  }
  return out;
}

// matmul builds jnp.matmul's program (jax/_src/numpy/tensor_contractions.py, matmul): a batch
// dimension one operand lacks, or has as a 1, is a free dimension of the dot_general (the 1
// squeezed), those both have are its batch dimensions, one both have as a 1 is squeezed from
// both and inserted back after the product (the last two cases), and a transpose puts the
// result in numpy's order; no operand is broadcast. The values are numpy's (host loops above).
TEST(JnpSemantics, MatmulBatchDimensionsAsJnpWithoutBroadcastingAnOperand) {
  const std::vector<std::pair<Shape, Shape>> cases = {
      {{3, 4, 5}, {5, 2}},    {{4, 5}, {3, 5, 2}},          {{1, 4, 5}, {3, 5, 2}}, {{2, 1, 4, 5}, {3, 5, 2}},
      {{3, 4, 5}, {3, 5, 2}}, {{3, 1, 4, 5}, {1, 2, 5, 2}}, {{1, 4, 5}, {1, 5, 2}}, {{2, 1, 4, 5}, {1, 5, 2}},
  };
  for (const auto& [ls, rs] : cases) {
    SCOPED_TRACE(absl::StrCat(shape_to_string(ls), " @ ", shape_to_string(rs)));
    absl::StatusOr<Graph> g =
        trace([](const std::vector<Value>& in) { return std::vector<Value>{matmul(in[0], in[1])}; },
              {{DType::kF32, ls}, {DType::kF32, rs}});
    ASSERT_TRUE(g.ok()) << g.status();
    for (int id = 0; id < g->size(); ++id) EXPECT_NE(g->node(id).op, Op::kBroadcastInDim) << g->to_text();
    auto values = [](const Shape& s, int salt) {
      int64_t count = 1;
      for (int64_t d : s) count *= d;
      std::vector<float> v;
      for (int64_t i = 0; i < count; ++i) v.push_back(static_cast<float>((i * 7 + salt) % 11 - 5));
      return v;
    };
    const std::vector<float> l = values(ls, 1), r = values(rs, 3);
    const HostArray lh = HostArray::from_vector<float>(ls, l), rh = HostArray::from_vector<float>(rs, r);
    absl::StatusOr<std::vector<HostArray>> out = evaluate_on_host(*g, {&lh, &rh});
    ASSERT_TRUE(out.ok()) << out.status();
    Shape want_shape;
    const std::vector<float> want = host_matmul(ls, l, rs, r, &want_shape);
    EXPECT_EQ((*out)[0], HostArray::from_vector<float>(want_shape, want));
  }
}

// The composites of client/lax.cc on the host against JAX's docstring examples (lax.pad in
// jax/_src/lax/lax.py, jnp.pad in jax/_src/numpy/lax_numpy.py, jnp.cumsum) and plain loops.
TEST(JnpSemantics, PadScansArgminTrianglesEinsum) {
  auto run = [](const TracedFunction& f, std::vector<ArrayType> types, std::vector<const HostArray*> in) {
    absl::StatusOr<Graph> g = trace(f, types);
    EXPECT_TRUE(g.ok()) << g.status();
    absl::StatusOr<std::vector<HostArray>> out = g.ok() ? evaluate_on_host(*g, in) : g.status();
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? *std::move(out) : std::vector<HostArray>{};
  };
  auto ints = [](Shape s, std::vector<int32_t> v) { return HostArray::from_vector<int32_t>(std::move(s), v); };
  const HostArray x4 = ints({4}, {1, 2, 3, 4}), x5 = ints({5}, {1, 2, 3, 4, 5}), x10 = ints({4}, {10, 20, 30, 40});
  const HostArray x23 = ints({2, 3}, {1, 2, 3, 4, 5, 6});
  std::vector<HostArray> p = run(
      [](const std::vector<Value>& in) {
        const Value zero = full({}, 0.0, DType::kI32);
        return std::vector<Value>{
            pad(in[0], zero, {{2, 3, 0}}),   pad(in[0], zero, {{0, 0, 1}}),
            pad(in[1], zero, {{-1, -2, 0}}), pad(in[3], full({}, -1.0, DType::kI32), {{2, 2, 0}, {2, 2, 0}}),
            pad(in[2], {{2, 2}}, 99.0),      pad(in[2], {{2, 4}}),
            pad(in[3], {{1, 2}, {3, 0}}),    cumsum(in[3], 1),
            cumsum(reshape(in[3], {6}), 0)};
      },
      {{DType::kI32, {4}}, {DType::kI32, {5}}, {DType::kI32, {4}}, {DType::kI32, {2, 3}}}, {&x4, &x5, &x10, &x23});
  ASSERT_EQ(p.size(), 9u);
  EXPECT_EQ(p[0], ints({9}, {0, 0, 1, 2, 3, 4, 0, 0, 0}));
  EXPECT_EQ(p[1], ints({7}, {1, 0, 2, 0, 3, 0, 4}));
  EXPECT_EQ(p[2], ints({2}, {2, 3}));
  EXPECT_EQ(p[3], ints({6, 7}, {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 1,  2,  3,  -1, -1,
                                -1, -1, 4,  5,  6,  -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1}));
  EXPECT_EQ(p[4], ints({8}, {99, 99, 10, 20, 30, 40, 99, 99}));
  EXPECT_EQ(p[5], ints({10}, {0, 0, 10, 20, 30, 40, 0, 0, 0, 0}));
  EXPECT_EQ(p[6],
            ints({5, 6}, {0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 4, 5, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(p[7], ints({2, 3}, {1, 3, 6, 4, 9, 15}));
  EXPECT_EQ(p[8], ints({6}, {1, 3, 6, 10, 15, 21}));

  // Plain loops on a random (5, 7) matrix (odd sizes: the scans' last step is partial).
  std::mt19937 rng(7);
  HostArray a = random_array(DType::kF64, {5, 7}, Domain::kSigned, rng);
  const HostArray b = random_array(DType::kF64, {5, 7}, Domain::kSigned, rng);
  a.mutable_values<double>()[2 * 7 + 4] = a.values<double>()[0 * 7 + 4];  // a tie in column 4: the first wins
  a.mutable_values<double>()[3 * 7 + 1] = std::nan("");                   // a NaN in column 1 and row 3
  std::vector<HostArray> r = run(
      [](const std::vector<Value>& in) {
        const Value &u = in[0], &v = in[1];
        return std::vector<Value>{
            cumsum(u, 0),    cumprod(u, 1, true), cummax(u, 1), cummin(u, 0, true),        argmin(u, 0),
            argmin(u, 1),    tril(u, 1),          triu(u, -1),  einsum("ij,kj->ki", u, v), einsum("ij,ik->j", u, v),
            stop_gradient(u)};
      },
      {{DType::kF64, {5, 7}}, {DType::kF64, {5, 7}}}, {&a, &b});
  ASSERT_EQ(r.size(), 11u);
  auto at = [&](int i, int j) { return a.values<double>()[i * 7 + j]; };
  auto bt = [&](int i, int j) { return b.values<double>()[i * 7 + j]; };
  auto expect = [](const HostArray& got, int64_t k, double want, const std::string& what) {
    const double g = got.element_as_double(k);
    if (std::isnan(want) || std::isinf(want)) {
      EXPECT_TRUE(std::isnan(want) ? std::isnan(g) : g == want) << what << " element " << k << ": " << g;
    } else {
      EXPECT_NEAR(g, want, 1e-12 * (1 + std::abs(want))) << what << " element " << k;
    }
  };
  // NaN propagates through max and min as in XLA; the loops use fmax-like NaN-first rules.
  auto nan_max = [](double p, double q) { return std::isnan(p) || std::isnan(q) ? std::nan("") : std::max(p, q); };
  auto nan_min = [](double p, double q) { return std::isnan(p) || std::isnan(q) ? std::nan("") : std::min(p, q); };
  for (int i = 0; i < 5; ++i) {
    for (int j = 0; j < 7; ++j) {
      double s = 0, pr = 1, mx = -INFINITY, mn = INFINITY;
      for (int k = 0; k <= i; ++k) s += at(k, j);
      for (int k = j; k < 7; ++k) pr *= at(i, k);
      for (int k = 0; k <= j; ++k) mx = nan_max(mx, at(i, k));
      for (int k = i; k < 5; ++k) mn = nan_min(mn, at(k, j));
      const int64_t e = i * 7 + j;
      expect(r[0], e, s, "cumsum 0");
      expect(r[1], e, pr, "cumprod 1 reverse");
      expect(r[2], e, mx, "cummax 1");
      expect(r[3], e, mn, "cummin 0 reverse");
      expect(r[6], e, j <= i + 1 ? at(i, j) : 0.0, "tril 1");
      expect(r[7], e, j >= i - 1 ? at(i, j) : 0.0, "triu -1");
      expect(r[10], e, at(i, j), "stop_gradient");
    }
  }
  auto first_min = [](std::vector<double> v) {
    int64_t best = 0;
    for (int64_t k = 1; k < static_cast<int64_t>(v.size()); ++k) {
      if (!std::isnan(v[best]) && (std::isnan(v[k]) || v[k] < v[best])) best = k;
    }
    return best;
  };
  for (int j = 0; j < 7; ++j) {
    std::vector<double> col;
    for (int i = 0; i < 5; ++i) col.push_back(at(i, j));
    EXPECT_EQ(r[4].element_as_double(j), first_min(col)) << "argmin 0 column " << j;
  }
  EXPECT_EQ(r[4].element_as_double(1), 3) << "the NaN";
  for (int i = 0; i < 5; ++i) {
    std::vector<double> row;
    for (int j = 0; j < 7; ++j) row.push_back(at(i, j));
    EXPECT_EQ(r[5].element_as_double(i), first_min(row)) << "argmin 1 row " << i;
  }
  for (int k = 0; k < 5; ++k) {
    for (int i = 0; i < 5; ++i) {
      double s = 0;
      for (int j = 0; j < 7; ++j) s += at(i, j) * bt(k, j);
      expect(r[8], k * 5 + i, s, "einsum ij,kj->ki");
    }
  }
  for (int j = 0; j < 7; ++j) {
    double s = 0;
    for (int i = 0; i < 5; ++i) {
      for (int k = 0; k < 7; ++k) s += at(i, j) * bt(i, k);
    }
    expect(r[9], j, s, "einsum ij,ik->j (k summed first)");
  }
  // argsort, sort and top_k against ranks counted pairwise (no sort involved): element k of a
  // lane goes to position #(elements before it in the order) — strictly smaller ones, and
  // equal ones with a lower index; NaNs (all equal) after everything ascending, before
  // everything descending; -0 equals 0.
  const HostArray s = HostArray::from_vector<double>(
      {3, 7}, {2.0, -1.0, 2.0,  std::nan(""), -0.0, 0.0,          -1.0, 5.0,       4.0,      3.0, 2.0,
               1.0, 0.0,  -1.0, std::nan(""), 1.0,  std::nan(""), 1.0,  -INFINITY, INFINITY, 1.0});
  std::vector<HostArray> so = run(
      [](const std::vector<Value>& in) {
        const auto [values, indices] = top_k(in[0], 4);
        return std::vector<Value>{argsort(in[0]), argsort(in[0], -1, true), sort(in[0]), values,
                                  indices,        argsort(in[0], 0)};
      },
      {{DType::kF64, {3, 7}}}, {&s});
  ASSERT_EQ(so.size(), 6u);
  auto before = [](double p, int64_t i, double q, int64_t j, bool descending) {  // p (at i) before q (at j)?
    const bool pn = std::isnan(p), qn = std::isnan(q);
    const bool less = descending ? (pn && !qn) || (!pn && !qn && p > q) : (!pn && qn) || (!pn && !qn && p < q);
    const bool equal = (pn && qn) || (!pn && !qn && p == q);
    return less || (equal && i < j);
  };
  for (bool descending : {false, true}) {
    for (int row = 0; row < 3; ++row) {
      for (int k = 0; k < 7; ++k) {
        int64_t position = 0;
        for (int j = 0; j < 7; ++j)
          position += before(s.values<double>()[row * 7 + j], j, s.values<double>()[row * 7 + k], k, descending);
        const HostArray& order = so[descending ? 1 : 0];
        EXPECT_EQ(order.element_as_double(row * 7 + position), k)
            << (descending ? "descending" : "ascending") << " row " << row;
        if (!descending) expect(so[2], row * 7 + position, s.values<double>()[row * 7 + k], "sort");
        if (descending && position < 4) {
          expect(so[3], row * 4 + position, s.values<double>()[row * 7 + k], "top_k values");
          EXPECT_EQ(so[4].element_as_double(row * 4 + position), k) << "top_k indices row " << row;
        }
      }
    }
  }
  EXPECT_EQ(so[4], HostArray::from_vector<int32_t>({3, 4}, {3, 0, 2, 4, 0, 1, 2, 3, 0, 2, 5, 1}));
  EXPECT_EQ(so[5].shape(), (Shape{3, 7}));
  // The refusals name the rule.
  const std::vector<ArrayType> two = {{DType::kF32, {4, 4}}, {DType::kF32, {4, 4}}};
  auto message = [&](std::function<Value(const Value&, const Value&)> f) {
    return std::string(trace([f](const std::vector<Value>& in) { return std::vector<Value>{f(in[0], in[1])}; }, two)
                           .status()
                           .message());
  };
  EXPECT_THAT(message([](const Value& u, const Value& v) { return einsum("ii,ij->ij", u, v); }),
              HasSubstr("label 'i' repeats in operand 0 ('ii'); traces and diagonals are not supported"));
  EXPECT_THAT(message([](const Value& u, const Value& v) { return einsum("ij,jk", u, v); }),
              HasSubstr("must have the form 'ab,bc->ac'"));
  EXPECT_THAT(message([](const Value& u, const Value&) {
                return pad(u, full({}, 0.0), {{-3, -2, 0}, {0, 0, 0}});
              }),
              HasSubstr("pad: dimension 0 of (4, 4) padded by (-3, -2, 0) would have negative size -1"));
  EXPECT_THAT(message([](const Value& u, const Value&) {
                return pad(u, full({}, 0, DType::kI32), {{0, 0, 0}});
              }),
              HasSubstr("pad: 1 padding entries for an operand of shape (4, 4)"));
  EXPECT_THAT(message([](const Value& u, const Value&) { return cumsum(u, 2); }),
              HasSubstr("cumsum: axis 2 is out of range for shape (4, 4)"));
  EXPECT_THAT(message([](const Value& u, const Value&) { return top_k(u, 5).first; }),
              HasSubstr("top_k: k = 5 for an operand of shape (4, 4); it needs rank >= 1 and 0 <= k <= the last"));
}

class JitOpsTest : public MeshesSuite, public ::testing::WithParamInterface<OpCase> {};

TEST_P(JitOpsTest, MatchesHostReference) {
  const OpCase& c = GetParam();
  ASSERT_NE(client_, nullptr);
  // Auto axes: each case's expected layouts and collectives are the compiler's propagation
  // (GSPMD); explicit mode's are ExplicitGrid's and ExplicitJitTest's.
  const Mesh& mesh = auto_meshes_[c.mesh];
  std::mt19937 rng(seed_of(c.name));
  std::vector<HostArray> inputs;
  std::vector<const HostArray*> ptrs;
  std::vector<PartitionSpec> specs;
  for (const Input& in : c.inputs) inputs.push_back(random_array(in.dtype, in.shape, in.domain, rng));
  for (size_t i = 0; i < c.inputs.size(); ++i) {
    ptrs.push_back(&inputs[i]);
    specs.push_back(c.inputs[i].spec);
  }
  const CaseFunction f = c.f;
  absl::StatusOr<JitCheck> r = run_against_host(
      *client_, mesh, [f, &mesh](const std::vector<Value>& in) { return f(in, mesh); }, ptrs, specs, c.options);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->got.size(), c.outputs.size());
  for (size_t i = 0; i < c.outputs.size(); ++i) {
    SCOPED_TRACE("output " + std::to_string(i) + ": " + c.outputs[i]);
    EXPECT_TRUE(results_match(r->got[i], r->want[i], kF32Tolerance));
    if (i < c.want_specs.size() && c.want_specs[i].has_value()) {
      // The layout wanted (P() for a matrix comes back as P(None, None): the same layout).
      EXPECT_TRUE(
          NamedSharding(mesh, r->out_specs[i])
              .is_equivalent_to(NamedSharding(mesh, *c.want_specs[i]), static_cast<int>(r->want[i].shape().size())))
          << "got " << r->out_specs[i].to_string() << ", want " << c.want_specs[i]->to_string();
    }
  }
  for (const std::string& collective : c.want_in_plan) EXPECT_THAT(r->plan_text, HasSubstr(collective + "("));
  for (const std::string& text : c.want_text) EXPECT_THAT(r->plan_text, HasSubstr(text));
  if (c.no_collectives) {
    for (const char* collective :
         {"all_reduce(", "all_gather(", "reduce_scatter(", "all_to_all(", "collective_permute("}) {
      EXPECT_THAT(r->plan_text, Not(HasSubstr(collective)));
    }
  }
  if (HasFailure()) ADD_FAILURE() << "plan:\n" << r->plan_text;
}

INSTANTIATE_TEST_SUITE_P(AllOps, JitOpsTest, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<OpCase>& info) { return info.param.name; });

}  // namespace
}  // namespace tessera
