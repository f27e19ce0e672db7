// HostArray: a dense, row-major, dtype-erased array in this process's memory.
//
// It is what device_put takes and what fetching returns. Its storage is one 64-byte aligned
// block; core/xtensor_interop.h views it as an xtensor expression without copying.
//
//   HostArray x = HostArray::from_vector<float>({2, 3}, {0, 1, 2, 3, 4, 5});
//   x.values<float>()[4] == 4.0f;
//   HostArray y = x.clone();   // HostArray is move-only; copies are explicit
#ifndef TESSERA_CORE_HOST_ARRAY_H_
#define TESSERA_CORE_HOST_ARRAY_H_

#include <cassert>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/dtype.h"
#include "core/shape.h"

namespace tessera {

// Elements someone else owns, used in place: `dtype` elements, dense and row-major, at
// `data`. Client::device_put reads a HostView and Array::fetch_into writes a MutableHostView,
// so an application's own buffers (a std::vector, an xtensor container, a memory-mapped
// file) go to and from the cluster with no copy through a HostArray. The memory must stay
// valid (and, for a MutableHostView, unread by others) until the call returns.
//
//   std::vector<float> mine(16 * 8, 1.0f);
//   client->device_put(HostView{DType::kF32, {16, 8}, mine.data()}, sharding);
//   x->fetch_into(MutableHostView{DType::kF32, {16, 8}, mine.data()});
struct HostView {
  DType dtype = DType::kF32;
  Shape shape;
  const void* data = nullptr;
};
struct MutableHostView {
  DType dtype = DType::kF32;
  Shape shape;
  void* data = nullptr;
};

// OK when `shape` is valid for `dtype` (validate_shape) and `data` is not null (or the shape
// has no elements); else INVALID_ARGUMENT naming `where`, the shape and the rule.
absl::Status validate_view(DType dtype, const Shape& shape, const void* data, absl::string_view where);

class HostArray {
 public:
  // An empty float32 array of shape (0,).
  HostArray() : HostArray(DType::kF32, Shape{0}) {}

  // Uninitialized storage. Throws std::bad_alloc when the memory cannot be allocated.
  // REQUIRES: validate_shape(shape, dtype_size(dtype), ...) is OK.
  HostArray(DType dtype, Shape shape);

  // Filled with 0 (false), or 1 (true). Same requirements as the constructor.
  // Freed buffers of 64 KiB and more are kept for the next array of the same size (fresh
  // pages cost their zeroing again), oldest dropped first beyond `bytes` in all per process
  // (default 1 GiB). This memory is not any device's: a daemon under a memory limit sets what
  // its headroom holds (tessera-worker --buffer_cache_bytes).
  static void set_buffer_cache_limit(size_t bytes);
  // The bytes the cache holds now.
  static size_t buffer_cache_bytes();
  // The bytes of array storage handed back to malloc in this process since it started (freed,
  // or dropped by the cache; not those the cache keeps): what a daemon's heap may hold as free
  // chunks until it trims (core/heap.h). Monotonic; any thread.
  static int64_t bytes_freed();

  // An array over storage this process did not allocate through HostArray (a mapping of a
  // client's memfd, worker/transfers.cc): `data` holds nbytes() of `dtype` elements, dense and
  // row-major, and is released by `release(data, nbytes())` when the array goes (never through
  // the buffer cache, nor counted in bytes_freed). The array may write its elements (a kernel
  // in place), so `data` must be writable. REQUIRES: as the constructor's; `data` aligned for
  // `dtype`; `release` not null.
  using Release = void (*)(std::byte* data, size_t bytes);
  static HostArray adopt(DType dtype, Shape shape, std::byte* data, Release release);

  static HostArray zeros(DType dtype, Shape shape);
  static HostArray ones(DType dtype, Shape shape);
  // Element i (row-major) holds i converted to dtype; for bool, i % 2 == 1.
  static HostArray arange(DType dtype, Shape shape);

  // A copy of `values` (row-major) as an array of dtype_of<T>() and `shape`.
  // REQUIRES: values.size() == num_elements(shape); otherwise prints both and aborts.
  template <typename T>
  static HostArray from_vector(Shape shape, const std::vector<T>& values) {
    HostArray a(dtype_of<T>(), std::move(shape));
    if (static_cast<int64_t>(values.size()) != a.size()) size_mismatch(values.size(), a);
    if constexpr (std::is_same_v<T, bool>) {
      for (size_t i = 0; i < values.size(); ++i) a.mutable_values<bool>()[i] = values[i];
    } else if (!values.empty()) {
      std::memcpy(a.data(), values.data(), values.size() * sizeof(T));
    }
    return a;
  }

  HostArray(HostArray&&) noexcept = default;
  HostArray& operator=(HostArray&&) noexcept = default;
  HostArray(const HostArray&) = delete;
  HostArray& operator=(const HostArray&) = delete;

  // A deep copy. A moved-from HostArray may only be assigned to or destroyed.
  HostArray clone() const;

  // The same elements under another shape with as many elements; no copy.
  // REQUIRES: num_elements(shape) == size().
  HostArray reshaped(Shape shape) && {
    assert(num_elements(shape) == size_);
    shape_ = std::move(shape);
    return std::move(*this);
  }

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t size() const { return size_; }
  int64_t nbytes() const { return size_ * dtype_size(dtype_); }

  std::byte* data() { return data_.get(); }
  const std::byte* data() const { return data_.get(); }

  // This array's elements as views (valid while it lives), for the calls that take them.
  HostView view() const;
  MutableHostView mutable_view();

  // The elements, row-major, viewed in place (valid while this array lives).
  // REQUIRES: dtype_of<T>() == dtype().
  template <typename T>
  absl::Span<const T> values() const {
    assert(dtype_of<T>() == dtype_);
    return absl::Span<const T>(reinterpret_cast<const T*>(data_.get()), static_cast<size_t>(size_));
  }
  template <typename T>
  absl::Span<T> mutable_values() {
    assert(dtype_of<T>() == dtype_);
    return absl::Span<T>(reinterpret_cast<T*>(data_.get()), static_cast<size_t>(size_));
  }

  // Element i (row-major) as a double, whatever the dtype; for messages and tests.
  // REQUIRES: 0 <= i < size().
  double element_as_double(int64_t i) const;

  // Same dtype, shape and bytes. Bitwise: NaNs with equal bits are equal, 0.0 and -0.0
  // are not.
  bool operator==(const HostArray& other) const;
  bool operator!=(const HostArray& other) const { return !(*this == other); }

 private:
  // from_vector with the wrong number of values: a programming error, like a bad index;
  // prints both sizes and aborts (in every build: writing past the buffer would be worse).
  [[noreturn]] static void size_mismatch(size_t values, const HostArray& array);

  // Frees a buffer of `bytes` (rounded) bytes: large ones go back to a bounded process-wide
  // cache that the next allocation of the same size takes (see host_array.cc); adopted storage
  // (`release` set) goes back to its owner instead.
  struct FreeDeleter {
    size_t bytes;
    Release release;  // null: ours (no initializer: unique_ptr needs it default-constructible here)
    void operator()(std::byte* p) const;
  };
  // adopt's: the fields alone, storage set by the caller.
  HostArray(DType dtype, Shape shape, std::unique_ptr<std::byte, FreeDeleter> data)
      : dtype_(dtype), shape_(std::move(shape)), size_(num_elements(shape_)), data_(std::move(data)) {}

  DType dtype_;
  Shape shape_;
  int64_t size_;
  std::unique_ptr<std::byte, FreeDeleter> data_;
};

}  // namespace tessera

#endif  // TESSERA_CORE_HOST_ARRAY_H_
