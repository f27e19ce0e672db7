// tessera._tessera: the extension module. Status errors become the exceptions of
// tessera/errors.py (ValueError for INVALID_ARGUMENT, RuntimeError subclasses for the rest,
// each with the code's name as `.code`), raised with the C++ message.
#include "absl/strings/str_cat.h"
#include "python/src/binding.h"

namespace tessera::python {
namespace {

void translate(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const StatusError& e) {
    const absl::Status& s = e.status();
    py::object error = py::module_::import("tessera.errors")
                           .attr("from_status")(absl::StatusCodeToString(s.code()), std::string(s.message()));
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
  }
}

}  // namespace

PYBIND11_MODULE(_tessera, m) {
  m.doc() = "The Tessera client SDK (C++), bound for the tessera package; use tessera, not this module.";
  py::register_exception_translator(&translate);
  bind_arrays(m);
  bind_tracing(m);
  bind_optim(m);
}

}  // namespace tessera::python
