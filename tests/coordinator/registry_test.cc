// Registry: losing a device and getting it back — by registration only, and with its shards
// kept (the same process) or reported lost (a new process).
#include "coordinator/registry.h"

#include "core/mesh.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

class RegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 2; ++i) {
      ASSERT_TRUE(registry_.register_worker(absl::StrCat("w", i), absl::StrCat("h:", i), i, 1 << 20, 0, t0_).ok());
    }
    absl::StatusOr<Mesh> mesh = make_mesh({2}, {"x"}, {0, 1});
    ASSERT_TRUE(mesh.ok());
    absl::StatusOr<uint64_t> id = registry_.create_array(DType::kF32, {4}, NamedSharding(*mesh, P("x")));
    ASSERT_TRUE(id.ok());
    array_ = *id;
  }

  const absl::Time t0_ = absl::FromUnixSeconds(1000);
  Registry registry_{absl::Seconds(3)};
  uint64_t array_ = 0;
};

TEST_F(RegistryTest, ALostDeviceComesBackOnlyByRegisteringAgain) {
  EXPECT_THAT(registry_.mark_lost(t0_ + absl::Seconds(4)), ElementsAre(0, 1));
  absl::Status beat = registry_.heartbeat(1, 1, t0_ + absl::Seconds(5));
  EXPECT_EQ(beat.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(beat.message()), HasSubstr("register again"));
  EXPECT_FALSE(registry_.device(1)->alive);

  // The same process (it held incarnation 1): alive again, its shards kept.
  absl::StatusOr<DeviceRecord> back = registry_.register_worker("w1", "h:1", 1, 1 << 20, 1, t0_ + absl::Seconds(6));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->incarnation, 2u);
  EXPECT_TRUE(registry_.device(1)->alive);
  EXPECT_TRUE(registry_.heartbeat(1, 2, t0_ + absl::Seconds(7)).ok());
  EXPECT_EQ(registry_.heartbeat(1, 1, t0_ + absl::Seconds(7)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(registry_.get_array(array_)->lost_devices, IsEmpty());
}

TEST_F(RegistryTest, ANewProcessUnderAKnownNameLosesTheShardsItHeld) {
  absl::StatusOr<DeviceRecord> fresh = registry_.register_worker("w0", "h:9", -1, 1 << 20, 0, t0_);
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(fresh->id, 0);
  EXPECT_EQ(fresh->incarnation, 2u);
  EXPECT_THAT(registry_.get_array(array_)->lost_devices, ElementsAre(0));
  EXPECT_THAT(registry_.arrays()[0].lost_devices, ElementsAre(0));
}

}  // namespace
}  // namespace tessera
