#include "core/host_array.h"

#include <cstdlib>
#include <new>

namespace tessera {
namespace {

constexpr size_t kAlignment = 64;

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
  }
}

}  // namespace

HostArray::HostArray(DType dtype, Shape shape) : dtype_(dtype), shape_(std::move(shape)), size_(num_elements(shape_)) {
  size_t bytes = static_cast<size_t>(nbytes());
  size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  if (rounded == 0) rounded = kAlignment;
  void* p = std::aligned_alloc(kAlignment, rounded);
  if (p == nullptr) throw std::bad_alloc();
  data_.reset(static_cast<std::byte*>(p));
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
