// Clients, meshes, shardings and arrays: tessera._tessera's half that moves data. numpy
// arrays go to device_put as HostViews (read in place) and come back from fetch written in
// place (Array::fetch_into) or, for a shard, as the HostArray the SDK returns, owned by the
// numpy array (no copy). Every call that waits on the cluster releases the GIL.
#include <pybind11/numpy.h>
#include <pybind11/operators.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/explicit_axes_check.h"
#include "python/src/binding.h"
#include "tessera/tessera.h"

namespace tessera::python {
namespace {

py::dtype numpy_dtype(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return py::dtype::of<float>();
    case DType::kF64:
      return py::dtype::of<double>();
    case DType::kI32:
      return py::dtype::of<int32_t>();
    case DType::kI64:
      return py::dtype::of<int64_t>();
    case DType::kBool:
      return py::dtype::of<bool>();
    case DType::kU32:
      return py::dtype::of<uint32_t>();
    case DType::kF16:
      return py::dtype("float16");  // numpy's own: the same IEEE binary16 bits, no copy
    case DType::kU8:
      return py::dtype::of<uint8_t>();
    case DType::kI8:
      return py::dtype::of<int8_t>();
    case DType::kI16:
      return py::dtype::of<int16_t>();
    case DType::kBF16:
      break;
  }
  // numpy has no bfloat16 (ml_dtypes, which adds one, is not a dependency).
  throw StatusError(absl::InvalidArgumentError(
      "bfloat16 has no numpy dtype without ml_dtypes, which Tessera's Python package does not use: bfloat16 arrays "
      "are not supported from Python (the C++ SDK has them)"));
}

// The DType of a numpy array; INVALID_ARGUMENT naming numpy's dtype for one Tessera lacks.
DType dtype_of_numpy(const py::array& a) {
  for (DType d : kAllDTypes) {
    if (d == DType::kBF16) continue;  // no numpy dtype
    if (a.dtype().is(numpy_dtype(d)) || a.dtype().equal(numpy_dtype(d))) return d;
  }
  throw StatusError(absl::InvalidArgumentError(absl::StrCat(
      "device_put: numpy dtype ", std::string(py::str(a.dtype())),
      " is not one of Tessera's (float32, float64, int32, int64, bool, uint32, float16, uint8, int8, int16; "
      "bfloat16 is made on the devices with astype)")));
}

Shape shape_of(const py::array& a) { return Shape(a.shape(), a.shape() + a.ndim()); }

// A numpy array owning `host` (moved to the heap; freed with the numpy array).
py::array to_numpy(HostArray host) {
  auto* owned = new HostArray(std::move(host));
  py::capsule base(owned, [](void* p) { delete static_cast<HostArray*>(p); });
  return py::array(numpy_dtype(owned->dtype()), owned->shape(), owned->data(), base);
}

// Waits for `arrays` with the GIL released, in slices short enough that a pending signal
// (Ctrl-C: KeyboardInterrupt) ends the wait within ~0.1 s by raising its exception here. The
// calls themselves go on on the cluster; their arrays become ready (or fail) as without it.
void wait_interruptibly(const std::vector<Array>& arrays) {
  for (const Array& a : arrays) {
    while (true) {
      bool ready;
      {
        py::gil_scoped_release release;
        ready = a.await_ready(absl::Milliseconds(100));
      }
      if (ready) break;
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
  }
}

py::array fetch(const Array& array) {
  wait_interruptibly({array});
  py::array out(numpy_dtype(array.dtype()), array.shape());
  MutableHostView view{array.dtype(), array.shape(), out.mutable_data()};
  absl::Status status;
  {
    py::gil_scoped_release release;
    status = array.fetch_into(view);
  }
  check(status);
  return out;
}

Array device_put(const Client& client, const py::array& host, const NamedSharding& sharding) {
  if (!(host.flags() & py::array::c_style)) {
    throw StatusError(absl::InvalidArgumentError("device_put: the numpy array must be C-contiguous"));
  }
  HostView view{dtype_of_numpy(host), shape_of(host), host.data()};
  py::gil_scoped_release release;  // `host` stays referenced by the caller's frame
  return value_or_throw(client.device_put(view, sharding));
}

// Client::array (jnp.array): uncommitted, on the default device.
Array uncommitted_array(const Client& client, const py::array& host) {
  if (!(host.flags() & py::array::c_style)) {
    throw StatusError(absl::InvalidArgumentError("array: the numpy array must be C-contiguous"));
  }
  HostView view{dtype_of_numpy(host), shape_of(host), host.data()};
  py::gil_scoped_release release;  // `host` stays referenced by the caller's frame
  return value_or_throw(client.array(view));
}

py::tuple index_tuple(const Index& index) {
  py::tuple t(index.size());
  for (size_t d = 0; d < index.size(); ++d) t[d] = py::make_tuple(index[d].start, index[d].stop);
  return t;
}

}  // namespace

void bind_arrays(py::module_& m) {
  py::enum_<DType>(m, "DType")
      .value("float32", DType::kF32)
      .value("float64", DType::kF64)
      .value("int32", DType::kI32)
      .value("int64", DType::kI64)
      .value("bool", DType::kBool)
      .value("uint32", DType::kU32)
      .value("bfloat16", DType::kBF16)
      .value("float16", DType::kF16)
      .value("uint8", DType::kU8)
      .value("int8", DType::kI8)
      .value("int16", DType::kI16);
  m.def("numpy_dtype", &numpy_dtype);
  m.def("promote_types", &promote_types);

  py::class_<Device>(m, "Device")
      .def_readonly("id", &Device::id)
      .def_readonly("address", &Device::address)
      .def_readonly("alive", &Device::alive)
      .def_readonly("draining", &Device::draining);

  py::enum_<AxisType>(m, "AxisType")
      .value("Auto", AxisType::kAuto)
      .value("Explicit", AxisType::kExplicit)
      .value("Manual", AxisType::kManual);

  py::class_<Mesh>(m, "Mesh")
      .def(py::init([](std::vector<int64_t> shape, std::vector<std::string> names, std::vector<int> ids,
                       std::vector<AxisType> types) {
             return value_or_throw(Mesh::create(std::move(shape), std::move(names), std::move(ids), std::move(types)));
           }),
           py::arg("shape"), py::arg("names"), py::arg("ids"), py::arg("types") = std::vector<AxisType>{})
      .def_property_readonly("shape", &Mesh::shape)
      .def_property_readonly("axis_types", &Mesh::axis_types)
      .def_property_readonly("axis_names", &Mesh::axis_names)
      .def_property_readonly("device_ids", &Mesh::device_ids)
      .def("__repr__", &Mesh::to_string)
      .def("abstract_mesh", &Mesh::abstract_mesh)
      .def(py::self == py::self);

  // jax.sharding.AbstractMesh, and get_abstract_mesh() with Python's ambient mesh (set_mesh)
  // as this thread's for the question (tessera/mesh_context.h).
  py::class_<AbstractMesh>(m, "AbstractMesh")
      .def(py::init<std::vector<int64_t>, std::vector<std::string>, std::vector<AxisType>>())
      .def_property_readonly("axis_sizes", &AbstractMesh::axis_sizes)
      .def_property_readonly("axis_names", &AbstractMesh::axis_names)
      .def_property_readonly("axis_types", &AbstractMesh::axis_types)
      .def("__repr__", &AbstractMesh::to_string)
      .def(py::self == py::self);
  m.def("get_abstract_mesh", [](std::optional<Mesh> ambient) {
    std::optional<MeshScope> scope;
    if (ambient) scope.emplace(*std::move(ambient));
    return get_abstract_mesh();
  });
  // The rule of reshard's and out_sharding's specs (Explicit axes only) for the calls Python
  // makes itself outside a trace (a creation function's placement, reshard of an Array).
  m.def("check_explicit_axes", [](const std::string& api, const PartitionSpec& spec, const Mesh& mesh) {
    check(internal::check_explicit_axes(api, spec, mesh));
  });
  m.def("check_explicit_axes", [](const std::string& api, const PartitionSpec& spec, const AbstractMesh& in_force) {
    check(internal::check_explicit_axes(api, spec, in_force));
  });
  // explicit_axes' rule for its in_sharding of argument i, for Python's eager explicit_axes
  // (the traced one checks it in the SDK).
  m.def("check_explicit_axes_in_sharding",
        [](size_t i, DType dtype, Shape shape, const PartitionSpec& spec, const Mesh& inner) {
          check(internal::check_explicit_axes_in_sharding(i, {dtype, std::move(shape)}, spec, inner));
        });

  py::class_<PartitionSpec>(m, "PartitionSpec")
      .def(py::init<std::vector<Axes>>())
      // P(..., unreduced={...}, reduced={...}): JAX's construction checks raise ValueError.
      .def(py::init([](std::vector<Axes> dims, std::vector<std::string> unreduced, std::vector<std::string> reduced) {
        PartitionSpec spec(std::move(dims), std::move(unreduced), std::move(reduced));
        absl::Status valid = spec.check();
        if (!valid.ok()) throw py::value_error(std::string(valid.message()));
        return spec;
      }))
      .def_property_readonly("dims", &PartitionSpec::dims)
      .def_property_readonly("unreduced", &PartitionSpec::unreduced)
      .def_property_readonly("reduced", &PartitionSpec::reduced)
      .def("__repr__", &PartitionSpec::to_string)
      .def(py::self == py::self);

  py::class_<NamedSharding>(m, "NamedSharding")
      .def(py::init<Mesh, PartitionSpec>())
      .def_property_readonly("mesh", &NamedSharding::mesh)
      .def_property_readonly("spec", &NamedSharding::spec)
      .def("validate", [](const NamedSharding& s, const Shape& shape) { check(s.validate(shape)); })
      .def("shard_shape",
           [](const NamedSharding& s, const Shape& shape) {
             check(s.validate(shape));
             return s.shard_shape(shape);
           })
      // (device id, index as ((start, stop), ...), replica id) per device, in mesh order.
      .def("device_shards",
           [](const NamedSharding& s, const Shape& shape) {
             check(s.validate(shape));
             py::list out;
             for (const DeviceShard& d : s.device_shards(shape)) {
               out.append(py::make_tuple(d.device_id, index_tuple(d.index), d.replica_id));
             }
             return out;
           })
      .def("is_fully_replicated",
           [](const NamedSharding& s) {
             check(s.validate_spec());
             return s.is_fully_replicated();
           })
      .def("is_equivalent_to", &NamedSharding::is_equivalent_to)
      .def("__repr__", &NamedSharding::to_string)
      .def(py::self == py::self);

  py::class_<Shard>(m, "Shard")
      .def_property_readonly("device_id", &Shard::device_id)
      .def_property_readonly("index", [](const Shard& s) { return index_tuple(s.index()); })
      .def_property_readonly("replica_id", &Shard::replica_id)
      .def_property_readonly("shape", &Shard::shape)
      .def("data", [](const Shard& s) {
        absl::StatusOr<HostArray> host;
        {
          py::gil_scoped_release release;
          host = s.data();
        }
        return to_numpy(value_or_throw(std::move(host)));
      });

  py::class_<Array>(m, "Array")
      .def_property_readonly("shape", &Array::shape)
      .def_property_readonly("dtype", &Array::dtype)
      .def_property_readonly("sharding", &Array::sharding)
      .def_property_readonly("committed", &Array::committed)
      .def_property_readonly("addressable_shards", &Array::addressable_shards)
      .def("fetch", &fetch)
      .def("is_ready", &Array::is_ready)
      .def("block_until_ready", [](const Array& a) {
        wait_interruptibly({a});
        absl::Status status;
        {
          py::gil_scoped_release release;
          status = a.block_until_ready();
        }
        check(status);
      });

  m.def("device_get", [](const std::vector<Array>& arrays) {
    py::list out;
    for (const Array& a : arrays) out.append(fetch(a));
    return out;
  });
  m.def("block_until_ready", [](const std::vector<Array>& arrays) {
    wait_interruptibly(arrays);
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = block_until_ready(arrays);
    }
    check(status);
  });
  m.def("visualize_sharding",
        [](const Shape& shape, const NamedSharding& s) { return value_or_throw(visualize_sharding(shape, s)); });

  py::class_<Client>(m, "Client")
      .def_static("local",
                  [](int n) {
                    py::gil_scoped_release release;
                    return value_or_throw(Client::local(n));
                  })
      .def_static(
          "connect",
          [](const std::string& address, int min_devices, double timeout_s, bool adopt_puts) {
            ConnectOptions options;
            options.min_devices = min_devices;
            options.timeout = absl::Seconds(timeout_s);
            options.adopt_puts = adopt_puts;
            py::gil_scoped_release release;
            return value_or_throw(Client::connect(address, options));
          },
          py::arg("address"), py::arg("min_devices"), py::arg("timeout_s"), py::arg("adopt_puts") = false)
      .def("devices",
           [](const Client& c) {
             py::gil_scoped_release release;
             return value_or_throw(c.devices());
           })
      .def(
          "make_mesh",
          [](const Client& c, std::vector<int64_t> shape, std::vector<std::string> names,
             std::optional<std::vector<int>> ids, std::vector<AxisType> types) {
            py::gil_scoped_release release;
            if (ids) return value_or_throw(c.make_mesh(std::move(shape), std::move(names), std::move(*ids), types));
            Mesh first = value_or_throw(c.make_mesh(shape, names));
            return value_or_throw(tessera::make_mesh(std::move(shape), std::move(names), first.device_ids(), types));
          },
          py::arg("shape"), py::arg("names"), py::arg("ids") = std::nullopt, py::arg("types") = std::vector<AxisType>{})
      // JAX's Device.memory_stats() keys where they mean the same (bytes_in_use, bytes_limit),
      // then the worker's own counters under their SDK names (DeviceStats).
      .def("memory_stats",
           [](const Client& c, int device_id) {
             DeviceStats s;
             {
               py::gil_scoped_release release;
               s = value_or_throw(c.device_stats(device_id));
             }
             const std::pair<const char*, int64_t> counters[] = {
                 {"bytes_in_use", s.bytes_used},
                 {"bytes_limit", s.memory_limit_bytes},
                 {"num_buffers", s.buffer_count},
                 {"bytes_put", s.bytes_put},
                 {"bytes_fetched", s.bytes_fetched},
                 {"bytes_fanned_out", s.bytes_fanned_out},
                 {"plans_loaded", s.plans_loaded},
                 {"shm_bytes_put", s.shm_bytes_put},
                 {"shm_bytes_fetched", s.shm_bytes_fetched},
                 {"client_memory_bytes_read", s.client_memory_bytes_read},
                 {"client_memory_bytes_written", s.client_memory_bytes_written},
                 {"shm_messages_received", s.shm_messages_received},
                 {"in_process_messages_received", s.in_process_messages_received},
             };
             py::dict d;
             for (const auto& [key, value] : counters) d[key] = value;
             return d;
           })
      .def("device_put", &device_put)
      .def("array", &uncommitted_array)
      .def("device_put_array",
           [](const Client& c, const Array& x, const NamedSharding& sharding) {
             py::gil_scoped_release release;
             return value_or_throw(c.device_put(x, sharding));
           })
      .def("start_profile",
           [](const Client& c, int64_t events_per_daemon) {
             py::gil_scoped_release release;
             check(c.start_profile(ProfileOptions{events_per_daemon}));
           })
      .def("stop_profile",
           [](const Client& c, const std::string& path) {
             py::gil_scoped_release release;
             check(c.stop_profile(path));
           })
      .def_property_readonly("coordinator_address", &Client::coordinator_address);
}

}  // namespace tessera::python
