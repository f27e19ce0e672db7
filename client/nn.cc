// tessera::nn: composites traced from the ops of trace.h (see nn.h for what each computes).
#include "tessera/nn.h"

#include <cmath>
#include <limits>

namespace tessera::nn {
namespace {

// A negative axis counts from the end; one out of range is left for the op to refuse.
int64_t normalized(const Value& x, int64_t axis) { return axis < 0 ? axis + x.rank() : axis; }

}  // namespace

Value relu(const Value& x) { return maximum(x, full({}, 0.0, x.dtype())); }

Value gelu(const Value& x, bool approximate) {
  if (approximate) {
    const double c = std::sqrt(2.0 / M_PI);
    return x * 0.5 * (tanh((x + x * x * x * 0.044715) * c) + 1.0);
  }
  return x * 0.5 * (erf(x * (1.0 / std::sqrt(2.0))) + 1.0);
}

Value silu(const Value& x) { return x * logistic(x); }

Value softmax(const Value& x, int64_t axis) {
  const int64_t a = normalized(x, axis);
  const Value e = exp(x - max(x, {a}, true));
  return e / sum(e, {a}, true);
}

Value log_softmax(const Value& x, int64_t axis) {
  const int64_t a = normalized(x, axis);
  const Value shifted = x - max(x, {a}, true);
  return shifted - log(sum(exp(shifted), {a}, true));
}

Value logsumexp(const Value& x, int64_t axis, bool keepdims) {
  const int64_t a = normalized(x, axis);
  const Value m = max(x, {a}, true);
  // Where the maximum is infinite (every term -inf, or some +inf) shift by 0 instead, so that
  // -inf - -inf does not make NaN: the result is then log(sum(exp(x))) itself, as in JAX.
  const Value finite = abs(m) < full({}, std::numeric_limits<double>::infinity(), x.dtype());
  const Value shift = where(finite, m, full({}, 0.0, x.dtype()));
  const Value out = log(sum(exp(x - shift), {a}, true)) + shift;
  return keepdims ? out : squeeze(out, {a});
}

Value one_hot(const Value& labels, int64_t num_classes, DType dtype) {
  Shape shape = labels.shape();
  shape.push_back(num_classes);
  const Value classes = iota(labels.dtype(), shape, static_cast<int64_t>(shape.size()) - 1);
  return convert(expand_dims(labels, -1) == classes, dtype);
}

Value cross_entropy(const Value& logits, const Value& labels) {
  const int64_t classes = logits.rank() > 0 ? logits.shape().back() : 0;
  return -sum(one_hot(labels, classes, logits.dtype()) * log_softmax(logits), {-1 + logits.rank()});
}

Value layer_norm(const Value& x, const Value& scale, const Value& bias, double eps) {
  const int64_t last = x.rank() - 1;
  const Value centred = x - mean(x, {last}, true);
  const Value variance = mean(centred * centred, {last}, true);
  return centred * rsqrt(variance + eps) * scale + bias;
}

Value rms_norm(const Value& x, const Value& scale, double eps) {
  const int64_t last = x.rank() - 1;
  return x * rsqrt(mean(x * x, {last}, true) + eps) * scale;
}

Value dot_product_attention(const Value& query, const Value& key, const Value& value, const std::optional<Value>& mask,
                            bool is_causal, std::optional<double> scale) {
  const Shape qs = query.shape(), ks = key.shape();
  const int64_t head = qs.size() == 4 ? qs[3] : 1;
  // (B, T, N, H) . (B, S, N, H) over H, batched over B and N: (B, N, T, S).
  Value logits = dot_general(query, key, DotDims{{0, 2}, {0, 2}, {3}, {3}}) *
                 scale.value_or(1.0 / std::sqrt(static_cast<double>(head)));
  std::optional<Value> keep = mask;
  if (is_causal && qs.size() == 4 && ks.size() == 4) {
    const Shape ts = {qs[1], ks[1]};
    const Value causal = broadcast_to(iota(DType::kI32, ts, 0) >= iota(DType::kI32, ts, 1), logits.shape());
    keep = keep ? logical_and(*keep, causal) : causal;
  }
  if (keep) {
    // JAX masks with the dtype's lowest finite value, so a row with nothing kept is uniform
    // rather than NaN.
    logits = where(*keep, logits, full({}, std::numeric_limits<float>::lowest(), logits.dtype()));
  }
  const Value weights = softmax(logits, -1);
  // (B, N, T, S) . (B, S, N, H) over S, batched over B and N: (B, N, T, H), then (B, T, N, H).
  return transpose(dot_general(weights, value, DotDims{{0, 1}, {0, 2}, {3}, {1}}), {0, 2, 1, 3});
}

}  // namespace tessera::nn
