// core/daemon.h: device ids from the environment Kubernetes gives a pod.
#include "core/daemon.h"

#include <stdlib.h>
#include <unistd.h>

#include "core/open_mode.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

// Sets (or, for nullptr, unsets) a variable for one test and restores it after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    value != nullptr ? setenv(name, value, 1) : unsetenv(name);
  }
  ~ScopedEnv() { had_ ? setenv(name_, old_.c_str(), 1) : unsetenv(name_); }

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

TEST(DeviceIdFromEnvironment, OrdinalEndsTheStatefulSetPodName) {
  ScopedEnv pod("POD_NAME", "tessera-worker-13");
  absl::StatusOr<int> id = device_id_from_environment("ordinal");
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(*id, 13);
}

TEST(DeviceIdFromEnvironment, OrdinalFallsBackToTheHostName) {
  ScopedEnv pod("POD_NAME", nullptr);
  ScopedEnv host("HOSTNAME", "tessera-worker-0");
  absl::StatusOr<int> id = device_id_from_environment("ordinal");
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(*id, 0);
}

TEST(DeviceIdFromEnvironment, APodNameWithoutAnOrdinalIsNamed) {
  for (const char* name : {"tessera-worker", "tessera-worker-x7k2q", "tessera-worker-", "worker-+3", "w-99999999999"}) {
    ScopedEnv pod("POD_NAME", name);
    absl::StatusOr<int> id = device_id_from_environment("ordinal");
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_THAT(id.status().message(), HasSubstr(std::string("the pod name '") + name + "' does not end in '-N'"));
  }
}

TEST(DeviceIdFromEnvironment, JobIndexIsTheCompletionIndex) {
  {
    ScopedEnv index("JOB_COMPLETION_INDEX", "5");
    absl::StatusOr<int> id = device_id_from_environment("job_index");
    ASSERT_TRUE(id.ok()) << id.status();
    EXPECT_EQ(*id, 5);
  }
  for (const char* value : {static_cast<const char*>(nullptr), "", "-1", "five", "3.0"}) {
    ScopedEnv index("JOB_COMPLETION_INDEX", value);
    absl::StatusOr<int> id = device_id_from_environment("job_index");
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument) << (value ? value : "(unset)");
    EXPECT_THAT(id.status().message(), HasSubstr("$JOB_COMPLETION_INDEX='"));
    EXPECT_THAT(id.status().message(), HasSubstr("is not a device id"));
  }
}

TEST(DeviceIdFromEnvironment, AnUnknownSourceIsNamed) {
  absl::StatusOr<int> id = device_id_from_environment("pod_index");
  EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(id.status().message(), HasSubstr("'pod_index' is neither 'ordinal' nor 'job_index'"));
}

// Plaintext is for loopback only (core/open_mode.h): an address, parsed, not a prefix of a name.
TEST(OpenMode, LoopbackIsAnAddressOrLocalhostNotANamesPrefix) {
  for (const char* host : {"127.0.0.1", "127.3.4.5", "localhost", "::1", "[::1]", "0:0:0:0:0:0:0:1"}) {
    EXPECT_TRUE(is_loopback_host(host)) << host;
  }
  for (const char* host : {"0.0.0.0", "10.0.0.1", "127.x.example", "127.0.0.1.example", "::", "worker-0", "",
                           "128.0.0.1", "::ffff:10.0.0.1"}) {
    EXPECT_FALSE(is_loopback_host(host)) << host;
  }
  const Credentials none;
  EXPECT_TRUE(check_open_mode(none, "127.0.0.1", false, "d").ok());
  EXPECT_TRUE(check_open_mode(none, "0.0.0.0", true, "d").ok());
  const absl::Status refused = check_open_mode(none, "127.x.example", false, "tessera-worker");
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(refused.message()),
              HasSubstr("tessera-worker: no --credentials, and it would listen on 127.x.example, which is not a "
                        "loopback address"));
}

}  // namespace
}  // namespace tessera
