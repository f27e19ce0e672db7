// run_kernel: checks that the operands are what the node says they are, by the op's type rule
// (core/op.h), then runs the kernel its family registered (worker/kernels/internal.h).
//
// The node may have come over the wire, so nothing about it is trusted: the type rule checks
// every attribute the kernels index with against the operands before any arithmetic runs, and
// the result type must be the one the rule gives.
#include "worker/kernels/kernels.h"

#include <cstdint>
#include <new>
#include <string>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status.h"
#include "worker/kernels/internal.h"

namespace tessera {
namespace {

bool is_known(DType d) { return static_cast<uint8_t>(d) <= static_cast<uint8_t>(kLastDType); }

// INVALID_ARGUMENT "<op>: <message>".
template <typename... Args>
absl::Status error(const Node& node, const Args&... args) {
  return absl::InvalidArgumentError(absl::StrCat(op_name(node.op), ": ", args...));
}

// The registry: every family's kernels, by (op, backend).
struct Registry {
  internal::KernelFn cpu[kNumOps] = {};
  Registry() {
    for (absl::Span<const internal::KernelEntry> family :
         {internal::elementwise_kernels(), internal::layout_kernels(), internal::reduction_kernels(),
          internal::dot_kernels(), internal::indexing_kernels()}) {
      for (const internal::KernelEntry& k : family) cpu[static_cast<int>(k.op)] = k.fn;
    }
  }
};

absl::Status check_node(const Node& node, const std::vector<const HostArray*>& xs) {
  if (!is_op(node.op))
    return absl::InvalidArgumentError(absl::StrCat("run_kernel: unknown op ", static_cast<int>(node.op)));
  if (node.op == Op::kParameter) {
    return error(node, "has no kernel: a parameter's value is an input of the program, not computed");
  }
  if (internal::find_kernel(node.op) == nullptr) return error(node, "has no kernel");
  absl::InlinedVector<ArrayType, 4> in;  // no outer vector for the usual arities (each shape still is)
  for (size_t i = 0; i < xs.size(); ++i) {
    if (xs[i] == nullptr) return error(node, "operand ", i, " is null");
    if (!is_known(xs[i]->dtype())) return error(node, "operand ", i, " has an unknown dtype");
    in.push_back({xs[i]->dtype(), xs[i]->shape()});
  }
  if (!is_known(node.dtype)) return error(node, "the node has an unknown dtype");
  // The op's name as a view (is_op holds): no string is built unless the shape is refused.
  TESSERA_RETURN_IF_ERROR(validate_shape(node.shape, dtype_size(node.dtype), op_def(node.op).name));
  TESSERA_ASSIGN_OR_RETURN(ArrayType want, infer_type(node, in));
  if (want.dtype != node.dtype || want.shape != node.shape) {  // compared in place: no copy of the node's shape
    std::vector<std::string> types;
    for (const ArrayType& t : in) types.push_back(type_to_string(t.dtype, t.shape));
    return error(node, "the operands (", absl::StrJoin(types, ", "), ") give ", type_to_string(want.dtype, want.shape),
                 " but the node is ", type_to_string(node.dtype, node.shape));
  }
  return absl::OkStatus();
}

}  // namespace

namespace internal {

KernelFn find_kernel(Op op, Backend backend) {
  static const Registry* const kRegistry = new Registry();
  if (!is_op(op) || backend != Backend::kCpu) return nullptr;
  return kRegistry->cpu[static_cast<int>(op)];
}

}  // namespace internal

bool can_run_in_place(const Node& node, const HostArray& operand) {
  return can_run_in_place(node, operand.dtype(), operand.shape());
}

bool can_run_in_place(const Node& node, DType dtype, const Shape& shape) {
  return has_trait(node.op, kInPlace) && dtype == node.dtype && shape == node.shape;
}

absl::Status run_kernel_in_place(const Node& node, const std::vector<const HostArray*>& operands, int reuse) {
  TESSERA_RETURN_IF_ERROR(check_node(node, operands));
  if (reuse < 0 || reuse >= static_cast<int>(operands.size()) || !can_run_in_place(node, *operands[reuse])) {
    return error(node, "cannot write its result over operand ", reuse);
  }
  // The storage is a heap block separate from the (possibly const) HostArray object: writing
  // it is defined; the caller guarantees nobody else reads it.
  return internal::find_kernel(node.op)(node, operands, const_cast<std::byte*>(operands[reuse]->data())).status();
}

absl::StatusOr<HostArray> run_kernel(const Node& node, const std::vector<const HostArray*>& operands) {
  TESSERA_RETURN_IF_ERROR(check_node(node, operands));
  try {
    return internal::find_kernel(node.op)(node, operands, nullptr);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(op_name(node.op), ": out of memory for the result ",
                                                     type_to_string(node.dtype, node.shape), " or its temporaries"));
  }
}

}  // namespace tessera
