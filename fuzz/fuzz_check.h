// What every fuzz target asserts beyond "no crash": a decoder that rejects its input does so
// with one of the codes its caller expects and a message saying why, and an accepted value
// survives a round trip through its wire form. A broken rule aborts, which libFuzzer reports
// with the input that broke it.
#ifndef TESSERA_FUZZ_FUZZ_CHECK_H_
#define TESSERA_FUZZ_FUZZ_CHECK_H_

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

}  // namespace tessera::fuzz

// Protobuf logs every string field that is not UTF-8; the fuzzer makes many.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

#endif  // TESSERA_FUZZ_FUZZ_CHECK_H_
