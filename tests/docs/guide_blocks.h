// The code blocks of docs/guide.md, as tests/docs/extract_guide.cmake extracts them into
// guide_blocks.cc (generated in the build tree), for guide_test to run.
//
//   for (const guide::Block& b : guide::blocks()) {
//     absl::Status s = b.run(client, mesh);   // docs/guide.md, the block at line b.line
//   }
#ifndef TESSERA_TESTS_DOCS_GUIDE_BLOCKS_H_
#define TESSERA_TESTS_DOCS_GUIDE_BLOCKS_H_

#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tessera/tessera.h"

namespace tessera::guide {

struct Block {
  int line = 0;  // of the block's opening fence in docs/guide.md
  // Runs the block: a snippet with the suite's client and mesh; a program's main (which
  // ignores both) as an error unless it returns 0.
  std::function<absl::Status(const Client& client, const Mesh& mesh)> run;
  // What the block must print to std::cout (the ```text output block after it), or null.
  const char* expected_output = nullptr;
};

// Every ```cpp block of the guide, in order.
const std::vector<Block>& blocks();

inline absl::Status main_status(int code) {
  return code == 0 ? absl::OkStatus() : absl::InternalError(absl::StrCat("main returned ", code));
}
inline absl::Status run_main(int (*main)()) { return main_status(main()); }
inline absl::Status run_main(int (*main)(int, char**)) {
  char name[] = "guide_program";
  char* argv[] = {name, nullptr};
  return main_status(main(1, argv));
}

}  // namespace tessera::guide

#endif  // TESSERA_TESTS_DOCS_GUIDE_BLOCKS_H_
