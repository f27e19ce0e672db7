// grad and value_and_grad: every rule checked against central finite differences in float64
// on random inputs, the gradient program compiled by jit and run on Client::local(8) with
// random shardings of its arguments; the finite differences evaluate the function on the host
// (tests/support/host_eval.h). Plus the errors and the non-differentiable paths.
#include <functional>
#include <random>
#include <string>
#include <utility>
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

struct GradCase {
  std::string name;
  std::vector<Shape> inputs;  // float64; all differentiated
  Domain domain = Domain::kSigned;
  // Any function of the inputs; the test differentiates sum(f(inputs) * weights).
  std::function<Value(const std::vector<Value>&)> f;
};

void PrintTo(const GradCase& c, std::ostream* os) { *os << c.name; }

std::vector<GradCase> grad_cases() {
  using V = const std::vector<Value>&;
  const Shape m = {4, 8};
  std::vector<GradCase> out;
  auto unary = [&](std::string name, Value (*op)(const Value&), Domain domain = Domain::kSigned) {
    out.push_back({name, {m}, domain, [op](V in) { return op(in[0]); }});
  };
  unary("neg", [](const Value& x) { return -x; });
  unary("abs", abs);
  unary("exp", exp);
  unary("log", log, Domain::kPositive);
  unary("tanh", tanh);
  unary("logistic", logistic);
  unary("sqrt", sqrt, Domain::kPositive);
  unary("rsqrt", rsqrt, Domain::kPositive);
  unary("sin", sin);
  unary("cos", cos);
  unary("erf", erf);
  out.push_back({"erf_inv", {m}, Domain::kSigned, [](V in) { return erf_inv(in[0] * 0.4); }});
  out.push_back({"add", {m, m}, Domain::kSigned, [](V in) { return in[0] + in[1]; }});
  out.push_back({"sub", {m, m}, Domain::kSigned, [](V in) { return in[0] - in[1]; }});
  out.push_back({"mul", {m, m}, Domain::kSigned, [](V in) { return in[0] * in[1]; }});
  out.push_back({"div", {m, m}, Domain::kPositive, [](V in) { return in[0] / in[1]; }});
  out.push_back({"pow", {m, m}, Domain::kPositive, [](V in) { return pow(in[0], in[1]); }});
  out.push_back({"max", {m, m}, Domain::kSigned, [](V in) { return maximum(in[0], in[1]); }});
  out.push_back({"min", {m, m}, Domain::kSigned, [](V in) { return minimum(in[0], in[1]); }});
  out.push_back({"rem", {m, m}, Domain::kPositive, [](V in) { return rem(in[0] * 3.0, in[1]); }});
  out.push_back({"remainder", {m}, Domain::kSigned, [](V in) { return in[0] % 0.75; }});
  out.push_back(
      {"clamp", {m}, Domain::kSigned, [](V in) { return clamp(full({}, -0.9), in[0] * 2.0, full({}, 1.1)); }});
  out.push_back(
      {"matmul_batch_broadcast", {{2, 4, 8}, {8, 6}}, Domain::kSigned, [](V in) { return matmul(in[0], in[1]); }});
  out.push_back(
      {"matmul_matrix_by_batch", {{4, 8}, {3, 8, 6}}, Domain::kSigned, [](V in) { return matmul(in[0], in[1]); }});
  // jnp.matmul's program (free dimensions, a squeezed 1, a transpose into numpy's order) is
  // differentiated through its dot_general, reshape and transpose.
  out.push_back(
      {"matmul_size_one_batch", {{1, 4, 8}, {3, 8, 6}}, Domain::kSigned, [](V in) { return matmul(in[0], in[1]); }});
  out.push_back({"matmul_two_batch_broadcast", {{2, 1, 4, 8}, {3, 8, 6}}, Domain::kSigned, [](V in) {
                   return matmul(in[0], in[1]);
                 }});
  out.push_back(
      {"matmul_batch_both", {{3, 4, 8}, {3, 8, 6}}, Domain::kSigned, [](V in) { return matmul(in[0], in[1]); }});
  out.push_back({"broadcasting_add", {m, {8}}, Domain::kSigned, [](V in) { return in[0] + in[1]; }});
  out.push_back({"where", {m, m}, Domain::kSigned, [](V in) { return where(in[0] > in[1], in[0] * 2.0, in[1]); }});
  out.push_back({"broadcast_in_dim_stretched", {{8, 1}}, Domain::kSigned, [](V in) {
                   return broadcast_in_dim(in[0], {4, 8, 3}, {1, 2}) * 1.5;
                 }});
  out.push_back({"reshape", {m}, Domain::kSigned, [](V in) { return exp(reshape(in[0], {2, 16})); }});
  out.push_back({"transpose", {{2, 4, 8}}, Domain::kSigned, [](V in) { return sin(transpose(in[0], {2, 0, 1})); }});
  out.push_back({"expand_squeeze", {m}, Domain::kSigned, [](V in) { return squeeze(expand_dims(in[0], 1), {1}); }});
  out.push_back({"sum", {m}, Domain::kSigned, [](V in) { return sum(in[0] * in[0], {1}); }});
  out.push_back({"mean", {m}, Domain::kSigned, [](V in) { return mean(in[0], {0}); }});
  out.push_back({"max_reduce", {m}, Domain::kSigned, [](V in) { return max(in[0], {1}); }});
  out.push_back({"min_reduce", {m}, Domain::kSigned, [](V in) { return min(in[0], {0}, true); }});
  out.push_back({"prod_reduce", {m}, Domain::kNearOne, [](V in) { return prod(in[0], {1}); }});
  out.push_back({"matmul", {{4, 8}, {8, 6}}, Domain::kSigned, [](V in) { return matmul(in[0], in[1]); }});
  out.push_back({"dot_batch_and_odd_contracting", {{2, 8, 4}, {4, 2, 3}}, Domain::kSigned, [](V in) {
                   // batch lhs 0 with rhs 1, contract lhs 2 with rhs 0: result (2, 8, 3)
                   return dot_general(in[0], in[1], DotDims{{0}, {1}, {2}, {0}});
                 }});
  out.push_back({"dot_contract_two", {{4, 2, 8}, {8, 4}}, Domain::kSigned, [](V in) {
                   return dot_general(in[0], in[1], DotDims{{}, {}, {2, 0}, {0, 1}});
                 }});
  out.push_back({"slice", {m}, Domain::kSigned, [](V in) { return slice(in[0], {1, 2}, {3, 7}) * 3.0; }});
  out.push_back({"concatenate", {m, {4, 3}}, Domain::kSigned, [](V in) {
                   return concatenate({in[0], in[1] * in[1], in[0]}, 1);
                 }});
  out.push_back({"constraint", {m}, Domain::kSigned, [](V in) {
                   const Mesh mesh = *make_mesh({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7},
                                                {AxisType::kAuto, AxisType::kAuto});
                   return tanh(with_sharding_constraint(in[0] * 2.0, NamedSharding(mesh, P(None, "model"))));
                 }});
  out.push_back({"mlp_layer", {{4, 8}, {8, 6}, {6}}, Domain::kSigned, [](V in) {
                   return logistic(matmul(tanh(in[0]), in[1]) + in[2]);
                 }});
  out.push_back({"used_twice", {m}, Domain::kSigned, [](V in) { return in[0] * exp(in[0]) + in[0]; }});
  // shard_map bodies on the (4, 2) mesh: each collective, and arguments and results replicated
  // over axes their specs leave out.
  auto shard_mapped = [&](std::string name, std::vector<Shape> shapes, std::vector<PartitionSpec> in_specs,
                          PartitionSpec out_spec, std::function<Value(const std::vector<Value>&)> body,
                          Domain domain = Domain::kSigned) {
    out.push_back({"shard_map_" + name, std::move(shapes), domain, [=](V in) {
                     const Mesh mesh = *make_mesh({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7},
                                                  {AxisType::kAuto, AxisType::kAuto});
                     ShardMapped f =
                         shard_map([body](const std::vector<Value>& b) { return std::vector<Value>{body(b)}; }, mesh,
                                   in_specs, {out_spec});
                     return f(in)[0];
                   }});
  };
  shard_mapped("replicated", {m}, {P()}, P(), [](V b) { return sin(b[0]) * 2.0; });
  shard_mapped("psum", {m}, {P("data", "model")}, P("data", None), [](V b) { return psum(b[0] * b[0], "model"); });
  shard_mapped("psum_of_replicated", {m}, {P("data", None)}, P("data", None),
               [](V b) { return psum(exp(b[0]), {"model"}); });
  shard_mapped("pmean_both", {m}, {P("data", "model")}, P(), [](V b) { return pmean(tanh(b[0]), {"data", "model"}); });
  shard_mapped("pmax", {m}, {P("data", None)}, P(), [](V b) { return pmax(b[0] * 3.0, "data"); });
  // all_gather's result varies along its axes as JAX types it, so the out_spec names 'data':
  // every device's gathered copy is a block of the result.
  shard_mapped("all_gather", {m}, {P("data", "model")}, P("data", "model"),
               [](V b) { return all_gather(b[0] * b[0], "data", 0, true); });
  shard_mapped("psum_scatter", {m}, {P("data", None)}, P("data", "model"),
               [](V b) { return psum_scatter(sin(b[0]), "model", 1, true); });
  shard_mapped("ppermute", {m}, {P("data", None)}, P("data", None), [](V b) {
    return ppermute(b[0] * b[0], "data", {{0, 1}, {1, 2}, {2, 3}, {3, 0}});
  });
  shard_mapped("all_to_all", {m}, {P("data", "model")}, P(Axes{"data", "model"}, None),
               [](V b) { return all_to_all(exp(b[0]), "model", 1, 0, true); });
  shard_mapped("matmul_psum", {{4, 8}, {8, 6}}, {P(None, "model"), P("model", None)}, P(),
               [](V b) { return psum(matmul(b[0], b[1]), "model"); });
  // pvary of a replicated argument, and of a psum's result (both invariant along the axis).
  shard_mapped("pvary", {{2, 8}, {8, 8}}, {P(), P("data", None)}, P("data", None),
               [](V b) { return tanh(pvary(b[0], "data")) * b[1]; });
  shard_mapped("pvary_of_psum", {{4, 8}}, {P(None, "model")}, P(None, "model"),
               [](V b) { return pvary(psum(b[0] * b[0], "model"), "model") * sin(b[0]); });
  out.push_back({"shard_map_inside_automatic_code", {{4, 8}, {8, 6}}, Domain::kSigned, [](V in) {
                   const Mesh mesh = *make_mesh({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7},
                                                {AxisType::kAuto, AxisType::kAuto});
                   ShardMapped f = shard_map(
                       [](const std::vector<Value>& b) {
                         return std::vector<Value>{psum_scatter(matmul(b[0], b[1]), "model", 1, true)};
                       },
                       mesh, {P("data", "model"), P("model", None)}, {P("data", "model")});
                   return exp(f({tanh(in[0]), in[1] * 2.0})[0] * 0.5);
                 }});
  // Bodies manual over 'data' only (axis_names), their work split over 'model' by the
  // compiler: x * x * x as JAX's test_grad_nested_partial_auto_with_residuals differentiates it
  // (tests/shard_map_test.py: 3 v^2), and a matmul whose weights enter replicated over the
  // manual axis and split over the automatic one, with a psum over the manual axis.
  auto partial_manual = [&](std::string name, std::vector<Shape> shapes, std::vector<PartitionSpec> in_specs,
                            PartitionSpec out_spec, std::function<Value(const std::vector<Value>&)> body) {
    out.push_back({"shard_map_axis_names_" + name, std::move(shapes), Domain::kSigned, [=](V in) {
                     const Mesh mesh = *make_mesh({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7},
                                                  {AxisType::kAuto, AxisType::kAuto});
                     ShardMapped f =
                         shard_map([body](const std::vector<Value>& b) { return std::vector<Value>{body(b)}; }, mesh,
                                   in_specs, {out_spec}, {.axis_names = {"data"}});
                     return f(in)[0];
                   }});
  };
  partial_manual("cube", {m}, {P("data", None)}, P("data", None), [](V b) { return b[0] * b[0] * b[0]; });
  partial_manual("matmul_psum", {{8, 8}, {8, 4}}, {P("data", None), P()}, P(),
                 [](V b) { return psum(tanh(matmul(b[0], b[1])), "data"); });
  // Indexing: index arrays are made in the function (the test differentiates float inputs),
  // with repeats, negatives and, where the mode drops or clamps them, out-of-range indices.
  const auto ids = [](std::vector<int32_t> v) {
    // iota-based, so the values are traced: ids[k] = v[k] through a one-hot sum.
    Value out = full({static_cast<int64_t>(v.size())}, 0.0, DType::kI32);
    for (size_t k = 0; k < v.size(); ++k) {
      const Value at_k = convert(iota(DType::kI32, {static_cast<int64_t>(v.size())}, 0) ==
                                     full({static_cast<int64_t>(v.size())}, static_cast<double>(k), DType::kI32),
                                 DType::kI32);
      out = out + at_k * v[k];
    }
    return out;
  };
  out.push_back({"take", {{6, 4}}, Domain::kSigned, [ids](V in) { return take(in[0], ids({3, -1, 3, 0, 5}), 0); }});
  out.push_back({"take_axis1_clip", {{6, 4}}, Domain::kSigned, [ids](V in) {
                   return take(in[0] * in[0], ids({2, 9, -7, 2}), 1, IndexMode::kClip);
                 }});
  out.push_back({"take_fill_out_of_range", {{6, 4}}, Domain::kSigned, [ids](V in) {
                   return take(in[0], ids({1, 8, 4}), 0, IndexMode::kFillOrDrop, Scalar(0.0));
                 }});
  out.push_back({"scatter_add", {{6, 4}, {5, 4}}, Domain::kSigned, [ids](V in) {
                   return at(in[0], ids({1, 4, 1, -2, 7})).add(in[1] * in[1]);
                 }});
  out.push_back({"scatter_set", {{6, 4}, {3, 4}}, Domain::kSigned, [ids](V in) {
                   return tanh(at(in[0], ids({4, 0, 2})).set(in[1]));
                 }});
  out.push_back({"dynamic_slice", {{6, 4}}, Domain::kSigned, [](V in) {
                   return dynamic_slice(in[0], {full({}, 4.0, DType::kI32), full({}, 1.0, DType::kI32)}, {3, 2});
                 }});
  out.push_back(
      {"dynamic_update_slice", {{6, 4}, {2, 4}}, Domain::kSigned, [](V in) {
         return dynamic_update_slice(in[0], sin(in[1]), {full({}, 3.0, DType::kI32), full({}, 0.0, DType::kI32)});
       }});
  // lax.gather / scatter_add with dimension numbers and take_along_axis (client/lax_gather.cc;
  // values: tests/integration/gather_test.cc): windows at (i, j), one start out of range.
  const auto pairs = [ids](std::vector<int> v) { return reshape(ids(v), {static_cast<int64_t>(v.size() / 2), 2}); };
  out.push_back({"gather_dimension_numbers_clip", {{6, 4}}, Domain::kSigned, [pairs](V in) {
                   return gather(in[0], pairs({0, 1, 5, 3, 2, -1}), GatherDimensionNumbers{{1}, {0}, {0, 1}}, {1, 2},
                                 IndexMode::kClip);
                 }});
  out.push_back({"gather_dimension_numbers_fill", {{6, 4}}, Domain::kSigned, [pairs](V in) {
                   return gather(in[0] * in[0], pairs({0, 1, 4, 2, 2, 3}), GatherDimensionNumbers{{1}, {0}, {0, 1}},
                                 {1, 2}, IndexMode::kFillOrDrop, Scalar(0.0));
                 }});
  out.push_back(
      {"scatter_add_dimension_numbers", {{6, 4}, {3, 2}}, Domain::kSigned, [pairs](V in) {
         return scatter_add(in[0], pairs({0, 1, 5, 2, 2, 3}), in[1] * in[1], ScatterDimensionNumbers{{1}, {0}, {0, 1}});
       }});
  out.push_back({"take_along_axis", {{4, 5}}, Domain::kSigned, [ids](V in) {
                   return take_along_axis(in[0], reshape(ids({0, 4, 4, -1, 2, 1, 3, 3}), {4, 2}), 1);
                 }});
  // lax.scatter_mul / min / max (values: gather_test.cc). scatter_mul's: the operand's is
  // scatter_mul(t, ...), the updates' gather(t * operand) (JAX's _scatter_mul_transpose_rule,
  // which needs unique indices; with repeated ones here, the product rule). min / max: the
  // element equal to the result takes its cotangent (_scatter_extremal_jvp; random inputs tie
  // with probability 0). Rows (1, 5, 1), one (5) out of range (dropped), windows of 2 columns.
  const ScatterDimensionNumbers rows{{1}, {0}, {0, 1}};
  out.push_back({"scatter_mul_unique", {{6, 4}, {3, 2}}, Domain::kSigned, [pairs, rows](V in) {
                   return scatter_mul(in[0], pairs({0, 1, 5, 2, 2, 3}), sin(in[1]), rows);
                 }});
  out.push_back({"scatter_mul_repeated", {{6, 4}, {3, 2}}, Domain::kSigned, [pairs, rows](V in) {
                   return scatter_mul(in[0], pairs({1, 1, 1, 2, 4, 2}), in[1], rows);
                 }});
  out.push_back({"scatter_min_repeated", {{6, 4}, {4, 2}}, Domain::kSigned, [pairs, rows](V in) {
                   return scatter_min(in[0] * in[0], pairs({1, 1, 1, 2, 6, 0, 1, 1}), in[1], rows);
                 }});
  out.push_back({"scatter_max_clip", {{6, 4}, {4, 2}}, Domain::kSigned, [pairs, rows](V in) {
                   return scatter_max(in[0], pairs({3, 0, 3, 1, 9, 2, 0, 0}), in[1] * 2.0, rows, IndexMode::kClip);
                 }});
  // lax.scatter_sub (values: gather_test.cc): JAX's _scatter_addsub_transpose_rule, the operand's
  // gradient the cotangent, the updates' the negated gather of it (0 for dropped windows). And
  // lax.scatter_apply, differentiated through its applications of func (JAX has no rule). Rows
  // (1, 1) repeated, (9, 0) out of range and (2, 3) whose window of 2 columns overruns: dropped in
  // kFillOrDrop and kOneHot, clamped in kClip; kPromiseInBounds with in-bounds starts only.
  const std::vector<std::pair<const char*, GatherScatterMode>> modes = {
      {"clip", GatherScatterMode::kClip},
      {"fill", GatherScatterMode::kFillOrDrop},
      {"one_hot", GatherScatterMode::kOneHot},
      {"promise_in_bounds", GatherScatterMode::kPromiseInBounds}};
  for (const auto& [mode_name, mode] : modes) {
    const std::vector<int> starts = mode == GatherScatterMode::kPromiseInBounds
                                        ? std::vector<int>{1, 1, 1, 1, 5, 0, 2, 2}
                                        : std::vector<int>{1, 1, 1, 1, 9, 0, 2, 3};
    out.push_back(
        {absl::StrCat("scatter_sub_", mode_name), {{6, 4}, {4, 2}}, Domain::kSigned, [pairs, rows, starts, mode](V in) {
           return scatter_sub(in[0], pairs(starts), sin(in[1]), rows, mode);
         }});
    out.push_back(
        {absl::StrCat("scatter_apply_", mode_name), {{6, 4}}, Domain::kSigned, [pairs, rows, starts, mode](V in) {
           return scatter_apply(
               in[0], pairs(starts), [](const Value& v) { return sin(v) * 1.5 + 0.25; }, rows, {4, 2}, mode);
         }});
  }
  // scatter_apply with a largest count of 4 (r = 3: chunks of 2 and 1 further applications):
  // (1, 1) four times, (3, 2) twice, (9, 2) clamped onto (5, 2) and (0, 0) once each.
  out.push_back({"scatter_apply_repeated_r3", {{6, 4}}, Domain::kSigned, [pairs, rows](V in) {
                   return scatter_apply(
                       in[0], pairs({1, 1, 1, 1, 1, 1, 1, 1, 3, 2, 9, 2, 3, 2, 0, 0}),
                       [](const Value& v) { return sin(v) * 1.5 + 0.25; }, rows, {8, 2}, GatherScatterMode::kClip);
                 }});
  // tessera::nn's composites (their values: tests/client/nn_test.cc).
  // Issue #15's composites (client/lax.cc): pad's VJP slices the cotangent (strided through
  // the interior padding) and sums the rest into padding_value, as lax's transpose of pad;
  // the scans differentiate through their combines (JAX: associative_scan).
  out.push_back({"pad_negative_interior", {m, {}}, Domain::kSigned, [](V in) {
                   return pad(in[0], in[1], {{2, -1, 1}, {-3, 2, 2}});
                 }});
  out.push_back({"jnp_pad", {m}, Domain::kSigned, [](V in) { return sin(pad(in[0], {{1, 2}, {0, 3}}, 0.5)); }});
  out.push_back({"cumsum", {m}, Domain::kSigned, [](V in) { return cumsum(in[0], 1); }});
  out.push_back({"cumsum_reverse", {m}, Domain::kSigned, [](V in) { return cumsum(in[0], 0, true); }});
  out.push_back({"cumprod", {m}, Domain::kNearOne, [](V in) { return cumprod(in[0], 1); }});
  out.push_back({"cumprod_reverse", {{4, 7}}, Domain::kSigned, [](V in) { return cumprod(in[0], 1, true); }});
  out.push_back({"cummax", {m}, Domain::kSigned, [](V in) { return cummax(in[0], 1); }});
  out.push_back({"cummin_reverse", {m}, Domain::kSigned, [](V in) { return cummin(in[0], 0, true); }});
  out.push_back({"tril_triu", {m}, Domain::kSigned, [](V in) { return tril(in[0], 2) * 2.0 + triu(in[0], -1); }});
  out.push_back(
      {"einsum_transposed", {{4, 8}, {6, 8}}, Domain::kSigned, [](V in) { return einsum("ij,kj->ki", in[0], in[1]); }});
  out.push_back({"einsum_batch_summed", {{2, 4, 3}, {2, 3, 5}}, Domain::kSigned, [](V in) {
                   return einsum("bij,bjk->kb", in[0], in[1]);
                 }});
  // sort and top_k: the cotangent goes back through the permutation (a gather's VJP).
  out.push_back({"sort", {m}, Domain::kSigned, [](V in) { return sort(in[0]) * iota(DType::kF64, {4, 8}, 1); }});
  out.push_back({"top_k_values", {m}, Domain::kSigned, [](V in) { return top_k(exp(in[0]), 3).first; }});
  out.push_back({"nn_softmax", {m}, Domain::kSigned, [](V in) { return nn::softmax(in[0]); }});
  out.push_back({"nn_log_softmax", {m}, Domain::kSigned, [](V in) { return nn::log_softmax(in[0], 0); }});
  out.push_back({"nn_logsumexp", {m}, Domain::kSigned, [](V in) { return nn::logsumexp(in[0]); }});
  out.push_back({"nn_gelu_tanh", {m}, Domain::kSigned, [](V in) { return nn::gelu(in[0]); }});
  out.push_back({"nn_gelu_exact", {m}, Domain::kSigned, [](V in) { return nn::gelu(in[0], false); }});
  out.push_back({"nn_silu", {m}, Domain::kSigned, [](V in) { return nn::silu(in[0]); }});
  out.push_back(
      {"nn_layer_norm", {m, {8}, {8}}, Domain::kSigned, [](V in) { return nn::layer_norm(in[0], in[1], in[2]); }});
  out.push_back({"nn_rms_norm", {m, {8}}, Domain::kSigned, [](V in) { return nn::rms_norm(in[0], in[1]); }});
  out.push_back({"nn_cross_entropy", {m}, Domain::kSigned, [](V in) {
                   return nn::cross_entropy(in[0], iota(DType::kI32, {4}, 0) * 2);
                 }});
  out.push_back({"nn_causal_attention", {{2, 4, 2, 4}, {2, 4, 2, 4}, {2, 4, 2, 4}}, Domain::kSigned, [](V in) {
                   return nn::dot_product_attention(in[0], in[1], in[2], std::nullopt, true);
                 }});
  // relu (jax.nn.relu: max(x, 0); the random inputs never hit the kink at 0).
  out.push_back({"nn_relu", {m}, Domain::kSigned, [](V in) { return nn::relu(in[0]); }});
  // Attention with a mask (B, N, T, S) and a shorter key sequence (S = 3): keep s != t, and
  // nothing at all in row t = 0 of batch 1, head 0 (JAX's masked rows attend uniformly, with
  // the lowest finite value, so that row's gradient flows to v only).
  out.push_back({"nn_masked_attention", {{2, 4, 2, 4}, {2, 3, 2, 4}, {2, 3, 2, 4}}, Domain::kSigned, [](V in) {
                   const Shape s = {2, 2, 4, 3};
                   const Value t = iota(DType::kI32, s, 2), u = iota(DType::kI32, s, 3);
                   const Value dead =
                       logical_and(logical_and(iota(DType::kI32, s, 0) == 1, iota(DType::kI32, s, 1) == 0), t == 0);
                   const Value keep = logical_and(t != u, logical_not(dead));
                   return nn::dot_product_attention(in[0], in[1], in[2], keep);
                 }});
  // Control flow (client/vjp/control.cc): a recurrent layer h' = tanh(h @ w / 2 + x) scanned
  // over 4 rows, its final carry and both stacked outputs; reverse; fori_loop.
  for (bool reverse : {false, true}) {
    out.push_back({reverse ? "scan_reverse" : "scan", {{4, 4}, {4, 4}, {4, 4, 4}}, Domain::kSigned, [reverse](V in) {
                     ScanResult r = scan(
                         [](const std::vector<Value>& c, const std::vector<Value>& x) {
                           const Value h = tanh(matmul(c[0], c[1]) * 0.5 + x[0]);
                           return ScanStep{{h, c[1]}, {h * h, sum(h * x[0])}};
                         },
                         {in[0], in[1]}, {in[2]}, std::nullopt, reverse);
                     return r.carry[0] + sum(r.ys[0], {0}) + sum(r.ys[1]) + r.carry[1];
                   }});
  }
  // A body reading outer values (closed-over consts, JAX's scan consts): their cotangents sum
  // over the iterations; a nested scan captures through the outer body.
  out.push_back({"scan_closure", {{4, 4}, {4, 4}, {4, 4, 4}, {4}}, Domain::kSigned, [](V in) {
                   const Value w = in[1], b = in[3];
                   ScanResult r = scan(
                       [&](const std::vector<Value>& c, const std::vector<Value>& x) {
                         const Value h = tanh(matmul(c[0], w) * 0.5 + x[0] + b);
                         return ScanStep{{h}, {h * b}};
                       },
                       {in[0]}, {in[2]});
                   return r.carry[0] + sum(r.ys[0], {0});
                 }});
  out.push_back({"scan_closure_nested", {{4, 4}, {4, 4}, {3, 4, 4}}, Domain::kSigned, [](V in) {
                   const Value w = in[1];
                   ScanResult r = scan(
                       [&](const std::vector<Value>& c, const std::vector<Value>& x) {
                         const Value inner = fori_loop(0, 2,
                                                       [&](const Value&, const std::vector<Value>& d) {
                                                         return std::vector<Value>{tanh(matmul(d[0], w) * 0.5 + x[0])};
                                                       },
                                                       {c[0]})[0];
                         return ScanStep{{inner * 0.9}, {}};
                       },
                       {in[0]}, {in[2]});
                   return r.carry[0];
                 }});
  // cond / switch: the cotangent goes through the taken branch (JAX's cond transpose); the
  // branches read an outer value; checkpoint recomputes its function in the backward pass.
  out.push_back({"cond", {{4, 4}, {4, 4}}, Domain::kSigned, [](V in) {
                   const Value w = in[1];
                   const Branch a = [&](const std::vector<Value>& o) {
                     return std::vector<Value>{tanh(matmul(o[0], w)), sum(o[0] * o[0])};
                   };
                   const Branch b = [](const std::vector<Value>& o) {
                     return std::vector<Value>{exp(o[0] * 0.5), sum(o[0])};
                   };
                   std::vector<Value> r = cond(sum(in[0] * 0.0) < 1.0, a, b, {in[0]});      // true_fun
                   std::vector<Value> q = cond(sum(in[0] * 0.0) > 1.0, a, b, {in[0] * w});  // false_fun
                   return r[0] * r[1] + q[0] + q[1];
                 }});
  out.push_back({"switch", {{4, 4}, {4, 4}}, Domain::kSigned, [](V in) {
                   const std::vector<Branch> br = {
                       [](const std::vector<Value>& o) { return std::vector<Value>{o[0] * o[1]}; },
                       [](const std::vector<Value>& o) { return std::vector<Value>{matmul(o[0], o[1]) * 0.5}; },
                       [](const std::vector<Value>& o) { return std::vector<Value>{sin(o[1])}; }};
                   return switch_(full({}, 1, DType::kI32), br, {in[0], in[1]})[0] +
                          switch_(full({}, 9, DType::kI32), br, {in[0], in[1]})[0];
                 }});
  out.push_back({"checkpoint", {{4, 4}, {4, 4}}, Domain::kSigned, [](V in) {
                   const TracedFunction layer = checkpoint([](const std::vector<Value>& a) {
                     return std::vector<Value>{tanh(matmul(a[0], a[1]) * 0.5 + a[0])};
                   });
                   return layer({layer({in[0], in[1]})[0], in[1]})[0];
                 }});
  // With a saving policy (jax.checkpoint_policies): the kept values are read in the backward
  // pass, not computed again. Two matmuls in a row (the second reads the first's kept
  // result), a batched dot_general (kept by dots_saveable only), and checkpoint as a scan
  // body whose kept dots become the scan's residuals.
  const auto policy_case = [](CheckpointPolicy policy) {
    return [policy](V in) {
      const TracedFunction layer = checkpoint(
          [](const std::vector<Value>& a) {
            const Value h = tanh(matmul(a[0], a[1]) * 0.5 + a[0]);
            const Value batched =
                dot_general(reshape(h, {2, 2, 4}), reshape(a[1], {2, 4, 2}), DotDims{{0}, {0}, {2}, {1}});
            return std::vector<Value>{sin(matmul(h, a[1])) + sum(batched * batched) * 0.05};
          },
          policy);
      return layer({layer({in[0], in[1]})[0], in[1]})[0];
    };
  };
  out.push_back(
      {"checkpoint_dots_saveable", {{4, 4}, {4, 4}}, Domain::kSigned, policy_case(checkpoint_policies::dots_saveable)});
  out.push_back({"checkpoint_dots_with_no_batch_dims_saveable",
                 {{4, 4}, {4, 4}},
                 Domain::kSigned,
                 policy_case(checkpoint_policies::dots_with_no_batch_dims_saveable)});
  out.push_back({"checkpoint_everything_saveable",
                 {{4, 4}, {4, 4}},
                 Domain::kSigned,
                 policy_case(checkpoint_policies::everything_saveable)});
  // Second order: the case's value is a first-order gradient (checked by the cases above), so
  // its gradient is a grad of grad, against central differences of that value. grad lays each
  // gradient out as its argument (sharding_as), which the outer grad goes back through; with a
  // saving policy the outer grad differentiates the kept values too.
  const auto second_order = [](CheckpointPolicy policy, bool remat) {
    return [policy, remat](V in) {
      const TracedFunction layer = [](const std::vector<Value>& a) {
        return std::vector<Value>{tanh(matmul(a[0], a[1]) * 0.5) * a[0]};
      };
      const TracedFunction f = remat ? checkpoint(layer, policy) : layer;
      const TracedFunction loss = [f](const std::vector<Value>& a) {
        const Value y = f(a)[0];
        return std::vector<Value>{sum(y * y)};
      };
      const std::vector<Value> g = grad(loss, {0, 1})({in[0], in[1]});
      return g[0] * g[0] + sin(g[1]);
    };
  };
  out.push_back({"grad_of_grad", {{4, 4}, {4, 4}}, Domain::kSigned, second_order(nullptr, false)});
  out.push_back({"grad_of_grad_checkpoint", {{4, 4}, {4, 4}}, Domain::kSigned, second_order(nullptr, true)});
  out.push_back({"grad_of_grad_checkpoint_dots_saveable",
                 {{4, 4}, {4, 4}},
                 Domain::kSigned,
                 second_order(checkpoint_policies::dots_saveable, true)});
  out.push_back(
      {"checkpoint_dots_in_scan", {{4, 4}, {4, 4}, {3, 4, 4}}, Domain::kSigned, [](V in) {
         const TracedFunction body = checkpoint(
             [](const std::vector<Value>& a) { return std::vector<Value>{tanh(matmul(a[0], a[1]) * 0.5 + a[2])}; },
             checkpoint_policies::dots_saveable);
         ScanResult r = scan(
             [&](const std::vector<Value>& c, const std::vector<Value>& x) {
               const Value h = body({c[0], c[1], x[0]})[0];
               return ScanStep{{h, c[1]}, {h * h}};
             },
             {in[0], in[1]}, {in[2]});
         return r.carry[0] + sum(r.ys[0], {0});
       }});
  out.push_back(
      {"fori_loop", {{4, 4}, {4, 4}}, Domain::kSigned, [](V in) {
         return fori_loop(
             0, 3,
             [](const Value& i, const std::vector<Value>& c) {
               return std::vector<Value>{tanh(matmul(c[0], c[1]) * 0.5 + convert(i, DType::kF64) * 0.1), c[1] * 0.9};
             },
             {in[0], in[1]})[0];
       }});
  return out;
}

// A random layout for `shape` on the (4, 2) mesh, among those that fit.
PartitionSpec random_spec(const Shape& shape, std::mt19937& rng) {
  std::vector<PartitionSpec> fits = {P()};
  const std::vector<PartitionSpec> candidates = {P("data"),          P(None, "model"), P("data", "model"),
                                                 P("model", "data"), P(None, "data"),  P("model")};
  for (const PartitionSpec& s : candidates) {
    bool ok = s.size() <= static_cast<int>(shape.size());
    for (int d = 0; ok && d < s.size(); ++d) {
      int64_t n = 1;
      for (const std::string& a : s.axes(d)) n *= a == "data" ? 4 : 2;
      ok = shape[d] % n == 0;
    }
    if (ok) fits.push_back(s);
  }
  return fits[std::uniform_int_distribution<size_t>(0, fits.size() - 1)(rng)];
}

class GradTest : public MeshesSuite, public ::testing::WithParamInterface<GradCase> {};

TEST_P(GradTest, MatchesCentralFiniteDifferences) {
  const GradCase& c = GetParam();
  ASSERT_NE(client_, nullptr);
  // (4, 2): 'data', 'model', Auto axes: each argument takes a random layout and the compiler
  // reconciles them (GSPMD). On Explicit axes JAX >= 0.9 refuses operands split differently.
  const Mesh& mesh = auto_meshes_[1];
  const size_t n = c.inputs.size();
  // The scalar: sum(f(x) * w), w a random weight given as the last input (not differentiated).
  absl::StatusOr<Graph> shape_probe = trace([&](const std::vector<Value>& in) { return std::vector<Value>{c.f(in)}; },
                                            [&] {
                                              std::vector<ArrayType> t;
                                              for (const Shape& s : c.inputs) t.push_back({DType::kF64, s});
                                              return t;
                                            }());
  ASSERT_TRUE(shape_probe.ok()) << shape_probe.status();
  const Shape out_shape = shape_probe->node(shape_probe->outputs()[0]).shape;
  TracedFunction loss = [&c, n](const std::vector<Value>& in) {
    std::vector<Value> x(in.begin(), in.begin() + n);
    return std::vector<Value>{sum(c.f(x) * in[n])};
  };
  std::vector<int> argnums(n);
  for (size_t i = 0; i < n; ++i) argnums[i] = static_cast<int>(i);

  std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>()(c.name)));
  std::vector<HostArray> inputs;
  std::vector<ArrayType> types;
  std::vector<Array> args;
  for (const Shape& s : c.inputs) inputs.push_back(random_array(DType::kF64, s, c.domain, rng));
  inputs.push_back(random_array(DType::kF64, out_shape, Domain::kSigned, rng));
  for (const HostArray& a : inputs) {
    types.push_back({DType::kF64, a.shape()});
    const PartitionSpec spec = random_spec(a.shape(), rng);
    absl::StatusOr<Array> put = client_->device_put(a, NamedSharding(mesh, spec));
    ASSERT_TRUE(put.ok()) << put.status();
    args.push_back(*std::move(put));
  }
  Jitted step = jit(value_and_grad(loss, argnums));
  absl::StatusOr<std::vector<Array>> got = step(args);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), n + 1);

  absl::StatusOr<Graph> loss_graph = trace(loss, types);
  ASSERT_TRUE(loss_graph.ok());
  auto loss_at = [&](const std::vector<HostArray>& at) {
    std::vector<const HostArray*> ptrs;
    for (const HostArray& a : at) ptrs.push_back(&a);
    absl::StatusOr<std::vector<HostArray>> v = evaluate_on_host(*loss_graph, ptrs);
    EXPECT_TRUE(v.ok()) << v.status();
    return v.ok() ? (*v)[0].element_as_double(0) : 0.0;
  };
  absl::StatusOr<HostArray> value = (*got)[0].fetch();
  ASSERT_TRUE(value.ok());
  EXPECT_NEAR(value->element_as_double(0), loss_at(inputs), 1e-9 * (1 + std::abs(loss_at(inputs))));
  constexpr double h = 1e-6;
  for (size_t k = 0; k < n; ++k) {
    absl::StatusOr<HostArray> g = (*got)[k + 1].fetch();
    ASSERT_TRUE(g.ok()) << g.status();
    ASSERT_EQ(g->shape(), inputs[k].shape());
    // Laid out as its argument (a spec written short, P('data') for a matrix, comes back
    // padded to the rank: the same layout, NamedSharding.is_equivalent_to as in JAX).
    EXPECT_TRUE(
        (*got)[k + 1].sharding().is_equivalent_to(args[k].sharding(), static_cast<int>(inputs[k].shape().size())))
        << "gradient " << k << " sharding " << (*got)[k + 1].sharding().spec().to_string() << " for "
        << args[k].sharding().spec().to_string();
    for (int64_t i = 0; i < inputs[k].size(); ++i) {
      std::vector<HostArray> plus, minus;
      for (const HostArray& a : inputs) {
        plus.push_back(a.clone());
        minus.push_back(a.clone());
      }
      plus[k].mutable_values<double>()[i] += h;
      minus[k].mutable_values<double>()[i] -= h;
      const double fd = (loss_at(plus) - loss_at(minus)) / (2 * h);
      EXPECT_NEAR(g->element_as_double(i), fd, 1e-5 * (1 + std::abs(fd))) << "d/d input " << k << " element " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllRules, GradTest, ::testing::ValuesIn(grad_cases()),
                         [](const ::testing::TestParamInfo<GradCase>& info) { return info.param.name; });

TEST(Grad, ErrorsAndNonDifferentiablePaths) {
  auto trace_status = [](const TracedFunction& f, std::vector<ArrayType> types) { return trace(f, types).status(); };
  const TracedFunction sum_f = [](const std::vector<Value>& in) { return std::vector<Value>{sum(in[0])}; };
  absl::Status s = trace_status(grad(sum_f, {0}), {{DType::kI32, {4}}});
  EXPECT_THAT(std::string(s.message()), HasSubstr("grad: argument 0 is i32[4]; gradients need float inputs"));
  s = trace_status(grad(sum_f, {2}), {{DType::kF32, {4}}});
  EXPECT_THAT(std::string(s.message()), HasSubstr("argnum 2 is out of range for 1 arguments"));
  s = trace_status(grad([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0}; }),
                   {{DType::kF32, {4}}});
  EXPECT_THAT(std::string(s.message()), HasSubstr("must return a float scalar first, not f32[4]"));
  // Comparisons, argmax and floor carry no gradient: d/dx of sum(floor(x) + (x > 0)) is 0.
  absl::StatusOr<Graph> g =
      trace(grad([](const std::vector<Value>& in) {
              Value idx = convert(argmax(in[0], 0), DType::kF32);
              return std::vector<Value>{sum(floor(in[0]) + convert(in[0] > 0.0 * in[0], DType::kF32)) + idx};
            }),
            {{DType::kF32, {4}}});
  ASSERT_TRUE(g.ok()) << g.status();
  const HostArray x = HostArray::from_vector<float>({4}, {0.5f, -1.5f, 2.25f, 3.0f});
  absl::StatusOr<std::vector<HostArray>> d = evaluate_on_host(*g, {&x});
  ASSERT_TRUE(d.ok()) << d.status();
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ((*d)[0].element_as_double(i), 0.0);
}

// lax.stop_gradient: grad(lambda x: sum(x * stop_gradient(x) + stop_gradient(exp(x))))(x) is
// stop_gradient(x) = x (the documented example of jax.lax.stop_gradient differentiates
// through one factor only). Finite differences cannot see this, so the values are exact.
TEST(Grad, StopGradientPassesNoCotangent) {
  absl::StatusOr<Graph> g = trace(grad([](const std::vector<Value>& in) {
                                    const Value& x = in[0];
                                    return std::vector<Value>{sum(x * stop_gradient(x) + stop_gradient(exp(x)))};
                                  }),
                                  {{DType::kF64, {5}}});
  ASSERT_TRUE(g.ok()) << g.status();
  const HostArray x = HostArray::from_vector<double>({5}, {0.5, -1.5, 2.25, 3.0, -0.125});
  absl::StatusOr<std::vector<HostArray>> d = evaluate_on_host(*g, {&x});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)[0], x);
}

}  // namespace
}  // namespace tessera
