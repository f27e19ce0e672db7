// What every fuzz target asserts beyond "no crash": a decoder that rejects its input does so
// with one of the codes its caller expects and a message saying why, and an accepted value
// survives a round trip through its wire form. A broken rule aborts, which libFuzzer reports
// with the input that broke it.
#ifndef TESSERA_FUZZ_FUZZ_CHECK_H_
#define TESSERA_FUZZ_FUZZ_CHECK_H_

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <string>

#include "absl/status/status.h"
#include "google/protobuf/stubs/logging.h"

namespace tessera::fuzz {

inline void fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz check failed: %s: %s\n", what, detail.c_str());
  std::abort();
}

inline void check(bool ok, const char* what) {
  if (!ok) fail(what, "");
}

// A rejection names its reason and has one of `codes` (INVALID_ARGUMENT unless said).
inline void check_rejection(const absl::Status& status, const char* what,
                            std::initializer_list<absl::StatusCode> codes = {absl::StatusCode::kInvalidArgument}) {
  if (status.ok()) return;
  bool expected = false;
  for (absl::StatusCode c : codes) expected = expected || status.code() == c;
  if (!expected || status.message().empty()) fail(what, status.ToString());
}

// An input holding two messages: the first's length (2 bytes, little-endian, cut to what is
// there), the first, then the second. False when either does not parse.
template <typename First, typename Second>
bool parse_two(const uint8_t* data, size_t size, First& first, Second& second) {
  if (size < 2) return false;
  const size_t length = std::min<size_t>(data[0] | data[1] << 8, size - 2);
  return first.ParseFromArray(data + 2, static_cast<int>(length)) &&
         second.ParseFromArray(data + 2 + length, static_cast<int>(size - 2 - length));
}

}  // namespace tessera::fuzz

// Protobuf logs every string field that is not UTF-8; the fuzzer makes many.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

#endif  // TESSERA_FUZZ_FUZZ_CHECK_H_
