// The template engine's evaluator: renders a parsed template (ast.h) with a
// context, with the semantics of jinja2's ImmutableSandboxedEnvironment as
// transformers sets it up. Jinja's scoping (a for loop's body gets a fresh
// scope each iteration, so a set inside a loop is gone after it; hence
// namespace()), the loop variable, break / continue, block set with filters,
// and the globals raise_exception(msg), strftime_now(fmt) (local time),
// range (at most kMaxRange items), dict and namespace. Internal to the
// template engine (common/text/jinja/, the renderer behind
// common/text/chat_template.h); other code uses ChatTemplate.
//
// Usage (chat_template.cc does this):
//   ASSIGN_OR_RETURN(std::vector<Node> body, ParseTemplate(source));
//   ASSIGN_OR_RETURN(Value context, FromJson(json_object));
//   ASSIGN_OR_RETURN(std::string text, Render(body, *context.dict));
//
// Threads: Render only reads `body` and `context`, so any number of threads
// may render one tree at once, with one context too if it holds no namespace
// or generator (FromJson's never do); the values a render makes are its own.
#ifndef KNAPSERVE_COMMON_TEXT_JINJA_EVALUATOR_H_
#define KNAPSERVE_COMMON_TEXT_JINJA_EVALUATOR_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/text/jinja/ast.h"
#include "common/text/jinja/value.h"

namespace knapserve::jinja {

// The text of `body` rendered with the variables of `context` (a name
// missing from it is undefined). Errors are InvalidArgument: exactly `msg`
// for raise_exception(msg); "line L: <what>" for any other (a type error,
// calling something that is not a function, an undefined value used in
// arithmetic, the output over kMaxOutputBytes, more than kMaxLoopIterations
// loop iterations in all).
absl::StatusOr<std::string> Render(const std::vector<Node>& body,
                                   const DictData& context);

}  // namespace knapserve::jinja

#endif  // KNAPSERVE_COMMON_TEXT_JINJA_EVALUATOR_H_
