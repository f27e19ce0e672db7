#include "coordinator/worker_channels.h"

#include "absl/strings/str_cat.h"
#include "proto/rpc.h"

namespace tessera {

std::shared_ptr<WorkerChannel> WorkerChannels::get(const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto& w = workers_[address];
  if (w == nullptr) {
    w = std::make_shared<WorkerChannel>();
    w->stub = pb::Worker::NewStub(make_channel(address, identity_));
    w->handed_over = handed_over_;
    auto local = local_.find(address);
    if (local != local_.end()) {
      absl::MutexLock stream_lock(&w->mu);
      w->local = local->second;
    }
  }
  return w;
}

void WorkerChannels::hand_runs_in_process(const std::string& address, std::shared_ptr<LocalRuns> runs) {
  absl::MutexLock lock(&mu_);
  local_[address] = runs;
  auto it = workers_.find(address);
  if (it == workers_.end()) return;
  absl::MutexLock stream_lock(&it->second->mu);
  it->second->local = std::move(runs);  // its current stream, if any, stays until it breaks
}

int WorkerChannels::retain(const absl::flat_hash_set<std::string>& addresses) {
  std::vector<std::shared_ptr<PlanStream>> streams;
  int evicted = 0;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = workers_.begin(); it != workers_.end();) {
      if (addresses.contains(it->first)) {
        ++it;
        continue;
      }
      {
        absl::MutexLock stream_lock(&it->second->mu);
        if (it->second->plans != nullptr) streams.push_back(std::move(it->second->plans));
      }
      workers_.erase(it++);
      ++evicted;
    }
  }
  for (const std::shared_ptr<PlanStream>& s : streams) s->close(absl::ZeroDuration());  // does not wait
  return evicted;
}

int WorkerChannels::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(workers_.size());
}

std::vector<std::shared_ptr<PlanStream>> WorkerChannels::take_plan_streams() {
  std::vector<std::shared_ptr<PlanStream>> streams;
  absl::MutexLock lock(&mu_);
  for (auto& [address, w] : workers_) {
    absl::MutexLock stream_lock(&w->mu);
    if (w->plans != nullptr) streams.push_back(std::move(w->plans));
  }
  return streams;
}

std::map<int, std::string> WorkerChannels::unconfirmed(const std::vector<Registered>& registered, absl::Time deadline) {
  struct Probe {
    std::shared_ptr<WorkerChannel> channel;  // kept until the call is done, even if evicted
    grpc::ClientContext ctx;
    pb::HandshakeRequest request;
    pb::HandshakeReply reply;
    grpc::Status status;
  };
  std::vector<std::unique_ptr<Probe>> probes;
  absl::Mutex mu;
  size_t answered = 0;  // guarded by mu
  for (const Registered& r : registered) {
    Probe& p = *probes.emplace_back(std::make_unique<Probe>());
    p.channel = get(r.address);
    p.request.set_protocol_version(kProtocolVersion);
    p.request.set_peer("tessera-coordinator");
    p.ctx.set_deadline(absl::ToChronoTime(deadline));
    // No wait for the connection: a dead address answers at once (the caller asks again).
    p.channel->stub->async()->Handshake(&p.ctx, &p.request, &p.reply, [&mu, &answered, &p](grpc::Status status) {
      absl::MutexLock lock(&mu);
      p.status = std::move(status);
      ++answered;
    });
  }
  {
    // Every call has `deadline`, so every callback runs by then; cancelled if gRPC is late.
    absl::MutexLock lock(&mu);
    auto all = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return answered == probes.size(); };
    if (!mu.AwaitWithDeadline(absl::Condition(&all), deadline + absl::Seconds(1))) {
      for (const std::unique_ptr<Probe>& p : probes) p->ctx.TryCancel();
      mu.Await(absl::Condition(&all));  // the callbacks use `probes`: they must have run
    }
  }
  std::map<int, std::string> out;
  for (size_t i = 0; i < registered.size(); ++i) {
    const Registered& r = registered[i];
    const Probe& p = *probes[i];
    if (!p.status.ok()) {
      out[r.device] = absl::StrCat("its worker did not answer (", p.status.error_message(), ")");
    } else if (p.reply.epoch() != r.epoch || p.reply.incarnation() != r.incarnation) {
      out[r.device] = absl::StrCat("the worker there holds registration ", p.reply.epoch(), "/", p.reply.incarnation(),
                                   ", not ", r.epoch, "/", r.incarnation,
                                   p.reply.incarnation() == 0 ? " (a new process, not registered yet)" : "");
    }
  }
  return out;
}

}  // namespace tessera
