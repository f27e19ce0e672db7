// tessera::random: JAX's threefry2x32 PRNG (jax/_src/random/threefry2x32.py, core.py) traced
// from ops. The hash and the counters are the random_bits op's (core/op.h); everything here is
// the arithmetic JAX puts around it.
#include "tessera/random.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "client/trace_state.h"

namespace tessera::random {
namespace {

using internal::TraceState;

// The random_bits op of `key` over `shape`, counting from `counter` (an int64 scalar).
Value random_bits(const Value& key, const Value& counter, Shape shape, bool words) {
  TraceState* t = TraceState::common({&key, &counter});
  if (t == nullptr) return Value();
  return t->make(t->graph.add_random_bits(TraceState::id(key), TraceState::id(counter), std::move(shape), words));
}

Value counter_zero() { return full({}, 0, DType::kI64); }

Value fail(const Value& like, const std::string& message) {
  TraceState* t = TraceState::common({&like});
  return t == nullptr ? Value() : t->fail(absl::InvalidArgumentError(message));
}

// [hi, lo] as a key.
Value pair(const Value& hi, const Value& lo) {
  return concatenate({reshape(convert(hi, DType::kU32), {1}), reshape(convert(lo, DType::kU32), {1})}, 0);
}

// Word w (0 or 1) of every key of uint32[shape + (2,)].
Value word(const Value& words, int64_t w) {
  std::vector<int64_t> start(words.rank(), 0), limit = words.shape();
  start.back() = w;
  limit.back() = w + 1;
  Shape shape = words.shape();
  shape.pop_back();
  return reshape(slice(words, std::move(start), std::move(limit)), std::move(shape));
}

}  // namespace

Value key(int64_t seed) {
  const uint64_t bits = static_cast<uint64_t>(seed);
  return pair(full({}, static_cast<double>(bits >> 32), DType::kU32),
              full({}, static_cast<double>(bits & 0xFFFFFFFFu), DType::kU32));
}

Value key(const Value& seed) {
  if (!seed.ok()) return Value();
  const DType d = seed.dtype();
  if (seed.rank() != 0 || is_floating(d) || d == DType::kBool) {
    return fail(seed, absl::StrCat("random::key: the seed is ", type_to_string(d, seed.shape()),
                                   "; it must be an integer scalar"));
  }
  const Value hi = d == DType::kI64 ? shift_right_logical(seed, full({}, 32, DType::kI64)) : full({}, 0, DType::kU32);
  return pair(hi, seed);
}

Value split(const Value& key, int64_t num) { return split(key, Shape{num}); }

Value split(const Value& key, Shape shape) { return random_bits(key, counter_zero(), std::move(shape), true); }

Value fold_in(const Value& key, const Value& data) {
  if (!data.ok()) return Value();
  if (data.rank() != 0 || is_floating(data.dtype()) || data.dtype() == DType::kBool) {
    return fail(data, absl::StrCat("random::fold_in: data is ", type_to_string(data.dtype(), data.shape()),
                                   "; it must be an integer scalar"));
  }
  // threefry_seed of a uint32: the counter (0, data).
  return random_bits(key, convert(convert(data, DType::kU32), DType::kI64), {}, true);
}

Value fold_in(const Value& key, int64_t data) {
  return random_bits(key, full({}, static_cast<double>(static_cast<uint32_t>(data)), DType::kI64), {}, true);
}

Value key_at(const Value& keys, int64_t i) { return reshape(slice(keys, {i, 0}, {i + 1, 2}), {2}); }

Value bits(const Value& key, Shape shape) { return random_bits(key, counter_zero(), std::move(shape), false); }

Value uniform(const Value& key, Shape shape, DType dtype, double minval, double maxval) {
  if (!key.ok()) return Value();
  Value floats;
  double lo = minval, span = maxval - minval;
  if (dtype == DType::kF32) {
    // JAX: bitcast((bits >> 9) | bits(1.0f)) - 1.0f, which is exactly (bits >> 9) * 2^-23.
    const Value b = bits(key, shape);
    floats = convert(shift_right_logical(b, full(shape, 9, DType::kU32)), DType::kF32) * 0x1p-23;
    // minval and maxval are converted to float32 first and subtracted there, as in JAX.
    lo = static_cast<float>(minval);
    span = static_cast<float>(maxval) - static_cast<float>(minval);
  } else if (dtype == DType::kF64) {
    // JAX's 64 random bits are (word0 << 32) | word1; their top 52 as a mantissa in [1, 2),
    // minus 1: word0 * 2^-32 + (word1 >> 12) * 2^-52, exactly.
    const Value w = random_bits(key, counter_zero(), shape, true);
    floats = convert(word(w, 0), DType::kF64) * 0x1p-32 +
             convert(shift_right_logical(word(w, 1), full(shape, 12, DType::kU32)), DType::kF64) * 0x1p-52;
  } else {
    return fail(key, absl::StrCat("random::uniform: dtype ", dtype_name(dtype), " is not float32 or float64"));
  }
  return maximum(full(shape, lo, dtype), floats * span + lo);
}

Value normal(const Value& key, Shape shape, DType dtype) {
  if (dtype != DType::kF32 && dtype != DType::kF64) {
    return fail(key, absl::StrCat("random::normal: dtype ", dtype_name(dtype), " is not float32 or float64"));
  }
  const double lo = dtype == DType::kF32 ? std::nextafter(-1.0f, 0.0f) : std::nextafter(-1.0, 0.0);
  return erf_inv(uniform(key, std::move(shape), dtype, lo, 1.0)) * std::sqrt(2.0);
}

Value truncated_normal(const Value& key, double lower, double upper, Shape shape, DType dtype) {
  double a, b, above, below;  // erf of the bounds over sqrt(2), and the open interval's ends
  if (dtype == DType::kF32) {
    const float sqrt2 = static_cast<float>(std::sqrt(2.0)), l = static_cast<float>(lower),
                u = static_cast<float>(upper);
    a = std::erf(l / sqrt2);
    b = std::erf(u / sqrt2);
    above = std::nextafter(l, std::numeric_limits<float>::infinity());
    below = std::nextafter(u, -std::numeric_limits<float>::infinity());
  } else if (dtype == DType::kF64) {
    a = std::erf(lower / std::sqrt(2.0));
    b = std::erf(upper / std::sqrt(2.0));
    above = std::nextafter(lower, std::numeric_limits<double>::infinity());
    below = std::nextafter(upper, -std::numeric_limits<double>::infinity());
  } else {
    return fail(key, absl::StrCat("random::truncated_normal: dtype ", dtype_name(dtype), " is not float32 or float64"));
  }
  const Value out = erf_inv(uniform(key, shape, dtype, a, b)) * std::sqrt(2.0);
  return clamp(full({}, above, dtype), out, full({}, below, dtype));
}

Value bernoulli(const Value& key, double p, Shape shape) { return uniform(key, std::move(shape)) < p; }

Value bernoulli(const Value& key, const Value& p, Shape shape) {
  if (!p.ok()) return Value();
  if (!is_floating(p.dtype())) {
    return fail(p, absl::StrCat("random::bernoulli: p is ", type_to_string(p.dtype(), p.shape()),
                                "; it must have a floating dtype"));
  }
  return uniform(key, std::move(shape), p.dtype()) < p;
}

Value categorical(const Value& key, const Value& logits, int64_t axis) {
  if (!logits.ok()) return Value();
  if (!is_floating(logits.dtype())) {
    return fail(logits, absl::StrCat("random::categorical: logits are ", type_to_string(logits.dtype(), logits.shape()),
                                     "; they must have a floating dtype"));
  }
  const double tiny =
      logits.dtype() == DType::kF32 ? std::numeric_limits<float>::min() : std::numeric_limits<double>::min();
  const Value gumbel = -log(-log(uniform(key, logits.shape(), logits.dtype(), tiny, 1.0)));
  return argmax(gumbel + logits, axis);
}

}  // namespace tessera::random
