// The pybind11 binding of the client SDK (tessera._tessera), shared by its four files:
// module.cc (errors, the module), arrays.cc (Client, Mesh, shardings, Array), tracing.cc
// (Value ops, jit, grad, shard_map, the collectives), optim.cc (the optimisers). Only the
// binding includes this header.
#ifndef TESSERA_PYTHON_SRC_BINDING_H_
#define TESSERA_PYTHON_SRC_BINDING_H_

#include <pybind11/pybind11.h>

#include <exception>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tessera::python {

namespace py = pybind11;

// A failed absl::Status on its way to Python: module.cc's translator raises it as the
// exception tessera.errors maps its code to. Holds no Python object, so it may be thrown with
// the GIL released.
class StatusError : public std::exception {
 public:
  explicit StatusError(absl::Status status) : status_(std::move(status)), what_(status_.ToString()) {}
  const absl::Status& status() const { return status_; }
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  absl::Status status_;
  std::string what_;
};

inline void check(const absl::Status& status) {
  if (!status.ok()) throw StatusError(status);
}
template <typename T>
T value_or_throw(absl::StatusOr<T> result) {
  if (!result.ok()) throw StatusError(result.status());
  return *std::move(result);
}

void bind_arrays(py::module_& m);
void bind_tracing(py::module_& m);
void bind_optim(py::module_& m);  // optim.cc: tessera/optim.h for tessera/optax.py

}  // namespace tessera::python

#endif  // TESSERA_PYTHON_SRC_BINDING_H_
