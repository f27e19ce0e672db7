// The digits MLP of example_mlp_train, shared with bench_compile: logits = tanh(x @ w1 + b1)
// @ w2 + b2, mean softmax cross-entropy, and one SGD training step over it.
//
//   Jitted step = jit(mlp::train_step(0.1));   // in: w1, b1, w2, b2, x, one-hot y
//   // out: the loss, then the four updated parameters
#ifndef TESSERA_EXAMPLES_MLP_MODEL_H_
#define TESSERA_EXAMPLES_MLP_MODEL_H_

#include <vector>

#include "tessera/tessera.h"

namespace tessera::mlp {

// Parameters first (w1, b1, w2, b2), then x.
inline Value logits(const std::vector<Value>& p, const Value& x) {
  return matmul(tanh(matmul(x, p[0]) + p[1]), p[2]) + p[3];
}

// Mean cross-entropy of softmax(logits) against one-hot labels: in = w1, b1, w2, b2, x, y.
inline std::vector<Value> loss(const std::vector<Value>& in) {
  const Value z = logits(in, in[4]);
  const Value shifted = z - max(z, {1}, true);
  const Value log_softmax = shifted - log(sum(exp(shifted), {1}, true));
  return {-mean(sum(in[5] * log_softmax, {1}))};
}

// The loss, its gradients with respect to the parameters, and the SGD update.
inline TracedFunction train_step(double lr) {
  return [lr](const std::vector<Value>& in) {
    std::vector<Value> vg = value_and_grad(loss, {0, 1, 2, 3})(in);
    std::vector<Value> out = {vg[0]};
    for (int i = 0; i < 4; ++i) out.push_back(in[i] - vg[i + 1] * lr);
    return out;
  };
}

}  // namespace tessera::mlp

#endif  // TESSERA_EXAMPLES_MLP_MODEL_H_
