// Arguments of the functions, methods, filters and tests a template calls,
// and binding them to parameters as Python does. Internal to the template
// engine (common/text/jinja/, the renderer behind
// common/text/chat_template.h); other code uses ChatTemplate.
//
// Every function is pure and safe to call from any thread. Errors are the
// engine's unlocated InvalidArgument problems (errors.h), worded after
// Python's TypeError messages and naming the callee ("the filter 'join' got
// an unexpected keyword argument 'x'").
#ifndef KNAPSERVE_COMMON_TEXT_JINJA_ARGS_H_
#define KNAPSERVE_COMMON_TEXT_JINJA_ARGS_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/text/jinja/value.h"

namespace knapserve::jinja {

// Arguments of a call, a filter or a test, evaluated: the positional ones in
// order, then the keyword ones in the order written. A filter's or a test's
// subject is not among them.
struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
};

// Binds `args` to the parameters `names` (the first `required` of them must
// be given), as Python binds a call's arguments: one slot per name, nullopt
// where none was given. `what` names the callee in the errors (too many
// arguments, an unknown or repeated keyword, a missing required one).
absl::StatusOr<std::vector<std::optional<Value>>> Bind(
    std::string_view what, const Args& args,
    const std::vector<std::string_view>& names, size_t required);

// An optional argument that is absent or None.
bool IsNone(const std::optional<Value>& v);

// `v` as an int (a bool counts), else a problem "<what> must be an integer,
// not '<type>'".
absl::StatusOr<int64_t> IntArg(std::string_view what, const Value& v);
// `v` as a str, else a problem "<what> must be a string, not '<type>'".
absl::StatusOr<std::string> StrArg(std::string_view what, const Value& v);

// Whether `name` is one of `set`.
bool Among(std::string_view name, std::initializer_list<std::string_view> set);

}  // namespace knapserve::jinja

#endif  // KNAPSERVE_COMMON_TEXT_JINJA_ARGS_H_
