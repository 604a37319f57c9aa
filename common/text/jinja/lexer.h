// The template engine's lexer: Jinja's (jinja2/lexer.py) with trim_blocks
// and lstrip_blocks, as transformers configures it. A template's source
// becomes template data and the tokens inside {{ }} and {% %} tags; comments
// go, {% raw %} bodies become data, whitespace control (- and +) is applied.
// Internal to the template engine (common/text/jinja/, the renderer behind
// common/text/chat_template.h); other code uses ChatTemplate.
//
// Usage (parser.h's ParseTemplate does this):
//   const std::string normalized = NormalizeNewlines(source);
//   const SourceMap map(normalized);
//   ASSIGN_OR_RETURN(std::vector<Token> tokens, Lex(normalized, map));
//
// Errors are InvalidArgument "line L, column C: <what>" (SourceMap::Error):
// "unterminated '{{' tag (no matching '}}')", "unexpected character '$'",
// "unterminated string literal", ... All functions are pure and safe from
// any thread; a SourceMap is immutable and may be shared.
#ifndef KNAPSERVE_COMMON_TEXT_JINJA_LEXER_H_
#define KNAPSERVE_COMMON_TEXT_JINJA_LEXER_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace knapserve::jinja {

enum class Tok {
  kData,        // Template text outside tags.
  kVarBegin,    // {{
  kVarEnd,      // }}
  kBlockBegin,  // {%
  kBlockEnd,    // %}
  kName,
  kString,
  kInt,
  kFloat,
  kOp,  // An operator or a bracket: + // == ( | . , ...
  kEof,
};

struct Token {
  Tok type = Tok::kEof;
  std::string text;  // Data, a name, a string's value, an operator.
  int64_t int_value = 0;
  double float_value = 0;
  size_t offset = 0;  // Where it starts in the (normalized) source.
};

// Line and column (1-based, in characters) of offsets in the source. Holds a
// view of `source`, which must outlive it.
class SourceMap {
 public:
  explicit SourceMap(std::string_view source);

  // The line of `offset`.
  int Line(size_t offset) const;

  // InvalidArgument "line L, column C: <what>" for `offset`.
  absl::Status Error(size_t offset, std::string_view what) const;

 private:
  std::string_view source_;
  std::vector<size_t> line_starts_;
};

// What Jinja's lexer does first: \r\n and \r become \n, and one trailing
// newline goes (keep_trailing_newline=False).
std::string NormalizeNewlines(std::string_view source);

// The tokens of `source` (normalized, valid UTF-8), ending with one kEof;
// `map` is `source`'s SourceMap, for the errors. Strings are unescaped as
// Python's unicode-escape codec does; numbers are Python's literals (with _
// separators, 0b / 0o / 0x), an int beyond int64 is an error. Brackets inside
// a tag must balance.
absl::StatusOr<std::vector<Token>> Lex(std::string_view source,
                                       const SourceMap& map);

}  // namespace knapserve::jinja

#endif  // KNAPSERVE_COMMON_TEXT_JINJA_LEXER_H_
