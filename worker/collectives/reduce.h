// Elementwise reductions used by all_reduce and reduce_scatter.
//
//   reduce_into(DType::kF32, ReduceOp::kSum, acc, in, n);   // acc[i] = acc[i] + in[i]
#ifndef TESSERA_WORKER_COLLECTIVES_REDUCE_H_
#define TESSERA_WORKER_COLLECTIVES_REDUCE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/collective.h"
#include "core/dtype.h"

namespace tessera {

// acc[i] = op(acc[i], in[i]) for i < n elements of `dtype`.
void reduce_into(DType dtype, ReduceOp op, std::byte* acc, const std::byte* in, int64_t n);

}  // namespace tessera

#endif  // TESSERA_WORKER_COLLECTIVES_REDUCE_H_
