// extract_block / insert_block (and the raw copy_block_* they wrap) against an
// element-by-element reference.
#include "core/slicing.h"

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "core/host_array.h"
#include "core/mesh.h"
#include "core/partition_spec.h"
#include "core/sharding.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// ---- Reference -------------------------------------------------------------------------------

// An array of rank <= 3 seen as 3-D, by prepending dimensions of size 1.
struct As3D {
  int64_t dim[3];
  Slice slice[3];
};

As3D Pad(const Shape& shape, const Index& index) {
  As3D out{{1, 1, 1}, {{0, 1}, {0, 1}, {0, 1}}};
  const size_t lead = 3 - shape.size();
  for (size_t d = 0; d < shape.size(); ++d) {
    out.dim[lead + d] = shape[d];
    out.slice[lead + d] = index[d];
  }
  return out;
}

// Visits every element of block `index`: f(offset in the global array, offset in the block).
template <typename F>
void NaiveForEach(const Shape& shape, const Index& index, F f) {
  const As3D a = Pad(shape, index);
  const int64_t e1 = a.slice[1].stop - a.slice[1].start;
  const int64_t e2 = a.slice[2].stop - a.slice[2].start;
  for (int64_t i = a.slice[0].start; i < a.slice[0].stop; ++i) {
    for (int64_t j = a.slice[1].start; j < a.slice[1].stop; ++j) {
      for (int64_t k = a.slice[2].start; k < a.slice[2].stop; ++k) {
        const int64_t global = (i * a.dim[1] + j) * a.dim[2] + k;
        const int64_t local = ((i - a.slice[0].start) * e1 + (j - a.slice[1].start)) * e2 + (k - a.slice[2].start);
        f(global, local);
      }
    }
  }
}

HostArray NaiveExtract(const HostArray& global, const Index& index) {
  Shape block;
  for (const Slice& s : index) block.push_back(s.stop - s.start);
  HostArray out(global.dtype(), block);
  const size_t es = static_cast<size_t>(dtype_size(global.dtype()));
  NaiveForEach(global.shape(), index,
               [&](int64_t g, int64_t l) { std::memcpy(out.data() + l * es, global.data() + g * es, es); });
  return out;
}

void NaiveInsert(const HostArray& block, const Index& index, HostArray* global) {
  const size_t es = static_cast<size_t>(dtype_size(global->dtype()));
  NaiveForEach(global->shape(), index,
               [&](int64_t g, int64_t l) { std::memcpy(global->data() + g * es, block.data() + l * es, es); });
}

// ---- Helpers ---------------------------------------------------------------------------------

// Same dtype, shape and bytes; on failure names the first differing element.
testing::AssertionResult SameArray(const HostArray& actual, const HostArray& expected) {
  if (actual.dtype() != expected.dtype()) {
    return testing::AssertionFailure() << "dtype " << dtype_name(actual.dtype()) << " vs "
                                       << dtype_name(expected.dtype());
  }
  if (actual.shape() != expected.shape()) {
    return testing::AssertionFailure() << "shape " << shape_to_string(actual.shape()) << " vs "
                                       << shape_to_string(expected.shape());
  }
  for (int64_t i = 0; i < actual.size(); ++i) {
    if (actual.element_as_double(i) != expected.element_as_double(i)) {
      return testing::AssertionFailure() << "element " << i << ": " << actual.element_as_double(i) << " vs "
                                         << expected.element_as_double(i);
    }
  }
  if (actual != expected) return testing::AssertionFailure() << "bytes differ";
  return testing::AssertionSuccess();
}

template <typename T>
void FillRandom(HostArray* a, std::mt19937* rng) {
  // (1-byte integers: up to 100, so that no value wraps to 0.)
  std::uniform_int_distribution<int> dist(std::is_same_v<T, bool> ? 0 : 1, std::is_same_v<T, bool> ? 1
                                                                           : sizeof(T) == 1        ? 100
                                                                                                   : 1 << 20);
  for (T& v : a->mutable_values<T>()) v = static_cast<T>(dist(*rng));
}

// Random contents (nonzero unless bool).
HostArray RandomArray(DType dtype, const Shape& shape, std::mt19937* rng) {
  HostArray a(dtype, shape);
  switch (dtype) {
    case DType::kF32:
      FillRandom<float>(&a, rng);
      break;
    case DType::kF64:
      FillRandom<double>(&a, rng);
      break;
    case DType::kI32:
      FillRandom<int32_t>(&a, rng);
      break;
    case DType::kI64:
      FillRandom<int64_t>(&a, rng);
      break;
    case DType::kBool:
      FillRandom<bool>(&a, rng);
      break;
    case DType::kU32:
      FillRandom<uint32_t>(&a, rng);
      break;
    case DType::kBF16:
      FillRandom<BFloat16>(&a, rng);
      break;
    case DType::kF16:
      FillRandom<Float16>(&a, rng);
      break;
    case DType::kU8:
      FillRandom<uint8_t>(&a, rng);
      break;
    case DType::kI8:
      FillRandom<int8_t>(&a, rng);
      break;
    case DType::kI16:
      FillRandom<int16_t>(&a, rng);
      break;
  }
  return a;
}

// A random valid index: each slice is the whole dimension a third of the time (to exercise
// merged runs), else any [start, stop), empty ones included.
Index RandomIndex(const Shape& shape, std::mt19937* rng) {
  Index index;
  for (int64_t dim : shape) {
    if (std::uniform_int_distribution<int>(0, 2)(*rng) == 0) {
      index.push_back({0, dim});
      continue;
    }
    const int64_t start = std::uniform_int_distribution<int64_t>(0, dim)(*rng);
    const int64_t stop = std::uniform_int_distribution<int64_t>(start, dim)(*rng);
    index.push_back({start, stop});
  }
  return index;
}

// ---- Hand-written cases ----------------------------------------------------------------------

TEST(Slicing, BlockShape) {
  EXPECT_EQ(block_shape({{1, 3}, {0, 0}, {2, 5}}), (Shape{2, 0, 3}));
  EXPECT_EQ(block_shape({}), Shape{});
}

TEST(Slicing, ExtractKnownBlocks) {
  // [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
  HostArray a = HostArray::arange(DType::kI32, {4, 3});
  EXPECT_THAT(extract_block(a, {{1, 3}, {0, 2}}).values<int32_t>(), ElementsAre(3, 4, 6, 7));
  EXPECT_THAT(extract_block(a, {{0, 4}, {2, 3}}).values<int32_t>(), ElementsAre(2, 5, 8, 11));
  EXPECT_THAT(extract_block(a, {{2, 3}, {0, 3}}).values<int32_t>(), ElementsAre(6, 7, 8));
  EXPECT_THAT(extract_block(a, {{1, 3}, {0, 3}}).values<int32_t>(), ElementsAre(3, 4, 5, 6, 7, 8));
  EXPECT_EQ(extract_block(a, {{1, 3}, {0, 2}}).shape(), (Shape{2, 2}));

  // Element (i, j, k) = 12 i + 4 j + k.
  HostArray b = HostArray::arange(DType::kF64, {2, 3, 4});
  HostArray block = extract_block(b, {{0, 2}, {1, 2}, {1, 3}});
  EXPECT_EQ(block.shape(), (Shape{2, 1, 2}));
  EXPECT_THAT(block.values<double>(), ElementsAre(5, 6, 17, 18));
  EXPECT_THAT(extract_block(b, {{1, 2}, {0, 3}, {3, 4}}).values<double>(), ElementsAre(15, 19, 23));
}

TEST(Slicing, InsertKnownBlock) {
  HostArray a = HostArray::zeros(DType::kI32, {4, 3});
  insert_block(HostArray::from_vector<int32_t>({2, 2}, {1, 2, 3, 4}), {{1, 3}, {1, 3}}, &a);
  EXPECT_THAT(a.values<int32_t>(), ElementsAre(0, 0, 0, 0, 1, 2, 0, 3, 4, 0, 0, 0));
  insert_block(HostArray::from_vector<int32_t>({1, 3}, {7, 8, 9}), {{3, 4}, {0, 3}}, &a);
  EXPECT_THAT(a.values<int32_t>(), ElementsAre(0, 0, 0, 0, 1, 2, 0, 3, 4, 7, 8, 9));
}

// The raw byte API works for any element size, including ones no DType has.
TEST(Slicing, RawCopyWithTwoByteElements) {
  std::vector<uint16_t> global(4 * 5);
  for (size_t i = 0; i < global.size(); ++i) global[i] = static_cast<uint16_t>(1000 + i);
  const Index index = {{1, 3}, {2, 5}};
  std::vector<uint16_t> block(6);
  copy_block_out(reinterpret_cast<const std::byte*>(global.data()), {4, 5}, 2, index,
                 reinterpret_cast<std::byte*>(block.data()));
  EXPECT_THAT(block, ElementsAre(1007, 1008, 1009, 1012, 1013, 1014));

  std::vector<uint16_t> out(4 * 5, 0);
  copy_block_in(reinterpret_cast<const std::byte*>(block.data()), {4, 5}, 2, index,
                reinterpret_cast<std::byte*>(out.data()));
  EXPECT_THAT(out, ElementsAre(0, 0, 0, 0, 0,           //
                               0, 0, 1007, 1008, 1009,  //
                               0, 0, 1012, 1013, 1014,  //
                               0, 0, 0, 0, 0));
}

TEST(Slicing, ZeroSizeBlocks) {
  HostArray a = HostArray::arange(DType::kF32, {4, 3});
  const HostArray original = a.clone();
  for (const Index& index :
       {Index{{2, 2}, {0, 3}}, Index{{0, 4}, {1, 1}}, Index{{4, 4}, {3, 3}}, Index{{1, 1}, {0, 0}}}) {
    HostArray block = extract_block(a, index);
    EXPECT_EQ(block.size(), 0);
    EXPECT_EQ(block.shape(), (Shape{index[0].stop - index[0].start, index[1].stop - index[1].start}));
    insert_block(block, index, &a);
    EXPECT_TRUE(SameArray(a, original));
  }
  // Blocks of arrays that are themselves empty.
  HostArray empty = HostArray::zeros(DType::kI64, {0, 3});
  EXPECT_EQ(extract_block(empty, {{0, 0}, {0, 3}}).shape(), (Shape{0, 3}));
  EXPECT_EQ(extract_block(empty, {{0, 0}, {1, 2}}).shape(), (Shape{0, 1}));
  HostArray empty2 = HostArray::zeros(DType::kI64, {3, 0});
  EXPECT_EQ(extract_block(empty2, {{1, 2}, {0, 0}}).shape(), (Shape{1, 0}));
  insert_block(HostArray::zeros(DType::kI64, {3, 0}), {{0, 3}, {0, 0}}, &empty2);
  EXPECT_EQ(empty2.size(), 0);
}

TEST(Slicing, ScalarArrays) {
  HostArray x = HostArray::from_vector<float>({}, {3.5f});
  EXPECT_TRUE(validate_index({}, {}).ok());
  HostArray block = extract_block(x, {});
  EXPECT_EQ(block.shape(), Shape{});
  EXPECT_THAT(block.values<float>(), ElementsAre(3.5f));

  HostArray y = HostArray::zeros(DType::kF32, {});
  insert_block(block, {}, &y);
  EXPECT_THAT(y.values<float>(), ElementsAre(3.5f));
}

TEST(Slicing, ValidateIndex) {
  const Shape shape = {4, 3};
  EXPECT_TRUE(validate_index({{0, 4}, {0, 3}}, shape).ok());
  EXPECT_TRUE(validate_index({{4, 4}, {3, 3}}, shape).ok());
  EXPECT_TRUE(validate_index({{1, 2}, {2, 3}}, shape).ok());

  absl::Status rank = validate_index({{0, 4}}, shape);
  EXPECT_EQ(rank.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(rank.message(), HasSubstr("rank 2"));
  EXPECT_EQ(validate_index({{0, 4}, {0, 3}, {0, 1}}, shape).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(validate_index({}, shape).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(validate_index({{0, 1}}, {}).code(), absl::StatusCode::kInvalidArgument);

  struct Case {
    Index index;
    std::string fact;
  };
  const std::vector<Case> bad = {
      {{{-1, 2}, {0, 3}}, "slice 0"},  // negative start
      {{{3, 2}, {0, 3}}, "slice 0"},   // start > stop
      {{{0, 5}, {0, 3}}, "slice 0"},   // stop > dim
      {{{0, 4}, {2, 4}}, "slice 1"},  {{{0, 4}, {4, 4}}, "slice 1"},
  };
  for (const Case& c : bad) {
    SCOPED_TRACE(index_to_string(c.index));
    absl::Status status = validate_index(c.index, shape);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr(c.fact));
  }
}

// ---- Randomized, against the reference -------------------------------------------------------

TEST(Slicing, RandomBlocksMatchReference) {
  std::mt19937 rng(20240531);
  const std::vector<Shape> shapes = {{5, 4, 3}, {2, 7, 6}, {1, 1, 1}, {4, 1, 5}, {3, 0, 2}, {6, 9}, {11}};
  for (DType dtype : kAllDTypes) {
    for (const Shape& shape : shapes) {
      HostArray global = RandomArray(dtype, shape, &rng);
      for (int trial = 0; trial < 40; ++trial) {
        const Index index = RandomIndex(shape, &rng);
        SCOPED_TRACE(dtype_name(dtype) + " " + shape_to_string(shape) + " " + index_to_string(index));
        ASSERT_TRUE(validate_index(index, shape).ok());

        // Extract.
        HostArray block = extract_block(global, index);
        ASSERT_TRUE(SameArray(block, NaiveExtract(global, index)));

        // Insert a fresh block over other contents; everything outside the block survives.
        HostArray fresh = RandomArray(dtype, block.shape(), &rng);
        HostArray target = RandomArray(dtype, shape, &rng);
        HostArray expected = target.clone();
        NaiveInsert(fresh, index, &expected);
        insert_block(fresh, index, &target);
        ASSERT_TRUE(SameArray(target, expected));

        // Round trip into zeros.
        HostArray zeros = HostArray::zeros(dtype, shape);
        HostArray expected_zeros = HostArray::zeros(dtype, shape);
        insert_block(block, index, &zeros);
        NaiveInsert(NaiveExtract(global, index), index, &expected_zeros);
        ASSERT_TRUE(SameArray(zeros, expected_zeros));
      }
    }
  }
}

// ---- Every layout of the sharding tables ------------------------------------------------------

TEST(Slicing, DeviceBlocksReassembleEveryLayout) {
  const Mesh mesh = make_mesh({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7}).value();
  const std::vector<PartitionSpec> layouts = {P("data", None),          P(None, "model"),         P("data", "model"),
                                              P(Axes{"data", "model"}), P(Axes{"model", "data"}), P()};
  std::mt19937 rng(7);
  for (DType dtype : {DType::kI32, DType::kF64, DType::kBool}) {
    for (const Shape& shape : {Shape{8, 2}, Shape{16, 8}}) {
      const HostArray global = RandomArray(dtype, shape, &rng);
      for (const PartitionSpec& spec : layouts) {
        SCOPED_TRACE(dtype_name(dtype) + " " + shape_to_string(shape) + " " + spec.to_string());
        NamedSharding sharding(mesh, spec);
        ASSERT_TRUE(sharding.validate(shape).ok());
        HostArray rebuilt = HostArray::zeros(dtype, shape);
        for (const DeviceShard& shard : sharding.device_shards(shape)) {
          HostArray block = extract_block(global, shard.index);
          EXPECT_EQ(block.shape(), sharding.shard_shape(shape));
          EXPECT_TRUE(SameArray(block, NaiveExtract(global, shard.index)));
          insert_block(block, shard.index, &rebuilt);
        }
        EXPECT_TRUE(SameArray(rebuilt, global));
      }
    }
  }
}

}  // namespace
}  // namespace tessera
