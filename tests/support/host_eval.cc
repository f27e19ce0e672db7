#include "tests/support/host_eval.h"

#include "absl/strings/str_cat.h"
#include "worker/kernels/kernels.h"

namespace tessera {

absl::StatusOr<std::vector<HostArray>> evaluate_on_host(const Graph& graph,
                                                        const std::vector<const HostArray*>& inputs) {
  if (inputs.size() != graph.parameters().size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("evaluate_on_host: ", graph.parameters().size(), " parameters but ", inputs.size(), " inputs"));
  }
  // Every node's value is kept to the end: reference graphs are small.
  std::vector<HostArray> values(graph.size());
  for (int id = 0; id < graph.size(); ++id) {
    const Node& n = graph.node(id);
    if (n.op == Op::kParameter) {
      const HostArray* in = inputs[n.index];
      if (in == nullptr || in->dtype() != n.dtype || in->shape() != n.shape) {
        return absl::InvalidArgumentError(absl::StrCat(
            "evaluate_on_host: parameter ", n.index, " is ", type_to_string(n.dtype, n.shape), " but the input is ",
            in == nullptr ? std::string("null") : type_to_string(in->dtype(), in->shape())));
      }
      values[id] = in->clone();
      continue;
    }
    if (n.op == Op::kShardingConstraint) {  // placement only: the value is its operand's
      values[id] = values[n.operands[0]].clone();
      continue;
    }
    std::vector<const HostArray*> operands;
    for (int o : n.operands) operands.push_back(&values[o]);
    absl::StatusOr<HostArray> v = run_kernel(n, operands);
    if (!v.ok()) {
      return absl::Status(v.status().code(), absl::StrCat("evaluate_on_host: %", id, ": ", v.status().message()));
    }
    values[id] = *std::move(v);
  }
  std::vector<HostArray> out;
  for (int o : graph.outputs()) out.push_back(values[o].clone());
  return out;
}

}  // namespace tessera
