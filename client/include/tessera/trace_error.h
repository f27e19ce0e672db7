// Failing a trace from the traced function itself: the C++ counterpart of raising an
// exception while JAX traces a Python function (a missing pytree entry, an option the
// arguments do not support). Ops record their own errors; this is for the function's checks.
//
//   if (in.size() < 4) {
//     fail_trace(absl::InvalidArgumentError("train_step: dropout 0.1 needs a fourth tree"));
//     return {};
//   }
#ifndef TESSERA_TRACE_ERROR_H_
#define TESSERA_TRACE_ERROR_H_

#include "absl/status/status.h"

namespace tessera {

// Records `status` as the error of the trace in progress on this thread (unless it already
// has one, whose error is kept, as for ops), so jit's call returns it; later ops record
// nothing. Does nothing for an OK status or outside a trace. Defined in client/trace.cc.
void fail_trace(const absl::Status& status);

}  // namespace tessera

#endif  // TESSERA_TRACE_ERROR_H_
