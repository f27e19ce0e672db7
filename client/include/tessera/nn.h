// tessera::nn — the composites real models are written with, as jax.nn (and optax / flax where
// jax.nn has none) names them, traced from the ops of trace.h. They work in any traced
// function, through grad and under any sharding (they are ordinary ops to the compiler).
//
//   Value p = nn::softmax(logits);                          // over the last axis
//   Value loss = mean(nn::cross_entropy(logits, labels));   // labels: integer class ids
//   Value y = nn::dot_product_attention(q, k, v, std::nullopt, /*is_causal=*/true);
//
// Axes may be negative (counted from the end), as in JAX. Float operands only, except labels.
#ifndef TESSERA_NN_H_
#define TESSERA_NN_H_

#include <optional>

#include "tessera/trace.h"

namespace tessera::nn {

// max(x, 0), as jax.nn.relu.
Value relu(const Value& x);
// jax.nn.gelu: with `approximate` (JAX's default) 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
// else the exact 0.5 x (1 + erf(x / sqrt(2))).
Value gelu(const Value& x, bool approximate = true);
// x * logistic(x), as jax.nn.silu (swish).
Value silu(const Value& x);

// jax.nn.softmax / log_softmax over `axis`, shifted by the maximum for stability.
Value softmax(const Value& x, int64_t axis = -1);
Value log_softmax(const Value& x, int64_t axis = -1);
// log(sum(exp(x), axis)), as jax.nn.logsumexp: stable, and -inf (not NaN) where every term is
// -inf.
Value logsumexp(const Value& x, int64_t axis = -1, bool keepdims = false);

// jax.nn.one_hot: float32 x.shape + (num_classes,), 1 where the class equals the label (a label
// outside [0, num_classes) gives a row of zeros, as in JAX).
Value one_hot(const Value& labels, int64_t num_classes, DType dtype = DType::kF32);
// optax.softmax_cross_entropy_with_integer_labels: -log_softmax(logits)[label] per example;
// logits (..., classes), labels (...) of an integer dtype.
Value cross_entropy(const Value& logits, const Value& labels);

// Layer normalisation over the last axis (flax.linen.LayerNorm): (x - mean) / sqrt(var + eps)
// * scale + bias, with scale and bias of the last axis' size.
Value layer_norm(const Value& x, const Value& scale, const Value& bias, double eps = 1e-6);
// RMS normalisation over the last axis (flax.linen.RMSNorm): x / sqrt(mean(x^2) + eps) * scale.
Value rms_norm(const Value& x, const Value& scale, double eps = 1e-6);

// jax.nn.dot_product_attention: query (B, T, N, H), key and value (B, S, N, H); softmax of
// q . k / sqrt(H) (or `scale`) over S, then the weighted sum of values: (B, T, N, H). `mask`, if
// given, is bool (B, N, T, S) (True keeps a position); `is_causal` keeps position s <= t.
Value dot_product_attention(const Value& query, const Value& key, const Value& value,
                            const std::optional<Value>& mask = std::nullopt, bool is_causal = false,
                            std::optional<double> scale = std::nullopt);

}  // namespace tessera::nn

#endif  // TESSERA_NN_H_
