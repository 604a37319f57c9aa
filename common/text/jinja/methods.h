// What `.name`, `[key]`, `[a:b:c]` and `.method(...)` do on the template
// engine's values, as jinja2's ImmutableSandboxedEnvironment does them: str
// methods (startswith, split, strip, replace, ...), dict.get / items / keys
// / values / copy, list and tuple count / index / copy, the fields of the
// loop variable and of a namespace. Internal to the template engine
// (common/text/jinja/, the renderer behind common/text/chat_template.h);
// other code uses ChatTemplate.
//
// A missing attribute or item is undefined (with Jinja's message), not an
// error; an attribute or item of undefined is an error. Mutating methods of
// lists and dicts (append, pop, update, ...) are "unsafe" in the immutable
// sandbox: undefined, and an error when called.
//
// Every function is pure apart from what Values share (a generator passed to
// str.join is used up) and may be called from any thread that may use its
// Values (value.h). Errors are the engine's unlocated InvalidArgument
// problems (errors.h).
#ifndef KNAPSERVE_COMMON_TEXT_JINJA_METHODS_H_
#define KNAPSERVE_COMMON_TEXT_JINJA_METHODS_H_

#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/text/jinja/args.h"
#include "common/text/jinja/value.h"

namespace knapserve::jinja {

// The attribute `name` of `obj` that is a method (a kMethod callable bound to
// `obj`) or, for a namespace and the loop, a field, as Python's getattr finds
// it; nullopt if there is none. Methods Python has but this engine does not
// implement are found too (calling them is an error): in jinja2 they shadow
// a dict key of the same name.
std::optional<Value> RealAttribute(const Value& obj, const std::string& name);

// The undefined value of a missing attribute: "'int object' has no attribute
// 'name'".
Value NoAttribute(const Value& obj, std::string_view name);

// obj.name, as jinja2's sandboxed getattr: a real attribute, else the item
// `name`, else undefined. An attribute of undefined is an error.
absl::StatusOr<Value> GetAttr(const Value& obj, const std::string& name);

// obj[key], as jinja2's sandboxed getitem: the item (a dict's key, a list's,
// tuple's or string's index, negative from the end), else the attribute named
// `key`, else undefined. An item of undefined is an error.
absl::StatusOr<Value> GetItem(const Value& obj, const Value& key);

// obj[start:stop:step] with Python's semantics, for a str, list or tuple;
// any part may be absent or None. Jinja subscripts slices directly (not
// through the sandbox's getitem), so every failure is an error.
absl::StatusOr<Value> SliceOf(const Value& obj,
                              const std::optional<Value> parts[3]);

// Calls the method `name` of `self` (a method RealAttribute found) with
// `args`. "<type>.<name>() is not supported" for the methods that are found
// but not implemented.
absl::StatusOr<Value> CallMethod(const Value& self, const std::string& name,
                                 const Args& args);

}  // namespace knapserve::jinja

#endif  // KNAPSERVE_COMMON_TEXT_JINJA_METHODS_H_
