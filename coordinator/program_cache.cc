#include "coordinator/program_cache.h"

#include <algorithm>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "coordinator/compiler/propagate.h"
#include "core/status.h"
#include "core/wire.h"
#include "proto/rpc.h"

namespace tessera {

absl::StatusOr<std::shared_ptr<Program>> ProgramCache::compile(std::string key, Graph graph, const Mesh& mesh,
                                                               const std::vector<PartitionSpec>& inputs,
                                                               const std::vector<std::optional<PartitionSpec>>& outputs,
                                                               const std::vector<int>& donated, uint64_t session) {
  {
    absl::MutexLock lock(&mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) {
      cache_hits_.fetch_add(1);
      return hold_locked(programs_[it->second], session);
    }
  }
  cache_misses_.fetch_add(1);
  const absl::Time compile_start = absl::Now();
  TESSERA_ASSIGN_OR_RETURN(Propagation propagation, propagate(graph, mesh, inputs, outputs));
  TESSERA_ASSIGN_OR_RETURN(Executable exe, partition(graph, mesh, propagation, outputs, donated));
  compile_seconds_.observe(absl::Now() - compile_start);
  auto program = std::make_shared<Program>(std::move(graph), std::move(exe));
  std::vector<std::shared_ptr<Program>> evicted;
  {
    absl::MutexLock lock(&mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) return hold_locked(programs_[it->second], session);  // compiled concurrently
    program->id = registry_->ids().next();
    ++compilations_;
    program->key = key;
    cache_[std::move(key)] = program->id;
    programs_[program->id] = program;
    hold_locked(program, session);
    evicted = evict_locked();
  }
  unload_plans(std::move(evicted), /*wait=*/false);
  return program;
}

absl::StatusOr<std::shared_ptr<Program>> ProgramCache::use(uint64_t id, const Caller& caller,
                                                           std::unique_ptr<ProgramUse>* use) {
  std::shared_ptr<Program> program;
  std::unique_ptr<ProgramUse> held;
  bool denied = false;
  {
    // Execute calls this on gRPC callback threads, concurrently with compile (insert, evict)
    // and release (erase): the lookup, the tick and `running` change under mu_.
    absl::MutexLock lock(&mu_);
    auto it = programs_.find(id);
    if (it == programs_.end()) {
      if (registry_->ids().before_epoch(id)) {
        return absl::AbortedError(absl::StrCat("execute: executable ", id,
                                               " belongs to an earlier incarnation of the coordinator, which "
                                               "restarted since; compile again"));
      }
      // Evicted from the compile cache, or released with the last session holding it: the
      // client compiles it again (the SDK does so by itself on ABORTED).
      return absl::AbortedError(absl::StrCat("execute: executable ", id, " is not in the compile cache (it holds the ",
                                             max_programs_,
                                             " most recently used programs, --max_programs); compile again"));
    }
    program = it->second;
    program->last_used = ++use_ticks_;
    held = std::make_unique<ProgramUse>(this, program.get());
    denied = !caller.at_least(Role::kAdmin) && program->sessions.count(caller.session) == 0;
  }
  *use = std::move(held);  // (outside mu_: a use it replaces takes mu_ as it ends)
  if (denied) {
    return absl::PermissionDeniedError(absl::StrCat("execute: executable ", id,
                                                    " was compiled by another session; a client runs only the "
                                                    "programs its own session compiled (Compile it first)"));
  }
  return program;
}

std::vector<std::shared_ptr<Program>> ProgramCache::evict_locked() {
  std::vector<std::shared_ptr<Program>> evicted;
  const size_t limit = static_cast<size_t>(std::max(1, max_programs_));
  while (programs_.size() > limit) {
    auto oldest = programs_.end();
    for (auto it = programs_.begin(); it != programs_.end(); ++it) {
      if (it->second->running == 0 &&
          (oldest == programs_.end() || it->second->last_used < oldest->second->last_used)) {
        oldest = it;
      }
    }
    if (oldest == programs_.end()) break;  // every one is running: over the bound until they end
    cache_.erase(oldest->second->key);
    evicted.push_back(std::move(oldest->second));
    programs_.erase(oldest);
    ++evictions_;
  }
  return evicted;
}

std::shared_ptr<Program> ProgramCache::hold_locked(std::shared_ptr<Program> program, uint64_t session) {
  if (session != 0) program->sessions.insert(session);
  program->last_used = ++use_ticks_;
  return program;
}

std::vector<std::shared_ptr<Program>> ProgramCache::release(const std::vector<uint64_t>& lapsed) {
  std::vector<std::shared_ptr<Program>> unused;
  if (lapsed.empty()) return unused;
  absl::MutexLock lock(&mu_);
  for (auto it = programs_.begin(); it != programs_.end();) {
    std::set<uint64_t>& holders = it->second->sessions;
    const size_t before = holders.size();
    for (uint64_t s : lapsed) holders.erase(s);
    if (before == 0 || !holders.empty()) {
      ++it;
      continue;
    }
    unused.push_back(it->second);
    it = programs_.erase(it);
  }
  absl::erase_if(cache_, [&](const auto& entry) { return programs_.count(entry.second) == 0; });
  return unused;
}

void ProgramCache::unload_plans(std::vector<std::shared_ptr<Program>> programs, bool wait) {
  if (programs.empty()) return;
  // Counted last, after `programs` (the cache's references: nothing else holds a program no
  // execution runs) are destroyed: a trim between the count and their destruction would find
  // nothing to return, reset the count, and leave their pages until the next release.
  absl::Cleanup count_release = [this, &programs] {
    programs.clear();
    heap_.released();
  };
  std::map<int, pb::UnloadPlansRequest> per_device;
  for (const std::shared_ptr<Program>& p : programs) {
    absl::MutexLock lock(&p->mu);
    for (const auto& [device, incarnations] : p->loaded) per_device[device].add_plan_ids(p->id);
  }
  std::vector<std::shared_ptr<WorkerChannel>> workers;
  std::vector<const pb::UnloadPlansRequest*> requests;
  for (const auto& [device, request] : per_device) {
    std::optional<DeviceRecord> d = registry_->device(device);
    if (!d.has_value() || !d->alive) continue;
    workers.push_back(channels_->get(d->address));
    requests.push_back(&request);
  }
  if (!wait) {
    for (size_t i = 0; i < workers.size(); ++i) {
      fan_out_->call_async<pb::UnloadPlansRequest, pb::UnloadPlansReply>(
          workers[i], *requests[i], [](auto* stub, auto* ctx, auto* req, auto* reply, auto done) {
            stub->UnloadPlans(ctx, req, reply, std::move(done));
          });
    }
    return;
  }
  std::vector<pb::UnloadPlansReply> replies(workers.size());
  fan_out_->fan_out(workers, kConnectDeadline, [&](int i, grpc::ClientContext* ctx, auto done) {
    workers[i]->stub->async()->UnloadPlans(ctx, requests[i], &replies[i], std::move(done));
  });
}

std::vector<int> ProgramCache::missing_plans(Program& program, const Members& members) {
  std::vector<int> missing;
  absl::MutexLock lock(&program.mu);
  for (size_t k = 0; k < members.peers.size(); ++k) {
    auto it = program.loaded.find(members.peers[k].device_id());
    if (it == program.loaded.end() || it->second != members.incarnations) missing.push_back(static_cast<int>(k));
  }
  return missing;
}

absl::Status ProgramCache::load_plans(Program& program, const Members& members,
                                      const std::vector<std::shared_ptr<WorkerChannel>>& workers) {
  const std::vector<pb::PeerAddress>& peers = members.peers;
  const std::vector<int> missing = missing_plans(program, members);
  if (missing.empty()) return absl::OkStatus();
  std::vector<pb::LoadPlanReply> replies(missing.size());
  std::vector<std::shared_ptr<WorkerChannel>> targets;
  Members target;
  // One program for every device (each resolves it for its position): encoded once, and
  // every call reads the same request.
  pb::LoadPlanRequest request;
  request.set_plan_id(program.id);
  tessera::to_proto(program.exe.program, request.mutable_plan());
  tessera::to_proto(program.exe.mesh, request.mutable_mesh());
  for (const pb::PeerAddress& p : peers) *request.add_peers() = p;
  for (size_t m = 0; m < missing.size(); ++m) {
    targets.push_back(workers[missing[m]]);
    target.peers.push_back(peers[missing[m]]);
    target.incarnations.push_back(members.incarnations[missing[m]]);
  }
  std::vector<grpc::Status> statuses = fan_out_->fan_out(
      targets, kControlDeadline,
      [&](int m, grpc::ClientContext* ctx, auto done) {
        targets[m]->stub->async()->LoadPlan(ctx, &request, &replies[m], std::move(done));
      },
      absl::InfiniteDuration(), &target);
  TESSERA_RETURN_IF_ERROR(FanOut::first_failure(statuses, target.peers, "load plan"));
  absl::MutexLock lock(&program.mu);
  for (size_t m = 0; m < target.peers.size(); ++m) {
    program.loaded[target.peers[m].device_id()] = members.incarnations;
  }
  return absl::OkStatus();
}

ProgramCache::Counts ProgramCache::counts() {
  absl::MutexLock lock(&mu_);
  return Counts{static_cast<int64_t>(programs_.size()), compilations_, evictions_};
}

void ProgramCache::list(bool everything, uint64_t session, size_t max_bytes, size_t* bytes, pb::ClusterStatus* reply) {
  absl::MutexLock lock(&mu_);
  reply->set_compilations(compilations_);
  reply->set_programs_evicted(evictions_);
  for (const auto& [id, program] : programs_) {
    if (!everything && program->sessions.count(session) == 0) continue;
    if (*bytes > max_bytes) {
      reply->set_executables_omitted(reply->executables_omitted() + 1);
      continue;
    }
    pb::ExecutableInfo* info = reply->add_executables();
    info->set_executable_id(id);
    tessera::to_proto(program->exe.mesh, info->mutable_mesh());
    for (const PartitionSpec& spec : program->exe.input_specs) to_proto(spec, info->add_input_specs());
    for (const PartitionSpec& spec : program->exe.output_specs) to_proto(spec, info->add_output_specs());
    info->set_graph_nodes(static_cast<int64_t>(program->graph.size()));
    info->set_executions(program->executions.load());
    *bytes += info->ByteSizeLong() + 8;
  }
}

}  // namespace tessera
