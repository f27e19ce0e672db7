// The state of a trace in progress, shared by tracing (trace.cc) and shard_map
// (shard_map.cc). Internal to the client library.
#ifndef TESSERA_CLIENT_TRACE_STATE_H_
#define TESSERA_CLIENT_TRACE_STATE_H_

#include <initializer_list>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "client/explicit/rules.h"
#include "core/graph.h"
#include "core/mesh.h"
#include "tessera/trace.h"

namespace tessera {
namespace internal {

// One trace in progress: the graph being recorded and its first error.
struct TraceState : std::enable_shared_from_this<TraceState> {
  Graph graph;
  absl::Status error;
  // The shard_map bodies being traced, innermost last: their mesh (what collectives run over).
  std::vector<Mesh> manual_meshes;

  // Explicit sharding (client/explicit/rules.h): the arguments' mesh when it has an Explicit
  // axis, and then every node's type spec, by id (filled by make() as nodes are added); inside
  // an out_sharding, rules may leave an ambiguous result to it (out_sharding_scopes > 0).
  std::optional<Mesh> explicit_mesh;
  std::vector<TypeSpec> specs;
  int out_sharding_scopes = 0;

  // The type specs of the nodes added since the last call (their rules' errors name the op).
  absl::Status type_new_nodes();

  // The trace running on this thread (for ops without operands: iota, full).
  static thread_local TraceState* current;

  static TraceState* of(const Value& v) { return v.trace_.get(); }
  static int id(const Value& v) { return v.id_; }

  Value make(absl::StatusOr<int> id) {
    if (!id.ok()) return fail(id.status());
    if (explicit_mesh.has_value()) {
      absl::Status typed = type_new_nodes();
      if (!typed.ok()) return fail(typed);
    }
    return Value(shared_from_this(), *id);
  }
  Value fail(const absl::Status& status) {
    if (error.ok()) error = status;
    return Value();
  }

  // The trace all of `values` belong to, or null (recording why) if one failed already or
  // they come from different traces.
  static TraceState* common(std::initializer_list<const Value*> values) {
    TraceState* t = nullptr;
    for (const Value* v : values) {
      if (!v->ok()) return nullptr;
      if (t == nullptr) t = of(*v);
      if (of(*v) != t) {
        t->fail(absl::InvalidArgumentError("an op mixes values of two different traces"));
        return nullptr;
      }
    }
    return t;
  }
};

// A dimension given numpy-style (negative counts from the end) as a position in 0..rank-1
// (out-of-range values stay out of range, for the graph to refuse).
inline int64_t normalize_axis(int64_t axis, int64_t rank) { return axis < 0 ? axis + rank : axis; }

}  // namespace internal

}  // namespace tessera

#endif  // TESSERA_CLIENT_TRACE_STATE_H_
