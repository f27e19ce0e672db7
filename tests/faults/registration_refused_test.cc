// A worker whose registration again is refused, driven through its Registration against a real
// coordinator process (docs/design.md, "Held sends end with the attempt"): before every
// RegisterWorker the worker holds its collective sends (Transport::begin_registration); a
// refused attempt ends the hold (Transport::end_registration), and the held send goes on under
// the registration declared before, which the peer (a real worker process) refuses to take,
// naming the rule: the op fails with the peer's PERMISSION_DENIED, within its deadline, and
// nothing waits for a registration that will not come. TransportRegistration.* (worker_units_test)
// checks end_registration called directly; here the Registration's own refused RegisterWorker
// calls it. Every wait has a deadline; teardown kills only this test's processes, by pid.
#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/auth.h"
#include "proto/health.h"
#include "tessera/tessera.h"
#include "tests/faults/fault_cluster.h"
#include "worker/buffer_store.h"
#include "worker/collectives/transport.h"
#include "worker/plan_store.h"
#include "worker/registration.h"

namespace tessera {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

class RegistrationRefusedTest : public FaultClusterTest {};

// A worker of this process (device 7, name "first") registers; the coordinator restarts, and
// another worker ("usurper") registers as device 7 with the new one before the first's
// heartbeats begin. The first's heartbeat is then refused (another epoch) and it registers
// again: the coordinator refuses, ALREADY_EXISTS ("device id 7 is taken by worker
// 'usurper'"). A collective send of the first, begun while that RegisterWorker was out, is
// held; the refusal releases it under the first's old registration (coordinator epoch before
// the restart), which worker 0 (a real process, registered with the new coordinator) refuses,
// so the op's receive fails PERMISSION_DENIED naming the earlier epoch, not DEADLINE_EXCEEDED
// at the op's deadline. Before session 31 the send waited for its whole deadline.
TEST_F(RegistrationRefusedTest, AHeldSendGoesOnUnderTheOldRegistrationAndTheOpFailsWithThePeersReason) {
  absl::StatusOr<Client> client = connect();  // every device alive
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<std::vector<Device>> devices = client->devices();
  ASSERT_TRUE(devices.ok()) << devices.status();
  const std::string worker0 = (*devices)[0].address;

  constexpr int kDevice = 7;
  constexpr uint64_t kOp = uint64_t{1} << 40;
  const absl::Duration kOpTimeout = absl::Seconds(20);
  WorkerOptions options;
  options.coordinator_address = cluster_.address;
  options.device_id = kDevice;
  options.name = "first";
  options.credentials = credentials_;
  options.register_timeout = absl::Seconds(20);
  Transport transport(credentials_);
  BufferStore store(int64_t{1} << 20);
  PlanStore plans(16);
  HealthService health;
  std::atomic<int> registrations{0};
  absl::Mutex mu;
  std::vector<bool> attempts;         // registering(true / false), in order
  std::optional<std::thread> sender;  // the held send, begun at the second attempt
  std::optional<absl::Status> sent;   // its result
  bool held = false;                  // the send was held while the RegisterWorker was out
  absl::Cleanup join_sender = [&] {
    if (sender.has_value() && sender->joinable()) sender->join();
  };
  absl::Time op_start;
  const std::byte data[4] = {std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}};
  auto registering = [&](bool begins) {
    begins ? transport.begin_registration() : transport.end_registration();
    absl::MutexLock lock(&mu);
    attempts.push_back(begins);
    if (!begins || attempts.size() != 2) return;  // the first is start()'s (it succeeded: no `false`)
    // The registration again: a run's send to worker 0 begins now and is held (the
    // RegisterWorker is sent when this returns).
    op_start = absl::Now();
    sender.emplace([&] {
      absl::Status s = transport.send(0, worker0, {kOp, 0, 0, 0}, data, 4, op_start + kOpTimeout);
      absl::MutexLock l(&mu);
      sent = s;
    });
    held = poll_until([&] { return transport.held_sends() == 1; }, absl::Seconds(20));
  };
  Registration first(
      options, daemon_identity(credentials_), &store, &plans, &health,
      [&](int id, uint64_t epoch, uint64_t incarnation) {
        transport.set_self(id);
        transport.declare(epoch, incarnation);
        ++registrations;
      },
      [] {}, nullptr, registering);
  ASSERT_TRUE(first.start("127.0.0.1:1").ok());
  ASSERT_EQ(registrations.load(), 1);

  ASSERT_NO_FATAL_FAILURE(restart_coordinator());
  WorkerOptions usurper_options = options;
  usurper_options.name = "usurper";
  BufferStore usurper_store(int64_t{1} << 20);
  PlanStore usurper_plans(16);
  HealthService usurper_health;
  Registration usurper(usurper_options, daemon_identity(credentials_), &usurper_store, &usurper_plans, &usurper_health,
                       [](int, uint64_t, uint64_t) {});
  ASSERT_TRUE(usurper.start("127.0.0.1:2").ok());
  usurper.start_heartbeats();
  // Every device alive with the new coordinator (connect waits for it): worker 0 registered with
  // it, so it takes streams of its epoch only.
  ASSERT_TRUE(connect().ok());

  first.start_heartbeats();  // refused (another epoch): registers again, refused
  {
    absl::MutexLock lock(&mu);
    const auto refused = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return attempts.size() >= 3 && sent.has_value(); };
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&refused), absl::Seconds(30)))
        << "attempts: " << attempts.size() << ", send ended: " << sent.has_value();
    EXPECT_EQ(attempts[1], true);
    ASSERT_TRUE(held) << "the send was not held during the registration again (held_sends() never 1)";
    EXPECT_EQ(attempts[2], false);  // refused: the hold ended
    // The send went on (under the old registration) rather than waiting for its deadline.
    EXPECT_TRUE(sent->ok() || sent->code() == absl::StatusCode::kPermissionDenied) << *sent;
  }
  EXPECT_EQ(registrations.load(), 1) << "the registration again was not refused";
  EXPECT_EQ(transport.held_sends(), 0);
  // Worker 0 ends the stream declaring the old registration: the op fails with its reason (the
  // send's own error if the refusal came before its message was queued, else the op's wait's).
  absl::Status op_error;
  {
    absl::MutexLock lock(&mu);
    op_error = *sent;
  }
  if (op_error.ok()) {
    op_error = transport.receive(0, worker0, {kOp, 0, 0, 0}, op_start, op_start + kOpTimeout).status();
  }
  EXPECT_EQ(op_error.code(), absl::StatusCode::kPermissionDenied) << op_error;
  EXPECT_THAT(std::string(op_error.message()),
              AllOf(HasSubstr(absl::StrCat("device ", kDevice)), HasSubstr("an earlier coordinator epoch")));
  first.stop();
  usurper.stop();
}

}  // namespace
}  // namespace tessera
