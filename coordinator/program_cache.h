// ProgramCache: the compile cache: compiled programs by their whole request (compile_key),
// at most max_programs of them (the least recently used that no execution runs goes first,
// unloaded from the workers), each held by the sessions that compiled it (released when the
// last lapses), and which devices have its plan loaded (load_plans, unload_plans).
//
// Locks: mu_ guards the table, the LRU ticks, the counts, and each Program's sessions, key,
// last_used and running; each Program's own mu guards which devices loaded its plan. Order:
// mu_ is never held with a Program::mu, and never across a compilation (propagate and
// partition run unlocked; a concurrent compile of the same key keeps the first) or a call to
// the workers (evicted programs are unloaded after it is released). load_plans and
// unload_plans with `wait` block on FanOut: never on a gRPC callback thread.
//
//   ProgramCache cache(1024, &registry, &channels, &fan_out);
//   absl::StatusOr<std::shared_ptr<Program>> p = cache.compile(key, graph, mesh, ins, outs, donated, session);
#ifndef TESSERA_COORDINATOR_PROGRAM_CACHE_H_
#define TESSERA_COORDINATOR_PROGRAM_CACHE_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/compiler/partition.h"
#include "coordinator/fan_out.h"
#include "coordinator/registry.h"
#include "coordinator/worker_channels.h"
#include "core/graph.h"
#include "core/heap.h"
#include "core/metrics.h"
#include "proto/auth.h"
#include "proto/tessera.grpc.pb.h"

namespace tessera {

// A compiled program and the devices that have its plan loaded. A plan carries the address
// of every device of the program, so each device's entry is the incarnations of all of
// them when it got the plan: a worker that restarted has lost its plans, and the others
// know it under an old address (an address changes only with a new incarnation).
struct Program {
  Program(Graph g, Executable e) : graph(std::move(g)), exe(std::move(e)) {
    // Each device resolves the one program into a plan of as many instructions (and loops).
    op_span = std::max<uint64_t>(op_span, plan_op_span(exe.program));
  }
  uint64_t id = 0;
  Graph graph;
  Executable exe;
  // Ids an execution takes: its own, and one per instruction for the op ids of its
  // collectives (worker/interpreter.h's plan_op_id).
  uint64_t op_span = 1;
  absl::Mutex mu;
  std::map<int, std::vector<uint64_t>> loaded ABSL_GUARDED_BY(mu);
  std::atomic<int64_t> executions{0};
  // Guarded by ProgramCache::mu_: the sessions that compiled it (it is freed when the last
  // lapses); its compile_key; when it was last compiled or executed (a tick of ProgramCache::use_ticks_,
  // for the cache's LRU order); the executions using it (it is not evicted while any runs).
  std::set<uint64_t> sessions;
  std::string key;
  uint64_t last_used = 0;
  int running = 0;
};

class ProgramCache {
 public:
  ProgramCache(int max_programs, Registry* registry, WorkerChannels* channels, FanOut* fan_out)
      : max_programs_(max_programs), registry_(registry), channels_(channels), fan_out_(fan_out) {}

  // Keeps a program out of eviction while an execution uses it (until destroyed).
  class ProgramUse {
   public:
    // REQUIRES: cache->mu_ held.
    ProgramUse(ProgramCache* cache, Program* program) : cache_(cache), program_(program) { ++program_->running; }
    ~ProgramUse() {
      absl::MutexLock lock(&cache_->mu_);
      --program_->running;
    }
    ProgramUse(const ProgramUse&) = delete;
    ProgramUse& operator=(const ProgramUse&) = delete;

   private:
    ProgramCache* const cache_;
    Program* const program_;
  };

  // The program of the checked request `key` (compile_key of the rest), compiled unless the
  // cache has it, held by `session` (0: none) from now on.
  absl::StatusOr<std::shared_ptr<Program>> compile(std::string key, Graph graph, const Mesh& mesh,
                                                   const std::vector<PartitionSpec>& inputs,
                                                   const std::vector<std::optional<PartitionSpec>>& outputs,
                                                   const std::vector<int>& donated, uint64_t session);

  // Executable `id` for an execution by `caller`, kept out of eviction by *use: ABORTED if it
  // is not in the cache (the client compiles it again), PERMISSION_DENIED if another session
  // compiled it and `caller` is no admin.
  absl::StatusOr<std::shared_ptr<Program>> use(uint64_t id, const Caller& caller, std::unique_ptr<ProgramUse>* use);

  // Forgets `lapsed` as holders of programs; returns the programs no session holds any more
  // (forgotten too), whose plans the workers may drop.
  std::vector<std::shared_ptr<Program>> release(const std::vector<uint64_t>& lapsed);

  // Tells the devices that loaded `programs` to drop their plans (bounded; a device that does
  // not answer keeps them: plan ids are never reused). Without `wait`, only starts to. Takes
  // the cache's references and drops them before it counts the release for the heap trimmer
  // (what no execution still holds is destroyed by then).
  void unload_plans(std::vector<std::shared_ptr<Program>> programs, bool wait = true);

  // The indices of the members that lack the program's plan for the members as they are now.
  static std::vector<int> missing_plans(Program& program, const Members& members);

  // Sends the program's plan to every device that does not have it yet (blocks: FanOut).
  absl::Status load_plans(Program& program, const Members& members,
                          const std::vector<std::shared_ptr<WorkerChannel>>& workers);

  struct Counts {
    int64_t programs = 0;
    int64_t compilations = 0;
    int64_t evictions = 0;
  };
  Counts counts();
  int64_t cache_hits() const { return cache_hits_.load(); }
  // Compile requests the cache did not hold (each compiled, whether it then failed or another
  // request compiled the same program meanwhile): with cache_hits(), every compile request.
  int64_t cache_misses() const { return cache_misses_.load(); }
  // Told of every eviction and release: the coordinator's monitor trims the heap after them.
  HeapTrimmer& heap() { return heap_; }
  const LatencyHistogram& compile_seconds() const { return compile_seconds_; }

  // GetClusterStatus's programs (those of `session` unless `everything`), while `*bytes`
  // stays within `max_bytes` (the rest counted), and the cache's counts.
  void list(bool everything, uint64_t session, size_t max_bytes, size_t* bytes, pb::ClusterStatus* reply);

 private:
  // The least recently used programs beyond max_programs that no execution uses, forgotten;
  // their plans are the workers' to drop.
  std::vector<std::shared_ptr<Program>> evict_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `session` (0: none) holds `program` from now on.
  std::shared_ptr<Program> hold_locked(std::shared_ptr<Program> program, uint64_t session)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int max_programs_;
  Registry* const registry_;
  WorkerChannels* const channels_;
  FanOut* const fan_out_;

  absl::Mutex mu_;
  absl::flat_hash_map<std::string, uint64_t> cache_ ABSL_GUARDED_BY(mu_);  // compile_key -> id
  std::map<uint64_t, std::shared_ptr<Program>> programs_ ABSL_GUARDED_BY(mu_);
  int64_t compilations_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t evictions_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t use_ticks_ ABSL_GUARDED_BY(mu_) = 0;

  std::atomic<int64_t> cache_hits_{0};
  std::atomic<int64_t> cache_misses_{0};
  HeapTrimmer heap_;
  LatencyHistogram compile_seconds_{"tessera_coordinator_compile_seconds",
                                    "Compilations (propagation and partitioning) of programs not in the cache."};
};

using ProgramUse = ProgramCache::ProgramUse;

}  // namespace tessera

#endif  // TESSERA_COORDINATOR_PROGRAM_CACHE_H_
