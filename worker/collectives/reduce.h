// Elementwise reductions used by all_reduce and reduce_scatter.
//
//   reduce_into(DType::kF32, ReduceOp::kSum, acc, in, n);   // acc[i] = acc[i] + in[i]
//   reduce(DType::kF32, ReduceOp::kSum, out, a, b, n);       // out[i] = a[i] + b[i]
#ifndef TESSERA_WORKER_COLLECTIVES_REDUCE_H_
#define TESSERA_WORKER_COLLECTIVES_REDUCE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/collective.h"
#include "core/dtype.h"

namespace tessera {

// out[i] = op(a[i], b[i]) for i < n elements of `dtype`. `out` may be `a` or `b`.
void reduce(DType dtype, ReduceOp op, std::byte* out, const std::byte* a, const std::byte* b, int64_t n);

// acc[i] = op(acc[i], in[i]) for i < n elements of `dtype`.
inline void reduce_into(DType dtype, ReduceOp op, std::byte* acc, const std::byte* in, int64_t n) {
  reduce(dtype, op, acc, acc, in, n);
}

}  // namespace tessera

#endif  // TESSERA_WORKER_COLLECTIVES_REDUCE_H_
