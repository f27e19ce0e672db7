// join_at_most: the bounded lists of error messages (core/bounded_join.h).
#include "core/bounded_join.h"

#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace tessera {
namespace {

TEST(BoundedJoin, NamesTheFirstItemsAndCountsTheRest) {
  EXPECT_EQ(join_at_most(std::vector<int>{}, 2), "");
  EXPECT_EQ(join_at_most(std::vector<int>{3}, 2), "3");
  EXPECT_EQ(join_at_most(std::vector<int>{3, 5}, 2), "3, 5");
  EXPECT_EQ(join_at_most(std::vector<int>{3, 5, 8}, 2), "3, 5 and 1 more");
  EXPECT_EQ(join_at_most(std::vector<int>{3, 5, 8}, 0), "3 more");
  EXPECT_EQ(join_at_most(std::vector<std::string>{"a: x", "b: y", "c"}, 2, "; "), "a: x; b: y and 1 more");
  std::vector<uint64_t> many(2000);
  for (size_t i = 0; i < many.size(); ++i) many[i] = 100 + i;
  EXPECT_EQ(join_at_most(many, 3), "100, 101, 102 and 1997 more");
}

TEST(BoundedJoin, FormatsEachItemAsTold) {
  const std::map<int, uint64_t> peers = {{0, 7}, {4, 1}, {9, 2}};
  EXPECT_EQ(join_at_most(peers, 2, ", ", [](std::string* out, const auto& p) { absl::StrAppend(out, p.first); }),
            "0, 4 and 1 more");
}

}  // namespace
}  // namespace tessera
