// jit: compiles an array function for the shardings of its arguments and runs it on the
// devices, as jax.jit — the result arrays come back sharded as propagation decided (or as
// out_shardings says), with the collectives their layouts need inserted automatically.
//
//   Jitted layer = jit([](const std::vector<Value>& in) { return std::vector<Value>{tanh(matmul(in[0], in[1]))}; });
//   absl::StatusOr<std::vector<Array>> y = layer({x, w});      // x P('data', None), w P(None, 'model')
//   (*y)[0].sharding().spec();                                   // P('data', 'model')
//   std::cout << layer.as_text();                                // the program every device runs
//
// A Jitted traces once per argument signature (dtypes, shapes, shardings) and the coordinator
// compiles each signature once: calling again with same-typed, same-sharded arrays only runs.
// Calls are dispatched asynchronously: back-to-back calls do not wait for each other's round
// trips, and block_until_ready() (or fetching) waits for the data:
//
//   std::vector<Array> y = {x};
//   for (int i = 0; i < 100; ++i) y = *step(y);        // returns at once each time
//   absl::Status s = y[0].block_until_ready();         // the first failure's error, if any
#ifndef TESSERA_JIT_H_
#define TESSERA_JIT_H_

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tessera/array.h"
#include "tessera/trace.h"

namespace tessera {

// How jit compiles and runs a function. Entries that do not fit the call (a wrong count, an
// axis not in the mesh) make the call fail with INVALID_ARGUMENT.
struct JitOptions {
  // One entry per output (or empty): the sharding wanted for it; nullopt lets propagation choose.
  std::vector<std::optional<PartitionSpec>> out_shardings;
  // How long every device may wait on the others within one execution; the call's deadline
  // derives from it (see Array::block_until_ready).
  absl::Duration timeout = absl::Seconds(60);
  // One entry per argument (or empty): the sharding each argument must have; nullopt accepts
  // any. For a committed array, as in JAX, a mismatch is an error (INVALID_ARGUMENT naming
  // the argument and both specs), never an implicit move: reshard with device_put or
  // with_sharding_constraint inside the function instead. An uncommitted one
  // (Array::committed) is moved to it. (Last: positional initializers of the fields above keep
  // their meaning.)
  std::vector<std::optional<PartitionSpec>> in_shardings = {};
  // Arguments the call takes over, as jax.jit's donate_argnums: the call runs once earlier
  // calls still reading them are done; each worker then drops them from its memory, writes
  // elementwise results over them in place (a training step's `w - lr * g` reuses w's
  // buffer) and frees the rest after their last use, whatever the call's outcome. Any later
  // use of a donated array (or a copy of its handle) is an error naming the donation:
  // INVALID_ARGUMENT when passed to a jitted call, FAILED_PRECONDITION when read (fetch,
  // Shard::data, block_until_ready, run_collective). An argument may not be donated and also
  // passed in another position (INVALID_ARGUMENT).
  std::vector<int> donate_argnums = {};
};

// A static argument of a jitted call, as jax.jit's static_argnums: a compile-time constant the
// traced function sees as a plain value (to choose shapes or branches, or to bake in), not an
// array. Its type and exact value are part of the compilation's key: a call with another value
// traces and compiles again, one with an equal value (same type; doubles equal bit for bit, so
// 0.1 and 0.1 + 1e-17, or 0.0 and -0.0, differ) reuses the program.
// Surprising: unlike Python's, int 1, double 1.0 and true are three different keys.
using StaticValue = std::variant<bool, int64_t, double, std::string>;
// A traced function with static arguments: `statics` are the call's, in order.
using StaticTracedFunction =
    std::function<std::vector<Value>(const std::vector<Value>& arrays, const std::vector<StaticValue>& statics)>;

// A function compiled by jit. Copies share the compilation cache.
class Jitted {
 public:
  // Nothing is traced or compiled until the first call. Prefer jit().
  Jitted(TracedFunction f, JitOptions options);
  Jitted(StaticTracedFunction f, JitOptions options);

  // Runs the function on `args` (the committed ones on one mesh of one client),
  // asynchronously as jax.jit. Uncommitted arguments (Array::committed) move first, as JAX
  // moves them: to the committed ones' mesh (replicated, or as in_shardings says); with none
  // committed, to the mesh a shard_map or sharding constraint in the function names (each as
  // the first one reading it wants it; the function is traced once more per signature to find
  // it), else they stay. Moving is a device_put (its errors, naming the argument). Then,
  // after the compilation (first call of a signature, synchronous) it returns the output
  // arrays at once, and the call runs on the devices once its arguments are ready (the
  // outputs of earlier calls still running are waited for, not on this thread). The outputs
  // report the call's outcome when used (Array::block_until_ready lists the errors): a lost
  // device, a kernel error, each naming the device. Errors returned here: INVALID_ARGUMENT
  // for no arguments, a trace error (naming the op and shapes), arguments on different
  // meshes or clients, an argument already donated, or options that do not fit the call
  // (in_shardings, donate_argnums, out_shardings); the compilation's errors (INVALID_ARGUMENT
  // when propagation fails, NOT_FOUND when the mesh names a device not in the cluster,
  // UNAVAILABLE or DEADLINE_EXCEEDED when the coordinator does not answer); an argument's
  // error when it is the output of a call already known to have failed (its root cause's
  // code, naming the original failure). With 16 calls of this client in flight, waits for one
  // to finish first (DEADLINE_EXCEEDED if none does by its deadline).
  absl::StatusOr<std::vector<Array>> operator()(const std::vector<Array>& args) const;
  // The same with static arguments (the C++ form of static_argnums: arrays and static values
  // come in two lists, so no position needs marking). INVALID_ARGUMENT when `statics` is not
  // empty and the function was made from a TracedFunction (it takes none).
  absl::StatusOr<std::vector<Array>> operator()(const std::vector<Array>& args,
                                                const std::vector<StaticValue>& statics) const;

  // The compiled program of the most recently used signature, like JAX's
  // lower(...).compile().as_text(): the one program every device runs (SPMD), its collectives
  // over mesh axes with their cause; empty before the first call. Asks the coordinator (the
  // program is cached there); a failure comes back as a "# ..." line naming the error.
  std::string as_text() const;
  // The same program as `device_id` runs it: replica groups as device ids, local slices as
  // offsets. NOT_FOUND (as a "# ..." line) when the device is not in the program's mesh.
  std::string as_text(int device_id) const;

  // Surprising: not this function's count, but how many programs the coordinator had
  // compiled in all (for every client and function) when this function last compiled a
  // signature; 0 before its first call. A cached call changes nothing.
  int64_t compilations() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// jax.jit: `f` compiled on its first call for each argument signature. Never fails itself;
// errors come from the calls.
Jitted jit(TracedFunction f, JitOptions options = {});
// jax.jit with static arguments: `f` traced and compiled once per argument signature and
// static values.
//   Jitted scale = jit([](const std::vector<Value>& in, const std::vector<StaticValue>& s) {
//     return std::vector<Value>{in[0] * std::get<double>(s[0])};
//   });
//   scale({x}, {2.0});   scale({x}, {3.0});    // two programs
Jitted jit(StaticTracedFunction f, JitOptions options = {});

// jax.typeof of an array: its dtype, shape and sharding over its mesh's Explicit axes
// ("f32[8@X,2]"; "f32[8,2]" on an all-Auto mesh, as JAX's type shows no Auto axes).
ShapedType type_of(const Array& x);

// jax.sharding.reshard(x, sharding) outside a trace: x laid out by `sharding`, moved by
// collectives on the workers (a jitted sharding constraint on x's mesh, device_put's move onto
// another), never through the client. x itself when it is laid out so already;
// INVALID_ARGUMENT when the sharding does not fit x (NamedSharding::validate's rules).
// A bare spec resolves against the ambient mesh (set_mesh), as JAX's canonicalize_sharding:
// with none, INVALID_ARGUMENT "reshard: the bare PartitionSpec P(...) needs a mesh: ...".
// Inside a trace, reshard(Value, spec) in tessera/trace.h.
absl::StatusOr<Array> reshard(const Array& x, const NamedSharding& sharding);
absl::StatusOr<Array> reshard(const Array& x, const PartitionSpec& spec);

}  // namespace tessera

#endif  // TESSERA_JIT_H_
