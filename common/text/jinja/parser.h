// The template engine's parser: Jinja's grammar (jinja2/parser.py), function
// for function, for the statements and expressions chat templates use (see
// common/text/chat_template.h for the subset). Internal to the template
// engine (common/text/jinja/, the renderer behind
// common/text/chat_template.h); other code uses ChatTemplate.
//
// Errors are InvalidArgument "line L, column C: <what>" (no "chat template:"
// prefix; chat_template.cc adds it): a syntax error ("expected 'in', got
// end of statement block ('%}')"), a construct outside the subset ("{% macro
// %} is not supported", "unknown filter 'foo'"), or nesting past
// kMaxBlockDepth / kMaxExprDepth. Filter and test names are checked here, as
// Jinja checks them when it compiles a template.
//
// The functions are pure and safe to call from any thread; the tree they
// return belongs to the caller (see ast.h).
#ifndef KNAPSERVE_COMMON_TEXT_JINJA_PARSER_H_
#define KNAPSERVE_COMMON_TEXT_JINJA_PARSER_H_

#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/text/jinja/ast.h"
#include "common/text/jinja/lexer.h"

namespace knapserve::jinja {

// The template `source`: checks that it is valid UTF-8, normalizes its
// newlines, lexes and parses it.
absl::StatusOr<std::vector<Node>> ParseTemplate(std::string_view source);

// The template whose tokens (Lex's, ending with kEof) are `tokens`; `map` is
// the SourceMap of the source they came from.
absl::StatusOr<std::vector<Node>> ParseTokens(const std::vector<Token>& tokens,
                                              const SourceMap& map);

}  // namespace knapserve::jinja

#endif  // KNAPSERVE_COMMON_TEXT_JINJA_PARSER_H_
