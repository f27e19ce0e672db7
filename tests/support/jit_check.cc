#include "tests/support/jit_check.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "tests/support/host_eval.h"

namespace tessera {

HostArray random_array(DType dtype, const Shape& shape, Domain domain, std::mt19937& rng) {
  HostArray a(dtype, shape);
  const double lo = domain == Domain::kSigned ? -2.0 : domain == Domain::kPositive ? 0.5 : 0.8;
  const double hi = domain == Domain::kSigned ? 2.0 : domain == Domain::kPositive ? 2.5 : 1.25;
  std::uniform_real_distribution<double> real(lo, hi);
  std::uniform_int_distribution<int> small(-4, 4);
  switch (dtype) {
    case DType::kF32:
      for (float& v : a.mutable_values<float>()) v = static_cast<float>(real(rng));
      break;
    case DType::kF64:
      for (double& v : a.mutable_values<double>()) v = real(rng);
      break;
    case DType::kI32:
      for (int32_t& v : a.mutable_values<int32_t>()) v = small(rng);
      break;
    case DType::kI64:
      for (int64_t& v : a.mutable_values<int64_t>()) v = small(rng);
      break;
    case DType::kBool:
      for (bool& v : a.mutable_values<bool>()) v = (rng() & 1) != 0;
      break;
    case DType::kU32:
      for (uint32_t& v : a.mutable_values<uint32_t>()) v = static_cast<uint32_t>(rng());
      break;
    case DType::kBF16:
      for (BFloat16& v : a.mutable_values<BFloat16>()) v = BFloat16(real(rng));
      break;
    case DType::kF16:
      for (Float16& v : a.mutable_values<Float16>()) v = Float16(real(rng));
      break;
    case DType::kU8:
      for (uint8_t& v : a.mutable_values<uint8_t>()) v = static_cast<uint8_t>(small(rng) + 4);
      break;
    case DType::kI8:
      for (int8_t& v : a.mutable_values<int8_t>()) v = static_cast<int8_t>(small(rng));
      break;
    case DType::kI16:
      for (int16_t& v : a.mutable_values<int16_t>()) v = static_cast<int16_t>(small(rng));
      break;
  }
  return a;
}

::testing::AssertionResult results_match(const HostArray& got, const HostArray& want, double rtol) {
  if (got.dtype() != want.dtype() || got.shape() != want.shape()) {
    return ::testing::AssertionFailure() << "got " << type_to_string(got.dtype(), got.shape()) << ", want "
                                         << type_to_string(want.dtype(), want.shape());
  }
  const bool exact = want.dtype() != DType::kF32 && want.dtype() != DType::kF64;
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < want.size(); ++i) {
    const double g = got.element_as_double(i), w = want.element_as_double(i);
    const bool same =
        exact ? g == w
              : (std::isnan(g) && std::isnan(w)) || g == w || std::abs(g - w) <= rtol * std::max(1.0, std::abs(w));
    if (!same) {
      if (first < 0) first = i;
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << want.size() << " elements differ"
                                       << (exact ? " (exact comparison)" : absl::StrCat(" (rtol ", rtol, ")"))
                                       << "; first at flat index " << first << ": got " << got.element_as_double(first)
                                       << ", want " << want.element_as_double(first);
}

std::unique_ptr<Client> start_local_client() {
  absl::StatusOr<Client> client = Client::local(8);
  if (!client.ok()) {
    ADD_FAILURE() << "Client::local(8): " << client.status();
    return nullptr;
  }
  return std::make_unique<Client>(*std::move(client));
}

const std::vector<MeshDef>& test_meshes() {
  static const auto* const kMeshes = new std::vector<MeshDef>{
      {"m8", {8}, {"data"}}, {"m4x2", {4, 2}, {"data", "model"}}, {"m2x4", {2, 4}, {"data", "model"}}};
  return *kMeshes;
}

Mesh with_auto_axes(const Mesh& mesh) {
  return *Mesh::create(mesh.shape(), mesh.axis_names(), mesh.device_ids(),
                       std::vector<AxisType>(mesh.axis_names().size(), AxisType::kAuto));
}

void MeshesSuite::SetUpTestSuite() {
  client_ = start_local_client().release();
  if (client_ == nullptr) return;
  for (const MeshDef& m : test_meshes()) {
    absl::StatusOr<Mesh> mesh = client_->make_mesh(m.shape, m.axes);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    auto_meshes_.push_back(with_auto_axes(*mesh));
    meshes_.push_back(*std::move(mesh));
  }
}

void MeshesSuite::TearDownTestSuite() {
  meshes_.clear();
  auto_meshes_.clear();
  delete client_;
  client_ = nullptr;
}

absl::StatusOr<JitCheck> run_against_host(const Client& client, const Mesh& mesh, const TracedFunction& f,
                                          const std::vector<const HostArray*>& inputs,
                                          const std::vector<PartitionSpec>& specs, const JitOptions& options) {
  std::vector<Array> args;
  std::vector<ArrayType> types;
  for (size_t i = 0; i < inputs.size(); ++i) {
    absl::StatusOr<Array> a = client.device_put(*inputs[i], NamedSharding(mesh, specs[i]));
    if (!a.ok()) return a.status();
    args.push_back(*std::move(a));
    types.push_back({inputs[i]->dtype(), inputs[i]->shape()});
  }
  Jitted jitted = jit(f, options);
  absl::StatusOr<std::vector<Array>> out = jitted(args);
  if (!out.ok()) return out.status();
  JitCheck check;
  check.plan_text = jitted.as_text();
  for (const Array& a : *out) {
    absl::StatusOr<HostArray> host = a.fetch();
    if (!host.ok()) return host.status();
    check.got.push_back(*std::move(host));
    check.out_specs.push_back(a.sharding().spec());
  }
  absl::StatusOr<Graph> graph = trace(f, types);
  if (!graph.ok()) return graph.status();
  absl::StatusOr<std::vector<HostArray>> want = evaluate_on_host(*graph, inputs);
  if (!want.ok()) return want.status();
  check.want = *std::move(want);
  return check;
}

}  // namespace tessera
