#include "tessera/jit.h"

#include <algorithm>

#include "absl/base/casts.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "client/client_impl.h"
#include "client/execution.h"
#include "client/explicit/rules.h"
#include "core/status.h"
#include "core/wire.h"
#include "proto/rpc.h"
#include "tessera/mesh_context.h"

namespace tessera {

struct Jitted::State {
  TracedFunction f;
  StaticTracedFunction with_statics;  // set instead of f for a function with static arguments
  JitOptions options;
  // What a call needs of a compiled signature: the executable and its outputs' types, and
  // what it takes to compile it again after a coordinator restart (the request, and the
  // inputs' types for adopting them again).
  struct Compiled {
    internal::ExecutableRef executable;
    std::vector<ArrayType> output_types;
    std::vector<NamedSharding> output_shardings;
    // What a recompile after a coordinator restart sends again, and what as_text() asks again
    // (a cache hit there) with a text wanted: compile replies carry none, so their size does
    // not grow with the program.
    std::shared_ptr<const pb::CompileRequest> request;
    std::vector<std::string> output_specs;                      // as the coordinator gave them (serialized)
    std::vector<pb::ArrayInfo> inputs;                          // dtype, shape and sharding of each argument
    std::weak_ptr<internal::ClientImpl> client;                 // Jitted does not keep a cluster alive
    std::shared_ptr<const std::vector<pb::ArrayInfo>> outputs;  // the same of each output
    // Whether the traced function names a mesh (a shard_map's, a constraint's): its outputs
    // are then committed even when its arguments were not (JAX's intermediate shardings).
    bool names_mesh = false;
  };
  // Where a call's uncommitted arguments go (place): `args` with them moved, and what the
  // function is traced on.
  struct Placed {
    std::vector<Array> args;
    // The shardings the trace types the arguments by: the placed ones, except for arguments
    // moved to the mesh the function names (their trace is the one that found it, as JAX
    // traces an uncommitted argument on no mesh).
    std::vector<NamedSharding> trace_shardings;
    bool moved_to_named_mesh = false;
  };
  // The mesh a traced function names (a shard_map's or a sharding constraint's, other than
  // `args_mesh`), and the spec each parameter first meets there (P() when none): where a call
  // whose arguments are all uncommitted runs. nullopt when it names none.
  struct NamedPlacement {
    Mesh mesh;
    std::vector<PartitionSpec> specs;
  };
  // `args` with the uncommitted ones moved as JAX moves them
  // (jax/_src/interpreters/pxla.py, _get_and_check_device_assignment): to the committed
  // arguments' mesh, else to the mesh the function names (dispatch.py's
  // get_intermediate_shardings: shard_map meshes and sharding constraints), each with its
  // in_shardings entry or the spec its first shard_map or constraint gives it, else
  // replicated; with no such mesh they stay on the default device.
  absl::StatusOr<Placed> place(const std::vector<Array>& args, const std::vector<StaticValue>& statics);
  // The text of `compiled` as `kind` asks (for one device's view: `device`), or a line
  // naming the error.
  static std::string text_of(const Compiled& compiled, pb::CompileRequest::Text kind, int device);
  // What the coordinator would refuse of a traced `graph` for arguments on `mesh`, refused
  // here, once, naming the meshes (never its address): a constraint or a shard_map onto
  // another mesh; out_shardings that do not fit the outputs (NamedSharding::validate's rules).
  absl::Status check_traced(const Graph& graph, const Mesh& mesh) const;
  // Traces and compiles the function for `signature` (args' types and shardings), and caches
  // the result under it.
  absl::StatusOr<std::shared_ptr<const Compiled>> compile(const std::string& signature, const Mesh& mesh,
                                                          const std::vector<ArrayType>& types,
                                                          const std::vector<Array>& args,
                                                          const std::vector<NamedSharding>& trace_shardings,
                                                          const std::string& who,
                                                          const std::vector<StaticValue>& statics);
  // f, or f with `statics` bound.
  TracedFunction bound(const std::vector<StaticValue>& statics) const;

  // internal::Recompile for `old`, cached under `signature`: AdoptArrays of the inputs, then
  // Compile of the same request; the cache then holds the new executable.
  static void recompile(const std::shared_ptr<State>& state, const std::string& signature,
                        const std::shared_ptr<const Compiled>& old, internal::ClientImpl* client,
                        const std::string& who, const std::vector<uint64_t>& ids, absl::Time deadline,
                        std::function<void(absl::StatusOr<internal::ExecutableRef>)> done);

  absl::Mutex mu;
  std::map<std::string, std::shared_ptr<const Compiled>> compiled ABSL_GUARDED_BY(mu);  // by argument signature
  // place's finding for calls whose arguments are all uncommitted, by their signature.
  std::map<std::string, std::optional<NamedPlacement>> named_placements ABSL_GUARDED_BY(mu);
  std::shared_ptr<const Compiled> last ABSL_GUARDED_BY(mu);  // the most recently used signature's
  int64_t compilations ABSL_GUARDED_BY(mu) = 0;
};

Jitted::Jitted(TracedFunction f, JitOptions options) : state_(std::make_shared<State>()) {
  state_->f = std::move(f);
  state_->options = std::move(options);
}

Jitted::Jitted(StaticTracedFunction f, JitOptions options) : state_(std::make_shared<State>()) {
  state_->with_statics = std::move(f);
  state_->options = std::move(options);
}

Jitted jit(TracedFunction f, JitOptions options) { return Jitted(std::move(f), std::move(options)); }

Jitted jit(StaticTracedFunction f, JitOptions options) { return Jitted(std::move(f), std::move(options)); }

namespace {

// A static value in a compilation's key: its type and its exact value (a double's bits).
std::string static_key(const StaticValue& v) {
  if (const bool* b = std::get_if<bool>(&v)) return *b ? "b1" : "b0";
  if (const int64_t* i = std::get_if<int64_t>(&v)) return absl::StrCat("i", *i);
  if (const double* d = std::get_if<double>(&v)) return absl::StrCat("d", absl::bit_cast<uint64_t>(*d));
  const std::string& s = std::get<std::string>(v);
  return absl::StrCat("s", s.size(), ":", s);
}

// JAX's check of a committed argument against the context mesh (jax.set_mesh):
// jax/_src/interpreters/pxla.py, _get_and_check_device_assignment, compares every sharding's
// device assignment with the context mesh's flat devices, in order ("if
// ctx_mesh._flat_devices_tuple != arr_device_assignment: raise DeviceAssignmentMismatchError"),
// which jit reports as "Received incompatible devices for jitted computation" (stages.py). So
// the same devices in the same order under another shape pass; another order does not.
absl::Status check_context_devices(const Array& arg, size_t i, const Mesh& context) {
  const Mesh& on = arg.sharding().mesh();
  if (on.device_ids() == context.device_ids()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "jit: incompatible devices: argument ", i, " (", type_to_string(arg.dtype(), arg.shape()), ") is committed to ",
      on.to_string_with_devices(), " but the context mesh (set_mesh) is ", context.to_string_with_devices(),
      "; a committed argument must be on the context mesh's devices, in its order (JAX: \"Received "
      "incompatible devices for jitted computation\"): device_put it onto the context mesh, or call "
      "outside the set_mesh scope"));
}

// Whether two meshes hold the same devices, in whatever order and shape.
bool same_devices(const Mesh& a, const Mesh& b) {
  std::vector<int> x = a.device_ids(), y = b.device_ids();
  std::sort(x.begin(), x.end());
  std::sort(y.begin(), y.end());
  return x == y;
}

}  // namespace

std::string Jitted::State::text_of(const Compiled& compiled, pb::CompileRequest::Text kind, int device) {
  std::shared_ptr<internal::ClientImpl> client = compiled.client.lock();
  if (client == nullptr) return "# as_text: the client of this program is gone\n";
  pb::CompileRequest req = *compiled.request;
  req.set_text(kind);
  req.set_text_device(device);
  pb::CompileReply reply;
  grpc::ClientContext ctx;
  set_deadline(&ctx, kControlDeadline);
  absl::Status s = from_grpc(client->coordinator()->Compile(&ctx, req, &reply),
                             absl::StrCat("as_text: coordinator ", client->coordinator_address()));
  return s.ok() ? reply.text() : absl::StrCat("# ", s.ToString(), "\n");
}

std::string Jitted::as_text() const {
  std::shared_ptr<const State::Compiled> last;
  {
    absl::MutexLock lock(&state_->mu);
    last = state_->last;
  }
  return last == nullptr ? "" : State::text_of(*last, pb::CompileRequest::TEXT_PROGRAM, 0);
}

std::string Jitted::as_text(int device_id) const {
  std::shared_ptr<const State::Compiled> last;
  {
    absl::MutexLock lock(&state_->mu);
    last = state_->last;
  }
  return last == nullptr ? "" : State::text_of(*last, pb::CompileRequest::TEXT_DEVICE, device_id);
}

int64_t Jitted::compilations() const {
  absl::MutexLock lock(&state_->mu);
  return state_->compilations;
}

ShapedType type_of(const Array& x) {
  const int rank = static_cast<int>(x.shape().size());
  return ShapedType{x.dtype(),
                    x.shape(),
                    internal::to_partition_spec(internal::type_spec_of(x.sharding().spec(), x.sharding().mesh(), rank))
                        .with_unreduced(x.sharding().spec().unreduced())
                        .with_reduced(x.sharding().spec().reduced()),
                    {},
                    x.sharding().mesh().axis_names()};
}

namespace internal {

absl::StatusOr<Array> relayout_on_mesh(const Array& x, const NamedSharding& target) {
  TESSERA_ASSIGN_OR_RETURN(std::vector<Array> out, jit([target](const std::vector<Value>& in) {
                             return std::vector<Value>{with_sharding_constraint(in[0], target)};
                           })({x}));
  return out[0];
}

}  // namespace internal

absl::StatusOr<Array> reshard(const Array& x, const NamedSharding& target) {
  // As JAX's reshard (canonicalize_sharding): Explicit axes only (tests/pjit_test.py,
  // test_reshard_no_mesh_ctx refuses NamedSharding(Auto mesh, P('x'))).
  TESSERA_RETURN_IF_ERROR(internal::check_explicit_axes("reshard", target.spec(), target.mesh()));
  absl::Status fits = target.validate(x.shape());
  if (!fits.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("reshard: ", type_to_string(x.dtype(), x.shape()), " to ",
                                                   target.spec().to_string(), ": ", fits.message()));
  }
  if (target == x.sharding()) return x;
  if (target.mesh() != x.sharding().mesh()) return Client(internal::array_state(x).client).device_put(x, target);
  return internal::relayout_on_mesh(x, target);
}

// auto_axes / explicit_axes on arrays: one jitted program running the traced switch (which
// sees the arguments' Explicit mesh as a trace inside jit does), compiled once per signature.
struct AxesSwitched::Eager {
  Jitted program;
};

AxesSwitched::AxesSwitched(TracedFunction traced)
    : traced_(std::move(traced)), eager_(std::make_shared<Eager>(Eager{jit(traced_)})) {}

absl::StatusOr<std::vector<Array>> AxesSwitched::operator()(const std::vector<Array>& args) const {
  return eager_->program(args);
}

absl::StatusOr<Array> reshard(const Array& x, const PartitionSpec& spec) {
  TESSERA_ASSIGN_OR_RETURN(NamedSharding target, ambient_sharding(spec, "reshard"));
  return reshard(x, target);
}

absl::StatusOr<std::vector<Array>> Jitted::operator()(const std::vector<Array>& args) const {
  return (*this)(args, {});
}

absl::StatusOr<std::vector<Array>> Jitted::operator()(const std::vector<Array>& given,
                                                      const std::vector<StaticValue>& statics) const {
  if (given.empty()) return absl::InvalidArgumentError("jit: a jitted function needs at least one array argument");
  if (!statics.empty() && !state_->with_statics) {
    return absl::InvalidArgumentError(absl::StrCat("jit: ", statics.size(),
                                                   " static arguments for a function that takes none (make it "
                                                   "from a StaticTracedFunction)"));
  }
  TESSERA_ASSIGN_OR_RETURN(State::Placed placed, state_->place(given, statics));
  const std::vector<Array>& args = placed.args;
  const internal::ArrayState& first = internal::array_state(args[0]);
  // The call on this thread: its checks and, the first time, its trace and compile; the
  // execution itself runs asynchronously (a wait shows as "wait").
  ProfileSpan span(&first.client->profile(), "client", [] { return std::string("jit call"); });
  const Mesh& mesh = first.sharding.mesh();
  std::vector<ArrayType> types;
  // The mesh (with its device order) is part of the signature: the same specs on another
  // mesh are another program. So are the client and its session: a program is its session's
  // (another client's executable would be refused, another cluster's would be another program).
  std::string signature = absl::StrCat(first.client->serial(), ":", first.client->session(), ";", mesh.to_string(),
                                       absl::StrJoin(mesh.device_ids(), ","), ";");
  // So is the ambient mesh, which bare specs in the function resolve against while it traces.
  if (std::optional<Mesh> ambient = get_mesh()) {
    absl::StrAppend(&signature, "ambient ", ambient->to_string(), absl::StrJoin(ambient->device_ids(), ","), ";");
  }
  const std::vector<std::optional<PartitionSpec>>& in_shardings = state_->options.in_shardings;
  if (!in_shardings.empty() && in_shardings.size() != args.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("jit: in_shardings has ", in_shardings.size(), " entries for ", args.size(), " arguments"));
  }
  const std::vector<int>& donate = state_->options.donate_argnums;
  for (int k : donate) {
    if (k < 0 || k >= static_cast<int>(args.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("jit: donate_argnums names argument ", k, " of a call with ", args.size(), " arguments"));
    }
    for (size_t j = 0; j < args.size(); ++j) {
      if (static_cast<int>(j) != k &&
          internal::array_state(args[j]).buffers == internal::array_state(args[k]).buffers) {
        return absl::InvalidArgumentError(absl::StrCat("jit: argument ", k, " is donated and also passed as argument ",
                                                       j, "; a donated array can be passed once"));
      }
    }
  }
  for (size_t i = 0; i < args.size(); ++i) {
    const internal::ArrayState& a = internal::array_state(args[i]);
    if (a.buffers->donated()) {
      return absl::InvalidArgumentError(absl::StrCat("jit: argument ", i, " (", type_to_string(a.dtype, a.shape),
                                                     ") was donated to an earlier call (donate_argnums) and no longer "
                                                     "exists; pass that call's output instead"));
    }
    if (a.client != first.client)
      return absl::InvalidArgumentError(absl::StrCat("jit: argument ", i, " is on another client"));
    if (a.sharding.mesh() != mesh && !same_devices(a.sharding.mesh(), mesh)) {
      // JAX's "Received incompatible devices for jitted computation": both device lists.
      return absl::InvalidArgumentError(
          absl::StrCat("jit: incompatible devices: argument ", i, " (", type_to_string(a.dtype, a.shape),
                       ") is on device ids [", absl::StrJoin(a.sharding.mesh().device_ids(), ", "), "] (",
                       a.sharding.mesh().to_string(), ") and argument 0 (", type_to_string(first.dtype, first.shape),
                       ") on device ids [", absl::StrJoin(mesh.device_ids(), ", "), "] (", mesh.to_string(),
                       "); every argument must be on one mesh: device_put one onto the other's sharding"));
    }
    if (a.sharding.mesh() != mesh) {
      const auto [this_mesh, first_mesh] = distinguish(a.sharding.mesh(), mesh);
      return absl::InvalidArgumentError(absl::StrCat("jit: argument ", i, " is on ", this_mesh, ", argument 0 on ",
                                                     first_mesh, "; every argument must be on one mesh"));
    }
    if (!in_shardings.empty() && in_shardings[i].has_value()) {
      // The checks and the message of an out_shardings entry that does not fit its output.
      const NamedSharding wanted(mesh, *in_shardings[i]);
      absl::Status fits = wanted.validate(a.shape);
      if (!fits.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("jit: input ", i, " ", type_to_string(a.dtype, a.shape), ": ",
                                                       fits.message(), " (in_shardings[", i, "])"));
      }
      if (!wanted.is_equivalent_to(a.sharding, static_cast<int>(a.shape.size()))) {
        return absl::InvalidArgumentError(absl::StrCat("jit: argument ", i, " has sharding ",
                                                       a.sharding.spec().to_string(), " but in_shardings[", i, "] is ",
                                                       in_shardings[i]->to_string(),
                                                       "; committed arrays are not moved implicitly (as in JAX): "
                                                       "device_put it with the wanted sharding"));
      }
    }
    types.push_back({a.dtype, a.shape});
    absl::StrAppend(&signature, dtype_name(a.dtype), shape_to_string(a.shape), a.sharding.spec().to_string(), ";");
  }
  for (const StaticValue& v : statics) absl::StrAppend(&signature, "static ", static_key(v), ";");
  // Arguments moved to the mesh the function names were traced where they were (on no mesh's
  // types): another trace than of the same arrays committed there.
  if (placed.moved_to_named_mesh) absl::StrAppend(&signature, "moved;");
  if (mesh.has_axis_type(AxisType::kManual)) {
    return absl::UnimplementedError(absl::StrCat("jit: the arguments are on ", mesh.to_string(),
                                                 ", but Tessera compiles only for Auto and Explicit mesh axes (a "
                                                 "Manual axis is shard_map's): make the mesh's axes Auto or Explicit"));
  }
  std::shared_ptr<const State::Compiled> compiled;
  {
    absl::MutexLock lock(&state_->mu);
    auto it = state_->compiled.find(signature);
    if (it != state_->compiled.end()) {
      compiled = it->second;
      state_->last = compiled;
    }
  }
  internal::ClientImpl& client = *first.client;
  const std::string who = absl::StrCat("jit: coordinator ", client.coordinator_address());
  if (compiled == nullptr) {
    TESSERA_ASSIGN_OR_RETURN(compiled,
                             state_->compile(signature, mesh, types, args, placed.trace_shardings, who, statics));
  }
  // An argument whose call has already failed fails this one at once.
  std::vector<std::shared_ptr<internal::ArrayBuffers>> inputs;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::shared_ptr<internal::ArrayBuffers>& buffers = internal::array_state(args[i]).buffers;
    if (buffers->producer() != nullptr && buffers->ready() && !buffers->wait().ok()) {
      return internal::Execution::failed_input(who, i, *buffers->producer());
    }
    inputs.push_back(buffers);
  }
  // Dispatch: the call runs once its arguments are ready; its outputs come back at once.
  const absl::Duration timeout = state_->options.timeout;
  const absl::Time deadline = internal::Execution::finish_by(inputs, timeout);
  TESSERA_RETURN_IF_ERROR(client.in_flight()->begin_execution(deadline, who));
  const int num_outputs = static_cast<int>(compiled->output_types.size());
  auto execution =
      std::make_shared<internal::Execution>(&client, std::move(inputs), num_outputs, timeout, deadline, who);
  // Donated arguments: this call runs after the calls still reading them, and frees them
  // when it finishes (whatever its outcome: a donated array is gone either way, as in JAX).
  std::vector<std::shared_ptr<internal::Execution>> after;
  for (int k : donate) {
    const std::shared_ptr<internal::ArrayBuffers>& buffers = internal::array_state(args[k]).buffers;
    std::vector<std::shared_ptr<internal::Execution>> readers = buffers->donate();
    after.insert(after.end(), readers.begin(), readers.end());
    execution->on_finish([buffers] { buffers->free_buffers(); });
  }
  for (const Array& a : args) internal::array_state(a).buffers->add_reader(execution);
  // Outputs are uncommitted only when every argument was and stayed on the default device,
  // and nothing asked for a sharding (pxla.py's `committed` in lower_sharding_computation).
  bool committed = compiled->names_mesh || mesh.size() > 1;
  for (const Array& a : args) committed = committed || a.committed();
  for (const auto& s : state_->options.out_shardings) committed = committed || s.has_value();
  for (const auto& s : in_shardings) committed = committed || s.has_value();
  std::vector<Array> out;
  for (int i = 0; i < num_outputs; ++i) {
    const ArrayType& type = compiled->output_types[i];
    auto buffers = std::make_shared<internal::ArrayBuffers>(&client, execution, i);
    out.push_back(internal::make_array(std::make_shared<internal::ArrayState>(
        first.client, std::move(buffers), type.dtype, type.shape, compiled->output_shardings[i], committed)));
  }
  execution->describe_outputs(compiled->outputs);
  execution->start(compiled->executable, after,
                   [state = state_, signature, compiled, client = &client, who](
                       const std::vector<uint64_t>& ids, absl::Time deadline,
                       std::function<void(absl::StatusOr<internal::ExecutableRef>)> done) {
                     State::recompile(state, signature, compiled, client, who, ids, deadline, std::move(done));
                   });
  return out;
}

void Jitted::State::recompile(const std::shared_ptr<State>& state, const std::string& signature,
                              const std::shared_ptr<const Compiled>& old, internal::ClientImpl* client,
                              const std::string& who, const std::vector<uint64_t>& ids, absl::Time deadline,
                              std::function<void(absl::StatusOr<internal::ExecutableRef>)> done) {
  // gRPC needs these until the last callback has run.
  struct Call {
    grpc::ClientContext adopt_ctx;
    pb::AdoptArraysRequest adopt;
    pb::AdoptArraysReply adopted;
    grpc::ClientContext compile_ctx;
    pb::CompileReply reply;
  };
  auto call = std::make_shared<Call>();
  call->adopt.set_session_id(client->session());
  for (size_t i = 0; i < ids.size() && i < old->inputs.size(); ++i) {
    pb::ArrayInfo* a = call->adopt.add_arrays();
    *a = old->inputs[i];
    a->set_array_id(ids[i]);
    a->set_grant(client->grant(ids[i]));
  }
  call->adopt_ctx.set_deadline(absl::ToChronoTime(std::min(deadline, absl::Now() + kControlDeadline)));
  call->compile_ctx.set_deadline(absl::ToChronoTime(deadline));
  pb::Coordinator::Stub* coordinator = client->coordinator();
  coordinator->async()->AdoptArrays(
      &call->adopt_ctx, &call->adopt, &call->adopted,
      [state, signature, old, who, call, coordinator, done = std::move(done)](grpc::Status adopted) mutable {
        if (!adopted.ok()) {
          done(from_grpc(adopted, who));
          return;
        }
        coordinator->async()->Compile(
            &call->compile_ctx, old->request.get(), &call->reply,
            [state, signature, old, who, call, done = std::move(done)](grpc::Status compiled) {
              if (!compiled.ok()) {
                done(from_grpc(compiled, who));
                return;
              }
              const pb::CompileReply& reply = call->reply;
              bool same = reply.output_specs_size() == static_cast<int>(old->output_specs.size());
              for (int i = 0; same && i < reply.output_specs_size(); ++i) {
                same = reply.output_specs(i).SerializeAsString() == old->output_specs[i];
              }
              if (!same) {
                done(absl::InternalError(absl::StrCat(who,
                                                      ": compiled again after the coordinator restarted, the "
                                                      "program's outputs are laid out differently")));
                return;
              }
              auto fresh = std::make_shared<Compiled>(*old);
              fresh->executable = {reply.executable_id(), reply.epoch()};
              {
                absl::MutexLock lock(&state->mu);
                state->compiled[signature] = fresh;
                state->compilations = reply.compilations();
              }
              done(fresh->executable);
            });
      });
}

TracedFunction Jitted::State::bound(const std::vector<StaticValue>& statics) const {
  if (!with_statics) return f;
  return [this, statics](const std::vector<Value>& in) { return with_statics(in, statics); };
}

absl::StatusOr<Jitted::State::Placed> Jitted::State::place(const std::vector<Array>& args,
                                                           const std::vector<StaticValue>& statics) {
  const std::optional<Mesh> ambient = get_mesh();
  if (ambient.has_value()) {
    for (size_t i = 0; i < args.size(); ++i) {
      if (args[i].committed()) TESSERA_RETURN_IF_ERROR(check_context_devices(args[i], i, *ambient));
    }
  }
  Placed placed{args, {}, false};
  const Array* committed = nullptr;
  bool any_uncommitted = false;
  for (const Array& a : args) {
    if (a.committed() && committed == nullptr) committed = &a;
    any_uncommitted = any_uncommitted || !a.committed();
  }
  const auto trace_on_placed = [&placed] {
    for (const Array& a : placed.args) placed.trace_shardings.push_back(a.sharding());
    return placed;
  };
  if (!any_uncommitted) return trace_on_placed();
  const internal::ArrayState& first = internal::array_state(args[0]);
  // A move is a device_put onto `target`; a donated or another client's argument is left for
  // the call's checks to name.
  const auto move = [&](size_t i, const NamedSharding& target) -> absl::Status {
    const internal::ArrayState& a = internal::array_state(args[i]);
    if (a.client != first.client || a.buffers->donated()) return absl::OkStatus();
    absl::StatusOr<Array> moved = Client(a.client).device_put(args[i], target);
    if (!moved.ok()) {
      return absl::Status(moved.status().code(),
                          absl::StrCat("jit: moving uncommitted argument ", i, " (", type_to_string(a.dtype, a.shape),
                                       ") to ", target.to_string(), ": ", moved.status().message()));
    }
    placed.args[i] = *moved;
    return absl::OkStatus();
  };
  const auto wanted_spec = [this](size_t i) {
    return i < options.in_shardings.size() && options.in_shardings[i].has_value() ? *options.in_shardings[i]
                                                                                  : PartitionSpec();
  };
  if (committed != nullptr) {
    // To the committed arguments' mesh (their devices decide, as JAX's do).
    const Mesh& mesh = committed->sharding().mesh();
    for (size_t i = 0; i < args.size(); ++i) {
      if (!args[i].committed()) TESSERA_RETURN_IF_ERROR(move(i, NamedSharding(mesh, wanted_spec(i))));
    }
    return trace_on_placed();
  }
  // All uncommitted: where the function says it runs, found by tracing it once per signature.
  std::vector<ArrayType> types;
  std::vector<NamedSharding> shardings;
  std::string key = absl::StrCat(first.client->serial(), ":", first.client->session(), ";");
  if (ambient.has_value()) {
    absl::StrAppend(&key, "ambient ", ambient->to_string(), absl::StrJoin(ambient->device_ids(), ","), ";");
  }
  for (const Array& a : args) {
    types.push_back({a.dtype(), a.shape()});
    shardings.push_back(a.sharding());
    absl::StrAppend(&key, dtype_name(a.dtype()), shape_to_string(a.shape()), a.sharding().to_string(),
                    absl::StrJoin(a.sharding().mesh().device_ids(), ","), ";");
  }
  for (const StaticValue& v : statics) absl::StrAppend(&key, "static ", static_key(v), ";");
  std::optional<NamedPlacement> found;
  bool known = false;
  {
    absl::MutexLock lock(&mu);
    auto it = named_placements.find(key);
    if (it != named_placements.end()) {
      found = it->second;
      known = true;
    }
  }
  if (!known) {
    TESSERA_ASSIGN_OR_RETURN(Graph graph, trace(bound(statics), types, shardings));
    for (int id = 0; id < graph.size() && !found.has_value(); ++id) {
      const Mesh* on = mesh_of(graph.node(id));
      if (on != nullptr && *on != args[0].sharding().mesh()) found = NamedPlacement{*on, {}};
    }
    if (found.has_value()) {
      // Each argument as the first shard_map or constraint reading it wants it (the compiler
      // would propagate that layout back to it); replicated when none reads it directly.
      std::map<int, int> parameter_index;
      for (size_t i = 0; i < graph.parameters().size(); ++i) parameter_index[graph.parameters()[i]] = i;
      found->specs.assign(args.size(), PartitionSpec());
      std::vector<bool> seen(args.size(), false);
      for (int id = 0; id < graph.size(); ++id) {
        const Node& n = graph.node(id);
        const auto* s = std::get_if<ShardingAttrs>(&n.attributes);
        if (s == nullptr || n.operands.empty() || s->sharding.mesh() != found->mesh) continue;
        auto p = parameter_index.find(n.operands[0]);
        if (p == parameter_index.end() || static_cast<size_t>(p->second) >= args.size() || seen[p->second]) continue;
        seen[p->second] = true;
        found->specs[p->second] = s->sharding.spec();
      }
    }
    absl::MutexLock lock(&mu);
    named_placements[key] = found;
  }
  if (found.has_value() && ambient.has_value() && found->mesh.device_ids() != ambient->device_ids()) {
    // pxla.py checks the shardings inside the computation (dispatch.py's
    // get_intermediate_shardings) against the context mesh too.
    return absl::InvalidArgumentError(absl::StrCat(
        "jit: incompatible devices: the function names ", found->mesh.to_string_with_devices(),
        " (a shard_map's or a with_sharding_constraint's) but the context mesh (set_mesh) is ",
        ambient->to_string_with_devices(),
        "; a computation runs on the context mesh's devices, in its order (JAX: \"Received incompatible devices "
        "for jitted computation\"): name the context mesh in the function, or call it outside the set_mesh scope"));
  }
  if (!found.has_value()) {
    // No mesh named anywhere: JAX takes the devices of the context mesh (jax.set_mesh) when
    // there is one, else the default device (pxla.py, _get_and_check_device_assignment: "if
    // first_sharding_info is None and not ctx_mesh.empty ... device_assignment =
    // ctx_mesh._flat_devices_tuple"), and the outputs are committed (lower_sharding_computation:
    // committed when the context mesh is not empty). So the arguments go to the ambient mesh,
    // replicated unless in_shardings says otherwise.
    if (ambient.has_value()) {
      for (size_t i = 0; i < args.size(); ++i)
        TESSERA_RETURN_IF_ERROR(move(i, NamedSharding(*ambient, wanted_spec(i))));
    }
    return trace_on_placed();
  }
  for (size_t i = 0; i < args.size(); ++i) {
    const bool asked = i < options.in_shardings.size() && options.in_shardings[i].has_value();
    TESSERA_RETURN_IF_ERROR(move(i, NamedSharding(found->mesh, asked ? wanted_spec(i) : found->specs[i])));
  }
  placed.trace_shardings = std::move(shardings);
  placed.moved_to_named_mesh = true;
  return placed;
}

absl::Status Jitted::State::check_traced(const Graph& graph, const Mesh& mesh) const {
  for (int id = 0; id < graph.size(); ++id) {
    const Node& n = graph.node(id);
    const Mesh* on = mesh_of(n);
    if (on == nullptr || *on == mesh) continue;
    const auto [theirs, ours] = distinguish(*on, mesh);
    const char* what = n.op == Op::kShardingConstraint ? "with_sharding_constraint" : "shard_map";
    return absl::InvalidArgumentError(
        absl::StrCat("jit: a ", what, " onto ", theirs, " in a function whose arguments are on ", ours,
                     "; Tessera moves values within one mesh: put the arguments on that mesh, or name theirs"));
  }
  if (!options.out_shardings.empty() && options.out_shardings.size() != graph.outputs().size()) {
    return absl::InvalidArgumentError(absl::StrCat("jit: out_shardings has ", options.out_shardings.size(),
                                                   " entries for ", graph.outputs().size(), " outputs"));
  }
  for (size_t i = 0; i < options.out_shardings.size(); ++i) {
    if (!options.out_shardings[i].has_value()) continue;
    const Node& o = graph.node(graph.outputs()[i]);
    absl::Status fits = NamedSharding(mesh, *options.out_shardings[i]).validate(o.shape);
    if (!fits.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("jit: output ", i, " ", type_to_string(o.dtype, o.shape), ": ", fits.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Jitted::State::Compiled>> Jitted::State::compile(
    const std::string& signature, const Mesh& mesh, const std::vector<ArrayType>& types, const std::vector<Array>& args,
    const std::vector<NamedSharding>& trace_shardings, const std::string& who,
    const std::vector<StaticValue>& statics) {
  TESSERA_ASSIGN_OR_RETURN(Graph graph, trace(bound(statics), types, trace_shardings));
  TESSERA_RETURN_IF_ERROR(check_traced(graph, mesh));
  pb::CompileRequest req;
  to_proto(graph, req.mutable_graph());
  to_proto(mesh, req.mutable_mesh());
  for (const Array& a : args) {
    pb::NamedSharding s;
    to_proto(a.sharding(), &s);
    *req.add_input_specs() = s.spec();
  }
  req.mutable_donated_inputs()->Assign(options.donate_argnums.begin(), options.donate_argnums.end());
  req.set_session_id(internal::array_state(args[0]).client->session());
  for (const auto& spec : options.out_shardings) {
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
  const internal::ArrayState& first = internal::array_state(args[0]);
  TESSERA_RETURN_IF_ERROR(from_grpc(first.client->coordinator()->Compile(&ctx, req, &reply), who));
  auto result = std::make_shared<State::Compiled>();
  for (int id = 0; id < graph.size(); ++id)
    result->names_mesh = result->names_mesh || mesh_of(graph.node(id)) != nullptr;
  for (const Array& a : args) {
    pb::ArrayInfo& info = result->inputs.emplace_back();
    info.set_dtype(to_proto(a.dtype()));
    to_proto(a.shape(), info.mutable_shape());
    to_proto(a.sharding(), info.mutable_sharding());
  }
  result->request = std::make_shared<const pb::CompileRequest>(std::move(req));
  if (reply.output_specs_size() != static_cast<int>(graph.outputs().size())) {
    return absl::InternalError(absl::StrCat(who, ": Compile returned ", reply.output_specs_size(),
                                            " output shardings for a function of ", graph.outputs().size(),
                                            " outputs"));
  }
  result->executable = {reply.executable_id(), reply.epoch()};
  result->client = first.client;
  for (int i = 0; i < reply.output_specs_size(); ++i) {
    result->output_specs.push_back(reply.output_specs(i).SerializeAsString());
    const Node& o = graph.node(graph.outputs()[i]);
    result->output_types.push_back({o.dtype, o.shape});
    pb::NamedSharding s;
    to_proto(mesh, s.mutable_mesh());
    *s.mutable_spec() = reply.output_specs(i);
    TESSERA_ASSIGN_OR_RETURN(NamedSharding sharding, sharding_from_proto(s));
    result->output_shardings.push_back(std::move(sharding));
  }
  auto outputs = std::make_shared<std::vector<pb::ArrayInfo>>();
  for (size_t i = 0; i < result->output_types.size(); ++i) {
    pb::ArrayInfo& info = outputs->emplace_back();
    info.set_dtype(to_proto(result->output_types[i].dtype));
    to_proto(result->output_types[i].shape, info.mutable_shape());
    to_proto(result->output_shardings[i], info.mutable_sharding());
  }
  result->outputs = std::move(outputs);
  absl::MutexLock lock(&mu);
  compiled[signature] = result;
  last = result;
  compilations = reply.compilations();
  return std::shared_ptr<const State::Compiled>(std::move(result));
}

}  // namespace tessera
