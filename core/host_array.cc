#include "core/host_array.h"

#include <sys/mman.h>

#include <cstdio>
#include <cstdlib>
#include <deque>
#include <new>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace tessera {
namespace {

constexpr size_t kAlignment = 64;

// Large buffers are placed on transparent huge pages: a fresh 64 MiB buffer then costs 32
// page faults instead of 16384, which on a busy host is most of the time a collective takes.
constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kHugePageMinBytes = size_t{4} << 20;

// Freed large buffers are kept (up to kCachedBytes in all, oldest dropped first) and handed
// to the next allocation of the same size: memory fresh from the kernel is zeroed page by
// page on first touch, which for a 64 MiB collective result costs more than moving its data
// over loopback. Steady-state programs allocate the same sizes every step.
constexpr size_t kCachedBytes = size_t{256} << 20;

class BufferCache {
 public:
  void* take(size_t bytes) {
    absl::MutexLock lock(&mu_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->first != bytes) continue;
      void* p = it->second;
      free_.erase(it);
      cached_ -= bytes;
      return p;
    }
    return nullptr;
  }

  void give(void* p, size_t bytes) {
    std::deque<void*> dropped;
    {
      absl::MutexLock lock(&mu_);
      if (bytes > kCachedBytes) {
        dropped.push_back(p);
      } else {
        free_.emplace_back(bytes, p);
        cached_ += bytes;
      }
      while (cached_ > kCachedBytes) {
        dropped.push_back(free_.front().second);
        cached_ -= free_.front().first;
        free_.pop_front();
      }
    }
    for (void* q : dropped) std::free(q);
  }

 private:
  absl::Mutex mu_;
  std::deque<std::pair<size_t, void*>> free_ ABSL_GUARDED_BY(mu_);  // oldest first
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

HostArray::HostArray(DType dtype, Shape shape) : dtype_(dtype), shape_(std::move(shape)), size_(num_elements(shape_)) {
  const size_t bytes = static_cast<size_t>(nbytes());
  const size_t alignment = bytes >= kHugePageMinBytes ? kHugePage : kAlignment;
  size_t rounded = (bytes + alignment - 1) / alignment * alignment;
  if (rounded == 0) rounded = kAlignment;
  void* p = alignment == kHugePage ? buffer_cache().take(rounded) : nullptr;
  if (p == nullptr) {
    p = std::aligned_alloc(alignment, rounded);
    if (p == nullptr) throw std::bad_alloc();
    if (alignment == kHugePage) madvise(p, rounded, MADV_HUGEPAGE);  // advice only: failure is harmless
  }
  data_ = std::unique_ptr<std::byte, FreeDeleter>(static_cast<std::byte*>(p), FreeDeleter{rounded});
}

void HostArray::FreeDeleter::operator()(std::byte* p) const {
  if (bytes >= kHugePageMinBytes) {
    buffer_cache().give(p, bytes);
  } else {
    std::free(p);
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
