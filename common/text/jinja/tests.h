// The template engine's tests (`x is name(args)`, and the tests select /
// reject apply): boolean, callable, defined, divisibleby, eq / equalto / ==,
// escaped, even, false, float, ge / >=, gt / > / greaterthan, in, integer,
// iterable, le / <=, lower, lt / < / lessthan, mapping, ne / !=, none,
// number, odd, sameas, sequence, string, true, undefined, upper; as jinja2's
// do them. Internal to the template engine (common/text/jinja/, the renderer
// behind common/text/chat_template.h); other code uses ChatTemplate.
//
// Every function is pure apart from what Values share (`x is in gen` uses a
// generator up to the item found) and may be called from any thread that may
// use its Values (value.h). Errors are the engine's unlocated
// InvalidArgument problems (errors.h).
#ifndef KNAPSERVE_COMMON_TEXT_JINJA_TESTS_H_
#define KNAPSERVE_COMMON_TEXT_JINJA_TESTS_H_

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/text/jinja/args.h"
#include "common/text/jinja/value.h"

namespace knapserve::jinja {

// Whether `name` is one of the tests above (the parser refuses the others,
// as Jinja does when it compiles a template).
bool IsKnownTest(std::string_view name);

// `v is name(args)`. A problem "unknown test 'name'" for a name IsKnownTest
// refuses, and for wrong arguments or values the test cannot compare.
absl::StatusOr<bool> ApplyTest(const std::string& name, const Value& v,
                               const Args& args);

}  // namespace knapserve::jinja

#endif  // KNAPSERVE_COMMON_TEXT_JINJA_TESTS_H_
