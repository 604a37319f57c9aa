// The template engine's filters (`x | name(args)`): abs, attr, capitalize,
// count, d / default, first, float, int, items, join, last, length, list,
// lower, map, reject, rejectattr, replace, safe, select, selectattr, string,
// title, tojson (Hugging Face's: json.dumps with ensure_ascii=False, indent,
// separators, sort_keys), trim, upper; as jinja2's do them. select, reject,
// selectattr, rejectattr, map and items give one-shot generators, as Jinja's
// do. Internal to the template engine (common/text/jinja/, the renderer
// behind common/text/chat_template.h); other code uses ChatTemplate.
//
// Every function is pure apart from what Values share (a generator filtered
// is used up) and may be called from any thread that may use its Values
// (value.h). Errors are the engine's unlocated InvalidArgument problems
// (errors.h).
#ifndef KNAPSERVE_COMMON_TEXT_JINJA_FILTERS_H_
#define KNAPSERVE_COMMON_TEXT_JINJA_FILTERS_H_

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/text/jinja/args.h"
#include "common/text/jinja/value.h"

namespace knapserve::jinja {

// Whether `name` is one of the filters above (the parser refuses the others,
// as Jinja does when it compiles a template).
bool IsKnownFilter(std::string_view name);

// `v | name(args)`. A problem "unknown filter 'name'" for a name
// IsKnownFilter refuses, and for wrong arguments or a value the filter cannot
// take; a lazy filter's own failure comes when its generator is used.
absl::StatusOr<Value> ApplyFilter(const std::string& name, const Value& v,
                                  const Args& args);

}  // namespace knapserve::jinja

#endif  // KNAPSERVE_COMMON_TEXT_JINJA_FILTERS_H_
