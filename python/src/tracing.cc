// Tracing, jit, grad and shard_map: tessera._tessera's half that records programs. A Python
// function becomes a TracedFunction that takes the GIL and calls it on the Values; the
// tracer, the compiler and the executions are the SDK's. The Python side (tessera/_trace.py)
// wraps Values in its Tracer class, flattens pytrees and keeps a Python error raised inside a
// traced function, which it raises again when the trace fails.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "python/src/binding.h"
#include "tessera/tessera.h"

namespace tessera::python {
namespace {

// `f` (a Python callable from a list of Values to a list of Values) as a TracedFunction. The
// SDK may copy it and drop the copies on its own threads, so the Python object is released
// under the GIL. An exception escaping `f` (tessera/_trace.py catches them first) or a result
// that is not a list of Values gives an invalid Value, which fails the trace.
TracedFunction traced(py::object f) {
  std::shared_ptr<py::object> held(new py::object(std::move(f)), [](py::object* o) {
  // An interpreter that is gone or shutting down (a gRPC thread dropping the last copy at
  // exit): leak rather than take a GIL that no longer exists.
#if PY_VERSION_HEX >= 0x030D0000
    if (!Py_IsInitialized() || Py_IsFinalizing()) return;
#else
    if (!Py_IsInitialized() || _Py_IsFinalizing()) return;
#endif
    py::gil_scoped_acquire gil;
    delete o;
  });
  return [held](const std::vector<Value>& in) -> std::vector<Value> {
    py::gil_scoped_acquire gil;
    try {
      return (*held)(in).cast<std::vector<Value>>();
    } catch (const py::error_already_set&) {
      return {Value()};
    } catch (const py::cast_error&) {
      return {Value()};
    }
  };
}

Value scalar_op(const std::string& op, const Value& x, double y, bool reverse) {
  if (op == "add") return reverse ? y + x : x + y;
  if (op == "sub") return reverse ? y - x : x - y;
  if (op == "mul") return reverse ? y * x : x * y;
  if (op == "truediv") return reverse ? y / x : x / y;
  throw StatusError(absl::InvalidArgumentError(absl::StrCat("scalar_op: unknown op '", op, "'")));
}
Value scalar_op_int(const std::string& op, const Value& x, int64_t y, bool reverse) {
  if (op == "add") return reverse ? y + x : x + y;
  if (op == "sub") return reverse ? y - x : x - y;
  if (op == "mul") return reverse ? y * x : x * y;
  if (op == "truediv") return reverse ? y / x : x / y;
  throw StatusError(absl::InvalidArgumentError(absl::StrCat("scalar_op_int: unknown op '", op, "'")));
}

// A gather's fill value from Python (a float or an int; None: JAX's default for the dtype).
std::optional<Scalar> fill_scalar(const std::optional<std::variant<int64_t, double>>& fill) {
  if (!fill) return std::nullopt;
  return std::visit([](auto v) { return Scalar(v); }, *fill);
}

// GatherScatterMode by the lower-case name of its enumerator (tessera/lax.py's enum values).
GatherScatterMode gather_scatter_mode(const std::string& name) {
  if (name == "clip") return GatherScatterMode::kClip;
  if (name == "fill_or_drop") return GatherScatterMode::kFillOrDrop;
  if (name == "promise_in_bounds") return GatherScatterMode::kPromiseInBounds;
  if (name == "one_hot") return GatherScatterMode::kOneHot;
  throw StatusError(absl::InvalidArgumentError(
      absl::StrCat("GatherScatterMode: unknown mode '", name, "' (clip, fill_or_drop, promise_in_bounds, one_hot)")));
}

// `op()` with `mesh` (an out_sharding NamedSharding's mesh, or Python's ambient one) the ambient
// mesh when given: a trace not in explicit mode resolves out_sharding's bare spec against it.
template <typename Op>
auto on_mesh(std::optional<Mesh> mesh, Op op) {
  std::optional<MeshScope> scope;
  if (mesh) scope.emplace(*std::move(mesh));
  return op();
}

void bind_ops(py::module_& m) {
  using V = const Value&;
  for (auto [name, fn] : std::vector<std::pair<const char*, Value (*)(V)>>{{"neg", &neg},
                                                                           {"abs", &abs},
                                                                           {"exp", &exp},
                                                                           {"log", &log},
                                                                           {"tanh", &tanh},
                                                                           {"logistic", &logistic},
                                                                           {"sqrt", &sqrt},
                                                                           {"rsqrt", &rsqrt},
                                                                           {"sin", &sin},
                                                                           {"cos", &cos},
                                                                           {"erf", &erf},
                                                                           {"floor", &floor},
                                                                           {"ceil", &ceil},
                                                                           {"sign", &sign},
                                                                           {"logical_not", &logical_not},
                                                                           {"relu", &nn::relu},
                                                                           {"silu", &nn::silu}}) {
    m.def(name, fn);
  }
  for (auto [name, fn] : std::vector<std::pair<const char*, Value (*)(V, V)>>{{"add", &add},
                                                                              {"sub", &sub},
                                                                              {"mul", &mul},
                                                                              {"div", &div},
                                                                              {"pow", &pow},
                                                                              {"maximum", &maximum},
                                                                              {"minimum", &minimum},
                                                                              {"logical_and", &logical_and},
                                                                              {"logical_or", &logical_or},
                                                                              {"cross_entropy", &nn::cross_entropy}}) {
    m.def(name, fn);
  }
  m.def("truediv", [](V x, V y) { return x / y; });
  m.def("eq", [](V x, V y) { return x == y; });
  m.def("ne", [](V x, V y) { return x != y; });
  m.def("lt", [](V x, V y) { return x < y; });
  m.def("le", [](V x, V y) { return x <= y; });
  m.def("gt", [](V x, V y) { return x > y; });
  m.def("ge", [](V x, V y) { return x >= y; });
  m.def("where", &where);
  m.def("scalar_op", &scalar_op);
  m.def("scalar_op_int", &scalar_op_int);

  m.def("convert", &convert);
  using Dims = std::vector<int64_t>;
  m.def("broadcast_in_dim", static_cast<Value (*)(V, Shape, Dims)>(&broadcast_in_dim));
  m.def("broadcast_to", static_cast<Value (*)(V, Shape)>(&broadcast_to));
  // With out_sharding (lax.broadcast_in_dim / jnp.broadcast_to(..., out_sharding=)).
  m.def("broadcast_in_dim", [](V x, Shape shape, Dims dims, const PartitionSpec& spec, std::optional<Mesh> mesh) {
    return on_mesh(std::move(mesh), [&] { return broadcast_in_dim(x, std::move(shape), std::move(dims), spec); });
  });
  m.def("broadcast_to", [](V x, Shape shape, const PartitionSpec& spec, std::optional<Mesh> mesh) {
    return on_mesh(std::move(mesh), [&] { return broadcast_to(x, std::move(shape), spec); });
  });
  m.def("reshape", static_cast<Value (*)(V, Shape)>(&reshape));
  // With out_sharding (jnp.reshape(..., out_sharding=)); `mesh` as matmul's below.
  m.def("reshape", [](V x, Shape shape, const PartitionSpec& spec, std::optional<Mesh> mesh) {
    return on_mesh(std::move(mesh), [&] { return reshape(x, std::move(shape), spec); });
  });
  m.def("transpose", &transpose);
  m.def("expand_dims", &expand_dims);
  m.def("squeeze", &squeeze);
  m.def("sum", [](V x, std::vector<int64_t> axes, bool keepdims) { return sum(x, std::move(axes), keepdims); });
  m.def("max", [](V x, std::vector<int64_t> axes, bool keepdims) { return max(x, std::move(axes), keepdims); });
  m.def("min", [](V x, std::vector<int64_t> axes, bool keepdims) { return min(x, std::move(axes), keepdims); });
  m.def("prod", [](V x, std::vector<int64_t> axes, bool keepdims) { return prod(x, std::move(axes), keepdims); });
  m.def("mean", [](V x, std::vector<int64_t> axes, bool keepdims) { return mean(x, std::move(axes), keepdims); });
  m.def("argmax", &argmax);
  m.def("argmin", &argmin);
  auto dot_dims = [](Dims lhs_contracting, Dims rhs_contracting, Dims lhs_batch, Dims rhs_batch) {
    DotDims dims;
    dims.lhs_contracting = std::move(lhs_contracting);
    dims.rhs_contracting = std::move(rhs_contracting);
    dims.lhs_batch = std::move(lhs_batch);
    dims.rhs_batch = std::move(rhs_batch);
    return dims;
  };
  m.def("dot_general",
        [dot_dims](V lhs, V rhs, Dims lhs_contracting, Dims rhs_contracting, Dims lhs_batch, Dims rhs_batch) {
          return dot_general(lhs, rhs,
                             dot_dims(std::move(lhs_contracting), std::move(rhs_contracting), std::move(lhs_batch),
                                      std::move(rhs_batch)));
        });
  // With out_sharding (lax.dot_general(..., out_sharding=)); `mesh` as matmul's below.
  m.def("dot_general", [dot_dims](V lhs, V rhs, Dims lhs_contracting, Dims rhs_contracting, Dims lhs_batch,
                                  Dims rhs_batch, const PartitionSpec& spec, std::optional<Mesh> mesh) {
    return on_mesh(std::move(mesh), [&] {
      return dot_general(
          lhs, rhs,
          dot_dims(std::move(lhs_contracting), std::move(rhs_contracting), std::move(lhs_batch), std::move(rhs_batch)),
          spec);
    });
  });
  m.def("matmul", static_cast<Value (*)(V, V)>(&matmul));
  // With out_sharding; `mesh` (Python's ambient mesh, or the NamedSharding's) for a trace not
  // in explicit mode, whose bare specs resolve against the SDK's ambient mesh.
  m.def("matmul", [](V a, V b, const PartitionSpec& spec, std::optional<Mesh> mesh) {
    return on_mesh(std::move(mesh), [&] { return matmul(a, b, spec); });
  });
  m.def("slice", &slice, py::arg("x"), py::arg("start"), py::arg("limit"), py::arg("strides") = std::vector<int64_t>{});
  m.def("rev", &rev, py::arg("x"), py::arg("dimensions"));
  m.def("concatenate", &concatenate);
  m.def("iota", static_cast<Value (*)(DType, Shape, int64_t)>(&iota));
  m.def("full", static_cast<Value (*)(Shape, double, DType)>(&full));
  // With out_sharding (lax.broadcasted_iota, jnp.full / zeros / ones / arange in a trace).
  m.def("iota", [](DType dtype, Shape shape, int64_t dimension, const PartitionSpec& spec, std::optional<Mesh> mesh) {
    return on_mesh(std::move(mesh), [&] { return iota(dtype, std::move(shape), dimension, spec); });
  });
  m.def("full", [](Shape shape, double value, DType dtype, const PartitionSpec& spec, std::optional<Mesh> mesh) {
    return on_mesh(std::move(mesh), [&] { return full(std::move(shape), value, dtype, spec); });
  });
  m.def("with_sharding_constraint",
        static_cast<Value (*)(const Value&, const NamedSharding&)>(&with_sharding_constraint));
  // Issue #15's stop_gradient and the composites of client/lax.cc.
  m.def("stop_gradient", &stop_gradient);
  m.def("pad", [](V x, V padding_value, const std::vector<std::tuple<int64_t, int64_t, int64_t>>& config) {
    std::vector<PadDim> dims;
    for (const auto& [low, high, interior] : config) dims.push_back({low, high, interior});
    return pad(x, padding_value, dims);
  });
  for (auto [name, fn] : std::vector<std::pair<const char*, Value (*)(V, int64_t, bool)>>{
           {"cumsum", &cumsum}, {"cumprod", &cumprod}, {"cummax", &cummax}, {"cummin", &cummin}}) {
    m.def(name, fn);
  }
  m.def("tril", &tril);
  m.def("triu", &triu);
  m.def("einsum", static_cast<Value (*)(const std::string&, V, V)>(&einsum));
  m.def("einsum", [](const std::string& subscripts, V a, V b, const PartitionSpec& spec, std::optional<Mesh> mesh) {
    return on_mesh(std::move(mesh), [&] { return einsum(subscripts, a, b, spec); });
  });
  // Explicit sharding (issue 16 item 2): jax.typeof as JAX prints it, and reshard in a trace.
  m.def("type_of", [](V x) { return type_of(x).to_string(); });
  m.def("type_of_array", [](const Array& x) { return type_of(x).to_string(); });
  m.def("reshard", [](V x, const PartitionSpec& spec, std::optional<Mesh> mesh) {
    return on_mesh(std::move(mesh), [&] { return reshard(x, spec); });
  });
  // jax.sharding.auto_axes / explicit_axes inside a trace, on flat lists of Values;
  // `out_specs` (auto_axes) is called once f has run, for the flattened out_sharding prefix.
  m.def("auto_axes",
        [](py::object f, const std::vector<Value>& args, std::vector<std::string> axes, py::object out_specs) {
          auto specs = std::make_shared<py::object>(std::move(out_specs));
          TracedFunction g = internal::auto_axes(traced(std::move(f)), std::move(axes), [specs] {
            py::gil_scoped_acquire gil;
            try {
              return (*specs)().cast<std::vector<PartitionSpec>>();
            } catch (const py::error_already_set&) {
              return std::vector<PartitionSpec>();
            } catch (const py::cast_error&) {
              return std::vector<PartitionSpec>();
            }
          });
          return g(args);
        });
  m.def("explicit_axes", [](py::object f, const std::vector<Value>& args, std::vector<std::string> axes,
                            std::vector<PartitionSpec> in_specs, std::optional<Mesh> mesh) {
    return on_mesh(std::move(mesh),
                   [&] { return explicit_axes(traced(std::move(f)), std::move(axes), std::move(in_specs))(args); });
  });
  m.def("argsort", &argsort);
  m.def("sort", &sort);
  m.def("top_k", &top_k);

  m.def("gelu", &nn::gelu);
  m.def("softmax", &nn::softmax);
  m.def("log_softmax", &nn::log_softmax);
  m.def("logsumexp", &nn::logsumexp);
  m.def("one_hot", &nn::one_hot);
  m.def("layer_norm", &nn::layer_norm);
  m.def("rms_norm", &nn::rms_norm);
  m.def("dot_product_attention", &nn::dot_product_attention);

  // jax.random (tessera/random.h: raw uint32[2] keys, threefry2x32, partitionable); the
  // Python names and defaults are tessera/random.py's.
  m.def("random_key", static_cast<Value (*)(V)>(&random::key));
  m.def("random_split", static_cast<Value (*)(V, Shape)>(&random::split));
  m.def("random_fold_in", static_cast<Value (*)(V, V)>(&random::fold_in));
  m.def("random_bits", &random::bits);
  m.def("random_uniform", &random::uniform);
  m.def("random_normal", &random::normal);
  m.def("random_truncated_normal", &random::truncated_normal);
  m.def("random_bernoulli", static_cast<Value (*)(V, V, Shape)>(&random::bernoulli));
  m.def("random_categorical", &random::categorical);

  // The shard_map collectives; `axes` is one mesh axis or several, major to minor.
  m.def("psum", [](V x, Axes axes) { return psum(x, AxisNames(std::move(axes))); });
  m.def("pmean", [](V x, Axes axes) { return pmean(x, AxisNames(std::move(axes))); });
  m.def("pmax", [](V x, Axes axes) { return pmax(x, AxisNames(std::move(axes))); });
  m.def("pmin", [](V x, Axes axes) { return pmin(x, AxisNames(std::move(axes))); });
  m.def("all_gather", [](V x, Axes axes, int64_t axis, bool tiled, const std::string& to) {
    return all_gather(x, AxisNames(std::move(axes)), axis, tiled, to);
  });
  m.def("psum_scatter", [](V x, Axes axes, int64_t dim, bool tiled) {
    return psum_scatter(x, AxisNames(std::move(axes)), dim, tiled);
  });
  m.def("pbroadcast", [](V x, Axes axes, int64_t source) { return pbroadcast(x, AxisNames(std::move(axes)), source); });
  m.def("ppermute", [](V x, Axes axes, const std::vector<std::pair<int64_t, int64_t>>& perm) {
    return ppermute(x, AxisNames(std::move(axes)), perm);
  });
  m.def("all_to_all", [](V x, Axes axes, int64_t split, int64_t concat, bool tiled) {
    return all_to_all(x, AxisNames(std::move(axes)), split, concat, tiled);
  });
  m.def("ragged_all_to_all", [](V operand, V output, V input_offsets, V send_sizes, V output_offsets, V recv_sizes,
                                Axes axes, const std::vector<std::vector<int64_t>>& axis_index_groups) {
    return ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                             AxisNames(std::move(axes)), axis_index_groups);
  });
  m.def("axis_index", [](Axes axes) { return axis_index(AxisNames(std::move(axes))); });
  // Varying manual axes (tessera/shard_map.h): lax.pvary / lax.pcast, and a body value's varying
  // axes (jax.typeof(x).manual_axis_type.varying).
  m.def("pvary", [](V x, Axes axes) { return pvary(x, AxisNames(std::move(axes))); });
  m.def("pcast", [](V x, Axes axes, const std::string& to) { return pcast(x, AxisNames(std::move(axes)), to); });
  m.def("varying_axes", [](V x) { return type_of(x).varying; });
  m.def("axis_size", [](Axes axes) { return axis_size(AxisNames(std::move(axes))); });

  // Indexing (trace.h states each form's out-of-range rule; tessera/numpy.py maps jnp's and
  // lax's signatures onto these). `fill_value` is a float or an int (None: JAX's default).
  m.def("rem", &rem);
  m.def("remainder", &remainder);
  m.def("clamp", &clamp);
  m.def("take", [](V x, V indices, int64_t axis, bool clip, std::optional<std::variant<int64_t, double>> fill) {
    return take(x, indices, axis, clip ? IndexMode::kClip : IndexMode::kFillOrDrop, fill_scalar(fill));
  });
  m.def("at_get", [](V x, V indices, int64_t axis) { return at(x, indices, axis).get(); });
  // x.at[i].get(out_sharding=) (trace.h: the gather with the Explicit axes as Auto, then laid out).
  m.def("at_get", [](V x, V indices, int64_t axis, const PartitionSpec& spec, std::optional<Mesh> mesh) {
    return on_mesh(std::move(mesh), [&] { return at(x, indices, axis).get(spec); });
  });
  // The other .at[] forms with out_sharding (tessera/numpy.py _at_laid_out): `f()` (one Value)
  // run as IndexRef::get(out_sharding) runs its gather (internal::auto_out_sharding, trace.h).
  m.def("at_laid_out",
        [](const std::string& api, V x, const PartitionSpec& spec, std::optional<Mesh> mesh, py::object f) {
          return on_mesh(std::move(mesh), [&] {
            return internal::auto_out_sharding(api, x, spec, [&] { return traced(std::move(f))({}).at(0); });
          });
        });
  m.def("at_set", [](V x, V indices, int64_t axis, V updates) { return at(x, indices, axis).set(updates); });
  m.def("at_add", [](V x, V indices, int64_t axis, V updates) { return at(x, indices, axis).add(updates); });
  // lax.gather / the scatters / jnp.take_along_axis with dimension numbers (trace.h); `mode` is
  // GatherScatterMode's name in lower case, as tessera/lax.py's enum spells its values.
  m.def("gather", [](V operand, V start_indices, Dims offset_dims, Dims collapsed_slice_dims, Dims start_index_map,
                     Dims operand_batching_dims, Dims start_indices_batching_dims, Dims slice_sizes,
                     const std::string& mode, std::optional<std::variant<int64_t, double>> fill) {
    GatherDimensionNumbers dims{std::move(offset_dims), std::move(collapsed_slice_dims), std::move(start_index_map),
                                std::move(operand_batching_dims), std::move(start_indices_batching_dims)};
    return gather(operand, start_indices, dims, std::move(slice_sizes), gather_scatter_mode(mode), fill_scalar(fill));
  });
  using ScatterFn = Value (*)(V, V, V, const ScatterDimensionNumbers&, GatherScatterMode);
  for (auto [name, fn] : std::vector<std::pair<const char*, ScatterFn>>{{"scatter", &scatter},
                                                                        {"scatter_add", &scatter_add},
                                                                        {"scatter_sub", &scatter_sub},
                                                                        {"scatter_mul", &scatter_mul},
                                                                        {"scatter_min", &scatter_min},
                                                                        {"scatter_max", &scatter_max}}) {
    m.def(name, [fn = fn](V operand, V scatter_indices, V updates, Dims update_window_dims, Dims inserted_window_dims,
                          Dims scatter_dims_to_operand_dims, Dims operand_batching_dims,
                          Dims scatter_indices_batching_dims, const std::string& mode) {
      ScatterDimensionNumbers dims{std::move(update_window_dims), std::move(inserted_window_dims),
                                   std::move(scatter_dims_to_operand_dims), std::move(operand_batching_dims),
                                   std::move(scatter_indices_batching_dims)};
      return fn(operand, scatter_indices, updates, dims, gather_scatter_mode(mode));
    });
  }
  // lax.scatter_apply: `func` a Python callable from a one-Value list to a one-Value list (as
  // tessera/lax.py wraps the user's function); anything else fails the trace.
  m.def("scatter_apply", [](V operand, V scatter_indices, py::object func, Dims update_window_dims,
                            Dims inserted_window_dims, Dims scatter_dims_to_operand_dims, Dims operand_batching_dims,
                            Dims scatter_indices_batching_dims, Shape update_shape, const std::string& mode) {
    TracedFunction f = traced(std::move(func));
    ScatterDimensionNumbers dims{std::move(update_window_dims), std::move(inserted_window_dims),
                                 std::move(scatter_dims_to_operand_dims), std::move(operand_batching_dims),
                                 std::move(scatter_indices_batching_dims)};
    auto apply = [f](const Value& v) {
      std::vector<Value> out = f({v});
      return out.size() == 1 ? out[0] : Value();
    };
    return scatter_apply(operand, scatter_indices, apply, dims, std::move(update_shape), gather_scatter_mode(mode));
  });
  m.def("take_along_axis",
        [](V x, V indices, int64_t axis, const std::string& mode, std::optional<std::variant<int64_t, double>> fill) {
          return take_along_axis(x, indices, axis, gather_scatter_mode(mode), fill_scalar(fill));
        });
  m.def("dynamic_slice", &dynamic_slice);
  m.def("dynamic_update_slice", &dynamic_update_slice);
}

}  // namespace

void bind_tracing(py::module_& m) {
  py::class_<Value>(m, "Value")
      .def_property_readonly("dtype", &Value::dtype)
      .def_property_readonly("shape", &Value::shape)
      .def_property_readonly("ok", &Value::ok);
  bind_ops(m);

  // The traced Graph of `f` on inputs of these (dtype, shape)s, as text (for tests and
  // debugging; jit is what runs programs).
  m.def("trace_text", [](py::object f, const std::vector<std::pair<DType, Shape>>& inputs) {
    std::vector<ArrayType> types;
    for (const auto& [dtype, shape] : inputs) types.push_back(ArrayType{dtype, shape});
    return value_or_throw(trace(traced(std::move(f)), types)).to_text();
  });

  // The same Graph as its nodes, for tessera.make_jaxpr: ([(op name, operand ids, type as
  // "f32[6]", attributes as Graph::to_text prints them)], parameter ids, output ids).
  m.def("trace_nodes", [](py::object f, const std::vector<std::pair<DType, Shape>>& inputs) {
    std::vector<ArrayType> types;
    for (const auto& [dtype, shape] : inputs) types.push_back(ArrayType{dtype, shape});
    const Graph g = value_or_throw(trace(traced(std::move(f)), types));
    std::vector<std::tuple<std::string, std::vector<int>, std::string, std::string>> nodes;
    for (const Node& n : g.nodes()) {
      nodes.emplace_back(op_name(n.op), n.operands, type_to_string(n.dtype, n.shape), attrs_to_text(n));
    }
    return std::make_tuple(std::move(nodes), g.parameters(), g.outputs());
  });

  py::class_<Jitted>(m, "Jitted")
      .def(py::init([](py::object f, std::vector<std::optional<PartitionSpec>> in_shardings,
                       std::vector<int> donate_argnums, double timeout_s) {
        JitOptions options;
        options.in_shardings = std::move(in_shardings);
        options.donate_argnums = std::move(donate_argnums);
        options.timeout = absl::Seconds(timeout_s);
        return Jitted(traced(std::move(f)), std::move(options));
      }))
      // `context`: Python's ambient mesh (tessera.set_mesh), this thread's ambient mesh for the
      // call, so the call is the SDK's under set_mesh (its placement and its checks).
      .def(
          "__call__",
          [](const Jitted& j, const std::vector<Array>& args, std::optional<Mesh> context) {
            py::gil_scoped_release release;
            if (!context.has_value()) return value_or_throw(j(args));
            MeshScope scope = set_mesh(*std::move(context));
            return value_or_throw(j(args));
          },
          py::arg("args"), py::arg("context") = py::none())
      .def("as_text", [](const Jitted& j) { return j.as_text(); })
      .def("compilations", &Jitted::compilations);

  // grad / value_and_grad of `f` as a function of Values (called inside a trace).
  m.def("grad", [](py::object f, std::vector<int> argnums, bool with_value) {
    TracedFunction fn = traced(std::move(f));
    return with_value ? value_and_grad(std::move(fn), std::move(argnums)) : grad(std::move(fn), std::move(argnums));
  });

  // lax.scan / fori_loop inside a trace: `f` takes the flat [carries..., x rows...] and
  // returns the flat [carries..., ys...] (tessera/lax.py flattens the pytrees).
  m.def("scan", [](py::object f, const std::vector<Value>& init, const std::vector<Value>& xs,
                   std::optional<int64_t> length, bool reverse) {
    TracedFunction fn = traced(std::move(f));
    const size_t carries = init.size();
    ScanResult r = scan(
        [fn, carries](const std::vector<Value>& c, const std::vector<Value>& x) {
          std::vector<Value> in = c;
          in.insert(in.end(), x.begin(), x.end());
          std::vector<Value> out = fn(in);
          const size_t n = std::min(carries, out.size());
          return ScanStep{{out.begin(), out.begin() + n}, {out.begin() + n, out.end()}};
        },
        init, xs, length, reverse);
    return std::make_pair(r.carry, r.ys);
  });
  m.def("fori_loop", [](int64_t lower, int64_t upper, py::object f, const std::vector<Value>& init) {
    TracedFunction fn = traced(std::move(f));
    return fori_loop(
        lower, upper,
        [fn](const Value& i, const std::vector<Value>& c) {
          std::vector<Value> in = {i};
          in.insert(in.end(), c.begin(), c.end());
          return fn(in);
        },
        init);
  });

  // lax.while_loop / switch / cond and jax.checkpoint inside a trace, on flat lists of Values
  // (tessera/lax.py and _api.py flatten the pytrees); cond returns a one-element list.
  m.def("while_loop", [](py::object cond_fun, py::object body_fun, const std::vector<Value>& init) {
    TracedFunction c = traced(std::move(cond_fun));
    return while_loop(
        [c](const std::vector<Value>& x) {
          std::vector<Value> r = c(x);
          return r.empty() ? Value() : r[0];
        },
        traced(std::move(body_fun)), init);
  });
  m.def("switch", [](const Value& index, std::vector<py::object> branches, const std::vector<Value>& operands) {
    std::vector<Branch> fns;
    for (py::object& f : branches) fns.push_back(traced(std::move(f)));
    return switch_(index, fns, operands);
  });
  m.def("cond", [](const Value& pred, py::object on_true, py::object on_false, const std::vector<Value>& operands) {
    return cond(pred, traced(std::move(on_true)), traced(std::move(on_false)), operands);
  });
  // jax.vmap inside a trace, on flat lists of Values; `out_axes` (tessera/_api.py flattens the
  // out_axes pytree against f's results) is called once f has run; `spmd_axis_name` a list of
  // mesh axes (empty: none).
  m.def("vmap", [](py::object f, const std::vector<Value>& args, std::vector<std::optional<int64_t>> in_axes,
                   py::object out_axes, std::optional<int64_t> axis_size, std::vector<std::string> spmd_axis_name) {
    auto axes = std::make_shared<py::object>(std::move(out_axes));
    TracedFunction g = internal::vmap(
        traced(std::move(f)), std::move(in_axes),
        [axes](size_t) {
          py::gil_scoped_acquire gil;
          try {
            return (*axes)().cast<std::vector<std::optional<int64_t>>>();
          } catch (const py::error_already_set&) {
            return std::vector<std::optional<int64_t>>{};
          } catch (const py::cast_error&) {
            return std::vector<std::optional<int64_t>>{};
          }
        },
        axis_size, std::move(spmd_axis_name));
    return g(args);
  });
  // `policy`: None (nothing_saveable), or `decide(primitive, dimension_numbers)` -> bool,
  // tessera/_api.py's, which calls the user's jax.checkpoint_policies-style policy and keeps
  // what it raises (so nothing escapes here; an exception reads as "not saved").
  m.def("checkpoint", [](py::object f, const std::vector<Value>& args, py::object policy) {
    CheckpointPolicy decide;
    if (!policy.is_none()) {
      auto held = std::make_shared<py::object>(std::move(policy));
      decide = [held](const SaveableOp& op) {
        py::gil_scoped_acquire gil;
        py::object dims = py::none();
        if (op.primitive == "dot_general") {
          dims = py::make_tuple(
              py::make_tuple(py::tuple(py::cast(op.lhs_contracting)), py::tuple(py::cast(op.rhs_contracting))),
              py::make_tuple(py::tuple(py::cast(op.lhs_batch)), py::tuple(py::cast(op.rhs_batch))));
        }
        try {
          return (*held)(op.primitive, dims).cast<bool>();
        } catch (const py::error_already_set&) {
          return false;
        } catch (const py::cast_error&) {
          return false;
        }
      };
    }
    return checkpoint(traced(std::move(f)), std::move(decide))(args);
  });

  py::class_<ShardMapped>(m, "ShardMapped")
      .def("call_values", [](const ShardMapped& s, const std::vector<Value>& args) { return s(args); })
      .def("call_arrays",
           [](const ShardMapped& s, const std::vector<Array>& args) {
             py::gil_scoped_release release;
             return value_or_throw(s(args));
           })
      .def("as_text", &ShardMapped::as_text);
  m.def(
      "shard_map",
      [](py::object f, const Mesh& mesh, std::vector<PartitionSpec> in_specs, std::vector<PartitionSpec> out_specs,
         bool check_vma, std::vector<std::string> axis_names, bool out_specs_for_all) {
        ShardMapOptions options;
        options.check_vma = check_vma;
        options.axis_names = std::move(axis_names);
        options.out_specs_for_all = out_specs_for_all;
        return shard_map(traced(std::move(f)), mesh, std::move(in_specs), std::move(out_specs), options);
      },
      py::arg("f"), py::arg("mesh"), py::arg("in_specs"), py::arg("out_specs"), py::arg("check_vma"),
      py::arg("axis_names") = std::vector<std::string>{}, py::arg("out_specs_for_all") = false);
}

}  // namespace tessera::python
