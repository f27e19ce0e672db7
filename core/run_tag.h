// A run tag: 64 random bits that every Exchange message of a run's collectives carries, so
// that a worker files a message for a run only if its sender was told the tag. Op ids are a
// counter anyone can predict; a run tag is not. The coordinator draws one per execution,
// RunCollective and reshard (RunPlanRequest, WorkerCollectiveRequest, WorkerReshardRequest
// .run_tag); a client draws one per replicated put's fan-out (ShardFanOut.run_tag).
//
//   pb::RunPlanRequest r;
//   r.set_run_tag(random_run_tag());  // never 0: 0 is no tag, which workers refuse
#ifndef TESSERA_CORE_RUN_TAG_H_
#define TESSERA_CORE_RUN_TAG_H_

#include <sys/random.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace tessera {

// 64 bits of the kernel's CSPRNG, as core/shm_transfer.cc draws a segment's token. 0 is no tag:
// it is drawn again. getrandom(2) of 8 bytes does not fail once the pool is initialised (it
// waits until then) and is not cut short by signals; any other outcome aborts, naming it: no
// run may go untagged.
inline uint64_t random_run_tag() {
  uint64_t tag = 0;
  ssize_t got;
  do {
    got = getrandom(&tag, sizeof tag, 0);
  } while ((got < 0 && errno == EINTR) || (got == static_cast<ssize_t>(sizeof tag) && tag == 0));
  if (got != static_cast<ssize_t>(sizeof tag)) {
    std::fprintf(stderr, "tessera: getrandom for a run tag returned %zd: %s\n", got,
                 got < 0 ? std::strerror(errno) : "short read");
    std::abort();
  }
  return tag;
}

// A worker's refusal of a request that would run collectives under run tag 0 (no tag, which
// would take anyone's messages at the predictable op ids): INVALID_ARGUMENT naming `place`
// (the request and its op, execution or buffer) and `field`, the request's run tag field.
//
//   if (req.run_tag() == 0) return run_tag_0_refusal("Reshard of op 7", "WorkerReshardRequest.run_tag");
//   // "Reshard of op 7: WorkerReshardRequest.run_tag is 0; a run with collectives needs a random
//   //  nonzero run tag (protocol version 29)"
inline absl::Status run_tag_0_refusal(absl::string_view place, absl::string_view field) {
  return absl::InvalidArgumentError(absl::StrCat(
      place, ": ", field, " is 0; a run with collectives needs a random nonzero run tag (protocol version 29)"));
}

}  // namespace tessera

#endif  // TESSERA_CORE_RUN_TAG_H_
