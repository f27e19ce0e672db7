#include "core/handoff.h"

#include <algorithm>
#include <map>

#include "absl/base/const_init.h"
#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace tessera {
namespace {

absl::Mutex handoff_mu(absl::kConstInit);
uint64_t next_token ABSL_GUARDED_BY(handoff_mu) = 1;
int64_t taken_count ABSL_GUARDED_BY(handoff_mu) = 0;
int64_t deposited_count ABSL_GUARDED_BY(handoff_mu) = 0;
struct Waiting {
  std::shared_ptr<const HostArray> buffer;
  int takers = 1;  // takes left
};
std::map<uint64_t, Waiting>& waiting() ABSL_EXCLUSIVE_LOCKS_REQUIRED(handoff_mu) {
  static auto* by_token = new std::map<uint64_t, Waiting>();
  return *by_token;
}

}  // namespace

absl::StatusOr<uint64_t> Handoff::deposit(std::shared_ptr<const HostArray> buffer, int takers) {
  absl::MutexLock lock(&handoff_mu);
  if (waiting().size() >= static_cast<size_t>(kMaxWaiting)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("in-process handoff: ", kMaxWaiting, " buffers wait to be taken already"));
  }
  const uint64_t token = next_token++;
  waiting()[token] = Waiting{std::move(buffer), std::max(takers, 1)};
  ++deposited_count;
  return token;
}

std::shared_ptr<const HostArray> Handoff::take(uint64_t token) {
  absl::MutexLock lock(&handoff_mu);
  auto it = waiting().find(token);
  if (it == waiting().end()) return nullptr;
  std::shared_ptr<const HostArray> buffer = it->second.buffer;
  if (--it->second.takers == 0) waiting().erase(it);
  ++taken_count;
  return buffer;
}

void Handoff::withdraw(uint64_t token) {
  absl::MutexLock lock(&handoff_mu);
  waiting().erase(token);
}

int64_t Handoff::taken() {
  absl::MutexLock lock(&handoff_mu);
  return taken_count;
}

int64_t Handoff::deposited() {
  absl::MutexLock lock(&handoff_mu);
  return deposited_count;
}

}  // namespace tessera
