// Every kernel against a naive reference written here: plain loops over multi-indices that
// compute each expected element in double. Nodes come from core::Graph, so their attributes are
// the ones tracing produces; operands are small random values from a fixed seed.
//
// Tolerances: integers and bool exact; float32 1e-5 and float64 1e-12 relative to the element's
// scale, which is |expected| for elementwise results and the sum of the absolute values of the
// terms for sums and dot products (the error of a sum grows with its terms, not its result).
#include "worker/kernels/kernels.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/graph.h"
#include "core/host_array.h"
#include "core/mesh.h"
#include "core/partition_spec.h"
#include "core/sharding.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/kernels/blas.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

constexpr DType kNumeric[] = {DType::kF32, DType::kF64, DType::kI32, DType::kI64};
constexpr DType kFloats[] = {DType::kF32, DType::kF64};
constexpr DType kIntegers[] = {DType::kI32, DType::kI64};

// Shapes for elementwise ops: a scalar, empty arrays, a vector, rank 3.
const std::vector<Shape> kShapes = {{}, {0}, {7}, {2, 3, 4}, {3, 0, 2}};

// ---- Multi-indices ---------------------------------------------------------------------------

void unravel(int64_t flat, const Shape& shape, std::vector<int64_t>* index) {
  index->resize(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    (*index)[d] = flat % shape[d];
    flat /= shape[d];
  }
}

std::vector<int64_t> unravel(int64_t flat, const Shape& shape) {
  std::vector<int64_t> index;
  unravel(flat, shape, &index);
  return index;
}

int64_t ravel(const std::vector<int64_t>& index, const Shape& shape) {
  int64_t flat = 0;
  for (size_t d = 0; d < shape.size(); ++d) flat = flat * shape[d] + index[d];
  return flat;
}

// ---- Operands --------------------------------------------------------------------------------

// The dtypes the sweeps below cover, whose references are computed in double with signed
// semantics; uint32 (wrapping unsigned arithmetic) has tests of its own (Kernels.Uint32*).
constexpr DType kSweptDTypes[] = {DType::kF32, DType::kF64, DType::kI32, DType::kI64, DType::kBool};

// Uniform in [lo, hi] for floats, integers in [lo, hi] for integer dtypes, fair coins for bool.
HostArray random_array(DType dtype, const Shape& shape, std::mt19937& rng, double lo = -3, double hi = 3) {
  HostArray a(dtype, shape);
  std::uniform_real_distribution<double> real(lo, hi);
  std::uniform_int_distribution<int64_t> integer(static_cast<int64_t>(std::ceil(lo)),
                                                 static_cast<int64_t>(std::floor(hi)));
  std::bernoulli_distribution coin(0.5);
  for (int64_t i = 0; i < a.size(); ++i) {
    switch (dtype) {
      case DType::kF32:
        a.mutable_values<float>()[i] = static_cast<float>(real(rng));
        break;
      case DType::kF64:
        a.mutable_values<double>()[i] = real(rng);
        break;
      case DType::kI32:
        a.mutable_values<int32_t>()[i] = static_cast<int32_t>(integer(rng));
        break;
      case DType::kI64:
        a.mutable_values<int64_t>()[i] = integer(rng);
        break;
      case DType::kBool:
        a.mutable_values<bool>()[i] = coin(rng);
        break;
      case DType::kU32:
        a.mutable_values<uint32_t>()[i] = static_cast<uint32_t>(integer(rng));
        break;
      case DType::kBF16:
        a.mutable_values<BFloat16>()[i] = BFloat16(real(rng));
        break;
      case DType::kF16:
        a.mutable_values<Float16>()[i] = Float16(real(rng));
        break;
      case DType::kU8:
        a.mutable_values<uint8_t>()[i] = static_cast<uint8_t>(integer(rng));
        break;
      case DType::kI8:
        a.mutable_values<int8_t>()[i] = static_cast<int8_t>(integer(rng));
        break;
      case DType::kI16:
        a.mutable_values<int16_t>()[i] = static_cast<int16_t>(integer(rng));
        break;
    }
  }
  return a;
}

// Small integers (as any dtype), so that comparisons see ties.
HostArray small_integers(DType dtype, const Shape& shape, std::mt19937& rng) {
  HostArray a = random_array(DType::kI64, shape, rng, -2, 2);
  HostArray out(dtype, shape);
  for (int64_t i = 0; i < a.size(); ++i) {
    const int64_t v = a.values<int64_t>()[i];
    switch (dtype) {
      case DType::kF32:
        out.mutable_values<float>()[i] = static_cast<float>(v);
        break;
      case DType::kF64:
        out.mutable_values<double>()[i] = static_cast<double>(v);
        break;
      case DType::kI32:
        out.mutable_values<int32_t>()[i] = static_cast<int32_t>(v);
        break;
      case DType::kI64:
        out.mutable_values<int64_t>()[i] = v;
        break;
      case DType::kBool:
        out.mutable_values<bool>()[i] = v > 0;
        break;
      case DType::kU32:
        out.mutable_values<uint32_t>()[i] = static_cast<uint32_t>(v);
        break;
      case DType::kBF16:
        out.mutable_values<BFloat16>()[i] = BFloat16(v);
        break;
      case DType::kF16:
        out.mutable_values<Float16>()[i] = Float16(v);
        break;
      case DType::kU8:
        out.mutable_values<uint8_t>()[i] = static_cast<uint8_t>(v);
        break;
      case DType::kI8:
        out.mutable_values<int8_t>()[i] = static_cast<int8_t>(v);
        break;
      case DType::kI16:
        out.mutable_values<int16_t>()[i] = static_cast<int16_t>(v);
        break;
    }
  }
  return out;
}

// Replaces zeros (integer divisors) by 3.
void avoid_zeros(HostArray* a) {
  for (int64_t i = 0; i < a->size(); ++i) {
    if (a->element_as_double(i) != 0) continue;
    if (a->dtype() == DType::kI32) a->mutable_values<int32_t>()[i] = 3;
    if (a->dtype() == DType::kI64) a->mutable_values<int64_t>()[i] = 3;
    if (a->dtype() == DType::kF32) a->mutable_values<float>()[i] = 3;
    if (a->dtype() == DType::kF64) a->mutable_values<double>()[i] = 3;
  }
}

// ---- Expected values and comparison ----------------------------------------------------------

struct Expected {
  DType dtype = DType::kF32;
  Shape shape;
  std::vector<double> values;
  std::vector<double> scale;  // per element; empty means |value|
};

double tolerance(DType dtype) {
  if (dtype == DType::kF32) return 1e-5;
  if (dtype == DType::kF64) return 1e-12;
  return 0;
}

void expect_matches(const HostArray& got, const Expected& want) {
  ASSERT_EQ(type_to_string(got.dtype(), got.shape()), type_to_string(want.dtype, want.shape));
  ASSERT_EQ(static_cast<size_t>(got.size()), want.values.size());
  const double tol = tolerance(want.dtype);
  int failures = 0;
  for (int64_t i = 0; i < got.size(); ++i) {
    const double g = got.element_as_double(i);
    const double w = want.values[static_cast<size_t>(i)];
    bool ok;
    if (std::isnan(w)) {
      ok = std::isnan(g);
    } else if (tol == 0 || std::isinf(w)) {
      ok = g == w;
    } else {
      const double scale = want.scale.empty() ? std::abs(w) : want.scale[static_cast<size_t>(i)];
      ok = std::abs(g - w) <= tol * scale;
    }
    if (!ok && ++failures <= 5) {
      ADD_FAILURE() << "element " << i << " [" << absl::StrJoin(unravel(i, want.shape), ",") << "] is " << g
                    << ", want " << w;
    }
  }
  EXPECT_EQ(failures, 0) << "elements differ from the reference";
}

// The value a kernel should produce for `v` stored in `dtype`: rounding for float32, truncation
// and saturation for integers (NaN -> 0), "nonzero" for bool.
double as_dtype(double v, DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<float>(v);
    case DType::kF64:
      return v;
    case DType::kI32:
    case DType::kI64: {
      if (std::isnan(v)) return 0;
      const double lo = dtype == DType::kI32 ? -2147483648.0 : -9223372036854775808.0;
      const double hi = dtype == DType::kI32 ? 2147483647.0 : 9223372036854775807.0;
      return std::clamp(std::trunc(v), lo, hi);
    }
    case DType::kBool:
      return v != 0;
    case DType::kU32:
      return std::isnan(v) ? 0 : std::clamp(std::trunc(v), 0.0, 4294967295.0);
    case DType::kBF16:
      return static_cast<double>(BFloat16(v));
    case DType::kF16:
      return static_cast<double>(Float16(v));
    case DType::kU8:
      return std::isnan(v) ? 0 : std::clamp(std::trunc(v), 0.0, 255.0);
    case DType::kI8:
      return std::isnan(v) ? 0 : std::clamp(std::trunc(v), -128.0, 127.0);
    case DType::kI16:
      return std::isnan(v) ? 0 : std::clamp(std::trunc(v), -32768.0, 32767.0);
  }
  return v;
}

Expected elementwise(DType dtype, const HostArray& x, const std::function<double(double)>& f) {
  Expected e{dtype, x.shape(), {}, {}};
  for (int64_t i = 0; i < x.size(); ++i) e.values.push_back(f(x.element_as_double(i)));
  return e;
}

Expected elementwise(DType dtype, const HostArray& x, const HostArray& y,
                     const std::function<double(double, double)>& f) {
  Expected e{dtype, x.shape(), {}, {}};
  for (int64_t i = 0; i < x.size(); ++i) e.values.push_back(f(x.element_as_double(i), y.element_as_double(i)));
  return e;
}

// ---- Running nodes ---------------------------------------------------------------------------

// The node `id` names, or (after reporting why) a parameter node, which no kernel computes.
Node node_of(const Graph& g, const absl::StatusOr<int>& id) {
  if (!id.ok()) {
    ADD_FAILURE() << "building the node failed: " << id.status();
    return Node{};
  }
  return g.node(*id);
}

// run_kernel; for an elementwise node, also run_kernel_in_place over each operand that can
// take the result (on a copy), which must give the same bytes as the fresh result.
HostArray run(const Node& node, const std::vector<const HostArray*>& operands) {
  absl::StatusOr<HostArray> out = run_kernel(node, operands);
  if (!out.ok()) {
    ADD_FAILURE() << out.status();
    return HostArray();
  }
  for (size_t j = 0; j < operands.size(); ++j) {
    if (!can_run_in_place(node, *operands[j])) continue;
    const HostArray copy = operands[j]->clone();
    std::vector<const HostArray*> with_copy = operands;
    for (const HostArray*& o : with_copy) {
      if (o == operands[j]) o = &copy;  // x * x: every use of the operand reads the copy
    }
    absl::Status in_place = run_kernel_in_place(node, with_copy, static_cast<int>(j));
    EXPECT_TRUE(in_place.ok()) << in_place;
    EXPECT_TRUE(copy == *out) << op_name(node.op) << " in place over operand " << j << " differs";
  }
  return std::move(out).value();
}

std::string trace(Op op, DType dtype, const Shape& shape) {
  return absl::StrCat(op_name(op), " on ", type_to_string(dtype, shape));
}

// ---- Constant, iota ---------------------------------------------------------------------------

TEST(Kernels, ConstantOfEveryDtype) {
  for (DType dtype : kSweptDTypes) {
    for (const Shape& shape : kShapes) {
      for (double value : {2.75, -1.5, 0.0, 7.0}) {
        SCOPED_TRACE(absl::StrCat(trace(Op::kConstant, dtype, shape), " value ", value));
        Graph g;
        const Node node = node_of(g, g.add_constant(dtype, shape, value));
        Expected want{
            dtype, shape, std::vector<double>(static_cast<size_t>(num_elements(shape)), as_dtype(value, dtype)), {}};
        expect_matches(run(node, {}), want);
      }
    }
  }
}

TEST(Kernels, IotaAlongEachDimension) {
  const std::vector<Shape> shapes = {{5}, {2, 3, 4}, {3, 0, 2}, {1, 6}};
  for (DType dtype : kNumeric) {
    for (const Shape& shape : shapes) {
      for (int64_t axis = 0; axis < static_cast<int64_t>(shape.size()); ++axis) {
        SCOPED_TRACE(absl::StrCat(trace(Op::kIota, dtype, shape), " axis ", axis));
        Graph g;
        const Node node = node_of(g, g.add_iota(dtype, shape, axis));
        Expected want{dtype, shape, {}, {}};
        for (int64_t i = 0; i < num_elements(shape); ++i) {
          want.values.push_back(static_cast<double>(unravel(i, shape)[static_cast<size_t>(axis)]));
        }
        expect_matches(run(node, {}), want);
      }
    }
  }
}

// ---- Unary -----------------------------------------------------------------------------------

struct UnaryCase {
  Op op;
  std::function<double(double)> reference;
  bool positive_inputs = false;
};

TEST(Kernels, UnaryFloatOps) {
  const std::vector<UnaryCase> cases = {
      {Op::kNeg, [](double v) { return -v; }},
      {Op::kAbs, [](double v) { return std::abs(v); }},
      {Op::kExp, [](double v) { return std::exp(v); }},
      {Op::kLog, [](double v) { return std::log(v); }, true},
      {Op::kTanh, [](double v) { return std::tanh(v); }},
      {Op::kLogistic, [](double v) { return 1 / (1 + std::exp(-v)); }},
      {Op::kSqrt, [](double v) { return std::sqrt(v); }, true},
      {Op::kRsqrt, [](double v) { return 1 / std::sqrt(v); }, true},
      {Op::kSin, [](double v) { return std::sin(v); }},
      {Op::kCos, [](double v) { return std::cos(v); }},
      {Op::kErf, [](double v) { return std::erf(v); }},
      {Op::kFloor, [](double v) { return std::floor(v); }},
      {Op::kCeil, [](double v) { return std::ceil(v); }},
      {Op::kSign, [](double v) { return v > 0   ? 1.0
                                        : v < 0 ? -1.0
                                                : v; }},
  };
  std::mt19937 rng(1);
  for (const UnaryCase& c : cases) {
    for (DType dtype : kFloats) {
      for (const Shape& shape : kShapes) {
        SCOPED_TRACE(trace(c.op, dtype, shape));
        Graph g;
        const Node node = node_of(g, g.add_unary(c.op, g.add_parameter(dtype, shape)));
        const HostArray x =
            c.positive_inputs ? random_array(dtype, shape, rng, 0.05, 5) : random_array(dtype, shape, rng);
        expect_matches(run(node, {&x}), elementwise(dtype, x, c.reference));
      }
    }
  }
}

// float32 exp and tanh run vectorized polynomials (worker/kernels/vector_math.cc), not the C
// library: over a sweep of the whole float range (every 9973rd bit pattern, both signs, the
// subnormals, the overflow and underflow edges) and the special values, each element within 2
// ulps (exp; 3 for tanh) of the double-precision result rounded to float32, subnormal results
// within one subnormal step; on lengths around the vector widths (the loops' tails), in place
// too (run).
bool ulp_distance_ok(float got, double want_double, int ulps) {
  const float want = static_cast<float>(want_double);
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want) || want == 0) return got == want || std::abs(got) <= std::numeric_limits<float>::denorm_min();
  if (std::abs(want) < std::numeric_limits<float>::min()) {
    return std::abs(got - want) <= std::numeric_limits<float>::denorm_min();
  }
  if (std::signbit(got) != std::signbit(want)) return false;
  int32_t a = 0, b = 0;
  std::memcpy(&a, &got, sizeof(a));
  std::memcpy(&b, &want, sizeof(b));
  return std::abs(static_cast<int64_t>(a) - b) <= ulps;
}

TEST(Kernels, Float32ExpAndTanhWithinUlpsOverTheWholeRange) {
  std::vector<float> xs = {0.0f,
                           -0.0f,
                           1.0f,
                           -1.0f,
                           0.625f,
                           -0.625f,
                           0.6249f,
                           88.72f,
                           88.73f,
                           -87.33f,
                           -103.9f,
                           -104.f,
                           -105.f,
                           -200.0f,
                           1e-30f,
                           -1e-30f,
                           20.0f,
                           -20.0f,
                           9.0f,
                           -9.0f,
                           std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::quiet_NaN(),
                           std::numeric_limits<float>::denorm_min()};
  for (uint64_t bits = 0; bits <= 0xFFFFFFFFull; bits += 9973) {
    const auto b = static_cast<uint32_t>(bits);
    float f = 0;
    std::memcpy(&f, &b, sizeof(f));
    xs.push_back(f);
  }
  struct Case {
    Op op;
    double (*reference)(double);
    int ulps;
  };
  for (const Case& c : {Case{Op::kExp, [](double v) { return std::exp(v); }, 2},
                        Case{Op::kTanh, [](double v) { return std::tanh(v); }, 3}}) {
    for (const size_t n : {xs.size(), size_t{1}, size_t{15}, size_t{16}, size_t{17}, size_t{33}}) {
      SCOPED_TRACE(absl::StrCat(op_name(c.op), " of ", n, " elements"));
      const int64_t len = static_cast<int64_t>(n);
      Graph g;
      const Node node = node_of(g, g.add_unary(c.op, g.add_parameter(DType::kF32, {len})));
      const HostArray x = HostArray::from_vector<float>({len}, std::vector<float>(xs.end() - len, xs.end()));
      const HostArray out = run(node, {&x});
      int failures = 0;
      for (int64_t i = 0; i < len; ++i) {
        const float v = x.values<float>()[i];
        const float got = out.values<float>()[i];
        if (!ulp_distance_ok(got, c.reference(v), c.ulps) && ++failures <= 5) {
          ADD_FAILURE() << op_name(c.op) << "(" << v << ") = " << got << ", want " << c.reference(v);
        }
      }
      EXPECT_EQ(failures, 0);
    }
  }
  // The signs of zero and the infinities exactly, as the C library.
  Graph g;
  const Node tanh = node_of(g, g.add_unary(Op::kTanh, g.add_parameter(DType::kF32, {3})));
  const float inf = std::numeric_limits<float>::infinity();
  const HostArray special = HostArray::from_vector<float>({3}, {-0.0f, inf, -inf});
  const HostArray out = run(tanh, {&special});
  EXPECT_TRUE(std::signbit(out.values<float>()[0]) && out.values<float>()[0] == 0);
  EXPECT_EQ(out.values<float>()[1], 1.0f);
  EXPECT_EQ(out.values<float>()[2], -1.0f);
}

// erf against tabulated values (Abramowitz and Stegun, Table 7.1), not the C library the kernel
// calls; lax.erf is defined on floats only, so integers are refused by the type rule.
TEST(Kernels, ErfMatchesTabulatedValues) {
  const std::vector<double> x = {0.0, 0.1, 0.5, 1.0, 1.5, 2.0, -0.5, -1.0, -2.0};
  const std::vector<double> want = {0.0,          0.1124629160,  0.5204998778,  0.8427007929, 0.9661051465,
                                    0.9953222650, -0.5204998778, -0.8427007929, -0.9953222650};
  for (DType dtype : kFloats) {
    SCOPED_TRACE(dtype_name(dtype));
    Graph g;
    const Node node = node_of(g, g.add_unary(Op::kErf, g.add_parameter(dtype, {9})));
    const HostArray typed = dtype == DType::kF64
                                ? HostArray::from_vector<double>({9}, x)
                                : HostArray::from_vector<float>({9}, std::vector<float>(x.begin(), x.end()));
    const HostArray out = run(node, {&typed});
    for (size_t i = 0; i < x.size(); ++i) {
      const double got = dtype == DType::kF32 ? out.values<float>()[i] : out.values<double>()[i];
      EXPECT_NEAR(got, want[i], dtype == DType::kF32 ? 1e-6 : 1e-9) << "erf(" << x[i] << ")";
    }
  }
  Graph g;
  EXPECT_EQ(g.add_unary(Op::kErf, g.add_parameter(DType::kI32, {2})).status(),
            absl::InvalidArgumentError(
                "erf: operand is i32[2]; it needs float32, float64, bfloat16 or float16 (convert first)"));
}

TEST(Kernels, UnaryIntegerAndBoolOps) {
  const std::vector<UnaryCase> cases = {
      {Op::kNeg, [](double v) { return -v; }},
      {Op::kAbs, [](double v) { return std::abs(v); }},
      {Op::kSign, [](double v) { return v > 0   ? 1.0
                                        : v < 0 ? -1.0
                                                : 0.0; }},
      {Op::kNot, [](double v) { return -v - 1; }},  // bitwise: ~v == -v - 1 in two's complement
  };
  std::mt19937 rng(2);
  for (const UnaryCase& c : cases) {
    for (DType dtype : kIntegers) {
      for (const Shape& shape : kShapes) {
        SCOPED_TRACE(trace(c.op, dtype, shape));
        Graph g;
        const Node node = node_of(g, g.add_unary(c.op, g.add_parameter(dtype, shape)));
        const HostArray x = random_array(dtype, shape, rng, -9, 9);
        expect_matches(run(node, {&x}), elementwise(dtype, x, c.reference));
      }
    }
  }
  for (const Shape& shape : kShapes) {
    SCOPED_TRACE(trace(Op::kNot, DType::kBool, shape));
    Graph g;
    const Node node = node_of(g, g.add_unary(Op::kNot, g.add_parameter(DType::kBool, shape)));
    const HostArray x = random_array(DType::kBool, shape, rng);
    expect_matches(run(node, {&x}), elementwise(DType::kBool, x, [](double v) { return 1 - v; }));
  }
}

TEST(Kernels, UnaryEdgeValues) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const HostArray x = HostArray::from_vector<float>({5}, {0.0f, -0.0f, inf, -inf, nan});
  auto apply = [&](Op op) {
    Graph g;
    return run(node_of(g, g.add_unary(op, g.add_parameter(DType::kF32, {5}))), {&x});
  };
  const HostArray sign = apply(Op::kSign);
  EXPECT_EQ(sign.values<float>()[0], 0.0f);
  EXPECT_TRUE(std::signbit(sign.values<float>()[1]));  // sign(-0.0) == -0.0
  EXPECT_EQ(sign.values<float>()[2], 1.0f);
  EXPECT_EQ(sign.values<float>()[3], -1.0f);
  EXPECT_TRUE(std::isnan(sign.values<float>()[4]));
  const HostArray logistic = apply(Op::kLogistic);
  EXPECT_EQ(logistic.values<float>()[2], 1.0f);
  EXPECT_EQ(logistic.values<float>()[3], 0.0f);

  // Integer negation and abs of the most negative value wrap (no UB).
  const HostArray m = HostArray::from_vector<int32_t>({2}, {std::numeric_limits<int32_t>::min(), -7});
  Graph g;
  const int p = g.add_parameter(DType::kI32, {2});
  EXPECT_EQ(run(node_of(g, g.add_unary(Op::kNeg, p)), {&m}),
            HostArray::from_vector<int32_t>({2}, {std::numeric_limits<int32_t>::min(), 7}));
  EXPECT_EQ(run(node_of(g, g.add_unary(Op::kAbs, p)), {&m}),
            HostArray::from_vector<int32_t>({2}, {std::numeric_limits<int32_t>::min(), 7}));
  EXPECT_EQ(run(node_of(g, g.add_unary(Op::kNot, p)), {&m}),
            HostArray::from_vector<int32_t>({2}, {std::numeric_limits<int32_t>::max(), 6}));
}

// ---- Binary ----------------------------------------------------------------------------------

struct BinaryCase {
  Op op;
  std::vector<DType> dtypes;
  std::function<double(double, double)> reference;
};

int64_t as_int(double v) { return static_cast<int64_t>(v); }

TEST(Kernels, BinaryOps) {
  const std::vector<DType> numeric(std::begin(kNumeric), std::end(kNumeric));
  const std::vector<BinaryCase> cases = {
      {Op::kAdd, numeric, [](double a, double b) { return a + b; }},
      {Op::kSub, numeric, [](double a, double b) { return a - b; }},
      {Op::kMul, numeric, [](double a, double b) { return a * b; }},
      {Op::kDiv, {DType::kF32, DType::kF64}, [](double a, double b) { return a / b; }},
      {Op::kDiv, {DType::kI32, DType::kI64}, [](double a, double b) { return std::trunc(a / b); }},
      {Op::kPow, numeric, [](double a, double b) { return std::pow(a, b); }},
      {Op::kRem, numeric, [](double a, double b) { return std::fmod(a, b); }},
      {Op::kMax,
       {DType::kF32, DType::kF64, DType::kI32, DType::kI64, DType::kBool},
       [](double a, double b) { return std::max(a, b); }},
      {Op::kMin,
       {DType::kF32, DType::kF64, DType::kI32, DType::kI64, DType::kBool},
       [](double a, double b) { return std::min(a, b); }},
      {Op::kAnd, {DType::kI32, DType::kI64}, [](double a, double b) { return as_int(a) & as_int(b); }},
      {Op::kOr, {DType::kI32, DType::kI64}, [](double a, double b) { return as_int(a) | as_int(b); }},
      {Op::kAnd, {DType::kBool}, [](double a, double b) { return a != 0 && b != 0; }},
      {Op::kOr, {DType::kBool}, [](double a, double b) { return a != 0 || b != 0; }},
  };
  std::mt19937 rng(3);
  for (const BinaryCase& c : cases) {
    for (DType dtype : c.dtypes) {
      for (const Shape& shape : kShapes) {
        SCOPED_TRACE(trace(c.op, dtype, shape));
        Graph g;
        const Node node = node_of(g, g.add_binary(c.op, g.add_parameter(dtype, shape), g.add_parameter(dtype, shape)));
        HostArray x = random_array(dtype, shape, rng, -9, 9);
        HostArray y = random_array(dtype, shape, rng, -9, 9);
        if (c.op == Op::kDiv || c.op == Op::kRem) avoid_zeros(&y);
        if (c.op == Op::kPow) {  // positive bases for floats; exponents the integers can take exactly
          x = is_floating(dtype) ? random_array(dtype, shape, rng, 0.1, 3) : random_array(dtype, shape, rng, -5, 5);
          y = is_floating(dtype) ? random_array(dtype, shape, rng, -2, 2) : random_array(dtype, shape, rng, 0, 4);
        }
        expect_matches(run(node, {&x, &y}), elementwise(dtype, x, y, c.reference));
      }
    }
  }
}

TEST(Kernels, IntegerArithmeticWrapsAndDivisionFollowsXla) {
  using L = std::numeric_limits<int32_t>;
  const HostArray x = HostArray::from_vector<int32_t>({6}, {L::max(), L::min(), L::min(), 7, -7, 5});
  const HostArray y = HostArray::from_vector<int32_t>({6}, {1, 1, -1, 0, 2, -2});
  Graph g;
  const int a = g.add_parameter(DType::kI32, {6}), b = g.add_parameter(DType::kI32, {6});
  auto apply = [&](Op op) { return run(node_of(g, g.add_binary(op, a, b)), {&x, &y}); };
  EXPECT_EQ(apply(Op::kAdd), HostArray::from_vector<int32_t>({6}, {L::min(), L::min() + 1, L::max(), 7, -5, 3}));
  EXPECT_EQ(apply(Op::kSub), HostArray::from_vector<int32_t>({6}, {L::max() - 1, L::max(), L::min() + 1, 7, -9, 7}));
  EXPECT_EQ(apply(Op::kMul), HostArray::from_vector<int32_t>({6}, {L::max(), L::min(), L::min(), 0, -14, -10}));
  // x / 0 == -1, INT_MIN / -1 == INT_MIN, truncation toward zero.
  EXPECT_EQ(apply(Op::kDiv), HostArray::from_vector<int32_t>({6}, {L::max(), L::min(), L::min(), -1, -3, -2}));
  // rem takes the dividend's sign; x % 0 == x and INT_MIN % -1 == 0, as XLA's integer remainder.
  EXPECT_EQ(apply(Op::kRem), HostArray::from_vector<int32_t>({6}, {0, 0, 0, 7, -1, 1}));

  // pow: wraps; a negative exponent gives 1 for base 1, else 0.
  const HostArray base = HostArray::from_vector<int64_t>({5}, {2, 3, 1, -1, 2});
  const HostArray exponent = HostArray::from_vector<int64_t>({5}, {64, 3, -2, -1, -1});
  Graph h;
  const Node pow =
      node_of(h, h.add_binary(Op::kPow, h.add_parameter(DType::kI64, {5}), h.add_parameter(DType::kI64, {5})));
  EXPECT_EQ(run(pow, {&base, &exponent}), HostArray::from_vector<int64_t>({5}, {0, 27, 1, 0, 0}));
}

TEST(Kernels, FloatMaxMinPropagateNan) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const HostArray x = HostArray::from_vector<float>({3}, {nan, 1.0f, 2.0f});
  const HostArray y = HostArray::from_vector<float>({3}, {1.0f, nan, 3.0f});
  Graph g;
  const int a = g.add_parameter(DType::kF32, {3}), b = g.add_parameter(DType::kF32, {3});
  for (Op op : {Op::kMax, Op::kMin}) {
    SCOPED_TRACE(op_name(op));
    const HostArray out = run(node_of(g, g.add_binary(op, a, b)), {&x, &y});
    EXPECT_TRUE(std::isnan(out.values<float>()[0]));
    EXPECT_TRUE(std::isnan(out.values<float>()[1]));
    EXPECT_EQ(out.values<float>()[2], op == Op::kMax ? 3.0f : 2.0f);
  }
}

TEST(Kernels, Comparisons) {
  const std::vector<std::pair<Op, std::function<double(double, double)>>> cases = {
      {Op::kEq, [](double a, double b) { return a == b; }}, {Op::kNe, [](double a, double b) { return a != b; }},
      {Op::kLt, [](double a, double b) { return a < b; }},  {Op::kLe, [](double a, double b) { return a <= b; }},
      {Op::kGt, [](double a, double b) { return a > b; }},  {Op::kGe, [](double a, double b) { return a >= b; }},
  };
  std::mt19937 rng(4);
  for (const auto& [op, reference] : cases) {
    for (DType dtype : kSweptDTypes) {
      for (const Shape& shape : kShapes) {
        SCOPED_TRACE(trace(op, dtype, shape));
        Graph g;
        const Node node = node_of(g, g.add_binary(op, g.add_parameter(dtype, shape), g.add_parameter(dtype, shape)));
        const HostArray x = small_integers(dtype, shape, rng);
        const HostArray y = small_integers(dtype, shape, rng);
        expect_matches(run(node, {&x, &y}), elementwise(DType::kBool, x, y, reference));
      }
    }
  }
}

TEST(Kernels, Select) {
  std::mt19937 rng(5);
  for (DType dtype : kSweptDTypes) {
    for (const Shape& shape : kShapes) {
      SCOPED_TRACE(trace(Op::kSelect, dtype, shape));
      Graph g;
      const int p = g.add_parameter(DType::kBool, shape);
      const Node node = node_of(g, g.add_select(p, g.add_parameter(dtype, shape), g.add_parameter(dtype, shape)));
      const HostArray pred = random_array(DType::kBool, shape, rng);
      const HostArray t = random_array(dtype, shape, rng), f = random_array(dtype, shape, rng);
      Expected want{dtype, shape, {}, {}};
      for (int64_t i = 0; i < pred.size(); ++i) {
        want.values.push_back(pred.element_as_double(i) != 0 ? t.element_as_double(i) : f.element_as_double(i));
      }
      expect_matches(run(node, {&pred, &t, &f}), want);
    }
  }
}

// A plan's elementwise kernel may read an operand broadcast on the fly (core/op.cc's
// infer_type; coordinator/compiler/passes/broadcast_operands.cc): a rank-0 one, or one of the
// result's rank with size 1 along the dimensions it repeats (XLA's degenerate dimensions).
// Against the element the materialised broadcast would hold there, indexed by hand: size-1
// dimensions and rank 0 read index 0. Both operand orders, each dtype family, and select with
// each operand repeated.
double broadcast_element(const HostArray& x, const Shape& result, int64_t flat) {
  if (x.shape().empty()) return x.element_as_double(0);
  int64_t at = 0, stride = 1, rest = flat;
  for (size_t d = result.size(); d-- > 0;) {
    const int64_t i = rest % result[d];
    rest /= result[d];
    if (x.shape()[d] != 1) at += i * stride;
    stride *= x.shape()[d];
  }
  return x.element_as_double(at);
}

Node elementwise_node(Op op, DType dtype, const Shape& shape, int operands) {
  Node n;
  n.op = op;
  n.dtype = dtype;
  n.shape = shape;
  for (int k = 0; k < operands; ++k) n.operands.push_back(k);
  return n;
}

TEST(Kernels, OperandsBroadcastOnTheFly) {
  const Shape full = {3, 4, 5};
  const std::vector<Shape> repeated = {{}, {1, 1, 1}, {3, 4, 1}, {1, 4, 5}, {3, 1, 5}, {1, 1, 5}, {3, 1, 1}, {1, 4, 1}};
  const std::vector<BinaryCase> cases = {
      {Op::kAdd, {DType::kF32, DType::kI32}, [](double a, double b) { return a + b; }},
      {Op::kSub, {DType::kF64, DType::kI64}, [](double a, double b) { return a - b; }},
      {Op::kMax,
       {DType::kF32, DType::kBool, DType::kBF16},
       [](double a, double b) { return std::max(a, b); }},  // bf16: widened
      {Op::kLt, {DType::kF32, DType::kI32}, [](double a, double b) { return a < b ? 1.0 : 0.0; }},
  };
  std::mt19937 rng(31);
  for (const BinaryCase& c : cases) {
    for (DType dtype : c.dtypes) {
      const DType out = has_trait(c.op, kComparison) ? DType::kBool : dtype;
      const Node node = elementwise_node(c.op, out, full, 2);
      for (const Shape& shape : repeated) {
        for (bool repeated_first : {false, true}) {
          SCOPED_TRACE(absl::StrCat(trace(c.op, dtype, full), " with ", type_to_string(dtype, shape),
                                    repeated_first ? " first" : " second"));
          const HostArray big = random_array(dtype, full, rng, -9, 9), small = random_array(dtype, shape, rng, -9, 9);
          const HostArray& x = repeated_first ? small : big;
          const HostArray& y = repeated_first ? big : small;
          Expected want{out, full, {}, {}};
          for (int64_t i = 0; i < num_elements(full); ++i) {
            want.values.push_back(c.reference(broadcast_element(x, full, i), broadcast_element(y, full, i)));
          }
          expect_matches(run(node, {&x, &y}), want);
        }
      }
    }
  }
  for (DType dtype : {DType::kF32, DType::kI64}) {
    const Node node = elementwise_node(Op::kSelect, dtype, full, 3);
    for (const Shape& shape : repeated) {
      for (int which = 0; which < 3; ++which) {
        SCOPED_TRACE(absl::StrCat("select of ", type_to_string(dtype, full), " with operand ", which, " ",
                                  type_to_string(which == 0 ? DType::kBool : dtype, shape)));
        const HostArray pred = random_array(DType::kBool, which == 0 ? shape : full, rng);
        const HostArray t = random_array(dtype, which == 1 ? shape : full, rng);
        const HostArray f = random_array(dtype, which == 2 ? shape : full, rng);
        Expected want{dtype, full, {}, {}};
        for (int64_t i = 0; i < num_elements(full); ++i) {
          want.values.push_back(broadcast_element(pred, full, i) != 0 ? broadcast_element(t, full, i)
                                                                      : broadcast_element(f, full, i));
        }
        expect_matches(run(node, {&pred, &t, &f}), want);
      }
    }
  }
}

// What does not broadcast so is refused with the rule's message on the operands as given, and a
// graph never holds a broadcasting node (it broadcasts with broadcast_in_dim).
TEST(KernelErrors, OperandsThatDoNotBroadcast) {
  const Node add = elementwise_node(Op::kAdd, DType::kF32, {3, 4}, 2);
  const HostArray x = HostArray::zeros(DType::kF32, {3, 4});
  const HostArray rows = HostArray::zeros(DType::kF32, {2, 4}), vector = HostArray::zeros(DType::kF32, {4});
  const HostArray i32 = HostArray::zeros(DType::kI32, {});
  EXPECT_EQ(run_kernel(add, {&x, &rows}).status(),
            absl::InvalidArgumentError("add: operands f32[3,4] and f32[2,4] differ"));
  EXPECT_EQ(run_kernel(add, {&x, &vector}).status(),
            absl::InvalidArgumentError("add: operands f32[3,4] and f32[4] differ"));
  EXPECT_EQ(run_kernel(add, {&x, &i32}).status(),
            absl::InvalidArgumentError("add: operands f32[3,4] and i32[] differ"));
  const HostArray column = HostArray::zeros(DType::kF32, {3, 1});
  EXPECT_EQ(
      run_kernel(elementwise_node(Op::kAdd, DType::kF32, {3, 5}, 2), {&x, &column}).status(),
      absl::InvalidArgumentError("add: the operands (f32[3,4], f32[3,1]) give f32[3,4] but the node is f32[3,5]"));
  Graph g;
  EXPECT_EQ(g.add_binary(Op::kAdd, g.add_parameter(DType::kF32, {3, 4}), g.add_parameter(DType::kF32, {})).status(),
            absl::InvalidArgumentError("add: operands f32[3,4], f32[] differ in shape (broadcast_in_dim first)"));
  EXPECT_EQ(g.add_select(g.add_parameter(DType::kBool, {3, 1}), g.add_parameter(DType::kF32, {3, 4}),
                         g.add_parameter(DType::kF32, {3, 4}))
                .status(),
            absl::InvalidArgumentError(
                "select: operands bool[3,1], f32[3,4], f32[3,4] differ in shape (broadcast_in_dim first)"));
}

// ---- Convert ---------------------------------------------------------------------------------

TEST(Kernels, ConvertBetweenEveryPairOfDtypes) {
  std::mt19937 rng(6);
  for (DType from : kSweptDTypes) {
    for (DType to : kSweptDTypes) {
      for (const Shape& shape : kShapes) {
        SCOPED_TRACE(absl::StrCat("convert ", type_to_string(from, shape), " to ", dtype_name(to)));
        Graph g;
        const Node node = node_of(g, g.add_convert(g.add_parameter(from, shape), to));
        const HostArray x = random_array(from, shape, rng, -5, 5);
        expect_matches(run(node, {&x}), elementwise(to, x, [to](double v) { return as_dtype(v, to); }));
      }
    }
  }
}

TEST(Kernels, ConvertSaturatesAndMapsNanToZero) {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  const HostArray x = HostArray::from_vector<double>({8}, {1e10, -1e10, nan, inf, -inf, 2.9, -2.9, -0.0});
  for (DType to : {DType::kI32, DType::kI64, DType::kBool, DType::kF32}) {
    SCOPED_TRACE(dtype_name(to));
    Graph g;
    const Node node = node_of(g, g.add_convert(g.add_parameter(DType::kF64, {8}), to));
    expect_matches(run(node, {&x}), elementwise(to, x, [to](double v) { return as_dtype(v, to); }));
  }
  // NaN is nonzero, so true; -0.0 is zero.
  Graph g;
  const HostArray b = run(node_of(g, g.add_convert(g.add_parameter(DType::kF64, {8}), DType::kBool)), {&x});
  EXPECT_EQ(b, HostArray::from_vector<bool>({8}, {true, true, true, true, true, true, true, false}));
  // Narrowing integers wrap.
  const HostArray wide = HostArray::from_vector<int64_t>({2}, {(int64_t{1} << 32) + 5, -1});
  Graph h;
  const HostArray narrow = run(node_of(h, h.add_convert(h.add_parameter(DType::kI64, {2}), DType::kI32)), {&wide});
  EXPECT_EQ(narrow, HostArray::from_vector<int32_t>({2}, {5, -1}));
}

// ---- Layout ----------------------------------------------------------------------------------

TEST(Kernels, BroadcastInDim) {
  struct Case {
    Shape from, to;
    std::vector<int64_t> dims;
  };
  const std::vector<Case> cases = {
      {{3}, {2, 3}, {1}},
      {{3, 1}, {3, 4}, {0, 1}},
      {{}, {2, 3}, {}},
      {{1, 4}, {2, 3, 4}, {1, 2}},
      {{2, 1, 4}, {2, 3, 4}, {0, 1, 2}},
      {{4}, {4, 3, 2}, {0}},
      {{2}, {2, 0}, {0}},
      {{}, {}, {}},
      {{1}, {5}, {0}},
  };
  std::mt19937 rng(7);
  for (DType dtype : kSweptDTypes) {
    for (const Case& c : cases) {
      SCOPED_TRACE(absl::StrCat(trace(Op::kBroadcastInDim, dtype, c.from), " to ", shape_to_string(c.to)));
      Graph g;
      const Node node = node_of(g, g.add_broadcast_in_dim(g.add_parameter(dtype, c.from), c.to, c.dims));
      const HostArray x = random_array(dtype, c.from, rng);
      Expected want{dtype, c.to, {}, {}};
      std::vector<int64_t> from_index(c.from.size());
      for (int64_t i = 0; i < num_elements(c.to); ++i) {
        const std::vector<int64_t> to_index = unravel(i, c.to);
        for (size_t d = 0; d < c.from.size(); ++d) {
          from_index[d] = c.from[d] == 1 ? 0 : to_index[static_cast<size_t>(c.dims[d])];
        }
        want.values.push_back(x.element_as_double(ravel(from_index, c.from)));
      }
      expect_matches(run(node, {&x}), want);
    }
  }
}

TEST(Kernels, ReshapeKeepsRowMajorOrder) {
  const std::vector<std::pair<Shape, Shape>> cases = {
      {{2, 3, 4}, {6, 4}}, {{2, 3, 4}, {24}}, {{}, {1, 1}}, {{1}, {}}, {{0, 3}, {3, 0}}, {{6}, {2, 3}},
  };
  std::mt19937 rng(8);
  for (DType dtype : kSweptDTypes) {
    for (const auto& [from, to] : cases) {
      SCOPED_TRACE(absl::StrCat(trace(Op::kReshape, dtype, from), " to ", shape_to_string(to)));
      Graph g;
      const Node node = node_of(g, g.add_reshape(g.add_parameter(dtype, from), to));
      const HostArray x = random_array(dtype, from, rng);
      Expected want{dtype, to, {}, {}};
      for (int64_t i = 0; i < x.size(); ++i) want.values.push_back(x.element_as_double(i));
      const HostArray out = run(node, {&x});
      expect_matches(out, want);
      if (x.size() > 0) {
        EXPECT_NE(out.data(), x.data()) << "reshape returns a copy";
      }
    }
  }
}

TEST(Kernels, TransposeByEveryPermutation) {
  const std::vector<Shape> shapes = {{}, {4}, {2, 3}, {2, 3, 4}, {3, 0, 2}};
  std::mt19937 rng(9);
  for (DType dtype : kSweptDTypes) {
    for (const Shape& shape : shapes) {
      std::vector<int64_t> perm(shape.size());
      for (size_t i = 0; i < perm.size(); ++i) perm[i] = static_cast<int64_t>(i);
      do {
        SCOPED_TRACE(absl::StrCat(trace(Op::kTranspose, dtype, shape), " by {", absl::StrJoin(perm, ","), "}"));
        Graph g;
        const Node node = node_of(g, g.add_transpose(g.add_parameter(dtype, shape), perm));
        const HostArray x = random_array(dtype, shape, rng);
        Shape to(shape.size());
        for (size_t i = 0; i < perm.size(); ++i) to[i] = shape[static_cast<size_t>(perm[i])];
        Expected want{dtype, to, {}, {}};
        std::vector<int64_t> from_index(shape.size());
        for (int64_t i = 0; i < num_elements(to); ++i) {
          const std::vector<int64_t> to_index = unravel(i, to);
          for (size_t d = 0; d < perm.size(); ++d) from_index[static_cast<size_t>(perm[d])] = to_index[d];
          want.values.push_back(x.element_as_double(ravel(from_index, shape)));
        }
        expect_matches(run(node, {&x}), want);
      } while (std::next_permutation(perm.begin(), perm.end()));
    }
  }
}

// Strided cases as lax.slice's (jax/_src/lax/slicing.py, _slice_shape_rule: a dimension of
// core.stride_dim, the indices start, start + stride, ... below limit). A stride past the
// dimension keeps one element: x[::2**62] and a stride of INT64_MAX (from the wire) used to
// overflow the size rule (which gave 0) and the kernel's step.
TEST(Kernels, Slice) {
  struct Case {
    Shape shape;
    std::vector<int64_t> start, limit, strides;
  };
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  const std::vector<Case> cases = {
      {{5}, {1}, {4}, {}},
      {{2, 3, 4}, {0, 1, 1}, {2, 3, 3}, {}},
      {{}, {}, {}, {}},
      {{3, 4}, {3, 0}, {3, 4}, {}},
      {{4, 5}, {1, 0}, {3, 5}, {}},
      {{2, 3, 4}, {0, 0, 0}, {2, 3, 4}, {}},
      {{2, 3, 4}, {1, 2, 3}, {2, 3, 4}, {}},
      {{7, 5}, {1, 0}, {7, 5}, {3, 2}},
      {{3, 8}, {0, 1}, {3, 8}, {1, 2}},
      {{16, 16}, {0, 0}, {16, 16}, {int64_t{1} << 62, 4}},
      {{16, 16}, {3, 0}, {16, 16}, {kMax, kMax}},
      {{4, 4}, {2, 0}, {2, 4}, {kMax, 1}},
  };
  std::mt19937 rng(10);
  for (DType dtype : kSweptDTypes) {
    for (const Case& c : cases) {
      SCOPED_TRACE(absl::StrCat(trace(Op::kSlice, dtype, c.shape), " from {", absl::StrJoin(c.start, ","), "} to {",
                                absl::StrJoin(c.limit, ","), "} by {", absl::StrJoin(c.strides, ","), "}"));
      auto stride = [&](size_t d) { return c.strides.empty() ? 1 : c.strides[d]; };
      Graph g;
      const Node node = node_of(g, g.add_slice(g.add_parameter(dtype, c.shape), c.start, c.limit, c.strides));
      const HostArray x = random_array(dtype, c.shape, rng);
      Shape to;
      for (size_t d = 0; d < c.shape.size(); ++d) {
        int64_t kept = 0;  // counted, not computed: start, start + stride, ... below limit
        for (int64_t i = c.start[d]; i < c.limit[d]; i += std::min(stride(d), c.limit[d])) ++kept;
        to.push_back(kept);
      }
      Expected want{dtype, to, {}, {}};
      std::vector<int64_t> from_index(c.shape.size());
      for (int64_t i = 0; i < num_elements(to); ++i) {
        const std::vector<int64_t> to_index = unravel(i, to);
        for (size_t d = 0; d < to.size(); ++d) from_index[d] = c.start[d] + to_index[d] * stride(d);
        want.values.push_back(x.element_as_double(ravel(from_index, c.shape)));
      }
      expect_matches(run(node, {&x}), want);
    }
  }
}

// lax.rev (jax/_src/lax/lax.py rev_p, XLA's Rev): element i of a reversed dimension of size n
// is the operand's n-1-i, checked against a host loop for rank 0, 1 and 3, one and several
// dimensions (given unsorted: the graph sorts them), none, and empty dimensions.
TEST(Kernels, RevMatchesAHostLoop) {
  struct Case {
    Shape shape;
    std::vector<int64_t> dims;
  };
  const std::vector<Case> cases = {
      {{}, {}},         {{7}, {0}},          {{7}, {}},           {{2, 3, 4}, {0}},
      {{2, 3, 4}, {1}}, {{2, 3, 4}, {2}},    {{2, 3, 4}, {2, 0}}, {{2, 3, 4}, {0, 1, 2}},
      {{3, 0, 2}, {1}}, {{3, 0, 2}, {0, 2}}, {{0}, {0}},          {{5, 1, 3}, {1, 2}},
  };
  std::mt19937 rng(11);
  for (DType dtype : kSweptDTypes) {
    for (const Case& c : cases) {
      SCOPED_TRACE(absl::StrCat(trace(Op::kRev, dtype, c.shape), " along {", absl::StrJoin(c.dims, ","), "}"));
      Graph g;
      const Node node = node_of(g, g.add_rev(g.add_parameter(dtype, c.shape), c.dims));
      const HostArray x = random_array(dtype, c.shape, rng);
      Expected want{dtype, c.shape, {}, {}};
      for (int64_t i = 0; i < num_elements(c.shape); ++i) {
        std::vector<int64_t> from = unravel(i, c.shape);
        for (int64_t d : c.dims) from[d] = c.shape[d] - 1 - from[d];
        want.values.push_back(x.element_as_double(ravel(from, c.shape)));
      }
      expect_matches(run(node, {&x}), want);
    }
  }
}

// _rev_shape_rule: "rev dimensions must be unique" and all less than the operand's rank.
TEST(Kernels, RevRefusesRepeatedOrOutOfRangeDimensions) {
  Graph g;
  const int x = g.add_parameter(DType::kF32, {2, 3});
  EXPECT_EQ(g.add_rev(x, {1, 1}).status(),
            absl::InvalidArgumentError("rev of f32[2,3] along {1,1}: axis 1 appears twice"));
  EXPECT_EQ(g.add_rev(x, {2}).status(),
            absl::InvalidArgumentError("rev of f32[2,3] along {2}: axis 2 is out of range for rank 2"));
  EXPECT_EQ(g.add_rev(x, {-1}).status(),
            absl::InvalidArgumentError("rev of f32[2,3] along {-1}: axis -1 is out of range for rank 2"));
}

TEST(Kernels, Concatenate) {
  struct Case {
    std::vector<Shape> shapes;
    int64_t axis;
  };
  const std::vector<Case> cases = {
      {{{2, 3}, {4, 3}}, 0},
      {{{2, 3}, {2, 1}, {2, 0}}, 1},
      {{{2, 3, 4}, {2, 2, 4}, {2, 1, 4}}, 1},
      {{{2, 3, 4}, {2, 3, 1}}, 2},
      {{{5}}, 0},
      {{{0, 3}, {2, 3}}, 0},
      {{{3, 0}, {3, 0}}, 0},
  };
  std::mt19937 rng(11);
  for (DType dtype : kSweptDTypes) {
    for (const Case& c : cases) {
      SCOPED_TRACE(absl::StrCat(trace(Op::kConcatenate, dtype, c.shapes[0]), "... along ", c.axis));
      Graph g;
      std::vector<int> params;
      std::vector<HostArray> xs;
      std::vector<const HostArray*> operands;
      for (const Shape& s : c.shapes) {
        params.push_back(g.add_parameter(dtype, s));
        xs.push_back(random_array(dtype, s, rng));
      }
      for (const HostArray& x : xs) operands.push_back(&x);
      const Node node = node_of(g, g.add_concatenate(params, c.axis));
      Shape to = c.shapes[0];
      to[static_cast<size_t>(c.axis)] = 0;
      for (const Shape& s : c.shapes) to[static_cast<size_t>(c.axis)] += s[static_cast<size_t>(c.axis)];
      Expected want{dtype, to, {}, {}};
      for (int64_t i = 0; i < num_elements(to); ++i) {
        std::vector<int64_t> index = unravel(i, to);
        int64_t& along = index[static_cast<size_t>(c.axis)];
        size_t k = 0;
        while (along >= c.shapes[k][static_cast<size_t>(c.axis)]) along -= c.shapes[k++][static_cast<size_t>(c.axis)];
        want.values.push_back(xs[k].element_as_double(ravel(index, c.shapes[k])));
      }
      expect_matches(run(node, operands), want);
    }
  }
}

TEST(Kernels, ShardingConstraintReturnsACopy) {
  absl::StatusOr<Mesh> mesh = make_mesh({2}, {"data"}, {0, 1});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  std::mt19937 rng(12);
  for (DType dtype : kSweptDTypes) {
    SCOPED_TRACE(dtype_name(dtype));
    Graph g;
    const Node node =
        node_of(g, g.add_sharding_constraint(g.add_parameter(dtype, {4, 3}), NamedSharding(*mesh, P("data"))));
    const HostArray x = random_array(dtype, {4, 3}, rng);
    const HostArray out = run(node, {&x});
    EXPECT_EQ(out, x);
    EXPECT_NE(out.data(), x.data());
  }
}

// ---- Reductions ------------------------------------------------------------------------------

// Reduces `x` over `axes` in double; the scale of a sum is the sum of its terms' magnitudes.
Expected reference_reduce(Op op, const HostArray& x, const std::vector<int64_t>& axes) {
  const bool is_bool = x.dtype() == DType::kBool;
  Shape kept;
  for (size_t d = 0; d < x.shape().size(); ++d) {
    if (std::find(axes.begin(), axes.end(), static_cast<int64_t>(d)) == axes.end()) kept.push_back(x.shape()[d]);
  }
  double init = 0;
  const double inf = std::numeric_limits<double>::infinity();
  switch (op) {
    case Op::kReduceSum:
      init = 0;
      break;
    case Op::kReduceProd:
      init = 1;
      break;
    case Op::kReduceMax:
      init = is_bool                    ? 0
             : is_floating(x.dtype())   ? -inf
             : x.dtype() == DType::kI32 ? std::numeric_limits<int32_t>::lowest()
                                        : static_cast<double>(std::numeric_limits<int64_t>::lowest());
      break;
    default:
      init = is_bool                    ? 1
             : is_floating(x.dtype())   ? inf
             : x.dtype() == DType::kI32 ? std::numeric_limits<int32_t>::max()
                                        : static_cast<double>(std::numeric_limits<int64_t>::max());
      break;
  }
  Expected e{x.dtype(), kept, std::vector<double>(static_cast<size_t>(num_elements(kept)), init),
             std::vector<double>(static_cast<size_t>(num_elements(kept)), 0)};
  std::vector<int64_t> index, kept_index;
  for (int64_t i = 0; i < x.size(); ++i) {
    unravel(i, x.shape(), &index);
    kept_index.clear();
    for (size_t d = 0; d < index.size(); ++d) {
      if (std::find(axes.begin(), axes.end(), static_cast<int64_t>(d)) == axes.end()) kept_index.push_back(index[d]);
    }
    const size_t o = static_cast<size_t>(ravel(kept_index, kept));
    const double v = x.element_as_double(i);
    double& acc = e.values[o];
    switch (op) {
      case Op::kReduceSum:
        acc = is_bool ? std::max(acc, v) : acc + v;
        e.scale[o] += std::abs(v);
        break;
      case Op::kReduceProd:
        acc = is_bool ? std::min(acc, v) : acc * v;
        break;
      case Op::kReduceMax:
        acc = std::max(acc, v);
        break;
      default:
        acc = std::min(acc, v);
        break;
    }
  }
  if (op != Op::kReduceSum) e.scale.clear();
  return e;
}

TEST(Kernels, ReductionsOverAxes) {
  struct Case {
    Shape shape;
    std::vector<int64_t> axes;
  };
  const std::vector<Case> cases = {
      {{2, 3, 4}, {0}},       {{2, 3, 4}, {1}}, {{2, 3, 4}, {2}},    {{2, 3, 4}, {0, 2}},
      {{2, 3, 4}, {0, 1, 2}}, {{2, 3, 4}, {}},  {{5}, {0}},          {{}, {}},
      {{3, 0, 2}, {1}},       {{3, 0, 2}, {0}}, {{4, 9, 7}, {1, 2}}, {{3, 5}, {1}},
      {{2, 8}, {1}},          {{2, 131}, {1}},  {{2, 2, 1027}, {2}}, {{2, 3, 6}, {0, 2}},
  };
  // The last five: rows of every length mod 4 along a reduced last dimension (sums fold them
  // four at a time).
  std::mt19937 rng(13);
  for (Op op : {Op::kReduceSum, Op::kReduceMax, Op::kReduceMin, Op::kReduceProd}) {
    for (DType dtype : kSweptDTypes) {
      for (const Case& c : cases) {
        if (op == Op::kReduceProd && !c.shape.empty() && c.shape.back() > 100) continue;  // would underflow float32
        SCOPED_TRACE(absl::StrCat(trace(op, dtype, c.shape), " over {", absl::StrJoin(c.axes, ","), "}"));
        Graph g;
        const Node node = node_of(g, g.add_reduce(op, g.add_parameter(dtype, c.shape), c.axes));
        // Products of up to 63 factors of magnitude <= 2 stay exact in int64 and double; int32 ones
        // use the small case counts only.
        const bool big = num_elements(c.shape) > 24;
        const HostArray x = op == Op::kReduceProd && (big || dtype == DType::kI32)
                                ? random_array(dtype, c.shape, rng, -1.2, 1.2)
                                : random_array(dtype, c.shape, rng, -4, 4);
        expect_matches(run(node, {&x}), reference_reduce(op, x, c.axes));
      }
    }
  }
}

TEST(Kernels, ReduceMaxMinPropagateNanAndArgmaxPicksTheFirstNan) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const HostArray x = HostArray::from_vector<float>({2, 4}, {1, nan, 5, nan, 3, 3, 2, 1});
  Graph g;
  const int p = g.add_parameter(DType::kF32, {2, 4});
  for (Op op : {Op::kReduceMax, Op::kReduceMin}) {
    const HostArray out = run(node_of(g, g.add_reduce(op, p, {1})), {&x});
    EXPECT_TRUE(std::isnan(out.values<float>()[0])) << op_name(op);
    EXPECT_EQ(out.values<float>()[1], op == Op::kReduceMax ? 3.0f : 1.0f) << op_name(op);
  }
  EXPECT_EQ(run(node_of(g, g.add_argmax(p, 1, DType::kI32)), {&x}), HostArray::from_vector<int32_t>({2}, {1, 0}));
}

TEST(Kernels, ArgmaxReturnsTheFirstMaximum) {
  struct Case {
    Shape shape;
    int64_t axis;
  };
  const std::vector<Case> cases = {{{2, 3, 4}, 0}, {{2, 3, 4}, 1}, {{2, 3, 4}, 2}, {{5}, 0}, {{1}, 0}, {{3, 0, 2}, 0}};
  std::mt19937 rng(14);
  for (DType dtype : kSweptDTypes) {
    for (DType index_dtype : kIntegers) {
      for (const Case& c : cases) {
        SCOPED_TRACE(
            absl::StrCat(trace(Op::kArgmax, dtype, c.shape), " axis ", c.axis, " as ", dtype_name(index_dtype)));
        Graph g;
        const Node node = node_of(g, g.add_argmax(g.add_parameter(dtype, c.shape), c.axis, index_dtype));
        const HostArray x = small_integers(dtype, c.shape, rng);  // ties
        Shape kept = c.shape;
        kept.erase(kept.begin() + c.axis);
        Expected want{index_dtype, kept, {}, {}};
        for (int64_t o = 0; o < num_elements(kept); ++o) {
          std::vector<int64_t> index = unravel(o, kept);
          index.insert(index.begin() + c.axis, 0);
          int64_t best = 0;
          double best_value = -std::numeric_limits<double>::infinity();
          for (int64_t k = 0; k < c.shape[static_cast<size_t>(c.axis)]; ++k) {
            index[static_cast<size_t>(c.axis)] = k;
            const double v = x.element_as_double(ravel(index, c.shape));
            if (v > best_value) {
              best_value = v;
              best = k;
            }
          }
          want.values.push_back(static_cast<double>(best));
        }
        expect_matches(run(node, {&x}), want);
      }
    }
  }
}

// ---- dot_general -----------------------------------------------------------------------------

// The dimensions of a rank-`rank` operand that are neither batch nor contracting.
std::vector<int64_t> free_of(size_t rank, const std::vector<int64_t>& batch, const std::vector<int64_t>& contracting) {
  std::vector<int64_t> out;
  for (int64_t d = 0; d < static_cast<int64_t>(rank); ++d) {
    if (std::count(batch.begin(), batch.end(), d) == 0 && std::count(contracting.begin(), contracting.end(), d) == 0) {
      out.push_back(d);
    }
  }
  return out;
}

Expected reference_dot(const HostArray& lhs, const HostArray& rhs, const DotDims& dd) {
  const Shape& ls = lhs.shape();
  const Shape& rs = rhs.shape();
  const std::vector<int64_t> lf = free_of(ls.size(), dd.lhs_batch, dd.lhs_contracting);
  const std::vector<int64_t> rf = free_of(rs.size(), dd.rhs_batch, dd.rhs_contracting);
  Shape out_shape, k_shape;
  for (int64_t d : dd.lhs_batch) out_shape.push_back(ls[static_cast<size_t>(d)]);
  for (int64_t d : lf) out_shape.push_back(ls[static_cast<size_t>(d)]);
  for (int64_t d : rf) out_shape.push_back(rs[static_cast<size_t>(d)]);
  for (int64_t d : dd.lhs_contracting) k_shape.push_back(ls[static_cast<size_t>(d)]);
  Expected e{lhs.dtype(), out_shape, {}, {}};
  std::vector<int64_t> out_index, k_index, li(ls.size()), ri(rs.size());
  for (int64_t o = 0; o < num_elements(out_shape); ++o) {
    unravel(o, out_shape, &out_index);
    size_t pos = 0;
    for (size_t b = 0; b < dd.lhs_batch.size(); ++b, ++pos) {
      li[static_cast<size_t>(dd.lhs_batch[b])] = out_index[pos];
      ri[static_cast<size_t>(dd.rhs_batch[b])] = out_index[pos];
    }
    for (int64_t d : lf) li[static_cast<size_t>(d)] = out_index[pos++];
    for (int64_t d : rf) ri[static_cast<size_t>(d)] = out_index[pos++];
    double sum = 0, scale = 0;
    for (int64_t k = 0; k < num_elements(k_shape); ++k) {
      unravel(k, k_shape, &k_index);
      for (size_t c = 0; c < k_index.size(); ++c) {
        li[static_cast<size_t>(dd.lhs_contracting[c])] = k_index[c];
        ri[static_cast<size_t>(dd.rhs_contracting[c])] = k_index[c];
      }
      const double term = lhs.element_as_double(ravel(li, ls)) * rhs.element_as_double(ravel(ri, rs));
      sum += term;
      scale += std::abs(term);
    }
    e.values.push_back(sum);
    e.scale.push_back(scale);
  }
  return e;
}

TEST(Kernels, DotGeneral) {
  struct Case {
    std::string name;
    Shape lhs, rhs;
    DotDims dims;
  };
  const std::vector<Case> cases = {
      {"matmul (M,K)x(K,N)", {4, 5}, {5, 3}, {{}, {}, {1}, {0}}},
      {"batched (B,M,K)x(B,K,N)", {2, 4, 5}, {2, 5, 3}, {{0}, {0}, {2}, {1}}},
      {"lhs (K,M) contracting 0, rhs (N,K) contracting 1", {5, 4}, {3, 5}, {{}, {}, {0}, {1}}},
      {"vector dot", {7}, {7}, {{}, {}, {0}, {0}}},
      {"outer product", {3}, {4}, {{}, {}, {}, {}}},
      {"matrix-vector", {4, 6}, {6}, {{}, {}, {1}, {0}}},
      {"batch in the middle (M,B,K)x(K,B,N)", {3, 2, 5}, {5, 2, 4}, {{1}, {1}, {2}, {0}}},
      {"two contracting dimensions", {2, 3, 4}, {4, 2, 5}, {{}, {}, {0, 2}, {1, 0}}},
      {"batched, rhs (B,N,K)", {2, 4, 5}, {2, 3, 5}, {{0}, {0}, {2}, {2}}},
      {"two batch dimensions, swapped", {2, 3, 4, 5}, {3, 2, 5, 6}, {{0, 1}, {1, 0}, {3}, {2}}},
      {"empty contraction", {3, 0}, {0, 4}, {{}, {}, {1}, {0}}},
      {"empty free dimension", {0, 5}, {5, 3}, {{}, {}, {1}, {0}}},
      {"size-1 dimensions", {1, 5, 1}, {5, 1}, {{}, {}, {1}, {0}}},
      {"scalars", {}, {}, {{}, {}, {}, {}}},
      // Operands BLAS reads in place with strided rows (nn::dot_product_attention's two).
      {"attention logits (B,T,N,H)x(B,S,N,H)", {2, 5, 3, 4}, {2, 6, 3, 4}, {{0, 2}, {0, 2}, {3}, {3}}},
      {"attention values (B,N,T,S)x(B,S,N,H)", {2, 3, 5, 6}, {2, 6, 3, 4}, {{0, 1}, {0, 2}, {3}, {1}}},
      {"strided rows, transposed (K,B,M)x(B,K,N)", {5, 2, 3}, {2, 5, 4}, {{1}, {0}, {0}, {1}}},
      {"rows of two dimensions (B,M1,M2,K)x(K,N)", {2, 3, 2, 5}, {5, 4}, {{}, {}, {3}, {0}}},
      {"columns that do not collapse: copied", {3, 4, 5}, {5, 4, 2}, {{}, {}, {1, 2}, {1, 0}}},
      {"size-1 dimensions in every group", {1, 3, 1, 4}, {4, 1, 2, 1}, {{0}, {3}, {3}, {0}}},
  };
  std::mt19937 rng(15);
  for (DType dtype : kNumeric) {
    for (const Case& c : cases) {
      SCOPED_TRACE(absl::StrCat(c.name, ": ", type_to_string(dtype, c.lhs), " x ", type_to_string(dtype, c.rhs)));
      Graph g;
      const Node node =
          node_of(g, g.add_dot_general(g.add_parameter(dtype, c.lhs), g.add_parameter(dtype, c.rhs), c.dims));
      const HostArray lhs = random_array(dtype, c.lhs, rng, -5, 5);
      const HostArray rhs = random_array(dtype, c.rhs, rng, -5, 5);
      expect_matches(run(node, {&lhs, &rhs}), reference_dot(lhs, rhs, c.dims));
    }
  }
}

TEST(Kernels, DotGeneralIntegerWraps) {
  using L = std::numeric_limits<int32_t>;
  const HostArray lhs = HostArray::from_vector<int32_t>({1, 2}, {L::max(), 2});
  const HostArray rhs = HostArray::from_vector<int32_t>({2, 1}, {1, 1});
  Graph g;
  const Node node = node_of(g, g.add_dot_general(g.add_parameter(DType::kI32, {1, 2}),
                                                 g.add_parameter(DType::kI32, {2, 1}), {{}, {}, {1}, {0}}));
  EXPECT_EQ(run(node, {&lhs, &rhs}), HostArray::from_vector<int32_t>({1, 1}, {L::min() + 1}));
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// 256x512 times 512x128 in float32: checked against the reference, and timed against the
// textbook triple loop (informational: the machines are noisy, so nothing is asserted on time).
TEST(Kernels, DotGeneralLargeFloat32UsesBlas) {
  constexpr int64_t m = 256, k = 512, n = 128;
  std::mt19937 rng(16);
  const HostArray lhs = random_array(DType::kF32, {m, k}, rng, -1, 1);
  const HostArray rhs = random_array(DType::kF32, {k, n}, rng, -1, 1);
  Graph g;
  const Node node = node_of(g, g.add_dot_general(g.add_parameter(DType::kF32, {m, k}),
                                                 g.add_parameter(DType::kF32, {k, n}), {{}, {}, {1}, {0}}));

  // Reference in double (the generic reference_dot would take seconds here).
  const float* a = lhs.values<float>().data();
  const float* b = rhs.values<float>().data();
  Expected want{DType::kF32, {m, n}, {}, {}};
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0, scale = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double term = static_cast<double>(a[i * k + p]) * b[p * n + j];
        sum += term;
        scale += std::abs(term);
      }
      want.values.push_back(sum);
      want.scale.push_back(scale);
    }
  }

  run(node, {&lhs, &rhs});  // warm up OpenBLAS's threads and buffers
  double kernel_seconds = std::numeric_limits<double>::infinity();
  HostArray out;
  for (int rep = 0; rep < 5; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    out = run(node, {&lhs, &rhs});
    kernel_seconds = std::min(kernel_seconds, seconds_since(start));
  }
  expect_matches(out, want);

  std::vector<float> naive(static_cast<size_t>(m * n));
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float sum = 0;
      for (int64_t p = 0; p < k; ++p) sum += a[i * k + p] * b[p * n + j];
      naive[static_cast<size_t>(i * n + j)] = sum;
    }
  }
  const double naive_seconds = seconds_since(start);
  EXPECT_NEAR(naive[0], out.values<float>()[0], 1e-3);

  const double gflop = 2.0 * m * n * k / 1e9;
  std::cout << "[ timing   ] dot_general f32 256x512x128: kernel " << kernel_seconds * 1e3 << " ms ("
            << gflop / kernel_seconds << " GFLOP/s, OpenBLAS kernel " << blas_kernel_name() << "), naive loop "
            << naive_seconds * 1e3 << " ms (" << gflop / naive_seconds << " GFLOP/s)\n";
  ::testing::Test::RecordProperty("kernel_ms", std::to_string(kernel_seconds * 1e3));
  ::testing::Test::RecordProperty("naive_ms", std::to_string(naive_seconds * 1e3));
}

// ---- Errors ----------------------------------------------------------------------------------

// ---- Indexing -------------------------------------------------------------------------------

const Node gather_node(DType dtype, const Shape& x, DType index_dtype, const Shape& i, GatherAttrs attrs) {
  Graph g;
  const int xp = g.add_parameter(dtype, x);
  return node_of(g, g.add_gather(xp, g.add_parameter(index_dtype, i), std::move(attrs)));
}

// jnp.take's docstring (jax/_src/numpy/indexing.py) with x = [[1, 2, 3], [4, 5, 6]] and
// indices [2, 0]: along axis 1 [[3, 1], [6, 4]]; along axis 0, where 2 is out of range, fill
// mode gives [[nan, nan, nan], [1, 2, 3]] and clip mode [[4, 5, 6], [1, 2, 3]].
TEST(Kernels, GatherMatchesJaxTakeExamples) {
  const HostArray x = HostArray::from_vector<float>({2, 3}, {1, 2, 3, 4, 5, 6});
  const HostArray i = HostArray::from_vector<int32_t>({2}, {2, 0});
  const double nan = std::numeric_limits<double>::quiet_NaN();
  expect_matches(
      run(gather_node(DType::kF32, {2, 3}, DType::kI32, {2}, GatherAttrs{1, IndexMode::kFillOrDrop, std::nullopt}),
          {&x, &i}),
      Expected{DType::kF32, {2, 2}, {3, 1, 6, 4}, {}});
  expect_matches(
      run(gather_node(DType::kF32, {2, 3}, DType::kI32, {2}, GatherAttrs{0, IndexMode::kFillOrDrop, std::nullopt}),
          {&x, &i}),
      Expected{DType::kF32, {2, 3}, {nan, nan, nan, 1, 2, 3}, {}});
  expect_matches(
      run(gather_node(DType::kF32, {2, 3}, DType::kI32, {2}, GatherAttrs{0, IndexMode::kClip, std::nullopt}), {&x, &i}),
      Expected{DType::kF32, {2, 3}, {4, 5, 6, 1, 2, 3}, {}});
  // The other default fill values (jnp.take: the lowest signed integer, true for bool), and a
  // given one; lax.gather reads a negative index as out of range.
  const HostArray n = HostArray::from_vector<int32_t>({2, 2}, {1, 2, 3, 4});
  const HostArray b = HostArray::from_vector<bool>({2}, {false, false});
  const HostArray j = HostArray::from_vector<int64_t>({3}, {-1, 1, 5});
  expect_matches(
      run(gather_node(DType::kI32, {2, 2}, DType::kI64, {3}, GatherAttrs{0, IndexMode::kFillOrDrop, std::nullopt}),
          {&n, &j}),
      Expected{DType::kI32, {3, 2}, {-2147483648.0, -2147483648.0, 3, 4, -2147483648.0, -2147483648.0}, {}});
  expect_matches(
      run(gather_node(DType::kBool, {2}, DType::kI64, {3}, GatherAttrs{0, IndexMode::kFillOrDrop, std::nullopt}),
          {&b, &j}),
      Expected{DType::kBool, {3}, {1, 0, 1}, {}});
  expect_matches(
      run(gather_node(DType::kI32, {2, 2}, DType::kI64, {3}, GatherAttrs{1, IndexMode::kFillOrDrop, Scalar(7)}),
          {&n, &j}),
      Expected{DType::kI32, {2, 3}, {7, 2, 7, 7, 4, 7}, {}});
}

// Index i of a dimension of size n under `mode`, or -1 for none (fill / drop).
int64_t reference_index(int64_t i, int64_t n, IndexMode mode) {
  if (mode == IndexMode::kClip) return std::min(std::max<int64_t>(i, 0), n - 1);
  return i >= 0 && i < n ? i : -1;
}

// Every axis of a rank-3 operand, rank 0, 1 and 2 index arrays with out-of-range and negative
// indices, both modes and every dtype, against a loop over the result's multi-index.
TEST(Kernels, GatherAgainstLoops) {
  const Shape x_shape = {3, 4, 2};
  const std::vector<Shape> index_shapes = {{}, {5}, {2, 3}};
  std::mt19937 rng(21);
  for (DType dtype : kSweptDTypes) {
    for (int64_t axis = 0; axis < 3; ++axis) {
      for (const Shape& i_shape : index_shapes) {
        for (IndexMode mode : {IndexMode::kClip, IndexMode::kFillOrDrop}) {
          SCOPED_TRACE(absl::StrCat(trace(Op::kGather, dtype, x_shape), " axis ", axis, " indices ",
                                    shape_to_string(i_shape), mode == IndexMode::kClip ? " clip" : " fill"));
          const HostArray x = random_array(dtype, x_shape, rng);
          const HostArray idx = random_array(DType::kI32, i_shape, rng, -2, 5);
          const Node node = gather_node(dtype, x_shape, DType::kI32, i_shape, GatherAttrs{axis, mode, std::nullopt});
          const double fill = default_fill_value(dtype).to_double();
          Expected want{dtype, node.shape, {}, {}};
          for (int64_t r = 0; r < num_elements(node.shape); ++r) {
            const std::vector<int64_t> at = unravel(r, node.shape);
            const std::vector<int64_t> j(at.begin() + axis, at.begin() + axis + static_cast<int64_t>(i_shape.size()));
            const int64_t k =
                reference_index(static_cast<int64_t>(idx.element_as_double(ravel(j, i_shape))), x_shape[axis], mode);
            std::vector<int64_t> from(at.begin(), at.begin() + axis);
            from.push_back(k);
            from.insert(from.end(), at.begin() + axis + static_cast<int64_t>(i_shape.size()), at.end());
            want.values.push_back(k < 0 ? fill : x.element_as_double(ravel(from, x_shape)));
          }
          expect_matches(run(node, {&x, &idx}), want);
        }
      }
    }
  }
}

// scatter sets, scatter_add adds every update, repeated indices included (jax.Array.at: "all
// updates will be applied"); out-of-range updates are dropped in fill/drop mode and clamped in
// clip mode.
TEST(Kernels, ScatterAgainstLoops) {
  const Shape x_shape = {4, 3};
  const Shape i_shape = {5};
  std::mt19937 rng(22);
  for (Op op : {Op::kScatter, Op::kScatterAdd}) {
    for (DType dtype : kSweptDTypes) {
      if (op == Op::kScatterAdd && dtype == DType::kBool) continue;
      for (int64_t axis = 0; axis < 2; ++axis) {
        for (IndexMode mode : {IndexMode::kClip, IndexMode::kFillOrDrop}) {
          SCOPED_TRACE(
              absl::StrCat(trace(op, dtype, x_shape), " axis ", axis, mode == IndexMode::kClip ? " clip" : ""));
          const HostArray x = random_array(dtype, x_shape, rng);
          // scatter (set): distinct in-range targets, so that which repeat lands does not matter.
          const HostArray idx = op == Op::kScatter ? HostArray::from_vector<int32_t>({5}, {2, -1, 0, 9, 1})
                                                   : HostArray::from_vector<int32_t>({5}, {1, 2, 1, -3, 7});
          Shape u_shape = x_shape;
          u_shape[axis] = 5;
          const HostArray u = random_array(dtype, u_shape, rng);
          Graph g;
          const int xp = g.add_parameter(dtype, x_shape), ip = g.add_parameter(DType::kI32, i_shape);
          const Node node = node_of(
              g, g.add_scatter(op, xp, ip, g.add_parameter(dtype, u_shape), GatherAttrs{axis, mode, std::nullopt}));
          std::vector<double> want(static_cast<size_t>(x.size()));
          for (int64_t e = 0; e < x.size(); ++e) want[e] = x.element_as_double(e);
          std::vector<std::vector<double>> written(want.size());  // scatter: every update aimed at each element
          for (int64_t e = 0; e < u.size(); ++e) {
            std::vector<int64_t> at = unravel(e, u_shape);
            const int64_t k =
                reference_index(static_cast<int64_t>(idx.element_as_double(at[axis])), x_shape[axis], mode);
            if (k < 0) continue;
            at[axis] = k;
            const int64_t t = ravel(at, x_shape);
            if (op == Op::kScatterAdd) {
              want[t] = as_dtype(want[t] + u.element_as_double(e), dtype);
            } else {
              written[t].push_back(u.element_as_double(e));
              want[t] = u.element_as_double(e);
            }
          }
          const HostArray got = run(node, {&x, &idx, &u});
          // Clip mode folds -1 and 9 onto rows 0 and the last: a set there lands one of the
          // updates aimed at it (JAX leaves which one to the implementation).
          for (size_t t = 0; t < want.size(); ++t) {
            if (written[t].size() < 2) continue;
            const double g = got.element_as_double(static_cast<int64_t>(t));
            EXPECT_NE(std::find(written[t].begin(), written[t].end(), g), written[t].end()) << "element " << t;
            want[t] = g;
          }
          expect_matches(got, Expected{dtype, x_shape, want, std::vector<double>(want.size(), 8.0)});
        }
      }
    }
  }
}

// batch_dims (GatherAttrs): the first n dimensions of x and the indices are matched
// elementwise, as tf.gather(batch_dims=n) / a per-example read of a KV cache. gather, scatter
// and scatter_add with n = 1 and 2, every axis from n on, rank-n to rank-(n + 2) indices with
// out-of-range and negative entries, both modes, every dtype, against a plain loop: element
// (b, p, j, q) of the gathered value is x[b, p, indices[b, j], q] (or dropped / the fill).
TEST(Kernels, BatchedGatherAndScatterAgainstLoops) {
  const Shape x_shape = {2, 3, 4, 2};
  std::mt19937 rng(23);
  for (Op op : {Op::kGather, Op::kScatter, Op::kScatterAdd}) {
    for (DType dtype : kSweptDTypes) {
      if (op == Op::kScatterAdd && dtype == DType::kBool) continue;
      for (int64_t n = 1; n <= 2; ++n) {
        const Shape batch(x_shape.begin(), x_shape.begin() + n);
        for (int64_t axis = n; axis < 4; ++axis) {
          for (const Shape& extra : {Shape{}, Shape{3}, Shape{2, 2}}) {
            for (IndexMode mode : {IndexMode::kClip, IndexMode::kFillOrDrop}) {
              Shape i_shape = batch;
              i_shape.insert(i_shape.end(), extra.begin(), extra.end());
              SCOPED_TRACE(absl::StrCat(trace(op, dtype, x_shape), " batch_dims ", n, " axis ", axis, " indices ",
                                        shape_to_string(i_shape), mode == IndexMode::kClip ? " clip" : " fill"));
              const HostArray x = random_array(dtype, x_shape, rng);
              // scatter (set) writes distinct targets per example, so no repeat decides an element.
              HostArray idx = random_array(DType::kI32, i_shape, rng, -2, 6);
              if (op == Op::kScatter) {
                std::vector<int32_t> distinct(static_cast<size_t>(num_elements(i_shape)));
                const int64_t m = num_elements(extra);
                for (size_t e = 0; e < distinct.size(); ++e) {
                  const int32_t k = static_cast<int32_t>((e % m + e / m) % m);
                  distinct[e] = mode == IndexMode::kFillOrDrop && k == 1 ? 9 : k;  // one dropped
                }
                idx = HostArray::from_vector<int32_t>(i_shape, distinct);
              }
              Graph g;
              const int xp = g.add_parameter(dtype, x_shape), ip = g.add_parameter(DType::kI32, i_shape);
              const GatherAttrs attrs{axis, mode, std::nullopt, n};
              // Where each element of the gathered value (the updates) comes from (goes to) in x.
              Shape r_shape(x_shape.begin(), x_shape.begin() + axis);
              r_shape.insert(r_shape.end(), extra.begin(), extra.end());
              r_shape.insert(r_shape.end(), x_shape.begin() + axis + 1, x_shape.end());
              auto target = [&](int64_t r) {
                const std::vector<int64_t> at = unravel(r, r_shape);
                std::vector<int64_t> j(at.begin(), at.begin() + n);
                j.insert(j.end(), at.begin() + axis, at.begin() + axis + static_cast<int64_t>(extra.size()));
                const int64_t k = reference_index(static_cast<int64_t>(idx.element_as_double(ravel(j, i_shape))),
                                                  x_shape[axis], mode);
                if (k < 0) return int64_t{-1};
                std::vector<int64_t> from(at.begin(), at.begin() + axis);
                from.push_back(k);
                from.insert(from.end(), at.begin() + axis + static_cast<int64_t>(extra.size()), at.end());
                return ravel(from, x_shape);
              };
              if (op == Op::kGather) {
                const Node node = node_of(g, g.add_gather(xp, ip, attrs));
                ASSERT_EQ(node.shape, r_shape);
                const double fill = default_fill_value(dtype).to_double();
                Expected want{dtype, r_shape, {}, {}};
                for (int64_t r = 0; r < num_elements(r_shape); ++r) {
                  const int64_t t = target(r);
                  want.values.push_back(t < 0 ? fill : x.element_as_double(t));
                }
                expect_matches(run(node, {&x, &idx}), want);
                continue;
              }
              const HostArray u = random_array(dtype, r_shape, rng);
              const Node node = node_of(g, g.add_scatter(op, xp, ip, g.add_parameter(dtype, r_shape), attrs));
              std::vector<double> want(static_cast<size_t>(x.size()));
              for (int64_t e = 0; e < x.size(); ++e) want[e] = x.element_as_double(e);
              std::vector<int> hits(want.size());
              for (int64_t r = 0; r < u.size(); ++r) {
                const int64_t t = target(r);
                if (t < 0) continue;
                ++hits[t];
                want[t] =
                    op == Op::kScatterAdd ? as_dtype(want[t] + u.element_as_double(r), dtype) : u.element_as_double(r);
              }
              const HostArray got = run(node, {&x, &idx, &u});
              // Clip mode folds -2 and 9 onto an example's first and last rows: a set there lands
              // one of the updates aimed at it, which the loop above cannot single out.
              if (op == Op::kScatter && mode == IndexMode::kClip) {
                for (size_t t = 0; t < want.size(); ++t) {
                  if (hits[t] > 1) want[t] = got.element_as_double(static_cast<int64_t>(t));
                }
              }
              expect_matches(got, Expected{dtype, x_shape, want, std::vector<double>(want.size(), 8.0)});
            }
          }
        }
      }
    }
  }
}

// lax.dynamic_slice's and lax.dynamic_update_slice's docstrings (jax/_src/lax/slicing.py): with
// x = arange(12).reshape(3, 4), starts (1, 1) and sizes (2, 3) give [[5, 6, 7], [9, 10, 11]],
// sizes (2, 4) clamp the column start to 0: [[4, 5, 6, 7], [8, 9, 10, 11]]; ones(3) written into
// zeros(6) at 2 gives [0, 0, 1, 1, 1, 0], at 5 the start clamps to 3: [0, 0, 0, 1, 1, 1].
TEST(Kernels, DynamicSliceAndUpdateClampTheirStartsAsLax) {
  std::vector<int32_t> twelve(12);
  for (int k = 0; k < 12; ++k) twelve[k] = k;
  const HostArray x = HostArray::from_vector<int32_t>({3, 4}, twelve);
  const HostArray starts = HostArray::from_vector<int32_t>({2}, {1, 1});
  auto window = [&](Shape sizes, const HostArray& at) {
    Graph g;
    const int xp = g.add_parameter(DType::kI32, {3, 4});
    return run(node_of(g, g.add_dynamic_slice(xp, g.add_parameter(at.dtype(), at.shape()), std::move(sizes))),
               {&x, &at});
  };
  expect_matches(window({2, 3}, starts), Expected{DType::kI32, {2, 3}, {5, 6, 7, 9, 10, 11}, {}});
  expect_matches(window({2, 4}, starts), Expected{DType::kI32, {2, 4}, {4, 5, 6, 7, 8, 9, 10, 11}, {}});
  const HostArray negative = HostArray::from_vector<int64_t>({2}, {-5, 7});
  expect_matches(window({1, 2}, negative), Expected{DType::kI32, {1, 2}, {2, 3}, {}});
  const HostArray zeros = HostArray::zeros(DType::kF32, {6});
  const HostArray ones = HostArray::from_vector<float>({3}, {1, 1, 1});
  auto update = [&](int32_t at) {
    const HostArray s = HostArray::from_vector<int32_t>({1}, {at});
    Graph g;
    const int xp = g.add_parameter(DType::kF32, {6}), up = g.add_parameter(DType::kF32, {3});
    return run(node_of(g, g.add_dynamic_update_slice(xp, up, g.add_parameter(DType::kI32, {1}))), {&zeros, &ones, &s});
  };
  expect_matches(update(2), Expected{DType::kF32, {6}, {0, 0, 1, 1, 1, 0}, {}});
  expect_matches(update(5), Expected{DType::kF32, {6}, {0, 0, 0, 1, 1, 1}, {}});
  expect_matches(update(-2), Expected{DType::kF32, {6}, {1, 1, 1, 0, 0, 0}, {}});
  // A rank-2 update inside a rank-2 operand.
  const HostArray patch = HostArray::from_vector<int32_t>({2, 2}, {-1, -2, -3, -4});
  Graph g;
  const int xp = g.add_parameter(DType::kI32, {3, 4}), pp = g.add_parameter(DType::kI32, {2, 2});
  expect_matches(
      run(node_of(g, g.add_dynamic_update_slice(xp, pp, g.add_parameter(DType::kI32, {2}))), {&x, &patch, &starts}),
      Expected{DType::kI32, {3, 4}, {0, 1, 2, 3, 4, -1, -2, 7, 8, -3, -4, 11}, {}});
}

// The type rules refuse what the kernels cannot index with, naming the rule.
TEST(KernelErrors, IndexingTypeRules) {
  Graph g;
  const int x = g.add_parameter(DType::kF32, {4, 3});
  const int f = g.add_parameter(DType::kF32, {2});
  const int i = g.add_parameter(DType::kI32, {2});
  EXPECT_THAT(std::string(g.add_gather(x, f, GatherAttrs{0, IndexMode::kFillOrDrop, std::nullopt}).status().message()),
              HasSubstr("indices are f32[2]; they need int32 or int64"));
  EXPECT_THAT(std::string(g.add_gather(x, i, GatherAttrs{2, IndexMode::kFillOrDrop, std::nullopt}).status().message()),
              HasSubstr("axis 2 is out of range"));
  EXPECT_THAT(std::string(g.add_gather(x, i, GatherAttrs{0, IndexMode::kClip, Scalar(0)}).status().message()),
              HasSubstr("a fill value needs the fill mode"));
  EXPECT_THAT(std::string(g.add_scatter(Op::kScatterAdd, x, i, x, GatherAttrs{0, IndexMode::kFillOrDrop, std::nullopt})
                              .status()
                              .message()),
              HasSubstr("the updates must be f32[2,3]"));
  // batch_dims: the batch dimensions come before the indexed one and match in size.
  const int ib = g.add_parameter(DType::kI32, {4, 2});
  EXPECT_THAT(std::string(g.add_gather(x, ib, GatherAttrs{0, IndexMode::kClip, std::nullopt, 1}).status().message()),
              HasSubstr("gather of f32[4,3] at i32[4,2] along axis 0 with batch_dims 1: batch_dims 1 must be in "
                        "[0, min(axis 0, the indices' rank 2)]"));
  EXPECT_THAT(std::string(g.add_gather(x, i, GatherAttrs{1, IndexMode::kClip, std::nullopt, 1}).status().message()),
              HasSubstr("batch dimension 0 has size 4 in the operand and 2 in the indices; batch dimensions must "
                        "be equal"));
  EXPECT_THAT(
      std::string(
          g.add_scatter(Op::kScatter, x, ib, x, GatherAttrs{1, IndexMode::kClip, std::nullopt, 1}).status().message()),
      HasSubstr("scatter into f32[4,3] at i32[4,2] of f32[4,3] along axis 1 with batch_dims 1: the updates "
                "must be f32[4,2]"));
  EXPECT_THAT(std::string(g.add_gather(x, ib, GatherAttrs{1, IndexMode::kClip, std::nullopt, -1}).status().message()),
              HasSubstr("batch_dims -1 must be in"));
  EXPECT_THAT(std::string(g.add_dynamic_slice(x, i, {5, 1}).status().message()),
              HasSubstr("size 5 of dimension 0 is outside [0, 4]"));
  EXPECT_THAT(std::string(g.add_dynamic_slice(x, g.add_parameter(DType::kI32, {3}), {1, 1}).status().message()),
              HasSubstr("they need one per dimension, shape (2)"));
}

TEST(KernelErrors, ParameterHasNoKernel) {
  Graph g;
  const Node node = g.node(g.add_parameter(DType::kF32, {4}));
  absl::StatusOr<HostArray> out = run_kernel(node, {});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(out.status().message(), HasSubstr("parameter"));
}

TEST(KernelErrors, WrongOperandCount) {
  Graph g;
  const int x = g.add_parameter(DType::kF32, {4});
  const HostArray a = HostArray::zeros(DType::kF32, {4});
  const HostArray pred = HostArray::zeros(DType::kBool, {4});
  const Node add = node_of(g, g.add_binary(Op::kAdd, x, x));
  EXPECT_EQ(run_kernel(add, {&a}).status(), absl::InvalidArgumentError("add: takes 2 operands, got 1"));
  const Node tanh = node_of(g, g.add_unary(Op::kTanh, x));
  EXPECT_EQ(run_kernel(tanh, {&a, &a}).status(), absl::InvalidArgumentError("tanh: takes 1 operand, got 2"));
  const Node constant = node_of(g, g.add_constant(DType::kF32, {4}, 1));
  EXPECT_EQ(run_kernel(constant, {&a}).status(), absl::InvalidArgumentError("constant: takes 0 operands, got 1"));
  const Node select = node_of(g, g.add_select(g.add_parameter(DType::kBool, {4}), x, x));
  EXPECT_EQ(run_kernel(select, {&pred, &a}).status(), absl::InvalidArgumentError("select: takes 3 operands, got 2"));
  const Node concat = node_of(g, g.add_concatenate({x, x}, 0));
  EXPECT_EQ(run_kernel(concat, {}).status(),
            absl::InvalidArgumentError("concatenate: takes at least one operand, got none"));
  EXPECT_EQ(run_kernel(add, {&a, nullptr}).status(), absl::InvalidArgumentError("add: operand 1 is null"));
}

// The kernels check a node with its op's type rule (core/op.h), the one Graph uses: the messages
// are the rule's, or say which type the operands give against the node's.
TEST(KernelErrors, MismatchedOperandType) {
  Graph g;
  const int x = g.add_parameter(DType::kF32, {4});
  const HostArray f32 = HostArray::zeros(DType::kF32, {4});
  const HostArray i32 = HostArray::zeros(DType::kI32, {4});
  const HostArray f32_5 = HostArray::zeros(DType::kF32, {5});
  const Node tanh = node_of(g, g.add_unary(Op::kTanh, x));
  EXPECT_EQ(run_kernel(tanh, {&i32}).status(),
            absl::InvalidArgumentError(
                "tanh: operand is i32[4]; it needs float32, float64, bfloat16 or float16 (convert first)"));
  EXPECT_EQ(run_kernel(tanh, {&f32_5}).status(),
            absl::InvalidArgumentError("tanh: the operands (f32[5]) give f32[5] but the node is f32[4]"));
  const Node add = node_of(g, g.add_binary(Op::kAdd, x, x));
  EXPECT_EQ(run_kernel(add, {&f32, &i32}).status(),
            absl::InvalidArgumentError("add: operands f32[4] and i32[4] differ"));
  const Node lt = node_of(g, g.add_binary(Op::kLt, x, x));
  EXPECT_EQ(run_kernel(lt, {&f32, &i32}).status(), absl::InvalidArgumentError("lt: operands f32[4] and i32[4] differ"));
  const Node select = node_of(g, g.add_select(g.add_parameter(DType::kBool, {4}), x, x));
  EXPECT_EQ(
      run_kernel(select, {&f32, &f32, &f32}).status(),
      absl::InvalidArgumentError(
          "select: needs a bool predicate and two branches of its shape and one dtype; got f32[4], f32[4], f32[4]"));

  const int m = g.add_parameter(DType::kF32, {3, 4});
  const int w = g.add_parameter(DType::kF32, {4, 2});
  const Node dot = node_of(g, g.add_dot_general(m, w, {{}, {}, {1}, {0}}));
  const HostArray lhs = HostArray::zeros(DType::kF32, {3, 4});
  const HostArray short_rhs = HostArray::zeros(DType::kF32, {5, 2});
  const HostArray f64_rhs = HostArray::zeros(DType::kF64, {4, 2});
  absl::Status s = run_kernel(dot, {&lhs, &short_rhs}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      s.message(),
      HasSubstr("dot_general of f32[3,4] and f32[5,2]: contracting dimensions 1 (size 4) and 0 (size 5) differ"));
  EXPECT_EQ(run_kernel(dot, {&lhs, &f64_rhs}).status(),
            absl::InvalidArgumentError("dot_general of f32[3,4] and f64[4,2]: dtypes differ"));

  const Node concat = node_of(g, g.add_concatenate({m, m}, 0));
  const HostArray wide = HostArray::zeros(DType::kF32, {3, 5});
  s = run_kernel(concat, {&lhs, &wide}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(),
              HasSubstr("concatenate of f32[3,4], f32[3,5] along axis 0: operands must agree off the axis"));

  const Node reduce = node_of(g, g.add_reduce(Op::kReduceSum, m, {1}));
  const HostArray other = HostArray::zeros(DType::kF32, {4, 3});
  s = run_kernel(reduce, {&other}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("reduce_sum: the operands (f32[4,3]) give f32[4] but the node is f32[3]"));

  const Node transpose = node_of(g, g.add_transpose(m, {1, 0}));
  EXPECT_EQ(run_kernel(transpose, {&other}).status(),
            absl::InvalidArgumentError("transpose: the operands (f32[4,3]) give f32[3,4] but the node is f32[4,3]"));

  // Only the dtype differs: an add of f64 over f32 operands (a select so wrong would read past
  // their storage).
  Node add64 = node_of(g, g.add_binary(Op::kAdd, g.add_parameter(DType::kF32, {2}), g.add_parameter(DType::kF32, {2})));
  add64.dtype = DType::kF64;
  const HostArray f2 = HostArray::zeros(DType::kF32, {2});
  EXPECT_EQ(run_kernel(add64, {&f2, &f2}).status(),
            absl::InvalidArgumentError("add: the operands (f32[2], f32[2]) give f32[2] but the node is f64[2]"));
  // A node's negative dimension is refused naming the op.
  Node tanh_node = node_of(g, g.add_unary(Op::kTanh, g.add_parameter(DType::kF32, {2})));
  tanh_node.shape = {-1};
  EXPECT_EQ(run_kernel(tanh_node, {&f2}).status(),
            absl::InvalidArgumentError("tanh: dimension 0 of shape (-1,) is negative"));
}

TEST(KernelErrors, OpNotDefinedForTheDtype) {
  // Nodes the graph would refuse to build, as a corrupted request could carry them.
  Graph g;
  Node exp = node_of(g, g.add_unary(Op::kExp, g.add_parameter(DType::kF32, {2})));
  exp.dtype = DType::kI32;
  const HostArray i32 = HostArray::zeros(DType::kI32, {2});
  absl::Status s = run_kernel(exp, {&i32}).status();
  EXPECT_EQ(s, absl::InvalidArgumentError(
                   "exp: operand is i32[2]; it needs float32, float64, bfloat16 or float16 (convert first)"));

  Node and_node =
      node_of(g, g.add_binary(Op::kAnd, g.add_parameter(DType::kI32, {2}), g.add_parameter(DType::kI32, {2})));
  and_node.dtype = DType::kF32;
  const HostArray f32 = HostArray::zeros(DType::kF32, {2});
  EXPECT_EQ(run_kernel(and_node, {&f32, &f32}).status().code(), absl::StatusCode::kInvalidArgument);

  Node dot = node_of(
      g, g.add_dot_general(g.add_parameter(DType::kI32, {2}), g.add_parameter(DType::kI32, {2}), {{}, {}, {0}, {0}}));
  dot.dtype = DType::kBool;
  const HostArray b = HostArray::zeros(DType::kBool, {2});
  EXPECT_EQ(run_kernel(dot, {&b, &b}).status().code(), absl::StatusCode::kInvalidArgument);

  Node iota = node_of(g, g.add_iota(DType::kI32, {3}, 0));
  iota.dtype = DType::kBool;
  EXPECT_EQ(run_kernel(iota, {}).status().code(), absl::StatusCode::kInvalidArgument);

  Node neg = node_of(g, g.add_unary(Op::kNeg, g.add_parameter(DType::kI32, {2})));
  neg.dtype = DType::kBool;
  EXPECT_EQ(run_kernel(neg, {&b}).status().code(), absl::StatusCode::kInvalidArgument);
}

// Malformed attributes never reach the arithmetic: each mutation of a valid node is rejected.
TEST(KernelErrors, MalformedNodesAreRejected) {
  Graph g;
  const int x = g.add_parameter(DType::kF32, {2, 3, 4});
  const HostArray a = HostArray::zeros(DType::kF32, {2, 3, 4});
  struct Case {
    std::string name;
    absl::StatusOr<int> id;
    std::function<void(Node*)> corrupt;
  };
  const std::vector<Case> cases = {
      {"transpose repeating an axis", g.add_transpose(x, {2, 1, 0}),
       [](Node* n) {
         n->attrs<TransposeAttrs>().permutation = {0, 0, 1};
       }},
      {"transpose with a short permutation", g.add_transpose(x, {2, 1, 0}),
       [](Node* n) {
         n->attrs<TransposeAttrs>().permutation = {1, 0};
       }},
      {"reduce over an axis out of range", g.add_reduce(Op::kReduceSum, x, {1}),
       [](Node* n) { n->attrs<ReduceAttrs>().axes = {5}; }},
      {"reduce over a negative axis", g.add_reduce(Op::kReduceMax, x, {1}),
       [](Node* n) { n->attrs<ReduceAttrs>().axes = {-1}; }},
      {"reduce with the wrong result", g.add_reduce(Op::kReduceMin, x, {1}),
       [](Node* n) {
         n->shape = {2, 5};
       }},
      {"argmax over a missing axis", g.add_argmax(x, 1, DType::kI32),
       [](Node* n) { n->attrs<ArgmaxAttrs>().axis = 7; }},
      {"argmax into floats", g.add_argmax(x, 1, DType::kI32), [](Node* n) { n->dtype = DType::kF32; }},
      {"argmax carrying a reduction's attributes", g.add_argmax(x, 1, DType::kI64),
       [](Node* n) { n->attributes = ReduceAttrs{{1}}; }},
      {"slice carrying no attributes", g.add_slice(x, {0, 0, 0}, {2, 3, 4}),
       [](Node* n) { n->attributes = NoAttrs{}; }},
      {"broadcast to a dimension out of range", g.add_broadcast_in_dim(x, {2, 3, 4, 5}, {0, 1, 2}),
       [](Node* n) {
         n->attrs<BroadcastAttrs>().result_dims = {0, 1, 9};
       }},
      {"broadcast with too few dims", g.add_broadcast_in_dim(x, {2, 3, 4, 5}, {0, 1, 2}),
       [](Node* n) {
         n->attrs<BroadcastAttrs>().result_dims = {0, 1};
       }},
      {"broadcast stretching a size-3 dimension", g.add_broadcast_in_dim(x, {2, 3, 4, 5}, {0, 1, 2}),
       [](Node* n) {
         n->shape = {2, 6, 4, 5};
       }},
      {"slice past the end", g.add_slice(x, {0, 0, 0}, {2, 3, 4}),
       [](Node* n) {
         n->attrs<SliceAttrs>().limit = {2, 3, 5};
       }},
      {"slice starting below zero", g.add_slice(x, {0, 0, 0}, {2, 3, 4}),
       [](Node* n) {
         n->attrs<SliceAttrs>().start = {-1, 0, 0};
       }},
      {"slice with the wrong result", g.add_slice(x, {0, 0, 0}, {2, 3, 4}),
       [](Node* n) {
         n->shape = {2, 3, 3};
       }},
      {"slice without limits", g.add_slice(x, {0, 0, 0}, {2, 3, 4}),
       [](Node* n) { n->attrs<SliceAttrs>().limit.clear(); }},
      {"slice by a zero stride", g.add_slice(x, {0, 0, 0}, {2, 3, 4}),
       [](Node* n) {
         n->attrs<SliceAttrs>().strides = {1, 0, 1};
       }},
      {"slice by a negative stride", g.add_slice(x, {0, 0, 0}, {2, 3, 4}),
       [](Node* n) {
         n->attrs<SliceAttrs>().strides = {1, 1, -1};
       }},
      {"slice by too few strides", g.add_slice(x, {0, 0, 0}, {2, 3, 4}),
       [](Node* n) {
         n->attrs<SliceAttrs>().strides = {2, 2};
       }},
      {"slice by INT64_MAX sized as by 1", g.add_slice(x, {0, 0, 0}, {2, 3, 4}),
       [](Node* n) {
         n->attrs<SliceAttrs>().strides = {std::numeric_limits<int64_t>::max(), 1, 1};
       }},
      {"reshape changing the size", g.add_reshape(x, {6, 4}),
       [](Node* n) {
         n->shape = {6, 5};
       }},
      {"negative result dimension", g.add_reshape(x, {6, 4}),
       [](Node* n) {
         n->shape = {-6, -4};
       }},
      {"concatenate along a missing axis", g.add_concatenate({x}, 0),
       [](Node* n) { n->attrs<ConcatAttrs>().axis = 3; }},
      {"concatenate with the wrong total", g.add_concatenate({x}, 0),
       [](Node* n) {
         n->shape = {3, 3, 4};
       }},
      {"dot_general contracting a missing dimension", g.add_dot_general(x, x, {{0}, {0}, {2}, {2}}),
       [](Node* n) { n->attrs<DotAttrs>().dims.lhs_contracting = {3}; }},
      {"dot_general with unpaired dimensions", g.add_dot_general(x, x, {{0}, {0}, {2}, {2}}),
       [](Node* n) { n->attrs<DotAttrs>().dims.rhs_contracting = {}; }},
      {"dot_general with the wrong result", g.add_dot_general(x, x, {{0}, {0}, {2}, {2}}),
       [](Node* n) {
         n->shape = {2, 3, 4};
       }},
      {"comparison into floats", g.add_binary(Op::kEq, x, x), [](Node* n) { n->dtype = DType::kF32; }},
      {"unknown op", g.add_unary(Op::kNeg, x), [](Node* n) { n->op = static_cast<Op>(200); }},
      {"unknown dtype", g.add_unary(Op::kNeg, x), [](Node* n) { n->dtype = static_cast<DType>(9); }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Node node = node_of(g, c.id);
    c.corrupt(&node);
    std::vector<const HostArray*> operands(node.operands.size(), &a);
    EXPECT_EQ(run_kernel(node, operands).status().code(), absl::StatusCode::kInvalidArgument);
  }
  Node iota = node_of(g, g.add_iota(DType::kI32, {3}, 0));
  iota.attrs<IotaAttrs>().dimension = 1;
  EXPECT_EQ(run_kernel(iota, {}).status().code(), absl::StatusCode::kInvalidArgument);
}

// ---- BLAS ------------------------------------------------------------------------------------

TEST(Blas, KernelNameIsReported) {
  const std::string name = blas_kernel_name();
  EXPECT_FALSE(name.empty());
  std::cout << "[ blas     ] OpenBLAS kernel " << name << ", CPU AVX-512F: " << (cpu_supports_avx512() ? "yes" : "no")
            << "\n";
}

// ---- uint32 and randomness --------------------------------------------------------------------

// random_bits of `key` at one 64-bit counter, both words.
std::pair<uint32_t, uint32_t> threefry_at(uint32_t k0, uint32_t k1, uint64_t counter) {
  Graph g;
  const Node node = node_of(
      g, g.add_random_bits(g.add_parameter(DType::kU32, {2}), g.add_parameter(DType::kI64, {}), {}, /*words=*/true));
  const HostArray key = HostArray::from_vector<uint32_t>({2}, {k0, k1});
  const HostArray c = HostArray::from_vector<int64_t>({}, {static_cast<int64_t>(counter)});
  const HostArray out = run(node, {&key, &c});
  return {out.values<uint32_t>()[0], out.values<uint32_t>()[1]};
}

TEST(Kernels, RandomBitsAreThreefry2x32KnownAnswers) {
  struct Case {
    uint32_t k0, k1, x0, x1, w0, w1;
  };
  const std::vector<Case> cases = {
      // Random123's known answers, as jax tests/random_test.py testThreefry2x32 asserts them.
      {0, 0, 0, 0, 0x6b200159, 0x99ba4efe},
      {0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0x1cb996fc, 0xbb002be7},
      {0x13198a2e, 0x03707344, 0x243f6a88, 0x85a308d3, 0xc4923a9c, 0x483df7a0},
      // testPRNGValues: fold_in(PRNGKey(0), 4) is [2285895361, 433833334], and the rows of its
      // (original-layout) split(PRNGKey(0), 4) are the words of the counters (i, i + 4).
      {0, 0, 0, 4, 2285895361u, 433833334u},
      {0, 0, 1, 5, 1501764800u, 4221794875u},
      {0, 0, 2, 6, 1518642379u, 839183663u},
      {0, 0, 3, 7, 4090693311u, 3740430601u},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat("key ", c.k0, ",", c.k1, " counter ", c.x0, ",", c.x1));
    const auto [w0, w1] = threefry_at(c.k0, c.k1, (uint64_t{c.x0} << 32) | c.x1);
    EXPECT_EQ(w0, c.w0);
    EXPECT_EQ(w1, c.w1);
  }
}

TEST(Kernels, RandomBitsOfABlockAreTheWholeArraysBits) {
  const HostArray key = HostArray::from_vector<uint32_t>({2}, {0, 42});
  const HostArray zero = HostArray::from_vector<int64_t>({}, {0});
  Graph g;
  const int k = g.add_parameter(DType::kU32, {2}), c = g.add_parameter(DType::kI64, {});
  const HostArray whole = run(node_of(g, g.add_random_bits(k, c, {6, 10}, false)), {&key, &zero});
  const HostArray words = run(node_of(g, g.add_random_bits(k, c, {6, 10}, true)), {&key, &zero});
  ASSERT_EQ(words.shape(), (Shape{6, 10, 2}));
  // The xor of the two words at each flat index.
  for (int64_t i = 0; i < 60; ++i) {
    const auto [w0, w1] = threefry_at(0, 42, static_cast<uint64_t>(i));
    ASSERT_EQ(whole.values<uint32_t>()[i], w0 ^ w1) << i;
    ASSERT_EQ(words.values<uint32_t>()[2 * i], w0) << i;
    ASSERT_EQ(words.values<uint32_t>()[2 * i + 1], w1) << i;
  }
  // A (3, 5) block at (3, 5) of the (6, 10) array counts from its first element, 35.
  Node block = node_of(g, g.add_random_bits(k, c, {6, 10}, false));
  block.shape = {3, 5};
  const HostArray first = HostArray::from_vector<int64_t>({}, {35});
  const HostArray got = run(block, {&key, &first});
  for (int64_t r = 0; r < 3; ++r) {
    for (int64_t j = 0; j < 5; ++j) {
      EXPECT_EQ(got.values<uint32_t>()[r * 5 + j], whole.values<uint32_t>()[(3 + r) * 10 + 5 + j]) << r << "," << j;
    }
  }
  EXPECT_EQ(g.add_random_bits(c, c, {2}, false).status(),
            absl::InvalidArgumentError(
                "random_bits of (2,): the key is i64[]; it must be uint32[2] (or uint32[batch..., 2])"));
}

// A batch of keys (vmap's form of the op; JAX's random_bits_p over keys of any shape,
// jax/_src/random/prng.py): each key's bits at its own counter, batch dimensions first,
// equal to the op run on that key alone; a block of the counted dimensions counts from the
// counter as the single key's block does.
TEST(Kernels, RandomBitsOfABatchOfKeysAreEachKeysOwnBits) {
  const HostArray keys = HostArray::from_vector<uint32_t>({2, 3, 2}, {0, 42, 1, 2, 7, 7, 0xFFFFFFFFu, 0, 5, 9, 3, 1});
  const HostArray counters = HostArray::from_vector<int64_t>({2, 3}, {0, 3, 4294967295, 0, 1, 1LL << 40});
  Graph g;
  const int k = g.add_parameter(DType::kU32, {2, 3, 2}), c = g.add_parameter(DType::kI64, {2, 3});
  const int k1 = g.add_parameter(DType::kU32, {2}), c1 = g.add_parameter(DType::kI64, {});
  for (bool words : {false, true}) {
    const Node batched = node_of(g, g.add_random_bits(k, c, {4, 5}, words));
    ASSERT_EQ(batched.shape, words ? (Shape{2, 3, 4, 5, 2}) : (Shape{2, 3, 4, 5}));
    const HostArray got = run(batched, {&keys, &counters});
    Node block = batched;  // a (2, 3) block at (0, 0) of each key's (4, 5)
    block.shape[2] = 2;
    block.shape[3] = 3;
    const HostArray got_block = run(block, {&keys, &counters});
    const Node one = node_of(g, g.add_random_bits(k1, c1, {4, 5}, words));
    const int64_t per_key = words ? 40 : 20;
    for (int64_t i = 0; i < 6; ++i) {
      const HostArray key =
          HostArray::from_vector<uint32_t>({2}, {keys.values<uint32_t>()[2 * i], keys.values<uint32_t>()[2 * i + 1]});
      const HostArray counter = HostArray::from_vector<int64_t>({}, {counters.values<int64_t>()[i]});
      const HostArray alone = run(one, {&key, &counter});
      const std::vector<uint32_t> want(alone.values<uint32_t>().begin(), alone.values<uint32_t>().end());
      const std::vector<uint32_t> have(got.values<uint32_t>().begin() + i * per_key,
                                       got.values<uint32_t>().begin() + (i + 1) * per_key);
      EXPECT_EQ(have, want) << "key " << i << (words ? " words" : "");
      const int64_t w = words ? 2 : 1;
      for (int64_t r = 0; r < 2; ++r) {
        for (int64_t j = 0; j < 3 * w; ++j) {
          EXPECT_EQ(got_block.values<uint32_t>()[i * 6 * w + r * 3 * w + j], want[r * 5 * w + j])
              << "key " << i << " block " << r << "," << j;
        }
      }
    }
  }
  // Spot values of the independent threefry: key (0, 42) at counters 0.. and key (1, 2) at 3...
  const HostArray bits = run(node_of(g, g.add_random_bits(k, c, {4, 5}, false)), {&keys, &counters});
  const auto [a0, a1] = threefry_at(0, 42, 7);
  EXPECT_EQ(bits.values<uint32_t>()[7], a0 ^ a1);
  const auto [b0, b1] = threefry_at(1, 2, 3 + 19);
  EXPECT_EQ(bits.values<uint32_t>()[20 + 19], b0 ^ b1);
  EXPECT_EQ(g.add_random_bits(k, c1, {2}, false).status(),
            absl::InvalidArgumentError("random_bits of (2,): the counter is i64[]; it must be i64[2,3], one per key"));
}

TEST(Kernels, ShiftRightLogicalShiftsInZeros) {
  Graph g;
  const Node i32 = node_of(
      g, g.add_binary(Op::kShiftRightLogical, g.add_parameter(DType::kI32, {5}), g.add_parameter(DType::kI32, {5})));
  const HostArray x = HostArray::from_vector<int32_t>({5}, {-1, -8, 64, 7, -1});
  const HostArray by = HostArray::from_vector<int32_t>({5}, {28, 1, 3, 32, -1});
  // lax.shift_right_logical(int32(-1), 28) == 15; a shift by 32 (or a negative one) gives 0.
  EXPECT_EQ(run(i32, {&x, &by}).values<int32_t>(), (std::vector<int32_t>{15, 2147483644, 8, 0, 0}));
  const Node u32 = node_of(
      g, g.add_binary(Op::kShiftRightLogical, g.add_parameter(DType::kU32, {3}), g.add_parameter(DType::kU32, {3})));
  const HostArray ux = HostArray::from_vector<uint32_t>({3}, {0xFFFFFFFFu, 0x80000000u, 5});
  const HostArray uby = HostArray::from_vector<uint32_t>({3}, {9, 31, 33});
  EXPECT_EQ(run(u32, {&ux, &uby}).values<uint32_t>(), (std::vector<uint32_t>{0x7FFFFFu, 1, 0}));
  EXPECT_EQ(g.add_binary(Op::kShiftRightLogical, g.add_parameter(DType::kF32, {2}), g.add_parameter(DType::kF32, {2}))
                .status(),
            absl::InvalidArgumentError("shift_right_logical: operands are f32[2]; it needs an integer dtype"));
}

TEST(Kernels, Uint32ArithmeticWrapsAndConvertsAsXla) {
  Graph g;
  const int a = g.add_parameter(DType::kU32, {4}), b = g.add_parameter(DType::kU32, {4});
  const HostArray x = HostArray::from_vector<uint32_t>({4}, {0xFFFFFFFFu, 3, 0, 10});
  const HostArray y = HostArray::from_vector<uint32_t>({4}, {2, 5, 0, 3});
  using V = std::vector<uint32_t>;
  auto binary = [&](Op op) {
    const HostArray out = run(node_of(g, g.add_binary(op, a, b)), {&x, &y});
    return V(out.values<uint32_t>().begin(), out.values<uint32_t>().end());
  };
  EXPECT_EQ(binary(Op::kAdd), (V{1, 8, 0, 13}));
  EXPECT_EQ(binary(Op::kSub), (V{0xFFFFFFFDu, 0xFFFFFFFEu, 0, 7}));
  EXPECT_EQ(binary(Op::kMul), (V{0xFFFFFFFEu, 15, 0, 30}));
  EXPECT_EQ(binary(Op::kDiv), (V{0x7FFFFFFFu, 0, 0xFFFFFFFFu, 3}));  // x / 0: all ones, as XLA
  EXPECT_EQ(binary(Op::kRem), (V{1, 3, 0, 1}));                      // x % 0 == x
  EXPECT_EQ(binary(Op::kMax), (V{0xFFFFFFFFu, 5, 0, 10}));           // unsigned order
  EXPECT_EQ(run(node_of(g, g.add_unary(Op::kNeg, a)), {&x}).values<uint32_t>(), (V{1, 0xFFFFFFFDu, 0, 0xFFFFFFF6u}));
  EXPECT_EQ(run(node_of(g, g.add_unary(Op::kSign, a)), {&x}).values<uint32_t>(), (V{1, 1, 0, 1}));
  EXPECT_EQ(run(node_of(g, g.add_convert(a, DType::kI32)), {&x}).values<int32_t>(),
            (std::vector<int32_t>{-1, 3, 0, 10}));
  EXPECT_EQ(run(node_of(g, g.add_convert(a, DType::kF64)), {&x}).values<double>(),
            (std::vector<double>{4294967295.0, 3, 0, 10}));
  // float to uint32 truncates and saturates at 0 and 2^32 - 1; NaN gives 0.
  const HostArray f = HostArray::from_vector<float>({4}, {-3.5f, 7.9f, 5e9f, std::nanf("")});
  EXPECT_EQ(run(node_of(g, g.add_convert(g.add_parameter(DType::kF32, {4}), DType::kU32)), {&f}).values<uint32_t>(),
            (V{0, 7, 0xFFFFFFFFu, 0}));
  EXPECT_EQ(promote_types(DType::kU32, DType::kI32), DType::kI64);  // jnp.promote_types
  EXPECT_EQ(promote_types(DType::kBool, DType::kU32), DType::kU32);
  EXPECT_EQ(promote_types(DType::kU32, DType::kF32), DType::kF32);
}

TEST(Kernels, ErfInvMatchesTabulatedValuesAndInvertsErf) {
  // erfinv(0.5), erfinv(0.9), erfinv(-0.999), erfinv(0.1) to 16 digits (the published values,
  // e.g. scipy.special.erfinv's; each checked here by math.erf(y) == x in double).
  const std::vector<double> x = {0.0, 0.5, 0.9, -0.999, 0.1};
  const std::vector<double> want = {0.0, 0.4769362762044699, 1.1630871536766743, -2.3267537655135246,
                                    0.08885599049425769};
  for (DType dtype : kFloats) {
    SCOPED_TRACE(dtype_name(dtype));
    Graph g;
    const Node node = node_of(g, g.add_unary(Op::kErfInv, g.add_parameter(dtype, {5})));
    const HostArray typed = dtype == DType::kF64
                                ? HostArray::from_vector<double>({5}, x)
                                : HostArray::from_vector<float>({5}, std::vector<float>(x.begin(), x.end()));
    const HostArray out = run(node, {&typed});
    for (size_t i = 0; i < x.size(); ++i) {
      const double got = dtype == DType::kF32 ? out.values<float>()[i] : out.values<double>()[i];
      EXPECT_NEAR(got, want[i], (dtype == DType::kF32 ? 3e-6 : 1e-14) * std::max(1.0, std::abs(want[i])))
          << "erf_inv(" << x[i] << ")";
    }
    // erf(erf_inv(v)) == v across (-1, 1), the tails included; +-1 give +-inf, beyond NaN.
    std::vector<double> grid;
    for (double v = -0.9999; v < 1; v += 0.0137) grid.push_back(v);
    for (double v : {1 - 1e-6, -(1 - 1e-9), 1.0, -1.0, 1.5}) grid.push_back(v);
    const HostArray in = dtype == DType::kF64
                             ? HostArray::from_vector<double>({static_cast<int64_t>(grid.size())}, grid)
                             : HostArray::from_vector<float>({static_cast<int64_t>(grid.size())},
                                                             std::vector<float>(grid.begin(), grid.end()));
    const HostArray inverse = run(node_of(g, g.add_unary(Op::kErfInv, g.add_parameter(dtype, in.shape()))), {&in});
    for (int64_t i = 0; i < in.size(); ++i) {
      const double v = in.element_as_double(i), y = inverse.element_as_double(i);
      if (std::abs(v) > 1) {
        EXPECT_TRUE(std::isnan(y)) << v;
      } else if (std::abs(v) == 1) {
        EXPECT_EQ(y, v * std::numeric_limits<double>::infinity());
      } else if (dtype == DType::kF64) {
        EXPECT_NEAR(std::erf(y), v, 4e-16) << v;
      } else {
        EXPECT_NEAR(std::erf(y), v, 4e-7) << v;
      }
    }
  }
}

}  // namespace
}  // namespace tessera
