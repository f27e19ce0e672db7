#include "coordinator/execution_driver.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "coordinator/access.h"
#include "coordinator/ids.h"
#include "coordinator/request_limits.h"
#include "core/run_tag.h"
#include "core/status.h"
#include "proto/local_runs.h"
#include "proto/rpc.h"

namespace tessera {
namespace {

// Calls naming the outputs of calls still in flight (ExecuteRequest.pending_inputs): how long
// a call waits for a producer that has not reached the coordinator (gRPC may hand two calls to
// the handlers out of order; a producer whose Execute never came fails its consumers then),
// how many such producers may be awaited at once, and how many finished calls' outcomes are
// remembered for consumers that arrive after them (the SDK has at most 16 calls in flight).
constexpr absl::Duration kProducerArrival = absl::Seconds(10);
constexpr size_t kMaxAwaitedCalls = 1024;
constexpr size_t kMaxRememberedCalls = 4096;
constexpr size_t kMaxCalls = 1 << 16;

}  // namespace

void ExecutionDriver::start_execution(const CallKey& key, const Caller& caller, const pb::ExecuteRequest& req,
                                      grpc::ServerUnaryReactor* reactor, pb::ExecuteReply* reply,
                                      std::vector<std::pair<int, std::shared_ptr<Execution>>> producers,
                                      std::map<int, std::vector<uint64_t>> frees) {
  absl::StatusOr<std::shared_ptr<Execution>> e = prepare_execution(req, caller, reactor, reply);
  if (!e.ok()) {
    fan_out_->delete_buffers(frees, /*wait=*/false);
    complete_call(key, e.status(), {});
    reactor->Finish(to_grpc(e.status()));
    return;
  }
  (*e)->call = key;
  (*e)->producers = std::move(producers);
  publish_running(key, *e);
  if (ProgramCache::missing_plans(*(*e)->program, (*e)->members).empty()) {
    bool ride = true;
    for (const auto& [device, ids] : frees) {
      bool member = false;
      for (const pb::PeerAddress& p : (*e)->members.peers) member = member || p.device_id() == device;
      ride = ride && member;
    }
    if (ride) {
      std::set<uint64_t> ids;
      int64_t blocks = 0;
      for (const auto& [device, buffers] : frees) {
        ids.insert(buffers.begin(), buffers.end());
        blocks += static_cast<int64_t>(buffers.size());
      }
      for (uint64_t id : ids) (*e)->request.add_free_buffers(id);
      deletes_on_runs_.fetch_add(blocks);
      (*e)->frees = std::move(frees);
    } else {
      fan_out_->delete_buffers(frees, /*wait=*/false);
    }
    run_plans(*std::move(e));
    return;
  }
  fan_out_->delete_buffers(frees, /*wait=*/false);
  // Loading waits for the workers: on a thread of the pool, never this one. The server
  // waits for Finish before it goes, and the pool's destructor for the thread.
  std::shared_ptr<Execution> execution = *std::move(e);
  absl::Status started = plan_loads_.run([this, execution] {
    absl::Status loaded = programs_->load_plans(*execution->program, execution->members, execution->workers);
    if (loaded.ok()) {
      run_plans(execution);
    } else {
      fail_execution(*execution, loaded);
    }
  });
  if (!started.ok())
    fail_execution(*execution, absl::Status(started.code(), absl::StrCat("execute: ", started.message())));
}

absl::Status ExecutionDriver::arrive_call(const CallKey& key) {
  if (key.call == 0) return absl::OkStatus();
  absl::MutexLock lock(&calls_mu_);
  auto it = calls_.find(key);
  if (it == calls_.end()) {
    if (calls_.size() >= kMaxCalls) {
      return absl::ResourceExhaustedError(absl::StrCat("execute: ", kMaxCalls,
                                                       " calls named by call id are in flight or awaited; call ",
                                                       key.call, " is one too many"));
    }
    calls_[key].arrived = true;
    return absl::OkStatus();
  }
  if (it->second.arrived || it->second.outcome.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat("execute: call id ", key.call, " was used already by session ",
                                                   key.session, "; each call of a session needs an id of its own"));
  }
  it->second.arrived = true;  // awaited by calls that came first
  --awaited_calls_;
  return absl::OkStatus();
}

void ExecutionDriver::complete_call(const CallKey& key, const absl::Status& status, std::vector<uint64_t> outputs) {
  if (key.call == 0) return;
  std::vector<CallWaiter> waiters;
  CallOutcome outcome{status, std::move(outputs)};
  {
    absl::MutexLock lock(&calls_mu_);
    auto it = calls_.find(key);
    if (it == calls_.end()) return;
    CallEntry& entry = it->second;
    if (status.code() == absl::StatusCode::kAborted) {
      if (entry.waiters.empty()) {
        calls_.erase(it);
      } else {
        entry.arrived = false;
        entry.awaited_until = absl::Now() + kProducerArrival;
        ++awaited_calls_;
      }
      return;
    }
    entry.outcome = outcome;
    entry.running = nullptr;
    waiters.swap(entry.waiters);
    remembered_.push_back(key);
    while (remembered_.size() > kMaxRememberedCalls) {
      calls_.erase(remembered_.front());
      remembered_.pop_front();
    }
  }
  for (auto& w : waiters) w(&outcome, nullptr);
}

void ExecutionDriver::publish_running(const CallKey& key, const std::shared_ptr<Execution>& e) {
  if (key.call == 0) return;
  std::vector<CallWaiter> waiters;
  {
    absl::MutexLock lock(&calls_mu_);
    auto it = calls_.find(key);
    if (it == calls_.end()) return;
    it->second.running = e;
    waiters.swap(it->second.waiters);
  }
  for (auto& w : waiters) w(nullptr, e);
}

void ExecutionDriver::start_monitor(absl::Duration tick, MonitorSteps steps) {
  if (monitor_.joinable()) {  // our invariant: assigning a joinable std::thread would terminate anyway
    std::fprintf(stderr, "tessera-coordinator: ExecutionDriver::start_monitor called twice\n");
    std::abort();
  }
  monitor_ = std::thread([this, tick, steps = std::move(steps)] {
    auto run = [](const std::function<void()>& step) {
      if (step) step();
    };
    while (!monitor_stopping_.WaitForNotificationWithTimeout(tick)) {
      run(steps.before_watch);
      watch_executions();
      run(steps.after_watch);
      expire_awaited_calls();
      run(steps.after);
    }
  });
}

void ExecutionDriver::stop_monitor() {
  if (!monitor_stopping_.HasBeenNotified()) monitor_stopping_.Notify();
  if (monitor_.joinable()) monitor_.join();
}

void ExecutionDriver::expire_awaited_calls() {
  std::vector<std::pair<CallKey, std::vector<CallWaiter>>> expired;
  const absl::Time now = absl::Now();
  {
    absl::MutexLock lock(&calls_mu_);
    for (auto it = calls_.begin(); it != calls_.end();) {
      if (it->second.arrived || it->second.outcome.has_value() || now < it->second.awaited_until) {
        ++it;
        continue;
      }
      expired.emplace_back(it->first, std::move(it->second.waiters));
      --awaited_calls_;
      calls_.erase(it++);
    }
  }
  for (auto& [key, waiters] : expired) {
    CallOutcome outcome{absl::DeadlineExceededError(absl::StrCat("call ", key.call, " of session ", key.session,
                                                                 " did not reach the coordinator within ",
                                                                 absl::FormatDuration(kProducerArrival))),
                        {}};
    for (auto& w : waiters) w(&outcome, nullptr);
  }
}

void ExecutionDriver::await_producers(const CallKey& key, const Caller& caller, const pb::ExecuteRequest* req,
                                      grpc::ServerUnaryReactor* reactor, pb::ExecuteReply* reply,
                                      std::map<int, std::vector<uint64_t>> frees) {
  const uint64_t epoch = registry_->epoch();
  if (req->epoch() != 0 && req->epoch() != epoch) {
    fan_out_->delete_buffers(frees, /*wait=*/false);
    // The producers ran under an earlier coordinator: nothing here is theirs.
    absl::Status aborted = absl::AbortedError(
        absl::StrCat("execute: executable ", req->executable_id(), " was compiled by coordinator epoch ", req->epoch(),
                     " but this is epoch ", epoch, " (the coordinator restarted); compile again"));
    complete_call(key, aborted, {});
    reactor->Finish(to_grpc(aborted));
    return;
  }
  auto wait = std::make_shared<ProducerWait>();
  wait->key = key;
  wait->caller = caller;
  wait->request = *req;
  wait->reactor = reactor;
  wait->reply = reply;
  {
    absl::MutexLock lock(&wait->mu);
    wait->frees = std::move(frees);
  }
  const int n = req->pending_inputs_size();
  wait->pending.store(n + 1);  // one for this function
  bool awaits_arrival = false;
  auto one_done = [this, wait] {
    if (wait->pending.fetch_sub(1) != 1) return;
    absl::Status failure;
    std::vector<std::pair<int, std::shared_ptr<Execution>>> producers;
    std::map<int, std::vector<uint64_t>> frees;
    {
      absl::MutexLock lock(&wait->mu);
      failure = wait->failure;
      producers.swap(wait->producers);
      frees.swap(wait->frees);
    }
    if (!failure.ok()) {
      fan_out_->delete_buffers(frees, /*wait=*/false);
      complete_call(wait->key, failure, {});
      wait->reactor->Finish(to_grpc(failure));
      return;
    }
    bool behind_a_running_call = false;
    for (const auto& [input, producer] : producers) {
      absl::MutexLock lock(&producer->mu);
      behind_a_running_call = behind_a_running_call || !producer->finished;
    }
    if (behind_a_running_call) chained_calls_.fetch_add(1);
    start_execution(wait->key, wait->caller, wait->request, wait->reactor, wait->reply, std::move(producers),
                    std::move(frees));
  };
  auto fail = [wait](absl::Status status) {
    absl::MutexLock lock(&wait->mu);
    if (wait->failure.ok()) wait->failure = std::move(status);
  };
  for (int k = 0; k < n; ++k) {
    const pb::CallOutput& p = req->pending_inputs(k);
    if (p.input() < 0 || p.input() >= req->input_arrays_size() || req->input_arrays(p.input()) != 0 ||
        p.call_id() == 0 || p.call_id() == key.call || p.output() < 0) {
      fail(absl::InvalidArgumentError(absl::StrCat(
          "execute: pending input ", k, " (input ", p.input(), ", call ", p.call_id(), ", output ", p.output(),
          ") must name one of the ", req->input_arrays_size(), " inputs left 0, and an output of another call")));
      one_done();
      continue;
    }
    // The producer ended (outcome) or runs: then this is sent after its runs were.
    auto resolve = [wait, p, fail, one_done](const CallOutcome* outcome, const std::shared_ptr<Execution>& running) {
      auto take = [wait, p, fail, one_done](const absl::Status& status, const std::vector<uint64_t>& outputs,
                                            std::shared_ptr<Execution> producer) {
        if (!status.ok()) {
          fail(absl::Status(status.code(), absl::StrCat("execute: input ", p.input(),
                                                        " is an output of a failed call: ", status.message())));
        } else if (p.output() >= static_cast<int>(outputs.size())) {
          fail(absl::InvalidArgumentError(absl::StrCat("execute: input ", p.input(), " names output ", p.output(),
                                                       " of call ", p.call_id(), ", which has ", outputs.size())));
        } else {
          absl::MutexLock lock(&wait->mu);
          wait->request.set_input_arrays(p.input(), outputs[p.output()]);
          if (producer != nullptr) wait->producers.emplace_back(p.input(), std::move(producer));
        }
        one_done();
      };
      if (outcome != nullptr) {
        take(outcome->status, outcome->outputs, nullptr);
        return;
      }
      when_sent(*running, [take, running] {
        const absl::Status failed = failed_before_finish(*running);
        take(failed, running->output_ids, failed.ok() ? running : nullptr);
      });
    };
    std::optional<CallOutcome> known;
    std::shared_ptr<Execution> running;
    absl::Status refused;
    {
      absl::MutexLock lock(&calls_mu_);
      const CallKey producer{key.session, p.call_id()};
      auto it = calls_.find(producer);
      if (it != calls_.end() && it->second.outcome.has_value()) {
        known = it->second.outcome;
      } else if (it != calls_.end() && it->second.running != nullptr) {
        running = it->second.running;
      } else if (it == calls_.end() && (awaited_calls_ >= kMaxAwaitedCalls || calls_.size() >= kMaxCalls)) {
        refused = absl::ResourceExhaustedError(
            absl::StrCat("execute: input ", p.input(), " names call ", p.call_id(), ", which has not arrived, and ",
                         awaited_calls_, " such calls are awaited already (at most ", kMaxAwaitedCalls, ")"));
      } else {
        CallEntry& entry = calls_[producer];
        if (it == calls_.end()) {
          entry.awaited_until = absl::Now() + kProducerArrival;
          ++awaited_calls_;
        }
        entry.waiters.push_back(resolve);
        awaits_arrival = awaits_arrival || !entry.arrived;
      }
    }
    if (known.has_value()) {
      resolve(&*known, nullptr);
    } else if (running != nullptr) {
      resolve(nullptr, running);
    } else if (!refused.ok()) {
      fail(refused);
      one_done();
    }
  }
  if (awaits_arrival) {
    // A producer has not reached the coordinator (it may never): the deletions go now, not
    // kept while it waits (the start cannot take them before the one_done below). A producer
    // that arrived passes its checks and sends its runs at once, or once its plans are
    // loaded: they ride on this call's runs then, as in a chain (no StreamDelete on every
    // stream per link).
    std::map<int, std::vector<uint64_t>> now;
    {
      absl::MutexLock lock(&wait->mu);
      now.swap(wait->frees);
    }
    if (!now.empty()) fan_out_->delete_buffers(now, /*wait=*/false);
  }
  one_done();
}

void ExecutionDriver::watch_executions() {
  std::vector<std::shared_ptr<Execution>> running;
  {
    absl::MutexLock lock(&executions_mu_);
    for (const auto& [id, e] : executions_) running.push_back(e);
  }
  const absl::Time now = absl::Now();
  for (const std::shared_ptr<Execution>& e : running) {
    const int lost = fan_out_->changed_member(e->members);
    const bool late = now > e->deadline;
    {
      absl::MutexLock lock(&e->mu);
      // Not before every run is sent: a cancel would miss the runs sent after it.
      if (!e->sent || e->cancelled || (lost < 0 && !late && now - e->first_failure < kFailureGrace)) continue;
      e->cancelled = true;
      e->lost = lost;
    }
    // Outside the lock: a cancelled run completes on this thread.
    const grpc::Status status =
        lost < 0 && late ? grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                                        absl::StrCat("no result within ", absl::FormatDuration(run_wait(*e))))
                         : grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    for (const std::shared_ptr<PlanStream>& stream : e->streams) {
      if (stream != nullptr) stream->cancel(e->id, status);
    }
  }
}

void ExecutionDriver::when_sent(Execution& e, std::function<void()> f) {
  {
    absl::MutexLock lock(&e.mu);
    if (!e.sent && !e.finished) {
      e.on_sent.push_back(std::move(f));
      return;
    }
  }
  f();
}

void ExecutionDriver::when_finished(Execution& e, std::function<void()> f) {
  {
    absl::MutexLock lock(&e.mu);
    if (!e.finished) {
      e.on_finished.push_back(std::move(f));
      return;
    }
  }
  f();
}

absl::Status ExecutionDriver::failed_before_finish(Execution& e) {
  absl::MutexLock lock(&e.mu);
  return e.finished ? e.outcome : absl::OkStatus();
}

void ExecutionDriver::settle(Execution& e, const absl::Status& outcome) {
  std::vector<std::function<void()>> waiting;
  {
    absl::MutexLock lock(&e.mu);
    e.finished = true;
    e.outcome = outcome;
    waiting.swap(e.on_sent);
    for (auto& f : e.on_finished) waiting.push_back(std::move(f));
    e.on_finished.clear();
  }
  for (auto& f : waiting) f();
}

absl::StatusOr<std::shared_ptr<Execution>> ExecutionDriver::prepare_execution(const pb::ExecuteRequest& req,
                                                                              const Caller& caller,
                                                                              grpc::ServerUnaryReactor* reactor,
                                                                              pb::ExecuteReply* reply) {
  TESSERA_ASSIGN_OR_RETURN(const uint64_t session, acting_session(caller, req.session_id(), "execute"));
  std::shared_ptr<Program> program;
  std::unique_ptr<ProgramUse> use;
  const uint64_t epoch = registry_->epoch();
  if (req.epoch() != 0 && req.epoch() != epoch) {
    return absl::AbortedError(absl::StrCat("execute: executable ", req.executable_id(),
                                           " was compiled by coordinator epoch ", req.epoch(), " but this is epoch ",
                                           epoch, " (the coordinator restarted); compile again"));
  }
  TESSERA_ASSIGN_OR_RETURN(program, programs_->use(req.executable_id(), caller, &use));
  TESSERA_ASSIGN_OR_RETURN(const absl::Duration timeout, run_timeout("execute", req.timeout_ms()));
  const Graph& graph = program->graph;
  const Executable& exe = program->exe;
  if (req.input_arrays_size() != static_cast<int>(graph.parameters().size())) {
    return absl::InvalidArgumentError(absl::StrCat("execute: the program takes ", graph.parameters().size(),
                                                   " inputs, got ", req.input_arrays_size()));
  }
  std::vector<uint64_t> input_ids;
  for (int i = 0; i < req.input_arrays_size(); ++i) {
    TESSERA_ASSIGN_OR_RETURN(ArrayRecord a, registry_->get_array(req.input_arrays(i)));
    TESSERA_RETURN_IF_ERROR(check_owner(caller, a, absl::StrCat("execute: input ", i), "read"));
    const Node& p = graph.node(graph.parameters()[i]);
    if (a.dtype != p.dtype || a.shape != p.shape) {
      return absl::InvalidArgumentError(absl::StrCat("execute: input ", i, " is ", type_to_string(a.dtype, a.shape),
                                                     " but the program takes ", type_to_string(p.dtype, p.shape)));
    }
    // The same layout (P('x') is P('x', None) for a matrix), not the same spec as written.
    if (!a.sharding.is_equivalent_to(NamedSharding(exe.mesh, exe.input_specs[i]), static_cast<int>(a.shape.size()))) {
      return absl::InvalidArgumentError(absl::StrCat("execute: input ", i, " is laid out as ", a.sharding.to_string(),
                                                     " but the program was compiled for ",
                                                     NamedSharding(exe.mesh, exe.input_specs[i]).to_string()));
    }
    TESSERA_RETURN_IF_ERROR(check_not_lost(*registry_, a, absl::StrCat("execute: input ", i)));
    input_ids.push_back(a.id);
  }
  TESSERA_ASSIGN_OR_RETURN(Members members, fan_out_->alive_members(exe.mesh.device_ids(), "execute"));
  auto e = std::make_shared<Execution>();
  for (size_t i = 0; i < graph.outputs().size(); ++i) {
    const Node& o = graph.node(graph.outputs()[i]);
    absl::StatusOr<uint64_t> id =
        registry_->create_array(o.dtype, o.shape, NamedSharding(exe.mesh, exe.output_specs[i]), session);
    if (!id.ok()) {
      registry_->remove_arrays(e->output_ids);  // nothing ran: no device holds them yet
      return id.status();
    }
    e->output_ids.push_back(*id);
    e->outputs.push_back(*registry_->get_array(*id));
  }
  const size_t n = members.peers.size();
  e->id = registry_->ids().next(program->op_span + 1);
  pb::RunPlanRequest& r = e->request;
  r.set_execution_id(e->id);
  // Random, the same for every device of the execution: its collectives' messages carry it,
  // and a worker takes none that does not (op ids alone are predictable).
  r.set_run_tag(random_run_tag());
  r.set_plan_id(program->id);
  for (uint64_t id : input_ids) r.add_input_buffers(id);
  for (uint64_t id : e->output_ids) r.add_output_buffers(id);
  r.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
  for (size_t k = 0; k < n; ++k) e->workers.push_back(channels_->get(members.peers[k].address()));
  e->statuses.resize(n);
  e->reactor = reactor;
  e->reply = reply;
  e->program = std::move(program);
  e->use = std::move(use);
  e->members = std::move(members);
  return e;
}

absl::Duration ExecutionDriver::run_wait(const Execution& e) {
  return absl::Milliseconds(e.request.timeout_ms()) + absl::Seconds(5);
}

void ExecutionDriver::run_plans(std::shared_ptr<Execution> e) {
  // In process, the workers' run executor wakes once for the call's n runs (and those of the
  // calls started from on_sent), when this ends: no result is waited for here.
  HandOverBatch batch;
  const int n = static_cast<int>(e->workers.size());
  // Its runs start on the workers after its producers' runs: its wait starts after theirs.
  absl::Time start = absl::Now();
  for (const auto& [input, p] : e->producers) start = std::max(start, p->deadline);
  e->deadline = start + run_wait(*e);
  for (int k = 0; k < n; ++k) e->streams.push_back(e->workers[k]->plan_stream(e->members.incarnations[k]));
  {
    absl::MutexLock lock(&executions_mu_);
    executions_[e->id] = e;  // watched by watch_executions
  }
  for (int k = 0; k < n; ++k) {
    auto done = [this, e, k, n](grpc::Status s) {
      if (s.ok()) e->workers[k]->reached = true;
      {
        absl::MutexLock lock(&e->mu);
        if (!s.ok()) e->first_failure = std::min(e->first_failure, absl::Now());
        e->statuses[k] = std::move(s);
        if (++e->done < n) return;
      }
      finish_execution(e);
    };
    if (e->streams[k] == nullptr) {
      auto it = e->frees.find(e->members.peers[k].device_id());
      if (it != e->frees.end()) fan_out_->delete_buffers({{it->first, it->second}}, /*wait=*/false);
      done(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the worker registered anew since the call was checked"));
    } else {
      e->streams[k]->run(e->request, std::move(done));
    }
  }
  std::vector<std::function<void()>> on_sent;
  {
    absl::MutexLock lock(&e->mu);
    e->sent = true;
    on_sent.swap(e->on_sent);
  }
  for (auto& f : on_sent) f();
}

void ExecutionDriver::finish_execution(const std::shared_ptr<Execution>& e) {
  if (!e->producers.empty()) {
    // Answer after the producers did: with the first one's error if one failed.
    auto producers = std::make_shared<std::vector<std::pair<int, std::shared_ptr<Execution>>>>();
    producers->swap(e->producers);
    auto left = std::make_shared<std::atomic<int>>(static_cast<int>(producers->size()) + 1);
    auto one_done = [this, e, producers, left] {
      if (left->fetch_sub(1) != 1) return;
      for (const auto& [input, p] : *producers) {
        const absl::Status failed = failed_before_finish(*p);  // finished: its outcome
        if (!failed.ok()) {
          e->producer_failure = absl::Status(
              failed.code(),
              absl::StrCat("execute: input ", input, " is an output of a failed call: ", failed.message()));
          break;
        }
      }
      producers->clear();
      finish_execution(e);
    };
    for (const auto& [input, p] : *producers) when_finished(*p, one_done);
    one_done();
    return;
  }
  {
    absl::MutexLock lock(&executions_mu_);
    executions_.erase(e->id);
  }
  absl::Status status;
  bool unloaded = false;
  {
    absl::MutexLock lock(&e->mu);
    if (e->lost >= 0) {
      e->statuses[e->lost] = fan_out_->lost_status();
    }
    status = FanOut::first_failure(e->statuses, e->members.peers, "execute");
    // A worker that dropped the plan (it keeps at most --max_plans) gets it again next time.
    for (size_t k = 0; k < e->statuses.size(); ++k) {
      const grpc::Status& s = e->statuses[k];
      if (s.error_code() != grpc::StatusCode::NOT_FOUND || !absl::StrContains(s.error_message(), "is not loaded")) {
        continue;
      }
      absl::MutexLock program_lock(&e->program->mu);
      e->program->loaded.erase(e->members.peers[k].device_id());
      unloaded = true;
    }
  }
  if (unloaded) {
    // ABORTED: the SDK compiles again (a cache hit) and retries, which loads the plan again.
    status = absl::AbortedError(absl::StrCat(status.message(), "; its plan is loaded again at the next call"));
  }
  if (!e->producer_failure.ok()) status = e->producer_failure;
  execute_seconds_.observe(absl::Now() - e->started);
  if (!status.ok()) {
    executions_failed_.fetch_add(1);
    fail_execution(*e, status);  // never waits
    return;
  }
  executions_ok_.fetch_add(1);
  e->program->executions.fetch_add(1);
  for (const ArrayRecord& a : e->outputs) {
    e->reply->add_output_ids(a.id);
    e->reply->add_grants(auth_->grant(a.id));
  }
  complete_call(e->call, absl::OkStatus(), e->output_ids);
  settle(*e, absl::OkStatus());
  e->reactor->Finish(grpc::Status::OK);
}

void ExecutionDriver::fail_execution(Execution& e, const absl::Status& status) {
  fan_out_->delete_buffers(FanOut::buffers_of(registry_->remove_arrays(e.output_ids)), /*wait=*/false);
  complete_call(e.call, status, {});
  settle(e, status);
  e.reactor->Finish(to_grpc(status));
}

}  // namespace tessera
