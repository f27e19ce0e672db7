// WorkerDevice: the device id this worker holds (the coordinator's answer to its last
// registration), which every part of the worker reads to name itself in errors.
//
// No lock: the id is an atomic, set by registration and read anywhere.
//
//   WorkerDevice device;
//   device.set(3);
//   return device.name_in(status);   // "device 3: <message>"
#ifndef TESSERA_WORKER_DEVICE_H_
#define TESSERA_WORKER_DEVICE_H_

#include <atomic>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tessera {

class WorkerDevice {
 public:
  int id() const { return id_.load(); }
  void set(int id) { id_ = id; }

  // "device N: " before an error's message.
  absl::Status name_in(const absl::Status& status) const {
    if (status.ok()) return status;
    return absl::Status(status.code(), absl::StrCat("device ", id_.load(), ": ", status.message()));
  }

 private:
  std::atomic<int> id_{-1};
};

}  // namespace tessera

#endif  // TESSERA_WORKER_DEVICE_H_
