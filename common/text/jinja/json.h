// JSON in and out of the template engine's values: the render context (a
// JSON object) as Values, and json.dumps of a Value for the tojson filter.
// Internal to the template engine (common/text/jinja/, the renderer behind
// common/text/chat_template.h); other code uses ChatTemplate.
//
// Every function is pure and safe to call from any thread; the Values made
// are new and belong to the caller. Errors are the engine's unlocated
// InvalidArgument problems (errors.h).
#ifndef KNAPSERVE_COMMON_TEXT_JINJA_JSON_H_
#define KNAPSERVE_COMMON_TEXT_JINJA_JSON_H_

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/text/jinja/value.h"
#include "nlohmann/json.hpp"

namespace knapserve::jinja {

// `j` as a Value: null, booleans, numbers, strings, arrays as lists, objects
// as dicts in the order of `j`'s keys (nlohmann::json sorts them;
// ordered_json keeps a client's order). A problem for an integer beyond
// int64, a string or key that is not valid UTF-8, or nesting deeper than
// kMaxValueDepth.
absl::StatusOr<Value> FromJson(const nlohmann::json& j);
absl::StatusOr<Value> FromJson(const nlohmann::ordered_json& j);

// json.dumps's options, as Hugging Face's tojson filter passes them.
struct JsonStyle {
  bool ensure_ascii = false;
  std::optional<std::string> indent;  // None: all on one line.
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};

// json.dumps(v, ...) appended to `out`, `level` the indentation level `v`
// starts at (0 at the top). Floats as Python prints them (NaN, Infinity);
// tuples as arrays. A problem ("Object of type X is not JSON serializable")
// for undefined, a namespace, a function, a generator, a dict view or the
// loop, and when `out` would grow over kMaxOutputBytes.
absl::Status AppendJson(const Value& v, const JsonStyle& style, int level,
                        std::string* out);

}  // namespace knapserve::jinja

#endif  // KNAPSERVE_COMMON_TEXT_JINJA_JSON_H_
