#include "coordinator/worker_channels.h"

#include "proto/rpc.h"

namespace tessera {

WorkerChannel* WorkerChannels::get(const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto& w = workers_[address];
  if (w == nullptr) {
    w = std::make_unique<WorkerChannel>();
    w->stub = pb::Worker::NewStub(make_channel(address, identity_));
  }
  return w.get();
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

}  // namespace tessera
