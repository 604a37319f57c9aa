// The template engine's error conventions and the limits that bound its
// work. Internal to the template engine (common/text/jinja/, the renderer
// behind common/text/chat_template.h); other code uses ChatTemplate.
//
// How errors travel inside the engine (all absl::Status, never exceptions):
//  - kInvalidArgument: a problem not yet located (helpers such as Arith or a
//    filter do not know the line); the evaluator's Eval / Exec of the node it
//    happened in adds "line L: " (AtLine) and turns it into
//  - kFailedPrecondition: located, passed up unchanged;
//  - kAborted: raise_exception(msg), passed up unchanged.
// What leaves the engine is InvalidArgument only: ParseTemplate (parser.h)
// gives "line L, column C: <what>", Render (evaluator.h) "line L: <what>" or
// exactly the message of raise_exception; chat_template.cc prefixes "chat
// template: ".
//
// The limits keep hostile templates and contexts from crashing the server:
// past one, the error names the limit. Everything here is a constant or a
// pure function, safe to call from any thread.
#ifndef KNAPSERVE_COMMON_TEXT_JINJA_ERRORS_H_
#define KNAPSERVE_COMMON_TEXT_JINJA_ERRORS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace knapserve::jinja {

// The largest output, and the largest string a template may build: 16 MiB
// (ChatTemplate::kMaxOutputBytes, which chat_template.cc checks is the same).
inline constexpr size_t kMaxOutputBytes = size_t{16} << 20;
// Loop iterations one render may run, all loops together
// (ChatTemplate::kMaxLoopIterations).
inline constexpr int64_t kMaxLoopIterations = 100'000;
// The bytes of all the strings one render's expressions may yield, all
// together: 16 x kMaxOutputBytes, 256 MiB (ChatTemplate::kMaxStringBytes).
// Values are copied when read, so a loop that reads or extends a large
// string does work in proportion to it each iteration; this bounds the time
// such a template can take where kMaxLoopIterations alone would not.
inline constexpr uint64_t kMaxStringBytes = uint64_t{16} * kMaxOutputBytes;
// Nesting limits: blocks inside blocks and the depth of an expression's tree
// (both bound the recursion of the parser and the renderer), and the depth of
// lists and dicts (bounds repr, tojson and comparisons).
inline constexpr int kMaxBlockDepth = 100;
inline constexpr int kMaxExprDepth = 100;
inline constexpr int kMaxValueDepth = 256;
// jinja2.sandbox.MAX_RANGE.
inline constexpr int64_t kMaxRange = 100000;
// The longest list `list * n` may make.
inline constexpr size_t kMaxListItems = 1000000;

// An unlocated problem (kInvalidArgument, see above).
inline absl::Status Problem(std::string what) {
  return absl::InvalidArgumentError(what);
}

// `status` located at `line`: an unlocated problem becomes kFailedPrecondition
// "line L: <what>"; any other status (OK included) is returned unchanged.
inline absl::Status AtLine(int line, const absl::Status& status) {
  if (status.code() != absl::StatusCode::kInvalidArgument) return status;
  return absl::FailedPreconditionError(
      absl::StrCat("line ", line, ": ", status.message()));
}

// Debian's Abseil has its own string_view type; StrCat needs it.
inline absl::string_view Sv(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

// The message of an output (or string) over kMaxOutputBytes.
inline std::string OutputTooLarge() {
  return absl::StrCat("the output would be larger than ", kMaxOutputBytes >> 20,
                      " MiB");
}

// A problem when `size` (of an output or a string) is over kMaxOutputBytes.
inline absl::Status CheckSize(size_t size) {
  if (size > kMaxOutputBytes) return Problem(OutputTooLarge());
  return absl::OkStatus();
}

}  // namespace knapserve::jinja

#endif  // KNAPSERVE_COMMON_TEXT_JINJA_ERRORS_H_
