// The distributed-arrays notebook's MLP (784 -> 1024 -> 1024 -> 1024 -> 10, relu, squared
// error, batch 1024) as one value_and_grad + SGD step, under three layouts of its parameters:
// data parallelism (replicated), FSDP as JAX users write it (every parameter P('data', None))
// and FSDP with each weight pinned to P() before use (the hand-written plan that gathers
// weights). Shared by bench_compile (bytes from the compiler's accounting, no workers) and
// bench_fsdp (step times on Client::local(8)); issue 14 item 6's goal is automatic FSDP moving
// at most 1.2x the bytes of the pinned one.
//
//   TracedFunction step = fsdp_mlp_step(mesh, FsdpLayout::kAuto);
//   jit(step)(args)   // args laid out by fsdp_mlp_specs(FsdpLayout::kAuto), typed fsdp_mlp_types()
#ifndef TESSERA_BENCH_FSDP_MLP_H_
#define TESSERA_BENCH_FSDP_MLP_H_

#include <vector>

#include "tessera/grad.h"
#include "tessera/trace.h"

namespace tessera {

enum class FsdpLayout { kDataParallel, kPinned, kAuto };

inline const char* fsdp_layout_name(FsdpLayout layout) {
  switch (layout) {
    case FsdpLayout::kDataParallel:
      return "dp";
    case FsdpLayout::kPinned:
      return "fsdp_pinned";
    case FsdpLayout::kAuto:
      break;
  }
  return "fsdp_auto";
}

inline constexpr int64_t kFsdpBatch = 1024;

// w0, b0, w1, b1, w2, b2, w3, b3, x, y.
inline std::vector<ArrayType> fsdp_mlp_types() {
  const std::vector<int64_t> widths = {784, 1024, 1024, 1024, 10};
  std::vector<ArrayType> types;
  for (size_t l = 0; l + 1 < widths.size(); ++l) {
    types.push_back({DType::kF32, {widths[l], widths[l + 1]}});
    types.push_back({DType::kF32, {widths[l + 1]}});
  }
  types.push_back({DType::kF32, {kFsdpBatch, 784}});
  types.push_back({DType::kF32, {kFsdpBatch, 10}});
  return types;
}

// The batch over 'data'; parameters replicated (dp) or their first dimension over 'data' (the
// last bias, 10 wide, does not split 8 ways and stays replicated).
inline std::vector<PartitionSpec> fsdp_mlp_specs(FsdpLayout layout) {
  const bool dp = layout == FsdpLayout::kDataParallel;
  std::vector<PartitionSpec> specs;
  for (int l = 0; l < 4; ++l) {
    specs.push_back(dp ? P() : P("data", None));
    specs.push_back(dp || l == 3 ? P() : P("data"));
  }
  specs.push_back(P("data", None));
  specs.push_back(P("data", None));
  return specs;
}

// Returns {loss, updated parameters...}.
inline TracedFunction fsdp_mlp_step(const Mesh& mesh, FsdpLayout layout) {
  const bool pin = layout == FsdpLayout::kPinned;
  return [mesh, pin](const std::vector<Value>& in) {
    auto loss = [mesh, pin](const std::vector<Value>& p) {
      Value h = p[8];
      for (int l = 0; l < 4; ++l) {
        Value w = pin ? with_sharding_constraint(p[2 * l], NamedSharding(mesh, P())) : p[2 * l];
        h = matmul(h, w) + p[2 * l + 1];
        if (l < 3) h = maximum(h, h * 0.0);
      }
      const Value d = h - p[9];
      return std::vector<Value>{sum(d * d) / static_cast<double>(kFsdpBatch)};
    };
    std::vector<Value> vg = value_and_grad(loss, {0, 1, 2, 3, 4, 5, 6, 7})(in);
    std::vector<Value> out = {vg[0]};
    for (int i = 0; i < 8; ++i) out.push_back(in[i] - vg[i + 1] * 0.01);
    return out;
  };
}

}  // namespace tessera

#endif  // TESSERA_BENCH_FSDP_MLP_H_
