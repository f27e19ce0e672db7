// BufferStore: the device memory of one worker — numbered, immutable buffers within a limit.
//
// A buffer is first reserved (its bytes count against the limit from then on), then filled
// and committed, or cancelled. Readers get a shared_ptr, so a buffer deleted while it is
// being sent stays alive until the send ends.
//
//   TESSERA_RETURN_IF_ERROR(store.reserve(7, shape_bytes));   // RESOURCE_EXHAUSTED if full
//   store.commit(7, std::make_shared<const HostArray>(std::move(data)));
//   absl::StatusOr<std::shared_ptr<const HostArray>> b = store.get(7);
#ifndef TESSERA_WORKER_BUFFER_STORE_H_
#define TESSERA_WORKER_BUFFER_STORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/host_array.h"

namespace tessera {

class BufferStore {
 public:
  explicit BufferStore(int64_t memory_limit_bytes) : limit_(memory_limit_bytes) {}

  // Claims `bytes` for buffer `id`. ALREADY_EXISTS if `id` is held or reserved;
  // RESOURCE_EXHAUSTED (naming the sizes) if the bytes do not fit under the limit.
  absl::Status reserve(uint64_t id, int64_t bytes);

  // Counts `bytes` held outside any buffer (collective messages waiting in the mailbox)
  // against the limit; false, counting nothing, if they do not fit. uncharge gives them back.
  bool charge(int64_t bytes);
  void uncharge(int64_t bytes);

  // Releases a reservation that will not be committed. No-op if none.
  void cancel(uint64_t id);

  // Stores `data` under a reserved `id`. REQUIRES: reserve(id, data->nbytes()) succeeded.
  void commit(uint64_t id, std::shared_ptr<const HostArray> data);

  // NOT_FOUND if no committed buffer has this id.
  absl::StatusOr<std::shared_ptr<const HostArray>> get(uint64_t id) const;

  // Deletes committed buffers; returns how many of `ids` existed. A buffer still being
  // filled (reserved) is deleted when it is committed. `unknown`, if given, gets the ids
  // neither committed nor reserved here.
  int erase(const std::vector<uint64_t>& ids, std::vector<uint64_t>* unknown = nullptr);

  // Every committed buffer, by id (a registration reports them to the coordinator).
  std::map<uint64_t, std::shared_ptr<const HostArray>> contents() const;

  struct Stats {
    int64_t buffer_count = 0;
    int64_t bytes_used = 0;  // committed and reserved
    int64_t limit_bytes = 0;
  };
  Stats stats() const;

 private:
  // Constant after construction.
  const int64_t limit_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<const HostArray>> buffers_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, int64_t> reserved_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<uint64_t> doomed_ ABSL_GUARDED_BY(mu_);  // reserved, then erased: commit drops them
  int64_t bytes_used_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tessera

#endif  // TESSERA_WORKER_BUFFER_STORE_H_
