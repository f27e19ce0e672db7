// Matchers for compiled programs and statuses, so tests assert structure and codes instead of
// text with slot numbers (XLA's partitioner tests match the structure of the result).
//
//   EXPECT_THAT(collectives_of(exe), ElementsAre(IsCollective(CollectiveKind::kAllGather, {"data"},
//                                                             /*of_value=*/1, /*bytes=*/384)));
//   EXPECT_THAT(collectives_of(exe), Contains(IsCollective(CollectiveKind::kAllReduce, {"model"})));
//   EXPECT_THAT(f(...).status(), StatusIs(absl::StatusCode::kInvalidArgument, "not divisible"));
#ifndef TESSERA_TESTS_SUPPORT_PLAN_MATCHERS_H_
#define TESSERA_TESTS_SUPPORT_PLAN_MATCHERS_H_

#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_join.h"
#include "coordinator/compiler/partition.h"
#include "core/plan.h"
#include "gmock/gmock.h"

namespace tessera::testing {

// One collective of a program: what runs, over which mesh axes (empty for a permute between
// layouts), on which graph value, and the bytes a device receives for it.
struct CollectiveInfo {
  CollectiveKind kind;
  std::vector<std::string> axes;
  int value = -1;  // the graph node whose value it moves
  int64_t bytes = 0;
  std::string cause;
};

inline std::ostream& operator<<(std::ostream& os, const CollectiveInfo& c) {
  return os << collective_name(c.kind) << "(axes=" << absl::StrJoin(c.axes, ",") << ") of %" << c.value << ", "
            << c.bytes << " B/device; " << c.cause;
}

// The program's last loop instruction (top level), or null.
inline const Instruction* the_loop(const DevicePlan& plan) {
  const Instruction* found = nullptr;
  for (const Instruction& i : plan.code) {
    if (i.kind == Instruction::Kind::kLoop) found = &i;
  }
  return found;
}

// How many collective instructions the program has at its top level (a loop's body is a
// program of its own).
inline int collectives(const DevicePlan& plan) {
  int n = 0;
  for (const Instruction& i : plan.code) n += i.kind == Instruction::Kind::kCollective ? 1 : 0;
  return n;
}

// The program's collectives, in order.
inline std::vector<CollectiveInfo> collectives_of(const Executable& exe) {
  std::vector<CollectiveInfo> out;
  for (const Instruction& i : exe.program.code) {
    if (i.kind != Instruction::Kind::kCollective) continue;
    out.push_back({i.collective.kind, i.axes, i.value, collective_bytes_per_device(i, exe.mesh), i.cause});
  }
  return out;
}

// The replica groups of each collective of `exe`, in order, as device `device` resolves the
// program (core/plan.h's resolve); empty, with a failure recorded, when it cannot.
inline std::vector<std::vector<std::vector<int>>> resolved_groups(const Executable& exe, int device) {
  std::vector<std::vector<std::vector<int>>> out;
  absl::StatusOr<DevicePlan> plan = resolve(exe.program, exe.mesh, device);
  if (!plan.ok()) {
    ADD_FAILURE() << "device " << device << " cannot resolve the program: " << plan.status();
    return out;
  }
  for (const Instruction& i : plan->code) {
    if (i.kind == Instruction::Kind::kCollective) out.push_back(i.collective.groups);
  }
  return out;
}

inline void PrintTo(const CollectiveInfo& c, std::ostream* os) { *os << c; }

MATCHER_P4(IsCollectiveMatcher, kind, axes, of_value, bytes, "") {
  *result_listener << "is " << ::testing::PrintToString(arg);
  return arg.kind == kind && arg.axes == axes && (of_value < 0 || arg.value == of_value) &&
         (bytes < 0 || arg.bytes == bytes);
}
// A collective of `kind` over `axes`; of graph value `of_value` and moving `bytes` per device
// unless those are -1.
inline auto IsCollective(CollectiveKind kind, std::vector<std::string> axes, int of_value = -1, int64_t bytes = -1) {
  return IsCollectiveMatcher(kind, std::move(axes), of_value, bytes);
}

// An absl::Status (or StatusOr's status()) with `code` whose message contains `part`.
MATCHER_P2(StatusIs, code, part, "") {
  const absl::Status& s = arg;
  *result_listener << "status is " << s;
  return s.code() == code && std::string(s.message()).find(part) != std::string::npos;
}

}  // namespace tessera::testing

#endif  // TESSERA_TESTS_SUPPORT_PLAN_MATCHERS_H_
