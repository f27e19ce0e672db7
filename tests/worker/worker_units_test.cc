// Unit tests of the worker's pieces that need no network: the buffer store and the
// reduction kernels.
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "worker/buffer_store.h"
#include "worker/collectives/reduce.h"

namespace tessera {
namespace {

TEST(BufferStore, ReserveCommitGetErase) {
  BufferStore store(1000);
  ASSERT_TRUE(store.reserve(1, 400).ok());
  EXPECT_EQ(store.reserve(1, 10).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(store.reserve(2, 601).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store.get(1).status().code(), absl::StatusCode::kNotFound);  // reserved, not yet committed
  store.commit(1, std::make_shared<const HostArray>(HostArray::zeros(DType::kF32, {100})));
  ASSERT_TRUE(store.get(1).ok());
  EXPECT_EQ(store.stats().bytes_used, 400);
  EXPECT_EQ(store.erase({1, 99}), 1);
  EXPECT_EQ(store.stats().bytes_used, 0);
  EXPECT_EQ(store.stats().buffer_count, 0);
}

TEST(BufferStore, CancelReleasesTheReservation) {
  BufferStore store(100);
  ASSERT_TRUE(store.reserve(1, 100).ok());
  store.cancel(1);
  EXPECT_EQ(store.stats().bytes_used, 0);
  EXPECT_TRUE(store.reserve(1, 100).ok());
}

TEST(BufferStore, ErasedWhileBeingFilledIsDroppedOnCommit) {
  BufferStore store(1000);
  ASSERT_TRUE(store.reserve(7, 40).ok());
  EXPECT_EQ(store.erase({7}), 0);  // not committed yet
  store.commit(7, std::make_shared<const HostArray>(HostArray::zeros(DType::kF32, {10})));
  EXPECT_EQ(store.get(7).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.stats().bytes_used, 0);
  EXPECT_EQ(store.stats().buffer_count, 0);
}

// reduce_into against a plain loop, for every dtype and op, with the input deliberately
// misaligned (as data straight from the wire can be).
template <typename T>
void check_reduce(DType dtype) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> dist(-5, 5);
  const int n = 1001;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kProd}) {
    // Plain arrays: std::vector<bool> has no data().
    std::unique_ptr<T[]> a(new T[n]), b(new T[n]), want(new T[n]);
    for (int i = 0; i < n; ++i) {
      a[i] = static_cast<T>(dist(rng));
      b[i] = static_cast<T>(dist(rng));
      if constexpr (std::is_same_v<T, bool>) {
        want[i] = (op == ReduceOp::kSum || op == ReduceOp::kMax) ? (a[i] || b[i]) : (a[i] && b[i]);
      } else {
        switch (op) {
          case ReduceOp::kSum:
            want[i] = a[i] + b[i];
            break;
          case ReduceOp::kMax:
            want[i] = std::max(a[i], b[i]);
            break;
          case ReduceOp::kMin:
            want[i] = std::min(a[i], b[i]);
            break;
          case ReduceOp::kProd:
            want[i] = a[i] * b[i];
            break;
        }
      }
    }
    std::vector<std::byte> unaligned(n * sizeof(T) + 1);
    std::memcpy(unaligned.data() + 1, b.get(), n * sizeof(T));
    reduce_into(dtype, op, reinterpret_cast<std::byte*>(a.get()), unaligned.data() + 1, n);
    for (int i = 0; i < n; ++i) ASSERT_EQ(a[i], want[i]) << dtype_name(dtype) << " " << reduce_op_name(op) << " " << i;
  }
}

TEST(Reduce, EveryDtypeAndOpMatchesAPlainLoop) {
  check_reduce<float>(DType::kF32);
  check_reduce<double>(DType::kF64);
  check_reduce<int32_t>(DType::kI32);
  check_reduce<int64_t>(DType::kI64);
  check_reduce<bool>(DType::kBool);
}

TEST(Reduce, IntegerSumsWrapAround) {
  int32_t a = 2147483647, b = 1;
  reduce_into(DType::kI32, ReduceOp::kSum, reinterpret_cast<std::byte*>(&a), reinterpret_cast<const std::byte*>(&b), 1);
  EXPECT_EQ(a, -2147483647 - 1);
}

}  // namespace
}  // namespace tessera
