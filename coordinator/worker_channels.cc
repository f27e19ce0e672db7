#include "coordinator/worker_channels.h"

#include "proto/rpc.h"

namespace tessera {

std::shared_ptr<WorkerChannel> WorkerChannels::get(const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto& w = workers_[address];
  if (w == nullptr) {
    w = std::make_shared<WorkerChannel>();
    w->stub = pb::Worker::NewStub(make_channel(address, identity_));
  }
  return w;
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

}  // namespace tessera
