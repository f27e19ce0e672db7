// DType, Shape and HostArray, plus the xtensor views over HostArray storage.
#include "core/host_array.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "core/dtype.h"
#include "core/shape.h"
#include "core/xtensor_interop.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "xtensor/xarray.hpp"

namespace tessera {
namespace {

using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// ---- DType -----------------------------------------------------------------------------------

TEST(DType, SizesAndNumpyNames) {
  struct Case {
    DType dtype;
    int64_t size;
    std::string name;
  };
  const std::vector<Case> cases = {
      {DType::kF32, 4, "float32"},   {DType::kF64, 8, "float64"}, {DType::kI32, 4, "int32"},
      {DType::kI64, 8, "int64"},     {DType::kBool, 1, "bool"},   {DType::kU32, 4, "uint32"},
      {DType::kBF16, 2, "bfloat16"}, {DType::kF16, 2, "float16"}, {DType::kU8, 1, "uint8"},
      {DType::kI8, 1, "int8"},       {DType::kI16, 2, "int16"}};
  ASSERT_EQ(std::size(kAllDTypes), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(kAllDTypes[i], cases[i].dtype);
    EXPECT_EQ(dtype_size(cases[i].dtype), cases[i].size);
    EXPECT_EQ(dtype_name(cases[i].dtype), cases[i].name);
  }
  static_assert(dtype_of<float>() == DType::kF32);
  static_assert(dtype_of<double>() == DType::kF64);
  static_assert(dtype_of<int32_t>() == DType::kI32);
  static_assert(dtype_of<int64_t>() == DType::kI64);
  static_assert(dtype_of<bool>() == DType::kBool);
}

// ---- Shape -----------------------------------------------------------------------------------

TEST(Shape, ToStringAsPythonTuple) {
  EXPECT_EQ(shape_to_string({16, 8}), "(16, 8)");
  EXPECT_EQ(shape_to_string({4}), "(4,)");
  EXPECT_EQ(shape_to_string({}), "()");
  EXPECT_EQ(shape_to_string({2, 0, 3}), "(2, 0, 3)");
}

TEST(Shape, NumElements) {
  EXPECT_EQ(num_elements({16, 8}), 128);
  EXPECT_EQ(num_elements({4}), 4);
  EXPECT_EQ(num_elements({}), 1);
  EXPECT_EQ(num_elements({3, 0, 5}), 0);
}

TEST(Shape, ValidateShape) {
  EXPECT_TRUE(validate_shape({16, 8}, 4, "x").ok());
  EXPECT_TRUE(validate_shape({}, 8, "x").ok());
  EXPECT_TRUE(validate_shape({0, 5}, 8, "x").ok());

  absl::Status negative = validate_shape({4, -1}, 4, "device_put");
  EXPECT_EQ(negative.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(negative.message(), HasSubstr("device_put"));
  EXPECT_THAT(negative.message(), HasSubstr("dimension 1"));
  EXPECT_THAT(negative.message(), HasSubstr("(4, -1)"));

  const int64_t big = int64_t{1} << 31;
  absl::Status overflow = validate_shape({big, big}, 4, "device_put");  // 2^64 bytes
  EXPECT_EQ(overflow.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(overflow.message(), HasSubstr("device_put"));
  EXPECT_TRUE(validate_shape({big, big}, 1, "x").ok());  // 2^62 bytes fits
}

// ---- HostArray -------------------------------------------------------------------------------

TEST(HostArrayDeathTest, FromVectorWithTheWrongCountAbortsInEveryBuild) {
  EXPECT_DEATH(HostArray::from_vector<float>({2, 2}, {1, 2, 3, 4, 5}), "5 values for shape \\(2, 2\\), which has 4");
}

TEST(HostArray, ViewsShowTheArraysOwnStorage) {
  HostArray x = HostArray::arange(DType::kI32, {3, 2});
  const HostView v = x.view();
  EXPECT_EQ(v.dtype, DType::kI32);
  EXPECT_EQ(v.shape, (Shape{3, 2}));
  EXPECT_EQ(v.data, x.data());
  EXPECT_EQ(x.mutable_view().data, x.data());
  EXPECT_TRUE(validate_view(DType::kI32, {3, 2}, x.data(), "here").ok());
  EXPECT_TRUE(validate_view(DType::kI32, {0, 2}, nullptr, "here").ok());  // no elements, no data needed
  EXPECT_THAT(std::string(validate_view(DType::kI32, {3, 2}, nullptr, "here").message()),
              testing::HasSubstr("here: the view of int32 (3, 2) has no data"));
  EXPECT_EQ(validate_view(DType::kI32, {3, -2}, x.data(), "here").code(), absl::StatusCode::kInvalidArgument);
}

TEST(HostArray, FromVectorAndValues) {
  HostArray x = HostArray::from_vector<float>({2, 3}, {0, 1, 2, 3, 4, 5});
  EXPECT_EQ(x.dtype(), DType::kF32);
  EXPECT_EQ(x.shape(), (Shape{2, 3}));
  EXPECT_EQ(x.size(), 6);
  EXPECT_EQ(x.nbytes(), 24);
  EXPECT_THAT(x.values<float>(), ElementsAre(0.f, 1.f, 2.f, 3.f, 4.f, 5.f));

  HostArray i64 = HostArray::from_vector<int64_t>({3}, {-7, 0, int64_t{1} << 40});
  EXPECT_EQ(i64.dtype(), DType::kI64);
  EXPECT_EQ(i64.nbytes(), 24);
  EXPECT_THAT(i64.values<int64_t>(), ElementsAre(-7, 0, int64_t{1} << 40));

  HostArray b = HostArray::from_vector<bool>({2, 2}, {true, false, false, true});
  EXPECT_EQ(b.dtype(), DType::kBool);
  EXPECT_EQ(b.nbytes(), 4);
  EXPECT_THAT(b.values<bool>(), ElementsAre(true, false, false, true));

  HostArray scalar = HostArray::from_vector<double>({}, {2.5});
  EXPECT_EQ(scalar.shape(), Shape{});
  EXPECT_EQ(scalar.size(), 1);
  EXPECT_THAT(scalar.values<double>(), ElementsAre(2.5));

  HostArray empty = HostArray::from_vector<int32_t>({0, 4}, {});
  EXPECT_EQ(empty.size(), 0);
  EXPECT_EQ(empty.nbytes(), 0);
}

TEST(HostArray, DefaultIsEmptyFloat32) {
  HostArray a;
  EXPECT_EQ(a.dtype(), DType::kF32);
  EXPECT_EQ(a.shape(), Shape{0});
  EXPECT_EQ(a.size(), 0);
}

TEST(HostArray, StorageIs64ByteAligned) {
  for (DType dtype : kAllDTypes) {
    HostArray a = HostArray::zeros(dtype, {3, 5});
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % 64, 0u) << dtype_name(dtype);
  }
}

// A freed buffer of 64 KiB or more goes to the next array of the same size (core/host_array.cc:
// memory fresh from the kernel costs page faults), the most recently freed first; other sizes
// get other storage, and reused storage keeps the 64-byte alignment (and the 2 MiB one of
// large buffers). Nothing else in this test allocates these sizes.
TEST(HostArray, FreedStorageGoesToTheNextArrayOfItsSize) {
  for (const int64_t n : {int64_t{40000}, int64_t{3} << 20}) {  // 160 KB; 12 MB (huge pages)
    SCOPED_TRACE(n);
    const std::byte* first = nullptr;
    const std::byte* second = nullptr;
    {
      HostArray a(DType::kF32, {n});
      HostArray b(DType::kF32, {n});
      first = a.data();
      second = b.data();
    }  // b is freed first, then a
    HostArray other(DType::kF32, {n + 4096});
    EXPECT_NE(other.data(), first);
    EXPECT_NE(other.data(), second);
    HostArray c(DType::kF32, {n});
    EXPECT_EQ(c.data(), first);
    HostArray d(DType::kF32, {n});
    EXPECT_EQ(d.data(), second);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(d.data()) % (n >= (int64_t{1} << 20) ? (2 << 20) : 64), 0u);
  }
  // Just under 4 MiB rounds to 4 MiB and is huge-page aligned like an exact 4 MiB, so a cached
  // one is what the next 4 MiB array expects.
  { HostArray e(DType::kU8, {(int64_t{4} << 20) - 3}); }
  HostArray f(DType::kU8, {int64_t{4} << 20});
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f.data()) % (2 << 20), 0u);
}

// The cache holds what is freed up to its limit; lowering the limit drops what is kept.
TEST(HostArray, TheBufferCacheKeepsNoMoreThanItsLimit) {
  constexpr int64_t n = 50000;  // 200 KB, rounded up to 64 bytes
  constexpr size_t kBytes = 200000;
  HostArray::set_buffer_cache_limit(0);  // empty, whatever earlier tests left
  EXPECT_EQ(HostArray::buffer_cache_bytes(), 0u);
  HostArray::set_buffer_cache_limit(size_t{1} << 30);
  { HostArray a(DType::kF32, {n}); }
  EXPECT_EQ(HostArray::buffer_cache_bytes(), kBytes);
  HostArray::set_buffer_cache_limit(0);
  EXPECT_EQ(HostArray::buffer_cache_bytes(), 0u);
  { HostArray b(DType::kF32, {n}); }
  EXPECT_EQ(HostArray::buffer_cache_bytes(), 0u);  // freed over the limit: given back at once
  HostArray::set_buffer_cache_limit(kBytes);
  { HostArray c(DType::kF32, {n}); }
  { HostArray d(DType::kF32, {2 * n}); }  // alone over the limit: not kept
  EXPECT_EQ(HostArray::buffer_cache_bytes(), kBytes);
  HostArray::set_buffer_cache_limit(size_t{1} << 30);
}

// Storage allocated elsewhere (worker/transfers.cc's mapping of a client's memfd) is used in
// place, moves with the array and goes back through its release function once, with the
// array's byte count; never into the buffer cache nor into bytes_freed.
std::vector<std::pair<std::byte*, size_t>>& released() {
  static auto* const calls = new std::vector<std::pair<std::byte*, size_t>>;
  return *calls;
}

TEST(HostArray, AdoptedStorageGoesBackToItsOwner) {
  constexpr int64_t n = 50000;  // 200 KB: an allocation this large would be cached
  HostArray::set_buffer_cache_limit(0);
  HostArray::set_buffer_cache_limit(size_t{1} << 30);
  const int64_t freed_before = HostArray::bytes_freed();
  auto* storage = static_cast<std::byte*>(std::aligned_alloc(64, n * 4));
  ASSERT_NE(storage, nullptr);
  released().clear();
  {
    HostArray a = HostArray::adopt(DType::kF32, {n / 2, 2}, storage, [](std::byte* data, size_t bytes) {
      released().emplace_back(data, bytes);
      std::free(data);
    });
    EXPECT_EQ(a.data(), storage);
    EXPECT_EQ(a.nbytes(), n * 4);
    a.mutable_values<float>()[n - 1] = 3.5f;
    HostArray b = std::move(a).reshaped({n});
    EXPECT_EQ(b.data(), storage);
    EXPECT_EQ(b.values<float>()[n - 1], 3.5f);
    HostArray c = b.clone();  // an ordinary copy
    EXPECT_NE(c.data(), storage);
    EXPECT_EQ(c, b);
    EXPECT_TRUE(released().empty());
  }
  ASSERT_EQ(released().size(), 1u);
  EXPECT_EQ(released()[0].first, storage);
  EXPECT_EQ(released()[0].second, static_cast<size_t>(n * 4));
  // The clone went to the cache as usual (200000 bytes, 64-byte rounded); the adopted storage did not.
  EXPECT_EQ(HostArray::buffer_cache_bytes(), size_t{200000});
  EXPECT_EQ(HostArray::bytes_freed(), freed_before);
}

// arange(dtype, (2, 3)) spelled out per dtype.
HostArray ExpectedArange2x3(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return HostArray::from_vector<float>({2, 3}, {0, 1, 2, 3, 4, 5});
    case DType::kF64:
      return HostArray::from_vector<double>({2, 3}, {0, 1, 2, 3, 4, 5});
    case DType::kI32:
      return HostArray::from_vector<int32_t>({2, 3}, {0, 1, 2, 3, 4, 5});
    case DType::kI64:
      return HostArray::from_vector<int64_t>({2, 3}, {0, 1, 2, 3, 4, 5});
    case DType::kBool:
      return HostArray::from_vector<bool>({2, 3}, {false, true, false, true, false, true});
    case DType::kU32:
      return HostArray::from_vector<uint32_t>({2, 3}, {0, 1, 2, 3, 4, 5});
    case DType::kBF16:  // 0x3F80 is 1.0, 0x4000 2.0, ... (float32's top 16 bits)
      return HostArray::from_vector<BFloat16>(
          {2, 3}, {BFloat16::from_bits(0), BFloat16::from_bits(0x3F80), BFloat16::from_bits(0x4000),
                   BFloat16::from_bits(0x4040), BFloat16::from_bits(0x4080), BFloat16::from_bits(0x40A0)});
    case DType::kF16:
      return HostArray::from_vector<Float16>(
          {2, 3}, {Float16::from_bits(0), Float16::from_bits(0x3C00), Float16::from_bits(0x4000),
                   Float16::from_bits(0x4200), Float16::from_bits(0x4400), Float16::from_bits(0x4500)});
    case DType::kU8:
      return HostArray::from_vector<uint8_t>({2, 3}, {0, 1, 2, 3, 4, 5});
    case DType::kI8:
      return HostArray::from_vector<int8_t>({2, 3}, {0, 1, 2, 3, 4, 5});
    case DType::kI16:
      return HostArray::from_vector<int16_t>({2, 3}, {0, 1, 2, 3, 4, 5});
  }
  return HostArray();
}

TEST(HostArray, ArangeEveryDType) {
  for (DType dtype : kAllDTypes) {
    SCOPED_TRACE(dtype_name(dtype));
    HostArray a = HostArray::arange(dtype, {2, 3});
    EXPECT_EQ(a.dtype(), dtype);
    EXPECT_EQ(a.shape(), (Shape{2, 3}));
    EXPECT_EQ(a.size(), 6);
    EXPECT_TRUE(a == ExpectedArange2x3(dtype));
    const bool is_bool = dtype == DType::kBool;
    for (int64_t i = 0; i < 6; ++i) {
      EXPECT_EQ(a.element_as_double(i), is_bool ? static_cast<double>(i % 2) : static_cast<double>(i));
    }
  }
}

TEST(HostArray, OnesAndZerosEveryDType) {
  for (DType dtype : kAllDTypes) {
    SCOPED_TRACE(dtype_name(dtype));
    HostArray ones = HostArray::ones(dtype, {4, 2});
    HostArray zeros = HostArray::zeros(dtype, {4, 2});
    EXPECT_EQ(ones.dtype(), dtype);
    EXPECT_EQ(zeros.shape(), (Shape{4, 2}));
    EXPECT_EQ(ones.nbytes(), 8 * dtype_size(dtype));
    for (int64_t i = 0; i < 8; ++i) {
      EXPECT_EQ(ones.element_as_double(i), 1.0);
      EXPECT_EQ(zeros.element_as_double(i), 0.0);
    }
    EXPECT_TRUE(ones != zeros);
  }
  EXPECT_THAT(HostArray::ones(DType::kF32, {3}).values<float>(), Each(1.0f));
  EXPECT_THAT(HostArray::ones(DType::kI64, {3}).values<int64_t>(), Each(int64_t{1}));
  EXPECT_THAT(HostArray::ones(DType::kBool, {3}).values<bool>(), Each(true));
  EXPECT_THAT(HostArray::zeros(DType::kF64, {3}).values<double>(), Each(0.0));
  EXPECT_THAT(HostArray::zeros(DType::kBool, {3}).values<bool>(), Each(false));
  EXPECT_EQ(HostArray::ones(DType::kI32, {}).size(), 1);
  EXPECT_EQ(HostArray::zeros(DType::kI32, {0}).size(), 0);
}

TEST(HostArray, CloneIsEqualAndIndependent) {
  for (DType dtype : kAllDTypes) {
    SCOPED_TRACE(dtype_name(dtype));
    HostArray a = HostArray::arange(dtype, {3, 4});
    HostArray b = a.clone();
    EXPECT_TRUE(a == b);
    EXPECT_NE(a.data(), b.data());
    std::memset(b.data(), 0, static_cast<size_t>(b.nbytes()));
    EXPECT_TRUE(a != b);
    EXPECT_TRUE(a == HostArray::arange(dtype, {3, 4}));
  }
  HostArray empty = HostArray::zeros(DType::kF64, {0, 3});
  EXPECT_TRUE(empty.clone() == empty);
}

TEST(HostArray, EqualityNeedsSameDTypeShapeAndBytes) {
  HostArray a = HostArray::zeros(DType::kI32, {2, 3});
  EXPECT_TRUE(a == HostArray::zeros(DType::kI32, {2, 3}));
  EXPECT_TRUE(a != HostArray::zeros(DType::kI32, {6}));     // same bytes, other shape
  EXPECT_TRUE(a != HostArray::zeros(DType::kF32, {2, 3}));  // same bytes, other dtype
  EXPECT_TRUE(a != HostArray::from_vector<int32_t>({2, 3}, {0, 0, 0, 0, 0, 1}));
  EXPECT_TRUE(HostArray::zeros(DType::kF32, {0}) != HostArray::zeros(DType::kF32, {0, 0}));
}

TEST(HostArray, MoveKeepsStorage) {
  HostArray a = HostArray::arange(DType::kI64, {5});
  const std::byte* data = a.data();
  HostArray b = std::move(a);
  EXPECT_EQ(b.data(), data);
  EXPECT_THAT(b.values<int64_t>(), ElementsAre(0, 1, 2, 3, 4));
}

TEST(HostArray, ElementAsDouble) {
  HostArray f = HostArray::from_vector<float>({2}, {-1.5f, 0.25f});
  EXPECT_EQ(f.element_as_double(0), -1.5);
  EXPECT_EQ(f.element_as_double(1), 0.25);
  HostArray d = HostArray::from_vector<double>({1}, {1e300});
  EXPECT_EQ(d.element_as_double(0), 1e300);
  HostArray i32 = HostArray::from_vector<int32_t>({2}, {-2147483647 - 1, 2147483647});
  EXPECT_EQ(i32.element_as_double(0), -2147483648.0);
  EXPECT_EQ(i32.element_as_double(1), 2147483647.0);
  HostArray i64 = HostArray::from_vector<int64_t>({2}, {-5, int64_t{1} << 40});
  EXPECT_EQ(i64.element_as_double(0), -5.0);
  EXPECT_EQ(i64.element_as_double(1), 1099511627776.0);
  HostArray b = HostArray::from_vector<bool>({2}, {true, false});
  EXPECT_EQ(b.element_as_double(0), 1.0);
  EXPECT_EQ(b.element_as_double(1), 0.0);
}

// ---- xtensor interop -------------------------------------------------------------------------

TEST(XtensorInterop, AsXtensorSharesStorage) {
  HostArray a = HostArray::from_vector<float>({2, 3}, {0, 1, 2, 3, 4, 5});
  auto view = as_xtensor<float>(a);
  ASSERT_EQ(view.dimension(), 2u);
  EXPECT_EQ(view.shape()[0], 2u);
  EXPECT_EQ(view.shape()[1], 3u);
  EXPECT_EQ(view(0, 2), 2.0f);
  EXPECT_EQ(view(1, 0), 3.0f);
  EXPECT_EQ(view.data(), a.values<float>().data());

  view(1, 2) = 50.0f;  // writes through the view land in the array
  EXPECT_EQ(a.values<float>()[5], 50.0f);
  a.mutable_values<float>()[1] = -1.0f;  // and the other way round
  EXPECT_EQ(view(0, 1), -1.0f);
  view *= 2.0f;
  EXPECT_THAT(a.values<float>(), ElementsAre(0.f, -2.f, 4.f, 6.f, 8.f, 100.f));

  const HostArray& c = a;
  auto const_view = as_xtensor<float>(c);
  EXPECT_EQ(const_view(1, 1), 8.0f);
  EXPECT_EQ(const_view.data(), c.values<float>().data());
}

TEST(XtensorInterop, FromXtensorCopies) {
  xt::xarray<float> x = {{1, 2}, {3, 4}};
  HostArray a = from_xtensor(x);
  EXPECT_EQ(a.dtype(), DType::kF32);
  EXPECT_EQ(a.shape(), (Shape{2, 2}));
  EXPECT_THAT(a.values<float>(), ElementsAre(1.f, 2.f, 3.f, 4.f));
  x(0, 0) = 100;
  EXPECT_EQ(a.values<float>()[0], 1.0f);  // a copy, not a view

  HostArray i = from_xtensor(xt::xarray<int64_t>{{{1, 2, 3}}, {{4, 5, 6}}});
  EXPECT_EQ(i.dtype(), DType::kI64);
  EXPECT_EQ(i.shape(), (Shape{2, 1, 3}));
  EXPECT_THAT(i.values<int64_t>(), ElementsAre(1, 2, 3, 4, 5, 6));

  // Any expression, evaluated into the new array.
  HostArray src = HostArray::arange(DType::kF64, {2, 2});
  HostArray doubled = from_xtensor(as_xtensor<double>(src) * 2.0 + 1.0);
  EXPECT_EQ(doubled.dtype(), DType::kF64);
  EXPECT_EQ(doubled.shape(), (Shape{2, 2}));
  EXPECT_THAT(doubled.values<double>(), ElementsAre(1.0, 3.0, 5.0, 7.0));
}

}  // namespace
}  // namespace tessera
