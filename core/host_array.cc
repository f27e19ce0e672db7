#include "core/host_array.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <iterator>
#include <list>
#include <new>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace tessera {
namespace {

constexpr size_t kAlignment = 64;

// Large buffers are placed on transparent huge pages: a fresh 64 MiB buffer then costs 32
// page faults instead of 16384, which on a busy host is most of the time a collective takes.
constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kHugePageMinBytes = size_t{4} << 20;

// Freed buffers of kCachedMinBytes or more are kept (up to kCachedBytes in all, oldest dropped
// first) and handed to the next allocation of the same size: memory fresh from the kernel is
// zeroed page by page on first touch, and glibc returns buffers of this size to the kernel when
// they are freed (mmap/munmap, or trimming the arena), so a freed-and-remade intermediate cost
// its page faults again every time. A transformer step measured a third of its time zeroing
// fresh pages, and with 8 in-process devices faulting at once far more (they share the
// process's page tables). Steady-state programs allocate the same sizes every step: the cache
// holds what a step freed until the next step asks for it.
// (The limit is HostArray::set_buffer_cache_limit's; a tessera-worker sets its
// --buffer_cache_bytes, which its container's memory headroom must hold.)
constexpr size_t kCachedMinBytes = size_t{64} << 10;
constexpr size_t kCachedBytes = size_t{1} << 30;

// HostArray::bytes_freed's count: relaxed, as it only paces trims.
std::atomic<int64_t> freed_bytes{0};

void free_counted(void* p, size_t bytes) {
  freed_bytes.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
  std::free(p);
}

class BufferCache {
 public:
  void* take(size_t bytes) {
    absl::MutexLock lock(&mu_);
    auto it = by_size_.find(bytes);
    if (it == by_size_.end()) return nullptr;
    const auto entry = it->second.back();  // the most recent: likeliest still in the caches
    it->second.pop_back();
    if (it->second.empty()) by_size_.erase(it);  // no entry per size ever seen
    void* p = entry->second;
    age_.erase(entry);
    cached_ -= bytes;
    return p;
  }

  void give(void* p, size_t bytes) {
    std::vector<std::pair<size_t, void*>> dropped;
    {
      absl::MutexLock lock(&mu_);
      if (bytes > limit_) {
        dropped.emplace_back(bytes, p);
      } else {
        age_.emplace_back(bytes, p);
        by_size_[bytes].push_back(std::prev(age_.end()));
        cached_ += bytes;
      }
      drop_over_limit(&dropped);
    }
    for (const auto& [size, q] : dropped) free_counted(q, size);
  }

  size_t bytes() {
    absl::MutexLock lock(&mu_);
    return cached_;
  }

  void set_limit(size_t bytes) {
    std::vector<std::pair<size_t, void*>> dropped;
    {
      absl::MutexLock lock(&mu_);
      limit_ = bytes;
      drop_over_limit(&dropped);
    }
    for (const auto& [size, q] : dropped) free_counted(q, size);
  }

 private:
  using Entry = std::list<std::pair<size_t, void*>>::iterator;

  void drop_over_limit(std::vector<std::pair<size_t, void*>>* dropped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    while (cached_ > limit_) {  // the oldest is the first of its size
      const auto [size, q] = age_.front();
      std::deque<Entry>& same = by_size_[size];
      same.pop_front();
      if (same.empty()) by_size_.erase(size);
      age_.pop_front();
      cached_ -= size;
      dropped->emplace_back(size, q);
    }
  }

  absl::Mutex mu_;
  size_t limit_ ABSL_GUARDED_BY(mu_) = kCachedBytes;
  std::list<std::pair<size_t, void*>> age_ ABSL_GUARDED_BY(mu_);                 // oldest first
  absl::flat_hash_map<size_t, std::deque<Entry>> by_size_ ABSL_GUARDED_BY(mu_);  // each oldest first
  size_t cached_ ABSL_GUARDED_BY(mu_) = 0;
};

BufferCache& buffer_cache() {
  static BufferCache* const kCache = new BufferCache;  // never destroyed: arrays may outlive main
  return *kCache;
}

template <typename F>
void for_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF32:
      f(float{});
      break;
    case DType::kF64:
      f(double{});
      break;
    case DType::kI32:
      f(int32_t{});
      break;
    case DType::kI64:
      f(int64_t{});
      break;
    case DType::kBool:
      f(bool{});
      break;
    case DType::kU32:
      f(uint32_t{});
      break;
    case DType::kBF16:
      f(BFloat16{});
      break;
    case DType::kF16:
      f(Float16{});
      break;
    case DType::kU8:
      f(uint8_t{});
      break;
    case DType::kI8:
      f(int8_t{});
      break;
    case DType::kI16:
      f(int16_t{});
      break;
  }
}

}  // namespace

void HostArray::set_buffer_cache_limit(size_t bytes) { buffer_cache().set_limit(bytes); }
size_t HostArray::buffer_cache_bytes() { return buffer_cache().bytes(); }
int64_t HostArray::bytes_freed() { return freed_bytes.load(std::memory_order_relaxed); }

HostArray::HostArray(DType dtype, Shape shape) : dtype_(dtype), shape_(std::move(shape)), size_(num_elements(shape_)) {
  const size_t bytes = static_cast<size_t>(nbytes());
  // The alignment follows from the rounded size alone, so a cached buffer of that size always
  // has the alignment its next user expects (4 MiB less a few bytes rounds to 4 MiB: huge).
  size_t rounded = std::max<size_t>((bytes + kAlignment - 1) / kAlignment * kAlignment, kAlignment);
  const size_t alignment = rounded >= kHugePageMinBytes ? kHugePage : kAlignment;
  rounded = (rounded + alignment - 1) / alignment * alignment;
  void* p = rounded >= kCachedMinBytes ? buffer_cache().take(rounded) : nullptr;
  if (p == nullptr) {
    p = std::aligned_alloc(alignment, rounded);
    if (p == nullptr) throw std::bad_alloc();
    if (alignment == kHugePage) madvise(p, rounded, MADV_HUGEPAGE);  // advice only: failure is harmless
  }
  data_ = std::unique_ptr<std::byte, FreeDeleter>(static_cast<std::byte*>(p), FreeDeleter{rounded, nullptr});
}

HostArray HostArray::adopt(DType dtype, Shape shape, std::byte* data, Release release) {
  assert(release != nullptr);
  const size_t bytes = static_cast<size_t>(num_elements(shape) * dtype_size(dtype));
  return HostArray(dtype, std::move(shape), std::unique_ptr<std::byte, FreeDeleter>(data, FreeDeleter{bytes, release}));
}

void HostArray::FreeDeleter::operator()(std::byte* p) const {
  if (release != nullptr) {
    release(p, bytes);
  } else if (bytes >= kCachedMinBytes) {
    buffer_cache().give(p, bytes);
  } else {
    free_counted(p, bytes);
  }
}

absl::Status validate_view(DType dtype, const Shape& shape, const void* data, absl::string_view where) {
  absl::Status valid = validate_shape(shape, dtype_size(dtype), where);
  if (!valid.ok()) return valid;
  if (data == nullptr && num_elements(shape) > 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": the view of ", dtype_name(dtype), " ",
                                                   shape_to_string(shape), " has no data (a null pointer)"));
  }
  return absl::OkStatus();
}

HostView HostArray::view() const { return {dtype_, shape_, data_.get()}; }

MutableHostView HostArray::mutable_view() { return {dtype_, shape_, data_.get()}; }

void HostArray::size_mismatch(size_t values, const HostArray& array) {
  std::fprintf(stderr, "HostArray::from_vector: %zu values for shape %s, which has %lld elements\n", values,
               shape_to_string(array.shape()).c_str(), static_cast<long long>(array.size()));
  std::abort();
}

HostArray HostArray::zeros(DType dtype, Shape shape) {
  HostArray a(dtype, std::move(shape));
  std::memset(a.data(), 0, static_cast<size_t>(a.nbytes()));
  return a;
}

HostArray HostArray::ones(DType dtype, Shape shape) {
  HostArray a(dtype, std::move(shape));
  for_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    for (T& v : a.mutable_values<T>()) v = T(1);
  });
  return a;
}

HostArray HostArray::arange(DType dtype, Shape shape) {
  HostArray a(dtype, std::move(shape));
  for_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    auto v = a.mutable_values<T>();
    for (size_t i = 0; i < v.size(); ++i) {
      if constexpr (std::is_same_v<T, bool>) {
        v[i] = (i % 2) == 1;
      } else {
        v[i] = static_cast<T>(i);
      }
    }
  });
  return a;
}

HostArray HostArray::clone() const {
  HostArray a(dtype_, shape_);
  if (nbytes() > 0) std::memcpy(a.data(), data(), static_cast<size_t>(nbytes()));
  return a;
}

double HostArray::element_as_double(int64_t i) const {
  double out = 0;
  for_dtype(dtype_, [&](auto zero) {
    using T = decltype(zero);
    out = static_cast<double>(values<T>()[static_cast<size_t>(i)]);
  });
  return out;
}

bool HostArray::operator==(const HostArray& other) const {
  return dtype_ == other.dtype_ && shape_ == other.shape_ &&
         (nbytes() == 0 || std::memcmp(data(), other.data(), static_cast<size_t>(nbytes())) == 0);
}

}  // namespace tessera
