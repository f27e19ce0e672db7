#include "tessera/jit.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "client/client_impl.h"
#include "core/status.h"
#include "core/wire.h"
#include "proto/rpc.h"

namespace tessera {

struct Jitted::State {
  TracedFunction f;
  JitOptions options;
  absl::Mutex mu;
  struct Compiled {
    uint64_t id = 0;
    std::string text;
  };
  std::map<std::string, Compiled> compiled ABSL_GUARDED_BY(mu);  // by argument signature
  std::string last_text ABSL_GUARDED_BY(mu);
  int64_t compilations ABSL_GUARDED_BY(mu) = 0;
};

Jitted::Jitted(TracedFunction f, JitOptions options) : state_(std::make_shared<State>()) {
  state_->f = std::move(f);
  state_->options = std::move(options);
}

Jitted jit(TracedFunction f, JitOptions options) { return Jitted(std::move(f), std::move(options)); }

std::string Jitted::as_text() const {
  absl::MutexLock lock(&state_->mu);
  return state_->last_text;
}

int64_t Jitted::compilations() const {
  absl::MutexLock lock(&state_->mu);
  return state_->compilations;
}

absl::StatusOr<std::vector<Array>> Jitted::operator()(const std::vector<Array>& args) const {
  if (args.empty()) return absl::InvalidArgumentError("jit: a jitted function needs at least one array argument");
  const internal::ArrayState& first = internal::array_state(args[0]);
  const Mesh& mesh = first.sharding.mesh();
  std::vector<ArrayType> types;
  // The mesh (with its device order) is part of the signature: the same specs on another
  // mesh are another program.
  std::string signature = absl::StrCat(mesh.to_string(), absl::StrJoin(mesh.device_ids(), ","), ";");
  for (size_t i = 0; i < args.size(); ++i) {
    const internal::ArrayState& a = internal::array_state(args[i]);
    if (a.client != first.client)
      return absl::InvalidArgumentError(absl::StrCat("jit: argument ", i, " is on another client"));
    if (a.sharding.mesh() != mesh) {
      return absl::InvalidArgumentError(absl::StrCat("jit: argument ", i, " is on ", a.sharding.mesh().to_string(),
                                                     ", argument 0 on ", mesh.to_string(),
                                                     "; every argument must be on one mesh"));
    }
    types.push_back({a.dtype, a.shape});
    absl::StrAppend(&signature, dtype_name(a.dtype), shape_to_string(a.shape), a.sharding.spec().to_string(), ";");
  }
  uint64_t executable = 0;
  {
    absl::MutexLock lock(&state_->mu);
    auto it = state_->compiled.find(signature);
    if (it != state_->compiled.end()) {
      executable = it->second.id;
      state_->last_text = it->second.text;
    }
  }
  internal::ClientImpl& client = *first.client;
  const std::string who = absl::StrCat("jit: coordinator ", client.coordinator_address());
  if (executable == 0) {
    TESSERA_ASSIGN_OR_RETURN(Graph graph, trace(state_->f, types));
    pb::CompileRequest req;
    to_proto(graph, req.mutable_graph());
    to_proto(mesh, req.mutable_mesh());
    for (const Array& a : args) {
      pb::NamedSharding s;
      to_proto(a.sharding(), &s);
      *req.add_input_specs() = s.spec();
    }
    for (const auto& spec : state_->options.out_shardings) {
      pb::OptionalSpec* o = req.add_output_specs();
      o->set_set(spec.has_value());
      if (spec.has_value()) {
        pb::NamedSharding s;
        to_proto(NamedSharding(mesh, *spec), &s);
        *o->mutable_spec() = s.spec();
      }
    }
    pb::CompileReply reply;
    grpc::ClientContext ctx;
    set_deadline(&ctx, kControlDeadline + absl::Seconds(50));
    TESSERA_RETURN_IF_ERROR(from_grpc(client.coordinator()->Compile(&ctx, req, &reply), who));
    executable = reply.executable_id();
    absl::MutexLock lock(&state_->mu);
    state_->compiled[signature] = {executable, reply.text()};
    state_->last_text = reply.text();
    state_->compilations = reply.compilations();
  }
  pb::ExecuteRequest req;
  req.set_executable_id(executable);
  for (const Array& a : args) req.add_input_arrays(a.id());
  req.set_timeout_ms(absl::ToInt64Milliseconds(state_->options.timeout));
  pb::ExecuteReply reply;
  grpc::ClientContext ctx;
  set_deadline(&ctx, state_->options.timeout + absl::Seconds(10));
  TESSERA_RETURN_IF_ERROR(from_grpc(client.coordinator()->Execute(&ctx, req, &reply), who));
  std::vector<Array> out;
  for (const pb::ArrayInfo& info : reply.outputs()) {
    TESSERA_ASSIGN_OR_RETURN(DType dtype, dtype_from_proto(info.dtype()));
    TESSERA_ASSIGN_OR_RETURN(Shape shape, shape_from_proto(info.shape(), dtype));
    TESSERA_ASSIGN_OR_RETURN(NamedSharding sharding, sharding_from_proto(info.sharding()));
    out.push_back(internal::make_array(
        std::make_shared<internal::ArrayState>(first.client, info.array_id(), dtype, shape, std::move(sharding))));
  }
  return out;
}

}  // namespace tessera
