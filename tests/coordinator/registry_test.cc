// Registry: losing a device and getting it back — by registration only, and with its shards
// kept (the same process) or reported lost (a new process); ids across coordinator
// incarnations, and arrays adopted again after a restart from what the workers hold.
#include "coordinator/registry.h"

#include <set>
#include <utility>
#include <vector>

#include "coordinator/access.h"
#include "coordinator/request_limits.h"
#include "core/mesh.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/tessera.pb.h"

namespace tessera {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

class RegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 2; ++i) {
      ASSERT_TRUE(
          registry_.register_worker({absl::StrCat("w", i), absl::StrCat("h:", i), i, 1 << 20, 0, 0, {}}, t0_).ok());
    }
    absl::StatusOr<Mesh> mesh = make_mesh({2}, {"x"}, {0, 1});
    ASSERT_TRUE(mesh.ok());
    absl::StatusOr<uint64_t> id = registry_.create_array(DType::kF32, {4}, NamedSharding(*mesh, P("x")));
    ASSERT_TRUE(id.ok());
    array_ = *id;
  }

  const absl::Time t0_ = absl::FromUnixSeconds(1000);
  Registry registry_{absl::Seconds(3), t0_};
  uint64_t array_ = 0;
};

TEST_F(RegistryTest, ALostDeviceComesBackOnlyByRegisteringAgain) {
  EXPECT_THAT(registry_.mark_lost(t0_ + absl::Seconds(4)), ElementsAre(0, 1));
  const uint64_t epoch = registry_.epoch();
  absl::Status beat = registry_.heartbeat(1, epoch, 1, t0_ + absl::Seconds(5));
  EXPECT_EQ(beat.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(beat.message()), HasSubstr("register again"));
  EXPECT_FALSE(registry_.device(1)->alive);

  // The same process (it held incarnation 1): alive again, its shards kept.
  absl::StatusOr<DeviceRecord> back =
      registry_.register_worker({"w1", "h:1", 1, 1 << 20, epoch, 1, {}}, t0_ + absl::Seconds(6));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->incarnation, 2u);
  EXPECT_TRUE(registry_.device(1)->alive);
  EXPECT_TRUE(registry_.heartbeat(1, epoch, 2, t0_ + absl::Seconds(7)).ok());
  EXPECT_EQ(registry_.heartbeat(1, epoch, 1, t0_ + absl::Seconds(7)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(registry_.get_array(array_)->lost_devices, IsEmpty());
}

TEST_F(RegistryTest, ADrainingDeviceIsRefusedWorkUntilItRegistersAgain) {
  const uint64_t epoch = registry_.epoch();
  bool newly = true;
  ASSERT_TRUE(registry_.heartbeat(1, epoch, 1, t0_ + absl::Seconds(1), false, &newly).ok());
  EXPECT_FALSE(newly);
  EXPECT_TRUE(check_not_draining(registry_, {0, 1}, "jit").ok());
  ASSERT_TRUE(registry_.heartbeat(1, epoch, 1, t0_ + absl::Seconds(2), true, &newly).ok());
  EXPECT_TRUE(newly);
  ASSERT_TRUE(registry_.heartbeat(1, epoch, 1, t0_ + absl::Seconds(2), true, &newly).ok());
  EXPECT_FALSE(newly);  // said once
  // A heartbeat without the mark (an older one, arriving late) does not clear it.
  ASSERT_TRUE(registry_.heartbeat(1, epoch, 1, t0_ + absl::Seconds(2)).ok());
  EXPECT_TRUE(registry_.device(1)->draining);
  EXPECT_TRUE(registry_.device(1)->alive);
  // It is alive (the health check counts it) but takes no work (GetTopology's wait does not).
  EXPECT_TRUE(registry_.wait_for_alive(2, absl::ZeroDuration()));
  EXPECT_FALSE(registry_.wait_for_alive(2, absl::ZeroDuration(), /*taking_work=*/true));
  EXPECT_TRUE(registry_.wait_for_alive(1, absl::ZeroDuration(), /*taking_work=*/true));
  const absl::Status refused = check_not_draining(registry_, {0, 1}, "jit");
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(refused.message()), HasSubstr("jit: device 1 (h:1) is draining"));
  EXPECT_TRUE(check_not_draining(registry_, {0}, "jit").ok());
  // The worker back (the same process, or a new one under its name): it takes work again.
  ASSERT_TRUE(registry_.register_worker({"w1", "h:1", 1, 1 << 20, epoch, 1, {}}, t0_ + absl::Seconds(3)).ok());
  EXPECT_FALSE(registry_.device(1)->draining);
  EXPECT_TRUE(check_not_draining(registry_, {0, 1}, "jit").ok());
  EXPECT_TRUE(registry_.wait_for_alive(2, absl::ZeroDuration(), /*taking_work=*/true));
}

TEST_F(RegistryTest, ADeregisteredDeviceHasLeftAndIsNeverCountedLost) {
  const uint64_t epoch = registry_.epoch();
  ASSERT_TRUE(registry_.heartbeat(1, epoch, 1, t0_ + absl::Seconds(1), /*draining=*/true).ok());
  // A deregistration from another incarnation, or of another coordinator's, is refused.
  EXPECT_EQ(registry_.deregister(1, epoch, 2).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(registry_.deregister(1, epoch + 1, 1).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry_.deregister(7, epoch, 1).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(registry_.deregister(1, epoch, 1).ok());
  ASSERT_TRUE(registry_.deregister(1, epoch, 1).ok());  // said twice (a retried call): counted once
  std::optional<DeviceRecord> d = registry_.device(1);
  ASSERT_TRUE(d.has_value());
  EXPECT_TRUE(d->left);
  EXPECT_FALSE(d->alive);
  EXPECT_FALSE(d->draining);
  EXPECT_EQ(d->times_left, 1u);
  // Long past the heartbeat timeout: device 0 (silent) is lost, device 1 is not.
  EXPECT_THAT(registry_.mark_lost(t0_ + absl::Seconds(10)), ElementsAre(0));
  EXPECT_EQ(registry_.device(1)->times_lost, 0u);
  EXPECT_TRUE(registry_.device(1)->left);
  const absl::Status beat = registry_.heartbeat(1, epoch, 1, t0_ + absl::Seconds(11));
  EXPECT_EQ(beat.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(beat.message()), HasSubstr("device 1 (h:1) left (its worker deregistered)"));
  // Back under its name: alive, no longer left.
  ASSERT_TRUE(registry_.register_worker({"w1", "h:1", 1, 1 << 20, 0, 0, {}}, t0_ + absl::Seconds(12)).ok());
  EXPECT_TRUE(registry_.device(1)->alive);
  EXPECT_FALSE(registry_.device(1)->left);
  EXPECT_EQ(registry_.device(1)->times_left, 1u);
}

// The cluster view's version (session 40: a heartbeat reply carries the view only when the
// worker's version is not the current one): every change of the alive devices or of an
// incarnation gives a new version, and the view read with it is that change's; a heartbeat, or
// a sweep that finds nobody lost, keeps it. A worker holding the current version gets no copy.
TEST_F(RegistryTest, EveryChangeOfTheAliveDevicesOrAnIncarnationGivesANewViewVersion) {
  using View = std::vector<std::pair<int, uint64_t>>;
  const uint64_t epoch = registry_.epoch();
  ClusterView view;
  ASSERT_TRUE(registry_.cluster_view(0, &view));
  EXPECT_NE(view.version, 0u);  // 0 is "no view"
  EXPECT_EQ(view.alive, (View{{0, 1}, {1, 1}}));
  std::set<uint64_t> seen = {view.version};
  // Returns the view after a step, expecting (`changed`) a version not seen before or the same.
  auto after = [&](bool changed) {
    const uint64_t before = view.version;
    ClusterView now;
    EXPECT_TRUE(registry_.cluster_view(0, &now));
    if (changed) {
      EXPECT_TRUE(seen.insert(now.version).second) << "version " << now.version << " again";
    } else {
      EXPECT_EQ(now.version, before);
    }
    view = now;
    return view.alive;
  };
  // Up to date: the version only, no devices.
  ClusterView current;
  current.alive = {{5, 5}};
  EXPECT_FALSE(registry_.cluster_view(view.version, &current));
  EXPECT_EQ(current.version, view.version);
  EXPECT_TRUE(current.alive.empty());

  ASSERT_TRUE(registry_.heartbeat(0, epoch, 1, t0_ + absl::Seconds(2), /*draining=*/true).ok());
  EXPECT_EQ(after(false), (View{{0, 1}, {1, 1}}));
  ASSERT_TRUE(registry_.heartbeat(1, epoch, 1, t0_ + absl::Seconds(2)).ok());
  EXPECT_THAT(registry_.mark_lost(t0_ + absl::Seconds(4)), IsEmpty());
  EXPECT_EQ(after(false), (View{{0, 1}, {1, 1}}));
  // A registration of a new device.
  ASSERT_TRUE(registry_.register_worker({"w2", "h:2", 2, 1 << 20, 0, 0, {}}, t0_ + absl::Seconds(4)).ok());
  EXPECT_EQ(after(true), (View{{0, 1}, {1, 1}, {2, 1}}));
  // A device lost (0 and 1 last beat at 2 s; 2 registered at 4 s).
  EXPECT_THAT(registry_.mark_lost(t0_ + absl::Seconds(6)), ElementsAre(0, 1));
  EXPECT_EQ(after(true), (View{{2, 1}}));
  // Registered again: a new incarnation.
  ASSERT_TRUE(registry_.register_worker({"w1", "h:1", 1, 1 << 20, epoch, 1, {}}, t0_ + absl::Seconds(6)).ok());
  EXPECT_EQ(after(true), (View{{1, 2}, {2, 1}}));
  // Re-registered while alive (a new process under the same name): a new incarnation too.
  ASSERT_TRUE(registry_.register_worker({"w2", "h:2", 2, 1 << 20, 0, 0, {}}, t0_ + absl::Seconds(6)).ok());
  EXPECT_EQ(after(true), (View{{1, 2}, {2, 2}}));
  // A device that left; its deregistration said again changes nothing more.
  ASSERT_TRUE(registry_.deregister(2, epoch, 2).ok());
  EXPECT_EQ(after(true), (View{{1, 2}}));
  ASSERT_TRUE(registry_.deregister(2, epoch, 2).ok());
  EXPECT_EQ(after(false), (View{{1, 2}}));
}

TEST_F(RegistryTest, ANewProcessUnderAKnownNameLosesTheShardsItHeld) {
  absl::StatusOr<DeviceRecord> fresh = registry_.register_worker({"w0", "h:9", -1, 1 << 20, 0, 0, {}}, t0_);
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(fresh->id, 0);
  EXPECT_EQ(fresh->incarnation, 2u);
  EXPECT_THAT(registry_.get_array(array_)->lost_devices, ElementsAre(0));
  EXPECT_THAT(registry_.arrays()[0].lost_devices, ElementsAre(0));
}

TEST_F(RegistryTest, AnEarlierIncarnationOfTheSameProcessIsANewProcess) {
  // Epoch 0 is no registration at all; another coordinator's incarnation 1 is not this one's.
  absl::StatusOr<DeviceRecord> other = registry_.register_worker({"w1", "h:1", 1, 1 << 20, 7, 1, {}}, t0_);
  ASSERT_TRUE(other.ok());
  EXPECT_THAT(registry_.get_array(array_)->lost_devices, ElementsAre(1));
}

// A coordinator that restarts (a later start time) never hands out an id of the earlier one,
// answers ABORTED for those, and refuses the earlier one's heartbeats (NOT_FOUND: register).
TEST_F(RegistryTest, IdsOfARestartedCoordinatorNeverMeetTheEarlierOnes) {
  Registry later(absl::Seconds(3), t0_ + absl::Milliseconds(1));
  EXPECT_GT(later.epoch(), array_);
  EXPECT_TRUE(later.ids().before_epoch(array_));
  const uint64_t first = later.ids().next(10);
  EXPECT_EQ(later.ids().next(), first + 10);
  EXPECT_GE(first, later.epoch());
  absl::StatusOr<ArrayRecord> old = later.get_array(array_);
  EXPECT_EQ(old.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(old.status().message()), HasSubstr("earlier incarnation of the coordinator"));
  EXPECT_EQ(later.get_array(first).status().code(), absl::StatusCode::kNotFound);

  ASSERT_TRUE(later.register_worker({"w0", "h:0", 0, 1 << 20, 0, 0, {}}, t0_).ok());
  absl::Status beat = later.heartbeat(0, registry_.epoch(), 1, t0_);
  EXPECT_EQ(beat.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(beat.message()), HasSubstr("restarted"));
  EXPECT_TRUE(later.heartbeat(0, later.epoch(), 1, t0_).ok());

  // A worker holding an id beyond this epoch (a clock that went back) moves the counter past it.
  ASSERT_TRUE(
      later.register_worker({"w1", "h:1", 1, 1 << 20, registry_.epoch(), 1, {{first + 1000, {DType::kF32, {2}}}}}, t0_)
          .ok());
  EXPECT_GT(later.ids().next(), first + 1000);
}

// Found by fuzz_register: a worker holding a buffer under the id 2^64 - 1 (a client may put a
// block under any id in the development mode) wrapped the counter to 0, after which every id
// handed out was "of an earlier incarnation"; one just below 2^62 moved it onto bit 62, the
// workers' barrier ops. Such ids are no coordinator's: the counter stays in [epoch, 2^62).
TEST_F(RegistryTest, HeldIdsThatNoCoordinatorHandsOutDoNotMoveTheCounter) {
  Registry later(absl::Seconds(3), t0_ + absl::Seconds(1));
  const uint64_t before = registry_.epoch();
  uint64_t last = later.ids().next();
  int device = 0;
  for (uint64_t held : {~uint64_t{0}, (uint64_t{1} << 62) - 1, uint64_t{1} << 61}) {
    const std::string name = absl::StrCat("w", device);
    ASSERT_TRUE(
        later.register_worker({name, "h:1", device, 1 << 20, before, 1, {{held, {DType::kF32, {2}}}}}, t0_).ok());
    const uint64_t fresh = later.ids().next();
    EXPECT_GT(fresh, last) << "held " << held;
    EXPECT_LT(fresh, later.epoch() + 100) << "held " << held;
    EXPECT_FALSE(later.ids().before_epoch(fresh)) << "held " << held;
    last = fresh;
    ++device;
  }
  // Below 2^61 the guard still holds: the counter moves past the id.
  const uint64_t ahead = later.epoch() + 1'000'000;
  ASSERT_TRUE(later.register_worker({"w9", "h:9", 9, 1 << 20, before, 1, {{ahead, {DType::kF32, {2}}}}}, t0_).ok());
  EXPECT_GT(later.ids().next(), ahead);
}

TEST_F(RegistryTest, AnArrayIsAdoptedAgainOnlyFromWhatEveryDeviceHolds) {
  const ArrayRecord a = *registry_.get_array(array_);  // f32[4] split over 2 devices: blocks f32[2]
  Registry later(absl::Seconds(3), t0_ + absl::Seconds(1));
  const uint64_t before = registry_.epoch();
  ASSERT_TRUE(later.register_worker({"w0", "h:0", 0, 1 << 20, before, 1, {{array_, {DType::kF32, {2}}}}}, t0_).ok());
  // Device 1 has not registered again yet.
  absl::Status early = later.adopt_array(a);
  EXPECT_EQ(early.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(early.message()), AllOf(HasSubstr(absl::StrCat("array ", array_)), HasSubstr("device 1")));
  // It holds another block shape under that id.
  ASSERT_TRUE(later.register_worker({"w1", "h:1", 1, 1 << 20, before, 1, {{array_, {DType::kF32, {3}}}}}, t0_).ok());
  absl::Status wrong = later.adopt_array(a);
  EXPECT_EQ(wrong.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(wrong.message()), AllOf(HasSubstr("device 1"), HasSubstr("f32[3]")));
  // Its report replaces the earlier one.
  ASSERT_TRUE(later.register_worker({"w1", "h:1", 1, 1 << 20, before, 1, {{array_, {DType::kF32, {2}}}}}, t0_).ok());
  EXPECT_EQ(later.orphan_count(), 1);
  ArrayRecord other = a;
  other.dtype = DType::kI32;
  EXPECT_EQ(later.adopt_array(other).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(later.adopt_array(a).ok());
  EXPECT_TRUE(later.adopt_array(a).ok());  // again: the same array
  EXPECT_EQ(later.adopt_array(other).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(later.get_array(array_)->sharding, a.sharding);
  EXPECT_EQ(later.orphan_count(), 0);
  // An id of this incarnation cannot be adopted: it is known or was never handed out.
  ArrayRecord fresh = a;
  fresh.id = later.ids().next();
  EXPECT_EQ(later.adopt_array(fresh).code(), absl::StatusCode::kNotFound);
}

TEST_F(RegistryTest, OrphansNobodyAdoptsAreRemovedByDevice) {
  Registry later(absl::Seconds(3), t0_ + absl::Seconds(1));
  const uint64_t before = registry_.epoch();
  const std::map<uint64_t, HeldShard> held = {{array_, {DType::kF32, {2}}}, {array_ + 1, {DType::kI32, {8}}}};
  ASSERT_TRUE(later.register_worker({"w0", "h:0", 0, 1 << 20, before, 1, held}, t0_).ok());
  ASSERT_TRUE(later.register_worker({"w1", "h:1", 1, 1 << 20, before, 1, {{array_, {DType::kF32, {2}}}}}, t0_).ok());
  // Buffers of this incarnation's ids are not orphans of an earlier one.
  ASSERT_TRUE(
      later.register_worker({"w2", "h:2", 2, 1 << 20, before, 1, {{later.epoch() + 5, {DType::kF32, {2}}}}}, t0_).ok());
  EXPECT_EQ(later.orphan_count(), 2);
  std::map<int, std::vector<uint64_t>> removed = later.remove_orphans({array_, array_ + 1, 12345});
  EXPECT_THAT(removed[0], ElementsAre(array_, array_ + 1));
  EXPECT_THAT(removed[1], ElementsAre(array_));
  EXPECT_EQ(removed.count(2), 0u);
  EXPECT_EQ(later.orphan_count(), 0);
}

// A session's arrays go when its lease lapses; renewals keep it; a lapsed session is refused.
TEST(RegistrySessions, ALapsedSessionsArraysAreTakenAndItIsRefusedAfterwards) {
  const absl::Time t0 = absl::Now();
  Registry registry(absl::Seconds(3), t0, absl::Seconds(10));
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(registry.register_worker({absl::StrCat("w", i), absl::StrCat("h:", i), i, 1 << 20, 0, 0, {}}, t0).ok());
  }
  absl::StatusOr<Mesh> mesh = make_mesh({2}, {"x"}, {0, 1});
  ASSERT_TRUE(mesh.ok());
  const uint64_t held = registry.open_session(t0);
  const uint64_t renewed = registry.open_session(t0);
  absl::StatusOr<uint64_t> a = registry.create_array(DType::kF32, {4}, NamedSharding(*mesh, P("x")), held);
  absl::StatusOr<uint64_t> b = registry.create_array(DType::kF32, {4}, NamedSharding(*mesh, P("x")), renewed);
  absl::StatusOr<uint64_t> free = registry.create_array(DType::kF32, {4}, NamedSharding(*mesh, P("x")));
  ASSERT_TRUE(a.ok() && b.ok() && free.ok());

  EXPECT_TRUE(registry.take_lapsed(t0 + absl::Seconds(9)).sessions.empty());
  ASSERT_TRUE(registry.renew_session(renewed, t0 + absl::Seconds(9)).ok());
  Registry::Lapsed lapsed = registry.take_lapsed(t0 + absl::Seconds(11));
  EXPECT_THAT(lapsed.sessions, ElementsAre(held));
  EXPECT_EQ(lapsed.arrays, 1);
  EXPECT_THAT(lapsed.buffers[0], ElementsAre(*a));
  EXPECT_THAT(lapsed.buffers[1], ElementsAre(*a));
  EXPECT_EQ(registry.get_array(*a).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry.get_array(*b).ok());
  EXPECT_TRUE(registry.get_array(*free).ok());  // no owner: until deleted

  absl::Status again = registry.renew_session(held, t0 + absl::Seconds(12));
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(again.message()), AllOf(HasSubstr(absl::StrCat("session ", held)), HasSubstr("lapsed")));
  EXPECT_EQ(registry.create_array(DType::kF32, {4}, NamedSharding(*mesh, P("x")), held).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// A deletion batch is decided id by id (take_arrays): the caller's arrays go, another
// session's stay (listed as refused), unknown ids are skipped; and the refusal names the
// refused ids and counts what the batch deleted.
TEST(RegistrySessions, ADeletionBatchRemovesTheCallersArraysAndRefusesOnlyAnotherSessions) {
  const absl::Time t0 = absl::Now();
  Registry registry(absl::Seconds(3), t0, absl::Seconds(10));
  ASSERT_TRUE(registry.register_worker({"w0", "h:0", 0, 1 << 20, 0, 0, {}}, t0).ok());
  absl::StatusOr<Mesh> mesh = make_mesh({1}, {"x"}, {0});
  ASSERT_TRUE(mesh.ok());
  const uint64_t mine = registry.open_session(t0);
  const uint64_t theirs = registry.open_session(t0);
  absl::StatusOr<uint64_t> a = registry.create_array(DType::kF32, {4}, NamedSharding(*mesh, P("x")), mine);
  absl::StatusOr<uint64_t> b = registry.create_array(DType::kF32, {4}, NamedSharding(*mesh, P("x")), theirs);
  absl::StatusOr<uint64_t> c = registry.create_array(DType::kF32, {4}, NamedSharding(*mesh, P("x")), mine);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  const uint64_t unknown = *c + 1000;

  Caller caller;
  caller.session = mine;
  std::vector<uint64_t> refused;
  std::vector<ArrayRecord> removed = registry.remove_arrays_if(
      {*a, *b, unknown, *c}, [&](const ArrayRecord& r) { return is_owner(caller, r); }, &refused);
  ASSERT_EQ(removed.size(), 2u);
  EXPECT_EQ(removed[0].id, *a);
  EXPECT_EQ(removed[1].id, *c);
  EXPECT_THAT(refused, ElementsAre(*b));
  EXPECT_EQ(registry.get_array(*a).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.get_array(*b)->session, theirs);
  EXPECT_EQ(registry.get_array(*c).status().code(), absl::StatusCode::kNotFound);

  EXPECT_TRUE(refused_deletions("DeleteArray", {}, 2, 2).ok());
  absl::Status one = refused_deletions("DeleteArray", refused, 2, 4);
  EXPECT_EQ(one.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(one.message(), absl::StrCat("DeleteArray: array ", *b,
                                        " belongs to another session; only its owner (or an admin credential) may "
                                        "delete it (2 of the other 3 of the 4 arrays were deleted; the rest are "
                                        "unknown here)"));
  absl::Status all = refused_deletions("execute: delete_arrays", {7, 9}, 1, 3);
  EXPECT_EQ(all.message(),
            "execute: delete_arrays: arrays 7, 9 belong to other sessions; only their owners (or an admin "
            "credential) may delete them (the other 1 of the 3 arrays was deleted)");
  EXPECT_EQ(refused_deletions("DeleteArray", {7}, 0, 1).message(),
            "DeleteArray: array 7 belongs to another session; only its owner (or an admin credential) may delete it");
}

// After a restart, a session of the earlier incarnation is taken over on first use, and the
// buffers nobody adopts within a lease of their report are taken.
TEST(RegistrySessions, EarlierSessionsAreTakenOverAndUnadoptedOrphansLapse) {
  const absl::Time t0 = absl::Now();
  Registry before(absl::Seconds(3), t0, absl::Seconds(10));
  const uint64_t session = before.open_session(t0);
  Registry after(absl::Seconds(3), t0 + absl::Seconds(1), absl::Seconds(10));
  const absl::Time t1 = t0 + absl::Seconds(1);
  const std::map<uint64_t, HeldShard> held = {{before.ids().next(), {DType::kF32, {2}}},
                                              {before.ids().next(), {DType::kF32, {2}}}};
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(
        after.register_worker({absl::StrCat("w", i), absl::StrCat("h:", i), i, 1 << 20, before.epoch(), 1, held}, t1)
            .ok());
  }
  EXPECT_TRUE(after.renew_session(session, t1).ok());
  absl::StatusOr<Mesh> mesh = make_mesh({2}, {"x"}, {0, 1});
  ASSERT_TRUE(mesh.ok());
  ArrayRecord kept{held.begin()->first, DType::kF32, {4}, NamedSharding(*mesh, P("x")), {}, session};
  ASSERT_TRUE(after.adopt_array(kept).ok());
  EXPECT_TRUE(after.take_lapsed(t1 + absl::Seconds(9)).buffers.empty());
  ASSERT_TRUE(after.renew_session(session, t1 + absl::Seconds(9)).ok());
  Registry::Lapsed lapsed = after.take_lapsed(t1 + absl::Seconds(11));
  EXPECT_TRUE(lapsed.sessions.empty());
  EXPECT_EQ(lapsed.orphans, 1);
  EXPECT_THAT(lapsed.buffers[0], ElementsAre(std::next(held.begin())->first));
  EXPECT_TRUE(after.get_array(kept.id).ok());
}

// A worker that asks for any id gets the lowest free one, up to kMaxDeviceId (65,535): the
// 65,537th worker is refused RESOURCE_EXHAUSTED naming the limit, which the size bound of the
// workers' peer view assumes (docs/design.md); a worker already registered still registers
// again at the limit. (A walk of every device per registration made this test quadratic.)
TEST(RegistryLimits, TheDeviceAfterTheLastIdIsRefusedNamingTheLimit) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  Registry registry(absl::Seconds(3), t0);
  ASSERT_TRUE(registry.register_worker({"asked-7", "h:1", 7, 1 << 20, 0, 0, {}}, t0).ok());
  for (int i = 0; i < kMaxDeviceId; ++i) {  // every id but 7, lowest first
    absl::StatusOr<DeviceRecord> r = registry.register_worker({absl::StrCat("w", i), "h:1", -1, 1 << 20, 0, 0, {}}, t0);
    ASSERT_TRUE(r.ok()) << i << ": " << r.status();
    ASSERT_EQ(r->id, i < 7 ? i : i + 1) << i;
  }
  absl::StatusOr<DeviceRecord> refused = registry.register_worker({"one-too-many", "h:1", -1, 1 << 20, 0, 0, {}}, t0);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr(absl::StrCat("worker 'one-too-many': every device id from 0 to ", kMaxDeviceId,
                                     " is taken (the limit of a cluster's devices)")));
  absl::StatusOr<DeviceRecord> again = registry.register_worker({"w100", "h:2", -1, 1 << 20, 0, 0, {}}, t0);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->id, 101);
  EXPECT_EQ(again->address, "h:2");
  EXPECT_EQ(registry.devices().size(), static_cast<size_t>(kMaxDeviceId) + 1);
}

// Request limits (coordinator/request_limits.h): each refusal names the value and the rule.
TEST(RequestLimits, RunTimeoutsAreBoundedInsteadOfOverflowing) {
  EXPECT_EQ(*run_timeout("execute", 0), absl::Seconds(10));
  EXPECT_EQ(*run_timeout("execute", 2500), absl::Milliseconds(2500));
  absl::StatusOr<absl::Duration> huge = run_timeout("execute", int64_t{1} << 62);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(huge.status().message()),
              AllOf(HasSubstr("execute: timeout_ms 4611686018427387904"), HasSubstr("limit of 3600000")));
}

TEST(RequestLimits, RegistrationsNeedAnIdInRangeAndAHostAndPort) {
  EXPECT_TRUE(check_registration("worker-0", "127.0.0.1:4000", -1).ok());
  EXPECT_TRUE(check_registration("w", "tessera-workers-3.tessera-workers:5000", 3).ok());
  EXPECT_TRUE(check_registration("w", "[::1]:5000", 65535).ok());
  struct Case {
    std::string name, address;
    int64_t id;
    std::string error;
  };
  for (const Case& c : std::vector<Case>{
           {"w", "127.0.0.1:1", 2147483647,
            "requested device id 2147483647 is out of range (-1 for any, or 0 to 65535)"},
           {"w", "127.0.0.1:1", -2, "requested device id -2"},
           {"w", "not an address", 0, "has a space or a byte that is not printable ASCII"},
           {"w", "nocolon", 0, "address 'nocolon' is not host:port"},
           {"w", "host:0", 0, "is not host:port with a port from 1 to 65535"},
           {"w", "host:65536", 0, "is not host:port"},
           {"w", ":80", 0, "is not host:port"},
           {"w", "::1:80", 0, "an IPv6 host in brackets"},
           {"", "h:1", 0, "name is empty"},
           {std::string(256, 'n'), "h:1", 0, "(256 bytes) is longer than 255 bytes"},
       }) {
    SCOPED_TRACE(c.address);
    absl::Status s = check_registration(c.name, c.address, c.id);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.error));
  }
}

TEST(RequestLimits, CompileGraphsNeedAnOutputAndParametersInOrder) {
  pb::Graph graph;
  absl::Status empty = check_compile_graph(graph, 0);
  EXPECT_EQ(empty.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(empty.message()), HasSubstr("has 0 nodes and 0 outputs; a program needs an output"));
  pb::KernelNode* p = graph.add_nodes()->mutable_node();
  p->set_op(pb::OP_PARAMETER);
  p->mutable_parameter()->set_index(7);
  graph.add_outputs(0);
  absl::Status seven = check_compile_graph(graph, 1);
  EXPECT_EQ(seven.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(seven.message()), HasSubstr("graph node 0 is parameter index 7 but it is parameter 0"));
  p->mutable_parameter()->set_index(0);
  EXPECT_TRUE(check_compile_graph(graph, 1).ok());
  absl::Status specs = check_compile_graph(graph, 2);
  EXPECT_THAT(std::string(specs.message()),
              HasSubstr("the graph has 1 parameters but the request gives 2 input specs"));
}

}  // namespace
}  // namespace tessera
