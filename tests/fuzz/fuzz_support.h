// Helpers shared by the fuzz targets in tests/fuzz/.
//
// Each fuzz_<name>.cc defines libFuzzer's entry point
// LLVMFuzzerTestOneInput(data, size) for one parser that takes untrusted
// bytes. The same source builds two ways:
//   - with clang's -fsanitize=fuzzer (tools/fuzz.sh, build-fuzz/): a real
//     coverage-guided fuzzer under ASan and UBSan;
//   - with the normal compiler and replay_main.cc (the test suite): a program
//     that runs every file of the generated seed corpus and of
//     tests/fuzz/regressions/<name>/ through the entry point once, so an input
//     that once crashed stays a test.
//
// A target returns normally for any input the parser refuses with a status
// (that is the parser doing its job). It aborts through FUZZ_CHECK when a
// property of the parser's contract breaks: an accepted input that does not
// round-trip, an error without a message, a view past the end of the data.
// libFuzzer records an abort as a crash, like a sanitizer report.
//
// Everything here runs on the fuzzer's one thread.
#ifndef KNAPSERVE_TESTS_FUZZ_FUZZ_SUPPORT_H_
#define KNAPSERVE_TESTS_FUZZ_FUZZ_SUPPORT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"

// Aborts with the file, line and condition when `condition` is false.
#define FUZZ_CHECK(condition)                                      \
  do {                                                             \
    if (!(condition))                                              \
      ::knapserve::fuzz::Fail(__FILE__, __LINE__, #condition, ""); \
  } while (false)

// The same with a message (a status, a value) printed after the condition.
#define FUZZ_CHECK_MSG(condition, message)                                \
  do {                                                                    \
    if (!(condition))                                                     \
      ::knapserve::fuzz::Fail(__FILE__, __LINE__, #condition, (message)); \
  } while (false)

namespace knapserve {
class LlamaModel;
class Tokenizer;
}  // namespace knapserve

namespace knapserve::fuzz {

// Prints "FUZZ_CHECK failed at FILE:LINE: CONDITION MESSAGE" and aborts.
[[noreturn]] void Fail(const char* file, int line, const char* condition,
                       std::string_view message);

// The input as text.
inline std::string_view AsText(const uint8_t* data, size_t size) {
  return std::string_view(reinterpret_cast<const char*>(data), size);
}

// Checks what every refusal owes the caller: a non-OK code and a message
// that says what was wrong.
void CheckRefusal(const absl::Status& status);

// A path for a scratch file of this process (under $TMPDIR, or /tmp), named
// with the process id and `name`, so parallel fuzzers do not share one. The
// file is removed when the process exits normally. Call from the fuzzing
// thread only.
std::string ScratchPath(std::string_view name);

// Writes `size` bytes to `path`, replacing it; aborts if it cannot.
void WriteScratchFile(const std::string& path, const uint8_t* data,
                      size_t size);

// The shared data folder (tools/shared_data.h's rule: $KNAPSERVE_SHARED, else
// ../shared) + "/" + relative.
std::string SharedFile(std::string_view relative);

// The shared data's stories260k model (fp32, CPU) and its tokenizer, loaded
// on first use and kept for the process. Exit 2 with a message naming
// KNAPSERVE_SHARED when they cannot be loaded: that is a set-up error, not a
// finding.
const LlamaModel& Stories260k();
const Tokenizer& Stories260kTokenizer();
// The tokenizer.json at SharedFile(relative), loaded once per path and kept;
// exit 2 as above when it cannot be loaded.
const Tokenizer& SharedTokenizer(std::string_view relative);

// Drops protobuf's log lines (a string field with invalid UTF-8 is logged
// at every parse, and the parse is meant to fail).
void SilenceProtobufLogs();

// Torch's intra-op threads to one, as the fuzzer is single-threaded and a
// thread pool per input would dominate the run time.
void UseOneTorchThread();

}  // namespace knapserve::fuzz

#endif  // KNAPSERVE_TESTS_FUZZ_FUZZ_SUPPORT_H_
