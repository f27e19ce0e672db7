// docs/guide.md cannot drift from the API: every ```cpp block of it is compiled (by
// extract_guide.cmake into guide_blocks.cc) and run here against one Client::local(8) with a
// (4, 2) ("data", "model") mesh, and must succeed; a block followed by a ```text output block
// must print exactly that (a line "..." standing for any number of lines, and "..." within a
// line for any text).
#include <stdlib.h>
#include <unistd.h>

#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/credentials.h"
#include "gtest/gtest.h"
#include "tests/docs/guide_blocks.h"
#include "tests/integration/jit_support.h"

namespace tessera::guide {
namespace {

// Whether `line` matches `pattern`, where "..." in the pattern matches any text.
bool line_matches(absl::string_view pattern, absl::string_view line) {
  const size_t dots = pattern.find("...");
  if (dots == absl::string_view::npos) return pattern == line;
  if (line.substr(0, dots) != pattern.substr(0, dots)) return false;
  const absl::string_view rest = pattern.substr(dots + 3);
  for (size_t i = dots; i <= line.size(); ++i) {
    if (line_matches(rest, line.substr(i))) return true;
  }
  return false;
}

// Whether `lines` from `i` match `pattern` from `p`, where a pattern line "..." matches any
// number of lines.
bool lines_match(const std::vector<std::string>& pattern, size_t p, const std::vector<std::string>& lines, size_t i) {
  if (p == pattern.size()) return i == lines.size();
  if (pattern[p] == "...") {
    for (size_t j = i; j <= lines.size(); ++j) {
      if (lines_match(pattern, p + 1, lines, j)) return true;
    }
    return false;
  }
  return i < lines.size() && line_matches(pattern[p], lines[i]) && lines_match(pattern, p + 1, lines, i + 1);
}

bool output_matches(const std::string& expected, const std::string& got) {
  return lines_match(absl::StrSplit(expected, '\n'), 0, absl::StrSplit(got, '\n'), 0);
}

// Captures std::cout while alive.
class CaptureStdout {
 public:
  CaptureStdout() : old_(std::cout.rdbuf(captured_.rdbuf())) {}
  ~CaptureStdout() { std::cout.rdbuf(old_); }
  std::string text() const { return captured_.str(); }

 private:
  std::ostringstream captured_;
  std::streambuf* old_;
};

class GuideTest : public jit_support::LocalSuite<::testing::TestWithParam<size_t>> {
 protected:
  // The guide's cluster takes its tokens from a directory, and $TESSERA_TOKEN_FILE names the
  // client token (as `tessera run-example` sets it), which the guide's Client::connect reads.
  static void SetUpTestSuite() {
    const std::string dir = absl::StrCat(::testing::TempDir(), "/guide-credentials-", getpid());
    absl::StatusOr<Credentials> credentials = generate_credentials();
    ASSERT_TRUE(credentials.ok());
    ASSERT_TRUE(write_credentials(dir, *credentials).ok());
    setenv("TESSERA_TOKEN_FILE", absl::StrCat(dir, "/", kClientTokenFile).c_str(), 1);
    LocalOptions options;
    options.credentials_dir = dir;
    start_cluster(options);
  }
};

TEST(Guide, HasBlocks) { EXPECT_GE(blocks().size(), 10u); }

TEST(Guide, OutputPatternsMatchAsDocumented) {
  EXPECT_TRUE(output_matches("a\n...\nd\n", "a\nb\nc\nd\n"));
  EXPECT_TRUE(output_matches("a\n...\nd\n", "a\nd\n"));
  EXPECT_FALSE(output_matches("a\nd\n", "a\nb\nd\n"));
  EXPECT_FALSE(output_matches("a\n...\nd\n", "a\nb\nd\nx\n"));
  EXPECT_TRUE(output_matches("port ...: buffer ... needs 8\n", "port 127.0.0.1:4242: buffer 77 needs 8\n"));
  EXPECT_FALSE(output_matches("port ...: needs 8\n", "port 4242: needs 9\n"));
}

TEST_P(GuideTest, BlockRuns) {
  ASSERT_NE(client_, nullptr);
  const Block& block = blocks()[GetParam()];
  SCOPED_TRACE(::testing::Message() << "docs/guide.md:" << block.line);
  absl::Status status;
  std::string printed;
  {
    CaptureStdout capture;
    status = block.run(*client_, *mesh_);
    printed = capture.text();
  }
  EXPECT_TRUE(status.ok()) << status;
  if (block.expected_output != nullptr) {
    EXPECT_TRUE(output_matches(block.expected_output, printed)) << "printed:\n"
                                                                << printed << "\nexpected (the ```text output block):\n"
                                                                << block.expected_output;
  }
}

INSTANTIATE_TEST_SUITE_P(Blocks, GuideTest, ::testing::Range<size_t>(0, blocks().size()),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           return "line_" + std::to_string(blocks()[info.param].line);
                         });

}  // namespace
}  // namespace tessera::guide
