#include "worker/buffer_store.h"

#include "absl/strings/str_cat.h"

namespace tessera {

absl::Status BufferStore::reserve(uint64_t id, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (buffers_.contains(id) || reserved_.contains(id)) {
    return absl::AlreadyExistsError(absl::StrCat("buffer ", id, " already exists"));
  }
  if (bytes > limit_ - bytes_used_) {
    return absl::ResourceExhaustedError(absl::StrCat("buffer ", id, " needs ", bytes, " bytes but only ",
                                                     limit_ - bytes_used_, " of the device's ", limit_,
                                                     " bytes are free"));
  }
  reserved_[id] = bytes;
  bytes_used_ += bytes;
  return absl::OkStatus();
}

bool BufferStore::charge(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (bytes > limit_ - bytes_used_) return false;
  bytes_used_ += bytes;
  return true;
}

void BufferStore::uncharge(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  bytes_used_ -= bytes;
}

void BufferStore::cancel(uint64_t id) {
  absl::MutexLock lock(&mu_);
  doomed_.erase(id);
  auto it = reserved_.find(id);
  if (it == reserved_.end()) return;
  bytes_used_ -= it->second;
  reserved_.erase(it);
}

void BufferStore::commit(uint64_t id, std::shared_ptr<const HostArray> data) {
  absl::MutexLock lock(&mu_);
  auto it = reserved_.find(id);
  if (doomed_.erase(id) > 0) {
    // Deleted while it was being made: drop it instead of keeping a buffer nobody owns.
    bytes_used_ -= it->second;
    reserved_.erase(it);
    return;
  }
  // The reservation's bytes now belong to the buffer; erase() gives them back.
  bytes_used_ += data->nbytes() - it->second;
  reserved_.erase(it);
  buffers_[id] = std::move(data);
}

absl::StatusOr<std::shared_ptr<const HostArray>> BufferStore::get(uint64_t id) const {
  absl::MutexLock lock(&mu_);
  auto it = buffers_.find(id);
  if (it == buffers_.end()) return absl::NotFoundError(absl::StrCat("buffer ", id, " does not exist"));
  return it->second;
}

int BufferStore::erase(const std::vector<uint64_t>& ids, std::vector<uint64_t>* unknown) {
  absl::MutexLock lock(&mu_);
  int erased = 0;
  for (uint64_t id : ids) {
    auto it = buffers_.find(id);
    if (it == buffers_.end()) {
      if (reserved_.contains(id)) {
        doomed_.insert(id);
      } else if (unknown != nullptr) {
        unknown->push_back(id);
      }
      continue;
    }
    bytes_used_ -= it->second->nbytes();
    buffers_.erase(it);
    ++erased;
  }
  return erased;
}

std::map<uint64_t, std::shared_ptr<const HostArray>> BufferStore::contents() const {
  absl::MutexLock lock(&mu_);
  return std::map<uint64_t, std::shared_ptr<const HostArray>>(buffers_.begin(), buffers_.end());
}

BufferStore::Stats BufferStore::stats() const {
  absl::MutexLock lock(&mu_);
  return Stats{static_cast<int64_t>(buffers_.size()), bytes_used_, limit_};
}

}  // namespace tessera
